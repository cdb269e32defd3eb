"""TRL's string-choice fields: a value TRL 1.16 does not take is refused when the config is built, with
the closest value it takes, instead of a traceback after the model has loaded (TRL's trainer raises only
where it branches on the field). The tables are compared with the values TRL's own code branches on, so
a TRL release that adds, renames or drops one fails here."""

import ast
import collections
import dataclasses
import inspect

import pytest
import transformers
import trl
import trl.trainer.grpo_config
import trl.trainer.grpo_trainer
import trl.trainer.sft_config
import trl.trainer.sft_trainer

import grpotrl
from grpotrl.configs import checks, complete_grpo_config

# a number or 'auto': TRL's own __post_init__ converts its strings and raises on any other, before a model loads
NOT_CHOICES = {"pad_to_multiple_of"}


def _literals(node) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return {value for element in node.elts for value in _literals(element)}
    return set()


def trl_fields(config) -> list:
    """``config``'s own fields: TRL's, not ``TrainingArguments``' (transformers checks those at construction)."""
    inherited = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return [f for f in dataclasses.fields(config) if f.name not in inherited]


def branched_on(config, *modules) -> dict[str, set[str]]:
    """TRL field of ``config`` -> the strings ``modules``' source compares ``<anything>.<field>`` with (``==``,
    ``!=``, ``in``, ``not in``)."""
    own = {f.name for f in trl_fields(config)}
    found = collections.defaultdict(set)
    for module in modules:
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr in own:
                for comparator in node.comparators:
                    found[node.left.attr] |= _literals(comparator)
    return {name: values for name, values in found.items() if values and name not in NOT_CHOICES}


@pytest.mark.parametrize("config, table, modules", [
    (trl.GRPOConfig, checks.GRPO_CHOICES, (trl.trainer.grpo_trainer, trl.trainer.grpo_config)),
    (trl.SFTConfig, checks.SFT_CHOICES, (trl.trainer.sft_trainer, trl.trainer.sft_config)),
], ids=["GRPO", "SFT"])
def test_choice_tables_are_the_values_trls_code_branches_on(config, table, modules):
    """Every field TRL's trainer or config branches on by string is in the table, with exactly those strings
    (the config's for the deprecated values it converts: SFT's 'chunked_nll', 'bfd-requeue')."""
    branched = branched_on(config, *modules)
    # cache_implementation: transformers' field; vllm_model_impl: handed to vLLM (both checked below)
    assert set(branched) == set(table) - {"cache_implementation", "vllm_model_impl"}
    for name, values in branched.items():
        assert {v for v in table[name] if isinstance(v, str)} == values, name
    declared = {f.name: set(f.metadata["choices"]) for f in trl_fields(config) if "choices" in f.metadata}
    for name, values in declared.items():  # SFTConfig declares its choices in the field's metadata too
        assert values <= set(table[name]), name


def test_grpo_choice_tables_take_what_trl_converts_and_transformers_validates():
    """scale_rewards: TRL maps True / False to 'group' / 'none'; cache_implementation: exactly what transformers'
    GenerationConfig (which TRL hands it to) validates."""
    assert checks.GRPO_CHOICES["scale_rewards"][-2:] == (True, False)
    assert [trl.GRPOConfig(output_dir="x", use_cpu=True, bf16=False, scale_rewards=v).scale_rewards
            for v in (True, False)] == ["group", "none"]
    for value in checks.GRPO_CHOICES["cache_implementation"]:
        transformers.GenerationConfig(cache_implementation=value).validate(strict=True)
    with pytest.raises(ValueError, match="cache_implementation"):
        transformers.GenerationConfig(cache_implementation="statik").validate(strict=True)


def test_vllm_model_impl_takes_what_trls_vllm_wrapper_documents(tmp_path):
    """TRL hands vllm_model_impl to vLLM's LLM(model_impl=...) unread, so a misspelling failed only once vLLM
    started, after the model had loaded. The table is the list TRL's vLLM wrapper documents (GRPOConfig's help
    names two of them)."""
    import re

    import trl.generation.vllm_generation

    doc = inspect.getdoc(trl.generation.vllm_generation.VLLMGeneration)
    section = re.search(r"^( *)model_impl \(`str`.*?\n(.*?)(?=^\1\w+ \(`)", doc, re.S | re.M).group(2)
    assert checks.GRPO_CHOICES["vllm_model_impl"] == tuple(re.findall(r'^\s*- "(\w+)"', section, re.M))
    help_names = set(re.findall(r"`(\w+)`", trl.GRPOConfig.__dataclass_fields__["vllm_model_impl"].metadata["help"]))
    assert help_names == {"vllm", "transformers"} and help_names <= set(checks.GRPO_CHOICES["vllm_model_impl"])
    for value in checks.GRPO_CHOICES["vllm_model_impl"]:
        assert grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, vllm_model_impl=value).vllm_model_impl \
            == value


@pytest.mark.parametrize("config, field, value, hint", [
    (grpotrl.GRPOConfig, "importance_sampling_level", "seq", "sequence"),
    (grpotrl.GRPOConfig, "scale_rewards", "grp", "group"),
    (grpotrl.GRPOConfig, "multi_objective_aggregation", "normalise_then_sum", "normalize_then_sum"),
    (grpotrl.GRPOConfig, "vllm_importance_sampling_mode", "token_trunc", "token_truncate"),
    (grpotrl.GRPOConfig, "vllm_mode", "colocated", "colocate"),
    (grpotrl.GRPOConfig, "vllm_model_impl", "vlm", "vllm"),
    (grpotrl.GRPOConfig, "vllm_model_impl", "Transformers", "transformers"),
    (grpotrl.GRPOConfig, "loss_type", "dr-grpo", "dr_grpo"),
    (grpotrl.GRPOConfig, "cache_implementation", "statik", "static"),
    (grpotrl.GADConfig, "importance_sampling_level", "Sequence", "sequence"),
    (grpotrl.SFTConfig, "packing_strategy", "bfd-split", "bfd_split"),
    (grpotrl.SFTConfig, "truncation_mode", "keep_begin", "keep_end"),
    (grpotrl.SFTConfig, "loss_type", "nl", "nll"),
])
def test_a_misspelled_choice_is_refused_with_the_closest_value(tmp_path, config, field, value, hint):
    """TRL takes any string here and fails only where its trainer branches on it, after the model loads."""
    with pytest.raises(grpotrl.InputError, match=rf"^{field}='{value}': TRL 1.16 takes .*'{hint}'.* \(did you mean "
                                                 rf"'{hint}'\?\)\. Fix it in the recipe"):
        config(output_dir=str(tmp_path), use_cpu=True, **{field: value})


def test_a_trl_config_with_a_misspelled_choice_is_refused_and_every_value_trl_takes_passes(tmp_path):
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, importance_sampling_level="seq")
    with pytest.raises(grpotrl.InputError, match=r"importance_sampling_level='seq'"):
        complete_grpo_config(args)
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    args.scale_rewards = 1  # 1 == True, but not the bool TRL converts
    with pytest.raises(grpotrl.InputError, match=r"scale_rewards=1: TRL 1.16 takes"):
        checks.check_ranges(args)
    for name, values in checks.GRPO_CHOICES.items():
        for value in values:
            ok = grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True)
            setattr(ok, name, value)
            checks.check_ranges(ok)
    for name, values in checks.SFT_CHOICES.items():
        for value in values:
            ok = grpotrl.SFTConfig(output_dir=str(tmp_path), use_cpu=True)
            setattr(ok, name, value)
            checks.check_ranges(ok)
