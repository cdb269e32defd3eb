"""Checks the trainers and the CLI run before TRL loads anything (bad input stops before compute),
plus the two things quantized (QLoRA) models need and the resume checkpoint's requirements.

* ``prepare_model_and_tokenizer``: model path, tokenizer, stop tokens, dataset; a quantized model
  without LoRA is refused, and bitsandbytes' CPU kernels are pinned (``pin_quantized_kernels``).
  ``trainable_dtypes_kept``: a resumed QLoRA adapter keeps the dtype TRL gave it.
* ``check_model_args``: a recipe's quantization / LoRA fields (``trl.ModelConfig``) before the
  weights are read: 4/8-bit needs ``use_peft``, a compute dtype, and LoRA target modules that exist.
* ``resume_checkpoint``: ``resume_from_checkpoint`` (a path, or true for the newest
  ``checkpoint-N``) checked to hold everything this trainer saves, or an ``InputError``; a
  warning when the step falls inside one of TRL's generation batches (no exact resume then).
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
import math
import os
import re
import sys
from contextlib import contextmanager

from .. import templates
from ..errors import InputError

logger = logging.getLogger(__name__)


def _is_conversational(dataset) -> bool:
    if dataset is None or not hasattr(dataset, "column_names"):
        return True
    try:
        row = next(iter(dataset))
    except StopIteration:
        return True
    value = row.get("prompt", row.get("messages"))
    return isinstance(value, list)


_NOT_GIVEN = object()


def prepare_model_and_tokenizer(model, processing_class, args, train_dataset, kind: str, peft_config=_NOT_GIVEN,
                                prompt_optional: bool = False):
    """Resolve aliases and validate model, tokenizer, stop tokens and dataset before any weights load.

    ``model`` is a local directory, a Hugging Face Hub id (``args.model_init_kwargs["revision"]``
    honoured, as TRL does) or a loaded model. Returns ``(model, processing_class, stop_token_ids,
    model_id)``: ``model`` is the resolved name when it was given as a string (an alias becomes its
    cached directory), ``model_id`` the directory or Hub id its files come from (or None). A tokenizer
    not given is loaded exactly as TRL's trainer would load it (``AutoProcessor``; GRPO pads and
    truncates on the left). When the trainer passes its ``peft_config`` (None included), a loaded
    quantized model must come with one or be a PEFT model already. Bitsandbytes layers are pinned to
    one kernel (``pin_quantized_kernels``). ``prompt_optional``: rows may lack ``prompt`` (an
    ``environment_factory``'s ``reset`` supplies it).
    """
    from transformers import AutoProcessor
    from trl.trainer.utils import get_config_model_id

    from ..hub import check_model_source, generation_config
    from ..models import resolve_model_path
    from ..validation import check_dataset, check_output_dir, check_ranges, check_tokenizer_files

    check_ranges(args)  # grpotrl's configs did at construction; TRL's and their subclasses did not
    check_output_dir(args.output_dir, overwrite=True)  # only a file where output_dir should be (the rest: train())
    if train_dataset is not None:
        check_dataset(train_dataset, "train", kind=kind, prompt_optional=prompt_optional)
    revision = None
    if isinstance(model, str):
        model = resolve_model_path(model)
        revision = (getattr(args, "model_init_kwargs", None) or {}).get("revision")
        check_model_source(model, revision)
        model_id = model
        gen_config = generation_config(model, revision)
    else:
        model_id = get_config_model_id(model.config) or None
        gen_config = getattr(model, "generation_config", None)
        bits = quantized_bits(model)
        if bits and peft_config is None and not hasattr(model, "peft_config"):  # _NOT_GIVEN: not checked
            raise InputError(
                f"The model is loaded in {bits}-bit (bitsandbytes) and no peft_config was given, so the trainer "
                f"would fully fine-tune a quantized model, whose {bits}-bit weights cannot take an update. Pass "
                "`peft_config=peft.LoraConfig(...)` (QLoRA: LoRA adapters on the frozen quantized base; from a "
                "recipe: `use_peft: true`), or load the model without quantization_config."
            )
        pin_quantized_kernels(model)
    if processing_class is None:
        if model_id is None:
            raise InputError("The model has no name or path to load its tokenizer from: pass `processing_class`.")
        check_tokenizer_files(model_id)  # not transformers' "install sentencepiece or tiktoken"
        sides = {"truncation_side": "left", "padding_side": "left"} if kind == "grpo" else {}
        processing_class = AutoProcessor.from_pretrained(model_id, revision=revision,
                                                         trust_remote_code=args.trust_remote_code, **sides)
    if train_dataset is not None and _is_conversational(train_dataset):  # SFT passes None: it checks its own
        templates.require_chat_template(processing_class)
    stop_ids = templates.stop_token_ids(processing_class, gen_config)
    if kind == "grpo" and train_dataset is not None:  # prompts the model's context cannot hold (config only)
        from ..preflight_data import check_prompt_lengths

        check_prompt_lengths(train_dataset, "train", getattr(processing_class, "tokenizer", processing_class),
                             model_id, revision, getattr(args, "max_completion_length", None),
                             **(getattr(args, "chat_template_kwargs", None) or {}))
    return model, processing_class, stop_ids, model_id


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


def check_model_args(model_args, model_path: str) -> None:
    """A recipe's quantization and LoRA fields (``trl.ModelConfig``), before any weights are read."""
    bits = 4 if model_args.load_in_4bit else 8 if model_args.load_in_8bit else None
    if bits:
        flag = f"load_in_{bits}bit"
        if not model_args.use_peft:
            raise InputError(
                f"{flag}: true without use_peft: true would fully fine-tune a {bits}-bit quantized model, whose "
                f"weights cannot take an update. Add `use_peft: true` (QLoRA: LoRA adapters on the frozen "
                f"quantized base; see recipes/smollm2/grpo_qlora.yaml), or drop {flag} to train every weight."
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise InputError(f"{flag} needs the bitsandbytes package: `pip install bitsandbytes`.")
        if bits == 4 and model_args.dtype not in ("float32", "bfloat16", "float16"):
            raise InputError(
                f"load_in_4bit computes in `dtype`, which is {model_args.dtype!r}. Set dtype: float32 (CPU; the "
                "I5 guard's 1e-5 tolerance holds) or bfloat16 (GPU)."
            )
    if model_args.use_peft and model_args.lora_target_modules:
        _check_lora_targets(model_args.lora_target_modules, model_path, model_args.model_revision)


def _check_lora_targets(targets: list[str] | str, model_path: str, revision: str | None = None) -> None:
    """Every name in ``lora_target_modules`` must name modules of the model (PEFT ignores a
    misspelled one as long as another matches). Builds the model on the meta device: no weights."""
    if isinstance(targets, str) or targets == ["all-linear"]:  # a regex, or PEFT's keyword
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:  # an adapter dir or a remote-code model: PEFT checks at load time instead
        config = AutoConfig.from_pretrained(model_path, revision=revision)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError):
        return
    leaves = {name.rsplit(".", 1)[-1] for name, module in skeleton.named_modules()
              if isinstance(module, torch.nn.Linear)}
    names = {name for name, _ in skeleton.named_modules()}
    missing = [t for t in targets if t not in leaves and not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        hints = [f"{t!r} (did you mean {difflib.get_close_matches(t, sorted(leaves), n=1)[0]!r}?)"
                 if difflib.get_close_matches(t, sorted(leaves), n=1) else repr(t) for t in missing]
        raise InputError(
            f"lora_target_modules names no module of {config.model_type} ({model_path}): {', '.join(hints)}. "
            f"Its linear layers are {sorted(leaves)}; use some of those, or 'all-linear'."
        )


# ---------------------------------------------------------------------------------------------
# Resume
# ---------------------------------------------------------------------------------------------

def resume_files(args, kind: str) -> tuple[str, ...]:
    """Files a checkpoint of this trainer holds beyond the Trainer's own: the template fingerprint
    (I2), TRL's adaptive-entropy controller, the GAD discriminator and its optimizer."""
    files = [templates.FINGERPRINT_FILE] if getattr(args, "check_template", True) else []
    if getattr(args, "use_adaptive_entropy", False):
        files.append("entropy_ctrl_state.json")  # TRL writes it after trainer_state.json, and skips it if absent
    if kind == "gad":
        from .gad_engine import checkpoint_files

        files += checkpoint_files(deepspeed=sharded_launch(args) == "DeepSpeed")
    return tuple(files)


def resume_checkpoint(checkpoint, args, kind: str, use_peft: bool | None = None) -> str | None:
    """``resume_from_checkpoint`` as a checked path: True (or "true"/"last") is the newest
    ``checkpoint-N`` in ``output_dir``; None/False is no resume. An incomplete checkpoint is an
    ``InputError`` naming it and the newest complete one; nothing is deleted. With ``use_peft``
    given, a LoRA checkpoint needs a LoRA run and a full one a full run."""
    from ..validation import check_resume_checkpoint, find_last_checkpoint

    if checkpoint in (None, False, "", "false", "False"):
        return None
    required = resume_files(args, kind)
    if checkpoint in (True, "true", "True", "last"):
        checkpoint = find_last_checkpoint(args.output_dir, required)
    else:
        check_resume_checkpoint(checkpoint, required)
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


class CheckedResume:
    """Mixin of grpotrl's trainers (before the TRL class): ``train(resume_from_checkpoint=...)``
    from Python gets the CLI's checks (a complete checkpoint with everything this trainer saves,
    LoRA vs full weights, the template fingerprint, I2), and a resumed QLoRA adapter keeps the
    dtype TRL gave it; a finished run in ``output_dir`` is not trained over unless asked
    (``train(overwrite_output_dir=True)``). Overrides ``train`` and ``_load_from_checkpoint``."""

    _resume_kind = "grpo"

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, *, overwrite_output_dir=False):
        """TRL's ``train``, after the resume checks; a finished run in ``output_dir`` (final weights and
        ``trainer_state.json`` at its root) is refused unless resuming or ``overwrite_output_dir=True``."""
        from ..validation import check_finished_run

        if resume_from_checkpoint in (None, False) and not overwrite_output_dir:
            check_finished_run(self.args.output_dir)  # before the first checkpoint replaces its log and model
        if resume_from_checkpoint not in (None, False):
            use_peft = hasattr(self.accelerator.unwrap_model(self.model), "peft_config")
            resume_from_checkpoint = resume_checkpoint(resume_from_checkpoint, self.args, self._resume_kind, use_peft)
            if resume_from_checkpoint and getattr(self.args, "check_template", True):
                templates.check_fingerprint(resume_from_checkpoint, getattr(self, "_tokenizer", None)
                                            or self.processing_class)
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        with trainable_dtypes_kept(model if model is not None else self.model):
            super()._load_from_checkpoint(resume_from_checkpoint, model)


def sharded_launch(args) -> str | None:
    """"DeepSpeed" or "FSDP" when this run is set up for it, by the training arguments or by
    ``accelerate launch`` (its environment), known before anything loads; else None."""
    from accelerate.utils import parse_flag_from_env

    if args.deepspeed or parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        return "DeepSpeed"
    if args.fsdp or parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return "FSDP"
    return None
