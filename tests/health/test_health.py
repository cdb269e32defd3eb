"""Health signals (grpotrl.health) on hand-built batches whose answers are worked out in the
comments, plus the chat-header spellings and the boundary report on the real SmolLM2 tokenizer
(pad == eos == <|im_end|>)."""

import math

import pytest
import torch

from grpotrl import InvariantError, guards, health
from grpotrl.chat import boundary, templates


def test_logit_stats_max_gap_and_top5_mass_by_hand():
    # row 0, token 0: logits [5, 3, 1, 1, 0, 0]; row 0, token 1: all 0 over V=6
    logits = torch.tensor([[[5.0, 3.0, 1.0, 1.0, 0.0, 0.0], [0.0] * 6]])  # [B=1, C=2, V=6]
    s = health.logit_stats(logits, temperature=1.0)
    assert s["logits/max"].tolist() == [[5.0, 0.0]]
    assert s["logits/top1_top2_gap"].tolist() == [[2.0, 0.0]]  # 5 - 3; a tie gives 0
    # token 0: Z = e^5 + e^3 + 2e + 2 = 148.413 + 20.086 + 5.437 + 2 = 175.936
    #   top-5 mass = (Z - e^0) / Z = 174.936 / 175.936 = 0.99432; top-1 = 148.413 / 175.936 = 0.84356
    # token 1: uniform over 6: top-5 mass 5/6, top-1 1/6
    assert s["logits/top5_mass"][0].tolist() == pytest.approx([0.99432, 5 / 6], abs=1e-5)
    assert s["logits/top1_prob"][0].tolist() == pytest.approx([0.84356, 1 / 6], abs=1e-5)


def test_logit_stats_probabilities_are_at_the_sampling_temperature():
    # logits [2, 0] at T=2 are [1, 0]: top-1 prob e / (e + 1) = 0.73106; the raw max stays 2
    s = health.logit_stats(torch.tensor([[[2.0, 0.0]]]), temperature=2.0)
    assert s["logits/max"].item() == 2.0 and s["logits/top1_top2_gap"].item() == 2.0
    assert s["logits/top1_prob"].item() == pytest.approx(0.73106, abs=1e-5)
    assert s["logits/top5_mass"].item() == pytest.approx(1.0)  # V=2 < 5: all the mass


def test_masked_means_leave_out_padding():
    # the mask drops the second token of row 0: mean of 4 and 2 = 3 (not (4+100+2)/3)
    sums = health.masked_means({"x": torch.tensor([[4.0, 100.0], [2.0, 0.0]])}, torch.tensor([[1, 0], [1, 0]]))
    total, count = sums["x"].tolist()
    assert total / count == 3.0


def test_per_sample_entropy_min_p10_by_hand():
    # per-sample means over the mask: row 0 (0.0 + 0.2) / 2 = 0.1, row 1 2.0, row 2 3.0, row 3 4.0,
    # row 4 has no token (left out). min 0.1; p10 = 0.1 + 0.1 * (4 - 1) * (2.0 - 0.1) = 0.67
    H = torch.tensor([[0.0, 0.2, 9.0], [2.0, 2.0, 2.0], [3.0, 0.0, 0.0], [4.0, 4.0, 0.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])
    s = health.summarise_samples(health.per_sample_mean(H, mask))
    assert s["entropy/sample_min"] == pytest.approx(0.1)
    assert s["entropy/sample_p10"] == pytest.approx(0.67)
    assert s["entropy/sample_mean"] == pytest.approx((0.1 + 2 + 3 + 4) / 4)


def test_per_sample_entropy_empty_batch_is_nan_not_an_error():
    s = health.summarise_samples(health.per_sample_mean(torch.ones(2, 3), torch.zeros(2, 3)))
    assert all(math.isnan(v) for v in s.values())


def test_stop_tokens_counted_without_left_padding_when_pad_is_a_stop_id():
    # SmolLM2: pad == <|im_end|> == 2. Row 0 is a left-padded prompt "<|im_start|>user\nhi<|im_end|>\n"
    # with 3 pad tokens: 1 real stop token (counting the pads too says 4 "eot", a false bug).
    prompt = torch.tensor([[2, 2, 2, 1, 4093, 198, 6004, 2, 198]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    assert health.count_ids(prompt, mask, [2]).tolist() == [1]
    # a completion with two stop ids inside what the loss trains on (a sampler that did not stop)
    completion = torch.tensor([[30, 2, 31, 0, 2], [30, 2, 2, 2, 2]])  # row 1: stop, then right padding
    cmask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])  # row 0: ids 2 and 0 in the mask
    assert health.count_ids(completion, cmask, [0, 2]).tolist() == [2, 1]


def test_a_tool_loops_turn_ends_are_not_extra_stop_tokens(smollm2_tokenizer):
    # a two-turn completion: "call<|im_end|>" | tool result "<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
    # (tool_mask 0) | "Done<|im_end|>", right-padded: 1 stop counted, as for a single turn
    tok = smollm2_tokenizer
    turn1, turn2 = [30, 2], [31, 2]
    tool = tok.encode("<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    ids = torch.tensor([turn1 + tool + turn2 + [2, 2]])
    loss_mask = torch.tensor([[1, 1] + [0] * len(tool) + [1, 1, 0, 0]])
    assert health.count_ids(ids, loss_mask, [2]).tolist() == [2]  # the loss's tokens hold both turns' stops
    counted = health.stop_count_mask(loss_mask)
    assert health.count_ids(ids, counted, [2]).tolist() == [1]
    batch = {"prompt_ids": torch.tensor([[1, 5]]), "prompt_mask": torch.ones(1, 2), "completion_ids": ids,
             "lengths": torch.tensor([len(turn1 + tool + turn2)]), "stop_mask": counted}
    text = boundary.batch_boundary_report(tok, batch, [2], n=1)
    assert "1 in the completion" in text and "!!" not in text


def test_length_shares():
    # lengths 1, 1, 3, 16 with max_completion_length 16: 2/4 one-token, 1/4 at the cap
    assert health.length_shares(torch.tensor([1, 1, 3, 16]), 16) == {
        "completions/one_token_share": 0.5, "completions/max_length_share": 0.25}


def test_zero_rewards():
    rewards = torch.tensor([0.5, 0.5, 0.5, 1.0, 0.0, 0.0, 0.0, float("nan"), 0.0])
    # 4 of the 8 scored rewards are exactly 0
    assert health.zero_reward_share(rewards) == 0.5
    # the weighted sum TRL uses: None from every function -> NaN, not 0 (INVARIANT I8)
    per_func = torch.tensor([[1.0, 0.0], [float("nan"), float("nan")], [0.0, 2.0]])
    assert health.group_rewards(per_func, torch.tensor([1.0, 0.5])).tolist()[::2] == [1.0, 1.0]
    assert math.isnan(health.group_rewards(per_func, torch.tensor([1.0, 0.5]))[1])


def test_per_task_lengths_and_rewards():
    tasks = ["fairness", "hallucination", "fairness", "fairness"]
    out = health.task_lengths(tasks, torch.tensor([4, 10, 6, 2]))
    assert out["tasks/fairness/completions/mean_length"] == 4.0  # (4 + 6 + 2) / 3
    assert out["tasks/fairness/completions/min_length"] == 2.0
    assert out["tasks/hallucination/completions/max_length"] == 10.0
    assert health.task_rewards(tasks, torch.tensor([1.0, 0.5, 0.0, 0.5]))["tasks/fairness/reward"] == 0.5


LLAMA3_TEMPLATE = (  # Meta-Llama-3-8B-Instruct's template
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN3_TEMPLATE = (  # Qwen3's ChatML with its thinking switch (the generation-prompt part, as Qwen3 writes it)
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\n\n</think>\n\n' }}{%- endif -%}"
    "{%- endif -%}")


@pytest.fixture(scope="module")
def llama3_tokenizer(smollm2_path):
    """SmolLM2's vocabulary with Llama-3's header and end-of-turn special tokens and template (offline)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def qwen3_tokenizer(smollm2_path):
    """SmolLM2's ChatML vocabulary with Qwen3's <think> / </think> (added, not special) and its template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = QWEN3_TEMPLATE
    return tok


def _starts(tok, texts, headers):
    return boundary.starts_with_header(tok, [tok.encode(t, add_special_tokens=False) for t in texts], headers)


# I3 / chat_header rule: a word that begins like the role name is no header (it stopped good runs)
NOT_HEADERS = ["assistants can help", "assistantship is a role", " assistants", "Assistant\n4", "4<|im_end|>"]


def test_I3_chatml_header_is_detected_as_tokens_not_as_a_word_prefix(smollm2_tokenizer):
    tok = smollm2_tokenizer
    headers = boundary.chat_headers(tok)
    assert [tok.decode(h) for h in headers] == ["<|im_start|>assistant\n", "<|im_start|>", "assistant\n"]
    assert _starts(tok, ["<|im_start|>assistant\n4", "assistant\n4", " assistant\n\n4", "<|im_start|>user\nhi"],
                   headers) == [True, True, True, True]
    assert _starts(tok, NOT_HEADERS, headers) == [False] * len(NOT_HEADERS)
    # the old text-prefix rule called these headers: "assistants can help".startswith("assistant")
    assert boundary.starts_with_header(tok, [tok.encode("assistant", add_special_tokens=False) + [2]],
                                       headers) == [False]


def test_chat_headers_when_the_template_has_no_generation_prompt(smollm2_tokenizer):
    """A template that ignores add_generation_prompt: the header is read off an assistant turn."""
    template = smollm2_tokenizer.chat_template.replace("{% if add_generation_prompt %}", "{% if false %}")
    headers = boundary.chat_headers(smollm2_tokenizer, template)
    assert [smollm2_tokenizer.decode(h) for h in headers] == ["<|im_start|>assistant\n", "<|im_start|>", "assistant\n"]


def test_I3_llama3_header_is_detected_as_tokens(llama3_tokenizer):
    tok = llama3_tokenizer
    headers = boundary.chat_headers(tok)
    assert [tok.decode(h) for h in headers] == ["<|start_header_id|>assistant<|end_header_id|>\n\n",
                                                "<|start_header_id|>", "assistant\n"]
    assert _starts(tok, ["<|start_header_id|>assistant<|end_header_id|>\n\nHi", "<|start_header_id|>user",
                         "assistant\n\nHi"], headers) == [True, True, True]
    assert _starts(tok, NOT_HEADERS + ["assistant<|end_header_id|>"], headers) == [False] * (len(NOT_HEADERS) + 1)


@pytest.mark.parametrize("thinking", [True, False])
def test_I3_qwen3_header_is_detected_as_tokens_with_and_without_thinking(qwen3_tokenizer, thinking):
    tok = qwen3_tokenizer
    headers = boundary.chat_headers(tok, enable_thinking=thinking)
    full = "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")
    assert [tok.decode(h) for h in headers] == [full, "<|im_start|>", "assistant\n"]
    assert _starts(tok, [full + "4", "<|im_start|>assistant\n4", "assistant\n<think>"], headers) == [True] * 3
    # a thinking model opens its answer with <think>: that is not a header
    assert _starts(tok, NOT_HEADERS + ["<think>\nassistants", "</think>\n\n4"], headers) == \
        [False] * (len(NOT_HEADERS) + 2)


def test_I3_reward_text_check_passes_words_that_begin_like_the_role(smollm2_tokenizer):
    tok = smollm2_tokenizer
    headers = boundary.chat_headers(tok, new_turn=False)
    ids = [tok.encode(t, add_special_tokens=False) + [2] for t in ("assistants can help", "assistantship")]
    texts = tok.batch_decode(ids, skip_special_tokens=True)
    guards.check_reward_text(tok, ids, texts, headers)  # the old check raised [I3] on both
    bad = [tok.encode("assistant\n4", add_special_tokens=False) + [2]]
    with pytest.raises(InvariantError, match=r"\[I3\].*chat header"):
        guards.check_reward_text(tok, bad, tok.batch_decode(bad, skip_special_tokens=True), headers)


def test_boundary_report_shows_both_sides_and_counts(smollm2_tokenizer):
    tok = smollm2_tokenizer
    p = templates.prompt_ids(tok, [{"role": "user", "content": "What is 2?"}])
    c_ok = tok("4", add_special_tokens=False)["input_ids"] + [2]
    c_header = tok.encode("<|im_start|>assistant\n4", add_special_tokens=False) + [2]
    C = max(len(c_ok), len(c_header))
    batch = {
        "prompt_ids": torch.tensor([[2, 2] + p, [2, 2] + p]),  # 2 left-padding tokens (pad == <|im_end|>)
        "prompt_mask": torch.tensor([[0, 0] + [1] * len(p)] * 2),
        "completion_ids": torch.tensor([c_ok + [2] * (C - len(c_ok)), c_header + [2] * (C - len(c_header))]),
        "lengths": torch.tensor([len(c_ok), len(c_header)]),
        "rewards": torch.tensor([1.0, 0.0]),
    }
    text = boundary.batch_boundary_report(tok, batch, [2], boundary.chat_headers(tok), n=2)
    assert "pad id 2 (a stop id: left padding is not counted" in text
    # the default system prompt and the user turn each end with <|im_end|>: 2 in the prompt
    assert "+ 2 left padding" in text and "stop tokens: 2 in the prompt, 1 in the completion" in text
    assert "prompt tail: '2?<|im_end|>\\n<|im_start|>assistant\\n'" in text
    assert "completion head: '4<|im_end|>'" in text
    assert text.count("!! the completion starts with the chat header") == 1  # row 1 only
