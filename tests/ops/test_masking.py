"""I3/I4 on hand-built batches. SmolLM2's ids: <|im_end|> = 2 is eos AND pad."""

import pytest
import torch

from grpotrl.ops.masking import completion_mask, extract_completions, first_stop_index, position_ids_from_mask

EOS = PAD = 2  # SmolLM2: pad_token == eos_token == <|im_end|>
EOT = 7  # a second stop id (e.g. <|eot_id|> beside eos)


def test_I4_stop_token_stays_in_loss_when_pad_is_eos():
    # early stop at t=1, then right padding with pad == eos: [5, EOS, PAD, PAD]
    ids = torch.tensor([[5, EOS, PAD, PAD]])
    # the first EOS (t=1) is in the loss; the padding that equals eos is not
    assert completion_mask(ids, [EOS]).tolist() == [[1, 1, 0, 0]]


def test_I4_a_pad_token_mask_drops_the_stop_token():
    ids = torch.tensor([[5, 6, EOS, PAD]])
    pad_mask = (ids != PAD).long()  # the wrong fix: mask = sequence != pad (and mask[first_eos:] = 0)
    assert pad_mask.tolist() == [[1, 1, 0, 0]]  # drops the stop token: the model never learns to stop
    assert completion_mask(ids, [EOS]).tolist() == [[1, 1, 1, 0]]


def test_I4_several_stop_ids_first_one_wins():
    ids = torch.tensor([[5, EOT, EOS, PAD], [EOS, 5, EOT, 9], [5, 6, 8, 9]])
    # row 0 stops at EOT (t=1); row 1 at EOS (t=0, empty answer); row 2 never stops: all real tokens
    assert completion_mask(ids, [EOS, EOT]).tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert first_stop_index(ids, [EOS, EOT]).tolist() == [1, 0, 4]


def test_I4_lengths_cut_rows_without_stop():
    # a row of 2 real tokens that stopped without a stop id (e.g. a stop string), padded with 0
    ids = torch.tensor([[5, 6, 0, 0]])
    assert completion_mask(ids, [EOS], lengths=torch.tensor([2])).tolist() == [[1, 1, 0, 0]]


def test_I3_extraction_at_padded_width_not_count(smollm2_tokenizer):
    batch = smollm2_tokenizer(["short", "a much longer prompt here"], padding=True, padding_side="left",
                              return_tensors="pt")
    P = batch["input_ids"].shape[1]
    gen = torch.tensor([[100, 200], [300, 400]])
    out = torch.cat([batch["input_ids"], gen], dim=1)
    assert extract_completions(out, P).tolist() == gen.tolist()
    # slicing at the count of non-pad tokens returns prompt tokens for the short row
    count = int(batch["attention_mask"][0].sum())
    assert count < P and out[0, count:].tolist() != gen[0].tolist()


def test_position_ids_match_generate_convention():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    # left-padded row: real tokens at 0,1,2,3; right-finished row: 0..4, then padding repeats 4
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 4]]


def test_I4_an_empty_completion_batch_has_no_stop_token():
    ids = torch.zeros(2, 0, dtype=torch.long)  # [B=2, C=0]: every completion empty (a rollout_func's, say)
    assert first_stop_index(ids, [EOS]).tolist() == [0, 0]
    assert completion_mask(ids, [EOS]).shape == (2, 0)


def test_I4_guard_names_an_empty_completion_batch_instead_of_crashing(smollm2_tokenizer):
    from grpotrl.errors import InvariantError
    from grpotrl.guards import check_completion_mask

    ids = torch.zeros(2, 0, dtype=torch.long)
    with pytest.raises(InvariantError, match=r"\[I4\] row 5: the completion holds no stop token in its 0 columns"):
        check_completion_mask(smollm2_tokenizer, ids, torch.zeros(2, 0), [EOS], [5, 6], max_length=4)
