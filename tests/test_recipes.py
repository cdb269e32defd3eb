"""Every recipe under recipes/ parses, and opens with the exact command that launches it."""

from pathlib import Path

import pytest
import yaml

from grpotrl import cli, validation

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))
METHOD_RECIPES = [p for p in RECIPES if "accelerate" not in p.relative_to(ROOT / "recipes").parts]
ACCELERATE_CONFIGS = sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def method_of(path: Path) -> str:
    """``sft_quickstart.yaml`` -> ``sft``."""
    return path.stem.split("_")[0]


def header(path: Path) -> str:
    """The comment block the file opens with."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


def test_recipes_exist():
    assert {rel(p) for p in METHOD_RECIPES} >= {"recipes/smollm2/sft_quickstart.yaml",
                                                "recipes/smollm2/grpo_quickstart.yaml"}
    assert "recipes/accelerate/single.yaml" in {rel(p) for p in ACCELERATE_CONFIGS}


@pytest.mark.parametrize("path", RECIPES, ids=rel)
def test_every_yaml_is_a_safe_mapping(path):
    assert isinstance(yaml.safe_load(path.read_text()), dict)


@pytest.mark.parametrize("path", METHOD_RECIPES, ids=rel)
def test_method_recipe_opens_with_its_launch_command(path):
    assert f"grpotrl {method_of(path)} --config {rel(path)}" in header(path)


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=rel)
def test_accelerate_config_opens_with_its_launch_command_and_loads(path):
    from accelerate.commands.config.config_args import ClusterConfig

    assert f"accelerate launch --config_file {rel(path)} -m grpotrl.cli" in header(path)
    ClusterConfig.from_yaml_file(str(path))  # raises on keys accelerate does not know


@pytest.mark.parametrize("path", METHOD_RECIPES, ids=rel)
def test_method_recipe_parses_into_the_cli_dataclasses(path):
    import grpotrl

    script_args, training_args, model_args = cli.parse_args(method_of(path), ["--config", str(path)])
    expected = {"sft": grpotrl.SFTConfig, "grpo": grpotrl.GRPOConfig, "gad": grpotrl.GADConfig}[method_of(path)]
    assert type(training_args) is expected
    assert model_args.model_name_or_path and training_args.output_dir
    assert training_args.use_cpu and not training_args.bf16 and training_args.report_to == []
    if method_of(path) == "grpo":
        assert validation.resolve_reward_funcs(script_args.reward_funcs)


def test_grpo_quickstart_starts_from_the_sft_quickstart_output():
    sft = yaml.safe_load((ROOT / "recipes/smollm2/sft_quickstart.yaml").read_text())
    grpo = yaml.safe_load((ROOT / "recipes/smollm2/grpo_quickstart.yaml").read_text())
    assert grpo["model_name_or_path"] == sft["output_dir"]


def test_command_line_overrides_the_recipe():
    path = ROOT / "recipes/smollm2/grpo_quickstart.yaml"
    _, training_args, _ = cli.parse_args("grpo", ["--config", str(path), "--max_steps", "3", "--learning_rate", "1e-6"])
    assert (training_args.max_steps, training_args.learning_rate) == (3, 1e-6)
