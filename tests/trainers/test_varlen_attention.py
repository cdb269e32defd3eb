"""packed_attention='varlen': each padding-free forward's sequences in one row, kept apart by their boundaries.

The attention by hand on small tensors (two sequences of 3 and 5 tokens, grouped-query heads) against a dense
block-causal mask; the boundaries of a packing plan by hand; the transformers and torch names it relies on;
varlen == padded (TRL's ``_get_per_token_logps_and_entropies``) for the logprobs, entropies, loss and gradients
of every loss type in fp32 on CPU (the per-sequence sdpa path, and the tree attention where rows share their
prompt: 1e-5 relative, as the mask path's tests); the model switched back after each call; the resolution of ``packed_attention`` and its refusals. The CUDA kernel
(torch's FlashAttention varlen, bf16) is not run here: no GPU.
"""

import contextlib
import inspect
import logging
from types import SimpleNamespace

import pytest
import torch
import transformers
import torch.nn.functional as F
from conftest import arithmetic_prompts, length_reward
from test_padding_free import (_assert_every_loss_type_equal, _assert_really_packed, _forward, _rel,
                               _step_grads_and_microbatches, _tiny_model, _trainer)

import grpotrl
from grpotrl.configs.checks import check_packed_attention
from grpotrl.errors import InputError, InvariantError
from grpotrl.ops.packing import pack
from grpotrl.ops.varlen import cu_seqlens, varlen_attention
from grpotrl.trainers import packed_attention, padding_free


# ---------------------------------------------------------------- the attention, by hand

def _block_causal(lengths: list[int]) -> torch.Tensor:
    """[T, T] True where a query may see a key: its own sequence's earlier tokens and itself."""
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])  # [T] each token's sequence
    T = seq.numel()
    return (seq.view(-1, 1) == seq.view(1, -1)) & torch.ones(T, T, dtype=torch.bool).tril()


def test_varlen_attention_equals_dense_block_causal_sdpa_with_grouped_query_heads():
    # two sequences of 3 and 5 tokens: T = 8, boundaries [0, 3, 8]; 6 query heads over 2 key/value heads
    torch.manual_seed(0)
    T, H, Hk, D = 8, 6, 2, 4
    q = torch.randn(T, H, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, Hk, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(T, Hk, D, dtype=torch.float64, requires_grad=True)
    cu = cu_seqlens([3, 5])
    assert cu.tolist() == [0, 3, 8]
    out = varlen_attention(q, k, v, cu, max_length=5, scale=0.3)  # [T, H, D]
    # the dense reference: each key/value head repeated for its 3 query heads, a [T, T] block-causal mask
    mask = _block_causal([3, 5])
    assert mask[3].tolist() == [False] * 3 + [True] + [False] * 4  # the second sequence's first token sees itself
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1),
                                         v.repeat_interleave(3, 1).transpose(0, 1), attn_mask=mask,
                                         scale=0.3).transpose(0, 1)  # [T, H, D]
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    # query head h uses key/value head h // 3: the first sequence's first token is its own value
    torch.testing.assert_close(out[0, 4], v[0, 1].detach(), atol=1e-12, rtol=0)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_the_boundaries_of_a_packing_plan_by_hand():
    # sequences of 3, 5 and 2 tokens end to end: boundaries [0, 3, 8, 10]
    assert cu_seqlens([3, 5, 2]).tolist() == [0, 3, 8, 10]
    assert cu_seqlens([3, 5, 2]).dtype == torch.int32
    # three padded rows (L = 6, K = 3; 0 is pad) of 3, 5 and 2 real tokens, capacity 6:
    # first-fit decreasing: 5 -> row 0 (room 1); 3 -> row 1 (room 3); 2 -> row 1 (room 1)  => [[1], [0, 2]]
    ids = torch.tensor([[0, 0, 11, 12, 13, 0],
                        [21, 22, 23, 24, 25, 0],
                        [0, 0, 31, 32, 0, 0]])
    p = pack(ids, (ids != 0).long(), logits_to_keep=3, capacity=6)
    assert p.spans == [[5], [3, 2]] and p.widths == [5, 5]
    # a varlen forward of both rows lays row 0 then row 1 end to end: 5, 3, 2 -> [0, 5, 8, 10]
    assert cu_seqlens([n for r in (0, 1) for n in p.spans[r]]).tolist() == [0, 5, 8, 10]
    # with shared prompts a span is a tree (its prefix once and each row's own tokens)
    shared = torch.tensor([[0, 7, 8, 9, 10], [0, 7, 8, 11, 0]])  # prompt [7, 8] twice: tree 7 | 8 9 10 | 8 11
    p = pack(shared, (shared != 0).long(), 2, capacity=6, share_prompts=True)
    assert p.spans == [[6]] and p.trees == [[(1, [3, 2])]]  # prefix 7; own 8 9 10 and 8 11
    assert pack(shared, (shared != 0).long(), 2, capacity=6).trees == [[(0, [4])], [(0, [3])]]  # nothing shared


def test_varlen_with_shared_prompts_runs_a_groups_rows_in_one_tree_of_up_to_a_forwards_tokens(tiny_llama, grpo_args,
                                                                                                monkeypatch):
    """Under varlen a prompt's rows share it whole: one tree of up to ``batch_size x L`` tokens (the tokens of one
    of TRL's padded chunks), each packed row one forward, where the mask path's trees stop at ``L``. Two prompts
    of 3 tokens, 3 rows each, completions of 2-4 tokens (L = 7, K = 4): with batch_size 3 each prompt is one tree
    of 2 + (1 + n) per row tokens, one forward each; the mask path's trees hold one row each."""
    model = _trainer(tiny_llama, grpo_args, gradient_checkpointing=False)[0].model  # with TRL's fused head
    ids = torch.tensor([[1, 2, 3, 4, 5, 0, 0], [1, 2, 3, 6, 7, 8, 0], [1, 2, 3, 9, 10, 11, 12],
                        [13, 14, 15, 22, 23, 0, 0], [13, 14, 15, 16, 17, 0, 0], [13, 14, 15, 18, 19, 20, 21]])
    attn = (ids != 0).long()
    seen = []
    original = packed_attention.tree_attention

    def recording(query, key, value, trees, scale=None):
        seen.append((query.size(0), trees))
        return original(query, key, value, trees, scale)

    monkeypatch.setattr(packed_attention, "tree_attention", recording)
    with torch.no_grad():
        out, _ = padding_free.packed_logps_and_entropies(model, ids, attn, 4, 3, False, contextlib.nullcontext,
                                                        share_prompts=True, attention="varlen")
        ref, _ = padding_free.packed_logps_and_entropies(model, ids, attn, 4, 3, False, contextlib.nullcontext)
    layers = model.config.num_hidden_layers
    # prompt [1, 2, 3]: prefix [1, 2], own 3 4 5 | 3 6 7 8 | 3 9 10 11 12 -> 2 + 3 + 4 + 5 = 14 tokens
    # prompt [13, 14, 15]: prefix [13, 14], own 15 22 23 | 15 16 17 | 15 18 19 20 21 -> 2 + 3 + 3 + 5 = 13 tokens
    # (a tree's rows longest first, as share_plan places them)
    assert sorted(seen) == sorted([(14, [(2, [5, 4, 3])])] * layers + [(13, [(2, [5, 3, 3])])] * layers)
    # the mask path's trees stop at L = 7: prefix 2 + own 3, 4 or 5, no two rows of a prompt together: 6 trees
    assert pack(ids, attn, 4, capacity=7, share_prompts=True).trees == [[(2, [n])] for n in (5, 5, 4, 3, 3, 3)]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_the_attention_function_takes_transformers_signature_and_refuses_what_it_does_not_compute():
    torch.manual_seed(0)
    module = SimpleNamespace(is_causal=True)
    q, k, v = torch.randn(1, 4, 7, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)  # [1, H, T, D]
    cu = cu_seqlens([4, 3])
    out, weights = packed_attention.attention_forward(module, q, k, v, None, dropout=0.0, scaling=0.5,
                                                      cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4,
                                                      max_length_k=4, position_ids=None)
    assert out.shape == (1, 7, 4, 8) and weights is None  # [1, T, H, D], as transformers' sdpa returns
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                         attn_mask=_block_causal([4, 3]), scale=0.5).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    bounds = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4, max_length_k=4)
    for kw, what in ((dict(dropout=0.1), "attention dropout"), (dict(sliding_window=4), "a sliding window"),
                     (dict(softcap=50.0), "softcapped logits"), (dict(is_causal=False), "non-causal")):
        with pytest.raises(InputError, match=rf"{what}.*packed_attention='mask'"):
            packed_attention.attention_forward(module, q, k, v, None, **{**bounds, **kw})
    with pytest.raises(InputError, match="only some of the sequence boundaries"):
        packed_attention.attention_forward(module, q, k, v, None, cu_seq_lens_q=cu)
    # without boundaries (a padded forward): transformers' sdpa with the mask it is given
    module = SimpleNamespace(is_causal=True, num_key_value_groups=2)
    mask = _block_causal([4, 3])
    out, _ = packed_attention.attention_forward(module, q, k, v, mask, scaling=0.5)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    with pytest.raises(InputError, match="2 rows"):
        packed_attention.attention_forward(module, q.expand(2, -1, -1, -1), k, v, None, **bounds)


# ---------------------------------------------------------------- the names relied on

def test_the_transformers_and_torch_names_varlen_relies_on():
    """transformers' AttentionInterface.register, the mask interface with grpotrl's mask function (sdpa's, or
    FlashAttention's 2-D mask inside ``padded``), set_attn_implementation and the dispatch heuristic, FlashAttentionKwargs' names (which
    the model's forward passes to the attention function), and torch's varlen_attn's signature."""
    import transformers
    from torch.nn.attention.varlen import varlen_attn
    from transformers import masking_utils
    from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert transformers.AttentionInterface.register.__func__  # a classmethod updating the global mapping
    packed_attention.register()
    assert packed_attention.NAME in ALL_ATTENTION_FUNCTIONS.valid_keys()
    assert ALL_ATTENTION_FUNCTIONS[packed_attention.NAME] is packed_attention.attention_forward
    # grpotrl's mask function: sdpa's, so that a forward without boundaries runs as under sdpa
    assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS[packed_attention.NAME] is packed_attention.mask_function
    assert list(inspect.signature(masking_utils.sdpa_mask).parameters)[:2] == ["batch_size", "q_length"] or \
        "allow_is_causal_skip" in inspect.signature(masking_utils.sdpa_mask).parameters
    # inside ``padded``: FlashAttention's mask function, the 2-D mask (None where it keeps every token)
    keep = torch.tensor([[False, True, True]])
    assert torch.equal(masking_utils.flash_attention_mask(batch_size=1, q_length=3, kv_length=3, attention_mask=keep),
                       keep)
    assert masking_utils.flash_attention_mask(batch_size=1, q_length=3, kv_length=3,
                                              attention_mask=torch.ones(1, 3, dtype=torch.bool)) is None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    assert list(inspect.signature(sdpa_attention_forward).parameters)[:5] == ["module", "query", "key", "value",
                                                                              "attention_mask"]
    assert set(FlashAttentionKwargs.__annotations__) >= {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                                         "max_length_k"}
    assert callable(transformers.PreTrainedModel.set_attn_implementation)
    assert isinstance(transformers.LlamaForCausalLM._can_set_attn_implementation(), bool)
    params = inspect.signature(varlen_attn).parameters
    assert list(params)[:7] == ["query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k"]
    # one of the two signatures ops.varlen._kernel_arguments knows (torch 2.13; torch 2.9-2.11)
    assert {"scale", "window_size", "enable_gqa"} <= set(params) or "is_causal" in params
    if not torch.cuda.is_available():  # CUDA only: what the CPU path exists for
        x = torch.randn(4, 2, 8, dtype=torch.bfloat16)
        with pytest.raises((NotImplementedError, RuntimeError)):
            varlen_attn(x, x, x, cu_seqlens([4]), cu_seqlens([4]), 4, 4)


# ---------------------------------------------------------------- varlen == padded (fp32, CPU)

@pytest.fixture(params=[False, True], ids=["sequences", "shared-prompts"])
def varlen(monkeypatch, request):
    """The trainer's packed forwards under varlen, however grpo.py passes them: each sequence on its own (the kernel's
    layout), and each prompt once for its rows (the tree attention, ``ops.varlen.tree_attention``)."""
    packed, tree_attention = padding_free.packed_logps_and_entropies, packed_attention.tree_attention
    trees = []  # each tree attention call's trees

    def run(*args, **kwargs):
        return packed(*args, **{**kwargs, "attention": "varlen", "share_prompts": request.param})

    def recording(query, key, value, trees_, scale=None):
        trees.append(trees_)
        return tree_attention(query, key, value, trees_, scale)

    monkeypatch.setattr(padding_free, "packed_logps_and_entropies", run)
    monkeypatch.setattr(packed_attention, "tree_attention", recording)
    yield
    # shared prompts: the test's forwards ran trees that share a prefix; without: none ran
    assert bool(trees) == request.param and all(any(p for p, _ in t) for t in trees)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gpt2"])
def test_I5_varlen_logprobs_and_entropies_equal_padded(arch, request, grpo_args, varlen):
    """Rotary (llama, 4 query heads over 2 key/value heads) and absolute positions (gpt2): per token, in TRL's
    [B, C] layout, zeros where TRL leaves zeros, with TRL's batch_size chunking; the model runs its own
    attention again afterwards."""
    trainer, inputs = _trainer(request.getfixturevalue(arch), grpo_args, gradient_checkpointing=False)
    _assert_really_packed(inputs)
    for batch_size in (None, 3):
        trainer.padding_free = False
        lp0, h0, _ = _forward(trainer, trainer.model, inputs, batch_size=batch_size)
        trainer.padding_free = True
        lp1, h1, _ = _forward(trainer, trainer.model, inputs, batch_size=batch_size)
        assert trainer.model.config._attn_implementation == "sdpa"
        lp0, h0, lp1, h1 = lp0.detach(), h0.detach(), lp1.detach(), h1.detach()
        assert _rel(lp1, lp0) < 1e-5 and _rel(h1, h0) < 1e-5, (_rel(lp1, lp0), _rel(h1, h0))
        torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
        assert (lp1[inputs["completion_mask"] == 0] == 0).all()


def test_I5_varlen_logprobs_equal_padded_in_bf16(tiny_llama, grpo_args, varlen):
    """``bf16=True`` on CPU (autocast over fp32 weights: the rotary embedding hands the attention an fp32 query and
    key and a bf16 value): the varlen logprobs are the padded forward's but for rounding in a few tokens, median
    gap 0 (the I5 guard allows 0.02). Measured: 2% of 295 tokens differ here, none on SmolLM2; an attention of
    3-D per-sequence calls, which take another CPU kernel, moved 98% of them (SmolLM2: median 1.1e-2 nats)."""
    trainer, inputs = _trainer(tiny_llama, grpo_args, gradient_checkpointing=False, bf16=True)
    _assert_really_packed(inputs)
    out = []
    for on in (False, True):
        trainer.padding_free = on
        with torch.no_grad():
            out.append(_forward(trainer, trainer.model, inputs, entropy=False)[0])
    gap = (out[1] - out[0]).abs()[inputs["completion_mask"].bool()]  # [loss tokens]
    assert gap.isfinite().all() and gap.numel() > 20
    moved = (gap > 0).float().mean().item()
    assert gap.median().item() == 0 and moved < 0.25, (gap.median().item(), moved)


def _loss_and_grads(trainer, inputs):
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    out = []
    for on in (False, True):
        trainer.padding_free = on
        loss = trainer._compute_loss(trainer.model, inputs)
        out.append((loss.detach(), torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])))
    (l0, g0), (l1, g1) = out
    assert g0.norm() > 0 and l0.abs() > 1e-4, (l0, g0.norm())
    return _rel(l1, l0), _rel(g1, g0)


@pytest.mark.parametrize("beta", [pytest.param(0.0, marks=pytest.mark.slow), 0.04])  # 0.04 adds the KL to the same loss
def test_varlen_loss_and_gradients_equal_padded_for_every_loss_type(beta, tiny_llama, grpo_args, varlen):
    trainer, inputs = _trainer(tiny_llama, grpo_args, beta=beta, num_iterations=2, gradient_checkpointing=False)
    _assert_really_packed(inputs)
    _assert_every_loss_type_equal(trainer, inputs, _loss_and_grads)


def test_varlen_under_gradient_checkpointing_gives_the_padded_loss_and_gradients(tiny_llama, grpo_args, varlen):
    """TRL's default, gradient checkpointing: the backward recomputes each layer, inside the trainer's step-wide
    switch to varlen (``GRPOTrainer._policy_attention``, around ``training_step``), with the boundaries it was first
    called with; a padded forward inside the switch (the reference here, I5's recompute on guard steps) runs sdpa.
    Loss and gradients equal the padded step's within fp32 rounding."""
    trainer, inputs = _trainer(tiny_llama, grpo_args, beta=0.04, gradient_checkpointing=True)
    # as transformers' Trainer turns it on when training starts (these tests skip its loop)
    trainer.model.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(
        trainer.args.activation_checkpointing_kwargs or {}) or None)
    assert packed_attention.pretrained_of(trainer.model).is_activation_checkpointing
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    out = []
    for on in (False, True):
        trainer.padding_free = on
        trainer.packed_attention = "varlen" if on else "mask"
        trainer.model.zero_grad(set_to_none=True)
        with trainer._policy_attention(trainer.model):
            loss = trainer._compute_loss(trainer.model, inputs)
            loss.backward()
        out.append((loss.detach(), torch.cat([p.grad.flatten() for p in params])))
    (l0, g0), (l1, g1) = out
    assert g0.norm() > 0 and _rel(l1, l0) < 1e-5 and _rel(g1, g0) < 1e-5, (_rel(l1, l0), _rel(g1, g0))
    assert trainer.model.config._attn_implementation == "sdpa"


def test_varlen_with_lora_equals_padded(tiny_llama, grpo_args, varlen):
    """LoRA: the model is PEFT-wrapped, the transformers model inside it is switched."""
    from peft import LoraConfig

    trainer, inputs = _trainer(tiny_llama, grpo_args, beta=0.04, gradient_checkpointing=False,
                               peft=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    loss_rel, grad_rel = _loss_and_grads(trainer, inputs)
    assert loss_rel < 1e-5 and grad_rel < 1e-5, (loss_rel, grad_rel)
    assert packed_attention.pretrained_of(trainer.model).config._attn_implementation == "sdpa"


def test_forwards_agreed_across_processes_run_varlen_on_padding(tiny_llama, grpo_args):
    """ZeRO-3's extra forwards (a 2-token row of padding) run under varlen with their own boundaries."""
    trainer, inputs = _trainer(tiny_llama, grpo_args, gradient_checkpointing=False)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    K = inputs["completion_ids"].size(1)
    args = (trainer.model, ids, attn, K, None, False, contextlib.nullcontext)
    calls = []
    alone, _ = padding_free.packed_logps_and_entropies(*args, attention="varlen")
    agreed, _ = padding_free.packed_logps_and_entropies(*args, attention="varlen",
                                                        agree_forwards=lambda n: calls.append(n) or n + 2)
    assert calls == [1]
    torch.testing.assert_close(agreed, alone, atol=1e-6, rtol=0)


def test_the_model_is_switched_back_after_an_error_and_a_nested_switch_leaves_it_to_the_outer(tiny_llama):
    model = _tiny_model(tiny_llama)
    with pytest.raises(RuntimeError, match="boom"), packed_attention.running(model):
        assert model.config._attn_implementation == packed_attention.NAME
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    with packed_attention.running(model):
        with packed_attention.running(model):
            pass
        assert model.config._attn_implementation == packed_attention.NAME
    assert model.config._attn_implementation == "sdpa"


# ---------------------------------------------------------------- resolution, refusals, the startup line

def _args(**kw):
    return SimpleNamespace(**{"packed_attention": "auto", "gradient_checkpointing": False, "disable_dropout": True,
                              **kw})


def test_a_varlen_forward_builds_no_mask_and_every_layer_runs_varlen(tiny_llama, monkeypatch):
    """Inside ``bounded`` transformers asks grpotrl's mask function and gets none (without it, restarting position
    ids make it build a [1, 1, T, T] mask nothing reads); outside, the same model builds sdpa's mask. A forward in
    which fewer attention calls ran varlen than the model has layers stops with I5."""
    from transformers import masking_utils

    model = _tiny_model(tiny_llama)
    built = []
    real = masking_utils.sdpa_mask
    monkeypatch.setattr(packed_attention, "sdpa_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    ids, pos = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[0, 1, 2, 0, 1]])
    cu = cu_seqlens([3, 2])
    with torch.no_grad(), packed_attention.running(model):
        with packed_attention.bounded(model):
            model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=3, max_length_k=3)
        assert built == []
        model(input_ids=ids, attention_mask=torch.ones_like(ids))  # a padded forward: sdpa's mask
        assert built
        with pytest.raises(InvariantError, match=r"\[I5\].*0 attention calls.*2 layers.*packed_attention='mask'"):
            with packed_attention.bounded(model):
                pass  # no forward: no layer ran varlen


def test_a_padded_forward_inside_padded_runs_the_varlen_attention_row_by_row(tiny_llama, monkeypatch):
    """I5's recompute where torch's kernel runs the packed forwards: the padded batch (a left-padded prompt, a
    stopped completion, a full row) inside ``padded`` gets the 2-D mask and each attention layer runs the varlen
    attention over each row's kept tokens, once per layer; its logits equal sdpa's padded forward at every kept
    token (fp32, the per-sequence path). On the kernel's branch (a stand-in on CPU) each layer hands the kernel the
    batch's rows as one call of 3 sequences. A forward that did not run it (the model not switched) stops with I5."""
    import grpotrl.ops.varlen as varlen
    from grpotrl.ops.masking import position_ids_from_mask

    model = _tiny_model(tiny_llama)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0], [1] * 7])  # [B, L]
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 0, 0], [9, 8, 7, 6, 5, 4, 3]])
    batch = dict(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False)
    keep = mask.bool()
    ran = []
    monkeypatch.setattr(packed_attention, "padded_varlen_attention",
                        lambda *a, **k: ran.append(a[3]) or varlen.padded_varlen_attention(*a, **k))
    with torch.no_grad():
        expected = model(**batch).logits  # [B, L, V] sdpa
        with packed_attention.running(model), packed_attention.padded(model):
            out = model(**batch).logits
    assert len(ran) == model.config.num_hidden_layers and all(torch.equal(m, keep) for m in ran)
    torch.testing.assert_close(out[keep], expected[keep], atol=1e-5, rtol=1e-5)
    calls = []

    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        calls.append((cu_seq_q.tolist(), max_q))
        return torch.zeros_like(query)

    monkeypatch.setattr(varlen, "KERNEL_DEVICES", ("cpu",))
    monkeypatch.setattr(varlen, "_kernel", lambda: (kernel, inspect.signature(kernel).parameters))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), packed_attention.running(model), \
            packed_attention.padded(model):
        model(**batch)
    assert calls == [([0, 5, 10, 17], 7)] * model.config.num_hidden_layers
    with pytest.raises(InvariantError, match=r"\[I5\].*0 attention calls of a padded forward.*2 layers"):
        with torch.no_grad(), packed_attention.padded(model):
            model(**batch)  # sdpa: not switched to grpotrl's attention


def test_under_autocast_over_fp32_weights_every_layer_hands_the_kernel_one_half_dtype(tiny_llama, monkeypatch):
    """``bf16: true`` over fp32 weights: the rotary embedding hands each attention layer an fp32 query and key beside
    a bf16 value, and torch's kernel takes one half dtype. Through the model's own forward, with the kernel's branch
    taken on CPU (a stand-in with torch 2.9-2.11's signature that records what it gets), every layer gives it bf16
    query, key and value, in autocast's dtype, as transformers' FlashAttention casts them."""
    import grpotrl.ops.varlen as varlen

    seen = []

    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        seen.append((query.dtype, key.dtype, value.dtype, is_causal))
        return torch.zeros_like(query)

    monkeypatch.setattr(varlen, "KERNEL_DEVICES", ("cpu",))
    monkeypatch.setattr(varlen, "_kernel", lambda: (kernel, inspect.signature(kernel).parameters))
    model = _tiny_model(tiny_llama)
    ids, pos, cu = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[0, 1, 2, 0, 1]]), cu_seqlens([3, 2])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), packed_attention.running(model), \
            packed_attention.bounded(model):
        model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=3, max_length_k=3)
    assert seen == [(torch.bfloat16, torch.bfloat16, torch.bfloat16, True)] * model.config.num_hidden_layers


def test_auto_is_varlen_only_where_measured_faster_and_an_explicit_setting_is_honoured(tiny_llama):
    """'auto' is varlen on CPU in fp32 (measured faster there, docs/cost.md; bf16 and fp16 were not measured, and
    stay on the mask), and the mask elsewhere until measured; 'varlen' and 'mask' are honoured everywhere; a config
    without the field (trl.GRPOConfig) keeps the mask."""
    model = _tiny_model(tiny_llama)
    assert padding_free.VARLEN_MEASURED_FASTER_ON == ("cpu",)
    assert padding_free.resolve_packed_attention(_args(), model, model, "cpu", packed=True) == ("varlen", None)
    for precision, dtype in (({"bf16": True}, "bfloat16"), ({"fp16": True}, "float16")):  # measured in fp32 only
        assert padding_free.resolve_packed_attention(_args(**precision), model, model, "cpu", packed=True) == (
            "mask", f"varlen was measured faster than the mask on cpu in fp32 only, and this run computes in {dtype}; "
            "see docs/cost.md")
    assert padding_free.resolve_packed_attention(_args(), _tiny_model(tiny_llama).to(torch.bfloat16), None, "cpu",
                                                 packed=True)[0] == "mask"  # bf16 weights
    assert padding_free.resolve_packed_attention(_args(packed_attention="varlen", bf16=True), model, None, "cpu",
                                                 packed=True) == ("varlen", None)  # asked for: honoured
    assert padding_free.resolve_packed_attention(_args(), model, None, "cpu", packed=False) == \
        ("mask", "padding_free is off, and varlen runs the padding-free forwards")
    for device in ("cuda", "xpu"):
        assert padding_free.resolve_packed_attention(_args(bf16=True), model, None, device, packed=True) == (
            "mask", f"varlen not measured faster than the mask on {device}; see docs/cost.md")
    for device in ("cpu", "cuda", "xpu"):
        assert padding_free.resolve_packed_attention(_args(packed_attention="varlen"), model, model, device,
                                                     packed=True) == ("varlen", None)
        assert padding_free.resolve_packed_attention(_args(packed_attention="mask"), model, None, device, True) == \
            ("mask", None)
    assert padding_free.resolve_packed_attention(SimpleNamespace(), model, None, "cpu", True) == ("mask", None)


def test_auto_on_a_kernel_device_is_varlen_in_bf16_and_fp16_only(tiny_llama, monkeypatch):
    """Once a device is measured faster, 'auto' there is varlen where the kernel runs it: in bf16 or fp16 (autocast's
    or the weights'); an fp32 run stays on the mask and says why; an explicit 'varlen' in fp32 is honoured (one
    sdpa per sequence)."""
    model = _tiny_model(tiny_llama)
    monkeypatch.setattr(padding_free, "VARLEN_MEASURED_FASTER_ON", ("cuda",))
    monkeypatch.setattr(padding_free, "_varlen_kernel_missing", lambda: None)
    for precision in ({"bf16": True}, {"fp16": True}):
        assert padding_free.resolve_packed_attention(_args(**precision), model, None, "cuda", True) == ("varlen", None)
    assert padding_free.resolve_packed_attention(_args(), model.to(torch.bfloat16), None, "cuda", True) == \
        ("varlen", None)  # bf16 weights without autocast
    choice, why = padding_free.resolve_packed_attention(_args(), model.float(), None, "cuda", True)
    assert choice == "mask" and "fp32" in why and "bf16: true" in why
    assert padding_free.resolve_packed_attention(_args(packed_attention="varlen"), model, None, "cuda", True) == \
        ("varlen", None)


def test_the_varlen_kernel_is_honoured_with_the_guards_on(tiny_llama, monkeypatch):
    """On CUDA in bf16/fp16 torch's FlashAttention kernel rounds every token otherwise than sdpa (an H100: median
    gap 0.022-0.032 nats, I5's bound 0.02), so I5's recompute runs through the kernel too (``padded``): an explicit
    'varlen' is honoured with the guards on or off, and 'auto' stays on the mask on CUDA, where varlen was not
    measured faster."""
    model = _tiny_model(tiny_llama)
    monkeypatch.setattr(padding_free, "_varlen_kernel_missing", lambda: None)
    for precision in ({"bf16": True}, {"fp16": True}):
        for guard_steps in (2, -1, 0):
            args = _args(packed_attention="varlen", guard_steps=guard_steps, **precision)
            assert padding_free.resolve_packed_attention(args, model, None, "cuda", True) == ("varlen", None)
            assert padding_free.kernel_runs(args, model, "cuda", "varlen")
        choice, why = padding_free.resolve_packed_attention(_args(guard_steps=-1, **precision), model, None, "cuda",
                                                            True)
        assert choice == "mask" and "not measured faster" in why
    assert not padding_free.kernel_runs(_args(), model.float(), "cuda", "varlen")  # fp32: one sdpa per sequence
    assert not padding_free.kernel_runs(_args(bf16=True), model, "cpu", "varlen")  # no kernel on CPU


def test_prompts_are_shared_under_varlen_except_where_the_kernel_runs_it(tiny_llama):
    """torch's varlen kernel takes sequence boundaries, not trees: on CUDA in bf16/fp16 varlen runs each sequence on
    its own; on CPU, and in fp32 anywhere, the tree attention shares each prompt (``GRPOTrainer.__init__``)."""
    model = _tiny_model(tiny_llama)
    assert padding_free.kernel_runs(_args(bf16=True), model, "cuda", "varlen")
    assert padding_free.kernel_runs(_args(fp16=True), model, "cuda", "varlen")
    assert not padding_free.kernel_runs(_args(), model, "cuda", "varlen")  # fp32: one sdpa per sequence or tree
    assert not padding_free.kernel_runs(_args(bf16=True), model, "cpu", "varlen")
    assert not padding_free.kernel_runs(_args(bf16=True), model, "cuda", "mask")


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_varlen_trees_regroup_a_step_by_prompt_and_keep_the_step_gradient(loss_type, tiny_llama, grpo_args):
    """Under varlen with shared prompts a forward runs each of its prompts once whatever its rows' lengths, so the
    balanced microbatches hold one prompt each (2 prompts x 4 answers, 2 microbatches of 4) where TRL's shuffle
    mixed them; the optimizer step's gradient and logged loss are TRL's grouping's (1e-5 relative)."""
    kw = {"packed_attention": "varlen", "loss_type": loss_type}
    off, g_off, loss_off, seen_off = _step_grads_and_microbatches(tiny_llama, grpo_args, balance_microbatches=False,
                                                                  **kw)
    on, g_on, loss_on, seen_on = _step_grads_and_microbatches(tiny_llama, grpo_args, **kw)
    assert on.share_prompts and on.packed_attention == "varlen" and on.balance_microbatches
    assert sorted(r for _, rows, _ in seen_on for r in rows) == sorted(r for _, rows, _ in seen_off for r in rows)
    assert [p for *_, p in seen_on] == [1, 1], seen_on
    assert any(p > 1 for *_, p in seen_off), seen_off  # TRL's shuffle mixed the prompts (seeded): a real regrouping
    assert g_off.norm() > 0 and _rel(g_on, g_off) < 1e-5
    assert loss_on == pytest.approx(loss_off, rel=1e-5, abs=1e-7)  # at step 1 the policy loss is about 0


def test_varlen_refusals_name_the_cause_and_what_to_do(tiny_llama, tiny_gpt2):
    model = _tiny_model(tiny_llama)
    on = _args(packed_attention="varlen")
    gpt2 = _tiny_model(tiny_gpt2)  # GPT2Attention.attn_dropout: p 0.1, handed to the attention in training mode
    assert padding_free.resolve_packed_attention(on, gpt2, None, "cpu", True) == ("varlen", None)  # disable_dropout
    assert padding_free._attention_dropout_modules(gpt2)[:2] == ["transformer.h.0.attn.attn_dropout",
                                                                 "transformer.h.0.attn.resid_dropout"]
    cases = [
        (dict(packed=False), model, "padding_free is off"),
        (dict(args=_args(packed_attention="varlen", use_transformers_continuous_batching=True)), model,
         "continuous batching runs the rollout under the policy's attention"),
        (dict(args=_args(packed_attention="varlen", disable_dropout=False)), gpt2,
         "disable_dropout is off and GPT2LMHeadModel's attention layers hold dropout"),
        ({}, _tiny_model(tiny_llama, _attn_implementation="eager"), "stands in for sdpa only"),
        ({}, _tiny_model(tiny_llama, attn_logit_softcapping=50.0), "softcaps"),
        ({}, _tiny_model(tiny_llama, sliding_window=16), "sliding-window"),
        # the attention modules' own number (set before they are built), until disable_dropout zeroes it
        ({}, transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, attention_dropout=0.1),
         "attention_dropout 0.1"),
    ]
    for kw, m, why in cases:
        args, packed = kw.get("args", on), kw.get("packed", True)
        with pytest.raises(InputError, match=rf"packed_attention='varlen': .*{why}.*packed_attention='mask'"):
            padding_free.resolve_packed_attention(args, m, None, "cuda", packed)
        auto = SimpleNamespace(**{**vars(args), "packed_attention": "auto"})
        choice, reason = padding_free.resolve_packed_attention(auto, m, None, "cuda", packed)
        assert choice == "mask" and why in reason
    # a reference model inside a DeepSpeed engine, whose own ``config`` is DeepSpeed's dict: the model inside counts
    engine = torch.nn.Module()
    engine.module, engine.config = _tiny_model(tiny_llama), {"zero_optimization": {"stage": 2}}
    assert padding_free.resolve_packed_attention(on, model, engine, "cpu", True) == ("varlen", None)
    custom = _tiny_model(tiny_llama)
    custom.config._attn_implementation = "my_kernel"
    with pytest.raises(InputError, match="my_kernel"):
        padding_free.resolve_packed_attention(on, model, custom, "cuda", True)  # the reference counts too
    for bad in ("flash", 1, None):
        with pytest.raises(InputError, match="packed_attention="):
            check_packed_attention(SimpleNamespace(packed_attention=bad))
    check_packed_attention(SimpleNamespace(packed_attention=" Varlen "))


def test_the_startup_line_says_which_packed_attention_and_why(tiny_llama, grpo_args):
    args = grpo_args()
    assert args.packed_attention == "auto"
    line = padding_free.startup_line(args, "cuda", True, None, True, True, None, attention="mask",
                                     why_attention="varlen not measured faster than the mask on cuda; see docs/cost.md")
    assert line.endswith("; packed attention mask (auto: varlen not measured faster than the mask on cuda; see "
                         "docs/cost.md)"), line
    args.packed_attention = "varlen"
    assert padding_free.startup_line(args, "cuda", True, None, True, True, None, attention="varlen").endswith(
        "; packed attention varlen (set varlen)")
    assert "packed attention" not in padding_free.startup_line(args, "cuda", True, None, True, True, None)


def test_I5_names_the_varlen_path_when_the_packed_logprobs_differ(smollm2_tokenizer):
    from grpotrl.guards import precision
    from grpotrl.guards.logprobs import check_logprobs_in_precision

    tol = precision.tolerances(torch.float32, 1e-5)
    reference = torch.full((1, 3), -1.0)
    used = reference + torch.tensor([[0.0, 0.5, 0.0]])
    args = (smollm2_tokenizer, used, reference, torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3),
            torch.tensor([[5, 6, 7]]), 1.0, tol, [0])
    with pytest.raises(InvariantError, match=r"(?s)\[I5\].*packed_attention='varlen'.*set packed_attention='mask'"):
        check_logprobs_in_precision(*args, packed="varlen")
    with pytest.raises(InvariantError, match="set padding_free=False"):
        check_logprobs_in_precision(*args, packed=True)


def test_a_run_trains_under_varlen_with_I5_on_every_step(tiny_llama, grpo_args, caplog):
    """Two steps with packed_attention='varlen', gradient checkpointing on (TRL's default) and the guards on every
    step (I5 compares the varlen logprobs with the padded forward)."""
    args = grpo_args(max_steps=2, guard_steps=-1, padding_free=True, packed_attention="varlen")
    assert args.gradient_checkpointing
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args,
                                  train_dataset=arithmetic_prompts(16))
    assert trainer.packed_attention == "varlen" and trainer.share_prompts  # CPU: the tree attention
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.model.config._attn_implementation == "sdpa"
    gaps = [h["guards/logprob_max_gap"] for h in trainer.state.log_history if "guards/logprob_max_gap" in h]
    assert len(gaps) == 2 and max(gaps) < 1e-4, gaps  # I5 checked the varlen logprobs at both steps


@pytest.mark.parametrize("planted, bf16", [(False, False), (False, True), (True, False)],
                         ids=["control", "control-bf16", "shifted-positions"])
def test_I5_through_the_varlen_attention_row_by_row_passes_varlen_and_stops_a_shifted_position(
        tiny_llama, grpo_args, monkeypatch, planted, bf16):
    """Where torch's kernel runs the packed forwards (CUDA, bf16) I5's padded recompute runs through the same
    attention (``kernel_reference``). On CPU the kernel does not run, so the switch is set by hand here; the
    recompute then takes the varlen attention row by row (counted), and I5 in fp32 passes the varlen loss and stops
    the loss forward that numbers each completion token one position further than generate did. In bf16 (CPU
    autocast, the per-sequence sdpa under the kernel's dtype rules) the control passes I5's bf16 bounds."""
    from planted import ShiftedCompletionPositions

    import grpotrl.ops.varlen as varlen

    ran = []
    monkeypatch.setattr(packed_attention, "padded_varlen_attention",
                        lambda *a, **k: ran.append(1) or varlen.padded_varlen_attention(*a, **k))
    # beta 0: the shifted loss forward would fail I10 first, against the reference model's step-0 logprobs
    args = grpo_args(max_steps=2, guard_steps=-1, padding_free=True, packed_attention="varlen", beta=0.0, bf16=bf16)
    trainer = ShiftedCompletionPositions(model=tiny_llama, reward_funcs=length_reward, args=args,
                                         train_dataset=arithmetic_prompts(16))
    assert trainer.packed_attention == "varlen" and not trainer.kernel_reference  # CPU: no kernel
    trainer.kernel_reference, trainer.active = True, planted
    if planted:
        with pytest.raises(InvariantError, match=r"(?s)\[I5\].*packed_attention='varlen'"):
            trainer.train()
        assert ran
        return
    trainer.train()
    assert trainer.state.global_step == 2 and ran
    if bf16:  # I5's bf16 statistics, within their bounds on both steps
        medians = [h["guards/logprob_median_gap"] for h in trainer.state.log_history
                   if "guards/logprob_median_gap" in h]
        assert len(medians) == 2 and max(medians) <= 0.02, medians
        return
    gaps = [h["guards/logprob_max_gap"] for h in trainer.state.log_history if "guards/logprob_max_gap" in h]
    assert len(gaps) == 2 and max(gaps) < 1e-4, gaps
