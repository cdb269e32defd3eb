"""The padding-free logprob forward (``padding_free``): TRL's fused-head forward on packed rows.

``GRPOTrainer._get_per_token_logps_and_entropies`` hands a text-only call here when the run is
padding-free; every other call (image inputs, a MoE router loss) runs TRL's padded forward.
The call's rows are packed together (``ops.packing.pack``: rows of at most the padded width, so no
row's attention costs more than a padded row's), run at most ``batch_size`` packed rows at a time, each
forward cut to its widest row (``ops.packing.forward_plan``), through the model with ``position_ids``
restarting at 0 for each sequence, ``attention_mask=None`` and the fused head's labels on the scored
tokens only (on CPU the head then projects those positions only, as TRL's does on Triton devices:
``_intercept.inject_compact_head``), and put back in TRL's ``[B, K]`` layout
(``ops.packing.unpack``): everything downstream (loss types, IS correction, KL, entropy bonus,
metrics, guards) sees what the padded forward would have given.

``packed_attention='varlen'`` (``resolve_packed_attention``) runs each forward's sequences end to
end in one row ``[1, T]`` with their boundaries instead, under an attention function registered with transformers
(``trainers.packed_attention``): no mask. With shared prompts (where torch's varlen kernel does not run it:
``kernel_runs``) all of a prompt's rows share it, in one tree of up to ``batch_size x L`` tokens (a forward's), each
row attending over the prompt's keys and its own (``ops.varlen.tree_attention``).

Under sdpa the rows of one prompt run it once (``resolve_share``; ``ops.packing.share_plan``: a tree of
the prompt and each row's own tokens; under the mask a boolean ``[r, 1, W, W]`` one), and the token-balanced
microbatches (``balanced``) count a shared prompt once, so a prompt's rows go together where it pays. Under
varlen's trees a forward's cost is its tokens, whatever their rows, so the microbatches are regrouped by prompt
instead (``ops.packing.prompt_plan``): each prompt runs about once per optimizer step rather than once in each
microbatch TRL's shuffle spread its rows over.

``resolve`` turns the config's setting into on or off for a loaded model on a kind of device: ``"auto"``
is on where the model's attention keeps packed rows apart (transformers' sdpa and eager, which read the
sequence boundaries from the restarting position ids in every row), there are no image inputs or router
losses, and the device is one where the padding-free step was measured faster than TRL's padded one
(``MEASURED_FASTER_ON``: CPU; on an H100 in bf16 it was slower, docs/cost.md). FlashAttention is refused:
transformers reads the boundaries from position ids there only in a forward of one row, and a packed
forward holds several. The finished-row rollout follows the resolved ``padding_free`` (an explicit
``True`` turns both on, on any device). The I5 guard recomputes the padded forward on guard steps and
compares: a model whose attention ignores the packing stops there (``guards.check_logprobs_in_precision``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..configs.checks import check_packed_attention
from ..errors import InputError
from ..models.dropout import attention_dropout
from ..generation.compiled_rollout import parse_setting  # true / false / 'auto', as configs.checks took it
from ..ops.packing import IGNORE, Packed, balance_plan, forward_plan, pack, prompt_plan, prompts_of, unpack
from ..ops.loss_types import named
from ..guards.precision import compute_dtype
from ..ops.varlen import KERNEL_DEVICES, VARLEN_DTYPES, cu_seqlens
from . import _intercept, packed_attention

logger = logging.getLogger(__name__)

PACKED_ATTENTION = ("sdpa", "eager")  # honour restarting position ids in every row of a forward
MEASURED_FASTER_ON = ("cpu",)  # device types where 'auto' is on: the step measured faster than TRL's (docs/cost.md)
VARLEN_MEASURED_FASTER_ON = ("cpu",)  # device types where packed_attention 'auto' is 'varlen' (docs/cost.md)
# (device type, packed attention) -> a bench run in bf16/fp16 where I5's median gap between the packed forward and
# the padded recompute exceeded I5's bound: rounding, not a fault, yet I5 stopped the run (docs/cost.md)
I5_OVER_BOUND = {("cuda", "mask"): "on an H100 in bf16 autocast at 8 prompts x 8 generations x 256 tokens, I5's "
                                   "median gap against the padded recompute was 0.022 nats over 736 tokens (its "
                                   "bound: 0.02), and I5 stopped the run at step 1"}


_text_config = packed_attention.text_config  # unwrapped: a DeepSpeed engine's ``config`` is DeepSpeed's own


def _attention_of(model) -> str | None:
    config = getattr(packed_attention.pretrained_of(model) or model, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None


def resolve(args, model, is_vlm: bool, device_type: str) -> tuple[bool, str | None]:
    """Whether the run's logprob forwards (and with them its rollout, ``generation.finished_rows``) are
    padding-free (``args.padding_free`` for ``model`` on a device of ``device_type``, ``torch.device.type``:
    "cpu", "cuda", ...), and why not where it asked for ``"auto"`` and it is off. ``"auto"`` is on only on
    ``MEASURED_FASTER_ON``; an explicit ``True`` is honoured on any device. An explicit ``True`` that cannot
    work is an ``InputError``: image inputs, a MoE router loss, ``kl_estimator='full'``, FlashAttention."""
    want = parse_setting(getattr(args, "padding_free", False))
    if want is False:
        return False, None
    text = _text_config(model)
    why = None
    if is_vlm:
        why = "the processing class is multimodal (image inputs are sliced per row by TRL's padded forward)"
    elif getattr(text, "output_router_logits", False):
        why = ("the model returns a MoE router load-balancing loss, which would count the packed rows' tail "
               "padding differently from the padded batch")
    elif getattr(args, "kl_estimator", None) == "full":
        why = ("kl_estimator='full' rebuilds the policy's logits from the loss forward's hidden states in the "
               "padded layout")
    if why is not None:
        if want is True:
            raise InputError(f"padding_free=True: {why}. Set padding_free=False (or 'auto').")
        return False, why
    attention = _attention_of(model)
    if attention is not None and "flash" in attention.lower():
        why = (f"attn_implementation={attention!r}: under FlashAttention transformers keeps the sequences of a "
               "packed row apart only in a forward of one row (it reads their boundaries from the position ids "
               "when batch_size == 1), and a packed forward holds several rows of several sequences each: keeping "
               "them apart needs cu_seq_lens, which grpotrl does not pass")
        if want is True:
            raise InputError(f"padding_free=True: {why}. Set padding_free=False, or attn_implementation='sdpa'.")
        return False, why
    if attention not in PACKED_ATTENTION:
        if want is True:  # the user's call: I5 compares with the padded forward on guard steps
            logger.warning("padding_free=True with attn_implementation=%r, which grpotrl does not know to keep "
                           "packed rows apart; the I5 guard checks it against the padded forward on guard steps.",
                           attention)
            return True, None
        return False, (f"attn_implementation={attention!r} is not one known to keep packed rows apart "
                       f"({', '.join(PACKED_ATTENTION)})")
    if want == "auto" and device_type not in MEASURED_FASTER_ON:
        return False, f"not measured faster than TRL's padded forward on {device_type}; see docs/cost.md"
    return True, None


def guard_warning(device_type: str, packed: bool, attention: str, low_precision: bool, guarded: bool) -> str | None:
    """The warning a trainer logs at init where a padding-free run in bf16/fp16 (``low_precision``) with the
    guards on (``guarded``) has been measured to stop at I5 by rounding alone on this device and packed
    attention (``I5_OVER_BOUND``), else None. I5 compares the packed forward with the padded recompute; where
    they round apart by more than I5's bf16 bounds, I5 cannot tell that from a layout fault.

    >>> guard_warning("cpu", True, "mask", True, True) is None, guard_warning("cuda", True, "mask", False, True)
    (True, None)
    >>> guard_warning("cuda", True, "mask", True, True).startswith("padding_free on cuda with packed_attention")
    True
    """
    measured = I5_OVER_BOUND.get((device_type, attention))
    if not (packed and low_precision and guarded and measured):
        return None
    return (f"padding_free on {device_type} with packed_attention={attention!r} in half precision: {measured}. "
            f"The guards may stop this run at its first guard step. padding_free='auto' (off on {device_type}) "
            "runs the measured default; see docs/cost.md.")


def startup_line(args, device_type: str, packed: bool, why_packed: str | None, rollout: bool, balanced: bool,
                 why_balanced: str | None, attention: str | None = None, why_attention: str | None = None,
                 why_no_rollout: str | None = None) -> str:
    """The line a trainer logs once at init: what ``padding_free``, the finished-row rollout,
    ``balance_microbatches`` and (given ``attention``) ``packed_attention`` resolved to on ``device_type``, and
    why, e.g. ``grpotrl: padding_free off (auto: not measured faster than TRL's padded forward on cuda; see
    docs/cost.md); finished-row rollout off (padding_free off); balance_microbatches off (auto: the logprob
    forwards run padded ...); packed attention mask (auto: padding_free off)``. ``why_packed``,
    ``why_balanced`` and ``why_attention`` are ``resolve``'s, ``resolve_balance``'s and
    ``resolve_packed_attention``'s reasons; ``rollout``: whether rows that have stopped leave the decoding batch
    (``padding_free`` on, transformers' generate); ``why_no_rollout``: why not, where ``padding_free`` is on and
    transformers' generate runs (the compiled rollout's static cache keeps every row)."""
    if packed and why_packed is None and parse_setting(args.padding_free) == "auto":
        why_packed = f"measured faster than TRL's padded forward on {device_type}; see docs/cost.md"
    if rollout:
        why_rollout = "padding_free on, transformers' generate"
    elif not packed:
        why_rollout = "padding_free off"
    else:
        why_rollout = why_no_rollout or "not transformers' generate: vLLM, continuous batching, a rollout_func or tools"
    parts = [_chosen("padding_free", parse_setting(args.padding_free), packed, why_packed),
             _chosen("finished-row rollout", None, rollout, why_rollout),
             _chosen("balance_microbatches", parse_setting(getattr(args, "balance_microbatches", False)), balanced,
                     why_balanced)]
    if attention is not None:
        parts.append(_attention_chosen(_packed_attention_setting(args), attention, why_attention, device_type))
    return "grpotrl: " + "; ".join(parts)


def _attention_chosen(asked: str, attention: str, why: str | None, device_type: str) -> str:
    """``"packed attention varlen (set varlen)"``, ``"packed attention mask (auto: why)"``."""
    if asked == "auto" and why is None:
        why = (f"varlen measured faster than the mask on {device_type}" if attention == "varlen" else
               f"varlen not measured faster than the mask on {device_type}; see docs/cost.md")
    how = [asked if asked == "auto" else f"set {asked}"] + ([why] if why else [])
    return f"packed attention {attention} ({': '.join(how)})"


def _chosen(name: str, asked: bool | str | None, on: bool, why: str | None) -> str:
    """``"name on (auto: why)"``, ``"name off (set false)"``; ``asked`` None: a choice that follows another."""
    how = [] if asked is None else ["auto" if asked == "auto" else f"set {str(asked).lower()}"]
    return f"{name} {'on' if on else 'off'} ({': '.join(how + ([why] if why else []))})"


SHARED_PROMPT_ATTENTION = ("sdpa",)  # take a dense [r, 1, W, W] boolean mask as it is (transformers' masking_utils)


def resolve_share(packed: bool, *models) -> bool:
    """Whether the padding-free forwards run each prompt once for its rows (``ops.packing.share_plan``):
    where every model given (the policy, the reference) runs sdpa, which applies the tree mask as it is,
    in full-attention layers only. Eager adds the mask as a float bias, and transformers hands a ready 4D
    mask to sliding-window and chunked layers unchanged (their window would be lost). Under varlen the trees
    run ``ops.varlen.tree_attention``; where torch's varlen kernel runs varlen (``kernel_runs``), the caller
    passes ``packed=False``: the kernel takes sequence boundaries, not trees."""
    return packed and all(_attention_of(m) in SHARED_PROMPT_ATTENTION and _full_attention_only(m)
                          for m in models if m is not None)


def _attention_dropout_modules(model) -> list[str]:
    """The names of the ``nn.Dropout`` modules with ``p > 0`` inside ``model``'s attention layers (modules whose
    class name holds "Attention"), such as GPT-2's ``attn_dropout``, which hands its ``p`` to the attention
    function in training mode; TRL's ``disable_dropout`` sets them to 0."""
    return [f"{name}.{child_name}" for name, module in model.named_modules() if "Attention" in type(module).__name__
            for child_name, child in module.named_children() if isinstance(child, torch.nn.Dropout) and child.p > 0]


def _full_attention_only(model) -> bool:
    config = _text_config(model)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(t == "full_attention" for t in layer_types)
    return getattr(config, "sliding_window", None) is None and getattr(config, "attention_chunk_size", None) is None


def _packed_attention_setting(args) -> str:
    """``args.packed_attention`` lower-cased; a config without the field asks for the mask (a ``trl.GRPOConfig``
    gets "mask" from ``configs.complete_grpo_config``)."""
    return str(getattr(args, "packed_attention", "mask")).strip().lower()


def resolve_packed_attention(args, model, ref_model, device_type: str, packed: bool) -> tuple[str, str | None]:
    """How the padding-free forwards keep their packed sequences apart (``args.packed_attention`` for the policy
    ``model`` and ``ref_model`` (None: none, or the policy's disabled adapter) on a device of ``device_type``, in
    a run whose logprob forwards are ``packed`` or not): ``"mask"`` (the rows ``[r, W]`` with restarting position
    ids, transformers' mask, or the shared-prompt tree mask) or ``"varlen"`` (each forward's sequences in one
    row ``[1, T]`` with their boundaries, ``trainers.packed_attention``: no mask), and why not
    ``"varlen"`` where it asked for ``"auto"``. ``"auto"`` is ``"varlen"`` only on ``VARLEN_MEASURED_FASTER_ON``
    and, where a kernel runs it (CUDA), in bf16/fp16 (the kernel's dtypes: in fp32 an explicit ``"varlen"`` runs one
    sdpa per sequence); elsewhere (CPU) in fp32, the dtype it was measured in. Where the kernel runs it, I5's padded
    recompute runs through the kernel too (``GRPOTrainer._reference_attention``): the kernel rounds every token
    otherwise than sdpa, by as much as a layout fault moves I5's median (docs/cost.md).
    An explicit ``"varlen"`` that cannot work is an ``InputError``."""
    check_packed_attention(args)
    want = _packed_attention_setting(args)
    if want == "mask":
        return "mask", None
    why = None
    if not packed:
        why = "padding_free is off, and varlen runs the padding-free forwards"
    elif getattr(args, "use_transformers_continuous_batching", False):
        why = ("continuous batching runs the rollout under the policy's attention, which varlen switches for the "
               "whole training step, and it takes sdpa, eager, paged or flash attention only")
    elif device_type == "cuda":
        why = _varlen_kernel_missing()
    for m in (model, ref_model):
        if why is not None or m is None:
            continue
        text, attention = _text_config(m), _attention_of(m)
        if attention != "sdpa":
            why = (f"attn_implementation={attention!r}: varlen stands in for sdpa only (it is sdpa where a forward "
                   "carries no sequence boundaries)")
        elif not packed_attention.dispatches_by_name(m):
            why = (f"{type(m).__name__}'s attention layers do not look their function up in transformers' "
                   "AttentionInterface, so they would not run varlen")
        elif getattr(text, "attn_logit_softcapping", None) is not None:
            why = "the model softcaps its attention logits, which the varlen kernel does not"
        elif not _full_attention_only(m):
            why = "the model has sliding-window or chunked attention layers, which varlen would run as full attention"
        elif (p := max((attention_dropout(x) for x in m.modules()), default=0.0)) > 0:  # disable_dropout zeroes it
            why = (f"the model's attention layers hold attention_dropout {p}, and varlen runs without dropout (set "
                   "disable_dropout=True)")
        elif not getattr(args, "disable_dropout", False) and (dropouts := _attention_dropout_modules(m)):
            why = (f"disable_dropout is off and {type(m).__name__}'s attention layers hold dropout "
                   f"({dropouts[0]}), which varlen does not compute (set disable_dropout=True)")
    if why is not None:
        if want == "varlen":
            raise InputError(f"packed_attention='varlen': {why}. Set packed_attention='mask' (or 'auto').")
        return "mask", why
    if want == "auto":
        if device_type not in VARLEN_MEASURED_FASTER_ON:
            return "mask", f"varlen not measured faster than the mask on {device_type}; see docs/cost.md"
        # what was measured is the kernel on a kernel device, the fp32 tree attention elsewhere
        if device_type in KERNEL_DEVICES and not kernel_runs(args, model, device_type, "varlen"):
            return "mask", ("the run computes in fp32, and the varlen kernel takes bf16/fp16 only (set bf16: true); "
                            "in fp32 varlen is one sdpa per sequence")
        dtype = compute_dtype(model, getattr(args, "bf16", False), getattr(args, "fp16", False))
        if device_type not in KERNEL_DEVICES and dtype != torch.float32:
            return "mask", (f"varlen was measured faster than the mask on {device_type} in fp32 only, and this run "
                            f"computes in {str(dtype).removeprefix('torch.')}; see docs/cost.md")
    return "varlen", None


def kernel_runs(args, model, device_type: str, attention: str) -> bool:
    """Whether torch's varlen kernel runs the packed forwards: ``attention`` (``resolve_packed_attention``'s) is
    varlen, on a kernel device (CUDA), in bf16/fp16 (autocast's or the weights')."""
    return attention == "varlen" and device_type in KERNEL_DEVICES and compute_dtype(
        model, getattr(args, "bf16", False), getattr(args, "fp16", False)) in VARLEN_DTYPES


def _varlen_kernel_missing() -> str | None:
    """Why torch's varlen kernel cannot run on this CUDA device (None where it can): torch without
    ``torch.nn.attention.varlen`` (before 2.9), or a GPU below compute capability 8.0 (FlashAttention's)."""
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no varlen attention kernel (torch.nn.attention.varlen, torch >= 2.9)"
    if not torch.cuda.is_available():  # a resolution asked about CUDA on a machine without it: nothing to read
        return None
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"the GPU's compute capability {major}.{minor} is below FlashAttention's 8.0"
    return None


def resolve_balance(args, packed: bool) -> tuple[bool, str | None]:
    """Whether each optimizer step's microbatches are regrouped by tokens (``args.balance_microbatches``
    for a run whose logprob forwards are ``packed`` or not), and why not where it asked for ``"auto"``
    and it is off. An explicit ``True`` that would change the loss is an ``InputError``."""
    want = parse_setting(getattr(args, "balance_microbatches", False))
    if want is False:
        return False, None
    why = None
    if not packed:
        why = "the logprob forwards run padded (padding_free off), where a microbatch costs its longest row"
    elif not named(args.loss_type).grouping_free:  # the step's loss depends on which rows share a microbatch
        why = f"loss_type={args.loss_type!r} normalises each microbatch by its own token count"
    elif args.top_entropy_quantile < 1.0:
        why = "top_entropy_quantile < 1 picks the high-entropy tokens per microbatch"
    elif args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        why = "the entropy bonus is a token mean per microbatch"
    elif args.cagrad != "off":
        why = "CAGrad combines the task gradients of each microbatch"
    elif args.steps_per_generation % args.gradient_accumulation_steps:
        why = (f"steps_per_generation={args.steps_per_generation} is not a multiple of gradient_accumulation_steps="
               f"{args.gradient_accumulation_steps}, so a generation's microbatches straddle optimizer steps")
    if why is None:
        return True, None
    if want is True:
        raise InputError(f"balance_microbatches=True: {why}, so regrouping the rows would change the loss. "
                         "Set balance_microbatches=False (or 'auto').")
    return False, why


def balanced(batches: list[dict], window: int, share_prompts: bool = False, by_prompt: bool = False) -> list[dict]:
    """TRL's microbatches of one generation batch (``batches``, each a dict of per-row values and
    shared ones), each run of ``window`` consecutive ones (one optimizer step's) regrouped so that
    their real-token counts (prompt + completion) are even (``ops.packing.balance_plan``): the
    same rows per window, the same number per microbatch, each microbatch's rows in TRL's order. With
    ``share_prompts`` a row's prompt counts once per microbatch (its rows share the prompt's forward).
    With ``by_prompt`` (varlen trees: a forward shares a prompt across all of its rows, and its cost is
    its tokens, not its rows times their width) a prompt's rows go together instead
    (``ops.packing.prompt_plan``): the fewest prompt runs, at the price of uneven microbatches. A window
    already so grouped, or holding a value that is not one per row (tensor of another length), is
    returned as it was."""
    out = []
    for start in range(0, len(batches), window):
        out.extend(_balanced_window(batches[start:start + window], share_prompts, by_prompt))
    return out


def _balanced_window(batches: list[dict], share_prompts: bool, by_prompt: bool) -> list[dict]:
    size = batches[0]["completion_mask"].size(0)
    keys = [k for k, v in batches[0].items() if (isinstance(v, torch.Tensor) and v.ndim > 0) or isinstance(v, list)]
    if any(len(b[k]) != size for b in batches for k in keys):
        return batches  # not one value per row: no regrouping can be vouched for
    shared = share_prompts or by_prompt
    prompts = [p for b in batches for p in prompts_of(b["prompt_ids"], b["prompt_mask"])] if shared else None  # a sync
    if by_prompt:
        plan = prompt_plan(prompts, len(batches))
    else:
        lengths = torch.cat([b["prompt_mask"].sum(1) + b["completion_mask"].sum(1) for b in batches]).tolist()  # a sync
        plan = balance_plan(lengths, len(batches), prompts)
    if all(rows == list(range(g * size, (g + 1) * size)) for g, rows in enumerate(plan)):
        return batches  # TRL's grouping kept
    window = {k: _concat([b[k] for b in batches]) for k in keys}  # each per-row value over the window's rows
    return [{**first, **{k: _take(window[k], rows) for k in keys}} for first, rows in zip(batches, plan)]


def _concat(parts: list):
    return torch.cat(parts) if isinstance(parts[0], torch.Tensor) else [x for part in parts for x in part]


def _take(values, rows: list[int]):
    if isinstance(values, torch.Tensor):
        return values[torch.tensor(rows, dtype=torch.long, device=values.device)]
    return [values[i] for i in rows]


# What a CPU forward (and its backward) costs besides its tokens, in packed cells (measured: docs/cost.md,
# "Forwards cut to their rows").
CPU_FORWARD_OVERHEAD = 64


def packed_logps_and_entropies(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                               batch_size: int | None, compute_entropy: bool, autocast, pad_id: int = 0,
                               share_prompts: bool = False, agree_forwards: Callable[[int], int] | None = None,
                               attention: str = "mask"):
    """TRL's ``_get_per_token_logps_and_entropies`` (text only, no router loss) on packed rows:
    per-token logprobs [B, K] and entropies [B, K] (or None), zeros where nothing is scored, as TRL's.
    ``autocast()`` is the accelerator's autocast context.

    All ``B`` rows of the call are packed together (rows of at most the padded width ``L``), then run
    at most ``batch_size`` packed rows per forward: no forward is larger than one of TRL's padded chunks
    (``batch_size x L``), and a call whose chunks each hold one prompt's group (the reference and
    old-policy forwards over a whole generation batch, before TRL shuffles it) packs short groups together
    instead of leaving each chunk's rows part-empty. ``attention`` (``resolve_packed_attention``): ``"mask"``
    runs each forward's rows ``[r, w]``, cut to its widest row (``ops.packing.forward_plan``: on CPU the fewest
    cells, counting ``CPU_FORWARD_OVERHEAD`` per forward; elsewhere the fewest forwards), and with
    ``share_prompts`` (``resolve_share``) the rows of one prompt run its prompt once (``ops.packing.share_plan``)
    under a tree attention mask. ``"varlen"`` runs each forward's sequences end to end in one row ``[1, T]`` with
    their boundaries (``trainers.packed_attention``), in the fewest forwards; with ``share_prompts`` a prompt's rows
    form one tree of up to ``batch_size x L`` tokens (a forward of each packed row), run by the tree attention
    (``ops.varlen.tree_attention``: each row over the prompt's keys and its own).

    ``agree_forwards`` (sharded parameters, ZeRO-3: each forward gathers every layer's parameters, a collective):
    takes this process's number of forwards and returns the number every process runs (the largest); the
    missing ones run on a 2-token row of padding, their output in the result with weight 0, so that the
    backward (and a checkpointed layer's recompute) runs through them too, as through another process's."""
    if attention not in ("mask", "varlen"):
        raise ValueError(f"attention={attention!r}: 'mask' or 'varlen' (resolve_packed_attention)")
    varlen = attention == "varlen"
    with packed_attention.running(model) if varlen else contextlib.nullcontext():
        return _packed_forwards(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                                autocast, pad_id, share_prompts, agree_forwards, varlen)


def _packed_forwards(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, autocast, pad_id,
                     share_prompts, agree_forwards, varlen: bool):
    B, L = input_ids.shape
    batch_size = batch_size or B  # TRL's chunking: at most batch_size rows per forward (memory)
    # varlen with shared prompts: a prompt's rows in one tree of up to a forward's tokens, each packed row a forward
    whole = varlen and share_prompts
    packed = pack(input_ids, attention_mask, logits_to_keep, capacity=L * batch_size if whole else L, pad_id=pad_id,
                  share_prompts=share_prompts)
    device = packed.input_ids.device
    R, W = packed.input_ids.shape
    overhead = CPU_FORWARD_OVERHEAD if device.type == "cpu" and not varlen else None  # varlen: no cells cut
    plan = forward_plan(packed.widths, 1 if whole else batch_size, overhead)
    # before any forward: the agreement is a collective, and so is each forward under ZeRO-3
    forwards = agree_forwards(len(plan)) if agree_forwards is not None else len(plan)
    logps, entropies = [], []
    for rows in plan:
        index = torch.tensor(rows, dtype=torch.long, device=device)  # [r]
        if varlen:
            log_probs, entropy = _varlen_forward(model, packed, rows, index, compute_entropy, autocast)  # [r, W - 1]
        else:
            width = min(max(packed.widths[rows[0]], 2), W)  # the widest first; the head's output [r, w - 1] not empty
            with autocast(), _intercept.inject_compact_head(device):  # the scored positions only
                out = model(input_ids=packed.input_ids[index, :width],
                            attention_mask=packed.attention_mask(index, width),
                            position_ids=packed.position_ids[index, :width], labels=packed.labels[index, :width],
                            fused_lm_head=True)  # log_probs [r, w - 1]
            log_probs = F.pad(out.log_probs, (0, W - width))  # [r, W - 1]: the cut columns score nothing
            entropy = F.pad(out.entropy, (0, W - width)) if compute_entropy else None
        logps.append(log_probs)
        entropies.append(entropy)
    back = torch.tensor([r for rows in plan for r in rows], device=device).argsort()  # [R] each packed row's place

    def unpacked(parts):
        return unpack(torch.cat(parts, dim=0)[back], packed)  # [R, W - 1] in packed order -> [B, K]

    logps = unpacked(logps)  # [B, K]
    boundaries = dict(cu_seq_lens_q=cu_seqlens([2], device), cu_seq_lens_k=cu_seqlens([2], device), max_length_q=2,
                      max_length_k=2) if varlen else {}  # the padding row: one sequence of 2
    for _ in range(forwards - len(plan)):  # another process runs more forwards: as many here, on padding
        with autocast(), _intercept.inject_compact_head(device), \
                packed_attention.bounded(model) if varlen else contextlib.nullcontext():
            out = model(input_ids=packed.input_ids.new_full((1, 2), pad_id),
                        position_ids=torch.arange(2, device=device).view(1, 2),
                        labels=torch.tensor([[IGNORE, pad_id]], dtype=packed.input_ids.dtype, device=device),
                        fused_lm_head=True, **boundaries)  # log_probs [1, 1]
        logps = logps + 0.0 * out.log_probs.sum()  # in the graph, adding 0
    return logps, unpacked(entropies) if compute_entropy else None


def _varlen_forward(model, packed: Packed, rows: list[int], index: torch.Tensor, compute_entropy: bool, autocast):
    """One forward of the packed ``rows`` (``index [r]``) with their sequences end to end in one row ``[1, T]``
    (each row's used width, its sequences, in row order) and their boundaries as transformers' FlashAttention
    keyword arguments; the head's shifted output put back in the packed rows' layout ``[r, W - 1]`` (the value at
    a row's last token, which predicts the next row's first, is never scored)."""
    device, W = packed.input_ids.device, packed.input_ids.size(1)
    widths = torch.tensor([packed.widths[r] for r in rows], device=device)  # [r]
    used = torch.arange(W, device=device) < widths.unsqueeze(1)  # [r, W] each row's sequences
    lengths = [n for r in rows for n in packed.spans[r]]  # the forward's sequences, left to right
    tokens = sum(lengths)  # T
    extra = max(0, 2 - tokens)  # the head's output [1, T - 1] must not be empty: a padding sequence after
    ids, pos, labels = (torch.cat([x[index][used], x.new_full((extra,), fill)]).unsqueeze(0)  # [1, T + extra]
                        for x, fill in ((packed.input_ids, 0), (packed.position_ids, 0), (packed.labels, IGNORE)))
    if extra:
        pos[0, tokens:] = torch.arange(extra, device=device)
        lengths = lengths + [extra]
    cu = cu_seqlens(lengths, device)  # [N + 1]
    trees = [t for r in rows for t in packed.trees[r]] + ([(0, [extra])] if extra else [])
    shared = {packed_attention.TREES: trees} if any(p for p, _ in trees) else {}  # prompts shared: tree attention
    with autocast(), _intercept.inject_compact_head(device), packed_attention.bounded(model):
        out = model(input_ids=ids, position_ids=pos, labels=labels, fused_lm_head=True, cu_seq_lens_q=cu,
                    cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths),
                    **shared)  # log_probs [1, T - 1]

    def rows_of(values):  # [1, T + extra - 1] -> [r, W - 1]
        flat = F.pad(values[0], (0, 1))[:tokens]  # [T] the value at each token (predicting the next)
        return flat.new_zeros(len(rows), W).masked_scatter(used, flat)[:, :W - 1]

    return rows_of(out.log_probs), rows_of(out.entropy) if compute_entropy else None
