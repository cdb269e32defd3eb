"""``grpotrl.GRPOTrainer``: TRL's GRPOTrainer with INVARIANTS I1-I5 guarded on its real tensors.

Overrides (everything else is TRL's):
  * ``__init__``: validates the model path, tokenizer, stop tokens, dataset and the
    checkpoint's template fingerprint (I2) before TRL loads anything; stops generation on
    every stop id; gives the logprob forward generate's position ids (I5).
  * ``_generate``: on the transformers path, hands ``generate`` the response-only penalty
    and min-new-tokens processors (I6) and keeps the sampler's own logprobs; records what
    ``generate`` saw and returned and checks I1 (prompt ids are the chat template plus
    generation prompt, no doubled BOS) and I3 (completion is ``output[i, P:]``; the reward
    text is its decoding, no chat header).
  * ``_generate_and_score_completions``: tags each row so the loss can be traced back to
    its generation; applies the optional importance-sampling correction on the transformers
    path (``hf_importance_sampling_correction``).
  * ``_compute_loss``: on the microbatch the loss really uses, checks I1 (same prompt ids as
    generation), I3/I4 (same completion ids, mask up to and including the first stop) and I5
    (the logprobs the loss used equal ``log_softmax(logits / T)`` recomputed independently);
    logs the sampler/trainer logprob gap whenever sampler logprobs exist.
  * ``save_model``: writes the chat-template fingerprint beside the weights (I2).

Guards run for the first ``guard_steps`` steps (default 2), every step with -1, never with 0.
"""

from __future__ import annotations

import logging

import torch
import trl

from .. import guards, templates
from ..configs import GRPOConfig
from ..errors import InputError
from ..losses import importance_sampling_ratio
from ..masking import position_ids_from_mask
from ..processors import MinNewTokensProcessor, build_processors, sampler_logprobs
from ._common import prepare_model_and_tokenizer

logger = logging.getLogger(__name__)

ROW_KEY = "grpotrl_row"


def _positions_from_attention_mask(module, args, kwargs):
    """Forward pre-hook: TRL's fused logprob forward passes no position ids, so models with
    absolute positions would score left-padded rows at other positions than generate used."""
    if kwargs.get("fused_lm_head") and kwargs.get("position_ids") is None and kwargs.get("attention_mask") is not None:
        kwargs["position_ids"] = position_ids_from_mask(kwargs["attention_mask"])
    return args, kwargs


class GRPOTrainer(trl.GRPOTrainer):
    _tag_names = ["trl", "grpo", "grpotrl"]

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, **kwargs):
        if args is None:
            args = GRPOConfig(output_dir="grpotrl-output")
        model, processing_class, self.stop_token_ids, model_dir = prepare_model_and_tokenizer(
            model, processing_class, args, train_dataset, kind="grpo"
        )
        if getattr(args, "check_template", True):
            templates.check_fingerprint(model_dir, processing_class)
        _check_generation_args(args, kwargs)
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, **kwargs)

        # Stop on every stop id (TRL stops on eos and generation_config's ids only)
        self.eos_token_ids = list(dict.fromkeys([*self.eos_token_ids, *self.stop_token_ids]))
        if getattr(self, "generation_config", None) is not None:
            self.generation_config.eos_token_id = self.eos_token_ids
            self.generation_kwargs["eos_token_id"] = self.eos_token_ids
            # transformers' repetition penalty counts the prompt: ours (I6) replaces it
            self.generation_config.repetition_penalty = 1.0
            self.generation_kwargs["repetition_penalty"] = 1.0
        if self.use_vllm:
            _pass_penalties_to_vllm(self, args)
        for m in (self.model, self.ref_model):
            if m is not None:
                m.register_forward_pre_hook(_positions_from_attention_mask, with_kwargs=True)
        self._guard_record: dict | None = None
        self._guard_max_gap = 0.0

    # ------------------------------------------------------------------ schedule

    def _guard_now(self) -> bool:
        n = self.args.guard_steps
        return n < 0 or self.state.global_step < n

    def _header_text(self) -> str:
        """The generation prompt as reward functions would see it (``assistant\n`` for ChatML)."""
        ids = templates.generation_prompt_ids(self._tokenizer, self.chat_template, **self.chat_template_kwargs)
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------ generation (I1, I3)

    def _hf_generate_path(self) -> bool:
        return not self.use_vllm and not self.use_transformers_continuous_batching and self.rollout_func is None

    def _generation_extras(self, input_ids) -> dict:
        """Keyword arguments added to each ``generate`` call: the I6 processors, and the
        processed scores whenever the sampler's distribution can differ from the trainer's."""
        a = self.args
        processors = build_processors(input_ids.size(1), a.presence_penalty, a.frequency_penalty,
                                      a.repetition_penalty, a.min_new_tokens, self.eos_token_ids)
        extra = {"logits_processor": processors} if processors else {}
        if processors or a.hf_importance_sampling_correction:
            extra.update(output_scores=True, return_dict_in_generate=True)
        return extra

    def _generate(self, prompts: list):
        guard = self._guard_now()
        intercept = self._hf_generate_path() and not self.tools
        if not guard:
            self._guard_record = None
        if not guard and not intercept:
            out = super()._generate(prompts)
            self._log_completion_shape(out[1])
            return out
        model = self.accelerator.unwrap_model(self.model_wrapped)
        with guards.record_generate(model, self._generation_extras if intercept else None) as calls:
            out = super()._generate(prompts)
        if calls and calls[-1]["scores"] is not None:
            out = self._with_sampler_logprobs(out, calls[-1])
        self._log_completion_shape(out[1], calls[-1] if calls else None)
        if not guard:
            return out
        prompt_ids, completion_ids, _, completions = out[:4]
        tok = self._tokenizer

        if isinstance(prompts[0], list) and self.rollout_func is None:
            expected = [templates.prompt_ids(tok, p, self.chat_template, **self.chat_template_kwargs)
                        for p in prompts]
            guards.check_prompts_templated(tok, prompt_ids, expected)
        if calls:  # the transformers path: compare against what generate really returned
            call = calls[-1]
            gen_in = call["input_ids"].cpu()
            attn = call["attention_mask"] if call["attention_mask"] is not None else torch.ones_like(gen_in)
            guards.check_same_prompt(tok, guards._unpad(gen_in, attn), prompt_ids, range(len(prompt_ids)))
            if not self.tools:
                guards.check_extraction(tok, gen_in, call["output"].cpu(), completion_ids, self.eos_token_ids)
        elif not self.use_vllm and self.rollout_func is None:
            logger.warning("grpotrl guard: could not observe `generate`; I3 is checked on the text only.")
        if not self.tools and getattr(tok, "response_schema", None) is None \
                and getattr(tok, "response_template", None) is None:
            guards.check_reward_text(tok, completion_ids, completions, self._header_text())
        self._guard_record = {
            "prompt_ids": [list(p) for p in prompt_ids],
            "completion_ids": [list(c) for c in completion_ids],
        }
        return out

    def _with_sampler_logprobs(self, out: tuple, call: dict) -> tuple:
        """Put the sampler's own per-token logprobs where TRL keeps vLLM's (I5)."""
        P = call["input_ids"].size(1)
        lp = sampler_logprobs(call["scores"], call["output"], P)  # [B, C]
        per_row = [lp[i, : len(c)].tolist() for i, c in enumerate(out[1])]
        return (*out[:4], per_row, *out[5:])

    def _log_completion_shape(self, completion_ids: list, call: dict | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        n = len(completion_ids)
        one = sum(len(c) == 1 for c in completion_ids)
        trig = 0
        for p in (call or {}).get("extra", {}).get("logits_processor", []):
            if isinstance(p, MinNewTokensProcessor):
                trig = p.trigger_count
        totals = self.accelerator.gather(torch.tensor([n, one, trig], device=self.accelerator.device))
        totals = totals.view(-1, 3).sum(0).tolist()
        self._metrics[mode]["completions/one_token_share"].append(totals[1] / max(totals[0], 1))
        if self.args.min_new_tokens:
            self._metrics[mode]["generation/min_new_tokens_trigger_rate"].append(totals[2] / max(totals[0], 1))

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        output[ROW_KEY] = torch.arange(output["prompt_ids"].size(0), device=output["prompt_ids"].device)
        if self.args.hf_importance_sampling_correction and "sampling_per_token_logps" in output:
            self._apply_importance_sampling(output)
        return output

    def _apply_importance_sampling(self, output: dict) -> None:
        """TRL's truncated IS correction for the transformers path. The ratio multiplies the
        advantages, which equals TRL's ``per_token_loss * ratio`` for the loss types linear in
        the advantage (every type but vespo, refused at init); the KL term stays unscaled."""
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)  # [B, P+C]
        attn = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)  # [B, P+C]
        if "old_per_token_logps" not in output:
            with torch.no_grad():
                output["old_per_token_logps"] = self._get_per_token_logps_and_entropies(
                    self.model, ids, attn, output["completion_ids"].size(1),
                    batch_size=self.args.per_device_train_batch_size)[0]
        a = self.args
        ratio = importance_sampling_ratio(output["old_per_token_logps"], output["sampling_per_token_logps"],
                                          output["completion_mask"], a.vllm_importance_sampling_mode,
                                          a.vllm_importance_sampling_clip_min, a.vllm_importance_sampling_clip_max)
        output["advantages"] = output["advantages"].unsqueeze(1) * ratio  # [B, C] or [B, 1]
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["sampling/importance_sampling_ratio/mean"].append(
            self.accelerator.gather(ratio.mean()).mean().item())

    # ------------------------------------------------------------------ loss (I1, I3, I4, I5)

    def _compute_loss(self, model, inputs):
        record = self._guard_record
        if record is None or not self._guard_now() or ROW_KEY not in inputs:
            if "sampling_per_token_logps" not in inputs:
                return super()._compute_loss(model, inputs)
            with guards.record_calls(self, "_get_per_token_logps_and_entropies") as calls:
                loss = super()._compute_loss(model, inputs)
            self._log_sampler_gap(calls[0][0], inputs)
            return loss
        tok = self._tokenizer
        rows = inputs[ROW_KEY].tolist()
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, cmask = inputs["completion_ids"], inputs["completion_mask"]

        generated_prompts = [record["prompt_ids"][r] for r in rows]
        guards.check_same_prompt(tok, generated_prompts, guards._unpad(prompt_ids, prompt_mask), rows)
        guards.check_same_completions(tok, generated_prompts, [record["completion_ids"][r] for r in rows],
                                      completion_ids, rows)
        lengths = torch.tensor([len(record["completion_ids"][r]) for r in rows], device=completion_ids.device)
        guards.check_completion_mask(tok, completion_ids, cmask, lengths, self.eos_token_ids, rows,
                                     truncated_masked=self.mask_truncated_completions)

        with guards.record_calls(self, "_get_per_token_logps_and_entropies") as calls:
            loss = super()._compute_loss(model, inputs)
        used = calls[0][0]  # [B, C] the policy logprobs the loss was built from
        if "sampling_per_token_logps" in inputs:
            self._log_sampler_gap(used, inputs)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P+C]
        attention_mask = torch.cat([prompt_mask, cmask], dim=1)  # [B, P+C]
        reference, scale = guards.recompute_logprobs(self.accelerator.unwrap_model(model), input_ids,
                                                     attention_mask, completion_ids.size(1), self.temperature)
        atol = self.args.guard_logprob_atol * (100 if (self.args.bf16 or self.args.fp16) else 1)
        gap = guards.check_logprobs(tok, used, reference, cmask, completion_ids, self.temperature, atol, rows,
                                    scale=scale)
        self._guard_max_gap = max(self._guard_max_gap, gap)
        self._metrics["train"]["guards/logprob_max_gap"].append(gap)
        return loss

    def _log_sampler_gap(self, used: torch.Tensor, inputs: dict) -> None:
        """|sampler - trainer| logprob on the loss's tokens: what the processors (and any
        sampler/trainer mismatch) changed. TRL logs the same for vLLM only."""
        mask = inputs["completion_mask"].bool()
        gap = (used.detach() - inputs["sampling_per_token_logps"]).abs()[mask]
        gap = gap[torch.isfinite(gap)]
        stats = torch.stack([gap.mean(), gap.max()]) if gap.numel() else torch.zeros(2, device=used.device)
        stats = self.accelerator.gather(stats).view(-1, 2)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["sampling/sampler_trainer_logp_gap/mean"].append(stats[:, 0].mean().item())
        self._metrics[mode]["sampling/sampler_trainer_logp_gap/max"].append(stats[:, 1].max().item())

    # ------------------------------------------------------------------ checkpoints (I2)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            templates.save_fingerprint(output_dir or self.args.output_dir, self._tokenizer, self.chat_template)


def _check_generation_args(args: GRPOConfig, kwargs: dict) -> None:
    """I6 arguments, validated before TRL loads anything."""
    build_processors(0, args.presence_penalty, args.frequency_penalty, args.repetition_penalty,
                     args.min_new_tokens, [0])
    if args.min_new_tokens and args.max_completion_length and args.min_new_tokens >= args.max_completion_length:
        raise InputError(f"min_new_tokens={args.min_new_tokens} must be < max_completion_length="
                         f"{args.max_completion_length}, or no completion could ever stop.")
    penalties = args.presence_penalty or args.frequency_penalty or args.min_new_tokens
    if penalties and kwargs.get("tools"):
        raise InputError("presence/frequency penalties and min_new_tokens are not supported with tools yet: "
                         "the multi-turn loop calls generate several times per completion. Set them to 0.")
    if args.hf_importance_sampling_correction and args.loss_type == "vespo":
        raise InputError("hf_importance_sampling_correction folds the ratio into the advantages, which is not "
                         "equivalent for loss_type='vespo'. Use another loss_type or turn the correction off.")


def _pass_penalties_to_vllm(trainer: GRPOTrainer, args: GRPOConfig) -> None:
    """vLLM counts output tokens only for presence/frequency penalties, so they pass through; its
    repetition penalty counts the prompt, which I6 rules out: say so."""
    extra = {k: v for k, v in (("presence_penalty", args.presence_penalty),
                               ("frequency_penalty", args.frequency_penalty),
                               ("min_tokens", args.min_new_tokens)) if v}
    if extra:
        trainer.vllm_generation.generation_kwargs = {**trainer.vllm_generation.generation_kwargs, **extra}
    if args.repetition_penalty != 1.0:
        logger.warning("vLLM's repetition_penalty counts prompt tokens too (INVARIANT I6); prefer "
                       "presence_penalty / frequency_penalty, which vLLM applies to output tokens only.")
