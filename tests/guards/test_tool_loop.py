"""I1, I3 and I4 on TRL's multi-turn tool loop (``tools=`` / ``environment_factory=``), where one
completion spans several ``generate`` calls: the first turn's prompt is the chat template (with
the tool schema), each later turn's prompt is the previous prompt + the completion + the tool
result, and the loss covers the model's turns only (``tool_mask``). A run with a tool call in
every step passes the guards on every step; a loop that re-tokenizes, or a mask that trains on
the tool result, is stopped.

The tiny model runs on SmolLM2's tokenizer with TRL's Qwen2.5 chat template (the same ChatML
special tokens, plus tool calling); its ``generate`` is scripted, as in TRL's own tool tests, so
every step has a valid tool call, a failing one and a plain answer."""

import pytest
import torch
from conftest import CounterEnvironment
from datasets import Dataset
from transformers import AutoTokenizer
from trl.chat_template_utils import qwen2_5_chat_template

import grpotrl
from grpotrl import InvariantError, guards

CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
BAD_CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "c": 4}}\n</tool_call>'


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def reward_done(completions, **kwargs):
    return [float("Done" in c[-1].get("content", "")) + 0.1 * len(c) for c in completions]


@pytest.fixture
def tool_tokenizer(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama, padding_side="left", truncation_side="left")
    tok.chat_template = qwen2_5_chat_template
    return tok


def scripted_generate(tok, calls):
    """First turn (all 3 rows): a tool call, a failing tool call, a plain answer; the second turn
    (the 2 rows that called a tool): "Done!". Each row ends with <|im_end|> and is right-padded
    with it (pad == eos)."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def generate(input_ids, **kwargs):
        texts = [CALL, BAD_CALL, "No tool needed."] if input_ids.size(0) == 3 else ["Done!"] * input_ids.size(0)
        rows = [tok(t, add_special_tokens=False)["input_ids"] + [im_end] for t in texts]
        width = max(map(len, rows)) + 2
        out = torch.tensor([r + [im_end] * (width - len(r)) for r in rows[: input_ids.size(0)]])
        calls.append(input_ids.size(0))
        return torch.cat([input_ids, out.to(input_ids.device)], dim=1)

    return generate


class Observed(grpotrl.GRPOTrainer):
    def _compute_loss(self, model, inputs):
        self.tool_masks = getattr(self, "tool_masks", []) + [inputs["tool_mask"].clone()]
        return super()._compute_loss(model, inputs)


def test_I1_I3_I4_multi_turn_tool_calls_pass_the_guards_on_every_step(tiny_llama, tool_tokenizer, grpo_args,
                                                                      monkeypatch):
    prompts = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is 3 times {i}?"}]}
                                 for i in range(4)])
    trainer = Observed(model=tiny_llama, reward_funcs=reward_done, processing_class=tool_tokenizer, tools=[multiply],
                       args=grpo_args(per_device_train_batch_size=3, num_generations=3, max_completion_length=128),
                       train_dataset=prompts)
    calls = []
    monkeypatch.setattr(trainer.model, "generate", scripted_generate(tool_tokenizer, calls))
    trainer.train()
    assert calls == [3, 2, 3, 2]  # two steps, each a first turn of 3 rows and a second turn for the 2 tool calls
    logs = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert logs[-1]["tools/call_frequency"] == pytest.approx(2 / 3)
    assert logs[-1]["tools/failure_frequency"] == pytest.approx(1 / 2)
    assert len([h for h in trainer.state.log_history if "guards/logprob_max_gap" in h]) == 2  # I5 ran every step
    assert all((m == 0).any() for m in trainer.tool_masks)  # the loss saw tool results, masked out
    loss_mask = trainer.hook_record.batch("train").guard["loss_mask"]  # I4's per-turn loss mask, from the recorded turns
    assert loss_mask[0].count(0) > 0 and 0 not in loss_mask[2]


def test_I1_I3_I4_environment_rows_without_prompt_pass_the_guards(tiny_llama, tool_tokenizer, grpo_args,
                                                                   monkeypatch):
    """Rows with no ``prompt`` column: the environment's reset() writes it (with TRL's placeholder
    user turn), and the tool schema in the template is the environment's."""
    trainer = Observed(model=tiny_llama, reward_funcs=reward_done, processing_class=tool_tokenizer,
                       environment_factory=CounterEnvironment,
                       train_dataset=Dataset.from_list([{"start": i} for i in range(4)]),
                       args=grpo_args(per_device_train_batch_size=3, num_generations=3, max_completion_length=128,
                                      max_steps=1))
    calls = []
    monkeypatch.setattr(trainer.model, "generate", scripted_generate(tool_tokenizer, calls))
    trainer.train()
    assert calls == [3, 2]
    counts = [e.count for e in trainer.environments]  # one row's group: the same start for all three
    assert counts[0] == 12 and counts[1] == counts[2] < 4  # the failing call and the plain answer change nothing
    assert [h for h in trainer.state.log_history if "guards/logprob_max_gap" in h]


# ---------------------------------------------------------------- the guard alone, on crafted turns
# ids: prompt [5, 6]; turn 1 [7, 2] (2 = stop); tool result [8, 9] then generation prompt [1, 3]; turn 2 [4, 2]


def _call(inputs, outputs, pad=0):
    width = max(map(len, inputs))
    ids = torch.tensor([[pad] * (width - len(i)) + i for i in inputs])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in inputs])
    out = torch.cat([ids, torch.tensor(outputs)], dim=1)
    return {"input_ids": ids, "attention_mask": mask, "output": out}


def _loop(second_input, completion=(7, 2, 8, 9, 1, 3, 4, 2), tool_mask=(1, 1, 0, 0, 0, 0, 1, 1), budget=64):
    calls = [_call([[5, 6], [5, 6, 6]], [[7, 2, 2], [4, 2, 2]]),  # row 1 answers at once
             _call([second_input], [[4, 2, 2]])]
    return guards.check_tool_loop(_Tok(), calls, [[5, 6], [5, 6, 6]], [list(completion), [4, 2]],
                                  [list(tool_mask), [1, 1]], stop_ids=[2], generation_prompt=[1, 3],
                                  max_completion_length=budget)


class _Tok:
    pad_token_id = 0

    def decode(self, ids, **kwargs):
        return " ".join(map(str, ids))


def test_I1_tool_loop_guard_passes_prompt_completion_tool_result():
    assert _loop([5, 6, 7, 2, 8, 9, 1, 3]) == [[1, 1, 0, 0, 0, 0, 1, 1], [1, 1]]


def test_I3_tool_loop_guard_follows_trls_cut_of_the_last_turn_to_the_budget():
    assert _loop([5, 6, 7, 2, 8, 9, 1, 3], completion=(7, 2, 8, 9, 1, 3, 4), tool_mask=(1, 1, 0, 0, 0, 0, 1),
                 budget=7) == [[1, 1, 0, 0, 0, 0, 1], [1, 1]]


def test_I1_tool_loop_guard_stops_a_re_tokenized_history():
    with pytest.raises(InvariantError, match="I1.*row 0, turn 2: the prompt ids given to generation do not continue"):
        _loop([5, 6, 70, 2, 8, 9, 1, 3])  # the first turn's completion re-tokenized differently


def test_I1_tool_loop_guard_stops_a_tool_result_without_generation_prompt():
    with pytest.raises(InvariantError, match="does not end with the generation prompt"):
        _loop([5, 6, 7, 2, 8, 9])


def test_I4_tool_loop_guard_stops_a_mask_that_trains_on_the_tool_result():
    with pytest.raises(InvariantError, match="I4.*tool_mask is wrong at completion position 2"):
        _loop([5, 6, 7, 2, 8, 9, 1, 3], tool_mask=(1, 1, 1, 1, 1, 1, 1, 1))


def test_I3_tool_loop_guard_stops_a_completion_that_drops_the_tool_result():
    with pytest.raises(InvariantError, match="I3.*row 0: the completion is not what generate produced"):
        _loop([5, 6, 7, 2, 8, 9, 1, 3], completion=(7, 2, 4, 2), tool_mask=(1, 1, 1, 1))


def test_I4_loss_mask_of_a_tool_loop():
    ids = torch.tensor([[7, 2, 8, 9, 4, 2, 0]])  # padded to C = 7
    good = torch.tensor([[1, 1, 0, 0, 1, 1, 0]])
    guards.check_loss_mask(_Tok(), ids, good, [[1, 1, 0, 0, 1, 1]], [2], rows=[0])
    with pytest.raises(InvariantError, match="I4.*position 2"):
        guards.check_loss_mask(_Tok(), ids, torch.tensor([[1, 1, 1, 1, 1, 1, 0]]), [[1, 1, 0, 0, 1, 1]], [2], [0])
    cut = torch.tensor([[7, 2, 8, 9, 4, 4, 0]])  # the last turn cut to the budget, no stop: masked out entirely
    guards.check_loss_mask(_Tok(), cut, torch.zeros(1, 7), [[1, 1, 0, 0, 1, 1]], [2], [0], truncated_masked=True)


def test_I1_I3_I4_checks_that_pair_rows_refuse_lists_of_other_lengths():
    """The row-pairing checks zipped their lists: a list one row short compared the rows both had and passed the
    rest unchecked. Each now names the counts (I1: the templated prompts, generation's and the loss's prompts;
    I3: the tool loop's completions; I4: the tool loop's loss masks)."""
    tok = _Tok()
    tok.bos_token_id = None
    with pytest.raises(InvariantError, match=r"I1.*2 rows of used against 1 of template"):
        guards.check_prompts_templated(tok, [[5, 6], [5, 7]], [[5, 6]])
    with pytest.raises(InvariantError, match=r"I1.*2 rows of rows against 2 of generation, 1 of loss"):
        guards.check_same_prompt(tok, [[5, 6], [5, 7]], [[5, 6]], [0, 1])
    with pytest.raises(InvariantError, match=r"I3.*2 rows of prompts against 1 of completions"):
        guards.check_tool_loop(tok, [_call([[5, 6], [5, 6, 6]], [[4, 2, 2], [4, 2, 2]])], [[5, 6], [5, 6, 6]],
                               [[4, 2]], [[1, 1], [1, 1]], stop_ids=[2], generation_prompt=[1, 3],
                               max_completion_length=64)
    ids = torch.tensor([[7, 2, 8, 9, 4, 2, 0], [4, 2, 0, 0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0]])
    with pytest.raises(InvariantError, match=r"I4.*2 rows of rows against 1 of expected_masks"):
        guards.check_loss_mask(tok, ids, mask, [[1, 1, 0, 0, 1, 1]], [2], rows=[0, 1])
    guards.check_prompts_templated(tok, [[5, 6]], [[5, 6]])  # equal counts, equal rows: passes
