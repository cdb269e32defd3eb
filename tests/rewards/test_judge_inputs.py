"""Judges given bad settings, a bad key, a broken environment or a judge that puts no mass on the scale:
refused when built (``InputError``, before any model loads) or a row without a score, never a made-up
score and never an exception out of the reward function (I8). Per-task judges' notes land in TRL's
completion table one per batch row."""

import asyncio
import math
from collections import defaultdict
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import trl
from judge_server import LoopbackJudge

from grpotrl.errors import InputError
from grpotrl.rewards.judges import HttpJudge, LocalJudge, _excerpt
from grpotrl.rewards.recipe import parse_judges
from grpotrl.rewards.rubrics import FAIRNESS, Rubric, parse_verdict
from grpotrl.rewards.tasks import per_task

KEY_ENV = "GRPOTRL_TEST_JUDGE_KEY"


@pytest.fixture
def server():
    with LoopbackJudge(reply="The answer was read.\nVERDICT: 4") as p:
        yield p


def trl_extra_log():
    """TRL's own ``_log_completion_extra`` on an object holding only the buffer it writes."""
    owner = SimpleNamespace(_pending_extra_logs=defaultdict(list))
    return owner._pending_extra_logs, lambda column, values: trl.GRPOTrainer._log_completion_extra(owner, column,
                                                                                                    values)


def test_I8_per_task_judges_log_one_note_per_batch_row_into_trls_table(server):
    """Two tasks' judges each see their own rows; TRL's table needs every column as long as the batch, also in a
    batch where one task has no row (its column is then all None, not missing or stale)."""
    funcs = per_task({"a": HttpJudge(FAIRNESS, base_url=server.url, model="m", name="ja"),
                      "b": HttpJudge(FAIRNESS, base_url=server.url, model="m", name="jb")}, "task")
    for tasks in (["a", "b", "a", "b"], ["a", "a", "a", "a"]):
        pending, log_extra = trl_extra_log()
        prompts, completions = [f"q{i}" for i in range(4)], [f"c{i}" for i in range(4)]
        for f in funcs:
            asyncio.run(f(prompts=prompts, completions=completions, task=tasks, log_extra=log_extra))
        assert {c: len(v) for c, v in pending.items()} == {"a/judge/ja": 4, "b/judge/jb": 4}
        pd.DataFrame({"prompt": prompts, **pending})  # TRL's table: raises on columns of other lengths
        for task, column in (("a", "a/judge/ja"), ("b", "b/judge/jb")):
            notes = pending[column]
            assert [n is not None for n in notes] == [t == task for t in tasks], (column, notes)
            assert all("VERDICT: 4" in n for n in notes if n is not None)


@pytest.mark.parametrize("key", ["sk-abc123def456\n", " sk-abc123def456", "sk-abc\u2019123def456"])
def test_I8_a_key_no_header_can_carry_is_refused_when_built_and_never_shown(server, monkeypatch, key):
    monkeypatch.setenv(KEY_ENV, key)
    with pytest.raises(InputError, match=f"'{KEY_ENV}'") as err:
        HttpJudge(FAIRNESS, base_url=server.url, model="m", api_key_env=KEY_ENV)
    assert "abc123" not in str(err.value)


def test_I8_a_key_spoilt_after_the_judge_was_built_gives_none_rows_not_an_exception(server, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-abc123def456")
    judge = HttpJudge(FAIRNESS, base_url=server.url, model="m", api_key_env=KEY_ENV, max_failed_batches=0)
    monkeypatch.setenv(KEY_ENV, "sk-abc\u2019123def456")
    scores = asyncio.run(judge(["q", "q"], ["a", "b"]))
    assert scores == [None, None] and judge.failures == {"transport": 2}
    assert server.requests == [] and "abc" not in judge.last_error


def test_I8_a_proxy_variable_httpx_cannot_read_gives_none_rows_not_an_exception(monkeypatch):
    # a remote host: a loopback one never reads the proxy variables (test_judge_faults.py); no request leaves,
    # since the client cannot be built
    judge = HttpJudge(FAIRNESS, base_url="http://judge.invalid:8000/v1", model="m", max_failed_batches=1)
    monkeypatch.setenv("ALL_PROXY", "ftp://proxy.invalid:21")
    with pytest.raises(Exception) as err:  # the documented stop after max_failed_batches, naming the cause
        asyncio.run(judge(["q"], ["a"]))
    assert type(err.value).__name__ == "JudgeError" and "proxy" in str(err.value).lower()
    assert judge.failures == {"transport": 1}


def test_a_tls_setting_that_cannot_be_read_is_refused_when_the_judge_is_built(server, monkeypatch, tmp_path):
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "missing.pem"))
    with pytest.raises(InputError, match="SSL_CERT_FILE"):
        HttpJudge(FAIRNESS, base_url=server.url, model="m")


@pytest.mark.parametrize("setting, value", [
    ("timeout", math.nan), ("timeout", math.inf), ("timeout", 0), ("max_failed_batches", -1), ("cache_size", -1),
    ("max_tokens", 0), ("temperature", math.nan), ("backoff", -0.5), ("max_retries", 1.5), ("max_concurrency", 0),
])
def test_a_judge_setting_not_finite_or_out_of_range_is_refused_when_built(server, setting, value):
    with pytest.raises(InputError, match=f"{setting} must be"):
        HttpJudge(FAIRNESS, base_url=server.url, model="m", **{setting: value})


@pytest.mark.parametrize("setting, value, match", [
    ("timeout", float("inf"), "timeout must be"), ("max_retries", float("nan"), "max_retries must be"),
    ("cache_size", -1, "cache_size must be"),
])
def test_a_recipe_judge_setting_out_of_range_names_the_judge(setting, value, match):
    with pytest.raises(InputError, match=f"judges.j.*{match}"):
        parse_judges({"j": {"base_url": "http://127.0.0.1:9/v1", "model": "m", "rubric": "fairness", setting: value}})


def test_a_recipe_key_variable_that_is_not_set_is_named_only_when_it_reads_as_a_name(monkeypatch):
    monkeypatch.delenv("JUDGE_TEST_UNSET_KEY", raising=False)
    settings = {"base_url": "http://127.0.0.1:9/v1", "model": "m", "rubric": "fairness"}
    with pytest.raises(InputError, match="'JUDGE_TEST_UNSET_KEY' is not set"):
        parse_judges({"j": settings | {"api_key_env": "JUDGE_TEST_UNSET_KEY"}})
    pasted = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345"  # a key where its variable's name goes
    with pytest.raises(InputError, match="not set") as err:
        parse_judges({"j": settings | {"api_key_env": pasted}})
    assert "AbCdEfGh" not in str(err.value)


@pytest.mark.parametrize("fields, match", [
    ({"low": 4, "high": 4}, "low < high"), ({"low": 5, "high": 1}, "low < high"),
    ({"examples": ({"prompt": "p", "completion": "c"},)}, r"lacks \['verdict'\]"),
    ({"examples": ({"prompt": "p", "completion": "c", "verdict": 9},)}, "verdict 9"),
])
def test_a_rubric_that_cannot_score_is_refused_when_made(fields, match):
    with pytest.raises(InputError, match=match):
        Rubric(name="r", system="s", template="{prompt} {completion}", **fields)
    with pytest.raises(InputError, match=match):  # the same from a recipe, before any model loads
        parse_judges({"j": {"base_url": "http://127.0.0.1:9/v1", "model": "m",
                            "rubric": {"system": "s", "template": "{prompt} {completion}",
                                       **{k: list(v) if k == "examples" else v for k, v in fields.items()}}}})


def test_I8_a_verdict_on_another_scale_is_no_verdict():
    assert parse_verdict("VERDICT: 4/5") == 4.0
    assert parse_verdict("VERDICT: 4/10") is None and parse_verdict("VERDICT: 5/100") is None
    assert parse_verdict("VERDICT: 7/10", 1, 10) == 7.0


class ScaleLogits(torch.nn.Module):
    """A judge model reduced to its last logits: each row's next-token logits are ``fill``'s."""

    def __init__(self, vocab: int, fill):
        super().__init__()
        self.vocab, self.fill = vocab, fill
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return self.anchor.device

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep):
        logits = torch.zeros(input_ids.shape[0], len(logits_to_keep), self.vocab)
        self.fill(logits)
        return SimpleNamespace(logits=logits)


def off_the_scale(logits):  # all mass on one token, the scale's digits 200 nats below: their mass underflows
    logits[...] = -200.0
    logits[..., 100] = 0.0


def not_finite(logits):
    logits[...] = math.nan


@pytest.mark.parametrize("fill", [off_the_scale, not_finite])
def test_I8_local_judge_without_mass_on_the_scale_gives_none_never_a_score(smollm2_tokenizer, fill):
    judge = LocalJudge(ScaleLogits(len(smollm2_tokenizer), fill), smollm2_tokenizer, FAIRNESS)
    metrics = {}
    assert judge(["Describe nurses."], ["They care."], log_metric=metrics.__setitem__) == [None]
    assert metrics["judge/local_fairness/missing_share"] == 1.0


def test_I8_local_judge_with_mass_on_the_scale_scores_it(smollm2_tokenizer):
    """The control of the test above: the same model reduced to logits that favour the scale's 4."""
    probe = LocalJudge(ScaleLogits(len(smollm2_tokenizer), lambda x: None), smollm2_tokenizer, FAIRNESS)
    four = probe.score_ids[3]

    def on_four(logits):
        logits[..., four] = 30.0

    judge = LocalJudge(ScaleLogits(len(smollm2_tokenizer), on_four), smollm2_tokenizer, FAIRNESS)
    assert judge(["Describe nurses."], ["They care."]) == [pytest.approx(0.75, abs=1e-6)]


@pytest.mark.parametrize("batch_size", [0, -1])
def test_local_judge_batch_size_below_one_is_refused(smollm2_tokenizer, batch_size):
    with pytest.raises(InputError, match="batch_size"):
        LocalJudge(ScaleLogits(len(smollm2_tokenizer), off_the_scale), smollm2_tokenizer, FAIRNESS,
                   batch_size=batch_size)
    with pytest.raises(InputError, match="batch_size"):
        parse_judges({"j": {"model_path": "smollm2-135m-instruct", "rubric": "fairness", "batch_size": batch_size}})


KEY = "sk-proj-7Hq2Lx9Vd4Wm1Rc8Tz5Np3Kb6Yf0Gs"


@pytest.mark.parametrize("tail", [False, True])
def test_I8_a_large_body_keeps_no_piece_of_the_key_wherever_it_sits(tail):
    """The note comes from a window of a 1 MiB body: a key at every offset across the note's 200-character
    cut and around the window's edges (whole, or cut by the body's end) leaves no 8-character piece of itself
    in the note."""
    from grpotrl.rewards.judges import ESCAPED, PIECE

    secrets = (f"Bearer {KEY}", KEY)
    pieces = {KEY[i:i + 8] for i in range(len(KEY) - 7)}
    body = "x" * (1 << 20)
    edge = 2 * 200 + ESCAPED * PIECE  # the window: twice the note plus the longest a piece is written
    for at in [*range(0, 200 + 30), *range(edge - 2 * len(KEY) - 30, edge + 30)]:
        text = (body[:len(body) - at] + KEY + "y" * max(at - len(KEY), 0))[-len(body):] if tail else \
            "z" * at + KEY + body
        note = _excerpt(text, secrets, tail=tail)
        assert len(note) <= 200 and not [p for p in pieces if p in note], (at, note)
