"""The model and its settings, checked once before any weights load (config files and headers only).

* ``check_ranges``: every numeric setting of a TRL or grpotrl config within what its field can
  mean (a wrong sign, ``entropy_coef < 0`` for I7 among them, a zero, a NaN), before TRL's own
  ``__post_init__`` divides by any of them.
* ``check_grpotrl_fields``: grpotrl's own GRPO fields (health rules, sampler gap, CAGrad, the
  adaptive entropy range I7, sampling settings grpotrl would otherwise drop, I6); run by the configs.
* ``check_model_dir``: a local checkpoint with ``config.json`` and complete weights (every shard
  of a sharded one; safetensors files not truncated), or a PEFT adapter dir whose base model
  passes the same check (Hub ids: ``grpotrl.hub.check_model_source``).
* ``check_tokenizer_files``: a local model dir holds a tokenizer vocabulary.
* ``check_discriminator_source``: GAD's ``discriminator_model_name_or_path``.
* ``check_model_args``: a recipe's quantization / LoRA fields (``trl.ModelConfig``; the CLI's):
  4/8-bit needs ``use_peft``, a compute dtype, and LoRA target modules that exist.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import os

from .checkpoints import _files, _weights_problem
from .errors import InputError


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# field -> (test of a value that is set, what it must be); None always passes (TRL's "not set")
RANGES = {
    "learning_rate": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
    "beta": (lambda v: _real(v) and v >= 0, "a finite number >= 0 (a negative KL coefficient rewards leaving the "
             "reference)"),
    "epsilon": (lambda v: _real(v) and v > 0, "a finite number > 0 (the lower clip of the ratio)"),
    "epsilon_high": (lambda v: _real(v) and v > 0, "a finite number > 0 (the upper clip of the ratio)"),
    "temperature": (lambda v: _real(v) and v > 0, "a finite number > 0: the logprobs are log_softmax(logits / T), "
                    "and greedy decoding (T = 0) would give every completion of a group the same text, hence zero "
                    "advantages; for nearly greedy sampling use a small T such as 0.1"),
    "top_p": (lambda v: _real(v) and 0 < v <= 1, "in (0, 1]"),
    "min_p": (lambda v: _real(v) and 0 <= v <= 1, "in [0, 1]"),
    "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0 (0: off)"),
    "repetition_penalty": (lambda v: _real(v) and v > 0, "a finite number > 0 (1.0: off)"),
    "presence_penalty": (_real, "a finite number"),
    "frequency_penalty": (_real, "a finite number"),
    "entropy_coef": (lambda v: _real(v) and v >= 0, "a finite number >= 0: the loss is policy + beta*KL - c*H with "
                     "c >= 0 encouraging exploration (INVARIANT I7); 0 for no bonus"),
    "weight_decay": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
    "max_grad_norm": (lambda v: _real(v) and v >= 0, "a finite number >= 0 (0: no clipping)"),
    "warmup_ratio": (lambda v: _real(v) and 0 <= v <= 1, "in [0, 1]"),
    "num_train_epochs": (lambda v: _real(v) and v > 0, "a finite number > 0"),
    "num_generations": (lambda v: _int(v) and v >= 2, "an integer >= 2 (GRPO normalises rewards within a group)"),
    "num_iterations": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "steps_per_generation": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "per_device_train_batch_size": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "per_device_eval_batch_size": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "gradient_accumulation_steps": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "max_steps": (lambda v: _int(v) and (v > 0 or v == -1), "an integer > 0 (or -1: by num_train_epochs)"),
    "max_completion_length": (lambda v: _int(v) and v >= 1, "an integer >= 1 (new tokens per completion)"),
    "max_prompt_length": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "max_length": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "min_new_tokens": (lambda v: _int(v) and v >= 0, "an integer >= 0"),
    "guard_steps": (lambda v: _int(v) and v >= -1, "an integer: -1 every step, 0 off, N the first N steps"),
    "guard_logprob_atol": (lambda v: _real(v) and v > 0, "a finite number > 0"),
    "discriminator_learning_rate": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
    "kl_in_reward_coef": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
}


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_ranges(args) -> None:
    """Raise ``InputError`` for the first numeric setting of ``args`` (any TRL or grpotrl config) that is
    set to something its field cannot mean: a wrong sign, a zero, a NaN, a list. Runs on the config,
    before any weights load, and before TRL's own __post_init__ divides by any of them."""
    for name, (ok, what) in RANGES.items():
        value = getattr(args, name, None)
        if value is not None and not ok(value):
            raise InputError(f"{name}={value!r} ({type(value).__name__}): it must be {what}. Fix it in the recipe, "
                             "on the command line or in the config.")


def _adopt_generation_kwarg(args, kwargs: dict, name: str, why: str) -> None:
    """``generation_kwargs[name]``, where given, becomes ``args.<name>``: checked against ``RANGES``
    first, refused where the field is set to another value than its default 1.0 (``temperature=0.7``
    with ``generation_kwargs={"temperature": 1.0}`` too: TRL would sample at 1.0)."""
    if name not in kwargs:
        return
    given, field = kwargs[name], getattr(args, name)
    ok, what = RANGES[name]
    if not ok(given):
        raise InputError(f"generation_kwargs['{name}']={given!r}: it must be {what}.")
    if field not in (1.0, given):  # 1.0: the default of both fields
        raise InputError(f"{name}={field} and generation_kwargs['{name}']={given} disagree ({why}): "
                         f"set it once, as {name}.")
    setattr(args, name, given)


def check_grpotrl_fields(args) -> None:
    """grpotrl's own checks of a GRPO config (also run on a ``trl.GRPOConfig`` that
    ``complete_grpo_config`` completed): each bad value is an ``InputError`` saying what to use."""
    from .configs import HEALTH_ACTIONS, HEALTH_RULES

    actions = args.health_rule_actions or {}
    if args.health_action not in ("auto", *HEALTH_ACTIONS):
        raise InputError(f"health_action={args.health_action!r}: use 'auto', 'stop', 'warn' or 'off'.")
    if not isinstance(actions, dict) or any(k not in HEALTH_RULES or v not in HEALTH_ACTIONS
                                            for k, v in actions.items()):
        raise InputError(f"health_rule_actions={actions!r}: map rule names {list(HEALTH_RULES)} to one of "
                         f"{list(HEALTH_ACTIONS)}, e.g. {{'entropy_collapse': 'stop'}}.")
    if args.sampler_gap_action not in ("warn", "stop", "off"):
        raise InputError(f"sampler_gap_action={args.sampler_gap_action!r}: use 'warn', 'stop' or 'off'.")
    if not (isinstance(args.sampler_gap_threshold, (int, float)) and args.sampler_gap_threshold > 0
            and math.isfinite(args.sampler_gap_threshold)):
        raise InputError(f"sampler_gap_threshold={args.sampler_gap_threshold!r}: use a finite number of nats > 0 "
                         "(e.g. 0.1), or sampler_gap_action='off'.")
    if args.cagrad not in ("off", "exact", "low_memory"):
        raise InputError(f"cagrad={args.cagrad!r}: use 'off', 'exact' or 'low_memory'.")
    if not 0.0 <= args.cagrad_c < 10:
        raise InputError(f"cagrad_c={args.cagrad_c}: use a value in [0, 10) (typical 0.4-0.5; 0 = mean gradient).")
    _check_generation_settings(args)
    if args.use_adaptive_entropy and not 0 <= args.entropy_coef_min <= args.entropy_coef_max:
        raise InputError(f"entropy_coef_min={args.entropy_coef_min}, entropy_coef_max={args.entropy_coef_max}: "
                         "TRL's adaptive controller moves the entropy bonus coefficient between them, and c < 0 "
                         "would minimise entropy (INVARIANT I7). Use 0 <= entropy_coef_min <= entropy_coef_max.")


def _check_generation_settings(args) -> None:
    """Sampling settings grpotrl would otherwise drop or contradict without a word: each is honoured
    or refused.

    TRL lets ``generation_kwargs`` override the sampling fields. Two of them grpotrl reads elsewhere,
    so a value given there becomes the field (checked like the field), and a different value in both
    places is refused: ``repetition_penalty``, applied response-only like the field (I6; on the
    transformers path grpotrl replaces transformers' own, which counts the prompt), and
    ``temperature``, at which the logprobs are computed (I5: TRL computes them at the field's
    temperature, so ``generation_kwargs={"temperature": 0.7}`` alone sampled at 0.7 and trained on
    logprobs at 1.0). Continuous batching runs transformers' own sampler, which takes no logits
    processors: the response-only penalties and ``min_new_tokens`` cannot be applied there."""
    kwargs = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
    _adopt_generation_kwarg(args, kwargs, "repetition_penalty", "I6: the penalty counts response tokens only")
    _adopt_generation_kwarg(args, kwargs, "temperature", "I5: completions would be sampled at one temperature "
                            "and their logprobs computed at the other")
    if args.use_transformers_continuous_batching:
        unsupported = {name: value for name, value in (
            ("presence_penalty", args.presence_penalty), ("frequency_penalty", args.frequency_penalty),
            ("repetition_penalty", args.repetition_penalty if args.repetition_penalty != 1.0 else None),
            ("min_new_tokens", args.min_new_tokens or kwargs.get("min_new_tokens"))) if value}
        if unsupported:
            raise InputError(
                f"{', '.join(f'{k}={v}' for k, v in unsupported.items())} with use_transformers_continuous_batching: "
                "continuous batching samples with transformers' own batch scheduler, which takes none of grpotrl's "
                "logits processors, so these would be silently dropped (a repetition penalty there would also count "
                "the prompt, INVARIANT I6). Use the transformers generate path (use_transformers_continuous_batching: "
                "false) or vLLM, or leave these settings at their defaults.")


# ---------------------------------------------------------------------------------------------
# Model directories and tokenizer files
# ---------------------------------------------------------------------------------------------

def check_model_dir(path: str | None) -> None:
    """Raise ``InputError`` unless ``path`` is a local, complete checkpoint (or PEFT adapter) dir."""
    if not path:
        raise InputError("No model given. Set `model_name_or_path` in the recipe (or pass --model_name_or_path "
                         "DIR): a local checkpoint directory or the alias 'smollm2-135m-instruct'.")
    directory = os.path.expanduser(path)
    if os.path.isdir(directory):
        if os.path.isfile(os.path.join(directory, "adapter_config.json")):
            problem = _weights_problem(directory, "adapter")
            if problem:
                raise InputError(f"PEFT adapter dir {path!r} has incomplete weights: {problem} (found: "
                                 f"{_files(directory)}). Copy the adapter again or pick another checkpoint.")
            with open(os.path.join(directory, "adapter_config.json")) as f:
                base = json.load(f).get("base_model_name_or_path")
            from .hub import check_model_source
            from .models import resolve_model_path

            try:
                check_model_source(resolve_model_path(base) if base else base)
            except InputError as err:
                raise InputError(f"The base model of PEFT adapter {path!r} is not usable: {err}") from None
            return
        if not os.path.isfile(os.path.join(directory, "config.json")):
            raise InputError(
                f"Model dir {path!r} has no config.json (found: {_files(directory)}). Point "
                "`model_name_or_path` at the directory that holds config.json and the weights (for a training "
                "run, its output_dir or one of its checkpoint-N dirs)."
            )
        problem = _weights_problem(directory, "model")
        if problem:
            raise InputError(
                f"Model dir {path!r} has incomplete weights: {problem} (found: {_files(directory)}). The save or "
                "copy that made it did not finish: save or copy it again, or pick another checkpoint."
            )
        return
    if os.path.exists(directory):
        raise InputError(f"Model path {path!r} is a file; `model_name_or_path` must be a directory holding "
                         "config.json and the weights, or a Hugging Face Hub id.")
    from .models import ALIASES

    aliases = ", ".join(repr(a) for a in ALIASES)
    raise InputError(
        f"Model dir {path!r} does not exist (absolute: {os.path.abspath(directory)}). If it is the output of "
        "an earlier run (the GRPO quickstart starts from the SFT quickstart's output), run that first, from the "
        f"directory the path is relative to; otherwise fix the path. Known aliases: {aliases}; a Hugging Face "
        "Hub id (org/name) is loaded from the Hub."
    )


def check_discriminator_source(path: str) -> None:
    """GAD's ``discriminator_model_name_or_path``: a model dir, alias or Hub id (cached when offline)."""
    from .hub import check_model_source
    from .models import resolve_model_path

    try:
        check_model_source(resolve_model_path(path), what="Discriminator model")
    except InputError as err:
        raise InputError(f"discriminator_model_name_or_path {path!r}: {err}") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.tiktoken")


def check_tokenizer_files(path: str) -> None:
    """Raise ``InputError`` when the local model dir ``path`` holds no tokenizer vocabulary (a
    checkpoint saved without its tokenizer); transformers would say to install sentencepiece or
    tiktoken instead. Hub ids and PEFT adapter dirs pass (their files come from elsewhere)."""
    directory = os.path.expanduser(path)
    if not os.path.isdir(directory) or os.path.isfile(os.path.join(directory, "adapter_config.json")):
        return
    names = os.listdir(directory)
    if any(n in TOKENIZER_FILES or n.endswith((".tiktoken", ".model")) for n in names):
        return
    raise InputError(
        f"Model dir {path!r} has no tokenizer files (none of {list(TOKENIZER_FILES)}; found: {_files(directory)}): "
        "it was saved without its tokenizer. Save the tokenizer of the model it was trained from into it "
        "(`AutoTokenizer.from_pretrained(base).save_pretrained(dir)`), or from Python pass processing_class=."
    )


# ---------------------------------------------------------------------------------------------
# A recipe's quantization and LoRA settings
# ---------------------------------------------------------------------------------------------

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
    if model_args.use_peft and model_args.lora_target_modules and model_path:  # no path: the preflight says so
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
