"""What grpotrl's trainers share beyond the preflight (``grpotrl/preflight/``): the checked resume.

* ``trainable_dtypes_kept``: a resumed QLoRA adapter keeps the dtype TRL gave it (bitsandbytes'
  kernels: ``models.quantization``).
* ``CheckedResume``: ``train(resume_from_checkpoint=...)`` checked (``checkpoints.resume_checkpoint``)
  unless the preflight already checked that checkpoint; a finished run is not trained over; the
  ``output_dir`` is locked against a second run from ``train()`` to ``end()`` or until ``train()`` raises
  (``run_lock``); a full disk while saving is one clear error (``checkpoints.disk_full_named``); a save into
  an existing ``checkpoint-N`` cut short leaves it incomplete, never mixed; a health stop's checkpoint is
  full and deletes no earlier one (``health.callbacks.stop_save_settings``); ``save_total_limit``, during
  training and in transformers' end-of-training cleanup, deletes only this run's checkpoints.
* ``settle_collectives_at_exit``: a distributed process that trained lets torch's collective threads free
  their last work before the interpreter shuts down, however it exits (else a finished run can exit with
  SIGABRT).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import time
from contextlib import contextmanager, nullcontext

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..checkpoints import (check_finished_run, check_resume_architecture, current_run_checkpoints, disk_full_named,
                           resume_files, resume_requested, rotate_run_checkpoints)
from ..errors import InputError
from ..health.callbacks import stop_save_settings
from ..preflight import check_resume
from ..checkpoints.run_lock import add_run_record, lock_output_dir, release_output_dir
from . import _intercept

logger = logging.getLogger(__name__)


SETTLE_S = 0.2


@functools.cache  # once per process
def settle_collectives_at_exit() -> None:
    """At interpreter exit (an ``atexit`` handler: after the script's last line, an uncaught exception or
    ``SystemExit``, before the interpreter shuts down), release the GIL for ``SETTLE_S`` seconds so that torch's
    collective threads free their last finished work while the interpreter is alive.

    A gloo worker thread drops its reference to a finished work (and the Python tensors the work holds)
    just after the rank's ``wait()`` returns, and ``destroy_process_group`` does not join those threads.
    When the main thread is already in interpreter shutdown, that decref takes the GIL from a dying
    interpreter and the process aborts (``terminate called without an active exception``, exit -6)
    after a run that finished and saved. Measured on 2 CPU processes over gloo (torch 2.13, DDP steps,
    then an all-reduce, then exit; the rate varied with the machine's load from 1 in 30 to 6 in 20):
    14 aborts in 162 exits without ``destroy_process_group``, 1 in 65 with it alone, 0 in 90 with it and
    this pause, 0 in 40 with this pause alone."""
    atexit.register(_settle)


def _settle() -> None:
    logger.debug("grpotrl: %.1f s for torch's collective threads to free their last work before exit", SETTLE_S)
    time.sleep(SETTLE_S)


@contextmanager
def trainable_dtypes_kept(model):
    """Give every trainable parameter back the dtype it had before the block.

    For a resume: the Trainer reloads a PEFT adapter with ``load_adapter``, which builds it in
    fp32, while TRL casts QLoRA adapters to bf16 at init. Left so, a resumed QLoRA run computes
    its LoRA branch and takes its updates in another precision than the run it continues (its
    entropy differs from the first resumed step on; measured on SmolLM2). Kept, a QLoRA run resumed
    at step 5 reproduced the uninterrupted run's steps 6-10 and its final adapter exactly."""
    dtypes = {name: p.dtype for name, p in model.named_parameters() if p.requires_grad}
    yield
    for name, p in model.named_parameters():
        if name in dtypes and p.dtype != dtypes[name]:
            p.data = p.data.to(dtypes[name])


class CheckedResume:
    """Mixin of grpotrl's trainers (before the TRL class): ``train(resume_from_checkpoint=...)``
    from Python gets the CLI's checks (a complete checkpoint with everything this trainer saves,
    LoRA vs full weights, the template fingerprint, I2), and a resumed QLoRA adapter keeps the
    dtype TRL gave it; a finished run in ``output_dir`` is not trained over unless asked
    (``overwrite_output_dir``: the config's field or ``train``'s argument) or continued (a resume from a
    checkpoint inside ``output_dir``); a second run into the same ``output_dir`` is refused (``run_lock``:
    locked from ``train()`` until ``end()``, until ``train()`` raises, or until the process exits, so
    ``save_model`` after ``train`` is covered and the resume that a ``HealthStop`` invites may come from
    another process); a checkpoint of another architecture is refused before its weights load; a full disk
    while a checkpoint is written is a ``DiskFullError`` naming the file and the last complete checkpoint;
    a save into an existing ``checkpoint-N`` that is cut short leaves it incomplete; a health stop's
    checkpoint is a full one and deletes no earlier checkpoint; ``save_total_limit`` deletes only this run's
    checkpoints, when a checkpoint is saved and at the end of training (never an earlier run's in the same
    ``output_dir``); a push to the Hub during training uploads the template fingerprint with the weights.
    Overrides ``train``, ``end``, ``_load_from_checkpoint``, ``_save_checkpoint``, ``_finalize_training`` and
    ``_push_from_checkpoint``; each trainer gives ``_save_fingerprint``. Sets ``args.save_total_limit`` to None
    within transformers' ``_save_checkpoint`` (its rotation deletes nothing; this run's checkpoints are rotated
    after it) and shadows ``transformers.trainer.sort_checkpoints`` within ``_finalize_training``
    (``_intercept.inject_end_checkpoints``: its cleanup lists this run's checkpoints only)."""

    _resume_kind = "grpo"

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, *, overwrite_output_dir=None):
        """TRL's ``train``, after the ``output_dir`` lock and the resume checks; a finished run in ``output_dir``
        (final weights and ``trainer_state.json`` at its root) is refused unless resuming it (a checkpoint
        inside ``output_dir``: ``checkpoints.resumes_inside``) or overwriting (``overwrite_output_dir``: this
        argument, else the config's field). The first ``train()`` given ``args.resume_from_checkpoint``
        resumes from the checkpoint the preflight checked and resolved before the weights loaded, not checked
        again; any other value, and any later ``train()`` (a run since may have written newer checkpoints), is
        resolved and checked here. When TRL's ``train`` raises (a ``HealthStop``, a full disk, Ctrl-C), the
        lock is released: the run is over, and its resume may come from another process. In a distributed
        process it first registers ``settle_collectives_at_exit``. Before TRL's ``train`` it adds the
        ``checkpoints.run_lock.GrpotrlRun`` callback (once): every checkpoint records its run's id and how many
        processes saved it, so that ``resume_from_checkpoint: true`` never takes an overwritten run's checkpoint."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            settle_collectives_at_exit()
        # before anything is written; a no-op when this process holds it already (the CLI took it)
        took = lock_output_dir(self.args.output_dir, self.accelerator.process_index, self.accelerator.num_processes)
        if overwrite_output_dir is None:
            overwrite_output_dir = getattr(self.args, "overwrite_output_dir", False)  # a trl config may lack it
        try:
            done = self._checked_resume  # the preflight's ResumeCheck, before the weights loaded
            self._checked_resume = done._replace(given=None, checkpoint=None)  # resolved then: for this call only
            if resume_requested(done.given) and resume_from_checkpoint == done.given:
                resume_from_checkpoint = done.checkpoint  # checked then: not again
            elif resume_requested(resume_from_checkpoint):  # another value: checked as the preflight checked its own
                use_peft = hasattr(self.accelerator.unwrap_model(self.model), "peft_config")
                resume_from_checkpoint = check_resume(
                    self.args, done.kind, _intercept.read_tokenizer(self) or self.processing_class, use_peft,
                    done.chat_template_kwargs, given=resume_from_checkpoint, tool_sets=done.tool_sets).checkpoint
            else:
                resume_from_checkpoint = None
            if not overwrite_output_dir:  # before the first checkpoint replaces its log and model
                check_finished_run(self.args.output_dir, resume=resume_from_checkpoint)
        except InputError:
            if took:  # refused before anything was written: output_dir is left as it was found
                release_output_dir(self.args.output_dir)
            raise
        add_run_record(self)  # which run each checkpoint belongs to, and how many processes saved it
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)
        except BaseException:
            release_output_dir(self.args.output_dir)
            raise

    def end(self):
        """transformers' ``end`` (trackers finished, process group destroyed), then the ``output_dir`` lock
        released: the run, with the ``save_model`` / ``save_state`` / ``push_to_hub`` before it, is over."""
        try:
            super().end()
        finally:
            release_output_dir(self.args.output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """TRL's, after the checkpoint's config is compared with the model's (the preflight did so before
        the model loaded; ``train(resume_from_checkpoint=other)`` gets it here, still before the
        checkpoint's weights load), keeping the trainable parameters' dtypes."""
        model = model if model is not None else self.model
        unwrapped = self.accelerator.unwrap_model(model)
        peft_config = (getattr(unwrapped, "peft_config", None) or {}).get("default")
        check_resume_architecture(resume_from_checkpoint, unwrapped.config,
                                  getattr(unwrapped.config, "_name_or_path", None), peft_config)
        with trainable_dtypes_kept(model):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _save_checkpoint(self, model, trial):
        """TRL's, with a full disk turned into ``DiskFullError`` (``checkpoints.disk_full_named``: the file,
        the last complete checkpoint) instead of torch's "unexpected pos"; the incomplete
        ``checkpoint-N`` is left as it is, and a resume refuses it. A ``checkpoint-N`` that exists already (a
        run resumed from an earlier checkpoint reaches step N again) first loses what marks it complete
        (``_unmark_complete``), so that a save cut short leaves it incomplete, never the new weights beside
        the old optimizer and RNG state. While a health rule stops the run, the save uses
        ``health.callbacks.stop_save_settings``: it deletes no earlier checkpoint and is a full one.
        ``save_total_limit`` deletes only this run's older checkpoints, never the one just saved nor an earlier
        run's (``checkpoints.rotate_run_checkpoints``), where transformers' rotation deletes every older
        ``checkpoint-N`` in ``output_dir``."""
        step = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        directory = os.path.join(self.args.output_dir, step)
        with self.disk_full_named(directory, f"the checkpoint of step {self.state.global_step}"), \
                _fields_set(self.args, stop_save_settings(self)):
            if self.args.should_save:
                _unmark_complete(directory, weights_only=self.args.save_only_model)
            limit = self.args.save_total_limit
            with _fields_set(self.args, {"save_total_limit": None}):  # rotated below, this run's checkpoints only
                super()._save_checkpoint(model, trial)
            if self.args.should_save:
                run_dir = self._get_output_dir(trial)
                rotate_run_checkpoints(run_dir, os.path.join(run_dir, step), limit, self.state.best_model_checkpoint)

    def _finalize_training(self, trial, num_train_samples, start_time):
        """Transformers' (metrics logged, the best model loaded, ``on_train_end``), with its end-of-training
        cleanup restricted to this run's checkpoints. Under ``save_total_limit: 1`` with a best checkpoint tracked
        (``metric_for_best_model``, which ``load_best_model_at_end`` sets by default) transformers deletes every
        ``checkpoint-N`` in ``output_dir`` but the best, an earlier run's included; here it deletes this run's
        other than the best (those it saved and those it resumed: ``checkpoints.current_run_checkpoints``), and
        an earlier run's stay where they are. The list it deletes from is chosen
        (``_intercept.inject_end_checkpoints``); ``args.save_total_limit`` keeps the user's value throughout, for
        the callbacks that read it."""
        def this_runs(output_dir, listed):
            return current_run_checkpoints(output_dir, listed, "the end of training's checkpoint cleanup")

        with _intercept.inject_end_checkpoints(this_runs):
            return super()._finalize_training(trial, num_train_samples, start_time)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Transformers': copies a checkpoint's weights, config and tokenizer to ``output_dir`` and uploads that
        folder to the Hub (``push_to_hub`` with ``hub_strategy`` other than "end"); the template fingerprint is
        written there first (``_save_fingerprint``), or the Hub repo (and ``output_dir``) would hold the weights
        without it and a run trained from them could not check I2."""
        if self.is_world_process_zero() and self.args.hub_strategy != "end":
            self._save_fingerprint(self.args.output_dir)
        super()._push_from_checkpoint(checkpoint_folder)

    def _save_fingerprint(self, output_dir: str) -> None:
        """The chat-template fingerprint (``grpotrl_template.json``) of this run's tokenizer into ``output_dir``:
        each trainer's own (what its data was rendered with)."""
        raise NotImplementedError

    def disk_full_named(self, directory: str, what: str, in_checkpoint: bool = False):
        """``checkpoints.disk_full_named`` for a write of this trainer into ``directory``; nothing when
        ``in_checkpoint`` (``save_model(_internal_call=True)``: ``_save_checkpoint`` names the checkpoint)."""
        if in_checkpoint:
            return nullcontext()
        return disk_full_named(directory, self.args.output_dir, what, resume_files(self.args, self._resume_kind))


# what the Trainer (and TRL) write last into a checkpoint, in order: their presence marks it complete
COMPLETION_MARKS = ("trainer_state.json", "entropy_ctrl_state.json")
# what a weights-only save (save_only_model) does not write
STATE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt")


def _unmark_complete(directory: str, weights_only: bool) -> None:
    """Before a save into ``directory``: remove the files that mark an existing checkpoint complete
    (``COMPLETION_MARKS``: ``trainer_state.json``, which ``checkpoints.checkpoint_problems`` requires and
    the Trainer writes last, and TRL's ``entropy_ctrl_state.json`` after it), so that until the save
    writes them again the checkpoint counts as incomplete; for a weights-only save also the optimizer,
    scheduler, scaler and RNG files it will not rewrite (left, they would sit beside other weights).
    Nothing when ``directory`` does not exist. Run by the processes that write ``trainer_state.json``
    (``args.should_save``), before any of their own writes."""
    if not os.path.isdir(directory):
        return
    names = list(COMPLETION_MARKS)
    if weights_only:
        names += [*STATE_FILES, *(n for n in os.listdir(directory) if n.startswith("rng_state") and n.endswith(".pth"))]
    for name in names:
        try:
            os.remove(os.path.join(directory, name))
        except FileNotFoundError:  # never written, or another node's process removed it first
            pass


@contextmanager
def _fields_set(args, fields: dict):
    """``args``'s ``fields`` set to the given values for the block, restored after it, however it ends."""
    before = {name: getattr(args, name) for name in fields}
    try:
        for name, value in fields.items():
            setattr(args, name, value)
        yield
    finally:
        for name, value in before.items():
            setattr(args, name, value)
