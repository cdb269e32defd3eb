r"""Judges and the checks around them (I8) on replies and settings real runs meet:

* a reasoning judge (Qwen3, DeepSeek-R1 served without a reasoning parser) sends its thinking in ``content``,
  inside ``<think>...</think>`` or, where the chat template opened the block in the prompt, ending at a lone
  ``</think>``: a verdict line written while thinking is not the judge's verdict, and a reply whose thinking
  never closed has none; a reply with Windows line ends (``\r\n``) is read like one with ``\n``;
* a judge whose rubric column is empty or None on every row it scores sends nothing, so it neither scores nor
  ever reaches ``JudgeError``: refused before any model loads, as a rule reward's empty column is; and a judge
  behind a ``JudgeRouter`` has its rubric's columns checked like any other judge, not first at the judged batch;
* an integer setting given as a float (``max_tokens=256.0``) is used as the integer it was checked to be:
  OpenAI's API answers 400 to ``"max_tokens": 256.0``, and a float ``max_reply_bytes`` cannot cut a body.
"""

import json
import logging

import pytest
from datasets import Dataset
from test_judge_faults import ScriptedJudge, completion, judge_call

from grpotrl.errors import InputError
from grpotrl.rewards.judges import HttpJudge, JudgeRouter
from grpotrl.rewards.resolve import check_reward_columns, check_reward_signal
from grpotrl.rewards.rubrics import FAIRNESS, HALLUCINATION, parse_verdict

# ---------------------------------------------------------------------------- a reasoning judge's thinking

THOUGHT_ONLY = [
    # thinking in <think>...</think>, then an answer without a verdict line
    "<think>\nA first guess:\nVERDICT: 5\nBut it stereotypes nurses.\n</think>\nThe answer stereotypes nurses.",
    # the template opened <think> in the prompt: the reply holds the thinking and its closing tag only
    "A first guess:\nVERDICT: 5\nBut it stereotypes nurses.\n</think>\n\nThe answer is unfair.",
    # thinking that never closed: no answer at all
    "<think>\nA first guess:\nVERDICT: 5\nLet me check the second sentence",
]


@pytest.mark.parametrize("reply", THOUGHT_ONLY)
def test_I8_a_verdict_line_inside_the_judges_thinking_is_no_verdict(reply):
    assert parse_verdict(reply) is None


@pytest.mark.parametrize("reply, score", [
    ("<think>\nVERDICT: 5\nNo, it stereotypes.\n</think>\nVERDICT: 2", 2.0),
    ("<THINK>VERDICT: 1</THINK>\n\nVERDICT: 4", 4.0),
    ("Reasoning, VERDICT: 5 on its own line next:\nVERDICT: 5\n</think>\nVERDICT: 3", 3.0),
])
def test_I8_the_verdict_after_the_judges_thinking_is_read(reply, score):
    assert parse_verdict(reply) == score


@pytest.mark.parametrize("reply, score", [("The answer is fair.\r\nVERDICT: 4\r\n", 4.0),
                                          ("VERDICT: 2\r\n\r\nThat is all.\r\n", 2.0),
                                          ("**Verdict:** 3/5.\r\n", 3.0)])
def test_I8_a_reply_with_windows_line_ends_is_read(reply, score):
    assert parse_verdict(reply) == score


def test_I8_a_reasoning_judge_over_http_scores_only_its_answer():
    """Row 0's answer has no verdict (only its thinking has): None, reason no_verdict; row 1 is scored on its
    answer's verdict, not on the one it thought of first."""
    replies = {"a": THOUGHT_ONLY[0], "b": "<think>\nVERDICT: 5\nToo generous.\n</think>\nVERDICT: 2"}

    def answer(request):
        graded = json.loads(request["body"])["messages"][-1]["content"]
        return 200, completion(replies["a" if "<response>\na\n" in graded else "b"], "stop")

    with ScriptedJudge(answer) as server:
        judge = HttpJudge(FAIRNESS, base_url=server.url, model="m", max_failed_batches=0)
        scores, metrics, extras = judge_call(judge, ["q", "q"], ["a", "b"])
    assert scores == [None, 0.25]  # (2 - 1) / (5 - 1)
    assert metrics["judge/fairness/failed/no_verdict"] == 0.5
    assert "stereotypes nurses" in extras["judge/fairness"][0]


def test_I8_think_tags_in_the_graded_completion_are_defanged():
    """A reasoning policy's completion keeps its text, but its think tags cannot close the judge's thinking when
    the judge parrots it back."""
    graded = FAIRNESS.messages("q", "<think>plan</think>\nNurses can be anyone.\n</ Think >")[-1]["content"]
    assert "[think]plan[/think]\nNurses can be anyone.\n[/think]" in graded
    assert parse_verdict(graded + "\nVERDICT: 4") == 4.0  # a parrot of it, then the verdict


# ---------------------------------------------------------------------------- a judge with nothing to read

def test_I8_a_judge_whose_rubric_column_is_empty_on_every_row_is_refused_before_compute():
    """Every row lacks its reference: the judge would send nothing, score nothing and never raise JudgeError."""
    data = Dataset.from_dict({"prompt": ["q1", "q2", "q3"], "reference": ["", None, "  "],
                              "task": ["facts", "facts", "fair"]})
    judge = HttpJudge(HALLUCINATION, base_url="http://127.0.0.1:9/v1", model="m", name="facts_judge")
    for funcs in ([judge], {"facts": [judge]}, [JudgeRouter({"facts": judge})]):
        with pytest.raises(InputError, match=r"Column 'reference' of the 'train' split, which judge 'facts_judge' "
                                             r"\(rubric 'hallucination', field 'reference'\)( \(task 'facts'\))? "
                                             r"reads, is empty or None on every row"):
            check_reward_signal(funcs, data, "train")


def test_a_judge_whose_rubric_column_is_empty_on_some_rows_is_warned_about(caplog):
    data = Dataset.from_dict({"prompt": ["q1", "q2", "q3"], "reference": ["r", None, "r"], "task": ["a"] * 3})
    judge = HttpJudge(HALLUCINATION, base_url="http://127.0.0.1:9/v1", model="m", name="facts_judge")
    with caplog.at_level(logging.WARNING):
        check_reward_signal([judge], data, "train")
    assert "'reference'" in caplog.text and "facts_judge" in caplog.text and "1 of 3 rows" in caplog.text
    # rows of other tasks do not count: only the task a judge scores
    data = Dataset.from_dict({"prompt": ["q1", "q2"], "reference": ["r", None], "task": ["facts", "fair"]})
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_reward_signal({"facts": [judge]}, data, "train")
        check_reward_signal([JudgeRouter({"facts": judge})], data, "train")
    assert caplog.text == ""


def test_I8_a_routed_judges_rubric_column_missing_is_refused_before_compute():
    """A JudgeRouter's judge reads its rubric's columns like any judge: refused before the load, not an
    InputError at the first judged batch after generation."""
    data = Dataset.from_dict({"prompt": ["q1"], "task": ["facts"]})
    judge = HttpJudge(HALLUCINATION, base_url="http://127.0.0.1:9/v1", model="m", name="facts_judge")
    with pytest.raises(InputError, match=r"Judge 'facts_judge' \(rubric 'hallucination'\) reads the dataset "
                                         r"column\(s\) \['reference'\]"):
        check_reward_columns([JudgeRouter({"facts": judge})], data, "train")
    with pytest.raises(InputError, match="routes on the column 'task', which the 'train' split lacks"):
        check_reward_columns([JudgeRouter({"facts": judge})], Dataset.from_dict({"prompt": ["q"]}), "train")


# ---------------------------------------------------------------------------- integer settings given as floats

def test_integer_settings_given_as_floats_are_used_as_integers():
    body = completion("x" * 5000 + "\nVERDICT: 4", "stop")
    with ScriptedJudge(lambda request: (200, body)) as server:
        judge = HttpJudge(FAIRNESS, base_url=server.url, model="m", max_tokens=16.0, max_reply_bytes=2048.0,
                          max_concurrency=2.0, max_retries=1.0, max_failed_batches=0)
        scores, metrics, _ = judge_call(judge, ["q"], ["a"])
        sent = json.loads(server.requests[-1]["body"])["max_tokens"]
    assert sent == 16 and isinstance(sent, int)  # OpenAI's API refuses "max_tokens": 16.0 with a 400
    assert scores == [None] and metrics["judge/fairness/failed/too_large"] == 1.0  # not "transport"
    assert all(isinstance(getattr(judge, k), int) for k in ("max_tokens", "max_reply_bytes", "max_concurrency",
                                                            "max_retries", "max_failed_batches", "cache_size"))


# ---------------------------------------------------------------------------- replies as content parts, rules

def test_I8_a_reply_sent_as_content_parts_is_read_from_its_text_parts():
    """Some servers send a reasoning model's reply as a list of content parts: the text parts are the reply (the
    reasoning part's verdict is not), a list without one is no reply text, never a crash or a made-up score."""
    parts = {"a": [{"type": "reasoning", "text": "VERDICT: 5"}, {"type": "text", "text": "Fair.\nVERDICT: 4"}],
             "b": [{"type": "reasoning", "text": "VERDICT: 5"}]}

    def answer(request):
        graded = json.loads(request["body"])["messages"][-1]["content"]
        body = json.loads(completion("x", "stop"))
        body["choices"][0]["message"]["content"] = parts["a" if "<response>\na\n" in graded else "b"]
        return 200, json.dumps(body).encode()

    with ScriptedJudge(answer) as server:
        judge = HttpJudge(FAIRNESS, base_url=server.url, model="m", max_failed_batches=0)
        scores, metrics, _ = judge_call(judge, ["q", "q"], ["a", "b"])
    assert scores == [0.75, None]  # (4 - 1) / (5 - 1); no text part
    assert metrics["judge/fairness/failed/not_a_chat_completion"] == 0.5


def test_rules_read_grouped_thousands_and_a_prompt_without_text():
    from grpotrl.rewards.rubrics import prompt_text
    from grpotrl.rewards.rules import exact_answer_reward

    completions = [[{"role": "assistant", "content": "The total is $1,234."}],
                   [{"role": "assistant", "content": "Pick 1,2 or 3"}]]
    assert exact_answer_reward(completions, answer=["1234", "3"]) == [1.0, 1.0]  # not 234; "1,2" is 1 and 2
    assert exact_answer_reward(completions, answer=["1,234", "2"]) == [1.0, 0.0]
    assert prompt_text([{"role": "user", "content": None}]) == ""
