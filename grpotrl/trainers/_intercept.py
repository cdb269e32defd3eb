"""Every change grpotrl makes to a TRL method or a model at run time, in one place.

The trainers override TRL hooks by subclassing (their docstrings list them). Where a check needs
what TRL or transformers computed *inside* a hook -- the rewards TRL's ``_calculate_rewards``
returned, the logprobs the loss really used, what ``model.generate`` saw -- or needs to hand
``generate`` something TRL does not, the trainers wrap a method on the instance for the length of
one call and restore it after (one exception: ``inject_position_ids``, a forward pre-hook for the
model's lifetime). The names say which kind each is:

* ``record_*``: the wrapped call runs unchanged; its arguments or results are kept for a check.
* ``inject_*``: the call runs with something added or replaced (keyword arguments, a reordered
  processor list, position ids, a method shadowed for the block: ``inject_attr``).
* ``skip_*``: the call does less than it would, with the same result: ``skip_head_weight_grad``.
* ``set_*``: writes TRL's private fields the way TRL itself would have (``set_microstep_done``).

``TRLGenerate`` names the positions of the tuple TRL's ``_generate`` returns
(``tests/test_trl_hooks.py`` pins the layout).
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from transformers import GenerationMixin, LogitsProcessorList

from ..ops.masking import position_ids_from_mask
from ..generation.sampled_logprobs import SampledLogprobRecorder

# trl.GRPOTrainer._generate returns these, in this order (trl 1.16; tests/test_trl_hooks.py)
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
    modules = model.modules() if hasattr(model, "modules") else [model]
    gen = next((m for m in modules if isinstance(m, GenerationMixin)), None)
    if gen is None:
        yield
        return
    original = gen._get_logits_processor

    def recorders_last(*args, **kwargs):
        processors = original(*args, **kwargs)
        recorders = [p for p in processors if isinstance(p, SampledLogprobRecorder)]
        for r in recorders:
            r.placed_last = True
        return LogitsProcessorList([p for p in processors if not isinstance(p, SampledLogprobRecorder)] + recorders)

    with inject_attr(gen, "_get_logits_processor", recorders_last):
        yield


def _positions_from_attention_mask(module, args, kwargs):
    """Forward pre-hook: TRL's fused logprob forward passes no position ids, so models with
    absolute positions would score left-padded rows at other positions than generate used."""
    if kwargs.get("fused_lm_head") and kwargs.get("position_ids") is None and kwargs.get("attention_mask") is not None:
        kwargs["position_ids"] = position_ids_from_mask(kwargs["attention_mask"])
    return args, kwargs


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
# and the positions of the head's weight and bias among its inputs and saved tensors (tests/test_trl_hooks.py)
FUSED_HEAD_NODE, HEAD_WEIGHT, HEAD_BIAS = "ChunkedLogProbFunctionBackward", 1, 2


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
    the window's total is logged as ``step_time`` once per accumulation window (tests/test_trl_hooks.py
    pins TRL's lines)."""
    trainer._step += 1
    trainer._current_train_step_time += seconds
    if trainer._step % trainer.current_gradient_accumulation_steps == 0:
        trainer._metrics["train"]["step_time"].append(trainer._current_train_step_time)
        trainer._current_train_step_time = 0.0
