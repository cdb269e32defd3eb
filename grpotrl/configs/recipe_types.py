"""A recipe's values checked against the types of the fields they set, before anything loads.

``TrlParser`` reads a recipe with ``yaml.safe_load`` and hands its values to argparse as
defaults; argparse converts only strings, so ``learning_rate: [1]``, ``bf16: 2`` or
``max_steps: 1.5`` reached the trainer as they were. ``read_recipe`` turns a YAML syntax error
into one line (file, line, column, problem); ``check_recipe_types`` refuses each value its
field's annotation cannot hold, naming the field, the value and the expected type;
``check_config_types`` does the same for the fields a Python user set on a grpotrl config.

What a field takes is read from its annotation: ``bool`` (true/false, or a string argparse
reads as one), ``int`` (no float, no bool), ``float`` (any finite-or-infinite number, never
NaN), ``str`` (a string: quote numbers), ``list[X]``, ``dict``, unions, ``Literal``, enums
(their values, or any string where the field also takes ``str``). A string where a number or
bool is expected passes only if argparse would convert it. Annotations this module does not
know pass (the config's own checks see them).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import types
import typing

from ..errors import InputError

_PLAIN = (str, int, float, bool, list, tuple, dict, numbers.Number)  # what a recipe or a plain Python call holds
# Fields whose documented types go beyond their annotation: TRL/transformers convert these in
# __post_init__ (GRPOConfig: scale_rewards True -> "group", False -> "none"; TrainingArguments:
# fsdp=True), so a drop-in must take them too (TRL's own tests pass scale_rewards=True/False).
ALSO_TAKES = {"scale_rewards": bool, "fsdp": bool, "padding_free": bool,  # true/false/"auto"
              "balance_microbatches": bool}
_BOOL_STRINGS = {"true", "false", "yes", "no", "y", "n", "1", "0", "t", "f"}  # transformers' string_to_bool


def read_recipe(path: str) -> dict:
    """The recipe at ``path`` as a mapping; a YAML syntax error or a non-mapping is an ``InputError``."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            recipe = yaml.safe_load(f)
    except UnicodeDecodeError as err:
        raise InputError(f"Recipe {path} is not UTF-8 text (byte {err.start}: {err.reason}). Save it as UTF-8."
                         ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        context, opened = getattr(err, "context", None), getattr(err, "context_mark", None)
        if context and opened is not None:
            context += f" opened at line {opened.line + 1}, column {opened.column + 1}"
        raise InputError(f"Recipe {path} is not valid YAML{where}: {problem}" + (f" ({context})" if context else "")
                         + ". Fix that line (a recipe is a flat mapping `key: value`; indent with spaces, not tabs)."
                         ) from None
    if recipe is None:
        raise InputError(f"Recipe {path} is empty. A recipe is a mapping of settings (`key: value` lines); see "
                         "recipes/smollm2/ for examples.")
    if not isinstance(recipe, dict):
        raise InputError(f"Recipe {path} holds a YAML {type(recipe).__name__}, not a mapping of settings "
                         "(`key: value` lines, e.g. `learning_rate: 1.0e-5`).")
    return recipe


def _type_name(tp) -> str:
    if tp is type(None):
        return "null"
    if isinstance(tp, type):
        return {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
                "dict": "a mapping", "list": "a list"}.get(tp.__name__, tp.__name__)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_type_name(a) for a in args))
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin is list:
        return f"a list of {_type_name(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    if origin is dict:
        return "a mapping"
    return str(tp)


def _is_number_string(value: str, kind: type) -> bool:
    try:
        number = kind(value)
    except ValueError:
        return False
    return not (kind is float and math.isnan(number))


def matches(value, tp) -> bool:
    """Whether ``value`` (as YAML gives it) is something a field annotated ``tp`` holds.

    >>> matches(1, float), matches(1.5, int), matches(2, bool), matches(float("nan"), float)
    (True, False, False, False)
    >>> matches("1e-5", float), matches([1, 2], list[float]), matches(None, int | None)
    (True, True, True)
    """
    if tp is typing.Any or tp is object:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool) or (isinstance(value, str) and value.lower() in _BOOL_STRINGS)
    if tp is int:
        return (isinstance(value, numbers.Integral) and not isinstance(value, bool)) or (
            isinstance(value, str) and _is_number_string(value, int))
    if tp is float:
        if isinstance(value, str):
            return _is_number_string(value, float)
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)
    if tp is str:
        return isinstance(value, str)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return isinstance(value, tp) or value in {m.value for m in tp}
    if origin is list or tp is list:
        if isinstance(value, str) and args and args[0] is str:  # one string for a list of strings: argparse's nargs
            return True
        return isinstance(value, (list, tuple)) and all(matches(v, args[0]) for v in value) if args else \
            isinstance(value, (list, tuple))
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # an annotation this module does not know: the config checks it


def _fields(dataclass_types) -> dict:
    """Field name -> annotation over ``dataclass_types`` (later classes do not override earlier ones,
    as HfArgumentParser registers the first)."""
    out: dict = {}
    for cls in dataclass_types:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, _annotation(f.name, hints))
    return out


def _annotation(name: str, hints: dict):
    """The type a field holds: its annotation, widened by ``ALSO_TAKES``."""
    tp = hints.get(name, typing.Any)
    return tp | ALSO_TAKES[name] if name in ALSO_TAKES and tp is not typing.Any else tp


def _problem(name: str, value, tp) -> str:
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    kind = "NaN" if isinstance(value, float) and math.isnan(value) else type(value).__name__
    hint = ""
    if tp in (int, int | None) and isinstance(value, float) and value.is_integer():
        hint = f" (write {int(value)})"
    elif str in typing.get_args(tp) or tp is str:
        hint = " (quote it: '...')" if not isinstance(value, (list, dict)) else ""
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    return f"{name}: {shown} is {article} {kind}, but {name} takes {_type_name(tp)}{hint}"


def check_recipe_types(recipe: dict, dataclass_types, path: str) -> None:
    """Raise ``InputError`` listing every value of ``recipe`` whose field (in ``dataclass_types``)
    cannot hold it. Keys no dataclass knows are left to the parser (it names them with hints)."""
    fields = _fields(dataclass_types)
    bad = [_problem(k, v, fields[k]) for k, v in recipe.items() if k in fields and not matches(v, fields[k])]
    if bad:
        raise InputError(f"Recipe {path}: " + "; ".join(bad) + ". Fix the value(s); `--help` describes every key.")


def check_config_types(config) -> None:
    """Raise ``InputError`` for a field set on ``config`` (a dataclass, before its ``__post_init__``
    converts anything) to a value its annotation cannot hold; fields left at their default pass."""
    hints = typing.get_type_hints(type(config))
    bad = []
    for f in dataclasses.fields(config):
        if not f.init or f.name not in hints:
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        value = getattr(config, f.name, None)
        if _same(value, default) or not isinstance(value, _PLAIN):
            continue  # left as it was, or an object the user built on purpose (AcceleratorConfig, ...)
        if not matches(value, _annotation(f.name, hints)):
            bad.append(_problem(f.name, value, _annotation(f.name, hints)))
    if bad:
        raise InputError(f"{type(config).__name__}: " + "; ".join(bad) + ".")


def _same(value, default) -> bool:
    try:
        return value is default or bool(value == default)
    except Exception:  # noqa: BLE001  tensors, arrays: not a default
        return False
