"""A KV cache layer that grows in place: a decoding step writes its keys and values into room left after the
cached ones, where transformers' ``DynamicLayer`` copies the whole cache into a new tensor (``torch.cat``) at
every step.

Letters: ``B`` rows, ``Hk`` key/value heads, ``n`` cached positions, ``s`` new ones, ``D`` the head size.

``GrowingLayer`` is a ``DynamicLayer`` whose ``keys`` and ``values`` ``[B, Hk, n, D]`` are the first ``n``
positions of buffers ``[B, Hk, n + room, D]``; an update that fits writes ``[n, n + s)`` in place and returns
the views ``[B, Hk, n + s, D]``; one that does not (or follows a method that replaced ``keys``: beam
reordering) copies the cache once into new buffers with ``ROOM`` positions to spare. A row selection (the
finished-row rollout's ``batch_select_indices``) gathers the rows straight into such buffers. Every other
method is ``DynamicLayer``'s, on the views (``crop`` leaves a shorter view of the same buffers). The attention reads the
views as it read the concatenated tensors (strided along the positions: CPU sdpa gives the same bits).
On SmolLM2's 64 rows at 200 cached positions one ``torch.cat`` of a layer's keys took 0.42 ms, 25 ms a decoding
step over 30 layers' keys and values.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

ROOM = 32  # positions to spare after a copy: one copy per 32 decoding steps, at most 32 positions of memory


class GrowingLayer(DynamicLayer):
    """transformers' ``DynamicLayer``, its keys and values growing in place (module docstring)."""

    _key_room: torch.Tensor | None = None  # [B, Hk, n + room, D] the buffers the views are the start of
    _value_room: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """``DynamicLayer.update``: the cache with ``key_states, value_states [B, Hk, s, D]`` appended; returns
        the keys and values ``[B, Hk, n + s, D]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, s = self.get_seq_length(), key_states.shape[-2]
        if not (self._holds_views() and n + s <= self._key_room.shape[-2]):
            self._key_room, self._value_room = (_room(self.keys, key_states, n), _room(self.values, value_states, n))
        self._key_room[:, :, n:n + s] = key_states
        self._value_room[:, :, n:n + s] = value_states
        self.keys, self.values = self._key_room[:, :, :n + s], self._value_room[:, :, :n + s]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """``DynamicLayer.batch_select_indices``, the rows written straight into new buffers with ``ROOM``
        positions to spare: one copy, where a selection and the next update's move would make two."""
        n = self.get_seq_length()
        if n == 0:
            return
        rows = torch.as_tensor(indices, device=self.keys.device)
        rows = rows.nonzero().view(-1) if rows.dtype == torch.bool else rows  # [b]
        self._key_room, self._value_room = _selected(self.keys, rows, n), _selected(self.values, rows, n)
        self.keys, self.values = self._key_room[:, :, :n], self._value_room[:, :, :n]

    def _holds_views(self) -> bool:
        """The keys and values are still the start of the buffers: no ``DynamicLayer`` method replaced them
        (``crop`` keeps a shorter view of them; beam reordering makes new tensors)."""
        return self._key_room is not None and all(
            t is not None and t._base is room and t.data_ptr() == room.data_ptr()
            for t, room in ((self.keys, self._key_room), (self.values, self._value_room)))

    def reset(self) -> None:
        """``DynamicLayer.reset``, the buffers dropped too."""
        self._key_room = self._value_room = None
        super().reset()


def _room(cached: torch.Tensor, new: torch.Tensor, n: int) -> torch.Tensor:
    """A buffer ``[B, Hk, n + s + ROOM, D]`` holding ``cached``'s ``n`` positions first (``new``: the update's
    ``[B, Hk, s, D]``, for the shape, dtype and device)."""
    B, H, s, D = new.shape
    room = new.new_empty((B, H, n + s + ROOM, D))
    if n:
        room[:, :, :n] = cached
    return room


def _selected(cached: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """A buffer ``[b, Hk, n + ROOM, D]`` holding the rows ``rows [b]`` of ``cached [B, Hk, n, D]`` first,
    gathered straight into it."""
    room = cached.new_empty((rows.numel(), cached.size(1), n + ROOM, cached.size(3)))
    torch.index_select(cached, 0, rows, out=room[:, :, :n])  # writes into the view: no intermediate tensor
    return room


def grow_in_place(cache) -> None:
    """Each of ``cache``'s layers that is exactly a ``DynamicLayer`` and holds nothing yet becomes a
    ``GrowingLayer`` (a ``DynamicCache`` before its prefill); any other layer is left as it is."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and not layer.is_initialized:
            cache.layers[i] = GrowingLayer()
