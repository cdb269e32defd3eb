"""``grpotrl.GRPOTrainer``: TRL's GRPOTrainer with INVARIANTS I1-I5 guarded on its real tensors.

Overrides (everything else is TRL's):
  * ``__init__``: takes a ``trl.GRPOConfig`` (or a subclass) too, filling in grpotrl's fields
    (``configs.complete_grpo_config``); validates the model path, tokenizer, stop tokens,
    dataset (an ``IterableDataset`` on its first rows) and the checkpoint's template
    fingerprint (I2) before TRL loads anything; refuses ``cagrad`` settings it would ignore (only
    ``MultiTaskGRPOTrainer`` reads them); stops generation on every stop id; gives the
    logprob forward generate's position ids (I5).
  * ``_generate``: on the transformers path, hands ``generate`` the response-only penalty
    and min-new-tokens processors (I6) and keeps the sampler's own logprobs (one number per
    token, recorded after transformers' warpers: ``processors.after_warpers`` shadows the model's
    ``_get_logits_processor`` for the call); records what
    ``generate`` saw and returned and checks I1 (prompt ids are the chat template plus
    generation prompt, with the row's tools and ``chat_template_kwargs``, no doubled BOS) and
    I3 (completion is ``output[i, P:]``; the reward text is its decoding, no chat header) and
    I4 from the tokens alone (each completion ends right after its first stop id, or has none and
    is generation's cap long; on every sampler, vLLM and continuous batching included). On
    TRL's tool loop (``tools``, ``environment_factory``) every turn's ``generate`` call is
    checked: a later turn's prompt is the previous prompt + completion + tool result, the
    completion spans the turns, ``tool_mask`` covers the model's turns only. A ``rollout_func``
    generates its own way and is not observed (I1/I3 between its output and the loss still are).
  * ``_generate_and_score_completions``: tags each row so the loss can be traced back to
    its generation; logs the batch's health signals (stop tokens in prompts and completions,
    chat-header starts, zero rewards, per-task lengths); runs DAPO dynamic sampling when
    asked (``dynamic_sampling``); applies the optional importance-sampling correction on the
    transformers path (``hf_importance_sampling_correction``).
  * ``_compute_loss``: on the microbatch the loss really uses, checks I1 (same prompt ids as
    generation), I3/I4 (same completion ids, mask up to and including the first stop; on a
    tool loop ``completion_mask * tool_mask`` on each generated turn) and I5 (the logprobs the
    loss used equal ``log_softmax(logits / T)`` recomputed independently; not while dropout
    is active, where no deterministic reference exists);
    logs the sampler/trainer logprob gap whenever sampler logprobs exist, per-sample entropy
    every step, and the logit signals where the I5 forward (or ``health_logit_steps``) has logits.
  * ``compute_loss``: checks I7 on the loss about to be backpropagated: ``d loss / d H == -c``
    for the entropy bonus coefficient ``c`` in force (TRL's ``entropy_coef`` / adaptive
    controller), measured on the graph from the loss back to the entropy node (cheap: a few
    elementwise ops, never the model); on guard steps also that the entropy node is the
    policy's entropy at the sampling temperature.
  * ``save_model``: writes the chat-template fingerprint beside the weights (I2).
  * ``train`` / ``_load_from_checkpoint`` (``_common.CheckedResume``): a resume checkpoint is
    checked complete before anything loads; a resumed QLoRA adapter keeps its dtype.

Guards run for the first ``guard_steps`` steps (default 2), every step with -1, never with 0.
Health rules (stopping only certainly broken runs by default, warning otherwise) and the
boundary report are callbacks (``grpotrl.callbacks``) added at init;
``boundary_report()`` prints the last generation batch's prompt/completion boundary on demand.
"""

from __future__ import annotations

import logging

import torch
import trl
from accelerate.utils import gather_object

from .. import callbacks, dynamic_sampling, guards, health, identity, templates
from ..configs import GRPOConfig, complete_grpo_config
from ..errors import InvariantError
from ..logprobs import entropy_from_logits
from ..losses import importance_sampling_ratio
from ..masking import position_ids_from_mask
from ..preflight import check_grpo, task_labels
from ..processors import MinNewTokensProcessor, SampledLogprobRecorder, after_warpers, build_processors
from ._common import CheckedResume, pin_quantized_kernels

logger = logging.getLogger(__name__)

ROW_KEY = "grpotrl_row"
TASK_KEY = "grpotrl_task"  # [B] index into trainer.task_names, when rows carry a task label


def _positions_from_attention_mask(module, args, kwargs):
    """Forward pre-hook: TRL's fused logprob forward passes no position ids, so models with
    absolute positions would score left-padded rows at other positions than generate used."""
    if kwargs.get("fused_lm_head") and kwargs.get("position_ids") is None and kwargs.get("attention_mask") is not None:
        kwargs["position_ids"] = position_ids_from_mask(kwargs["attention_mask"])
    return args, kwargs


class GRPOTrainer(CheckedResume, trl.GRPOTrainer):
    _tag_names = ["trl", "grpo", "grpotrl"]
    _reads_cagrad = False  # MultiTaskGRPOTrainer's fields: refused here rather than ignored

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, **kwargs):
        args = complete_grpo_config(args if args is not None else GRPOConfig(output_dir="grpotrl-output"))
        # every check that must pass before TRL loads the model (grpotrl/preflight.py), once
        model, processing_class, reward_funcs, self.stop_token_ids, self._checked_resume = check_grpo(
            self, model, reward_funcs, args, train_dataset, eval_dataset, processing_class, kwargs)
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, **kwargs)
        pin_quantized_kernels(self.model)  # a quantized model TRL loaded from a path (I5 on bitsandbytes' CPU kernels)

        # Stop on every stop id (TRL stops on eos and generation_config's ids only)
        # (and on generation_kwargs' own eos_token_id, which the line below would otherwise overwrite)
        extra = args.generation_kwargs.get("eos_token_id") if isinstance(args.generation_kwargs, dict) else None
        extra = [extra] if isinstance(extra, int) else list(extra or [])
        self.eos_token_ids = list(dict.fromkeys([*self.eos_token_ids, *self.stop_token_ids, *extra]))
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
        self._warned_dropout = False  # I5 skipped while dropout is active: said once
        self._identity_due = bool(args.check_step0_identity) and args.guard_steps != 0  # I10, first microbatch
        self._warned_sampler_gap = False
        self._last_batch: dict | None = None  # for boundary_report()
        self._step_losses: list | None = None  # for NonFiniteRule, when it is on
        self._template = templates.chat_template_of(self.processing_class, self.chat_template)  # None: plain text
        self._chat_headers = health.chat_headers(self._tokenizer, self._template, **self.chat_template_kwargs)
        # I3's: the generation prompt the prompt ends with, when the template writes one (a new turn, or a
        # header the model writes itself after a template without one, is the chat_header rule's business)
        self._reward_headers = health.chat_headers(self._tokenizer, self._template, new_turn=False,
                                                   **self.chat_template_kwargs) if self._template is not None \
            and templates.generation_prompt_ids(self._tokenizer, self._template, **self.chat_template_kwargs) else []
        self._add_health_callbacks(args)
        self.task_names = task_labels(args.task_column, train_dataset, eval_dataset)  # sorted, [] if no column
        self._loss_entropies: tuple | None = None  # (entropies [B, C], mask [B, C]) of the last loss, for I7
        self._generated_stops: torch.Tensor | None = None  # [B] stop tokens generate wrote per row (stops/*)

    def _add_health_callbacks(self, args: GRPOConfig) -> None:
        if args.health_report_steps:
            self.add_callback(callbacks.BoundaryReport(self, args.health_report_steps))
        rules = [callbacks.NonFiniteRule(self), callbacks.HeaderRule(self),
                 callbacks.OneTokenRule(self, args.health_patience, args.health_max_one_token_share),
                 callbacks.EntropyRule(self, args.health_patience, args.health_min_entropy)]
        if args.health_flat_reward_steps:
            rules.append(callbacks.FlatRewardRule(self, args.health_flat_reward_steps))
        for rule in rules:
            if rule.action != "off":
                self.add_callback(rule)
        if rules[0].action != "off":  # NonFiniteRule reads the step's losses
            self._step_losses = []

    # ------------------------------------------------------------------ schedule

    def _guard_now(self) -> bool:
        n = self.args.guard_steps
        return n < 0 or self.state.global_step < n

    # ------------------------------------------------------------------ generation (I1, I3)

    def _hf_generate_path(self) -> bool:
        return not self.use_vllm and not self.use_transformers_continuous_batching and self.rollout_func is None

    def _generation_extras(self, input_ids) -> dict:
        """Keyword arguments added to each ``generate`` call: the I6 processors, and a recorder of
        the sampler's own logprobs whenever the sampler's distribution can differ from the
        trainer's (one number per sampled token, not ``output_scores``' ``[B, V]`` per step)."""
        a = self.args
        processors = build_processors(input_ids.size(1), a.presence_penalty, a.frequency_penalty,
                                      a.repetition_penalty, a.min_new_tokens, self.eos_token_ids)
        if processors or a.hf_importance_sampling_correction:
            processors.append(SampledLogprobRecorder())  # runs after the warpers: after_warpers in _generate
        return {"logits_processor": processors} if processors else {}

    def _generate(self, prompts: list):
        intercept = self._hf_generate_path() and not self.tools
        # a user's rollout_func may call generate its own way (several turns, other prompts): not observed
        if self.rollout_func is None and (intercept or self._guard_now()):
            model = self.accelerator.unwrap_model(self.model_wrapped)
            with guards.record_generate(model, self._generation_extras if intercept else None) as calls, \
                    after_warpers(model):
                out = super()._generate(prompts)
        else:
            out, calls = super()._generate(prompts), []
        if calls:
            out = self._with_sampler_logprobs(out, calls[-1])
        self._log_completion_shape(out[1], calls[-1] if calls else None)
        self._generated_stops = self._count_generated_stops(calls)
        if not self._guard_now():
            self._guard_record = None
            return out
        prompt_ids, completion_ids, tool_mask, completions = out[:4]
        tok = self._tokenizer
        record = {"prompt_ids": [list(p) for p in prompt_ids], "completion_ids": [list(c) for c in completion_ids]}
        if isinstance(prompts[0], list) and self.rollout_func is None and not self._is_vlm:
            guards.check_prompts_templated(tok, prompt_ids, self._template_prompt_ids(prompts))
        if calls and self.tools:  # the tool loop: one generate call per turn
            record["loss_mask"] = guards.check_tool_loop(
                tok, calls, prompt_ids, completion_ids, tool_mask, self.eos_token_ids,
                templates.generation_prompt_ids(tok, self._template, **self.chat_template_kwargs),
                self.max_completion_length)
        elif calls:  # the transformers path: compare against what generate really returned
            call = calls[-1]
            gen_in = call["input_ids"].cpu()
            attn = call["attention_mask"] if call["attention_mask"] is not None else torch.ones_like(gen_in)
            guards.check_same_prompt(tok, guards._unpad(gen_in, attn), prompt_ids, range(len(prompt_ids)))
            guards.check_extraction(tok, gen_in, call["output"].cpu(), completion_ids, self.eos_token_ids)
        elif not self.use_vllm and self.rollout_func is None:
            logger.warning("grpotrl guard: could not observe `generate`; I3 is checked on the text only.")
        if not self.tools and self.rollout_func is None:  # I4 from the tokens and the stop set, on every sampler
            guards.check_stops(tok, completion_ids, self.eos_token_ids, self._completion_cap())
        if not self.tools and getattr(tok, "response_schema", None) is None \
                and getattr(tok, "response_template", None) is None:
            guards.check_reward_text(tok, completion_ids, completions, self._reward_headers)
        self._guard_record = record
        return out

    def _count_generated_stops(self, calls: list[dict]) -> torch.Tensor | None:
        """Stop tokens the model generated per row [B], read off ``generate``'s raw output (the
        completion is cut after the first one); None where there is none to read (vLLM and continuous
        batching return the completion as sampled, a tool loop spans several calls)."""
        if not calls or self.tools:
            return None
        call = calls[-1]
        raw = call["output"][:, call["input_ids"].size(1):]  # [B, C] everything sampled, padding after its stop
        return health.generated_stop_counts(raw, self.eos_token_ids, call["stop_ids"]).to(self.accelerator.device)

    def _completion_cap(self) -> int | None:
        """The length generation cuts a completion that has no stop token at (I4); None where one may
        also end earlier without a stop token: stop strings, a context-length cap of vLLM's, a rollout_func."""
        kw = self.args.generation_kwargs or {}
        if self.rollout_func is not None or kw.get("stop_strings") or kw.get("stop") \
                or (self.use_vllm and self.args.vllm_max_model_length):
            return None
        return kw.get("max_tokens" if self.use_vllm else "max_new_tokens", self.max_completion_length)

    def _template_prompt_ids(self, prompts: list) -> list[list[int]]:
        """I1's reference: each conversational prompt through the chat template in force, with the
        generation prompt, ``chat_template_kwargs`` and the tools TRL renders for its row (an
        environment's own tools with ``environment_factory``)."""
        if self.environment_factories is not None:
            tools = [self._env_tools[name] or None for name in self._batch_environments]
        else:
            tools = [self.tools or None] * len(prompts)
        return [templates.prompt_ids(self._tokenizer, p, self._template, tools=t, **self.chat_template_kwargs)
                for p, t in zip(prompts, tools)]

    def _with_sampler_logprobs(self, out: tuple, call: dict) -> tuple:
        """Put the sampler's own per-token logprobs where TRL keeps vLLM's (I5), when recorded."""
        recorder = next((p for p in call["extra"].get("logits_processor", [])
                         if isinstance(p, SampledLogprobRecorder)), None)
        if recorder is None:
            return out
        lp = recorder.logprobs(call["output"])  # [B, C]
        per_row = [lp[i, : len(c)].tolist() for i, c in enumerate(out[1])]
        return (*out[:4], per_row, *out[5:])

    def _log_completion_shape(self, completion_ids: list, call: dict | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        self._completion_lengths = torch.tensor([len(c) for c in completion_ids], device=self.accelerator.device)
        n = len(completion_ids)
        one = sum(len(c) == 1 for c in completion_ids)
        capped = sum(len(c) >= self.args.max_completion_length for c in completion_ids)
        trig = 0
        for p in (call or {}).get("extra", {}).get("logits_processor", []):
            if isinstance(p, MinNewTokensProcessor):
                trig = p.trigger_count
        totals = self.accelerator.gather(torch.tensor([n, one, trig, capped], device=self.accelerator.device))
        totals = totals.view(-1, 4).sum(0).tolist()
        self._metrics[mode]["completions/one_token_share"].append(totals[1] / max(totals[0], 1))
        self._metrics[mode]["completions/max_length_share"].append(totals[3] / max(totals[0], 1))
        if self.args.min_new_tokens:
            self._metrics[mode]["generation/min_new_tokens_trigger_rate"].append(totals[2] / max(totals[0], 1))

    def _generate_and_score_completions(self, inputs):
        output, rewards = self._score_round(inputs)
        if self.args.dynamic_sampling and self.model.training:
            output = self._dynamic_sampling(output, rewards)
        if self.args.hf_importance_sampling_correction and "sampling_per_token_logps" in output:
            self._apply_importance_sampling(output)
        return output

    def _score_round(self, inputs) -> tuple[dict, torch.Tensor]:
        """TRL's generate-and-score, rows tagged, health logged; also returns the rewards [B_global]."""
        with guards.record_calls(self, "_calculate_rewards") as scored:
            output = super()._generate_and_score_completions(inputs)
        output[ROW_KEY] = torch.arange(output["prompt_ids"].size(0), device=output["prompt_ids"].device)
        if self.task_names and isinstance(inputs[0], dict):
            output[TASK_KEY] = torch.tensor([self.task_names.index(str(x[self.args.task_column])) for x in inputs],
                                            device=output["prompt_ids"].device)  # [B]
            _check_groups_single_task(self.accelerator.gather(output[TASK_KEY]), self.num_generations,
                                      self.task_names)
        rewards = health.group_rewards(scored[-1], self.reward_weights)  # [B_global]
        self._log_batch_health(inputs, output, rewards)
        return output, rewards

    # ------------------------------------------------------------------ health (grpotrl.health, grpotrl.callbacks)

    def _log_batch_health(self, inputs: list, output: dict, rewards: torch.Tensor) -> None:
        """Stop tokens in prompts (left padding excluded) and in completions (the loss's tokens),
        chat-header starts, exactly-zero rewards, per-task lengths and rewards when rows have a
        ``task``; keeps the batch for ``boundary_report()``."""
        metrics = self._metrics["train" if self.model.training else "eval"]
        completion_ids = output["completion_ids"]  # [B, C]
        header = torch.tensor(health.starts_with_header(self._tokenizer, completion_ids[:, :32].tolist(),
                                                        self._chat_headers), device=completion_ids.device)
        if "tool_mask" in output:  # each turn's own stop is not counted, only those past it
            stop_mask = health.stop_count_mask(output["completion_mask"] * output["tool_mask"])  # [B, C]
        else:  # every token the sampler returned (vLLM and continuous batching return them all)
            t = torch.arange(completion_ids.size(1), device=completion_ids.device)
            stop_mask = (t < self._completion_lengths.to(t.device).unsqueeze(1)).long()  # [B, C]
        completion_stops = health.count_ids(completion_ids, stop_mask, self.eos_token_ids)  # [B]
        if self._generated_stops is not None:  # transformers: generate's raw output, past the cut completion
            completion_stops = self._generated_stops
        per_row = torch.stack([health.count_ids(output["prompt_ids"], output["prompt_mask"], self.eos_token_ids),
                               completion_stops, header.long()], dim=1).float()  # [B, 3]
        per_row = self.accelerator.gather(per_row)  # [B_global, 3]
        metrics["stops/prompt_mean"].append(per_row[:, 0].mean().item())
        metrics["stops/completion_mean"].append(per_row[:, 1].mean().item())
        metrics["stops/completion_max"].append(per_row[:, 1].max().item())
        metrics["completions/header_share"].append(per_row[:, 2].mean().item())
        metrics["rewards/zero_share"].append(health.zero_reward_share(rewards))
        column = self.args.task_column
        if isinstance(inputs[0], dict) and column in inputs[0]:
            tasks = gather_object([str(x[column]) for x in inputs])
            lengths = self.accelerator.gather(self._completion_lengths)  # [B_global]
            for key, value in {**health.task_lengths(tasks, lengths), **health.task_rewards(tasks, rewards)}.items():
                metrics[key].append(value)
        start = self.accelerator.process_index * len(inputs)
        self._last_batch = {"prompt_ids": output["prompt_ids"], "prompt_mask": output["prompt_mask"],
                            "completion_ids": completion_ids, "lengths": self._completion_lengths,
                            "stop_mask": stop_mask, "generated_stops": completion_stops,
                            "rewards": rewards[start:start + len(inputs)]}

    def boundary_report(self, n: int = 4) -> str:
        """The last generation batch by eye (seed 000): prompt tail and completion head with
        special tokens shown, ids around the boundary, stop-token counts. Printed after the
        first ``health_report_steps`` steps; call it any time."""
        if self._last_batch is None:
            return "grpotrl boundary report: no generation batch yet"
        return health.boundary_report(self._tokenizer, self._last_batch, self.eos_token_ids, self._chat_headers, n)

    def _log_loss_health(self, loss: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor,
                         task: torch.Tensor | None = None) -> None:
        """Per-sample entropy (min, p10, mean of the per-sample means), per task when rows carry
        one (``task`` [B] indexes ``task_names``); the loss for NonFiniteRule."""
        mode = "train" if self.model.training else "eval"
        per_sample = self.accelerator.gather(health.per_sample_mean(entropies.detach().float(), mask))  # [B_global]
        for key, value in health.summarise_samples(per_sample).items():
            self._metrics[mode][key].append(value)
        if task is not None:
            tasks = [self.task_names[i] for i in self.accelerator.gather(task).tolist()]
            for key, value in health.task_means(tasks, per_sample, "entropy").items():
                self._metrics[mode][key].append(value)
        if self._step_losses is not None and mode == "train":
            self._step_losses.append(loss.detach())

    def _log_logit_signals(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        """logits/max, top1_top2_gap, top1_prob, top5_mass: token means over the completion mask."""
        sums = health.masked_means(health.logit_stats(logits, self.temperature), mask)  # name -> [sum, count]
        totals = self.accelerator.gather(torch.stack(list(sums.values()))).view(-1, len(sums), 2).sum(0)  # [k, 2]
        mode = "train" if self.model.training else "eval"
        for name, (total, count) in zip(sums, totals.tolist()):
            self._metrics[mode][name].append(total / count if count else float("nan"))

    def _logit_signals_due(self) -> bool:
        n = self.args.health_logit_steps
        return n > 0 and self.model.training and self.state.global_step % n == 0

    # ------------------------------------------------------------------ DAPO dynamic sampling

    def _dynamic_sampling(self, output: dict, rewards: torch.Tensor) -> dict:
        """Drop zero-variance groups from the loss and refill with fresh prompts, for up to
        ``dynamic_sampling_max_rounds`` extra rounds (``grpotrl.dynamic_sampling``). Decisions
        use the gathered rewards, so every process takes the same rounds."""
        G, P = self.num_generations, self.accelerator.num_processes
        target = rewards.numel() // G  # groups per generation batch, all processes
        batches, zero_std = [output], [health.zero_std_groups(rewards, G)]
        record = self._guard_record
        rounds = 0
        while rounds < self.args.dynamic_sampling_max_rounds:
            missing = target - int(sum((~z).sum() for z in zero_std))
            if missing <= 0:
                break
            rounds += 1
            while (missing * G) % P:  # rows must split evenly over the processes
                missing += 1
            out, r = self._score_round(self._refill_rows(missing, rounds))
            out[ROW_KEY] = out[ROW_KEY] + sum(b[ROW_KEY].numel() for b in batches)
            if record is not None and self._guard_record is not None:
                record = {k: record[k] + self._guard_record[k] for k in record}
            batches.append(out)
            zero_std.append(health.zero_std_groups(r, G))
        keeps = dynamic_sampling.keep_groups(zero_std, target)
        kept = sum(int(k.sum()) for k in keeps)
        generated = sum(z.numel() for z in zero_std)
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/dropped_share"].append(1 - kept / generated if kept else 0.0)
        metrics["dynamic_sampling/rounds"].append(rounds)
        metrics["dynamic_sampling/filled_share"].append(kept / target)
        self._guard_record = record
        if kept == 0:  # nothing has a gradient: train on the first batch as plain GRPO would
            return output
        rows = torch.cat([dynamic_sampling.local_rows(k, G, self.accelerator.process_index, b[ROW_KEY].numel())
                          for k, b in zip(keeps, batches)])  # [B_local_all_rounds]
        counts = self.accelerator.gather(rows.sum().reshape(1).to(self.accelerator.device)).tolist()
        count = min(dynamic_sampling.common_count(counts, self.args.steps_per_generation), rows.numel())
        rows = dynamic_sampling.fill_rows(rows, count)
        merged = dynamic_sampling.select_rows(dynamic_sampling.concat_rows(batches, self._tokenizer.pad_token_id),
                                              rows)
        loss_mask = merged["completion_mask"] * merged.get("tool_mask", 1)
        merged["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        return merged

    def _refill_rows(self, groups: int, round_: int) -> list[dict]:
        """This process's share of ``groups`` fresh prompts x G, drawn from train_dataset with a
        generator seeded by (seed, step, round): the same draw on every process."""
        gen = torch.Generator().manual_seed(hash((self.args.seed, self.state.global_step, round_)) % 2**63)
        idx = torch.randint(len(self.train_dataset), (groups,), generator=gen).tolist()
        rows = [self.train_dataset[i] for i in idx for _ in range(self.num_generations)]
        local = len(rows) // self.accelerator.num_processes
        start = self.accelerator.process_index * local
        return rows[start:start + local]

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
        guard = record is not None and self._guard_now() and ROW_KEY in inputs
        tok = self._tokenizer
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, cmask = inputs["completion_ids"], inputs["completion_mask"]
        if guard:
            rows = inputs[ROW_KEY].tolist()
            generated_prompts = [record["prompt_ids"][r] for r in rows]
            guards.check_same_prompt(tok, generated_prompts, guards._unpad(prompt_ids, prompt_mask), rows)
            guards.check_same_completions(tok, generated_prompts, [record["completion_ids"][r] for r in rows],
                                          completion_ids, rows)
            if "loss_mask" in record:  # a tool loop: the loss covers each generated turn, no tool result
                guards.check_loss_mask(tok, completion_ids, cmask * inputs["tool_mask"],
                                       [record["loss_mask"][r] for r in rows], self.eos_token_ids, rows,
                                       truncated_masked=self.mask_truncated_completions)
            elif "tool_mask" not in inputs:  # (a rollout_func's env_mask: turns not observed, I4 not checked)
                lengths = torch.tensor([len(record["completion_ids"][r]) for r in rows], device=completion_ids.device)
                guards.check_completion_mask(tok, completion_ids, cmask, self.eos_token_ids, rows,
                                             self._completion_cap(), lengths=lengths,
                                             truncated_masked=self.mask_truncated_completions)

        with guards.record_calls(self, "_get_per_token_logps_and_entropies") as calls:
            loss = super()._compute_loss(model, inputs)
        used, entropies = calls[0][0], calls[0][1]  # [B, C] the policy logprobs and entropies the loss used
        loss_mask = cmask * inputs.get("tool_mask", 1)  # [B, C]
        if self._identity_due and self.model.training:
            self._identity_due = False
            if self.state.global_step == 0:
                self._check_step0_identity(model, used, inputs, loss_mask)
        if "sampling_per_token_logps" in inputs:
            self._log_sampler_gap(used, inputs)
        self._loss_entropies = (entropies, loss_mask) if entropies is not None else None
        if entropies is not None:
            self._log_loss_health(loss, entropies, loss_mask, inputs.get(TASK_KEY))
        if not (guard or self._logit_signals_due()):
            return loss
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P+C]
        attention_mask = torch.cat([prompt_mask, cmask], dim=1)  # [B, P+C]
        reference, scale, logits = guards.recompute_logprobs(self.accelerator.unwrap_model(model), input_ids,
                                                             attention_mask, completion_ids.size(1), self.temperature,
                                                             return_logits=True)
        self._log_logit_signals(logits, loss_mask)
        if not guard:
            return loss
        if _dropout_active(model):  # the loss's forward samples dropout masks: no deterministic reference exists
            if not self._warned_dropout:
                logger.warning("grpotrl guard: I5 (and the I7 entropy values) are not checked while dropout is active "
                               "in the training forward (disable_dropout=False, TRL's default): the loss then scores "
                               "another function than the one that sampled. Set disable_dropout=True to check them.")
                self._warned_dropout = True
            return loss
        low_precision = 100 if (self.args.bf16 or self.args.fp16) else 1
        gap = guards.check_logprobs(tok, used, reference, cmask, completion_ids, self.temperature,
                                    self.args.guard_logprob_atol * low_precision, rows, scale=scale)
        if entropies is not None and self._entropy_bonus_enabled:  # the node I7's sign check differentiates
            guards.check_entropy_values(entropies, entropy_from_logits(logits, self.temperature), loss_mask,
                                        atol=1e-3 * low_precision)
        del logits
        self._guard_max_gap = max(self._guard_max_gap, gap)
        self._metrics["train"]["guards/logprob_max_gap"].append(gap)
        return loss

    def _check_step0_identity(self, model, used: torch.Tensor, inputs: dict, loss_mask: torch.Tensor) -> None:
        """I10: the reference's and the old policy's logprobs on this (first, step-0) microbatch are
        the loss's own. Logged as identity/step0_{ref,old}_logp_gap/{mean,max}."""
        if _dropout_active(model):
            logger.warning("grpotrl guard: I10 (step-0 identity of reference and old policy) is not checked while "
                           "dropout is active in the training forward (disable_dropout=False).")
            return
        rows = inputs[ROW_KEY].tolist() if ROW_KEY in inputs else list(range(used.size(0)))
        low = bool(self.args.bf16 or self.args.fp16)
        policy = self.accelerator.unwrap_model(model)
        sides = []
        if inputs.get("ref_per_token_logps") is not None:
            ref = self.accelerator.unwrap_model(self.ref_model) if self.ref_model is not None else None
            adapter = "ref" if "ref" in (getattr(policy, "peft_config", None) or {}) else None
            sides.append(("ref", "reference", inputs["ref_per_token_logps"],
                          identity.reference_causes(policy, ref, adapter)))
        if inputs.get("old_per_token_logps") is not None:
            sides.append(("old", "old policy", inputs["old_per_token_logps"],
                          " Likely cause: the old logprobs were computed by another forward (other position ids, "
                          "dtype or dropout) than the loss's."))
        for key, what, other, causes in sides:
            mean, worst = identity.check_step0_identity(self._tokenizer, used, other, loss_mask,
                                                        inputs["completion_ids"], what, low, rows, causes)
            self._metrics["train"][f"identity/step0_{key}_logp_gap/mean"].append(mean)
            self._metrics["train"][f"identity/step0_{key}_logp_gap/max"].append(worst)

    def _log_sampler_gap(self, used: torch.Tensor, inputs: dict) -> None:
        """The sampler against the trainer on the loss's tokens: the raw, untruncated importance ratio
        per token and per sequence (TRL logs only the truncated one, issue 5231), |sampler - trainer|
        logprob (what the processors, and any mismatch, changed; TRL logs it for vLLM only), and the
        gate ``sampler_gap_threshold`` / ``sampler_gap_action`` on its mean."""
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)  # [B, C]
        trainer = inputs.get("old_per_token_logps")  # what TRL's IS ratio uses, when computed
        trainer = used.detach() if trainer is None else trainer  # [B, C]
        raw = identity.raw_ratio_stats(trainer, inputs["sampling_per_token_logps"], mask)
        gap = (used.detach() - inputs["sampling_per_token_logps"]).abs()[mask.bool()]
        gap = gap[torch.isfinite(gap)]
        local = torch.tensor([float(gap.mean()) if gap.numel() else 0.0, float(gap.max()) if gap.numel() else 0.0,
                              *raw.values()], device=used.device)  # [2 + len(raw)]
        stats = self.accelerator.gather(local).view(-1, local.numel())  # [world, 2 + len(raw)]
        mode = "train" if self.model.training else "eval"
        mean_gap = stats[:, 0].mean().item()
        self._metrics[mode]["sampling/sampler_trainer_logp_gap/mean"].append(mean_gap)
        self._metrics[mode]["sampling/sampler_trainer_logp_gap/max"].append(stats[:, 1].max().item())
        for j, name in enumerate(raw):
            col = stats[:, 2 + j]
            col = col[torch.isfinite(col)]
            if col.numel():
                value = col.min() if name.endswith("/min") else col.max() if name.endswith("/max") else col.mean()
                self._metrics[mode][f"sampling/raw_ratio/{name}"].append(value.item())
        a = self.args
        if a.sampler_gap_action == "off" or not mean_gap > a.sampler_gap_threshold:  # NaN trips it
            return
        own = [n for n in ("presence_penalty", "frequency_penalty", "min_new_tokens") if getattr(a, n)]
        own += ["repetition_penalty"] if a.repetition_penalty != 1.0 else []
        message = (f"sampler/trainer mismatch: the mean |logp_sampler - logp_trainer| over the loss's tokens is "
                   f"{mean_gap:.3f} nats > sampler_gap_threshold={a.sampler_gap_threshold} (step "
                   f"{self.state.global_step}). The update is computed for a distribution the completions were not "
                   "sampled from. Likely causes: `generation_kwargs` that change sampling behind the trainer's back "
                   f"(temperature, top_k, top_p, min_p other than the config's: T={self.temperature}), a logits "
                   "processor of your own, or a sampler in another precision."
                   + (f" grpotrl's own processors are on ({', '.join(own)}): they change the sampler's distribution "
                      "on purpose; hf_importance_sampling_correction corrects the update for it, or raise "
                      "sampler_gap_threshold." if own else ""))
        if a.sampler_gap_action == "stop":
            raise InvariantError("I5", message)
        if not self._warned_sampler_gap:
            logger.warning("grpotrl: %s (said once; sampling/sampler_trainer_logp_gap/mean is logged every step)",
                           message)
            self._warned_sampler_gap = True

    # ------------------------------------------------------------------ the entropy bonus's sign (I7)

    def entropy_coef_in_force(self) -> float:
        """The ``c`` of ``- c * H`` that TRL's loss applies now: ``entropy_coef``, gated by the
        adaptive controller's previous-step entropy when ``use_adaptive_entropy``."""
        if not self._entropy_bonus_enabled:
            return 0.0
        if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
            return 0.0
        return float(self.entropy_coef)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        coef = self.entropy_coef_in_force()  # before the adaptive controller updates it in the loss
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.model.training and self._loss_entropies is not None:
            self._check_entropy_sign(loss, self._loss_entropies[0], coef, "the GRPO loss")
        return loss

    def _check_entropy_sign(self, loss: torch.Tensor, entropies: torch.Tensor, coef: float, where: str) -> float:
        """I7 on ``loss``; the slope is logged as ``entropy/dloss_dH`` (must read ``-entropy_coef``)."""
        slope = guards.check_entropy_sign(loss, entropies, coef, self.current_gradient_accumulation_steps, where)
        self._metrics["train"]["entropy/dloss_dH"].append(slope)
        return slope

    # ------------------------------------------------------------------ checkpoints (I2)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            templates.save_fingerprint(output_dir or self.args.output_dir, self._tokenizer, self.chat_template,
                                       chat_template_kwargs=[self.chat_template_kwargs or {}])


def _dropout_active(model) -> bool:
    """Whether a training forward of ``model`` samples dropout masks: an ``nn.Dropout`` with p > 0,
    or an attention module with a float ``attention_dropout`` > 0 (TRL's ``disable_dropout``
    zeroes the former only)."""
    return model.training and any(
        (isinstance(m, torch.nn.Dropout) and m.p > 0)
        or (isinstance(getattr(m, "attention_dropout", None), float) and m.attention_dropout > 0)
        for m in model.modules())


def _check_groups_single_task(task: torch.Tensor, num_generations: int, names: list[str]) -> None:
    """Group normalisation (mean and std over each prompt's G completions) must never mix tasks:
    every group of G consecutive gathered rows carries one task label."""
    groups = task.view(-1, num_generations)  # [B_global / G, G]
    mixed = (groups != groups[:, :1]).any(-1)  # [B_global / G]
    if mixed.any():
        g = int(mixed.nonzero()[0])
        raise InvariantError("multi-task", f"generation group {g} mixes tasks {[names[i] for i in groups[g].tolist()]}"
                             ": its advantages would normalise one task's rewards by another's. Each prompt's "
                             "num_generations completions must come from one row (TRL's RepeatSampler does this).")


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
