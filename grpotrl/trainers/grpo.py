"""``grpotrl.GRPOTrainer``: TRL's GRPOTrainer with INVARIANTS I1-I7 and I10-I12 guarded on its real tensors.

The class docstring is a map of the TRL hooks it overrides and the TRL methods it wraps at run time;
each hook's own docstring states its contract. What one hook hands the next travels in
``hook_record`` (``trainers/records.py``).

Guards run for the first ``guard_steps`` steps (default 2), every step with -1, never with 0, with the
tolerances of the run's compute dtype (``guard_tolerances``, ``guards/precision.py``). Health rules
(stopping only certainly broken runs by default, warning otherwise) and the boundary report are
callbacks (``grpotrl.health.callbacks``) added at init; ``boundary_report()`` prints the last
generation batch's prompt/completion boundary on demand.
"""

from __future__ import annotations

import contextlib
import gc
import logging

import torch
import trl
from accelerate.utils import gather_object

from .. import guards, health
from ..chat import boundary, templates
from ..configs import GRPOConfig, complete_grpo_config
from ..errors import InputError, InvariantError
from ..generation import compiled_rollout
from ..generation.finished_rows import decoding_share
from ..generation.processors import min_new_tokens_fired, vllm_sampling
from ..generation.sampled_logprobs import generation_extras, recorded_logprobs, recorded_measures
from ..guards import denominator, identity, precision
from ..guards.ranks import add_rank_agreement, caught, decided_together
from ..health import callbacks
from ..models.dropout import disable_dropout
from ..models.quantization import pin_quantized_kernels
from ..ops import importance, sampling
from ..ops.logprobs import entropy_from_logits, temperature_slope
from ..ops.loss_types import named
from ..preflight import check_grpo, task_labels
from . import _intercept, dynamic_sampling, packed_attention, padding_free
from ._common import CheckedResume
from .adapter import adapter_loaded
from ._intercept import TRLGenerate
from .records import BatchRecord, Generated, HookRecord, LossTerms
from .reference_kl import ReferenceKL

logger = logging.getLogger(__name__)

ROW_KEY = "grpotrl_row"
TASK_KEY = "grpotrl_task"  # [B] index into trainer.task_names, when rows carry a task label


class GRPOTrainer(CheckedResume, ReferenceKL, trl.GRPOTrainer):
    """TRL's GRPOTrainer with INVARIANTS I1-I7 and I10-I12 guarded (module docstring).

    Overrides (each hook's docstring has its contract; everything else is TRL's):
      * ``__init__``: every check that can fail before a model loads; a PEFT adapter named by path or Hub id loaded
        onto its base for TRL to train (``adapter.adapter_loaded``: TRL's ``ref`` copy of it is the reference); then
        grpotrl's settings (I2, I6, KL, ``padding_free``, the guards' precision, health callbacks, I12 on several
        ranks).
      * ``_generate``: observes ``generate`` (I6 processors, the sampler's logprobs, rows that stopped leave
        the decoding batch under ``padding_free``, a static cache and a compiled decoding step under
        ``compiled_rollout``); I1, I3, I4 on guard steps.
      * ``_generate_and_score_completions``: rows tagged, health signals, dynamic sampling, the IS correction.
      * ``_calculate_rewards``: a +-inf reward made missing and counted (``nonfinite_reward`` health rule).
      * ``_get_per_token_logps_and_entropies``: packed rows under ``padding_free``, TRL's layout back.
      * ``_prepare_inputs``: token-balanced microbatches under ``balance_microbatches``.
      * ``_compute_loss``: grpotrl's KL in place of TRL's; I1, I3, I4, I11 on the microbatch; before TRL's loss
        forward ``_recompute_reference`` (guard and logit-signal steps: I5's padded recompute, the logit
        signals), after it ``_check_loss``: I10 at step 0, the sampler gap, entropy health, I5 and I7's entropy
        values.
      * ``compute_loss``: I7, the entropy bonus's sign on the graph being backpropagated. Under DDP the guards of
        ``_compute_loss`` and ``compute_loss`` decide together on every rank, once per microbatch at the end of
        ``compute_loss`` (``_guards_agree_now``, ``guards.ranks.decided_together``): a guard failing on one rank
        stops every rank there, each naming the failing rank(s), rather than leaving the others waiting in their
        next collective.
      * ``training_step``, ``prediction_step``: TRL's fused head in CPU-sized tiles; under
        ``packed_attention='varlen'`` the policy switched to grpotrl's varlen attention for the whole step.
      * ``save_model``: the chat-template fingerprint beside the weights (I2; ``_save_fingerprint``).
      * ``train`` / ``end`` / ``_load_from_checkpoint`` / ``_save_checkpoint`` / ``_finalize_training`` /
        ``_push_from_checkpoint`` (``_common.CheckedResume``):
        ``output_dir`` locked against a second run; a resume checkpoint checked before anything loads; a full
        disk named; ``save_total_limit`` deletes this run's checkpoints only, at each save and at the end. The KL methods live in ``reference_kl.ReferenceKL``, a mixin that overrides nothing of TRL's.

    Wraps at run time (``trainers/_intercept.py``; each method restored when the hook returns):
      * ``self._calculate_rewards`` in ``_generate_and_score_completions`` (``record_rewards``): records
        the rewards TRL scored.
      * each transformers model's ``enable_input_require_grads`` inside the policy, in
        ``_generate_and_score_completions`` (``skip_stacked_input_grad_hooks``): TRL switches gradient checkpointing
        off and on around the rollout; each switch on keeps one input-embedding hook instead of adding another.
      * ``self._get_per_token_logps_and_entropies`` in ``_compute_loss`` (``record_loss_forward``): records
        the logprobs and entropies TRL's loss used (I5, I7, I10).
      * the policy's ``model.generate`` in ``_generate`` (transformers path and guard steps, ``record_generate``):
        records its inputs and outputs; on the transformers path injects the I6 processors (response-only
        penalties, min-new-tokens over every stop id) and a recorder of the sampler's logprobs, and under
        ``compiled_rollout`` the static cache of the call's bucket and transformers' ``CompileConfig``
        (``generation.compiled_rollout.generate_kwargs``).
      * under ``compiled_rollout`` on CUDA, transformers' ``DeferredStopCheck.is_supported`` in ``_generate``
        (``inject_deferred_stop_check``): the decoding loop reads its stop flag one step late, never waiting on
        the device (one extra forward per call, whose token and cache entries transformers undoes); and
        ``torch.multinomial`` (``inject_draw_one(defer_check=True)``): the same tokens without torch's per-step read
        of a validity flag, which is read once after ``generate``.
      * on CPU, ``torch.multinomial`` in ``_generate`` on the transformers path
        (``inject_draw_one(defer_check=False)``): the same tokens, the exponential draws computed in half torch's
        time (``ops.sampling.exponential_draws``).
      * the policy's ``_get_logits_processor`` (transformers' ``GenerationMixin``) in ``_generate``
        (``inject_recorders_after_warpers``): the recorder runs after transformers' warpers, on the scores
        it samples from.
      * with ``padding_free`` on the transformers path, the policy's ``generate`` and ``_get_stopping_criteria``
        and a forward pre-hook and hook on it, in ``_generate`` (``skip_finished_rows``): a row that has stopped
        leaves the decoding batch (its KV cache and its forward); the loop pads it and samples as before; rows
        that repeat a prompt run its prefill once, and the KV cache's layers grow in place.
      * under ``compiled_rollout``, the generating model's ``get_compiled_call`` in ``_generate`` (``record_calls``):
        whether transformers compiled the decoding step (an ``InputError`` where it ran eagerly).
      * under ``compiled_rollout``, each transformers model's input-embedding gradient hooks inside the policy, in
        ``_generate`` (``skip_input_grad_hooks``): removed for the rollout (no gradient flows there, and torch's
        dynamo refuses their ``requires_grad_`` in a compiled step), put back after where TRL did not.
      * under ``packed_attention='varlen'`` (``trainers/packed_attention.py``): the policy's attention implementation
        (transformers' ``set_attn_implementation``) in ``training_step`` and ``prediction_step``, its backward
        included, and the policy's or reference's in each packed no-grad forward, and, where torch's varlen kernel
        runs them, in I5's padded recompute (``_reference_attention``); grpotrl's attention and mask functions
        registered by name in transformers' ``AttentionInterface`` / ``AttentionMaskInterface`` (once, for the
        process).
      * ``self.beta`` in ``_compute_loss`` (``inject_attr``): 0 for TRL's loss, whose KL grpotrl replaces.
      * ``self.get_high_entropy_mask`` in ``_compute_loss`` (``record_entropy_mask``): records TRL's top-entropy
        mask (``top_entropy_quantile``), which with the loss mask gives the tokens TRL's entropy bonus acts on (I7).
      * ``trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE`` and ``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE`` in
        ``training_step`` and ``prediction_step`` on CPU (``inject_head_tiles``): 512 and 4096, for the step's
        forwards and backward.
      * ``transformers.trainer.sort_checkpoints`` in ``_finalize_training`` (``inject_end_checkpoints``, from
        ``_common.CheckedResume``): the end-of-training cleanup lists this run's checkpoints only.
      * with ``kl_estimator='full'``, a forward hook on the policy's backbone in ``_compute_loss``
        (``record_backbone_output``): its last hidden states, which the LM head turns into the loss forward's logits.
      * a forward pre-hook on the policy and reference models, for their lifetime (``inject_position_ids``):
        injects generate's position ids into TRL's fused logprob forward (I5 on absolute-position models).
      * at init (not a wrap), bitsandbytes' quantized layers of the policy are pinned to their training kernel
        (``models.quantization.pin_quantized_kernels``: a forward pre-hook on 8-bit layers), so I5's eval-mode
        recomputation computes what training does.

    TRL's private fields, read and written only through ``trainers/_intercept.py``: ``_tokenizer``
    (``read_tokenizer``), ``_is_vlm``, ``_env_tools`` / ``_batch_environments`` (``read_row_tools``, I1's
    tools per row), ``_entropy_bonus_enabled`` / ``_last_world_entropy`` (``read_entropy_bonus``, I7), and
    ``_metrics``, where every grpotrl metric goes (``set_metrics``; ``metric_values()`` reads them for the
    health rules). Calls TRL's ``_get_per_token_logps_and_entropies`` for the old policy's logprobs
    (``hf_importance_sampling_correction``).
    """

    _tag_names = ["trl", "grpo", "grpotrl"]
    _multitask = False  # reads task labels (rewards per task, CAGrad): the preflight refuses them otherwise

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, **kwargs):
        """TRL's ``GRPOTrainer.__init__`` with the same arguments, after every check that can fail before a model
        loads (``preflight.check_grpo``: model path, tokenizer, stop tokens, dataset, rewards, resume checkpoint,
        chat-template fingerprint I2), then grpotrl's own settings.

        Args:
            model: a model id or path, as TRL takes it (or a loaded model).
            reward_funcs: TRL's reward functions (callables, reward-model ids, judges), one or a list.
            args: a ``grpotrl.GRPOConfig``; a ``trl.GRPOConfig`` is completed with grpotrl's defaults
                (``configs.complete_grpo_config``), keeping TRL's padded forward unless it sets ``padding_free``.
            train_dataset, eval_dataset, processing_class, **kwargs: as TRL's.

        Raises:
            InputError: bad input, said before any weights load (what, which value, what to do).

        After TRL's init: generation stops on every stop id; the KL settings (``KLFields``); generate's position
        ids into every logprob forward; ``padding_free`` / ``balance_microbatches`` and ``compiled_rollout``
        resolved for the model and the kind of device, and logged in a line each; the guards' tolerances for the
        run's compute dtype (``guard_tolerances``); the health callbacks and, on several ranks, I12's ``RankAgreement``.
        """
        args = complete_grpo_config(args if args is not None else GRPOConfig(output_dir="grpotrl-output"))
        # every check that must pass before TRL loads the model (grpotrl/preflight/), once
        checked = check_grpo(model, reward_funcs, args, train_dataset, eval_dataset, processing_class, kwargs,
                             trainer_name=type(self).__name__, multitask=self._multitask, resume_kind=self._resume_kind)
        model, processing_class = checked.model, checked.processing_class
        self.stop_token_ids, self._checked_resume = checked.stop_token_ids, checked.checked_resume
        reward_funcs = self._with_kl_reward_column(checked.reward_funcs, args)
        with adapter_loaded(model, checked.adapter, args, kwargs, processing_class) as (model, kwargs):  # base + it
            super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                             processing_class=processing_class, **kwargs)
        pin_quantized_kernels(self.model)  # a quantized model TRL loaded from a path (I5 on bitsandbytes' CPU kernels)
        if args.disable_dropout:  # TRL zeroed the dropout layers; the attention modules' own dropout too
            for m in (self.model, self.ref_model):
                if m is not None:
                    disable_dropout(m)
        # KL (KLFields): in the loss grpotrl's own term replaces TRL's (beta is kept: TRL computes the reference
        # logprobs when it is not 0); in the reward (verl: kl_ctrl.kl_coef) the column ``kl_penalty``
        self.kl_coef = args.beta
        self.kl_reward_coef = args.beta if args.kl_in_reward_coef is None else args.kl_in_reward_coef
        self._kl_in_loss = bool(args.beta and args.use_kl_loss)

        # Stop on every stop id (TRL stops on eos and generation_config's ids only)
        # (and on generation_kwargs' own eos_token_id, which the line below would otherwise overwrite)
        extra = args.generation_kwargs.get("eos_token_id") if isinstance(args.generation_kwargs, dict) else None
        extra = [extra] if isinstance(extra, int) else list(extra or [])
        self.eos_token_ids = list(dict.fromkeys([*self.eos_token_ids, *self.stop_token_ids, *extra]))
        if getattr(self, "generation_config", None) is not None:
            self.generation_config.eos_token_id = self.eos_token_ids
            self.generation_kwargs["eos_token_id"] = self.eos_token_ids
            # transformers' repetition penalty counts the prompt: ours (I6) replaces it; its min-new-tokens (from
            # generation_kwargs, which the config made the field) would block first and hide ours, whose rate is logged
            # (0 where the model's generation_config.json sets one, which generate would fill None from: preflight
            # warns of it; None elsewhere, since 0 still adds a min-length processor to every decoding step)
            self.generation_config.repetition_penalty = 1.0
            self.generation_kwargs["repetition_penalty"] = 1.0
            model_config = getattr(self.accelerator.unwrap_model(self.model), "generation_config", None)
            self.generation_config.min_new_tokens = 0 if getattr(model_config, "min_new_tokens", None) else None
            self.generation_kwargs.pop("min_new_tokens", None)
        if self.use_vllm:
            self.vllm_generation.generation_kwargs = vllm_sampling(args, self.eos_token_ids,
                                                                   self.vllm_generation.generation_kwargs)
        _intercept.inject_position_ids(self.model, self.ref_model)
        # padding_free (and with it the finished-row rollout and balance_microbatches): 'auto' is on only on a
        # kind of device where it was measured faster than TRL's padded forward (docs/cost.md)
        device = self.accelerator.device.type
        self.padding_free, why_packed = padding_free.resolve(args, self.model, _intercept.read_is_vlm(self), device)
        self.compiled_rollout = self._resolve_compiled_rollout(args, device)  # before _drops_finished_rows is read
        if why_packed is not None:
            logger.warning("padding_free='auto' is off for this run: %s. The logprob forwards run padded.", why_packed)
        # how the packed forwards keep their sequences apart: the mask (and shared prompts), or varlen boundaries
        self.packed_attention, why_attention = padding_free.resolve_packed_attention(
            args, self.model, self.ref_model, device, self.padding_free)
        # prompts shared under the tree mask, or under varlen's tree attention where torch's kernel does not run it
        kernel = padding_free.kernel_runs(args, self.model, device, self.packed_attention)
        # I5's padded recompute through that kernel too: it rounds every token otherwise than sdpa (docs/cost.md)
        self.kernel_reference = kernel
        self.share_prompts = padding_free.resolve_share(self.padding_free and not kernel, self.model, self.ref_model)
        self.balance_microbatches, why_balanced = padding_free.resolve_balance(args, self.padding_free)
        if why_balanced is not None and self.padding_free:
            logger.info("balance_microbatches='auto' is off for this run: %s. Microbatches keep TRL's grouping.",
                        why_balanced)
        logger.info(padding_free.startup_line(
            args, device, self.padding_free, why_packed, self._drops_finished_rows(), self.balance_microbatches,
            why_balanced, attention=self.packed_attention, why_attention=why_attention,
            why_no_rollout="compiled rollout on: its static KV cache keeps every row" if self.compiled_rollout else None))
        # what the numeric guards (I5, I7, I10, I11) allow between two correct forwards in this run's precision
        self.guard_tolerances = precision.tolerances(precision.compute_dtype(self.model, args.bf16, args.fp16),
                                                     args.guard_logprob_atol)
        unsafe = padding_free.guard_warning(device, self.padding_free, self.packed_attention,
                                            self.guard_tolerances.low_precision, args.guard_steps != 0)
        if unsafe is not None:
            logger.warning(unsafe)
        self.hook_record = HookRecord()  # what one hook hands the next (trainers/records.py)
        self._warned: set[str] = set()  # warnings given once: a check skipped under dropout, the sampler gap
        self.hook_record.identity_due = bool(args.check_step0_identity) and args.guard_steps != 0  # I10 once
        self._template = templates.chat_template_of(self.processing_class, self.chat_template)  # None: plain text
        tok = _intercept.read_tokenizer(self)
        self._chat_headers = boundary.chat_headers(tok, self._template, **self.chat_template_kwargs)
        self._reward_headers = boundary.reward_headers(tok, self._template, **self.chat_template_kwargs)
        self._nonfinite_reward_action = callbacks.rule_action(args, callbacks.NonFiniteRewardRule)
        self.step_findings = callbacks.add_health_callbacks(self, args)  # what each step found, for the rules
        # I12: ranks hold one model (several ranks only), from the first step and from the policy's first update
        add_rank_agreement(self, args.guard_steps, self._identity_step())
        self.task_names = task_labels(args.task_column, train_dataset, eval_dataset)  # sorted, [] if no column

    def _guard_now(self) -> bool:
        return guards.due(self.args.guard_steps, self.state.global_step)

    def _record_metrics(self, metrics: dict[str, float], mode: str | None = None) -> None:
        """Each value onto TRL's metric list of its name (logged as their mean at the next log step):
        ``mode``'s, else the current one's (``_intercept.set_metrics``)."""
        _intercept.set_metrics(self, metrics, mode or ("train" if self.model.training else "eval"))

    def metric_values(self, mode: str = "train") -> dict[str, list]:
        """TRL's metric lists of ``mode``, name -> the values appended since the last log step (read
        only; the health rules read the step's values here, ``grpotrl.health.callbacks``)."""
        return _intercept.read_metrics(self, mode)

    # ------------------------------------------------------------------ generation (I1, I3, I4, I6)

    def _hf_generate_path(self) -> bool:
        return not self.use_vllm and not self.use_transformers_continuous_batching and self.rollout_func is None

    def _injects_processors(self) -> bool:
        """Whether ``_generate`` puts grpotrl's processors and recorder into ``generate``: transformers' own
        single-turn generate path."""
        return self._hf_generate_path() and not self.tools

    def _drops_finished_rows(self) -> bool:
        """Whether ``_generate`` takes rows that stopped out of the decoding batch (``padding_free`` on, on the
        path where grpotrl injects into ``generate``, without the compiled rollout, whose static KV cache keeps
        every row and whose loop cannot take the finished-row rollout's host reads)."""
        return bool(self.padding_free) and self._injects_processors() and not self.compiled_rollout

    def _resolve_compiled_rollout(self, args, device: str):
        """The run's compiled rollout (``generation.compiled_rollout``): its ``CompileConfig`` where it is on (the
        transformers generate path, nothing refused, ``compiled_rollout`` 'true', or 'auto' on a device where it
        was measured faster, in a run like the measured one: no DeepSpeed, no adapter), else None; logs what was
        chosen and why in one line.

        Raises:
            InputError: ``compiled_rollout`` 'true' where it cannot run (``compiled_rollout.refusal``).
        """
        facts = compiled_rollout.model_facts(_intercept._generating_module(self.model))
        deepspeed = getattr(self.accelerator.state, "deepspeed_plugin", None)
        why_not = compiled_rollout.refusal(
            hf_generate=self._hf_generate_path(), tools=bool(self.tools),
            cache_implementation=getattr(getattr(self, "generation_config", None), "cache_implementation", None),
            is_vlm=_intercept.read_is_vlm(self), facts=facts,
            sharded=bool(self.is_fsdp_enabled or (deepspeed is not None and deepspeed.zero_stage == 3)))
        not_covered = compiled_rollout.unmeasured(deepspeed=deepspeed is not None,
                                                  adapter=hasattr(self.model, "peft_config"))
        on, why = compiled_rollout.resolve(getattr(args, "compiled_rollout", False), device, why_not, not_covered)
        logger.info(compiled_rollout.startup_line(args.compiled_rollout, device, on, why))
        return compiled_rollout.compile_config(device, facts["fullgraph"]) if on else None

    def _generation_extras(self, input_ids) -> dict:
        """What ``_generate`` injects into each ``generate`` call: grpotrl's processors and the sampler-logprob
        recorder (``sampled_logprobs.generation_extras``) and, with the compiled rollout, the static cache of
        the call's bucket and the compile config (``compiled_rollout.generate_kwargs``)."""
        extras = generation_extras(self.args, input_ids.size(1), self.eos_token_ids)
        if self.compiled_rollout is None:
            return extras
        context = getattr(packed_attention.text_config(self.model), "max_position_embeddings", None)
        return {**extras, **compiled_rollout.generate_kwargs(self.compiled_rollout, input_ids.size(1),
                                                             self.generation_config.max_new_tokens, context)}

    def _generate(self, prompts: list):
        """TRL's ``_generate`` (one round of generation for this process's prompts), observed: on the transformers
        generate path grpotrl's processors (response-only penalties, min-new-tokens over every stop id) and the
        sampler's logprob recorder are injected, and with ``padding_free`` rows that stopped leave the decoding
        batch; on guard steps I1, I3 and I4 are checked against what ``generate`` saw and returned
        (``_check_generation``).

        Args:
            prompts: this process's prompts (chat messages or text), ``num_generations`` times each
                (``num_generations_eval`` in evaluation).

        Returns:
            output (TRLGenerate): TRL's ``(prompt_ids, completion_ids, tool_mask, completions, num_items_in_batch, logprobs, extra)``
            (``TRLGenerate``), with the sampler's own logprobs in ``logprobs`` where they were recorded (under
            top-k/top-p/min-p those of the full softmax with ``truncated_sampling_correction``). Writes
            ``hook_record.generated`` for ``_generate_and_score_completions``.

        Raises:
            InvariantError: I1, I3 or I4 failed on a guard step.
        """
        inject = self._injects_processors()
        # a user's rollout_func may call generate its own way (several turns, other prompts): not observed
        if self.rollout_func is None and (inject or self._guard_now()):
            model = self.accelerator.unwrap_model(self.model_wrapped)
            drop = _intercept.skip_finished_rows(model) if self._drops_finished_rows() else contextlib.nullcontext([])
            # CPU: torch's own draws in half the time (ops.sampling.exponential_draws); the same tokens
            draw = _intercept.inject_draw_one(defer_check=False) if inject and \
                self.accelerator.device.type in sampling.FAST_DRAW_ON else contextlib.nullcontext()
            with _intercept.record_generate(model, self._generation_extras if inject else None) as calls, \
                    _intercept.inject_recorders_after_warpers(model), drop as decoding_rows, draw, \
                    self._compiled_generate(model) as compiled:
                out = TRLGenerate(*super()._generate(prompts))
            if decoding_rows:  # the share of the decoding batch the model ran (padding_free's rollout saving)
                self._record_metrics({"padding_free/decoding_rows": decoding_share(decoding_rows)})
            if compiled is not None and calls:
                self._check_compiled(model, compiled)
        else:
            out, calls = TRLGenerate(*super()._generate(prompts)), []
        sampled = recorded_logprobs(calls[-1], out.completion_ids,
                                    full_softmax=self.args.truncated_sampling_correction) if calls else None
        # the sampler's own per-token logprobs, where TRL keeps vLLM's (I5); under top-k/top-p/min-p those of
        # the full softmax of its processed scores (sampled_logprobs' docstring; truncated_sampling_correction)
        if sampled is not None:
            out = out._replace(logprobs=sampled)
        self.hook_record.generated = Generated(
            completion_lengths=self._log_completion_shape(out.completion_ids, calls[-1] if calls else None),
            # stop tokens generate wrote per row [B], past the cut completion (not on vLLM, CB, a tool loop)
            generated_stops=None if not calls or self.tools else
            health.generated_stops_of(calls[-1], self.eos_token_ids).to(self.accelerator.device),
            guard=self._check_generation(prompts, out, calls) if self._guard_now() else None,
            sampler=recorded_measures(calls[-1]) if sampled is not None else None)
        return out

    @contextlib.contextmanager
    def _compiled_generate(self, model):
        """Under the compiled rollout, the ``generate`` calls of the block: the stop flag read one step late and
        ``torch.multinomial`` without its per-step device read, on the devices where those apply
        (``compiled_rollout.DEFERRED_STOP_ON``, ``SYNC_FREE_DRAW_ON``), and without the input embeddings'
        gradient hooks, which a compiled step refuses (``_intercept.skip_input_grad_hooks``); yields the list of
        the compiled calls transformers made (``get_compiled_call``, once per ``generate`` that compiled its
        decoding step). Where a call traced a new graph, the block ends with one ``gc.collect()``, which frees
        that call's static cache from dynamo's trace state (``compiled_rollout.graphs_traced``). Without the
        compiled rollout nothing changes and it yields None."""
        if self.compiled_rollout is None:
            yield None
            return
        traced = compiled_rollout.graphs_traced()
        with contextlib.ExitStack() as stack:
            stack.enter_context(_intercept.skip_input_grad_hooks(model))
            stack.enter_context(_intercept.inject_deferred_stop_check(compiled_rollout.DEFERRED_STOP_ON))
            if self.accelerator.device.type in compiled_rollout.SYNC_FREE_DRAW_ON:
                stack.enter_context(_intercept.inject_draw_one(defer_check=True))
            yield stack.enter_context(_intercept.record_calls(_intercept._generating_module(model),
                                                              "get_compiled_call"))
        if compiled_rollout.graphs_traced() != traced:
            gc.collect()

    def _check_compiled(self, model, compiled: list) -> None:
        """The rollout's ``generate`` compiled its decoding step (``compiled``: ``_compiled_generate``'s list), else
        an ``InputError``: transformers runs it eagerly, with a warning, where its ``_valid_auto_compile_criteria``
        refuses. Logs ``generation/compiled_rollout`` (1) and the static cache's length transformers sized
        (``generation/compiled_rollout_cache_len``)."""
        if not compiled:
            raise InputError("compiled_rollout: transformers ran the rollout's decoding step eagerly (its "
                             "_valid_auto_compile_criteria refused the call; its warning above says why). Set "
                             "compiled_rollout: false.")
        cache_len = getattr(_intercept._generating_module(model), "_previous_max_cache_length", None)
        self._record_metrics({"generation/compiled_rollout": 1.0,
                              "generation/compiled_rollout_cache_len": float(cache_len or "nan")})

    def _check_generation(self, prompts: list, out: TRLGenerate, calls: list[dict]) -> dict:
        """I1, I3, I4 on what ``_generate`` returned and ``generate`` saw (``guards.check_generation``)."""
        tok = _intercept.read_tokenizer(self)
        chat = isinstance(prompts[0], list) and self.rollout_func is None and not _intercept.read_is_vlm(self)
        tool_loop = None
        if calls and self.tools:
            tool_loop = {"tool_mask": out.tool_mask, "max_completion_length": self.max_completion_length,
                         "generation_prompt": templates.generation_prompt_ids(tok, self._template,
                                                                              **self.chat_template_kwargs)}
        schema = any(getattr(tok, a, None) is not None for a in ("response_schema", "response_template"))
        return guards.check_generation(
            tok, out.prompt_ids, out.completion_ids, out.completions, calls, self.eos_token_ids,
            templated=self._template_prompt_ids(prompts) if chat else None, tool_loop=tool_loop,
            cap=self._completion_cap(), stops=not self.tools and self.rollout_func is None,
            reward_headers=None if self.tools or schema else self._reward_headers,
            observable=not self.use_vllm and self.rollout_func is None)

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
        tok, tools = _intercept.read_tokenizer(self), _intercept.read_row_tools(self, len(prompts))
        return [templates.prompt_ids(tok, p, self._template, tools=t, **self.chat_template_kwargs)
                for p, t in zip(prompts, tools)]

    def _log_completion_shape(self, completion_ids: list, call: dict | None = None) -> torch.Tensor:
        """Logs the shares of 1-token and capped completions (``health.length_shares``) and, where grpotrl's
        processor blocks the stop ids (``_injects_processors``; vLLM's ``min_tokens`` counts nothing), the
        min-new-tokens trigger rate, over every process's completions; returns this process's completion
        lengths [B]."""
        lengths = torch.tensor([len(c) for c in completion_ids], device=self.accelerator.device)  # [B]
        local = torch.cat([lengths, lengths.new_tensor([min_new_tokens_fired(call)])])  # [B + 1]
        counted = self.args.min_new_tokens if self._injects_processors() else 0
        self._record_metrics(health.completion_shape(self.accelerator.gather(local).view(-1, local.numel()),
                                             self.args.max_completion_length, counted))
        return lengths

    # ------------------------------------------------------------------ scoring, health, dynamic sampling

    def _generate_and_score_completions(self, inputs):
        """TRL's generation batch for ``inputs``, rows tagged and health signals logged (``_score_round``); with
        ``dynamic_sampling`` the groups without a gradient (TRL's advantages all equal) refilled
        (``dynamic_sampling.refill``); on the transformers path with ``hf_importance_sampling_correction`` the
        advantages corrected. Writes the current mode's ``hook_record.batches`` entry (``BatchRecord``) for its
        microbatches: the batch's I1/I3/I4 record (None off guard steps), on training guard steps its loss tokens
        over every process (I11), and the sampler's measures. An evaluation's batch writes the ``"eval"`` entry
        only, so a training generation batch that several optimizer steps share is checked against its own record
        after an evaluation in between.

        Args:
            inputs: this process's rows of the generation batch (the dataset's columns, one dict a row).

        Returns:
            output (dict): TRL's, ``prompt_ids`` / ``prompt_mask`` [B, P], ``completion_ids`` / ``completion_mask`` [B, C],
            ``advantages`` [B], ..., plus ``grpotrl_row`` [B] (each row's index in the generation batch, which the
            loss's guards trace rows back by) and, when rows carry a task, ``grpotrl_task`` [B].
        """
        output, generated = self._score_round(inputs)
        guard, sampler = generated.guard, generated.sampler
        training = self.model.training

        def rescore(rows):  # one more round of generation for dynamic sampling, with its own guard record
            round_output, round_generated = self._score_round(rows)
            return round_output, self._gathered_advantages(round_output), round_generated.guard

        if self.args.dynamic_sampling and training:
            sampler = None  # the merged rows come from several rounds: no one recorder measured them
            output, guard = dynamic_sampling.refill(
                output, self._gathered_advantages(output), guard, log=self._record_metrics, score_round=rescore,
                accelerator=self.accelerator, train_dataset=self.train_dataset, seed=self.args.seed,
                step=self.state.global_step, num_generations=self.num_generations,
                max_rounds=self.args.dynamic_sampling_max_rounds, steps_per_generation=self.args.steps_per_generation,
                pad_token_id=_intercept.read_tokenizer(self).pad_token_id, row_key=ROW_KEY,
                aggregation=self.args.multi_objective_aggregation if self._merges_batch_statistics() else None)
        if self.args.hf_importance_sampling_correction and "sampling_per_token_logps" in output:
            self._apply_importance_sampling(output)
        window_tokens = None
        if self._guard_now() and training:  # I11: the generation batch's loss tokens, every process
            loss_mask = output["completion_mask"] * output.get("tool_mask", 1)  # [B, C]
            window_tokens = self.accelerator.gather(loss_mask.sum().reshape(1)).sum().item()
        self.hook_record.batches["train" if training else "eval"] = BatchRecord(guard, window_tokens, sampler)
        return output

    def _gathered_advantages(self, output: dict) -> torch.Tensor:
        """The advantages TRL computed for a scored round, over every process [B_global] (TRL keeps this
        process's slice): what dynamic sampling decides "no gradient" from, whatever TRL's
        ``multi_objective_aggregation`` and ``scale_rewards``."""
        return self.accelerator.gather(output["advantages"])  # [B_global]

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards [B_global, K], with every +-inf made missing (NaN, as TRL reads a ``None``:
        left out of the group baseline) and counted for the ``nonfinite_reward`` health rule
        (``rewards/<name>/nonfinite_share``). TRL alone would zero the whole group's advantages and
        log ``reward: inf``. With the rule 'off', TRL's values as they are."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._nonfinite_reward_action == "off":
            return rewards_per_func
        shares, found = health.nonfinite_rewards(rewards_per_func, self.reward_func_names)
        self._record_metrics(shares)
        if self.model.training:
            self.step_findings.nonfinite_rewards.extend(found)
        return rewards_per_func.masked_fill(torch.isinf(rewards_per_func), float("nan"))  # [B_global, K]

    def _group_size(self) -> int:
        """The completions per prompt TRL groups the current mode's batch by (its advantages' mean and std):
        ``num_generations`` in training, ``num_generations_eval`` (``num_generations`` where unset) in evaluation."""
        return self.num_generations if self.model.training else self.num_generations_eval

    def _merges_batch_statistics(self) -> bool:
        """Whether dynamic sampling's merged batches need their advantages recomputed over their own rows: TRL's
        use batch statistics (``dynamic_sampling.uses_batch_statistics``), so each round's rows carry the parts."""
        return bool(self.args.dynamic_sampling) and dynamic_sampling.uses_batch_statistics(
            self.args.scale_rewards, self.args.multi_objective_aggregation)

    def _score_round(self, inputs) -> tuple[dict, Generated]:
        """TRL's generate-and-score, rows tagged, health logged (from the rewards TRL scored); also returns what
        the round's ``_generate`` saw."""
        with _intercept.record_rewards(self) as scored, _intercept.skip_stacked_input_grad_hooks(self.model):
            output = super()._generate_and_score_completions(inputs)
        generated = self.hook_record.generated
        output[ROW_KEY] = torch.arange(output["prompt_ids"].size(0), device=output["prompt_ids"].device)
        if self.task_names and isinstance(inputs[0], dict):
            output[TASK_KEY] = torch.tensor([self.task_names.index(str(x[self.args.task_column])) for x in inputs],
                                            device=output["prompt_ids"].device)  # [B]
            _check_groups_single_task(self.accelerator.gather(output[TASK_KEY]), self._group_size(),
                                      self.task_names)
        rewards = health.group_rewards(scored[-1], self.reward_weights)  # [B_global]
        self._log_batch_health(inputs, output, rewards, generated)
        if self._merges_batch_statistics() and self.model.training:  # for a merged batch's advantages
            parts = dynamic_sampling.advantage_parts(scored[-1], self.reward_weights, self.num_generations,
                                                     self.args.multi_objective_aggregation)  # [B_global] each
            start = self.accelerator.process_index * len(inputs)
            output.update({k: v[start:start + len(inputs)] for k, v in zip(dynamic_sampling.ADVANTAGE_PARTS, parts)})
        return output, generated

    def _log_batch_health(self, inputs: list, output: dict, rewards: torch.Tensor, generated: Generated) -> None:
        """Stop tokens in prompts and completions, chat-header starts, zero rewards (``health.stop_rows``,
        ``health.batch_metrics``), the share of groups whose rewards are all equal (``health.flat_group_share``),
        per-task lengths and rewards when rows have a ``task``; keeps a training batch for ``boundary_report()``."""
        lengths = generated.completion_lengths  # [B]
        per_row, stop_mask, stops = health.stop_rows(_intercept.read_tokenizer(self), output, lengths,
                                                     generated.generated_stops, self.eos_token_ids, self._chat_headers)
        metrics = health.batch_metrics(self.accelerator.gather(per_row), rewards)
        # groups with no policy gradient, whatever scale_rewards (flat_rewards reads it; TRL's frac_reward_zero_std
        # is the whole batch's under scale_rewards='batch')
        metrics["rewards/flat_group_share"] = health.flat_group_share(rewards, self._group_size())
        column = self.args.task_column
        if isinstance(inputs[0], dict) and column in inputs[0]:
            tasks = gather_object([str(x[column]) for x in inputs])
            metrics.update({**health.task_lengths(tasks, self.accelerator.gather(lengths)),  # [B_global]
                            **health.task_rewards(tasks, rewards)})
        self._record_metrics(metrics)
        if not self.model.training:
            return  # boundary_report() shows what training sampled
        start = self.accelerator.process_index * len(inputs)
        self.hook_record.last_batch = {"prompt_ids": output["prompt_ids"], "prompt_mask": output["prompt_mask"],
                            "completion_ids": output["completion_ids"], "lengths": lengths,
                            "stop_mask": stop_mask, "generated_stops": stops,
                            "rewards": rewards[start:start + len(inputs)]}

    def boundary_report(self, n: int = 4) -> str:
        """The last generation batch by eye: prompt tail and completion head with
        special tokens shown, ids around the boundary, stop-token counts. Printed after the
        first ``health_report_steps`` steps; call it any time."""
        if self.hook_record.last_batch is None:
            return "grpotrl boundary report: no generation batch yet"
        return boundary.batch_boundary_report(_intercept.read_tokenizer(self), self.hook_record.last_batch, self.eos_token_ids,
                                              self._chat_headers, n)

    def _log_loss_health(self, loss: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor,
                         task: torch.Tensor | None = None) -> None:
        """Per-sample entropy (min, p10, mean of the per-sample means), per task when rows carry
        one (``task`` [B] indexes ``task_names``), and the microbatch's loss tokens over every process
        (``entropy/loss_tokens``: the count TRL's ``entropy`` of this microbatch divides by, which the
        entropy_collapse rule weights it by); the loss for NonFiniteRule."""
        rows = torch.stack([health.per_sample_mean(entropies.detach().float(), mask), mask.sum(-1).float()], -1)
        rows = self.accelerator.gather(rows)  # [B_global, 2]: per-sample entropy, loss tokens
        per_sample = rows[:, 0]  # [B_global]
        summary = torch.cat([health.sample_summary(per_sample), rows[:, 1].sum().reshape(1)]).tolist()  # one sync
        metrics = {**dict(zip(health.SAMPLE_SUMMARY, summary)), "entropy/loss_tokens": summary[-1]}
        if task is not None:
            tasks = [self.task_names[i] for i in self.accelerator.gather(task).tolist()]
            metrics.update(health.task_means(tasks, per_sample, "entropy"))
        self._record_metrics(metrics)
        if self.step_findings.losses is not None and self.model.training:
            self.step_findings.losses.append(loss.detach())

    def _log_logit_signals(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        """logits/max, top1_top2_gap, top1_prob, top5_mass: token means over the completion mask."""
        totals = self.accelerator.gather(health.logit_signal_sums(logits, mask, self.temperature))  # [world*K, 2]
        self._record_metrics(health.means_of_sums(health.LOGIT_SIGNALS,
                                          totals.view(-1, len(health.LOGIT_SIGNALS), 2).sum(0)))

    def _logit_signals_due(self) -> bool:
        n = self.args.health_logit_steps
        return n > 0 and self.model.training and self.state.global_step % n == 0

    def _apply_importance_sampling(self, output: dict) -> None:
        """TRL's truncated IS correction on the transformers path (``identity.correct_advantages``),
        with the old policy's logprobs computed here where TRL did not."""
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)  # [B, P+C]
        attn = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)  # [B, P+C]
        if "old_per_token_logps" not in output:
            with torch.no_grad():
                output["old_per_token_logps"] = self._get_per_token_logps_and_entropies(
                    self.model, ids, attn, output["completion_ids"].size(1),
                    batch_size=self.args.per_device_train_batch_size)[0]
        ratio = identity.correct_advantages(output, self.args)  # [B, C] or [B, 1]
        self._record_metrics({"sampling/importance_sampling_ratio/mean": self.accelerator.gather(ratio.mean()).mean().item()})

    # ------------------------------------------------------------------ loss (I1, I3, I4, I5, I10)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, pixel_values=None,
                                           image_grid_thw=None, num_images=None, pixel_attention_mask=None,
                                           spatial_shapes=None, num_tiles=None, image_sizes=None, token_type_ids=None,
                                           mm_token_type_ids=None, image_position_ids=None):
        """TRL's logprob forward (the policy's with its backward, the old policy's, the reference's); with
        ``padding_free`` on and a text-only call without a router loss, on packed rows without padding
        (``padding_free.packed_logps_and_entropies``), returned in TRL's layout.

        Args:
            model: the policy or the reference model. input_ids, attention_mask: [B, P + C], left-padded prompts
                and right-padded completions. logits_to_keep: C. batch_size: at most this many rows per forward.
            compute_entropy, compute_aux_loss, and the image inputs: as TRL's.

        Returns:
            logps_and_entropies (tuple): ``(logps [B, C], entropies [B, C] or None, aux_loss or None)``: each completion token's
            ``log_softmax(logits / T)`` and entropy, 0 where nothing is scored, as TRL's.
        """
        multimodal = (pixel_values, image_grid_thw, num_images, pixel_attention_mask, spatial_shapes, num_tiles,
                      image_sizes, token_type_ids, mm_token_type_ids, image_position_ids)
        if not self.padding_free or compute_aux_loss or any(x is not None for x in multimodal):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                pixel_values, image_grid_thw, num_images, pixel_attention_mask, spatial_shapes, num_tiles,
                image_sizes, token_type_ids, mm_token_type_ids, image_position_ids)
        pad = _intercept.read_tokenizer(self).pad_token_id
        logps, entropies = padding_free.packed_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, self.accelerator.autocast,
            pad_id=pad if pad is not None else 0, share_prompts=self.share_prompts,
            agree_forwards=self._most_forwards if self._sharded_parameters() else None, attention=self.packed_attention)
        return logps, entropies, None

    def _sharded_parameters(self) -> bool:
        """Whether each forward gathers the parameters from every process (ZeRO-3, FSDP), so that every process
        must run as many forwards."""
        plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed_enabled else None
        zero3 = plugin is not None and plugin.zero_stage == 3
        return self.accelerator.num_processes > 1 and (zero3 or self.is_fsdp_enabled)

    def _most_forwards(self, forwards: int) -> int:
        """The largest number of packed forwards any process runs for this call (a collective)."""
        return int(self.accelerator.gather(torch.tensor([forwards], device=self.accelerator.device)).max())

    def _prepare_inputs(self, generation_batch):
        """TRL's: the next microbatch of the buffered generation batch (generating a new batch when due). With
        ``balance_microbatches`` on, a new generation batch's microbatches are regrouped by token count (under
        varlen with shared prompts, by prompt: each forward then runs its prompts once), each optimizer step's
        window on its own (``padding_free.balanced``): the same rows per optimizer step and per microbatch count,
        so the step's loss is the same sum.

        Args:
            generation_batch: the dataloader's rows for one generation batch (TRL's argument).

        Returns:
            inputs (dict): the microbatch the loss takes (``_compute_loss``'s ``inputs``).
        """
        before = _intercept.read_buffered_inputs(self)
        inputs = super()._prepare_inputs(generation_batch)
        buffer = _intercept.read_buffered_inputs(self)
        if not (self.balance_microbatches and self.model.training) or buffer is before:
            return inputs  # eval, or a microstep that reuses the buffered generation batch
        window = self.args.gradient_accumulation_steps  # one optimizer step's microbatches
        by_prompt = self.share_prompts and self.packed_attention == "varlen"  # a forward's rows share each prompt
        regrouped = padding_free.balanced(buffer, window, self.share_prompts, by_prompt)
        return _intercept.set_buffered_inputs(self, regrouped)

    def _compute_loss(self, model, inputs):
        """TRL's loss on one microbatch with grpotrl's KL term (``KLFields``) in place of TRL's, and the loss-side
        guards on it (``_check_loss``).

        TRL's own in-loss KL (an unclamped k3) is left out by running TRL's loss with ``beta`` 0, and ``beta *
        losses.kl_loss_term`` reduced as TRL reduces for ``loss_type`` is added (``_kl_loss``); with
        ``kl_estimator='full'`` the loss forward runs padded and its backbone's hidden states are recorded.

        Args:
            model: the (wrapped) policy.
            inputs: one microbatch of ``_generate_and_score_completions``' dict: ``prompt_ids`` / ``prompt_mask``
                [B, P], ``completion_ids`` / ``completion_mask`` [B, C], ``advantages`` [B], ``grpotrl_row`` [B],
                and TRL's optional ``old_per_token_logps``, ``ref_per_token_logps``, ``sampling_per_token_logps``
                [B, C].

        Returns:
            loss (torch.Tensor): the scalar loss to backpropagate. Writes ``hook_record.loss`` (the entropies,
            the loss mask and the entropy bonus's tokens TRL's loss used) for ``compute_loss``'s I7 check.

        Raises:
            InvariantError: a guard found the microbatch or its logprobs wrong (I1, I3, I4, I5, I7, I10, I11). Each
                runs in ``caught()``: within ``compute_loss``'s section (TRL's ``compute_loss`` is its only caller)
                under DDP a rank whose check failed runs on through the same collectives as the others, and every
                rank raises at that section's end (``_guards_agree_now``), naming the rank(s) it failed on; outside
                one, or in one process, the check raises where it failed.
        """
        record = self.hook_record.batch("train" if self.model.training else "eval")
        guard = record.guard if self._guard_now() and ROW_KEY in inputs else None
        if guard is not None:  # I1, I3, I4 on the microbatch the loss uses, before any compute
            with caught():
                guards.check_loss_inputs(_intercept.read_tokenizer(self), guard, inputs, inputs[ROW_KEY].tolist(),
                                         self.eos_token_ids, self._completion_cap(), self.mask_truncated_completions)
        recomputed = self._recompute_reference(model, inputs, guarded=guard is not None)
        full_kl = self._kl_in_loss and self.args.kl_estimator == "full"
        capture = _intercept.record_backbone_output(self.accelerator.unwrap_model(model)) if full_kl \
            else contextlib.nullcontext([])
        # 'full' rebuilds logits from the loss forward's hidden states in the padded layout: that forward runs
        # padded (padding_free's 'auto' is off for it at init; this covers a config changed afterwards)
        padded = _intercept.inject_attr(self, "padding_free", False) if full_kl else contextlib.nullcontext()
        with _intercept.record_loss_forward(self) as calls, _intercept.inject_attr(self, "beta", 0.0), \
                _intercept.record_entropy_mask(self) as entropy_masks, capture as hidden, padded:
            loss = super()._compute_loss(model, inputs)
        used, entropies = calls[0][0], calls[0][1]  # [B, C] the policy logprobs and entropies the loss used
        loss_mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)  # [B, C]
        bonus_mask = loss_mask * entropy_masks[0] if entropy_masks else loss_mask  # [B, C]: TRL's effective mask
        if guard is not None and self.model.training:  # I11 on TRL's policy loss (grpotrl's KL is not added yet)
            with caught():
                self._check_denominator(loss, used, inputs, loss_mask)
        if self._kl_in_loss:
            loss = loss + self._kl_loss(model, inputs, used, loss_mask, hidden[0] if full_kl else None)
        self.hook_record.loss = LossTerms(entropies, loss_mask, bonus_mask)
        self._check_loss(model, inputs, loss, used, entropies, loss_mask, recomputed)
        return loss

    def _recompute_reference(self, model, inputs: dict, guarded: bool) -> guards.Recomputed | None:
        """On guard steps (``guarded``) and logit-signal steps, one independent padded no-grad forward of the
        microbatch (``guards.recompute_logprobs``), run before the loss's forward: it logs the logit signals and,
        on guard steps, returns what I5 and I7 compare the loss with (``guards.Recomputed``, [B, C] values), so
        that its [B, C, V] logits are freed before the loss's autograd graph exists (read next to that graph,
        they raised a guard step's peak memory over a later step's). None where nothing is compared: not due,
        or dropout is active (the loss's forward then samples masks: no deterministic reference exists)."""
        if not (guarded or self._logit_signals_due()):
            return None
        completion_ids, cmask = inputs["completion_ids"], inputs["completion_mask"]  # [B, C]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)  # [B, P+C]
        attention_mask = torch.cat([inputs["prompt_mask"], cmask], dim=1)  # [B, P+C]
        unwrapped = self.accelerator.unwrap_model(model)
        with self._reference_attention(unwrapped):
            reference, scale, logits = guards.recompute_logprobs(unwrapped, input_ids, attention_mask,
                                                                 completion_ids.size(1), self.temperature,
                                                                 return_logits=True)
        self._log_logit_signals(logits, cmask * inputs.get("tool_mask", 1))
        if not guarded or guards.skipped_for_dropout(model, "I5 (and the I7 entropy values) are", self._warned):
            return None
        with torch.no_grad():
            slope = temperature_slope(logits, completion_ids, self.temperature) \
                if self.guard_tolerances.low_precision else None  # [B, C]
            entropies = entropy_from_logits(logits, self.temperature) \
                if _intercept.read_entropy_bonus(self).enabled else None  # [B, C]: the node I7's sign check uses
        return guards.Recomputed(reference, scale, slope, entropies)

    def _identity_step(self) -> int:
        """The step whose first microbatch with a loss token I10 checks: the policy's first update, step 0, where
        the reference and the old policy are still the policy."""
        return 0

    def _check_loss(self, model, inputs: dict, loss: torch.Tensor, used: torch.Tensor, entropies: torch.Tensor | None,
                    loss_mask: torch.Tensor, recomputed: guards.Recomputed | None) -> None:
        """The checks and signals of the loss a microbatch is about to backpropagate, in order: I10 on the first
        microbatch of step 0 (``_identity_step``: the reference's and old policy's logprobs equal ``used``); the sampler/trainer gap
        where the sampler's logprobs exist; the per-sample entropy and the loss for the health rules; and, on
        guard steps, what ``_recompute_reference`` read (``recomputed``) against the loss: I5 (``used`` [B, C] is
        ``log_softmax(logits / T)`` at generate's positions, in the run's precision: ``guard_tolerances``) and
        I7's entropy values (``entropies`` [B, C] are the policy's)."""
        if self.hook_record.identity_due and self.model.training:
            self.hook_record.identity_due = False
            if self.state.global_step == self._identity_step():
                with caught():
                    self._check_step0_identity(model, used, inputs, loss_mask)
                # a microbatch with no loss token compares nothing: the next one of that step is checked
                self.hook_record.identity_due = self.hook_record.identity_unchecked = not bool(loss_mask.any())
            elif self.hook_record.identity_unchecked:
                logger.warning("grpotrl guard I10 was not checked: no microbatch of step %d held a loss token.",
                               self._identity_step())
        if "sampling_per_token_logps" in inputs:
            self._log_sampler_gap(used, inputs)
        if entropies is not None:
            self._log_loss_health(loss, entropies, loss_mask, inputs.get(TASK_KEY))
        if recomputed is None:
            return
        completion_ids = inputs["completion_ids"]  # [B, C]
        with caught():
            metrics = guards.check_logprobs_in_precision(_intercept.read_tokenizer(self), used, recomputed.logprobs,
                                                         recomputed.slope, recomputed.scale, inputs["completion_mask"],
                                                         completion_ids, self.temperature, self.guard_tolerances,
                                                         inputs[ROW_KEY].tolist(),
                                                         packed=self.padding_free and self.packed_attention)
            self._record_metrics(metrics)  # an evaluation's I5 with the evaluation's metrics
        if entropies is not None and recomputed.entropies is not None:
            with caught():
                guards.check_entropy_values(entropies, recomputed.entropies, loss_mask, self.guard_tolerances)

    def _reference_attention(self, model) -> contextlib.AbstractContextManager:
        """The attention of I5's padded recompute of ``model``: its own (sdpa), or where torch's varlen kernel runs
        the packed forwards (``kernel_reference``) that kernel over each padded row's kept tokens
        (``packed_attention.padded``), so that the recompute rounds as the loss's forward does and I5's bf16
        bounds measure the layout, not two kernels' rounding. The model is switched to that attention already
        (``training_step``, ``prediction_step``); where it is not, no layer runs it and ``padded`` stops with I5."""
        return packed_attention.padded(model) if self.kernel_reference else contextlib.nullcontext()

    def _check_step0_identity(self, model, used: torch.Tensor, inputs: dict, loss_mask: torch.Tensor) -> None:
        """I10: the reference's and the old policy's logprobs on this (first, step-0) microbatch are
        the loss's own (``identity.check_step0_logprobs``). Logged as identity/step0_{ref,old}_logp_gap/*."""
        if guards.skipped_for_dropout(model, "I10 (step-0 identity of reference and old policy) is",
                                      self._warned):
            return
        rows = inputs[ROW_KEY].tolist() if ROW_KEY in inputs else list(range(used.size(0)))
        ref = self.accelerator.unwrap_model(self.ref_model) if self.ref_model is not None else None
        self._record_metrics(identity.check_step0_logprobs(_intercept.read_tokenizer(self), used, inputs, loss_mask, rows,
                                                   self.guard_tolerances, self.accelerator.unwrap_model(model), ref),
                     "train")

    def _log_sampler_gap(self, used: torch.Tensor, inputs: dict) -> None:
        """The sampler against the trainer on the loss's tokens (``ops.importance.sampler_gap_local``): the raw,
        untruncated importance ratio per token and per sequence (TRL logs only the truncated one),
        |sampler - trainer| logprob (TRL logs it for vLLM only), and the gate
        ``sampler_gap_threshold`` / ``sampler_gap_action`` on its mean. Where the recorder measured them
        (the transformers path; not with dynamic sampling, whose rows mix generation rounds), the gap's
        causes on the same tokens (``importance.sampler_causes_local``), logged as ``sampling/causes/*``
        and named by the gate. Every mean is over all processes' loss tokens, each process weighted by its
        token count (a process without one counts for nothing); a value measured on no token is not logged,
        and the gate is told how many loss tokens there were (``identity.gate_sampler_gap``)."""
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)  # [B, C]
        old = inputs.get("old_per_token_logps")  # what TRL's IS ratio uses, when computed
        trainer = used.detach() if old is None else old  # [B, C]
        sampler = inputs["sampling_per_token_logps"]  # [B, C]
        local = importance.sampler_gap_local(used, trainer, sampler, mask)  # [2 * len(GAP_COLUMNS)]
        measured = self.hook_record.batch("train" if self.model.training else "eval").sampler
        if measured is not None and ROW_KEY in inputs:
            rows, C = inputs[ROW_KEY], mask.size(1)
            raw, log_mass = (_fit_columns(measured[k].to(used.device)[rows], C) for k in ("raw", "log_kept_mass"))
            untruncated = sampler if self.args.truncated_sampling_correction else sampler + log_mass  # [B, C]
            causes = importance.sampler_causes_local(used, old, untruncated, raw, log_mass, mask)  # [2 * len(CAUSES)]
        else:  # not measured: every cause over 0 tokens
            causes = used.new_zeros((2 * len(importance.CAUSES),), dtype=torch.float32)
        # one host sync for both summaries (their own .cpu() is then a no-op)
        world = self.accelerator.gather(torch.cat([local, causes])).view(-1, local.numel() + causes.numel()).cpu()
        metrics, loss_tokens = importance.sampler_gap_metrics(world[:, :local.numel()])
        found = importance.sampler_causes_metrics(world[:, local.numel():])
        self._record_metrics({**metrics, **{f"sampling/causes/{k}": v for k, v in found.items()}})
        if measured is not None:
            found.update(sampler_temperature=measured["temperature"], processors=measured["processors"],
                         own_processors=measured["own_processors"], truncation=measured["truncation"],
                         corrected=bool(self.args.truncated_sampling_correction),
                         dtype=str(next((p.dtype for p in self.model.parameters() if p.is_floating_point()), "?")))
        identity.gate_sampler_gap(self.args, metrics.get("sampling/sampler_trainer_logp_gap/mean", float("nan")),
                                  loss_tokens, self.state.global_step, self.temperature, self._warned, found,
                                  "train" if self.model.training else "eval",
                                  int(metrics.get("sampling/sampler_trainer_logp_gap/unmeasured_tokens", 0)))

    # ------------------------------------------------------------------ the loss's own denominator (I11)

    def _check_denominator(self, loss: torch.Tensor, used: torch.Tensor, inputs: dict, mask: torch.Tensor) -> None:
        """I11: the weight TRL's policy loss gives each loss token, read as ``d loss / d used`` (one backward
        through the loss's elementwise ops), equals ``1 / guards.denominator.expected_normaliser`` computed
        from ``mask`` [B, C], the accumulation window's real microbatch count (TRL's and the Trainer's
        ``current_gradient_accumulation_steps``: ``gradient_accumulation_steps``, fewer on an epoch's last, partial
        window), the world size and the generation batch's token count (``_generate_and_score_completions``).
        Tokens whose weight cannot be read (advantage 0, a clipped ratio, a token masked by TRL's entropy or
        off-policy masks) are counted in ``guards/denominator_checked_share``; a step where none can be read warns
        once."""
        if not used.requires_grad:
            return
        args = self.args
        (grad,) = torch.autograd.grad(loss, used, retain_graph=True, allow_unused=True)
        grad = torch.zeros_like(used) if grad is None else grad  # [B, C]
        old = inputs.get("old_per_token_logps")
        log_ratio = (used - old if old is not None else torch.zeros_like(used)).detach().float()  # [B, C]
        slope = denominator.token_slope(
            self.loss_type, inputs["advantages"].float(), log_ratio, mask.float(),
            sequence_level=self.importance_sampling_level == "sequence", epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high, delta=args.delta, sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg)  # [B, C]
        folds = named(self.loss_type).folds_sampler_ratio
        if self.use_vllm and self.vllm_importance_sampling_correction and not folds:
            slope = slope * inputs["importance_sampling_ratio"]  # TRL multiplies the per-token loss by it
        if folds and inputs.get("importance_sampling_ratio") is not None:
            slope = torch.full_like(slope, torch.nan)  # inside the sequence weight: phi != 1, not readable
        if self.top_entropy_quantile < 1.0 or self.off_policy_mask_threshold is not None:
            slope = torch.where(grad == 0, torch.nan, slope)  # a token TRL masked out carries no weight to read
        expected = denominator.expected_normaliser(
            self.loss_type, mask, max_completion_length=self.max_completion_length,
            accumulation=self.current_gradient_accumulation_steps,
            window_tokens=self.hook_record.batch("train").window_tokens,
            num_processes=self.accelerator.num_processes, steps_per_generation=args.steps_per_generation)  # [B]
        metrics = denominator.check_denominator(self.loss_type, grad.float(), slope, expected, mask,
                                                rtol=self.guard_tolerances.denominator_rtol,
                                                tiny=1024 * torch.finfo(used.dtype).tiny)
        if not metrics["guards/denominator_checked_share"] and "denominator" not in self._warned:
            self._warned.add("denominator")
            logger.warning("grpotrl guard I11: no token of this microbatch carried a readable weight (advantages 0, "
                           "ratios clipped or masked), so the loss's normaliser (loss_type=%r) was not checked here.",
                           self.loss_type)
        self._record_metrics(metrics, "train")

    # ------------------------------------------------------------------ the entropy bonus's sign (I7)

    def entropy_coef_in_force(self) -> float:
        """The ``c`` of ``- c * H`` that TRL's loss applies now: ``entropy_coef``, gated by the
        adaptive controller's previous-step entropy when ``use_adaptive_entropy``."""
        bonus = _intercept.read_entropy_bonus(self)
        if not bonus.enabled:
            return 0.0
        if self.use_adaptive_entropy and bonus.last_world_entropy > self.args.entropy_target:
            return 0.0
        return float(self.entropy_coef)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's (which calls ``_compute_loss``), then I7 on the loss about to be backpropagated: ``d loss / d H``
        along the entropies the loss used (``hook_record.loss``) is ``-c``, the coefficient in force before the
        adaptive controller updated it; 0 on a microbatch where the bonus acts on no token (``_check_entropy_sign``).

        Returns:
            loss (torch.Tensor): the loss, as TRL's.

        Raises:
            InvariantError: the entropy bonus enters with another sign or weight (I7), or a guard of
                ``_compute_loss`` failed; under DDP, where ``_guards_agree_now``, on every rank, naming the rank(s) it
                failed on.
        """
        coef = self.entropy_coef_in_force()  # before the adaptive controller updates it in the loss
        with decided_together(self._guards_agree_now(), self.accelerator.device):  # _compute_loss's guards join it
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            terms = self.hook_record.loss
            if self.model.training and terms is not None and terms.entropies is not None:
                with caught():
                    self._check_entropy_sign(loss, terms, coef, "the GRPO loss")
        return loss

    def _guards_agree_now(self) -> bool:
        """Whether this microbatch's loss-side guards are decided on every rank at one point, the end of
        ``compute_loss`` (``guards.ranks.decided_together``: under DDP one all_gather of a flag, none in one process):
        on guard steps (I1, I3, I4, I5, I7's entropy values, I11; I10, whose step, ``_identity_step``, is one) and, in
        training with an entropy bonus configured, on every microbatch (I7's sign). It reads only what every rank
        holds alike (the config, the step, train or eval), never the microbatch, so that every rank reaches the
        agreement equally often. Elsewhere a failing guard raises on its own rank (I7's sign without a bonus)."""
        return self._guard_now() or (self.model.training and _intercept.read_entropy_bonus(self).enabled)

    def training_step(self, model, inputs, num_items_in_batch):
        """TRL's, with TRL's fused LM head on CPU in tiles of 512 tokens x 4096 vocabulary columns
        (``_intercept.inject_head_tiles``): its CPU fallback makes about ten passes over tile-sized fp32
        temporaries, at TRL's sizes the step's largest transient. The same values per token within fp32
        rounding; elsewhere TRL's tiles. Under ``packed_attention='varlen'`` the policy runs grpotrl's varlen
        attention for the whole step (``packed_attention.running``), its backward included: a layer that gradient
        checkpointing recomputes there sees the sequence boundaries it was first called with (a forward without
        boundaries runs sdpa, as before)."""
        with _intercept.inject_head_tiles(self.accelerator.device), self._policy_attention(model):
            return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys: list[str] | None = None):
        """TRL's, with the LM head's CPU tiles and the policy's attention as in ``training_step``."""
        with _intercept.inject_head_tiles(self.accelerator.device), self._policy_attention(model):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def _policy_attention(self, model):
        """``packed_attention.running(model)`` under ``packed_attention='varlen'``, else nothing."""
        return packed_attention.running(model) if self.packed_attention == "varlen" else contextlib.nullcontext()

    def _check_entropy_sign(self, loss: torch.Tensor, terms: LossTerms, coef: float, where: str) -> None:
        """I7 on ``loss`` along ``terms.entropies`` (``guards.check_entropy_sign``); the slope is logged as
        ``entropy/dloss_dH`` (must read ``-entropy_coef``). Where the bonus acts on no token of the microbatch
        (``terms.bonus_mask`` empty: every row truncated under ``mask_truncated_completions``, an all-zero tool
        mask, no token of this process above TRL's top-entropy threshold), TRL's bonus is ``c * 0``: the slope must
        be 0, the sign is not checked there, and with a bonus in force ``guards/entropy_sign_checked_share`` counts
        it (0 for such a microbatch, 1 for a checked one; a warning once), as I11 counts its unreadable tokens."""
        acts = bool(terms.bonus_mask.any())
        slope = guards.check_entropy_sign(loss, terms.entropies, coef, self.current_gradient_accumulation_steps,
                                          where, acts=acts)
        metrics = {"entropy/dloss_dH": slope} if acts else {}
        if coef:
            metrics["guards/entropy_sign_checked_share"] = float(acts)
            if not acts and "entropy_sign" not in self._warned:
                self._warned.add("entropy_sign")
                logger.warning("grpotrl guard I7: the entropy bonus (c=%g) acts on no token of this microbatch (every "
                               "loss token masked: truncated completions, tool results, or TRL's top-entropy mask), so "
                               "%s was checked to carry no entropy gradient, and its sign was not checked here.",
                               coef, where)
        self._record_metrics(metrics, "train")

    # ------------------------------------------------------------------ checkpoints (I2)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """TRL's, then the chat-template fingerprint (``grpotrl_template.json``) beside the weights, which I2 checks
        when the checkpoint is trained on. A full disk is a ``DiskFullError`` naming the file."""
        with self.disk_full_named(output_dir or self.args.output_dir, "the model", _internal_call):
            super().save_model(output_dir, _internal_call)
            if self.args.should_save:
                self._save_fingerprint(output_dir or self.args.output_dir)

    def _save_fingerprint(self, output_dir: str) -> None:
        """The fingerprint of the saved tokenizer's template, the one this run rendered its prompts with where that
        differs (TRL's prefix-preserving variant for tools: ``trained_template``), its ``chat_template_kwargs`` and
        tool sets (``_common.CheckedResume._push_from_checkpoint`` calls it too)."""
        templates.save_fingerprint(output_dir, _intercept.read_tokenizer(self), trained_template=self.chat_template,
                                   chat_template_kwargs=[self.chat_template_kwargs or {}],
                                   tools=templates.tool_schema_sets(_intercept.read_tool_sets(self)))


def _check_groups_single_task(task: torch.Tensor, group_size: int, names: list[str]) -> None:
    """Group normalisation (mean and std over each prompt's G completions) must never mix tasks:
    every group of G consecutive gathered rows carries one task label. ``group_size``: the G TRL groups this
    batch by (``num_generations`` in training, ``num_generations_eval`` in evaluation)."""
    if task.numel() % group_size:
        raise InvariantError("multi-task", f"the generation batch has {task.numel()} rows over every process, not "
                             f"a whole number of groups of {group_size} completions per prompt, so its groups cannot "
                             "be checked for one task each. Make the global batch size (per_device_train_batch_size, "
                             "or per_device_eval_batch_size in evaluation, x processes) a multiple of num_generations "
                             "(num_generations_eval in evaluation).")
    groups = task.view(-1, group_size)  # [B_global / G, G]
    mixed = (groups != groups[:, :1]).any(-1)  # [B_global / G]
    if mixed.any():
        g = int(mixed.nonzero()[0])
        raise InvariantError("multi-task", f"generation group {g} mixes tasks {[names[i] for i in groups[g].tolist()]}"
                             f" (groups of {group_size} completions): its advantages would normalise one task's "
                             "rewards by another's. Each prompt's completions must come from one row (TRL's "
                             "RepeatSampler does this).")


def _fit_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` [B, C'] cut or NaN-padded to ``width`` columns (the recorder's C' and the batch's C differ
    when the generation batch was padded differently)."""
    if x.size(1) >= width:
        return x[:, :width]
    return torch.cat([x, x.new_full((x.size(0), width - x.size(1)), float("nan"))], dim=1)
