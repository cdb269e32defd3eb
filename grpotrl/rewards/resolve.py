"""Reward names from a recipe to functions, and the dataset columns those functions read: checked
once, before any weights load, by the trainers' preflight (``grpotrl/preflight/``), whether the
rewards come from a recipe (``RewardNames``) or from Python.

* ``resolve_reward_funcs``: each name looked up in the recipe's judges, grpotrl's ``REWARD_FUNCS``
  (``rules.py``), the names ``trl grpo`` knows (``trl_reward_funcs``), then a dotted import path,
  whose function is checked as TRL calls it at once; each error quotes the entry as the recipe or
  command line wrote it (``reward_funcs entry 'os.system': Reward posix.system(command) ...``).
  ``task:name`` entries give a mapping task -> functions (``MultiTaskGRPOTrainer``).
* ``check_reward_callables``: every reward is something TRL can call as it does,
  ``f(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_extra=...,
  log_metric=..., **columns)``: not a class, not a non-callable, not a builtin whose signature
  cannot be read or does not take those keywords (TRL would fail after the model loaded and generated).
* ``check_reward_sources``: every reward model given by name (a local directory or Hub id, which TRL loads after
  the policy) has complete weights and, where TRL loads it from the name, tokenizer files: the policy's own checks
  (``models.sources``), the error naming the entry (``reward_funcs[i]``).
* ``check_reward_columns``: every required argument of a reward function, and every column a
  judge's rubric reads, is a column of the dataset (TRL would fail only after generation).
* ``check_reward_signal``: a column a reward reads that is empty or None on every row it scores
  (the reward would be constant: zero signal) is refused; on some rows, a warning naming them. A judge's
  rubric columns count the same way (a row without one is never sent: on every row, the judge would score
  nothing and never stop); a ``JudgeRouter``'s judges are checked in both, each on its task's rows.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import InputError
from ..data.checks import row_list
from ..models.sources import check_model_source, check_tokenizer_source
from . import rules

logger = logging.getLogger(__name__)

REWARD_FUNCS = {
    "exact_answer": rules.exact_answer_reward,
    "format": rules.format_reward,
    "length": rules.length_penalty,
    "even_handed": rules.even_handed_reward,
}

# Keyword arguments TRL's GRPOTrainer passes to every reward function besides the dataset columns.
_TRAINER_REWARD_KWARGS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                          "environments"}


def trl_reward_funcs() -> dict:
    """The built-in names of TRL's ``trl grpo`` script (``trl/scripts/grpo.py``), with its settings."""
    from trl.rewards import (accuracy_reward, get_soft_overlong_punishment, reasoning_accuracy_reward,
                             think_format_reward)

    return {"accuracy_reward": accuracy_reward, "reasoning_accuracy_reward": reasoning_accuracy_reward,
            "think_format_reward": think_format_reward,
            "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)}


def _import_reward(path: str, entry: str):
    """``my_lib.rewards.custom_reward`` -> that function, as ``trl grpo`` imports it (the working
    directory is put first on ``sys.path``), checked as TRL will call it (``_uncallable``, before the
    columns are known). ``entry`` is the ``reward_funcs`` entry as written (``task:path`` included):
    every error quotes it."""
    import difflib
    import importlib
    import sys

    module_path, _, attr = path.rpartition(".")
    if not all(part.isidentifier() for part in path.split(".")):
        raise InputError(f"reward_funcs entry {entry!r} is not a dotted import path: write it as module.function, "
                         "e.g. my_lib.rewards.custom_reward (each part a Python name).")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as err:
        raise InputError(f"reward_funcs entry {entry!r}: cannot import module {module_path!r} ({err}). Put the "
                         f"directory that holds it on PYTHONPATH (the working directory {os.getcwd()} is searched), "
                         "or fix the dotted path.") from None
    func = getattr(module, attr, None)
    if not callable(func):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        close = difflib.get_close_matches(attr, names, n=3)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        more = f" and {len(names) - 30} more" if len(names) > 30 else ""
        raise InputError(f"reward_funcs entry {entry!r}: module {module_path!r} ({getattr(module, '__file__', '?')}) "
                         f"has no callable {attr!r}{hint}; its callables: {names[:30]}{more}.")
    problem = _uncallable(func, _trl_keywords(environments=False))
    if problem:
        raise InputError(f"reward_funcs entry {entry!r}: {problem}")
    return func


def resolve_reward_funcs(names: list[str] | str | None, judges: dict | None = None,
                         reward_model: str | None = None) -> list | dict:
    """Map a recipe's ``reward_funcs`` to functions, looking each name up in this order: the
    recipe's ``judges`` (``grpotrl.rewards.recipe.parse_judges``), grpotrl's ``REWARD_FUNCS``,
    the names ``trl grpo`` knows (``trl_reward_funcs``), then a dotted import path
    (``my_lib.rewards.custom_reward``). ``["exact_answer", "format"]`` -> a list;
    ``["hallucination:exact_answer", "fairness:even_handed"]`` (``task:name``, every entry) -> a
    mapping task -> functions, for MultiTaskGRPOTrainer (rows carry the task in ``task_column``).
    ``reward_model`` (``reward_model_name_or_path``) goes first in the list, as ``trl grpo`` puts it;
    with per-task rewards it is an error (a reward model scores every row)."""
    names = [names] if isinstance(names, str) else list(names or [])
    judges = judges or {}
    trl_funcs = trl_reward_funcs()
    known = [*judges, *REWARD_FUNCS, *trl_funcs]
    if not names and not reward_model:
        raise InputError(f"GRPO needs at least one reward: set `reward_funcs` to some of {known} (or a dotted path "
                         "such as my_lib.rewards.custom_reward), or `reward_model_name_or_path`.")
    shadowed = [n for n in judges if n in REWARD_FUNCS or n in trl_funcs]
    if shadowed:
        raise InputError(f"Judge name(s) {shadowed} in `judges` are also built-in reward names; rename the judge(s).")
    tagged = [":" in n for n in names]
    if any(tagged) and not all(tagged):
        raise InputError(f"`reward_funcs` {names} mixes per-task entries (task:name) with plain names: give every "
                         "entry a task (e.g. hallucination:exact_answer), or none.")
    unknown = [n for n in names if n.rpartition(":")[2] not in known and "." not in n.rpartition(":")[2]]
    if unknown:
        raise InputError(
            f"Unknown reward function(s) {unknown} in `reward_funcs`. Known: {known} (the recipe's judges, "
            "grpotrl/rewards/rules.py, trl.rewards), or a dotted import path to your own function such as "
            "my_lib.rewards.custom_reward; any of them as task:name for rewards per task."
        )

    def lookup(entry):
        name = entry.rpartition(":")[2]
        for table in (judges, REWARD_FUNCS, trl_funcs):
            if name in table:
                return table[name]
        return _import_reward(name, entry)

    if not names or not all(tagged):
        return ([reward_model] if reward_model else []) + [lookup(n) for n in names]
    if reward_model:
        raise InputError(f"reward_model_name_or_path {reward_model!r} scores every row, but `reward_funcs` gives "
                         "rewards per task (task:name). Drop one of them, or wrap the reward model in a function "
                         "and name it per task.")
    per_task: dict[str, list] = {}
    for n in names:
        per_task.setdefault(n.rpartition(":")[0], []).append(lookup(n))
    return per_task


@dataclass
class RewardNames:
    """A recipe's rewards by name (``reward_funcs``, ``judges``, ``reward_model_name_or_path``), handed
    to a GRPO trainer as its ``reward_funcs``: its preflight resolves them (``resolve``) once the
    model, tokenizer and rows have passed, so those errors come first, as the CLI always ordered them."""

    names: list[str] | str | None
    judges: dict | None = None
    reward_model: str | None = None

    @property
    def by_task(self) -> bool:
        """Every name is ``task:name``: rewards per task (``MultiTaskGRPOTrainer``)."""
        names = [self.names] if isinstance(self.names, str) else list(self.names or [])
        return bool(names) and all(":" in n for n in names)

    def resolve(self) -> list | dict:
        """The functions (``resolve_reward_funcs``); the preflight then checks the columns they read."""
        return resolve_reward_funcs(self.names, self.judges, self.reward_model)


def _listed(funcs) -> list:
    """One reward function, or a list of them, as TRL takes them; None is none (TRL 1.16 allows it
    when an ``environment_factory`` owns the reward, and raises its own error otherwise).

    >>> _listed(None), _listed(len), _listed([len, "model-id"])
    ([], [<built-in function len>], [<built-in function len>, 'model-id'])
    """
    if funcs is None:
        return []
    return list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]


REWARD_SIGNATURE = "def my_reward(prompts, completions, **kwargs) -> list[float | None]"


def _trl_keywords(environments: bool) -> list[str]:
    """The keywords TRL 1.16's ``_calculate_rewards`` passes every reward besides the columns, in this order
    (an error names the first one a function does not take)."""
    return ["prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
            *(["environments"] if environments else [])]


def _uncallable(func, keywords: list[str]) -> str | None:
    """Why TRL could not call the reward ``func`` with ``keywords`` (TRL's own and one per column) and its
    own required arguments (those a column must fill: ``check_reward_columns``' error), or None. Reward
    models (a path or Hub id, an ``nn.Module``) and local judges not loaded yet are TRL's / grpotrl's to check."""
    import torch

    from .recipe import LocalJudgeSpec

    if isinstance(func, (str, torch.nn.Module, LocalJudgeSpec)):
        return None
    name = getattr(func, "__qualname__", None) or type(func).__name__
    where = f"Reward {getattr(func, '__module__', None) or '?'}.{name}"
    if inspect.isclass(func):
        return (f"{where} is a class, not a reward function: TRL would call {name}(prompts=..., completions=...) "
                f"and get an instance, not rewards. Pass an instance ({name}(...)) whose __call__ is "
                f"{REWARD_SIGNATURE}, or a function.")
    if not callable(func):
        return (f"A reward in reward_funcs is {func!r:.80} (of type {type(func).__name__}), not a function. A "
                f"reward is a function {REWARD_SIGNATURE}, a reward model's path, or a judge.")
    try:
        signature = inspect.signature(func)
    except (ValueError, TypeError):
        return (f"{where}: its signature cannot be read (a builtin or C function), so nothing shows that it takes "
                f"TRL's keywords. Wrap it in a Python function {REWARD_SIGNATURE}.")
    params = signature.parameters.values()
    required = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                              p.KEYWORD_ONLY)]
    try:
        signature.bind(**dict.fromkeys([*keywords, *required]))
    except TypeError as err:
        return (f"{where}{signature} cannot be called as TRL calls a reward function, with the keywords prompts, "
                f"completions, completion_ids, trainer_state, log_extra, log_metric and one per dataset column "
                f"({err}). Give it the signature {REWARD_SIGNATURE} (take the columns you need by name before "
                "**kwargs).")
    return None


def check_reward_callables(reward_funcs, columns: list[str] | None = None, environments: bool = False) -> None:
    """Every reward function can be called the way TRL 1.16's ``_calculate_rewards`` calls it:
    ``f(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_extra=...,
    log_metric=..., **row)`` with a keyword per dataset column in ``columns`` (all but prompt,
    completion, completion_ids; ``environments=`` with an ``environment_factory``), or else an
    ``InputError`` naming it and the signature required (``_uncallable``). A required argument named
    after a column the dataset lacks is ``check_reward_columns``' error, not this one.
    ``reward_funcs``: one function, a list, or a mapping task -> function(s)."""
    if isinstance(reward_funcs, Mapping):
        reward_funcs = [f for funcs in reward_funcs.values() for f in _listed(funcs)]
    row = [c for c in (columns or []) if c not in ("prompt", "completion", "completion_ids")]
    for func in _listed(reward_funcs):
        problem = _uncallable(func, [*_trl_keywords(environments), *row])
        if problem:
            raise InputError(problem)


def check_reward_sources(reward_funcs, revision: str | None = None, processing_classes=None) -> None:
    """Every reward model given by name is checked as the policy's model is, before anything loads. TRL 1.16's
    ``GRPOTrainer`` loads a ``str`` in ``reward_funcs`` (a local directory or Hub id) once the policy has loaded:
    ``AutoModelForSequenceClassification.from_pretrained(name, num_labels=1, **model_init_kwargs)``, then, where
    ``reward_processing_classes`` gives none at its index, ``AutoTokenizer.from_pretrained(name, revision=...)``.
    So its weights (``models.sources.check_model_source``) and, where TRL loads it from the name, its tokenizer
    (``models.sources.check_tokenizer_source``) are checked at ``revision`` (``model_init_kwargs['revision']``,
    which TRL uses for every reward model too), and an ``InputError`` names the entry (``reward_funcs[i]``).
    ``processing_classes`` is TRL's ``reward_processing_classes``: None, one (for one reward), or a list with one
    entry per reward (None where TRL loads it); another length is refused here, where TRL refuses it after the
    policy has loaded. Per-task rewards (a mapping) hold no reward model (``tasks.per_task`` refuses one)."""
    by_task = isinstance(reward_funcs, Mapping)
    funcs = [f for fs in reward_funcs.values() for f in _listed(fs)] if by_task else _listed(reward_funcs)
    classes = ([None] * len(funcs) if processing_classes is None else
               processing_classes if isinstance(processing_classes, list) else [processing_classes])
    if len(classes) != len(funcs):
        raise InputError(f"The number of reward processing classes ({len(classes)}) must match the number of reward "
                         f"functions ({len(funcs)}), as TRL requires: give reward_processing_classes one entry per "
                         "reward function, in reward_funcs' order (None where the reward is not a reward model, or "
                         "where its tokenizer loads from its name).")
    for i, (func, tokenizer) in enumerate(zip(funcs, classes)):
        if by_task or not isinstance(func, str):
            continue
        entry = f"reward_funcs[{i}] (a reward model{'; from a recipe, reward_model_name_or_path' if i == 0 else ''})"
        try:
            check_model_source(func, revision, what="Reward model")
        except InputError as err:
            raise InputError(f"{entry}: {err}") from None
        if tokenizer is None:
            try:
                check_tokenizer_source(func, revision, elsewhere=f"from Python pass reward_processing_classes[{i}] "
                                                                 "(processing_class is the policy's)")
            except InputError as err:
                raise InputError(f"{entry}: {err}") from None


def check_reward_weights(reward_funcs, weights) -> None:
    """``reward_weights`` (given: one weight per reward function, in TRL's order: a per-task mapping's flattened,
    ``tasks.per_task``) of another length than the reward functions is refused before anything loads, in TRL's
    words; TRL 1.16 refuses it once the policy and every reward model have loaded. ``use_kl_in_reward``'s extra
    column is counted where it is added (``trainers.reference_kl``), so call this without it.

    >>> check_reward_weights([len, len], [1.0, 0.5]); check_reward_weights({"a": len, "b": [len, len]}, [1, 1, 1])
    >>> check_reward_weights([len], [1.0, 2.0])
    Traceback (most recent call last):
    ...
    grpotrl.errors.InputError: Number of reward weights (2) must match number of reward functions (1), as TRL requires: give reward_weights one weight per reward function, in reward_funcs' order.
    """
    if weights is None:
        return
    funcs = [f for fs in reward_funcs.values() for f in _listed(fs)] if isinstance(reward_funcs, Mapping) \
        else _listed(reward_funcs)
    if len(weights) != len(funcs):
        raise InputError(f"Number of reward weights ({len(weights)}) must match number of reward functions "
                         f"({len(funcs)}), as TRL requires: give reward_weights one weight per reward function, in "
                         "reward_funcs' order.")


def check_reward_columns(reward_funcs, dataset, split_name: str) -> None:
    """Every required argument of every reward function must be a column of ``dataset``
    (TRL passes the columns as keyword arguments; a missing one fails only after generation), and so
    must every column a judge's rubric reads, a ``JudgeRouter``'s judges' and the column it routes on included.
    ``reward_funcs``: one function, a list, or a mapping task -> function(s). A dataset whose
    columns are not known (an ``IterableDataset`` without features) is not checked."""
    if not getattr(dataset, "column_names", None):
        return
    if isinstance(reward_funcs, Mapping):  # per task: every task's functions
        reward_funcs = [f for funcs in reward_funcs.values() for f in _listed(funcs)]
    funcs = []
    for func in _listed(reward_funcs):
        funcs.append(func)
        if (routed := _routed(func)) is not None:  # a JudgeRouter: the column it routes on, then its judges
            judges, column = routed
            if column not in dataset.column_names:
                raise InputError(
                    f"JudgeRouter {getattr(func, 'name', '?')!r} routes on the column {column!r}, which the "
                    f"{split_name!r} split lacks (columns: {dataset.column_names}). Add the column, or build the "
                    "router with task_column= naming the column that holds each row's task.")
            funcs += list(judges.values())
    for func in funcs:
        rubric = getattr(func, "rubric", None)  # a judge reads its rubric's columns
        if rubric is not None and (missing := [c for c in rubric.columns.values() if c not in dataset.column_names]):
            raise InputError(
                f"Judge {func.name!r} (rubric {rubric.name!r}) reads the dataset column(s) {missing}, but the "
                f"{split_name!r} split has columns {dataset.column_names}. Map the rubric's fields to your columns "
                "with the judge's rubric_columns (e.g. {reference: answer}) or add the column."
            )
        if not inspect.isfunction(func):  # reward models and callable objects: TRL checks them
            continue
        needed = [
            p.name for p in inspect.signature(func).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in _TRAINER_REWARD_KWARGS
        ]
        missing = [n for n in needed if n not in dataset.column_names]
        if missing:
            raise InputError(
                f"Reward function {func.__name__} needs the dataset column(s) {missing}, but the {split_name!r} "
                f"split has columns {dataset.column_names}. Add them to the dataset or drop that reward."
            )


def _routed(func) -> tuple[Mapping, str] | None:
    """A ``JudgeRouter``'s judges (task -> judge) and the column it routes on; None for any other reward."""
    judges, column = getattr(func, "judges", None), getattr(func, "task_column", None)
    return (judges, column) if isinstance(judges, Mapping) and isinstance(column, str) else None


def _unjudged(value) -> bool:
    """A rubric column's value on which a judge skips its row (``judges._has_columns``): None or blank text."""
    return value is None or str(value).strip() == ""


def _useless(value) -> bool:
    return value is None or (isinstance(value, (str, list, dict)) and not (value.strip() if isinstance(value, str)
                                                                             else value))


def check_reward_signal(reward_funcs, dataset, split_name: str, task_column: str = "task") -> None:
    """A dataset column a reward function reads (a required argument named after it) that is
    None or empty on every row it scores gives that reward nothing to compare with: an
    ``InputError`` naming the column and the function. Empty on some rows: a warning naming them.
    Per-task rewards (a mapping task -> functions) are checked on their task's rows. A judge's rubric
    columns (``_check_judge_signal``) too, a ``JudgeRouter``'s judges each on the rows of its task."""
    if not hasattr(dataset, "column_names") or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return
    everyone = list(range(len(dataset)))
    if isinstance(reward_funcs, Mapping):
        labels = [str(t) for t in dataset[task_column]] if task_column in dataset.column_names else []
        scored = [(f, [i for i, t in enumerate(labels) if t == str(task)], f" (task {task!r})")
                  for task, fs in reward_funcs.items() for f in _listed(fs)]
    else:
        scored = [(f, everyone, "") for f in _listed(reward_funcs)]
    for func, rows, task in list(scored):  # a JudgeRouter's judges score the rows of their own task
        if (routed := _routed(func)) is not None and routed[1] in dataset.column_names:
            labels = dataset[routed[1]]
            scored += [(judge, [i for i in rows if labels[i] == routed_task], task or f" (task {routed_task!r})")
                       for routed_task, judge in routed[0].items()]
    for func, rows, task in scored:
        if getattr(func, "rubric", None) is not None and rows:
            _check_judge_signal(func, dataset, rows, split_name, task)
            continue
        if not inspect.isfunction(func) or not rows:
            continue
        for name, p in inspect.signature(func).parameters.items():
            if p.default is not p.empty or name not in dataset.column_names or name in ("prompt", "completion"):
                continue
            values = dataset[name]
            _check_column_filled(
                name, split_name, f"reward {func.__name__}{task}", rows, [i for i in rows if _useless(values[i])],
                every="that reward would be the same for every completion and train nothing. Fill the column, or "
                      "drop that reward.",
                some="those rows get no signal from it.")


def _check_judge_signal(judge, dataset, rows: list[int], split_name: str, task: str) -> None:
    """``check_reward_signal`` for a judge: a row whose rubric column is None or blank is one the judge never
    sends. On every row it scores, the judge would score nothing and, having asked nothing, never stop with
    ``JudgeError``: an ``InputError``. On some rows: a warning naming them."""
    rubric, name = judge.rubric, getattr(judge, "name", None) or getattr(judge, "__name__", "?")
    for field_name, column in rubric.columns.items():
        if column not in dataset.column_names:  # check_reward_columns' error
            continue
        values = dataset[column]
        _check_column_filled(
            column, split_name, f"judge {name!r} (rubric {rubric.name!r}, field {field_name!r}){task}", rows,
            [i for i in rows if _unjudged(values[i])],
            every="the judge would send none of them, score nothing and never stop. Fill the column, map the field "
                  "to another column with the judge's rubric_columns (e.g. {reference: answer}), or drop the judge.",
            some="the judge does not score those rows.")


def _check_column_filled(column: str, split_name: str, reader: str, rows: list[int], empty: list[int], *,
                         every: str, some: str) -> None:
    """The column ``column`` that ``reader`` (a reward or a judge, as an error names it) reads is empty on the
    rows ``empty`` of the ``rows`` it scores: on every one an ``InputError`` (``every``: what follows and what to
    do), on some a warning naming them (``some``: what follows), on none nothing."""
    if len(empty) == len(rows):
        raise InputError(f"Column {column!r} of the {split_name!r} split, which {reader} reads, is empty or None on "
                         f"every row it scores ({len(rows)} rows): {every}")
    if empty:
        logger.warning("Column %r of the %r split, which %s reads, is empty or None on %d of %d rows (%s): %s",
                       column, split_name, reader, len(empty), len(rows), row_list(empty), some)
