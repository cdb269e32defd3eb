"""A setting given twice, in the recipe or on the command line, is refused before anything loads (YAML and
argparse would keep the last silently); ``null`` or a whole number written as a float or an exponent where a
field takes an integer says what to write instead. No model is loaded here: these errors come first."""

import re

import pytest
import yaml

from grpotrl import cli
from grpotrl.errors import InputError

QUICKSTART = {"model_name_or_path": "outputs/smollm2-sft-quickstart", "output_dir": "out", "max_steps": 40,
              "reward_funcs": ["exact_answer", "format"], "learning_rate": 3.0e-5, "use_cpu": True}


def recipe(tmp_path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def refusal(argv: list[str]) -> str:
    """The one message ``parse_args`` refuses ``argv`` with (it raises before any model or data loads)."""
    with pytest.raises(InputError) as err:
        cli.parse_args(argv[0], argv[1:])
    return str(err.value)


# ---------------------------------------------------------------------------------------------
# The same setting twice
# ---------------------------------------------------------------------------------------------

def test_recipe_key_twice_names_the_key_both_lines_and_the_file_at_any_depth(tmp_path):
    """Control (passes before and after): the recipe's loader refuses a key set twice, at the top level and
    inside a mapping held by a list, with both 1-based line numbers and the file."""
    path = recipe(tmp_path, "max_steps: 1\nuse_cpu: true\nlearning_rate: 1.0e-5\nuse_cpu: true\n"
                            "learning_rate: 2.0e-5\n")
    assert f"Recipe {path} sets 'use_cpu' twice (lines 2 and 4)" in refusal(["grpo", "--config", path])
    path = recipe(tmp_path, "judges:\n  j:\n    rubric: fairness\n    model: a\n    base_url: b\n    model: c\n")
    assert f"Recipe {path} sets 'model' twice (lines 4 and 6)" in refusal(["grpo", "--config", path])


@pytest.mark.parametrize("flags, expected", [
    (["--max_steps", "1", "--max_steps", "2"], "max_steps (--max_steps, --max_steps)"),
    (["--max_steps", "1", "--max-steps=2"], "max_steps (--max_steps, --max-steps)"),  # argparse's other spelling
    (["--reward_funcs", "exact_answer", "--reward_funcs", "format"],  # argparse kept ['format'] alone
     "reward_funcs (--reward_funcs, --reward_funcs)"),
    (["--gradient_checkpointing", "true", "--no_gradient_checkpointing"],  # a bool's --no_ flag sets it too
     "gradient_checkpointing (--gradient_checkpointing, --no_gradient_checkpointing)"),
])
def test_a_flag_given_twice_on_the_command_line_is_refused_naming_both(flags, expected, tmp_path):
    """argparse keeps the last of two flags silently: ``--reward_funcs exact_answer --reward_funcs format``
    trained on ``format`` alone."""
    path = recipe(tmp_path, yaml.safe_dump(QUICKSTART))
    line = refusal(["grpo", "--config", path, *flags])
    assert f"Set more than once on the command line: {expected}. argparse would keep the last silently" in line, line


def test_two_settings_twice_are_one_error_and_no_value_is_shown(tmp_path):
    path = recipe(tmp_path, yaml.safe_dump(QUICKSTART))
    line = refusal(["grpo", "--config", path, "--hub_token", "hf_secret1", "--seed", "1", "--hub_token=hf_secret2",
                    "--seed", "2"])
    assert "hub_token (--hub_token, --hub_token); seed (--seed, --seed)" in line and "hf_secret" not in line, line


def test_the_command_line_overrides_the_recipe_once_per_flag(tmp_path):
    """Control (passes before and after): a flag given once overrides the recipe's value, as ``make quickstart``'s
    ``--overwrite_output_dir true`` does for a recipe that sets it."""
    path = recipe(tmp_path, yaml.safe_dump({**QUICKSTART, "overwrite_output_dir": False}))
    script_args, args, _ = cli.parse_args("grpo", ["--config", path, "--overwrite_output_dir", "true",
                                                   "--max_steps", "5", "--reward_funcs", "format"])
    assert args.overwrite_output_dir is True and args.max_steps == 5 and script_args.reward_funcs == ["format"]


# ---------------------------------------------------------------------------------------------
# What to write instead
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    ("null", "max_steps: null is no value for max_steps, which takes an integer: write one (e.g. -1, its default), "
             "or remove the line to keep the default"),
    ("~", "max_steps: null is no value for max_steps"),
    ("1e3", "max_steps: '1e3' is a str, but max_steps takes an integer (write 1000: YAML 1.1 reads a number with an "
            "exponent but no dot or no sign as a string)"),
    ("'1e3'", "max_steps: '1e3' is a str, but max_steps takes an integer (write 1000)"),  # quoted: argparse's int fails
    ("2.5e+3", "max_steps: 2500.0 is a float, but max_steps takes an integer (write 2500)"),  # a control: as before
])
def test_null_or_an_exponent_for_an_integer_field_says_what_to_write(value, expected, tmp_path):
    """``max_steps: null`` said "None is a NoneType"; ``max_steps: 1e3`` (a string to YAML 1.1) "'1e3' is a str"."""
    text = yaml.safe_dump(QUICKSTART).replace("max_steps: 40", f"max_steps: {value}")
    path = recipe(tmp_path, text)
    line = refusal(["grpo", "--config", path])
    assert f"Recipe {path}: {expected}" in line, line
    assert "NoneType" not in line


@pytest.mark.parametrize("field, expected", [
    ("learning_rate", "learning_rate: null is no value for learning_rate, which takes a number: write one (e.g. "
                      "1.0e-06, its default)"),
    ("use_peft", "use_peft: null is no value for use_peft, which takes true or false: write one (e.g. false, "
                 "its default)"),
    ("lr_scheduler_type", "lr_scheduler_type: null is no value for lr_scheduler_type, which takes SchedulerType or a "
                          "string: write one (e.g. linear, its default)"),
])
def test_null_for_any_field_that_takes_no_null_names_what_it_takes_and_its_default(field, expected, tmp_path):
    path = recipe(tmp_path, yaml.safe_dump({**QUICKSTART, field: None}))
    assert expected in refusal(["grpo", "--config", path])


def test_null_num_generations_is_refused_before_trl_divides_by_it(tmp_path):
    """TRL annotates num_generations ``int | None``, but its GRPOConfig computes ``generation_batch_size %
    num_generations``: ``num_generations: null`` was a TypeError traceback."""
    path = recipe(tmp_path, yaml.safe_dump({**QUICKSTART, "num_generations": None}))
    assert ("num_generations: null is no value for num_generations, which takes an integer: write one (e.g. 8, its "
            "default), or remove the line") in refusal(["grpo", "--config", path])


def test_null_where_the_field_takes_null_passes(tmp_path):
    """Control: ``reward_weights: null`` and ``dataset_config: null`` are values those fields take."""
    path = recipe(tmp_path, yaml.safe_dump({**QUICKSTART, "dataset_config": None, "reward_weights": None}))
    script_args, args, _ = cli.parse_args("grpo", ["--config", path])
    assert args.reward_weights is None and script_args.dataset_config is None


def test_a_fraction_for_an_integer_field_gets_no_write_hint(tmp_path):
    """Control: 1.5 and 1e-3 are no whole number, so there is nothing to write instead."""
    for value in ("1.5", "1e-3"):
        path = recipe(tmp_path, yaml.safe_dump(QUICKSTART).replace("max_steps: 40", f"max_steps: {value}"))
        line = refusal(["grpo", "--config", path])
        assert re.search(r"max_steps: \S+ is a (float|str), but max_steps takes an integer\. Fix", line), line


@pytest.mark.parametrize("value, expected", [
    ("1e3", "Argument --max_steps/--max-steps: invalid int value: '1e3' (write 1000). `--help` describes every key."),
    ("1000.0", "invalid int value: '1000.0' (write 1000)."),
    ("null", "invalid int value: 'null' (no value: leave --max_steps out to keep the recipe's value or the default)."),
])
def test_an_exponent_or_null_for_an_integer_flag_says_what_to_write(value, expected, tmp_path):
    path = recipe(tmp_path, yaml.safe_dump(QUICKSTART))
    assert expected in refusal(["grpo", "--config", path, "--max_steps", value])
