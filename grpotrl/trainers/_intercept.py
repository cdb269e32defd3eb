"""Every change grpotrl makes to a TRL method or a model at run time, in one place.

The trainers override TRL hooks by subclassing (their docstrings list them). Where a check needs
what TRL or transformers computed *inside* a hook -- the rewards TRL's ``_calculate_rewards``
returned, the logprobs the loss really used, what ``model.generate`` saw -- or needs to hand
``generate`` something TRL does not, the trainers wrap a method on the instance for the length of
one call and restore it after (one exception: ``inject_position_ids``, a forward pre-hook for the
model's lifetime). The names say which kind each is:

* ``record_*``: the wrapped call runs unchanged; its arguments or results are kept for a check.
* ``inject_*``: the call runs with something added or replaced (keyword arguments, a reordered
  processor list, position ids, a method shadowed for the block: ``inject_attr``; the checkpoints
  transformers' end of training may delete: ``inject_end_checkpoints``).
* ``skip_*``: the call does less than it would, with the same result: ``skip_head_weight_grad``,
  ``skip_stacked_input_grad_hooks``, ``skip_input_grad_hooks``.
* ``set_*``: writes TRL's private fields the way TRL itself would have (``set_microstep_done``,
  ``set_metrics``, ``set_buffered_inputs``).
* ``read_*``: returns what TRL keeps in a private field, as it is (nothing is wrapped or written):
  ``read_tokenizer``, ``read_is_vlm``, ``read_row_tools``, ``read_tool_sets``, ``read_entropy_bonus``,
  ``read_metrics``, ``read_buffered_inputs``.

No other module of grpotrl reads or writes a private field of a TRL trainer (``self._x`` that TRL
sets); the trainers call TRL's private *methods* only as TRL's own hooks (``super()._x``,
``self._get_per_token_logps_and_entropies``, ``self._prepare_inputs``), each pinned by signature. Two
private names are read where they are used, both pinned in ``tests/trainers/test_trl_hooks.py``: a model config's
``_attn_implementation`` (``trainers/padding_free.py``: the attention that runs, as transformers sets
it) and TRL's config classes' ``_VALID_DICT_FIELDS`` (``configs/__init__.py`` extends it with grpotrl's
dict-valued fields). The compiled rollout (``generation/compiled_rollout.py``) reads a model's
``_can_compile_fullgraph`` and ``_supports_default_dynamic_cache`` and sets ``CompileConfig._compile_all_devices``,
transformers' own switches for its compile path (pinned there too); ``skip_input_grad_hooks`` reads a transformers
model's ``_require_grads_hooks``, the list its ``enable_input_require_grads`` keeps (pinned there too).
Each helper here is pinned by ``tests/trainers/test_trl_hooks.py`` against TRL's source: a renamed field or
method fails there, not silently in a run.

``TRLGenerate`` names the positions of the tuple TRL's ``_generate`` returns
(``tests/trainers/test_trl_hooks.py`` pins the layout).
"""

from __future__ import annotations

import threading
from collections import namedtuple
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
import transformers.trainer as transformers_trainer
import trl.kernels.chunked_logprob as trl_chunked
import trl.trainer.utils as trl_utils
from transformers import GenerationMixin, PreTrainedModel
from transformers.generation import utils as generation_utils
from transformers.generation.configuration_utils import GenerationMode

from ..generation.finished_rows import FinishedRows, ObservedCriteria, usable
from ..generation.sampled_logprobs import arrange_processors
from ..ops.losses import merge_rows
from ..ops.masking import position_ids_from_mask
from ..ops.sampling import draw_one, invalid_rows

# trl.GRPOTrainer._generate returns these, in this order (trl 1.16; tests/trainers/test_trl_hooks.py)
TRLGenerate = namedtuple("TRLGenerate", "prompt_ids completion_ids tool_mask completions logprobs extra_fields "
                                        "images tool_images")


@contextmanager
def inject_attr(obj, name: str, value) -> Iterator[None]:
    """Inject ``value`` as ``obj.name`` for the block (an instance attribute shadowing the class's),
    restoring exactly what was there. Every wrap below goes through it."""
    missing = object()
    before = vars(obj).get(name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if before is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, before)


@contextmanager
def record_calls(obj, name: str) -> Iterator[list]:
    """Record: the return values of ``obj.name(...)`` in the block, in call order. The trainers keep
    what TRL's ``_calculate_rewards`` and ``_get_per_token_logps_and_entropies`` returned this way,
    whichever subclass computed them."""
    original = getattr(obj, name)
    results = []

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        results.append(out)
        return out

    with inject_attr(obj, name, spy):
        yield results


def record_rewards(trainer):
    """Record: what TRL's ``_calculate_rewards`` returns in the block ([N_global, n_funcs] each call, gathered),
    whichever subclass computed it (``with record_rewards(trainer) as scored``)."""
    return record_calls(trainer, "_calculate_rewards")


def record_loss_forward(trainer):
    """Record: what TRL's logprob forward ``_get_per_token_logps_and_entropies`` returns in the block,
    ``(logps [B, C], entropies [B, C] or None, aux loss or None)`` per call: inside ``_compute_loss``,
    its first call is the forward the loss is built on (graph tensors)."""
    return record_calls(trainer, "_get_per_token_logps_and_entropies")


def record_entropy_mask(trainer):
    """Record: TRL's top-entropy token masks [B, C] (``get_high_entropy_mask``, ``top_entropy_quantile``)
    computed in the block."""
    return record_calls(trainer, "get_high_entropy_mask")


@dataclass
class TaskForward:
    """What ``inject_forward_per_task`` recorded of the loss's forward."""

    pieces: dict = field(default_factory=dict)  # key -> (logps [n_k, C], entropies [n_k, C] or None, aux or None)
    rows: dict = field(default_factory=dict)  # key -> the piece's rows [n_k]; key None: one piece of every row
    merged: tuple | None = None  # (logps [B, C], entropies [B, C] or None, aux or None): what the loss got

    def merge(self) -> tuple:
        """The pieces in row order (``losses.merge_rows``), all attached; the aux loss their mean."""
        first = next(iter(self.pieces.values()))
        logps, entropies = (merge_rows({k: p[i] for k, p in self.pieces.items()}, self.rows)
                            if first[i] is not None else None for i in (0, 1))
        aux = [p[2] for p in self.pieces.values() if p[2] is not None]
        return logps, entropies, torch.stack(aux).mean() if aux else None


_TEXT_ONLY = ("batch_size", "compute_entropy", "compute_aux_loss")  # what a per-task forward may be given


@contextmanager
def inject_forward_per_task(trainer, split: dict) -> Iterator[TaskForward]:
    """Inject: the first ``_get_per_token_logps_and_entropies`` call in the block (the loss's
    forward) runs once per entry of ``split`` (task -> its rows [n_k]) at the batch's padded
    width and returns the rows merged back in order (``losses.merge_rows``), so that a task
    term's backward walks its own rows' graph only. Records the pieces and what was returned
    in the ``TaskForward`` it yields. Image inputs (which TRL slices its own way) run as one
    piece of every row; any later call in the block is TRL's, unchanged."""
    record = TaskForward()
    trl_forward = trainer._get_per_token_logps_and_entropies

    def per_task(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if record.merged is not None:
            return trl_forward(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        rows = split
        if args or any(v is not None for n, v in kwargs.items() if n not in _TEXT_ONLY):
            rows = {None: torch.arange(input_ids.size(0), device=input_ids.device)}
        for k, r in rows.items():
            record.pieces[k] = trl_forward(model, input_ids if k is None else input_ids[r],
                                           attention_mask if k is None else attention_mask[r],
                                           logits_to_keep, *args, **kwargs)
        record.rows = rows
        record.merged = record.merge()
        return record.merged

    with inject_attr(trainer, "_get_per_token_logps_and_entropies", per_task):
        yield record


@contextmanager
def record_generate(model, inject: Callable | None = None) -> Iterator[list[dict]]:
    """Record the inputs and outputs of each ``model.generate`` call in the block (I1, I3, I4);
    with ``inject(input_ids) -> dict``, inject those keyword arguments into each call (the I6
    processors, the sampler-logprob recorder). When the injected arguments ask for
    ``return_dict_in_generate`` the caller still gets the plain sequences it asked for."""
    original = model.generate
    calls = []

    def spy(*args, **kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        extra = inject(input_ids) if inject is not None else {}
        out = original(*args, **{**kwargs, **extra})
        sequences = out.sequences if hasattr(out, "sequences") else out
        calls.append({
            "input_ids": input_ids,
            "attention_mask": kwargs.get("attention_mask"),
            "output": sequences,
            "scores": getattr(out, "scores", None),
            "extra": extra,
            "stop_ids": _sampler_stop_ids(model, kwargs),  # what the sampler itself stops on
        })
        return sequences if extra.get("return_dict_in_generate") and not kwargs.get("return_dict_in_generate") else out

    with inject_attr(model, "generate", spy):
        yield calls


def _sampler_stop_ids(model, kwargs: dict) -> list[int]:
    """The eos ids a ``generate`` call stops on: its ``eos_token_id``, else its generation config's."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    ids = kwargs.get("eos_token_id", getattr(config, "eos_token_id", None))
    return [int(i) for i in ([ids] if isinstance(ids, int) else ids or [])]


def _generating_module(model):
    """The module whose ``generate`` runs the decoding loop: the model itself, or the base model under PEFT
    (the first ``GenerationMixin`` in ``model.modules()``); None if there is none."""
    modules = model.modules() if hasattr(model, "modules") else [model]
    return next((m for m in modules if isinstance(m, GenerationMixin)), None)


@contextmanager
def inject_recorders_after_warpers(model) -> Iterator[None]:
    """Within the block, every ``SampledLogprobRecorder`` handed to ``model.generate(logits_processor=...)``
    runs last, after every processor and warper that ``generate`` adds itself (temperature, top-k,
    top-p, min-p, watermarking, renormalisation): on the scores it samples from.

    transformers puts a caller's processors BEFORE its warpers (``_get_logits_processor``, 5.23).
    This shadows that method on the model's generating module (the first ``GenerationMixin`` in
    ``model.modules()``: the model itself, or the base model under PEFT) with one that moves the
    recorders to the end of the list it returns, and restores it on exit. A recorder used outside
    the block raises when read instead of returning pre-temperature logprobs.
    """
    gen = _generating_module(model)
    if gen is None:
        yield
        return
    original = gen._get_logits_processor

    def recorders_last(*args, **kwargs):  # and the recorders' taps (sampled_logprobs.arrange_processors)
        return arrange_processors(original(*args, **kwargs))

    with inject_attr(gen, "_get_logits_processor", recorders_last):
        yield


@contextmanager
def inject_deferred_stop_check(device_types: tuple[str, ...]) -> Iterator[None]:
    """Inject: in ``generate`` calls of the block decoding on a device whose type is in ``device_types``, the
    decoding loop reads its stop flag one step late (transformers' ``DeferredStopCheck``), so the host never
    waits on the device inside the loop. transformers 5.24 defers only on "mps"
    (``DeferredStopCheck.is_supported``); this shadows that static method for the block with one that also says
    yes on ``device_types`` where its other preconditions hold (no assistant model; a cache that can be cropped
    back, or that ``generate`` does not return). The loop then runs one forward more than it needs, whose token
    ``generate`` drops (``_undo_generation_steps``) and whose cache entries it crops: the sequences returned are
    those of the plain loop. That extra step runs the logits processors once more: grpotrl's recorder keeps
    only the columns of the sequences returned (``SampledLogprobRecorder.logprobs``) and its penalties keep no
    state; min-new-tokens runs on it too, and may count a trigger in a row that stopped before its minimum
    through a stop string or a user's stopping criterion (its trigger-rate metric only; the tokens returned are
    those of the plain loop).
    A sampling run draws one more token per call, so later calls draw other numbers than the plain loop's.
    A transformers without ``DeferredStopCheck`` (before 5.24) runs its loop as written: a stop read per step."""
    check = getattr(generation_utils, "DeferredStopCheck", None)
    if check is None:
        yield
        return
    original = check.is_supported

    def is_supported(device, cache, cache_is_returned, is_assistant):
        if original(device, cache, cache_is_returned, is_assistant):
            return True
        if device.type not in device_types or is_assistant:
            return False
        return cache is None or cache.is_croppable or not cache_is_returned  # transformers' own conditions

    with inject_attr(check, "is_supported", staticmethod(is_supported)):
        yield


_REFUSED_DRAW = ("probability tensor contains either `inf`, `nan` or element < 0, or a row sums to 0 "
                 "(torch.multinomial's check)")


@contextmanager
def inject_draw_one(defer_check: bool) -> Iterator[None]:
    """Inject: each ``torch.multinomial(probs, 1)`` call of the block (transformers' sampling step in
    ``GenerationMixin._sample``) draws with ``ops.sampling.draw_one``: the very tokens torch draws (the same
    exponential draws from the same generator, on CPU computed in half the time: ``ops.sampling.exponential_draws``).
    ``defer_check``: torch's check of the probabilities reads a flag from the device, one host synchronisation per
    decoding step; instead each call's rows that check would refuse (NaN, inf, a negative entry, a row summing to 0:
    ``ops.sampling.invalid_rows``) are or-ed into one flag on the device, read once when the block ends, and if any
    was seen torch's own error is raised then. Without it (CPU, where the read costs nothing) a call that torch
    would refuse raises torch's error at once. Any other call (several samples, ``out=``, a generator, not
    ``[B, V]``, another thread's: ``torch.multinomial`` is an attribute of the torch module, shadowed process-wide
    while the block runs) is torch's."""
    original = torch.multinomial
    seen: list[torch.Tensor] = []  # at most one [] bool tensor: any invalid row so far
    thread = threading.get_ident()

    def multinomial(input, num_samples, replacement=False, *, generator=None, out=None):
        if num_samples != 1 or generator is not None or out is not None or input.dim() != 2 \
                or threading.get_ident() != thread:
            return original(input, num_samples, replacement, generator=generator, out=out)
        bad = invalid_rows(input).any()  # [] bool, on the device
        if not defer_check:
            if bool(bad):
                raise RuntimeError(_REFUSED_DRAW)
        else:
            seen[:] = [seen[0] | bad] if seen else [bad]
        return draw_one(input)  # [B, 1]

    with inject_attr(torch, "multinomial", multinomial):
        yield
    if seen and bool(seen[0]):  # the one read, after the loop
        raise RuntimeError(_REFUSED_DRAW + " (read once after generate: the decoding loop sampled from such a "
                           "distribution)")


@contextmanager
def skip_finished_rows(model) -> Iterator[list[FinishedRows]]:
    """Skip: in each ``model.generate`` call of the block that decodes plainly (greedy or sampling, no
    assistant, no custom loop), the rows that have stopped leave the model's forward and its KV cache, and rows
    that repeat a prompt run its prefill once (``generation.finished_rows``); the loop still pads finished rows and
    samples for every row. Yields each such
    call's ``FinishedRows`` (its ``forward_rows``: the rows each forward ran).

    Wraps, on the model's generating module (as ``inject_recorders_after_warpers``), ``generate`` (to scope
    each call and refuse assisted or custom decoding) and ``_get_stopping_criteria`` (transformers 5.24 builds
    the loop's criteria there: ``ObservedCriteria`` hands each step's decision to the call's
    ``FinishedRows``), plus a forward pre-hook and hook for the block."""
    gen = _generating_module(model)
    calls: list[FinishedRows] = []
    if gen is None:
        yield calls
        return
    current: list[FinishedRows | None] = [None]  # the running call's, None outside a usable call
    plain = [False]  # the running generate call decodes with transformers' own loop, no assistant
    original_generate, original_criteria = gen.generate, gen._get_stopping_criteria

    def generate(*args, **kwargs):
        plain[0] = not any(kwargs.get(k) is not None for k in ("assistant_model", "custom_generate",
                                                                 "prompt_lookup_num_tokens"))
        try:
            return original_generate(*args, **kwargs)
        finally:
            current[0], plain[0] = None, False

    def criteria(generation_config, *args, **kwargs):
        built = original_criteria(generation_config, *args, **kwargs)
        mode = generation_config.get_generation_mode()
        if not plain[0] or mode not in (GenerationMode.SAMPLE, GenerationMode.GREEDY_SEARCH) \
                or not usable(generation_config, built, gen.config.is_encoder_decoder):
            return built
        current[0] = FinishedRows()
        calls.append(current[0])
        return ObservedCriteria(built, current[0].observe)

    def before(module, args, kwargs):
        return (args, current[0].before_forward(kwargs)) if current[0] is not None and not args else None

    def after(module, args, kwargs, output):
        return current[0].after_forward(output) if current[0] is not None and not args else None

    handles = [gen.register_forward_pre_hook(before, with_kwargs=True),
               gen.register_forward_hook(after, with_kwargs=True)]
    try:
        with inject_attr(gen, "generate", generate), inject_attr(gen, "_get_stopping_criteria", criteria):
            yield calls
    finally:
        for handle in handles:
            handle.remove()


def _positions_from_attention_mask(module, args, kwargs):
    """Forward pre-hook: TRL's fused logprob forward passes no position ids, so models with
    absolute positions would score left-padded rows at other positions than generate used."""
    if kwargs.get("fused_lm_head") and kwargs.get("position_ids") is None and kwargs.get("attention_mask") is not None:
        kwargs["position_ids"] = position_ids_from_mask(kwargs["attention_mask"])
    return args, kwargs


@contextmanager
def inject_compact_head(device: torch.device) -> Iterator[None]:
    """Inject: on CPU, TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) projects only the
    positions it scores (``labels != -100``) in the block, as it already does on Triton devices, instead of
    every position with the unscored ones zeroed after: the same values, without the head's matmuls and
    vocabulary-wide temporaries over prompt tokens and row tails. TRL projects every position elsewhere so
    that tile shapes do not change per batch on compiled devices (Neuron); eager CPU recompiles nothing.
    Other devices keep TRL's choice (tests/trainers/test_trl_hooks.py pins the line it reads)."""
    if device.type != "cpu":
        yield
        return
    original = trl_utils._use_triton
    with inject_attr(trl_utils, "_use_triton", lambda d: d.type == "cpu" or original(d)):
        yield


# TRL's fused head on CPU works through tiles of CPU_HEAD_TOKENS tokens x CPU_HEAD_COLUMNS vocabulary columns (TRL:
# 4096 x 32768, sized for cuBLAS and Triton). Without Triton each tile is folded by about ten elementwise torch
# passes, each over the whole tile: at 4096 x 32768 fp32, 512 MiB per temporary; at 512 x 4096 an 8 MiB tile stays
# in the last-level cache. The sizes were chosen by bench/bench_head_tiles.py (figures: docs/cost.md, "The head's
# token tiles on CPU" and "Forwards cut to their rows, and the head's vocabulary tiles").
CPU_HEAD_TOKENS = 512
CPU_HEAD_COLUMNS = 4096


@contextmanager
def inject_head_tiles(device: torch.device) -> Iterator[None]:
    """Inject: on CPU, TRL's fused LM head (``trl.kernels.chunked_logprob.ChunkedLogProbFunction``) works in tiles
    of ``CPU_HEAD_TOKENS`` tokens (TRL's ``TOKEN_CHUNK_SIZE``: 4096) by ``CPU_HEAD_COLUMNS`` vocabulary columns
    (``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``: 32768). Without Triton, each tile's torch fallback makes
    about ten passes over fp32 temporaries of the tile's size: at TRL's sizes, gigabytes, the largest transient
    of a CPU step, and every pass from main memory. Each token's logprob and entropy folds the same logits in
    more vocabulary tiles, and the weight gradient sums the same products in more token tiles (fp32 rounding).
    The forward reads both sizes at call time (the backward the token size at call time, the columns from the
    forward's ``ctx``), so the block must hold the backward (``GRPOTrainer.training_step``). Other devices keep
    TRL's sizes (tests/trainers/test_trl_hooks.py pins the reads)."""
    if device.type != "cpu":
        yield
        return
    with inject_attr(trl_chunked, "TOKEN_CHUNK_SIZE", min(CPU_HEAD_TOKENS, trl_chunked.TOKEN_CHUNK_SIZE)), \
            inject_attr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE",
                        min(CPU_HEAD_COLUMNS, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE)):
        yield


@contextmanager
def inject_end_checkpoints(keep: Callable[[str, list[str]], list[str]]) -> Iterator[None]:
    """Inject: transformers' ``Trainer._finalize_training`` lists the checkpoints its end-of-training cleanup deletes
    (under ``save_total_limit == 1`` with a best checkpoint tracked: every one but the best) with
    ``sort_checkpoints(output_dir=..., best_model_checkpoint=...)``, a name of the ``transformers.trainer`` module
    that nothing else there calls. In the block that name is shadowed (process-wide, as ``inject_draw_one``
    shadows ``torch.multinomial``) by one whose calls from this thread return ``keep(output_dir, listed)``, a
    selection of what transformers listed, in its order; a call from another thread is transformers'.
    ``trainer.args`` is not touched: a callback reading ``save_total_limit`` meanwhile sees the user's value
    (tests/trainers/test_trl_hooks.py pins the call)."""
    original = transformers_trainer.sort_checkpoints
    thread = threading.get_ident()

    def sort_checkpoints(output_dir, *args, **kwargs):
        listed = original(output_dir, *args, **kwargs)
        return listed if threading.get_ident() != thread else keep(output_dir, listed)

    with inject_attr(transformers_trainer, "sort_checkpoints", sort_checkpoints):
        yield


def inject_position_ids(*models) -> None:
    """Inject generate's position ids (``cumsum(mask) - 1``) into TRL's fused logprob forward of
    each model given (I5): a forward pre-hook for the models' lifetime, keyed on ``fused_lm_head``."""
    for m in models:
        if m is not None:
            m.register_forward_pre_hook(_positions_from_attention_mask, with_kwargs=True)


@contextmanager
def record_backbone_output(causal_lm) -> Iterator[list]:
    """Record the backbone's last hidden states [B, L, H] of every forward in the block (the
    graph tensors: logits built on them backpropagate into the loss's own forward)."""
    inner = causal_lm.get_base_model() if hasattr(causal_lm, "get_base_model") else causal_lm
    seen = []
    handle = inner.base_model.register_forward_hook(lambda m, a, out: seen.append(out.last_hidden_state))
    try:
        yield seen
    finally:
        handle.remove()


# TRL's fused LM head (trl.kernels.chunked_logprob.ChunkedLogProbFunction, trl 1.16): its backward node,
# and the positions of the head's weight and bias among its inputs and saved tensors (tests/trainers/test_trl_hooks.py)
FUSED_HEAD_NODE, HEAD_WEIGHT, HEAD_BIAS = "ChunkedLogProbFunctionBackward", 1, 2


@contextmanager
def skip_stacked_input_grad_hooks(model) -> Iterator[None]:
    """Skip: inside the block, a transformers model in ``model`` that enables its input gradients removes the hook
    it added before, so it holds one, not a stack. TRL switches gradient checkpointing off and back on around
    ``generate`` and around the rollout's no-grad logprob forwards; each switch on runs transformers'
    ``enable_input_require_grads``, which adds a forward hook on the input embeddings, and the switch off removes
    it only under an adapter transformers loaded itself. Without this, a run with checkpointing gained two hooks a
    step, every decoding step called them all, and a compiled decoding step (the compiled rollout) recompiled on
    their number at each step until torch's recompile limit stopped the run at step 9."""
    def once(m):
        enable = m.enable_input_require_grads

        def enable_once():
            m.disable_input_require_grads()  # the hooks this model's last enable added
            return enable()
        return enable_once

    with ExitStack() as stack:
        for m in model.modules():
            if isinstance(m, PreTrainedModel):
                stack.enter_context(inject_attr(m, "enable_input_require_grads", once(m)))
        yield


@contextmanager
def skip_input_grad_hooks(model) -> Iterator[None]:
    """Skip: inside the block, the forward hooks that transformers' ``enable_input_require_grads`` put on the input
    embeddings of each transformers model in ``model`` are removed; where the block leaves such a model without
    them, they are put back at its end. Each hook marks the embeddings' output as requiring a gradient, for the
    backward of a checkpointed step; under ``no_grad``, as in ``generate``, it changes nothing, and torch 2.11's
    dynamo refuses its ``requires_grad_`` inside a compiled decoding step (``Unsupported``: the compiled rollout
    stopped at its first call under gradient checkpointing on an H100). TRL's switch of gradient checkpointing back
    on after ``generate`` may add them again inside the block: then they are left as they are."""
    stripped = [m for m in model.modules()
                if isinstance(m, PreTrainedModel) and getattr(m, "_require_grads_hooks", None)]
    for m in stripped:
        m.disable_input_require_grads()
    try:
        yield
    finally:
        for m in stripped:
            if not getattr(m, "_require_grads_hooks", None):
                m.enable_input_require_grads()


@contextmanager
def skip_head_weight_grad(roots: list, inputs: list) -> Iterator[int]:
    """For ``torch.autograd.grad(root, inputs)`` calls in the block that need no gradient of the LM
    head's weight or bias: TRL's fused head computes in its backward the gradient of every input that
    required one at forward time (``ctx.needs_input_grad``), whatever the call asks for -- a dense
    ``[V, H]`` matrix for the weight, which ``autograd.grad`` then drops. Each fused-head node the
    roots' graphs reach gets the weight's and bias's flags switched off for the block and restored
    after (the Trainer's own backward of the same graph needs the weight's gradient). Nodes whose
    weight or bias is one of ``inputs`` are left as they are. Yields how many nodes it switched."""
    wanted = {t.data_ptr() for t in inputs}
    seen, stack, switched = set(), [r.grad_fn for r in roots if r.grad_fn is not None], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == FUSED_HEAD_NODE:
            saved = node.saved_tensors
            head = [t for t in saved[HEAD_WEIGHT:HEAD_BIAS + 1] if t is not None]
            if not any(t.data_ptr() in wanted for t in head):
                switched.append((node, node.needs_input_grad))
            continue  # the backbone below the head is not searched
        stack.extend(fn for fn, _ in node.next_functions)
    for node, flags in switched:
        node.needs_input_grad = tuple(False if i in (HEAD_WEIGHT, HEAD_BIAS) else f for i, f in enumerate(flags))
    try:
        yield len(switched)
    finally:
        for node, flags in switched:
            node.needs_input_grad = flags


def set_microstep_done(trainer, seconds: float) -> None:
    """Set TRL's bookkeeping of one training microstep that ran no loss (GAD's discriminator warmup),
    as trl 1.16's ``GRPOTrainer.training_step`` keeps it: ``_step`` counts microsteps (TRL's generation
    schedule in ``_prepare_inputs`` reads it), ``_current_train_step_time`` adds up ``seconds``, and
    the window's total is logged as ``step_time`` once per accumulation window (tests/trainers/test_trl_hooks.py
    pins TRL's lines)."""
    trainer._step += 1
    trainer._current_train_step_time += seconds
    if trainer._step % trainer.current_gradient_accumulation_steps == 0:
        trainer._metrics["train"]["step_time"].append(trainer._current_train_step_time)
        trainer._current_train_step_time = 0.0


def read_buffered_inputs(trainer) -> list[dict] | None:
    """TRL's ``_buffered_inputs``: the microbatches ``_prepare_inputs`` cut the current generation batch
    into (``steps_per_generation`` of them; ``None`` before the first generation). Read it; write
    through ``set_buffered_inputs``."""
    return trainer._buffered_inputs


def set_buffered_inputs(trainer, batches: list[dict]) -> dict:
    """Replace TRL's buffered microbatches with ``batches`` (as many, the same rows) and return the one
    the current microstep trains on, as trl 1.16's ``_prepare_inputs`` picks it:
    ``batches[_step % steps_per_generation]`` (tests/trainers/test_trl_hooks.py pins TRL's line)."""
    trainer._buffered_inputs = batches
    return batches[trainer._step % trainer.args.steps_per_generation]


def set_metrics(trainer, metrics: dict[str, float], mode: str) -> None:
    """Append each value to TRL's metric list of its name, ``_metrics[mode][name]``, as TRL logs its own
    (their mean is logged at the next log step, then the lists are cleared)."""
    for key, value in metrics.items():
        trainer._metrics[mode][key].append(value)


def read_metrics(trainer, mode: str = "train") -> dict[str, list]:
    """TRL's metric lists of ``mode`` (``_metrics[mode]``): name -> the values appended since the last
    log step. Read it; write through ``set_metrics``."""
    return trainer._metrics[mode]


def read_tokenizer(trainer):
    """TRL's ``_tokenizer``: the text tokenizer of ``processing_class`` (a processor's own tokenizer for a
    VLM), as ``GRPOTrainer.__init__`` and ``SFTTrainer.__init__`` set it."""
    return trainer._tokenizer


def read_is_vlm(trainer) -> bool:
    """TRL's ``_is_vlm``: whether ``processing_class`` is a multimodal processor (set in ``__init__``)."""
    return trainer._is_vlm


def read_row_tools(trainer, n: int) -> list:
    """The tools TRL renders into each of the ``n`` prompts ``_generate`` is generating, ``None`` for none:
    with ``environment_factory``, each row's environment's own (``_env_tools[name]`` over
    ``_batch_environments``, as TRL's ``_generate`` reads them), else ``trainer.tools``."""
    if trainer.environment_factories is not None:
        return [trainer._env_tools[name] or None for name in trainer._batch_environments]
    return [trainer.tools or None] * n


def read_tool_sets(trainer) -> list:
    """Every set of tools TRL renders prompts with, ``None`` for none: with ``environment_factory``, each
    environment's own (``_env_tools``), else ``trainer.tools``."""
    if trainer.environment_factories is not None:
        return [tools or None for tools in trainer._env_tools.values()]
    return [trainer.tools or None]


EntropyBonus = namedtuple("EntropyBonus", "enabled last_world_entropy")


def read_entropy_bonus(trainer) -> EntropyBonus:
    """TRL's entropy-bonus state: ``_entropy_bonus_enabled`` (``entropy_coef != 0`` or adaptive) and the
    adaptive controller's ``_last_world_entropy`` (the previous step's; ``inf`` before the first)."""
    return EntropyBonus(trainer._entropy_bonus_enabled, trainer._last_world_entropy)
