"""``ops.sampling``: torch.multinomial's one-sample draw without its host synchronisation."""

import math

import pytest
import torch

from grpotrl.ops.sampling import draw_one, invalid_rows


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
