"""Cost of a GRPO step: plain ``trl.GRPOTrainer`` vs grpotrl's variants, at 8 x 8 x 256 by default.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/bench_padding_free.py    # CPU: trl, padded, packed; 2 rounds
    python bench/bench_padding_free.py                                       # CUDA: trl, default, fastest; 1 round
    .venv/bin/python bench/bench_padding_free.py --prompts 4 --generations 8 --length 128 --steps 3 --rounds 1
    MALLOC_MMAP_THRESHOLD_=131072 ... --variants trl,packed --steps 3    # each step's own CPU peak (slower, noisier times)

The variants: ``trl`` (plain TRL, always run: every ratio is against it); ``default`` (grpotrl's GRPOConfig
defaults, ``padding_free`` left at 'auto', so whatever that resolves to on this device; the header says which);
``padded`` and ``packed`` (grpotrl with ``padding_free`` forced off and on); ``compiled`` (grpotrl's defaults with
the compiled rollout forced on: a static KV cache and the decoding step compiled, ``compiled_rollout=true``);
``varlen`` (``padding_free=true`` with ``packed_attention=varlen``: on CUDA in bf16 torch's varlen kernel, I5's
guard-step recompute through the same kernel; elsewhere one sdpa per sequence or prompt tree; the finished-row
rollout on, as ``padding_free`` turns it on);
``fastest`` (every speed setting forced on: ``padding_free=true``, ``compiled_rollout=true``,
``packed_attention=varlen``: on CUDA in bf16 the kernel, whose I5 recompute runs through it; with the mask there,
I5's bf16 median bound stopped the run at step 1 on an H100, 2026-11-27). ``--variants`` defaults to ``trl,padded,packed`` on CPU and ``trl,default,fastest``
on CUDA; ``--rounds`` to 2 on CPU and 1 on CUDA, so that on a GPU the three variants' 4 steps at 8 x 8 x 256,
each child's setup and compilation included, run in one command of a few minutes. CUDA runs bf16 (autocast
over the fp32 weights).

SmolLM2-135M-Instruct on open questions, half of them asking for a short answer (so a batch's
answers run from a few tokens to the cap, as in real prompt mixes), the same config,
seed and data for every variant, learning rate 0 so that every variant samples the same
completions; fresh subprocesses, variants rotated round by round (``_runner.alternate``). Printed: a header
with the device's name, the date and the torch / transformers / trl versions; then
step time, CPU time and the run's peak memory (CPU: peak RSS; CUDA: ``torch.cuda.max_memory_allocated``;
the largest of the setup's and each step's own peaks)
as ratios against plain TRL measured in the same run; the completion-length spread and the share
of the padded ``[B, P + C]`` loss batch that is padding; per step the loss and grad norm of the
padded and padding-free grpotrl runs and their relative difference; and where a step's time goes
(sampling + rewards, where padding_free's rollout leaves the rows that have stopped out of the decoding
batch; the no-grad reference/old-policy logprob forwards; the loss forward + backward), each against plain
TRL's, and the share of the decoding batch the padding-free run's model ran; the decoding rate (completion tokens
per second of sampling) against the rate at which the device's memory bandwidth could read the weights once per
decoding step of all the batch's rows (the bandwidth measured here, by copying a 1 GiB tensor); the time
torch.compile spent (``torch._dynamo``'s own timer) and how much longer the first step's sampling took than the
later steps'; and each step's own peak memory (CPU: the peak
RSS, reset at each step's start through ``/proc/self/clear_refs``; CUDA: ``reset_peak_memory_stats``), so that
the steps after grpotrl's guard steps can be compared, split into the peak of its rollouts and of the rest (loss
forward + backward, optimizer), with the memory held when the rollout ended and the widest loss microbatch's
columns: where a variant samples other completions, a wider loss batch raises its peak by itself. On CUDA each
timed span starts and ends with ``torch.cuda.synchronize()``, so a phase's kernels count in it. The padded reference for the loss comparison is
``padded``, or ``default`` where it resolved to padding_free off.
Goals, after the guard steps: on CPU the step <= 0.6x plain TRL's for ``packed`` (the CPU default); on CUDA
<= 0.5x for ``default`` (the compiled rollout), ``compiled`` and ``fastest``, peak memory <= 1.0x, the
same mean completion length as TRL's within sampling noise; loss and grad norm equal to the padded path's within
1e-5 relative (fp32), step by step.
The guards run on grpotrl's default schedule (the first 2 steps), in every grpotrl variant. A variant whose
run fails (an ``InvariantError`` from a guard, say) or outlasts ``--child-timeout`` is reported with its stderr's
tail and left out; the others are printed, and the bench exits 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import _runner  # bench/_runner.py: the timer and the alternating driver

VARIANTS = ("trl", "default", "padded", "packed", "compiled", "varlen", "fastest")
DEFAULT_VARIANTS = {"cpu": "trl,padded,packed", "cuda": "trl,default,fastest"}
# step time / plain TRL's after the guard steps, per device: CPU's default is packed; on CUDA every speed setting on
GOALS_ON = {"cpu": {"default": 0.6, "packed": 0.6}, "cuda": {"default": 0.5, "compiled": 0.5, "fastest": 0.5}}
GUARD_STEPS = 2  # grpotrl's default guard_steps: steps 1-2 also run I5's padded recompute forward
# I5's statistics as the guard steps log them (bf16: the fitted temperature's ratio, the median gap and the worst
# row's mean gap, against 1 +- 1%, 0.02 and 0.5; fp32: the largest gap, against guard_logprob_atol)
GUARD_METRICS = ("guards/logprob_temperature_ratio", "guards/logprob_median_gap", "guards/logprob_row_gap",
                 "guards/logprob_max_gap")
QUESTIONS = [  # open questions; half ask for a short answer, so a batch's completions run from a few tokens to the cap
    "Why is the sky blue?", "What makes a good teacher?", "How do vaccines work?",
    "Describe your ideal weekend.", "What is the difference between weather and climate?",
    "Why do people procrastinate, and how can they stop?", "Explain how a bicycle stays upright.",
    "What should I pack for a week-long hiking trip?",
    "In one short sentence: what is a rainbow?", "Name one thing that makes a city pleasant to live in.",
    "In a few words, why do cats purr?", "Answer in one sentence: is it better to rent or to buy a home?",
    "Give a one-line definition of gravity.", "In one sentence, what is a good breakfast?",
    "Suggest a name for a lost dog, nothing else.", "Say briefly what autumn smells like.",
]


def open_questions():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS])


def length_reward(completions, **kwargs):
    """Any reward will do at learning rate 0; this one varies within a group (non-zero advantages)."""
    return [len(c[0]["content"]) / 100 for c in completions]


class PaddingShare:
    """Each loss microbatch's real tokens, padded cells and completion lengths (the ``_compute_loss``
    inputs), summed over the run."""

    def __init__(self):
        self.real, self.cells, self.lengths = 0, 0, []

    def add(self, inputs: dict) -> None:
        attn = [inputs["prompt_mask"], inputs["completion_mask"]]
        self.real += int(sum(m.sum() for m in attn))
        self.cells += int(sum(m.numel() for m in attn))
        self.lengths.extend(inputs["completion_mask"].sum(1).tolist())


def child(variant: str, steps: int, shape: tuple[int, int, int]) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import time

    import torch
    import transformers
    import trl

    import grpotrl
    from grpotrl.models import resolve_model_path

    cuda = torch.cuda.is_available()
    common = dict(output_dir=f"/tmp/grpotrl-bench-pf-{variant}", **_runner.shape_config(*shape),
                  max_steps=steps, logging_steps=1, report_to="none", use_cpu=not cuda, bf16=cuda,
                  disable_dropout=True, save_strategy="no", seed=0, temperature=0.9, beta=0.04,
                  learning_rate=0.0)
    share = PaddingShare()
    if variant == "trl":
        trainer_class, args = trl.GRPOTrainer, trl.GRPOConfig(**common)
    elif variant == "default":  # padding_free left at 'auto': what it resolves to on this device
        trainer_class, args = grpotrl.GRPOTrainer, grpotrl.GRPOConfig(**common)
    elif variant == "compiled":
        trainer_class, args = grpotrl.GRPOTrainer, grpotrl.GRPOConfig(**common, compiled_rollout="true")
    elif variant == "varlen":
        trainer_class, args = grpotrl.GRPOTrainer, grpotrl.GRPOConfig(**common, padding_free=True,
                                                                      packed_attention="varlen")
    elif variant == "fastest":
        trainer_class, args = grpotrl.GRPOTrainer, grpotrl.GRPOConfig(
            **common, padding_free=True, compiled_rollout="true", packed_attention="varlen")
    else:
        trainer_class, args = grpotrl.GRPOTrainer, grpotrl.GRPOConfig(**common, padding_free=variant == "packed")

    phases = {"rollout": 0.0, "no_grad_logps": 0.0, "step": 0.0}  # seconds in the current step
    per_step = {k: [] for k in phases}

    def timed(key, fn):
        sync()
        t = time.perf_counter()
        try:
            return fn()
        finally:
            sync()
            phases[key] += time.perf_counter() - t

    def sync():  # CUDA: the span's kernels finish inside it
        if cuda:
            torch.cuda.synchronize()

    class Recorded(trainer_class):
        def _compute_loss(self, model, inputs):
            share.add(inputs)
            widths.append(inputs["prompt_mask"].size(1) + inputs["completion_mask"].size(1))
            return super()._compute_loss(model, inputs)

        def _generate_and_score_completions(self, inputs):  # sampling, rewards, reference/old logprobs
            self.in_rollout = True
            segment("rollout")
            try:
                return timed("rollout", lambda: super(Recorded, self)._generate_and_score_completions(inputs))
            finally:
                self.in_rollout = False
                segment("rest")
                held.append(read_held())

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            # the rollout's no-grad forwards only: a guard step's recompute inside the loss counts as the loss's
            call = lambda: super(Recorded, self)._get_per_token_logps_and_entropies(*args, **kwargs)  # noqa: E731
            rollout = getattr(self, "in_rollout", False) and not torch.is_grad_enabled()
            return timed("no_grad_logps", call) if rollout else call()

        def training_step(self, *args, **kwargs):
            return timed("step", lambda: super(Recorded, self).training_step(*args, **kwargs))

    # bytes, per step: the peak of its rollouts (sampling, rewards, the no-grad logprob forwards) and of the rest
    # (loss forward + backward, optimizer), each read and reset where one gives way to the other (CPU: VmHWM through
    # /proc/self/clear_refs; CUDA: reset_peak_memory_stats); the step's own peak is the larger
    segment_peaks = {"rollout": [], "rest": []}
    now = {"segment": "rest", "peaks": {"rollout": 0, "rest": 0}}
    held, held_now = [], []  # bytes allocated (CPU: RSS) when a rollout ended: what the loss starts from
    widths, step_widths = [], []  # the loss microbatches' P + C columns; per step, the widest

    before_steps = []  # bytes: the peak up to the first step (loading, setup), before the first reset

    def segment(to: str) -> None:
        """The peak since the last reset goes to the segment that ran; the next one starts from a reset."""
        peaks = now["peaks"]
        peaks[now["segment"]] = max(peaks[now["segment"]], read_peak())
        reset_peak()
        now["segment"] = to

    class Phases(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if not before_steps:
                before_steps.append(read_peak())
            reset_peak()
            now.update(segment="rest", peaks={"rollout": 0, "rest": 0})
            held.clear()
            widths.clear()

        def on_step_end(self, args, state, control, **kw):
            for k in phases:
                per_step[k].append(phases[k])
                phases[k] = 0.0
            segment("rest")
            for k in segment_peaks:
                segment_peaks[k].append(now["peaks"][k])
            held_now.append(max(held, default=0))
            step_widths.append(max(widths, default=0))

    def reset_peak():
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            _runner.reset_peak_rss()

    def read_peak() -> int:
        return torch.cuda.max_memory_allocated() if cuda else _runner.rss_kib() * 1024

    def read_held() -> int:
        return torch.cuda.memory_allocated() if cuda else _runner.rss_kib("VmRSS") * 1024

    timer = _runner.step_timer()
    trainer = Recorded(model=resolve_model_path("smollm2-135m-instruct"), reward_funcs=length_reward, args=args,
                       train_dataset=open_questions(), callbacks=[timer, Phases()])
    assert variant not in ("padded", "packed") or trainer.padding_free == (variant == "packed")
    trainer.train()
    compile_seconds = _compile_seconds()
    step_peaks = [max(pair) for pair in zip(*segment_peaks.values())]
    # the run's peak: each step resets it (ru_maxrss and max_memory_allocated read the last step's alone)
    peak = max(before_steps + step_peaks + [read_peak()])
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    _runner.report(variant=variant, step_times=timer.times, cpu_times=timer.cpu, peak_bytes=peak,
                   lengths=_runner.completion_lengths(trainer), device="cuda" if cuda else "cpu",
                   losses=[h["loss"] for h in logs], grad_norms=[h["grad_norm"] for h in logs],
                   rewards=[h["reward"] for h in trainer.state.log_history if "reward" in h],
                   real=share.real, cells=share.cells, completion_lengths=share.lengths,
                   phases=per_step, step_peaks=step_peaks, segment_peaks=segment_peaks, held=held_now,
                   widths=step_widths,
                   decoding_rows=[h["padding_free/decoding_rows"] for h in trainer.state.log_history
                                  if "padding_free/decoding_rows" in h],
                   padding_free=getattr(trainer, "padding_free", None), compile_seconds=compile_seconds,
                   compile_counts=_compile_counts(),
                   weight_bytes=sum(p.numel() * (2 if cuda else p.element_size()) for p in trainer.model.parameters()),
                   rows=shape[0] * shape[1],
                   guards=[{k.removeprefix("guards/logprob_"): h[k] for k in GUARD_METRICS if k in h}
                           for h in trainer.state.log_history if any(k in h for k in GUARD_METRICS)])


def _compile_seconds() -> float:
    """Seconds torch.compile spent in this process (``torch._dynamo``'s timer of its compilations, the backend's
    included; CUDA graphs are recorded at their first runs, which the first step's sampling time shows)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    return float(values[names.index("_compile.compile_inner")]) if "_compile.compile_inner" in names else 0.0


def _compile_counts() -> dict:
    """What torch.compile counted in this process: dynamo's compiled graphs (``unique_graphs``: more than the
    buckets a run reached means recompiles) and inductor's CUDA-graph counters (records, re-records, skips), by
    their names in ``torch._dynamo.utils.counters``."""
    from torch._dynamo.utils import counters

    found = {"graphs": counters["stats"].get("unique_graphs", 0)}
    found.update({k: v for k, v in counters["inductor"].items() if "cudagraph" in k})
    return found


def bandwidth_bytes_per_s() -> float | None:
    """The device's memory bandwidth as a copy of 1 GiB measures it (read + write), CUDA only."""
    import time

    import torch

    if not torch.cuda.is_available():
        return None
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * 10 * x.numel() / (time.perf_counter() - t)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def main() -> None:
    import datetime

    import torch
    import transformers
    import trl

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1 if cuda else 2)
    p.add_argument("--child", choices=VARIANTS)
    p.add_argument("--child-timeout", type=float, default=None,
                   help="seconds after which a variant's run is killed and left out (the others go on); default none")
    p.add_argument("--variants", default=DEFAULT_VARIANTS["cuda" if cuda else "cpu"],
                   help="comma-separated subset of " + ",".join(VARIANTS) + " (trl is always run: the ratios are "
                        "against it); default: " + " on CPU, ".join(DEFAULT_VARIANTS.values()) + " on CUDA")
    _runner.add_shape_args(p, prompts=8, generations=8, length=256)
    a = p.parse_args()
    if a.child:
        return child(a.child, a.steps, (a.prompts, a.generations, a.length))
    device = torch.cuda.get_device_name() if cuda else f"CPU, {os.cpu_count()} cores"
    print(f"{device}  {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}  torch {torch.__version__}  "
          f"transformers {transformers.__version__}  trl {trl.__version__}", flush=True)
    bandwidth = bandwidth_bytes_per_s()
    if bandwidth is not None:
        print(f"memory bandwidth (a 1 GiB copy): {bandwidth / 1e12:.2f} TB/s", flush=True)
    variants = tuple(v for v in VARIANTS if v == "trl" or v in a.variants.split(","))
    goals = GOALS_ON["cuda" if cuda else "cpu"]
    results = _runner.alternate(__file__, variants, a.rounds, ["--steps", str(a.steps), *_runner.shape_args(a)],
                                describe=progress, keep_going=True, timeout=a.child_timeout)
    failed = [v for v in variants if v not in results]
    if "trl" in failed:
        sys.exit("plain TRL's run failed: no ratio to print")
    variants = tuple(v for v in variants if v in results)

    def mean(v, key="step_times"):
        return _runner.mean_per_step(results, v, key)

    def peak(v):
        return max(res["peak_bytes"] for res in results[v])

    first = results[variants[-1]][0]
    lengths = first["completion_lengths"]
    print(f"\ndevice={first['device']} ({device}) steps={a.steps} rounds={a.rounds} "
          f"shape={a.prompts} prompts x {a.generations} generations x {a.length} tokens")
    if "default" in variants:
        print(f"default: grpotrl's GRPOConfig defaults; padding_free 'auto' resolved to "
              f"{'on' if results['default'][0]['padding_free'] else 'off'} on this device")
    print(f"completion lengths (round 0, every loss row): min {min(lengths):.0f}  median "
          f"{statistics.median(lengths):.0f}  max {max(lengths):.0f}  stdev {statistics.pstdev(lengths):.1f}")
    print(f"padding share of the padded [B, P + C] loss batches: {1 - first['real'] / first['cells']:.1%}")
    for v in variants[1:]:
        print(_runner.same_lengths(results, "trl", v))
    print("mean completion length and reward over every step and round (a rollout that draws other random numbers, "
          "as CUDA graphs do, samples other completions: these should agree within sampling noise):")
    for v in variants:
        lengths_v = [x for res in results[v] for x in res["lengths"]]
        rewards_v = [x for res in results[v] for x in res["rewards"]]
        print(f"  {v:8s} length {statistics.mean(lengths_v):7.2f} tokens   reward {statistics.mean(rewards_v):.4f}")
    for v in variants:
        goal = "  (goal <= %s)" % goals[v] if v in goals else ""
        print(f"{v:8s} step {mean(v):7.3f} s ({mean(v) / mean('trl'):.3f}x){goal}   cpu {mean(v, 'cpu_times'):7.3f} s "
              f"({mean(v, 'cpu_times') / mean('trl', 'cpu_times'):.3f}x)   peak {peak(v) / 2**20:7.0f} MiB "
              f"({peak(v) / peak('trl'):.3f}x)" + ("  (goal <= 1.0)" if v in goals else ""))
    guard = GUARD_STEPS
    if a.steps > guard:
        after = slice(guard, None)
        print(f"steps {guard + 1}..{a.steps} only (after grpotrl's guard steps):")
        for v in variants:
            step, cpu = (_runner.mean_per_step(results, v, key, after) for key in ("step_times", "cpu_times"))
            step0, cpu0 = (_runner.mean_per_step(results, "trl", key, after) for key in ("step_times", "cpu_times"))
            top = max(max(res["step_peaks"][after]) for res in results[v])  # the steps' own peaks, not the run's
            top0 = max(max(res["step_peaks"][after]) for res in results["trl"])
            goal = "  (goal <= %s)" % goals[v] if v in goals else ""
            print(f"  {v:8s} step {step:7.3f} s ({step / step0:.3f}x){goal}   cpu {cpu:7.3f} s ({cpu / cpu0:.3f}x)   "
                  f"peak {top / 2**20:7.0f} MiB ({top / top0:.3f}x)" + ("  (goal <= 1.0)" if v in goals else ""))
            print(f"  {'':8s} " + "   ".join(
                f"{name} peak {x / 2**20:7.0f} MiB ({x / x0:.3f}x)" for name, x, x0 in (
                    (f"the {k}'s" if k == "rest" else "the rollouts'",
                     *(max(max(res["segment_peaks"][k][after]) for res in results[u]) for u in (v, "trl")))
                    for k in ("rollout", "rest"))))
    steady = slice(guard, None) if a.steps > guard else slice(None)

    def phase(v, name):
        """Mean seconds per step (over rounds, over the steady steps) of one phase of the step."""
        def one(res):
            p = {k: x[steady] for k, x in res["phases"].items()}
            return {"sampling": [r - n for r, n in zip(p["rollout"], p["no_grad_logps"])],
                    "no_grad_logps": p["no_grad_logps"],
                    "loss": [s - r for s, r in zip(p["step"], p["rollout"])]}[name]
        return statistics.mean(statistics.mean(one(res)) for res in results[v])

    print(f"phases per step ({'steps %d..%d' % (guard + 1, a.steps) if a.steps > guard else 'every step'}; "
          "padding_free runs the sampling without its finished rows and packs the last two):")
    names = {"sampling": "sampling + rewards", "no_grad_logps": "reference/old logprob forwards",
             "loss": "loss forward + backward"}
    for v in variants:
        print(f"  {v:8s} " + "   ".join(f"{names[k]} {phase(v, k):7.2f} s ({phase(v, k) / max(phase('trl', k), 1e-9):.3f}x)"
                                      for k in names))
    for v in variants:
        if results[v][0].get("decoding_rows"):
            print(f"  {v:7s} share of the decoding batch the model ran, per step (round 0; "
                  "padding_free/decoding_rows): " + "  ".join(f"{x:.3f}" for x in results[v][0]["decoding_rows"]))
    print(f"decoding rate ({'steps %d..%d' % (guard + 1, a.steps) if a.steps > guard else 'every step'}; completion "
          "tokens per second of sampling + rewards; the limit: every row's token of a decoding step for each read of "
          "the weights at the measured bandwidth" + ("" if bandwidth else ", CUDA only") + "):")
    for v in variants:
        res0 = results[v][0]
        tokens = statistics.mean(res0["lengths"][steady]) * res0["rows"]  # completion tokens per step
        rate = tokens / max(phase(v, "sampling"), 1e-9)
        limit = f"   limit {res0['rows'] * bandwidth / res0['weight_bytes']:.0f} tokens/s " \
                f"({rate / (res0['rows'] * bandwidth / res0['weight_bytes']):.4f} of it)" if bandwidth else ""
        print(f"  {v:8s} {rate:9.1f} tokens/s{limit}   torch.compile {res0['compile_seconds']:.1f} s   first step's "
              f"sampling {res0['phases']['rollout'][0] - phase(v, 'sampling') - phase(v, 'no_grad_logps'):+.1f} s "
              "against a later step's")
    print("I5 on the guard steps (round 0, each logged step; bounds in bf16: temperature_ratio 1 +- 0.01, "
          "median_gap <= 0.02, row_gap <= 0.5; fp32: max_gap <= 1e-5 x the logit scale):")
    for v in variants:
        for i, g in enumerate(results[v][0].get("guards", [])):
            print(f"  {v:8s} step {i + 1}: " + "  ".join(f"{k} {x:.4g}" for k, x in g.items()))
    print("peak memory per step, MiB (round 0; the guard steps also hold I5's padded recompute): the step's, its "
          "rollouts' (sampling, rewards, no-grad forwards) / the rest's (loss forward + backward, optimizer), what was "
          "held when the rollout ended" + (" (allocated)" if cuda else " (RSS)") + ", and the widest loss "
          "microbatch's P + C columns (a sampled batch with longer completions costs the loss more)")
    for v in variants:
        res0 = results[v][0]
        print(f"  {v:8s} " + "  ".join(
            f"{s / 2**20:.0f} ({r / 2**20:.0f} / {t / 2**20:.0f}, held {h / 2**20:.0f}, W {w})"
            for s, r, t, h, w in zip(res0["step_peaks"], res0["segment_peaks"]["rollout"],
                                     res0["segment_peaks"]["rest"], res0["held"], res0["widths"])))
    padded = "padded" if "padded" in variants else next(
        (v for v in variants if v == "default" and not results[v][0]["padding_free"]), None)
    if padded is not None and "packed" in variants:
        compare_losses(results, padded)
    if failed:
        sys.exit(f"failed, left out above: {', '.join(failed)}")


def compare_losses(results: dict, padded: str) -> None:
    """Per step, the padded run's loss and grad norm against the padding-free (``packed``) run's."""
    label = "padded" if padded == "padded" else "default (padded)"
    print(f"per step, {label} vs padding-free (round 0; goal: relative difference <= 1e-5):")
    pad, pf = results[padded][0], results["packed"][0]
    for s, (l0, l1, g0, g1) in enumerate(zip(pad["losses"], pf["losses"], pad["grad_norms"], pf["grad_norms"])):
        print(f"  step {s + 1}: loss {l0:+.8e} vs {l1:+.8e} (rel {_rel(l1, l0):.1e})   "
              f"grad_norm {g0:.8e} vs {g1:.8e} (rel {_rel(g1, g0):.1e})")


def progress(variant: str, res: dict) -> str:
    """A child's figures on its progress line, so that a command cut short still shows them: the steps after the
    guard steps, the first step's sampling (compilation and CUDA-graph recording show there) and what torch.compile
    counted (``_compile_counts``)."""
    steps, rollout = res["step_times"], res["phases"]["rollout"]
    after = (f"  steps {GUARD_STEPS + 1}..: {statistics.mean(steps[GUARD_STEPS:]):.3f} s"
             if len(steps) > GUARD_STEPS else "")
    counts = "  ".join(f"{k} {v}" for k, v in res["compile_counts"].items())
    return (f"{after}  first step's rollout {rollout[0]:.1f} s  torch.compile {res['compile_seconds']:.1f} s "
            f"({counts})  peak {res['peak_bytes'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
