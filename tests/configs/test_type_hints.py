"""What the type checks of ``grpotrl/configs/recipe_types.py`` say, from a recipe, the command line and Python.

None for a field whose annotation takes no None is refused from Python as a recipe's ``null`` is (TRL took
``max_steps=None`` and transformers then compared it with 0); a whole number where a list's or mapping's item
takes an integer is written as that integer; a value reads as its user wrote it: ``true`` in a recipe, ``True``
from Python, the flag's own text on the command line."""

import dataclasses
import re
import typing
from dataclasses import dataclass, field

import pytest

import grpotrl
from grpotrl import cli
from grpotrl.configs import recipe_types
from grpotrl.configs.recipe_types import check_config_types, check_recipe_types, read_recipe


def _recipe(tmp_path, text: str) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\n" + text)
    return str(path)


def _recipe_error(tmp_path, text: str, command: str = "grpo") -> str:
    """The error ``grpotrl COMMAND --config`` raises for a recipe holding ``text``, before anything loads."""
    with pytest.raises(grpotrl.InputError) as err:
        cli.parse_args(command, ["--config", _recipe(tmp_path, text)])
    return str(err.value)


@dataclass
class Lengths:
    """A user's script arguments (or a field a later TRL adds) whose items take integers."""

    lengths: list[int] = field(default_factory=list)
    caps: dict[str, int] = field(default_factory=dict)
    run_name_prefix: str = None  # annotated without None, defaulting to None: as many scripts write it


@dataclass
class LengthsConfig(grpotrl.GRPOConfig):
    """A user's subclass of grpotrl's config, as open-r1 subclasses TRL's."""

    lengths: list[int] = field(default_factory=list)
    run_name_prefix: str = None


# ---------------------------------------------------------------------------------------------
# None from Python, where the annotation takes no None
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("configs, name, takes, default", [
    ((grpotrl.GRPOConfig, grpotrl.SFTConfig, grpotrl.GADConfig), "max_steps", "an integer", "-1"),
    ((grpotrl.GRPOConfig,), "learning_rate", "a number", "1e-06"),
    ((grpotrl.SFTConfig,), "dataset_text_field", "a string", "'text'"),
    ((grpotrl.GADConfig,), "discriminator_lora_r", "an integer", "0"),
    ((grpotrl.GRPOConfig,), "gradient_accumulation_steps", "an integer", "1"),  # TRL: a TypeError in __post_init__
    ((grpotrl.SFTConfig,), "logging_steps", "a number", "10"),  # transformers: '>' between NoneType and int
])
def test_none_where_the_annotation_takes_no_none_is_refused_from_python(configs, name, takes, default, tmp_path):
    """TRL annotates ``max_steps: int = -1`` and took None; transformers then failed comparing it with 0 (or,
    for gradient_accumulation_steps and logging_steps, in __post_init__ with a TypeError naming no field)."""
    for config in configs:
        with pytest.raises(grpotrl.InputError) as err:
            config(output_dir=str(tmp_path), use_cpu=True, **{name: None})
        assert str(err.value) == (f"{config.__name__}: {name}: None is no value for {name}, which takes {takes}: "
                                  f"pass one (e.g. {default}, its default), or leave {name} out to keep the default.")


def test_none_from_python_reads_as_the_recipes_null_does(tmp_path):
    """The same refusal in both, each in its user's words: ``null`` / write / remove the line in a recipe,
    ``None`` / pass / leave it out from Python. (The recipe's half is a control: it read so before.)"""
    recipe = _recipe_error(tmp_path, "max_steps: null\n")
    assert ("max_steps: null is no value for max_steps, which takes an integer: write one (e.g. -1, its default), "
            "or remove the line to keep the default") in recipe
    with pytest.raises(grpotrl.InputError, match=r"^GRPOConfig: max_steps: None is no value for max_steps, which "
                                                 r"takes an integer: pass one \(e\.g\. -1, its default\), or leave "
                                                 r"max_steps out to keep the default\.$"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=None)


@pytest.mark.parametrize("config_class", [grpotrl.GRPOConfig, grpotrl.SFTConfig, grpotrl.GADConfig])
def test_every_field_whose_annotation_takes_no_none_refuses_none_from_python(config_class, tmp_path):
    """Every field of the config at once: the error names exactly the fields whose annotation has no None (and
    num_generations, which TRL computes with), other than those whose default is None and those TRL or
    transformers take None for beyond their annotation (``ALSO_TAKES``: ``debug``, which HfArgumentParser
    leaves None when no flag sets it)."""
    config = config_class(output_dir=str(tmp_path), use_cpu=True)
    hints = typing.get_type_hints(config_class)
    fields = [f for f in dataclasses.fields(config_class) if f.init and f.name in hints]
    for f in fields:
        object.__setattr__(config, f.name, None)

    def takes_none(tp) -> bool:
        return tp is typing.Any or tp is type(None) or any(map(takes_none, typing.get_args(tp))) or (
            typing.get_origin(tp) is typing.Literal and None in typing.get_args(tp))

    expected = {f.name for f in fields if recipe_types._default(f) is not None
                and (not takes_none(recipe_types._annotation(f.name, hints)) or f.name in recipe_types.NO_NULL)}
    with pytest.raises(grpotrl.InputError) as err:
        check_config_types(config)
    refused = set(re.findall(r"(?:^|; )(?:\w+: )?(\w+): None is no value for \1\b", str(err.value)))
    assert refused == expected and {"max_steps", "learning_rate", "seed"} <= refused and "debug" not in refused


@pytest.mark.parametrize("command", ["grpo", "sft", "gad"])
def test_the_none_a_command_line_parser_leaves_is_not_refused(command, tmp_path):
    """HfArgumentParser leaves ``debug`` (``str | list[DebugOption]``, default '') None when nothing sets it;
    transformers turns that None into [] (so does the config here): a recipe that sets none of them parses."""
    dataset = "gad_toy" if command == "gad" else "quickstart"
    path = _recipe(tmp_path, f"model_name_or_path: x\ndataset_name: {dataset}\n")
    training_args = cli.parse_args(command, ["--config", path])[1]
    assert training_args.debug == [] and training_args.max_steps == -1


def test_none_where_the_annotation_or_the_default_takes_it_passes(tmp_path):
    """Controls, and one more: ``X | None`` fields keep taking None from Python (max_completion_length, GAD's
    epsilon_high); a field annotated ``str`` whose default is None takes None everywhere, since a default is
    never refused: from Python (as before) and from a recipe (refused before, as ``null is no value``)."""
    assert grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_completion_length=None,
                              eval_steps=None).max_completion_length is None
    assert grpotrl.GADConfig(output_dir=str(tmp_path), use_cpu=True, epsilon_high=None).epsilon_high is None
    assert LengthsConfig(output_dir=str(tmp_path), use_cpu=True, run_name_prefix=None).run_name_prefix is None
    check_recipe_types({"run_name_prefix": None, "eval_steps": None}, [Lengths, grpotrl.GRPOConfig], "r.yaml")


# ---------------------------------------------------------------------------------------------
# A whole number where a list's or mapping's item takes an integer
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("lengths: [1e3]\n", r"lengths: \['1e3'\] is a list, but lengths takes a list of integers \(lengths\[0\] is "
                         r"'1e3', a str; write 1000\)"),  # YAML 1.1 reads 1e3 as a string: it said `write 1000.0`
    ("lengths: [8, 1.0e+3]\n", r"lengths\[1\] is 1000\.0, a float; write 1000\)"),  # it said nothing
    ("caps: {a: 2e3}\n", r"caps: \{'a': '2e3'\} is a dict, .* \(caps\['a'\] is '2e3', a str; write 2000\)"),
    ("lengths: [1.5e0]\n", r"\(lengths\[0\] is '1\.5e0', a str\)\."),  # no integer to write: it said `write 1.5`
])
def test_a_whole_number_for_an_integer_item_in_a_recipe_says_the_integer_to_write(text, expected, tmp_path):
    """As a plain integer field does (``max_steps: 1e3``: write 1000, ``whole_number``)."""
    path = _recipe(tmp_path, text)
    with pytest.raises(grpotrl.InputError, match=expected):
        check_recipe_types(read_recipe(path), [Lengths], path)


def test_a_number_yaml_read_as_a_string_for_a_float_item_says_how_yaml_writes_it(tmp_path):
    """Control: an item that takes a float keeps YAML's form of the number (as before)."""
    error = _recipe_error(tmp_path, "reward_weights: [1e-1, 1e3]\n")
    assert "(reward_weights[0] is '1e-1', a str; write 0.1)" in error, error


def test_a_whole_number_for_an_integer_item_from_python_says_the_integer_to_write(tmp_path):
    """``lengths=[1000.0]`` said only that the item is a float."""
    with pytest.raises(grpotrl.InputError, match=r"^LengthsConfig: lengths: \[8, 1000\.0\] is a list, but lengths "
                                                 r"takes a list of integers \(lengths\[1\] is 1000\.0, a float; write "
                                                 r"1000\)\.$"):
        LengthsConfig(output_dir=str(tmp_path), use_cpu=True, lengths=[8, 1000.0])


# ---------------------------------------------------------------------------------------------
# true, false and null as the user wrote them
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("max_steps: true\n", "max_steps: true is a bool, but max_steps takes an integer."),
    ("reward_weights: [true, 1]\n", "reward_weights: [true, 1] is a list, but reward_weights takes a list of numbers "
                                    "or null (reward_weights[0] is true, a bool)."),
    ("reward_weights: [1, null]\n", "reward_weights: [1, null] is a list, but reward_weights takes a list of numbers "
                                    "or null (reward_weights[1] is null)."),
    ("trackio_static_space_id: true\n", "trackio_static_space_id: true is a bool, but trackio_static_space_id takes a "
                                        "string or null or one of false (quote it: '...')."),
    ("model_init_kwargs: {true: bf16}\n", "(model_init_kwargs has the key true, a bool)."),
])
def test_a_recipes_bool_and_null_read_as_yaml_writes_them(text, expected, tmp_path):
    """``max_steps: true`` was refused as ``True is a bool``: Python's word, which the recipe's user did not
    write (and ``None, a NoneType`` for an item written ``null``)."""
    error = _recipe_error(tmp_path, text)
    assert expected in error and "True" not in error and "None" not in error, error


@pytest.mark.parametrize("kwargs, expected", [
    ({"lr_scheduler_type": True}, r"^GRPOConfig: lr_scheduler_type: True is a bool, but lr_scheduler_type takes "
                                  r"SchedulerType or a string \(quote it: '\.\.\.'\)\.$"),  # a control
    ({"reward_weights": [True, 1]}, r"reward_weights: \[True, 1\] is a list, but reward_weights takes a list of "
                                    r"numbers or None \(reward_weights\[0\] is True, a bool\)\.$"),
    ({"trackio_static_space_id": True}, r"takes a string or None or one of False \(quote it"),
])
def test_a_python_calls_bool_and_none_read_as_python_writes_them(kwargs, expected, tmp_path):
    """From Python, Python's words: ``True``, and ``None`` for what takes None (it said ``null``)."""
    with pytest.raises(grpotrl.InputError, match=expected):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **kwargs)


@pytest.mark.parametrize("typed", ["true", "True"])
def test_a_command_lines_bool_reads_as_the_user_typed_it(typed, tmp_path):
    """Control: argparse converts each flag's text to its field's type before any config exists, so a
    command line never reaches the type checks with a bool where an integer belongs; its refusal quotes the
    text as typed."""
    with pytest.raises(grpotrl.InputError, match=rf"--max_steps/--max-steps: invalid int value: '{typed}'"):
        cli.parse_args("grpo", ["--config", _recipe(tmp_path, ""), "--max_steps", typed])
