"""Every recipe under recipes/ parses, and opens with the exact command that launches it; every
DeepSpeed JSON parses, is named by an accelerate config (JSON has no comments: the launch command
is that config's), and its "auto" values are all ones transformers fills from a recipe."""

import json
import re
from pathlib import Path

import pytest
import yaml

from grpotrl import cli
from grpotrl.rewards import resolve

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))
METHOD_RECIPES = [p for p in RECIPES if "accelerate" not in p.relative_to(ROOT / "recipes").parts]
ACCELERATE_CONFIGS = sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))
DEEPSPEED_CONFIGS = sorted((ROOT / "recipes" / "accelerate" / "deepspeed").glob("*.json"))


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
    assert {rel(p) for p in ACCELERATE_CONFIGS} >= {
        f"recipes/accelerate/{n}.yaml" for n in ("single", "ddp", "zero2", "zero3", "zero3_offload", "multinode_zero3")}
    assert {p.stem for p in DEEPSPEED_CONFIGS} >= {"zero2", "zero3", "zero3_offload"}


@pytest.mark.parametrize("path", RECIPES, ids=rel)
def test_every_yaml_is_a_safe_mapping(path):
    assert isinstance(yaml.safe_load(path.read_text()), dict)


@pytest.mark.parametrize("path", METHOD_RECIPES, ids=rel)
def test_method_recipe_opens_with_its_launch_command(path):
    assert f"grpotrl {method_of(path)} --config {rel(path)}" in header(path)


@pytest.mark.parametrize("path", RECIPES, ids=rel)
def test_every_command_and_module_a_recipe_names_exists(path):
    """Each `grpotrl M --config R` / `accelerate launch --config_file A` of a recipe's comments names files that
    exist, R a recipe of method M; each grpotrl/*.py it points a reader to exists."""
    text = path.read_text()
    for method, recipe in re.findall(r"grpotrl(?:\.cli)? (sft|grpo|gad) +--config (\S+)", text):
        assert (ROOT / recipe).is_file() and method_of(ROOT / recipe) == method, f"{method} --config {recipe}"
    for config in re.findall(r"--config_file (\S+)", text):
        assert (ROOT / config).is_file(), config
    for module in re.findall(r"grpotrl/[\w/]+\.py", text):
        assert (ROOT / module).is_file(), f"{rel(path)} names {module}, which does not exist"


RAN_WITH = "# Accelerate configs it was run with"


@pytest.mark.parametrize("path", METHOD_RECIPES, ids=rel)
def test_method_recipe_states_the_accelerate_configs_it_was_run_with(path):
    head = header(path)
    assert RAN_WITH in head, (f"{rel(path)}: add a header line '{RAN_WITH} (recipes/accelerate/, ...): single, ...' "
                              "naming only the configs it was really run with")
    statement = " ".join(head[head.index(RAN_WITH):].split(":", 1)[1].split("\n")[:2])  # "single, ddp, ..."
    assert any(re.search(rf"\b{c.stem}\b", statement) for c in ACCELERATE_CONFIGS), statement


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=rel)
def test_accelerate_config_opens_with_its_launch_command_and_loads(path):
    from accelerate.commands.config.config_args import ClusterConfig

    assert f"accelerate launch --config_file {rel(path)} -m grpotrl.cli" in header(path)
    ClusterConfig.from_yaml_file(str(path))  # raises on keys accelerate does not know


def deepspeed_file(accelerate_config: Path) -> str | None:
    return (yaml.safe_load(accelerate_config.read_text()).get("deepspeed_config") or {}).get("deepspeed_config_file")


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=rel)
def test_accelerate_config_names_an_existing_deepspeed_json(path):
    """Paths are relative to the repo root, where every launch command runs."""
    cfg = yaml.safe_load(path.read_text())
    if cfg["distributed_type"] == "DEEPSPEED":
        assert (ROOT / deepspeed_file(path)).is_file(), deepspeed_file(path)
    assert "use_cpu" not in cfg or path.stem == "single", "CPU or GPU comes from the method recipe (use_cpu)"


@pytest.mark.parametrize("path", DEEPSPEED_CONFIGS, ids=rel)
def test_deepspeed_json_parses_and_is_launched_by_an_accelerate_config(path):
    ds = json.loads(path.read_text())
    assert ds["zero_optimization"]["stage"] in (2, 3)
    users = [c for c in ACCELERATE_CONFIGS if deepspeed_file(c) == rel(path)]
    assert users, f"no recipes/accelerate/*.yaml names {rel(path)} as its deepspeed_config_file"
    for config in users:  # the launch command of the JSON is its accelerate config's
        assert f"accelerate launch --config_file {rel(config)} -m grpotrl.cli" in header(config)


def _autos(d: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose value is "auto"."""
    found = []
    for key, value in d.items():
        if isinstance(value, dict):
            found += _autos(value, f"{prefix}{key}.")
        elif value == "auto":
            found.append(prefix + key)
    return found


@pytest.mark.parametrize("path", DEEPSPEED_CONFIGS, ids=rel)
def test_deepspeed_auto_values_are_filled_from_a_recipe(path):
    """transformers fills "auto" from the trainer config and the model (hidden size, steps); one
    it cannot fill would reach DeepSpeed as the string "auto"."""
    from types import SimpleNamespace

    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    _, args, _ = cli.parse_args("grpo", ["--config", str(ROOT / "recipes/smollm2/grpo_quickstart.yaml")])
    ds = HfTrainerDeepSpeedConfig(str(path))  # registers itself globally: a ZeRO-3 one would switch on zero.Init
    try:
        assert _autos(ds.config), "a recipe JSON takes batch sizes, clipping and precision from the trainer config"
        ds.trainer_config_process(args)
        ds.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=576)), args.max_steps)
        assert _autos(ds.config) == []
        assert ds.config["train_micro_batch_size_per_gpu"] == args.per_device_train_batch_size
    finally:
        unset_hf_deepspeed_config()


@pytest.mark.parametrize("path", METHOD_RECIPES, ids=rel)
def test_method_recipe_parses_into_the_cli_dataclasses(path):
    import grpotrl

    script_args, training_args, model_args = cli.parse_args(method_of(path), ["--config", str(path)])
    expected = {"sft": grpotrl.SFTConfig, "grpo": grpotrl.GRPOConfig, "gad": grpotrl.GADConfig}[method_of(path)]
    assert type(training_args) is expected
    assert model_args.model_name_or_path and training_args.output_dir
    assert training_args.use_cpu and not training_args.bf16 and training_args.report_to == []
    if method_of(path) == "grpo":
        from grpotrl.rewards.recipe import parse_judges

        judges = parse_judges(script_args.judges)
        assert resolve.resolve_reward_funcs(script_args.reward_funcs, judges,
                                               script_args.reward_model_name_or_path)


def test_grpo_quickstart_starts_from_the_sft_quickstart_output():
    sft = yaml.safe_load((ROOT / "recipes/smollm2/sft_quickstart.yaml").read_text())
    grpo = yaml.safe_load((ROOT / "recipes/smollm2/grpo_quickstart.yaml").read_text())
    assert grpo["model_name_or_path"] == sft["output_dir"]


def test_command_line_overrides_the_recipe():
    path = ROOT / "recipes/smollm2/grpo_quickstart.yaml"
    _, training_args, _ = cli.parse_args("grpo", ["--config", str(path), "--max_steps", "3", "--learning_rate", "1e-6"])
    assert (training_args.max_steps, training_args.learning_rate) == (3, 1e-6)


def test_a_number_yaml_reads_as_a_string_inside_a_list_is_refused(tmp_path):
    """YAML 1.1 reads ``1e-1`` (no dot) as the string '1e-1'; argparse converts a recipe's own string values but
    no item of a list or mapping, so ``reward_weights: [1e-1, 1]`` reached TRL's ``torch.tensor`` as strings
    ("too many dimensions 'str'", after the model loaded) and ``{rope: 'no'}`` as a true string."""
    from grpotrl.errors import InputError

    path = tmp_path / "r.yaml"
    for text, expected in [
        ("reward_weights: [1e-1, 1]\n", r"reward_weights\[0\] is '1e-1', a str; write 0\.1\)"),
        ("liger_kernel_config: {rope: 'no'}\n", r"liger_kernel_config\['rope'\] is 'no', a str\)"),
    ]:
        path.write_text(f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nreward_funcs: [exact_answer, format]\n" + text)
        with pytest.raises(InputError, match=r"^Recipe \S+r\.yaml: .*" + expected):
            cli.parse_args("grpo", ["--config", str(path)])
    path.write_text(f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nlearning_rate: 1e-5\nreward_weights: [1.0e-1, 1]\n")
    _, args, _ = cli.parse_args("grpo", ["--config", str(path)])  # argparse converts a recipe's own '1e-5'
    assert args.learning_rate == 1e-5 and args.reward_weights == [0.1, 1]


@pytest.mark.parametrize("value", [{"use_cpu": "false"}, {"disable_dropout": "no"}, {"reward_weights": ["1e-1", 2]}])
def test_a_config_built_in_python_takes_no_string_for_a_bool_or_number(value, tmp_path):
    """No argparse converts a Python call's values: ``use_cpu="false"`` is a true string (the run would go to
    the CPU), ``disable_dropout="no"`` would disable dropout."""
    import grpotrl
    from grpotrl.errors import InputError

    name = next(iter(value))
    with pytest.raises(InputError, match=rf"^GRPOConfig: {name}: .* is a (str|list), but {name} takes"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), report_to="none", **value)
