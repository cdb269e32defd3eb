"""Peak memory of what a guard step reads from one microbatch's padded logits, in row chunks against one
whole-batch pass.

    MALLOC_MMAP_THRESHOLD_=131072 OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/bench_guard_readings.py
    python3 bench/bench_guard_readings.py --device cuda     # on a GPU

On a guard step (and a logit-signal step) the trainer reads, from I5's padded recompute of each loss
microbatch, while the loss's autograd graph is alive: the logprobs at the sampling temperature, the logit scale,
the logit signals, the temperature slope and the entropies. Written as one pass over the whole [B, C, V]
logits, each holds several fp32 copies of them; ``grpotrl.ops.logprobs`` works in ``row_chunks``. Each way runs
in a fresh process on the same random bf16 logits (one microbatch of the GPU bench: 8 rows x 256 completion
tokens x SmolLM2's 49152 vocabulary); printed: the peak above the memory before the readings (CPU: RSS
high-water mark, reset through ``/proc/self/clear_refs``; CUDA: ``max_memory_allocated``), the time, and
whether the two ways' values are bit-identical.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def whole_batch(logits, tokens, mask, T):
    """The five readings written as whole-batch passes (the formulas ``row_chunks`` splits)."""
    import torch

    z = logits.float()  # [B, C, V]
    logps = torch.log_softmax(z / T, -1)
    out = dict(logprobs=logps.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), scale=z.abs().amax(-1) / T)
    del logps
    top = z.topk(5, dim=-1).values
    out["top5_mass"] = ((top / T - torch.logsumexp(z / T, -1, keepdim=True)).exp().sum(-1) * mask).sum()
    out["slope"] = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - (torch.softmax(z / T, -1) * z).sum(-1)
    logps = torch.log_softmax(z / T, -1)
    out["entropy"] = -(logps.exp() * logps).sum(-1)
    return out


def chunked(logits, tokens, mask, T):
    """The same readings through the functions the trainer calls."""
    return dict(logprobs=token_logprobs(logits, tokens, T), scale=logit_scale(logits, T),
                top5_mass=health.logit_signal_sums(logits, mask, T)[3, 0],
                slope=temperature_slope(logits, tokens, T), entropy=entropy_from_logits(logits, T))


def child(way: str, device: str, shape: tuple[int, int, int], out: str) -> None:
    import torch

    import _runner  # bench/_runner.py: the peak-RSS reset and reading

    global health, entropy_from_logits, logit_scale, temperature_slope, token_logprobs
    from grpotrl import health  # imported by both ways, before the measurement
    from grpotrl.ops.logprobs import entropy_from_logits, logit_scale, temperature_slope, token_logprobs

    B, C, V = shape
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(B, C, V, generator=g) * 3).to(torch.bfloat16).to(device)  # [B, C, V]
    tokens = torch.randint(0, V, (B, C), generator=g).to(device)
    mask = torch.ones(B, C, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        _runner.reset_peak_rss()
        before = _runner.rss_kib("VmRSS") * 1024
    start = time.perf_counter()
    values = (whole_batch if way == "whole" else chunked)(logits, tokens, mask, 0.9)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _runner.rss_kib("VmHWM") * 1024 - before
    seconds = time.perf_counter() - start
    torch.save({k: v.cpu() for k, v in values.items()}, out)
    print(f"{way:6s} peak above start {peak / 2**20:7.0f} MiB  {seconds:6.2f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", type=int, nargs=3, default=[8, 256, 49152], metavar=("ROWS", "WIDTH", "VOCAB"))
    ap.add_argument("--child", choices=["whole", "chunked"])
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.device, tuple(a.shape), a.out)
    import torch

    print(f"device {a.device}{' ' + torch.cuda.get_device_name() if a.device == 'cuda' else ''}, torch "
          f"{torch.__version__}, bf16 logits {a.shape[0]} x {a.shape[1]} x {a.shape[2]}")
    files = {}
    for way in ("whole", "chunked"):
        files[way] = f"/tmp/grpotrl-bench-readings-{way}-{os.getpid()}.pt"
        subprocess.run([sys.executable, __file__, "--child", way, "--device", a.device, "--out", files[way],
                        "--shape", *map(str, a.shape)], check=True)
    whole, chunk = (torch.load(files[w]) for w in ("whole", "chunked"))
    same = {k: torch.equal(whole[k], chunk[k]) for k in whole}
    print("bit-identical:", ", ".join(f"{k} {v}" for k, v in same.items()))


if __name__ == "__main__":
    main()
