"""Rule rewards on the completions TRL builds: plain strings, one assistant message, and the tool loop's
messages (TRL 1.16 ``GRPOTrainer._tool_call_loop``: the assistant's call, the tool's reply ``{"role": "tool",
"name": ..., "content": str(result)}``, then the assistant's next turn, which is missing when the tool's reply
used up ``max_completion_length``)."""

from grpotrl.rewards.rules import completion_text, exact_answer_reward, format_reward

CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}]}
REPLY = {"role": "tool", "name": "multiply", "content": "12"}


def test_I3_a_tools_reply_is_not_the_models_answer():
    # the loop cut after the tool's reply: the model gave no answer, so neither rule may pay for the tool's "12"
    cut = [CALL, REPLY]
    assert exact_answer_reward([cut], answer=["12"]) == [0.0]
    assert format_reward([cut]) == [0.0]
    # the model's own next turn is read, the tool's reply is not
    answered = [CALL, REPLY, {"role": "assistant", "content": "3 x 4 = 12"}]
    wrong = [CALL, REPLY, {"role": "assistant", "content": "It is 13"}]
    assert exact_answer_reward([answered, wrong], answer=["12", "12"]) == [1.0, 0.0]
    assert completion_text(answered) == "3 x 4 = 12"


def test_assistant_turns_do_not_run_together_and_parts_are_read():
    # "1" ending one turn and "2" starting the next are two numbers, not 12
    turns = [{"role": "assistant", "content": "About 1"}, REPLY, {"role": "assistant", "content": "2 more"}]
    assert exact_answer_reward([turns], answer=["12"]) == [0.0]
    parts = [{"role": "assistant", "content": [{"type": "text", "text": " 12 "}, {"type": "image"}]}]
    assert completion_text(parts) == " 12 "
    assert format_reward([parts]) == [1.0]
