"""Checks no GRPO framework runs in a user's run (INVARIANTS.md I10; issue 19).

* **I10, step-0 identity.** Before the first optimizer step the policy has not moved, so on the
  first microbatch the reference (a separate ref model, PEFT's disabled adapter, a ``ref``
  adapter) and the "old" policy must give the loss's own per-token logprobs: KL 0 and ratio 1.
  A reference in another dtype, a ``ref`` adapter that is not the policy's start, dropout on one
  side or other position ids all break that, silently, from step 1 on.
* **Sampler/trainer mismatch.** Where the sampler's own logprobs exist, the raw (untruncated)
  importance ratio ``exp(logp_trainer - logp_sampler)`` per token and per sequence, and a gate on
  the mean ``|logp_sampler - logp_trainer|``.

Pure tensor functions; the trainer (``trainers/grpo.py``) calls them on tensors it already has.
"""

from __future__ import annotations

import math

import torch

from .errors import InvariantError
from .guards import _require_finite

# I10 tolerances, per token, in nats. fp32: the two forwards differ only in batch shape (the reference
# is computed over the whole generation batch, the loss over its microbatch), which moves a 49k-vocabulary
# log-softmax by ~1e-6 to 1e-5 nats (I5 measures up to 1.6e-5 between kernels): 1e-4 leaves a margin and
# still catches a bf16 reference (~1e-2 nats per token). bf16/fp16: a logit keeps 8 (11) mantissa bits,
# so two forwards of the same weights over differently shaped batches may differ by a rounding step of a
# large logit (0.06-0.125 nats at |logit| ~ 20) on single tokens; the mean over the microbatch's tokens
# stays near 1e-2. Low precision is therefore held on the mean (0.05) and on the worst token (1.0): a
# reference that is another model, adapter or dtype is off by 0.1-several nats on average.
FP32_MAX_GAP = 1e-4
LOW_PRECISION_MEAN_GAP = 0.05
LOW_PRECISION_MAX_GAP = 1.0


def masked_gap_stats(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, tuple[int, int]]:
    """Mean and max of ``|a - b|`` over ``mask`` (a, b, mask: [B, C]) and the (row, token) of the max.

    >>> a = torch.tensor([[0.0, -1.0, 5.0], [-2.0, -3.0, 0.0]])
    >>> b = torch.tensor([[0.0, -1.5, 9.0], [-2.0, -2.0, 0.0]])
    >>> masked_gap_stats(a, b, torch.tensor([[1, 1, 0], [1, 1, 0]]))  # the 4.0 is masked out
    (0.375, 1.0, (1, 1))
    """
    on = mask.bool()  # [B, C]
    gap = torch.where(on, (a.detach().float() - b.detach().float()).abs(), 0.0)  # [B, C]
    n = int(on.sum())
    if n == 0:
        return 0.0, 0.0, (0, 0)
    i, t = divmod(int(gap.argmax()), gap.size(1))
    return float(gap.sum()) / n, float(gap.max()), (i, t)


def identity_tolerance(low_precision: bool) -> tuple[float, float]:
    """(mean, max) per-token gap I10 allows: see the module constants for why."""
    return (LOW_PRECISION_MEAN_GAP, LOW_PRECISION_MAX_GAP) if low_precision else (FP32_MAX_GAP, FP32_MAX_GAP)


def check_step0_identity(tokenizer, policy: torch.Tensor, other: torch.Tensor, mask: torch.Tensor,
                         completion_ids: torch.Tensor, what: str, low_precision: bool, rows,
                         causes: str = "") -> tuple[float, float]:
    """I10: at step 0 ``other`` (the reference's or the old policy's per-token logprobs, [B, C]) equals
    the loss's own ``policy`` logprobs [B, C] on every token in ``mask`` [B, C]. Returns (mean, max) gap;
    raises naming the first worst token and the likely causes."""
    policy, other = policy.detach(), other.detach()
    _require_finite("I10", tokenizer, completion_ids, mask.bool(), rows, ("the loss's logprob", policy),
                    (f"the {what} logprob", other))
    mean, worst, (i, t) = masked_gap_stats(policy, other, mask)
    mean_tol, max_tol = identity_tolerance(low_precision)
    if not (mean <= mean_tol and worst <= max_tol):
        token = tokenizer.decode([int(completion_ids[i, t])]) if tokenizer is not None else "?"
        raise InvariantError(
            "I10",
            f"at step 0, before any update, the {what} logprobs are not the policy's: row {rows[i]}, completion "
            f"token {t} ({token!r}) has {float(other[i, t]):.6f} vs the policy's {float(policy[i, t]):.6f} "
            f"(gap {worst:.2e}; mean gap {mean:.2e} over {int(mask.sum())} tokens; allowed mean {mean_tol:.0e}, "
            f"max {max_tol:.0e} in {'bf16/fp16' if low_precision else 'fp32'}). Every KL / ratio from step 1 on "
            f"would measure this difference, not training.{causes}",
        )
    return mean, worst


def reference_causes(policy_model, ref_model, peft_ref_adapter: str | None) -> str:
    """What differs between the policy and the model that computed the reference logprobs, as
    " Likely cause: ..." sentences for I10's message ("" when nothing visible differs)."""
    found = []
    if ref_model is not None:
        p = next((x.dtype for x in policy_model.parameters() if x.is_floating_point()), None)
        r = next((x.dtype for x in ref_model.parameters() if x.is_floating_point()), None)
        if p != r:
            found.append(f"the reference model is in {r} and the policy in {p}: load both in one dtype")
        elif (name := _first_different_weight(policy_model, ref_model)) is not None:
            found.append(f"the weight {name!r} differs between the policy and the reference, which TRL loaded from "
                         f"{getattr(ref_model.config, '_name_or_path', '?')!r} (the policy's config path): a model "
                         "object changed after loading, or another checkpoint under that path; pass the trainer a "
                         "path, or save the changed model and pass that")
        if ref_model.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in ref_model.modules()):
            found.append("the reference model is in training mode with dropout on: call ref_model.eval() or "
                         "disable_dropout=True")
    if peft_ref_adapter:
        found.append(f"the reference is the PEFT adapter {peft_ref_adapter!r}, which is not the policy's starting "
                     "adapter: load it from the same checkpoint as the policy's")
    if not found:
        found.append("the reference model is not the policy's checkpoint (another path or revision), or it "
                     "received other position ids / attention masks")
    return " Likely cause: " + "; ".join(found) + "."


def _first_different_weight(policy_model, ref_model) -> str | None:
    """The first parameter name whose values differ between the two models (same names, same
    shapes; sharded or renamed parameters are skipped). Only called once I10 has failed."""
    ref = dict(ref_model.named_parameters())
    with torch.no_grad():
        for name, p in policy_model.named_parameters():
            r = ref.get(name)
            if r is not None and r.shape == p.shape and p.numel() and not torch.equal(p.detach().to(r.device, r.dtype),
                                                                                         r.detach()):
                return name
    return None


def raw_ratio_stats(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                    low: float = 0.5, high: float = 2.0) -> dict[str, float]:
    """The raw, untruncated importance ratio ``exp(logp_trainer - logp_sampler)`` per token and per
    sequence (``exp`` of the summed log-ratio over the sequence's tokens), and the mean absolute
    logprob gap, over ``mask`` [B, C]. Non-finite sampler values (a token the sampler gave -inf)
    count as out of range and are left out of the means.

    >>> s = raw_ratio_stats(torch.tensor([[0.0, math.log(4)]]), torch.zeros(1, 2), torch.ones(1, 2))
    >>> s["token/mean"], s["token/max"], s["token/outside_share"], round(s["seq/mean"], 6), round(s["abs_gap/mean"], 6)
    (2.5, 4.0, 0.5, 4.0, 0.693147)
    """
    on = mask.bool()  # [B, C]
    log_ratio = trainer_logps.detach().float() - sampler_logps.detach().float()  # [B, C]
    finite = on & torch.isfinite(log_ratio)  # [B, C]
    lr = log_ratio[finite]  # [N]
    token = lr.exp()  # [N]
    seq_lr = torch.where(finite, log_ratio, 0.0).sum(1)  # [B]
    seq_rows = on.any(1) & (finite.sum(1) == on.sum(1))  # [B] rows whose every token is finite
    seq = seq_lr[seq_rows].clamp(max=80.0).exp()  # [S]
    n_on, n_seq = int(on.sum()), int(on.any(1).sum())

    def stats(x: torch.Tensor, total: int, prefix: str) -> dict[str, float]:
        if x.numel() == 0:
            return {f"{prefix}/mean": math.nan, f"{prefix}/min": math.nan, f"{prefix}/max": math.nan,
                    f"{prefix}/outside_share": 1.0 if total else 0.0}
        inside = int(((x >= low) & (x <= high)).sum())
        return {f"{prefix}/mean": float(x.mean()), f"{prefix}/min": float(x.min()), f"{prefix}/max": float(x.max()),
                f"{prefix}/outside_share": (total - inside) / total}

    return {**stats(token, n_on, "token"), **stats(seq, n_seq, "seq"),
            "abs_gap/mean": float(lr.abs().mean()) if lr.numel() else math.nan}
