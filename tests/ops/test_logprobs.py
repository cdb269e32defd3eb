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
