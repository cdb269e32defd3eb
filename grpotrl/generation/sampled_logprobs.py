"""The sampler's own logprobs (I5), and what a trainer injects into each ``generate`` call.

With ``do_sample=True``, ``generate`` appends temperature, top-k, top-p and min-p to the
processor list it was given, after grpotrl's I6 processors (``grpotrl.processors``), and samples
from ``softmax`` of what the whole list returns (transformers 5.23,
``GenerationMixin._get_logits_processor`` and ``_sample``). ``SampledLogprobRecorder`` keeps
``log_softmax`` of that tensor at the sampled token, one number per row and step, as generation
goes: inside ``trainers._intercept.inject_recorders_after_warpers(model)`` it runs last, after the
warpers. Nothing of size ``[B, V]`` is kept beyond the step after it was made, so memory is
O(B x V), not the O(B x C x V) of ``generate(output_scores=True)``, whose ``scores`` hold the
same tensors (``sampler_logprobs`` reads those; ``tests/test_processors.py`` checks both against
a real ``generate``). ``generation_extras`` builds a call's processors and recorder;
``recorded_logprobs`` reads the recorder back from a recorded call.

Letters: B rows, P padded prompt width, C completion width, V vocabulary.
"""

from __future__ import annotations

import math  # noqa: F401  (the doctests use math.inf)
from collections.abc import Sequence

import torch
from transformers import LogitsProcessor

from ..errors import InputError, InvariantError
from .processors import check_prompt_width, build_processors


def sampler_logprobs(scores: Sequence[torch.Tensor], sequences: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """The sampler's own per-token logprobs ``log_softmax(processed score)[token]``: ``[B, C]``.

    The reference form, from scores ``generate`` kept (``C x [B, V]`` in memory); training uses
    ``SampledLogprobRecorder``, which computes the same numbers as generation goes.

    ``scores`` and ``sequences`` are ``generate(..., do_sample=True, output_scores=True,
    return_dict_in_generate=True)``'s fields of those names: ``C`` tensors ``[B, V]`` after
    every processor and warper (temperature included), and ``[B, P + C]``. Columns after a
    row's first stop token hold padding that ``generate`` forced rather than sampled; their
    values are meaningless and may be ``-inf``: select with the completion mask
    (``torch.where``), do not multiply by it. Within the mask every value is finite, since a
    sampled token had probability > 0.

    >>> seq = torch.tensor([[4, 1, 0]])  # P=1: sampled 1, then 0
    >>> s = [torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, -math.inf]])]
    >>> sampler_logprobs(s, seq, prompt_width=1).tolist()  # log 1/2, log 1
    [[-0.6931471824645996, 0.0]]
    """
    check_prompt_width(prompt_width)
    tokens = sequences[:, prompt_width:]  # [B, C]
    if tokens.size(1) != len(scores):
        raise InputError(
            f"sampler_logprobs got {len(scores)} score steps for {tokens.size(1)} completion columns "
            f"(sequences width {sequences.size(1)} - prompt_width {prompt_width}). Pass generate's own "
            "`scores` and `sequences` from the same call, with P = the padded prompt width."
        )
    if not scores:
        return torch.zeros(sequences.size(0), 0, device=sequences.device)
    return torch.stack([processed_logprob(s, tokens[:, t]) for t, s in enumerate(scores)], dim=1)  # [B, C]


def processed_logprob(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(scores)[token]`` per row, in fp32: ``scores`` ``[B, V]``, ``tokens`` ``[B]`` -> ``[B]``.

    >>> s = torch.tensor([[0.0, 0.0], [0.0, -math.inf]])  # row 0 uniform over 2, row 1 all on id 0
    >>> processed_logprob(s, torch.tensor([1, 0])).tolist()  # log 1/2, log 1
    [-0.6931471824645996, 0.0]
    """
    scores = scores.float()  # [B, V]
    return scores.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(scores, dim=-1)  # [B]


class SampledLogprobRecorder(LogitsProcessor):
    """The sampler's own logprob of every sampled token, kept as ``generate`` goes: ``[B, C]``.

    The same numbers as ``sampler_logprobs`` on ``generate(output_scores=True)``, without keeping
    the ``C`` score tensors ``[B, V]``. It must run last, after transformers' warpers: hand it to
    ``generate(logits_processor=...)`` inside ``trainers._intercept.inject_recorders_after_warpers(model)``,
    which puts it there. At
    each step it returns ``scores`` unchanged and keeps a reference to them (the tensor
    ``generate`` samples from, and holds itself until its next step); at the next step, whose
    ``input_ids[:, -1]`` is the token just sampled (or the padding ``generate`` forced on a row
    that had stopped), it keeps that token's processed logprob (``[B]``) and lets the scores go.
    ``logprobs(sequences)`` gathers the last step's once ``generate`` has returned. Build one per
    ``generate`` call. As with ``sampler_logprobs``, columns after a row's first stop token are
    meaningless (maybe ``-inf``): select them with the completion mask.

    >>> rec = SampledLogprobRecorder()
    >>> rec.placed_last = True  # inject_recorders_after_warpers does this
    >>> _ = rec(torch.tensor([[4]]), torch.tensor([[0.0, 0.0]]))         # step 0, P=1: uniform over V=2
    >>> _ = rec(torch.tensor([[4, 1]]), torch.tensor([[0.0, -math.inf]]))  # sampled 1 at step 0: log 1/2
    >>> rec.logprobs(torch.tensor([[4, 1, 0]])).tolist()                   # sampled 0 at step 1: log 1
    [[-0.6931471824645996, 0.0]]
    """

    supports_continuous_batching = False  # reads the previous step's token from a static batch

    def __init__(self):
        self.placed_last = False  # set by inject_recorders_after_warpers: this recorder runs after every warper
        self._prompt_width: int | None = None  # P, the width of the first step's input_ids
        self._width: int | None = None  # width of the last step's input_ids
        self._pending: torch.Tensor | None = None  # [B, V] the last step's final scores
        self._steps: list[torch.Tensor] = []  # one [B] per step before it

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        width = input_ids.size(1)
        if self._width is None:
            self._prompt_width = width
        elif width != self._width + 1:
            raise InputError(
                f"SampledLogprobRecorder saw input_ids of width {width} after {self._width}: it was reused across "
                "generate calls. Build a new one per call."
            )
        self._width = width
        if self._pending is not None:
            self._steps.append(processed_logprob(self._pending, input_ids[:, -1]))  # [B]
        self._pending = scores  # [B, V], dropped at the next step
        return scores

    def logprobs(self, sequences: torch.Tensor) -> torch.Tensor:
        """``[B, C]`` for the ``sequences`` ``[B, P + C]`` that ``generate`` returned."""
        if self._prompt_width is None:  # generate sampled nothing
            return torch.zeros(sequences.size(0), 0, device=sequences.device)
        if not self.placed_last:
            raise InvariantError(
                "I5", "SampledLogprobRecorder ran before transformers' temperature/top-k/top-p warpers, so it saw "
                "other scores than the sampler's. Call generate inside "
                "grpotrl.trainers._intercept.inject_recorders_after_warpers(model); if "
                "you did, transformers no longer builds its processor list in GenerationMixin._get_logits_processor."
            )
        tokens = sequences[:, self._prompt_width:]  # [B, C]
        if self._pending is not None and len(self._steps) < tokens.size(1):
            self._steps.append(processed_logprob(self._pending, tokens[:, len(self._steps)]))  # [B]
            self._pending = None
        if len(self._steps) < tokens.size(1):
            raise InputError(
                f"SampledLogprobRecorder saw {len(self._steps) + (self._pending is not None)} generation steps, but "
                f"the sequences hold {tokens.size(1)} completion columns after P={self._prompt_width}. Pass the "
                "sequences of the generate call the recorder ran in."
            )
        # generate may run steps that it then undoes (transformers' DeferredStopCheck): always the last ones
        return torch.stack(self._steps[: tokens.size(1)], dim=1) if tokens.size(1) else tokens[:, :0].float()  # [B, C]


def generation_extras(args, prompt_width: int, stop_ids: list[int]) -> dict:
    """Keyword arguments a trainer injects into a ``generate`` call on a batch of prompt width
    ``prompt_width``: the I6 processors ``args`` asks for, and a recorder of the sampler's own
    logprobs whenever the sampler's distribution can differ from the trainer's (one number per
    sampled token, not ``output_scores``' ``[B, V]`` per step)."""
    processors = build_processors(prompt_width, args.presence_penalty, args.frequency_penalty,
                                  args.repetition_penalty, args.min_new_tokens, stop_ids)
    if processors or args.hf_importance_sampling_correction:
        processors.append(SampledLogprobRecorder())  # runs after the warpers: inject_recorders_after_warpers
    return {"logits_processor": processors} if processors else {}


def recorded_logprobs(call: dict, completion_ids: list[list[int]]) -> list[list[float]] | None:
    """The sampler's own logprobs per completion token from a recorded ``generate`` call
    (``trainers._intercept.record_generate``) whose injected processors held a recorder; else None."""
    recorder = next((p for p in call["extra"].get("logits_processor", []) if isinstance(p, SampledLogprobRecorder)),
                    None)
    if recorder is None:
        return None
    lp = recorder.logprobs(call["output"])  # [B, C]
    return [lp[i, : len(c)].tolist() for i, c in enumerate(completion_ids)]

