"""The model and its settings, checked once before any weights load (config files only).

* ``check_discriminator_source``: GAD's ``discriminator_model_name_or_path``.
* ``check_model_args``: a recipe's quantization / LoRA fields (``trl.ModelConfig``; the CLI's):
  4/8-bit needs ``use_peft``, a compute dtype, and LoRA target modules that exist; ``lora_*`` settings
  need ``use_peft``, and ``bnb_4bit_*`` / ``use_bnb_nested_quant`` need ``load_in_4bit`` (TRL ignores them
  without it). A PEFT adapter as ``model_name_or_path`` needs ``use_peft: true`` and LoRA settings that are the
  adapter's own (``check_adapter_settings``). It returns its lookup of the model (``models.sources.AdapterLookup``),
  which the CLI hands the trainer's preflight (``preflight.ADAPTER_LOOKUP``): one lookup per run start.
* ``check_adapter_peft_config``: a PEFT adapter named as the model takes no ``peft_config`` (the Python API's).

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
from ..models.sources import AdapterLookup, check_model_source, find_adapter


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

def check_model_args(model_args, model_path: str, dropout_disabled: bool = False) -> AdapterLookup | None:
    """A recipe's quantization and LoRA fields (``trl.ModelConfig``), before any weights are read. Returns the
    lookup of ``model_path`` at ``model_args.model_revision`` (``models.sources.AdapterLookup``: the PEFT adapter it
    names, whose settings the recipe's LoRA fields were compared with (``check_adapter_settings``;
    ``dropout_disabled``: the trainer zeroes every dropout, ``disable_dropout``), or None for a plain model), for
    the trainer's preflight to take instead of asking again (``preflight.ADAPTER_LOOKUP``); None where no path is
    given (the preflight says so)."""
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
    if not model_path:  # the preflight says so
        return None
    lookup = AdapterLookup(model_path, model_args.model_revision, find_adapter(model_path, model_args.model_revision))
    if lookup.adapter is not None:  # the trainer continues training the adapter, with its own settings
        check_adapter_settings(model_args, model_path, lookup.adapter.config, dropout_disabled)
    elif model_args.use_peft and model_args.lora_target_modules:
        check_lora_targets(model_args.lora_target_modules, model_path, model_args.model_revision)
    return lookup


# a recipe's LoRA field -> the adapter_config.json key PEFT writes it as (trl.get_peft_config's mapping)
LORA_FIELDS = {"lora_r": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
               "lora_target_modules": "target_modules", "lora_target_parameters": "target_parameters",
               "lora_modules_to_save": "modules_to_save", "lora_task_type": "task_type", "use_rslora": "use_rslora",
               "use_dora": "use_dora"}


def merge_advice(path: str) -> str:
    """How to turn the PEFT adapter at ``path`` into a plain checkpoint that keeps I2's fingerprint: merged into its
    base and saved with the adapter's tokenizer and ``grpotrl_template.json``."""
    return (f"merge it into its base first: `m = peft.AutoPeftModelForCausalLM.from_pretrained({path!r}); "
            "m.merge_and_unload().save_pretrained(MERGED)`, then copy the adapter's tokenizer files and "
            "grpotrl_template.json (the template fingerprint, I2) into MERGED, and start from MERGED")


def check_adapter_peft_config(path: str, peft_config) -> None:
    """A model named by a PEFT adapter ``path`` takes no ``peft_config`` (None): grpotrl's trainers load base + adapter
    and continue training that adapter with its own settings; a ``peft_config`` would ask for a second adapter on
    a PEFT model, which TRL refuses after the load."""
    if peft_config is None:
        return
    raise InputError(
        f"model={path!r} is a PEFT adapter, which grpotrl loads onto its base model and continues training with the "
        f"adapter's own settings (its adapter_config.json), and peft_config={type(peft_config).__name__}(...) asks "
        "for a new adapter on top of it (TRL refuses a PEFT model with a peft_config). Drop peft_config to continue "
        f"training this adapter; to train a new adapter on the weights it gives instead, {merge_advice(path)} with "
        "this peft_config."
    )


def check_adapter_settings(model_args, path: str, adapter: dict, dropout_disabled: bool = False) -> None:
    """A recipe (``trl.ModelConfig``) whose ``model_name_or_path`` is a PEFT adapter (``adapter``: its
    ``adapter_config.json``) continues training that adapter: it needs ``use_peft: true`` (``use_peft: false`` asks
    for a full fine-tune, which an adapter cannot take unmerged: refused, not merged, so that the run trains and
    saves what the recipe says), and each LoRA setting the recipe changes from its default must be the adapter's
    own (``LORA_FIELDS``); settings left at their defaults take the adapter's. Module names compare as sets of
    their last parts (``_names``), one name as a list of it, and ``all-linear`` as the names PEFT expands it to on the adapter's base (the recipe that
    trained the adapter passes); ``lora_dropout`` is not compared where the trainer zeroes every dropout
    (``dropout_disabled``)."""
    if not model_args.use_peft:
        raise InputError(
            f"model_name_or_path {path!r} is a PEFT adapter and this run has use_peft: false, which fine-tunes every "
            "weight of a plain model; the adapter is not merged silently, since the run would then train and save "
            "the whole model instead of an adapter. Set `use_peft: true` to continue training this adapter (with "
            f"its own settings, from its adapter_config.json), or, for a full fine-tune, {merge_advice(path)}."
        )
    differing = []
    for field, value in _changed_settings(model_args, tuple(LORA_FIELDS)).items():
        saved = adapter.get(LORA_FIELDS[field])
        if field == "lora_dropout" and dropout_disabled:
            continue
        if field in ("lora_target_modules", "lora_modules_to_save", "lora_target_parameters"):
            same, theirs = _names(value, adapter, path) == (names := _names(saved, adapter, path)), names
            shown = sorted(theirs) if isinstance(theirs, frozenset) else theirs  # the names' last parts
        else:
            same, shown = value == saved, saved
        if not same:
            differing.append(f"{field}: {value!r} (the adapter's {LORA_FIELDS[field]} is {shown!r})")
    if differing:
        raise InputError(
            f"model_name_or_path {path!r} is a PEFT adapter, which this run continues training with its own settings "
            f"(its adapter_config.json), and the recipe sets other ones: {'; '.join(differing)}. Drop these settings "
            f"(or set the adapter's values); to train a new adapter with them instead, {merge_advice(path)}."
        )


def _names(value, adapter: dict, path: str):
    """A PEFT name setting as compared: the set of the module names' last parts (PEFT matches a name against a
    module's dotted name or its end: ``q_proj`` and the ``model.layers.0.self_attn.q_proj`` it saves for
    ``all-linear`` are one; one name is a set of it; ``all-linear`` the linear layers PEFT targets with it on the
    adapter's base, ``_all_linear``), or a regular expression as written."""
    if value in ("all-linear", ["all-linear"]):
        return _all_linear(adapter.get("base_model_name_or_path"), adapter.get("revision")) or "all-linear"
    if isinstance(value, str) and not re.fullmatch(r"[\w.-]+", value):
        return value  # a regular expression, which PEFT full-matches against each module's dotted name
    return frozenset(name.rsplit(".", 1)[-1] for name in ([value] if isinstance(value, str) else value or ()))


def _all_linear(base: str | None, revision: str | None) -> frozenset | None:
    """The module names ``all-linear`` stands for on the model ``base`` (built on the meta device, no weights), as
    PEFT expands it: the last name of every ``torch.nn.Linear`` (GPT-2's ``Conv1D``) but the output layer's; None
    where its config cannot be read here."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    try:
        config = AutoConfig.from_pretrained(resolve_model_path(base), revision=revision)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, TypeError):
        return None
    output = skeleton.get_output_embeddings()
    return frozenset(name.rsplit(".", 1)[-1] for name, module in skeleton.named_modules()
                     if isinstance(module, (torch.nn.Linear, Conv1D)) and module is not output)


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
