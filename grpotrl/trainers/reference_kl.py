"""KL to the reference policy (``KLFields``), grpotrl's own: the in-loss term and the reward column.

``GRPOTrainer._compute_loss`` leaves TRL's unclamped in-loss k3 out (``beta`` injected as 0 for the call)
and adds ``_kl_loss``: ``beta * losses.kl_loss_term`` on the logprobs the policy loss used, reduced as TRL
reduces its per-token loss for ``loss_type``. With ``use_kl_in_reward`` the reward column ``kl_penalty``
(``kl_reward``) is added at init (``_with_kl_reward_column``). ``kl_estimator='full'`` rebuilds the policy's
logits from the loss forward's hidden states (``_full_kl_logits``). ``GADTrainer`` uses the same methods.

``ReferenceKL`` is a mixin of ``GRPOTrainer`` (it reads the trainer's ``args``, ``accelerator``, ``model``,
``ref_model``, ``kl_coef``, ``kl_reward_coef``, ``temperature`` and its metric and guard-step helpers); it
overrides nothing of TRL's.
"""

from __future__ import annotations

import contextlib

import torch
from trl.trainer.utils import use_adapter

from ..chat import templates
from ..errors import InputError, InvariantError
from ..guards.ranks import caught
from ..ops.losses import kl_full, kl_loss_term, kl_penalty
from ..ops.masking import pad_sequences, position_ids_from_mask
from ..ops.reduction import aggregate_like_trl
from ..preflight import no_kl_reference
from . import _intercept


class ReferenceKL:
    """The KL-to-the-reference methods of ``GRPOTrainer`` (module docstring)."""

    def _kl_loss(self, model, inputs: dict, logp: torch.Tensor, mask: torch.Tensor,
                 hidden: torch.Tensor | None) -> torch.Tensor:
        """``beta * losses.kl_loss_term`` on the logprobs the policy loss used (``logp`` [B, C], graph), reduced
        over ``mask`` [B, C] as TRL reduces its per-token loss for ``loss_type`` (``aggregate_like_trl``): TRL's
        loss is linear in its per-token KL and every reduction is linear, so this equals TRL's own term when
        ``kl_estimator='k3'``, the ratio per token and no clamp active. ``hidden``: the loss forward's last
        hidden states, for ``full``. Logs ``kl``, the estimator in force (times the ratio), as TRL 1.16 logs its own
        (``global_masked_mean``): the token mean over every process's loss tokens of this microbatch, the sum and
        the count reduced together (0 where no process has one: the count is clamped to 1)."""
        full = hidden is not None
        logits, ref_logits = self._full_kl_logits(model, inputs, hidden, logp, mask.size(1)) if full else (None, None)
        per_token_kl = kl_loss_term(  # [B, C], times the per-token importance ratio with use_bias_correction_kl
            logp, None if full else inputs["ref_per_token_logps"], inputs.get("old_per_token_logps"),
            self.args.kl_estimator, self.args.use_bias_correction_kl,
            logits=logits, ref_logits=ref_logits, temperature=self.temperature)
        training = self.model.training
        term = self.kl_coef * aggregate_like_trl(
            per_token_kl, mask, self.loss_type, max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"), num_processes=self.accelerator.num_processes,
            gradient_accumulation_steps=self.current_gradient_accumulation_steps if training else 1,  # set in train()
            steps_per_generation=self.args.steps_per_generation, training=training)
        totals = self.accelerator.reduce(torch.stack([(per_token_kl.detach() * mask).sum(), mask.sum().float()]),
                                         reduction="sum")
        self._record_metrics({"kl": (totals[0] / totals[1].clamp(min=1.0)).item()}, "train" if training else "eval")
        return term

    def _full_kl_logits(self, model, inputs, hidden, logp, width) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits [B, C, V] of the exact KL per completion token: the policy's from the loss's own
        forward (its backbone output through the LM head, so the gradient reaches the same graph), the
        reference's from one no-grad forward."""
        causal_lm = self.accelerator.unwrap_model(model)
        causal_lm = causal_lm.get_base_model() if hasattr(causal_lm, "get_base_model") else causal_lm
        logits = causal_lm.get_output_embeddings()(hidden[:, -width - 1:-1])  # [B, C, V]
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)  # [B, P+C]
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # [B, P+C]
        ref, ctx = self._ref_context()
        with torch.no_grad(), ctx:
            ref_logits = self._completion_logits(ref, ids, attn, width)  # [B, C, V]
        if self._guard_now():  # the logits we built must be the ones the loss's logprobs came from
            mine = torch.log_softmax(logits.detach().float() / self.temperature, -1)
            mine = mine.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)  # [B, C]
            m = inputs["completion_mask"].bool()
            gap = (mine - logp.detach())[m].abs().max().item() if m.any() else 0.0
            scale = logits.detach().abs().max().item() / self.temperature
            tol = self.guard_tolerances  # the same hidden states through the head: one rounding of the logits
            with caught():  # under DDP decided with the loss's other guards (this rank runs on to the reduce)
                if gap > tol.logprob_atol * max(scale, 1.0) * (100 if tol.low_precision else 1):
                    raise InvariantError(
                        "I5", f"kl_estimator='full' rebuilt the policy's logits from the loss's forward, but their "
                        f"logprobs differ from the loss's by {gap:.2e} nats (logit scale {scale:.1f}). This model's "
                        "LM head is not a plain linear layer (logit scaling or soft-capping?); use a sample-based "
                        "kl_estimator.")
        return logits, ref_logits

    def _ref_context(self):
        """(model, context) computing the reference policy, as TRL does (PEFT: adapter off). With neither a
        reference model nor a PEFT adapter (beta 0 without PEFT: ``check_grpo`` refuses it before the model loads)
        the preflight's own ``InputError`` (``preflight.no_kl_reference``): kept as the guard of a trainer whose
        reference is gone after ``__init__`` (``ref_model`` set to None, an adapter merged away)."""
        if self.ref_model is not None:
            return self.ref_model, contextlib.nullcontext()
        unwrapped = self.accelerator.unwrap_model(self.model)
        if not hasattr(unwrapped, "peft_config"):
            raise InputError(no_kl_reference(self.args.beta, self.args.kl_in_reward_coef))
        return self.model, use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)

    def _completion_logits(self, model, ids: torch.Tensor, attn: torch.Tensor, width: int) -> torch.Tensor:
        """Raw logits that score each completion token (position P + t - 1 scores token t): [B, C, V]."""
        out = self.accelerator.unwrap_model(model)(input_ids=ids, attention_mask=attn,
                                                   position_ids=position_ids_from_mask(attn),
                                                   logits_to_keep=width + 1, use_cache=False)
        return out.logits[:, :-1]

    @torch.no_grad()
    def _per_token_kl(self, ids: torch.Tensor, attn: torch.Tensor, width: int, estimator: str) -> torch.Tensor:
        """KL(pi || pi_ref) per completion token of the current policy, no grad: [B, C]."""
        bs = self.args.per_device_train_batch_size
        ref, ctx = self._ref_context()
        if estimator != "full":
            logp = self._get_per_token_logps_and_entropies(self.model, ids, attn, width, batch_size=bs)[0]
            with ctx:
                ref_logp = self._get_per_token_logps_and_entropies(ref, ids, attn, width, batch_size=bs)[0]
            return kl_penalty(logp, ref_logp, estimator)
        out = []
        for i in range(0, ids.size(0), bs):
            part = slice(i, i + bs)
            logits = self._completion_logits(self.model, ids[part], attn[part], width)
            with ctx:
                ref_logits = self._completion_logits(ref, ids[part], attn[part], width)
            out.append(kl_full(logits, ref_logits, self.temperature))
        return torch.cat(out)

    def kl_reward(self, prompts, completions, completion_ids, **kwargs) -> list[float]:
        """The reward column ``kl_penalty``: ``-kl_in_reward_coef * sum_t KL_t`` of each response under the
        current policy (``kl_in_reward_estimator``; both default to the loss's ``beta`` and
        ``kl_estimator``). Prompt ids come from the chat template, as generation's (I1)."""
        if not all(isinstance(p, list) for p in prompts) or self.tools:
            raise InputError("use_kl_in_reward needs chat prompts (lists of messages) and no tools: the KL is "
                             "recomputed from the templated prompt and the completion. Use the KL in the loss "
                             "(use_kl_loss) instead.")
        tok = _intercept.read_tokenizer(self)
        prompt_ids = [templates.prompt_ids(tok, p, self.chat_template, **self.chat_template_kwargs) for p in prompts]
        device = self.accelerator.device
        p_ids, p_mask = pad_sequences(prompt_ids, tok.pad_token_id, side="left", device=device)  # [N, P]
        c_ids, c_mask = pad_sequences([list(c) for c in completion_ids], tok.pad_token_id, device=device)  # [N, C]
        ids, attn = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)  # [N, P+C]
        estimator = self.args.kl_in_reward_estimator or self.args.kl_estimator
        per_token = self._per_token_kl(ids, attn, c_ids.size(1), estimator)  # [N, C]
        return (-self.kl_reward_coef * (per_token * c_mask).sum(-1)).tolist()

    def _with_kl_reward_column(self, reward_funcs, args):
        """``reward_funcs`` with the column ``kl_penalty`` (``kl_reward``) last, under ``use_kl_in_reward``."""
        if not args.use_kl_in_reward:
            return reward_funcs
        if reward_funcs is None:
            raise InputError("use_kl_in_reward adds a reward column to the reward functions, but none were given "
                             "(environment-owned rewards): put the KL in the loss (use_kl_loss) instead.")
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if args.reward_weights is not None and len(args.reward_weights) != len(funcs) + 1:
            raise InputError(f"reward_weights={list(args.reward_weights)} for {len(funcs)} reward functions, but "
                             "use_kl_in_reward adds the column kl_penalty last: give it a weight too (1.0: the KL "
                             "at kl_in_reward_coef), e.g. reward_weights: "
                             f"{[*args.reward_weights, 1.0][:len(funcs) + 1]}.")
        return [*funcs, _reward_column("kl_penalty", self.kl_reward)]


def _reward_column(name: str, fn):
    """``fn`` as a reward function TRL logs under ``name`` (``rewards/<name>/mean``)."""
    def column(*args, **kwargs):
        return fn(*args, **kwargs)

    column.__name__ = column.__qualname__ = name
    return column
