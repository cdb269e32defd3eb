"""Checkpoint and output-dir checks, run once before any weights load: is a saved model or a
``checkpoint-N`` dir complete, may this run write into ``output_dir``, and which checkpoint it resumes.

* ``checkpoint_problems``: what keeps a ``checkpoint-N`` dir from being resumed exactly (a SIGKILL
  during the save: trainer state, weights, optimizer, scheduler, RNG -- every saving process's, where the
  checkpoint records how many saved it -- and the files the trainer adds, each present and not truncated;
  headers and zip directories only, no weights read).
* ``check_resume_checkpoint`` / ``find_last_checkpoint`` / ``resume_checkpoint``:
  ``resume_from_checkpoint`` (a path, or true for the newest ``checkpoint-N`` of the run that last
  started in ``output_dir``: ``earlier_run_checkpoints``, ``run_lock.GrpotrlRun``) checked to hold
  everything this trainer saves, or an ``InputError`` naming the newest complete one; a warning
  when the step falls inside one of TRL's generation batches (no exact resume then).
* ``rotate_run_checkpoints``: ``save_total_limit`` over the current run's checkpoints only, never the one
  just saved; ``current_run_checkpoints``: which of a list of checkpoints a deletion may take (the trainers
  restrict transformers' end-of-training cleanup to them).
* ``check_output_dir`` (the CLI: a non-empty dir needs overwrite or a resume) and
  ``check_finished_run`` (the Python API: only a finished run is refused); a resume counts only from a
  checkpoint inside ``output_dir`` (``resumes_inside``); both name every way to set
  ``overwrite_output_dir`` (``OVERWRITE_HOW``). The run lock itself is ``run_lock.py``.
* ``check_resume_architecture``: a checkpoint written by a model of another architecture (its
  ``config.json`` fields; LoRA: ``adapter_config.json``'s rank, target modules and base model), an
  ``InputError`` naming the field and both values before the weights load.
* ``disk_full_named``: a full disk while a checkpoint or the model is written, a ``DiskFullError``
  naming the file and the last complete checkpoint (torch itself says only "unexpected pos").
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import shutil
import time
import zipfile
from contextlib import contextmanager

from transformers.trainer_utils import sort_checkpoints

from ..chat import templates
from ..configs.launch import sharded_launch
from ..errors import DiskFullError, HealthStop, InputError, InvariantError
from ..models.sources import WEIGHT_FILES, file_listing, safetensors_problem, weights_problem
from .run_lock import LOCK_FILE, RUN_FILE, checkpoint_record, read_run_file

logger = logging.getLogger(__name__)

def _torch_file_problem(path: str) -> str | None:
    """Why the ``torch.save`` file at ``path`` is cut short, or None. ``torch.save`` writes a zip
    whose directory sits at the end, so a file killed mid-write has none; reads the directory only."""
    try:
        with zipfile.ZipFile(path) as z:
            z.namelist()
    except (zipfile.BadZipFile, OSError):
        return f"{os.path.basename(path)} is {os.path.getsize(path)} bytes and not a complete torch.save file " \
               "(cut short while being written)"
    return None


def _file_problem(directory: str, name: str) -> str | None:
    """Why ``directory/name`` is missing or cut short (by its kind: safetensors, torch.save, JSON), or None."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return f"no {name}"
    if name.endswith(".safetensors"):
        return safetensors_problem(path)
    if name.endswith((".pt", ".pth", ".bin")):
        return _torch_file_problem(path)
    if name.endswith(".json"):
        try:
            with open(path) as f:
                json.load(f)
        except ValueError:
            return f"{name} is not valid JSON (cut short while being written)"
    return None


def checkpoint_problems(path: str, required: tuple[str, ...] = ()) -> list[str]:
    """What keeps ``path`` from being resumed exactly, as a list of reasons (empty: complete).

    The Trainer saves a checkpoint in this order: weights (+ ``required`` files a trainer writes
    beside them: template fingerprint, GAD discriminator), optimizer and scheduler, RNG state,
    and ``trainer_state.json`` last; TRL writes ``entropy_ctrl_state.json`` after that. A SIGKILL
    during the save leaves a prefix of that list, possibly with the last file cut short. The
    Trainer itself would resume from such a directory with a fresh optimizer or RNG without a
    word, so every file is checked: present, and not truncated (headers / zip directories only).
    A DeepSpeed checkpoint (``latest`` + ``global_stepN/``) keeps weights and optimizer there.
    """
    directory = os.path.expanduser(path)
    problems = [p for p in [_file_problem(directory, "trainer_state.json")] if p]
    if os.path.isfile(os.path.join(directory, "latest")):  # DeepSpeed: weights and optimizer in global_stepN/
        with open(os.path.join(directory, "latest")) as f:
            tag = f.read().strip()
        if not tag or not os.path.isdir(os.path.join(directory, tag)):
            problems.append(f"'latest' names DeepSpeed state {tag!r}, which is not there")
    else:
        is_adapter = os.path.isfile(os.path.join(directory, "adapter_config.json"))
        # the files a resume reads beside trainer_state.json, where present (a crash can leave one empty)
        unreadable = {name: p for name in READ_ON_RESUME if os.path.isfile(os.path.join(directory, name))
                      and (p := _file_problem(directory, name))}
        problems += unreadable.values()
        index_readable = not any(name.endswith(".index.json") for name in unreadable)  # weights_problem reads it
        if index_readable and (weights := weights_problem(directory, "adapter" if is_adapter else "model")):
            problems.append(weights)
        fsdp_optimizer = any(os.path.isdir(os.path.join(directory, n)) and "optimizer" in n
                             for n in os.listdir(directory))
        if not fsdp_optimizer:
            problems += [p for name in ("optimizer.pt", "scheduler.pt") if (p := _file_problem(directory, name))]
    rng = sorted(n for n in os.listdir(directory) if re.fullmatch(r"rng_state(_\d+)?\.pth", n))
    problems += _missing_rng_states(directory, rng)
    problems += [p for name in rng if (p := _file_problem(directory, name))]
    problems += [p for name in required if (p := _file_problem(directory, name))]
    if {"no trainer_state.json", "no optimizer.pt"} & set(problems) == {"no optimizer.pt"} and not rng:
        # trainer_state.json is written last: a kill cannot leave it without the optimizer
        problems.append(WEIGHTS_ONLY)
    return problems


def _missing_rng_states(directory: str, rng: list[str]) -> list[str]:
    """The RNG files ``directory`` lacks (``rng`` are those it has). Every process saves its own
    ``rng_state_<rank>.pth`` (transformers' ``Trainer._save_rng_state``, not only the saving ones) into its
    machine's ``output_dir``, and a resume loads each rank's own. So where grpotrl recorded that several
    processes saved it (``run_lock.checkpoint_record``), each rank's file; under ``save_on_each_node`` each
    machine's copy holds the files of the ranks on that machine, as recorded (``node_ranks``). One process:
    ``rng_state.pth``. Without a record (plain TRL, or a ``save_on_each_node`` record without ``node_ranks``)
    any one RNG file will do."""
    record = checkpoint_record(directory) or {}
    processes, node_ranks = record.get("processes"), record.get("node_ranks")
    if isinstance(processes, int) and processes > 1 and record.get("save_on_each_node"):
        if not (isinstance(node_ranks, list) and node_ranks and all(isinstance(r, int) for r in node_ranks)):
            return [] if rng else ["no rng_state.pth"]
        ranks = ", ".join(map(str, node_ranks))
        return [f"no {name} (save_on_each_node: this machine's copy holds the rng_state_<rank>.pth of its ranks "
                f"{ranks}, of {processes} processes)"
                for name in (f"rng_state_{rank}.pth" for rank in node_ranks) if name not in rng]
    if not isinstance(processes, int):
        return [] if rng else ["no rng_state.pth"]
    if processes <= 1:
        return [] if "rng_state.pth" in rng else ["no rng_state.pth"]
    return [f"no {name} ({processes} processes saved this checkpoint, each its own rng_state_<rank>.pth)"
            for name in (f"rng_state_{rank}.pth" for rank in range(processes)) if name not in rng]


# read by a resume when present: the model's config (transformers compares it), the adapter's (PEFT builds
# the adapter from it), a sharded save's index, and weights in torch.save's format
READ_ON_RESUME = ("config.json", "adapter_config.json",
                  *(name + ".index.json" for names in WEIGHT_FILES.values() for name in names),
                  *(bin_name for _, bin_name in WEIGHT_FILES.values()))

WEIGHTS_ONLY = ("trainer_state.json without optimizer or RNG state is what save_only_model=True writes: it cannot "
                "resume a run, only start a new one with model_name_or_path")


def _checkpoints(directory: str) -> list[str]:
    """``checkpoint-N`` names in ``directory``, by step."""
    if not os.path.isdir(directory):
        return []
    names = [n for n in os.listdir(directory) if re.fullmatch(r"checkpoint-\d+", n)
             and os.path.isdir(os.path.join(directory, n))]
    return sorted(names, key=_step)


def _step(name: str) -> int:
    """The step of a ``checkpoint-N`` name."""
    return int(name.split("-")[1])


def _last_written(path: str) -> float:
    """When ``path`` (a directory) or a file directly in it was last written."""
    return max([os.path.getmtime(path)] + [os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path)])


def earlier_run_checkpoints(directory: str) -> list[str]:
    """The ``checkpoint-N`` names in ``directory`` that an earlier run left there, by step: the run that last
    started training in ``directory`` (its ``run_lock.RUN_FILE``) did not save them and does not continue them.
    A checkpoint grpotrl saved says which run it belongs to (``run_lock.checkpoint_record``); one without that
    record (plain TRL, or a save cut short before ``trainer_state.json``) is an earlier run's when it was last
    written before that run first wrote there. Empty without a ``RUN_FILE`` (no grpotrl run trained there)."""
    current = read_run_file(directory)
    if current is None:
        return []
    earlier = []
    for name in _checkpoints(directory):
        path = os.path.join(directory, name)
        record = checkpoint_record(path)
        if record is not None:
            if record["run"] != current["run"]:
                earlier.append(name)
        elif _last_written(path) < current["since"]:
            earlier.append(name)
    return earlier


def _complete_checkpoints(directory: str, required: tuple[str, ...] = ()) -> list[str]:
    """The complete ``checkpoint-N`` names in ``directory`` that belong to its current run (the ones to name as
    a resume's alternative; never an earlier run's, ``earlier_run_checkpoints``)."""
    try:
        earlier = set(earlier_run_checkpoints(directory)) if os.path.isdir(directory) else set()
    except InputError:  # its run file is unreadable: name them all (a resume by path is checked on its own)
        earlier = set()
    return [n for n in _checkpoints(directory)
            if n not in earlier and not checkpoint_problems(os.path.join(directory, n), required)]


def check_resume_checkpoint(path: str, required: tuple[str, ...] = ()) -> None:
    """Raise ``InputError`` unless ``path`` is a complete checkpoint dir (``checkpoint_problems``);
    the message names what is missing and the complete checkpoints beside it. Deletes nothing."""
    directory = os.path.expanduser(path)
    parent = os.path.dirname(os.path.abspath(directory))
    if not os.path.isdir(directory):
        raise InputError(
            f"resume_from_checkpoint {path!r} is not a directory. Complete checkpoints in {parent}: "
            f"{_complete_checkpoints(parent, required) or 'none'}. Pick one, or drop resume_from_checkpoint to "
            "start fresh."
        )
    problems = checkpoint_problems(directory, required)
    if problems:
        others = [c for c in _complete_checkpoints(parent, required)
                  if os.path.join(parent, c) != os.path.abspath(directory)]
        hint = (f"Resume from the newest complete one (--resume_from_checkpoint {os.path.join(parent, others[-1])})"
                if others else "Drop resume_from_checkpoint to start fresh")
        inside = _complete_checkpoints(directory, required)  # a finished run's output_dir holds its checkpoints
        if WEIGHTS_ONLY in problems:  # saved so on purpose, not cut short: say only that
            raise InputError(
                f"Checkpoint {path!r} holds weights and trainer_state.json but no optimizer, scheduler or RNG state "
                f"(found: {file_listing(directory)}): it is a weights-only save (save_only_model=True, or a finished run's "
                "final output), which cannot resume a run. Start a new run from it with model_name_or_path "
                f"{path!r}, or resume from a full checkpoint"
                + (f": {os.path.join(path, inside[-1])}" if inside else f" (beside it: {others or 'none'})") + "."
            )
        raise InputError(
            f"Checkpoint {path!r} is incomplete: {'; '.join(problems)} (found: {file_listing(directory)}). The run that "
            "wrote it was probably killed (or ran out of disk) while saving, and resuming from it would load part of "
            f"the state. Complete checkpoints beside it: {others or 'none'}. {hint}; the incomplete directory is left "
            "as it is (delete it yourself once you no longer need it)."
        )


def last_complete_checkpoint(directory: str) -> str | None:
    """The path of the newest complete ``checkpoint-N`` of ``directory``'s current run (``_complete_checkpoints``),
    None where there is none."""
    names = _complete_checkpoints(directory)
    return os.path.join(directory, names[-1]) if names else None


def find_last_checkpoint(output_dir: str, required: tuple[str, ...] = ()) -> str:
    """The newest ``checkpoint-N`` of the run that last started in ``output_dir`` (for
    ``resume_from_checkpoint: true``), checked by ``check_resume_checkpoint``: when the newest is incomplete
    that is an error naming it and the newest complete one, never a silent step back to an older checkpoint.
    An earlier run's checkpoints (``earlier_run_checkpoints``: a run started afresh since, with
    ``overwrite_output_dir`` or into a dir holding checkpoints only) are never taken: when they are all there
    is, an ``InputError`` names them and how to resume one (by its path). Nothing is deleted."""
    names = _checkpoints(output_dir)
    if not names:
        raise InputError(
            f"resume_from_checkpoint is true but output_dir {output_dir!r} holds no checkpoint-N dir "
            f"(found: {file_listing(output_dir) if os.path.isdir(output_dir) else 'no such directory'}). Set "
            "resume_from_checkpoint to a checkpoint path, or drop it to start fresh."
        )
    earlier = earlier_run_checkpoints(output_dir)
    current = [n for n in names if n not in earlier]
    if not current:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(read_run_file(output_dir)["since"]))
        raise InputError(
            f"resume_from_checkpoint is true but every checkpoint in output_dir {output_dir!r} ({earlier}) belongs "
            f"to an earlier run than the one that last trained there (started {since}, with overwrite_output_dir or "
            "without resuming), which saved no checkpoint before it ended; resuming true would continue that last "
            "run. Nothing was deleted. To continue the earlier run, name its checkpoint: --resume_from_checkpoint "
            f"{os.path.join(output_dir, earlier[-1])} (resume_from_checkpoint=... in Python); to start afresh, "
            "drop resume_from_checkpoint."
        )
    left_out = [n for n in earlier if _step(n) > _step(current[-1])]
    if left_out:
        logger.warning("resume_from_checkpoint is true: resuming %s, the newest checkpoint of the run that last "
                       "trained in %s; %s belong to an earlier run it replaced, and are left as they are.",
                       current[-1], output_dir, left_out)
    last = os.path.join(output_dir, current[-1])
    check_resume_checkpoint(last, required)
    return last


def current_run_checkpoints(run_dir: str, paths: list[str], what: str) -> list[str]:
    """Those of ``paths`` (``checkpoint-N`` dirs in ``run_dir``, as transformers' ``sort_checkpoints`` lists them),
    in their order, that the run that last started in ``run_dir`` saved or continues: the ones a deletion of
    ``what`` (named in the warning) may take. Never an earlier run's (``earlier_run_checkpoints``: a run started
    afresh leaves them where they are), nor a directory that only looks like one (``sort_checkpoints`` lists
    ``checkpoint-3-old`` too). Empty when ``run_dir``'s run file cannot be read (a warning says so)."""
    try:
        earlier = set(earlier_run_checkpoints(run_dir))
    except InputError as err:
        logger.warning("%s: no checkpoint deleted, since it is unclear which run each belongs to: %s", what, err)
        return []
    own = {os.path.join(os.path.abspath(run_dir), n) for n in _checkpoints(run_dir) if n not in earlier}
    return [p for p in paths if os.path.abspath(p) in own]


def rotate_run_checkpoints(run_dir: str, saved: str, limit: int | None, best: str | None = None) -> list[str]:
    """``save_total_limit`` applied to the ``checkpoint-N`` dirs of the run that last started in ``run_dir``
    (``current_run_checkpoints``), after it saved ``saved``: the oldest (by time written, as transformers sorts
    them) are deleted until ``limit`` are left; returns the deleted paths. Never deleted: ``saved`` (the state to
    resume from; where the file system's mtimes are not reliable transformers sorts by step, and an older run's
    higher step would take its place), ``best`` (``load_best_model_at_end``), and an earlier run's checkpoints.
    When ``run_dir``'s run file cannot be read, nothing is deleted (a warning says so)."""
    if limit is None or limit <= 0:
        return []
    own = current_run_checkpoints(run_dir, sort_checkpoints(run_dir, use_mtime=True), f"save_total_limit {limit}")
    protected = {os.path.abspath(p) for p in (saved, best) if p}
    deleted = []
    for checkpoint in own:
        if len(own) - len(deleted) <= max(limit, len(protected)):
            break
        if os.path.abspath(checkpoint) not in protected:
            shutil.rmtree(checkpoint, ignore_errors=True)
            deleted.append(checkpoint)
    return deleted


OVERWRITE_HOW = ("overwrite_output_dir: true in the recipe, --overwrite_output_dir true on the command line, "
                 "GRPOConfig(overwrite_output_dir=True) (SFTConfig, GADConfig alike) or "
                 "train(overwrite_output_dir=True)")


def resumes_inside(checkpoint, output_dir: str) -> bool:
    """Whether resuming from ``checkpoint`` continues the run in ``output_dir``: True (or "true"/"last",
    the newest ``checkpoint-N`` there) or a path inside ``output_dir`` (symlinks resolved). Only such a
    resume lets a run write over what ``output_dir`` holds: a checkpoint of another run, resumed into
    it, would replace this run's model and log with the other's continuation.

    >>> [resumes_inside(c, "out") for c in (True, "out/checkpoint-5", "other/checkpoint-5", None)]
    [True, True, False, False]
    """
    if not resume_requested(checkpoint):
        return False
    if checkpoint is True or checkpoint in ("true", "True", "last"):
        return True
    path, directory = (os.path.realpath(os.path.expanduser(str(p))) for p in (checkpoint, output_dir))
    return os.path.commonpath([path, directory]) == directory


def check_output_dir(path: str, resume=False, overwrite: bool = False) -> None:
    """Raise ``InputError`` when a run into ``path`` would replace what is there: a finished run
    (weights, ``trainer_state.json``), ``checkpoint-N`` dirs, or any other file (the Trainer writes
    README.md, config.json, ... by name). Resuming that run or ``overwrite`` is the user saying so:
    ``resume`` is the run's ``resume_from_checkpoint`` (True, "true", or a path), and only a checkpoint
    inside ``path`` counts (``resumes_inside``). A file where a directory should be is always an error.
    Reads names only; the run lock (``run_lock.LOCK_FILE``, live or left by a killed run) and the run file
    (``run_lock.RUN_FILE``) do not count."""
    directory = os.path.expanduser(path)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise InputError(f"output_dir {path!r} is a file, not a directory. Point output_dir at a new directory.")
    if resumes_inside(resume, path) or overwrite or not os.path.isdir(directory):
        return
    names = set(os.listdir(directory)) - {LOCK_FILE, RUN_FILE}
    if not names:
        return
    checkpoints = _checkpoints(directory)
    finished = [n for n in ("trainer_state.json", *WEIGHT_FILES["model"], *WEIGHT_FILES["adapter"]) if n in names]
    if finished or checkpoints:
        steps = ""
        if "trainer_state.json" in names:
            try:
                with open(os.path.join(directory, "trainer_state.json")) as f:
                    steps = f" of {json.load(f).get('global_step')} steps"
            except (OSError, ValueError):
                pass
        what = (f"a finished run{steps} ({', '.join(finished)})" if finished else "no final model") + \
            (f" and checkpoints {checkpoints}" if checkpoints else "")
    else:
        what = f"files grpotrl did not write ({file_listing(directory)})"
    other = (f" (resume_from_checkpoint {resume!r} lies outside it: resuming another run's checkpoint does not "
             "continue this one)" if resume_requested(resume) else "")
    resume_how = ("resume that run with resume_from_checkpoint: true (--resume_from_checkpoint true), "
                  if checkpoints else "")
    raise InputError(
        f"output_dir {path!r} already holds {what}; this run would overwrite them{other}. Choose a new output_dir, "
        f"{resume_how}or replace it: {OVERWRITE_HOW}."
    )


def check_finished_run(path: str, resume=None) -> None:
    """The Python API's output_dir rule: raise ``InputError`` when ``path`` holds a finished run
    (final weights and ``trainer_state.json`` at its root, what ``save_model`` + ``save_state``
    write), unless ``resume`` (the checkpoint the run resumes from) continues it (``resumes_inside``);
    anything else is written into as TRL and transformers do (fresh temp dirs, checkpoints).
    The message names every way to lift it: a script's user may own only the recipe or the command line."""
    if resumes_inside(resume, path):
        return
    directory = os.path.expanduser(path)
    if not os.path.isfile(os.path.join(directory, "trainer_state.json")):
        return
    names = set(os.listdir(directory))
    weights = [n for n in (*WEIGHT_FILES["model"], *WEIGHT_FILES["adapter"])
               if n in names or n + ".index.json" in names]
    if not weights:
        return
    try:
        with open(os.path.join(directory, "trainer_state.json")) as f:
            steps = f" of {json.load(f).get('global_step')} steps"
    except (OSError, ValueError, AttributeError):
        steps = ""
    other = (f" (resume_from_checkpoint {resume!r} lies outside it: resuming another run's checkpoint does not "
             "continue this one)" if resume_requested(resume) else "")
    resume_how = ("resume it (resume_from_checkpoint: true, --resume_from_checkpoint true or "
                  "train(resume_from_checkpoint=True)), " if _checkpoints(directory) else "")
    raise InputError(
        f"output_dir {path!r} holds a finished run{steps} ({', '.join(weights)}, trainer_state.json); training into it "
        f"would replace its model and log history{other}. Use a new output_dir, {resume_how}or replace it: "
        f"{OVERWRITE_HOW}."
    )


# ---------------------------------------------------------------------------------------------
# Resume
# ---------------------------------------------------------------------------------------------

# GADTrainer's discriminator D in a checkpoint (written by ``trainers.gad_engine``): its full weights, and
# its optimizer state (``optimizer.pt``, or DeepSpeed's own ``latest`` + ``ds/``)
D_DIR = "discriminator"
D_WEIGHTS = "model.safetensors"
D_OPTIMIZER = "optimizer.pt"
DS_TAG = "ds"


def discriminator_files(deepspeed: bool) -> list[str]:
    """D's files in a checkpoint directory (for the resume checks, before anything loads)."""
    return [f"{D_DIR}/{D_WEIGHTS}", f"{D_DIR}/latest" if deepspeed else f"{D_DIR}/{D_OPTIMIZER}"]


def resume_files(args, kind: str) -> tuple[str, ...]:
    """Files a checkpoint of this trainer holds beyond the Trainer's own: the template fingerprint
    (I2), TRL's adaptive-entropy controller, the GAD discriminator and its optimizer."""
    files = [templates.FINGERPRINT_FILE] if getattr(args, "check_template", True) else []
    if getattr(args, "use_adaptive_entropy", False):
        files.append("entropy_ctrl_state.json")  # TRL writes it after trainer_state.json, and skips it if absent
    if kind == "gad":
        files += discriminator_files(deepspeed=sharded_launch(args) == "DeepSpeed")
    return tuple(files)


def resume_requested(checkpoint) -> bool:
    """Whether ``resume_from_checkpoint`` (a path, True, or "true"/"last" from a recipe) asks for a resume."""
    return checkpoint not in (None, False, "", "false", "False")


def resume_checkpoint(checkpoint, args, kind: str, use_peft: bool | None = None) -> str | None:
    """``resume_from_checkpoint`` as a checked path (``~`` expanded, as transformers expands ``output_dir``):
    True (or "true"/"last") is the newest ``checkpoint-N`` in ``output_dir``; None/False is no resume. An
    incomplete checkpoint is an ``InputError`` naming it and the newest complete one; nothing is deleted. With
    ``use_peft`` given, a LoRA checkpoint needs a LoRA run and a full one a full run."""
    if not resume_requested(checkpoint):
        return None
    required = resume_files(args, kind)
    if checkpoint in (True, "true", "True", "last"):
        checkpoint = find_last_checkpoint(args.output_dir, required)
    else:
        check_resume_checkpoint(checkpoint, required)
        checkpoint = os.path.expanduser(checkpoint)  # as checked; the Trainer would look for a dir named "~"
    adapter = os.path.isfile(os.path.join(checkpoint, "adapter_config.json"))
    if use_peft is not None and adapter != use_peft:
        raise InputError(
            f"Checkpoint {checkpoint!r} holds {'a LoRA adapter' if adapter else 'full weights'} but this run has "
            f"use_peft: {str(use_peft).lower()}. Resume with the settings that wrote it (use_peft, lora_*, "
            "load_in_4bit/8bit), or start a new run from it with model_name_or_path instead."
        )
    _warn_mid_generation(checkpoint, args, kind)
    return checkpoint


def _warn_mid_generation(checkpoint: str, args, kind: str) -> None:
    """TRL generates once per ``steps_per_generation * num_iterations`` micro-steps and reuses the
    batch in between; that buffer is not in a checkpoint. Resuming from a step inside such a block
    samples a new batch where the uninterrupted run reused the old one: it trains on, but not on
    the same completions."""
    every = (getattr(args, "steps_per_generation", None) or 1) * (getattr(args, "num_iterations", None) or 1)
    match = re.search(r"checkpoint-(\d+)$", os.path.normpath(checkpoint))
    if kind == "sft" or every <= 1 or match is None:
        return
    micro_steps = int(match.group(1)) * args.gradient_accumulation_steps
    if micro_steps % every:
        logger.warning(
            "Resuming from %s, which falls inside a generation batch (TRL generates every %d micro-steps: "
            "steps_per_generation x num_iterations); the resumed run samples that batch afresh, so it will not "
            "match an uninterrupted run. Checkpoints at multiples of %d optimizer steps resume exactly.",
            checkpoint, every, every // math.gcd(every, args.gradient_accumulation_steps))


# ---------------------------------------------------------------------------------------------
# The model a checkpoint was written by (config.json / adapter_config.json, before weights load)
# ---------------------------------------------------------------------------------------------

# what decides the shapes of the weights and optimizer state a checkpoint holds, by transformers'
# canonical names (a config class maps its own: GPT-2's ``n_embd`` is ``hidden_size``)
ARCHITECTURE_FIELDS = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers",
                       "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                       "num_local_experts", "tie_word_embeddings")


def read_config(path: str | None) -> dict | None:
    """The JSON object in ``path`` (a ``config.json``), or None when there is none or it is unreadable."""
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def architecture(config) -> dict:
    """``ARCHITECTURE_FIELDS`` of ``config`` (a ``PretrainedConfig``, or a ``config.json`` dict: read
    through its config class, so the class's defaults and aliases apply; no remote code is run). A
    field the config does not define is None."""
    if isinstance(config, dict):
        from transformers import CONFIG_MAPPING

        model_type = config.get("model_type")
        if model_type in CONFIG_MAPPING:
            try:
                config = CONFIG_MAPPING[model_type].from_dict(config)
            except Exception:  # a config its own class refuses: compare the fields as written
                pass
    get = config.get if isinstance(config, dict) else lambda name: getattr(config, name, None)
    fields = {name: get(name) for name in ARCHITECTURE_FIELDS}
    if fields["architectures"] is not None:
        fields["architectures"] = list(fields["architectures"])
    return fields


def architecture_differences(saved, model) -> list[tuple[str, object, object]]:
    """``(field, saved value, model value)`` for each ``ARCHITECTURE_FIELDS`` entry both configs define
    and disagree on."""
    a, b = architecture(saved), architecture(model)
    return [(name, a[name], b[name]) for name in ARCHITECTURE_FIELDS
            if a[name] is not None and b[name] is not None and a[name] != b[name]]


def _listed(differences: list[tuple[str, object, object]], where: str) -> str:
    return "; ".join(f"{name} is {saved!r} in {where} but {model!r} in this run's model"
                     for name, saved, model in differences)


def _modules(target_modules) -> list[str] | None:
    """LoRA ``target_modules`` as a sorted list of names; None for a regex, "all-linear" or unset (not compared)."""
    return sorted(target_modules) if isinstance(target_modules, (list, tuple, set)) else None


def check_resume_architecture(checkpoint: str, model_config, model_name: str | None, peft_config=None) -> None:
    """Raise ``InputError`` when ``checkpoint`` was written by a model of another architecture than this
    run's (``model_config``: its ``PretrainedConfig`` or ``config.json`` dict), before any weights load.

    Full weights: the checkpoint's ``config.json`` against the model's, field by field
    (``ARCHITECTURE_FIELDS``). A LoRA adapter: its ``adapter_config.json``'s ``r`` and
    ``target_modules`` against this run's ``peft_config`` (where it names them), and the config of its
    ``base_model_name_or_path`` (when that is a directory here) against the model's. The Trainer would
    otherwise load the model first and fail in the state dict or the optimizer (a traceback). A
    checkpoint without ``config.json`` is not compared."""
    name = model_name or "(the model passed in)"
    adapter = read_config(os.path.join(checkpoint, "adapter_config.json"))
    if adapter is None:
        saved = read_config(os.path.join(checkpoint, "config.json"))
        differences = architecture_differences(saved, model_config) if saved is not None else []
        if differences:
            raise InputError(
                f"Checkpoint {checkpoint!r} was written by a model of another architecture than this run's {name}: "
                f"{_listed(differences, 'its config.json')}. Its weights and optimizer state cannot load into this "
                "model. Resume with the model that wrote it (model_name_or_path), or drop resume_from_checkpoint "
                "to start fresh from this model."
            )
        return
    where = os.path.join(checkpoint, "adapter_config.json")
    pairs = (("r", adapter.get("r"), getattr(peft_config, "r", None)),
             ("target_modules", _modules(adapter.get("target_modules")),
              _modules(getattr(peft_config, "target_modules", None))))
    lora = [(key, saved, run) for key, saved, run in pairs if saved is not None and run is not None and saved != run]
    if lora:
        raise InputError(
            f"LoRA checkpoint {checkpoint!r} holds adapters of another shape than this run makes: "
            + "; ".join(f"lora {k} is {s!r} in {where} but {r!r} in this run's settings" for k, s, r in lora)
            + ". Resume with the LoRA settings that wrote it (lora_r, lora_target_modules), or drop "
            "resume_from_checkpoint to start fresh."
        )
    base = adapter.get("base_model_name_or_path")
    base_config = read_config(os.path.join(os.path.expanduser(base), "config.json")) if base else None
    differences = architecture_differences(base_config, model_config) if base_config is not None else []
    if differences:
        raise InputError(
            f"LoRA checkpoint {checkpoint!r} was trained on {base!r}, a model of another architecture than this "
            f"run's {name}: {_listed(differences, os.path.join(base, 'config.json'))}. Its adapters cannot load "
            f"into this model. Resume with model_name_or_path {base!r}, or drop resume_from_checkpoint to start "
            "fresh."
        )


# ---------------------------------------------------------------------------------------------
# A full disk while a checkpoint (or the final model) is written
# ---------------------------------------------------------------------------------------------

NEARLY_FULL_BYTES = 16 * 2**20  # torch.save's failed write says only "unexpected pos": this little free is the cause
DISK_FULL_TEXT = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


def _chain(err: BaseException):
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


def _nearest_dir(path: str) -> str:
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    return path or "."


def is_disk_full(err: BaseException, directory: str) -> bool:
    """Whether ``err``, raised while writing into ``directory``, is a full disk: an ``OSError`` ENOSPC or
    EDQUOT anywhere in its chain, a message saying so (safetensors: "No space left on device (os error
    28)"), or a write error of torch (its ``PytorchStreamWriter``: "unexpected pos", no errno) or of the
    OS with under ``NEARLY_FULL_BYTES`` left on that filesystem."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(e) for text in DISK_FULL_TEXT):
            return True
    if isinstance(err, (OSError, RuntimeError)):
        return shutil.disk_usage(_nearest_dir(directory)).free < NEARLY_FULL_BYTES
    return False


def _file_being_written(err: BaseException, directory: str) -> str:
    """The file a failed save was writing: the error's own ``filename``, else the newest file under
    ``directory`` when it is cut short, else its weights when they are missing (safetensors deletes
    what it could not finish), else the directory."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.filename:
            return str(e.filename)
    files = [os.path.join(root, n) for root, _, names in os.walk(directory) for n in names]
    if files:
        newest = max(files, key=os.path.getmtime)
        if _file_problem(os.path.dirname(newest), os.path.basename(newest)):
            return newest
    kind = "adapter" if os.path.isfile(os.path.join(directory, "adapter_config.json")) else "model"
    if os.path.isdir(directory) and weights_problem(directory, kind):
        return os.path.join(directory, WEIGHT_FILES[kind][0])
    return f"a file in {directory}"


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(path) for n in names)


@contextmanager
def disk_full_named(directory: str, run_dir: str, what: str, required: tuple[str, ...] = ()):
    """Turn a full disk while the block writes into ``directory`` (a ``checkpoint-N`` or the final
    model's dir) into ``DiskFullError``: the file being written, "no space left on device", the space
    free, and the last complete checkpoint in ``run_dir`` to resume from (or "none yet"), with the
    original as ``__cause__``. Deletes nothing: an incomplete ``checkpoint-N`` stays, and a resume
    refuses it (``check_resume_checkpoint``). Any other error passes through unchanged."""
    try:
        yield
    except (InputError, InvariantError, HealthStop):
        raise
    except Exception as err:
        if not is_disk_full(err, directory):
            raise
        complete = [c for c in _complete_checkpoints(run_dir, required)
                    if os.path.abspath(os.path.join(run_dir, c)) != os.path.abspath(directory)]
        last = os.path.join(run_dir, complete[-1]) if complete else None
        left = (f" {directory} is incomplete and left as it is (a resume refuses it; delete it once you have room)."
                if os.path.basename(os.path.normpath(directory)).startswith("checkpoint-") else "")
        then = (f"then resume with --resume_from_checkpoint {last} (a checkpoint takes about "
                f"{_size(last) / 2**20:.0f} MiB)" if last else "then run again")
        raise DiskFullError(
            f"No space left on device while writing {_file_being_written(err, directory)} ({what}; "
            f"{shutil.disk_usage(_nearest_dir(directory)).free / 2**20:.1f} MiB free there).{left} Last complete "
            f"checkpoint: {last or 'none yet'}. Free space or set output_dir to a disk with room, {then}."
        ) from err
