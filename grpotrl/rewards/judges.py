r"""LLM judges as TRL reward functions: ``(prompts, completions, **columns) -> list[float | None]``.

``HttpJudge`` asks any OpenAI-compatible chat-completions server (vLLM, TGI,
``transformers serve``, hosted APIs); ``LocalJudge`` scores with a causal LM already in
memory; ``JudgeRouter`` sends each row to the judge of its ``task`` column. All three are
ordinary reward functions: pass them in ``reward_funcs`` (TRL 1.16 awaits async ones on its
own event-loop thread, in parallel with other async rewards) or call them yourself
(``asyncio.run(judge(prompts, completions))``). Scores are mapped to [0, 1].

Failure semantics (INVARIANTS I8). A timeout, a dropped connection, an HTTP error, a body
that is not a chat completion or a reply without a readable verdict gives ``None`` for that
row -- TRL leaves it out of the group baseline -- never 0. Each call logs, through TRL's
``log_metric``, ``judge/<name>/missing_share`` (rows without a score), ``judge/<name>/http_status``
(the last status; 0 when no response came back) and ``judge/<name>/cache_hit_share``, and
through ``log_extra`` the judge's reply or the failure per row. After ``max_failed_batches``
consecutive calls in which no row got a score, ``JudgeError`` stops training, naming the
judge, the last HTTP status and the last error.

What it does not do: streaming, tool calls, JSON mode (``transformers serve`` rejects
``response_format``), cross-process cache sharing (the cache lives in the judge object,
one per process), or anything against a judge model that simply grades badly -- a 135M judge
obeys "VERDICT: 5" written inside the answer it grades; the parser and quoting only make
sure such text is never read as the judge's own verdict (``rubrics.py``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httpx2 as httpx
import torch
from trl.trainer.utils import is_async_callable

from ..discriminator import last_token_index
from ..errors import InputError
from ..masking import position_ids_from_mask
from .rubrics import Rubric, parse_verdict, prompt_text
from .rules import completion_text
from .tasks import rows_of

# Statuses worth asking again: overload and server-side errors.
_RETRY_STATUS = {429, 500, 502, 503, 504}
_MAX_RETRY_AFTER_S = 60.0


class JudgeError(RuntimeError):
    """A judge gave no score for ``max_failed_batches`` batches in a row."""


@dataclass
class _Verdict:
    score: float | None  # on the rubric's scale
    note: str  # the judge's reply, or what went wrong
    cacheable: bool  # the server answered (a score or a reply without a verdict)


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


class HttpJudge:
    """Scores each completion by asking an OpenAI-compatible ``/chat/completions`` endpoint.

    Args:
        rubric: what to ask (``rubrics.FAIRNESS``, ``rubrics.HALLUCINATION`` or your own).
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the ``model`` field of each request.
        api_key_env: NAME of the environment variable holding the API key (sent as a bearer
            token). The key is read at each call and kept nowhere: not in the object, its
            repr, its cache keys, logs or errors.
        name: metric and reward-column name (default: the rubric's name).
        max_concurrency: requests in flight at once.
        timeout: seconds per attempt, whole request included.
        max_retries: further attempts after a timeout, a dropped connection, 429 or 5xx, with
            exponential backoff from ``backoff`` seconds (a 429's ``Retry-After`` wins, capped).
        max_tokens, temperature: sampling of the judge's reply.
        max_failed_batches: consecutive calls without a single score before ``JudgeError``
            (0 never raises).
        cache_size: verdicts kept (least recently used dropped). A (settings, prompt,
            completion, columns) pair the server has answered is never sent again; failures
            are not cached.
    """

    def __init__(self, rubric: Rubric, *, base_url: str, model: str, api_key_env: str | None = None,
                 name: str | None = None, max_concurrency: int = 8, timeout: float = 30.0, max_retries: int = 2,
                 backoff: float = 0.5, max_tokens: int = 256, temperature: float = 0.0,
                 max_failed_batches: int = 3, cache_size: int = 100_000):
        if api_key_env is not None and not os.environ.get(api_key_env):
            raise InputError(f"HttpJudge: environment variable {api_key_env!r} (api_key_env) is not set; export "
                             "it with the judge's API key, or pass api_key_env=None for a server without one.")
        if max_concurrency < 1 or timeout <= 0 or max_retries < 0:
            raise InputError(f"HttpJudge: need max_concurrency >= 1, timeout > 0, max_retries >= 0; got "
                             f"{max_concurrency}, {timeout}, {max_retries}.")
        self.rubric, self.base_url, self.model, self.api_key_env = rubric, base_url.rstrip("/"), model, api_key_env
        self.name = self.__name__ = name or rubric.name  # TRL names the reward column after __name__
        self.max_concurrency, self.timeout = max_concurrency, timeout
        self.max_retries, self.backoff = max_retries, backoff
        self.max_tokens, self.temperature = max_tokens, temperature
        self.max_failed_batches, self.cache_size = max_failed_batches, cache_size
        self._cache: OrderedDict[str, tuple[float | None, str]] = OrderedDict()
        self._settings = json.dumps({"url": self.base_url, "model": model, "rubric": rubric.to_dict(),
                                     "max_tokens": max_tokens, "temperature": temperature}, sort_keys=True)
        self.failed_batches, self.last_status, self.last_error = 0, None, ""
        self.requests = 0  # HTTP attempts sent, retries included
        self._ssl = None  # built once: a new client is cheap with it, ~30-70 ms without

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
        rows = _rows(columns, self.rubric, n, self.name)
        messages = [self.rubric.messages(prompt_text(p), completion_text(c), r) if _has_columns(r) else None
                    for p, c, r in zip(prompts, completions, rows, strict=True)]
        keys = [self._key(m) if m is not None else None for m in messages]

        verdicts: dict[str, _Verdict] = {}
        hits = 0
        for key in keys:
            if key in self._cache:
                score, note = self._cache[key]
                self._cache.move_to_end(key)
                verdicts[key] = _Verdict(score, note, cacheable=False)
                hits += 1
        todo = {key: m for key, m in zip(keys, messages) if key is not None and key not in verdicts}
        if todo:  # each distinct pair once, even when a group repeats a completion
            verdicts.update(await self._ask_all(todo))

        scores = [verdicts[k].score if k is not None else None for k in keys]
        for key, v in verdicts.items():
            if v.cacheable:
                self._cache[key] = (v.score, v.note)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

        missing = sum(s is None for s in scores)
        if log_metric is not None:
            log_metric(f"judge/{self.name}/missing_share", missing / max(n, 1))
            log_metric(f"judge/{self.name}/cache_hit_share", hits / max(n, 1))
            if self.last_status is not None:
                log_metric(f"judge/{self.name}/http_status", float(self.last_status))
        if log_extra is not None:
            log_extra(f"judge/{self.name}", [verdicts[k].note[-200:] if k is not None else "row lacks a rubric column"
                                             for k in keys])
        asked = sum(k is not None for k in keys)
        self._count_failure(asked > 0 and missing == n, asked)
        return [self.rubric.normalise(s) if s is not None else None for s in scores]

    def _count_failure(self, failed: bool, rows: int) -> None:
        self.failed_batches = self.failed_batches + 1 if failed else 0
        if self.max_failed_batches and self.failed_batches >= self.max_failed_batches:
            status = self.last_status if self.last_status else "none (no response)"
            raise JudgeError(
                f"judge {self.name!r} gave no score for {self.failed_batches} batches in a row (last batch: "
                f"{rows} rows) at {self.base_url} model={self.model!r}; last HTTP status: {status}; last error: "
                f"{self.last_error or 'none'}. Check that the server is up and answers in the rubric's format "
                f"(a last line 'VERDICT: <{self.rubric.low}-{self.rubric.high}>'), or raise max_failed_batches "
                f"(0 never stops).")

    async def _ask_all(self, todo: dict[str, list[dict]]) -> dict[str, _Verdict]:
        headers = {}
        if self.api_key_env is not None:
            headers["Authorization"] = f"Bearer {os.environ.get(self.api_key_env, '')}"
        slots = asyncio.Semaphore(self.max_concurrency)
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        # One client per call: TRL's event loop is long-lived, a user's asyncio.run() is not,
        # and a client must not outlive the loop its connections belong to.
        self._ssl = self._ssl or httpx.create_ssl_context()
        async with httpx.AsyncClient(headers=headers, limits=limits, timeout=self.timeout, verify=self._ssl) as client:
            keys = list(todo)
            results = await asyncio.gather(*(self._ask(client, slots, todo[k]) for k in keys))
        return dict(zip(keys, results))

    async def _ask(self, client, slots: asyncio.Semaphore, messages: list[dict]) -> _Verdict:
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature}
        status, error = 0, ""
        for attempt in range(self.max_retries + 1):
            wait = self.backoff * 2**attempt * random.uniform(0.5, 1.0)
            async with slots:
                self.requests += 1
                try:
                    async with asyncio.timeout(self.timeout):
                        response = await client.post(f"{self.base_url}/chat/completions", json=body)
                except (TimeoutError, httpx.TimeoutException):
                    status, error = 0, f"timeout after {self.timeout} s"
                except httpx.TransportError as e:  # refused, dropped, reset, malformed response
                    status, error = 0, f"{type(e).__name__}: {e}"[:200]
                else:
                    status = response.status_code
                    if status not in _RETRY_STATUS:
                        break
                    error = self._redact(f"HTTP {status}: {response.text[:200]}")
                    retry_after = response.headers.get("retry-after", "")
                    if status == 429 and retry_after.replace(".", "", 1).isdigit():
                        wait = min(float(retry_after), _MAX_RETRY_AFTER_S)
            self.last_status, self.last_error = status, error
            if attempt < self.max_retries:
                await asyncio.sleep(wait)
        else:
            return _Verdict(None, error, cacheable=False)

        self.last_status = status
        if status != 200:
            self.last_error = self._redact(f"HTTP {status}: {response.text[:200]}")
            return _Verdict(None, self.last_error, cacheable=False)
        try:
            reply = response.json()["choices"][0]["message"]["content"]
            if not isinstance(reply, str):
                raise TypeError(type(reply).__name__)
        except Exception:  # noqa: BLE001 - any body that is not a chat completion
            self.last_error = self._redact(f"HTTP 200 with a body that is not a chat completion: "
                                           f"{response.text[:200]!r}")
            return _Verdict(None, self.last_error, cacheable=False)
        reply = self._redact(reply)
        score = parse_verdict(reply, self.rubric.low, self.rubric.high)
        if score is None:
            self.last_error = f"no verdict line in the reply: {reply[-200:]!r}"
        return _Verdict(score, reply, cacheable=True)

    def _redact(self, text: str) -> str:
        """Server text as kept in notes and errors, with the API key cut out should a server echo it."""
        key = os.environ.get(self.api_key_env, "") if self.api_key_env else ""
        return text.replace(key, "<api key>") if len(key) >= 4 else text


class LocalJudge:
    """Scores with a causal LM in memory, G-Eval style: the rubric's messages go through the
    judge tokenizer's chat template with the generation prompt, the reply is pre-filled with
    ``VERDICT: ``, and the score is the expectation of the scale under the next-token
    distribution restricted to the scale's digits, read at each row's last real token (I9).
    Logs ``judge/<name>/verdict_mass``: the probability the judge put on the scale at all (low
    means it would not have answered in format).

    The scale must be one token per score for this tokenizer (single digits: the default
    1-5); otherwise construction fails and says so.
    """

    PREFILL = "VERDICT:"

    def __init__(self, model, tokenizer, rubric: Rubric, *, name: str | None = None, batch_size: int = 4):
        self.model, self.tokenizer, self.rubric, self.batch_size = model, tokenizer, rubric, batch_size
        self.name = self.__name__ = name or f"local_{rubric.name}"
        if tokenizer.pad_token_id is None:
            raise InputError(f"LocalJudge {self.name!r}: the tokenizer has no pad token; set "
                             "tokenizer.pad_token = tokenizer.eos_token (padding is masked out).")
        self.prefill, self.score_ids = self._scale_tokens()

    def _scale_tokens(self) -> tuple[str, list[int]]:
        """``VERDICT: `` then digits (SmolLM2, Llama 3), or ``VERDICT:`` then `` 4`` (GPT-2):
        whichever writing makes every score one token after an unchanged prefill."""
        scale = range(self.rubric.low, self.rubric.high + 1)
        for prefill, sep in ((self.PREFILL + " ", ""), (self.PREFILL, " ")):
            head = self.tokenizer.encode(prefill, add_special_tokens=False)
            ids = []
            for n in scale:
                full = self.tokenizer.encode(prefill + sep + str(n), add_special_tokens=False)
                if full[:len(head)] != head or len(full) != len(head) + 1:
                    break
                ids.append(full[-1])
            if len(ids) == len(scale) and len(set(ids)) == len(ids):
                return prefill, ids
        raise InputError(f"LocalJudge {self.name!r}: the scores {self.rubric.low}..{self.rubric.high} of rubric "
                         f"{self.rubric.name!r} are not one token each for this tokenizer; use a rubric with a "
                         "single-digit scale (low/high between 0 and 9).")

    def _texts(self, prompts, completions, rows) -> list[str]:
        return [self.tokenizer.apply_chat_template(self.rubric.messages(prompt_text(p), completion_text(c), r),
                                                   tokenize=False, add_generation_prompt=True) + self.prefill
                for p, c, r in zip(prompts, completions, rows, strict=True)]

    @torch.inference_mode()
    def scores(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Expected score on the rubric's scale and the probability mass on it, per text."""
        values = torch.arange(self.rubric.low, self.rubric.high + 1, dtype=torch.float32)  # [S]
        expected, mass = [], []
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(texts), self.batch_size):
                # The template already holds BOS where the model wants one (I1: no doubled BOS).
                enc = self.tokenizer(texts[start:start + self.batch_size], add_special_tokens=False, padding=True,
                                     return_tensors="pt").to(self.model.device)
                last = last_token_index(enc["attention_mask"])  # [B]
                keep = torch.unique(last)  # [K] positions whose logits are needed
                logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                    position_ids=position_ids_from_mask(enc["attention_mask"]),
                                    logits_to_keep=keep).logits  # [B, K, V]
                at_last = logits[torch.arange(len(last)), torch.searchsorted(keep, last)]  # [B, V]
                probs = at_last.float().softmax(-1)[:, self.score_ids].cpu()  # [B, S]
                mass.append(probs.sum(-1))
                expected.append((probs * values).sum(-1) / probs.sum(-1).clamp_min(1e-30))
        finally:
            self.model.train(was_training)
        return torch.cat(expected), torch.cat(mass)

    def __call__(self, prompts, completions, log_metric: Callable | None = None,
                 log_extra: Callable | None = None, **columns) -> list[float | None]:
        rows = _rows(columns, self.rubric, len(completions), self.name)
        usable = [i for i, r in enumerate(rows) if _has_columns(r)]
        out: list[float | None] = [None] * len(completions)
        if usable:
            texts = self._texts([prompts[i] for i in usable], [completions[i] for i in usable],
                                [rows[i] for i in usable])
            expected, mass = self.scores(texts)
            for i, e in zip(usable, expected.tolist()):
                out[i] = self.rubric.normalise(e)
            if log_metric is not None:
                log_metric(f"judge/{self.name}/verdict_mass", mass.mean().item())
        if log_metric is not None:
            log_metric(f"judge/{self.name}/missing_share", sum(s is None for s in out) / max(len(out), 1))
        return out


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

        calls = []
        for task, idx in by_task.items():
            sub = rows_of(idx, n, prompts=prompts, completions=completions, **kwargs)
            sub["log_extra"] = scatter(idx)
            judge = self.judges[task]
            result = judge(**sub) if is_async_callable(judge) else asyncio.to_thread(judge, **sub)
            calls.append(result)
        out: list[float | None] = [None] * n
        for idx, scores in zip(by_task.values(), await asyncio.gather(*calls)):
            for i, s in zip(idx, scores, strict=True):
                out[i] = s
        if log_extra is not None:
            for column, values in extras.items():
                log_extra(column, values)
        return out

