"""Finished rows leave ``generate``'s decoding batch, and rows of one prompt run its prefill once: the model
runs the rows still generating only.

Letters: ``B`` rows of the ``generate`` call, ``b`` of them still generating (``b <= B``), ``V``
vocabulary, ``S`` tokens fed per decoding step (1), ``T`` tokens in the KV cache.

transformers' sampling loop (``GenerationMixin._sample``, 5.24) runs the model on all ``B`` rows at
every step until the last row stops; a row that has stopped gets the pad token whatever its logits
say (``next_tokens * unfinished + pad * (1 - unfinished)``, where a stopping criterion with an
``eos_token_id`` is in the list). With completions of uneven length that is the padding of the
rollout: the rows that have stopped still run every layer and grow their KV cache.

``FinishedRows`` keeps the rows that have stopped out of the model's forward, and hands the loop
back what it expects:

* ``before_forward(kwargs)`` on the prefill: the cache's plain layers grow in place from then on
  (``growing_cache.GrowingLayer``: a decoding step writes into room after the cached positions, where
  ``DynamicLayer`` copies the whole cache); where rows repeat one another (a GRPO generation batch holds
  each prompt ``num_generations`` times), one row of each runs (``input_ids``, ``attention_mask``,
  ``position_ids`` equal: the same prefill); ``after_forward`` copies its KV cache entries and logits to the
  rows that repeat it (``DynamicCache.batch_select_indices`` with repeated indices);
* ``observe(is_done)``: each step's ``stopping_criteria(input_ids, scores)`` ``[B]`` (the loop's own
  decision: ``unfinished = unfinished & ~is_done``), so a row counts as finished exactly when the loop
  pads it from then on;
* ``before_forward(kwargs)``: on a decoding step, drops the finished rows from the KV cache
  (``DynamicCache.batch_select_indices``, when the set changed; the ``cache`` argument) and from the batch inputs
  (``input_ids``, ``attention_mask``, ``position_ids``), each cut along its batch axis: dim 0, and for
  ``position_ids`` the one before the sequence axis, as transformers lays them out (``[B, L]``, or
  ``[k, B, L]`` for multimodal rope: Qwen2-VL's ``[4, B, L]``, which a Qwen2-VL model passes even for text);
* ``after_forward(output)``: the logits ``[b, S, V]`` back to ``[B, S, V]``, zeros in the finished
  rows' places. The loop pads those rows, so their logits choose nothing; the sampler still draws for
  all ``B`` rows (``torch.multinomial`` on ``[B, V]``), so the random stream is the one the full batch
  would use.

On SmolLM2 in fp32 on CPU the prefill of 8 distinct rows gives the same bits as that of their 64 copies
(logits and every layer's keys). The rows still generating get the logits the full batch would give them up to
the attention kernel's rounding (on CPU, sdpa's results move by about 1e-7 with the batch size: a sampled token
can then flip where two tokens' draws are that close, as between any two machines).

It is used only where the loop's result stays the same (``usable``): the plain decoding loop (``_sample``; not
beam search or assisted decoding), a loop that pads finished rows, a ``DynamicCache`` of full-attention or
sliding-window layers, nothing returned beyond the sequences (no scores, logits or cache), no other tensor among
the model's inputs (nor in a dict, list or tuple among them: ``mm_token_type_ids [B, L]``, a ``[k, B]`` layout,
``pixel_values``), and each of the three above holding the B rows on
its batch axis (a ``[1, L]`` ``position_ids`` broadcast over the rows is not cut). Elsewhere the call runs as
transformers wrote it. Where a decoding step's inputs stop being such after rows have left the cache, the call
stops with a ``RuntimeError``: the rows cannot be put back.
At least one row always stays in the forward, so a process whose rows have all stopped but that keeps
running forwards for the others (ZeRO-3's ``synced_gpus``) runs a forward of one row.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, StoppingCriteriaList
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .growing_cache import GrowingLayer, grow_in_place

BATCH_INPUTS = ("input_ids", "attention_mask", "position_ids")  # the decoding step's inputs with one row per row
# whose batch_select_indices keeps every row's state
CACHE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, GrowingLayer)


def usable(generation_config, stopping_criteria, is_encoder_decoder: bool) -> bool:
    """Whether a plain decoding loop (``_sample``) may run without its finished rows: the loop pads them (a
    criterion with an ``eos_token_id``), returns the sequences alone, and the model is a decoder."""
    pads_finished = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    return pads_finished and not generation_config.return_dict_in_generate and not is_encoder_decoder


class ObservedCriteria(StoppingCriteriaList):
    """``generate``'s stopping criteria, unchanged, each step's ``[B]`` decision handed to ``observe``."""

    def __init__(self, criteria, observe):
        super().__init__(criteria)
        self.observe = observe

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        is_done = super().__call__(input_ids, scores, **kwargs)  # [B]
        self.observe(is_done)
        return is_done


class FinishedRows:
    """The rows of one decoding loop still in the model's forward (module docstring)."""

    def __init__(self):
        self.finished: torch.Tensor | None = None  # [B] bool, the loop's ``~unfinished`` after each step
        self.live: torch.Tensor | None = None  # [b] ascending row indices in the forward and the cache
        self.rows: int | None = None  # B, from the first forward
        self.off = False  # a loop this class cannot vouch for: it runs as transformers wrote it
        self.forward_rows: list[int] = []  # the rows each forward ran (a measure, and for tests)
        self.copies: torch.Tensor | None = None  # [B] the prefill's row each row copies (rows repeating one another)
        self.cache = None  # the prefill's cache, to copy its entries to the repeated rows

    def observe(self, is_done: torch.Tensor) -> None:
        """The loop's stopping decision of one step, ``[B]`` bool."""
        self.finished = is_done.clone() if self.finished is None else self.finished | is_done

    def before_forward(self, kwargs: dict) -> dict:
        """The forward's keyword arguments, the finished rows left out on a decoding step."""
        ids = kwargs.get("input_ids")
        if self.off:
            return kwargs
        if self.rows is None:  # the prefill: all rows; decide once whether the loop can be vouched for
            self.rows = ids.size(0) if isinstance(ids, torch.Tensor) else 0
            self.live = torch.arange(self.rows, device=ids.device) if self.rows else None
            self.off = self.rows < 2 or not _plain_inputs(kwargs, self.rows)
            if self.off:
                self.forward_rows.append(self.rows)
                return kwargs
            return self._prefill(kwargs)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5.24 names it ``cache``
        if self.live.numel() == self.rows and not _droppable(cache, kwargs, self.rows):
            self.off = True  # nothing dropped yet: the loop goes on with every row
            return kwargs
        if not _plain_inputs(kwargs, self.rows):
            shapes = {name: tuple(v.shape) for name, v in kwargs.items() if isinstance(v, torch.Tensor)}
            raise RuntimeError(
                f"A decoding step of generate passed inputs {shapes} after finished rows left its KV cache; "
                f"the rows left out ({self.rows - self.live.numel()} of {self.rows}) cannot be cut from them or put "
                "back. Run with padding_free=False, which keeps every row in the decoding batch.")
        keep = (~self.finished).nonzero().squeeze(1) if self.finished is not None else self.live  # [b'] ascending
        if keep.numel() == 0:
            keep = self.live[:1]  # every row stopped and the loop runs on (synced_gpus): a forward of one row
        if keep.numel() != self.live.numel():  # rows only ever stop: keep is a subset of live
            cache.batch_select_indices(torch.searchsorted(self.live, keep))
            self.live = keep
        self.forward_rows.append(self.live.numel())
        return kwargs if self.live.numel() == self.rows else _rows_of(kwargs, self.live)

    def _prefill(self, kwargs: dict) -> dict:
        """The prefill's keyword arguments, where the empty cache's layers can copy rows: its plain layers made to
        grow in place (``growing_cache``), and one row of each set of rows that repeat one another (their
        ``BATCH_INPUTS`` equal) where some do (``copies`` set)."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not isinstance(cache, DynamicCache) or not cache.layers or not _copyable_layers(cache):
            self.forward_rows.append(self.rows)
            return kwargs
        grow_in_place(cache)
        inputs = [kwargs[name].movedim(_batch_dim(name, kwargs[name]), 0).reshape(self.rows, -1).long()
                  for name in BATCH_INPUTS if isinstance(kwargs.get(name), torch.Tensor)]  # [B, ...] each
        distinct, copies = torch.unique(torch.cat(inputs, dim=1), dim=0, return_inverse=True)  # [u, ...], [B]
        if distinct.size(0) == self.rows:
            self.forward_rows.append(self.rows)
            return kwargs
        first = torch.full((distinct.size(0),), self.rows, device=copies.device).scatter_reduce(
            0, copies, torch.arange(self.rows, device=copies.device), "amin")  # [u] the first row of each
        self.copies, self.cache = copies, cache
        self.forward_rows.append(first.numel())
        return _rows_of(kwargs, first)

    def after_forward(self, output):
        """The forward's output, its logits ``[b, S, V]`` back in ``[B, S, V]`` (zeros for finished rows; on the
        prefill, a repeated row's copied from the row that ran)."""
        if self.copies is not None:  # the prefill ran one row of each repeated set: copy to every row
            self.cache.batch_select_indices(self.copies)
            output.logits = output.logits.index_select(0, self.copies)  # [u, S, V] -> [B, S, V]
            self.copies = self.cache = None
            return output
        if self.off or self.live is None or self.live.numel() == self.rows:
            return output
        logits = output.logits  # [b, S, V]
        full = logits.new_zeros((self.rows, *logits.shape[1:]))  # [B, S, V]
        output.logits = full.index_copy(0, self.live, logits)
        return output


def _batch_dim(name: str, value: torch.Tensor) -> int:
    """The batch axis of a ``BATCH_INPUTS`` tensor: ``position_ids``' is the one before the sequence axis
    (``[B, L]``; ``[k, B, L]`` for multimodal rope, the layout transformers' own ``generate`` expands), the others'
    is 0."""
    return value.ndim - 2 if name == "position_ids" else 0


def _plain_inputs(kwargs: dict, rows: int) -> bool:
    """Every ``BATCH_INPUTS`` entry is absent, ``None`` or a tensor holding the ``rows`` rows on its batch axis
    (``_batch_dim``; not a ``[1, L]`` broadcast), and no other tensor is among a forward's inputs, nor in the dicts,
    lists and tuples among them (images, token types, embeddings, a ``[k, B]`` or ``[1, B, L]`` layout, pixel values
    whose first axis counts patches, not rows: this class would not know to cut them or which rows they belong to;
    one that belongs to no row keeps every row in the forward, which costs only the rows' compute).
    ``cache_position`` ``[S]`` holds positions, not rows."""
    for name, value in kwargs.items():
        if name in BATCH_INPUTS:
            least = 2 if name == "position_ids" else 1  # position ids [B, L] or [k, B, L]; the others [B, ...]
            if value is not None and not (isinstance(value, torch.Tensor) and value.ndim >= least
                                          and value.size(_batch_dim(name, value)) == rows):
                return False
        elif name != "cache_position" and _tensors_in(value):
            return False
    return True


def _tensors_in(value) -> list[torch.Tensor]:
    """The tensors ``value`` is or holds in its dicts, lists and tuples (a ``ModelOutput`` is a dict), at any
    depth; other objects (the cache) hold none here."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    return []


def _droppable(cache, kwargs: dict, rows: int) -> bool:
    """A decoding step whose cache can lose rows and whose inputs are ``BATCH_INPUTS`` alone."""
    return (isinstance(cache, DynamicCache) and cache.get_seq_length() > 0 and _copyable_layers(cache)
            and _plain_inputs(kwargs, rows))


def _copyable_layers(cache: DynamicCache) -> bool:
    """Every layer of ``cache`` is one whose ``batch_select_indices`` keeps each selected row's whole state."""
    return all(type(layer) in CACHE_LAYERS for layer in cache.layers)


def _rows_of(kwargs: dict, rows: torch.Tensor) -> dict:
    """A forward's keyword arguments with ``BATCH_INPUTS`` cut to ``rows [b]`` along their batch axis
    (``_batch_dim``), everything else as it is."""
    return {name: value.index_select(_batch_dim(name, value), rows)
            if name in BATCH_INPUTS and isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}


def decoding_share(calls: list[FinishedRows]) -> float:
    """The share of the decoding batch's row-steps the model ran, over ``calls`` (1.0: no row dropped)."""
    ran = sum(sum(c.forward_rows) for c in calls)
    full = sum(c.rows * len(c.forward_rows) for c in calls if c.rows)
    return ran / full if full else 1.0
