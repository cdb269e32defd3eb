"""A Hub id whose cached snapshot holds no tokenizer, offline (the session's own HF cache, tests/hub_cache.py):
refused before any weights load, by GRPO, SFT and the CLI alike, with the id, the snapshot, the files it lacks and
what to do; not refused when the tokenizer is there in another form, or when ``processing_class`` is given."""

import json
import os

import pytest
from conftest import HUB_CACHE, arithmetic_prompts, length_reward
from datasets import Dataset
from hub_cache import add_to_cache
from test_hub import no_weights_read  # noqa: F401  (a fixture)

import grpotrl
from grpotrl.errors import InputError

TOKENIZER_SAVED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
NO_TOKENIZER = "grpotrl-test/no-tokenizer"


@pytest.fixture(scope="module")
def hub_no_tokenizer(tiny_llama) -> str:
    """``tiny_llama`` without its tokenizer: config.json, generation_config.json and model.safetensors only."""
    snapshot = add_to_cache(HUB_CACHE, NO_TOKENIZER, tiny_llama, skip=TOKENIZER_SAVED)
    assert sorted(os.listdir(snapshot)) == ["config.json", "generation_config.json", "model.safetensors"]
    return snapshot


def _refusal_says_what_and_where(err, snapshot: str) -> None:
    text = str(err.value)
    assert f"Model {NO_TOKENIZER!r}" in text and snapshot in text  # the id and the snapshot it looked in
    assert "none of ['tokenizer.json', 'tokenizer.model', 'vocab.json'" in text  # the files that are missing
    assert "found: config.json, generation_config.json, model.safetensors" in text
    assert f"hf download {NO_TOKENIZER}" in text and "processing_class=" in text  # what to do


def test_grpo_refuses_a_cached_snapshot_without_tokenizer_before_any_weights(hub_no_tokenizer, grpo_args,
                                                                             no_weights_read):
    """transformers says "Unrecognized processing class in grpotrl-test/no-tokenizer" instead."""
    with pytest.raises(InputError, match="in the local Hugging Face cache without tokenizer files") as err:
        grpotrl.GRPOTrainer(model=NO_TOKENIZER, reward_funcs=length_reward, args=grpo_args(),
                            train_dataset=arithmetic_prompts(8))
    _refusal_says_what_and_where(err, hub_no_tokenizer)


def test_sft_refuses_a_cached_snapshot_without_tokenizer_before_any_weights(hub_no_tokenizer, tmp_path,
                                                                            no_weights_read):
    rows = [{"prompt": [{"role": "user", "content": f"{i} + 1?"}],
             "completion": [{"role": "assistant", "content": str(i + 1)}]} for i in range(4)]
    with pytest.raises(InputError, match="without tokenizer files") as err:
        grpotrl.SFTTrainer(model=NO_TOKENIZER, train_dataset=Dataset.from_list(rows),
                           args=grpotrl.SFTConfig(output_dir=str(tmp_path / "sft"), use_cpu=True, report_to="none"))
    _refusal_says_what_and_where(err, hub_no_tokenizer)


def test_cli_refuses_a_cached_snapshot_without_tokenizer_before_any_weights(hub_no_tokenizer, tmp_path,
                                                                            no_weights_read):
    from grpotrl import cli

    with pytest.raises(InputError, match="without tokenizer files") as err:
        cli.run("grpo", ["--model_name_or_path", NO_TOKENIZER, "--output_dir", str(tmp_path / "out"),
                         "--use_cpu", "true", "--reward_funcs", "exact_answer"])
    _refusal_says_what_and_where(err, hub_no_tokenizer)


def test_the_revision_whose_snapshot_lacks_the_tokenizer_is_the_one_named(tiny_llama, grpo_args, no_weights_read):
    """``model_init_kwargs['revision']`` picks the snapshot checked: main has a tokenizer, the revision has none."""
    add_to_cache(HUB_CACHE, "grpotrl-test/tokenizer-on-main", tiny_llama)
    add_to_cache(HUB_CACHE, "grpotrl-test/tokenizer-on-main", tiny_llama, revision="weights-only",
                 skip=TOKENIZER_SAVED)
    with pytest.raises(InputError, match=r"'grpotrl-test/tokenizer-on-main' \(revision 'weights-only'\) is in the "
                                         r"local Hugging Face cache without tokenizer files.*--revision weights-only"):
        grpotrl.GRPOTrainer(model="grpotrl-test/tokenizer-on-main", reward_funcs=length_reward,
                            args=grpo_args(model_init_kwargs={"revision": "weights-only"}),
                            train_dataset=arithmetic_prompts(8))
    with pytest.raises(AssertionError, match="weights were loaded"):  # main: every check passed, the load is next
        grpotrl.GRPOTrainer(model="grpotrl-test/tokenizer-on-main", reward_funcs=length_reward, args=grpo_args(),
                            train_dataset=arithmetic_prompts(8))


def test_an_explicit_processing_class_is_not_refused(hub_no_tokenizer, grpo_args, smollm2_tokenizer, tmp_path,
                                                     no_weights_read):
    """Control: a tokenizer given by the user is the tokenizer; the snapshot's files do not matter."""
    with pytest.raises(AssertionError, match="weights were loaded"):  # every check passed: the load is next
        grpotrl.GRPOTrainer(model=NO_TOKENIZER, reward_funcs=length_reward, args=grpo_args(),
                            train_dataset=arithmetic_prompts(8), processing_class=smollm2_tokenizer)
    rows = [{"prompt": [{"role": "user", "content": "1 + 1?"}], "completion": [{"role": "assistant", "content": "2"}]}]
    with pytest.raises(AssertionError, match="weights were loaded"):
        grpotrl.SFTTrainer(model=NO_TOKENIZER, train_dataset=Dataset.from_list(rows * 4),
                           processing_class=smollm2_tokenizer,
                           args=grpotrl.SFTConfig(output_dir=str(tmp_path / "sft"), use_cpu=True, report_to="none"))


def _vocab_and_merges(tiny_llama: str) -> dict[str, str]:
    """The BPE tokenizer of ``tiny_llama`` as GPT-2's files: vocab.json, merges.txt and a tokenizer_config.json
    naming GPT2Tokenizer (no tokenizer.json)."""
    with open(os.path.join(tiny_llama, "tokenizer.json")) as f:
        bpe = json.load(f)["model"]
    with open(os.path.join(tiny_llama, "tokenizer_config.json")) as f:
        config = {**json.load(f), "tokenizer_class": "GPT2Tokenizer"}
    merges = [" ".join(m) if isinstance(m, list) else m for m in bpe["merges"]]
    return {"vocab.json": json.dumps(bpe["vocab"]), "merges.txt": "#version: 0.2\n" + "\n".join(merges) + "\n",
            "tokenizer_config.json": json.dumps(config)}


def test_a_tokenizer_in_another_form_is_not_refused(tiny_llama, grpo_args, no_weights_read):
    """Controls: tokenizer.json alone (no tokenizer_config.json, no chat template: plain-text prompts), and GPT-2's
    vocab.json + merges.txt + tokenizer_config.json (no tokenizer.json) load as TRL loads them, and the run gets
    as far as the weights."""
    add_to_cache(HUB_CACHE, "grpotrl-test/tokenizer-json-only", tiny_llama,
                 skip=("tokenizer_config.json", "chat_template.jinja"))
    plain = Dataset.from_list([{"prompt": f"{i} + 1 ="} for i in range(8)])
    with pytest.raises(AssertionError, match="weights were loaded"):
        grpotrl.GRPOTrainer(model="grpotrl-test/tokenizer-json-only", reward_funcs=length_reward, args=grpo_args(),
                            train_dataset=plain)
    add_to_cache(HUB_CACHE, "grpotrl-test/vocab-and-merges", tiny_llama,
                 skip=("tokenizer.json", "tokenizer_config.json"), extra=_vocab_and_merges(tiny_llama))
    with pytest.raises(AssertionError, match="weights were loaded"):
        grpotrl.GRPOTrainer(model="grpotrl-test/vocab-and-merges", reward_funcs=length_reward, args=grpo_args(),
                            train_dataset=arithmetic_prompts(8))


@pytest.mark.parametrize("vocabulary", ["tokenizer.model", "spiece.model", "tokenizer.tiktoken", "vocab.txt"])
def test_a_sentencepiece_tiktoken_or_wordpiece_vocabulary_counts_as_a_tokenizer(tiny_llama, vocabulary):
    """Controls for the file rule itself: a snapshot holding one of these vocabularies (sentencepiece and tiktoken
    are not installed here, so the trainer could not load them) is not refused by the check; the same snapshot
    without it is."""
    from grpotrl.models.sources import check_tokenizer_source

    repo = "grpotrl-test/" + vocabulary.replace(".", "-")
    add_to_cache(HUB_CACHE, repo, tiny_llama, skip=TOKENIZER_SAVED, extra={vocabulary: "a vocabulary"})
    check_tokenizer_source(repo)
    add_to_cache(HUB_CACHE, repo, tiny_llama, revision="without", skip=TOKENIZER_SAVED)
    with pytest.raises(InputError, match="without tokenizer files"):
        check_tokenizer_source(repo, "without")
