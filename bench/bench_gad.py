"""Cost of GAD: step time of ``grpotrl.GADTrainer`` / plain ``grpotrl.GRPOTrainer`` on the same config.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/bench_gad.py              # SmolLM2, 8 steps x 2 rounds
    .venv/bin/python bench/bench_gad.py --steps 12 --rounds 3 --lora 16      # discriminator as a LoRA adapter

Both variants run SmolLM2-135M-Instruct on the toy GAD data (grpotrl/data/gad_toy.jsonl) with
the same generation and loss settings (2 prompts x 4 completions of up to 32 tokens, GSPO's
sequence-level ratio, no KL, guards on their default first 2 steps), in fresh subprocesses,
alternated (grpo, gad, grpo, gad, ...) so machine noise hits both. GRPO is rewarded by the
cheap rule ``exact_answer``; GAD by its discriminator (full fine-tune by default, initialised
from the student), which adds per step one forward and backward of a second 135M model over the
8 student + 2 teacher sequences, packed with each of the 2 prompts once (220-310 tokens instead
of 10 rows padded to ~78; ``scoring_batch`` in grpotrl/gad/discriminator.py), and its AdamW step
(whose ~1 GB of state is allocated at the first step: a one-off cost that 8 steps amortise
poorly). No warmup steps (they skip the student's update and would flatter GAD). Reported: the
mean step time over all steps, the ratio, each round's ratio (its two runs ran back to back),
the same for the process CPU time per step (all threads; far steadier than wall time when other
jobs share the cores) and the mean completion length (step time grows with it, and the two
students drift apart as they learn different rewards). Goal: <= 1.35.
"""

from __future__ import annotations

import argparse
import os
import statistics

import _runner  # bench/_runner.py: the timer and the alternating driver


def child(variant: str, steps: int, lora: int) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from datasets import load_dataset

    import grpotrl
    from grpotrl.models import resolve_model_path
    from grpotrl.rewards.rules import exact_answer_reward

    common = dict(output_dir=f"/tmp/grpotrl-bench-gad-{variant}", per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=32, max_steps=steps, logging_steps=1, report_to="none", use_cpu=True,
                  bf16=False, save_strategy="no", seed=0, temperature=0.9, beta=0.0, learning_rate=1e-5,
                  importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4,
                  disable_tqdm=True)
    data = os.path.join(os.path.dirname(grpotrl.__file__), "data", "gad_toy.jsonl")
    dataset = load_dataset("json", data_files=data, split="train")
    model = resolve_model_path("smollm2-135m-instruct")
    timer = _runner.step_timer()
    if variant == "grpo":
        trainer = grpotrl.GRPOTrainer(model=model, reward_funcs=exact_answer_reward, args=grpotrl.GRPOConfig(**common),
                                      train_dataset=dataset, callbacks=[timer])
    else:
        args = grpotrl.GADConfig(**common, discriminator_learning_rate=1e-5, discriminator_lora_r=lora)
        trainer = grpotrl.GADTrainer(model=model, args=args, train_dataset=dataset, callbacks=[timer])
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    _runner.report(variant=variant, step_times=timer.times, cpu_times=timer.cpu, lengths=lengths)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--lora", type=int, default=0, help="discriminator_lora_r (0: full fine-tune)")
    p.add_argument("--child", choices=["grpo", "gad"])
    a = p.parse_args()
    if a.child:
        return child(a.child, a.steps, a.lora)

    results = _runner.alternate(__file__, ("grpo", "gad"), a.rounds, ["--steps", str(a.steps), "--lora", str(a.lora)],
                                describe=lambda v, res: f"  completion length {statistics.mean(res['lengths']):.1f}")

    def mean(v, key="step_times"):  # a user's wall time per step: every step, guarded ones included
        return _runner.mean_per_step(results, v, key)

    def paired(key):  # each round's runs ran back to back
        return ", ".join(f"{statistics.mean(g[key]) / statistics.mean(p[key]):.2f}"
                         for p, g in zip(results["grpo"], results["gad"]))

    print(f"\nsteps={a.steps} rounds={a.rounds} discriminator_lora_r={a.lora}")
    print(f"step time  grpo {mean('grpo'):.2f} s  gad {mean('gad'):.2f} s  ratio {mean('gad') / mean('grpo'):.3f}"
          f"  (per round: {paired('step_times')}; goal <= 1.35)")
    print(f"cpu time   grpo {mean('grpo', 'cpu_times'):.2f} s  gad {mean('gad', 'cpu_times'):.2f} s  "
          f"ratio {mean('gad', 'cpu_times') / mean('grpo', 'cpu_times'):.3f}  (per round: {paired('cpu_times')}; "
          "process CPU seconds per step, all threads: steadier than wall time on a shared machine)")


if __name__ == "__main__":
    main()
