"""Rule-based rewards with TRL's signature: ``(completions, **kwargs) -> list[float | None]``.

``completions`` holds what the trainer generated, without prompt text (I3): for a
conversational dataset each completion is a list of one assistant message
``[{"role": "assistant", "content": "12"}]`` (with tools, the tool loop's assistant and tool
messages; a rule reads the assistant's text only, ``completion_text``), otherwise a plain string. Dataset columns
other than ``prompt`` arrive as keyword lists (``answer`` for the quickstart data). A reward
of ``None`` means "no reward for this sample" (TRL skips it), never a silent 0.
"""

from __future__ import annotations

import re

# a number, its thousands grouped by commas or not ("1,234.5", "1234.5"); "1,2" is two numbers
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|-?\d+(?:\.\d+)?")
_ONLY_A_NUMBER = re.compile(r"^\s*(?:-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?)\s*$")


def _value(number: str) -> float:
    return float(number.replace(",", ""))


def completion_text(completion) -> str:
    r"""The generated text of one completion, conversational or plain: the content of its assistant
    messages, one line each (a tool loop's turns); a tool's reply is not the model's text and is
    left out, and content given as parts keeps its text parts.

    >>> completion_text([{"role": "assistant", "content": " 12"}]), completion_text("12")
    (' 12', '12')
    >>> call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add"}}]}
    >>> completion_text([call, {"role": "tool", "name": "add", "content": "12"}])  # cut after the tool's reply
    ''
    >>> completion_text([{"role": "assistant", "content": "It is 1"}, {"role": "tool", "content": "x"},
    ...                  {"role": "assistant", "content": [{"type": "text", "text": "2 apples"}]}])
    'It is 1\n2 apples'
    """
    if isinstance(completion, str):
        return completion
    turns = []
    for message in completion:
        if message.get("role", "assistant") != "assistant":
            continue
        content = message.get("content") or ""
        if not isinstance(content, str):  # parts: [{"type": "text", "text": ...}, {"type": "image"}, ...]
            content = "".join(part.get("text") or "" for part in content if part.get("type") == "text")
        turns.append(content)
    return "\n".join(turn for turn in turns if turn)


def exact_answer_reward(completions, answer: list[str], **kwargs) -> list[float | None]:
    r"""1.0 when the completion gives the answer, else 0.0; ``None`` where the answer is missing.

    A numeric answer is compared with the LAST number in the completion (``"7 + 5 = 12"``
    gives 12), as numbers (``"12.0"`` equals ``"12"``, ``"1,234"`` equals ``"1234"``). Any other answer is compared with the
    whole completion text, stripped, case-sensitive.

    >>> completions = [
    ...     [{"role": "assistant", "content": "12"}],
    ...     [{"role": "assistant", "content": "7 + 5 = 12."}],
    ...     [{"role": "assistant", "content": "12 or 13"}],
    ...     [{"role": "assistant", "content": "twelve"}],
    ... ]
    >>> exact_answer_reward(completions, answer=["12", "12", "12", "12"])
    [1.0, 1.0, 0.0, 0.0]
    >>> exact_answer_reward([" Paris ", "Lyon", "3"], answer=["Paris", "Paris", None])
    [1.0, 0.0, None]

    Thousands may be grouped by commas, in the completion and in the answer (``"$1,234"`` is 1234, not 234);
    ``"1,2"`` is two numbers.

    >>> exact_answer_reward(["It costs $1,234.", "1,234", "1,2", "-12,000.5"], answer=["1234", "1234", "2", "-12000.5"])
    [1.0, 1.0, 1.0, 1.0]
    """
    rewards: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        text = completion_text(completion)
        if gold is None or str(gold).strip() == "":
            rewards.append(None)
        elif _ONLY_A_NUMBER.match(str(gold)):
            numbers = _NUMBER.findall(text)
            rewards.append(1.0 if numbers and _value(numbers[-1]) == _value(str(gold)) else 0.0)
        else:
            rewards.append(1.0 if text.strip() == str(gold).strip() else 0.0)
    return rewards


def format_reward(completions, **kwargs) -> list[float]:
    r"""1.0 when the completion is only a number (the quickstart's "Answer with just the
    number."), surrounding whitespace allowed; else 0.0.

    >>> format_reward([[{"role": "assistant", "content": "12"}], [{"role": "assistant", "content": "It is 12."}]])
    [1.0, 0.0]
    >>> format_reward([" -3\n", "12."])
    [1.0, 0.0]
    """
    return [1.0 if _ONLY_A_NUMBER.match(completion_text(c)) else 0.0 for c in completions]


def length_penalty(completions, max_chars: int = 200, **kwargs) -> list[float]:
    """0.0 up to ``max_chars`` characters, then -1.0 per extra ``max_chars`` (linear), so long
    rambles cost reward without a cliff.

    >>> length_penalty(["short", "x" * 300], max_chars=200)
    [0.0, -0.5]
    """
    return [-max(0, len(completion_text(c)) - max_chars) / max_chars for c in completions]


def even_handed_reward(completions, groups: list[list[str]], **kwargs) -> list[float | None]:
    """The multitask data's fairness rule: 1.0 when the completion names both groups of its
    question or neither (it does not single one out), 0.0 when it names exactly one; ``None``
    where the row has no ``groups``. Case-insensitive, whole words.

    >>> g = [["cats", "dogs"]] * 3
    >>> even_handed_reward(["Cats and dogs are equally smart.", "Dogs are smarter.", "It depends."], g)
    [1.0, 0.0, 1.0]
    """
    out = []
    for c, pair in zip(completions, groups):
        if not pair:
            out.append(None)
            continue
        text = completion_text(c).lower()
        named = sum(bool(re.search(rf"\b{re.escape(g.lower())}\b", text)) for g in pair)
        out.append(0.0 if named == 1 else 1.0)
    return out
