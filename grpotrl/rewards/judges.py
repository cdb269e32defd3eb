r"""LLM judges as TRL reward functions: ``(prompts, completions, **columns) -> list[float | None]``.

``HttpJudge`` asks any OpenAI-compatible chat-completions server (vLLM, TGI,
``transformers serve``, hosted APIs); ``LocalJudge`` scores with a causal LM already in
memory; ``JudgeRouter`` sends each row to the judge of its ``task`` column. All three are
ordinary reward functions: pass them in ``reward_funcs`` (TRL 1.16 awaits async ones on its
own event-loop thread, in parallel with other async rewards) or call them yourself
(``asyncio.run(judge(prompts, completions))``). Scores are mapped to [0, 1]. ``HttpJudge`` needs
httpx2 (``pip install 'grpotrl[judge]'``), imported when one is built; without it this module, the
CLI and the other judges load, and building an ``HttpJudge`` is an ``InputError`` saying what to install.

Failure semantics (INVARIANTS I8). Whatever the server or the transport does -- a timeout, a
dropped connection, an HTTP error, a corrupt or non-UTF-8 body, a body that is not a chat
completion, a reply over ``max_reply_bytes``, a reply that did not end as the judge's own (``finish_reason``
other than ``stop``: cut at ``max_tokens``, withheld by a content filter, a tool call, anything else), a reply
without a readable verdict -- that row gets ``None`` (TRL leaves it out of the group baseline),
never 0 and never an exception out of the reward function; only cancellation and ``JudgeError``
leave it. Each call logs, through
TRL's ``log_metric``, ``judge/<name>/missing_share`` (rows without a score),
``judge/<name>/failed/<reason>`` (share of rows per reason, ``FAILURE_REASONS``),
``judge/<name>/http_status`` (the last status this task's requests got; 0 when no whole reply came back) and
``judge/<name>/cache_hit_share``, and through ``log_extra`` the end of the judge's reply or the
failure per row. After ``max_failed_batches`` consecutive calls in which no row got a score,
``JudgeError`` stops training, naming the judge, the last HTTP status and the last error. The calls,
the last status and the last error are kept per task (``tasks.reward_task``): one judge shared by two
tasks, of which one always fails, stops all the same, and neither task reports the other's status or error.
``LocalJudge`` keeps the same contract for its own faults (``LOCAL_FAILURE_REASONS``): a row its tokenizer's chat
template raises on is unscored (``template_error``; a template that cannot render the rubric's messages at all is
refused when the judge is built), an input longer than its model's context is not cut but unscored
(``too_long``), a forward out of memory is asked again at half its rows down to one, an exception in its forward
leaves that forward's rows unscored (``model_error``), and ``max_failed_batches`` counts its calls without a score
the same way.

The API key. Read from the variable ``api_key_env`` names at each call, sent only as the
``Authorization`` header. Server text is redacted (``redact``: the header value and the key,
whole or any piece of ``PIECE`` = 8 characters or more, as sent, JSON-escaped, or JSON-escaped twice as a
request body quoted in an error's JSON string is) before it is cut short, so no note, log, error or
completion table holds a piece of it, whatever a server echoes. A loopback ``base_url`` (``localhost`` and
``*.localhost``, RFC 6761; 127.0.0.0/8, ``::1``) is asked directly: the environment's
proxy variables, which other hosts follow as httpx does, would hand such a proxy the key. Memory: a
reply's body is read streamed up to ``max_reply_bytes`` (1 MiB); the cache keeps a score and
a note of at most ``NOTE_CHARS`` per pair, never a body.

What it does not do: streaming, tool calls, JSON mode (``transformers serve`` rejects
``response_format``), cross-process cache sharing (the cache lives in the judge object,
one per process), or anything against a judge model that simply grades badly -- a 135M judge
obeys "VERDICT: 5" written inside the answer it grades; the parser and quoting only make
sure such text is never read as the judge's own verdict (``rubrics.py``).
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import ipaddress
import json
import logging
import math
import os
import random
import re
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit

import torch
from trl.trainer.utils import is_async_callable

from ..errors import InputError
from ..ops.masking import last_token_index, position_ids_from_mask
from .rubrics import Rubric, parse_verdict, prompt_text
from .rules import completion_text
from .tasks import reward_task, rows_of

logger = logging.getLogger(__name__)

# Statuses worth asking again: overload and server-side errors; those whose Retry-After is honoured.
_RETRY_STATUS = {429, 500, 502, 503, 504}
_RETRY_AFTER_STATUS = {429, 503}
_MAX_RETRY_AFTER_S = 60.0
_ERROR_BODY_BYTES = 4096  # of a non-200 body: enough for the note, the rest is not read
NOTE_CHARS = 200  # of server text kept per row (cache, completion logs, errors)
PIECE = 8  # no substring this long of a secret survives redaction
REDACTED = "<api key>"
# Why a row got no score (metrics judge/<name>/failed/<reason>):
FAILURE_REASONS = (
    "timeout",                # no complete reply within `timeout` seconds
    "transport",              # refused, dropped, reset, malformed HTTP: anything the transport raised
    "http_status",            # an answer with a status other than 200
    "undecodable",            # a body that cannot be decoded: corrupt gzip/deflate, not UTF-8
    "not_a_chat_completion",  # text, but no choices[0].message.content string in it
    "too_large",              # a body over max_reply_bytes (the rest is not read)
    "no_verdict",             # a chat completion without a readable verdict on the rubric's scale
    "truncated",              # a reply the server cut at max_tokens (finish_reason "length"): never read for a
                              # verdict, since the verdict it would have ended with may be missing or cut
    "filtered",               # finish_reason "content_filter": the server's filter withheld or cut the reply
    "tool_call",              # finish_reason "tool_calls" / "function_call": a call, no verdict text
    "unfinished",             # any other finish_reason than those above and _FINISHED: not read for a verdict
)
# Why a row got no score from a LocalJudge (the same metrics):
LOCAL_FAILURE_REASONS = (
    "template_error",  # the judge tokenizer's chat template raised on this row's messages: not scored
    "too_long",        # its judge input does not fit the judge model's context: not cut (a cut may change the
                       # verdict), not scored
    "model_error",     # the judge model's forward raised (a device error; out of memory on one row): no row of
                       # that forward is scored
    "no_verdict",      # no probability on the scale (it underflowed) or logits that are not finite
)
# transformers' model_max_length when the tokenizer's files set none (VERY_LARGE_INTEGER): not a context length.
_UNSET_MAX_LENGTH = 10 ** 12
# What a RuntimeError that is an allocation failure says: the CPU allocator ("DefaultCPUAllocator: can't allocate
# memory", "not enough memory: you tried to allocate"), MPS and older CUDA builds ("out of memory").
_OUT_OF_MEMORY = re.compile(r"out of memory|(?:can't|cannot|could not|unable to) allocate|not enough memory|"
                            r"tried to allocate", re.IGNORECASE)
# A reply the judge ended itself: OpenAI's "stop", none given, and TGI's names for it before it wrote "stop".
# Every other finish_reason gives no score: its reason, or "unfinished" for a value not named here.
_FINISHED = {None, "stop", "eos_token", "stop_sequence"}
_UNFINISHED = {"length": "truncated", "content_filter": "filtered", "tool_calls": "tool_call",
               "function_call": "tool_call"}
_FINISH_CHARS = 40  # of an unknown finish_reason shown in a note
# Where a JSON string escape may hide a key from plain search: "\/", "\"", "\\", "\n", ... and "\uXXXX"
# for any character, which is also the longest (6 characters for one).
_JSON_ESCAPE = re.compile(r'\\(?:u([0-9a-fA-F]{4})|(["\\/bfnrt]))')
_JSON_SIMPLE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
# How many times a key may be JSON-escaped and still be found: twice is a request body a server quotes inside
# its own JSON error ("\\/", "\\u002f", "\u005cu002f" for "/"). A key escaped three times is not recognised.
JSON_LEVELS = 2
ESCAPED = 6 ** JSON_LEVELS  # the most characters one character of a key is written as (\uXXXX at each level)


class JudgeError(RuntimeError):
    """A judge gave no score for ``max_failed_batches`` batches in a row."""


@dataclass
class _Verdict:
    score: float | None  # on the rubric's scale
    note: str  # the end of the judge's reply, or what went wrong (redacted, at most ~NOTE_CHARS + a prefix)
    reason: str | None  # one of FAILURE_REASONS when score is None
    cacheable: bool = False  # the server answered (a score or a reply without a verdict)
    status: int = 0  # the HTTP status of its last attempt (0 when no whole reply came back)


def redact(text: str, secrets) -> str:
    r"""``text`` with every secret, and every piece of one at least ``PIECE`` characters long, replaced
    by ``<api key>``: a server may echo a key whole, cut, or only its start or end, and as a JSON
    string it may escape any of its characters (``/`` as ``\/`` or ``\u002f``), up to ``JSON_LEVELS`` times
    (a request body quoted inside an error's JSON: ``\\/``, ``\\u002f``). Redact BEFORE cutting text short,
    or a key crossing the cut survives as a fragment. Secrets shorter than ``PIECE`` are replaced whole (from
    4 characters on).

    >>> redact("echo: Bearer sk-abcdefgh12345678, cut: sk-abcdefg...", ["sk-abcdefgh12345678"])
    'echo: Bearer <api key>, cut: <api key>...'
    >>> redact('{"error": "bad key sk\\u002dab\\/cd\\/efgh"}', ["sk-ab/cd/efgh"])
    '{"error": "bad key <api key>"}'
    >>> redact('{"error": "body: {\\"key\\": \\"sk\\\\u002dab\\\\/cd\\\\/efgh\\"}"}', ["sk-ab/cd/efgh"])
    '{"error": "body: {\\"key\\": \\"<api key>\\"}"}'
    """
    return _replaced(text, _secret_spans(text, secrets), 0, len(text))


def _secret_spans(text: str, secrets) -> list[list[int]]:
    """The ``[start, end)`` runs of ``text`` that are a secret or a piece of one (``redact``), as they are or
    JSON-escaped up to ``JSON_LEVELS`` times, merged, in order."""
    pieces = {s[i:i + PIECE] for s in secrets if len(s) >= PIECE for i in range(len(s) - PIECE + 1)}
    pieces |= {s for s in secrets if 4 <= len(s) < PIECE}
    spans = _found(text, pieces)
    decoded, at = text, None
    for _ in range(JSON_LEVELS):  # the same pieces in the text read as a JSON string, mapped back to where they are
        if "\\" not in decoded:  # written; then that read as a JSON string again
            break
        decoded, inner = _json_unescaped(decoded)
        at = inner if at is None else [at[i] for i in inner]  # decoded[a] is written at text[at[a]]
        spans += [(at[start], at[end]) for start, end in _found(decoded, pieces)]
    spans.sort()
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:  # overlapping or touching: one run
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _found(text: str, pieces) -> list[tuple[int, int]]:
    """Every ``[start, end)`` of ``text`` that is one of ``pieces``."""
    spans = []
    for piece in pieces:  # str.find, not a regex: re's pattern cache would keep the pieces
        at = text.find(piece)
        while at >= 0:
            spans.append((at, at + len(piece)))
            at = text.find(piece, at + 1)
    return spans


def _json_unescaped(text: str) -> tuple[str, list[int]]:
    r"""``text`` with its JSON string escapes decoded, and where in ``text`` each character of that starts, plus
    ``len(text)`` at the end: characters ``[a, b)`` of the decoded text are written at ``text[at[a]:at[b]]``.

    >>> _json_unescaped("a\\/b\\u0063")
    ('a/bc', [0, 1, 3, 4, 10])
    """
    out, at, done = [], [], 0
    for m in _JSON_ESCAPE.finditer(text):
        out += [text[done:m.start()], chr(int(m[1], 16)) if m[1] else _JSON_SIMPLE[m[2]]]
        at += [*range(done, m.start()), m.start()]
        done = m.end()
    out.append(text[done:])
    at += range(done, len(text) + 1)
    return "".join(out), at


def _replaced(text: str, spans: list[list[int]], lo: int, hi: int) -> str:
    """``text[lo:hi]`` with each of ``spans`` (clipped to it) replaced by ``REDACTED``."""
    out, done = [], lo
    for start, end in spans:
        start, end = max(start, lo), min(end, hi)
        if start < end:
            out += [text[done:start], REDACTED]
            done = end
    return "".join(out) + text[done:hi]


def _reply_text(content):
    """A chat completion's ``message.content`` as text: a string as it is; a list of content parts (as some
    servers send a reasoning model's reply) as its ``text`` parts joined, the others (reasoning, refusals, images)
    left out; None, or a list without a text part, as None (no reply text).

    >>> _reply_text([{"type": "reasoning", "text": "VERDICT: 1"}, {"type": "text", "text": "VERDICT: 4"}])
    'VERDICT: 4'
    >>> _reply_text([{"type": "image_url"}]) is None, _reply_text("VERDICT: 2")
    (True, 'VERDICT: 2')
    """
    if not isinstance(content, list):
        return content
    texts = [p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text" and isinstance(
        p.get("text"), str)]
    return "".join(texts) if texts else None


def _excerpt(text: str, secrets, tail: bool = False) -> str:
    """At most ``NOTE_CHARS`` of server text (its start, or its end with ``tail``), redacted before it is cut.

    Only a window of the text is searched, never a whole (up to ``max_reply_bytes``) body: the note is taken
    from the part of the window that no piece of a secret can cross out of, one piece in from the window's
    edge, so every piece there lies wholly inside the window and is found; redaction goes by pieces, so all of
    a secret in that part is replaced, however long it is. A piece written JSON-escaped is up to ``ESCAPED``
    times its ``PIECE`` characters (``\\uXXXX`` per character at each level), which is the length that counts.

    >>> _excerpt("x" * 300 + "sk-abcdefgh12345678" + "y" * 5, ["sk-abcdefgh12345678"], tail=True)[-20:]
    'xxxxxx<api key>yyyyy'
    """
    margin = ESCAPED * PIECE  # the longest a piece is written (a secret shorter than PIECE is one piece)
    width = 2 * NOTE_CHARS + margin
    if len(text) <= width:
        return (redact(text, secrets)[-NOTE_CHARS:] if tail else redact(text, secrets)[:NOTE_CHARS])
    if tail:
        window = text[-width:]
        return _replaced(window, _secret_spans(window, secrets), margin, width)[-NOTE_CHARS:]
    window = text[:width]
    return _replaced(window, _secret_spans(window, secrets), 0, width - margin)[:NOTE_CHARS]


def _retry_after(value: str | None, date: str | None = None) -> float | None:
    """A 429's or 503's ``Retry-After`` in seconds, capped at ``_MAX_RETRY_AFTER_S``: a number of seconds, or an
    HTTP date (RFC 9110), counted from the response's ``Date`` when it has one (the server's clock, whatever this
    machine's says) or from now; a date already past is 0. None when it is neither.

    >>> _retry_after("7"), _retry_after("Wed, 21 Oct 2015 07:28:30 GMT", "Wed, 21 Oct 2015 07:28:00 GMT")
    (7.0, 30.0)
    >>> _retry_after("3600"), _retry_after("soon"), _retry_after("-1")
    (60.0, None, None)
    """
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            then = _http_date(value)
        except (TypeError, ValueError, IndexError, OverflowError):  # what email.utils raises for a bad date
            return None
        try:
            now = _http_date(date) if date is not None else datetime.now(timezone.utc)
        except (TypeError, ValueError, IndexError, OverflowError):  # an unreadable Date: this machine's clock
            now = datetime.now(timezone.utc)
        seconds = max((then - now).total_seconds(), 0.0)
    return min(seconds, _MAX_RETRY_AFTER_S) if seconds >= 0 else None  # NaN fails the test too


def _http_date(text: str) -> datetime:
    """An HTTP date (``Wed, 21 Oct 2015 07:28:00 GMT``, or the obsolete forms RFC 9110 still accepts) in UTC."""
    when = parsedate_to_datetime(text)
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)  # asctime form: UTC (RFC 9110)


async def _read_capped(response, cap: int) -> tuple[bytes, bool]:
    """The decoded body up to ``cap`` bytes, and whether that was all of it; past the cap the rest
    is not read (leaving ``client.stream`` then closes the connection)."""
    parts, size = [], 0
    async for chunk in response.aiter_bytes():
        parts.append(chunk)
        size += len(chunk)
        if size > cap:
            return b"".join(parts)[:cap], False
    return b"".join(parts), True


def _rows(columns: Mapping, rubric: Rubric, n: int, judge: str) -> list[dict]:
    """The dataset columns the rubric reads, one dict per row; a missing column is an error."""
    missing = [c for c in rubric.columns.values() if c not in columns]
    if missing:
        present = sorted(k for k, v in columns.items() if isinstance(v, list))
        raise InputError(f"judge {judge!r}: rubric {rubric.name!r} reads dataset column(s) {missing}, but the "
                         f"batch has only {present}. Add the column or map the rubric to yours: "
                         f"dataclasses.replace(rubric, columns={{...}}).")
    return [{c: columns[c][i] for c in rubric.columns.values()} for i in range(n)]


def _has_columns(row: dict) -> bool:
    return all(v is not None and str(v).strip() != "" for v in row.values())


def _httpx():
    """httpx2, the HTTP client of ``HttpJudge`` (the ``judge`` extra); imported where a judge is built or asks,
    so that grpotrl and its CLI load without it. Missing, it is an ``InputError`` saying what to install."""
    try:
        import httpx2
    except ImportError:
        raise InputError("HttpJudge needs the package httpx2 (its HTTP client), which is not installed: "
                         "pip install 'grpotrl[judge]' (or pip install 'httpx2>=2.16').") from None
    return httpx2


class HttpJudge:
    """Scores each completion by asking an OpenAI-compatible ``/chat/completions`` endpoint.

    Args:
        rubric: what to ask (``rubrics.FAIRNESS``, ``rubrics.HALLUCINATION`` or your own).
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1``; no credentials in it
            (``user:password@``, ``?key=``): use ``api_key_env``. A loopback host (``localhost``,
            ``*.localhost``, 127.0.0.0/8, ``::1``) is asked directly, never through the environment's proxy variables
            (``HTTP_PROXY``, ``ALL_PROXY``, ...); other hosts follow them, and ``NO_PROXY``, as httpx does.
        model: the ``model`` field of each request.
        api_key_env: NAME of the environment variable holding the API key (sent as a bearer
            token). The key is read at each call and kept nowhere: not in the object, its
            repr, its cache keys, logs or errors. Server text that echoes it (whole, or any
            piece of 8 characters or more, as sent, JSON-escaped or JSON-escaped twice) is redacted
            before it is cut short or kept.
        name: metric and reward-column name (default: the rubric's name).
        max_concurrency: requests in flight at once.
        timeout: seconds per attempt, whole request and reply included. A row's attempts and the
            waits between them end within ``(max_retries + 1) * timeout`` seconds of its first attempt,
            and a call within ``ceil(rows / max_concurrency)`` times that (rows: the distinct pairs not
            in the cache): a row keeps its slot through its waits, a retry whose wait would end past the
            row's bound is not made (the row keeps its last failure), and the last attempt gets only
            what is left of the bound (reason ``timeout`` when that runs out).
        max_retries: further attempts after a timeout, a transport error, 429 or 5xx, with
            exponential backoff from ``backoff`` seconds; a 429's or 503's ``Retry-After``, in seconds or
            as an HTTP date, wins, capped at 60 s.
        max_tokens: the judge's reply, at most this many tokens. A reply the server cut at this
            limit (``finish_reason`` ``"length"``) gives ``None`` (reason ``truncated``), whatever
            verdict lines it holds: the verdict it was to end with may be missing or cut
            (``VERDICT: 4`` of ``VERDICT: 4.5``, or a verdict revised further on). Only a reply the
            judge ended itself is read: ``finish_reason`` ``"stop"`` or none (TGI's older
            ``"eos_token"`` / ``"stop_sequence"`` too); ``"content_filter"`` gives ``None`` with
            reason ``filtered``, ``"tool_calls"`` / ``"function_call"`` ``tool_call``, any other
            value ``unfinished``.
        temperature: the judge's sampling temperature.
        max_failed_batches: consecutive calls without a single score before ``JudgeError``
            (0 never raises), counted per task where the judge scores several (``per_task``,
            ``JudgeRouter``): another task's scores do not hide a task that always fails.
        cache_size: verdicts kept (least recently used dropped). A (settings, prompt,
            completion, columns) pair the server has answered is never sent again; failures
            are not cached. An entry is the score and a note of at most ``NOTE_CHARS``.
        max_reply_bytes: the most bytes of a reply's (decoded) body read; a larger reply gives
            ``None`` (reason ``too_large``) and the rest is never read. Memory per request is
            bounded by it.
    """

    def __init__(self, rubric: Rubric, *, base_url: str, model: str, api_key_env: str | None = None,
                 name: str | None = None, max_concurrency: int = 8, timeout: float = 30.0, max_retries: int = 2,
                 backoff: float = 0.5, max_tokens: int = 256, temperature: float = 0.0,
                 max_failed_batches: int = 3, cache_size: int = 100_000, max_reply_bytes: int = 1 << 20):
        if api_key_env is not None:
            _check_key(os.environ.get(api_key_env), api_key_env)
        _check_settings(max_concurrency=max_concurrency, timeout=timeout, max_retries=max_retries, backoff=backoff,
                        max_tokens=max_tokens, temperature=temperature, max_failed_batches=max_failed_batches,
                        cache_size=cache_size, max_reply_bytes=max_reply_bytes)
        # Checked to be whole numbers; kept as ints: a JSON "max_tokens": 256.0 is a 400 at OpenAI's API, and a
        # float max_reply_bytes cannot cut a body.
        max_concurrency, max_retries, max_tokens, max_failed_batches, cache_size, max_reply_bytes = map(
            int, (max_concurrency, max_retries, max_tokens, max_failed_batches, cache_size, max_reply_bytes))
        loopback = _check_base_url(base_url)
        httpx = _httpx()  # the HTTP client is there before a run counts on this judge
        try:  # SSL_CERT_FILE / SSL_CERT_DIR read now, not at the first judged batch
            ssl = httpx.create_ssl_context()
        except Exception as err:  # noqa: BLE001 - whatever the environment's certificates make it raise
            raise InputError(f"HttpJudge: cannot build the TLS context from this environment ({type(err).__name__}: "
                             f"{err}); check SSL_CERT_FILE / SSL_CERT_DIR.") from None
        self.rubric, self.base_url, self.model, self.api_key_env = rubric, base_url.rstrip("/"), model, api_key_env
        self.name = self.__name__ = name or rubric.name  # TRL names the reward column after __name__
        self.max_concurrency, self.timeout = max_concurrency, timeout
        self.max_retries, self.backoff = max_retries, backoff
        self.max_tokens, self.temperature = max_tokens, temperature
        self.max_failed_batches, self.cache_size = max_failed_batches, cache_size
        self.max_reply_bytes = max_reply_bytes
        self._cache: OrderedDict[str, tuple[float | None, str, str | None]] = OrderedDict()  # score, note, reason
        self._settings = json.dumps({"url": self.base_url, "model": model, "rubric": rubric.to_dict(),
                                     "max_tokens": max_tokens, "temperature": temperature}, sort_keys=True)
        # Per task (``reward_task``; None when called outside per-task rewards): consecutive calls without a score,
        # the HTTP status of the last attempt (0: no whole reply) and what went wrong last (``_error``).
        self.failed_batches: Counter[str | None] = Counter()
        self.last_statuses: dict[str | None, int] = {}
        self.last_errors: dict[str | None, str] = {}
        self._last_status, self._last_error = None, ""  # of whichever task met it last
        self.requests = 0  # HTTP attempts sent, retries included
        self.failures = Counter()  # rows without a score so far, by reason (FAILURE_REASONS)
        self._ssl = ssl  # built once: a new client is cheap with it, ~30-70 ms without
        # httpx reads the proxy variables only with trust_env (the TLS context above is built already)
        self._trust_env = not loopback

    @property
    def last_status(self) -> int | None:
        """The HTTP status of the judge's last attempt, whichever task it was for (0: no whole reply; None: none
        yet); a task's own is ``last_statuses[task]``."""
        return self._last_status

    @property
    def last_error(self) -> str:
        """What went wrong last with a row, whichever task it was for (``""``: nothing yet); a task's own is
        ``last_errors[task]``."""
        return self._last_error

    def _record(self, task: str | None, status: int, error: str | None) -> None:
        """An attempt for ``task``: its status, and what went wrong unless ``error`` is None."""
        self.last_statuses[task] = self._last_status = status
        if error is not None:
            self.last_errors[task] = self._last_error = error

    def __repr__(self) -> str:
        key = f", api_key_env={self.api_key_env!r}" if self.api_key_env else ""
        return (f"HttpJudge(name={self.name!r}, rubric={self.rubric.name!r}, base_url={self.base_url!r}, "
                f"model={self.model!r}{key}, max_concurrency={self.max_concurrency}, timeout={self.timeout})")

    def _key(self, messages: list[dict]) -> str:
        # The messages hold the prompt, the completion and the rubric's columns; settings hold the rest.
        return hashlib.sha256((self._settings + json.dumps(messages, sort_keys=True)).encode()).hexdigest()

    async def __call__(self, prompts, completions, log_metric: Callable | None = None,
                       log_extra: Callable | None = None, **columns) -> list[float | None]:
        n = len(completions)
        task = reward_task.get()
        rows = _rows(columns, self.rubric, n, self.name)
        messages = [self.rubric.messages(prompt_text(p), completion_text(c), r) if _has_columns(r) else None
                    for p, c, r in zip(prompts, completions, rows, strict=True)]
        keys = [self._key(m) if m is not None else None for m in messages]

        verdicts: dict[str, _Verdict] = {}
        hits = 0
        for key in keys:
            if key in self._cache:
                self._cache.move_to_end(key)
                verdicts[key] = _Verdict(*self._cache[key], status=200)  # cached: the server answered
                hits += 1
        todo = {key: m for key, m in zip(keys, messages) if key is not None and key not in verdicts}
        if todo:  # each distinct pair once, even when a group repeats a completion
            verdicts.update(await self._ask_all(todo, task))

        scores = [verdicts[k].score if k is not None else None for k in keys]
        for key, v in verdicts.items():
            if v.cacheable:
                self._cache[key] = (v.score, v.note, v.reason)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

        reasons = Counter(verdicts[k].reason for k in keys if k is not None and verdicts[k].reason is not None)
        self.failures.update(reasons)
        missing = sum(s is None for s in scores)
        if log_metric is not None:
            log_metric(f"judge/{self.name}/missing_share", missing / max(n, 1))
            log_metric(f"judge/{self.name}/cache_hit_share", hits / max(n, 1))
            for reason in FAILURE_REASONS:  # every reason every call: TRL averages each over the steps it got
                log_metric(f"judge/{self.name}/failed/{reason}", reasons[reason] / max(n, 1))
            if task in self.last_statuses:
                log_metric(f"judge/{self.name}/http_status", float(self.last_statuses[task]))
        if log_extra is not None:
            log_extra(f"judge/{self.name}", [verdicts[k].note if k is not None else "row lacks a rubric column"
                                             for k in keys])
        self._count_failure(task, [verdicts[k] for k in keys if k is not None])
        return [self.rubric.normalise(s) if s is not None else None for s in scores]

    def _count_failure(self, task: str | None, asked: list[_Verdict]) -> None:
        """Count a call in which no row of ``asked`` got a score against ``task`` (a call that scored one, or asked
        nothing, ends the run of failures), and raise ``JudgeError`` when that makes ``max_failed_batches``. The
        status and error named are this call's own, whatever another task's calls met meanwhile."""
        failed = bool(asked) and all(v.score is None for v in asked)
        self.failed_batches[task] = self.failed_batches[task] + 1 if failed else 0
        if self.max_failed_batches and self.failed_batches[task] >= self.max_failed_batches:
            last = asked[-1]
            status = last.status if last.status else "none (no response)"
            of_task = f" on task {task!r}" if task is not None else ""
            raise JudgeError(
                f"judge {self.name!r} gave no score for {self.failed_batches[task]} batches in a row{of_task} (last "
                f"batch: {len(asked)} rows) at {self.base_url} model={self.model!r}; last HTTP status: {status}; "
                f"last error: {self._error(last)}. Check that the server is up and answers in the rubric's format "
                f"(a last line 'VERDICT: <{self.rubric.low}-{self.rubric.high}>') within max_tokens="
                f"{self.max_tokens}, or raise max_failed_batches (0 never stops).")

    def _error(self, verdict: _Verdict) -> str:
        """What went wrong with a row without a score, for ``last_error`` and ``JudgeError``."""
        if verdict.reason == "no_verdict":
            return f"no verdict line in the reply: {verdict.note!r}"
        if verdict.reason == "truncated":
            return (f"the reply was cut at max_tokens={self.max_tokens} (finish_reason 'length'), so it was not read "
                    f"for a verdict; raise max_tokens or ask for a shorter reply: {verdict.note!r}")
        if verdict.reason == "filtered":
            return ("the server's content filter withheld or cut the reply, so it was not read for a verdict; judge "
                    "this task with a model or deployment whose filter lets its prompts and completions through, or "
                    f"score it with another reward function: {verdict.note!r}")
        if verdict.reason == "tool_call":
            return ("the judge answered with a tool call, not text, so there was no verdict to read; serve the judge "
                    "without tool calling (no tool parser or tool_choice for it), as grpotrl asks for text only: "
                    f"{verdict.note!r}")
        if verdict.reason == "unfinished":
            return ("the reply ended with a finish_reason other than 'stop', so it was not read for a verdict; see "
                    f"the server's log for why it stopped: {verdict.note!r}")
        return verdict.note or "none"

    async def _ask_all(self, todo: dict[str, list[dict]], task: str | None) -> dict[str, _Verdict]:
        key = os.environ.get(self.api_key_env, "") if self.api_key_env else ""
        headers = {"Authorization": f"Bearer {key}"} if self.api_key_env else {}
        # Every header value sent is a secret, and so is the bare key (redacted whole should it be
        # shorter than PIECE); they live in this call only.
        secrets = (*headers.values(), key) if key else ()
        slots = asyncio.Semaphore(self.max_concurrency)
        httpx = _httpx()
        keys = list(todo)
        try:  # a key changed since init, a proxy variable httpx cannot read: every row fails, nothing raises (I8)
            if self.api_key_env:
                _check_key(key, self.api_key_env)
            limits = httpx.Limits(max_connections=self.max_concurrency,
                                  max_keepalive_connections=self.max_concurrency)
            # One client per call: TRL's event loop is long-lived, a user's asyncio.run() is not,
            # and a client must not outlive the loop its connections belong to.
            client = httpx.AsyncClient(headers=headers, limits=limits, timeout=self.timeout, verify=self._ssl,
                                       trust_env=self._trust_env)
        except Exception as err:  # noqa: BLE001
            note = f"no client: {_excerpt(f'{type(err).__name__}: {err}', secrets)}"
            self._record(task, 0, note)
            return {k: _Verdict(None, note, "transport") for k in keys}
        async with client:
            results = await asyncio.gather(*(self._ask(client, slots, todo[k], secrets, task) for k in keys))
        return dict(zip(keys, results))

    async def _ask(self, client, slots: asyncio.Semaphore, messages: list[dict], secrets: tuple,
                   task: str | None) -> _Verdict:
        """One row: attempts until a usable answer, a failure not worth repeating, or no retries left."""
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature}
        loop = asyncio.get_running_loop()
        bound = (self.max_retries + 1) * self.timeout
        async with slots:  # held through the waits as well: a call's time is bounded by its rows' (class docstring)
            deadline = loop.time() + bound
            attempt = 0
            while True:
                self.requests += 1
                verdict, status, retry, retry_after = await self._attempt(client, body, secrets,
                                                                          deadline - loop.time())
                verdict.status = status
                wait = (retry_after if retry_after is not None
                        else self.backoff * 2**attempt * random.uniform(0.5, 1.0))
                again = retry and attempt < self.max_retries
                if again and loop.time() + wait >= deadline:  # no time left to ask after the wait
                    again = False
                    verdict.note += (f" (not asked again: a wait of {wait:.3g} s would pass the row's bound of "
                                     f"(max_retries + 1) * timeout = {bound:.3g} s)")
                self._record(task, status, self._error(verdict) if verdict.reason is not None else None)
                if not again:
                    return verdict
                await asyncio.sleep(wait)
                attempt += 1

    async def _attempt(self, client, body: dict, secrets: tuple,
                       left: float) -> tuple[_Verdict, int, bool, float | None]:
        """One HTTP exchange, given ``timeout`` or the ``left`` seconds of its row's bound if fewer -> (verdict,
        HTTP status or 0 when no whole reply came, worth retrying, a 429's or 503's Retry-After). Never raises
        but for cancellation: whatever the server or the transport does becomes a verdict with a reason (I8)."""
        status, encoding = 0, ""
        httpx = _httpx()
        limit = min(self.timeout, max(left, 0.0))
        try:
            async with asyncio.timeout(limit):
                async with client.stream("POST", f"{self.base_url}/chat/completions", json=body) as response:
                    status, encoding = response.status_code, response.headers.get("content-encoding", "")
                    retry_after = (_retry_after(response.headers.get("retry-after"), response.headers.get("date"))
                                   if status in _RETRY_AFTER_STATUS else None)
                    cap = self.max_reply_bytes if status == 200 else _ERROR_BODY_BYTES
                    data, complete = await _read_capped(response, cap)
        except (TimeoutError, httpx.TimeoutException):
            rest = "" if limit == self.timeout else " (what was left of the row's bound, (max_retries + 1) * timeout)"
            return _Verdict(None, f"timeout after {limit:.3g} s{rest}", "timeout"), 0, True, None
        except httpx.DecodingError as e:  # a corrupt gzip/deflate/zstd body
            note = _excerpt(f"HTTP {status} with a body that cannot be decoded ({encoding or 'identity'}): {e}",
                            secrets)
            return _Verdict(None, note, "undecodable"), status, status in _RETRY_STATUS, None
        except Exception as e:  # noqa: BLE001 - refused, dropped, reset, malformed or cut-off replies, ...
            return _Verdict(None, _excerpt(f"{type(e).__name__}: {e}", secrets), "transport"), 0, True, None

        if status != 200:
            note = f"HTTP {status}: {_excerpt(data.decode('utf-8', 'replace'), secrets)}"
            return _Verdict(None, note, "http_status"), status, status in _RETRY_STATUS, retry_after
        if not complete:
            note = f"HTTP 200 with a reply over max_reply_bytes={self.max_reply_bytes} (the rest was not read)"
            return _Verdict(None, note, "too_large"), status, False, None
        try:
            text = data.decode("utf-8")  # JSON is UTF-8 (RFC 8259)
        except UnicodeDecodeError:
            note = (f"HTTP 200 with a body that is not UTF-8: "
                    f"{_excerpt(data.decode('utf-8', 'replace'), secrets)!r}")
            return _Verdict(None, note, "undecodable"), status, False, None
        try:
            choice = json.loads(text)["choices"][0]
            finish = choice.get("finish_reason")
            finished = finish is None or (isinstance(finish, str) and finish in _FINISHED)
            message = choice.get("message")
            reply = _reply_text(message.get("content")) if isinstance(message, dict) else None
            if not isinstance(reply, str) and finished:  # a call or a filtered reply may have no text
                raise TypeError(type(reply).__name__)
        except Exception:  # noqa: BLE001 - any body that is not a chat completion
            note = f"HTTP 200 with a body that is not a chat completion: {_excerpt(text, secrets)!r}"
            return _Verdict(None, note, "not_a_chat_completion"), status, False, None
        if not finished:  # cut, withheld or a call: where the server stopped, not where the judge ended
            reason = _UNFINISHED.get(finish, "unfinished") if isinstance(finish, str) else "unfinished"
            tail = _excerpt(reply, secrets, tail=True) if isinstance(reply, str) and reply else "no reply text"
            # which finish_reason, then the reply's end (for "length", _error names it)
            note = tail if reason == "truncated" else \
                f"finish_reason {_excerpt(json.dumps(finish), secrets)[:_FINISH_CHARS]}: {tail}"
            # The server's own answer to this pair is cached, as a verdict is; an unknown one may be a passing fault.
            return _Verdict(None, note, reason, cacheable=reason != "unfinished"), status, False, None
        note = _excerpt(reply, secrets, tail=True)
        score = parse_verdict(reply, self.rubric.low, self.rubric.high)  # a number: nothing of a key in it
        return _Verdict(score, note, "no_verdict" if score is None else None, cacheable=True), status, False, None


def _check_key(key: str | None, env: str) -> None:
    """The API key in variable ``env`` as an HTTP header can carry it: set, printable ASCII, no surrounding
    whitespace (a key read from a file keeps its newline). The key is never shown; the variable's name only
    when it reads as one (``variable_name``), not as a key pasted in its place."""
    if not key:
        raise InputError(f"HttpJudge: the environment variable {variable_name(env)} (api_key_env) is not set here; "
                         "export it with the judge's API key, or pass api_key_env=None for a server without one.")
    if not (key.isascii() and key.isprintable()) or key != key.strip():
        raise InputError(f"HttpJudge: the API key in {variable_name(env)} (api_key_env) has whitespace around it or "
                         "characters an HTTP header cannot carry (not printable ASCII); export the key alone, "
                         "e.g. JUDGE_API_KEY=$(tr -d '\\n' < keyfile).")


_VARIABLE_NAME = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")  # JUDGE_API_KEY; not hf_..., sk_live_..., hex


def variable_name(env: str) -> str:
    """``env`` quoted when it reads as an environment variable's name (upper-case words joined by ``_``), else a
    description: an API key pasted where its variable's name goes must not be echoed into an error.

    >>> variable_name("JUDGE_API_KEY"), variable_name("hf_AbCdEfGh1234"), variable_name("d3b07384d113edec")
    ("'JUDGE_API_KEY'", 'named by api_key_env', 'named by api_key_env')
    """
    return repr(env) if _VARIABLE_NAME.fullmatch(env) else "named by api_key_env"


_SETTING_FLOORS = {  # setting: (smallest value; timeout must be above it), integer
    "max_concurrency": (1, True), "timeout": (0, False), "max_retries": (0, True), "backoff": (0, False),
    "max_tokens": (1, True), "temperature": (0, False), "max_failed_batches": (0, True), "cache_size": (0, True),
    "max_reply_bytes": (1024, True),
}


def _check_settings(**settings) -> None:
    """Each numeric setting finite and in range (``_SETTING_FLOORS``): NaN, an infinity, a negative cache or
    count would fail, or hang, only at the first judged batch."""
    for name, value in settings.items():
        low, integer = _SETTING_FLOORS[name]
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
              and (not integer or value == int(value)) and (value > low if name == "timeout" else value >= low))
        if not ok:
            kind = "an integer" if integer else "a finite number"
            raise InputError(f"HttpJudge: {name} must be {kind} {'>' if name == 'timeout' else '>='} {low}; "
                             f"got {value!r}.")


def _check_base_url(base_url: str) -> bool:
    """The API root, without credentials: the URL is shown in repr, errors and logs. The value is
    never echoed here (it may hold a secret). Returns whether its host is loopback (``_is_loopback``)."""
    try:
        parts = urlsplit(base_url)
        has_credentials = parts.username is not None or parts.password is not None
    except ValueError:
        raise InputError("HttpJudge: base_url is not a URL; give the API root, e.g. http://127.0.0.1:8000/v1.") \
            from None
    if has_credentials or parts.query or parts.fragment:
        raise InputError("HttpJudge: base_url holds user:password@, a ?query or a #fragment; give the API root "
                         "only, e.g. https://host/v1. A key goes in an environment variable named by api_key_env "
                         "(sent as a bearer token, never shown).")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError(f"HttpJudge: base_url must be an http:// or https:// URL with a host, e.g. "
                         f"http://127.0.0.1:8000/v1; got scheme {parts.scheme!r}.")
    return _is_loopback(parts.hostname)


def _is_loopback(host: str) -> bool:
    """``localhost``, a name under it (``judge.localhost``: RFC 6761 reserves them all for loopback) or a loopback
    address (127.0.0.0/8, ``::1``, ``::ffff:127.x.y.z``); a host as ``urlsplit`` gives it (no brackets), in any
    case, with or without the root's trailing dot.

    >>> [_is_loopback(h) for h in ("localhost", "Judge.LOCALHOST.", "127.0.0.2", "::1", "::ffff:127.0.0.1")]
    [True, True, True, True, True]
    >>> [_is_loopback(h) for h in ("10.0.0.1", "judge.local", "localhost.example.com", "notlocalhost")]
    [False, False, False, False]
    """
    name = host.rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _context_length(model, tokenizer) -> tuple[int | None, str]:
    """The most tokens the judge model reads at once, and which setting says so: the smaller of its config's
    max positions and the tokenizer's ``model_max_length`` (where set); ``(None, "")`` when neither says.

    >>> from types import SimpleNamespace
    >>> gpt2 = SimpleNamespace(config=SimpleNamespace(n_positions=1024))
    >>> _context_length(gpt2, SimpleNamespace(model_max_length=512)), _context_length(gpt2, SimpleNamespace())
    ((512, 'tokenizer.model_max_length'), (1024, 'config.n_positions'))
    """
    found = []
    config = getattr(model, "config", None)
    if config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config  # a VLM's text model
        for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = getattr(text, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found.append((value, f"config.{attr}"))
                break
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < _UNSET_MAX_LENGTH:
        found.append((value, "tokenizer.model_max_length"))
    return min(found) if found else (None, "")


def _first_line(err: BaseException, chars: int | None = NOTE_CHARS) -> str:
    """The first line of an exception's message, at most ``chars`` of it (None: all): what a note keeps of it."""
    text = str(err).strip()
    return text.splitlines()[0][:chars] if text else ""


def _out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation failure: torch's ``OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` is
    the same class), or a ``RuntimeError`` whose message says memory could not be allocated (the CPU allocator, MPS).

    >>> _out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    True
    >>> _out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes."))
    True
    >>> _out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))
    False
    """
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError)
                                                       and _OUT_OF_MEMORY.search(str(err)) is not None)


def _render(tokenizer, messages: list[dict], prefill: str) -> str:
    """One local judge input: ``messages`` through ``tokenizer``'s chat template with the generation prompt, then
    the verdict's ``prefill``. Raises what the template raises."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefill


class LocalJudge:
    """Scores with a causal LM in memory, G-Eval style: the rubric's messages go through the
    judge tokenizer's chat template with the generation prompt, the reply is pre-filled with
    ``VERDICT: ``, and the score is the expectation of the scale under the next-token
    distribution restricted to the scale's digits, read at each row's last real token (I9).
    Logs ``judge/<name>/verdict_mass``: the probability the judge put on the scale at all (low
    means it would not have answered in format), ``judge/<name>/missing_share``,
    ``judge/<name>/failed/<reason>`` (share of rows per ``LOCAL_FAILURE_REASONS``),
    ``judge/<name>/oom_retries`` (forwards asked again after running out of memory) and
    ``judge/<name>/batch_size`` (rows per forward once the call is done: the size the next call starts at; TRL
    averages it over a log step's calls and the processes, so a value between two sizes means it shrank within
    that step or on some ranks only), and through ``log_extra`` the failure per row.

    Refused when it is built (``InputError``), before any compute: a tokenizer without a chat template, and a
    template that raises on the rubric's messages (a system message, then the worked examples as turns, then the
    row: a template that takes no system message or wants the roles to alternate from a user turn raises on
    every row).

    Failures (I8) give ``None`` for the rows they touch, never a score and never an exception:
    a row whose messages the chat template raises on (on that row's text) is left unscored (``template_error``;
    its note keeps the error's type, and its message only where no piece of the row's text is in it);
    a row whose judge input (rubric, prompt, completion and the pre-filled verdict line) is longer than
    ``max_input_tokens`` is not cut but left unscored (``too_long``): cutting the completion, at
    its end or its middle, can hide what the verdict turns on (a falsehood in its last sentence). A forward that
    runs out of memory (``_out_of_memory``) lets go of what it held (and empties CUDA's cache) and is asked again
    with half its rows, down to one; ``batch_size`` stays at the smaller size for the rest of the run, with one
    warning per size. Any other exception in a forward, or running out of memory on one row, leaves that
    forward's rows unscored (``model_error``) and the other forwards' scores stand. After ``max_failed_batches``
    calls in a row without one score (0: never), counted per task like ``HttpJudge``'s, ``JudgeError`` stops the
    run.

    The scale must be one token per score for this tokenizer (single digits: the default
    1-5); otherwise construction fails and says so.
    """

    PREFILL = "VERDICT:"
    VERDICT_TOKENS = 1  # the score's own token, after the input: it needs a position in the context too

    def __init__(self, model, tokenizer, rubric: Rubric, *, name: str | None = None, batch_size: int = 4,
                 max_failed_batches: int = 3):
        # batch_size: rows per forward, halved for the rest of the run where a forward runs out of memory.
        self.model, self.tokenizer, self.rubric, self.batch_size = model, tokenizer, rubric, batch_size
        self.name = self.__name__ = name or f"local_{rubric.name}"
        for setting, value, low in (("batch_size", batch_size, 1), ("max_failed_batches", max_failed_batches, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"LocalJudge {self.name!r}: {setting} must be an integer >= {low}; got {value!r}.")
        self.prefill, self.score_ids = self.check_tokenizer(tokenizer, rubric, self.name)
        self.max_failed_batches = max_failed_batches
        context, self._context_from = _context_length(model, tokenizer)
        # The most tokens one judge input may have (None: neither the config nor the tokenizer says).
        self.max_input_tokens = context - self.VERDICT_TOKENS if context is not None else None
        # As HttpJudge's: per task, consecutive calls without a score and what went wrong last; rows without a
        # score so far, by reason; forwards asked again with fewer rows after running out of memory.
        self.failed_batches: Counter[str | None] = Counter()
        self.last_errors: dict[str | None, str] = {}
        self._last_error = ""
        self.failures = Counter()
        self.oom_retries = 0

    @property
    def last_error(self) -> str:
        """What went wrong last with a row, whichever task it was for (``""``: nothing yet); a task's own is
        ``last_errors[task]``."""
        return self._last_error

    @classmethod
    def check_tokenizer(cls, tokenizer, rubric: Rubric, name: str) -> tuple[str, list[int]]:
        """What the judge needs of its tokenizer, checked before its model loads (``rewards.recipe.LocalJudgeSpec``)
        and when it is built: a pad token; the scores of ``rubric``'s scale one token each after the prefill
        (``VERDICT: `` then digits, as SmolLM2 and Llama 3 write them, or ``VERDICT:`` then `` 4``, as GPT-2 does:
        whichever writing makes every score one token after an unchanged prefill); a chat template that renders the
        rubric's messages, on a stand-in row (a tokenizer without one, or a template that raises on the rubric's
        shape of messages, could score no row). Returns ``(prefill, score_ids)``; an ``InputError`` otherwise,
        naming the judge ``name``."""
        if tokenizer.pad_token_id is None:
            raise InputError(f"LocalJudge {name!r}: the tokenizer has no pad token; set "
                             "tokenizer.pad_token = tokenizer.eos_token (padding is masked out).")
        prefill, score_ids = cls._scale_tokens(tokenizer, rubric, name)
        if getattr(tokenizer, "chat_template", None) is None:
            raise InputError(f"LocalJudge {name!r}: the judge tokenizer "
                             f"({getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}) has no "
                             "chat template, so the rubric's messages cannot be rendered for it. Judge with an "
                             "instruct (chat) model, or set tokenizer.chat_template to the model's template.")
        stand_in = rubric.messages("A question.", "An answer.", dict.fromkeys(rubric.columns.values(), "A reference."))
        try:
            _render(tokenizer, stand_in, prefill)
        except Exception as err:  # noqa: BLE001 - whatever the template raises (its raise_exception, jinja errors)
            raise InputError(
                f"LocalJudge {name!r}: the judge tokenizer's chat template cannot render the messages of rubric "
                f"{rubric.name!r} (roles {', '.join(m['role'] for m in stand_in)}): it raised "
                f"{type(err).__name__}: {_first_line(err)}. Judge with a model whose chat template takes a system "
                "message and these turns, or set tokenizer.chat_template to one that does.") from None
        return prefill, score_ids

    @classmethod
    def _scale_tokens(cls, tokenizer, rubric: Rubric, name: str) -> tuple[str, list[int]]:
        scale = range(rubric.low, rubric.high + 1)
        for prefill, sep in ((cls.PREFILL + " ", ""), (cls.PREFILL, " ")):
            head = tokenizer.encode(prefill, add_special_tokens=False)
            ids = []
            for n in scale:
                full = tokenizer.encode(prefill + sep + str(n), add_special_tokens=False)
                if full[:len(head)] != head or len(full) != len(head) + 1:
                    break
                ids.append(full[-1])
            if len(ids) == len(scale) and len(set(ids)) == len(ids):
                return prefill, ids
        raise InputError(f"LocalJudge {name!r}: the scores {rubric.low}..{rubric.high} of rubric "
                         f"{rubric.name!r} are not one token each for this tokenizer; use a rubric with a "
                         "single-digit scale (low/high between 0 and 9).")

    def _text(self, prompt, completion, row: dict) -> str:
        """The judge input for one row (``_render`` of the rubric's messages for it)."""
        return _render(self.tokenizer, self.rubric.messages(prompt_text(prompt), completion_text(completion), row),
                       self.prefill)

    def _template_error(self, err: Exception, prompt, completion, row: dict) -> str:
        """The note of a row whose messages the template raised on: the error's type, and its first line unless a
        piece of the row's text (``PIECE`` characters or more, as the rubric quotes it) is in the message."""
        line = _first_line(err, None)  # searched whole: a piece of the row across the cut is found too
        quoted = self.rubric.fields(prompt_text(prompt), completion_text(completion), row).values()
        message = (line[:NOTE_CHARS] if not _secret_spans(line, list(quoted))
                   else "(its message quotes the row's text and is not kept)")
        return (f"the judge tokenizer's chat template raised {type(err).__name__} on this row's messages: {message}; "
                "the row is not scored: fix the template (tokenizer.chat_template) or judge with a model whose "
                "template renders it")

    @torch.inference_mode()
    def _score(self, texts: list[str]) -> tuple[list[_Verdict], list[float], int]:
        """A verdict per text (its score on the rubric's scale, or None with a reason), the probability mass
        each scored text put on the scale, and how many forwards were asked again after running out of memory."""
        values = torch.arange(self.rubric.low, self.rubric.high + 1, dtype=torch.float32)  # [S]
        verdicts: list[_Verdict | None] = [None] * len(texts)
        # The template already holds BOS where the model wants one (I1: no doubled BOS).
        lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        fit = []
        for i, length in enumerate(lengths):
            if self.max_input_tokens is not None and length > self.max_input_tokens:
                verdicts[i] = _Verdict(None, self._too_long(length), "too_long")
            else:
                fit.append(i)
        masses, retries, at = [], 0, 0
        was_training = self.model.training
        self.model.eval()
        try:
            while at < len(fit):
                chunk = fit[at:at + self.batch_size]
                try:
                    probs = self._forward([texts[i] for i in chunk])  # [B, S]
                except Exception as err:  # noqa: BLE001 - out of memory, a device or kernel error: these rows only
                    probs, oom, note = None, _out_of_memory(err), self._forward_error(err, len(chunk))
                if probs is None:  # out of the except: the failed forward's frames, and the tensors they held, are gone
                    if oom:
                        self._release_memory()
                    if oom and len(chunk) > 1:  # the same rows again, half as many per forward
                        self._shrink_batch(len(chunk))
                        retries += 1
                        continue
                    for i in chunk:
                        verdicts[i] = _Verdict(None, note, "model_error")
                    at += len(chunk)
                    continue
                at += len(chunk)
                mass = probs.sum(-1)  # [B]
                expected = (probs * values).sum(-1) / mass.clamp_min(1e-30)  # [B]
                for i, e, m in zip(chunk, expected.tolist(), mass.tolist()):
                    # No mass on the scale (it underflowed) or non-finite logits: no verdict, never a made-up score.
                    if math.isfinite(e) and math.isfinite(m) and m > 0:
                        verdicts[i] = _Verdict(e, f"expected score {e:.3f}, mass on the scale {m:.3f}", None)
                    else:
                        verdicts[i] = _Verdict(None, f"no probability on the scale (mass {m!r}); the judge would "
                                               "not answer in format", "no_verdict")
                    if math.isfinite(m):
                        masses.append(m)
        finally:
            self.model.train(was_training)
        self.oom_retries += retries
        return verdicts, masses, retries

    def _forward(self, batch: list[str]) -> torch.Tensor:
        """The next-token probabilities of the scale's scores at each text's last real token (I9), on the CPU."""
        enc = self.tokenizer(batch, add_special_tokens=False, padding=True, return_tensors="pt").to(self.model.device)
        last = last_token_index(enc["attention_mask"])  # [B]
        keep = torch.unique(last)  # [K] positions whose logits are needed
        logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                            position_ids=position_ids_from_mask(enc["attention_mask"]),
                            logits_to_keep=keep).logits  # [B, K, V]
        at_last = logits[torch.arange(len(last)), torch.searchsorted(keep, last)]  # [B, V]
        return at_last.float().softmax(-1)[:, self.score_ids].cpu()  # [B, S]

    def _release_memory(self) -> None:
        """After a forward ran out of memory: collect what it left in reference cycles and, on CUDA, give the
        allocator's cached blocks back, so that the smaller forward finds that memory free."""
        gc.collect()
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def _shrink_batch(self, rows: int) -> None:
        """A forward of ``rows`` ran out of memory: half that many rows per forward (at least one) from now on. The
        warning says the size now used and the setting that starts the next run there (nothing else keeps it; the
        size in force is the metric ``judge/<name>/batch_size``)."""
        was, self.batch_size = self.batch_size, max(rows // 2, 1)
        logger.warning("LocalJudge %r ran out of memory on a forward of %d rows: it scores %d rows per forward for "
                       "the rest of the run (batch_size was %d). To start there next time, set the judge's "
                       "batch_size to %d (judges.%s.batch_size in a recipe, LocalJudge(batch_size=...) in Python).",
                       self.name, rows, self.batch_size, was, self.batch_size, self.name)

    def _too_long(self, length: int) -> str:
        context = self.max_input_tokens + self.VERDICT_TOKENS
        return (f"the judge input is {length} tokens (rubric, prompt, completion and 'VERDICT:'), over the "
                f"{self.max_input_tokens} its context allows ({self._context_from} = {context}, less "
                f"{self.VERDICT_TOKENS} for the verdict); not cut, since a cut completion may change the verdict: "
                "lower max_completion_length, or judge with a model of a longer context")

    def _forward_error(self, err: Exception, rows: int) -> str:
        advice = "see the error"
        if _out_of_memory(err):  # a forward of more rows is asked again with fewer (_score): this was one row
            advice = (f"it ran out of memory on a single row (batch_size {self.batch_size}): lower "
                      "max_completion_length, or put the judge on a device with free memory")
        return (f"the judge model's forward raised {type(err).__name__}: {_first_line(err)}; its {rows} rows are not "
                f"scored: {advice}")

    def __call__(self, prompts, completions, log_metric: Callable | None = None,
                 log_extra: Callable | None = None, **columns) -> list[float | None]:
        task = reward_task.get()
        rows = _rows(columns, self.rubric, len(completions), self.name)
        verdicts: list[_Verdict | None] = [None] * len(completions)
        texts: dict[int, str] = {}  # row -> its judge input
        for i, row in enumerate(rows):
            if not _has_columns(row):
                continue
            try:
                texts[i] = self._text(prompts[i], completions[i], row)
            except Exception as err:  # noqa: BLE001 - what the template raises on this row's text: this row only
                verdicts[i] = _Verdict(None, self._template_error(err, prompts[i], completions[i], row),
                                       "template_error")
        masses: list[float] = []
        retries = 0
        if texts:
            scored, masses, retries = self._score(list(texts.values()))
            for i, v in zip(texts, scored, strict=True):
                verdicts[i] = v
        asked = [v for v in verdicts if v is not None]
        out = [self.rubric.normalise(v.score) if v is not None and v.score is not None else None for v in verdicts]
        reasons = Counter(v.reason for v in asked if v.reason is not None)
        self.failures.update(reasons)
        failed = [v for v in asked if v.reason is not None]
        if failed:
            self.last_errors[task] = self._last_error = failed[-1].note
        n = max(len(out), 1)
        if log_metric is not None:
            if masses:
                log_metric(f"judge/{self.name}/verdict_mass", sum(masses) / len(masses))
            log_metric(f"judge/{self.name}/missing_share", sum(s is None for s in out) / n)
            for reason in LOCAL_FAILURE_REASONS:  # every reason every call: TRL averages each over the steps it got
                log_metric(f"judge/{self.name}/failed/{reason}", reasons[reason] / n)
            log_metric(f"judge/{self.name}/oom_retries", retries)
            log_metric(f"judge/{self.name}/batch_size", self.batch_size)  # halved for the rest of the run on OOM
        if log_extra is not None:
            log_extra(f"judge/{self.name}", [v.note if v is not None else "row lacks a rubric column"
                                             for v in verdicts])
        self._count_failure(task, asked)
        return out

    def _count_failure(self, task: str | None, asked: list[_Verdict]) -> None:
        """As ``HttpJudge._count_failure``: a call in which no row of ``asked`` got a score counts against
        ``task``, a call that scored one resets it, and ``max_failed_batches`` in a row raise ``JudgeError``."""
        failed = bool(asked) and all(v.score is None for v in asked)
        self.failed_batches[task] = self.failed_batches[task] + 1 if failed else 0
        if self.max_failed_batches and self.failed_batches[task] >= self.max_failed_batches:
            of_task = f" on task {task!r}" if task is not None else ""
            raise JudgeError(
                f"local judge {self.name!r} gave no score for {self.failed_batches[task]} batches in a row{of_task} "
                f"(last batch: {len(asked)} rows); last error: {asked[-1].note}. Or raise max_failed_batches (now "
                f"{self.max_failed_batches}; 0 never stops).")


class JudgeRouter:
    """One reward column from several judges: each row goes to ``judges[row[task_column]]``;
    a row whose task has no judge gets ``None`` (another reward function scores it).

    >>> import asyncio
    >>> def shouty(prompts, completions, **kw): return [float(c.isupper()) for c in completions]
    >>> def long(prompts, completions, **kw): return [float(len(c) > 3) for c in completions]
    >>> route = JudgeRouter({"fairness": shouty, "hallucination": long})
    >>> asyncio.run(route(["p"] * 3, ["OK", "ok", "okay"], task=["fairness", "fairness", "math"]))
    [1.0, 0.0, None]
    """

    def __init__(self, judges: Mapping[str, Callable], task_column: str = "task", name: str = "judge"):
        self.judges, self.task_column = dict(judges), task_column
        self.name = self.__name__ = name

    def __repr__(self) -> str:
        return f"JudgeRouter({self.judges!r}, task_column={self.task_column!r}, name={self.name!r})"

    async def __call__(self, prompts, completions, log_extra: Callable | None = None, **kwargs):
        n = len(completions)
        if self.task_column not in kwargs:
            raise InputError(f"JudgeRouter {self.name!r}: the batch has no {self.task_column!r} column to route "
                             f"on (columns: {sorted(k for k, v in kwargs.items() if isinstance(v, list))}); add it "
                             "to the dataset, or pass a single judge as the reward function.")
        by_task: dict[str, list[int]] = {}
        for i, task in enumerate(kwargs[self.task_column]):
            if task in self.judges:
                by_task.setdefault(task, []).append(i)
        extras: dict[str, list] = {}

        def scatter(idx):  # a sub-judge's log_extra, put back at the rows it was given
            def log(column, values):
                extras.setdefault(column, [None] * n)
                for i, v in zip(idx, values, strict=True):
                    extras[column][i] = v
            return log

        async def ask(task, judge, sub):  # its own asyncio task under gather: the reward_task set stays in it
            reward_task.set(task)
            return await judge(**sub) if is_async_callable(judge) else await asyncio.to_thread(judge, **sub)

        calls = []
        for task, idx in by_task.items():
            sub = rows_of(idx, n, prompts=prompts, completions=completions, **kwargs)
            sub["log_extra"] = scatter(idx)
            calls.append(ask(task, self.judges[task], sub))
        out: list[float | None] = [None] * n
        for idx, scores in zip(by_task.values(), await asyncio.gather(*calls)):
            for i, s in zip(idx, scores, strict=True):
                out[i] = s
        if log_extra is not None:
            for column, values in extras.items():
                log_extra(column, values)
        return out

