"""``grpotrl.GRPOTrainer``: TRL's GRPOTrainer with INVARIANTS I1-I5 guarded on its real tensors.

Overrides (everything else is TRL's):
  * ``__init__``: validates the model path, tokenizer, stop tokens, dataset and the
    checkpoint's template fingerprint (I2) before TRL loads anything; stops generation on
    every stop id; gives the logprob forward generate's position ids (I5).
  * ``_generate``: records what ``generate`` saw and returned and checks I1 (prompt ids are
    the chat template plus generation prompt, no doubled BOS) and I3 (completion is
    ``output[i, P:]``; the reward text is its decoding, no chat header).
  * ``_generate_and_score_completions``: tags each row so the loss can be traced back to
    its generation.
  * ``_compute_loss``: on the microbatch the loss really uses, checks I1 (same prompt ids as
    generation), I3/I4 (same completion ids, mask up to and including the first stop) and I5
    (the logprobs the loss used equal ``log_softmax(logits / T)`` recomputed independently).
  * ``save_model``: writes the chat-template fingerprint beside the weights (I2).

Guards run for the first ``guard_steps`` steps (default 2), every step with -1, never with 0.
"""

from __future__ import annotations

import logging

import torch
import trl

from .. import guards, templates
from ..configs import GRPOConfig
from ..masking import position_ids_from_mask
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
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, **kwargs)

        # Stop on every stop id (TRL stops on eos and generation_config's ids only)
        self.eos_token_ids = list(dict.fromkeys([*self.eos_token_ids, *self.stop_token_ids]))
        if getattr(self, "generation_config", None) is not None:
            self.generation_config.eos_token_id = self.eos_token_ids
            self.generation_kwargs["eos_token_id"] = self.eos_token_ids
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

    def _generate(self, prompts: list):
        if not self._guard_now():
            self._guard_record = None
            return super()._generate(prompts)
        model = self.accelerator.unwrap_model(self.model_wrapped)
        with guards.record_generate(model) as calls:
            out = super()._generate(prompts)
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

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        output[ROW_KEY] = torch.arange(output["prompt_ids"].size(0), device=output["prompt_ids"].device)
        return output

    # ------------------------------------------------------------------ loss (I1, I3, I4, I5)

    def _compute_loss(self, model, inputs):
        record = self._guard_record
        if record is None or not self._guard_now() or ROW_KEY not in inputs:
            return super()._compute_loss(model, inputs)
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

    # ------------------------------------------------------------------ checkpoints (I2)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            templates.save_fingerprint(output_dir or self.args.output_dir, self._tokenizer, self.chat_template)
