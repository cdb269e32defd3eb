"""Reward functions per task: ``{"fairness": [f, g], "hallucination": h}`` -> TRL's flat list.

Each (task, function) pair becomes one TRL reward function named ``<task>/<name>`` that calls
the function on its task's rows only (prompts, completions and every per-row column cut to
those rows; judges see no other task's text) and returns None for the other rows. TRL sums
the functions with ``nansum``, so every row's reward comes from its own task's functions, and
``rewards/<task>/<name>/mean`` is logged per pair. Async functions (HTTP judges) stay async.
While a function scores its task's rows, ``reward_task`` holds the task: one function given to
several tasks (one judge) keeps what it counts per task apart (``HttpJudge``'s failed batches).

>>> def short(completions, **kw): return [-len(c[0]["content"]) for c in completions]
>>> f, = per_task({"a": short}, "task")
>>> f.__name__
'a/short'
>>> f(prompts=["p", "q"], completions=[[{"content": "xy"}], [{"content": "z"}]], task=["a", "b"])
[-2, None]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextvars import ContextVar

from trl.trainer.utils import get_callable_name, is_async_callable

from ..errors import InputError

# The task whose rows a reward function is scoring (set by per_task and JudgeRouter around the call; a context
# variable, so each of TRL's concurrent async rewards sees its own), None outside them.
reward_task: ContextVar[str | None] = ContextVar("grpotrl_reward_task", default=None)


def per_task(reward_funcs: Mapping[str, Callable | list[Callable]], column: str) -> list[Callable]:
    """The flat list TRL takes, in mapping order (task by task, functions in the given order):
    that is the order ``reward_weights`` follows."""
    out = []
    for task, funcs in reward_funcs.items():
        funcs = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
        if not funcs:
            raise InputError(f"reward_funcs[{task!r}] is empty: give task {task!r} at least one reward function.")
        for func in funcs:
            if isinstance(func, str) or not callable(func) or hasattr(func, "config"):
                raise InputError(f"reward_funcs[{task!r}] holds {func!r}: per-task rewards must be callables "
                                 "(functions, judges); wrap a reward model in a function that scores its task's rows.")
            out.append(_restricted(func, str(task), column))
    return out


def rows_of(rows: list[int], n: int, **columns) -> dict:
    """The reward-function keyword arguments of a batch of ``n`` rows cut to ``rows``: every per-row
    list (length ``n``: prompts, completions, dataset columns) sliced, anything else as it is.

    >>> rows_of([1], 2, prompts=["p", "q"], task=["a", "b"], trainer_state=None)
    {'prompts': ['q'], 'task': ['b'], 'trainer_state': None}
    """
    return {k: [v[i] for i in rows] if isinstance(v, list) and len(v) == n else v for k, v in columns.items()}


def whole_rows(log_extra: Callable, rows: list[int], n: int, task: str, logged: set[str]) -> Callable:
    """A ``log_extra`` for a function called on ``rows`` of a batch of ``n``: TRL's completions table wants one
    value per batch row, so each column is logged whole (``None`` on the other tasks' rows) and named after the
    task (``<task>/<column>``), so that two tasks' functions never log the same column twice in one batch. Each
    name logged is added to ``logged``.

    >>> table, logged = {}, set()
    >>> whole_rows(lambda c, v: table.update({c: v}), [1], 3, "a", logged)("judge/x", ["note"])
    >>> table, logged
    ({'a/judge/x': [None, 'note', None]}, {'a/judge/x'})
    """
    def log(column, values):
        full = [None] * n
        for i, v in zip(rows, values, strict=True):
            full[i] = v
        logged.add(f"{task}/{column}")
        log_extra(f"{task}/{column}", full)
    return log


def _restricted(func: Callable, task: str, column: str) -> Callable:
    name = f"{task}/{get_callable_name(func)}"
    logged: set[str] = set()  # the completion-table columns it has logged (whole_rows)

    def cut(prompts, completions, completion_ids=None, **kwargs):
        if column not in kwargs:
            raise InputError(f"reward {name}: the rows carry no {column!r} column (task_column={column!r}).")
        rows = [i for i, t in enumerate(kwargs[column]) if str(t) == task]
        n = len(prompts)
        if completion_ids is not None:
            kwargs["completion_ids"] = completion_ids
        if (log_extra := kwargs.get("log_extra")) is not None:
            for logged_column in () if rows else logged:  # not called this batch: its columns stay aligned
                log_extra(logged_column, [None] * n)
            kwargs["log_extra"] = whole_rows(log_extra, rows, n, task, logged)
        return rows, n, rows_of(rows, n, prompts=prompts, completions=completions, **kwargs)

    def spread(rows, n, values):
        if values is None or isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
            raise ValueError(f"reward {name} returned {str(values)[:40]!r} ({type(values).__name__}) for "
                             f"{len(rows)} rows of task {task!r}: a reward function returns a list with one float "
                             "(or None: no score) per completion it was given.")
        values = list(values)
        if len(values) != len(rows):
            raise ValueError(f"reward {name} returned {len(values)} rewards for {len(rows)} rows of task {task!r}.")
        full = [None] * n
        for i, v in zip(rows, values):
            full[i] = v
        return full

    if is_async_callable(func):
        async def restricted(prompts, completions, completion_ids=None, **kwargs):
            rows, n, sub = cut(prompts, completions, completion_ids, **kwargs)
            token = reward_task.set(task)
            try:
                return spread(rows, n, await func(**sub) if rows else [])
            finally:
                reward_task.reset(token)
    else:
        def restricted(prompts, completions, completion_ids=None, **kwargs):
            rows, n, sub = cut(prompts, completions, completion_ids, **kwargs)
            token = reward_task.set(task)
            try:
                return spread(rows, n, func(**sub) if rows else [])
            finally:
                reward_task.reset(token)

    restricted.__name__ = restricted.__qualname__ = name
    return restricted
