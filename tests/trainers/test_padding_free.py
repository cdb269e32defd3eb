"""padding_free: the logprob forwards on packed rows give what the padded forward gives (I5).

Pure tests of ``ops/packing.py`` with plans and index maps worked out by hand; trainer tests on
the tiny random models: packed == padded for the logprobs, entropies, loss and gradients (fp32,
1e-5 relative) of every TRL loss type, with and without a KL term, with LoRA, gradient
checkpointing, CAGrad and GAD; the default (on for grpotrl's config, off for a ``trl.GRPOConfig``);
the refusals; and I5 stopping a model whose attention ignores the packing at step 1.
"""

import contextlib
import logging

import pytest
import torch
import trl
from conftest import arithmetic_prompts, length_reward, perturbed_batch
from datasets import Dataset

import grpotrl
from grpotrl.errors import InputError, InvariantError
from grpotrl.ops.packing import (IGNORE, balance_plan, forward_plan, pack, pack_plan, prompt_plan, prompts_of,
                                 share_plan, unpack)
from grpotrl.trainers import _intercept, padding_free

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]  # trl 1.16's loss_type choices


# ---------------------------------------------------------------- ops/packing.py, by hand

def test_pack_plan_first_fit_decreasing():
    # longest first: 5 -> row 0 (room 1); 4 -> row 1 (room 2); 3 fits neither -> row 2 (room 3);
    # 2 -> row 1 (first with room >= 2)
    assert pack_plan([3, 5, 2, 4], capacity=6) == [[1], [3, 2], [0]]
    # ties in index order; 1 + 1 + 1 fill a row of 3 exactly
    assert pack_plan([1, 1, 1, 3], capacity=3) == [[3], [0, 1, 2]]
    assert pack_plan([], capacity=4) == []
    with pytest.raises(ValueError, match="does not fit"):
        pack_plan([5], capacity=4)


def test_forward_plan_by_hand():
    # widths 200, 298, 122, 290 -> sorted rows 1 (298), 3 (290), 0 (200), 2 (122); a run costs rows x its first
    # row's width + the overhead. Overhead 64: [1, 3] [0] [2] = 596 + 200 + 122 + 3 x 64 = 1110, against
    # [1, 3] [0, 2] = 1124, [1, 3, 0] [2] = 1144, each alone 1166, all four 1256
    assert forward_plan([200, 298, 122, 290], max_rows=8, overhead=64) == [[1, 3], [0], [2]]
    # overhead 0: each row alone costs only its tokens (910); a large one: a single forward (1192 + 1000)
    assert forward_plan([200, 298, 122, 290], max_rows=8, overhead=0) == [[1], [3], [0], [2]]
    assert forward_plan([200, 298, 122, 290], max_rows=8, overhead=1000) == [[1, 3, 0, 2]]
    # None: the fewest forwards max_rows allows (ceil(5 / 2) = 3), then the fewest cells; of sorted 9 8 5 5 1,
    # runs of 2, 2, 1 = 18 + 10 + 1 = 29 cells, against 2, 1, 2 = 18 + 5 + 10 = 33 and 1, 2, 2 = 9 + 16 + 10 = 35
    assert forward_plan([5, 9, 1, 8, 5], max_rows=2) == [[1, 3], [0, 4], [2]]
    assert forward_plan([7, 7, 7], max_rows=3, overhead=0) == [[0, 1, 2]]  # equal cost: the fewest forwards
    assert forward_plan([], max_rows=4) == []
    with pytest.raises(ValueError, match="max_rows"):
        forward_plan([3], max_rows=0)


def test_pack_and_unpack_by_hand():
    # two rows, P = 3 (left-padded prompts), K = 2 (right-padded completions); 0 is pad
    ids = torch.tensor([[0, 11, 12, 13, 14],    # prompt [11, 12], completion [13, 14]
                        [21, 22, 23, 24, 0]])   # prompt [21, 22, 23], completion [24]
    mask = torch.tensor([[0, 1, 1, 1, 1],
                         [1, 1, 1, 1, 0]])
    p = pack(ids, mask, logits_to_keep=2, capacity=5)
    # both sequences are 4 long; capacity 5 holds one each: plan [[0], [1]], width 4
    assert p.input_ids.tolist() == [[11, 12, 13, 14], [21, 22, 23, 24]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert p.labels.tolist() == [[IGNORE, IGNORE, 13, 14], [IGNORE, IGNORE, IGNORE, 24]]
    # shifted output [2, 3]: token 13 (packed col 2) is scored at col 1 -> flat 1; 14 at col 2 -> flat 2;
    # 24 (row 1, col 3) at col 2 -> flat 3 + 2 = 5. Targets in [2, 2]: (0,0)=0, (0,1)=1, (1,0)=2
    assert p.source.tolist() == [1, 2, 5] and p.target.tolist() == [0, 1, 2]
    values = torch.tensor([[10., 11., 12.], [20., 21., 22.]], requires_grad=True)
    out = unpack(values, p)
    assert out.tolist() == [[11., 12.], [22., 0.]]
    out.sum().backward()
    assert values.grad.tolist() == [[0., 1., 1.], [0., 0., 1.]]  # only the scored positions


def test_pack_two_sequences_in_one_row_and_a_padded_tail():
    # three rows, L = 4, K = 2: real lengths 2, 3, 1 + ... capacity 4:
    # plan: 3 -> row 0 (room 1); 2 -> row 1 (room 2); 1 -> row 0 (room 0)  => [[1, 2], [0]]
    ids = torch.tensor([[0, 5, 6, 0],     # prompt [5], completion [6]
                        [7, 8, 9, 0],     # prompt [7, 8], completion [9]
                        [0, 3, 0, 0]])    # prompt [3], empty completion
    mask = (ids != 0).long()
    p = pack(ids, mask, logits_to_keep=2, capacity=4, pad_id=0)
    assert p.input_ids.tolist() == [[7, 8, 9, 3], [5, 6, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0], [0, 1, 0, 1]]  # the tail restarts at 0
    assert p.labels.tolist() == [[IGNORE, IGNORE, 9, IGNORE], [IGNORE, 6, IGNORE, IGNORE]]
    # 9 at packed (0, 2) -> shifted (0, 1) = flat 1, target row 1 col 0 -> 2; 6 at (1, 1) -> (1, 0) = flat 3 -> 0
    assert p.source.tolist() == [1, 3] and p.target.tolist() == [2, 0]
    assert unpack(torch.arange(6.).view(2, 3), p).tolist() == [[3., 0.], [1., 0.], [0., 0.]]


def test_share_plan_by_hand():
    # prompt (1, 2, 3) twice: prefix (1, 2) shared, each row keeps 3 and its completion: own tokens 3 and 4;
    # capacity 9 - 2 leaves 7 for own tokens, so both fit one tree (longest first: row 1, then row 0)
    assert share_plan([(1, 2, 3), (1, 2, 3), (4,)], [5, 6, 2], capacity=9) == ([2, 2, 0], [[1, 0], [2]])
    # capacity 8 leaves 6: 4 + 3 do not fit, two trees, each still with its prefix
    assert share_plan([(1, 2, 3), (1, 2, 3), (4,)], [5, 6, 2], capacity=8) == ([2, 2, 0], [[1], [0], [2]])
    # a one-token prompt has nothing to share (its token predicts each row's first completion token)
    assert share_plan([(7,), (7,)], [3, 4], capacity=8) == ([0, 0], [[0], [1]])


def test_pack_shared_prompts_by_hand():
    # L = 5, K = 2; rows 0 and 1 share the prompt [11, 12]; row 2 has its own
    ids = torch.tensor([[0, 11, 12, 13, 14],    # prompt [11, 12], completion [13, 14]
                        [0, 11, 12, 15, 0],     # prompt [11, 12], completion [15]
                        [21, 22, 23, 24, 0]])   # prompt [21, 22, 23], completion [24]
    mask = (ids != 0).long()
    p = pack(ids, mask, logits_to_keep=2, capacity=6, pad_id=0, share_prompts=True)
    # tree 0: prefix [11], row 0's own [12, 13, 14], row 1's own [12, 15] (6 tokens); tree 1: row 2 (4 tokens)
    assert p.input_ids.tolist() == [[11, 12, 13, 14, 12, 15], [21, 22, 23, 24, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 1, 2], [0, 1, 2, 3, 0, 1]]  # each token's place in its row
    assert p.labels.tolist() == [[IGNORE, IGNORE, 13, 14, IGNORE, 15], [IGNORE, IGNORE, IGNORE, 24, IGNORE, IGNORE]]
    # shifted [2, 5]: 13 <- col 1 (flat 1), 14 <- 2, 15 <- col 4 (row 1's own 12: flat 4), 24 <- (1, 2) = 7;
    # targets in [3, 2]: (0, 0) = 0, (0, 1) = 1, (1, 0) = 2, (2, 0) = 4
    assert p.source.tolist() == [1, 2, 4, 7] and p.target.tolist() == [0, 1, 2, 4]
    assert p.tree.tolist() == [[0] * 6, [1, 1, 1, 1, -1, -1]]
    assert p.branch.tolist() == [[-1, 0, 0, 0, 1, 1], [2, 2, 2, 2, -1, -1]]
    T, F = True, False
    assert p.widths == [6, 4]  # row 1's last two columns are its tail
    assert p.attention_mask(torch.tensor([0, 1]), 6).squeeze(1).tolist() == [
        [[T, F, F, F, F, F],   # the shared 11
         [T, T, F, F, F, F],   # row 0: 12 13 14 see 11 and row 0
         [T, T, T, F, F, F],
         [T, T, T, T, F, F],
         [T, F, F, F, T, F],   # row 1: 12 15 see 11 and row 1, not row 0
         [T, F, F, F, T, T]],
        [[T, F, F, F, F, F],   # row 2, causal
         [T, T, F, F, F, F],
         [T, T, T, F, F, F],
         [T, T, T, T, F, F],
         [F, F, F, F, T, F],   # the tail sees the tail only (every query sees at least itself)
         [F, F, F, F, T, T]]]
    # a forward of row 1 alone, cut to its width: the same mask without the tail
    assert p.attention_mask(torch.tensor([1]), 4).squeeze(1).tolist() == [
        [[T, F, F, F], [T, T, F, F], [T, T, T, F], [T, T, T, T]]]
    # without shared prompts: no mask (transformers reads the sequences from the restarting position ids)
    assert pack(ids, mask, logits_to_keep=2, capacity=6).attention_mask(torch.tensor([0, 1]), 6) is None


# ---------------------------------------------------------------- trainer: packed == padded

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _trainer(model, grpo_args, cls=grpotrl.GRPOTrainer, dataset=None, rewards=length_reward, **kw):
    """A trainer and one batch of its inputs; the packed forwards under the mask (this file's path; varlen, with
    and without shared prompts, is tests/trainers/test_varlen_attention.py's)."""
    extra = {"peft_config": kw.pop("peft")} if "peft" in kw else {}
    args = grpo_args(**{"learning_rate": 0.0, "guard_steps": 0, "check_step0_identity": False,
                        "max_completion_length": 64, "packed_attention": "mask", **kw})
    trainer = cls(model=model, reward_funcs=rewards, args=args, train_dataset=dataset or arithmetic_prompts(16),
                  **extra)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which these tests skip
    trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    return trainer, inputs


def _padded_and_packed(trainer, fn):
    """``fn()`` with the trainer's logprob forwards padded, then packed."""
    out = []
    for on in (False, True):
        trainer.padding_free = on
        out.append(fn())
    return out


def _forward(trainer, model, inputs, entropy=True, batch_size=None):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)  # [B, P+C]
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)  # [B, P+C]
    return trainer._get_per_token_logps_and_entropies(model, ids, attn, inputs["completion_ids"].size(1),
                                                      batch_size=batch_size, compute_entropy=entropy)


def _assert_really_packed(inputs, trainer=None):
    """The batch has left padding, right padding and completions of several lengths, and packing puts
    several sequences in one row (so a completion could attend to another sequence's tokens); with the
    trainer's shared prompts (sdpa), rows share a prompt's forward (so a row could attend to another's)."""
    lengths = inputs["completion_mask"].sum(1)
    assert (inputs["prompt_mask"] == 0).any() and (inputs["completion_mask"] == 0).any()
    assert lengths.unique().numel() >= 3, lengths.tolist()
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)  # [B, P+C]
    plan = pack_plan(attn.sum(1).tolist(), attn.size(1))
    assert len(plan) < attn.size(0), (attn.sum(1).tolist(), attn.size(1))
    if trainer is not None:
        assert trainer.share_prompts
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        assert pack(ids, attn, inputs["completion_ids"].size(1), attn.size(1), share_prompts=True).tree is not None


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gpt2"])
def test_I5_packed_logprobs_and_entropies_equal_padded(arch, request, grpo_args):
    """Rotary (llama) and absolute positions (gpt2, where a wrong position id shows): per token, in TRL's
    [B, C] layout, zeros where TRL leaves zeros; TRL's batch_size chunking kept."""
    trainer, inputs = _trainer(request.getfixturevalue(arch), grpo_args)
    assert trainer.padding_free  # grpotrl's default, sdpa
    _assert_really_packed(inputs, trainer)
    for batch_size in (None, 3):
        (lp0, h0, _), (lp1, h1, _) = _padded_and_packed(trainer, lambda: _forward(trainer, trainer.model, inputs,
                                                                                  batch_size=batch_size))
        assert lp1.shape == lp0.shape == inputs["completion_ids"].shape
        lp0, h0, lp1, h1 = lp0.detach(), h0.detach(), lp1.detach(), h1.detach()
        assert _rel(lp1, lp0) < 1e-5 and _rel(h1, h0) < 1e-5, (_rel(lp1, lp0), _rel(h1, h0))
        torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
        assert (lp1[inputs["completion_mask"] == 0] == 0).all()


def test_a_call_is_packed_whole_and_run_in_forwards_no_larger_than_trls_chunks(tiny_llama, grpo_args):
    """The reference / old-policy call runs over a whole generation batch in TRL's ``batch_size`` chunks,
    each chunk one prompt's group (unshuffled). Packing the call whole and running ``batch_size`` packed
    rows per forward: every forward is at most ``batch_size x L`` (TRL's chunk), the rows are exactly the
    call's plan (its prompts shared, then first-fit decreasing: fewer than packing chunk by chunk here), and
    the values equal padded."""
    trainer, inputs = _trainer(tiny_llama, grpo_args)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)  # [B, L]
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)  # [B, L]
    B, L = ids.shape
    # regroup the rows as TRL's reference call sees them: sorted by length, so each chunk of 3 holds
    # similar lengths (as one prompt's group does) and packing chunk by chunk leaves rows part-empty
    order = attn.sum(1).argsort()
    inputs = {k: v[order] if torch.is_tensor(v) and v.dim() and v.size(0) == B else v for k, v in inputs.items()}
    lengths = attn[order].sum(1).tolist()
    assert trainer.share_prompts  # the call's rows of one prompt run it once
    whole = pack(ids[order], attn[order], inputs["completion_ids"].size(1), L, share_prompts=True).input_ids.size(0)
    by_chunk = sum(len(pack_plan(lengths[i:i + 3], L)) for i in range(0, B, 3))
    assert whole < by_chunk, (lengths, L)
    trainer.padding_free = False
    lp0 = _forward(trainer, trainer.model, inputs, entropy=False, batch_size=3)[0]
    trainer.padding_free = True
    packed = []  # [rows, width] of each forward of the packed call
    hook = trainer.model.register_forward_pre_hook(
        lambda m, args, kwargs: packed.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        lp1 = _forward(trainer, trainer.model, inputs, entropy=False, batch_size=3)[0]
    finally:
        hook.remove()
    assert all(r <= 3 and w <= L for r, w in packed), (packed, L)
    assert sum(r for r, _ in packed) == whole, (packed, whole, by_chunk)
    assert _rel(lp1.detach(), lp0.detach()) < 1e-5


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gpt2"])
def test_each_forward_is_cut_to_its_widest_row(arch, request, grpo_args):
    """One sequence of the padded width L = 300 and five of 20 tokens pack into rows of 300 and 100 used
    columns. One forward of both would run 2 x 300 cells + 64 (``CPU_FORWARD_OVERHEAD``) = 664; two forwards,
    each cut to its row, 300 + 100 + 2 x 64 = 528 (``forward_plan``): the call runs [1, 300] then [1, 100],
    and the values equal padded. A batch_size of 1 runs the same two forwards."""
    trainer, _ = _trainer(request.getfixturevalue(arch), grpo_args)
    assert padding_free.CPU_FORWARD_OVERHEAD == 64
    B, L, K = 6, 300, 280
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (B, L))  # [B, L]
    attn = torch.zeros(B, L, dtype=torch.long)  # [B, L]
    attn[0] = 1  # prompt of 20 + completion of 280
    attn[1:, L - K - 10:L - K + 10] = 1  # prompts of 10 (left-padded) + completions of 10 (right-padded)
    packed = pack(ids, attn, K, L)
    assert packed.widths == [300, 100]
    for batch_size in (None, 1):
        shapes = []  # [rows, width] of each forward

        def call():
            shapes.clear()
            return trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, K, batch_size=batch_size,
                                                              compute_entropy=True)

        hook = trainer.model.register_forward_pre_hook(
            lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
        try:
            (lp0, h0, _), (lp1, h1, _) = _padded_and_packed(trainer, call)
        finally:
            hook.remove()
        assert shapes == [(1, 300), (1, 100)], shapes  # the packed call's two forwards
        assert _rel(lp1.detach(), lp0.detach()) < 1e-5 and _rel(h1.detach(), h0.detach()) < 1e-5
        assert (lp1 != 0).sum() == attn[:, L - K:].sum()  # every scored token, each once


def test_forwards_agreed_across_processes_run_on_padding_and_join_the_graph(tiny_llama, grpo_args):
    """``agree_forwards`` (ZeRO-3, where each forward gathers the parameters from every process, so every
    process must run as many): where another process runs more forwards, the missing ones run on a 2-token row
    of padding and join the result with weight 0. The values and gradients are the plan's own, and the
    backward runs through every forward, as the other process's does (tests/test_distributed.py runs it under
    a real ZeRO-3 launch)."""
    trainer, inputs = _trainer(tiny_llama, grpo_args, gradient_checkpointing=False)
    model = trainer.model
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)  # [B, L]
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)  # [B, L]
    K = inputs["completion_ids"].size(1)
    params = [p for p in model.parameters() if p.requires_grad]
    layer = model.model.layers[0]
    forwards, backwards = [], []
    hooks = [layer.register_forward_pre_hook(lambda m, a: forwards.append(1)),
             layer.register_full_backward_hook(lambda m, grad_in, grad_out: backwards.append(1))]
    results = []
    try:
        for agree in (None, lambda n: n + 2):
            forwards.clear()
            backwards.clear()
            logps, _ = padding_free.packed_logps_and_entropies(
                model, ids, attn, K, None, False, contextlib.nullcontext, share_prompts=trainer.share_prompts,
                agree_forwards=agree)
            grads = torch.autograd.grad((logps * torch.linspace(-1, 1, K)).sum(), params)
            results.append((len(forwards), len(backwards), logps.detach(), torch.cat([g.flatten() for g in grads])))
    finally:
        for h in hooks:
            h.remove()
    (f0, b0, lp0, g0), (f1, b1, lp1, g1) = results
    assert f0 >= 1 and f1 == f0 + 2  # the plan's forwards, then two on padding
    assert b0 == f0 and b1 == f1  # the backward ran through each, the padding's too
    assert torch.equal(lp1, lp0)
    assert g0.norm() > 0 and _rel(g1, g0) < 1e-6


def test_the_packed_head_projects_only_the_scored_positions_on_cpu(tiny_llama, grpo_args, monkeypatch):
    """On CPU TRL's fused head projects every position (prompt tokens, row tails) and zeroes the unscored
    ones; the packed forward has it project the scored positions only (``_intercept.inject_compact_head``),
    with the same values. TRL's padded forward, and anything after the packed call, keep TRL's choice."""
    import trl.trainer.utils as trl_utils

    sizes = []
    original = trl_utils._ChunkedLogProbFunction.apply
    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply",
                        lambda hidden, *a: sizes.append(hidden.size(0)) or original(hidden, *a))
    trainer, inputs = _trainer(tiny_llama, grpo_args)
    calls = []  # the head's token counts, per call of _forward

    def forward():
        sizes.clear()
        out = _forward(trainer, trainer.model, inputs)
        calls.append(list(sizes))
        return out

    (padded, _, _), (packed, _, _) = _padded_and_packed(trainer, forward)
    scored = int(inputs["completion_mask"].sum())
    B, L = inputs["prompt_ids"].size(0), inputs["prompt_ids"].size(1) + inputs["completion_ids"].size(1)
    assert calls[0] == [B * (L - 1)]  # padded: every position of every row
    assert sum(calls[1]) == scored < B * (L - 1)  # packed (one or more forwards): the completion tokens only
    assert _rel(packed, padded) < 1e-5
    assert trl_utils._use_triton(torch.device("cpu")) is False  # restored


def test_the_cpu_steps_run_the_head_in_tiles_of_512_tokens_by_4096_columns(tiny_llama, grpo_args, monkeypatch):
    """On CPU the training step runs TRL's fused head in tiles of 512 tokens x 4096 vocabulary columns instead of
    4096 x 32768 (``_intercept.inject_head_tiles``): its forwards and its backward, which runs after the
    forward's block; evaluation's ``prediction_step`` too. TRL's sizes are back after each."""
    import trl.kernels.chunked_logprob as ck
    import trl.trainer.utils as trl_utils

    seen = []  # (forward or backward, tokens per tile, vocabulary columns per tile)
    original_forward, original_backward = ck.ChunkedLogProbFunction.forward, ck.ChunkedLogProbFunction.backward
    monkeypatch.setattr(ck.ChunkedLogProbFunction, "forward", staticmethod(
        lambda ctx, *a: seen.append(("forward", ck.TOKEN_CHUNK_SIZE, a[5])) or original_forward(ctx, *a)))
    monkeypatch.setattr(ck.ChunkedLogProbFunction, "backward", staticmethod(
        lambda ctx, *a: seen.append(("backward", ck.TOKEN_CHUNK_SIZE, ctx.chunk_size)) or original_backward(ctx, *a)))
    trainer, _ = _trainer(tiny_llama, grpo_args)
    assert len(trainer.processing_class) > _intercept.CPU_HEAD_COLUMNS  # the vocabulary spans several tiles
    trl_sizes = ck.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE
    assert trl_sizes[0] > _intercept.CPU_HEAD_TOKENS and trl_sizes[1] > _intercept.CPU_HEAD_COLUMNS  # else no change
    seen.clear()
    trainer.training_step(trainer.model, next(iter(trainer.get_train_dataloader())), None)
    assert {name for name, *_ in seen} == {"forward", "backward"}
    assert {tuple(sizes) for _, *sizes in seen} == {(_intercept.CPU_HEAD_TOKENS, _intercept.CPU_HEAD_COLUMNS)}
    assert (ck.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE) == trl_sizes == (4096, 32768)  # restored
    seen.clear()
    trainer.model.eval()
    trainer.prediction_step(trainer.model, next(iter(trainer.get_train_dataloader())), prediction_loss_only=True)
    assert seen and {tuple(sizes) for _, *sizes in seen} == {(_intercept.CPU_HEAD_TOKENS, _intercept.CPU_HEAD_COLUMNS)}
    assert (ck.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE) == trl_sizes


def _gad_args(grpo_args, **kw):
    """A GADConfig with the small GRPO settings of ``grpo_args`` (those GADConfig takes) and ``kw``."""
    base = {k: v for k, v in vars(grpo_args()).items() if k in {
        "output_dir", "per_device_train_batch_size", "num_generations", "max_completion_length", "max_steps",
        "logging_steps", "report_to", "use_cpu", "temperature", "save_strategy", "seed", "generation_kwargs"}}
    return grpotrl.GADConfig(**base, **kw)


def test_gad_warmup_steps_run_the_reference_head_in_the_cpu_tiles(tiny_llama, grpo_args, monkeypatch):
    """GADTrainer's discriminator-only warmup steps skip TRL's ``training_step`` but run the reference forward
    (``_prepare_inputs``): in the same CPU tiles as a training step."""
    import trl.kernels.chunked_logprob as ck
    from test_gad import toy_rows

    seen = []  # (tokens per tile, vocabulary columns per tile) of each head forward
    original = ck.ChunkedLogProbFunction.forward
    monkeypatch.setattr(ck.ChunkedLogProbFunction, "forward", staticmethod(
        lambda ctx, *a: seen.append((ck.TOKEN_CHUNK_SIZE, a[5])) or original(ctx, *a)))
    args = _gad_args(grpo_args, beta=0.1, discriminator_warmup_steps=1, guard_steps=0, disable_tqdm=True)
    trainer = grpotrl.GADTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(toy_rows(16)))
    assert trainer.state.global_step < args.discriminator_warmup_steps  # the step below is a warmup step
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which these tests skip
    trainer.training_step(trainer.model, next(iter(trainer.get_train_dataloader())), None)
    assert seen and set(seen) == {(_intercept.CPU_HEAD_TOKENS, _intercept.CPU_HEAD_COLUMNS)}, seen


def test_the_head_in_cpu_tiles_gives_the_values_and_gradients_of_trls_tiles():
    """Worked on 1300 tokens and 10000 vocabulary columns (TRL's one tile of 4096 x 32768 against the CPU's three
    of 512 tokens by three of 4096 columns): logprobs, entropies and the hidden and weight gradients within
    fp32 rounding (the online logsumexp folds the same logits in more vocabulary tiles)."""
    import trl.kernels.chunked_logprob as ck
    import trl.trainer.utils as trl_utils

    torch.manual_seed(0)
    hidden, weight = torch.randn(1300, 32), torch.randn(10000, 32) * 0.3  # [N, H], [V, H]
    targets = torch.randint(0, 10000, (1300,))  # [N]
    results = []
    for device in ("cuda", "cpu"):  # TRL's sizes (not injected off CPU), then the CPU tiles
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with _intercept.inject_head_tiles(torch.device(device)):
            columns = trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE  # what TRL's fused forward hands the head
            logps, entropy, *_ = ck.ChunkedLogProbFunction.apply(h, w, None, targets, 0.9, columns, None, 1.0,
                                                                  ("log_probs", "entropy"))
            (logps * torch.linspace(-1, 1, 1300) + 0.1 * entropy).sum().backward()
        results.append((columns, logps.detach(), entropy.detach(), h.grad, w.grad))
    assert results[0][0] == 32768 and results[1][0] == _intercept.CPU_HEAD_COLUMNS
    for one, tiles in zip(results[0][1:], results[1][1:]):
        assert _rel(tiles, one) < 1e-6


def test_shared_prompts_run_each_prompt_once_where_the_attention_takes_the_tree_mask(tiny_llama, grpo_args):
    """sdpa (the default): each forward of the call gets the tree mask, the prompts' tokens run once per
    tree (fewer tokens than plain packing), and the values equal padded. eager (which adds a mask as a
    float bias) and a reference model on another attention keep plain packing."""
    trainer, inputs = _trainer(tiny_llama, grpo_args)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)  # [B, L]
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)  # [B, L]
    K = inputs["completion_ids"].size(1)
    seen = []  # the attention mask of each forward
    hook = trainer.model.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["attention_mask"]),
                                                   with_kwargs=True)
    try:
        (lp0, h0, _), (lp1, h1, _) = _padded_and_packed(trainer, lambda: _forward(trainer, trainer.model, inputs))
    finally:
        hook.remove()
    assert trainer.share_prompts and seen[-1] is not None and seen[-1].dtype == torch.bool and seen[-1].dim() == 4
    shared, plain = pack(ids, attn, K, ids.size(1), share_prompts=True), pack(ids, attn, K, ids.size(1))
    prompts = [tuple(r[m.bool()].tolist()) for r, m in zip(inputs["prompt_ids"], inputs["prompt_mask"])]
    prefix, trees = share_plan(prompts, attn.sum(1).tolist(), ids.size(1))
    saved = sum(prefix[t[0]] * (len(t) - 1) for t in trees)  # each tree runs its prefix once
    assert len(set(prompts)) == 2 and saved >= 2 * 3 * 10, (trees, prefix)  # 2 prompts of 4 rows, 11+ tokens
    assert int(shared.labels.ne(-100).sum()) == int(plain.labels.ne(-100).sum())  # the same scored tokens
    assert shared.position_ids.numel() - int((shared.tree == -1).sum()) == int(attn.sum()) - saved
    assert _rel(lp1.detach(), lp0.detach()) < 1e-5 and _rel(h1.detach(), h0.detach()) < 1e-5

    eager = _tiny_model(tiny_llama, _attn_implementation="eager")
    assert padding_free.resolve_share(True, trainer.model) and not padding_free.resolve_share(False, trainer.model)
    assert not padding_free.resolve_share(True, trainer.model, eager)
    # a ready 4D mask reaches sliding-window and chunked layers unchanged: their window would be lost
    for config in ({"sliding_window": 16}, {"attention_chunk_size": 16},
                   {"layer_types": ["full_attention", "sliding_attention"]}):
        assert not padding_free.resolve_share(True, _tiny_model(tiny_llama, **config)), config
    assert padding_free.resolve_share(True, _tiny_model(tiny_llama, layer_types=["full_attention"] * 2))
    trainer, _ = _trainer(eager, grpo_args)
    assert trainer.padding_free and not trainer.share_prompts


def _loss_and_grads(trainer, inputs):
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def run():
        loss = trainer._compute_loss(trainer.model, inputs)
        return loss.detach(), torch.autograd.grad(loss, params)

    (l0, g0), (l1, g1) = _padded_and_packed(trainer, run)
    flat0, flat1 = torch.cat([g.flatten() for g in g0]), torch.cat([g.flatten() for g in g1])
    assert flat0.norm() > 0 and l0.abs() > 1e-4, (l0, flat0.norm())  # a relative difference means something
    return _rel(l1, l0), _rel(flat1, flat0)


@pytest.mark.parametrize("beta", [pytest.param(0.0, marks=pytest.mark.slow), 0.04])  # 0.04 adds the KL to the same loss
def test_loss_and_gradients_equal_padded_for_every_loss_type(beta, tiny_llama, grpo_args):
    """Same batch, same old/ref logprobs: the loss and the gradient of every parameter, packed vs padded,
    for each of TRL's loss types (luspo at the sequence level, as TRL requires). With beta > 0 the
    reference's logprobs, packed too, equal the padded ones."""
    trainer, inputs = _trainer(tiny_llama, grpo_args, beta=beta, num_iterations=2)
    _assert_really_packed(inputs, trainer)
    with torch.no_grad():  # the old policy (num_iterations > 1) and the reference go through the same override
        models = [trainer.model] + ([trainer.ref_model] if beta else [])
        for model in models:
            (a, _, _), (b, _, _) = _padded_and_packed(trainer, lambda: _forward(trainer, model, inputs, False))
            assert _rel(b, a) < 1e-5
    # the old policy a little away from the policy: ratios not 1, so that the loss is not a sum of advantages
    # (about 0, where fp32 rounding of the logprobs alone makes any relative difference)
    _assert_every_loss_type_equal(trainer, inputs, _loss_and_grads)


def _assert_every_loss_type_equal(trainer, inputs, loss_and_grads):
    """For each of TRL's loss types (luspo at the sequence level, as TRL requires), with the old policy a little
    away from the policy (ratios not 1): ``loss_and_grads(trainer, inputs)``'s relative differences of the loss
    and of the gradient, padded against packed, are below 1e-5."""
    torch.manual_seed(0)
    old = inputs["old_per_token_logps"]
    inputs = {**inputs, "old_per_token_logps": old + 0.1 * torch.randn_like(old) * inputs["completion_mask"]}
    level = trainer.importance_sampling_level
    for loss_type in LOSS_TYPES:
        trainer.loss_type = loss_type
        trainer.importance_sampling_level = "sequence" if loss_type == "luspo" else level
        loss_rel, grad_rel = loss_and_grads(trainer, inputs)
        assert loss_rel < 1e-5 and grad_rel < 1e-5, (loss_type, loss_rel, grad_rel)


def test_lora_and_no_gradient_checkpointing(tiny_llama, grpo_args):
    """LoRA (the reference is the disabled adapter), gradient checkpointing off."""
    from peft import LoraConfig

    trainer, inputs = _trainer(tiny_llama, grpo_args, beta=0.04, gradient_checkpointing=False,
                               peft=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    assert trainer.padding_free and not trainer.args.gradient_checkpointing
    loss_rel, grad_rel = _loss_and_grads(trainer, inputs)
    assert loss_rel < 1e-5 and grad_rel < 1e-5, (loss_rel, grad_rel)


def test_gradient_checkpointing(tiny_llama, grpo_args):
    """Checkpointing on, as Trainer.train turns it on (TRL's default; the CAGrad and I5 tests train with it)."""
    trainer, inputs = _trainer(tiny_llama, grpo_args)
    assert trainer.args.gradient_checkpointing
    trainer.model.activation_checkpointing_enable(trainer.args.gradient_checkpointing_kwargs)
    assert trainer.model.is_activation_checkpointing
    loss_rel, grad_rel = _loss_and_grads(trainer, inputs)
    assert loss_rel < 1e-5 and grad_rel < 1e-5, (loss_rel, grad_rel)


def test_cagrad_step_gradients_equal_padded(tiny_llama, grpo_args):
    """MultiTaskGRPOTrainer with CAGrad exact: a whole step (same seed, same completions), the gradients
    the optimizer receives, packed vs padded (per-task forwards go through the same override)."""
    from test_multitask import first_step_grads

    padded, t0 = first_step_grads("exact", tiny_llama, grpo_args, cagrad_c=0.5, padding_free=False)
    packed, t1 = first_step_grads("exact", tiny_llama, grpo_args, cagrad_c=0.5, padding_free=True)
    assert not t0.padding_free and t1.padding_free
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(packed, padded))
    den = sum(float(b.pow(2).sum()) for b in padded)
    assert den > 0 and (num / den) ** 0.5 < 1e-5
    assert t0.state.log_history[0]["loss"] == pytest.approx(t1.state.log_history[0]["loss"], rel=1e-5)


def test_gad_loss_and_gradients_equal_padded(tiny_llama, grpo_args):
    """GADTrainer (GSPO defaults, in-loss KL k3 against the reference, the policy moved off it): the loss and
    gradients."""
    from test_gad import toy_rows

    args = _gad_args(grpo_args, beta=0.1, guard_steps=0, check_step0_identity=False, disable_tqdm=True)
    trainer = grpotrl.GADTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(toy_rows(16)))
    assert trainer.padding_free
    inputs = perturbed_batch(trainer)  # the policy off its reference: a KL term not 0 (else the loss is about 0)
    assert (inputs["completion_mask"] == 0).any()
    loss_rel, grad_rel = _loss_and_grads(trainer, inputs)
    assert loss_rel < 1e-5 and grad_rel < 1e-5, (loss_rel, grad_rel)


# ---------------------------------------------------------------- defaults and refusals

def test_default_on_for_grpotrl_config_off_for_trl_config(tiny_llama, grpo_args, tmp_path):
    assert grpotrl.GRPOConfig(output_dir=str(tmp_path)).padding_free == "auto"
    kw = {k: v for k, v in vars(grpo_args()).items() if k in {
        "output_dir", "per_device_train_batch_size", "num_generations", "max_completion_length", "max_steps",
        "report_to", "use_cpu", "save_strategy"}}
    ours = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=grpo_args(),
                               train_dataset=arithmetic_prompts(8))
    assert ours.padding_free is True
    theirs = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=trl.GRPOConfig(**kw),
                                 train_dataset=arithmetic_prompts(8))
    assert theirs.padding_free is False and theirs.args.padding_free is False  # TRL's padded forward
    asked = trl.GRPOConfig(**kw)
    asked.padding_free = True  # set on a TRL config: honoured
    assert grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=asked,
                               train_dataset=arithmetic_prompts(8)).padding_free is True
    eager = grpo_args(model_init_kwargs={"attn_implementation": "eager"})
    assert grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=eager,
                               train_dataset=arithmetic_prompts(8)).padding_free is True


@pytest.mark.parametrize("value", ["sometimes", 2.5, None])
def test_bad_padding_free_value_is_refused_at_the_config(value, tmp_path):
    with pytest.raises(InputError, match="padding_free"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), padding_free=value)


@pytest.mark.parametrize("value,expected", [("true", True), ("False", False), ("auto", "auto"), (True, True)])
def test_recipe_strings_and_bools_are_read(value, expected, tmp_path):
    args = grpotrl.GRPOConfig(output_dir=str(tmp_path), padding_free=value)
    assert padding_free.parse_setting(args.padding_free) == expected


def _tiny_model(path, **config):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    for k, v in config.items():
        setattr(model.config, k, v)
    return model


def test_refusals_and_auto_off_with_the_reason(tiny_llama, tmp_path, caplog):
    """Image inputs, a MoE router loss, the full-KL estimator (which reads the padded hidden states) and
    FlashAttention (packed sequences kept apart in a forward of one row only) are refused for
    padding_free=True and turn 'auto' off with the reason; an attention implementation grpotrl does not
    know turns 'auto' off, and True is the user's call (I5 checks it)."""
    from types import SimpleNamespace

    model = _tiny_model(tiny_llama)
    on = SimpleNamespace(padding_free=True)
    auto = SimpleNamespace(padding_free="auto")
    with pytest.raises(InputError, match="multimodal.*padding_free=False"):
        padding_free.resolve(on, model, is_vlm=True, device_type="cpu")
    assert padding_free.resolve(auto, model, is_vlm=True, device_type="cpu")[0] is False
    with pytest.raises(InputError, match="kl_estimator='full'"):
        padding_free.resolve(SimpleNamespace(padding_free=True, kl_estimator="full"), model, False, "cpu")
    moe = _tiny_model(tiny_llama, output_router_logits=True)
    with pytest.raises(InputError, match="router"):
        padding_free.resolve(on, moe, is_vlm=False, device_type="cpu")
    off, why = padding_free.resolve(auto, moe, is_vlm=False, device_type="cpu")
    assert off is False and "router" in why
    assert padding_free.resolve(SimpleNamespace(padding_free=False), model, False, "cpu") == (False, None)
    for flash in ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn2"):
        model.config._attn_implementation = flash
        with pytest.raises(InputError, match=rf"attn_implementation='{flash}'.*batch_size == 1.*cu_seq_lens.*"
                                             r"padding_free=False, or attn_implementation='sdpa'"):
            padding_free.resolve(on, model, is_vlm=False, device_type="cuda")
        off, why = padding_free.resolve(auto, model, is_vlm=False, device_type="cpu")
        assert off is False and flash in why and "cu_seq_lens" in why
    model.config._attn_implementation = "my_kernel"
    off, why = padding_free.resolve(auto, model, is_vlm=False, device_type="cpu")
    assert off is False and "my_kernel" in why
    with caplog.at_level(logging.WARNING):
        assert padding_free.resolve(on, model, is_vlm=False, device_type="cpu") == (True, None)
    assert "I5 guard" in caplog.text


def test_auto_is_on_only_on_the_devices_where_it_was_measured_faster(tiny_llama):
    """'auto' is on on CPU and off, with the reason, on CUDA and every other device (measured slower on an
    H100 in bf16, docs/cost.md); an explicit True is honoured on any device."""
    from types import SimpleNamespace

    model = _tiny_model(tiny_llama)
    auto, on = SimpleNamespace(padding_free="auto"), SimpleNamespace(padding_free=True)
    assert padding_free.resolve(auto, model, is_vlm=False, device_type="cpu") == (True, None)
    for device in ("cuda", "xpu", "mps", "npu"):
        off, why = padding_free.resolve(auto, model, is_vlm=False, device_type=device)
        assert off is False and why == f"not measured faster than TRL's padded forward on {device}; see docs/cost.md"
        assert padding_free.resolve(on, model, is_vlm=False, device_type=device) == (True, None)
    # balance_microbatches follows: off with padding_free off
    balance = SimpleNamespace(balance_microbatches="auto")
    assert padding_free.resolve_balance(balance, packed=False) == \
        (False, "the logprob forwards run padded (padding_free off), where a microbatch costs its longest row")


def test_startup_line_says_what_was_chosen_and_why(tiny_llama, grpo_args, caplog):
    """At init the trainer logs one line: padding_free, the finished-row rollout, balance_microbatches and the
    packed attention, on or off, and why; on CUDA the same defaults read off (the line built for "cuda")."""
    with caplog.at_level(logging.INFO, logger="grpotrl.trainers.grpo"):
        trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=grpo_args(),
                                      train_dataset=arithmetic_prompts(8))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("grpotrl: padding_free")]
    assert lines == ["grpotrl: padding_free on (auto: measured faster than TRL's padded forward on cpu; see "
                     "docs/cost.md); finished-row rollout on (padding_free on, transformers' generate); "
                     "balance_microbatches on (auto); packed attention varlen (auto: varlen measured faster than the mask "
                     "on cpu)"], lines
    args = trainer.args
    why = "not measured faster than TRL's padded forward on cuda; see docs/cost.md"
    balance_why = "the logprob forwards run padded (padding_free off), where a microbatch costs its longest row"
    assert padding_free.startup_line(args, "cuda", False, why, False, False, balance_why) == (
        f"grpotrl: padding_free off (auto: {why}); finished-row rollout off (padding_free off); "
        f"balance_microbatches off (auto: {balance_why})")
    args.padding_free, args.balance_microbatches = True, False
    assert padding_free.startup_line(args, "cuda", True, None, True, False, None) == (
        "grpotrl: padding_free on (set true); finished-row rollout on (padding_free on, transformers' generate); "
        "balance_microbatches off (set false)")
    # the compiled rollout's static cache keeps every row: the reason is said
    assert "finished-row rollout off (compiled rollout on: its static KV cache keeps every row)" in \
        padding_free.startup_line(args, "cuda", True, None, False, False, None,
                                  why_no_rollout="compiled rollout on: its static KV cache keeps every row")


def test_a_padding_free_run_measured_to_stop_at_I5_by_rounding_is_warned_at_init(tiny_llama, grpo_args, caplog,
                                                                                   monkeypatch):
    """padding_free with the mask on CUDA in bf16 stopped at I5 on an H100 by rounding alone (median 0.022 nats
    at 8 x 8 x 256, bound 0.02): such a run is told so at init, before any compute; fp32, guards off, another
    device or the varlen kernel (whose recompute runs through that kernel) are not. A CPU run (the trainer here)
    logs no such warning."""
    warn = padding_free.guard_warning
    said = warn("cuda", True, "mask", True, True)
    assert "0.022 nats" in said and "padding_free='auto' (off on cuda)" in said and "docs/cost.md" in said
    assert warn("cuda", False, "mask", True, True) is None  # padding_free off
    assert warn("cuda", True, "mask", False, True) is None  # fp32: I5 compares token by token
    assert warn("cuda", True, "mask", True, False) is None  # guard_steps 0
    assert warn("cuda", True, "varlen", True, True) is None
    assert warn("cpu", True, "mask", True, True) is None
    with caplog.at_level(logging.WARNING, logger="grpotrl.trainers.grpo"):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(8),
                            args=grpo_args(padding_free=True, packed_attention="mask", bf16=True))
    assert not [r for r in caplog.records if "may stop this run" in r.getMessage()]
    # the trainer's wiring, with such a measurement recorded for this CPU's mask path
    monkeypatch.setitem(padding_free.I5_OVER_BOUND, ("cpu", "mask"), "a planted measurement")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpotrl.trainers.grpo"):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(8),
                            args=grpo_args(padding_free=True, packed_attention="mask", bf16=True))
    said = [r.getMessage() for r in caplog.records if "may stop this run" in r.getMessage()]
    assert len(said) == 1 and "a planted measurement" in said[0], said


# ---------------------------------------------------------------- I5 catches attention that ignores packing

def _ignores_packing(path, dropped="position_ids"):
    """tiny_llama whose backbone drops one packing input. ``position_ids``: transformers numbers the packed
    row 0..W-1, so the rows of a shared prompt after the first sit at the wrong distance from it (and without
    a tree mask the whole packed row is masked causally as ONE sequence). ``attention_mask`` (the tree mask
    of shared prompts): transformers reads the sequences from the position ids, which cut each row after the
    first off the shared prompt. On the padded batch (rotary positions: relative) it is the same model."""
    def drop(m, args, kwargs):  # the 2D masks of generate and the padded forward pass through
        mask = kwargs.get("attention_mask")
        if dropped == "position_ids" or (mask is not None and mask.dim() == 4):
            kwargs = {k: v for k, v in kwargs.items() if k != dropped}
        return args, kwargs

    model = _tiny_model(path)
    model.model.register_forward_pre_hook(drop, with_kwargs=True)
    return model


@pytest.mark.parametrize("on,dropped", [(True, "position_ids"), (True, "attention_mask"), (False, "position_ids")],
                         ids=["padding_free", "padding_free-tree-mask", "control"])
def test_I5_stops_a_model_whose_attention_ignores_packing_at_step_1(on, dropped, tiny_llama, grpo_args):
    """The mask path (varlen's: ``test_varlen_attention.py::test_I5_names_the_varlen_path_when_the_packed_logprobs_differ``)."""
    args = grpo_args(padding_free=on, guard_steps=-1, max_steps=1, per_device_train_batch_size=16, beta=0.0,
                     max_completion_length=64, packed_attention="mask")
    trainer = grpotrl.GRPOTrainer(model=_ignores_packing(tiny_llama, dropped), reward_funcs=length_reward, args=args,
                                  train_dataset=arithmetic_prompts(16))
    if not on:
        trainer.train()
        assert trainer.state.global_step == 1
        return
    assert trainer.share_prompts
    with pytest.raises(InvariantError, match=r"(?s)\[I5\].*set padding_free=False"):
        trainer.train()
    assert trainer.state.global_step == 0


# ---------------------------------------------------------------- balanced microbatches (peak memory)

def test_balance_plan_by_hand():
    """Longest first into the lightest group with room; kept as it was where that lowers nothing."""
    # 7 -> g0 (7); 6 -> g1 (6); 5 -> g1 (11, full); 2 -> g0 (9): g0 = rows [0, 2], g1 = rows [1, 3]
    # consecutive [7, 6] = 13 and [2, 5] = 7; balanced 9 and 11: heaviest 11 < 13
    assert balance_plan([7, 6, 2, 5], groups=2) == [[0, 2], [1, 3]]
    assert balance_plan([1, 2, 3, 4, 5, 6], groups=3) == [[0, 5], [1, 4], [2, 3]]  # 7, 7, 7 (was 3, 7, 11)
    assert balance_plan([4, 4, 4, 4], groups=2) == [[0, 1], [2, 3]]  # equal: TRL's grouping kept
    assert balance_plan([3, 1], groups=1) == [[0, 1]]
    with pytest.raises(ValueError, match="5 rows"):
        balance_plan([1] * 5, groups=2)


def test_prompt_plan_by_hand():
    """A prompt's rows together, in the order of each prompt's first row; consecutive where they already are."""
    # prompts a b a b c c: order a a b b c c -> rows [0, 2], [1, 3], [4, 5]
    assert prompt_plan([("a",), ("b",), ("a",), ("b",), ("c",), ("c",)], groups=3) == [[0, 2], [1, 3], [4, 5]]
    # prompt a has 3 rows, b 1, groups of 2: order a a a b -> [0, 1], [3, 2] -> each ascending
    assert prompt_plan([("a",), ("a",), ("b",), ("a",)], groups=2) == [[0, 1], [2, 3]]
    assert prompt_plan([("a",), ("b",)], groups=1) == [[0, 1]]
    with pytest.raises(ValueError, match="5 rows"):
        prompt_plan([("a",)] * 5, groups=2)


def test_balanced_moves_whole_rows_and_keeps_shared_values():
    """Each row's values move together (tensors and lists), shared values stay, each window is regrouped on
    its own, and a value that is not one per row leaves its window as TRL cut it."""
    def mb(lengths, tag):
        n = len(lengths)
        cmask = torch.tensor([[1] * k + [0] * (8 - k) for k in lengths])
        return {"prompt_mask": torch.ones(n, 2, dtype=torch.long), "completion_mask": cmask,
                "advantages": torch.tensor([float(k) for k in lengths]), "tag": [f"{tag}{k}" for k in lengths],
                "num_items_in_batch": torch.tensor(99), "old_per_token_logps": None}

    batches = [mb([8, 7], "a"), mb([1, 2], "b"), mb([3, 3], "c"), mb([3, 3], "d")]
    out = padding_free.balanced(batches, window=2)
    # window 1 rows 8, 7, 1, 2 (+2 prompt each): 8 -> g0, 7 -> g1, 2 -> g1, 1 -> g0: [8, 1] and [7, 2]
    assert [b["advantages"].tolist() for b in out[:2]] == [[8.0, 1.0], [7.0, 2.0]]
    assert [b["tag"] for b in out[:2]] == [["a8", "b1"], ["a7", "b2"]]
    assert out[0]["completion_mask"].sum(1).tolist() == [8, 1]
    assert all(b["num_items_in_batch"].item() == 99 and b["old_per_token_logps"] is None for b in out)
    assert out[2] is batches[2] and out[3] is batches[3]  # already even: untouched
    odd = [dict(b, extra=torch.zeros(3)) for b in batches[:2]]  # 3 values for 2 rows
    assert padding_free.balanced(odd, window=2) == odd


def test_balanced_with_shared_prompts_puts_a_prompts_rows_together():
    """Rows 0 and 2 share a 6-token prompt (5 tokens run once for both), rows 1 and 3 have 1-token prompts.
    Lengths 10, 8, 7, 5: by tokens alone [0, 3] and [1, 2] (15 and 15); counting the shared prompt once,
    [0, 2] and [1, 3] (10 + 7 - 5 = 12 and 13)."""
    C = 8  # completion width; prompts 6 wide
    prompts = [[1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 9], [1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 8]]
    completions = [4, 7, 1, 4]
    rows = [{"prompt_ids": torch.tensor([p]), "prompt_mask": (torch.tensor([p]) != 0).long(),
             "completion_mask": torch.tensor([[1] * c + [0] * (C - c)]), "advantages": torch.tensor([float(i)])}
            for i, (p, c) in enumerate(zip(prompts, completions))]
    batches = [{k: torch.cat([r[k] for r in rows[i:i + 2]]) for k in rows[0]} for i in (0, 2)]
    assert [(b["prompt_mask"].sum(1) + b["completion_mask"].sum(1)).tolist() for b in batches] == [[10, 8], [7, 5]]
    plain = padding_free.balanced(batches, window=2)
    shared = padding_free.balanced(batches, window=2, share_prompts=True)
    assert [b["advantages"].tolist() for b in plain] == [[0.0, 3.0], [1.0, 2.0]]
    assert [b["advantages"].tolist() for b in shared] == [[0.0, 2.0], [1.0, 3.0]]
    assert shared[0]["prompt_ids"].tolist() == [prompts[0], prompts[2]]


def test_balanced_by_prompt_keeps_a_prompts_rows_together_where_even_tokens_would_split_them():
    """Prompts A B A B of 2 tokens (1 shared), completions 1, 2, 2, 3: lengths 3, 4, 4, 5. By tokens with the
    shared prompt counted once: 5 (row 3, B) -> g0; 4 (row 1, B) -> g1 (g0 would be 5 + 4 - 1 = 8); 4 (row 2, A)
    -> g1 (8 against g0's 9); 3 (row 0) -> g0 (full g1): [0, 3] and [1, 2], 8 and 8 tokens, each microbatch
    running both prompts (consecutive: 7 and 9). By prompt: [0, 2] and [1, 3], 6 and 8 tokens."""
    C = 8
    prompts, completions = [[1, 2], [3, 4], [1, 2], [3, 4]], [1, 2, 2, 3]
    rows = [{"prompt_ids": torch.tensor([p]), "prompt_mask": torch.ones(1, 2, dtype=torch.long),
             "completion_mask": torch.tensor([[1] * c + [0] * (C - c)]), "advantages": torch.tensor([float(i)])}
            for i, (p, c) in enumerate(zip(prompts, completions))]
    batches = [{k: torch.cat([r[k] for r in rows[i:i + 2]]) for k in rows[0]} for i in (0, 2)]
    tokens = padding_free.balanced(batches, window=2, share_prompts=True)
    grouped = padding_free.balanced(batches, window=2, share_prompts=True, by_prompt=True)
    assert [b["advantages"].tolist() for b in tokens] == [[0.0, 3.0], [1.0, 2.0]]
    assert [b["advantages"].tolist() for b in grouped] == [[0.0, 2.0], [1.0, 3.0]]
    assert [b["prompt_ids"].tolist() for b in grouped] == [[[1, 2], [1, 2]], [[3, 4], [3, 4]]]
    assert padding_free.balanced(grouped, window=2, by_prompt=True) == grouped  # already together: untouched


def _step_grads_and_microbatches(tiny_llama, grpo_args, **kw):
    """One optimizer step of 2 microbatches (4 rows each, one generation batch of 2 prompts x 4): the
    gradient the optimizer receives, the loss logged, and each microbatch's real tokens under the mask path's
    trees, rows (their advantages) and number of distinct prompts."""
    from transformers import TrainerCallback

    grads, seen = [], []

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **k):
            grads.extend(p.grad.detach().clone().flatten() for p in model.parameters() if p.requires_grad)

    class Seen(grpotrl.GRPOTrainer):
        def _compute_loss(self, model, inputs):  # the tokens the packed forward runs (a shared prompt once a tree)
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)  # [B, L]
            attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)  # [B, L]
            p = pack(ids, attn, ids.size(1) - inputs["prompt_ids"].size(1), ids.size(1),
                     share_prompts=self.share_prompts)
            real = int(attn.sum()) if p.tree is None else int((p.tree != -1).sum())
            prompts = len(set(prompts_of(inputs["prompt_ids"], inputs["prompt_mask"])))
            seen.append((real, sorted(inputs["advantages"].tolist()), prompts))
            return super()._compute_loss(model, inputs)

    args = grpo_args(**{"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 1,
                        "max_grad_norm": 0.0, "learning_rate": 0.0, "max_completion_length": 32, "guard_steps": 1,
                        **kw})
    trainer = Seen(model=tiny_llama, reward_funcs=length_reward, args=args, train_dataset=arithmetic_prompts(8),
                   callbacks=[Grab()])
    trainer.train()
    return trainer, torch.cat(grads), trainer.state.log_history[0]["loss"], seen


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "luspo"])
def test_balanced_microbatches_lower_the_heaviest_and_keep_the_step_gradient(loss_type, tiny_llama, grpo_args):
    """Same seed, same completions: regrouped by tokens, the heaviest microbatch is lighter than TRL's
    random grouping made it, and the optimizer step's gradient and logged loss (policy loss + KL) are the
    same sum (1e-5 relative). The guards ran on the regrouped microbatch (guard_steps=1)."""
    kw = {"loss_type": loss_type, "importance_sampling_level": "sequence" if loss_type == "luspo" else "token",
          "packed_attention": "mask"}  # varlen's trees group by prompt instead (test_varlen_attention.py)
    off, g_off, loss_off, seen_off = _step_grads_and_microbatches(tiny_llama, grpo_args, balance_microbatches=False,
                                                                  **kw)
    on, g_on, loss_on, seen_on = _step_grads_and_microbatches(tiny_llama, grpo_args, **kw)
    assert on.balance_microbatches is True and off.balance_microbatches is False and on.padding_free
    assert sorted(r for _, rows, _ in seen_on for r in rows) == sorted(r for _, rows, _ in seen_off for r in rows)
    assert on.share_prompts  # regrouped by the tokens the forwards run: a prompt's rows together where it pays
    assert sum(t for t, *_ in seen_on) <= sum(t for t, *_ in seen_off), (seen_on, seen_off)
    assert max(t for t, *_ in seen_on) < max(t for t, *_ in seen_off), (seen_on, seen_off)  # regrouped, lighter
    assert g_off.norm() > 0 and _rel(g_on, g_off) < 1e-5
    assert loss_on == pytest.approx(loss_off, rel=1e-5)


def test_balance_default_and_when_auto_is_off(tiny_llama, grpo_args, caplog):
    """On by default with padding_free; off with the reason where the loss depends on which rows share a
    microbatch; true refused there; a trl.GRPOConfig keeps TRL's grouping."""
    from types import SimpleNamespace

    def args(**kw):
        base = dict(balance_microbatches="auto", loss_type="dapo", top_entropy_quantile=1.0, entropy_coef=0.0,
                    use_adaptive_entropy=False, cagrad="off", steps_per_generation=4, gradient_accumulation_steps=2)
        return SimpleNamespace(**{**base, **kw})

    assert padding_free.resolve_balance(args(), packed=True) == (True, None)
    for kw, why in [({}, "padding_free off"), ({"loss_type": "bnpo"}, "bnpo"), ({"top_entropy_quantile": 0.2},
                    "top_entropy_quantile"), ({"entropy_coef": 0.01}, "entropy bonus"),
                    ({"use_adaptive_entropy": True}, "entropy bonus"), ({"cagrad": "exact"}, "CAGrad"),
                    ({"steps_per_generation": 3}, "not a multiple")]:
        packed = bool(kw)
        on, reason = padding_free.resolve_balance(args(**kw), packed=packed)
        assert on is False and why in reason, (kw, reason)
        with pytest.raises(InputError, match="balance_microbatches=True.*change the loss"):
            padding_free.resolve_balance(args(balance_microbatches=True, **kw), packed=packed)
    assert padding_free.resolve_balance(args(balance_microbatches=False, loss_type="bnpo"), True) == (False, None)
    kw = {k: v for k, v in vars(grpo_args()).items() if k in {
        "output_dir", "per_device_train_batch_size", "num_generations", "max_completion_length", "report_to",
        "use_cpu", "save_strategy"}}
    theirs = trl.GRPOConfig(**kw)
    theirs.padding_free = True
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=theirs,
                                  train_dataset=arithmetic_prompts(8))
    assert trainer.padding_free is True and trainer.balance_microbatches is False
    with caplog.at_level(logging.INFO):
        bnpo = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=grpo_args(loss_type="bnpo"),
                                   train_dataset=arithmetic_prompts(8))
    assert bnpo.padding_free and not bnpo.balance_microbatches and "bnpo" in caplog.text
    with pytest.raises(InputError, match="balance_microbatches"):
        grpotrl.GRPOConfig(output_dir=kw["output_dir"], balance_microbatches="sometimes")
