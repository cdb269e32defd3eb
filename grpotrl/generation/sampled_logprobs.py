"""The sampler's own logprobs (I5), and what a trainer injects into each ``generate`` call.

With ``do_sample=True``, ``generate`` appends temperature, top-k, top-p and min-p to the
processor list it was given, after grpotrl's I6 processors (``grpotrl.generation.processors``), and samples
from ``softmax`` of what the whole list returns (transformers 5.23,
``GenerationMixin._get_logits_processor`` and ``_sample``). ``SampledLogprobRecorder`` keeps
``log_softmax`` of that tensor at the sampled token, one number per row and step, as generation
goes: inside ``trainers._intercept.inject_recorders_after_warpers(model)`` it runs last, after the
warpers. Nothing of size ``[B, V]`` is kept beyond the step after it was made, so memory is
O(B x V), not the O(B x C x V) of ``generate(output_scores=True)``, whose ``scores`` hold the
same tensors (``sampler_logprobs`` reads those; ``tests/generation/test_processors.py`` checks both against
a real ``generate``). ``generation_extras`` builds a call's processors and recorder;
``recorded_logprobs`` reads the recorder back from a recorded call.

**Truncated sampling (trl#6789).** With top-k / top-p / min-p (and transformers'
other truncation warpers) the sampler draws from ``q_trunc = softmax(S)`` renormalised over the kept
set ``K``, where ``S`` are the scores after every processor and temperature, while the trainer scores
the full softmax. Their ratio ``pi / q_trunc`` at a kept token is ``pi / q`` times the kept mass
``m = sum_{j in K} softmax(S)_j``, so at the same weights the importance ratio's mean is the kept mass
(0.896 at top_p 0.8 in trl#6789), not 1: a uniform shrink of every advantage by ``m``, larger where the
policy is uncertain, which no drift between sampler and trainer caused. grpotrl therefore records
both, and by default (``truncated_sampling_correction``) hands the trainer the sampler's logprob under
the **full** softmax of ``S``: ``log q_trunc(x) + log m = log_softmax(S)[x]``. The alternative, scoring
the trainer under the same truncation, would need the kept set of every token ([B, C, V]) at loss
time and would change the loss's gradient (``log pi - log pi(K)``); correcting the sampler's side
is O(B) per step and leaves the loss as TRL computes it. The ratio then measures what it is for
(the policy moved, or the sampler computes something else) and is 1 at the same weights. The
truncation itself stays a choice of the sampling procedure, logged as ``sampling/kept_mass/mean``.
TRL's vLLM path is left as it is: vLLM runs with ``logprobs_mode="processed_logprobs"``, i.e. the
logprobs of the truncated, renormalised distribution, so there the ratio's mean is the kept mass.

To measure the causes of a sampler/trainer gap, ``arrange_processors`` (called by
``trainers._intercept.inject_recorders_after_warpers``) also puts two taps in ``generate``'s list: one
before every processor (the model's raw logits ``R``) and one before the first truncation warper
(``S``), and notes the temperature the sampler ran at and the processors it ran. Per sampled token
the recorder keeps the truncated logprob, ``log m`` (``S`` over the set the final scores left finite)
and ``log_softmax(R / T_sampler)[x]`` (the model alone, no processor); ``recorded_measures`` returns them.

The recorder's and the taps' ``__call__`` read nothing on the host (shapes only: no ``.item()``, ``.tolist()``
or value-dependent indexing), so they queue device work only inside ``generate``'s loop; ``logprobs``
and ``measures`` run after it. Where ``generate`` runs a step it then undoes (transformers'
``DeferredStopCheck``, which the compiled rollout turns on on CUDA), the recorder keeps only the
columns of the sequences returned.

Letters: B rows, P padded prompt width, C completion width, V vocabulary.
"""

from __future__ import annotations

import math  # noqa: F401  (the doctests use math.inf)
from collections.abc import Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper
from transformers.generation.logits_process import (EpsilonLogitsWarper, EtaLogitsWarper, MinPLogitsWarper,
                                                    TopHLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
                                                    TypicalLogitsWarper)

from ..errors import InputError, InvariantError
from . import processors as own_processors
from .processors import check_prompt_width, build_processors

# transformers' warpers that keep a subset of the vocabulary and set the rest to -inf (5.23, _get_logits_processor)
TRUNCATION_WARPERS = (TopHLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
                      EpsilonLogitsWarper, EtaLogitsWarper)


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
    meaningless (maybe ``-inf``): select them with the completion mask. Each row must stay one completion
    from the first step to the sequences returned, as in transformers' sampling loop: ``logprobs`` compares
    the tokens it saw each row take with the row returned, and refuses beam search (rows reordered at each
    step, the best beams returned), where no row has a sampler logprob of its own.

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
        self.temperature = 1.0  # the sampler's, from its TemperatureLogitsWarper(s) (arrange_processors)
        self.processors: list[str] = []  # class names of the processors other than temperature and truncation
        self.truncation: list[str] = []  # class names of the truncation warpers
        self.own_processors: list[str] = []  # of ``processors``, grpotrl's own (I6: penalties, min_new_tokens)
        self.scores_are_raw_over_t = False  # no processor but at most one temperature warper: W is R / T itself
        self._prompt_width: int | None = None  # P, the width of the first step's input_ids
        self._width: int | None = None  # width of the last step's input_ids
        self._pending: torch.Tensor | None = None  # [B, V] the last step's final scores
        self.raw: torch.Tensor | None = None  # [B, V] this step's scores before any processor (a _Tap sets it)
        self.untruncated: torch.Tensor | None = None  # [B, V] this step's scores before truncation (a _Tap)
        self._pending_raw: torch.Tensor | None = None  # [B, V] R of the last step (generate holds it too)
        self._pending_lse: tuple | None = None  # [B] x 3: logsumexp of W, log kept mass, logsumexp(R / T)
        self._steps: list[torch.Tensor] = []  # one [B] per step before it: truncated logprob
        self._tokens: list[torch.Tensor] = []  # [B] per step before it: the token each row took, as input_ids showed
        self._log_mass: list[torch.Tensor] = []  # [B] log kept mass per step (0 without truncation)
        self._raw_steps: list[torch.Tensor] = []  # [B] log_softmax(R / T_sampler)[token] per step

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
            self._tokens.append(input_ids[:, -1].clone())  # a view would keep each step's input_ids alive
            self._keep(input_ids[:, -1])
        # this step's [B] normalisers now, so that no [B, V] beyond what generate holds itself (the raw logits
        # R and the final scores W, until its next step) outlives the step: S is let go here
        w = scores.float()  # [B, V]
        lse_w = torch.logsumexp(w, dim=-1)  # [B]
        log_mass = torch.zeros_like(lse_w)  # [B]
        if self.untruncated is not None:
            s = self.untruncated.float()  # [B, V]
            log_mass = torch.logsumexp(s.masked_fill(~torch.isfinite(w), -math.inf), dim=-1) \
                - torch.logsumexp(s, dim=-1)  # [B] log of the full softmax's mass over the kept set
        if self.raw is None:
            lse_raw = None
        elif self.scores_are_raw_over_t:  # W = R / T, by the one temperature warper: the same [B] numbers
            lse_raw = lse_w
        else:
            lse_raw = torch.logsumexp(self.raw.float() / self.temperature, dim=-1)  # [B]
        self._pending = scores  # [B, V], dropped at the next step
        self._pending_raw, self._pending_lse = self.raw, (lse_w, log_mass, lse_raw)
        self.raw = self.untruncated = None
        return scores

    def _keep(self, tokens: torch.Tensor) -> None:
        """The pending step's numbers at ``tokens`` [B], then lets its scores go."""
        lse_w, log_mass, lse_raw = self._pending_lse
        trunc = self._pending.float().gather(1, tokens[:, None]).squeeze(1) - lse_w  # [B]
        raw = trunc + log_mass if lse_raw is None else \
            self._pending_raw.float().gather(1, tokens[:, None]).squeeze(1) / self.temperature - lse_raw  # [B]
        self._steps.append(trunc)
        self._log_mass.append(log_mass)
        self._raw_steps.append(raw)
        self._pending = self._pending_raw = self._pending_lse = None

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
        self._check_rows(tokens)
        if self._pending is not None and len(self._steps) < tokens.size(1):
            self._keep(tokens[:, len(self._steps)])
        if len(self._steps) < tokens.size(1):
            raise InputError(
                f"SampledLogprobRecorder saw {len(self._steps) + (self._pending is not None)} generation steps, but "
                f"the sequences hold {tokens.size(1)} completion columns after P={self._prompt_width}. Pass the "
                "sequences of the generate call the recorder ran in."
            )
        # generate may run steps that it then undoes (transformers' DeferredStopCheck): always the last ones
        return torch.stack(self._steps[: tokens.size(1)], dim=1) if tokens.size(1) else tokens[:, :0].float()  # [B, C]

    def _check_rows(self, tokens: torch.Tensor) -> None:
        """``InputError`` unless row ``b`` of the completion ``tokens`` ``[B, C]`` is the row whose tokens the
        recorder saw step by step (its numbers are then that row's): beam search keeps ``num_beams`` rows per
        completion, reorders them at every step and returns the best, so the rows differ in number or tokens."""
        rows = (self._pending if self._pending is not None else self._steps[0]).size(0)
        seen = torch.stack(self._tokens, dim=1) if self._tokens else tokens[:rows, :0]  # [B', t]
        n = min(seen.size(1), tokens.size(1))  # the steps generate undid (DeferredStopCheck) are the last ones
        if rows != tokens.size(0) or not torch.equal(seen[:, :n], tokens[:, :n]):
            raise InputError(
                f"SampledLogprobRecorder recorded {rows} rows, but generate returned {tokens.size(0)} completions "
                "that are not those rows token by token: generate selected or reordered rows, as beam search "
                "(num_beams > 1, in generation_kwargs or the model's generation_config.json) does at every step. "
                "Beam sampling draws each token from all beams' accumulated scores, so no completion has a "
                "sampler logprob of its own. Generate with num_beams=1."
            )

    def measures(self, sequences: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per sampled token ``[B, C]``: ``truncated`` (= ``logprobs``), ``log_kept_mass`` (log of the full
        softmax's mass over the set the truncation warpers kept; 0 without them) and ``raw``
        (``log_softmax(R / T_sampler)[token]``: the model's logits alone, no processor)."""
        truncated = self.logprobs(sequences)  # [B, C]
        C = truncated.size(1)
        if not C:
            return {"truncated": truncated, "log_kept_mass": truncated, "raw": truncated}
        return {"truncated": truncated, "log_kept_mass": torch.stack(self._log_mass[:C], dim=1),
                "raw": torch.stack(self._raw_steps[:C], dim=1)}


class _Tap(LogitsProcessor):
    """Hands its recorder a reference to the scores at its place in ``generate``'s list (``slot``: 'raw'
    or 'untruncated'), unchanged. transformers' processors and warpers (5.23) return new tensors
    rather than writing into their input, so the reference still holds these scores at the next step."""

    supports_continuous_batching = False

    def __init__(self, recorder: "SampledLogprobRecorder", slot: str):
        self.recorder, self.slot = recorder, slot

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        setattr(self.recorder, self.slot, scores)
        return scores


def arrange_processors(processors) -> LogitsProcessorList:
    """``generate``'s processor list with each ``SampledLogprobRecorder`` moved last (after every warper:
    on the scores it samples from), a tap of the raw logits first and a tap before the first truncation
    warper; each recorder notes the sampler's temperature (the product of the ``TemperatureLogitsWarper``
    values, 1.0 without one) and the class names of the other processors and of the truncation warpers."""
    recorders = [p for p in processors if isinstance(p, SampledLogprobRecorder)]
    rest = [p for p in processors if not isinstance(p, (SampledLogprobRecorder, _Tap))]
    if not recorders:
        return LogitsProcessorList(rest)
    cut = next((i for i, p in enumerate(rest) if isinstance(p, TRUNCATION_WARPERS)), None)
    temperature = math.prod(float(p.temperature) for p in rest if isinstance(p, TemperatureLogitsWarper))
    for r in recorders:
        r.placed_last, r.temperature = True, temperature
        r.truncation = [type(p).__name__ for p in rest if isinstance(p, TRUNCATION_WARPERS)]
        r.processors = [type(p).__name__ for p in rest if not isinstance(p, (*TRUNCATION_WARPERS,
                                                                              TemperatureLogitsWarper))]
        r.own_processors = [type(p).__name__ for p in rest if isinstance(p, own_processors._ResponseOnly)]
        r.scores_are_raw_over_t = not r.processors and not r.truncation and \
            sum(isinstance(p, TemperatureLogitsWarper) for p in rest) <= 1
    head = [_Tap(r, "raw") for r in recorders]
    mid = [_Tap(r, "untruncated") for r in recorders] if cut is not None else []
    cut = len(rest) if cut is None else cut
    return LogitsProcessorList(head + rest[:cut] + mid + rest[cut:] + recorders)


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


def _recorder(call: dict) -> SampledLogprobRecorder | None:
    return next((p for p in call["extra"].get("logits_processor", []) if isinstance(p, SampledLogprobRecorder)), None)


def recorded_logprobs(call: dict, completion_ids: list[list[int]], full_softmax: bool = True) -> list[list[float]] | None:
    """The sampler's own logprobs per completion token from a recorded ``generate`` call
    (``trainers._intercept.record_generate``) whose injected processors held a recorder; else None.
    ``full_softmax``: under the full softmax of the sampler's processed scores (the truncated logprob
    plus the log kept mass, module docstring); else of the truncated, renormalised distribution."""
    recorder = _recorder(call)
    if recorder is None:
        return None
    m = recorder.measures(call["output"])  # [B, C] each
    lp = m["truncated"] + m["log_kept_mass"] if full_softmax else m["truncated"]  # [B, C]
    return [lp[i, : len(c)].tolist() for i, c in enumerate(completion_ids)]


def recorded_measures(call: dict) -> dict | None:
    """What the recorder of a recorded ``generate`` call measured, for the sampler-gap gate's causes:
    ``log_kept_mass`` and ``raw`` ``[B, C]`` (``SampledLogprobRecorder.measures``), the sampler's
    ``temperature``, and the class names of its ``processors`` and ``truncation`` warpers; None
    without a recorder."""
    recorder = _recorder(call)
    if recorder is None:
        return None
    m = recorder.measures(call["output"])
    return {"log_kept_mass": m["log_kept_mass"], "raw": m["raw"], "temperature": recorder.temperature,
            "processors": list(recorder.processors), "truncation": list(recorder.truncation),
            "own_processors": list(recorder.own_processors)}

