"""The values grpotrl's GRPO hooks hand each other. TRL calls its hooks with TRL's arguments and keeps
their TRL return values, so what grpotrl learns in one hook and needs in a later one travels in one
documented record on the trainer (``GRPOTrainer.hook_record``), typed here, never in loose fields.

Who writes and who reads each field, in the order TRL calls the hooks:

* ``_generate`` (inside TRL's ``_generate_and_score_completions``) writes ``generated``: what the round's
  ``generate`` calls saw and returned;
* ``_generate_and_score_completions`` reads it (health signals, dynamic sampling) and writes the mode's
  ``BatchRecord`` into ``batches``: the generation batch's I1/I3/I4 record (after dynamic sampling's refills),
  its loss tokens (I11) and the sampler's measures. One record per mode: an evaluation between two training
  steps that share one generation batch (``num_iterations > 1``, ``steps_per_generation >
  gradient_accumulation_steps``) leaves the training batch's record as it was;
* ``_compute_loss`` (each microbatch) reads the record of its mode (``HookRecord.batch``) and writes ``loss``;
* ``compute_loss`` (TRL's wrapper around ``_compute_loss``) and the multi-task trainer read ``loss`` (I7);
* ``_compute_loss``'s first training microbatch at step 0 that holds a loss token clears ``identity_due`` (I10 runs once);
* ``_generate_and_score_completions`` writes ``last_batch``, which ``boundary_report()`` and the boundary-report
  callback read;
* exact CAGrad (``MultiTaskGRPOTrainer``): ``compute_loss`` adds each microbatch's task gradients to
  ``TaskGradients``, ``training_step`` combines them after the optimizer step's last backward and empties it.

Letters: B rows of this process's generation batch (or microbatch), C completion width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Generated:
    """What one ``_generate`` call saw and returned.

    ``completion_lengths`` [B]: each completion's token count. ``generated_stops`` [B]: the stop ids
    ``generate`` wrote per row, past the cut completion too (None where ``generate`` was not observed: vLLM,
    continuous batching, a tool loop, a ``rollout_func``). ``guard``: ``guards.check_generation``'s record of the
    prompt and completion ids per row, which the loss's microbatches are checked against (None off guard
    steps). ``sampler``: what the sampler's logprob recorder measured (``sampled_logprobs.recorded_measures``:
    the raw logprobs, the log kept mass, the temperature and processors; None where nothing was recorded)."""

    completion_lengths: torch.Tensor
    generated_stops: torch.Tensor | None
    guard: dict | None
    sampler: dict | None


@dataclass(frozen=True)
class BatchRecord:
    """What one generation batch's microbatches are checked against. ``guard``: ``guards.check_generation``'s
    I1/I3/I4 record of its rows (None off guard steps). ``window_tokens``: its loss tokens over every process,
    the normaliser of dapo/cispo/vespo that I11 checks (training guard steps only, else None). ``sampler``: what
    the sampler's logprob recorder measured on its rows (None where nothing was recorded, or where dynamic
    sampling merged rows of several generation rounds)."""

    guard: dict | None = None
    window_tokens: float | None = None
    sampler: dict | None = None


@dataclass(frozen=True)
class LossTerms:
    """What the last ``_compute_loss`` fed TRL's loss: the policy's per-token ``entropies`` [B, C] (None
    when TRL computed none), the ``mask`` [B, C] of the tokens in the loss, and ``bonus_mask`` [B, C], the
    tokens TRL's entropy bonus averages over: ``mask`` times TRL's top-entropy mask (``top_entropy_quantile``),
    empty where every row is masked (truncated completions under ``mask_truncated_completions``, an all-zero
    tool mask) or no token of this process passed the top-entropy threshold."""

    entropies: torch.Tensor | None
    mask: torch.Tensor
    bonus_mask: torch.Tensor


@dataclass
class HookRecord:
    """The record the GRPO hooks hand each other (module docstring: who writes, who reads).

    ``generated``: the last ``_generate`` call's ``Generated`` (in either mode: read within the same
    ``_generate_and_score_completions``). ``batches``: mode (``"train"``, ``"eval"``) -> the ``BatchRecord`` of
    that mode's last generation batch, which its microbatches are checked against. ``loss``: the last
    microbatch's ``LossTerms``. ``identity_due``: I10 is still to run, on the first
    training microbatch of step 0 that holds a loss token (``identity_unchecked``: the ones before held none).
    ``last_batch``: the last generation batch's ids, lengths, stop counts and rewards, for
    ``boundary_report()``."""

    generated: Generated | None = None
    batches: dict[str, BatchRecord] = field(default_factory=dict)
    loss: LossTerms | None = None
    identity_due: bool = False
    identity_unchecked: bool = False
    last_batch: dict | None = None

    def batch(self, mode: str) -> BatchRecord:
        """The ``BatchRecord`` of ``mode``'s last generation batch (an empty one before the first)."""
        return self.batches.get(mode, BatchRecord())


@dataclass
class TaskGradients:
    """Exact CAGrad's per-task gradients over one optimizer step's microbatches. ``sums``: task index -> one
    tensor per trainable parameter, the task's gradient summed so far (every task but ``carrier``, present in
    the microbatch or not, so that every process reduces the same tensors); ``carrier``: the task whose
    gradient the Trainer's own backward carries into ``.grad`` (None when a regulariser's backward does);
    ``present``: the tasks with rows in some microbatch of the window on this process."""

    sums: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    carrier: int | None = None
    present: set[int] = field(default_factory=set)
