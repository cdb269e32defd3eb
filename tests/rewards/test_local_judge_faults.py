"""Judges whose model or server fails them mid-run (I8): a row without a score is ``None`` with a reason, counted
and logged, never an exception out of the reward function and never a made-up score.

``LocalJudge``, on the tiny real models of conftest (context: ``max_position_embeddings`` / ``n_positions`` 512):

* a judge input longer than the model's context, less the verdict's token, is not cut but ``None`` with reason
  ``too_long`` (a cut completion may change the verdict); one token shorter is scored;
* an exception raised inside the model's forward (a device error, raised by a forward hook of a real layer)
  leaves that forward's rows ``None`` with reason ``model_error``; the other forwards' rows keep their scores,
  and ``max_failed_batches`` calls in a row without a score raise ``JudgeError``, as for ``HttpJudge``;
* a forward that runs out of memory (CUDA's error, or the CPU allocator's ``RuntimeError``, planted by a hook that
  raises it on forwards of more than N rows) is asked again at half its rows, down to one; the smaller batch size
  stays, is warned about once, counted (``oom_retries``) and logged (``batch_size``, in TRL's log history too);
  out of memory on one row is ``model_error``;
* a tokenizer without a chat template, or a template that raises on the rubric's messages (Mistral v0.1's
  alternating roles, Gemma's "no system role"), is refused when the judge is built; a template that raises on
  one row's text leaves that row ``None`` with reason ``template_error``, its note without the row's text.

``HttpJudge``, on a scripted loopback server:

* a 429's or 503's ``Retry-After`` is honoured in seconds and as an HTTP date (counted from the response's
  ``Date`` when it has one);
* a row's attempts and waits end within ``(max_retries + 1) * timeout``, a call's within ``ceil(rows /
  max_concurrency)`` times that.
"""

import asyncio
import logging
import math
import re
import time
from email.utils import formatdate

import pytest
import torch
from conftest import arithmetic_prompts
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
    return len(judge.tokenizer(judge._text(PROMPT, reply(text), {}), add_special_tokens=False)["input_ids"])


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


def cuda_out_of_memory():
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. " + "x" * 400
                                  + "\nsecond line: not kept")


def cpu_out_of_memory():  # what torch's CPU allocator raises
    return RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried "
                        "to allocate 8589934592 bytes.")


def device_error():  # an error of the device that is no allocation failure
    return RuntimeError("CUDA error: an illegal memory access was encountered " + "x" * 400
                        + "\nsecond line: not kept")


class RaiseOnCalls:
    """A forward pre-hook for a real decoder layer: raises ``error()`` on the calls ``fail`` names (0-based), as
    the allocator or the device would there; its message's second line stands for what must not be kept."""

    def __init__(self, fail, error=cuda_out_of_memory):
        self.fail, self.error, self.calls = set(fail), error, 0

    def __call__(self, module, args):
        self.calls += 1
        if self.calls - 1 in self.fail:
            raise self.error()


class RaiseOverRows:
    """A forward pre-hook (with keywords) for the judge model itself: raises ``error()`` on a forward of more
    than ``rows`` rows, as an allocator with room for ``rows`` would; records each forward's row count."""

    def __init__(self, rows: int, error=cuda_out_of_memory):
        self.rows, self.error, self.seen = rows, error, []

    def __call__(self, module, args, kwargs):
        self.seen.append(kwargs["input_ids"].shape[0])
        if self.seen[-1] > self.rows:
            raise self.error()


TEXTS = ["They care for patients.", "Nurses are always women.", "Anyone can be a nurse.", "They work shifts.",
         "Men cannot be nurses.", "Nurses are kind.", "Some nurses are men.", "A nurse helps."]


def test_I8_local_judge_forward_error_gives_none_for_that_forward_only(tiny_llama):
    model, tokenizer = load(tiny_llama)
    texts = TEXTS[:4]
    clean, _, _ = local_call(LocalJudge(model, tokenizer, FAIRNESS, batch_size=2), texts)
    model.train()  # the judge sets eval for its forwards and gives the mode back, also after an error
    hook = model.model.layers[0].register_forward_pre_hook(RaiseOnCalls(fail=[0], error=device_error))
    try:
        judge = LocalJudge(model, tokenizer, FAIRNESS, batch_size=2)
        scores, metrics, notes = local_call(judge, texts)
    finally:
        hook.remove()
    assert model.training
    assert scores[:2] == [None, None]  # the first forward (rows 0, 1) raised, and is not asked again; the second scored
    torch.testing.assert_close(torch.tensor(scores[2:]), torch.tensor(clean[2:]), atol=1e-5, rtol=0)  # fp32
    assert metrics["judge/local_fairness/failed/model_error"] == 0.5 == metrics["judge/local_fairness/missing_share"]
    assert metrics["judge/local_fairness/oom_retries"] == 0 and judge.batch_size == 2
    assert notes[0] == notes[1] and notes[0].startswith("the judge model's forward raised RuntimeError: CUDA error")
    assert "its 2 rows are not scored: see the error" in notes[0] and "second line" not in notes[0]
    assert len(notes[0]) < NOTE_CHARS + 300 and judge.last_error == notes[1]


@pytest.mark.parametrize("error", [cuda_out_of_memory, cpu_out_of_memory])
def test_I8_local_judge_out_of_memory_is_asked_again_at_half_the_rows_and_keeps_that_batch_size(error, tiny_llama,
                                                                                                caplog):
    """Room for 2 rows, batch_size 4, 8 rows: the first forward (4 rows) runs out of memory and is asked again as
    two of 2; every later forward has 2 rows, in this call and the next; one warning, one retry counted. The
    scores are those of a judge that never ran out (fp32: batch shape alone moves them by rounding)."""
    model, tokenizer = load(tiny_llama)
    clean, _, _ = local_call(LocalJudge(model, tokenizer, FAIRNESS, batch_size=4), TEXTS)
    planted = RaiseOverRows(2, error)
    hook = model.register_forward_pre_hook(planted, with_kwargs=True)
    try:
        judge = LocalJudge(model, tokenizer, FAIRNESS, batch_size=4)
        with caplog.at_level(logging.WARNING, logger="grpotrl.rewards.judges"):
            scores, metrics, notes = local_call(judge, TEXTS)
            again, metrics_again, _ = local_call(judge, TEXTS)
    finally:
        hook.remove()
    assert None not in scores and None not in again
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(clean), atol=1e-5, rtol=0)  # fp32
    torch.testing.assert_close(torch.tensor(again), torch.tensor(clean), atol=1e-5, rtol=0)
    assert planted.seen == [4] + [2] * 4 + [2] * 4  # 4 rows failed; 8 rows as 4 forwards of 2, twice
    assert metrics["judge/local_fairness/oom_retries"] == 1 and metrics_again["judge/local_fairness/oom_retries"] == 0
    assert judge.batch_size == 2 and judge.oom_retries == 1 and judge.failures == {}
    assert metrics["judge/local_fairness/missing_share"] == 0.0
    warnings = [r.getMessage() for r in caplog.records if "ran out of memory" in r.getMessage()]
    assert warnings == ["LocalJudge 'local_fairness' ran out of memory on a forward of 4 rows: it scores 2 rows per "
                        "forward for the rest of the run (batch_size was 4). To start there next time, set the "
                        "judge's batch_size to 2 (judges.local_fairness.batch_size in a recipe, "
                        "LocalJudge(batch_size=...) in Python)."]


def test_I8_local_judge_logs_its_batch_size_in_force_halved_after_out_of_memory(tiny_llama):
    """``judge/<name>/batch_size`` is the rows per forward once each call is done. Room for 2 rows, batch_size 4:
    a call of 2 rows fits (4 logged, the configured size); a call of 8 runs out on its first forward of 4 and
    scores the rest 2 at a time (2 logged); the next call starts there (2 again)."""
    model, tokenizer = load(tiny_llama)
    planted = RaiseOverRows(2)
    hook = model.register_forward_pre_hook(planted, with_kwargs=True)
    try:
        judge = LocalJudge(model, tokenizer, FAIRNESS, batch_size=4)
        logged = [local_call(judge, texts)[1] for texts in (TEXTS[:2], TEXTS, TEXTS)]
    finally:
        hook.remove()
    assert planted.seen == [2] + [4] + [2] * 4 + [2] * 4
    assert [m["judge/local_fairness/batch_size"] for m in logged] == [4, 2, 2]
    assert [m["judge/local_fairness/oom_retries"] for m in logged] == [0, 1, 0]


def test_I8_local_judge_batch_size_after_out_of_memory_reaches_trls_logs(tiny_llama, grpo_args):
    """The judge as a GRPO reward function (TRL's ``log_metric``): room for 4 rows, batch_size 8, 8 completions a
    step. Step 1's first forward (8 rows) runs out of memory, its rows are scored 4 at a time, and every later
    forward has 4 rows: the run's log history shows ``judge/local_fairness/batch_size`` 4 at both steps, beside
    the retry counted at step 1."""
    import grpotrl

    model, tokenizer = load(tiny_llama)
    planted = RaiseOverRows(4)
    hook = model.register_forward_pre_hook(planted, with_kwargs=True)
    try:
        judge = LocalJudge(model, tokenizer, FAIRNESS, batch_size=8)
        trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=judge, args=grpo_args(max_steps=2),
                                      train_dataset=arithmetic_prompts())
        trainer.train()
    finally:
        hook.remove()
    assert planted.seen == [8, 4, 4, 4, 4]  # step 1: 8 failed, then 2 x 4; step 2: 2 x 4
    logs = [h for h in trainer.state.log_history if "judge/local_fairness/batch_size" in h]
    assert [h["judge/local_fairness/batch_size"] for h in logs] == [4.0, 4.0]
    assert [h["judge/local_fairness/oom_retries"] for h in logs] == [1.0, 0.0]
    assert all(h["judge/local_fairness/missing_share"] == 0.0 for h in logs)


def test_I8_local_judge_out_of_memory_down_to_one_row_gives_none_with_reason_model_error(tiny_llama, caplog):
    """No room for even one row: 4 rows, then 2, then 1 per forward (two retries, a warning each); each row's
    own forward runs out too, and every row is model_error, its note saying a single row did not fit."""
    model, tokenizer = load(tiny_llama)
    planted = RaiseOverRows(0)
    hook = model.register_forward_pre_hook(planted, with_kwargs=True)
    try:
        judge = LocalJudge(model, tokenizer, FAIRNESS, batch_size=4)
        with caplog.at_level(logging.WARNING, logger="grpotrl.rewards.judges"):
            scores, metrics, notes = local_call(judge, TEXTS[:4])
    finally:
        hook.remove()
    assert scores == [None] * 4 and planted.seen == [4, 2, 1, 1, 1, 1]
    assert metrics["judge/local_fairness/failed/model_error"] == 1.0 and judge.failures == {"model_error": 4}
    assert metrics["judge/local_fairness/oom_retries"] == 2 and judge.batch_size == 1
    assert notes[0].startswith("the judge model's forward raised OutOfMemoryError: CUDA out of memory")
    assert "its 1 rows are not scored: it ran out of memory on a single row (batch_size 1)" in notes[0]
    assert "second line" not in notes[0]
    assert sum("ran out of memory" in r.getMessage() for r in caplog.records) == 2


def test_I8_local_judge_stops_after_max_failed_batches_calls_in_a_row_without_a_score(tiny_llama):
    """Calls 0 and 2, 3 raise in every forward; call 1 scores and ends the first run of failures."""
    model, tokenizer = load(tiny_llama)
    judge = LocalJudge(model, tokenizer, FAIRNESS, batch_size=4, max_failed_batches=2)
    hook = model.model.layers[0].register_forward_pre_hook(RaiseOnCalls(fail=[0, 2, 3]))
    try:
        assert local_call(judge, ["They care."])[0] == [None]
        assert local_call(judge, ["They care."])[0] != [None]
        assert local_call(judge, ["They care."])[0] == [None]
        with pytest.raises(JudgeError, match=r"local judge 'local_fairness' gave no score for 2 batches in a row "
                                             r".*OutOfMemoryError.*ran out of memory on a single row "
                                             r"\(batch_size 4\).*max_failed_batches"):
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


# ---------------------------------------------------------------------------- LocalJudge: chat template

# Mistral-7B-Instruct-v0.1's template: user and assistant only, alternating from a user turn.
MISTRAL_V01 = ("{{ bos_token }}{% for message in messages %}"
               "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
               "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}{% else %}"
               "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
# Gemma's opening: no system message at all.
NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}")


def test_I8_local_judge_without_a_chat_template_is_refused_when_built(tiny_llama):
    model, tokenizer = load(tiny_llama)
    tokenizer.chat_template = None
    with pytest.raises(InputError, match=r"LocalJudge 'local_fairness': the judge tokenizer \(.*\) has no chat "
                                         r"template.*set tokenizer.chat_template"):
        LocalJudge(model, tokenizer, FAIRNESS)


def test_I8_a_recipe_judge_without_a_chat_template_is_refused_before_its_weights_load(tiny_llama, tmp_path,
                                                                                     monkeypatch):
    """A recipe's local judge (``judges: {j: {model_path: ...}}``) whose tokenizer has no chat template: refused
    from the tokenizer alone, before ``from_pretrained`` reads the judge's weights."""
    import shutil

    import transformers

    judge_dir = tmp_path / "judge"
    shutil.copytree(tiny_llama, judge_dir)
    _, tokenizer = load(tiny_llama)
    tokenizer.chat_template = None
    for name in ("chat_template.jinja", "chat_template.json"):
        (judge_dir / name).unlink(missing_ok=True)
    tokenizer.save_pretrained(judge_dir)
    spec = parse_judges({"j": {"model_path": str(judge_dir), "rubric": "fairness"}})["j"]

    def no_weights(*args, **kwargs):
        raise AssertionError("the judge's weights were loaded before its tokenizer was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(InputError, match=r"LocalJudge 'j': the judge tokenizer \(.*\) has no chat template"):
        spec.load("cpu")


@pytest.mark.parametrize("template, raised", [(MISTRAL_V01, "Conversation roles must alternate"),
                                              (NO_SYSTEM, "System role not supported")])
def test_I8_local_judge_whose_template_cannot_render_the_rubrics_messages_is_refused_when_built(template, raised,
                                                                                                tiny_llama):
    """The rubric sends a system message, then its worked examples as turns: a template that raises on that shape
    raises on every row, so it is refused before compute, with the roles and what the template said."""
    model, tokenizer = load(tiny_llama)
    tokenizer.chat_template = template
    with pytest.raises(InputError, match=r"LocalJudge 'local_fairness': the judge tokenizer's chat template cannot "
                                         r"render the messages of rubric 'fairness' \(roles system, user, assistant, "
                                         rf".*, user\): it raised TemplateError: {raised}"):
        LocalJudge(model, tokenizer, FAIRNESS)


# SmolLM2's template, behind a check that raises on some rows' text: once with a message of its own, once quoting it.
ROW_CHECK = ("{% for m in messages %}{% if '<|reserved|>' in m['content'] %}"
             "{{ raise_exception('this marker is kept for the template itself') }}{% endif %}"
             "{% if 'sk-live' in m['content'] %}{{ raise_exception('cannot render: ' + m['content'][-120:]) }}"
             "{% endif %}{% endfor %}")


def test_I8_a_row_the_chat_template_raises_on_is_none_with_reason_template_error(tiny_llama):
    """Rows 1 and 2 make the template raise: None, reason template_error, counted; rows 0 and 3 score as they do
    alone. Row 2's error quotes the row (its key-like text): the note keeps the error's type, not that message."""
    model, tokenizer = load(tiny_llama)
    texts = ["They care for patients.", "Nurses <|reserved|> are kind.", "My key is sk-live-0123456789abcdef, nurses.",
             "They work shifts."]
    clean = local_call(LocalJudge(model, tokenizer, FAIRNESS), [texts[0], texts[3]])[0]
    tokenizer.chat_template = ROW_CHECK + tokenizer.chat_template
    judge = LocalJudge(model, tokenizer, FAIRNESS)
    scores, metrics, notes = local_call(judge, texts)
    assert scores[1:3] == [None, None]
    torch.testing.assert_close(torch.tensor([scores[0], scores[3]]), torch.tensor(clean), atol=1e-5, rtol=0)  # fp32
    assert metrics["judge/local_fairness/failed/template_error"] == 0.5 == metrics["judge/local_fairness/missing_share"]
    assert judge.failures == {"template_error": 2}
    assert notes[1].startswith("the judge tokenizer's chat template raised TemplateError on this row's messages: "
                               "this marker is kept for the template itself; the row is not scored")
    assert notes[2].startswith("the judge tokenizer's chat template raised TemplateError on this row's messages: "
                               "(its message quotes the row's text and is not kept)")
    assert not any(piece in note for note in notes[1:3] for piece in ("sk-live", "0123456789", "nurses", "Describe"))
    assert judge.last_error == notes[2]


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
