"""``ops.varlen``: the arguments torch's varlen kernel takes in either of its signatures give the same
attention as the per-sequence path (a CPU stand-in for the CUDA kernel with each signature's semantics)."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from grpotrl.ops.varlen import _kernel_arguments, cu_seqlens, varlen_attention


def _per_sequence(q, k, v, cu, scale, causal):  # [T, H, D] with as many key/value heads as query heads
    bounds = cu.tolist()
    out = [F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                          is_causal=causal, scale=scale).transpose(0, 1)
           for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(out)


def kernel_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    assert window_size == (-1, 0), "causal attention is window (-1, 0) in this signature"
    if enable_gqa:
        group = query.size(1) // key.size(1)
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    assert key.size(1) == query.size(1), "grouped heads need enable_gqa in this signature"
    return _per_sequence(query, key, value, cu_seq_q, scale, causal=True)


def kernel_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    assert key.size(1) == query.size(1), "no grouped-query heads in this signature"
    return _per_sequence(query, key, value, cu_seq_q, None, causal=is_causal)  # scale: always 1 / sqrt(D)


@pytest.mark.parametrize("kernel", [kernel_2_13, kernel_2_11], ids=["torch-2.13", "torch-2.9-2.11"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_kernel_arguments_give_causal_attention_at_the_scale_in_either_signature(kernel, scale):
    """Sequences of 3 and 5 tokens, 4 query heads over 2 key/value heads, head size 8: the kernel called with
    what _kernel_arguments hands it equals the per-sequence causal sdpa (varlen_attention's CPU path)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(8, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    cu = cu_seqlens([3, 5])
    expected = varlen_attention(q, k, v, cu, 5, scale=scale)  # [T, H, D]
    query, key, value, options = _kernel_arguments(inspect.signature(kernel).parameters, q, k, v, scale)
    torch.testing.assert_close(kernel(query, key, value, cu, cu, 5, 5, **options), expected)
