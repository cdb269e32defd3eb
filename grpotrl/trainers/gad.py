"""``grpotrl.GADTrainer``: generative adversarial distillation (Ye et al., arXiv 2511.10643).

The student is trained by GRPO (GSPO's sequence-level ratio by default) on the score of a
discriminator D, a sequence-level reward model trained online to prefer the teacher's response
over the student's: ``-log sigmoid(D(teacher) - D(student))``, the group's teacher response
against each student response. Only the teacher's text is needed (black-box teacher): rows
hold ``prompt`` (chat messages) and ``teacher_response`` (text).

Each generation batch: generate (TRL), score student and teacher responses with D in one
forward with gradient, take the student scores (detached, BEFORE this batch's D update, as
verl's GAD does) as the reward, then step D's own AdamW. D reads the text the student generated,
decoded from its ids with every special token but the closing stop token (TRL's completions drop
them). With ``disable_dropout`` off and a D that holds dropout, the scores come from a separate
eval-mode forward without gradient, so the reward is D's function, not a dropout sample. For the
first ``discriminator_warmup_steps`` optimizer steps the student is not stepped. D reads its score
at the last real token through the same chat template for teacher and student (I9,
``grpotrl/discriminator.py``).

KL to the reference policy (``beta``, ``kl_estimator`` in k1/abs/k2/k3/full, or k1+/k3+/abs+) goes
in the loss (``use_kl_loss``), the reward (``use_kl_in_reward``) or both; GAD computes it itself
(TRL's own in-loss k3 is turned off) so every estimator takes one path, ``losses.kl_loss_term``:
grpotrl.GRPOTrainer's (``KLFields``), which GAD inherits with GSPO's sequence-level ratio.
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

import functools
import logging
import os
import time

import torch

from ..checkpoints import D_DIR, D_WEIGHTS
from ..configs import GADConfig
from ..gad.discriminator import DiscriminatorReward, load_discriminator
from ..errors import InputError
from ..guards import due
from ..models.dropout import disable_dropout
from ..preflight import ADAPTER_LOOKUP, check_gad, split_name, teacher_responses_over_cap
from . import _intercept
from .gad_engine import prepare_discriminator
from .grpo import GRPOTrainer

logger = logging.getLogger(__name__)


class GADTrainer(GRPOTrainer):
    """Generative adversarial distillation on grpotrl.GRPOTrainer (module docstring).

    Overrides (on top of grpotrl.GRPOTrainer's, whose overrides and run-time wraps all apply here;
    everything else is TRL's):
      * ``__init__``: checks ``teacher_response`` before any model loads (the student's PEFT adapter looked up once:
        GRPO's checks take that lookup through the private keyword ``preflight.ADAPTER_LOOKUP``, which never
        reaches TRL); loads D (a student's PEFT adapter merged into its base) and its optimizer after TRL, prepared
        under the student's launch (``gad_engine.py``: DDP by accelerate, or ``deepspeed.initialize`` at the
        student's ZeRO stage; FSDP is refused); sets TRL's ``beta`` to 0 for good (TRL computes no reference
        logprobs; the KL is grpotrl.GRPOTrainer's, ``_kl_loss``).
      * ``_calculate_rewards``: the D step above (``gad_engine``), then grpotrl.GRPOTrainer's rewards with D's
        column served its scores, so they take TRL's and grpotrl's handling of any reward (a non-finite score,
        NaN included, counted and made missing); one column per reward function: ``discriminator`` (and
        ``kl_penalty``, the method ``kl_reward``, with ``use_kl_in_reward``), gathered across processes.
      * ``_generate_and_score_completions``: adds the reference logprobs for the KL loss, which
        grpotrl.GRPOTrainer's ``_compute_loss`` adds (``_kl_loss``). With ``use_bias_correction_kl`` the
        importance ratio is per token, ``exp(logp - old_logp)``, even under ``importance_sampling_level=
        "sequence"`` (GAD's default), where TRL broadcasts the sequence's ratio: that keeps k1's and k3's
        gradient the KL's.
      * ``training_step``: during warmup, runs TRL's ``_prepare_inputs`` (generation, rewards, D's
        update; on CPU with the fused head's tiles of ``GRPOTrainer.training_step``) and TRL's step
        bookkeeping (``_intercept.set_microstep_done``: ``_step``, ``_current_train_step_time``, ``step_time``)
        only; the student gets no grad.
      * ``create_scheduler``: the student's LR schedule starts after discriminator warmup.
      * ``_guard_now`` / ``_identity_step`` (grpotrl.GRPOTrainer's): the guards' ``guard_steps`` count twice, from
        the run's first step (generation, D's I9) and from the student's (the loss-side guards I1/I3/I4, I5, I7,
        I11, which warmup never reaches), and I10 runs on the student's first step (its step 0; warmup left it,
        its reference and its old policy one model).
      * ``save_model`` / ``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler``:
        checkpoints hold D's full weights (``discriminator/model.safetensors``) and its optimizer
        state (``discriminator/optimizer.pt``, or DeepSpeed's sharded ``discriminator/ds/``); resume
        restores both.
      * ``_load_best_model`` (``load_best_model_at_end``): transformers' restores the best checkpoint's student;
        D's weights then come from the same checkpoint, so the model saved after training and its D trained
        together.

    Wraps at run time (``trainers/_intercept.py``): grpotrl.GRPOTrainer's, and in warmup, around
    ``_prepare_inputs``, its CPU head tiles (``inject_head_tiles``).
    TRL's private fields, only through ``trainers/_intercept.py``: ``_tokenizer`` (``read_tokenizer``: D's
    pad id and template), ``_metrics`` (``set_metrics``: D's metrics, ``kl``), and in warmup ``_step``,
    ``_current_train_step_time`` (``set_microstep_done``). Calls TRL's ``_get_per_token_logps_and_entropies``
    for reference logprobs and ``_prepare_inputs`` in warmup (tests/trainers/test_trl_hooks.py pins every private
    TRL name used here).
    """

    _tag_names = ["trl", "grpo", "gad", "grpotrl"]
    _resume_kind = "gad"

    def __init__(self, model, args: GADConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, **kwargs):
        """``grpotrl.GRPOTrainer.__init__`` with the discriminator's reward as the only reward function, after GAD's
        own checks (``preflight.check_gad``: teacher column, discriminator source, settings); then a warning
        where teacher responses are longer than the student can finish (``teacher_responses_over_cap``), and
        the discriminator D is built on the seeded student (``gad_engine``: torch or DeepSpeed), at the
        student's revision where it starts from the student's checkpoint (``discriminator_load_kwargs``); where
        that checkpoint is a PEFT adapter (a LoRA SFT's output), from its base with the adapter merged and the
        student's embedding rows (``gad.discriminator.merged_adapter``): the policy the student starts as.

        Raises:
            InputError: bad input, said before any weights load; FSDP (not supported).
        """
        if args is None:
            args = GADConfig(output_dir="grpotrl-gad-output")
        checked = check_gad(model, args, train_dataset, eval_dataset, kwargs)  # how D loads; then GRPO's checks
        load = checked.discriminator_load
        # GRPO's checks take the student's adapter lookup made for D (or the caller's it took), rather than asking
        # again; none made here: the caller's, if any, goes on as given
        if checked.student_adapter is not None:
            kwargs = {**kwargs, ADAPTER_LOOKUP: checked.student_adapter}

        # The reward functions exist before TRL starts (it names the metric columns after them);
        # D is attached once TRL has set the seed and loaded the student.
        self._d_reward = DiscriminatorReward(None, None, [], batch_size=args.per_device_train_batch_size)
        # GRPOTrainer adds the column kl_penalty (kl_reward) after D's with use_kl_in_reward
        super().__init__(model, [self._d_reward], args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, **kwargs)
        if self.is_fsdp_enabled:
            raise InputError("GADTrainer with FSDP is not supported; use DeepSpeed ZeRO or DDP.")

        # KL (GRPOTrainer's kl_coef, _kl_loss, kl_reward): TRL's beta is 0 from here on (it kept the ref model),
        # so TRL computes no reference logprobs GAD would not use; the loss's are computed below
        self.beta = 0.0

        tok = _intercept.read_tokenizer(self)
        over_cap = teacher_responses_over_cap(train_dataset, tok, args.max_completion_length,
                                              split_name(train_dataset, "train"))
        if over_cap and self.accelerator.is_main_process:  # D would learn length, not the teacher
            logger.warning(over_cap)

        student = self.accelerator.unwrap_model(self.model)
        student = student.get_base_model() if hasattr(student, "get_base_model") else student
        path = args.discriminator_model_name_or_path or getattr(student.config, "_name_or_path", None)
        # fp32 master weights for D under torch/DDP: a bf16 D with a plain AdamW at lr 1e-6 barely moves (an
        # update below bf16's resolution rounds away). Mixed precision still runs its forward in bf16 (accelerate's
        # autocast from prepare_model). DeepSpeed keeps its own fp32 master copy, so D takes the student's dtype.
        d_dtype = student.dtype if self.is_deepspeed_enabled else torch.float32
        rows = student.get_input_embeddings().num_embeddings if load["adapter"] else None  # as the adapter saved them
        disc = load_discriminator(path, tok.pad_token_id, dtype=d_dtype, lora_r=args.discriminator_lora_r,
                                  freeze_embeddings=args.discriminator_freeze_embeddings, embedding_rows=rows, **load)
        if args.disable_dropout:  # its layers and the attention modules' own dropout
            disable_dropout(disc)
        self._d = prepare_discriminator(self, disc, args.discriminator_learning_rate)  # DDP or DeepSpeed
        self.discriminator, self.discriminator_optimizer = self._d.model, self._d.optimizer
        self._d_reward.discriminator = self.discriminator
        self._d_reward.tokenizer = tok
        self._d_reward.stop_ids = list(self.stop_token_ids)
        self._d_reward.chat_template = self.chat_template

    # ------------------------------------------------------------------ discriminator step

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """D's score of each completion (before this batch's update, I9: read at the last real token), and in
        training one D step on teacher against student; then grpotrl.GRPOTrainer's rewards, D's column served
        those scores (``DiscriminatorReward.serving``), so they take the handling of any reward function: TRL's
        (``None`` as NaN, gathered) and grpotrl's (+-inf made missing and counted, the ``nonfinite_reward``
        rule). D has no "no score": a NaN score is a broken D, served as +inf to be counted (its row is
        missing either way); with the rule 'off', as it is. With ``use_kl_in_reward`` TRL calls the
        ``kl_penalty`` column's function.

        Returns:
            rewards (torch.Tensor): [N_global, n_funcs], gathered over processes, as TRL's.
        """
        # D scores the student (before this batch's update, as verl's GAD) and steps
        scores, metrics = self._d.score_and_step(
            self._d_reward, inputs, prompts, completion_ids_list, update=self.model.training,
            check_alone=self._guard_now())  # [N], read from the generated ids, without dropout
        self._record_metrics(metrics)
        if self._nonfinite_reward_action != "off" and torch.isnan(scores).any():
            logger.warning("The discriminator scored %d of %d responses NaN; counted as non-finite rewards "
                           "(nonfinite_reward, shown as inf).", int(torch.isnan(scores).sum()), scores.numel())
            scores = scores.nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))  # [N]
        with self._d_reward.serving(scores):
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

    # ------------------------------------------------------------------ KL to the reference policy

    def _generate_and_score_completions(self, inputs):
        """``grpotrl.GRPOTrainer``'s, plus the reference's logprobs (``ref_per_token_logps`` [B, C]) for GAD's KL
        term in the loss where TRL computed none (beta is injected as 0 for TRL's loss)."""
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

    # ------------------------------------------------------------------ warmup: D only

    def training_step(self, model, inputs, num_items_in_batch):
        """``grpotrl.GRPOTrainer``'s after ``discriminator_warmup_steps``. Before: generation, rewards and D's update
        only (through ``_prepare_inputs``), no loss and no backward, so the optimizer step leaves the student as it
        is; returns a zero loss."""
        if self.state.global_step >= self.args.discriminator_warmup_steps:
            return super().training_step(model, inputs, num_items_in_batch)
        # Generation, rewards and D's update happen in _prepare_inputs; no loss, no backward:
        # no student parameter gets a gradient, so the optimizer step leaves them all as they are.
        start = time.perf_counter()
        model.train()
        with _intercept.inject_head_tiles(self.accelerator.device):  # CPU: the reference forward's head, as in training
            self._prepare_inputs(inputs)
        _intercept.set_microstep_done(self, time.perf_counter() - start)  # TRL's generation schedule counts microsteps
        return torch.zeros((), device=self.args.device)

    def _guard_now(self) -> bool:
        """Guards due on the first ``guard_steps`` steps of the run and on the first ``guard_steps`` of the student's
        own, from step ``discriminator_warmup_steps`` on: the loss, and with it every loss-side guard, exists only
        then (with the default 2 guarded steps and a warmup of 2 or more, none of them would ever run)."""
        step, warmup = self.state.global_step, self.args.discriminator_warmup_steps
        return due(self.args.guard_steps, step) or (step >= warmup and due(self.args.guard_steps, step - warmup))

    def _identity_step(self) -> int:
        """I10 on the student's first step, ``discriminator_warmup_steps``: warmup changed no student weight, so
        there its reference and old policy still are the policy (GRPOTrainer's step 0 has no student loss)."""
        return self.args.discriminator_warmup_steps

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
        """``grpotrl.GRPOTrainer``'s, then D's weights in ``output_dir/discriminator`` (every process: ZeRO-3)."""
        with self.disk_full_named(output_dir or self.args.output_dir, "the model", _internal_call):
            super().save_model(output_dir, _internal_call)
            self._d.save_weights(os.path.join(output_dir or self.args.output_dir, D_DIR))  # every process: ZeRO-3

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """TRL's, then D's optimizer state beside its weights, so a resume continues D too."""
        super()._save_optimizer_and_scheduler(output_dir)
        self._d.save_optimizer(os.path.join(output_dir, D_DIR))

    def _load_optimizer_and_scheduler(self, checkpoint):
        """TRL's, then D's weights and optimizer state from the checkpoint (checked complete before anything
        loaded, ``CheckedResume.train``)."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        # CheckedResume.train has checked D's files (gad_engine.checkpoint_files) before anything loaded
        self._d.load(os.path.join(checkpoint, D_DIR))

    def _load_best_model(self) -> None:
        """Transformers' (the student's weights from ``state.best_model_checkpoint``), then D's weights from the
        same checkpoint (``discriminator/model.safetensors``, every process: under ZeRO-3 a collective), not D's
        last state, which never trained beside that student. Weights only: training is over, and a
        ``save_only_model`` checkpoint holds no D optimizer. Where the file is missing (a multi-node run without
        ``save_on_each_node``, as for transformers' own best model), D keeps its last weights, with a warning."""
        super()._load_best_model()
        if not self._d.load_weights(os.path.join(self.state.best_model_checkpoint, D_DIR)):
            logger.warning("No discriminator weights in the best checkpoint %s (%s): the discriminator keeps its last "
                           "weights, which did not train beside the best model. On several machines, set "
                           "save_on_each_node.", self.state.best_model_checkpoint, os.path.join(D_DIR, D_WEIGHTS))


def _after(delay: int, lr_lambda, step: int) -> float:
    """``lr_lambda`` started ``delay`` steps late (held at its step 0 until then)."""
    return lr_lambda(max(0, step - delay))
