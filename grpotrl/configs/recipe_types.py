"""A recipe's values checked against the types of the fields they set, before anything loads.

``TrlParser`` reads a recipe with ``yaml.safe_load`` and hands its values to argparse as
defaults; argparse converts only strings, so ``learning_rate: [1]``, ``bf16: 2`` or
``max_steps: 1.5`` reached the trainer as they were. ``read_recipe`` turns a YAML syntax error
into one line (file, line, column, problem); ``check_recipe_env`` refuses, in the recipe's ``env:``
block, the variables libraries read when imported, before a recipe is read; ``check_recipe_types``
refuses each value its field's annotation cannot hold, naming the field, the value, the expected
type and, inside a list or mapping, the item (``null`` where the field takes no None: what it takes, its
default, and that removing the line keeps it; a whole number written as a float or an exponent where it, or
the list's or mapping's item, takes an integer: ``write 1000`` for ``1.0e+3`` or ``1e3``);
``check_config_types`` does the same for the fields a Python user set on a grpotrl config (``None`` included).
A field's default passes both, a default of None where the annotation lacks None too. An error writes a value
as its user wrote it: a recipe's as YAML does (``true``, ``false``, ``null``), a Python call's as Python does
(``True``, ``None``). The command line never reaches these checks with a wrong type: argparse converts each
flag's text to its field's type, and its error quotes the text as typed (``invalid int value: 'true'``); a field
that takes ``False`` beside a string reads ``false`` as False (``take_false_from_command_line``).

pydantic checks each value against its field's annotation (``pydantic.TypeAdapter``), in its lax
mode (a tuple is a list, an enum's value is the enum) except for the plain types, which
``_PLAIN_TYPES`` makes strict: a bool is true or false (``bf16: 2`` is refused), an int no bool
and no float (``max_steps: 1.5``, ``max_steps: true``), a float any int or float but NaN (inf
passes: ``checks.RANGES`` refuses it where it means nothing), a str a string (quote numbers).
A recipe's own value may also be a string argparse converts to it (``learning_rate: '1.0e-5'``,
``use_peft: yes``); an item of a list or mapping may not, nor any value of a config built in Python:
argparse converts neither, so ``reward_weights: [1e-1, 1]`` (YAML 1.1 reads ``1e-1`` as a string) or
``GRPOConfig(use_cpu="false")`` (a true string) would reach the trainer as strings. A ``list[str]``
takes one string (``reward_funcs: exact_answer``, argparse's ``nargs``). Any other
class (``ParallelismConfig``) takes its instances only. An annotation pydantic cannot read passes
(the config's own checks see it).

``python_numbers`` turns a config's numpy scalars (``np.float32(1e-6)``, ``np.int64(4)``, ``np.bool_``), in
its fields and the lists and mappings they hold, into the Python numbers they print as, before any check:
TRL takes them at construction, but ``TrainingArguments.to_json_string`` (the config a run logs and saves)
cannot write a ``float32``, and the range checks test for Python numbers.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import numbers
import re
import types
import typing
from typing import Annotated

import numpy as np
import pydantic
from pydantic import AfterValidator, StrictBool, StrictStr

from ..errors import InputError

_PLAIN = (str, int, float, bool, list, tuple, dict, numbers.Number)  # what a recipe or a plain Python call holds
# Fields whose documented types go beyond their annotation: TRL/transformers convert these in
# __post_init__ (GRPOConfig: scale_rewards True -> "group", False -> "none"; TrainingArguments:
# fsdp=True, or a list of its options such as ["full_shard", "auto_wrap"]; debug=None -> [], which
# HfArgumentParser hands in when the command line and the recipe leave debug out), so a drop-in must take them
# too (TRL's own tests pass scale_rewards=True/False).
ALSO_TAKES = {"scale_rewards": bool, "fsdp": bool | list[str], "padding_free": bool,  # true/false/"auto"
              "balance_microbatches": bool, "compiled_rollout": bool, "debug": type(None)}
# Fields TRL annotates ``int | None`` that its ``__post_init__`` computes with (``GRPOConfig``:
# ``generation_batch_size % num_generations``), where None is a TypeError: they take no null.
NO_NULL = ("num_generations",)
_BOOL_STRINGS = {"true", "false", "yes", "no", "y", "n", "1", "0", "t", "f"}  # transformers' string_to_bool


class Yaml11Number(str):
    """A plain (unquoted) YAML scalar that YAML 1.1, and so ``yaml.safe_load``, reads as a string although it is
    written as a number: an exponent without a dot or without a sign (``1e-6``, ``5e3``, ``1.0e6``). Only
    ``read_recipe``'s loader makes these, so the checks can tell them from a string the recipe quoted."""


# What YAML 1.1 leaves a string and Python's float() reads as a number: an exponent, with no dot or no sign
_YAML11_NUMBER = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+")


class DuplicateKey(Exception):
    """A mapping of a recipe sets a key twice: ``(key, first line, second line)``."""


@functools.cache
def _unique_keys_loader():
    """``yaml.SafeLoader`` that raises ``DuplicateKey`` for a key set twice in one mapping, at any depth
    (``yaml.safe_load`` keeps the last value). Keys that a merge (``<<: *base``) brings in may be overridden."""
    import yaml

    class UniqueKeysLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise DuplicateKey(key, seen[key], line)
                    seen[key] = line
                except TypeError:  # an unhashable key: SafeLoader says so
                    continue
            return super().construct_mapping(node, deep=deep)

        def construct_yaml_str(self, node):
            value = super().construct_yaml_str(node)
            return Yaml11Number(value) if node.style is None and _YAML11_NUMBER.fullmatch(value) else value

    UniqueKeysLoader.add_constructor("tag:yaml.org,2002:str", UniqueKeysLoader.construct_yaml_str)
    return UniqueKeysLoader


def read_recipe(path: str) -> dict:
    """The recipe at ``path`` as a mapping; a YAML syntax error or a non-mapping is an ``InputError``."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            recipe = yaml.load(f, Loader=_unique_keys_loader())  # yaml.safe_load, but a key set twice is an error
    except DuplicateKey as err:
        raise InputError(f"Recipe {path} sets {err.args[0]!r} twice (lines {err.args[1]} and {err.args[2]}); YAML "
                         "would keep the second silently. Remove one of them.") from None
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


# Environment variables read when a library is imported or first initialises, which happens before a recipe is
# read: huggingface_hub, datasets and transformers read their HF_* / HUGGINGFACE_* / TRANSFORMERS_* settings (and
# XDG_CACHE_HOME) into constants at import, torch, numpy and their BLAS / OpenMP runtimes size their thread pools
# at import, and bitsandbytes' import initialises CUDA, which reads CUDA_VISIBLE_DEVICES once. TrlParser sets a
# recipe's `env:` block after all of that, so these would be set without effect.
IMPORT_TIME_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "CUDA_VISIBLE_DEVICES",
                   "XDG_CACHE_HOME")


def check_recipe_env(recipe: dict, path: str) -> None:
    """Raise ``InputError`` when the recipe's ``env:`` block (``TrlParser`` sets it in ``os.environ`` while
    parsing) names a variable of ``IMPORT_TIME_ENV``: read before the recipe, it would not be honoured.
    Other variables (``WANDB_PROJECT``, ``TOKENIZERS_PARALLELISM``, ...) are read when used and pass. The values
    are not shown: ``HF_TOKEN`` is one of these variables."""
    env = recipe.get("env")
    if not isinstance(env, dict):
        return  # none, or not a mapping: TrlParser says so
    late = [str(k) for k in env if str(k).startswith(IMPORT_TIME_ENV)]
    if late:
        shown = " ".join(f"{k}=<value>" for k in late)  # never the value: it may be a token
        raise InputError(
            f"Recipe {path}: env: sets {', '.join(late)}, which torch, transformers, datasets or huggingface_hub read "
            "when they are imported, before the recipe is read: the value would be set but not used (e.g. "
            f"HF_HUB_OFFLINE would not make the run offline). Export {'them' if len(late) > 1 else 'it'} before the "
            f"command instead (`{shown} grpotrl ...`, or in the shell or job script that launches it) and remove "
            f"{'them' if len(late) > 1 else 'it'} from env:.")


_NUMPY_NUMBERS = (np.bool_, np.integer, np.floating)


def _holds_numpy(value) -> bool:
    """Whether ``value`` is a numpy scalar or holds one, at any depth of lists, tuples and mappings."""
    if isinstance(value, dict):
        return any(_holds_numpy(k) or _holds_numpy(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(map(_holds_numpy, value))
    return isinstance(value, _NUMPY_NUMBERS)


def _python_number(value):
    """``value`` with every numpy scalar in it the Python number numpy prints it as (``np.float32(0.7)`` ->
    ``0.7``, which is the same float32; ``np.int64(4)`` -> ``4``), in new lists, tuples and dicts."""
    if isinstance(value, dict):
        return {_python_number(k): _python_number(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return (list if isinstance(value, list) else tuple)(map(_python_number, value))
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    return float(str(value)) if isinstance(value, np.floating) else value


def python_numbers(config) -> None:
    """Every field of ``config`` (a dataclass) that holds a numpy scalar, itself or in a list, tuple or mapping,
    set to a copy with Python numbers (``_python_number``); the caller's lists and mappings are not changed.
    This changes ``config``."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name, None)
        if _holds_numpy(value):
            setattr(config, f.name, _python_number(value))


def _bool_string(text: str) -> str:
    if text.lower() not in _BOOL_STRINGS:
        raise ValueError(f"argparse reads only {sorted(_BOOL_STRINGS)} as a bool")
    return text


def _no_bool(number):
    if isinstance(number, bool):
        raise ValueError("a bool is no number")
    return number


def _not_nan(number: float) -> float:
    if math.isnan(number):
        raise ValueError("NaN is no number")
    return number


# What a value may be where an annotation names a plain type: the type itself, strictly (numpy's numbers
# are numbers, a bool is none), or a string argparse converts to it (transformers' string_to_bool, int, float).
_Integral = Annotated[pydantic.InstanceOf[numbers.Integral], AfterValidator(_no_bool)]
_Real = Annotated[pydantic.InstanceOf[numbers.Real], AfterValidator(_no_bool)]
_PLAIN_TYPES = {
    bool: StrictBool | Annotated[str, AfterValidator(_bool_string)],
    int: _Integral | Annotated[str, AfterValidator(int)],
    float: Annotated[_Real | Annotated[str, AfterValidator(float)], AfterValidator(_not_nan)],
    str: StrictStr,
}
# Where no argparse converts a string (an item of a list or mapping, which argparse hands on as it is; any value
# of a config built in Python): the type itself only. ``reward_weights: [1e-1, 1]`` holds the string '1e-1' (YAML
# 1.1 reads a number without a dot as a string) and reached ``torch.tensor`` after the model loaded.
_STRICT_TYPES = {bool: StrictBool, int: _Integral, float: Annotated[_Real, AfterValidator(_not_nan)], str: StrictStr}


def _checked_as(tp, converted: bool = True):
    """The type pydantic checks a value for a field annotated ``tp`` against: ``tp`` with each plain type
    replaced by its ``_PLAIN_TYPES`` entry where argparse ``converted`` a string (a recipe's own values), else
    by its ``_STRICT_TYPES`` one (the items of a list or mapping), one string also taken for a ``list[str]``, and
    a dataclass (``ParallelismConfig``) taken as an instance only, never built from a mapping."""
    if tp in _PLAIN_TYPES:
        return (_PLAIN_TYPES if converted else _STRICT_TYPES)[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(_checked_as(a, converted) for a in args)]
    if origin is list and args == (str,):
        return list[StrictStr] | StrictStr
    if origin in (list, dict) and args:
        return origin[tuple(_checked_as(a, converted=False) for a in args)]
    if dataclasses.is_dataclass(tp):
        return pydantic.InstanceOf[tp]
    return tp


@functools.lru_cache(maxsize=None)
def _adapter(tp, converted: bool = True) -> pydantic.TypeAdapter | None:
    """pydantic's validator for a field annotated ``tp`` (``_checked_as``); None for an annotation pydantic
    cannot read."""
    try:
        return pydantic.TypeAdapter(_checked_as(tp, converted),
                                    config=pydantic.ConfigDict(arbitrary_types_allowed=True))
    except pydantic.PydanticUserError:
        return None


def _refusal(value, tp, converted: bool = True) -> pydantic.ValidationError | None:
    """pydantic's error for ``value`` (as YAML gives it, ``converted`` by argparse; or as a Python call gives
    it, not) where a field is annotated ``tp``; None where the field holds it."""
    adapter = _adapter(tp, converted)
    if adapter is None:
        return None
    try:  # strict=None: each type as ``_checked_as`` made it (True or False would override that)
        adapter.validate_python(value, strict=None)
    except pydantic.ValidationError as err:
        return err
    return None


def matches(value, tp) -> bool:
    """Whether ``value`` (as YAML gives it) is something a field annotated ``tp`` holds.

    >>> matches(1, float), matches(1.5, int), matches(2, bool), matches(float("nan"), float)
    (True, False, False, False)
    >>> matches("1e-5", float), matches([1, 2], list[float]), matches(None, int | None)
    (True, True, True)
    >>> matches("exact_answer", list[str] | None), matches([1, "x"], list[float]), matches({"a": 2}, dict[str, bool])
    (True, False, False)
    >>> matches(["1e-1"], list[float]), matches({"rope": "no"}, dict[str, bool])  # argparse converts no item
    (False, False)
    """
    return _refusal(value, tp) is None


def _type_name(tp, recipe: bool) -> str:
    """What a field annotated ``tp`` takes, in words; None and a ``Literal``'s values as a ``recipe`` writes them
    (``null``, ``one of false``) or, for a Python call, as Python does (``None``, ``one of False``)."""
    if tp is type(None):
        return "null" if recipe else "None"
    if isinstance(tp, type):
        return {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
                "dict": "a mapping", "list": "a list"}.get(tp.__name__, tp.__name__)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_type_name(a, recipe) for a in args))
    if origin is typing.Literal:
        return "one of " + ", ".join(_shown(a, 60, recipe) for a in args)
    if origin is list:
        return (f"a list of {_type_name(args[0], recipe).removeprefix('a ').removeprefix('an ')}s" if args
                else "a list")
    if origin is dict and args:
        keys, values = _type_name(args[0], recipe).removeprefix("a ").removeprefix("an "), _type_name(args[1], recipe)
        return f"a mapping (keys: {keys}s" + (f", values: {values})" if args[1] is not typing.Any else ")")
    return str(tp)


def _kind(value) -> str:
    """``value``'s kind with its article: ``an int``, ``a str``, ``a NaN``."""
    kind = "NaN" if isinstance(value, float) and math.isnan(value) else (
        "str" if isinstance(value, str) else type(value).__name__)  # a Yaml11Number is a str
    return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"


class _YamlWord:
    """A word YAML writes where Python writes ``True``, ``False`` or ``None``: its repr is the word itself (no
    string: a mapping's key ``True`` stays apart from its key ``'true'``)."""

    def __init__(self, word: str):
        self.word = word

    def __repr__(self) -> str:
        return self.word


def _as_yaml_words(value):
    """``value`` with each bool, None and non-finite float in it, at any depth of lists, tuples and mappings (keys
    too), a ``_YamlWord`` (``true``, ``false``, ``null``, ``.nan``, ``.inf``, ``-.inf``), so that its repr reads as
    a recipe writes it."""
    if isinstance(value, bool) or value is None:
        return _YamlWord({True: "true", False: "false", None: "null"}[value])
    if isinstance(value, float) and not math.isfinite(value):
        return _YamlWord(".nan" if math.isnan(value) else ".inf" if value > 0 else "-.inf")
    if isinstance(value, dict):
        return {_as_yaml_words(k): _as_yaml_words(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return (list if isinstance(value, list) else tuple)(map(_as_yaml_words, value))
    return value


def _shown(value, width: int, recipe: bool) -> str:
    """``value`` as an error shows it, cut to ``width``: its repr (a string in quotes, so it reads as one), with
    true, false and null as a ``recipe`` writes them (``[true, 1]``) or, for a Python call, as Python does."""
    text = repr(_as_yaml_words(value) if recipe else value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _as_yaml_number(item) -> str:
    """``'; write 1.0e-05'`` for a string that is a number (YAML 1.1 reads ``1e-5``, without a dot, as a
    string), as YAML writes that number; '' for anything else."""
    import yaml

    try:
        number = float(item) if isinstance(item, str) else None
    except ValueError:
        return ""
    return "" if number is None or math.isnan(number) else f"; write {yaml.safe_dump(number).splitlines()[0]}"


def _members(tp) -> tuple:
    """The types of the union ``tp``; ``(tp,)`` for one type."""
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def _item_types(tp, value) -> tuple:
    """``(key type, item type)`` of ``value`` (a list, tuple or mapping) where a field is annotated ``tp``, from
    the one member of ``tp`` that holds such a container (``list[int]`` of ``list[int] | None``: ``(int, int)``);
    ``typing.Any`` for what it does not say (``dict``, or two members of that kind)."""
    kinds = (dict,) if isinstance(value, dict) else (list, tuple)
    holders = [m for m in _members(tp) if (typing.get_origin(m) or m) in kinds]
    args = typing.get_args(holders[0]) if len(holders) == 1 else ()
    if isinstance(value, dict):
        return tuple(args) if len(args) == 2 else (typing.Any, typing.Any)
    return int, (args[0] if args else typing.Any)


def _integer_only(tp) -> bool:
    """Whether ``tp`` takes an integer and no float (``int``, ``int | None``)."""
    members = _members(tp)
    return int in members and float not in members


def _wrong_item(name: str, value, tp, err: pydantic.ValidationError, recipe: bool = False) -> str:
    """The deepest wrong item pydantic found in ``value`` (a list or mapping, for a field annotated ``tp``), as
    ``reward_weights[1] is 'x', a str`` or ``model_init_kwargs has the key 1, an int``; '' where ``value`` itself
    is wrong. A location also names the union members pydantic tried (``'list[...]'``): those index nothing and
    are skipped. A whole number written as a float or an exponent where the item takes an integer comes with the
    integer to write (``lengths[0] is '1e3', a str; write 1000``); in a ``recipe`` any other number that YAML
    read as a string, with how YAML writes it (``_as_yaml_number``)."""
    found, depth = "", 0
    for error in err.errors():
        where, item, item_tp, key_tp, steps, is_key = name, value, tp, typing.Any, 0, False
        for key in error["loc"]:
            if key == "[key]":  # the key of the item reached so far is wrong, not its value
                where, item, item_tp, is_key = where.rpartition("[")[0], error["input"], key_tp, True
            elif isinstance(item, (list, tuple)) and isinstance(key, int) and 0 <= key < len(item):
                key_tp, item_tp = _item_types(item_tp, item)
                where, item, steps = f"{where}[{key}]", item[key], steps + 1
            elif isinstance(item, dict) and key in item:
                key_tp, item_tp = _item_types(item_tp, item)
                where, item, steps = f"{where}[{key!r}]", item[key], steps + 1
        if steps > depth:
            kind = "" if item is None else f", {_kind(item)}"  # null / None says what it is
            found, depth = f"{where} {'has the key' if is_key else 'is'} {_shown(item, 60, recipe)}{kind}", steps
            if is_key:
                continue
            if _integer_only(item_tp):
                found += "" if (whole := whole_number(item)) is None else f"; write {whole}"
            elif recipe:
                found += _as_yaml_number(item)
    return found


# Fields and mapping keys whose values are credentials: an error shows ``<hidden>`` in their place, as
# transformers' TrainingArguments.__str__ hides every ``*_token`` field. (pad_token, eos_token are no secrets.)
_SECRET_NAME = re.compile(r"(^|_)(hub_token|token|access_token|auth_token|api_key|apikey|secret|password)$",
                          re.IGNORECASE)


def _secret(name) -> bool:
    return isinstance(name, str) and bool(_SECRET_NAME.search(name))


def _redacted(value):
    """``value`` with the value of every secret-named key (``_secret``) of its mappings, at any depth, hidden."""
    if isinstance(value, dict):
        return {k: "<hidden>" if _secret(k) else _redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return (list if isinstance(value, list) else tuple)(map(_redacted, value))
    return value


def whole_number(value) -> int | None:
    """The integer a float or a number-like string is (``1000.0``, ``'1e3'``: YAML 1.1 reads ``1e3`` as a string);
    None for anything else (``1.5``, ``'abc'``, inf, NaN, a bool, beyond 2**53).

    >>> whole_number(1000.0), whole_number("1e3"), whole_number(1.5), whole_number("abc"), whole_number(True)
    (1000, 1000, None, None, None)
    """
    try:
        number = float(value) if isinstance(value, (float, str)) else math.nan
    except ValueError:
        return None
    return int(number) if abs(number) < 2 ** 53 and number.is_integer() else None  # exact in a float; not inf, NaN


def _written(value, recipe: bool) -> str:
    """``value`` as a recipe writes it (``-1``, ``linear``, ``true``) or, for a Python call, as Python does."""
    import yaml

    value = value.value if isinstance(value, enum.Enum) else value
    return yaml.safe_dump(value, default_flow_style=True).splitlines()[0] if recipe else repr(value)


def _no_value(name: str, tp, recipe: bool, default) -> str:
    """What to write instead of ``null`` (``None``) for the field ``name``, annotated ``tp``, which takes no None:
    what it takes and its default, and that leaving it out keeps that default."""
    null, write, leave = ("null", "write", "remove the line") if recipe else ("None", "pass", f"leave {name} out")
    known = default is not dataclasses.MISSING and default is not None and len(repr(default)) <= 60
    example = f" (e.g. {_written(default, recipe)}, its default)" if known else ""
    return (f"{name}: {null} is no value for {name}, which takes {_type_name(tp, recipe)}: {write} one{example}, or "
            f"{leave} to keep the default")


def _problem(name: str, value, tp, recipe: bool = True, default=dataclasses.MISSING) -> str | None:
    """What is wrong with ``value`` for the field ``name`` annotated ``tp``, e.g. ``bf16: 2 is an int, but
    bf16 takes true or false``, with the wrong item of a list or mapping; None where the field holds it.
    A ``recipe``'s own values are strings argparse converts; a config's, built in Python, are not. ``null``
    where the field takes no None says what to write (``_no_value``, with the field's ``default``); a whole
    number written as a float or an exponent (``1000.0``, ``1e3``) where it takes an integer, how to write it."""
    if value is None and default is None:
        return None  # a field's default is never refused (``name: str = None``)
    err = _refusal(value, tp, converted=recipe)
    if err is None:
        return None
    if value is None:
        return _no_value(name, tp, recipe, default)
    takes, hint = _type_name(tp, recipe), ""
    if _integer_only(tp) and (whole := whole_number(value)) is not None:
        hint = f" (write {whole}" + (": YAML 1.1 reads a number with an exponent but no dot or no sign as a string)"
                                     if isinstance(value, Yaml11Number) else ")")
    elif str in typing.get_args(tp) or tp is str:
        hint = " (quote it: '...')" if not isinstance(value, (list, dict)) else ""
    if _secret(name):  # a credential: its value is never shown, only what it is and what the field takes
        return f"{name}: <hidden> is {_kind(value)}, but {name} takes {takes}"
    shown = _redacted(value)
    if item := _wrong_item(name, shown, tp, err, recipe):
        hint += f" ({item})"
    return f"{name}: {_shown(shown, 80, recipe)} is {_kind(value)}, but {name} takes {takes}{hint}"


def _fields(dataclass_types) -> dict:
    """Field name -> annotation over ``dataclass_types`` (later classes do not override earlier ones,
    as HfArgumentParser registers the first)."""
    out: dict = {}
    for cls in dataclass_types:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, _annotation(f.name, hints))
    return out


def _false_or_text(text: str):
    """A command-line value for a field that takes ``False`` besides a string: ``false`` (any case) is False."""
    return False if text.lower() == "false" else text


def take_false_from_command_line(parser) -> None:
    """A field annotated with ``Literal[False]`` beside ``str`` (``trackio_static_space_id``: False means no
    static Space) gets its command-line text as HfArgumentParser registers it, a string, so ``--FIELD false``
    would name a Space ``'false'``: its flag is made to read ``false`` as False (a recipe's YAML ``false`` is
    already False). Other text passes as typed."""
    for name, tp in _fields(parser.dataclass_types).items():
        action = parser._option_string_actions.get(f"--{name}")
        if action is not None and False in _literal_values(tp):
            action.type = _false_or_text


def _literal_values(tp) -> tuple:
    """The values of every ``Literal`` in ``tp`` (a union's members included)."""
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return tuple(v for member in typing.get_args(tp) for v in _literal_values(member))
    return ()


def _default(f: dataclasses.Field):
    """A field's default value (its factory's product), or ``dataclasses.MISSING``."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def _defaults(dataclass_types) -> dict:
    """Field name -> default over ``dataclass_types`` (the first class that has the field, as ``_fields``)."""
    out: dict = {}
    for cls in dataclass_types:
        for f in dataclasses.fields(cls):
            if f.name not in out:
                out[f.name] = _default(f)
    return out


def _annotation(name: str, hints: dict):
    """The type a field holds: its annotation, widened by ``ALSO_TAKES``, without None for ``NO_NULL``."""
    tp = hints.get(name, typing.Any)
    if name in NO_NULL and typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = typing.Union[tuple(a for a in typing.get_args(tp) if a is not type(None))]
    return tp | ALSO_TAKES[name] if name in ALSO_TAKES and tp is not typing.Any else tp


def _strings_read_from_numbers(where: str, value) -> list[str]:
    """``lr_scheduler_kwargs['min_lr'] is '1e-7'`` for each ``Yaml11Number`` inside ``value`` (a mapping, and the
    mappings and lists it holds). argparse converts no item of a mapping, and a field typed ``dict`` takes any
    item: ``lr_scheduler_kwargs: {min_lr: 1e-7}`` reached the scheduler as the string '1e-7' after the model
    loaded (a TypeError), ``generation_kwargs: {top_p: 9e-1}`` the sampler."""
    if isinstance(value, Yaml11Number):
        return [(f"{where} is {value!r}, a string: YAML 1.1 reads a number as one unless its exponent has a dot "
                 f"and a sign{_as_yaml_number(value)} (or quote it if a string is meant)")]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _strings_read_from_numbers(f"{where}[{k!r}]", v)]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _strings_read_from_numbers(f"{where}[{i}]", v)]
    return []


def check_recipe_types(recipe: dict, dataclass_types, path: str) -> None:
    """Raise ``InputError`` listing every value of ``recipe`` whose field (in ``dataclass_types``)
    cannot hold it, and every number inside a mapping that YAML 1.1 read as a string (a plain scalar such as
    ``1e-7``; a quoted one is a string on purpose and passes). Keys no dataclass knows are left to the parser
    (it names them with hints)."""
    fields, defaults = _fields(dataclass_types), _defaults(dataclass_types)
    bad = [problem for k, v in recipe.items()
           if k in fields and (problem := _problem(k, v, fields[k], default=defaults.get(k, dataclasses.MISSING)))]
    bad += [problem for k, v in recipe.items() if k in fields and isinstance(v, dict) and not _secret(k)
            and _refusal(v, fields[k]) is None for problem in _strings_read_from_numbers(k, v)]
    if bad:
        raise InputError(f"Recipe {path}: " + "; ".join(bad) + ". Fix the value(s); `--help` describes every key.")


def check_config_types(config) -> None:
    """Raise ``InputError`` for a field set on ``config`` (a dataclass, before its ``__post_init__``
    converts anything) to a value its annotation cannot hold, None included where the annotation takes no None
    (``max_steps=None``: TRL's ``int``, which transformers' Trainer compares with 0: a TypeError); fields left at
    their default pass (a default of None too, whatever the annotation says)."""
    hints = typing.get_type_hints(type(config))
    bad = []
    for f in dataclasses.fields(config):
        if not f.init or f.name not in hints:
            continue
        default = _default(f)
        value = getattr(config, f.name, None)
        if _same(value, default) or not (value is None or isinstance(value, _PLAIN)):
            continue  # left as it was, or an object the user built on purpose (AcceleratorConfig, ...)
        if problem := _problem(f.name, value, _annotation(f.name, hints), recipe=False, default=default):
            bad.append(problem)
    if bad:
        raise InputError(f"{type(config).__name__}: " + "; ".join(bad) + ".")


def _same(value, default) -> bool:
    try:
        return value is default or bool(value == default)
    except Exception:  # noqa: BLE001  tensors, arrays: not a default
        return False
