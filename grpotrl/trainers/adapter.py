"""A PEFT adapter named as the model (a LoRA SFT's output directory, or a Hub repo holding ``adapter_config.json``),
loaded for grpotrl's trainers to hand TRL.

* ``adapter_loaded``: the adapter's base model loads as TRL loads a model by name, its token embeddings take the
  rows the adapter saved for them (an SFT that added tokens: ``fit_embeddings``; a tokenizer with tokens the
  adapter saved no rows for is refused before the base loads), then the adapter loads onto it, trainable, the base
  frozen: TRL trains it as it trains a PEFT model passed in, and with ``beta`` > 0 copies it as the reference
  (``reference_in_adapter_dtype``: on a quantized base in the adapter's bf16, as TRL casts the adapter).
* ``adapter_tensor_shapes``, ``saved_rows``: what the adapter saved, read without loading weights.

The checks that run before any load (``peft_config`` beside an adapter, the recipe's LoRA settings, the KL's
reference) are the preflight's (``preflight.prepare_model_and_tokenizer``, ``preflight.model``).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from ..checkpoints import read_config
from ..errors import InputError
from ..models.sources import PeftAdapter, model_file
from ..preflight import ADAPTER_LOOKUP


@contextmanager
def adapter_loaded(model, adapter: PeftAdapter | None, args, kwargs: dict, processing_class):
    """``(model, kwargs)`` for TRL's trainer ``__init__``, within which it is called; ``kwargs`` never hold
    grpotrl's private ``preflight.ADAPTER_LOOKUP`` (the preflight's, not TRL's). ``processing_class``: the run's
    tokenizer, as the preflight returned it (the one given, or the one it loaded). ``model`` naming a PEFT
    adapter (``adapter``: the preflight's ``models.sources.find_adapter`` of it, read once per run start; a local
    directory or Hub repo holding ``adapter_config.json``, such as a LoRA SFT's output), which
    transformers' ``from_pretrained`` and TRL cannot load with peft < 0.22 ("Unrecognized model"), and which
    transformers' own PEFT integration (peft >= 0.22) loads as a plain model that TRL does not train as an
    adapter: its base model (``base_model_name_or_path``, at the adapter's recorded revision) loads as TRL
    loads a model by name (``trl.trainer.utils.create_model_from_path`` with ``args.model_init_kwargs``, the
    trainer's ``quantization_config``, ``trust_remote_code``, no device map under DDP or DeepSpeed), its token
    embeddings take the rows the adapter saved for them (``fit_embeddings``: an SFT that added tokens to the
    tokenizer, ``processing_class``), then the adapter loads onto it (``peft.PeftModel.from_pretrained``, at
    ``model_init_kwargs``' revision, with the config the preflight read: ``PeftAdapter.peft_config``) trainable,
    the base frozen;
    ``kwargs`` lose ``quantization_config`` (applied) and ``peft_config`` (None: the preflight refused any
    other, ``preflight.model.check_adapter_peft_config``). TRL then trains that adapter, and with ``beta`` > 0
    copies it as its reference (adapter ``ref``: the policy at step 0, I10; after TRL's ``__init__`` in the
    adapter's dtype, ``reference_in_adapter_dtype``, a PeftModel passed in too). Within the block, TRL's warning
    that ``model_init_kwargs`` is ignored for a model passed in is dropped: they were used. Anything else
    passes through unchanged.

    Raises:
        InputError: before the base loads, a tokenizer longer than the base's vocabulary where the adapter saved
            no embedding that long (``unsaved_rows``); after it, where the embeddings it saved are too short or
            the untied output embedding is missing (``fit_embeddings``).
    """
    kwargs = {k: v for k, v in kwargs.items() if k != ADAPTER_LOOKUP}
    if adapter is None:
        yield model, kwargs
        reference_in_adapter_dtype(model)  # a PeftModel passed in: TRL's `ref` copy of it too
        return
    from peft import PeftModel
    from trl.trainer.utils import create_model_from_path

    revision = adapter.revision  # model_init_kwargs', the adapter's own
    init_kwargs = {**(args.model_init_kwargs or {}), "revision": adapter.base_revision}  # the base's revision
    quantization_config = kwargs.get("quantization_config")
    if quantization_config is not None:  # the preflight refused it set in model_init_kwargs too
        init_kwargs["quantization_config"] = quantization_config
    if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):  # TRL's: "auto" fails distributed
        init_kwargs["device_map"] = None
    init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    shapes = adapter_tensor_shapes(model, revision)
    tokens = len(getattr(processing_class, "tokenizer", processing_class))
    base_name = adapter.base
    base_rows = _config_vocab_size(read_config(model_file(base_name, "config.json", adapter.base_revision)))
    if base_rows is not None and tokens > base_rows and not any(s and s[0] >= tokens for s in shapes.values()):
        raise InputError(unsaved_rows(model, base_name, tokens, base_rows))  # no tensor saved that long
    base = create_model_from_path(base_name, **init_kwargs)
    fit_embeddings(base, shapes, tokens, model, base_name)
    plugin = getattr(args, "deepspeed_plugin", None)
    quantized = getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False)  # as TRL reads it
    zero3 = plugin is not None and plugin.zero_stage == 3 and not quantized
    peft_kwargs = {"autocast_adapter_dtype": False} if zero3 else {}  # as TRL builds an adapter under ZeRO-3: one dtype
    if init_kwargs.get("token") is not None:  # a private adapter on the Hub: the token the base loaded with
        peft_kwargs["token"] = init_kwargs["token"]
    peft_model = PeftModel.from_pretrained(base, model, revision=revision, is_trainable=True,
                                           config=adapter.peft_config(), **peft_kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("quantization_config", "peft_config")}

    def quiet(record: logging.LogRecord) -> bool:  # accelerate's logger prefixes the rank ("[RANK 0] ")
        return "You passed `model_init_kwargs`" not in str(record.msg)

    loggers = [logging.getLogger(name) for name in ("trl.trainer.grpo_trainer", "trl.trainer.sft_trainer")]
    for log in loggers:
        log.addFilter(quiet)
    try:
        yield peft_model, kwargs
        reference_in_adapter_dtype(peft_model)
    finally:
        for log in loggers:
            log.removeFilter(quiet)


def reference_in_adapter_dtype(model) -> int:
    """After TRL's ``__init__``: each parameter of TRL's ``ref`` adapter (the copy of a trained adapter it takes as
    the KL's reference at ``beta`` > 0) in the dtype of the ``default`` adapter's parameter it copies; returns the
    tensors cast. TRL casts a quantized model's trainable weights to bf16 (QLoRA) after it copied them into
    ``ref``, which kept them in fp32: the reference then computed another function than the policy at step 0
    (I10), and every KL and ratio after measured the bf16 rounding of the adapter. Cast from the fp32 values the
    bf16 ones were rounded from, the two are bit for bit the same. A ``ref`` parameter is matched by its name's
    ``ref`` component (a module's ``lora_A.ref.weight``, a ParameterDict's ``lora_embedding_A.ref``); one without a
    ``default`` twin is left as it is. Nothing for a model without a ``ref`` adapter."""
    if "ref" not in (getattr(model, "peft_config", None) or {}):
        return 0
    params = dict(model.named_parameters())
    cast = 0
    for name, param in params.items():
        parts = name.split(".")  # "...lora_A.ref.weight", and a ParameterDict's "...lora_embedding_A.ref"
        own = params.get(".".join("default" if p == "ref" else p for p in parts), param) if "ref" in parts else param
        if own.dtype != param.dtype:
            param.data = param.data.to(own.dtype)
            cast += 1
    return cast


ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # peft's SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME


def adapter_tensor_shapes(path: str, revision: str | None = None) -> dict[str, tuple[int, ...]]:
    """Each tensor the PEFT adapter ``path`` saved (``adapter_model.safetensors``, else ``adapter_model.bin``),
    keyed as PEFT saved it (``base_model.model.<module>.<parameter>``), with its shape, read without loading the
    weights (the safetensors header; a ``.bin`` onto the meta device). Empty where it holds neither file (PEFT's
    own load says so)."""
    from safetensors import safe_open

    for name in ADAPTER_WEIGHTS:
        file = model_file(path, name, revision)
        if file is None:
            continue
        if name.endswith(".safetensors"):
            with safe_open(file, framework="pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        return {k: tuple(v.shape) for k, v in torch.load(file, map_location="meta", weights_only=True).items()}
    return {}


def saved_rows(shapes: dict[str, tuple[int, ...]], module: str) -> int | None:
    """The rows of the embedding ``module`` (its name in the base model) in a PEFT adapter's saved tensors
    (``adapter_tensor_shapes``): PEFT saves it whole under ``save_embedding_layers`` (by default where the
    embeddings were resized), in ``modules_to_save``, or as a LoRA target's ``base_layer``. None where it saved
    none.

    >>> saved_rows({"base_model.model.model.embed_tokens.weight": (49154, 64)}, "model.embed_tokens")
    49154
    >>> saved_rows({"base_model.model.model.layers.0.q_proj.lora_A.weight": (4, 64)}, "model.embed_tokens") is None
    True
    """
    for key in (f"base_model.model.{module}.weight", f"base_model.model.{module}.base_layer.weight"):
        if key in shapes:
            return shapes[key][0]
    return None


def unsaved_rows(path: str, base: str, tokens: int, rows: int) -> str:
    """Why the PEFT adapter ``path`` cannot be loaded with a tokenizer of ``tokens`` tokens onto ``base``'s
    ``rows`` embedding rows, and what to do."""
    return (f"The PEFT adapter {path!r} comes with a tokenizer of {tokens} tokens, and its base model {base!r} has "
            f"{rows} token embedding rows; the adapter saved no embedding rows for the {tokens - rows} tokens beyond "
            "them. The SFT that trained it added tokens to the tokenizer and resized the embeddings, and PEFT saved "
            "the adapter without its embedding layers (save_embedding_layers false, or 'auto' where PEFT could not "
            "read the base model's config, e.g. a Hub base offline), so the rows those tokens were trained with are "
            "lost: loading would give them new random rows. Save the SFT's model again with "
            "`model.save_pretrained(DIR, save_embedding_layers=True)`, or rerun the SFT with the embeddings in "
            "`modules_to_save` (recipe: `lora_modules_to_save: [embed_tokens, lm_head]`), and start from that "
            "adapter.")


def fit_embeddings(base, shapes: dict[str, tuple[int, ...]], tokens: int, path: str, base_name: str) -> None:
    """Resize the loaded ``base``'s token embeddings to the rows the PEFT adapter ``path`` saved for its input
    embedding (``saved_rows`` in ``shapes``), as PEFT's ``AutoPeftModelForCausalLM`` resizes a base to the adapter's
    tokenizer where it is longer, but to the saved rows themselves (an SFT may pad them to a multiple,
    ``resize_token_embeddings(pad_to_multiple_of=...)``), so that the saved embeddings then load; new rows are
    not initialised (``mean_resizing=False``): the adapter's replace them. ``InputError`` where the tokenizer's
    ``tokens`` outnumber the rows the model would have (``unsaved_rows``), or the base's output embedding is not
    tied to the input one and the adapter saved it with other rows (it would keep random rows)."""
    names = {id(module): name for name, module in base.named_modules()}
    embed, head = base.get_input_embeddings(), base.get_output_embeddings()
    rows = saved_rows(shapes, names[id(embed)])
    rows = embed.num_embeddings if rows is None else rows
    if tokens > rows:
        raise InputError(unsaved_rows(path, base_name, tokens, rows))
    if rows == embed.num_embeddings:
        return
    head_rows = None if head is None else saved_rows(shapes, names[id(head)])
    if head is not None and head.weight is not embed.weight and head_rows != rows:
        raise InputError(
            f"The PEFT adapter {path!r} saved {rows} rows of the input embedding {names[id(embed)]!r} (its base "
            f"model {base_name!r} has {embed.num_embeddings}), and {'none' if head_rows is None else head_rows} of "
            f"the output embedding {names[id(head)]!r}, which this base does not tie to it: the output rows would stay "
            "the base's, with random rows for the added tokens. Save the SFT's model again with "
            "`model.save_pretrained(DIR, save_embedding_layers=True)` (both embeddings), and start from that adapter.")
    base.resize_token_embeddings(rows, mean_resizing=False)


def _config_vocab_size(config: dict | None) -> int | None:
    """``vocab_size`` of a ``config.json`` (its text config's, for a multimodal one), None where it has none."""
    config = config or {}
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return size if isinstance(size, int) else None
