"""The CLI as a user drives it: recipe values that reached the library wrong after the model loaded, and
credentials that an error message printed back."""

import pytest

from grpotrl import cli
from grpotrl.errors import InputError

SECRET = "hf_test0123456789neverShown"


def recipe(tmp_path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(f"output_dir: {tmp_path / 'out'}\n" + text)
    return str(path)


# ---------------------------------------------------------------------------------------------
# One LoRA target module: PEFT took it as a regex of the whole dotted name and matched nothing
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("given", [
    ["lora_target_modules: q_proj\n"],
    ["lora_target_modules: [q_proj]\n"],
    ["", "--lora_target_modules", "q_proj"],
])
def test_a_single_lora_target_module_is_matched_as_a_module_name(given, tmp_path):
    from peft.tuners.tuners_utils import check_target_module_exists
    from trl import get_peft_config

    text, *argv = given
    _, _, model_args = cli.parse_args("grpo", ["--config", recipe(tmp_path, "use_peft: true\n" + text), *argv])
    assert model_args.lora_target_modules == ["q_proj"]
    lora = get_peft_config(model_args)
    assert check_target_module_exists(lora, "model.layers.0.self_attn.q_proj")
    assert not check_target_module_exists(lora, "model.layers.0.self_attn.k_proj")


@pytest.mark.parametrize("value", ["all-linear", "'.*\\.(q|v)_proj'"])
def test_all_linear_and_a_regex_stay_strings_as_peft_reads_them(value, tmp_path):
    _, _, model_args = cli.parse_args("grpo", ["--config", recipe(tmp_path, f"use_peft: true\nlora_target_modules: "
                                                                            f"{value}\n")])
    assert model_args.lora_target_modules == value.strip("'").replace("\\\\", "\\")


# ---------------------------------------------------------------------------------------------
# YAML 1.1 reads 1e-7 as a string; inside a mapping argparse converts nothing
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("lr_scheduler_type: cosine_with_min_lr\nlr_scheduler_kwargs:\n  min_lr: 1e-7\n",
     r"lr_scheduler_kwargs\['min_lr'\] is '1e-7', a string.*write 1\.0e-07"),
    ("generation_kwargs: {top_p: 9e-1}\n", r"generation_kwargs\['top_p'\] is '9e-1', a string.*write 0\.9"),
    ("model_init_kwargs: {rope_scaling: {factor: 2e0}}\n", r"model_init_kwargs\['rope_scaling'\]\['factor'\] is '2e0'"),
])
def test_a_number_yaml_reads_as_a_string_inside_a_mapping_is_refused_before_the_load(text, expected, tmp_path):
    """Both reached the library as strings after the model loaded: a TypeError in the scheduler, in the sampler."""
    with pytest.raises(InputError, match=expected):
        cli.parse_args("grpo", ["--config", recipe(tmp_path, text)])


def test_a_quoted_string_and_a_number_yaml_reads_as_one_pass_inside_a_mapping(tmp_path):
    _, args, _ = cli.parse_args("grpo", ["--config", recipe(tmp_path, "lr_scheduler_kwargs: {min_lr: 1.0e-7, name: "
                                                                      "'1e-7'}\nlearning_rate: 1e-6\n")])
    assert args.lr_scheduler_kwargs == {"min_lr": 1e-7, "name": "1e-7"}
    assert args.learning_rate == 1e-6


# ---------------------------------------------------------------------------------------------
# Credentials are never printed back
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    f"hub_token: [{SECRET}]\n",
    f"model_init_kwargs: [{{token: {SECRET}}}]\n",
    f"model_init_kwargs: {{token: {SECRET}, 1: x}}\n",
])
def test_a_token_in_a_recipe_value_of_the_wrong_type_is_not_shown(text, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["grpo", "--config", recipe(tmp_path, text)])
    err = capsys.readouterr().err
    assert exit_.value.code == cli.EXIT_INPUT
    assert "error: Recipe" in err and SECRET not in err


def test_an_unknown_flag_with_a_value_is_named_without_the_value(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["grpo", "--config", recipe(tmp_path, ""), f"--zzqx_credential={SECRET}"])
    err = capsys.readouterr().err
    assert exit_.value.code == cli.EXIT_INPUT
    assert "'zzqx_credential'" in err and SECRET not in err


def test_an_unknown_recipe_key_without_a_close_match_is_named_as_the_recipe_writes_it(tmp_path):
    with pytest.raises(InputError, match=r"Unknown key\(s\) in the recipe .*: 'reward_funcs'\. Fix"):
        cli.parse_args("sft", ["--config", recipe(tmp_path, "reward_funcs: [exact_answer]\n")])
