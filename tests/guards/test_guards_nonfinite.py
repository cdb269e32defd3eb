"""Guards fail loudly on what they cannot verify: a NaN or inf that reaches a comparison
fails it, naming where it came from; masked-out positions are never compared, so they cannot poison
the comparison; the entropy bonus coefficient in force must be >= 0 (I7)."""

import math

import pytest
import torch

import grpotrl
from grpotrl import guards
from grpotrl.errors import InputError, InvariantError
from grpotrl.guards.precision import tolerances

FP32 = tolerances(torch.float32)

MASK = torch.tensor([[1, 1, 0]])  # [B=1, C=3]: the last token is padding
IDS = torch.tensor([[5, 6, 2]])


def test_I5_masked_minus_inf_does_not_hide_a_real_gap():
    """Before: max(gap * mask) was NaN (inf * 0) and NaN > atol is False, so a 4-nat gap passed."""
    used = torch.tensor([[-1.0, -5.0, -math.inf]])
    reference = torch.tensor([[-1.0, -1.0, -0.5]])
    with pytest.raises(InvariantError, match=r"\[I5\].*completion token 1.*gap 4.00e\+00"):
        guards.check_logprobs(_Tok(), used, reference, MASK, IDS, 1.0, 1e-5, [0])


def test_I5_non_finite_value_on_a_real_token_fails_naming_it():
    for bad, where in ((torch.tensor([[-1.0, math.nan, 0.0]]), "the loss's logprob is nan"),
                       (torch.tensor([[-1.0, -math.inf, 0.0]]), "the loss's logprob is -inf")):
        with pytest.raises(InvariantError, match=rf"\[I5\].*row 0, completion token 1.*{where}"):
            guards.check_logprobs(_Tok(), bad, torch.tensor([[-1.0, -1.0, 0.0]]), MASK, IDS, 1.0, 1e-5, [0])
    with pytest.raises(InvariantError, match=r"independent log_softmax\(logits / T\) is nan"):
        guards.check_logprobs(_Tok(), torch.tensor([[-1.0, -1.0, 0.0]]), torch.tensor([[math.nan, -1.0, 0.0]]),
                              MASK, IDS, 1.0, 1e-5, [0])
    with pytest.raises(InvariantError, match=r"logit scale .* is inf"):
        guards.check_logprobs(_Tok(), torch.tensor([[-1.0, -1.0, 0.0]]), torch.tensor([[-1.0, -1.0, 0.0]]),
                              MASK, IDS, 1.0, 1e-5, [0], scale=torch.tensor([[1.0, math.inf, 1.0]]))
    # finite and equal on real tokens, garbage on padding: passes
    assert guards.check_logprobs(_Tok(), torch.tensor([[-1.0, -2.0, math.nan]]),
                                 torch.tensor([[-1.0, -2.0, -math.inf]]), MASK, IDS, 1.0, 1e-5, [0]) == 0.0


def test_I7_entropy_values_masked_inf_and_real_nan():
    with pytest.raises(InvariantError, match=r"\[I7\].*token 1.*gap 2.00e\+00"):
        guards.check_entropy_values(torch.tensor([[1.0, 3.0, math.inf]]), torch.tensor([[1.0, 1.0, 0.0]]), MASK, FP32)
    with pytest.raises(InvariantError, match=r"\[I7\].*the entropy the loss used is nan"):
        guards.check_entropy_values(torch.tensor([[1.0, math.nan, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]]), MASK, FP32)


def test_I7_negative_coefficient_in_force_fails_even_when_the_slope_matches_it():
    """A flipped entropy sign by the back door: an adaptive controller driven below 0 gives c = -0.5, and a loss of
    policy + 0.5 H has slope +0.5 = -c: the slope check alone would pass it."""
    H = torch.tensor([[1.0, 2.0]], requires_grad=True)
    loss = 1.0 + 0.5 * H.mean()
    with pytest.raises(InvariantError, match=r"\[I7\].*coefficient in force is c = -0.5"):
        guards.check_entropy_sign(loss, H, -0.5, 1.0, "the GRPO loss")


def test_I7_non_finite_slope_fails():
    H = torch.tensor([[1.0, 2.0]], requires_grad=True)
    loss = (H * torch.tensor([[math.nan, 1.0]])).sum()
    with pytest.raises(InvariantError, match=r"\[I7\].*not finite"):
        guards.check_entropy_sign(loss, H, 0.1, 1.0, "the GRPO loss")


def test_adaptive_entropy_settings_that_allow_a_negative_coefficient_are_refused(tmp_path):
    with pytest.raises(InputError, match=r"entropy_coef_min=-0.5.*0 <= entropy_coef_min <= entropy_coef_max"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), use_adaptive_entropy=True, entropy_coef_min=-0.5)
    grpotrl.GRPOConfig(output_dir=str(tmp_path), use_adaptive_entropy=True, entropy_coef_min=0.0)


class _Tok:
    def decode(self, ids):
        return f"<{ids[0]}>"
