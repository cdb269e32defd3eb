"""The varlen attention of the padding-free forwards (``packed_attention='varlen'``): transformers' side.

A varlen forward lays its packed sequences end to end in one row ``[1, T]`` and hands their boundaries to
every attention layer as transformers' FlashAttention keyword arguments (``cu_seq_lens_q/k``,
``max_length_q/k``, which the model's forward passes down through ``**kwargs``, to each decoder layer and so to
a checkpointed layer's recompute too). ``NAME`` is registered with ``transformers.AttentionInterface``: given
the boundaries it runs ``ops.varlen.varlen_attention`` (torch's FlashAttention varlen kernel on CUDA in
bf16/fp16, one causal sdpa per sequence elsewhere; where the forward's sequences share prompts, ``TREES`` carries
its trees and ``ops.varlen.tree_attention`` runs them) and ignores the mask; without them (a padded forward: the
I5 guard's recompute, TRL's own calls) it is transformers' sdpa, except inside ``padded`` (the I5 recompute
where torch's kernel runs the packed forwards): there each row's kept tokens (the mask's) are one sequence of the
same varlen attention (``ops.varlen.padded_varlen_attention``), so that I5 compares one kernel's rounding with
itself. Its mask function (``masking_utils.AttentionMaskInterface``) is sdpa's, except inside ``bounded`` (a
forward that carries boundaries), where it builds none: transformers would otherwise read the restarting position
ids and build a ``[1, 1, T, T]`` mask that nothing reads; and inside ``padded``, where it is the 2-D mask, as
transformers' FlashAttention takes it. ``bounded`` and ``padded`` also count the layers that ran the varlen
attention and stop (I5) a forward in which any attention layer did not: a layer that does not look its function
up by name would run over every sequence of the row at once, or over the padded rows under another mask.

``running(model)`` switches the model (the ``PreTrainedModel`` inside a PEFT, DDP or DeepSpeed wrapper) to
``NAME`` with transformers' ``set_attn_implementation`` and back in a ``finally``; the attention layers read the
implementation at forward time. The trainer keeps it switched for a whole training step (``GRPOTrainer.
training_step``), so that the backward's recompute of a checkpointed layer (gradient checkpointing) runs under
``NAME`` with the boundaries it was first called with, and around each packed no-grad forward of the rollout.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask, sdpa_mask

from ..errors import InputError, InvariantError
from ..ops.varlen import padded_varlen_attention, tree_attention, varlen_attention

NAME = "grpotrl_varlen"
TREES = "grpotrl_trees"  # the keyword argument that carries a forward's trees: its sequences share prompts
BOUNDED, PADDED = "bounded", "padded"  # the forwards that run the varlen attention: see ``bounded``, ``padded``
# inside ``bounded`` or ``padded``: which, and the list of the forward's attention calls that ran varlen (one entry
# each); else None
_FORWARD: contextvars.ContextVar[tuple[str, list] | None] = contextvars.ContextVar("grpotrl_varlen_forward",
                                                                                  default=None)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, sliding_window: int | None = None, softcap: float | None = None,
                      s_aux: torch.Tensor | None = None, position_bias: torch.Tensor | None = None, **kwargs):
    """transformers' attention-function signature. With the boundaries (``kwargs['cu_seq_lens_q']`` ``[N + 1]``
    and ``kwargs['max_length_q']``): one row of sequences end to end, ``query [1, H, T, D]``, ``key, value
    [1, Hk, T, D]``, the mask ignored (with ``kwargs[TREES]``, the row's trees: prompts shared, the tree
    attention); returns ``([1, T, H, D], None)``. Without them: transformers' sdpa, as the model would run it;
    inside ``padded``, each row's kept tokens (``attention_mask [B, L]``, the 2-D mask; None: all) one sequence of
    the varlen attention, returning ``([B, L, H, D], None)``. What it cannot compute it refuses, rather than
    computing something else: dropout, a sliding window, softcapped logits, attention sinks, a position bias,
    non-causal attention, several rows of boundaries, a padded forward over a cache."""
    cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    # never inside ``bounded`` or ``padded`` in a forward torch.compile traces (the compiled rollout's decoding
    # step): those forwards run eagerly, and dynamo cannot trace ``ContextVar.get``
    forward = None if torch.compiler.is_compiling() else _FORWARD.get()
    padded = cu is None and longest is None
    if padded and (forward is None or forward[0] != PADDED):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, sliding_window=sliding_window, softcap=softcap,
                                      s_aux=s_aux, position_bias=position_bias, **kwargs)
    refused = {"attention dropout": dropout or None, "a sliding window": sliding_window, "softcapped logits": softcap,
               "attention sinks": s_aux, "a position bias": position_bias,
               "non-causal attention": is_causal is False or getattr(module, "is_causal", True) is False or None}
    named = [name for name, value_ in refused.items() if value_ is not None]
    if padded and (attention_mask is not None and attention_mask.dim() != 2 or query.size(2) != key.size(2)):
        named.append("a padded forward over a cache or under a prepared mask")
    if named or not padded and (cu is None or longest is None or query.size(0) != 1):
        unbounded = cu is None or longest is None
        why = ", ".join(named) or ("only some of the sequence boundaries (cu_seq_lens_q, max_length_q)" if unbounded
                                   else f"{query.size(0)} rows (one row of sequences end to end only)")
        raise InputError(f"packed_attention='varlen': the attention layer {type(module).__name__} was called with "
                         f"{why}, which grpotrl's varlen attention does not compute. Set packed_attention='mask'.")
    if forward is not None:
        forward[1].append(1)
    # under autocast the query and key can be fp32 beside a half value: the kernel takes them in autocast's dtype, as
    # transformers' FlashAttention does (its get_target_dtype also walks the module for a Linear's dtype, which
    # GPT-2's Conv1D layers do not have)
    device = query.device.type
    half = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    if padded:
        return padded_varlen_attention(query, key, value, attention_mask, scale=scaling, half_dtype=half), None
    trees = kwargs.get(TREES)
    if trees is not None:  # the row's sequences share prompts: each over its tree's prefix and itself
        return tree_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), trees,
                              scale=scaling).unsqueeze(0), None  # [1, T, H, D]
    out = varlen_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),  # [T, H, D]
                           cu, int(longest), scale=scaling, half_dtype=half)
    return out.unsqueeze(0), None  # [1, T, H, D]


def mask_function(*args, **kwargs):
    """transformers' mask function for ``NAME``: sdpa's (``masking_utils.sdpa_mask``); none inside ``bounded``; the
    2-D mask (None where it keeps every token) inside ``padded``, as transformers' FlashAttention takes it."""
    forward = _FORWARD.get()
    if forward is None:
        return sdpa_mask(*args, **kwargs)
    return None if forward[0] == BOUNDED else flash_attention_mask(*args, **kwargs)


def register() -> None:
    """``NAME`` in transformers' attention functions and mask functions (idempotent)."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_function)


def bounded(model: torch.nn.Module):
    """The block runs one forward of ``model`` (switched to ``NAME``) with sequence boundaries: transformers builds
    no mask for it, and afterwards every attention layer of the model must have run the varlen attention.

    Raises:
        InvariantError: I5, where fewer or more attention calls ran varlen than the model has layers.
    """
    return _counted(model, BOUNDED, "attended over every packed sequence of the row at once")


def padded(model: torch.nn.Module):
    """The block runs one padded forward of ``model`` (switched to ``NAME``; ``[B, L]`` with its 2-D attention
    mask, no cache): each row's kept tokens one sequence of the varlen attention, the kernel the packed forwards
    run; afterwards every attention layer of the model must have run it.

    Raises:
        InvariantError: I5, where fewer or more attention calls ran varlen than the model has layers.
    """
    return _counted(model, PADDED, "attended under another attention than the packed forwards'")


@contextlib.contextmanager
def _counted(model: torch.nn.Module, kind: str, otherwise: str):
    calls: list = []
    token = _FORWARD.set((kind, calls))
    try:
        yield
    finally:
        _FORWARD.reset(token)
    inner = pretrained_of(model)
    layers = getattr(text_config(model), "num_hidden_layers", None)
    if layers is None or len(calls) != layers:
        raise InvariantError("I5", f"packed_attention='varlen': {len(calls)} attention calls of a {kind} forward of "
                             f"{type(inner).__name__} ({layers} layers) ran grpotrl's varlen attention; a layer that "
                             f"did not {otherwise}. Set packed_attention='mask'.")


def pretrained_of(model: torch.nn.Module) -> PreTrainedModel | None:
    """The outermost transformers model inside ``model`` (itself, or inside PEFT, DDP or DeepSpeed)."""
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def text_config(model: torch.nn.Module):
    """The (text) config of the transformers model inside ``model`` (a multimodal model's language model's)."""
    config = (pretrained_of(model) or model).config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def dispatches_by_name(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention layers look their function up by name at forward time (transformers'
    ``AttentionInterface``), so that switching the implementation switches what they run."""
    inner = pretrained_of(model)
    return inner is not None and all(type(m)._can_set_attn_implementation() for m in inner.modules()
                                     if isinstance(m, PreTrainedModel))


@contextlib.contextmanager
def running(model: torch.nn.Module):
    """``model``'s attention is ``NAME`` inside the block and what it was afterwards (also on an error); a block
    inside another's leaves the switch to the outer one."""
    inner = pretrained_of(model)
    if inner is None or not dispatches_by_name(model):
        raise InputError(f"packed_attention='varlen': {type(model).__name__}'s attention layers do not look their "
                         "function up in transformers' AttentionInterface. Set packed_attention='mask'.")
    before = inner.config._attn_implementation
    if before == NAME:
        yield
        return
    register()
    inner.set_attn_implementation(NAME)
    try:
        yield
    finally:
        inner.set_attn_implementation(before)
