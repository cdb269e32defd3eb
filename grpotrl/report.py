"""``grpotrl report OUTPUT_DIR``: PNG plots of a run, read from its ``trainer_state.json``.

    grpotrl report outputs/smollm2-grpo-quickstart
    grpotrl report outputs/smollm2-grpo-quickstart --out /tmp/plots

A person looks at a picture instead of reading logs. One PNG per panel plus ``report.png``
with every panel, written to ``OUTPUT_DIR/report/`` (or ``--out``). Panels, each drawn only
when the run logged its metrics: reward (total and per function), entropy (token mean and
the per-sample min / p10), KL, completion length (mean, min, max), clip ratios, health shares
(1-token, max-length, zero-variance groups, zero rewards, chat-header starts), logits (max,
top-1 minus top-2 gap), sampler vs trainer (mean and max |logp_sampler -
logp_trainer|, I10's step-0 gaps), raw importance ratios (token and sequence mean/min/max,
untruncated, beside TRL's truncated mean), one panel per per-task metric (``tasks/<task>/<metric>``, a curve per
task) and the GAD discriminator (``gad/d_acc``, ``gad/d_loss``; teacher and student scores).
Eval values, when logged, are dashed.

``trainer_state.json`` is what ``grpotrl grpo|sft`` saves beside the weights at the end, and every
``checkpoint-N/`` holds one of its step. The newest of them by ``global_step`` is read (the top level's where
steps tie), and the printed line names it: a run stopped by a health rule or interrupted has its newest state
only in its last checkpoint, and one that finished, was resumed and then stopped keeps the finished run's older
file at the top level.
Needs matplotlib (``pip install grpotrl[report]``); drawn with the Agg backend, no display.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

from .errors import InputError

# panel name -> (title, y label, metric keys); a panel is drawn when any key was logged
PANELS = {
    "reward": ("Reward", "reward", ["reward", re.compile(r"rewards/[^/]+/mean")]),
    "entropy": ("Entropy", "nats", ["entropy", "entropy/sample_min", "entropy/sample_p10"]),
    "kl": ("KL to the reference", "nats", ["kl"]),
    "completion_length": ("Completion length", "tokens",
                          ["completions/mean_length", "completions/min_length", "completions/max_length"]),
    "clip_ratio": ("Clip ratios", "share of tokens",
                   ["clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "cispo_clip_ratio"]),
    "health": ("Health shares", "share", ["completions/one_token_share", "completions/max_length_share",
                                          "frac_reward_zero_std", "rewards/zero_share", "completions/header_share",
                                          "dynamic_sampling/dropped_share"]),
    "logits": ("Logits", "logit", ["logits/max", "logits/top1_top2_gap"]),
    "sampler_mismatch": ("Sampler vs trainer", "nats", ["sampling/sampler_trainer_logp_gap/mean",
                                                        "sampling/sampler_trainer_logp_gap/max",
                                                        re.compile(r"identity/step0_\w+_logp_gap/max")]),
    "raw_ratio": ("Raw importance ratio (untruncated)", "ratio",
                  [re.compile(r"sampling/raw_ratio/(token|seq)/(mean|min|max)"),
                   "sampling/importance_sampling_ratio/mean"]),
    "discriminator": ("GAD discriminator", "value", ["gad/d_acc", "gad/d_loss", "d_acc", "d_loss"]),
    "discriminator_scores": ("GAD discriminator scores", "D score", ["gad/teacher_score", "gad/student_score"]),
}
TASK_KEY = re.compile(r"tasks/(?P<task>[^/]+)/(?P<metric>.+)")
CHECKPOINT = re.compile(r"checkpoint-(\d+)")  # a checkpoint directory's name; N is its global_step


def find_state(output_dir: str) -> str:
    """The newest ``trainer_state.json`` of the run in ``output_dir`` by its ``global_step``: the top level's
    (``save_state`` at the end) or a ``checkpoint-N/``'s. Where steps tie, the top level's, written last. A
    checkpoint's file that does not say its step is dated by N (the Trainer names a checkpoint by its step); a
    top-level one cannot be dated and is taken, so that ``read_log_history`` names what is wrong with it."""
    top = os.path.join(output_dir, "trainer_state.json")
    steps = {}  # path -> its global_step
    for path in glob.glob(os.path.join(output_dir, "checkpoint-*", "trainer_state.json")):
        m = CHECKPOINT.fullmatch(os.path.basename(os.path.dirname(path)))
        if m:
            step = state_step(path)
            steps[path] = int(m.group(1)) if step is None else step
    if os.path.isfile(top):
        steps[top] = state_step(top)
        if steps[top] is None:
            return top
    if not steps:
        raise InputError(f"No trainer_state.json in {output_dir!r} nor in a checkpoint-N/ below it. Point "
                         "`grpotrl report` at a run's output_dir (grpotrl grpo|sft save it there at the end).")
    return max(steps, key=lambda path: (steps[path], path == top))


def state_step(state_path: str) -> int | None:
    """``global_step`` of a ``trainer_state.json``; None where the file is no JSON mapping with an integer one."""
    try:
        with open(state_path, encoding="utf-8") as f:
            step = json.load(f).get("global_step")
    except (OSError, ValueError, AttributeError):  # cut short, not UTF-8 (ValueError both), not a mapping
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def read_log_history(state_path: str) -> list[dict]:
    """``log_history`` of a ``trainer_state.json``; a file cut short, not a JSON mapping, or whose
    log_history is not a list of mappings is an ``InputError`` naming the file and the place."""
    try:
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
    except json.JSONDecodeError as err:
        raise InputError(f"{state_path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}; "
                         f"{os.path.getsize(state_path)} bytes): it was probably cut short while being written. "
                         "Point `grpotrl report` at a run whose trainer_state.json is whole (or at one of its "
                         "checkpoint-N dirs).") from None
    except UnicodeDecodeError as err:
        raise InputError(f"{state_path} is not UTF-8 text ({err.reason} at byte {err.start}): not a "
                         "trainer_state.json the Trainer wrote.") from None
    history = state.get("log_history", []) if isinstance(state, dict) else None
    if not isinstance(history, list) or not all(isinstance(e, dict) for e in history):
        if not isinstance(state, dict):
            what = f"a JSON {type(state).__name__}, not a mapping"
        else:
            kind = "a list with non-mapping entries" if isinstance(history, list) else f"a {type(history).__name__}"
            what = f"a mapping whose log_history is {kind}"
        raise InputError(f"{state_path} is {what}: not a trainer_state.json the Trainer wrote (a mapping whose "
                         "log_history is a list of {metric: value} entries).")
    return history


def series(log_history: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """Every numeric logged key -> (steps, values), in logging order; None values left out."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for entry in log_history:
        step = entry.get("step")
        for key, value in entry.items():
            if key == "step" or step is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            steps, values = out.setdefault(key, ([], []))
            steps.append(step)
            values.append(value)
    return out


def panels(log_history: list[dict]) -> dict[str, tuple[str, str, dict[str, tuple[list, list]]]]:
    """The panels this run has data for: name -> (title, y label, {curve label: (steps, values)})."""
    data = series(log_history)
    out = {}
    for name, (title, ylabel, keys) in PANELS.items():
        curves = {}
        for key in keys:
            matched = [k for k in data if key.fullmatch(k)] if isinstance(key, re.Pattern) else [key]
            for k in matched:
                for label in (k, f"eval_{k}"):
                    if label in data:
                        curves[label] = data[label]
        if curves:
            out[name] = (title, ylabel, curves)
    per_task: dict[str, dict] = {}
    for key in data:
        m = TASK_KEY.fullmatch(key.removeprefix("eval_"))
        if m:
            label = m["task"] + (" (eval)" if key.startswith("eval_") else "")
            per_task.setdefault(m["metric"], {})[label] = data[key]
    for metric, curves in per_task.items():
        out["task_" + re.sub(r"\W+", "_", metric)] = (f"Per task: {metric}", metric, curves)
    return out


def write_report(output_dir: str, out_dir: str | None = None, state_path: str | None = None) -> dict[str, str]:
    """Draw every panel of the run in ``output_dir``; returns panel name -> PNG path, with
    ``"report"`` the figure of all panels. Axes titles are the panel titles. ``state_path``: the
    ``trainer_state.json`` to read (default ``find_state(output_dir)``)."""
    state_path = state_path or find_state(output_dir)
    try:
        import matplotlib
    except ImportError:
        raise InputError("grpotrl report draws with matplotlib, which is not installed: "
                         "pip install 'grpotrl[report]' (or pip install matplotlib).") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log_history = read_log_history(state_path)
    found = panels(log_history)
    if not found:
        raise InputError(f"{state_path} holds no logged training metrics (log_history is empty or has no known "
                         "keys): set logging_steps and train at least one logged step.")
    out_dir = out_dir or os.path.join(output_dir, "report")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise InputError(f"--out {out_dir!r} is a file, not a directory. Point --out at a directory (it is created "
                         "if missing).")
    try:
        os.makedirs(out_dir, exist_ok=True)
        return _draw_all(found, output_dir, state_path, out_dir, plt)
    except OSError as err:  # a read-only mount (someone else's run), a full disk
        plt.close("all")
        raise InputError(f"Cannot write the report into {out_dir!r}: {err.strerror or err}. Point --out at a "
                         "directory you can write to.") from None


def _draw_all(found: dict, output_dir: str, state_path: str, out_dir: str, plt) -> dict[str, str]:
    """One PNG per panel of ``found`` and ``report.png`` with all of them, in ``out_dir``."""
    cols = min(3, len(found))
    rows = -(-len(found) // cols)
    overview, grid = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
    paths = {}
    for i, (name, panel) in enumerate(found.items()):
        fig, ax = plt.subplots(figsize=(6, 4))
        _draw(ax, *panel)
        fig.tight_layout()
        paths[name] = os.path.join(out_dir, f"{name}.png")
        fig.savefig(paths[name], dpi=100)
        plt.close(fig)
        _draw(grid[i // cols][i % cols], *panel)
    for j in range(len(found), rows * cols):
        grid[j // cols][j % cols].set_visible(False)
    overview.suptitle(f"{os.path.abspath(output_dir)} ({state_path.removeprefix(output_dir).lstrip(os.sep)})")
    overview.tight_layout()
    paths["report"] = os.path.join(out_dir, "report.png")
    overview.savefig(paths["report"], dpi=90)
    plt.close(overview)
    return paths


def _draw(ax, title: str, ylabel: str, curves: dict) -> None:
    for label, (steps, values) in curves.items():
        eval_curve = label.startswith("eval_") or label.endswith("(eval)")
        ax.plot(steps, values, "--" if eval_curve else "-", marker="." if len(steps) < 50 else None, label=label)
    ax.set_title(title)
    ax.ticklabel_format(axis="y", useOffset=False)  # entropy 10.7891 reads better than 1e-5 + 1.0789e1
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="grpotrl report", description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", help="a run's output_dir (holding trainer_state.json)")
    parser.add_argument("--out", default=None, help="where to write the PNGs (default OUTPUT_DIR/report)")
    parser.error = _usage_error  # one `grpotrl report: error:` line
    args = parser.parse_args(argv)
    state_path = find_state(args.output_dir)
    paths = write_report(args.output_dir, args.out, state_path)
    step = state_step(state_path)
    print(f"grpotrl report: {len(paths) - 1} panels ({', '.join(p for p in paths if p != 'report')}) in "
          f"{os.path.dirname(paths['report'])}, from {os.path.relpath(state_path, args.output_dir)}"
          + (f" (step {step})" if step is not None else ""))


def _usage_error(message: str):
    raise InputError(f"{message[:1].upper()}{message[1:]}. Usage: grpotrl report OUTPUT_DIR [--out DIR]")
