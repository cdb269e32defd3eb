"""Causal attention over sequences laid end to end in one row, kept apart by their boundaries: pure tensor math.

Letters: ``T`` tokens of the row (every sequence's, end to end), ``N`` sequences, ``H`` query heads, ``Hk``
key/value heads (``H`` a multiple of ``Hk``: grouped-query attention), ``D`` the head size.

``cu_seqlens`` are the boundaries ``[0, n_0, n_0 + n_1, ..., T]`` (``N + 1`` ints); a token attends to the
earlier tokens of its own sequence and itself, nothing else, with no ``[T, T]`` mask anywhere. On CUDA in
fp16/bf16 (the inputs', or autocast's: ``kernel_dtype``) this is torch's own FlashAttention varlen kernel
(``torch.nn.attention.varlen.varlen_attn``); on every other device or dtype, one causal
``scaled_dot_product_attention`` per sequence, sliced by the boundaries (its cost is each sequence's own ``n^2``,
summed).

``padded_varlen_attention``: a padded batch ``[B, L]`` through the same attention, each row's kept tokens (the
mask's) one sequence: the padded forward computed by the kernel the packed forwards use.

``tree_attention``: sequences that share a prompt, laid out as trees (the shared prefix once, then each
sequence's own tokens): a prefix token attends to the earlier prefix tokens, a sequence's own token to the whole
prefix and the earlier tokens of its own part; one sdpa per prefix and per sequence, over the prefix's keys and
its own (each sequence's ``n (p + n)``, summed), with no ``[T, T]`` mask.
"""

from __future__ import annotations

import functools
import inspect
import itertools

import torch
import torch.nn.functional as F

VARLEN_DTYPES = (torch.float16, torch.bfloat16)  # what torch's FlashAttention varlen kernel takes
KERNEL_DEVICES = ("cuda",)  # the device types torch's varlen kernel runs on


def cu_seqlens(lengths: list[int], device: torch.device | str | None = None) -> torch.Tensor:
    """The boundaries of sequences of ``lengths`` tokens laid end to end: ``[0, cumulative sums...]``, int32
    (the kernel's index type).

    >>> cu_seqlens([3, 5, 2]).tolist()
    [0, 3, 8, 10]
    """
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_length: int, scale: float | None = None, half_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Causal attention of ``query [T, H, D]`` over ``key, value [T, Hk, D]`` within each sequence that
    ``cu_seqlens [N + 1]`` delimits (``max_length``: the longest sequence's tokens; ``scale``: the
    softmax scale, ``D ** -0.5`` when None; ``half_dtype``: autocast's dtype where it is on, see ``kernel_dtype``).
    Returns ``[T, H, D]``, in the kernel's dtype on CUDA. No dropout, no window, no softcap."""
    gqa = query.size(1) != key.size(1)
    target = kernel_dtype(query, key, value, half_dtype)
    if query.device.type in KERNEL_DEVICES and target is not None:
        varlen_attn, parameters = _kernel()
        cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
        query, key, value = (x.to(target) for x in (query, key, value))
        query, key, value, options = _kernel_arguments(parameters, query, key, value, scale)
        return varlen_attn(query, key, value, cu, cu, max_length, max_length, **options)
    bounds = cu_seqlens.tolist()  # N + 1 ints (a host transfer where cu_seqlens lives on an accelerator)
    # 4-D inputs, as transformers' sdpa passes them: on CPU a 3-D call takes another kernel, which in bf16 moved
    # most of SmolLM2's logprobs by ~1e-2 nats against the padded forward (4-D: the same bits)
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, H, T, D], [1, Hk, T, D]
    out = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scale,
                                          enable_gqa=gqa)  # [1, H, n, D]
           for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(out, dim=2)[0].transpose(0, 1)  # [T, H, D]


def padded_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                            scale: float | None = None, half_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Causal attention of a padded batch, each row's kept tokens as one sequence of ``varlen_attention`` (the
    same kernel, laid out from the mask alone): ``query [B, H, L, D]``, ``key, value [B, Hk, L, D]``, ``mask
    [B, L]`` (True: a token; None: every token of every row). A kept token attends to the row's earlier kept
    tokens and itself, as sdpa under the padded causal mask does; a padding token's output is zero. Returns
    ``[B, L, H, D]`` (transformers' attention output), in the kernel's dtype on CUDA.

    >>> q = torch.tensor([[0., 0.], [0., 0.], [0., 0.]]).view(1, 1, 3, 2)
    >>> v = torch.tensor([[9., 9.], [1., 2.], [3., 4.]]).view(1, 1, 3, 2)  # the first token is padding
    >>> padded_varlen_attention(q, q, v, torch.tensor([[False, True, True]]))[0, :, 0].tolist()
    [[0.0, 0.0], [1.0, 2.0], [2.0, 3.0]]
    """
    B, H, L, D = query.shape
    keep = torch.ones(B, L, dtype=torch.bool, device=query.device) if mask is None else mask.bool()  # [B, L]
    lengths = keep.sum(1).tolist()  # B ints (a host transfer where the mask lives on an accelerator)
    if not any(lengths):
        return query.new_zeros(B, L, H, D)
    q, k, v = (x.transpose(1, 2)[keep] for x in (query, key, value))  # [T, H, D], [T, Hk, D]: row by row
    out = varlen_attention(q, k, v, cu_seqlens([n for n in lengths if n], query.device),
                           max(lengths), scale=scale, half_dtype=half_dtype)  # [T, H, D]
    return out.new_zeros(B, L, H, D).index_put_((keep,), out)  # [B, L, H, D]


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, trees: list[tuple[int, list[int]]],
                   scale: float | None = None) -> torch.Tensor:
    """Attention of ``query [T, H, D]`` over ``key, value [T, Hk, D]`` within each tree of ``trees`` (end to end,
    ``(p, [n_0, n_1, ...])`` each: a prefix of ``p`` tokens, then sequences of ``n_i`` tokens that continue it): a
    prefix token sees the prefix up to itself, a sequence's token the whole prefix and its own sequence up to
    itself. ``p = 0``: the sequences are independent causal ones (``varlen_attention``'s). Returns ``[T, H, D]``.
    No dropout, no window, no softcap; any device and dtype (one sdpa per prefix and per sequence, 4-D as
    transformers' sdpa calls it: on CPU a 3-D call takes another kernel)."""
    gqa = query.size(1) != key.size(1)
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, H, T, D], [1, Hk, T, D]
    sizes = [n for p, lengths in trees for n in ([p] if p else []) + list(lengths)]
    # split, not slices: its backward writes each part's gradient once, where a slice's zero-fills the whole row
    qs, ks, vs = (x.split(sizes, dim=2) for x in (q, k, v))
    out, i = [], 0
    for p, lengths in trees:
        if p:
            prefix_k, prefix_v = ks[i], vs[i]  # [1, Hk, p, D]
            out.append(F.scaled_dot_product_attention(qs[i], prefix_k, prefix_v, is_causal=True, scale=scale,
                                                      enable_gqa=gqa))  # [1, H, p, D]
            i += 1
        for n in lengths:
            if p:
                out.append(F.scaled_dot_product_attention(qs[i], torch.cat([prefix_k, ks[i]], 2),
                                                          torch.cat([prefix_v, vs[i]], 2),
                                                          attn_mask=_prefix_causal(n, p, query.device),
                                                          scale=scale, enable_gqa=gqa))  # [1, H, n, D]
            else:
                out.append(F.scaled_dot_product_attention(qs[i], ks[i], vs[i], is_causal=True, scale=scale,
                                                          enable_gqa=gqa))
            i += 1
    return torch.cat(out, dim=2)[0].transpose(0, 1)  # [T, H, D]


@functools.lru_cache(maxsize=1024)
def _prefix_causal(n: int, p: int, device: torch.device) -> torch.Tensor:
    """``[n, p + n]`` True where a sequence's token sees a key: every key ``j < p`` (the prefix) and its own
    tokens up to itself (key ``p + j'``, ``j' <=`` the query's place). The same for every layer, the recompute
    and the backward of a forward: built once per shape.

    >>> _prefix_causal(2, 1, torch.device("cpu")).int().tolist()
    [[1, 1, 0], [1, 1, 1]]
    """
    return torch.ones(n, p + n, dtype=torch.bool, device=device).tril(p)


def kernel_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 half_dtype: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype torch's varlen kernel computes in (it takes fp16 or bf16 inputs of one dtype): the inputs' own
    where all three are one of those; else ``half_dtype`` where it is one, as transformers' FlashAttention casts
    an fp32 query to autocast's dtype (under autocast over fp32 weights the rotary embedding hands the attention
    an fp32 query and key beside a bf16 value); else None: no kernel, the per-sequence sdpa.

    >>> q, v = torch.zeros(1, 1, 1), torch.zeros(1, 1, 1, dtype=torch.bfloat16)
    >>> kernel_dtype(v, v, v), kernel_dtype(q, q, v), kernel_dtype(q, q, v, torch.bfloat16), kernel_dtype(q, q, q)
    (torch.bfloat16, None, torch.bfloat16, None)
    """
    if query.dtype in VARLEN_DTYPES and query.dtype == key.dtype == value.dtype:
        return query.dtype
    return half_dtype if half_dtype in VARLEN_DTYPES else None


@functools.cache
def _kernel():
    """torch's varlen kernel and its signature's parameters, read once (CUDA only: it raises NotImplementedError
    elsewhere)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, inspect.signature(varlen_attn).parameters


def _kernel_arguments(parameters, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """``varlen_attn``'s inputs and keyword arguments for causal attention at ``scale``, whichever of its two
    signatures the installed torch has (``parameters``: its ``inspect.signature(...).parameters``): torch 2.13
    takes ``window_size=(-1, 0)``, ``scale`` and ``enable_gqa``; torch 2.9-2.11 take ``is_causal=True`` and
    neither of the others, so there the query carries the scale (``scale * sqrt(D)`` times the kernel's
    ``1 / sqrt(D)``) and each key/value head is repeated for its group of query heads ([T, Hk, D] -> [T, H, D])."""
    options = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    if scale is not None:
        if "scale" in parameters:
            options["scale"] = scale
        elif abs(scale * query.size(-1) ** 0.5 - 1) > 1e-6:  # the kernel's own 1 / sqrt(D) otherwise: no extra pass
            query = query * (scale * query.size(-1) ** 0.5)
    if query.size(1) != key.size(1):
        if "enable_gqa" in parameters:
            options["enable_gqa"] = True
        else:
            group = query.size(1) // key.size(1)
            key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)  # [T, H, D]
    return query, key, value, options
