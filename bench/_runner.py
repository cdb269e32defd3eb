"""What every bench here shares: a per-step timer for the child process, and the driver that
runs variants alternately in fresh subprocesses so machine noise hits all of them.

A bench script is its own child: ``python bench/X.py --child VARIANT ...`` trains and prints
one ``RESULT {json}`` line; ``alternate`` runs the children and collects those results.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time


def step_timer():
    """A TrainerCallback recording wall time and process CPU time (all threads) per step: on a
    shared machine the CPU time is the steadier measure of the work a step does. On CUDA each step
    starts and ends with ``torch.cuda.synchronize()``, so its kernels count in it, not in the next one."""
    import torch
    from transformers import TrainerCallback

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.cpu, self.t = [], [], None

        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.t = (time.perf_counter(), time.process_time())

        def on_step_end(self, args, state, control, **kw):
            sync()
            self.times.append(time.perf_counter() - self.t[0])
            self.cpu.append(time.process_time() - self.t[1])

    return StepTimer()


def reset_peak_rss() -> None:
    """Restart this process's peak RSS (``VmHWM``) from its current RSS (Linux: ``/proc/self/clear_refs``,
    "5"). Run under ``MALLOC_MMAP_THRESHOLD_`` fixed, freed tensors leave the RSS, so the next peak is the
    work's own rather than what glibc kept from before."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rss_kib(field: str = "VmHWM") -> int:
    """``VmHWM`` (peak RSS since the last reset) or ``VmRSS`` of this process, KiB (``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def forward_backward(model, run) -> tuple[object, float, float]:
    """One loss microbatch's cost: ``run()``'s result, and the seconds and peak RSS (MiB above the RSS before it)
    of ``run()`` and the backward of the sum of its first value; ``model``'s gradients set to none after."""
    before = rss_kib("VmRSS")
    reset_peak_rss()
    t = time.perf_counter()
    out = run()
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    seconds = time.perf_counter() - t
    model.zero_grad(set_to_none=True)
    return out, seconds, (rss_kib() - before) / 1024


def completion_lengths(trainer) -> list[float]:
    """The mean completion length TRL logged at each step (``completions/mean_length``): two variants'
    step times compare the same work only where these agree (same seed, same sampled tokens)."""
    return [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]


def same_lengths(results: dict, a: str, b: str) -> str:
    """One line saying whether variants ``a`` and ``b`` sampled completions of the same lengths in every
    round (``lengths`` in their results), with round 0's lengths: else their ratios compare different work."""
    same = all(p["lengths"] == q["lengths"] for p, q in zip(results[a], results[b]))
    return (f"completion lengths per step, {a} vs {b}: {'identical' if same else 'DIFFER (different work)'}: "
            f"{results[a][0]['lengths']} vs {results[b][0]['lengths']}")


def report(**result) -> None:
    """The child's one line of output."""
    print("RESULT " + json.dumps(result), flush=True)


def alternate(script: str, variants: tuple[str, ...], rounds: int, args: list[str], describe=None,
              keep_going: bool = False, timeout: float | None = None) -> dict:
    """Run ``script --child V *args`` for each variant, ``rounds`` times, alternating; return
    ``{variant: [result, ...]}``. Round r starts at variant r (mod their number), so no variant
    always runs in the same slot (on this VM one child in a run can be 10-20% slower in every
    phase, its identical rollout too). ``describe(variant, result)`` adds to each progress line.
    A child that fails (no ``RESULT`` line) or runs past ``timeout`` seconds (killed) stops the bench with its
    stderr's tail; with ``keep_going`` its tail is printed, the variant is left out of the later rounds and of
    the returned dict, and the others go on (where device time is short, so that one failing setting does not
    lose the others' figures)."""
    results = {v: [] for v in variants}
    for r in range(rounds):
        for variant in variants[r % len(variants):] + variants[:r % len(variants)]:
            if variant not in results:
                continue
            try:
                out = subprocess.run([sys.executable, script, "--child", variant, *args], capture_output=True,
                                     text=True, timeout=timeout)
                line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
                tail = out.stderr[-3000:]
            except subprocess.TimeoutExpired as e:  # e.stderr: the bytes read before the kill, or None
                err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
                line, tail = None, f"killed after {timeout:g} s\n{err[-3000:]}"
            if line is None:
                if not keep_going:
                    sys.exit(f"{variant} run failed:\n{tail}")
                print(f"round {r} {variant:8s} FAILED, left out from here on:\n{tail}", flush=True)
                del results[variant]
                continue
            res = json.loads(line[len("RESULT "):])
            results[variant].append(res)
            extra = describe(variant, res) if describe else ""
            print(f"round {r} {variant:8s} mean step {statistics.mean(res['step_times']):.3f} s  "
                  f"cpu {statistics.mean(res['cpu_times']):.3f} s{extra}", flush=True)
    return results


def mean_per_step(results: dict, variant: str, key: str = "step_times", steps: slice = slice(None)) -> float:
    """Mean over rounds of the mean over ``steps`` of ``key`` (every step by default)."""
    return statistics.mean(statistics.mean(res[key][steps]) for res in results[variant])


def add_shape_args(parser, prompts: int = 2, generations: int = 4, length: int = 32) -> None:
    """--prompts, --generations, --length: the shape of one generation batch (docs/cost.md measures 8 x 8 x 256)."""
    parser.add_argument("--prompts", type=int, default=prompts, help="prompts per step")
    parser.add_argument("--generations", type=int, default=generations, help="completions per prompt")
    parser.add_argument("--length", type=int, default=length, help="max_completion_length")


def shape_args(a) -> list[str]:
    """The shape arguments, to hand on to the children."""
    return ["--prompts", str(a.prompts), "--generations", str(a.generations), "--length", str(a.length)]


def shape_config(prompts: int, generations: int, length: int) -> dict:
    """GRPOConfig fields for one step of ``prompts x generations`` completions of up to ``length``
    tokens, trained in microbatches of at most 8 rows (2 x 4: one microbatch of 8; 8 x 8: 8 of 8)."""
    rows = prompts * generations
    micro = math.gcd(rows, 8)
    return dict(per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro,
                num_generations=generations, max_completion_length=length)


def quickstart_trainer(variant: str, common: dict, callbacks: list, **grpotrl_fields):
    """The bench's GRPO run on SmolLM2 and the quickstart rows: plain ``trl.GRPOTrainer`` for the
    variant "trl" (``common`` only), else ``grpotrl.GRPOTrainer`` with ``grpotrl_fields`` on top."""
    import trl

    import grpotrl
    from grpotrl.data import load_quickstart
    from grpotrl.models import resolve_model_path
    from grpotrl.rewards.rules import exact_answer_reward

    trainer_class, config_class = ((trl.GRPOTrainer, trl.GRPOConfig) if variant == "trl"
                                   else (grpotrl.GRPOTrainer, grpotrl.GRPOConfig))
    fields = common if variant == "trl" else {**common, **grpotrl_fields}
    return trainer_class(model=resolve_model_path("smollm2-135m-instruct"), reward_funcs=exact_answer_reward,
                         args=config_class(**fields), train_dataset=load_quickstart("train"), callbacks=callbacks)
