"""How wide a packed row should be: one loss microbatch's forward + backward, padded vs packed into
rows of at most ``f x L`` tokens (``L`` the padded width), for several ``f``.

    MALLOC_MMAP_THRESHOLD_=131072 OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/bench_packing_capacity.py

SmolLM2-135M-Instruct (fp32, sdpa, TRL's fused LM head at temperature 0.9 with entropies, as the
GRPO loss runs it), 8 rows per microbatch, 2 prompts x 4 answers: prompts of 32-50 tokens, completions
capped at 256 tokens, half short (4-120), half long (150-256, 45% of them at the cap), random token ids
(the cost does not depend on them). Each microbatch runs padded, then packed at each capacity, then packed at ``1 x L``
with the fused head projecting the scored positions only (``_intercept.inject_compact_head``, what
``padding_free`` runs on CPU), then the same with each prompt run once for its 4 rows (``share_prompts``,
what ``padding_free`` runs under sdpa), in one process. Printed: each run's packed shape, time and peak
memory above the RSS before it (the peak RSS reset through ``/proc/self/clear_refs``; with glibc's mmap
threshold fixed, as in the command above, freed tensors leave the RSS and the peak is the run's own),
and each variant's total time and largest peak as ratios of the padded one's.
Why it matters: a wider row leaves less of its tail empty, but a masked attention costs ``W^2`` per
row, so past some width the attention costs more than the tail saves (``ops/packing.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

import _runner  # noqa: E402  bench/_runner.py: the peak-RSS reset and reading

from grpotrl.models import resolve_model_path  # noqa: E402
from grpotrl.ops.packing import pack, unpack  # noqa: E402
from grpotrl.trainers import _intercept  # noqa: E402

K = 256  # completion cap
FACTORS = (1, 1.5, 2, 3, 8)  # capacity = f x L; 8 x L holds a whole microbatch in one row
GROUP = 4  # rows per prompt: a microbatch of 8 is 2 prompts x 4 answers


def lengths(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    prompts = [p for p in (rng.randint(32, 50) for _ in range(n // GROUP)) for _ in range(GROUP)]
    completions = [rng.randint(4, 120) for _ in range(n // 2)] + [
        K if rng.random() < 0.45 else rng.randint(150, 255) for _ in range(n - n // 2)]
    rng.shuffle(completions)
    return prompts, completions


def batch(prompts: list[int], completions: list[int], P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts, right-padded completions: ``input_ids``, ``attention_mask`` [B, P + K]."""
    ids = torch.randint(100, 40000, (len(prompts), P + K))
    mask = torch.zeros_like(ids)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        ids[r, :P] = ids[r - r % GROUP, :P]  # the group's prompt
        mask[r, P - p:P] = 1
        mask[r, P:P + c] = 1
    return ids, mask


def setup(count: int):
    """Seeded: SmolLM2 as the GRPO loss runs it (fp32, sdpa, TRL's fused head at temperature 0.9 with
    entropies, train mode), ``count`` microbatches of 8 rows (``input_ids``, ``attention_mask`` [8, P + K])
    and their prompt width ``P``. ``bench_head_tiles.py`` runs the same."""
    torch.manual_seed(0)
    rng = random.Random(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("smollm2-135m-instruct"), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    add_fused_lm_head(model, temperature=0.9, outputs=("log_probs", "entropy"))
    model.train()
    prompts, completions = lengths(rng, 8 * count)
    P = max(prompts)
    return model, [batch(prompts[m:m + 8], completions[m:m + 8], P) for m in range(0, 8 * count, 8)], P


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=4)
    a = ap.parse_args()
    model, batches, P = setup(a.microbatches)
    L = P + K

    def padded(ids, mask):
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :P] = -100
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        return out.log_probs, tuple(ids.shape)

    def packed(ids, mask, capacity, compact=False, share=False):
        rows = pack(ids, mask, K, capacity=capacity, share_prompts=share)
        with _intercept.inject_compact_head(ids.device) if compact else contextlib.nullcontext():
            out = model(input_ids=rows.input_ids, position_ids=rows.position_ids,
                        attention_mask=rows.attention_mask(slice(None), rows.input_ids.size(1)), labels=rows.labels,
                        fused_lm_head=True)
        return unpack(out.log_probs, rows), tuple(rows.input_ids.shape)

    runs = [("padded", None, False, False)] + [(f"{f}L", int(f * L), False, False) for f in FACTORS] + [
        ("1L head", L, True, False), ("1L head shared", L, True, True)]
    total, peak = {name: 0.0 for name, *_ in runs}, {name: 0 for name, *_ in runs}
    for m, (ids, mask) in enumerate(batches):
        for name, capacity, compact, share in runs:
            (logps, shape), seconds, mib = _runner.forward_backward(
                model, lambda: padded(ids, mask) if capacity is None else packed(ids, mask, capacity, compact, share))
            total[name] += seconds
            peak[name] = max(peak[name], mib)
            print(f"microbatch {m}: {int(mask.sum())} real tokens  {name:14s} rows x width {shape}  "
                  f"cells {shape[0] * shape[1]:5d}  forward + backward {seconds:6.2f} s  peak +{mib:.0f} MiB", flush=True)
    print("1L head: rows of at most L, the fused head over the scored positions only; shared: each prompt once "
          "for its rows (ops.packing.share_plan, sdpa)")
    for name, *_ in runs:
        print(f"{name:14s} {total[name]:7.1f} s  {total[name] / total['padded']:.3f}x padded   "
              f"largest peak +{peak[name]:.0f} MiB  {peak[name] / peak['padded']:.3f}x padded")


if __name__ == "__main__":
    main()
