"""``disable_dropout`` (grpotrl's default) as a user meets it: a model loaded by path through the trainer computes
one function in training mode, whichever way its layers sample dropout (``grpotrl.models.dropout``). I5 needs
it: the loss and the guard's recomputation must score the function that sampled."""

import pytest
import torch
from datasets import Dataset
from transformers import OPTConfig, OPTForCausalLM

import grpotrl
from grpotrl.models.dropout import has_dropout

from conftest import length_reward


@pytest.fixture(scope="module")
def tiny_opt(tmp_path_factory, smollm2_tokenizer):
    """A random 2-layer OPT: its decoder layers and attention pass ``self.dropout`` (a float, from the config's
    ``dropout`` and ``attention_dropout``) to the dropout function themselves; it holds no ``nn.Dropout`` layer."""
    tok = smollm2_tokenizer
    torch.manual_seed(0)
    config = OPTConfig(vocab_size=len(tok), hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
                       max_position_embeddings=128, word_embed_proj_dim=32, dropout=0.1, attention_dropout=0.1,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    path = tmp_path_factory.mktemp("tiny-opt")
    OPTForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _two_training_forwards(model):
    model.train()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        return model(input_ids=ids).logits, model(input_ids=ids).logits  # [1, 7, V] each


@pytest.mark.parametrize("disable", [True, False])
def test_I5_disable_dropout_zeroes_the_dropout_numbers_opt_layers_sample_themselves(tiny_opt, grpo_args, disable):
    """OPT's layers sample ``nn.functional.dropout(x, p=self.dropout, training=self.training)``: with
    disable_dropout=True two training-mode forwards differed (TRL zeroes nn.Dropout layers only, and OPT has none).
    With disable_dropout=False they differ, and has_dropout (which tells GAD to score D's rewards in a forward of
    their own) says so: it said the model held no dropout."""
    trainer = grpotrl.GRPOTrainer(model=tiny_opt, reward_funcs=length_reward,
                                  args=grpo_args(disable_dropout=disable),
                                  train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "1 + 1?"}]}] * 8))
    first, second = _two_training_forwards(trainer.model)
    assert has_dropout(trainer.model) is not disable
    assert torch.equal(first, second) is disable
    assert trainer.model.config.dropout == 0.1 and trainer.model.config.attention_dropout == 0.1  # saved as given
