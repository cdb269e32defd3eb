"""CAGrad weight solver (grpotrl.losses.cagrad_*) against hand-built gradients and the reference.

The reference is ``cagrad()`` in Cranial-XIX/CAGrad nyuv2/utils.py, ported verbatim below
(numpy + scipy SLSQP): it returns the update direction ``d``; ours returns coefficients with
``d = sum_k coef_k g_k``. Directions are compared, weights may be non-unique (aligned tasks).
"""

import math

import numpy as np
import pytest
import torch

from grpotrl.ops.losses import cagrad_coefficients, cagrad_weights, merge_rows


def reference_cagrad(grads: np.ndarray, alpha: float = 0.5, rescale: int = 1) -> np.ndarray:
    """Cranial-XIX/CAGrad nyuv2/utils.py ``cagrad``; grads [dim, K] as there."""
    from scipy.optimize import minimize

    num_tasks = grads.shape[1]
    GG = grads.T @ grads
    g0_norm = np.sqrt(GG.mean() + 1e-8)
    x_start = np.ones(num_tasks) / num_tasks
    bnds = tuple((0, 1) for _ in x_start)
    cons = {"type": "eq", "fun": lambda x: 1 - sum(x)}
    A, b = GG, x_start.copy()
    c = alpha * g0_norm + 1e-8

    def objfn(x):
        return (x.reshape(1, num_tasks).dot(A).dot(b.reshape(num_tasks, 1))
                + c * np.sqrt(x.reshape(1, num_tasks).dot(A).dot(x.reshape(num_tasks, 1)) + 1e-8)).sum()

    res = minimize(objfn, x_start, bounds=bnds, constraints=cons, options={"ftol": 1e-12})
    ww = res.x
    gw = (grads * ww.reshape(1, -1)).sum(1)
    gw_norm = np.linalg.norm(gw)
    lmbda = c / (gw_norm + 1e-8)
    g = grads.mean(1) + lmbda * gw
    return {0: g, 1: g / (1 + alpha**2), 2: g / (1 + alpha)}[rescale]


def ours(grads: np.ndarray, alpha: float, rescale: int = 1) -> np.ndarray:
    G = torch.tensor(grads, dtype=torch.float64)  # [dim, K]
    coef, _ = cagrad_coefficients(G.T @ G, alpha, rescale)
    return (G * coef.double()).sum(1).numpy()


def angle(deg: float, norm: float = 1.0) -> list[float]:
    return [norm * math.cos(math.radians(deg)), norm * math.sin(math.radians(deg))]


def test_aligned_tasks_hand_derived():
    # g1 = (1, 0), g2 = (2, 0): g0 = (1.5, 0); F(t) = (2 - t)(1.5 + 0.5 * 1.5) is least at t = 1,
    # so w = (1, 0), g_w = g1, lambda = 0.5 * 1.5 / 1 = 0.75, d = (1.5 + 0.75, 0) / 1.25 = (1.8, 0)
    grads = np.array([[1.0, 2.0], [0.0, 0.0]])
    assert ours(grads, 0.5) == pytest.approx([1.8, 0.0], abs=1e-4)
    assert ours(grads, 0.5) == pytest.approx(reference_cagrad(grads, 0.5), abs=1e-4)


def test_orthogonal_tasks_hand_derived():
    # g1 = (1, 0), g2 = (0, 1): symmetric, w = (0.5, 0.5), g_w = g0, lambda = 0.5,
    # d = 1.5 g0 / 1.25 = (0.6, 0.6)
    grads = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert cagrad_weights(torch.eye(2), 0.5).tolist() == pytest.approx([0.5, 0.5], abs=1e-6)
    assert ours(grads, 0.5) == pytest.approx([0.6, 0.6], abs=1e-4)
    assert ours(grads, 0.5) == pytest.approx(reference_cagrad(grads, 0.5), abs=1e-4)


@pytest.mark.parametrize("norm2", [1.0, 2.0, 0.3])
def test_conflicting_at_150_degrees_matches_reference(norm2):
    grads = np.array([angle(0), angle(150, norm2)]).T  # [2, K=2]
    d = ours(grads, 0.5)
    assert d == pytest.approx(reference_cagrad(grads, 0.5), abs=1e-4)
    # CAGrad's point: within the ball |d - g0| <= alpha |g0| (d before its 1 / (1 + alpha^2)
    # rescale) it maximises the worst task's improvement min_k g_k . d, so it does at least as
    # well for the worst task as the mean gradient g0 (which is in the ball)
    g0 = grads.mean(1)
    assert min(grads.T @ (d * 1.25)) >= min(grads.T @ g0) - 1e-9


def test_conflicting_unequal_norms_against_a_dense_grid():
    """Independent of both solvers: minimise the 1-D objective on a 1e-6 grid."""
    g = np.array([angle(0), angle(150, 2.0)]).T  # [2, 2]
    A = g.T @ g
    c = 0.5 * math.sqrt(A.mean())
    t = np.linspace(0.0, 1.0, 1_000_001)
    x = np.stack([t, 1 - t], 1)  # [N, 2]
    F = x @ A @ np.array([0.5, 0.5]) + c * np.sqrt(np.einsum("ni,ij,nj->n", x, A, x) + 1e-8)
    w = cagrad_weights(torch.tensor(A), 0.5)
    assert w[0].item() == pytest.approx(t[F.argmin()], abs=1e-4)


@pytest.mark.parametrize("scale", [1e-12, 1e-6, 1.0, 1e6])
def test_two_tasks_closed_form_is_scale_free(scale):
    """CAGrad is scale-free: every gradient times s (the Gram matrix times s^2) scales the objective by s^2 and
    leaves the weights and lambda = alpha |g0| / |g_w| as they are, so the coefficients must not move. Worked by
    hand at alpha = 1: g1 = (2, 0), g2 = (-1, 1); Gram [[4, -2], [-2, 2]], g0 = (0.5, 0.5), |g0| = 1/sqrt2.
    With w = (t, 1 - t): g_w = (3t - 1, 1 - t), g_w . g0 = t, |g0| |g_w| = sqrt(5t^2 - 4t + 1), so
    F(t) = t + sqrt(5t^2 - 4t + 1); F'(t) = 0 at 2 - 5t = sqrt(5t^2 - 4t + 1) (5t < 2): 20t^2 - 16t + 3 = 0,
    t = 0.3 (the root 0.5 has 5t > 2); F(0.3) = 0.8 < F(0) = 1 < F(1) = 2.41.
    g_w = (-0.1, 0.7), |g_w| = 1/sqrt2, lambda = 1; d = (g0 + g_w) / (1 + 1) = (0.2, 0.6) = 0.4 g1 + 0.6 g2:
    coef = (1/2 + 0.3, 1/2 + 0.7) / 2 = (0.4, 0.6). Left absolute, the solver's 1e-8 terms move w to
    (0.2988, 0.7012) at the Gram matrix times 1e-6, and to the corner (0, 1), coef (0.25, 0.50), at 1e-12
    (gradient norms of 1e-6). Tolerance: the coefficients come back in fp32 (1e-7), t to ~sqrt(fp64 eps) = 1e-8."""
    gram = torch.tensor([[4.0, -2.0], [-2.0, 2.0]], dtype=torch.float64) * scale
    coef, w = cagrad_coefficients(gram, 1.0)
    assert w.tolist() == pytest.approx([0.3, 0.7], abs=1e-6)
    assert coef.tolist() == pytest.approx([0.4, 0.6], abs=1e-6)
    d = coef.double() @ torch.tensor([[2.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)  # the update at s = 1
    assert d.tolist() == pytest.approx([0.2, 0.6], abs=1e-6)


def test_alpha_zero_is_the_mean_gradient():
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(7, 3))
    assert ours(grads, 0.0) == pytest.approx(grads.mean(1), abs=1e-6)


@pytest.mark.parametrize("K", [3, 4])
def test_more_tasks_match_reference(K):
    rng = np.random.default_rng(K)
    grads = rng.normal(size=(6, K))
    grads[:, 0] *= -1.5  # a conflicting, larger task
    assert ours(grads, 0.4) == pytest.approx(reference_cagrad(grads, 0.4), abs=1e-4)


def test_merge_rows_puts_rows_back_and_keep_attaches_one_piece_only():
    """MultiTaskGRPOTrainer's per-task forward: task 0 scored rows 0 and 2, task 1 row 1."""
    a = torch.tensor([[1.0, 1.0], [3.0, 3.0]], requires_grad=True)  # [n_0=2, C=2]
    b = torch.tensor([[2.0, 2.0]], requires_grad=True)  # [n_1=1, C=2]
    rows = {0: torch.tensor([0, 2]), 1: torch.tensor([1])}
    whole = merge_rows({0: a, 1: b}, rows)  # [B=3, C=2]
    assert whole[:, 0].tolist() == [1.0, 2.0, 3.0]
    ga, gb = torch.autograd.grad((whole * torch.tensor([[1.0], [10.0], [100.0]])).sum(), [a, b])
    assert ga.tolist() == [[1.0, 1.0], [100.0, 100.0]] and gb.tolist() == [[10.0, 10.0]]
    only_a = merge_rows({0: a, 1: b}, rows, keep=0)  # same values; b's graph is never walked from it
    assert torch.equal(only_a, whole)
    assert torch.autograd.grad(only_a.sum(), [a, b], allow_unused=True)[1] is None
