"""Run-time checks of INVARIANTS.md I5 and I7: the logprobs and entropies the loss used.

I5: the logprobs the loss used equal an independent ``log_softmax(logits / T)`` recomputation
(``recompute_logprobs``: a plain forward with generate's position ids, dropout off): in fp32 token by
token, to a tolerance relative to the logit scale; in bf16/fp16, where two correct forwards differ by
rounding, as a fitted temperature and the median and per-row gaps (``check_logprobs_in_precision``,
tolerances in ``precision``). I7: the entropy bonus enters the backpropagated loss as
``- c * H`` (``check_entropy_sign`` differentiates the loss along the entropy node), and that
node is the policy's own entropy (``check_entropy_values``). Also the helpers these comparisons
share (``masked_gap``, ``worst_token``, ``require_finite``; ``identity.py`` reuses them) and the
dropout test that skips them when no deterministic reference exists. ``grpotrl.guards``
re-exports the checks: the trainers call them from there.

Letters: B rows, C padded completion width, V vocabulary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..errors import InvariantError
from ..models.dropout import has_dropout
from ..ops.logprobs import completion_logits, fit_along, logit_scale, token_logprobs
from ..ops.masking import position_ids_from_mask
from .precision import Tolerances, gap_statistics

logger = logging.getLogger(__name__)


def dropout_active(model) -> bool:
    """Whether a training forward of ``model`` samples dropout masks (``models.dropout.has_dropout``: an
    ``nn.Dropout`` with p > 0, or an attention module's ``attention_dropout`` > 0)."""
    return model.training and has_dropout(model)


def skipped_for_dropout(model, checks: str, said: set) -> bool:
    """True when ``model``'s training forward samples dropout masks, so no deterministic reference
    exists for ``checks`` (which compare two forwards): said once per ``checks``, never an error."""
    if not dropout_active(model):
        return False
    if checks not in said:
        said.add(checks)
        logger.warning("grpotrl guard: %s not checked while dropout is active in the training forward "
                       "(disable_dropout=False, TRL's default): the loss then scores another function than the one "
                       "that sampled. Set disable_dropout=True to check them.", checks)
    return True


def masked_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``|a - b|`` in fp32 where ``mask`` is on, 0 elsewhere (a masked -inf cannot poison it): [B, C].

    >>> a, b = torch.tensor([[0.0, -1.0, float("-inf")]]), torch.tensor([[0.5, -1.0, 0.0]])
    >>> masked_gap(a, b, torch.tensor([[1, 1, 0]]))
    tensor([[0.5000, 0.0000, 0.0000]])
    """
    return torch.where(mask.bool(), (a.detach().float() - b.detach().float()).abs(), 0.0)


def worst_token(gap: torch.Tensor) -> tuple[int, int]:
    """(row, token) of the largest entry of a [B, C] gap (NaN counts as largest)."""
    return divmod(int(gap.argmax()), gap.size(1)) if gap.numel() else (0, 0)


# ---------------------------------------------------------------- I5: logprobs at temperature T


@dataclass(frozen=True)
class Recomputed:
    """What a guard step reads from I5's padded recompute of one microbatch, each [B, C] (the trainer reads them
    before the loss's forward, so that the [B, C, V] logits are gone before its graph exists): ``logprobs``
    (``log_softmax(logits / T)`` at generate's positions), ``scale`` (``max |logits / T|``), ``slope``
    (``ops.logprobs.temperature_slope``, which ``check_logprobs_in_precision`` fits along in bf16/fp16; None in
    fp32) and ``entropies`` (``ops.logprobs.entropy_from_logits``, for ``check_entropy_values``; None where no
    entropy bonus is on)."""

    logprobs: torch.Tensor
    scale: torch.Tensor
    slope: torch.Tensor | None
    entropies: torch.Tensor | None


@torch.no_grad()
def recompute_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int,
                       temperature: float, return_logits: bool = False) -> tuple[torch.Tensor, ...]:
    """Independent I5 reference: a plain forward with generate's position ids, dropout off,
    ``log_softmax(logits / T)`` at the logit of input position ``P + t - 1``.

    Returns the logprobs [B, C] and the logit scale ``max |logits / T|`` per token [B, C]:
    fp32 rounding of a logprob grows with it, and the I5 tolerance is relative to it. With
    ``return_logits`` also the completion logits [B, C, V] (the health signals read them)."""
    was_training = model.training
    model.eval()
    try:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
            logits_to_keep=completion_width + 1,
        )
    finally:
        model.train(was_training)
    logits = completion_logits(out.logits, completion_width)  # [B, C, V]
    scale = logit_scale(logits, temperature)  # [B, C]
    logprobs = token_logprobs(logits, input_ids[:, -completion_width:], temperature)  # [B, C]
    return (logprobs, scale, logits) if return_logits else (logprobs, scale)


def check_logprobs(tokenizer, used: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor,
                   completion_ids: torch.Tensor, temperature: float, atol: float, rows,
                   scale: torch.Tensor | None = None) -> float:
    """I5 in fp32: the logprobs the loss used agree with the reference on every masked-in token, to
    ``atol`` times the logit scale ``max |logits / T|`` where that exceeds 1 (fp32 rounding of
    a log-softmax over a 49k vocabulary grows with the logits: on SmolLM2 the fused head and a
    plain log_softmax differ by up to 1.6e-5 nats). Returns the largest scaled gap."""
    used = used.detach()
    on = mask.bool()  # [B, C]
    require_finite("I5", tokenizer, completion_ids, on, rows, ("the loss's logprob", used),
                    ("the independent log_softmax(logits / T)", reference),
                    *((("the logit scale max|logits / T|", scale),) if scale is not None else ()))
    gap = masked_gap(used, reference, on)  # [B, C]
    scaled = gap / (scale.float().clamp(min=1.0) if scale is not None else 1.0)  # [B, C]
    worst = float(scaled.max()) if scaled.numel() else 0.0
    if not worst <= atol:  # NaN fails too
        i, t = worst_token(scaled)
        raise InvariantError(
            "I5",
            f"row {rows[i]}, completion token {t} ({tokenizer.decode([int(completion_ids[i, t])])!r}): the "
            f"loss used logprob {float(used[i, t]):.6f}, but log_softmax(logits / T={temperature})[token] "
            f"with generate's position ids is {float(reference[i, t]):.6f} (gap {float(gap[i, t]):.2e}, "
            f"{worst:.1e} relative to the logit scale > {atol:.0e}).\n"
            "The loss must score tokens with the distribution that sampled them: divide the logits by the "
            "sampling temperature, take the logit at position P + t - 1, use the attention mask's position ids "
            "(cumsum - 1) as generate does, and turn dropout off (`disable_dropout=True`).",
        )
    return worst


def check_logprobs_in_precision(tokenizer, used: torch.Tensor, reference: torch.Tensor, slope: torch.Tensor,
                                scale: torch.Tensor, mask: torch.Tensor, completion_ids: torch.Tensor,
                                temperature: float, tol: Tolerances, rows,
                                packed: bool | str = False) -> dict[str, float]:
    """I5 in the forwards' compute precision (``tol``, ``guards.precision``). fp32: ``check_logprobs``, token
    by token. bf16/fp16, where two correct forwards differ by rounding: (1) the temperature the loss's
    logprobs follow, fitted along ``slope`` [B, C] (``ops.logprobs.temperature_slope`` of the reference's
    logits), within ``tol.scale_rtol`` (+ 4 standard errors) of ``temperature``; (2) what the fit leaves
    (other position ids, packed rows that see each other, another prompt or model): its median over the
    loss tokens ``<= tol.median_gap`` and no row's mean ``> tol.row_gap``. ``packed``: the loss's logprobs
    came from padding-free packed rows (said in the message): True or ``"mask"`` under the packed rows' mask,
    ``"varlen"`` under grpotrl's varlen attention. Returns the ``guards/logprob_*`` metrics."""
    if not tol.low_precision:
        try:
            worst = check_logprobs(tokenizer, used, reference, mask, completion_ids, temperature, tol.logprob_atol,
                                   rows, scale=scale)
        except InvariantError as err:
            if not packed:
                raise
            raise InvariantError("I5", str(err).removeprefix("[I5] ") + " " + _packed_cause(packed)) from err
        return {"guards/logprob_max_gap": worst}
    on = mask.bool()  # [B, C]
    require_finite("I5", tokenizer, completion_ids, on, rows, ("the loss's logprob", used.detach()),
                   ("the independent log_softmax(logits / T)", reference),
                   ("d logprob / d (1 / T)", slope))
    # a token's rounding noise is up to tol.median_gap: a fit over a few tokens cannot read a temperature below it
    coef, se, residual = fit_along(used.detach().float() - reference.float(), slope, on,
                                   noise=tol.median_gap)  # residual [B, C]
    fitted = _fitted_temperature(temperature, float(coef))
    ratio, ratio_se = fitted / temperature, temperature * float(se)
    stats = gap_statistics(residual, on, tol.row_min_tokens)
    metrics = {"guards/logprob_max_gap": _scaled_max(used, reference, on, scale), "guards/logprob_temperature_ratio": ratio,
               "guards/logprob_median_gap": stats.median, "guards/logprob_row_gap": stats.row_mean}
    if not tol.within_rounding(stats):
        i, t = worst_token(residual.abs())
        raise InvariantError(
            "I5",
            f"the loss's logprobs are not log_softmax(logits / T={temperature}) recomputed with generate's position "
            f"ids, by more than {tol.name} rounding: over {stats.tokens} loss tokens the median gap is "
            f"{stats.median:.3g} nats (rounding: <= {tol.median_gap:g}) and row {rows[stats.row]}'s mean gap "
            f"{stats.row_mean:.3g} (<= {tol.row_gap:g}); the worst token is row {rows[i]}, completion token {t} "
            f"({tokenizer.decode([int(completion_ids[i, t])])!r}): {float(used[i, t]):.4f} vs "
            f"{float(reference[i, t]):.4f} (the gaps fit a temperature of {fitted:.4g}).\n"
            + _layout_causes(packed),
        )
    if not abs(ratio - 1) <= tol.scale_rtol + 4 * ratio_se:  # NaN fails too
        raise InvariantError(
            "I5",
            f"the loss's logprobs follow temperature {fitted:.4g}, not the sampling temperature T={temperature}: "
            f"fitted along d logprob / d (1 / T) over {stats.tokens} loss tokens, the ratio is {ratio:.4f} "
            f"(+- {ratio_se:.1e}; {tol.name} rounding allows 1 +- {tol.scale_rtol:g}).\n"
            "The loss must score tokens with the distribution that sampled them: divide the logits by the "
            "sampling temperature, once, in every logprob forward (policy, old policy, reference).",
        )
    return metrics


def _scaled_max(used: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor, scale: torch.Tensor) -> float:
    """The largest ``|used - reference|`` over ``mask``, per nat of logit scale above 1 (the fp32 statistic)."""
    scaled = masked_gap(used, reference, mask) / scale.float().clamp(min=1.0)  # [B, C]
    return float(scaled.max()) if scaled.numel() else 0.0


def _fitted_temperature(temperature: float, coef: float) -> float:
    """The temperature whose inverse is ``1 / temperature + coef`` (inf where that is not positive)."""
    inverse = 1.0 / temperature + coef
    return 1.0 / inverse if inverse > 0 else float("inf")


def _layout_causes(packed: bool | str) -> str:
    causes = ("Rounding moves single tokens; this moves the bulk of the tokens or whole rows. Score each token "
              "with the logit at position P + t - 1 of the prompt generation saw, with the attention mask's "
              "position ids (cumsum - 1) as generate does, each sequence attending to itself only, dropout off "
              "(`disable_dropout=True`).")
    return causes + " " + _packed_cause(packed) if packed else causes


def _packed_cause(packed: bool | str) -> str:
    return _VARLEN_CAUSE if packed == "varlen" else _PACKED_CAUSE


_PACKED_CAUSE = ("padding_free is on: the loss's logprobs came from packed rows, the reference from the padded batch. "
                 "If the model's attention ignores packed rows (its own mask code, or no position_ids), set "
                 "padding_free=False.")
_VARLEN_CAUSE = ("padding_free is on with packed_attention='varlen': the loss's logprobs came from each forward's "
                 "sequences in one row under grpotrl's varlen attention, the reference from the padded batch (where "
                 "torch's varlen kernel runs, through that kernel, row by row). If the "
                 "model's attention layers ignore the sequence boundaries (cu_seq_lens) or compute something the "
                 "varlen attention does not (a window, a softcap, a bias), set packed_attention='mask'.")


def require_finite(invariant: str, tokenizer, completion_ids, on: torch.Tensor, rows, *named) -> None:
    """A guard cannot verify a comparison with NaN or inf in it: any non-finite value at a
    masked-in position of the named [B, C] tensors fails, naming the tensor, row and token
    (masked-out positions are never compared, so they may hold anything)."""
    for what, values in named:
        bad = on & ~torch.isfinite(values.detach().float())  # [B, C]
        if bad.any():
            i, t = (int(x) for x in bad.nonzero()[0])
            token = repr(tokenizer.decode([int(completion_ids[i, t])])) if tokenizer is not None else "?"
            raise InvariantError(
                invariant, f"row {rows[i] if rows is not None else i}, completion token {t} ({token}): {what} is "
                f"{float(values[i, t])} ({int(bad.sum())} such values on tokens in the loss). A guard cannot compare "
                "a non-finite value, and the loss would train on it: look for a NaN/inf in the logits (overflow in "
                "half precision, a division by a zero temperature, a -inf from a logits processor on a sampled token).")


# ---------------------------------------------------------------- I7: the entropy bonus's sign


def entropy_slopes(loss: torch.Tensor, pieces: list[torch.Tensor], accumulation: float = 1.0) -> list[float]:
    """``d loss / d H`` on the graph that will be backpropagated, for ``H`` the mean entropy of the
    tokens the loss reads, once per entropy tensor in ``pieces`` (e.g. each task's rows), in one
    backward pass and one host sync: the derivative along "every token's entropy in that piece rises
    by one" (``sum_t d loss / d H_t``), times the gradient-accumulation factor the loss was divided
    by. Only the path from ``loss`` back to the entropy nodes is walked (a few elementwise ops),
    never the model. 0 for a piece the loss does not depend on.

    >>> H = torch.tensor([[0.5, 1.0]], requires_grad=True)  # [B=1, C=2]
    >>> G = torch.tensor([[0.2, 0.4]], requires_grad=True)
    >>> [round(s, 6) for s in entropy_slopes(1.0 - 0.1 * H.mean() + 0.0 * G.sum(), [H, G])]
    [-0.1, 0.0]
    """
    live = [i for i, h in enumerate(pieces) if h.requires_grad]
    slopes = [0.0] * len(pieces)
    if not live:
        return slopes
    grads = torch.autograd.grad(loss, [pieces[i] for i in live], retain_graph=True, allow_unused=True)
    sums = torch.stack([g.float().sum() if g is not None else torch.zeros((), device=loss.device)
                        for g in grads])  # [n], in fp32: a bf16 sum would round once more
    for i, value in zip(live, sums.tolist()):
        slopes[i] = value * accumulation
    return slopes


def entropy_slope(loss: torch.Tensor, entropies: torch.Tensor, accumulation: float = 1.0) -> float:
    """``entropy_slopes`` of one entropy tensor.

    >>> H = torch.tensor([[0.5, 1.0]], requires_grad=True)  # [B=1, C=2]
    >>> round(entropy_slope(1.0 - 0.1 * H.mean(), H), 6)  # policy - c H with c = 0.1
    -0.1
    """
    return entropy_slopes(loss, [entropies], accumulation)[0]


def check_entropy_sign(loss: torch.Tensor, entropies: torch.Tensor | None, coef: float, accumulation: float,
                       where: str, acts: bool = True) -> float:
    """I7: ``loss = policy + beta * KL - c * H``, so ``d loss / d H`` must be ``-c`` (to ``SLOPE_RTOL``
    of c). ``acts``: whether the bonus acts on any token of the microbatch; where it does not (its
    mask is empty), the bonus is ``c * 0`` and the slope must be 0 (``check_slope``). Returns the measured
    slope; raises naming ``where`` otherwise."""
    if entropies is None:
        if coef:
            raise InvariantError("I7", f"{where}: an entropy bonus c={coef:g} is configured but the loss received "
                                 "no entropies (compute_entropy=False?), so the bonus cannot act.")
        return 0.0
    return check_slope(entropy_slope(loss, entropies, accumulation), coef, where, acts=acts)


# I7's tolerance on ``d loss / d H``, relative to ``c``: the loss gives each of its n bonus tokens the weight
# ``c / n``, which bf16 entropies round by up to 2^-8 (0.4%), the same way on every token; a flipped
# sign is 200% off, a missing bonus 100%, a bonus divided by the accumulation twice 50% or more.
SLOPE_RTOL = 1e-2


def check_slope(slope: float, coef: float, where: str, acts: bool = True) -> float:
    """I7 on a measured ``d loss / d H`` (``entropy_slopes``): it must be ``-c`` with ``c >= 0``, to
    ``SLOPE_RTOL`` of c, however small c is (a flipped ``c = 1e-5`` is as wrong as a flipped 0.1); a NaN
    or inf fails. Where the bonus acts on no token (``acts`` False: its mask is empty, so no sign can be
    read) or ``c`` is 0, the slope must be 0 to the same tolerance: the loss depends on no entropy outside
    the bonus's tokens. Returns ``slope``.

    >>> check_slope(-0.1, 0.1, "the loss"), check_slope(0.0, 0.1, "the loss", acts=False)
    (-0.1, 0.0)
    """
    if not coef >= 0:  # NaN fails too
        raise InvariantError("I7", f"{where}: the entropy bonus coefficient in force is c = {coef:g}. The loss is "
                             "policy + beta * KL - c * H with c >= 0: a negative c minimises entropy. Keep "
                             "entropy_coef (and entropy_coef_min with use_adaptive_entropy) >= 0.")
    want = coef if acts else 0.0
    if not abs(slope + want) <= SLOPE_RTOL * abs(coef):  # NaN fails too; c = 0: exactly 0
        if slope != slope or abs(slope) == float("inf"):
            problem = "the slope is not finite (a NaN/inf in the loss or the entropies), so it cannot be verified"
        elif not acts:
            problem = ("the bonus acts on no token of this microbatch (every loss token is masked), so the loss must "
                       "not depend on H at all: it reads entropies outside the tokens it trains on")
        elif coef and slope == 0.0:
            problem = "the bonus is missing from it (the entropies carry no gradient into the loss)"
        elif coef and slope * coef > 0:
            problem = ("the entropy term enters with a FLIPPED sign, so every step lowers entropy "
                       "(entropy then collapses, from ~1 to 0.005 in a multi-task CAGrad run)")
        else:
            problem = "the entropy term enters with the wrong weight"
        raise InvariantError(
            "I7",
            f"{where}: on the graph being backpropagated d loss / d H = {slope:+.6g}, but the entropy bonus "
            f"coefficient is c = {coef:g}, so it must be {0.0 - want:+.6g}: {problem}.\n"
            "The loss must be policy + beta * KL - c * H with c >= 0 encouraging exploration. Fix the sign where "
            "the entropy term is built; do not switch modes to hide it.",
        )
    return slope


def check_entropy_values(used: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor, tol: Tolerances) -> None:
    """I7: the entropy node the sign check differentiates is the policy's entropy: equal, on
    every masked-in token, to the entropy of ``softmax(logits / T)`` recomputed independently
    (so a negated or rescaled "entropy" cannot pass the sign check). fp32: token by token, to
    ``tol.entropy_atol``. bf16/fp16: ``H_used`` fitted as a multiple of ``H_ref`` within
    ``tol.scale_rtol`` (+ 4 standard errors) of 1, and what the fit leaves as I5's layout statistics
    (median ``<= tol.median_gap``, no row's mean ``> tol.row_gap``)."""
    on = mask.bool()  # [B, C]
    require_finite("I7", None, None, on, None, ("the entropy the loss used", used),
                    ("the entropy of softmax(logits / T)", reference))
    if tol.low_precision:
        coef, se, residual = fit_along(used.detach().float() - reference.float(), reference, on, noise=tol.median_gap)
        stats = gap_statistics(residual, on, tol.row_min_tokens)
        scale_ok = abs(float(coef)) <= tol.scale_rtol + 4 * float(se)
        if not (scale_ok and tol.within_rounding(stats)):  # NaN fails too
            raise InvariantError(
                "I7", f"the entropy the loss used is not the entropy of softmax(logits / T) within {tol.name} "
                f"rounding: over {stats.tokens} loss tokens it is {1 + float(coef):.4f} x the recomputed one (1 +- "
                f"{tol.scale_rtol:g}), and what that leaves has median {stats.median:.3g} (<= {tol.median_gap:g}) and "
                f"row {stats.row}'s mean {stats.row_mean:.3g} (<= {tol.row_gap:g}). The entropy bonus must act on "
                "the policy's own entropy at the sampling temperature.")
        return
    gap = masked_gap(used, reference, on)  # [B, C]
    worst, atol = float(gap.max()) if gap.numel() else 0.0, tol.entropy_atol
    if not worst <= atol:
        i, t = worst_token(gap)
        raise InvariantError(
            "I7", f"row {i}, completion token {t}: the entropy the loss used is {float(used[i, t]):.6f} but the "
            f"entropy of softmax(logits / T) there is {float(reference[i, t]):.6f} (gap {worst:.2e} > {atol:.0e}). "
            "The entropy bonus must act on the policy's own entropy at the sampling temperature.",
        )
