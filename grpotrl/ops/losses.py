"""Loss-side tensor math: pure functions.

Letters: B rows, C completion width.
"""

from __future__ import annotations

import math

import torch


def importance_sampling_ratio(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                              mode: str = "sequence_mask", clip_min: float | None = None,
                              clip_max: float | None = 3.0) -> torch.Tensor:
    """TRL's truncated importance-sampling correction (its vLLM knobs), as a function.

    ``ratio = exp(trainer - sampler)`` per token (``token_*``, [B, C]) or per sequence summed
    over the mask (``sequence_*``, [B, 1]); ``*_truncate`` clamps it to [clip_min, clip_max],
    ``*_mask`` zeroes ratios outside. Tokens outside ``mask`` and NaN gaps count as ratio 1.

    >>> t, s, m = torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, -2.0]]), torch.ones(1, 2)
    >>> importance_sampling_ratio(t, s, m, "token_truncate", clip_max=2.0).tolist()  # exp(0), exp(1) -> 2
    [[1.0, 2.0]]
    >>> importance_sampling_ratio(t, s, m, "sequence_mask", clip_max=3.0).tolist()  # exp(1) = 2.718 <= 3
    [[2.7182817459106445]]
    """
    diff = torch.nan_to_num((trainer_logps - sampler_logps) * mask, nan=0.0)  # [B, C]
    if mode.startswith("sequence_"):
        diff = diff.sum(dim=-1, keepdim=True)  # [B, 1]
    elif not mode.startswith("token_"):
        raise ValueError(f"importance sampling mode {mode!r}: use token_/sequence_ + truncate/mask")
    ratio = torch.exp(diff)
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode.endswith("_mask"):
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"importance sampling mode {mode!r}: use token_/sequence_ + truncate/mask")


# ---------------------------------------------------------------- KL to the reference policy
#
# Per-token estimators of KL(pi || pi_ref) from the sampled token's logprobs (verl's names in
# brackets), and the exact KL over the vocabulary. ``logp`` and ``ref_logp`` are [B, C].
# ``kl_loss_term`` is the KL term of a loss built from them; its docstring says which gradient
# each estimator gives there, with and without the importance ratio.

KL_ESTIMATORS = ("k1", "abs", "k2", "k3", "full")


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """``log pi - log pi_ref`` [kl]: unbiased, high variance, can be negative.

    >>> kl_k1(torch.tensor([-1.0]), torch.tensor([-2.0])).tolist()
    [1.0]
    """
    return logp - ref_logp


def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """``|log pi - log pi_ref|`` [abs]."""
    return (logp - ref_logp).abs()


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """``0.5 (log pi - log pi_ref)^2`` [mse]: biased, low variance, never negative.

    >>> kl_k2(torch.tensor([-1.0]), torch.tensor([-3.0])).tolist()
    [2.0]
    """
    return 0.5 * (logp - ref_logp) ** 2


# verl's clamps of k3 (core_algos.kl_penalty, "low_var_kl"): the log-ratio before the exp, the value
# after it. TRL 1.16's in-loss k3 has neither: at log pi_ref - log pi = 100, exp overflows fp32, the
# value is inf and its gradient NaN. Inside both bounds k3 is computed by TRL's own expression.
KL_LOG_RATIO_CLAMP = 20.0  # |log pi_ref - log pi| is clamped to this before exp (e^20 ~ 4.9e8)
KL_VALUE_CLAMP = 10.0  # the k3 value is clamped to [-10, 10]; outside, its gradient is 0


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, clamp: float = KL_VALUE_CLAMP) -> torch.Tensor:
    """``r - log r - 1`` with ``r = pi_ref / pi`` [low_var_kl]: unbiased, never negative.
    As verl does, the log-ratio is clamped to [-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP] (20) BEFORE
    the exp and the value to [-clamp, clamp] (KL_VALUE_CLAMP, 10) after: clamping only the value
    leaves ``inf - inf`` in the backward pass, a NaN gradient for far-off tokens (logp = -100,
    ref = 0). A clamped token contributes the bound and no gradient.

    >>> round(kl_k3(torch.tensor([0.0]), torch.tensor([-1.0])).item(), 6)  # e^-1 + 1 - 1
    0.367879
    >>> kl_k3(torch.tensor([-100.0]), torch.tensor([0.0])).item()  # e^100 overflows fp32: clamped
    10.0
    """
    log_r = (ref_logp - logp).clamp(min=-KL_LOG_RATIO_CLAMP, max=KL_LOG_RATIO_CLAMP)
    return (torch.exp(log_r) - log_r - 1).clamp(min=-clamp, max=clamp)


def kl_full(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Exact ``KL(pi || pi_ref) = sum_v pi(v) (log pi(v) - log pi_ref(v))`` per position, from
    logits [B, C, V] at the sampling temperature; returns [B, C]. verl leaves it unimplemented.

    >>> lg, ref = torch.tensor([[[0.0, 0.0]]]), torch.tensor([[[0.0, -1e9]]])  # pi=(.5,.5), ref=(1,0)
    >>> kl_full(ref, lg).tolist()  # KL((1,0) || (.5,.5)) = log 2
    [[0.6931471824645996]]
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)  # at least fp32; fp64 stays fp64
    logp = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)  # [B, C, V]
    ref = torch.log_softmax(ref_logits.to(dtype) / temperature, dim=-1)  # [B, C, V]
    return (logp.exp() * (logp - ref)).sum(-1)  # [B, C]


# verl's names for the same estimators (``actor.kl_loss_type``, ``algorithm.kl_penalty``)
VERL_KL_NAMES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def kl_estimator_name(name: str) -> str:
    """grpotrl's name of an estimator given by ours or verl's, with verl's straight-through ``+``
    suffix kept (``k3+``: k3's value, k2's gradient); ``k2+`` is k2, as in verl.

    >>> [kl_estimator_name(n) for n in ("low_var_kl", "kl", "mse", "low_var_kl+", "k2+", "full")]
    ['k3', 'k1', 'k2', 'k3+', 'k2', 'full']
    """
    base, plus = (name[:-1], "+") if isinstance(name, str) and name.endswith("+") else (name, "")
    base = VERL_KL_NAMES.get(base, base)
    if base not in KL_ESTIMATORS or (plus and base == "full"):
        raise ValueError(f"KL estimator {name!r}: use one of {list(KL_ESTIMATORS)} or verl's {list(VERL_KL_NAMES)}, "
                         "optionally with '+' (straight-through: the estimator's value, k2's gradient; not 'full').")
    return base if base == "k2" else base + plus


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """The sample-based estimators by name, ours or verl's (``full`` needs logits: call ``kl_full``).
    With a ``+`` suffix the value is the estimator's and the gradient k2's, ``(log pi - log pi_ref)
    d log pi``, whose expectation over ``x ~ pi`` is the gradient of KL(pi || pi_ref) (k1's and k3's
    are not): verl's straight-through trick. That holds for this tensor's own gradient; times a
    differentiable importance ratio it no longer does (``kl_loss_term`` detaches the ratio)."""
    estimator = kl_estimator_name(estimator)
    base = estimator.rstrip("+")
    value = {"k1": kl_k1, "abs": kl_abs, "k2": kl_k2, "k3": kl_k3}.get(base)
    if value is None:
        raise ValueError(f"KL estimator {estimator!r} needs logits: call kl_full")
    kl = value(logp, ref_logp)
    if not estimator.endswith("+"):
        return kl
    grad = kl_k2(logp, ref_logp)
    return grad - grad.detach() + kl.detach()


# Estimators whose gradient in a loss comes from the importance ratio's score term on their value
# (``kl * d log pi``): k1 and k3, whose values are unbiased for the KL. Every other estimator's own
# gradient is the one promised, so the ratio enters those by its value only.
SCORE_FUNCTION_KL = ("k1", "k3")


def kl_loss_term(logp: torch.Tensor, ref_logp: torch.Tensor | None, old_logp: torch.Tensor | None,
                 estimator: str, bias_correction: bool, *, logits: torch.Tensor | None = None,
                 ref_logits: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
    """The per-token KL term of the loss [B, C], before ``beta`` and the loss's reduction.

    ``logp`` [B, C]: the policy's logprobs of the sampled tokens, with their graph; ``ref_logp``
    [B, C] the reference's (None for ``full``, which takes ``logits`` / ``ref_logits`` [B, C, V] at
    ``temperature`` instead); ``old_logp`` [B, C] the sampling policy's (None: on-policy, ``logp``
    detached, as TRL). ``bias_correction`` (TRL's ``use_bias_correction_kl``) multiplies by the
    per-token ratio ``r = exp(logp - old_logp)``, value 1 on-policy: differentiably for k1 and k3,
    whose gradient then gains the score term ``kl * d log pi``, and by its value only for the
    rest, whose own gradient already is the one promised (a second, score term would be added on
    top: for k2 and the ``+`` variants the gradient of KL(pi || pi_ref) counted twice over).

    Expected gradient per position, over the sampled token ``x ~ pi(.|prefix)``, the prefix held
    fixed (as in every per-token KL loss); with the correction also off-policy (``x ~ pi_old``).
    ``full``'s is exact for each sample on-policy, not only in expectation:

    ==========================  ================================  ===================================
    estimator                   bias_correction=True (default)    bias_correction=False (on-policy)
    ==========================  ================================  ===================================
    k1 [kl]                     d KL(pi || pi_ref)                0: noise only (GADConfig refuses)
    k3 [low_var_kl], TRL's      d KL(pi || pi_ref)                d KL(pi_ref || pi), the other KL
    k2 [mse], k1+, k3+, abs+    d KL(pi || pi_ref)                d KL(pi || pi_ref)
    full                        d KL(pi || pi_ref), exact         d KL(pi || pi_ref), exact
    abs                         d sum_v |pi(v) - pi_ref(v)|       d sum_v |pi(v) - pi_ref(v)|
    ==========================  ================================  ===================================

    abs is not a KL penalty in the loss: its gradient ``sign(log pi - log pi_ref) d log pi`` is, in
    expectation, that of the L1 distance (twice the total variation); ``abs+`` has abs's value and
    the KL's gradient. The ratio is per token whatever the policy loss's ``importance_sampling_level``:
    TRL multiplies by its ``coef_1``, which under ``"sequence"`` is the sequence's mean log-ratio
    broadcast to every token, and the table then fails (two independent positions: k1 gets half
    the gradient). tests/ops/test_losses.py checks every cell by exact enumeration of a small vocabulary.

    >>> lp, ref = torch.tensor([[-1.0]], requires_grad=True), torch.tensor([[-2.0]])
    >>> (g,) = torch.autograd.grad(kl_loss_term(lp, ref, None, "k1", True).sum(), lp)
    >>> g.item()  # d k1 + k1 * d log pi = 1 + 1
    2.0
    >>> (g,) = torch.autograd.grad(kl_loss_term(lp, ref, None, "k2", True).sum(), lp)
    >>> g.item()  # d k2 = logp - ref; the ratio enters by its value, 1
    1.0
    """
    estimator = kl_estimator_name(estimator)
    if estimator == "full":
        if logits is None or ref_logits is None:
            raise ValueError("kl_estimator 'full' needs the logits of both models: pass logits= and ref_logits=")
        kl = kl_full(logits, ref_logits, temperature)  # [B, C]
    else:
        kl = kl_penalty(logp, ref_logp, estimator)  # [B, C]
    if not bias_correction:
        return kl
    ratio = torch.exp(logp - (logp.detach() if old_logp is None else old_logp))  # [B, C], 1 on-policy
    return kl * (ratio if estimator in SCORE_FUNCTION_KL else ratio.detach())  # [B, C]


# ---------------------------------------------------------------- CAGrad (Liu et al., NeurIPS 2021)
# Letters: K tasks. The reference is Cranial-XIX/CAGrad, ``cagrad()`` in nyuv2/utils.py.


def _cagrad_objective(x: torch.Tensor, gram: torch.Tensor, b: torch.Tensor, c: float) -> torch.Tensor:
    """``g_w . g0 + c ||g0|| ||g_w||`` for the weights ``x`` [..., K]; ``c`` already holds ``alpha ||g0||``."""
    return (x @ gram @ b) + c * ((x @ gram * x).sum(-1) + 1e-8).sqrt()


def _golden_min(f, lo: float, hi: float, iters: int = 90) -> float:
    """Minimiser of a convex function of one variable on [lo, hi] (golden section; 0.618^90 ~ 1e-19)."""
    r = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    x1, x2 = b - r * (b - a), a + r * (b - a)
    f1, f2 = f(x1), f(x2)
    for _ in range(iters):
        if f1 <= f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - r * (b - a)
            f1 = f(x1)
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + r * (b - a)
            f2 = f(x2)
    return (a + b) / 2


def _unit_gram(gram: torch.Tensor) -> torch.Tensor:
    """``gram`` [K, K] in float64 on CPU, divided by its mean diagonal (the tasks' mean squared gradient norm).
    CAGrad's weights and coefficients do not change when every gradient is scaled by the same factor (the
    objective scales by its square, ``lambda`` not at all), and on the unit scale the solver's absolute 1e-8
    terms stay negligible for gradients of any size: unscaled, a Gram matrix of 1e-12 (gradient norms of 1e-6)
    has ``||g_w||^2`` below them, and the weights go to a corner of the simplex. An all-zero matrix is returned
    as it is."""
    gram = gram.detach().double().cpu()
    scale = gram.diagonal().mean()
    return gram / scale if scale > 0 else gram


def cagrad_weights(gram: torch.Tensor, alpha: float, sweeps: int = 50) -> torch.Tensor:
    """The simplex weights ``w`` [K] that minimise ``g_w . g0 + alpha ||g0|| ||g_w||``, where
    ``g_w = sum_k w_k g_k``, ``g0`` the mean task gradient, from the Gram matrix ``gram`` [K, K]
    (``gram[i, j] = g_i . g_j``). The objective is convex; it is minimised by exact line
    searches that move weight between two tasks at a time (one search solves K = 2).

    >>> cagrad_weights(torch.eye(2), 0.5).tolist()  # orthogonal, equal norms: symmetric
    [0.5, 0.5]
    """
    gram = _unit_gram(gram)
    K = gram.size(0)
    b = torch.full((K,), 1.0 / K, dtype=torch.float64)
    c = alpha * math.sqrt(max(gram.mean().item(), 0.0))
    x = b.clone()
    for _ in range(sweeps):
        before = _cagrad_objective(x, gram, b, c).item()
        for i in range(K):
            for j in range(i + 1, K):
                total = (x[i] + x[j]).item()

                def f(t, i=i, j=j, total=total):
                    y = x.clone()
                    y[i], y[j] = t, total - t
                    return _cagrad_objective(y, gram, b, c).item()

                t = _golden_min(f, 0.0, total)
                x[i], x[j] = t, total - t
        if K == 2 or before - _cagrad_objective(x, gram, b, c).item() < 1e-15:
            break
    return x.float()


def cagrad_coefficients(gram: torch.Tensor, alpha: float, rescale: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """CAGrad's update as a combination of the task gradients: ``d = sum_k coef_k g_k`` with
    ``d = g0 + lambda g_w``, ``lambda = alpha ||g0|| / ||g_w||``, divided by ``1 + alpha^2`` for
    ``rescale=1`` (the reference's default), ``1 + alpha`` for 2, unscaled for 0.
    Returns (coef [K], w [K]). ``alpha = 0`` gives the mean gradient. Scale-free, as CAGrad is: every gradient
    times ``s`` (``gram`` times ``s^2``) gives the same coefficients (``_unit_gram``).

    >>> coef, w = cagrad_coefficients(torch.eye(2), 0.0)
    >>> coef.tolist()
    [0.5, 0.5]
    >>> coef, w = cagrad_coefficients(torch.eye(2), 0.5)  # d = (1 + 0.5) g0 / (1 + 0.25)
    >>> [round(v, 6) for v in coef.tolist()]
    [0.6, 0.6]
    """
    K = gram.size(0)
    gram = _unit_gram(gram)  # the coefficients are scale-free; lambda's 1e-8 then is relative
    w = cagrad_weights(gram, alpha).double()
    g0_norm = math.sqrt(max(gram.mean().item(), 0.0))
    gw_norm = math.sqrt(max((w @ gram @ w).item(), 0.0))
    lam = alpha * g0_norm / (gw_norm + 1e-8)
    coef = torch.full((K,), 1.0 / K, dtype=torch.float64) + lam * w
    coef = coef / {0: 1.0, 1: 1 + alpha**2, 2: 1 + alpha}[rescale]
    return coef.float(), w.float()


# ---------------------------------------------------------------- rows computed in pieces


def merge_rows(pieces: dict, rows: dict, keep=None) -> torch.Tensor:
    """A batch computed in pieces, its rows put back in order: ``out[rows[k]] = pieces[k]``
    (``pieces[k]`` [n_k, ...], ``rows[k]`` [n_k] row indices; together every row once). With
    ``keep``, only ``pieces[keep]`` stays attached to its graph: a backward from a function of the
    result then walks that piece's graph alone, not the others' on zero gradients.

    >>> a, b = torch.tensor([[1.0], [3.0]]), torch.tensor([[2.0]])
    >>> merge_rows({0: a, 1: b}, {0: torch.tensor([0, 2]), 1: torch.tensor([1])}).flatten().tolist()
    [1.0, 2.0, 3.0]
    """
    flat = torch.cat([p if keep is None or k == keep else p.detach() for k, p in pieces.items()])  # [B, ...]
    order = torch.cat([rows[k] for k in pieces])  # [B]: flat's row i is the batch's row order[i]
    return flat[torch.argsort(order)]
