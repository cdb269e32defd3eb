"""Cost of CAGrad: step time of cagrad exact / low_memory vs the plain summed GRPO loss.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/bench_cagrad.py            # SmolLM2, 6 steps x 2 rounds
    .venv/bin/python bench/bench_cagrad.py --steps 8 --rounds 3 --completion 64

Variants, each in a fresh subprocess, alternated (plain, exact, low_memory; then exact,
low_memory, plain; ...) so machine noise hits all: the same MultiTaskGRPOTrainer on the shipped two-task data
(fairness + hallucination rows, rule rewards), 4 prompts x 4 generations a step, guards off,
with ``cagrad`` off / exact / low_memory, KL (beta 0.04) and an entropy bonus (0.01) on, or
both off with ``--no-reg`` (then exact needs K backward passes, not K + 1). ``plain`` is
single-objective GRPO on the same config: one backward of the summed loss, as TRL does. Compared: mean wall time and process
CPU time per step (the steadier measure on a shared machine) after the first step.
The learning rate is 0 unless ``--learning-rate`` says otherwise: every step still computes and
applies its update (AdamW's arithmetic is the same), but the weights stay put, so every variant
samples the same completions and the ratios compare the same work (the bench prints whether the
completion lengths agree). With a learning rate > 0 the variants' weights differ after step 1,
they sample other completions, and the rollout's length and time drift between them.
Goals for two tasks: exact <= 1.6, low_memory <= 1.15. Every variant also times the I7 sign
check from the inside (``guards_logprobs.entropy_slopes``, every slope the checks measure, run every
step), as a share of step CPU,
and splits each step's CPU time into phases (the profile): rollout (generation, rewards, the
reference's logprobs), the loss's forward, ``torch.autograd.grad`` (CAGrad's task gradients and
the I7 slopes), the Trainer's backward, and the rest (loss arithmetic, metrics, optimizer).
"""

from __future__ import annotations

import argparse
import os
import statistics

import _runner  # bench/_runner.py: the timer and the alternating driver

VARIANTS = ("plain", "exact", "low_memory")
PHASES = ("rollout", "loss forward", "autograd.grad", "trainer backward")


def child(variant: str, steps: int, completion: int, no_reg: bool, lr: float) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import time

    import grpotrl
    from grpotrl import guards
    from grpotrl.guards import logprobs as guards_logprobs

    inside = [0.0]  # CPU seconds in the I7 sign check
    check = guards_logprobs.entropy_slopes

    def timed_check(*a, **k):
        t = time.process_time()
        try:
            return check(*a, **k)
        finally:
            inside[0] += time.process_time() - t

    guards_logprobs.entropy_slopes = guards.entropy_slopes = timed_check
    import torch
    import trl
    from transformers import TrainerCallback

    phases = dict.fromkeys(PHASES, 0.0)  # CPU seconds per phase, all steps

    def timed(owner, name, phase, only=lambda: True):
        original = getattr(owner, name)

        def wrapper(*a, **k):
            if not only():
                return original(*a, **k)
            t = time.process_time()
            try:
                return original(*a, **k)
            finally:
                phases[phase] += time.process_time() - t

        setattr(owner, name, wrapper)

    timed(grpotrl.GRPOTrainer, "_generate_and_score_completions", "rollout")
    timed(trl.GRPOTrainer, "_get_per_token_logps_and_entropies", "loss forward", torch.is_grad_enabled)
    timed(torch.autograd, "grad", "autograd.grad")
    first = {}  # the phases after step 1, which pays one-time costs

    class AfterFirst(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 1:
                first.update(phases)
    from grpotrl.data import load_multitask
    from grpotrl.models import resolve_model_path
    from grpotrl.rewards.rules import even_handed_reward, exact_answer_reward, format_reward

    args = grpotrl.GRPOConfig(
        output_dir=f"/tmp/grpotrl-bench-cagrad-{variant}", per_device_train_batch_size=16, num_generations=4,
        max_completion_length=completion, max_steps=steps, logging_steps=1, report_to="none", use_cpu=True,
        save_strategy="no", seed=0, temperature=0.9, beta=0.0 if no_reg else 0.04,
        entropy_coef=0.0 if no_reg else 0.01, guard_steps=0,
        gradient_checkpointing=False, health_report_steps=0, learning_rate=lr,
        cagrad="off" if variant == "plain" else variant)
    timer = _runner.step_timer()
    trainer = grpotrl.MultiTaskGRPOTrainer(
        model=resolve_model_path("smollm2-135m-instruct"), args=args, train_dataset=load_multitask("train"),
        reward_funcs={"hallucination": [exact_answer_reward, format_reward], "fairness": even_handed_reward},
        callbacks=[timer, AfterFirst()])
    timed(trainer.accelerator, "backward", "trainer backward")
    trainer.train()
    _runner.report(variant=variant, step_times=timer.times, cpu_times=timer.cpu, inside=inside[0],
                   lengths=_runner.completion_lengths(trainer),
                   phases={k: (v - first.get(k, 0.0)) / max(len(timer.cpu) - 1, 1) for k, v in phases.items()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--completion", type=int, default=32, help="max_completion_length")
    p.add_argument("--no-reg", action="store_true", help="beta=0 and no entropy bonus (exact: K backward passes)")
    p.add_argument("--learning-rate", type=float, default=0.0,
                   help="0 (default) keeps every variant on the same weights, hence the same completions: equal work")
    p.add_argument("--child", choices=VARIANTS)
    a = p.parse_args()
    if a.child:
        return child(a.child, a.steps, a.completion, a.no_reg, a.learning_rate)
    def i7(variant, res):
        phases = ", ".join(f"{k} {v:.2f}" for k, v in res["phases"].items())
        return f"  I7 check {res['inside'] / sum(res['cpu_times']):.3%} of step cpu; cpu s per step: {phases}"

    results = _runner.alternate(__file__, VARIANTS, a.rounds,
                                ["--steps", str(a.steps), "--completion", str(a.completion),
                                 "--learning-rate", repr(a.learning_rate)]
                                + (["--no-reg"] if a.no_reg else []), describe=i7)
    after_first = slice(1, None)  # the first step pays one-time costs (allocations, buffers)

    print(f"\nsteps={a.steps} rounds={a.rounds} completion={a.completion} no_reg={a.no_reg} "
          f"learning_rate={a.learning_rate:g} (means over steps 2..{a.steps})")
    for variant in VARIANTS[1:]:
        print(_runner.same_lengths(results, "plain", variant))
    for key, label in (("step_times", "step time"), ("cpu_times", "cpu time ")):
        plain = _runner.mean_per_step(results, "plain", key, after_first)
        for variant, goal in (("exact", 1.6), ("low_memory", 1.15)):
            mine = _runner.mean_per_step(results, variant, key, after_first)
            per_round = ", ".join(f"{statistics.mean(m[key][after_first]) / statistics.mean(b[key][after_first]):.3f}"
                                  for b, m in zip(results["plain"], results[variant]))
            print(f"{label}  {variant:10s} {mine:.3f} s / plain {plain:.3f} s = {mine / plain:.3f}  "
                  f"(per round {per_round}; goal <= {goal})")
    print("\nCPU s per step (steps 2..) by phase; other = loss arithmetic, metrics, optimizer")
    print(f"{'variant':10s} " + " ".join(f"{p:>16s}" for p in (*PHASES, "other", "total")))
    for variant in VARIANTS:
        cpu = _runner.mean_per_step(results, variant, "cpu_times", after_first)
        ph = {p: statistics.mean(r["phases"][p] for r in results[variant]) for p in PHASES}
        cells = [*ph.values(), cpu - sum(ph.values()), cpu]
        print(f"{variant:10s} " + " ".join(f"{c:16.3f}" for c in cells))


if __name__ == "__main__":
    main()
