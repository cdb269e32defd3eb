"""The padding-free loss microbatch under ``packed_attention='mask'`` (shared prompts under the tree mask; and
without sharing) against ``'varlen'`` (each forward's sequences in one row: one causal sdpa per sequence on CPU, and
with shared prompts, the CPU default, one tree per prompt, each row over the prompt's keys and its own): forward +
backward of ``padding_free.packed_logps_and_entropies``, as the loss runs it.

    MALLOC_MMAP_THRESHOLD_=131072 OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/bench_varlen_attention.py

The data and model are ``bench_packing_capacity.py``'s (SmolLM2-135M-Instruct fp32, sdpa, TRL's fused head with
entropies, 8 rows per microbatch: 2 prompts x 4 answers of 4-256 tokens), run as a CPU training step runs it:
gradient checkpointing on (TRL's default; ``--no-checkpointing`` for off), in fp32 (``--bf16``: under bf16 autocast
over the fp32 weights, as ``use_cpu=True, bf16=True`` runs), the fused head in grpotrl's CPU tiles
(``_intercept.inject_head_tiles``), varlen under the step-wide switch (``packed_attention.running``, so that the
recompute sees the boundaries). The variants run interleaved, in
``--rounds`` rounds over ``--microbatches`` microbatches; printed: each variant's total time and largest peak RSS
above the RSS before the run, and their ratios to the first variant (mask, shared prompts: the CPU default before
varlen's shared prompts).
"""

from __future__ import annotations

import argparse
import contextlib
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import _runner  # noqa: E402  bench/_runner.py: the peak-RSS reset and reading
from bench_packing_capacity import K, setup  # noqa: E402

from grpotrl.trainers import _intercept, packed_attention, padding_free  # noqa: E402

VARIANTS = (("mask, shared prompts", "mask", True), ("mask", "mask", False), ("varlen", "varlen", False),
            ("varlen, shared prompts", "varlen", True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-checkpointing", action="store_true", help="gradient checkpointing off")
    ap.add_argument("--bf16", action="store_true", help="under bf16 autocast over the fp32 weights, as a run with "
                    "use_cpu=True, bf16=True computes")
    a = ap.parse_args()
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if a.bf16 else contextlib.nullcontext
    model, batches, _ = setup(a.microbatches)
    if not a.no_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    total = {name: 0.0 for name, *_ in VARIANTS}
    peak = {name: 0 for name, *_ in VARIANTS}
    for r in range(a.rounds):
        for m, (ids, mask) in enumerate(batches):
            for name, attention, share in VARIANTS:
                step = packed_attention.running(model) if attention == "varlen" else contextlib.nullcontext()
                with step, _intercept.inject_head_tiles(ids.device):
                    _, seconds, mib = _runner.forward_backward(model, lambda: padding_free.packed_logps_and_entropies(
                        model, ids, mask, K, None, True, autocast, share_prompts=share,
                        attention=attention))
                total[name] += seconds
                peak[name] = max(peak[name], mib)
                print(f"round {r} microbatch {m}: {int(mask.sum())} real tokens  {name:22s} forward + backward "
                      f"{seconds:6.2f} s  peak +{mib:.0f} MiB", flush=True)
    base = VARIANTS[0][0]
    for name, *_ in VARIANTS:
        print(f"{name:22s} {total[name]:7.1f} s  {total[name] / total[base]:.3f}x   largest peak +{peak[name]:.0f} MiB "
              f"{peak[name] / peak[base]:.3f}x")


if __name__ == "__main__":
    main()
