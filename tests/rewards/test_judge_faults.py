r"""``HttpJudge`` against servers and environments that mislead it (I8), each on loopback servers:

* a reply the server cut at ``max_tokens`` (``finish_reason: "length"``) is read for no verdict: ``None``,
  reason ``truncated``, counted, logged and named in ``JudgeError``, from the cache too; so is any reply the
  judge did not end itself (``content_filter``: ``filtered``, ``tool_calls`` / ``function_call``:
  ``tool_call``, any other value: ``unfinished``);
* one judge shared by two tasks (``per_task``, ``JudgeRouter``) counts failed batches per task: a task that
  always fails stops the run although the other task scores; and it logs each task's own last HTTP status and
  keeps each task's own last error;
* a loopback ``base_url`` (``localhost``, ``*.localhost``, 127.0.0.1) is asked directly whatever the proxy
  variables say (a second loopback server plays the proxy and records what it receives), while a remote host
  still goes through the proxy;
* a key the server echoes JSON-escaped (``\/``, ``\u002f``, ``\u002F``), or escaped twice as a request body
  quoted in a JSON error is (``\\/``, ``\\u002f``, ``\u005cu002f``), leaves no 8-character piece of itself in
  anything the judge shows, also when it sits at the edge of the window a large body is read in.
"""

import asyncio
import json
import logging
import re
import socket

import pytest
from judge_server import LoopbackJudge

from grpotrl.rewards.judges import FAILURE_REASONS, HttpJudge, JudgeError, JudgeRouter, _excerpt
from grpotrl.rewards.rubrics import FAIRNESS
from grpotrl.rewards.tasks import per_task

KEY_ENV = "GRPOTRL_TEST_JUDGE_KEY"
# 46 characters with a "/" every few: a JSON encoder that escapes it (or "+", "=", "-", "_") writes most of the
# key's 8-character pieces otherwise, and only a redaction that reads JSON escapes finds those.
KEY = "sk-pr/j7Hq2+Lx9/Vd4Wm=1R/c8Tz5N/_p3Kb6/-Yf0G/s"


class ScriptedJudge(LoopbackJudge):
    """A loopback server whose every answer is ``answer(request) -> (status, body)``; requests are recorded."""

    def __init__(self, answer):
        super().__init__()
        self.answer = answer

    async def _answer(self, request, reader, writer):
        self.requests.append({**request, "fault": None})
        status, body = self.answer(request)
        return await self._send(writer, status, body)


def completion(content: str | None, finish_reason) -> bytes:
    return json.dumps({"id": "loopback", "object": "chat.completion", "model": "loopback",
                       "choices": [{"index": 0, "finish_reason": finish_reason,
                                    "message": {"role": "assistant", "content": content}}]}).encode()


def judge_call(judge, prompts, completions, **columns):
    """Call a judge the way TRL does, collecting what it logs."""
    metrics, extras = {}, {}
    scores = asyncio.run(judge(prompts=prompts, completions=completions, log_metric=metrics.__setitem__,
                               log_extra=extras.__setitem__, **columns))
    return scores, metrics, extras


# ---------------------------------------------------------------------------- a reply cut at max_tokens

# A judge cut off mid-reasoning: its last verdict line is one it was about to revise.
CUT = "The answer looks fair.\nVERDICT: 4\nOn reflection it stereotypes nurses, so the verdict 4 above is wrong and"


@pytest.mark.parametrize("finish_reason, score", [("length", None), ("stop", 0.75)])
def test_I8_a_reply_cut_at_max_tokens_is_read_for_no_verdict(finish_reason, score):
    """finish_reason "length": the row is None with reason truncated, whatever verdict line the cut reply holds;
    the same reply ended by the judge itself ("stop") is scored: the cut alone makes the difference."""
    with ScriptedJudge(lambda request: (200, completion(CUT, finish_reason))) as server:
        judge = HttpJudge(FAIRNESS, base_url=server.url, model="m", max_tokens=24, max_failed_batches=2)
        scores, metrics, extras = judge_call(judge, ["q"], ["a"])
        assert scores == [score]
        truncated = 1.0 if score is None else 0.0
        assert metrics["judge/fairness/failed/truncated"] == truncated
        assert metrics["judge/fairness/missing_share"] == truncated
        assert extras["judge/fairness"][0].endswith("is wrong and")  # the reply's end, as for any reply
        if score is not None:
            return
        assert judge.failures == {"truncated": 1}
        with pytest.raises(JudgeError, match=r"2 batches in a row.*last HTTP status: 200; last error: the reply was "
                                             r"cut at max_tokens=24 \(finish_reason 'length'\)"):
            judge_call(judge, ["q"], ["a"])  # the same pair: from the cache, still truncated, still counted
        assert len(server.requests) == 1 and judge.failures == {"truncated": 2}


# A reply the judge did not end itself, each with a verdict line where its server may give text: (finish_reason,
# content, reason, cached, what JudgeError says to do).
UNFINISHED = [
    ("content_filter", "VERDICT: 4", "filtered", True, r"content filter withheld or cut the reply.*another reward"),
    ("content_filter", None, "filtered", True, r"content filter"),
    ("tool_calls", None, "tool_call", True, r"a tool call, not text.*without tool calling"),
    ("function_call", "VERDICT: 4", "tool_call", True, r"a tool call, not text"),
    ("abort", "VERDICT: 4", "unfinished", False, r"finish_reason other than 'stop'.*the server's log"),
    (7, "VERDICT: 4", "unfinished", False, r"finish_reason other than 'stop'"),
]


@pytest.mark.parametrize("finish_reason, content, reason, cached, advice", UNFINISHED)
def test_I8_a_reply_the_judge_did_not_end_itself_is_read_for_no_verdict(finish_reason, content, reason, cached,
                                                                        advice):
    """Only "stop" (or none) is read for a verdict: a filtered reply, a tool call or an unknown finish gives None
    with its own reason, counted, logged, cached where it is the server's own answer, and named in JudgeError."""
    with ScriptedJudge(lambda request: (200, completion(content, finish_reason))) as server:
        judge = HttpJudge(FAIRNESS, base_url=server.url, model="m", max_retries=0, max_failed_batches=2)
        scores, metrics, extras = judge_call(judge, ["q"], ["a"])
        assert scores == [None]
        assert {r for r in FAILURE_REASONS if metrics[f"judge/fairness/failed/{r}"]} == {reason}
        assert metrics[f"judge/fairness/failed/{reason}"] == 1.0 == metrics["judge/fairness/missing_share"]
        assert extras["judge/fairness"][0] == f"finish_reason {json.dumps(finish_reason)}: {content or 'no reply text'}"
        with pytest.raises(JudgeError, match=r"2 batches in a row.*last HTTP status: 200; last error: .*" + advice):
            judge_call(judge, ["q"], ["a"])  # the same pair: from the cache where cached, asked again where not
        assert len(server.requests) == (1 if cached else 2) and judge.failures == {reason: 2}


@pytest.mark.parametrize("finish_reason", ["stop", None, "eos_token", "stop_sequence"])
def test_I8_a_reply_the_judge_ended_itself_is_scored(finish_reason):
    """The control of the test above: the same reply, ended by the judge (TGI wrote "eos_token" for it), scores."""
    with ScriptedJudge(lambda request: (200, completion("VERDICT: 4", finish_reason))) as server:
        judge = HttpJudge(FAIRNESS, base_url=server.url, model="m", max_failed_batches=1)
        scores, metrics, _ = judge_call(judge, ["q"], ["a"])
        assert scores == [0.75] and not any(metrics[f"judge/fairness/failed/{r}"] for r in FAILURE_REASONS)


def test_I8_a_finish_reason_echoing_the_key_leaves_no_piece_of_it(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    with ScriptedJudge(lambda request: (200, completion("VERDICT: 4", request["headers"]["authorization"]))) as server:
        judge = HttpJudge(FAIRNESS, base_url=server.url, model="m", api_key_env=KEY_ENV, max_failed_batches=1)
        with pytest.raises(JudgeError, match="finish_reason other than 'stop'") as err:
            judge_call(judge, ["q"], ["a"])
    assert "<api key>" in judge.last_error and leaked([str(err.value), judge.last_error]) == []


# ---------------------------------------------------------------------------- one judge, two tasks


def verdict_for_task_a(messages):  # task a's completions get a verdict, task b's never do
    return "VERDICT: 4" if "task-a" in messages[-1]["content"] else "I cannot grade this."


def per_task_steps(judge):
    """One step as TRL runs per-task rewards: both tasks' functions at once, under asyncio.gather."""
    funcs = per_task({"a": judge, "b": judge}, "task")

    async def step(i):
        return await asyncio.gather(*(f(prompts=["q", "q"], completions=[f"task-a {i}", f"task-b {i}"],
                                        task=["a", "b"]) for f in funcs))
    return lambda i: asyncio.run(step(i))


def router_steps(judge):
    """One step of a JudgeRouter sending each task's rows to the same judge."""
    route = JudgeRouter({"a": judge, "b": judge})
    return lambda i: [asyncio.run(route(["q", "q"], [f"task-a {i}", f"task-b {i}"], task=["a", "b"]))]


@pytest.mark.parametrize("steps, scored", [(per_task_steps, [[0.75, None], [None, None]]),
                                           (router_steps, [[0.75, None]])])
def test_I8_a_task_that_always_fails_stops_although_another_task_shares_its_judge(steps, scored):
    with LoopbackJudge(reply=verdict_for_task_a) as server:
        judge = HttpJudge(FAIRNESS, base_url=server.url, model="m", max_failed_batches=3)
        run = steps(judge)
        for i in range(2):  # task a scores every step, task b never
            assert run(i) == scored
        with pytest.raises(JudgeError, match=r"3 batches in a row on task 'b'.*last error: no verdict line in the "
                                             r"reply: 'I cannot grade this.'"):
            run(2)


def test_I8_a_judge_called_outside_per_task_rewards_counts_its_calls_as_before():
    """The control: called directly, one success between failures resets the count."""
    with LoopbackJudge(reply=verdict_for_task_a) as server:
        judge = HttpJudge(FAIRNESS, base_url=server.url, model="m", max_failed_batches=2)
        for i in range(3):
            assert asyncio.run(judge(["q"], [f"task-b {i}"])) == [None]
            assert asyncio.run(judge(["q"], [f"task-a {i}"])) == [0.75]
        asyncio.run(judge(["q"], ["task-b x"]))
        with pytest.raises(JudgeError, match="2 batches in a row \\("):
            asyncio.run(judge(["q"], ["task-b y"]))


def test_I8_a_judge_shared_by_two_tasks_logs_each_tasks_own_status_and_error():
    """Task a's rows get 200 without a verdict, task b's an HTTP 500. Task a asked again (from the cache, no request)
    after task b must log a's status, 200, not b's, and each task keeps its own last error."""
    def answer(request):
        if "task-b" in json.loads(request["body"])["messages"][-1]["content"]:
            return 500, b'{"error": "overloaded"}'
        return 200, completion("I cannot grade this.", "stop")

    with ScriptedJudge(answer) as server:
        judge = HttpJudge(FAIRNESS, base_url=server.url, model="m", max_retries=0, max_failed_batches=0)
        run = dict(zip("ab", per_task({"a": judge, "b": judge}, "task")))
        logged = []
        for task in "aba":
            metrics = {}
            asyncio.run(run[task](prompts=["q"], completions=[f"task-{task}"], task=[task],
                                  log_metric=metrics.__setitem__))
            logged.append((task, metrics["judge/fairness/http_status"]))
        assert logged == [("a", 200.0), ("b", 500.0), ("a", 200.0)] and len(server.requests) == 2
    assert judge.last_statuses == {"a": 200, "b": 500}
    assert judge.last_errors == {"a": "no verdict line in the reply: 'I cannot grade this.'",
                                 "b": 'HTTP 500: {"error": "overloaded"}'}
    assert (judge.last_status, judge.last_error) == (500, judge.last_errors["b"])  # judge-wide: the latest


# ---------------------------------------------------------------------------- proxies


def set_proxy(monkeypatch, url: str) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, url)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)


def resolve_localhost_names(monkeypatch) -> None:
    """``*.localhost`` resolved to 127.0.0.1, as RFC 6761 resolvers (systemd-resolved, nss-myhostname) do; this
    machine's may not."""
    resolve = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):  # the host as a str, or as IDNA bytes (asyncio's)
        name = (host.decode("ascii") if isinstance(host, bytes) else str(host)).rstrip(".").lower()
        loopback = name == "localhost" or name.endswith(".localhost")
        return resolve("127.0.0.1" if loopback else host, *args, **kwargs)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "judge.localhost", "Judge.LOCALHOST."])
def test_I8_a_loopback_judge_is_asked_directly_never_through_the_proxy(monkeypatch, host):
    """The proxy is a real loopback server that would answer (VERDICT: 2) and records what reaches it: nothing
    may, and least of all the Authorization header. Every name under ``localhost`` is loopback (RFC 6761)."""
    monkeypatch.setenv(KEY_ENV, KEY)
    resolve_localhost_names(monkeypatch)
    with LoopbackJudge(reply="VERDICT: 4") as server, LoopbackJudge(reply="VERDICT: 2") as proxy:
        set_proxy(monkeypatch, f"http://127.0.0.1:{proxy.port}")
        judge = HttpJudge(FAIRNESS, base_url=f"http://{host}:{server.port}/v1", model="m", api_key_env=KEY_ENV,
                          max_retries=0, max_failed_batches=0)
        assert asyncio.run(judge(["q"], ["a"])) == [0.75]
        assert proxy.requests == []
        assert [r["headers"]["authorization"] for r in server.chat_requests] == [f"Bearer {KEY}"]


def test_I8_a_remote_judge_still_goes_through_the_proxy(monkeypatch):
    """The control of the test above: the same proxy gets a remote host's request (and answers it)."""
    with LoopbackJudge(reply="VERDICT: 2") as proxy:
        set_proxy(monkeypatch, f"http://127.0.0.1:{proxy.port}")
        judge = HttpJudge(FAIRNESS, base_url="http://judge.invalid:8000/v1", model="m", max_retries=0,
                          max_failed_batches=0)
        assert asyncio.run(judge(["q"], ["a"])) == [0.25]
        assert [r["path"] for r in proxy.chat_requests] == ["http://judge.invalid:8000/v1/chat/completions"]


def test_I8_a_loopback_judge_scores_under_a_proxy_variable_httpx_cannot_read(monkeypatch):
    with LoopbackJudge(reply="VERDICT: 4") as server:
        judge = HttpJudge(FAIRNESS, base_url=server.url, model="m", max_failed_batches=1)
        monkeypatch.setenv("ALL_PROXY", "ftp://proxy.invalid:21")
        assert asyncio.run(judge(["q"], ["a"])) == [0.75]


# ---------------------------------------------------------------------------- a key echoed JSON-escaped

ESCAPES = {  # how a server's JSON encoder may write each character of the key it echoes
    "slash": lambda text: json.dumps(text)[1:-1].replace("/", "\\/"),  # PHP, older Java encoders
    "u_lower": lambda text: "".join(c if c.isalnum() else f"\\u{ord(c):04x}" for c in text),
    "u_upper": lambda text: "".join(c if c.isalnum() else f"\\u{ord(c):04X}" for c in text),
    "mixed": lambda text: "".join(f"\\u{ord(c):04x}" if c in "-+" else "\\/" if c == "/" else c for c in text),
}
# Escaped twice: the request body (with the key escaped once) quoted as a string in the server's JSON error.
ESCAPES |= {
    "twice_slash": lambda text: json.dumps(ESCAPES["slash"](text))[1:-1],  # "/" as \\/
    "twice_u": lambda text: json.dumps(ESCAPES["u_lower"](text))[1:-1],  # "/" as \\u002f
    "twice_u_u": lambda text: ESCAPES["u_upper"](ESCAPES["u_lower"](text)),  # "/" as \u005Cu002f
    "twice_all": lambda text: "".join(f"\\u{ord(c):04x}" for c in "".join(f"\\u{ord(c):04x}" for c in text)),
}


def unescaped(text: str) -> str:
    """What a reader of ``text`` recovers from its JSON escapes."""
    return re.sub(r"\\(u[0-9a-fA-F]{4}|.)", lambda m: chr(int(m[1][1:], 16)) if len(m[1]) == 5 else m[1], text)


def leaked(texts) -> list[str]:
    """The key's 8-character pieces a reader of ``texts`` recovers, reading JSON escapes once or twice."""
    pieces = {KEY[i:i + 8] for i in range(len(KEY) - 7)}
    return sorted({p for t in texts for p in pieces if p in t or p in unescaped(t) or p in unescaped(unescaped(t))})


@pytest.mark.parametrize("escape", ESCAPES)
@pytest.mark.parametrize("echo", ["key", "header"])
def test_I8_a_key_echoed_json_escaped_leaves_no_piece_of_itself(monkeypatch, caplog, escape, echo):
    def answer(request):
        header = request["headers"]["authorization"]
        echoed = ESCAPES[escape](header if echo == "header" else header.removeprefix("Bearer "))
        return 401, ('{"error": {"message": "invalid api key: ' + echoed + '", "type": "auth"}}').encode()

    monkeypatch.setenv(KEY_ENV, KEY)
    caplog.set_level(logging.DEBUG)
    with ScriptedJudge(answer) as server:
        judge = HttpJudge(FAIRNESS, base_url=server.url, model="m", api_key_env=KEY_ENV, max_retries=0,
                          max_failed_batches=2)
        scores, metrics, extras = judge_call(judge, ["q"], ["a"])
        with pytest.raises(JudgeError) as err:
            judge_call(judge, ["q"], ["b"])
    shown = [str(err.value), *extras["judge/fairness"], judge.last_error, repr(judge), str(vars(judge)), caplog.text]
    assert scores == [None] and "<api key>" in extras["judge/fairness"][0]
    assert leaked(shown) == [], f"pieces of the key survived: {leaked(shown)} in {str(err.value)!r}"


@pytest.mark.parametrize("escape", ["slash", "u_lower", "twice_slash", "twice_u", "twice_u_u"])
@pytest.mark.parametrize("tail", [False, True])
def test_I8_a_json_escaped_key_across_the_cut_of_a_large_bodys_note_leaves_no_piece(escape, tail):
    """The note is 200 characters from a window of a 1 MiB body (its start, or its end with ``tail``); an escaped
    key (up to 36x longer than the key, escaped twice) at every offset across the note's cut leaves no
    8-character piece."""
    secrets = (f"Bearer {KEY}", KEY)
    written = ESCAPES[escape](KEY)
    body = "x" * (1 << 20)
    for at in range(200 - len(written) - 5, 205):  # where the written key starts (ends, with tail) in the note
        text = body[:len(body) - len(written) - at] + written + "y" * at if tail else "z" * at + written + body
        note = _excerpt(text, secrets, tail=tail)
        assert len(note) <= 200 and leaked([note]) == [], (at, note)


def fragments(note: str, size: int = 4) -> list[str]:
    """The key's ``size``-character fragments a reader of ``note`` recovers, reading JSON escapes up to twice."""
    readings = (note, unescaped(note), unescaped(unescaped(note)))
    return sorted({KEY[i:i + size] for i in range(len(KEY) - size + 1) if any(KEY[i:i + size] in r for r in readings)})


@pytest.mark.parametrize("escape", ["twice_u", "twice_u_u", "twice_all"])
@pytest.mark.parametrize("tail", [False, True])
def test_I8_a_twice_escaped_key_across_the_edge_of_the_part_a_note_comes_from_is_replaced_whole(escape, tail):
    """A note comes from the first (last, with ``tail``) 400 characters of a 1 MiB body, searched in a window one
    escaped piece wider. Two keys redacted first pull that edge into the note; a third key written across the edge
    at every offset must leave no fragment of itself there at all (each piece across the edge is found whole in the
    window), however long it is written (``twice_all``: 36 characters per character)."""
    secrets = (f"Bearer {KEY}", KEY)
    written, pull = ESCAPES[escape](KEY), ESCAPES["twice_u"](KEY) * 2  # pull: 224 characters -> "<api key>"
    body = "x" * (1 << 20)
    for at in range(len(pull), 400 + 5):  # where the third key starts (ends, with tail) in the body
        filler = "z" * (at - len(pull))
        text = body + written + filler + pull if tail else pull + filler + written + body
        note = _excerpt(text, secrets, tail=tail)
        assert note.count("<api key>") >= 1 and fragments(note) == [], (at, note)
