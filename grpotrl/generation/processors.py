"""Response-only penalties and stop-token suppression as ``transformers.LogitsProcessor``s.

Letters: B rows, P padded prompt width (prompts are left-padded), G tokens generated so far,
V vocabulary, C completion width (``G`` at the end of ``generate``).

INVARIANT I6: presence, frequency and repetition penalties count only ``input_ids[:, P:]``,
the tokens generated so far in each row, never the prompt or its left padding (counted over the prompt,
twenty " the" in the prompt and a 0.4 frequency penalty put " the" 8 logits down, so EOS,
never in that prompt, came out ~3000x likelier and answers were one token long). Because
prompts are left-padded, every row's response starts at column ``P`` whatever its prompt
length, so one integer is enough. transformers' own ``RepetitionPenaltyLogitsProcessor``, as
``generate`` builds it from ``repetition_penalty``, skips the padding but counts the prompt.

Each processor takes ``prompt_width`` = ``input_ids.shape[1]`` of the batch handed to
``generate``: build them per ``generate`` call (``build_processors``). ``__call__`` never
modifies its inputs; it returns new scores, or ``scores`` itself when it has nothing to do.
The one piece of state is ``MinNewTokensProcessor.triggered``, the per-row record the
trigger-rate metric needs. The sampler's own logprobs (I5), which ``generate`` takes with
these processors, are recorded by ``grpotrl.generation.sampled_logprobs``.

The penalties compute in fp32 (or the scores' dtype where wider) and round to the scores' dtype once, at the
end: in bf16, PyTorch rounds the penalty of ``logit - penalty`` to bf16 first (0.3 to 0.30078125: 200 repeats at
0.3 would move a logit by 60.16, not 60) and a count above 256 is not an integer. Only the generated ids'
logits are touched (gathered, penalised, scattered back); every other logit is returned as it came.

No ``__call__`` here reads a device value on the host (no ``.item()``, ``bool(tensor)``, ``.tolist()``
or indexing by a tensor's values; the stop ids reach the device once per call): inside ``generate``'s
loop they only queue device work, which the compiled rollout's deferred stop check relies on
(``generation.compiled_rollout``). ``trigger_count`` / ``trigger_rate`` read the device, after ``generate``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from ..errors import InputError

logger = logging.getLogger(__name__)


def check_prompt_width(prompt_width) -> int:
    if isinstance(prompt_width, bool) or not isinstance(prompt_width, int) or prompt_width < 0:
        raise InputError(
            f"prompt_width must be an int >= 0, got {prompt_width!r}. Pass the padded prompt width P = "
            "input_ids.shape[1] of the left-padded batch given to generate."
        )
    return prompt_width


def _check_number(name: str, value, low: float, high: float, low_open: bool = False, hint: str = "") -> float:
    ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok_type and math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if math.isfinite(high) else "")
        raise InputError(f"{name} must be a finite number {bound}, got {value!r}. {hint}".rstrip())
    return float(value)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype the penalties compute in: fp32, or ``dtype`` where it is wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def generated_counts(input_ids: torch.Tensor, prompt_width: int, vocab_size: int,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """How often each id occurs in ``input_ids[:, P:]``, per row: ``[B, V]``.

    >>> ids = torch.tensor([[2, 2, 5, 7, 7, 3],    # P=3: prompt [2, 2, 5] (left pad 2 = eos), generated [7, 7, 3]
    ...                     [5, 5, 5, 3, 2, 2]])   # generated [3, 2, 2]: stopped on 2, then padded with 2
    >>> generated_counts(ids, prompt_width=3, vocab_size=8).tolist()
    [[0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 2.0], [0.0, 0.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0]]
    """
    generated = input_ids[:, prompt_width:]  # [B, G]
    counts = torch.zeros(input_ids.size(0), vocab_size, dtype=dtype, device=input_ids.device)  # [B, V]
    return counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=dtype))  # [B, V]


class _ResponseOnly(LogitsProcessor):
    supports_continuous_batching = False  # needs the padded prompt width of a static batch

    def __init__(self, prompt_width: int):
        self.prompt_width = check_prompt_width(prompt_width)

    def _generated(self, input_ids: torch.Tensor) -> int:
        """G, the number of generated tokens in every row (a Python int: no device sync)."""
        if input_ids.size(1) < self.prompt_width:
            raise InputError(
                f"{type(self).__name__} was built with prompt_width={self.prompt_width} but generate passed "
                f"input_ids of width {input_ids.size(1)}. Build the processors per generate call with "
                "prompt_width = input_ids.shape[1] of that call's padded prompts."
            )
        return input_ids.size(1) - self.prompt_width


class PresencePenaltyProcessor(_ResponseOnly):
    """OpenAI presence penalty over the response: ``logit[j] -= penalty * (count_j > 0)``.

    ``penalty`` in [-2, 2], as OpenAI and vLLM accept (negative encourages repetition).

    >>> ids = torch.tensor([[9, 1, 1, 3]])  # P=2: prompt [9, 1], generated [1, 3]
    >>> PresencePenaltyProcessor(0.5, prompt_width=2)(ids, torch.zeros(1, 10)).tolist()[0][:4]
    [0.0, -0.5, 0.0, -0.5]
    """

    def __init__(self, penalty: float, prompt_width: int):
        super().__init__(prompt_width)
        self.penalty = _check_number("presence_penalty", penalty, -2.0, 2.0,
                                     hint="OpenAI and vLLM accept [-2, 2]; 0 turns it off.")

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if self._generated(input_ids) == 0:
            return scores
        generated = input_ids[:, self.prompt_width:]  # [B, G]
        picked = scores.gather(1, generated).to(_wide(scores.dtype)) - self.penalty  # [B, G]
        # an id generated twice writes the same value twice: penalised once
        return scores.scatter(1, generated, picked.to(scores.dtype))  # [B, V]


class FrequencyPenaltyProcessor(_ResponseOnly):
    """OpenAI frequency penalty over the response: ``logit[j] -= penalty * count_j``.

    ``penalty`` in [-2, 2], as OpenAI and vLLM accept. ``count_j`` is counted once (``generated_counts``, exact
    integers in fp32) and each generated id's logit moves once, by the product, in fp32 (module docstring): 1000
    repeats of a logit 10 at penalty 0.3 give -290 exactly (1000 subtractions of 0.3, each rounded, give -290.00046).
    vLLM computes the same in fp32 (its sampler's logits are fp32, its counts integers); transformers has no
    frequency penalty.

    >>> ids = torch.tensor([[9, 1, 1, 3]])  # P=2: prompt [9, 1], generated [1, 3]
    >>> FrequencyPenaltyProcessor(0.5, prompt_width=1)(ids, torch.zeros(1, 10)).tolist()[0][:4]  # P=1: [1, 1, 3]
    [0.0, -1.0, 0.0, -0.5]
    """

    def __init__(self, penalty: float, prompt_width: int):
        super().__init__(prompt_width)
        self.penalty = _check_number("frequency_penalty", penalty, -2.0, 2.0,
                                     hint="OpenAI and vLLM accept [-2, 2]; 0 turns it off.")

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if self._generated(input_ids) == 0:
            return scores
        generated = input_ids[:, self.prompt_width:]  # [B, G]
        wide = _wide(scores.dtype)
        count = generated_counts(input_ids, self.prompt_width, scores.size(-1), wide).gather(1, generated)  # [B, G]
        picked = scores.gather(1, generated).to(wide) - self.penalty * count  # [B, G]
        # an id generated twice writes the same value twice: moved once, by penalty * count
        return scores.scatter(1, generated, picked.to(scores.dtype))  # [B, V]


class RepetitionPenaltyProcessor(_ResponseOnly):
    """HF repetition penalty over the response: for every id generated so far, a positive logit
    is divided by ``penalty`` and a negative one multiplied (``penalty > 1`` discourages).

    >>> ids = torch.tensor([[0, 1, 0]])  # P=2: generated [0]; id 1 is prompt only
    >>> RepetitionPenaltyProcessor(2.0, prompt_width=2)(ids, torch.tensor([[-1.0, 4.0, 3.0]])).tolist()
    [[-2.0, 4.0, 3.0]]
    """

    def __init__(self, penalty: float, prompt_width: int):
        super().__init__(prompt_width)
        self.penalty = _check_number("repetition_penalty", penalty, 0.0, math.inf, low_open=True,
                                     hint="1.0 turns it off; > 1 discourages repeats.")

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if self._generated(input_ids) == 0:
            return scores
        generated = input_ids[:, self.prompt_width:]  # [B, G]
        picked = scores.gather(1, generated).to(_wide(scores.dtype))  # [B, G]
        picked = torch.where(picked < 0, picked * self.penalty, picked / self.penalty)  # [B, G]
        return scores.scatter(1, generated, picked.to(scores.dtype))  # [B, V], once per distinct id


class MinNewTokensProcessor(_ResponseOnly):
    """Blocks EVERY id in ``stop_ids`` (logit ``-inf``) while fewer than ``min_new_tokens`` tokens
    have been generated (I6); from the k-th generated token on, scores pass unchanged.

    ``stop_ids`` must hold every id that ends a response (``grpotrl.chat.templates.stop_token_ids``:
    eos, the template's end-of-turn, every id of ``generation_config.eos_token_id``); an id
    left out is neither blocked nor counted.

    Trigger record, for the min-new-tokens trigger rate: ``triggered`` (``[B]`` bool, None
    before the first blocked step) marks each row where, at some blocked step, a stop id had
    the highest incoming score (ties included), i.e. the row's mode was "stop here": greedy
    decoding would have ended the response. Which id is on top does not change under
    temperature, top-k, top-p or min-p, which run after this processor, so the record does not
    depend on the sampling knobs; put this processor after the penalties so it sees the
    penalised scores. A row whose stop probability was high but not the highest is not
    counted. ``trigger_rate`` is the share of rows marked. This OR-update is the only state any
    processor here keeps: build a new one per ``generate`` call.

    >>> p = MinNewTokensProcessor(2, stop_ids=[0, 3], prompt_width=1)
    >>> # G=0 < 2: both stop ids blocked; id 0 had the top score, so the row triggered
    >>> p(torch.tensor([[5]]), torch.tensor([[9.0, 1.0, 1.0, 1.0]])).tolist()
    [[-inf, 1.0, 1.0, -inf]]
    >>> p(torch.tensor([[5, 1, 1]]), torch.tensor([[9.0, 1.0, 1.0, 1.0]])).tolist()  # G=2: free
    [[9.0, 1.0, 1.0, 1.0]]
    >>> p.trigger_rate
    1.0
    """

    def __init__(self, min_new_tokens: int, stop_ids: int | Iterable[int] | torch.Tensor, prompt_width: int):
        super().__init__(prompt_width)
        if isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, int) or min_new_tokens < 1:
            raise InputError(
                f"min_new_tokens must be an int >= 1, got {min_new_tokens!r}. To turn it off, leave the "
                "processor out (build_processors does so for min_new_tokens=0)."
            )
        if isinstance(stop_ids, torch.Tensor):
            stop_ids = stop_ids.flatten().tolist()
        elif isinstance(stop_ids, int) and not isinstance(stop_ids, bool):
            stop_ids = [stop_ids]
        ids = list(stop_ids) if isinstance(stop_ids, Iterable) else None
        if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise InputError(
                f"stop_ids must be a non-empty list of token ids >= 0, got {stop_ids!r}. Pass every id that ends "
                "a response: grpotrl.chat.templates.stop_token_ids(tokenizer, generation_config)."
            )
        self.min_new_tokens = min_new_tokens
        self.stop_ids = list(dict.fromkeys(ids))
        self._stop = torch.tensor(self.stop_ids, dtype=torch.long)  # [S]
        self._stop_on: dict[torch.device, torch.Tensor] = {}  # device -> _stop there
        self.triggered: torch.Tensor | None = None  # [B] bool

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if self._generated(input_ids) >= self.min_new_tokens:
            return scores
        if max(self.stop_ids) >= scores.size(-1):
            raise InputError(
                f"stop_ids {self.stop_ids} hold an id >= the vocabulary size {scores.size(-1)} of the scores. "
                "Pass the stop ids of this model's tokenizer."
            )
        stop = self._stop_on.get(scores.device)
        if stop is None:  # copied to the scores' device once per call, not every step (a copy waits on the host)
            stop = self._stop_on[scores.device] = self._stop.to(scores.device)  # [S]
        hit = scores.index_select(-1, stop).amax(dim=-1) >= scores.amax(dim=-1)  # [B]: a stop id is the top
        if self.triggered is None:
            self.triggered = hit
        elif self.triggered.shape != hit.shape:
            raise InputError(
                f"MinNewTokensProcessor saw {hit.numel()} rows after {self.triggered.numel()}: it was reused "
                "across generate calls. Build a new one per call (build_processors)."
            )
        else:
            self.triggered = self.triggered | hit
        return scores.index_fill(-1, stop, -math.inf)  # [B, V]

    @property
    def trigger_count(self) -> int:
        """Rows marked in ``triggered`` (0 when nothing was blocked yet)."""
        return 0 if self.triggered is None else int(self.triggered.sum())

    @property
    def trigger_rate(self) -> float:
        """Share of rows marked in ``triggered`` (0.0 when nothing was blocked yet)."""
        return 0.0 if self.triggered is None else self.triggered.float().mean().item()


def build_processors(
    prompt_width: int,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    min_new_tokens: int = 0,
    stop_ids: Sequence[int] | None = None,
) -> LogitsProcessorList:
    """The active processors for one ``generate`` call, penalties first, then min-new-tokens.

    Pass the list as ``generate(..., logits_processor=...)`` and keep ``generation_config``'s
    ``repetition_penalty`` at 1.0 and ``min_new_tokens`` unset: ``generate`` would otherwise add
    its own prompt-counting repetition penalty on top of this one.

    >>> [type(p).__name__ for p in build_processors(7, presence_penalty=0.3, min_new_tokens=2, stop_ids=[2])]
    ['PresencePenaltyProcessor', 'MinNewTokensProcessor']
    >>> len(build_processors(7))
    0
    """
    processors = LogitsProcessorList()
    if repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyProcessor(repetition_penalty, prompt_width))
    if presence_penalty != 0.0:
        processors.append(PresencePenaltyProcessor(presence_penalty, prompt_width))
    if frequency_penalty != 0.0:
        processors.append(FrequencyPenaltyProcessor(frequency_penalty, prompt_width))
    if min_new_tokens != 0:
        processors.append(MinNewTokensProcessor(min_new_tokens, stop_ids if stop_ids is not None else [],
                                                prompt_width))
    return processors


def min_new_tokens_fired(call: dict | None) -> int:
    """How often the ``MinNewTokensProcessor`` injected into a recorded ``generate`` call fired (0 if none)."""
    return next((p.trigger_count for p in reversed((call or {}).get("extra", {}).get("logits_processor", []))
                 if isinstance(p, MinNewTokensProcessor)), 0)


def vllm_sampling(args, stop_ids: list[int], given: dict | None = None) -> dict:
    """vLLM's sampling keyword arguments: ``given`` (TRL's ``generation_kwargs``) with the I6 settings vLLM takes and
    every stop id. Presence and frequency penalties count output tokens only in vLLM, so they pass through; its
    repetition penalty counts the prompt, which I6 rules out: said, not passed. ``stop_token_ids`` adds ``stop_ids``
    (``grpotrl.chat.templates.stop_token_ids``: the template's end-of-turn among them) to any given: vLLM stops on the
    tokenizer's and the model's eos ids only, and blocks only its stop ids under ``min_tokens``.

    >>> args = type("Args", (), {"repetition_penalty": 1.0, "presence_penalty": 0.5, "frequency_penalty": 0.0,
    ...                          "min_new_tokens": 3})()
    >>> vllm_sampling(args, [2, 7], {"top_k": 5, "stop_token_ids": [9, 2]})
    {'top_k': 5, 'stop_token_ids': [9, 2, 7], 'presence_penalty': 0.5, 'min_tokens': 3}
    """
    if args.repetition_penalty != 1.0:
        logger.warning("vLLM's repetition_penalty counts prompt tokens too (INVARIANT I6); prefer "
                       "presence_penalty / frequency_penalty, which vLLM applies to output tokens only.")
    given = dict(given or {})
    stops = list(dict.fromkeys([*(given.get("stop_token_ids") or []), *stop_ids]))
    return {**given, "stop_token_ids": stops,
            **{k: v for k, v in (("presence_penalty", args.presence_penalty),
                                 ("frequency_penalty", args.frequency_penalty), ("min_tokens", args.min_new_tokens))
               if v}}
