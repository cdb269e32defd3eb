"""``ops.varlen``: the arguments torch's varlen kernel takes in either of its signatures give the same
attention as the per-sequence path (a CPU stand-in for the CUDA kernel with each signature's semantics); the padded
batch through the same attention is sdpa under the padded causal mask."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from grpotrl.ops.varlen import _kernel_arguments, cu_seqlens, padded_varlen_attention, tree_attention, varlen_attention


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


def _tree_mask(trees: list[tuple[int, list[int]]]) -> torch.Tensor:
    """[T, T] True where a query may see a key, from the definition: within one tree, a prefix token sees the prefix
    up to itself; a sequence's token sees the whole prefix and its own sequence up to itself."""
    tree, part, place = [], [], []  # each token's tree, part (-1: the prefix), place within its part
    for t, (p, lengths) in enumerate(trees):
        tree += [t] * p
        part += [-1] * p
        place += list(range(p))
        for i, n in enumerate(lengths):
            tree += [t] * n
            part += [i] * n
            place += list(range(n))
    T = len(tree)
    seen = torch.zeros(T, T, dtype=torch.bool)
    for a in range(T):
        for b in range(T):
            if tree[a] != tree[b]:
                continue
            if part[b] == -1:  # a prefix key: seen by the tree's own tokens, and by prefix tokens at or after it
                seen[a, b] = part[a] != -1 or place[b] <= place[a]
            else:
                seen[a, b] = part[a] == part[b] and place[b] <= place[a]
    return seen


def test_tree_attention_equals_dense_sdpa_under_the_tree_mask_with_grouped_query_heads():
    """Trees (2, [1, 3]), (0, [2]) and (1, [2]): T = 11, 6 query heads over 2 key/value heads; values, and the
    gradients of query, key and value, equal a dense sdpa under the [T, T] tree mask (float64)."""
    torch.manual_seed(0)
    trees = [(2, [1, 3]), (0, [2]), (1, [2])]
    T, H, Hk, D = 11, 6, 2, 4
    mask = _tree_mask(trees)
    # by hand: token 2 (the first tree's first row, 1 token) sees the prefix 0, 1 and itself; token 3 (the second
    # row's first) sees 0, 1 and itself, not token 2; token 10 (the last tree's second own token) sees the prefix 8,
    # its row's 9 and itself
    assert mask[2].nonzero().flatten().tolist() == [0, 1, 2]
    assert mask[3].nonzero().flatten().tolist() == [0, 1, 3]
    assert mask[5].nonzero().flatten().tolist() == [0, 1, 3, 4, 5]
    assert mask[7].nonzero().flatten().tolist() == [6, 7]
    assert mask[10].nonzero().flatten().tolist() == [8, 9, 10]
    q = torch.randn(T, H, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, Hk, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(T, Hk, D, dtype=torch.float64, requires_grad=True)
    out = tree_attention(q, k, v, trees, scale=0.3)  # [T, H, D]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1),
                                         v.repeat_interleave(3, 1).transpose(0, 1), attn_mask=mask,
                                         scale=0.3).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    # a tree with no prefix is varlen_attention's causal sequences
    flat = tree_attention(q, k, v, [(0, [4, 7])], scale=0.3)
    torch.testing.assert_close(flat, varlen_attention(q, k, v, cu_seqlens([4, 7]), 7, scale=0.3), atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tree_attention_in_low_precision_is_the_dense_masked_sdpa_but_for_rounding(dtype):
    """bf16/fp16 as the tree attention receives them in a CPU run: within two rounding steps of the dense masked
    sdpa, and most values the same."""
    torch.manual_seed(1)
    trees = [(5, [7, 3, 9]), (0, [6])]
    T = 5 + 7 + 3 + 9 + 6
    q, k, v = (torch.randn(T, h, 16).to(dtype) for h in (4, 2, 2))
    out = tree_attention(q, k, v, trees)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                         v.transpose(0, 1).unsqueeze(0), attn_mask=_tree_mask(trees),
                                         enable_gqa=True)[0].transpose(0, 1)
    step = torch.finfo(dtype).eps * ref.abs().clamp_min(1)
    assert ((out.float() - ref.float()).abs() <= 2 * step.float()).all()
    assert (out != ref).float().mean() < 0.25


# rows of 8 positions: left padding (a prompt), right padding (a stopped completion), a hole, none, nothing kept
PADDED_ROWS = [[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0], [0, 1, 1, 0, 1, 1, 1, 0], [1] * 8, [0] * 8]


def test_padded_varlen_attention_equals_sdpa_under_the_padded_causal_mask():
    """I5's reference where the packed forwards run torch's varlen kernel: each row's kept tokens one sequence.
    A kept token's output is sdpa's under the causal mask and the row's key mask (a hole's key unseen, as sdpa
    masks it); a padding token's is zero. 4 query heads over 2 key/value heads, head size 8, fp32."""
    torch.manual_seed(0)
    keep = torch.tensor(PADDED_ROWS, dtype=torch.bool)  # [B, L]
    B, L = keep.shape
    q, k, v = torch.randn(B, 4, L, 8), torch.randn(B, 2, L, 8), torch.randn(B, 2, L, 8)
    out = padded_varlen_attention(q, k, v, keep, scale=0.3)  # [B, L, H, D]
    mask = torch.ones(L, L, dtype=torch.bool).tril() & keep[:, None, None, :]  # [B, 1, L, L]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True).transpose(1, 2)
    assert out.shape == (B, L, 4, 8)
    torch.testing.assert_close(out[keep], expected[keep], atol=1e-6, rtol=1e-5)
    assert (out[~keep] == 0).all()
    torch.testing.assert_close(padded_varlen_attention(q, k, v, None), padded_varlen_attention(
        q, k, v, torch.ones(B, L, dtype=torch.bool)))  # no mask: every token kept


def test_padded_varlen_attention_hands_the_kernel_each_rows_kept_tokens_as_one_sequence(monkeypatch):
    """On the kernel's device the padded batch reaches the kernel as one call: the kept tokens row by row, with
    one boundary per row that keeps any (here through the torch-2.13 stand-in kernel on CPU, in bf16)."""
    import grpotrl.ops.varlen as varlen

    calls = []

    def recording(query, key, value, cu_q, cu_k, max_q, max_k, **options):
        calls.append((cu_q.tolist(), max_q, query.shape[0]))
        return kernel_2_13(query, key, value, cu_q, cu_k, max_q, max_k, **options)

    monkeypatch.setattr(varlen, "KERNEL_DEVICES", ("cpu",))
    monkeypatch.setattr(varlen, "_kernel", lambda: (recording, inspect.signature(kernel_2_13).parameters))
    torch.manual_seed(0)
    keep = torch.tensor(PADDED_ROWS, dtype=torch.bool)
    q, k, v = (torch.randn(5, h, 8, 8, dtype=torch.bfloat16) for h in (4, 2, 2))
    out = padded_varlen_attention(q, k, v, keep)
    assert calls == [([0, 5, 10, 15, 23], 8, 23)]
    monkeypatch.setattr(varlen, "KERNEL_DEVICES", ())
    # the per-sequence sdpa, but for bf16 rounding (the stand-in runs sdpa 3-D, another CPU kernel)
    torch.testing.assert_close(out, padded_varlen_attention(q, k, v, keep), atol=2**-6, rtol=0)
