"""What grpotrl's trainers share beyond the preflight (``grpotrl/preflight.py``): the two things
quantized (QLoRA) models need, the checked resume, and how the run is sharded.

* ``pin_quantized_kernels``: bitsandbytes' CPU kernels compute the same function in train and
  eval mode; ``trainable_dtypes_kept``: a resumed QLoRA adapter keeps the dtype TRL gave it.
* ``CheckedResume``: ``train(resume_from_checkpoint=...)`` checked (``checkpoints.resume_checkpoint``)
  unless the preflight already checked that checkpoint; a finished run is not trained over; the
  ``output_dir`` is locked against a second run from ``train()`` to ``end()`` (``run_lock``); a full
  disk while saving is one clear error (``checkpoints.disk_full_named``).
* ``sharded_launch``: DeepSpeed or FSDP, known before anything loads.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager, nullcontext

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..checkpoints import check_finished_run, check_resume_architecture, resume_requested
from ..errors import InputError
from ..run_lock import lock_output_dir, release_output_dir

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Quantized models (QLoRA)
# ---------------------------------------------------------------------------------------------

def quantized_bits(model) -> int | None:
    """4 or 8 when ``model`` was loaded through bitsandbytes, else None."""
    return 4 if getattr(model, "is_loaded_in_4bit", False) else 8 if getattr(model, "is_loaded_in_8bit", False) \
        else None


def _training_kernel(module, args):
    """Forward pre-hook of a bitsandbytes ``Linear8bitLt``: it reads ``self.training`` only to pick
    its matmul, so eval forwards use the training kernel too."""
    module.training = True


def pin_quantized_kernels(model) -> int:
    """Make bitsandbytes compute the same function in train and eval mode; returns the layers pinned.

    On CPU, bitsandbytes 0.50 picks its kernel by mode. A ``Linear4bit`` that sees an eval-mode,
    no-grad forward on an AVX512-BF16 CPU repacks its weights for a bf16 kernel for good: that
    forward differs from the training one (0.34 nats per token on SmolLM2), and every later
    training forward runs a kernel without autograd, so no gradient reaches any LoRA weight
    (measured: 0 of 120 LoRA tensors get one) while training runs on. The I5 guard's eval-mode
    recomputation is such a forward, and so is evaluation. A ``Linear8bitLt`` runs int8 matmuls
    with fp16 inputs in eval mode and dequantizes in training mode (1.2 nats apart). Pinned: 4-bit
    layers never repack, 8-bit layers always take their training kernel (the repacking is CPU-only;
    on CUDA the 8-bit layers run the same matmul in both modes). Idempotent.
    """
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:  # nothing quantized by bitsandbytes can exist
        return 0
    pinned = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            pinned += 1
        elif isinstance(module, bnb.nn.Linear8bitLt) and not getattr(module, "_grpotrl_pinned", False):
            module.register_forward_pre_hook(_training_kernel)
            module._grpotrl_pinned = True
            pinned += 1
    return pinned


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
    (``overwrite_output_dir``: the config's field or ``train``'s argument); a second run into the
    same ``output_dir`` is refused (``run_lock``: locked from ``train()`` until ``end()`` or the process
    exits, so ``save_model`` after ``train`` is covered); a checkpoint of another architecture is
    refused before its weights load; a full disk while a checkpoint is written is a ``DiskFullError``
    naming the file and the last complete checkpoint. Overrides ``train``, ``end``,
    ``_load_from_checkpoint`` and ``_save_checkpoint``."""

    _resume_kind = "grpo"

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, *, overwrite_output_dir=None):
        """TRL's ``train``, after the ``output_dir`` lock and the resume checks; a finished run in ``output_dir``
        (final weights and ``trainer_state.json`` at its root) is refused unless resuming or overwriting
        (``overwrite_output_dir``: this argument, else the config's field).
        ``args.resume_from_checkpoint`` was checked by the preflight, before the weights loaded: passed
        here, it is resumed from as checked, not checked again."""
        from ..preflight import check_resume

        # before anything is written; a no-op when this process holds it already (the CLI took it)
        took = lock_output_dir(self.args.output_dir, self.accelerator.process_index, self.accelerator.num_processes)
        if overwrite_output_dir is None:
            overwrite_output_dir = getattr(self.args, "overwrite_output_dir", False)  # a trl config may lack it
        try:
            done = self._checked_resume  # the preflight's ResumeCheck, before the weights loaded
            if resume_requested(done.given) and resume_from_checkpoint == done.given:
                resume_from_checkpoint = done.checkpoint  # checked then: not again
            elif resume_requested(resume_from_checkpoint):  # another value: checked as the preflight checked its own
                use_peft = hasattr(self.accelerator.unwrap_model(self.model), "peft_config")
                resume_from_checkpoint = check_resume(
                    self.args, done.kind, getattr(self, "_tokenizer", None) or self.processing_class, use_peft,
                    done.chat_template_kwargs, given=resume_from_checkpoint).checkpoint
            else:
                if not overwrite_output_dir:
                    check_finished_run(self.args.output_dir)  # before the first checkpoint replaces its log and model
                resume_from_checkpoint = None
        except InputError:
            if took:  # refused before anything was written: output_dir is left as it was found
                release_output_dir(self.args.output_dir)
            raise
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)

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
        ``checkpoint-N`` is left as it is, and a resume refuses it."""
        step = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        with self.disk_full_named(os.path.join(self.args.output_dir, step),
                                  f"the checkpoint of step {self.state.global_step}"):
            super()._save_checkpoint(model, trial)

    def disk_full_named(self, directory: str, what: str, in_checkpoint: bool = False):
        """``checkpoints.disk_full_named`` for a write of this trainer into ``directory``; nothing when
        ``in_checkpoint`` (``save_model(_internal_call=True)``: ``_save_checkpoint`` names the checkpoint)."""
        from ..checkpoints import disk_full_named, resume_files

        if in_checkpoint:
            return nullcontext()
        return disk_full_named(directory, self.args.output_dir, what, resume_files(self.args, self._resume_kind))


def sharded_launch(args) -> str | None:
    """"DeepSpeed" or "FSDP" when this run is set up for it, by the training arguments or by
    ``accelerate launch`` (its environment), known before anything loads; else None."""
    from accelerate.utils import parse_flag_from_env

    if args.deepspeed or parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        return "DeepSpeed"
    if args.fsdp or parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return "FSDP"
    return None
