"""What each of TRL 1.16's ``loss_type`` values means, in one table: ``LOSS_TYPES[name]``.

A loss type is two choices in ``trl.GRPOTrainer._compute_loss``: the per-token policy loss ``l_t``
(``PerToken``) and what the microbatch's summed ``l_t`` is divided by (``Normaliser``). Everything in
grpotrl that depends on the loss type reads this table, never the name:

* ``ops.reduction.reduce_rows``: TRL's reduction, restated (GAD's KL term, the multi-task terms);
* ``ops.task_losses.per_token_policy_loss``: TRL's per-token loss, restated (the multi-task terms);
* ``guards.denominator``: I11's expected normaliser and ``d l_t / d logp_t`` per token;
* ``trainers.padding_free.resolve_balance``: whether regrouping an optimizer step's rows keeps its loss;
* the sampler's importance ratio, multiplied onto ``l_t`` or folded into a sequence weight: the multi-task
  terms, the I11 slope, preflight's refusal of ``hf_importance_sampling_correction``.

Adding TRL's next loss type is one entry here. Only a formula TRL has not used before needs a new member:
a ``Normaliser`` is read by ``reduce_rows`` and ``expected_normaliser``, a ``PerToken`` by
``per_token_policy_loss`` and ``token_slope``, each of which then needs its branch. ``tests/trainers/test_trl_hooks.py``
fails when TRL's list of loss types, or the branch TRL takes for one, no longer matches this table.

Letters: B rows of the microbatch, C completion width, ``n_i`` row i's loss tokens, ``r`` the importance
ratio ``pi / pi_old``, ``A`` the advantage.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PerToken(enum.Enum):
    """TRL's per-token policy loss ``l_t`` (before the reduction and the KL term), by its formula."""

    CLIPPED = "-min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A), r capped at delta when set"
    SAPO = "-A sigmoid(tau (r - 1)) 4 / tau, tau by the sign of A"
    CISPO = "-min(r, epsilon_high) A logp, the weight detached"
    VESPO = "-phi(w) A logp, phi the gamma weight of the sequence's ratio w (sampler ratio included)"


class Normaliser(enum.Enum):
    """What TRL divides a row's summed ``l_t`` by, in training (times ``gradient_accumulation_steps``)."""

    ROW_TOKEN_MEAN = "n_i * B: each row's token mean, then the mean over rows"
    MICROBATCH_TOKENS = "sum(mask): the microbatch's token mean"
    MAX_LENGTH_ROWS = "B * max_completion_length"
    ROWS = "B: each row's token sum, then the mean over rows"
    WINDOW_TOKENS = ("num_items_in_batch / num_processes / steps_per_generation: the generation batch's loss "
                     "tokens, all processes, per microbatch")


@dataclass(frozen=True)
class LossType:
    """One ``loss_type``: its per-token loss and its normaliser. The properties follow from them.

    Wrong ``per_token``: the multi-task terms no longer add up to TRL's loss (a stop on the first guard
    step, I7), and I11 reads a wrong weight per token (a stop). Wrong ``normaliser``: the same two stops,
    GAD's KL term is scaled unlike TRL's policy loss, and a wrong ``grouping_free`` lets token-balanced
    microbatches change the step's gradient, which no guard sees. ``tests/trainers/test_trl_hooks.py`` (each entry
    against TRL's branches) and ``tests/ops/test_reduction.py`` (``grouping_free`` by two groupings) fail first.
    """

    name: str
    per_token: PerToken
    normaliser: Normaliser

    @property
    def grouping_free(self) -> bool:
        """The sum over an optimizer step's microbatches (of equal row counts) does not depend on which rows
        share a microbatch: every normaliser but the microbatch's own token count."""
        return self.normaliser is not Normaliser.MICROBATCH_TOKENS

    @property
    def token_sum(self) -> bool:
        """A token sum over the generation batch: TRL divides by ``num_items_in_batch``, which the caller
        must then hand in."""
        return self.normaliser is Normaliser.WINDOW_TOKENS

    @property
    def folds_sampler_ratio(self) -> bool:
        """The sampler's importance ratio goes inside the loss's sequence weight whenever the batch has one,
        instead of multiplying ``l_t`` under vLLM's correction; grpotrl's ``hf_importance_sampling_correction``,
        which folds the ratio into the advantages, is then not equivalent (preflight refuses it)."""
        return self.per_token is PerToken.VESPO


LOSS_TYPES: dict[str, LossType] = {t.name: t for t in (
    # every completion weighs the same, whatever its length
    LossType("grpo", PerToken.CLIPPED, Normaliser.ROW_TOKEN_MEAN),
    # a temperature-controlled soft gate instead of the hard clip
    LossType("sapo", PerToken.SAPO, Normaliser.ROW_TOKEN_MEAN),
    # every token of the microbatch weighs the same: the step's loss depends on which rows share one
    LossType("bnpo", PerToken.CLIPPED, Normaliser.MICROBATCH_TOKENS),
    # Dr. GRPO: a constant normaliser, no length bias
    LossType("dr_grpo", PerToken.CLIPPED, Normaliser.MAX_LENGTH_ROWS),
    # MiniMax-M1: the clipped ratio as a REINFORCE weight, every token of the generation batch the same
    LossType("cispo", PerToken.CISPO, Normaliser.WINDOW_TOKENS),
    # DAPO (TRL's default): every token of the generation batch weighs the same
    LossType("dapo", PerToken.CLIPPED, Normaliser.WINDOW_TOKENS),
    # a gamma weight of each sequence's ratio, the sampler's ratio inside it
    LossType("vespo", PerToken.VESPO, Normaliser.WINDOW_TOKENS),
    # GSPO's sequence ratio (TRL requires importance_sampling_level='sequence') with each row scaled by its length
    LossType("luspo", PerToken.CLIPPED, Normaliser.ROWS),
)}


def named(loss_type: str) -> LossType:
    """The table's entry for ``loss_type``; a ``ValueError`` naming it and TRL 1.16's loss types otherwise.

    >>> named("bnpo").grouping_free, named("dapo").token_sum, named("dapo").per_token is PerToken.CLIPPED
    (False, True, True)
    >>> sorted(t.name for t in LOSS_TYPES.values() if t.normaliser is Normaliser.WINDOW_TOKENS)
    ['cispo', 'dapo', 'vespo']
    """
    try:
        return LOSS_TYPES[loss_type]
    except (KeyError, TypeError):
        raise ValueError(f"loss_type={loss_type!r} is not one of TRL 1.16's: {', '.join(LOSS_TYPES)}") from None
