"""Checks no GRPO framework runs in a user's run (INVARIANTS.md I10).

* **I10, step-0 identity.** Before the first optimizer step the policy has not moved, so on the
  first microbatch the reference (a separate ref model, PEFT's disabled adapter, a ``ref``
  adapter) and the "old" policy must give the loss's own per-token logprobs: KL 0 and ratio 1.
  A reference in another dtype, a ``ref`` adapter that is not the policy's start, dropout on one
  side or other position ids all break that, silently, from step 1 on.
* **Sampler/trainer mismatch.** Where the sampler's own logprobs exist, a gate on the mean
  ``|logp_sampler - logp_trainer|`` (the statistics themselves, with the raw importance ratio, are
  pure math: ``ops/importance.py``).

The trainer (``trainers/grpo.py``) calls these on tensors it already has.
"""

from __future__ import annotations

import logging
import math

import torch

from ..errors import InvariantError
from .logprobs import require_finite, masked_gap, worst_token
from .precision import Tolerances, gap_statistics
from ..ops.losses import importance_sampling_ratio

logger = logging.getLogger(__name__)

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


def check_step0_identity(tokenizer, policy: torch.Tensor, other: torch.Tensor, mask: torch.Tensor,
                         completion_ids: torch.Tensor, what: str, tol: Tolerances, rows,
                         causes: str = "") -> tuple[float, float]:
    """I10: at step 0 ``other`` (the reference's or the old policy's per-token logprobs, [B, C]) equals
    the loss's own ``policy`` logprobs [B, C] on every token in ``mask`` [B, C], within ``tol``
    (``guards.precision``): in fp32 every token to ``tol.identity_max`` (the two forwards differ only in
    batch shape, ~1e-6 to 1e-5 nats; a bf16 reference is off by ~1e-2); in bf16/fp16, where a batch shape
    moves single tokens by a rounding step of a large logit, the mean gap ``<= tol.identity_mean``, the
    median ``<= tol.median_gap`` and no row's mean above ``tol.row_gap`` (a reference that is another model,
    adapter or dtype is off by 0.1 to several nats on most tokens). Returns (mean, max) gap, (nan, nan)
    where ``mask`` holds no token (nothing compared, nothing verified); raises naming the worst token and the
    likely causes."""
    policy, other = policy.detach(), other.detach()
    if not bool(mask.bool().any()):
        return math.nan, math.nan
    require_finite("I10", tokenizer, completion_ids, mask.bool(), rows, ("the loss's logprob", policy),
                    (f"the {what} logprob", other))
    mean, worst, (i, t) = masked_gap_stats(policy, other, mask)
    if tol.low_precision:
        stats = gap_statistics(policy - other, mask, tol.row_min_tokens)
        ok = mean <= tol.identity_mean and tol.within_rounding(stats)
        allowed = (f"allowed in {tol.name}: mean {tol.identity_mean:g}, median {tol.median_gap:g}, a row's mean "
                   f"{tol.row_gap:g}; here median {stats.median:.2e}, worst row's mean {stats.row_mean:.2e}")
    else:
        ok = worst <= tol.identity_max
        allowed = f"allowed {tol.identity_max:.0e} per token in fp32"
    if not ok:  # NaN fails too
        token = tokenizer.decode([int(completion_ids[i, t])]) if tokenizer is not None else "?"
        raise InvariantError(
            "I10",
            f"at step 0, before any update, the {what} logprobs are not the policy's: row {rows[i]}, completion "
            f"token {t} ({token!r}) has {float(other[i, t]):.6f} vs the policy's {float(policy[i, t]):.6f} "
            f"(gap {worst:.2e}; mean gap {mean:.2e} over {int(mask.sum())} tokens; {allowed}). Every KL / ratio "
            f"from step 1 on would measure this difference, not training.{causes}",
        )
    return mean, worst


def check_step0_logprobs(tokenizer, used: torch.Tensor, inputs: dict, loss_mask: torch.Tensor, rows,
                         tol: Tolerances, policy_model, ref_model) -> dict[str, float]:
    """I10 on the loss's first (step-0) microbatch: the reference's (``ref_per_token_logps``) and the
    old policy's (``old_per_token_logps``) logprobs in ``inputs``, where present, equal the loss's own
    ``used`` [B, C] on ``loss_mask``. ``policy_model`` / ``ref_model``: unwrapped, for the likely causes.
    Returns ``identity/step0_{ref,old}_logp_gap/{mean,max}``; none, with a warning, where ``loss_mask`` holds
    no token (every row masked, e.g. truncated under ``mask_truncated_completions``): I10 was not checked."""
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
    if sides and not bool(loss_mask.bool().any()):
        logger.warning("grpotrl guard I10: the step-0 microbatch has no loss token (every row masked), so the %s "
                       "logprobs were not compared with the policy's and I10 was not checked.",
                       " and ".join(what for _, what, _, _ in sides))
        return out
    for key, what, other, causes in sides:
        mean, worst = check_step0_identity(tokenizer, used, other, loss_mask, inputs["completion_ids"], what,
                                           tol, rows, causes)
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


CAUSE_SHARE = 0.25  # a measured cause is named when it is at least this share of sampler_gap_threshold (nats)


def sampler_gap_causes(measured: dict, temperature: float, threshold: float) -> list[str]:
    """The causes of a sampler/trainer gap that ``measured`` shows (``trainers.grpo._log_sampler_gap``:
    ``importance.CAUSES`` means in nats, and the recorder's ``sampler_temperature``, ``processors``,
    ``own_processors``, ``truncation``, ``corrected`` and the weights' ``dtype``), each as a sentence
    with its measured value; a gap component is named when it is at least ``CAUSE_SHARE`` x ``threshold``.

    >>> sampler_gap_causes({"sampler_temperature": 0.7}, 1.0, 0.1)[0][:64]
    'temperature: the sampler ran at T=0.7 (its TemperatureLogitsWarp'
    >>> sampler_gap_causes({"kept_mass": 0.8, "truncation_gap": 0.25, "corrected": False,
    ...                     "truncation": ["TopPLogitsWarper"]}, 1.0, 0.1)[0][:45]
    'truncation: TopPLogitsWarper kept on average '
    """
    big = CAUSE_SHARE * threshold
    out = []
    t = measured.get("sampler_temperature")
    if t is not None and not math.isclose(t, temperature, rel_tol=1e-6):
        out.append(f"temperature: the sampler ran at T={t:g} (its TemperatureLogitsWarper), the trainer scores at "
                   f"T={temperature:g}: make them one (GRPOConfig.temperature; generation_kwargs' temperature "
                   "becomes it)")
    trunc = measured.get("truncation_gap", 0.0)
    if not measured.get("corrected", True) and trunc >= big:
        out.append(f"truncation: {', '.join(measured.get('truncation') or ['top-k/top-p/min-p'])} kept on average "
                   f"{measured.get('kept_mass', float('nan')):.3f} of the probability mass, and the sampler's "
                   f"logprobs are of that renormalised distribution (mean |log kept mass| {trunc:.3f} nats; the "
                   "ratio's mean becomes the kept mass): set truncated_sampling_correction=True")
    proc = measured.get("processor_gap", 0.0)
    if proc >= big:
        names = measured.get("processors") or ["?"]
        own = set(measured.get("own_processors") or [])
        yours = [n for n in names if n not in own]
        out.append(f"logits processors moved the sampled tokens' logprobs by {proc:.3f} nats on average"
                   + (f"; yours or the model's generation_config's: {', '.join(yours)}" if yours else "")
                   + (f"; grpotrl's own (on purpose; hf_importance_sampling_correction corrects the update for "
                      f"them): {', '.join(sorted(own))}" if own else ""))
    stale = measured.get("stale_gap", 0.0)
    if stale >= big:
        out.append(f"stale weights: the policy moved {stale:.3f} nats per token since these completions were "
                   "sampled (num_iterations / steps_per_generation reuse a batch)")
    fwd = measured.get("forward_gap", 0.0)
    if fwd >= big and not out:
        out.append(f"the forward: generate's logits and the loss's on the same weights differ by {fwd:.3f} nats per "
                   f"token (weights in {measured.get('dtype', '?')}; under bf16/fp16 the two forwards round "
                   "differently, else other position ids, attention kernels or a sampler in another precision)")
    return out


def gate_sampler_gap(args, mean_gap: float, loss_tokens: int, step: int, temperature: float, said: set,
                     measured: dict | None = None, mode: str = "train", unmeasured: int = 0) -> None:
    """``sampler_gap_action`` when the mean sampler/trainer gap passes ``sampler_gap_threshold``: 'stop'
    raises, 'warn' warns once per ``mode`` ("train" or "eval"; ``said`` remembers), 'off' does nothing.
    ``mean_gap``: the token mean of ``|logp_sampler - logp_trainer|`` over every process's loss tokens where it
    is finite; ``loss_tokens``: every process's loss tokens, ``unmeasured`` of them with a gap that is not finite
    (a sampler or trainer logprob of -inf or NaN on a token the sampler drew). Such a gap cannot be verified, on
    one token or on all (``mean_gap`` NaN), and trips the gate like a gap above the threshold. A microbatch with no loss token on any process (every completion masked: truncated under
    ``mask_truncated_completions``, tool results) updates nothing and has no gap to gate: it warns once per
    ``mode`` that the gate was not checked, as I10 and I11 do, and passes, as TRL trains on it (loss 0).
    The message names the causes ``measured`` shows (``sampler_gap_causes``); without measurements, the
    likely ones; in evaluation, that it was measured on an evaluation batch, which updates nothing.

    >>> from types import SimpleNamespace as NS
    >>> args = NS(sampler_gap_action="stop", sampler_gap_threshold=0.1)
    >>> try: gate_sampler_gap(args, 0.5, 12, 3, 1.0, set(), {"temperature": 1.0}, mode="eval")
    ... except InvariantError as e: print(str(e).split(" is ")[1].split(". ")[0])
    0.500 nats > sampler_gap_threshold=0.1 (evaluation after step 3)
    """
    if args.sampler_gap_action == "off":
        return
    where = f"step {step}" if mode == "train" else f"evaluation after step {step}"
    if not loss_tokens:
        said_key = f"sampler_gap/unchecked/{mode}"
        if said_key not in said:
            said.add(said_key)
            logger.warning("grpotrl: the sampler-gap gate (sampler_gap_threshold=%s) was not checked on a microbatch "
                           "(%s): no process had a loss token (every completion masked: truncated under "
                           "mask_truncated_completions, or tool results). Said once.", args.sampler_gap_threshold,
                           where)
        return
    if mean_gap <= args.sampler_gap_threshold and not unmeasured:  # NaN is not: it trips the gate
        return
    meaning = ("Measured on an evaluation batch, which updates nothing; training samples its completions the same "
               "way, and its update is computed for a distribution they were not sampled from. ") if mode == "eval" \
        else "The update is computed for a distribution the completions were not sampled from. "
    if unmeasured or math.isnan(mean_gap):
        share = f"any of the {loss_tokens}" if math.isnan(mean_gap) else f"{unmeasured} of the {loss_tokens}"
        head = (f"sampler/trainer mismatch: the |logp_sampler - logp_trainer| gap is not finite on {share} loss "
                f"tokens ({where}): a sampler or trainer logprob is -inf or NaN there (the sampler drew a token one "
                "side gives probability 0, or a forward produced NaN), so the gap cannot be checked against "
                f"sampler_gap_threshold={args.sampler_gap_threshold}. ")
    else:
        head = (f"sampler/trainer mismatch: the mean |logp_sampler - logp_trainer| over the loss's tokens is "
                f"{mean_gap:.3f} nats > sampler_gap_threshold={args.sampler_gap_threshold} ({where}). {meaning}")
    causes = sampler_gap_causes(measured, temperature, args.sampler_gap_threshold) if measured else None
    if causes:
        message = head + "Measured causes: " + "; ".join(causes) + "."
    elif measured:
        message = head + ("None of the measured causes (temperature, truncation, processors, stale weights, the "
                          "forward) reaches a quarter of the threshold: the gap is their sum, or something unmeasured.")
    else:
        own = [n for n in ("presence_penalty", "frequency_penalty", "min_new_tokens") if getattr(args, n)]
        own += ["repetition_penalty"] if args.repetition_penalty != 1.0 else []
        message = head + (
            "Likely causes: `generation_kwargs` that change sampling behind the trainer's back (temperature, top_k, "
            f"top_p, min_p other than the config's: T={temperature}), a logits processor of your own, or a sampler "
            "in another precision."
            + (f" grpotrl's own processors are on ({', '.join(own)}): they change the sampler's distribution "
               "on purpose; hf_importance_sampling_correction corrects the update for it, or raise "
               "sampler_gap_threshold." if own else ""))
    if args.sampler_gap_action == "stop":
        raise InvariantError("I5", message)
    said_key = "sampler_gap" if mode == "train" else f"sampler_gap/{mode}"
    if said_key not in said:
        said.add(said_key)
        logger.warning("grpotrl: %s (said once; sampling/sampler_trainer_logp_gap/mean is logged every step)", message)
