"""The model and its settings, checked once before any weights load (config files only).

* ``check_discriminator_source``: GAD's ``discriminator_model_name_or_path``.
* ``check_model_args``: a recipe's quantization / LoRA fields (``trl.ModelConfig``; the CLI's):
  4/8-bit needs ``use_peft``, a compute dtype, and LoRA target modules that exist; ``lora_*`` settings
  need ``use_peft``, and ``bnb_4bit_*`` / ``use_bnb_nested_quant`` need ``load_in_4bit`` (TRL ignores them
  without it).

A model's source (a complete local dir, or a Hub id) is ``models.sources.check_model_source``, its tokenizer
files ``models.sources.check_tokenizer_source``; a
config's own value ranges are ``configs.checks``.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import re

from ..errors import InputError
from ..models import resolve_model_path
from ..models.sources import check_model_source


# ---------------------------------------------------------------------------------------------
# GAD's discriminator
# ---------------------------------------------------------------------------------------------

def check_discriminator_source(path: str) -> None:
    """GAD's ``discriminator_model_name_or_path``: a model dir, alias or Hub id (cached when offline)."""
    try:
        check_model_source(resolve_model_path(path), what="Discriminator model")
    except InputError as err:
        raise InputError(f"discriminator_model_name_or_path {path!r}: {err}") from None


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
    four_bit = _changed_settings(model_args, ("bnb_4bit_", "use_bnb_nested_quant"))
    if four_bit and bits != 4:
        raise InputError(
            f"{', '.join(f'{k}: {v!r}' for k, v in four_bit.items())} without load_in_4bit: true: TRL reads these "
            f"for 4-bit loading only, so they would be ignored and the model loaded "
            f"{'in 8-bit' if bits == 8 else 'unquantized'}. Add `load_in_4bit: true` (QLoRA, with use_peft: true)"
            f"{' instead of load_in_8bit' if bits == 8 else ''}, or drop these settings."
        )
    lora = _changed_settings(model_args, ("lora_", "use_rslora", "use_dora"))
    if lora and not model_args.use_peft:
        raise InputError(
            f"{', '.join(f'{k}: {v!r}' for k, v in lora.items())} without use_peft: true: TRL builds no adapter then, so "
            "these would be ignored and every weight of the model trained. Add `use_peft: true` to train LoRA "
            "adapters, or drop the lora_* settings to fine-tune the whole model."
        )
    if model_args.use_peft and model_args.lora_target_modules and model_path:  # no path: the preflight says so
        check_lora_targets(model_args.lora_target_modules, model_path, model_args.model_revision)


def _changed_settings(model_args, prefixes: tuple[str, ...]) -> dict:
    """The fields of ``model_args`` (``trl.ModelConfig``) whose names start with one of ``prefixes`` (the LoRA
    ones: ``lora_``, ``use_rslora``, ``use_dora``; the 4-bit ones: ``bnb_4bit_``, ``use_bnb_nested_quant``) set
    to another value than the field's default, by name."""
    return {f.name: getattr(model_args, f.name) for f in dataclasses.fields(model_args)
            if f.name.startswith(prefixes) and f.default is not dataclasses.MISSING
            and getattr(model_args, f.name) != f.default}


def check_lora_targets(targets: list[str] | str, model_path: str, revision: str | None = None,
                       setting: str = "lora_target_modules") -> None:
    """Every name in ``lora_target_modules`` (the setting named ``setting`` in errors) must name modules of the
    model (PEFT ignores a misspelled one as long as another matches); a string (PEFT's regex, full-matched against each module's
    dotted name) must match one. Builds the model on the meta device: no weights."""
    if targets in ("all-linear", ["all-linear"]):  # PEFT's keyword
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
    if isinstance(targets, str):
        try:
            matched = any(re.fullmatch(targets, n) for n in names)
        except re.error as e:
            raise InputError(f"{setting}={targets!r} is read by PEFT as a regular expression, and it is "
                             f"not one ({e}). Give a list of module names, e.g. {sorted(leaves)[:3]}.") from e
        if not matched:
            raise InputError(
                f"{setting}={targets!r} is read by PEFT as a regular expression that must match a "
                f"module's whole dotted name (e.g. {max(names, key=len)!r}), and it matches no module of "
                f"{config.model_type} ({model_path}). Give a list of names (e.g. [{', '.join(sorted(leaves)[:2])}]), "
                "or a pattern such as '.*\\.(q_proj|v_proj)', or 'all-linear'."
            )
        return
    missing = [t for t in targets if t not in leaves and not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        hints = [f"{t!r} (did you mean {difflib.get_close_matches(t, sorted(leaves), n=1)[0]!r}?)"
                 if difflib.get_close_matches(t, sorted(leaves), n=1) else repr(t) for t in missing]
        raise InputError(
            f"{setting} names no module of {config.model_type} ({model_path}): {', '.join(hints)}. "
            f"Its linear layers are {sorted(leaves)}; use some of those, or 'all-linear'."
        )
