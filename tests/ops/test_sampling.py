"""``ops.sampling``: torch.multinomial's one-sample draw without its host synchronisation."""

import math

import pytest
import torch

from grpotrl.ops.sampling import draw_one, exponential_draws, invalid_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_draw_one_returns_the_tokens_torch_multinomial_draws(dtype):
    """The same generator, the same draws, the same argmax: token for token what torch.multinomial(probs, 1)
    returns, seeded, over a vocabulary-sized batch and over unnormalised rows."""
    probs = torch.softmax(torch.randn(64, 49152) * 3, dim=-1).to(dtype)
    for seed in range(3):
        torch.manual_seed(seed)
        expected = torch.multinomial(probs, 1)
        torch.manual_seed(seed)
        assert torch.equal(draw_one(probs), expected)
    weights = torch.tensor([[0.0, 2.0, 6.0], [5.0, 0.0, 0.0]], dtype=dtype)  # rows summing to 8 and 5
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert torch.equal(draw_one(weights, generator=g1), torch.multinomial(weights, 1, generator=g2))


def test_draw_one_follows_the_distribution():
    """P(v) = p_v: 20000 draws from [0.1, 0.2, 0.7] land within 4 standard errors of each probability;
    a zero-probability token is never drawn."""
    probs = torch.tensor([[0.1, 0.2, 0.7, 0.0]]).expand(20000, 4).contiguous()
    torch.manual_seed(0)
    counts = torch.bincount(draw_one(probs).view(-1), minlength=4).double() / 20000
    for p, share in zip([0.1, 0.2, 0.7, 0.0], counts.tolist()):
        assert abs(share - p) <= 4 * math.sqrt(p * (1 - p) / 20000) + 1e-12


def test_invalid_rows_are_those_torch_multinomial_refuses():
    """Rows with NaN, +inf or a negative entry, or summing to 0: torch raises for each; invalid_rows flags
    exactly them."""
    probs = torch.tensor([[0.2, 0.8], [math.nan, 1.0], [math.inf, 0.0], [-0.1, 1.1], [0.0, 1.0], [0.0, 0.0]])
    assert invalid_rows(probs).tolist() == [False, True, True, True, False, True]
    for row in (1, 2, 3, 5):
        with pytest.raises(RuntimeError):
            torch.multinomial(probs[row:row + 1], 1)


def test_exponential_draws_are_torchs_bit_for_bit_and_leave_the_generator_where_torch_does():
    """The CPU form (float64 uniforms, vectorised log1p, the few near a float32 rounding boundary computed again):
    over 40 seeds of SmolLM2's [64, 49152] draw (1.3e8 values, about 4 of them near a boundary) every value is
    exponential_'s, and the generator's next draw is the same; a transposed or non-float32 tensor gets torch's own."""
    near = 0
    for seed in range(40):
        torch.manual_seed(seed)
        expected, after = torch.empty(64, 49152).exponential_(), torch.rand(3)
        torch.manual_seed(seed)
        got = exponential_draws(torch.empty(64, 49152))
        assert torch.equal(got, expected) and torch.equal(torch.rand(3), after)
        torch.manual_seed(seed)
        u = torch.rand(64, 49152, dtype=torch.float64)
        near += int((((-torch.log1p(-u)).view(torch.int64) & ((1 << 29) - 1)) - (1 << 28)).abs().le(8).sum())
    assert near > 0  # the recomputed branch ran
    for like in (torch.empty(49152, 64).t(), torch.empty(64, 49152, dtype=torch.float64)):
        g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        assert torch.equal(exponential_draws(like, g1), torch.empty_like(like).exponential_(1, generator=g2))


def test_exponential_draws_recompute_every_value_near_a_float32_rounding_midpoint(monkeypatch):
    """A planted vectorised log1p that puts every value exactly on a float32 rounding midpoint (where one double ulp
    decides the float32): each is found and computed again with the C library's log1p, so the draws are still
    exponential_'s. Without the recomputation the planted values would come back."""
    midpoint = (torch.tensor([0.75], dtype=torch.float64).view(torch.int64) & ~((1 << 29) - 1) | (1 << 28))
    planted = midpoint.view(torch.float64).item()  # -log1p(-u) as the planted log1p returns it, for every u
    real_log1p = torch.log1p
    monkeypatch.setattr(torch, "log1p", lambda x: real_log1p(x) * 0 - planted)
    got = exponential_draws(torch.empty(8, 16), torch.Generator().manual_seed(0))
    expected = torch.empty(8, 16).exponential_(1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(got, expected) and not torch.equal(got, torch.full((8, 16), planted).float())
