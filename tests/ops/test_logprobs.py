"""I5: logprobs at the sampling temperature, against hand-derived numbers."""

import math

import pytest
import torch

from grpotrl.ops.logprobs import completion_logits, entropy_from_logits, token_logprobs


def test_I5_temperature_divides_logits():
    logits = torch.tensor([[[1.0, 0.0, 0.0]]])
    # T=0.5: logits become [2, 0, 0]; p(token 0) = e^2 / (e^2 + 2)
    want = 2 - math.log(math.e**2 + 2)
    assert token_logprobs(logits, torch.tensor([[0]]), 0.5).item() == pytest.approx(want, abs=1e-6)
    # the temperature dropped (T=1): p = e / (e + 2)
    assert token_logprobs(logits, torch.tensor([[0]]), 1.0).item() == pytest.approx(1 - math.log(math.e + 2), abs=1e-6)


def test_I4_logit_at_P_plus_t_minus_1_scores_token_t():
    # L = 4 positions, C = 2: completion token 0 is scored by position 1, token 1 by position 2
    logits = torch.zeros(1, 4, 3)
    logits[0, 1, 2] = 5.0  # position P + 0 - 1 = 1 favours id 2
    logits[0, 2, 1] = 5.0  # position 2 favours id 1
    picked = completion_logits(logits, completion_width=2)
    assert picked.argmax(-1).tolist() == [[2, 1]]


def test_entropy_uniform_and_peaked():
    assert entropy_from_logits(torch.zeros(1, 1, 8)).item() == pytest.approx(math.log(8), abs=1e-6)
    assert entropy_from_logits(torch.tensor([[[100.0, 0.0]]])).item() == pytest.approx(0.0, abs=1e-6)


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 1, 2), torch.tensor([[0]]), 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_I5_chunked_logit_readings_equal_one_whole_batch_pass(monkeypatch, dtype):
    """Every [B, C, V] reading works in row chunks (a few fp32 [b, C, V] temporaries next to the loss's
    graph, not several [B, C, V] ones); with chunks forced to one or two rows, each equals the whole-batch
    formula written out here, bit for bit, in fp32 and bf16."""
    from grpotrl import health
    from grpotrl.ops import logprobs as ops

    torch.manual_seed(0)
    B, C, V, T = 5, 3, 7, 0.7
    logits = (torch.randn(B, C, V) * 4).to(dtype)
    tokens = torch.randint(0, V, (B, C))
    z = logits.float() / T  # [B, C, V]
    logps = torch.log_softmax(z, -1)
    whole = {
        "logprobs": logps.gather(-1, tokens.unsqueeze(-1)).squeeze(-1),
        "entropy": -(logps.exp() * logps).sum(-1),
        "scale": logits.float().abs().amax(-1) / T,
        "slope": logits.float().gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        - (torch.softmax(z, -1) * logits.float()).sum(-1),
        "top1_prob": (logits.float().amax(-1) / T - torch.logsumexp(z, -1)).exp(),
    }
    for per_chunk in (C * V, 2 * C * V):
        monkeypatch.setattr(ops, "CHUNK_ELEMENTS", per_chunk)
        assert len(ops.row_chunks(logits)) == -(-B // (per_chunk // (C * V)))
        got = {
            "logprobs": ops.token_logprobs(logits, tokens, T),
            "entropy": ops.entropy_from_logits(logits, T),
            "scale": ops.logit_scale(logits, T),
            "slope": ops.temperature_slope(logits, tokens, T),
            "top1_prob": health.logit_stats(logits, T)["logits/top1_prob"],
        }
        for name, value in got.items():
            assert value.dtype == torch.float32 and value.shape == (B, C), name
            assert torch.equal(value, whole[name]), (name, per_chunk, (value - whole[name]).abs().max())


def test_row_chunks_keep_one_row_when_a_row_alone_is_larger(monkeypatch):
    from grpotrl.ops import logprobs as ops

    monkeypatch.setattr(ops, "CHUNK_ELEMENTS", 10)
    assert ops.row_chunks(torch.empty(3, 4, 5, device="meta")) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert ops.row_chunks(torch.empty(0, 4, 5, device="meta")) == []
    assert ops.entropy_from_logits(torch.empty(0, 4, 5)).shape == (0, 4)
