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
@pytest.mark.parametrize("scale", [None, 0.3, 8**-0.5])  # 8**-0.5: the kernel's own (head size 8)
def test_kernel_arguments_give_causal_attention_at_the_scale_in_either_signature(kernel, scale):
    """Sequences of 3 and 5 tokens, 4 query heads over 2 key/value heads, head size 8: the kernel called with
    what _kernel_arguments hands it equals the per-sequence causal sdpa (varlen_attention's CPU path)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(8, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    cu = cu_seqlens([3, 5])
    expected = varlen_attention(q, k, v, cu, 5, scale=scale)  # [T, H, D]
    query, key, value, options = _kernel_arguments(inspect.signature(kernel).parameters, q, k, v, scale)
    torch.testing.assert_close(kernel(query, key, value, cu, cu, 5, 5, **options), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_path_equals_the_padded_masked_sdpa_but_for_last_bit_rounding_in_low_precision(dtype):
    """I5 compares the packed logprobs with a padded forward. Under CPU autocast the attention gets the query and
    key in fp32 (the rotary embedding promotes them) and the value in ``dtype``; there the per-sequence path must
    take the kernel that transformers' sdpa takes on the padded batch (``[N, H, W, D]`` with a boolean causal and
    key-padding mask): equal but for a last-bit rounding in under 2% of the values (measured: 0.1% in bf16, 0.6% in
    fp16; the masked padding keys change the kernel's blocks). 3-D inputs take another kernel on CPU: a third of
    the values differed, and on SmolLM2 in bf16 the guard's median gap rose from 0 to ~1e-2 nats, half its bound.
    Sequences of 37, 5 and 64 tokens, 9 query heads over 3 key/value heads, head size 64 (SmolLM2's)."""
    torch.manual_seed(0)
    lengths, H, Hk, D = [37, 5, 64], 9, 3, 64
    T, W = sum(lengths), max(lengths)
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hk, D), torch.randn(T, Hk, D).to(dtype)
    cu = cu_seqlens(lengths)
    with torch.autocast("cpu", dtype=dtype):
        out = varlen_attention(q, k, v, cu, W)  # [T, H, D]
        padded = [torch.zeros(len(lengths), W, x.size(1), D, dtype=x.dtype) for x in (q, k, v)]  # [N, W, h, D]
        for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            for x, p in zip((q, k, v), padded):
                p[i, : b - a] = x[a:b]
        qp, kp, vp = (p.transpose(1, 2) for p in padded)  # [N, h, W, D]
        real = torch.arange(W) < torch.tensor(lengths).unsqueeze(1)  # [N, W]
        mask = torch.ones(W, W, dtype=torch.bool).tril() & real[:, None, None, :]  # [N, 1, W, W]
        group = H // Hk
        ref = F.scaled_dot_product_attention(qp, kp.repeat_interleave(group, 1), vp.repeat_interleave(group, 1),
                                             attn_mask=mask)  # [N, H, W, D]
    expected = torch.cat([ref[i, :, :n].transpose(0, 1) for i, n in enumerate(lengths)])  # [T, H, D]
    assert out.dtype == expected.dtype == dtype
    differ = (out != expected).float().mean().item()
    assert differ < 0.02, f"{differ:.1%} of the values differ from the padded sdpa's"
    assert (out.float() - expected.float()).abs().max().item() <= 2**-6  # one bf16 step at |x| < 4 (the outputs here are)


@pytest.mark.parametrize("kernel", [kernel_2_13, kernel_2_11], ids=["torch-2.13", "torch-2.9-2.11"])
def test_the_kernel_gets_one_half_dtype_under_autocast_over_fp32_weights(kernel, monkeypatch):
    """Under autocast over fp32 weights the rotary embedding hands the attention an fp32 query and key beside a
    bf16 value; the kernel takes fp16/bf16 inputs of one dtype. The CUDA branch (run here on CPU with a stand-in
    kernel that refuses anything else) casts all three to autocast's dtype, as transformers' FlashAttention does,
    rather than leaving the kernel for the per-sequence path."""
    import grpotrl.ops.varlen as varlen

    seen = []

    def half_only(query, key, value, *args, **kwargs):
        seen.append((query.dtype, key.dtype, value.dtype))
        assert query.dtype == key.dtype == value.dtype == torch.bfloat16
        return kernel(query, key, value, *args, **kwargs)

    monkeypatch.setattr(varlen, "KERNEL_DEVICES", ("cpu",))
    monkeypatch.setattr(varlen, "_kernel", lambda: (half_only, inspect.signature(kernel).parameters))
    torch.manual_seed(0)
    q, k, v = torch.randn(8, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8).to(torch.bfloat16)
    cu = cu_seqlens([3, 5])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = varlen_attention(q, k, v, cu, 5, half_dtype=torch.bfloat16)
    assert seen == [(torch.bfloat16,) * 3] and out.dtype == torch.bfloat16
    monkeypatch.setattr(varlen, "KERNEL_DEVICES", ())
    expected = varlen_attention(q.bfloat16(), k.bfloat16(), v, cu, 5)  # the per-sequence sdpa on the same inputs
    torch.testing.assert_close(out, expected, atol=2**-6, rtol=0)
    # fp32 throughout, no autocast: no kernel (it would refuse fp32), the per-sequence sdpa
    monkeypatch.setattr(varlen, "KERNEL_DEVICES", ("cpu",))
    assert varlen_attention(q, k, v.float(), cu, 5).dtype == torch.float32 and len(seen) == 1
