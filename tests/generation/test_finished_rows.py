"""padding_free's rollout: rows that have stopped leave ``generate``'s decoding batch
(``generation.finished_rows``, ``_intercept.skip_finished_rows``), and nothing the loop returns changes."""

import contextlib

import pytest
import torch
from conftest import arithmetic_prompts, length_reward
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

import grpotrl
from grpotrl.generation.finished_rows import decoding_share
from grpotrl.generation.sampled_logprobs import SampledLogprobRecorder
from grpotrl.trainers import _intercept


class StopAt(LogitsProcessor):
    """Row i samples eos at generation step ``stops[i]`` (0: the first new token) and never before."""

    def __init__(self, stops: list[int], prompt_width: int, eos: int):
        self.stops, self.prompt_width, self.eos = torch.tensor(stops), prompt_width, eos

    def __call__(self, input_ids, scores):
        t = input_ids.size(1) - self.prompt_width  # the step being sampled
        scores = scores.clone()
        scores[self.stops > t, self.eos] = -float("inf")
        scores[self.stops == t] = -float("inf")
        scores[self.stops == t, self.eos] = 0.0
        return scores


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_gpt2"])  # rotary, and absolute positions
def model_and_batch(request):
    path = request.getfixturevalue(request.param)
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    batch = tok(["1 + 1 =", "What is two plus three, in words?", "Hi", "Count: 1 2 3"], return_tensors="pt",
                padding=True)
    return model, tok, batch


def _generate(model, tok, batch, drop: bool, stops=(1, 3, 3, 6), **kwargs):
    processors = [StopAt(list(stops), batch["input_ids"].size(1), tok.eos_token_id), SampledLogprobRecorder()]
    torch.manual_seed(0)
    with torch.no_grad(), _intercept.inject_recorders_after_warpers(model), \
            (_intercept.skip_finished_rows(model) if drop else contextlib.nullcontext([])) as calls:
        out = model.generate(**batch, max_new_tokens=8, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             logits_processor=processors, **kwargs)
    sequences = out.sequences if hasattr(out, "sequences") else out
    return out, processors[-1].logprobs(sequences), calls


@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(do_sample=True, temperature=0.7, top_k=0)])
def test_finished_rows_leave_the_forward_and_the_sequences_stay(model_and_batch, sampling):
    model, tok, batch = model_and_batch
    full, full_lp, _ = _generate(model, tok, batch, drop=False, **sampling)
    cut, cut_lp, calls = _generate(model, tok, batch, drop=True, **sampling)
    assert torch.equal(cut, full)  # the same tokens, pads included; the sampler drew for all 4 rows both times
    # rows stop at steps 1, 3, 3, 6 (by hand): the forward of step t runs the rows that have not sampled eos
    # before t; step 0 is the prefill; the loop ends once the last row samples eos at step 6
    assert [c.forward_rows for c in calls] == [[4, 4, 3, 3, 1, 1, 1]]
    assert decoding_share(calls) == pytest.approx(17 / 28)
    real = torch.arange(full_lp.size(1)) <= torch.tensor([1, 3, 3, 6]).view(-1, 1)  # [B, C] up to each eos
    torch.testing.assert_close(cut_lp[real], full_lp[real], rtol=0, atol=1e-5)  # the sampler's logprobs (I5)
    assert torch.isfinite(cut_lp).all()


@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(do_sample=True, temperature=0.7, top_k=0)])
def test_repeated_prompts_run_their_prefill_once_and_the_sequences_stay(model_and_batch, sampling):
    """A GRPO-shaped batch (each of the 4 prompts twice, rows of one prompt apart): the prefill runs the 4 distinct
    rows, every row gets its prompt's cache and logits, and the sequences and the sampler's logprobs are those of
    the full batch; the decoding steps then run every unfinished row."""
    model, tok, batch = model_and_batch
    twice = {k: torch.cat([v, v]) for k, v in batch.items()}  # rows 0-3 then their repeats 4-7
    stops = (1, 3, 3, 6, 2, 3, 5, 6)  # a repeat stops elsewhere than its first
    full, full_lp, _ = _generate(model, tok, twice, drop=False, stops=stops, **sampling)
    cut, cut_lp, calls = _generate(model, tok, twice, drop=True, stops=stops, **sampling)
    assert torch.equal(cut, full)
    # the prefill runs 4 rows; step t's forward the rows whose eos step is >= t: 8, 7, 6, 3, 3, 2 (steps 1-6)
    assert [c.forward_rows for c in calls] == [[4, 8, 7, 6, 3, 3, 2]]
    real = torch.arange(full_lp.size(1)) <= torch.tensor(stops).view(-1, 1)  # [B, C] up to each eos
    torch.testing.assert_close(cut_lp[real], full_lp[real], rtol=0, atol=1e-5)


def test_a_call_that_returns_more_than_sequences_keeps_every_row(model_and_batch):
    model, tok, batch = model_and_batch
    full, _, _ = _generate(model, tok, batch, drop=False, return_dict_in_generate=True, output_logits=True)
    out, _, calls = _generate(model, tok, batch, drop=True, return_dict_in_generate=True, output_logits=True)
    assert calls == []  # not used: the finished rows' logits are returned
    assert torch.equal(out.sequences, full.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, full.logits))


def test_beam_search_and_static_caches_keep_every_row(model_and_batch):
    model, tok, batch = model_and_batch
    with torch.no_grad(), _intercept.skip_finished_rows(model) as calls:
        model.generate(**batch, max_new_tokens=4, num_beams=2, pad_token_id=tok.pad_token_id)
    assert calls == []  # beam search is not the plain loop
    full, _, _ = _generate(model, tok, batch, drop=False, cache_implementation="static")
    out, _, calls = _generate(model, tok, batch, drop=True, cache_implementation="static")
    assert len(calls) == 1 and calls[0].off and calls[0].forward_rows == [4]  # a static cache cannot lose rows
    assert torch.equal(out, full)


def test_no_row_left_keeps_one_row_in_the_forward():
    """ZeRO-3's synced_gpus: the loop runs forwards after every row of this process stopped."""
    from grpotrl.generation.finished_rows import FinishedRows
    from transformers import DynamicCache

    rows = FinishedRows()
    ids = torch.zeros(3, 2, dtype=torch.long)
    rows.before_forward({"input_ids": ids, "attention_mask": torch.ones(3, 2)})
    cache = DynamicCache()
    cache.update(torch.zeros(3, 1, 2, 4), torch.zeros(3, 1, 2, 4), 0)
    rows.observe(torch.tensor([True, True, True]))
    out = rows.before_forward({"input_ids": ids[:, -1:], "attention_mask": torch.ones(3, 3), "cache": cache})
    assert out["input_ids"].shape == (1, 1) and out["attention_mask"].shape == (1, 3)
    assert cache.layers[0].keys.shape[0] == 1 and rows.forward_rows == [3, 1]


def test_padding_free_rollout_samples_what_the_full_batch_samples(tiny_llama, grpo_args):
    """Trainer level: padding_free on and off sample the same completions from the same seed (the rows stop
    early at different lengths: grpo_args biases the stop tokens), and the rollout's share is logged."""

    class Seen(grpotrl.GRPOTrainer):
        def _compute_loss(self, model, inputs):
            self.seen = getattr(self, "seen", []) + [inputs["completion_ids"].clone()]
            return super()._compute_loss(model, inputs)

    runs = {}
    for on in (True, False):
        trainer = Seen(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                       args=grpo_args(padding_free=on, max_steps=2))
        trainer.train()
        runs[on] = trainer
    assert all(torch.equal(a, b) for a, b in zip(runs[True].seen, runs[False].seen))
    shares = [h["padding_free/decoding_rows"] for h in runs[True].state.log_history
              if "padding_free/decoding_rows" in h]
    assert len(shares) == 2 and all(0 < s < 1 for s in shares), shares
    assert not any("padding_free/decoding_rows" in h for h in runs[False].state.log_history)


def test_rows_stay_in_the_decoding_batch_where_padding_free_resolved_off(tiny_llama, grpo_args, monkeypatch, caplog):
    """The rollout follows padding_free's resolved state: on a device where 'auto' is not measured faster
    (here CPU taken off the list, as CUDA is), every row stays in the forward and nothing is logged for it."""
    from grpotrl.trainers import padding_free

    monkeypatch.setattr(padding_free, "MEASURED_FASTER_ON", ())
    entered = []
    skip = _intercept.skip_finished_rows
    monkeypatch.setattr(_intercept, "skip_finished_rows", lambda model: entered.append(model) or skip(model))
    with caplog.at_level("INFO", logger="grpotrl.trainers.grpo"):
        trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                                      args=grpo_args(max_steps=1))
    assert trainer.padding_free is False
    assert "padding_free off (auto: not measured faster than TRL's padded forward on cpu; see docs/cost.md); " \
           "finished-row rollout off (padding_free off)" in caplog.text
    trainer.train()
    assert entered == []
    assert not any("padding_free/decoding_rows" in h for h in trainer.state.log_history)
