"""A LoRA SFT that added tokens (two special tokens, the embeddings resized, padded to a multiple of 64 as TRL's
``clone_chat_template`` pads them), then GRPO or GAD on its adapter directory.

PEFT saves the resized embeddings beside the adapter (``save_embedding_layers`` 'auto': the vocabulary differs
from the base config's), so the base model must take their rows before the adapter loads: loaded unresized it
fails ("size mismatch for base_model.model.model.embed_tokens.weight"). PEFT's AutoPeftModelForCausalLM resizes
the base to the adapter's tokenizer (49154); grpotrl resizes it to the rows saved (49216), which then load. An
adapter saved without them cannot give the added tokens the rows they were trained with: refused before the base
loads. On a tiny Llama (tied embeddings) over the SmolLM2 tokenizer.
"""

import shutil

import pytest
import torch
from conftest import arithmetic_prompts, length_reward
from datasets import Dataset
from peft import LoraConfig
from safetensors.torch import load_file, save_file
from test_gad import gad_args, toy_rows  # noqa: F401 (gad_args: a fixture)
from test_lora_sft_then_grpo import LORA, _sft_args, no_model_load  # noqa: F401 (no_model_load: a fixture)
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpotrl
from grpotrl import InputError

ADDED = ["<think>", "</think>"]
EMBED = "base_model.model.model.embed_tokens.weight"


@pytest.fixture(scope="module")
def resized_adapter(tiny_llama, tmp_path_factory) -> str:
    """The adapter directory of a LoRA SFT whose tokenizer got ``ADDED`` and whose embeddings were resized to a
    multiple of 64 (49154 tokens, 49216 rows) before the SFT: PEFT saved both embeddings (tied) beside it."""
    out = tmp_path_factory.mktemp("lora-sft-resized")
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.add_special_tokens({"additional_special_tokens": ADDED})
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    model.resize_token_embeddings(len(tok), pad_to_multiple_of=64)
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "completion": [{"role": "assistant", "content": f"<think></think>{i + 1}"}]} for i in range(8)]
    trainer = grpotrl.SFTTrainer(model=model, processing_class=tok, args=_sft_args(out),
                                 train_dataset=Dataset.from_list(rows), peft_config=LoraConfig(**LORA))
    trainer.train()
    trainer.save_model(str(out))
    trainer.end()
    return str(out)


def _saved_embedding(directory) -> torch.Tensor:
    return load_file(f"{directory}/adapter_model.safetensors")[EMBED]


def test_the_fixture_is_what_an_sft_that_added_tokens_saves(resized_adapter, tiny_llama):
    """Control (passes on any tree): the adapter dir's tokenizer has 2 tokens more than the base's embedding rows,
    and PEFT saved the resized embedding (49216 rows, a multiple of 64), with the added tokens' rows in it."""
    tok = AutoTokenizer.from_pretrained(resized_adapter)
    base_rows = AutoModelForCausalLM.from_pretrained(tiny_llama).get_input_embeddings().num_embeddings
    assert (len(tok), base_rows, _saved_embedding(resized_adapter).shape[0]) == (base_rows + 2, 49152, 49216)


def test_grpo_on_an_adapter_that_added_tokens_loads_the_embedding_rows_it_saved(resized_adapter, grpo_args):
    """The student's embedding is the saved one, every row (the added tokens' included), not the base's 49152 rows;
    the added token embeds in a forward and the run steps."""
    trainer = grpotrl.GRPOTrainer(model=resized_adapter, reward_funcs=length_reward,
                                  args=grpo_args(max_steps=1), train_dataset=arithmetic_prompts(8))
    embedding = trainer.model.get_input_embeddings().weight
    assert torch.equal(embedding.detach(), _saved_embedding(resized_adapter))
    ids = trainer.processing_class(ADDED[1], add_special_tokens=False, return_tensors="pt").input_ids  # [1, 1]
    assert ids.tolist() == [[49153]]
    with torch.no_grad():
        assert torch.isfinite(trainer.model(input_ids=ids).logits).all()
    trainer.train()


def test_gad_on_an_adapter_that_added_tokens_gives_the_discriminator_the_saved_rows(resized_adapter, gad_args):
    """D (base + adapter merged) takes the student's rows, which are the saved ones."""
    trainer = grpotrl.GADTrainer(model=resized_adapter, args=gad_args(max_steps=1),
                                 train_dataset=Dataset.from_list(toy_rows(8)))
    d_embedding = trainer.discriminator.hf_model.get_input_embeddings().weight.detach()
    assert torch.equal(d_embedding, _saved_embedding(resized_adapter))


def test_an_adapter_saved_without_the_added_tokens_rows_is_refused_before_the_load(resized_adapter, grpo_args,
                                                                                   tmp_path, no_model_load):
    """The same adapter saved without its embedding layers (``save_embedding_layers=False``): the added tokens'
    trained rows are nowhere, and a resize would draw new random ones. Refused before the base loads."""
    stripped = tmp_path / "no-embeddings"
    shutil.copytree(resized_adapter, stripped)
    weights = load_file(stripped / "adapter_model.safetensors")
    save_file({k: v for k, v in weights.items() if "lora_" in k}, stripped / "adapter_model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"comes with a tokenizer of 49154 tokens, and its base model .* has 49152 "
                                         r"token embedding rows; the adapter saved no embedding rows for the 2 tokens "
                                         r".*save_embedding_layers=True"):
        grpotrl.GRPOTrainer(model=str(stripped), reward_funcs=length_reward, args=grpo_args(max_steps=1),
                            train_dataset=arithmetic_prompts(8))


@pytest.fixture(scope="module")
def untied_resized_adapter(smollm2_tokenizer, tmp_path_factory) -> str:
    """A LoRA adapter (untrained) of a tiny Llama whose output embedding is not tied to the input one, both resized
    for ``ADDED`` and saved beside the adapter (``save_embedding_layers=True``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("untied")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=smollm2_tokenizer.eos_token_id,
                      pad_token_id=smollm2_tokenizer.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(root / "base")
    smollm2_tokenizer.save_pretrained(root / "base")
    tok = AutoTokenizer.from_pretrained(root / "base")
    tok.add_special_tokens({"additional_special_tokens": ADDED})
    model = AutoModelForCausalLM.from_pretrained(root / "base")
    model.resize_token_embeddings(len(tok))
    from peft import get_peft_model

    get_peft_model(model, LoraConfig(**LORA)).save_pretrained(root / "adapter", save_embedding_layers=True)
    tok.save_pretrained(root / "adapter")
    return str(root / "adapter")


@pytest.mark.parametrize("saved_head", [True, False])
def test_an_untied_output_embedding_takes_its_saved_rows_or_is_refused(untied_resized_adapter, saved_head, grpo_args,
                                                                       tmp_path):
    """Both embeddings saved: both take the saved rows (49154). The output embedding left out: the base's head would
    keep random rows for the added tokens, refused once the base's embeddings are known (after its load)."""
    adapter = tmp_path / "adapter"
    shutil.copytree(untied_resized_adapter, adapter)
    weights = load_file(adapter / "adapter_model.safetensors")
    head_key = "base_model.model.lm_head.weight"
    if not saved_head:
        save_file({k: v for k, v in weights.items() if k != head_key}, adapter / "adapter_model.safetensors",
                  metadata={"format": "pt"})
        with pytest.raises(InputError, match=r"saved 49154 rows of the input embedding 'model.embed_tokens' .* and "
                                             r"none of the output embedding 'lm_head', which this base does not tie"):
            grpotrl.GRPOTrainer(model=str(adapter), reward_funcs=length_reward, args=grpo_args(max_steps=1),
                                train_dataset=arithmetic_prompts(8))
        return
    trainer = grpotrl.GRPOTrainer(model=str(adapter), reward_funcs=length_reward, args=grpo_args(max_steps=1),
                                  train_dataset=arithmetic_prompts(8))
    model = trainer.model
    assert torch.equal(model.get_input_embeddings().weight.detach(), weights[EMBED])
    assert torch.equal(model.get_output_embeddings().weight.detach(), weights[head_key])
