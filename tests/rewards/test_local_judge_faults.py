"""Judges whose model or server fails them mid-run (I8): a row without a score is ``None`` with a reason, counted
and logged, never an exception out of the reward function and never a made-up score.

``LocalJudge``, on the tiny real models of conftest (context: ``max_position_embeddings`` / ``n_positions`` 512):

* a judge input longer than the model's context, less the verdict's token, is not cut but ``None`` with reason
  ``too_long`` (a cut completion may change the verdict); one token shorter is scored;
* an exception raised inside the model's forward (out of memory, raised by a forward hook of a real layer)
  leaves that forward's rows ``None`` with reason ``model_error``; the other forwards' rows keep their scores,
  and ``max_failed_batches`` calls in a row without a score raise ``JudgeError``, as for ``HttpJudge``.

``HttpJudge``, on a scripted loopback server:

* a 429's or 503's ``Retry-After`` is honoured in seconds and as an HTTP date (counted from the response's
  ``Date`` when it has one);
* a row's attempts and waits end within ``(max_retries + 1) * timeout``, a call's within ``ceil(rows /
  max_concurrency)`` times that.
"""

import asyncio
import math
import re
import time
from email.utils import formatdate

import pytest
import torch
from test_judge_faults import ScriptedJudge, completion, judge_call

from grpotrl.errors import InputError
from grpotrl.rewards.judges import LOCAL_FAILURE_REASONS, NOTE_CHARS, HttpJudge, JudgeError, LocalJudge
from grpotrl.rewards.recipe import parse_judges
from grpotrl.rewards.rubrics import FAIRNESS

PROMPT = [{"role": "user", "content": "Describe nurses."}]


def reply(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def local_call(judge, completions):
    metrics, extras = {}, {}
    scores = judge([PROMPT] * len(completions), [reply(c) for c in completions], log_metric=metrics.__setitem__,
                   log_extra=extras.__setitem__)
    return scores, metrics, extras.get(f"judge/{judge.name}")


def load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def input_tokens(judge, text: str) -> int:
    """How many tokens the judge's input for a completion ``text`` is (rubric, prompt, completion, prefill)."""
    return len(judge.tokenizer(judge._texts([PROMPT], [reply(text)], [{}])[0], add_special_tokens=False)["input_ids"])


def words_to_fill(judge, tokens: int) -> str:
    """A completion of repeated words whose judge input is exactly ``tokens`` long."""
    words = 1
    while input_tokens(judge, " ".join(["word"] * words)) < tokens:
        words += 1
    text = " ".join(["word"] * words)
    assert input_tokens(judge, text) == tokens, "each further ' word' is one token for SmolLM2's tokenizer"
    return text


# ---------------------------------------------------------------------------- LocalJudge: context


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gpt2"])
def test_I8_local_judge_input_over_the_context_is_none_with_reason_too_long(fixture, request):
    """512 positions, one for the verdict's token: a 511-token input is scored, a 512-token one is ``too_long``
    (not cut), and a far longer one neither crashes GPT-2's position table nor runs Llama past its context."""
    model, tokenizer = load(request.getfixturevalue(fixture))
    judge = LocalJudge(model, tokenizer, FAIRNESS, batch_size=4)
    fits, over = words_to_fill(judge, 511), words_to_fill(judge, 512)
    scores, metrics, notes = local_call(judge, ["They care for patients.", fits, over, "word " * 2000])
    assert scores[0] is not None and scores[1] is not None and scores[2:] == [None, None]
    assert metrics["judge/local_fairness/failed/too_long"] == 0.5 == metrics["judge/local_fairness/missing_share"]
    assert {r for r in LOCAL_FAILURE_REASONS if metrics[f"judge/local_fairness/failed/{r}"]} == {"too_long"}
    assert "512 tokens" in notes[2] and "over the 511" in notes[2] and "not cut" in notes[2]
    assert "max_completion_length" in notes[2] and judge.failures == {"too_long": 2}
    # The scored rows are what they are alone: the long rows did not change their forward.
    alone, _, _ = local_call(judge, ["They care for patients.", fits])
    torch.testing.assert_close(torch.tensor(alone), torch.tensor(scores[:2]), atol=1e-5, rtol=0)  # fp32
    assert judge.max_input_tokens == 511


def test_I8_local_judge_context_is_the_smaller_of_config_and_tokenizer(tiny_llama):
    model, tokenizer = load(tiny_llama)
    tokenizer.model_max_length = 450
    judge = LocalJudge(model, tokenizer, FAIRNESS)
    scores, metrics, notes = local_call(judge, [words_to_fill(judge, 449), words_to_fill(judge, 450)])
    assert scores[0] is not None and scores[1] is None and "tokenizer.model_max_length = 450" in notes[1]
    assert judge.max_input_tokens == 449


# ---------------------------------------------------------------------------- LocalJudge: forward errors


class OutOfMemoryOnce:
    """A forward pre-hook for a real decoder layer: raises CUDA's out-of-memory error on the calls ``fail``
    names (0-based), as the allocator would there; its message's second line stands for what must not be kept."""

    def __init__(self, fail):
        self.fail, self.calls = set(fail), 0

    def __call__(self, module, args):
        self.calls += 1
        if self.calls - 1 in self.fail:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. " + "x" * 400
                                         + "\nsecond line: not kept")


def test_I8_local_judge_forward_error_gives_none_for_that_forward_only(tiny_llama):
    model, tokenizer = load(tiny_llama)
    texts = ["They care for patients.", "Nurses are always women.", "Anyone can be a nurse.", "They work shifts."]
    clean, _, _ = local_call(LocalJudge(model, tokenizer, FAIRNESS, batch_size=2), texts)
    model.train()  # the judge sets eval for its forwards and gives the mode back, also after an error
    hook = model.model.layers[0].register_forward_pre_hook(OutOfMemoryOnce(fail=[0]))
    try:
        judge = LocalJudge(model, tokenizer, FAIRNESS, batch_size=2)
        scores, metrics, notes = local_call(judge, texts)
    finally:
        hook.remove()
    assert model.training
    assert scores[:2] == [None, None]  # the first forward (rows 0, 1) raised; the second scored
    torch.testing.assert_close(torch.tensor(scores[2:]), torch.tensor(clean[2:]), atol=1e-5, rtol=0)  # fp32
    assert metrics["judge/local_fairness/failed/model_error"] == 0.5 == metrics["judge/local_fairness/missing_share"]
    assert notes[0] == notes[1] and notes[0].startswith("the judge model's forward raised OutOfMemoryError: CUDA")
    assert "lower batch_size (now 2)" in notes[0] and "second line" not in notes[0]
    assert len(notes[0]) < NOTE_CHARS + 300 and judge.last_error == notes[1]


def test_I8_local_judge_stops_after_max_failed_batches_calls_in_a_row_without_a_score(tiny_llama):
    """Calls 0 and 2, 3 raise in every forward; call 1 scores and ends the first run of failures."""
    model, tokenizer = load(tiny_llama)
    judge = LocalJudge(model, tokenizer, FAIRNESS, batch_size=4, max_failed_batches=2)
    hook = model.model.layers[0].register_forward_pre_hook(OutOfMemoryOnce(fail=[0, 2, 3]))
    try:
        assert local_call(judge, ["They care."])[0] == [None]
        assert local_call(judge, ["They care."])[0] != [None]
        assert local_call(judge, ["They care."])[0] == [None]
        with pytest.raises(JudgeError, match=r"local judge 'local_fairness' gave no score for 2 batches in a row "
                                             r".*OutOfMemoryError.*lower batch_size \(now 4\).*max_failed_batches"):
            local_call(judge, ["They care."])
    finally:
        hook.remove()
    assert judge.failures == {"model_error": 3}


def test_local_judge_max_failed_batches_is_a_recipe_setting(tiny_llama):
    spec = parse_judges({"j": {"model_path": tiny_llama, "rubric": "fairness", "max_failed_batches": 0}})["j"]
    assert spec.max_failed_batches == 0 and spec.load("cpu").max_failed_batches == 0
    with pytest.raises(InputError, match=r"judges.j.max_failed_batches must be an integer >= 0"):
        parse_judges({"j": {"model_path": tiny_llama, "rubric": "fairness", "max_failed_batches": -1}})
    with pytest.raises(InputError, match="max_failed_batches must be an integer >= 0; got -1"):
        LocalJudge(*load(tiny_llama), FAIRNESS, max_failed_batches=-1)


# ---------------------------------------------------------------------------- HttpJudge: Retry-After and time


class TimedJudge(ScriptedJudge):
    """``ScriptedJudge`` whose ``answer(request)`` is ``(status, body, headers, delay_s)``: it waits ``delay_s``
    (without blocking the server's loop; a client that hangs up ends it), then answers with those headers; each
    request records when it came."""

    async def _answer(self, request, reader, writer):
        self.requests.append({**request, "fault": None, "t": time.monotonic()})
        status, body, headers, delay = self.answer(request)
        until = time.monotonic() + delay
        while time.monotonic() < until:  # bounded: the delay, or until the client hangs up
            if reader.at_eof():
                return False
            await asyncio.sleep(0.05)
        return await self._send(writer, status, body, headers)


def busy_once(status: int, headers):
    """The first request gets ``status`` with ``headers()``, every later one a verdict."""
    seen = []

    def answer(request):
        seen.append(request)
        if len(seen) == 1:
            return status, b'{"error": "busy"}', headers(), 0.0
        return 200, completion("VERDICT: 4", "stop"), {}, 0.0
    return answer


SERVER_DATE = "Sun, 06 Nov 1994 08:49:37 GMT"  # the server's clock, far from this machine's
RETRY_AFTER = {
    "seconds": lambda: {"Retry-After": "1"},
    "date": lambda: {"Date": SERVER_DATE, "Retry-After": "Sun, 06 Nov 1994 08:49:38 GMT"},  # 1 s on its clock
    "date_no_Date": lambda: {"Retry-After": formatdate(time.time() + 2, usegmt=True)},  # 1-2 s on this one
}


@pytest.mark.parametrize("form", list(RETRY_AFTER))
@pytest.mark.parametrize("status", [429, 503])
def test_I8_retry_after_is_honoured_for_429_and_503_in_seconds_and_as_an_http_date(status, form):
    """The backoff alone would wait at most 0.01 s; the server asked for about 1 s, and gets it."""
    with TimedJudge(busy_once(status, RETRY_AFTER[form])) as server:
        judge = HttpJudge(FAIRNESS, base_url=server.url, model="m", backoff=0.01, max_retries=1, timeout=5.0)
        scores, _, _ = judge_call(judge, ["q"], ["a"])
        gap = server.requests[1]["t"] - server.requests[0]["t"]
    assert scores == [0.75] and len(server.requests) == 2
    assert 0.9 <= gap < 2.5, f"asked again after {gap:.2f} s"


def test_I8_a_retry_after_date_already_past_retries_at_once():
    with TimedJudge(busy_once(503, lambda: {"Retry-After": "Sun, 06 Nov 1994 08:49:37 GMT"})) as server:
        judge = HttpJudge(FAIRNESS, base_url=server.url, model="m", backoff=0.01, max_retries=1, timeout=5.0)
        assert judge_call(judge, ["q"], ["a"])[0] == [0.75]
        assert server.requests[1]["t"] - server.requests[0]["t"] < 0.5


def graded(request) -> str:
    """The completion a judge request grades (the last user message holds it)."""
    import json

    return json.loads(request["body"])["messages"][-1]["content"]


def test_I8_a_rows_retries_and_waits_end_within_max_retries_plus_one_timeouts():
    """Always 429 with Retry-After 1 s; timeout 0.5 s, max_retries 3: a row's bound is 4 * 0.5 = 2 s. Asked at
    0 s and 1 s; a third attempt would come at 2 s, past the bound, so the row ends there with its 429 (the old
    wait-and-retry took 3 s per row). Two rows through one slot: the call within ceil(2 / 1) * 2 s."""
    always = lambda request: (429, b'{"error": "slow down"}', {"Retry-After": "1"}, 0.0)  # noqa: E731
    with TimedJudge(always) as server:
        judge = HttpJudge(FAIRNESS, base_url=server.url, model="m", timeout=0.5, max_retries=3, max_concurrency=1,
                          max_failed_batches=0)
        start = time.monotonic()
        scores, metrics, extras = judge_call(judge, ["q", "q"], ["first answer", "second answer"])
        took = time.monotonic() - start
    bound = (judge.max_retries + 1) * judge.timeout
    assert scores == [None, None] and metrics["judge/fairness/failed/http_status"] == 1.0
    for row in ("first answer", "second answer"):
        times = [r["t"] for r in server.requests if row in graded(r)]
        assert len(times) == 2 and times[-1] - times[0] < bound
    assert took < math.ceil(2 / judge.max_concurrency) * bound
    assert all("not asked again: a wait of 1 s would pass the row's bound" in note for note in extras["judge/fairness"])


def test_I8_a_rows_last_attempt_gets_only_what_is_left_of_its_bound():
    """timeout 1 s, max_retries 1: bound 2 s. A 429 asks for 1.5 s; the retry gets the 0.5 s left, not 1 s, and
    the server (10 s late) times it out at 2 s in all, where the old retry ran to 2.5 s."""
    seen = []

    def answer(request):
        seen.append(request)
        if len(seen) == 1:
            return 429, b'{"error": "slow down"}', {"Retry-After": "1.5"}, 0.0
        return 200, completion("VERDICT: 4", "stop"), {}, 10.0

    with TimedJudge(answer) as server:
        judge = HttpJudge(FAIRNESS, base_url=server.url, model="m", timeout=1.0, max_retries=1)
        start = time.monotonic()
        scores, metrics, extras = judge_call(judge, ["q"], ["a"])
        took = time.monotonic() - start
    assert scores == [None] and metrics["judge/fairness/failed/timeout"] == 1.0
    # the wait and the shortened retry's timeout took at least the 1.5 s asked for; that the retry got only what was
    # left (not a whole 1 s timeout) is what its note says (a wall-clock upper bound would fail on a loaded machine)
    assert took >= 1.5, f"the row took {took:.2f} s"
    assert re.match(r"timeout after 0\.\d+ s \(what was left of the row's bound", extras["judge/fairness"][0])
