"""Peak memory against completion length, penalties on vs off, against plain ``trl.GRPOTrainer``.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python bench/bench_memory.py   # SmolLM2, 8 x 8, 64..512 tokens
    PYTHONPATH=. .venv/bin/python bench/bench_memory.py --prompts 2 --generations 2 --lengths 16 32   # smoke

For each completion length, three variants train ``--steps`` steps on the same config, seed and
data, each in a fresh subprocess, alternated (trl, off, on, trl, ...) so machine noise hits all:
``trl`` is plain ``trl.GRPOTrainer``; ``off`` is ``grpotrl.GRPOTrainer`` with its defaults; ``on``
adds presence 0.5, frequency 0.5, repetition 1.1 and min_new_tokens 8 (which also make it record
the sampler's logprobs). A step generates ``prompts x generations`` completions (in
microbatches of at most 8 rows, ``_runner.shape_config``); the stop ids are suppressed, so
every completion is exactly ``length`` tokens and memory compares per length.

Two peaks per run. The GENERATION peak: the memory a ``generate`` call allocates above what
was live when it started, the median over the calls after the first (the first call also pages
in the weights, which the loader maps from disk, and sets up the kernels' buffers: a one-off,
~500 MiB on CPU), and the median over rounds. CUDA: ``max_memory_allocated``. CPU: the call's
peak RSS above its RSS at the start, the peak reset through ``/proc/self/clear_refs`` and read
from ``/proc/self/status`` (Linux; costs the call nothing). Before each call the freed heap is
handed back (``malloc_trim(0)``), and the children run with ``MALLOC_MMAP_THRESHOLD_=131072``, so
every buffer over 128 KiB is a mapping of its own that leaves the RSS when freed: what a call
allocates shows as RSS instead of reusing pages an earlier call left resident. The PROCESS peak (CUDA:
``max_memory_allocated``; CPU: peak RSS) is usually set by training's backward.
The ``output_scores`` regression (``length`` x [rows, vocab] fp32 held to the end of
``generate``) shows in the generation peak, growing with the length; the goal is on / off <= 1.05
at every length, flat. Printed as a table; drawn as a PNG when matplotlib is installed.
Step times are those of the steps after the first.
Run ``PYTHONPATH=.`` from the checkout so the grpotrl measured is this one, not an installed copy.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics

import _runner  # bench/_runner.py: the timer and the alternating driver

VARIANTS = ("trl", "off", "on")


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def generation_peak(model, record: list):
    """Wrap ``model.generate`` so every call appends its allocation peak to ``record``."""
    import torch

    original = model.generate
    libc = ctypes.CDLL("libc.so.6")

    def measured(*args, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = original(*args, **kwargs)
            record.append(torch.cuda.max_memory_allocated() - start)
            return out
        gc.collect()
        libc.malloc_trim(0)  # hand freed heap back, so that every call starts from the same kind of RSS
        before = _status_bytes("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")  # Linux: VmHWM (peak RSS) := current RSS
        out = original(*args, **kwargs)
        record.append(_status_bytes("VmHWM") - before)
        return out

    model.generate = measured


def child(variant: str, length: int, prompts: int, generations: int, steps: int) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import resource

    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from grpotrl.models import resolve_model_path
    from grpotrl.chat.templates import stop_token_ids

    model = resolve_model_path("smollm2-135m-instruct")
    stops = stop_token_ids(AutoTokenizer.from_pretrained(model), GenerationConfig.from_pretrained(model))
    common = dict(output_dir=f"/tmp/grpotrl-bench-memory-{variant}", max_steps=steps,
                  **_runner.shape_config(prompts, generations, length), logging_steps=1, report_to="none",
                  use_cpu=not torch.cuda.is_available(), bf16=False, disable_dropout=True, save_strategy="no", seed=0,
                  temperature=0.9, beta=0.04,
                  generation_kwargs={"suppress_tokens": stops})  # every completion is `length` tokens
    timer = _runner.step_timer()
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                     min_new_tokens=min(8, length // 2)) if variant == "on" else {}
    trainer = _runner.quickstart_trainer(variant, common, [timer], **penalties)
    gen_peaks: list[int] = []
    generation_peak(trainer.model, gen_peaks)
    trainer.train()
    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    _runner.report(variant=variant, step_times=timer.times, cpu_times=timer.cpu, peak_bytes=peak,
                   generation_peak_bytes=statistics.median(gen_peaks[1:]), mean_length=statistics.mean(lengths) if lengths else None)


def draw(path: str, lengths: list[int], gen: dict, proc: dict, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG (pip install matplotlib)"
    fig, (gen_ax, proc_ax, ratio_ax) = plt.subplots(1, 3, figsize=(14, 4.2))
    for v, style in zip(VARIANTS, ("k^--", "C0o-", "C3s-")):
        gen_ax.plot(lengths, [gen[v][n] / 2**20 for n in lengths], style, label=v)
        proc_ax.plot(lengths, [proc[v][n] / 2**20 for n in lengths], style, label=v)
    ratio_ax.plot(lengths, [gen["on"][n] / gen["off"][n] for n in lengths], "C3s-", label="on / off, generation")
    ratio_ax.plot(lengths, [proc["on"][n] / proc["off"][n] for n in lengths], "C1^-", label="on / off, process")
    ratio_ax.plot(lengths, [proc["off"][n] / proc["trl"][n] for n in lengths], "C0o-", label="off / trl, process")
    ratio_ax.axhline(1.05, color="grey", ls=":", label="goal 1.05")
    for ax, ylabel in ((gen_ax, "generation peak (MiB)"), (proc_ax, "process peak (MiB)"), (ratio_ax, "ratio")):
        ax.set(xlabel="completion length (tokens)", ylabel=ylabel, xscale="log")
        ax.minorticks_off()
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"drawn: {path}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--png", default="memory_vs_length.png")
    p.add_argument("--child", choices=VARIANTS)
    p.add_argument("--length", type=int)
    a = p.parse_args()
    if a.steps < 2:
        p.error("--steps must be at least 2: the generation peak is read from the calls after the first")
    if a.child:
        return child(a.child, a.length, a.prompts, a.generations, a.steps)

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # read by glibc at the children's start
    gen, proc, times = ({v: {} for v in VARIANTS} for _ in range(3))
    for n in a.lengths:
        print(f"--- completion length {n}", flush=True)
        results = _runner.alternate(
            __file__, VARIANTS, a.rounds,
            ["--length", str(n), "--prompts", str(a.prompts), "--generations", str(a.generations),
             "--steps", str(a.steps)],
            describe=lambda v, r: (f"  generation peak {r['generation_peak_bytes'] / 2**20:.0f} MiB"
                                   f"  process peak {r['peak_bytes'] / 2**20:.0f} MiB  mean length {r['mean_length']}"))
        for v in VARIANTS:
            gen[v][n] = statistics.median(r["generation_peak_bytes"] for r in results[v])
            proc[v][n] = max(r["peak_bytes"] for r in results[v])
            later = [t for r in results[v] for t in r["step_times"][1:]]
            times[v][n] = statistics.mean(later) if later else None

    import torch

    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    title = (f"SmolLM2-135M, {a.prompts} prompts x {a.generations} generations, {a.steps} steps, "
             f"{a.rounds} round(s), {where}")
    print(f"\n{title}\npeak MiB (generation = median over the generate calls after the first; process = whole run)")
    print(f"{'length':>6}  {'gen trl':>8} {'gen off':>8} {'gen on':>8} {'on/off':>6}   "
          f"{'proc trl':>8} {'proc off':>8} {'proc on':>8} {'off/trl':>7} {'on/off':>6}   {'step on/off':>11}")
    for n in a.lengths:
        step = (f"{times['on'][n] / times['off'][n]:11.3f}" if times["on"][n] and times["off"][n] else f"{'-':>11}")
        print(f"{n:6d}  " + " ".join(f"{gen[v][n] / 2**20:8.1f}" for v in VARIANTS)
              + f" {gen['on'][n] / gen['off'][n]:6.3f}   " + " ".join(f"{proc[v][n] / 2**20:8.0f}" for v in VARIANTS)
              + f" {proc['off'][n] / proc['trl'][n]:7.3f} {proc['on'][n] / proc['off'][n]:6.3f}   {step}")
    from transformers import AutoConfig

    from grpotrl.models import resolve_model_path

    vocab = AutoConfig.from_pretrained(resolve_model_path("smollm2-135m-instruct")).vocab_size
    rows = a.prompts * a.generations
    print("for scale, what generate(output_scores=True) would hold by the end (length x [rows, vocab] fp32): "
          + ", ".join(f"{n}: {n * rows * vocab * 4 / 2**20:.0f} MiB" for n in a.lengths))
    print("goal: on / off <= 1.05 at every length (generation and process), flat as the length grows")
    print(draw(a.png, a.lengths, gen, proc, title))


if __name__ == "__main__":
    main()
