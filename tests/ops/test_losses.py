"""Pure loss math against hand-derived numbers: KL estimators and the IS ratio."""

import itertools
import math

import pytest
import torch

from grpotrl.ops.losses import (KL_LOG_RATIO_CLAMP, KL_VALUE_CLAMP, importance_sampling_ratio, kl_abs, kl_full, kl_k1,
                                kl_k2, kl_k3, kl_loss_term, kl_penalty)


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
    # d = logp - ref = [1, -1]
    assert kl_k1(logp, ref).tolist() == [1.0, -1.0]
    assert kl_abs(logp, ref).tolist() == [1.0, 1.0]
    assert kl_k2(logp, ref).tolist() == [0.5, 0.5]
    # k3: r = exp(ref - logp) = [e^-1, e^1]; r - log r - 1 = [e^-1 + 1 - 1, e - 1 - 1]
    assert kl_k3(logp, ref).tolist() == pytest.approx([math.exp(-1), math.e - 2], abs=1e-6)
    assert kl_k3(torch.tensor([0.0]), torch.tensor([-50.0])).item() == 10.0  # 49 + e^-50 - 1, clamped


def test_kl_estimators_vanish_at_the_reference():
    x = torch.tensor([-0.3, -4.0])
    for est in ("k1", "abs", "k2", "k3"):
        assert kl_penalty(x, x, est).abs().max().item() == 0.0, est


def test_k1_and_k3_are_unbiased_for_the_exact_kl():
    """E_{x~pi}[k1] = E[k3] = KL(pi || ref); checked exactly by enumerating a 3-token vocabulary."""
    logits, ref_logits = torch.tensor([1.0, 0.0, -1.0]), torch.tensor([0.0, 0.5, 0.0])
    logp, ref = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    p = logp.exp()
    exact = kl_full(logits.view(1, 1, 3), ref_logits.view(1, 1, 3)).item()
    assert (p * kl_k1(logp, ref)).sum().item() == pytest.approx(exact, abs=1e-6)
    assert (p * kl_k3(logp, ref)).sum().item() == pytest.approx(exact, abs=1e-6)
    assert exact == pytest.approx((p * (logp - ref)).sum().item(), abs=1e-7)


def test_kl_full_temperature_and_identity():
    lg = torch.randn(2, 3, 7)
    assert kl_full(lg, lg).abs().max().item() < 1e-6
    # T=2 equals T=1 on halved logits
    ref = torch.randn(2, 3, 7)
    assert torch.allclose(kl_full(lg, ref, temperature=2.0), kl_full(lg / 2, ref / 2), atol=1e-6)


@pytest.mark.parametrize("est", ["k1", "abs", "k2", "k3"])
def test_kl_gradient_pushes_logp_back_towards_the_reference(est):
    """Minimising the penalty lowers log pi of a token pi over-weights relative to pi_ref."""
    logp = torch.tensor([-1.0], requires_grad=True)  # pi puts more mass on the token than ref
    kl_penalty(logp, torch.tensor([-2.0]), est).sum().backward()
    assert logp.grad.item() > 0  # gradient descent lowers logp


def test_kl_full_gradient_moves_pi_towards_ref():
    logits = torch.tensor([[[2.0, 0.0]]], requires_grad=True)
    ref = torch.tensor([[[0.0, 0.0]]])
    kl_full(logits, ref).sum().backward()
    assert logits.grad[0, 0, 0] > 0 > logits.grad[0, 0, 1]  # descent lowers the over-weighted logit


def test_importance_sampling_ratio_modes():
    t, s = torch.tensor([[0.0, 0.0, -1.0]]), torch.tensor([[0.0, -2.0, -1.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])  # last token is padding: ratio 1 whatever its values
    # token ratios exp([0, 2, 0]) = [1, 7.389, 1]
    assert importance_sampling_ratio(t, s, m, "token_truncate", clip_max=3.0).tolist() == [[1.0, 3.0, 1.0]]
    assert importance_sampling_ratio(t, s, m, "token_mask", clip_max=3.0).tolist() == [[1.0, 0.0, 1.0]]
    # sequence: exp(0 + 2) = 7.389 > 3
    assert importance_sampling_ratio(t, s, m, "sequence_truncate", clip_max=3.0).tolist() == [[3.0]]
    assert importance_sampling_ratio(t, s, m, "sequence_mask", clip_max=3.0).tolist() == [[0.0]]
    with pytest.raises(ValueError, match="mode"):
        importance_sampling_ratio(t, s, m, "bogus")


def test_k3_gradient_is_finite_at_extreme_log_ratios():
    """logp = -100, ref = 0 gave a NaN gradient (exp(100) = inf, then inf - inf in backward)."""
    logp = torch.tensor([-100.0, 100.0, -1.0], requires_grad=True)
    ref = torch.tensor([0.0, 0.0, 0.0])
    kl_k3(logp, ref).sum().backward()
    assert torch.isfinite(logp.grad).all(), logp.grad
    # in range the gradient is the analytic one: d/dlogp (e^(ref-logp) - (ref-logp) - 1) = 1 - e^(ref-logp)
    assert logp.grad[2].item() == pytest.approx(1 - math.e, abs=1e-5)


def test_straight_through_estimators_take_the_value_of_theirs_and_the_gradient_of_k2():
    """verl's ``k3+``: k3's value, k2's gradient (d/dlogp 0.5 (logp - ref)^2 = logp - ref)."""
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-2.0, -1.0])
    kl = kl_penalty(logp, ref, "low_var_kl+")
    assert kl.tolist() == pytest.approx(kl_k3(logp, ref).tolist())
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    assert grad.tolist() == pytest.approx([1.0, -1.0])  # logp - ref
    assert kl_penalty(logp, ref, "mse").tolist() == pytest.approx(kl_k2(logp, ref).tolist())


# ---------------------------------------------------------------- the KL term's gradient in a loss
# What each (estimator, use_bias_correction_kl) promises as the expected gradient of GAD's KL loss term
# (kl_loss_term's docstring, GADConfig's help), written out here, not read from the code under test:
# "fwd" d KL(pi || pi_ref), "rev" d KL(pi_ref || pi), "l1" d sum_v |pi(v) - pi_ref(v)|, "zero" 0.
PROMISED = {
    "k1": ("fwd", "zero"), "k3": ("fwd", "rev"), "k2": ("fwd", "fwd"), "full": ("fwd", "fwd"),
    "abs": ("l1", "l1"), "k1+": ("fwd", "fwd"), "k3+": ("fwd", "fwd"), "abs+": ("fwd", "fwd"),
}
VERL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "kl+": "k1+", "low_var_kl+": "k3+", "mse+": "k2",
                "k2+": "k2"}
V, C = 4, 2  # vocabulary, positions (independent: each has its own logits)
Z = torch.tensor([[1.0, -0.5, 0.3, -1.2], [0.2, 0.9, -0.7, 0.0]], dtype=torch.float64)  # policy logits [C, V]
Z_REF = torch.tensor([[-0.4, 0.6, 0.1, 0.8], [1.1, -0.3, 0.0, -0.9]], dtype=torch.float64)  # reference [C, V]
Z_OLD = torch.tensor([[0.5, 0.0, -0.2, -0.6], [-0.3, 0.4, 0.2, 0.7]], dtype=torch.float64)  # off-policy sampler


def _exact_gradient(kind: str, z: torch.Tensor) -> torch.Tensor:
    """d/dz of the promised divergence, summed over positions, by autograd of its closed form [C, V]."""
    z = z.detach().requires_grad_(True)
    logp, ref = torch.log_softmax(z, -1), torch.log_softmax(Z_REF, -1)  # [C, V]
    div = {"fwd": lambda: (logp.exp() * (logp - ref)).sum(), "rev": lambda: (ref.exp() * (ref - logp)).sum(),
           "l1": lambda: (logp.exp() - ref.exp()).abs().sum(), "zero": lambda: (0.0 * z).sum()}[kind]()
    return torch.autograd.grad(div, z)[0]


# off-policy (tokens drawn from pi_old) only with the ratio: without it nothing corrects for pi_old
KL_CASES = [(name, ratio, sampler) for name in list(PROMISED) + list(VERL_ALIASES) for ratio in (True, False)
            for sampler in ("on-policy", "old=None", "off-policy") if ratio or sampler != "off-policy"]


@pytest.mark.parametrize("name, bias_correction, sampler", KL_CASES)
def test_gad_kl_gradient_matches_exact_enumeration(name, bias_correction, sampler):
    """The expected gradient of kl_loss_term (GADTrainer's KL term), summed exactly over all
    V^C = 16 outcomes weighted by their probability under the sampler, equals the gradient its docstring
    promises. Before, the ratio was differentiable for every estimator: k2, k1+, k3+, abs+ got the KL's
    gradient plus a score term (relative error 0.44, 1.0, 0.35, 0.44 here). Off-policy (tokens drawn from
    pi_old) the ratio must correct it."""
    estimator = VERL_ALIASES.get(name, name)
    promised = PROMISED[estimator][0 if bias_correction else 1]
    z = Z.clone().requires_grad_(True)
    outcomes = torch.tensor(list(itertools.product(range(V), repeat=C)))  # [N=16, C]: every token pair
    pos = torch.arange(C).expand_as(outcomes)  # [N, C]
    logp = torch.log_softmax(z, -1)[pos, outcomes]  # [N, C] with graph to z
    ref_logp = torch.log_softmax(Z_REF, -1)[pos, outcomes]  # [N, C]
    old_logp = {"on-policy": logp.detach(), "old=None": None,
                "off-policy": torch.log_softmax(Z_OLD, -1)[pos, outcomes]}[sampler]  # [N, C]
    weight = (logp.detach() if old_logp is None else old_logp).sum(-1).exp()  # [N] P(outcome) under the sampler
    assert weight.sum().item() == pytest.approx(1.0, abs=1e-12)
    full = dict(logits=z.expand(len(outcomes), C, V), ref_logits=Z_REF.expand(len(outcomes), C, V))
    term = kl_loss_term(logp, None if estimator == "full" else ref_logp, old_logp, name, bias_correction,
                        **(full if estimator == "full" else {}))  # [N, C]
    (measured,) = torch.autograd.grad((weight * term.sum(-1)).sum(), z)  # E[d term], exactly: [C, V]
    exact = _exact_gradient(promised, Z)  # [C, V]
    if promised == "zero":
        assert measured.norm().item() < 1e-12, measured
        return
    assert exact.norm().item() > 0.1  # the distributions really differ
    rel = ((measured - exact).norm() / exact.norm()).item()
    assert rel < 1e-6, f"{name} ratio={bias_correction} {sampler}: gradient {promised}, relative error {rel:.3g}"


# log pi_ref - log pi, k3's value r - log r - 1 (r = e^x) and its gradient d/d logp = 1 - e^x, by hand:
#   x =  2.5 : e^2.5 - 3.5 = 8.682494, 1 - e^2.5 = -11.182494   (inside both clamps: TRL's own value)
#   x = -5   : e^-5 + 4    = 4.006738, 1 - e^-5  = 0.993262
#   x =  3   : e^3 - 4     = 16.0855 > 10 -> 10, gradient 0 (the value clamp)
#   x = -12  : e^-12 + 11  = 11.000006 > 10 -> 10, gradient 0
#   x =  100 : log-ratio clamped to 20 first (e^100 overflows fp32), e^20 - 21 > 10 -> 10, gradient 0
#   x = -100 : -> -20: e^-20 + 19 > 10 -> 10, gradient 0
K3_CLAMP_CASES = [(2.5, 8.682494, -11.182494), (-5.0, 4.006738, 0.993262), (3.0, 10.0, 0.0), (-12.0, 10.0, 0.0),
                  (100.0, 10.0, 0.0), (-100.0, 10.0, 0.0)]


@pytest.mark.parametrize("x, value, grad", K3_CLAMP_CASES)
def test_k3_clamps_are_verls_value_and_gradient_by_hand(x, value, grad):
    """verl's clamps (core_algos.kl_penalty, low_var_kl): log-ratio to [-20, 20] before the exp, value to
    [-10, 10] after; TRL 1.16's in-loss k3 has neither (inf and a NaN gradient at x = 100)."""
    assert (KL_LOG_RATIO_CLAMP, KL_VALUE_CLAMP) == (20.0, 10.0)
    logp = torch.tensor([0.0], requires_grad=True)
    kl = kl_k3(logp, torch.tensor([x]))
    (g,) = torch.autograd.grad(kl.sum(), logp)
    assert kl.item() == pytest.approx(value, rel=1e-6)
    assert g.item() == pytest.approx(grad, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("x", [2.5, 100.0, -100.0])
def test_straight_through_k3_keeps_the_clamped_value_and_k2s_gradient(x):
    """k3+ at a log-ratio x: the (clamped) k3 value, the gradient of k2 = 0.5 (logp - ref)^2, i.e. logp - ref = -x,
    finite even where k3's own exp would overflow."""
    logp = torch.tensor([0.0], requires_grad=True)
    kl = kl_penalty(logp, torch.tensor([x]), "k3+")
    (g,) = torch.autograd.grad(kl.sum(), logp)
    assert kl.item() == pytest.approx({c[0]: c[1] for c in K3_CLAMP_CASES}[x], rel=1e-6)
    assert g.item() == pytest.approx(-x)
