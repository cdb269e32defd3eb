"""How large TRL's fused LM head's tiles should be on CPU: one loss microbatch at TRL's 4096 tokens x 32768
vocabulary columns and smaller.

    MALLOC_MMAP_THRESHOLD_=131072 OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python bench/bench_head_tiles.py

Without Triton, TRL's fused head (``trl.kernels.chunked_logprob``) folds each ``[tokens, columns]`` tile of
logits with torch ops that hold about ten temporaries of the tile's size, fp32, in the forward and again in
the backward; TRL takes ``TOKEN_CHUNK_SIZE = 4096`` tokens (sized for cuBLAS) by ``trl.trainer.utils.
_CHUNKED_LOGPROB_CHUNK_SIZE = 32768`` columns per tile. grpotrl's steps on CPU take 512 x 4096
(``_intercept.inject_head_tiles``). This runs what ``padding_free`` runs on CPU
(SmolLM2-135M-Instruct fp32, sdpa, packed rows with shared prompts, the head over the scored positions only,
temperature 0.9 with entropies) on the microbatches of ``bench_packing_capacity.py`` (8 rows: 2 prompts x 4
answers of 4-256 tokens), each at every tile size, in one process after one untimed warm-up run: a no-grad
forward (the reference's) and a forward + backward (the loss's). Printed: per run the time, the peak RSS above
the RSS before it (reset through ``/proc/self/clear_refs``; with glibc's mmap threshold fixed, freed tensors
leave the RSS), the largest logprob difference and the weight gradient's relative difference against TRL's
tiles on the same microbatch; then each size's total time and largest peak as ratios of TRL's.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import trl.kernels.chunked_logprob as ck  # noqa: E402
import trl.trainer.utils as trl_utils  # noqa: E402

import _runner  # noqa: E402  bench/_runner.py: the peak-RSS reset and reading
import bench_packing_capacity as capacity  # noqa: E402  its microbatches

from grpotrl.ops.packing import pack, unpack  # noqa: E402
from grpotrl.trainers import _intercept  # noqa: E402

TRL_TILE = ck.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE  # 4096 x 32768 in trl 1.16
SIZES = (TRL_TILE, (512, 32768), (512, 8192), (512, 4096), (1024, 4096), (512, 2048))  # tokens, vocabulary columns


def set_tile(size: tuple[int, int]) -> None:
    ck.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=3)
    a = ap.parse_args()
    model, batches, P = capacity.setup(a.microbatches)
    L = P + capacity.K
    weight = model.get_output_embeddings().weight

    def run(rows, grad: bool):
        with torch.set_grad_enabled(grad), _intercept.inject_compact_head(rows.input_ids.device):
            out = model(input_ids=rows.input_ids, position_ids=rows.position_ids,
                        attention_mask=rows.attention_mask(slice(None), rows.input_ids.size(1)), labels=rows.labels,
                        fused_lm_head=True)
            logps = unpack(out.log_probs, rows)  # [8, K]
        if not grad:
            return logps, None
        logps.sum().backward()
        g = weight.grad.clone()
        model.zero_grad(set_to_none=True)
        return logps.detach(), g

    packed = [pack(ids, mask, capacity.K, capacity=L, share_prompts=True) for ids, mask in batches]
    run(packed[0], True)  # untimed: the first run pages the weights in and sets up the kernels' buffers
    total, peak = {}, {}
    for m, rows in enumerate(packed):
        for grad in (False, True):
            trl = None
            for size in SIZES:
                set_tile(size)
                before = _runner.rss_kib("VmRSS")
                _runner.reset_peak_rss()
                t = time.perf_counter()
                logps, g = run(rows, grad)
                seconds = time.perf_counter() - t
                mib = (_runner.rss_kib() - before) / 1024
                set_tile(TRL_TILE)
                trl = trl or (logps, g)
                key = (grad, size)
                total[key] = total.get(key, 0.0) + seconds
                peak[key] = max(peak.get(key, 0.0), mib)
                gap = (g - trl[1]).norm() / trl[1].norm() if grad else 0.0
                print(f"microbatch {m} rows x width {tuple(rows.input_ids.shape)}  "
                      f"{'forward + backward' if grad else 'no-grad forward   '}  tile {size[0]:4d} x {size[1]:5d}  "
                      f"{seconds:6.2f} s  peak +{mib:5.0f} MiB  logprob diff {(logps - trl[0]).abs().max():.1e}  "
                      f"weight grad rel {gap:.1e}", flush=True)
    for grad in (False, True):
        print("forward + backward (the loss's):" if grad else "no-grad forward (the reference's):")
        for size in SIZES:
            t0, p0 = total[(grad, TRL_TILE)], peak[(grad, TRL_TILE)]
            t = total[(grad, size)]
            print(f"  tile {size[0]:4d} x {size[1]:5d}  {t:6.1f} s ({t / t0:.3f}x TRL's)   "
                  f"largest peak +{peak[(grad, size)]:5.0f} MiB ({peak[(grad, size)] / p0:.3f}x TRL's)")


if __name__ == "__main__":
    main()
