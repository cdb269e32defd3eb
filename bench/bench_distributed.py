"""DDP vs DeepSpeed ZeRO-2 vs ZeRO-3: per-rank peak memory and step time of the same two-process
CPU GRPO (or GAD) run, launched with the repo's own recipes/accelerate/{ddp,zero2,zero3}.yaml.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/bench_distributed.py          # SmolLM2, 6 steps, 1 round
    .venv/bin/python bench/bench_distributed.py --steps 8 --rounds 2
    .venv/bin/python bench/bench_distributed.py --method gad   # GAD: a second 135M model (the discriminator) + AdamW

Each variant is ``accelerate launch --config_file recipes/accelerate/V.yaml bench/bench_distributed.py
--rank-run ...`` (2 processes, 1 thread each, gloo), run alternately in fresh launches
(ddp, zero2, zero3, ddp, ...) so machine noise hits all of them. The run is grpotrl's GRPO on
SmolLM2-135M-Instruct: 8 completions per rank (2 prompts x 4) of up to 32 tokens, KL to a
reference model (beta 0.04: TRL shards it too under ZeRO-3), fp32, guards on their default
first 2 steps. ``--method gad``: GADTrainer on the toy GAD data with the same settings and a
full discriminator initialised from the student (its own engine: DDP, or DeepSpeed at the same
ZeRO stage, so its AdamW states are sharded too). Reported per variant, as ratios to DDP: the mean step time over steps after the
first (rank 0), the process CPU time per step (mean over ranks; steadier than wall time on a
shared machine), and per rank the peak RSS, the peak once model and reference are loaded, and
the RSS after the last step. What it does not show: GPU memory, and the one-time JIT compile
of DeepSpeed's shm comm op on the first DeepSpeed run of a machine.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile

import _runner  # bench/_runner.py: the timer and the alternating driver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("ddp", "zero2", "zero3")


def rank_run(out: str, steps: int, method: str) -> None:
    """One rank of the launched run: train, then write this rank's timings and peak RSS."""
    import grpotrl  # noqa: I001  first: OMP_WAIT_POLICY before torch

    from datasets import load_dataset

    from grpotrl.data import load_quickstart
    from grpotrl.models import resolve_model_path
    from grpotrl.rewards.rules import exact_answer_reward

    common = dict(output_dir=os.path.join(out, "run"), per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=32, max_steps=steps, logging_steps=1, report_to="none", use_cpu=True,
                  bf16=False, save_strategy="no", seed=0, temperature=0.9, beta=0.04)
    timer = _runner.step_timer()
    model = resolve_model_path("smollm2-135m-instruct")
    if method == "gad":
        trainer = grpotrl.GADTrainer(model=model, args=grpotrl.GADConfig(**common), callbacks=[timer],
                                     train_dataset=load_dataset("json", split="train", data_files=os.path.join(
                                         os.path.dirname(grpotrl.__file__), "data", "gad_toy.jsonl")))
    else:
        trainer = grpotrl.GRPOTrainer(model=model, reward_funcs=exact_answer_reward, args=grpotrl.GRPOConfig(**common),
                                      train_dataset=load_quickstart("train"), callbacks=[timer])
    peak_load = peak_rss()  # model + reference loaded (under ZeRO-3 already sharded by zero.Init)
    trainer.train()
    rank = trainer.accelerator.process_index
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "step_times": timer.times, "cpu_times": timer.cpu, "peak_bytes": peak_rss(),
                   "peak_load_bytes": peak_load, "rss_end_bytes": current_rss()}, f)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    """Resident memory now (after the last step: params, optimizer states and grads at rest)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def child(variant: str, steps: int, method: str) -> None:
    """Launch the two ranks under ``variant``'s accelerate recipe; print one RESULT line."""
    with tempfile.TemporaryDirectory(prefix=f"grpotrl-bench-dist-{variant}-") as out:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
               f"recipes/accelerate/{variant}.yaml", "--main_process_port", port,
               os.path.abspath(__file__), "--rank-run", out, "--steps", str(steps), "--method", method]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        ranks = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "rank*.json")))]
        if proc.returncode or len(ranks) != 2:
            sys.exit(f"{variant}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    cpu = [statistics.mean(step) for step in zip(*(r["cpu_times"] for r in ranks))]  # per step, mean over ranks
    _runner.report(variant=variant, step_times=ranks[0]["step_times"], cpu_times=cpu,
                   **{key: [r[key] for r in ranks] for key in ("peak_bytes", "peak_load_bytes", "rss_end_bytes")})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--method", choices=["grpo", "gad"], default="grpo")
    p.add_argument("--child", choices=VARIANTS)
    p.add_argument("--rank-run", metavar="OUT_DIR", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_run:
        return rank_run(a.rank_run, a.steps, a.method)
    if a.child:
        return child(a.child, a.steps, a.method)

    def mib(res):
        return "/".join(f"{b / 2**20:.0f}" for b in res["peak_bytes"])

    results = _runner.alternate(__file__, VARIANTS, a.rounds, ["--steps", str(a.steps), "--method", a.method],
                                describe=lambda v, res: f"  peak rank0/rank1 {mib(res)} MiB")
    after_first = slice(1, None)  # step 1 pays one-time costs (DeepSpeed's first gathers, allocator growth)

    def step(v, key="step_times"):
        return _runner.mean_per_step(results, v, key, after_first)

    def mem(v, rank, key="peak_bytes"):  # the largest over rounds
        return max(res[key][rank] for res in results[v])

    print(f"\nSmolLM2-135M {a.method.upper()}, 2 CPU processes (gloo), steps={a.steps} rounds={a.rounds}; ratios to ddp")
    print(f"{'':6s} {'step s':>7s} {'ratio':>6s} {'cpu s':>6s} {'ratio':>6s} | "
          + " | ".join(f"{'rank ' + str(r) + ' MiB: peak':>20s} {'ratio':>5s} {'load':>5s} {'end':>5s} {'ratio':>5s}"
                       for r in (0, 1)))
    for v in VARIANTS:
        print(f"{v:6s} {step(v):7.2f} {step(v) / step('ddp'):6.2f} {step(v, 'cpu_times'):6.2f} "
              f"{step(v, 'cpu_times') / step('ddp', 'cpu_times'):6.2f} | "
              + " | ".join(f"{mem(v, r) / 2**20:20.0f} {mem(v, r) / mem('ddp', r):5.2f} "
                           f"{mem(v, r, 'peak_load_bytes') / 2**20:5.0f} {mem(v, r, 'rss_end_bytes') / 2**20:5.0f} "
                           f"{mem(v, r, 'rss_end_bytes') / mem('ddp', r, 'rss_end_bytes'):5.2f}" for r in (0, 1)))
    print("peak: peak RSS of the run; load: peak RSS once the model and reference are loaded; end: RSS after the "
          "last step (weights, optimizer states, gradients at rest)")


if __name__ == "__main__":
    main()
