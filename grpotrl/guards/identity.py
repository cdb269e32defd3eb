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

import logging
import math

import torch

from ..errors import InvariantError
from .logprobs import require_finite, masked_gap, worst_token
from ..ops.losses import importance_sampling_ratio

logger = logging.getLogger(__name__)

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
    gap = masked_gap(a, b, mask)  # [B, C]
    n = int(mask.bool().sum())
    if n == 0:
        return 0.0, 0.0, (0, 0)
    return float(gap.sum()) / n, float(gap.max()), worst_token(gap)


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
    require_finite("I10", tokenizer, completion_ids, mask.bool(), rows, ("the loss's logprob", policy),
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


def check_step0_logprobs(tokenizer, used: torch.Tensor, inputs: dict, loss_mask: torch.Tensor, rows,
                         low_precision: bool, policy_model, ref_model) -> dict[str, float]:
    """I10 on the loss's first (step-0) microbatch: the reference's (``ref_per_token_logps``) and the
    old policy's (``old_per_token_logps``) logprobs in ``inputs``, where present, equal the loss's own
    ``used`` [B, C] on ``loss_mask``. ``policy_model`` / ``ref_model``: unwrapped, for the likely causes.
    Returns ``identity/step0_{ref,old}_logp_gap/{mean,max}``."""
    sides = []
    if inputs.get("ref_per_token_logps") is not None:
        adapter = "ref" if "ref" in (getattr(policy_model, "peft_config", None) or {}) else None
        sides.append(("ref", "reference", inputs["ref_per_token_logps"],
                      reference_causes(policy_model, ref_model, adapter)))
    if inputs.get("old_per_token_logps") is not None:
        sides.append(("old", "old policy", inputs["old_per_token_logps"],
                      " Likely cause: the old logprobs were computed by another forward (other position ids, "
                      "dtype or dropout) than the loss's."))
    out = {}
    for key, what, other, causes in sides:
        mean, worst = check_step0_identity(tokenizer, used, other, loss_mask, inputs["completion_ids"], what,
                                           low_precision, rows, causes)
        out[f"identity/step0_{key}_logp_gap/mean"], out[f"identity/step0_{key}_logp_gap/max"] = mean, worst
    return out


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


def correct_advantages(output: dict, args) -> torch.Tensor:
    """TRL's truncated importance-sampling correction on a transformers-path batch: the ratio
    ``old_per_token_logps`` / ``sampling_per_token_logps`` (``args.vllm_importance_sampling_*``)
    multiplies ``output["advantages"]`` in place, which equals TRL's ``per_token_loss * ratio`` for
    the loss types linear in the advantage (every type but vespo, refused at init); the KL term stays
    unscaled. Returns the ratio [B, C] or [B, 1]."""
    ratio = importance_sampling_ratio(output["old_per_token_logps"], output["sampling_per_token_logps"],
                                      output["completion_mask"], args.vllm_importance_sampling_mode,
                                      args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max)
    output["advantages"] = output["advantages"].unsqueeze(1) * ratio  # [B, C] or [B, 1]
    return ratio


RATIO_STATS = ("token/mean", "token/min", "token/max", "token/outside_share",
               "seq/mean", "seq/min", "seq/max", "seq/outside_share", "abs_gap/mean")


def _summary(x: torch.Tensor, keep: torch.Tensor, total: torch.Tensor, low: float, high: float) -> list[torch.Tensor]:
    """mean, min, max of ``x`` where ``keep`` (NaN where nothing is kept) and the share of ``total``
    entries outside [low, high] (a ``total`` entry not kept counts as outside). 0-d tensors."""
    n = keep.sum()
    nan = torch.tensor(math.nan, device=x.device)
    mean = torch.where(keep, x, 0.0).sum() / n
    edge = x.new_full((1,), math.inf)  # an empty batch still reduces
    lo = torch.where(n > 0, torch.cat([torch.where(keep, x, math.inf).flatten(), edge]).amin(), nan)
    hi = torch.where(n > 0, torch.cat([torch.where(keep, x, -math.inf).flatten(), -edge]).amax(), nan)
    inside = (keep & (x >= low) & (x <= high)).sum()
    return [mean, lo, hi, (total - inside) / total.clamp(min=1)]


def raw_ratio_tensor(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                     low: float = 0.5, high: float = 2.0) -> torch.Tensor:
    """``raw_ratio_stats`` as one tensor [len(RATIO_STATS)] on the logprobs' device: masked
    reductions only, no host sync."""
    on = mask.bool()  # [B, C]
    log_ratio = trainer_logps.detach().float() - sampler_logps.detach().float()  # [B, C]
    finite = on & torch.isfinite(log_ratio)  # [B, C]
    safe = torch.where(finite, log_ratio, 0.0)  # [B, C]
    seq_rows = on.any(1) & (finite.sum(1) == on.sum(1))  # [B] rows whose every token is finite
    seq = safe.sum(1).clamp(max=80.0).exp()  # [B]
    n_gap = finite.sum()
    return torch.stack([*_summary(safe.exp(), finite, on.sum(), low, high),
                        *_summary(seq, seq_rows, on.any(1).sum(), low, high),
                        safe.abs().sum() / n_gap]).float()


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
    return dict(zip(RATIO_STATS, raw_ratio_tensor(trainer_logps, sampler_logps, mask, low, high).tolist()))


def sampler_gap_local(used: torch.Tensor, trainer: torch.Tensor, sampler: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """This process's sampler/trainer statistics on the loss's tokens, one tensor [2 + len(RATIO_STATS)]
    to gather (no host sync): mean and max of ``|used - sampler|`` over ``mask`` (finite entries; 0 when
    none), then ``raw_ratio_tensor(trainer, sampler, mask)``. used, trainer, sampler, mask: [B, C]."""
    gap = (used.detach().float() - sampler.detach().float()).abs()  # [B, C]
    keep = mask.bool() & torch.isfinite(gap)  # [B, C]
    n = keep.sum()
    mean = torch.where(n > 0, torch.where(keep, gap, 0.0).sum() / n.clamp(min=1), 0.0)
    worst = torch.where(keep, gap, 0.0).amax() if gap.numel() else gap.new_zeros(())
    return torch.cat([torch.stack([mean, worst]), raw_ratio_tensor(trainer, sampler, mask)])


def sampler_gap_metrics(stats: torch.Tensor) -> dict[str, float]:
    """The logged values from every process's ``sampler_gap_local`` [world, 2 + len(RATIO_STATS)]: the
    gap's mean of means and max of maxes; per ratio statistic the min, max or mean across processes
    of its finite entries (left out where none is finite). One host sync."""
    raw = stats[:, 2:]  # [world, K]
    ok = torch.isfinite(raw)  # [world, K]
    n = ok.sum(0)  # [K]
    values = torch.stack([torch.where(ok, raw, math.inf).amin(0), torch.where(ok, raw, -math.inf).amax(0),
                          torch.where(ok, raw, 0.0).sum(0) / n.clamp(min=1)])  # [3, K] min, max, mean
    pick = torch.tensor([0 if name.endswith("/min") else 1 if name.endswith("/max") else 2 for name in RATIO_STATS],
                        device=stats.device)
    row = torch.cat([stats[:, 0].mean().reshape(1), stats[:, 1].max().reshape(1),
                     values.gather(0, pick.unsqueeze(0)).squeeze(0), n.float()]).tolist()
    K = len(RATIO_STATS)
    out = {"sampling/sampler_trainer_logp_gap/mean": row[0], "sampling/sampler_trainer_logp_gap/max": row[1]}
    out.update({f"sampling/raw_ratio/{name}": v for name, v, c in zip(RATIO_STATS, row[2:2 + K], row[2 + K:]) if c})
    return out


def gate_sampler_gap(args, mean_gap: float, step: int, temperature: float, said: set) -> None:
    """``sampler_gap_action`` when the mean sampler/trainer gap passes ``sampler_gap_threshold`` (NaN
    too): 'stop' raises, 'warn' warns once (``said`` remembers), 'off' does nothing."""
    if args.sampler_gap_action == "off" or not mean_gap > args.sampler_gap_threshold:  # NaN trips it
        return
    own = [n for n in ("presence_penalty", "frequency_penalty", "min_new_tokens") if getattr(args, n)]
    own += ["repetition_penalty"] if args.repetition_penalty != 1.0 else []
    message = (f"sampler/trainer mismatch: the mean |logp_sampler - logp_trainer| over the loss's tokens is "
            f"{mean_gap:.3f} nats > sampler_gap_threshold={args.sampler_gap_threshold} (step {step}). The update is "
            "computed for a distribution the completions were not sampled from. Likely causes: `generation_kwargs` "
            f"that change sampling behind the trainer's back (temperature, top_k, top_p, min_p other than the "
            f"config's: T={temperature}), a logits processor of your own, or a sampler in another precision."
            + (f" grpotrl's own processors are on ({', '.join(own)}): they change the sampler's distribution "
               "on purpose; hf_importance_sampling_correction corrects the update for it, or raise "
               "sampler_gap_threshold." if own else ""))
    if args.sampler_gap_action == "stop":
        raise InvariantError("I5", message)
    if "sampler_gap" not in said:
        said.add("sampler_gap")
        logger.warning("grpotrl: %s (said once; sampling/sampler_trainer_logp_gap/mean is logged every step)", message)
