"""``grpotrl.GADTrainer``: generative adversarial distillation (Ye et al., arXiv 2511.10643).

The student is trained by GRPO (GSPO's sequence-level ratio by default) on the score of a
discriminator D, a sequence-level reward model trained online to prefer the teacher's response
over the student's: ``-log sigmoid(D(teacher) - D(student))``, the group's teacher response
against each student response. Only the teacher's text is needed (black-box teacher): rows
hold ``prompt`` (chat messages) and ``teacher_response`` (text).

Each generation batch: generate (TRL), score student and teacher responses with D in one
forward with gradient, take the student scores (detached, BEFORE this batch's D update, as
verl's GAD does) as the reward, then step D's own AdamW. For the first
``discriminator_warmup_steps`` optimizer steps the student is not stepped. D reads its score
at the last real token through the same chat template for teacher and student (I9,
``grpotrl/discriminator.py``).

KL to the reference policy (``beta``, ``kl_estimator`` in k1/abs/k2/k3/full, or k1+/k3+/abs+) goes
in the loss (``use_kl_loss``), the reward (``use_kl_in_reward``) or both; GAD computes it itself
(TRL's own in-loss k3 is turned off) so every estimator takes one path, ``losses.kl_loss_term``.
In the loss, with ``use_bias_correction_kl`` (TRL's default), every estimator but abs has the
gradient of KL(pi || pi_ref) in expectation, on- and off-policy: k1 and k3 through the importance
ratio's score term, as in TRL; k2, full and the ``+`` variants through their own gradient, so the
ratio enters them by its value only (TRL's differentiable ratio on top counted the KL's gradient
twice over). Without it: k2, full, ``+``: the same on-policy; k3: the gradient of KL(pi_ref || pi);
k1: zero, refused. abs's gradient is the L1 distance's, never the KL's (``abs+`` has the KL's).

Costs on top of GRPO: D's forward and backward on B*G + B sequences per generation batch, packed
so that a group's shared prompt runs once (``discriminator.scoring_batch``; bench/bench_gad.py:
1.24x GRPO's step CPU time), and its AdamW step; KL in the reward adds a no-grad policy and
reference forward over the generation batch; ``full`` materialises [B, C, V] logits of both models
per microbatch (the policy's from the loss's own forward, plus one reference forward).

The class docstring lists the hooks it overrides and what it wraps at run time.

Student SFT warmup on teacher responses (the paper's first stage) is a separate run on the
same template (I2): ``grpotrl sft --config recipes/smollm2/sft_gad_warmup.yaml``, then GAD
from its output (``--model_name_or_path outputs/smollm2-sft-gad-warmup``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

import torch
from trl.trainer.utils import use_adapter

from ..chat import templates
from ..configs import GADConfig
from ..gad.discriminator import DiscriminatorReward, load_discriminator, pad_sequences
from ..errors import InputError, InvariantError
from ..ops.losses import kl_full, kl_loss_term, kl_penalty
from ..ops.masking import position_ids_from_mask
from ..ops.reduction import aggregate_like_trl
from ..preflight import check_gad
from . import _intercept
from .gad_engine import D_DIR, prepare_discriminator
from .grpo import GRPOTrainer


class GADTrainer(GRPOTrainer):
    """Generative adversarial distillation on grpotrl.GRPOTrainer (module docstring).

    Overrides (on top of grpotrl.GRPOTrainer's, whose overrides and run-time wraps all apply here;
    everything else is TRL's):
      * ``__init__``: checks ``teacher_response`` before any model loads; loads D and its optimizer
        after TRL, prepared under the student's launch (``gad_engine.py``: DDP by accelerate, or
        ``deepspeed.initialize`` at the student's ZeRO stage; FSDP is refused); sets TRL's ``beta``
        to 0 (the KL is GAD's own).
      * ``_calculate_rewards``: the D step above (``gad_engine``); returns rewards gathered across
        processes, one column per reward function: ``discriminator`` (and ``kl_penalty``, the method
        ``kl_reward``, with ``use_kl_in_reward``).
      * ``_generate_and_score_completions``: adds the reference logprobs for the KL loss.
      * ``_compute_loss``: adds ``beta * losses.kl_loss_term`` on the logprobs the policy loss really
        used, reduced as TRL reduces its per-token loss for ``loss_type`` (``ops.reduction.aggregate_like_trl``,
        restated from TRL 1.16). With ``use_bias_correction_kl`` the importance ratio is per token,
        ``exp(logp - old_logp)``, even under ``importance_sampling_level="sequence"`` (GAD's default),
        where TRL broadcasts the sequence's ratio: that keeps k1's and k3's gradient the KL's.
      * ``training_step``: during warmup, runs TRL's ``_prepare_inputs`` (generation, rewards, D's
        update) and TRL's step bookkeeping (``_intercept.set_microstep_done``: ``_step``,
        ``_current_train_step_time``, ``step_time``) only; the student gets no grad.
      * ``create_scheduler``: the student's LR schedule starts after discriminator warmup.
      * ``save_model`` / ``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler``:
        checkpoints hold D's full weights (``discriminator/model.safetensors``) and its optimizer
        state (``discriminator/optimizer.pt``, or DeepSpeed's sharded ``discriminator/ds/``); resume
        restores both.

    Wraps at run time (``trainers/_intercept.py``), besides grpotrl.GRPOTrainer's:
      * ``self._get_per_token_logps_and_entropies`` in ``_compute_loss`` (``record_loss_forward``): records
        the logprobs the policy loss used (the KL is taken on them, with their graph).
      * with ``kl_estimator='full'``, a forward hook on the policy's backbone in ``_compute_loss``
        (``record_backbone_output``): records its last hidden states, which the LM head turns into the
        logits of the loss's own forward.
    TRL's private fields, only through ``trainers/_intercept.py``: ``_tokenizer`` (``read_tokenizer``: D's
    pad id and template), ``_metrics`` (``set_metrics``: D's metrics, ``kl``), and in warmup ``_step``,
    ``_current_train_step_time`` (``set_microstep_done``). Calls TRL's ``_get_per_token_logps_and_entropies``
    for reference logprobs and ``_prepare_inputs`` in warmup (tests/test_trl_hooks.py pins every private
    TRL name used here).
    """

    _tag_names = ["trl", "grpo", "gad", "grpotrl"]
    _resume_kind = "gad"

    def __init__(self, model, args: GADConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, **kwargs):
        if args is None:
            args = GADConfig(output_dir="grpotrl-gad-output")
        check_gad(model, args, train_dataset, eval_dataset, kwargs)  # then GRPO's (grpotrl/preflight.py)

        # The reward functions exist before TRL starts (it names the metric columns after them);
        # D is attached once TRL has set the seed and loaded the student.
        self._d_reward = DiscriminatorReward(None, None, [], batch_size=args.per_device_train_batch_size)
        kl_column = [_reward_column("kl_penalty", self.kl_reward)] if args.use_kl_in_reward else []
        reward_funcs = [self._d_reward] + kl_column
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, **kwargs)
        if self.is_fsdp_enabled:
            raise InputError("GADTrainer with FSDP is not supported; use DeepSpeed ZeRO or DDP.")

        # KL: computed here for every estimator; TRL's own in-loss k3 is off (it kept the ref model).
        self.kl_coef = args.beta  # in the loss (verl: actor.kl_loss_coef); in the reward (kl_ctrl.kl_coef):
        self.kl_reward_coef = args.beta if args.kl_in_reward_coef is None else args.kl_in_reward_coef
        self.beta = 0.0
        self._kl_in_loss = bool(args.beta and args.use_kl_loss)

        student = self.accelerator.unwrap_model(self.model)
        student = student.get_base_model() if hasattr(student, "get_base_model") else student
        path = args.discriminator_model_name_or_path or getattr(student.config, "_name_or_path", None)
        # fp32 master weights for D under torch/DDP: a bf16 D with a plain AdamW at lr 1e-6 barely moves (an
        # update below bf16's resolution rounds away). Mixed precision still runs its forward in bf16 (accelerate's
        # autocast from prepare_model). DeepSpeed keeps its own fp32 master copy, so D takes the student's dtype.
        d_dtype = student.dtype if self.is_deepspeed_enabled else torch.float32
        tok = _intercept.read_tokenizer(self)
        disc = load_discriminator(path, tok.pad_token_id, dtype=d_dtype,
                                  lora_r=args.discriminator_lora_r,
                                  freeze_embeddings=args.discriminator_freeze_embeddings)
        if args.disable_dropout:
            for module in disc.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
        self._d = prepare_discriminator(self, disc, args.discriminator_learning_rate)  # DDP or DeepSpeed
        self.discriminator, self.discriminator_optimizer = self._d.model, self._d.optimizer
        self._d_reward.discriminator = self.discriminator
        self._d_reward.tokenizer = tok
        self._d_reward.stop_ids = list(self.stop_token_ids)
        self._d_reward.chat_template = self.chat_template

    # ------------------------------------------------------------------ discriminator step

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # D scores the student (before this batch's update, as verl's GAD) and steps in train mode
        scores, metrics = self._d.score_and_step(
            self._d_reward, inputs, prompts, completions, completion_ids_list, update=self.model.training,
            check_alone=self._guard_now() and self.args.disable_dropout)  # [N]
        self._append(metrics)
        columns = [scores]
        if self.args.use_kl_in_reward:
            columns.append(torch.tensor(self.kl_reward(prompts, completions, completion_ids_list),
                                        dtype=torch.float32, device=scores.device))
        return self.accelerator.gather(torch.stack(columns, dim=1))  # [N_global, n_funcs]

    # ------------------------------------------------------------------ KL to the reference policy

    def _ref_context(self):
        """(model, context) computing the reference policy, as TRL does (PEFT: adapter off)."""
        if self.ref_model is not None:
            return self.ref_model, contextlib.nullcontext()
        unwrapped = self.accelerator.unwrap_model(self.model)
        if not hasattr(unwrapped, "peft_config"):
            raise InputError("GAD's KL needs a reference model, but none was created (beta was 0 at start?).")
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
        tok = _intercept.read_tokenizer(self)
        prompt_ids = [templates.prompt_ids(tok, p, self.chat_template, **self.chat_template_kwargs) for p in prompts]
        device = self.accelerator.device
        p_ids, p_mask = pad_sequences(prompt_ids, tok.pad_token_id, side="left", device=device)  # [N, P]
        c_ids, c_mask = pad_sequences([list(c) for c in completion_ids], tok.pad_token_id, device=device)  # [N, C]
        ids, attn = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)  # [N, P+C]
        estimator = self.args.kl_in_reward_estimator or self.args.kl_estimator
        per_token = self._per_token_kl(ids, attn, c_ids.size(1), estimator)  # [N, C]
        return (-self.kl_reward_coef * (per_token * c_mask).sum(-1)).tolist()

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self._kl_in_loss and self.args.kl_estimator != "full":
            ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)  # [B, P+C]
            attn = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)  # [B, P+C]
            ref, ctx = self._ref_context()
            with torch.no_grad(), ctx:
                output["ref_per_token_logps"] = self._get_per_token_logps_and_entropies(
                    ref, ids, attn, output["completion_ids"].size(1), batch_size=self.args.per_device_train_batch_size
                )[0]
        return output

    def _compute_loss(self, model, inputs):
        if not self._kl_in_loss:
            return super()._compute_loss(model, inputs)
        full = self.args.kl_estimator == "full"
        capture = _intercept.record_backbone_output(self.accelerator.unwrap_model(model)) if full \
            else contextlib.nullcontext([])
        with _intercept.record_loss_forward(self) as calls, capture as hidden:
            loss = super()._compute_loss(model, inputs)
        logp = calls[0][0]  # [B, C] the policy logprobs the loss was built from (graph tensor)
        mask = inputs["completion_mask"]  # [B, C] GAD has no tools, hence no tool_mask
        width = mask.size(1)
        logits, ref_logits = self._full_kl_logits(model, inputs, hidden[0], logp, width) if full else (None, None)
        per_token_kl = kl_loss_term(  # [B, C], times the per-token importance ratio with use_bias_correction_kl
            logp, None if full else inputs["ref_per_token_logps"], inputs.get("old_per_token_logps"),
            self.args.kl_estimator, self.args.use_bias_correction_kl,
            logits=logits, ref_logits=ref_logits, temperature=self.temperature)
        training = self.model.training
        loss = loss + self.kl_coef * aggregate_like_trl(
            per_token_kl, mask, self.loss_type, max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"), num_processes=self.accelerator.num_processes,
            gradient_accumulation_steps=self.current_gradient_accumulation_steps if training else 1,  # set in train()
            steps_per_generation=self.args.steps_per_generation, training=training)
        totals = self.accelerator.reduce(torch.stack([(per_token_kl.detach() * mask).sum(), mask.sum().float()]),
                                         reduction="sum")
        self._append({"kl": (totals[0] / totals[1].clamp(min=1.0)).item()}, "train" if training else "eval")
        return loss

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
            if gap > self.args.guard_logprob_atol * max(scale, 1.0) * (100 if self.args.bf16 else 1):
                raise InvariantError("I5", f"kl_estimator='full' rebuilt the policy's logits from the loss's forward, "
                                           f"but their logprobs differ from the loss's by {gap:.2e} nats (logit scale "
                                           f"{scale:.1f}). This model's LM head is not a plain linear layer (logit "
                                           "scaling or soft-capping?); use a sample-based kl_estimator.")
        return logits, ref_logits

    # ------------------------------------------------------------------ warmup: D only

    def training_step(self, model, inputs, num_items_in_batch):
        if self.state.global_step >= self.args.discriminator_warmup_steps:
            return super().training_step(model, inputs, num_items_in_batch)
        # Generation, rewards and D's update happen in _prepare_inputs; no loss, no backward:
        # no student parameter gets a gradient, so the optimizer step leaves them all as they are.
        start = time.perf_counter()
        model.train()
        self._prepare_inputs(inputs)
        _intercept.set_microstep_done(self, time.perf_counter() - start)  # TRL's generation schedule counts microsteps
        return torch.zeros((), device=self.args.device)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The student's LR schedule starts with the student: it spans the steps after discriminator
        warmup (its warmup_ratio / decay over those) and stands at its step 0 during warmup. A
        scheduler the user passed is left as it is."""
        W = self.args.discriminator_warmup_steps
        ours = self.lr_scheduler is None
        scheduler = super().create_scheduler(max(1, num_training_steps - W), optimizer)
        if ours and W:
            if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
                raise InputError(f"lr_scheduler_type={self.args.lr_scheduler_type!r} cannot be held still during "
                                 "discriminator warmup; use a schedule such as linear, cosine or constant.")
            scheduler.lr_lambdas = [functools.partial(_after, W, f) for f in scheduler.lr_lambdas]
        return scheduler

    # ------------------------------------------------------------------ checkpoints

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        with self.disk_full_named(output_dir or self.args.output_dir, "the model", _internal_call):
            super().save_model(output_dir, _internal_call)
            self._d.save_weights(os.path.join(output_dir or self.args.output_dir, D_DIR))  # every process: ZeRO-3

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        self._d.save_optimizer(os.path.join(output_dir, D_DIR))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        # CheckedResume.train has checked D's files (gad_engine.checkpoint_files) before anything loaded
        self._d.load(os.path.join(checkpoint, D_DIR))


def _reward_column(name: str, fn):
    """``fn`` as a reward function TRL logs under ``name`` (``rewards/<name>/mean``)."""
    def column(*args, **kwargs):
        return fn(*args, **kwargs)

    column.__name__ = column.__qualname__ = name
    return column


def _after(delay: int, lr_lambda, step: int) -> float:
    """``lr_lambda`` started ``delay`` steps late (held at its step 0 until then)."""
    return lr_lambda(max(0, step - delay))
