"""``grpotrl.MultiTaskGRPOTrainer``: GRPO over rows of several tasks, optionally with CAGrad
(Liu et al., NeurIPS 2021). What it changes about TRL is listed in the class docstring.

INVARIANT I7 in the CAGrad modes: ``d loss / d H == -c`` on every graph that is backpropagated
(the regulariser in exact mode, the weighted loss in low-memory mode; ``0`` on a microbatch where the
bonus acts on no token, as in ``grpotrl.GRPOTrainer``), ``0`` on each task
term that CAGrad rescales, and on guard steps the task terms add up to the policy loss of the
whole batch (so the regulariser carries no policy loss) and, in exact mode, the update the
combination applies raises H to first order when the bonus acts alone (a flipped sign anywhere
stops training with an ``InvariantError`` naming the term).

Supported: one process or DDP (task gradients are averaged over processes before the Gram
matrix). Not supported: DeepSpeed (any ZeRO stage: its engine owns the gradients) and FSDP;
the Liger loss (it bypasses TRL's ``_compute_loss``, whose forward the task terms reuse).
"""

from __future__ import annotations

import logging
import math
import re
from collections import namedtuple

import torch

from .. import guards
from ..configs import GRPOConfig, complete_grpo_config
from ..errors import InputError, InvariantError
from ..guards.ranks import caught, decided_together, gather_checksums, world_size
from ..health.callbacks import loss_scale
from ..ops.loss_types import named
from ..ops.losses import cagrad_coefficients
from ..ops.masking import masked_mean
from ..ops.reduction import Reduction
from ..ops.task_losses import PolicyLoss, policy_loss_terms, regulariser
from . import _intercept
from .grpo import TASK_KEY, GRPOTrainer
from .records import TaskGradients

logger = logging.getLogger(__name__)


class MultiTaskGRPOTrainer(GRPOTrainer):
    """GRPO over rows labelled by task (``task_column``), optionally with CAGrad (``cagrad``).

    Overrides (everything else is ``grpotrl.GRPOTrainer``'s, hence TRL's):
      * ``__init__``: ``reward_funcs`` may map each task label to its reward functions
        (``grpotrl.rewards.tasks``); a task of the data missing from the mapping, a missing
        column, ``scale_rewards='batch'`` (a std over every task), CAGrad under DeepSpeed/FSDP and CAGrad
        with reentrant activation checkpointing, and ``cagrad_c`` without CAGrad (``preflight.check_tasks``) are
        errors before the model loads. Groups never mix tasks (checked on every batch by
        ``grpotrl.GRPOTrainer``), and metrics come per task.
      * ``compute_loss`` (CAGrad on, training): the loss split into terms, CAGrad's loss (below).
      * ``training_step``: in exact mode, after the window's last backward, adds the CAGrad
        direction to the parameters' ``.grad``.

    Wraps at run time (``trainers/_intercept.py``), besides grpotrl.GRPOTrainer's; each restored when
    the full loss returns, in each CAGrad ``compute_loss``, around its one ``GRPOTrainer._compute_loss`` call:
      * ``self._get_per_token_logps_and_entropies`` (TRL's logprob forward), inject
        (``_intercept.inject_forward_per_task``): its first call (the loss's forward) runs one forward per task's
        rows at the batch's padded width, merged back in row order (``losses.merge_rows``), so that
        a task term's backward walks its own rows' graph only; the pieces are recorded for the task
        terms. Image inputs, and every later call, are TRL's, unchanged. In one process only: under
        DDP the ranks hold different tasks and each DDP forward is a collective, so the loss's
        forward stays one forward of every row there.
      * ``self.get_high_entropy_mask``, record (``_intercept.record_entropy_mask``): TRL's top-entropy
        token mask (``top_entropy_quantile``), which the task terms and the regulariser reuse.

    In each CAGrad ``compute_loss``:
      * ``GRPOTrainer._compute_loss`` is called once, as is (grpotrl's guards, health and
        metrics around TRL's ``_compute_loss``, the adaptive entropy controller included): the
        full loss, the one logged. TRL's loss is not called again.
      * Each task's policy loss ``L_k`` is computed from tensors (``ops.task_losses.policy_loss_terms``):
        TRL's per-token policy loss of the task's rows, from the logprobs of the full loss's forward
        (the task's own piece; an absent task's term is 0), reduced with the microbatch's normaliser
        for ``loss_type`` (every TRL 1.16 type).
      * The regulariser is ``full - sum_k L_k`` (``beta * KL - c * H``, plus an MoE aux loss); on
        guard steps the regulariser is also computed from tensors (``ops.task_losses.regulariser``)
        and ``sum_k L_k`` must equal TRL's policy loss, ``full`` less it (``_check_terms_add_up``,
        I7): a restatement that drifts from TRL's loss stops training.
        CAGrad combines the task terms only:
          - ``exact``: per-task gradients of all trainable parameters (``autograd.grad``, each
            through its own rows), summed over the gradient-accumulation window, combined after
            its last backward and added to ``.grad``, where the Trainer's own backward of the
            regulariser (every row) puts KL and entropy: about two backward passes of the batch
            in all; one when there is no regulariser (``beta = 0``, no entropy bonus: the
            Trainer's backward then carries the last task's gradient);
          - ``low_memory``: CAGrad weights from the per-task gradients of the last transformer
            block's trainable parameters only (K backward passes, each of its own rows, that stop
            at that block; during them TRL's fused LM head nodes have the weight's and bias's
            ``needs_input_grad`` switched off and restored after, ``_intercept.skip_head_weight_grad``,
            so no ``[V, H]`` weight gradient is computed and dropped), then one backward of
            ``sum_k coef_k L_k + regulariser``. The
            approximation: the weights see the conflict between tasks in one block, not the whole
            model, and with gradient accumulation they are computed per microbatch.
        The coefficients are scaled by K, so ``cagrad_c=0`` is exactly the plain summed GRPO
        gradient (the reference averages the task gradients; only the step size differs).
      * Read: TRL's loss settings, in one place (``_trl_loss_fields``: ``loss_type``, ``beta``,
        ``epsilon_low``/``epsilon_high``, ``importance_sampling_level``, ``max_completion_length``,
        ``off_policy_mask_threshold``, ``use_vllm``, ``vllm_importance_sampling_correction``,
        ``aux_loss_enabled``, ``router_aux_loss_coef``, and ``args``' ``delta``, ``sapo_*``, ``vespo_*``,
        ``use_bias_correction_kl``, ``steps_per_generation``); TRL's ``current_gradient_accumulation_steps``,
        ``accelerator`` (``sync_gradients``, ``reduce``, ``num_processes``, ``device``); grpotrl's
        ``entropy_coef_in_force``, ``_check_entropy_sign``, ``_guard_now``, ``hook_record.loss``, ``_record_metrics``
        (CAGrad's metrics onto TRL's, ``_intercept.set_metrics``).
        Under fp16's loss scaler each task's gradient is taken of ``L_k * S`` (S the scaler's scale) and divided by
        S in fp32 (``_gradients``), as the Trainer's backward is scaled: unscaled, a backward through fp16
        activations flushes small gradients to 0. Under bf16 and fp32 it is ``autograd.grad`` of ``L_k``.
        A task present in the microbatch whose loss reaches none of the parameters its gradient is taken on
        (``_check_reached``) stops training: its weight would silently be 0. A loss value that is NaN/inf in the
        forward (a task's ``L_k``, or the regulariser: KL, entropy bonus, aux loss) stops training on that
        microbatch, before any backward, whatever S is and with no scaler (``_check_losses_finite``, naming the
        tasks, the step and that the loss itself is non-finite): a loss scale multiplies the backward only, so
        no scale makes a loss value NaN/inf, and read as the scaler's overflow it would skip every step and halve
        S until S < 1. The values are read once per microbatch (one host read of K + 1 scalars, which on guard
        steps also carries the terms-add-up check's).
        Under DDP these checks decide on every process's values (``_every_rank``: one ``all_gather`` per check, fused
        with its host read; none in a single process): every rank stops at the same point with one error naming the
        failing rank(s), and logs the same ``guards/bonus_alone_checked_share``, rather than one rank raising while
        the others wait in their next collective. The per-task I7 check (a task's loss carries no entropy bonus) and
        the loss's I7 sign join ``grpotrl.GRPOTrainer``'s loss-side guards in its one agreement per microbatch, at
        the end of ``compute_loss`` (``GRPOTrainer._guards_agree_now``): a rank whose check failed runs on through
        the same collectives to it, and every rank stops there. A finite loss whose gradient is NaN/inf stops
        training too (a non-finite Gram entry, ``_check_gram_finite``, naming the tasks and the step), but for fp16's
        loss-scaler overflow (any gradient here, taken at a scale S >= 1): the scaler skips that update and
        halves S, the combination is skipped with it, and ``.grad`` holds an inf for the scaler to find
        (``_combine_window``, ``_low_memory_loss``). (A finite loss with a NaN gradient at S >= 1 reads as that
        overflow as well: the scaler halves S until S < 1, where it stops.)
        Logged: ``tasks/<task>/grad_norm``, ``tasks/<task>/cagrad_coef`` (over the gradients the task has rows in:
        in low-memory mode the microbatches that hold it), ``cagrad/min_cosine``,
        ``cagrad/deviation_from_sum``, ``entropy/bonus_alone_dH_per_lr`` and ``guards/bonus_alone_checked_share`` (exact,
        guard steps with a bonus: the composed update's I7 check, ``_check_composed_update``).
    """

    _tag_names = ["trl", "grpo", "grpotrl", "multi-task"]
    _multitask = True

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, **kwargs):
        """``grpotrl.GRPOTrainer.__init__`` (the same arguments); ``reward_funcs`` may also map each task of
        ``task_column`` to its reward functions, and the preflight checks the tasks (``check_tasks``). Then the
        empty ``TaskGradients`` of exact CAGrad and, for ``cagrad='low_memory'``, the last block's parameters its
        per-task gradients are taken on."""
        args = complete_grpo_config(args if args is not None else GRPOConfig(output_dir="grpotrl-output"))
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, **kwargs)
        self.task_gradients = TaskGradients()  # exact mode: the task gradients of the optimizer step so far
        self._proxy = _last_block_params(self.model) if args.cagrad == "low_memory" else None

    # ------------------------------------------------------------------ the loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """GRPO's loss with CAGrad off or in evaluation. In training with CAGrad on: the loss split into the per-task
        policy losses and the regulariser (``_loss_terms``: a NaN/inf value among them stops training, whatever fp16's
        loss scale), each task's loss checked to hold no entropy bonus (I7: CAGrad rescales it), then exact CAGrad's
        accumulation (``_exact_step``) or low-memory CAGrad's combined loss, whose ``d loss / d H`` is checked to be
        ``-c`` (0 where the bonus acts on no token of the microbatch: ``GRPOTrainer._check_entropy_sign``); the
        composed update is checked to raise the entropy on guard steps. Under DDP the I7 checks here and the guards
        of ``GRPOTrainer._compute_loss`` decide on every rank at its end (``GRPOTrainer._guards_agree_now``).

        Returns:
            loss (torch.Tensor): the loss the Trainer backpropagates for this microbatch.
        """
        if self.args.cagrad == "off" or not self.model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        coef = self.entropy_coef_in_force()
        with decided_together(self._guards_agree_now(), self.accelerator.device):  # _compute_loss's guards join it
            full, task_losses, reg = self._loss_terms(model, inputs, coef)
            present = {k for k, r in _task_rows(inputs, len(self.task_names)).items() if r.numel()}
            entropies = self.hook_record.loss.entropies if self.hook_record.loss is not None else None  # [B, C]
            for k, loss in task_losses.items():  # CAGrad rescales these: the bonus must not hide in them
                if entropies is None or not loss.requires_grad:
                    continue
                for slope in guards.entropy_slopes(loss, [entropies], self.current_gradient_accumulation_steps):
                    with caught():
                        guards.check_slope(slope, 0.0, f"the policy loss of task {self.task_names[k]!r}")
            if self.args.cagrad == "exact":
                loss = self._exact_step(model, task_losses, reg, coef, present)
            else:
                loss = self._low_memory_loss(task_losses, reg, present)
            with caught():
                self._check_entropy_sign(loss, self.hook_record.loss, coef, f"the CAGrad {self.args.cagrad} loss")
        return loss + (full - loss).detach()  # logs the GRPO loss; backpropagates ``loss``

    def _loss_terms(self, model, inputs: dict, coef: float):
        """(full loss, {task: its policy loss}, regulariser); ``coef``, the bonus in force, is for
        subclasses that rebuild a term (notebook 04's regulariser with the sign flipped). The full loss is
        ``GRPOTrainer._compute_loss`` (guards, health, metrics, the adaptive entropy controller),
        its forward run per task (``_intercept.inject_forward_per_task``). A task's term ``L_k`` is computed from that
        forward's logprobs, its own rows' piece (no new forward, no second call of TRL's loss):
        ``ops.task_losses.policy_loss_terms``, TRL's per-token policy loss of the task's rows reduced
        with the microbatch's normaliser. The regulariser is what remains, ``full - sum_k L_k`` =
        ``beta * KL - c * H (+ aux)``. Every task gets a term, present in this microbatch or not
        (an absent task's is 0, attached to the loss's forward).

        The terms' values are read to the host once (``K + 1`` scalars; on guard steps with TRL's policy loss
        restated from tensors, which ``_check_terms_add_up`` compares to their sum, I7), every process's under DDP
        (one all_gather): a NaN/inf among them on any rank stops training on every rank before any backward, naming
        the tasks (or the regulariser), the ranks and the step (``_check_losses_finite``), at any fp16 loss scale: it
        is the loss itself, never the scaler's overflow."""
        rows = _task_rows(inputs, len(self.task_names))  # task -> its rows [n_k]
        split = {k: r for k, r in rows.items() if r.numel()}
        if self.accelerator.num_processes > 1:  # one forward: ranks hold different tasks, and a DDP forward is a
            split = {None: torch.arange(inputs["advantages"].size(0), device=inputs["advantages"].device)}
        with _intercept.inject_forward_per_task(self, split) as forward, \
                _intercept.record_entropy_mask(self) as entropy_masks:
            full = GRPOTrainer._compute_loss(self, model, inputs)
        logps, entropies, aux = forward.merged  # [B, C], [B, C] or None, scalar or None: what TRL's loss used
        own = {k: forward.pieces[k][0] if k in forward.pieces else logps[r] for k, r in rows.items()}  # [n_k, C]
        entropy_mask = entropy_masks[0] if entropy_masks else None  # [B, C]: TRL's own top-entropy mask
        task_losses = self._policy_terms(own, rows, inputs, entropy_mask)
        reg = full - sum(task_losses.values())
        values = [loss.detach().double() for loss in (*task_losses.values(), reg)]
        if self._guard_now():  # TRL's policy loss: its full loss less the regulariser, from the same tensors
            trl_loss = self._trl_loss_fields(inputs)
            with torch.no_grad():
                restated = regulariser(logps, inputs.get("old_per_token_logps"), inputs.get("ref_per_token_logps"),
                                       entropies, _loss_mask(inputs), trl_loss.settings, trl_loss.reduction,
                                       entropy_coef=coef, entropy_mask=entropy_mask, aux_loss=aux,
                                       **trl_loss.regulariser)
                values.append(full.detach().double() - restated.double())
        K = len(task_losses)
        host = _check_losses_finite(torch.stack(values), [self.task_names[k] for k in task_losses],
                                    self.state.global_step + 1, self.args.cagrad)  # [W, K + 1 (+ 1)]: the one read
        for r in range(host.size(0) if host.size(1) > K + 1 else 0):  # every rank's, in one order: one verdict
            _check_terms_add_up(dict(zip(task_losses, host[r, :K])), host[r, K + 1], self.task_names,
                                _on_ranks([r], host.size(0)))
        return full, task_losses, reg

    def _policy_terms(self, logps: dict, rows: dict, inputs: dict, entropy_mask: torch.Tensor | None) -> dict:
        """``{task: L_k}`` from each task's logprobs ``logps[k]`` [n_k, C] (its rows ``rows[k]``) and the
        microbatch's ``inputs``: ``ops.task_losses.policy_loss_terms`` with TRL's settings (``_trl_loss_fields``)."""
        trl_loss = self._trl_loss_fields(inputs)
        return policy_loss_terms(logps, rows, inputs.get("old_per_token_logps"), inputs["advantages"],
                                     _loss_mask(inputs), trl_loss.settings, trl_loss.reduction,
                                     entropy_mask=entropy_mask, **trl_loss.per_token)

    # ------------------------------------------------------------------ TRL's fields (one place)

    def _trl_loss_fields(self, inputs: dict) -> TRLLossFields:
        """Every field of TRL's ``GRPOTrainer`` that the restated loss reads, in one place (TRL 1.16's
        ``_compute_loss`` in training mode reads the same; tests/trainers/test_trl_hooks.py): the per-token loss's
        settings, the microbatch's normaliser, the sampler tensors it uses, and the regulariser's
        ``beta``, KL bias correction and MoE aux-loss coefficient (0 when TRL adds no aux loss)."""
        args, mask = self.args, _loss_mask(inputs)
        settings = PolicyLoss(
            self.loss_type, importance_sampling_level=self.importance_sampling_level, epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high, delta=args.delta, sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg, vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg, off_policy_threshold=self.off_policy_mask_threshold)
        reduction = Reduction(
            self.loss_type, rows=mask.size(0), tokens=mask.sum(), max_completion_length=self.max_completion_length,
            accumulation=self.current_gradient_accumulation_steps, num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.accelerator.num_processes, steps_per_generation=args.steps_per_generation)
        if named(self.loss_type).folds_sampler_ratio:  # into its sequence weight whenever present
            ratio = inputs.get("importance_sampling_ratio")
        elif self.use_vllm and self.vllm_importance_sampling_correction:
            ratio = inputs["importance_sampling_ratio"]
        else:
            ratio = None
        sampled = inputs.get("sampling_per_token_logps") if self.off_policy_mask_threshold is not None else None
        return TRLLossFields(settings, reduction,
                             {"importance_sampling_ratio": ratio, "sampling_per_token_logps": sampled},
                             {"beta": self.kl_coef if self._kl_in_loss else 0.0, "kl_estimator": args.kl_estimator,
                              "bias_correction_kl": args.use_bias_correction_kl,
                              "aux_coef": self.router_aux_loss_coef if self.aux_loss_enabled else 0.0})

    # ------------------------------------------------------------------ CAGrad exact

    def _exact_step(self, model, task_losses: dict, reg: torch.Tensor, coef: float, present: set) -> torch.Tensor:
        """Accumulate each task's gradient over the window (``_gradients``: at fp16's loss scale, as the Trainer's
        backward takes it, then unscaled; every loss value is finite here, ``_loss_terms``); returns what the
        Trainer's backward carries into ``.grad``: the regulariser, or, when it has no gradient (``beta = 0``, no
        entropy bonus, no aux loss), the last task's loss, which saves one backward pass. ``training_step`` combines
        the window after its last backward."""
        params = _trainable(model)
        window = self.task_gradients
        window.carrier = None if (self._kl_in_loss or coef or self.aux_loss_enabled) else len(self.task_names) - 1
        if not window.sums:  # every task, present or not, so processes reduce the same tensors
            window.sums = {k: [torch.zeros_like(p) for p in params]
                           for k in range(len(self.task_names)) if k != window.carrier}
        window.present |= set(present)
        scale = loss_scale(self.accelerator)  # None without fp16's loss scaler
        missed = set()  # tasks whose loss reached no parameter
        for k, loss in task_losses.items():
            if k == window.carrier or k not in present:  # an absent task's gradient is 0
                continue
            grads = _gradients(loss, params, scale)
            if _reaches_none(grads):
                missed.add(k)
            for b, g in zip(window.sums[k], grads):
                if g is not None:
                    b.add_(g)
        _check_reached(missed, self.task_names, "every trainable parameter", self.accelerator.device)
        if self._guard_now() and coef:
            self._check_composed_update(params, coef)
        return task_losses.get(window.carrier, reg)  # reg has no gradient when it carries nothing

    def training_step(self, model, inputs, num_items_in_batch):
        """TRL's; in exact CAGrad mode, after the optimizer step's last backward, the summed task gradients
        (``task_gradients``) combined by CAGrad and added to ``.grad`` (``_combine_window``)."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.args.cagrad == "exact" and self.accelerator.sync_gradients and self.task_gradients.sums:
            self._combine_window(model)
        return loss

    def _combine_window(self, model) -> None:
        """After the window's last backward: CAGrad over the summed task gradients (averaged over
        processes), its direction added to ``.grad`` (which holds the regularisers' gradient, or
        the carrier task's: then its share is swapped for its CAGrad coefficient).

        Under fp16's loss scaler every gradient here was taken at its scale S: ``.grad`` holds the Trainer's
        backward times S, and the task sums are of ``autograd.grad(L_k * S) / S`` (``_gradients``: unscaled, the
        backward through fp16 activations was not). The carrier's gradient is read as ``.grad / S`` and the
        direction is added times S, so that the scaler's unscaling leaves the CAGrad update. Every loss value of
        the window was finite (``_loss_terms`` stops on a NaN/inf one, at any S), so a gradient that
        overflowed at S >= 1 (NaN/inf: the carrier's, or any task's sum) is the scaler's overflow: the scaler skips
        this update and halves S (``health.callbacks.NonFiniteRule`` lets it), so the combination is skipped with
        it; ``.grad`` is left as the scaler reads it where it holds the overflow (the carrier's), and otherwise
        given an inf so that the scaler finds it (``_leave_to_scaler``). Without a scaler, or at S < 1 (the
        unscaled gradient overflows too), a non-finite Gram entry stops training (``_cagrad_weights``)."""
        params = _trainable(model)
        tasks = list(range(len(self.task_names)))
        scale = loss_scale(self.accelerator)  # None without fp16's loss scaler
        in_grad = 1.0 if scale is None else scale  # .grad holds in_grad x the gradient
        carried = [torch.zeros_like(p) if p.grad is None else p.grad.detach() / in_grad for p in params]
        window = self.task_gradients
        bufs = [carried if k == window.carrier else [self._reduced(b) for b in window.sums[k]] for k in tasks]
        gram = _gram(bufs)  # [K, K]
        overflowed = _overflowed_at_scale(gram, scale)
        if overflowed and window.carrier not in overflowed:  # .grad may be finite: the scaler must see the inf
            _leave_to_scaler(params)
        if not overflowed:
            weights = self._cagrad_weights(tasks, gram)  # [K]
            shares = [w - (k == window.carrier) for k, w in zip(tasks, weights.tolist())]  # the carrier is in .grad
            direction = [in_grad * sum(s * b[i] for s, b in zip(shares, bufs)) for i in range(len(params))]
            self._log_cagrad(tasks, gram, weights, self._present_anywhere(tasks, window.present))
            self._compose_update(params, direction)
        window.sums, window.present = {}, set()  # the next optimizer step starts its own sums

    def _compose_update(self, params: list, direction: list) -> None:
        """The applied update: the CAGrad direction plus what the regularisers' backward puts in
        ``.grad`` (KL, entropy bonus), outside the combination."""
        for p, d in zip(params, direction):
            p.grad = d.clone() if p.grad is None else p.grad + d

    def _check_composed_update(self, params: list, coef: float) -> None:
        """I7, exact mode: with the bonus acting alone (no task direction, ``.grad`` holding what the backward of
        ``-c H`` gives, H over the tokens the bonus averages over), the update ``_compose_update`` applies must
        raise H to first order: ``dH = -lr <u, dH/dtheta> > 0``. One extra backward (guard steps only), of ``c H``
        as the Trainer's backward takes the bonus (``_gradients``: at fp16's loss scale S, then unscaled; an unscaled
        fp16 backward flushes the entropy's small gradient to 0). Logged: ``entropy/bonus_alone_dH_per_lr`` where
        checked, and ``guards/bonus_alone_checked_share`` (1 checked, 0 not; under several processes the share of
        ranks checked, and the rise their mean). Not checked, with a warning once per
        cause: a gradient that overflowed at S >= 1 (the check changes nothing: the Trainer's backward carries the
        bonus at the same S, so the scaler skips that update as a rule), or one that is 0 (the bonus acts on no token
        of the microbatch, or its gradient rounds to 0 even at S). A NaN/inf gradient without a scaler or at S < 1,
        and an update that does not raise H (a NaN change included), stop training.

        Under several processes each rank checks its own microbatch and the verdict is every rank's
        (``_every_rank``: one all_gather of |dH/dtheta|^2 and the rise, on ``accelerator.device``): a rank that fails
        stops every rank with one error naming it, and every rank logs the same values."""
        terms = self.hook_record.loss
        H = masked_mean(terms.entropies, terms.bonus_mask)  # the entropy the bonus raises
        scale = loss_scale(self.accelerator)  # None without fp16's loss scaler
        bonus = _gradients(coef * H, params, scale)  # d (c H) / dtheta
        bonus = [torch.zeros_like(p) if g is None else g for p, g in zip(params, bonus)]
        norm = sum(_dot(g, g) for g in bonus).item() / coef ** 2  # |dH/dtheta|^2
        rise = math.nan  # dH / lr, first order: read where the gradient is finite and not 0
        if math.isfinite(norm) and norm != 0:
            saved = [p.grad for p in params]
            try:
                for p, g in zip(params, bonus):
                    p.grad = -g  # the backward of -c H
                self._compose_update(params, [torch.zeros_like(p) for p in params])
                rise = -sum(_dot(p.grad, g) for p, g in zip(params, bonus)).item() / coef
            finally:
                for p, g in zip(params, saved):
                    p.grad = g
        local = torch.tensor([norm, rise], dtype=torch.float64)  # [2], on the host
        norms, rises = _every_rank(local, self.accelerator.device).T
        W, at = norms.numel(), "" if scale is None else f" at fp16's loss scale {scale:g}"
        ranks = {cause: [r for r, n in enumerate(norms.tolist()) if test(n)] for cause, test in (
            ("non-finite", lambda n: not math.isfinite(n)), ("zero", lambda n: n == 0),
            ("checked", lambda n: math.isfinite(n) and n != 0))}
        bad = ranks["non-finite"]  # the scaler's overflow at S >= 1 (one S on every rank), else a broken gradient
        if bad and not _overflowed_at_scale(norms[bad[0]].reshape(1, 1), scale):  # (its 1 x 1 Gram)
            raise InvariantError("I7", f"the entropy's gradient{at} is NaN/inf{_on_ranks(bad, W)} "
                                 f"(|dH/dtheta|^2 = {float(norms[bad[0]]):g}), so the update the CAGrad exact path "
                                 f"applies with the entropy bonus c={coef:g} cannot be checked to raise the entropy. "
                                 "Look for a NaN/inf logit or entropy in the policy's forward (half precision), or "
                                 "lower the learning rate.")
        checked = ranks["checked"]
        metrics = {"guards/bonus_alone_checked_share": len(checked) / W}
        if checked:
            metrics["entropy/bonus_alone_dH_per_lr"] = float(rises[checked].mean())
        self._record_metrics(metrics, "train")
        if bad:
            self._composed_update_unchecked(coef, "overflow", f"the entropy's gradient overflowed{at}"
                                            f"{_on_ranks(bad, W)} (the Trainer's backward, which "
                                            "carries the bonus, overflows there too as a rule: the scaler then skips "
                                            "the update and halves its scale)")
        if ranks["zero"]:
            self._composed_update_unchecked(coef, "zero", f"the entropy's gradient{at} is 0"
                                            f"{_on_ranks(ranks['zero'], W)} (the bonus acts on no token of this "
                                            "microbatch, or its gradient rounds to 0 in half precision)")
        falls = [r for r in checked if not rises[r] > 0]  # NaN is not
        if falls:
            r = falls[0]
            raise InvariantError("I7", f"with the entropy bonus c={coef:g} acting alone, the update the CAGrad "
                                 f"exact path applies{_on_ranks(falls, W)} changes H by {float(rises[r]):+.4g} x lr "
                                 f"to first order (|dH/dtheta|^2 = {float(norms[r]):.4g}): it lowers entropy. The "
                                 "regulariser gradient must be added to the combined task direction with a + sign, "
                                 "outside the combination (`_compose_update`).")

    def _composed_update_unchecked(self, coef: float, cause: str, why: str) -> None:
        """The composed-update check (``_check_composed_update``) could not read this microbatch (on some rank), for
        ``cause``: said once per ``cause`` (``guards/bonus_alone_checked_share`` counts it)."""
        if f"composed_update/{cause}" not in self._warned:
            self._warned.add(f"composed_update/{cause}")
            logger.warning("grpotrl guard I7: with the entropy bonus (c=%g) acting alone, the update the CAGrad exact "
                           "path applies was not checked to raise the entropy on step %d: %s. Said once; "
                           "guards/bonus_alone_checked_share counts the checked guard microbatches.",
                           coef, self.state.global_step + 1, why)

    # ------------------------------------------------------------------ CAGrad low-memory

    def _low_memory_loss(self, task_losses: dict, reg: torch.Tensor, present: set) -> torch.Tensor:
        """``sum_k coef_k L_k + regulariser`` with CAGrad coefficients from the last block's
        per-task gradients (this microbatch; ``_gradients``: at fp16's loss scale S, as the Trainer's backward
        takes it, then unscaled). The loss values are finite (``_loss_terms`` stops on a NaN/inf one, at any S), so
        a gradient that overflowed at S >= 1 is the scaler's overflow: the proxy's
        ``.grad`` is given an inf before the Trainer's backward (``_leave_to_scaler``), so the scaler skips the
        optimizer step this microbatch is in and halves S; the coefficients are then 1 (that update is not
        applied) and nothing is logged. Otherwise a non-finite Gram entry stops training (``_cagrad_weights``)."""
        tasks = list(range(len(self.task_names)))  # every task, so processes reduce the same tensors
        scale = loss_scale(self.accelerator)  # None without fp16's loss scaler
        local, missed = [], set()  # this process's task gradients [N_proxy] each; tasks that reached no parameter
        with _intercept.skip_head_weight_grad([task_losses[k] for k in present], self._proxy):
            for k in tasks:
                grads = (_gradients(task_losses[k], self._proxy, scale)
                         if k in present else [None] * len(self._proxy))
                if k in present and _reaches_none(grads):
                    missed.add(k)
                local.append(torch.cat([(torch.zeros_like(p) if g is None else g).flatten()
                                        for p, g in zip(self._proxy, grads)]))
        _check_reached(missed, self.task_names, "the last block's trainable parameters", self.accelerator.device)
        G = torch.stack([self._reduced(g) for g in local]).double()  # [K, N_proxy]
        gram = (G @ G.T).cpu()  # [K, K]: the combination is solved on CPU, as on the exact path
        if _overflowed_at_scale(gram, scale):  # the same on every process: the gradients are reduced
            _leave_to_scaler(self._proxy)
            weights = torch.ones(len(tasks))
        else:
            weights = self._cagrad_weights(tasks, gram)
            self._log_cagrad(tasks, gram, weights, self._present_anywhere(tasks, present))
        return sum(w * task_losses[k] for w, k in zip(weights.tolist(), tasks)) + reg

    def _present_anywhere(self, tasks: list[int], present: set) -> list[int]:
        """The tasks with rows in this microbatch on some process (the Gram matrix is of gradients averaged over
        processes): one all-reduce of K numbers under DDP, called by every process at the same point."""
        if self.accelerator.num_processes == 1:
            return [k for k in tasks if k in present]
        here = torch.tensor([float(k in present) for k in tasks], device=self.accelerator.device)  # [K]
        return [k for k, n in zip(tasks, self._reduced(here).tolist()) if n > 0]

    # ------------------------------------------------------------------ shared

    def _cagrad_weights(self, tasks: list[int], gram: torch.Tensor) -> torch.Tensor:
        """Coefficients on the task gradients, scaled by K (``cagrad_c=0`` = the plain sum).
        A task whose gradient is zero (no rows, or all its groups' rewards equal) is left out. A NaN/inf in
        ``gram`` stops training, naming the tasks and the step (``_check_gram_finite``): read as "not > 0" it
        would drop the task with weight 0 while its NaN still reaches ``.grad``, and an inf would enter the solver."""
        _check_gram_finite(gram, [self.task_names[k] for k in tasks], self.state.global_step + 1, self.args.cagrad)
        live = (gram.diagonal() > 0).nonzero().flatten().tolist()
        weights = torch.zeros(len(tasks))
        if len(live) == 1:
            weights[live[0]] = 1.0
        elif live:
            coef, _ = cagrad_coefficients(gram[live][:, live], self.args.cagrad_c)
            weights[live] = coef * len(live)
        return weights

    def _reduced(self, t: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(t, reduction="mean") if self.accelerator.num_processes > 1 else t

    def _log_cagrad(self, tasks: list[int], gram: torch.Tensor, weights: torch.Tensor, present: list[int]) -> None:
        """Per task with rows in the gradient (``present``, on any process: the microbatch's in low-memory mode,
        the optimizer step's window's in exact mode, whose sums hold every microbatch a task has rows in): gradient norm and CAGrad coefficient, so that the logged mean of a task runs over
        the gradients it had rows in, never over a 0 from a microbatch without it; the worst pairwise cosine
        between tasks with a gradient (NaN, which TRL's log leaves out of its mean, when fewer than two have one: a
        task without rows has no direction to compare); and how far the update is from the plain sum,
        |d - sum g| / |sum g|."""
        metrics = {}
        gram = gram.double()
        norms = gram.diagonal().clamp(min=0).sqrt()
        for k, n, w in zip(tasks, norms.tolist(), weights.tolist()):
            if k in present:
                metrics[f"tasks/{self.task_names[k]}/grad_norm"] = n
                metrics[f"tasks/{self.task_names[k]}/cagrad_coef"] = w
        if len(tasks) > 1:
            live = (norms > 0).nonzero().flatten()  # [K_live]
            cos = gram[live][:, live] / (norms[live, None] * norms[None, live])  # [K_live, K_live]
            off = cos[~torch.eye(live.numel(), dtype=torch.bool)]
            metrics["cagrad/min_cosine"] = off.min().item() if off.numel() else float("nan")
        ones, w = torch.ones(len(tasks), dtype=torch.float64), weights.double()
        plain = (ones @ gram @ ones).clamp(min=1e-30)
        deviation = ((w - ones) @ gram @ (w - ones)).clamp(min=0).div(plain).sqrt()
        metrics["cagrad/deviation_from_sum"] = deviation.item()
        self._record_metrics(metrics, "train")


def _check_terms_add_up(task_losses: dict, policy: torch.Tensor, names: list[str], rank: str = "") -> None:
    """I7 (guard steps): the task terms must add up to TRL's policy loss of the whole microbatch
    (TRL's full loss less its KL, bonus and aux loss, ``ops.task_losses.regulariser``), or the
    regulariser ``full - sum_k L_k`` would silently carry policy loss (rows of no task, or a
    restatement that drifted from TRL's) past CAGrad's combination. A NaN or inf fails. ``rank``: which
    process's microbatch the values are of, for the error (``_on_ranks``; empty in a single process)."""
    terms = torch.stack([loss.detach().double() for loss in task_losses.values()])  # [K]
    total, whole = float(terms.sum()), float(policy.detach())
    tolerance = 1e-6 + 1e-5 * float(terms.abs().sum())  # fp32 sums in another order
    finite = math.isfinite(total) and math.isfinite(whole)  # an inf term would make the tolerance inf
    if not (finite and abs(total - whole) <= tolerance):
        listed = ", ".join(f"{names[k]}: {float(v):+.6g}" for k, v in zip(task_losses, terms))
        raise InvariantError("I7", f"the CAGrad task terms add up to {total:+.8g} ({listed}), but the policy loss of "
                             f"the whole microbatch{rank} is {whole:+.8g} (tolerance {tolerance:.2g}). The regulariser "
                             "(full loss - the task terms) would carry the difference: policy loss on rows of no "
                             "task, or a NaN/inf, outside CAGrad's combination. Check the task labels "
                             "(task_column) and the rows of each term.")


TRLLossFields = namedtuple("TRLLossFields", "settings reduction per_token regulariser")


def _non_finite_tasks(gram: torch.Tensor) -> list[int]:
    """The tasks whose gradient holds a NaN/inf, read from the Gram matrix [K, K]: those with a non-finite
    squared norm (an inf or NaN element makes it so); where only off-diagonal entries are non-finite, the tasks
    of those entries. Empty when every entry is finite.

    >>> _non_finite_tasks(torch.tensor([[1.0, math.nan], [math.nan, math.nan]]))
    [1]
    """
    bad = ~torch.isfinite(gram)  # [K, K]
    diagonal = bad.diagonal().nonzero().flatten().tolist()
    return diagonal or sorted(set(bad.nonzero().flatten().tolist()))


def _check_gram_finite(gram: torch.Tensor, names: list[str], step: int, mode: str) -> None:
    """A Gram matrix [K, K] (``names[k]``: its row k's task) with a NaN/inf entry: an error naming the tasks whose
    gradient is non-finite, their squared norms and the optimizer step."""
    bad = _non_finite_tasks(gram)
    if bad:
        listed = ", ".join(f"{names[k]!r} (|g|^2 = {float(gram[k, k]):g})" for k in bad)
        raise InvariantError("multi-task", f"step {step}, cagrad={mode!r}: the gradient of task(s) {listed} is "
                             "NaN/inf. CAGrad cannot weigh a non-finite gradient: the update would carry the NaN, or "
                             "drop the task with weight 0. Look for an overflow in that task's loss (half precision, "
                             "a NaN/inf advantage or logprob), or lower the learning rate.")


def _every_rank(local: torch.Tensor, device=None) -> torch.Tensor:
    """``[W, *local.shape]`` on the host, row r rank r's ``local`` (moved to ``device``, the collective's: the
    accelerator's, where given and there are several processes), in one ``all_gather`` (I12's,
    ``guards.ranks.gather_checksums``) and one host read; in a single process
    (``world_size`` 1) ``local[None]`` read to the host, with no collective. Every process calls it at the
    same point: the multi-task checks decide on every rank's values, so that all stop together, with one error. A
    rank that raised alone would leave the others waiting in their next collective until the launcher, or NCCL's
    timeout, kills them."""
    if world_size() == 1:
        return local[None].cpu()
    return gather_checksums(local if device is None else local.to(device)).cpu()


def _on_ranks(ranks: list[int], world: int) -> str:
    """`` on rank(s) r, s (of W processes)`` for an error, empty in a single process."""
    return "" if world == 1 else f" on rank(s) {', '.join(map(str, ranks))} (of {world} processes)"


def _check_losses_finite(values: torch.Tensor, names: list[str], step: int, mode: str) -> torch.Tensor:
    """This process's loss values [K + 1 (+ n)], on the accelerator's device: each task's policy loss ``L_k``
    (``names[k]``), then the regulariser (``full - sum_k L_k``), then any values read with them (TRL's policy loss,
    restated on guard steps). They are read to the host once, every process's (``_every_rank``: one all_gather
    where there are several), and a NaN/inf among any rank's K + 1 loss values is an error on every rank, the same
    one: naming the tasks whose loss is non-finite and the ranks they are on (the regulariser where no task's is: a
    NaN task loss makes it NaN too), their values and the optimizer step, whatever fp16's loss scale S is: a loss
    scale multiplies the backward only, so its overflow is of a finite loss's gradient (the scaler's skipped step),
    never of a loss value. Read as overflow, a NaN loss at S >= 1 would skip every step and halve S until S < 1.

    Returns:
        torch.Tensor: every rank's values as read, ``[W, K + 1 (+ n)]`` on the host (W = 1 in one process), for the
        checks that share the read.

    >>> _check_losses_finite(torch.tensor([0.5, -0.25, 0.125]), ["a", "b"], 1, "exact").tolist()  # one process
    [[0.5, -0.25, 0.125]]
    >>> try:
    ...     _check_losses_finite(torch.tensor([0.5, math.nan, math.nan]), ["a", "b"], 3, "exact")
    ... except InvariantError as e:
    ...     print(str(e)[:81])
    [multi-task] step 3, cagrad='exact': the loss of task(s) 'b' (L = nan) is NaN/inf
    """
    world = _every_rank(values)  # [W, K + 1 (+ n)]
    losses, W = world[:, :len(names) + 1], world.size(0)  # [W, K + 1]
    if bool(torch.isfinite(losses).all()):
        return world
    bad = {r: ks for r in range(W) if (ks := [k for k in range(len(names)) if not math.isfinite(losses[r, k])])}
    if bad:
        what = "the loss of task(s) " + "; ".join(
            ", ".join(f"{names[k]!r} (L = {float(losses[r, k]):g})" for k in ks) + _on_ranks([r], W)
            for r, ks in bad.items())
        look = "a NaN/inf advantage (a NaN/inf reward or reward weight) or logprob in that task's rows"
    else:
        at = "; ".join(f"{float(losses[r, -1]):g}{_on_ranks([r], W)}" for r in range(W)
                       if not math.isfinite(losses[r, -1]))
        what = (f"the regulariser (beta * KL - c * H, plus an MoE aux loss: the full loss less the task terms; "
                f"{at})")
        look = "a NaN/inf reference logprob (the KL), entropy (the bonus) or MoE aux loss"
    raise InvariantError("multi-task", f"step {step}, cagrad={mode!r}: {what} is NaN/inf in the forward: the loss "
                         "value itself, not its gradient at fp16's loss scale (a loss scale multiplies the backward "
                         "only: its overflow, which the scaler skips, is of a finite loss's gradient). Every update "
                         f"would carry the NaN, at any scale. Look for {look}.")


def _gradients(loss: torch.Tensor, params: list, scale: float | None) -> list:
    """``autograd.grad`` of ``loss`` w.r.t. ``params`` (the graph kept; None for a parameter it does not reach), as
    the Trainer's backward takes it: under fp16's loss scaler (``scale``, None without one) the gradient of
    ``loss * scale``, divided by ``scale`` in fp32, so that a backward through fp16 activations does not flush a
    small loss's gradient to 0 (what the scaler exists to prevent). An overflow at ``scale`` stays NaN/inf: the
    scaler's case (``_overflowed_at_scale``), for a finite ``loss`` (the task terms and the regulariser, which
    carries the entropy bonus, are checked finite first: ``_check_losses_finite``)."""
    if scale is None:
        return list(torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True))
    grads = torch.autograd.grad(loss * scale, params, retain_graph=True, allow_unused=True)
    return [None if g is None else g.float() / scale for g in grads]


def _overflowed_at_scale(gram: torch.Tensor, scale: float | None) -> list[int]:
    """The tasks whose gradient, taken at fp16's loss scale ``scale`` >= 1, holds a NaN/inf (``_non_finite_tasks`` of
    the Gram matrix [K, K]): the scaler's overflow, whose update it skips. The gradients must be of finite loss values
    (``_check_losses_finite`` ran first): a NaN/inf loss is no overflow at any scale. Empty without a scaler (None),
    at a scale < 1 (where the unscaled gradient overflows as well: a broken gradient, ``_check_gram_finite``), or when
    every entry is finite."""
    return _non_finite_tasks(gram) if scale is not None and scale >= 1 else []


def _leave_to_scaler(params: list) -> None:
    """A task gradient overflowed at fp16's loss scale where ``.grad`` may not have: an inf put in the first
    parameter's ``.grad`` (added in place, or set where it is None), so that the scaler, which checks ``.grad``
    before the optimizer step, skips the update and lowers its scale, as when its own backward overflows."""
    p = params[0]
    if p.grad is None:
        p.grad = torch.full_like(p, math.inf)
    else:
        p.grad.add_(math.inf)


def _reaches_none(grads: list) -> bool:
    """``autograd.grad`` (``allow_unused``) gave None for every parameter: the loss has no path to any of them (a
    zero gradient, from zero advantages, is a tensor)."""
    return bool(grads) and all(g is None for g in grads)


def _check_reached(missed: set, names: list[str], where: str, device) -> None:
    """``missed``: this process's tasks (indices into ``names``) with rows in the microbatch whose loss reaches
    none of the parameters its gradient is taken on (``_reaches_none``): CAGrad would weigh its gradient as 0 and
    silently leave it out of the update. Decided on every rank's (``_every_rank``: one all_gather of K flags on
    ``device`` where there are several processes, none in one): an error on every rank, the same one, naming the
    tasks, the ranks they missed on and the likely causes."""
    local = torch.tensor([float(k in missed) for k in range(len(names))], dtype=torch.float64)  # [K], on the host
    flags = _every_rank(local, device)  # [W, K]
    if not bool(flags.any()):
        return
    W = flags.size(0)
    ranks = {k: _on_ranks(flags[:, k].nonzero().flatten().tolist(), W)
             for k in flags.any(dim=0).nonzero().flatten().tolist()}  # task -> where it missed
    (first, on), *rest = ranks.items()
    also = f", nor that of task(s) {'; '.join(f'{names[k]!r}{r}' for k, r in rest)}" if rest else ""
    raise InvariantError("multi-task", f"the policy loss of task {names[first]!r} has no gradient path to {where}"
                         f"{on}{also}: "
                         "CAGrad would read its gradient as 0 and drop the task from the update. Causes: reentrant "
                         "activation checkpointing (use_reentrant=True: the layers' forward keeps no graph to their "
                         "parameters; set use_reentrant: false), or, for cagrad='low_memory', a highest-numbered block "
                         "the loss does not pass through (a vision tower's): use cagrad='exact'.")


def _task_rows(inputs: dict, num_tasks: int) -> dict:
    """Task -> the indices [n_k] of its rows in the microbatch (empty for a task with none)."""
    return {k: (inputs[TASK_KEY] == k).nonzero().flatten() for k in range(num_tasks)}


def _loss_mask(inputs: dict) -> torch.Tensor:
    """The tokens TRL's loss reads [B, C]: the completion mask, times the tool mask when present."""
    mask = inputs["completion_mask"]
    return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]


def _trainable(model) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise InputError("CAGrad combines the tasks' gradients of the trainable parameters, but the model has none "
                         "(every parameter has requires_grad=False): unfreeze some, or give a peft_config")
    return params


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double() * b.double()).sum()


def _gram(bufs: list[list[torch.Tensor]]) -> torch.Tensor:
    """``[K, K]`` float64 inner products of K gradients, each a list of per-parameter tensors: per
    parameter, its K gradients cast to float64 once (``[K, n]``) and multiplied by their transpose
    (one pass over the parameter for all K(K+1)/2 pairs), summed over parameters; the upper
    triangle mirrored, so the matrix is exactly symmetric.

    >>> _gram([[torch.tensor([1.0, 0.0])], [torch.tensor([1.0, 2.0])]]).tolist()
    [[1.0, 1.0], [1.0, 5.0]]
    """
    gram = None
    for grads in zip(*bufs):  # one parameter's gradient in every task
        g = torch.empty(len(grads), grads[0].numel(), dtype=torch.float64, device=grads[0].device)  # [K, n]
        for row, grad in zip(g, grads):
            row.copy_(grad.reshape(-1))
        gram = g @ g.T if gram is None else gram + g @ g.T  # [K, K]
    gram = gram.triu()
    return (gram + gram.triu(1).T).cpu()


def _last_block_params(model) -> list[torch.Tensor]:
    """The trainable parameters of the highest-numbered block (``...layers.N...``): the proxy
    whose per-task gradients give the low-memory CAGrad weights."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    index = {n: int(m.group(1)) for n, _ in named if (m := re.search(r"\.(\d+)\.", n))}
    if not index:
        raise InputError("cagrad='low_memory' takes its weights from the last transformer block, but no trainable "
                         "parameter name has a block number (`...layers.N...`); use cagrad='exact'.")
    last = max(index.values())
    return [p for n, p in named if index.get(n) == last]
