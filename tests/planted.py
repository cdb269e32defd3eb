"""Faults planted in grpotrl's GRPOTrainer, for the tests that show a guard catches them (tests/guards/test_precision.py
in bf16 on CPU, tests/test_gpu.py on CUDA). Each is a subclass whose loss forward does one thing wrong and
everything else as grpotrl does; with ``factor = 1.0`` / ``active = False`` it is the control. ``PlantedBest``
plants an evaluation metric instead, for the tests of which checkpoint is a run's best
(tests/checkpoints/test_run_identity.py, tests/trainers/test_gad_review.py).

* ``LossAtScaledTemperature``: the loss scores at ``factor`` x the sampling temperature.
* ``ShiftedCompletionPositions``: the loss forward's position ids of the scored (completion) tokens are one
  more than generate's, so each completion sits one position further from its prompt.
* ``PackedRowsSeeEachOther``: the packed loss forward loses its position ids and attention mask, so the
  sequences packed into one row attend to each other as one sequence.
"""

import torch
from transformers import TrainerCallback
from trl.trainer.utils import add_fused_lm_head

import grpotrl


class LossAtScaledTemperature(grpotrl.GRPOTrainer):
    """The loss scores the completions at ``factor`` x the sampling temperature. Runs on CPU and CUDA alike.

    Overrides ``_get_per_token_logps_and_entropies``: on a call with gradients on (the loss's forward in
    ``_compute_loss``; the reference and old-policy forwards run without, generation and I5's recompute do not
    call it), the policy gets TRL's fused LM head again, built at ``factor * temperature``, for that call; its
    forward is put back after. TRL 1.16 reads the temperature once, when ``add_fused_lm_head`` builds the head at
    init, so scaling ``self.temperature`` around the call would change nothing. Factor 1.0 runs the same path (the
    control). Not for a PEFT model (TRL puts the head on its base model)."""

    factor = 1.1

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        if not torch.is_grad_enabled():
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        policy = self.accelerator.unwrap_model(model)
        forward = policy.forward
        add_fused_lm_head(policy, temperature=self.factor * self.temperature,
                          cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32, outputs=("log_probs", "entropy"))
        try:
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        finally:
            policy.forward = forward


class _LossForwardHook(grpotrl.GRPOTrainer):
    """Runs ``edit(kwargs)`` on the keyword arguments of every fused-head (logprob) forward of the policy with
    gradients on, after grpotrl's own pre-hooks; generation and I5's plain recompute are left alone."""

    active = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

        def hook(module, hook_args, hook_kwargs):
            if not (self.active and hook_kwargs.get("fused_lm_head") and torch.is_grad_enabled()):
                return None
            return hook_args, self.edit(dict(hook_kwargs))

        self.accelerator.unwrap_model(self.model).register_forward_pre_hook(hook, with_kwargs=True)

    def edit(self, kwargs: dict) -> dict:
        raise NotImplementedError


class ShiftedCompletionPositions(_LossForwardHook):
    """The loss forward numbers each scored token one position further than generate did."""

    def edit(self, kwargs):
        scored = (kwargs["labels"] != -100).long()  # [r, w] the completion tokens
        kwargs["position_ids"] = kwargs["position_ids"] + scored
        return kwargs


class PackedRowsSeeEachOther(_LossForwardHook):
    """The packed loss forward without position ids and attention mask: transformers then reads each packed row
    as one causal sequence, so its sequences see each other."""

    def edit(self, kwargs):
        kwargs.pop("position_ids", None)
        kwargs.pop("attention_mask", None)
        return kwargs


class PlantedBest(TrainerCallback):
    """Adds ``eval_planted`` to each evaluation's metrics, highest at step ``best``: with
    ``metric_for_best_model="planted"`` the best checkpoint is ``checkpoint-<best>``, whatever the loss."""

    def __init__(self, best: int):
        self.best = best

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics["eval_planted"] = -abs(state.global_step - self.best)
