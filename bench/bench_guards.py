"""Cost of grpotrl's guards: step time and peak memory, guarded vs plain ``trl.GRPOTrainer``.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/bench_guards.py            # SmolLM2, 12 steps
    .venv/bin/python bench/bench_guards.py --steps 20 --rounds 3 --guard-steps 2
    .venv/bin/python bench/bench_guards.py --prompts 8 --generations 8 --length 256 --steps 6   # the target shape
    .venv/bin/python bench/bench_guards.py --profile-ops --steps 6     # what grpotrl adds to an unguarded step, op by op

Both variants run the same config, seed and data in fresh subprocesses, alternated
(plain, guarded, plain, guarded, ...) so machine noise hits both; the mean step time over all
steps (guarded ones included), the process CPU time per step (steadier than wall time on a
shared machine) and the peak RSS (CPU) or peak CUDA memory are compared.
Goals with the default guard schedule (guard_steps=2): step time <= 1.03x, memory <= 1.05x.
What it does not measure: guard_steps=-1 (every step) costs one extra no-grad forward per
microbatch; run with --guard-steps -1 to see it.

Two step times differ by a few percent from run to run even on an idle machine, more than an
unguarded step's extra work, so ``--profile-ops`` measures that work directly: each variant runs
once under the torch profiler, which records every op of the steps after the guards (the steps
after ``guard_steps`` + 1); the ops grpotrl calls more often than plain TRL, priced at their
mean self CPU time per call, are grpotrl's added work, printed against plain TRL's total self
CPU time of those steps (ops both call equally often do the same work and cancel out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import _runner  # bench/_runner.py: the timer and the alternating driver


def op_profiler(skip: int):
    """A torch profiler over every step after the first ``skip`` and a callback stepping it."""
    import torch
    from transformers import TrainerCallback

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  schedule=torch.profiler.schedule(wait=skip, warmup=0, active=10**6))

    class Stepper(TrainerCallback):
        def on_train_begin(self, *a, **k):
            prof.start()

        def on_step_end(self, *a, **k):
            prof.step()

        def on_train_end(self, *a, **k):
            prof.stop()

    return prof, Stepper()


def child(variant: str, steps: int, guard_steps: int, shape: tuple[int, int, int], profile_ops: bool) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import resource

    import torch

    common = dict(output_dir=f"/tmp/grpotrl-bench-{variant}", **_runner.shape_config(*shape),
                  max_steps=steps, logging_steps=1, report_to="none", use_cpu=True,
                  bf16=False, disable_dropout=True, save_strategy="no", seed=0, temperature=0.9, beta=0.04)
    timer = _runner.step_timer()
    prof, stepper = op_profiler(steps_before_profile(guard_steps, steps)) if profile_ops else (None, None)
    trainer = _runner.quickstart_trainer(variant, common, [timer, *([stepper] if prof else [])],
                                         guard_steps=guard_steps)
    trainer.train()
    ops = {e.key: [e.count, e.self_cpu_time_total] for e in prof.key_averages()} if prof else None
    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    _runner.report(variant=variant, step_times=timer.times, cpu_times=timer.cpu, peak_bytes=peak,
                   lengths=_runner.completion_lengths(trainer), ops=ops)


def steps_before_profile(guard_steps: int, steps: int) -> int:
    """How many steps the op profile skips: the guarded ones and the step after the last of them
    (so that no work a guard step leaves behind falls into the profile)."""
    first = (steps if guard_steps < 0 else guard_steps) + 1
    if first >= steps:
        sys.exit(f"--profile-ops needs unguarded steps: --steps {steps} with --guard-steps {guard_steps} leaves none "
                 f"(use --steps {first + 3})")
    return first


def added_ops(trl_ops: dict, ours: dict) -> tuple[float, float, list]:
    """(plain TRL's self CPU seconds, grpotrl's added self CPU seconds, the top additions) from two
    ``{op: [count, self_cpu_us]}``: every op grpotrl calls more often, priced at its mean per call."""
    added = []
    for op, (n, us) in ours.items():
        extra = n - trl_ops.get(op, [0, 0])[0]
        if extra > 0:
            added.append((extra * us / n / 1e6, op, extra))
    added.sort(reverse=True)
    return sum(us for _, us in trl_ops.values()) / 1e6, sum(a[0] for a in added), added[:6]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--guard-steps", type=int, default=2)
    p.add_argument("--profile-ops", action="store_true", help="price the ops grpotrl adds to an unguarded step")
    p.add_argument("--child", choices=["trl", "grpotrl"])
    _runner.add_shape_args(p)
    a = p.parse_args()
    if a.child:
        return child(a.child, a.steps, a.guard_steps, (a.prompts, a.generations, a.length), a.profile_ops)
    if a.profile_ops:
        first = steps_before_profile(a.guard_steps, a.steps)
        results = _runner.alternate(__file__, ("trl", "grpotrl"), 1,
                                    ["--steps", str(a.steps), "--guard-steps", str(a.guard_steps), "--profile-ops",
                                     *_runner.shape_args(a)])
        trl_s, added_s, top = added_ops(results["trl"][0]["ops"], results["grpotrl"][0]["ops"])
        same = results["trl"][0]["lengths"] == results["grpotrl"][0]["lengths"]
        print(f"\nsteps {first + 1}..{a.steps} (unguarded), shape {a.prompts} x {a.generations} x {a.length}; "
              f"completion lengths {'identical' if same else 'DIFFER'}")
        print(f"self CPU of every op, plain TRL: {trl_s:.3f} s; added by grpotrl: {added_s:.3f} s = "
              f"{added_s / trl_s:.2%} (goal: a step <= 1.02x)")
        for sec, op, n in top:
            print(f"  {sec * 1e3:8.1f} ms  {op} (+{n} calls)")
        return

    results = _runner.alternate(__file__, ("trl", "grpotrl"), a.rounds,
                                ["--steps", str(a.steps), "--guard-steps", str(a.guard_steps), *_runner.shape_args(a)],
                                describe=lambda v, res: f"  peak {res['peak_bytes'] / 2**20:.0f} MiB")

    def med(v, key="step_times"):  # mean per step over every step, guarded ones included
        return _runner.mean_per_step(results, v, key)

    def peak(v):
        return max(res["peak_bytes"] for res in results[v])

    g = max(a.guard_steps, 0) if a.guard_steps >= 0 else a.steps

    def per_step(v, key, sl):
        return _runner.mean_per_step(results, v, key, sl)

    print(f"\nsteps={a.steps} rounds={a.rounds} guard_steps={a.guard_steps} "
          f"shape={a.prompts} prompts x {a.generations} generations x {a.length} tokens")
    if 0 < g < a.steps:
        guarded = per_step("grpotrl", "cpu_times", slice(0, g)) / per_step("trl", "cpu_times", slice(0, g))
        free = per_step("grpotrl", "cpu_times", slice(g, None)) / per_step("trl", "cpu_times", slice(g, None))
        print(f"cpu time of a guarded step / plain: {guarded:.3f}; of an unguarded step: {free:.3f}")
        rounds = [statistics.mean(q["cpu_times"][g:]) / statistics.mean(t["cpu_times"][g:])
                  for t, q in zip(results["trl"], results["grpotrl"])]
        print("  unguarded step cpu ratio per round (the spread is the noise): "
              + ", ".join(f"{r:.3f}" for r in rounds))
        for n in (50, 200, 1000):
            print(f"  projected run-time ratio for a {n}-step run: {(g * guarded + (n - g) * free) / n:.3f}")
    print(_runner.same_lengths(results, "trl", "grpotrl"))
    goal = "  (goal <= 1.03)" if a.guard_steps >= 0 else "  (no goal: guards at every step)"
    print(f"step time  trl {med('trl'):.3f} s  grpotrl {med('grpotrl'):.3f} s  ratio {med('grpotrl') / med('trl'):.3f}"
          + goal)
    print(f"cpu time   trl {med('trl', 'cpu_times'):.3f} s  grpotrl {med('grpotrl', 'cpu_times'):.3f} s  "
          f"ratio {med('grpotrl', 'cpu_times') / med('trl', 'cpu_times'):.3f}")
    print(f"peak mem   trl {peak('trl') / 2**20:.0f} MiB  grpotrl {peak('grpotrl') / 2**20:.0f} MiB  "
          f"ratio {peak('grpotrl') / peak('trl'):.3f}  (goal <= 1.05)")


if __name__ == "__main__":
    main()
