"""Cost of grpotrl's health signals and rules: step time with them vs without, same trainer.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/bench_health.py              # SmolLM2, 8 steps x 3 rounds
    .venv/bin/python bench/bench_health.py --steps 12 --rounds 4 --logit-steps 1
    .venv/bin/python bench/bench_health.py --prompts 8 --generations 8 --length 256 --steps 6   # the target shape

Variants, each in a fresh subprocess, alternated (bare, health, bare, health, ...) so machine
noise hits both: ``bare`` is grpotrl.GRPOTrainer with the signal hooks emptied and the rules
and boundary report off; ``health`` is the default (every signal logged, every rule on, the
boundary report printed after step 1). Guards are off in both (bench_guards.py measures them),
so the logit signals, which come free with the guard forward, are not computed unless
``--logit-steps N`` adds the opt-in extra forward every N steps. Compared: the mean wall time
per step and the process CPU time per step (steadier on a shared machine). On a shared machine
both move by a few percent from run to run, more than the health code costs, so the health
variant also times itself from the inside: the CPU time spent in the signal hooks and the
rules, as a share of its step CPU time. Goal: <= 1.02x (<= 2 % inside).
"""

from __future__ import annotations

import argparse
import os
import statistics

import _runner  # bench/_runner.py: the timer and the alternating driver


def child(variant: str, steps: int, logit_steps: int, shape: tuple[int, int, int]) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import time


    import grpotrl
    from grpotrl.health import callbacks
    from grpotrl.data import load_quickstart
    from grpotrl.models import resolve_model_path
    from grpotrl.rewards.rules import exact_answer_reward

    inside = [0.0]  # CPU seconds spent in the health hooks and callbacks

    def timed(fn):
        def wrapper(*args, **kwargs):
            t = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] += time.process_time() - t

        return wrapper

    class Bare(grpotrl.GRPOTrainer):
        def _log_batch_health(self, inputs, output, rewards):
            pass

        def _log_loss_health(self, loss, entropies, mask, task=None):
            pass

    common = dict(output_dir=f"/tmp/grpotrl-bench-health-{variant}", **_runner.shape_config(*shape),
                  max_steps=steps, logging_steps=1, report_to="none",
                  use_cpu=True, save_strategy="no", seed=0, temperature=0.9, beta=0.04, guard_steps=0)
    if variant == "bare":
        cls, extra = Bare, dict(health_action="off", health_report_steps=0)
    else:
        cls, extra = grpotrl.GRPOTrainer, dict(health_logit_steps=logit_steps)
    timer = _runner.step_timer()
    trainer = cls(model=resolve_model_path("smollm2-135m-instruct"), reward_funcs=exact_answer_reward,
                  args=grpotrl.GRPOConfig(**common, **extra), train_dataset=load_quickstart("train"),
                  callbacks=[timer])
    if variant == "health":
        for name in ("_log_batch_health", "_log_loss_health", "_log_logit_signals"):
            setattr(trainer, name, timed(getattr(trainer, name)))
        for cb in trainer.callback_handler.callbacks:
            if isinstance(cb, (callbacks.HealthRule, callbacks.BoundaryReport)):
                for event in ("on_step_begin", "on_step_end", "on_pre_optimizer_step"):
                    setattr(cb, event, timed(getattr(cb, event)))
    trainer.train()
    _runner.report(variant=variant, step_times=timer.times, cpu_times=timer.cpu, inside=inside[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--logit-steps", type=int, default=0, help="health_logit_steps of the health variant")
    p.add_argument("--child", choices=["bare", "health"])
    _runner.add_shape_args(p)
    a = p.parse_args()
    if a.child:
        return child(a.child, a.steps, a.logit_steps, (a.prompts, a.generations, a.length))

    def inside(variant, res):
        if variant != "health":
            return ""
        return (f"  inside health code {res['inside'] / len(res['cpu_times']) * 1000:.0f} ms/step "
                f"({res['inside'] / sum(res['cpu_times']):.2%} of step cpu)")

    results = _runner.alternate(__file__, ("bare", "health"), a.rounds,
                                ["--steps", str(a.steps), "--logit-steps", str(a.logit_steps),
                                 *_runner.shape_args(a)], describe=inside)

    def mean(v, key):  # mean per step over every step of every round
        return _runner.mean_per_step(results, v, key)

    def ratios(key):  # per round: health / bare of the same round
        return [statistics.mean(h[key]) / statistics.mean(b[key]) for b, h in zip(results["bare"], results["health"])]

    print(f"\nsteps={a.steps} rounds={a.rounds} logit_steps={a.logit_steps} "
          f"shape={a.prompts} prompts x {a.generations} generations x {a.length} tokens")
    for key, label in (("step_times", "step time"), ("cpu_times", "cpu time ")):
        per_round = ", ".join(f"{x:.3f}" for x in ratios(key))
        print(f"{label}  bare {mean('bare', key):.3f} s  health {mean('health', key):.3f} s  "
              f"ratio {mean('health', key) / mean('bare', key):.3f}  (per round {per_round}; goal <= 1.02)")
    share = sum(h["inside"] for h in results["health"]) / sum(sum(h["cpu_times"]) for h in results["health"])
    print(f"inside     health code {share:.2%} of the health variant's step cpu time (goal <= 2 %)")


if __name__ == "__main__":
    main()
