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


def _decoding_step(rows, position_ids: torch.Tensor) -> dict:
    """A prefill of 4 rows (no cache: nothing copied), row 1 stopping, then the next step's inputs and a 4-row
    cache; returns that step's inputs as ``rows`` hands them to the forward."""
    from transformers import DynamicCache

    ids = torch.arange(8).view(4, 2)
    rows.before_forward({"input_ids": ids, "attention_mask": torch.ones(4, 2), "position_ids": position_ids[..., :2]})
    cache = DynamicCache()
    cache.update(torch.zeros(4, 1, 2, 4), torch.zeros(4, 1, 2, 4), 0)
    rows.observe(torch.tensor([False, True, False, False]))
    return rows.before_forward({"input_ids": ids[:, -1:], "attention_mask": torch.ones(4, 3),
                                "position_ids": position_ids[..., 2:], "cache": cache})


def test_multimodal_rope_position_ids_are_cut_along_their_batch_axis():
    """Qwen2-VL's position ids are [4, B, L] (text + 3 rope axes), batch on the axis before the sequence; with B = 4
    the first axis has B entries too, and cutting it would keep rope axes 0, 2, 3 of every row."""
    from grpotrl.generation.finished_rows import FinishedRows

    position_ids = 100 * torch.arange(4).view(4, 1, 1) + 10 * torch.arange(4).view(1, 4, 1) + torch.arange(3)  # [4, 4, 3]
    rows = FinishedRows()
    out = _decoding_step(rows, position_ids)
    assert out["input_ids"].flatten().tolist() == [1, 5, 7]  # rows 0, 2, 3 (row 1 stopped)
    # pos[a, r, 2] = 100 a + 10 r + 2, for every rope axis a and the rows r = 0, 2, 3
    assert out["position_ids"].tolist() == [[[a * 100 + r * 10 + 2] for r in (0, 2, 3)] for a in range(4)]
    assert out["cache"].layers[0].keys.shape[0] == 3 and rows.forward_rows == [4, 3]


def test_position_ids_broadcast_over_the_rows_keep_every_row():
    """[1, L] position ids (one row for all: the batch axis does not hold B rows) cannot be cut: the call runs
    as transformers wrote it."""
    from grpotrl.generation.finished_rows import FinishedRows

    rows = FinishedRows()
    out = _decoding_step(rows, torch.arange(3).view(1, 3))
    assert rows.off and out["input_ids"].shape == (4, 1) and out["position_ids"].tolist() == [[2]]
    assert out["cache"].layers[0].keys.shape[0] == 4 and rows.forward_rows == [4]


def test_a_decoding_step_whose_inputs_cannot_be_cut_after_rows_left_is_an_error():
    """Once rows have left the KV cache they cannot come back: a later step's position ids that do not hold the B
    rows stop the call, naming the shapes."""
    from grpotrl.generation.finished_rows import FinishedRows

    rows = FinishedRows()
    cache = _decoding_step(rows, torch.arange(3).expand(4, 3))["cache"]  # [4, 3]: row 1 left the cache
    with pytest.raises(RuntimeError, match=r"'position_ids': \(1, 1\).*padding_free=False"):
        rows.before_forward({"input_ids": torch.zeros(4, 1, dtype=torch.long), "attention_mask": torch.ones(4, 4),
                             "position_ids": torch.tensor([[3]]), "cache": cache})


def _tiny_multimodal_rope_model(name: str, tok):
    """A randomly initialised 2-layer text model of a multimodal-rope family (position ids ``[4, B, L]`` in
    ``generate``), its vision tower of one tiny layer (the prompts are text: it never runs)."""
    import transformers

    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    rope = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}  # sums to the rotary dims / 2
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                  spatial_merge_size=1, temporal_patch_size=1)
    text, vision, family = {
        "qwen2_vl": (dict(text, rope_parameters=rope), dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2,
                     patch_size=2, spatial_merge_size=1, temporal_patch_size=1), "Qwen2VL"),
        "qwen2_5_vl": (dict(text, rope_parameters=rope), dict(vision, window_size=4, fullatt_block_indexes=[0]),
                       "Qwen2_5_VL"),
        "qwen3_vl": (dict(text, head_dim=8, rope_parameters=dict(rope, mrope_interleaved=True)),
                     dict(vision, num_position_embeddings=16, deepstack_visual_indexes=[0]), "Qwen3VL"),
        # head_dim 16, half of it rotary: 4 frequencies, as above
        "glm4v": (dict(text, hidden_size=64, rope_parameters=dict(rope, partial_rotary_factor=0.5)),
                  dict(vision, image_size=8), "Glm4v"),
        # one linear-attention layer (gated delta net), one full-attention layer
        "qwen3_5": (dict(text, head_dim=8, rope_parameters=dict(rope, mrope_interleaved=True), linear_key_head_dim=8,
                         linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
                         layer_types=["linear_attention", "full_attention"]),
                    dict(vision, num_position_embeddings=16), "Qwen3_5"),
    }[name]
    config = getattr(transformers, f"{family}Config")(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForConditionalGeneration")(config).eval()


@pytest.mark.parametrize("name, token_types, forward_rows", [
    # the prefill runs 3 distinct rows; step t's forward the rows whose eos step is >= t: 4, 3, 2, 1, 1 (steps 1-5)
    pytest.param("qwen2_vl", False, [3, 4, 3, 2, 1, 1], id="qwen2_vl"),
    pytest.param("qwen2_5_vl", False, [3, 4, 3, 2, 1, 1], id="qwen2_5_vl"),
    pytest.param("qwen3_vl", False, [3, 4, 3, 2, 1, 1], id="qwen3_vl"),
    pytest.param("glm4v", False, [3, 4, 3, 2, 1, 1], id="glm4v"),
    # mm_token_type_ids [B, L], as a processor returns them with text: not cut, so every row runs
    pytest.param("qwen2_vl", True, [4], id="qwen2_vl_token_types"),
    # a linear-attention layer's cache is not one whose rows are cut: every row runs
    pytest.param("qwen3_5", False, [4], id="qwen3_5"),
])
def test_multimodal_rope_text_rollout_without_finished_rows_samples_what_the_full_batch_samples(
        smollm2_tokenizer, name, token_types, forward_rows):
    """A (randomly initialised, tiny) multimodal-rope model generating text: transformers hands its forward position
    ids of shape [4, B, L] (and a rope_deltas [B, 1] stays on the model, unread while position ids are passed). The
    finished rows leave the forward and the repeated prompt runs its prefill once, or, where an input or the cache
    cannot be cut, every row runs; either way the sequences are the full batch's."""
    tok = smollm2_tokenizer  # pad == eos
    model = _tiny_multimodal_rope_model(name, tok)
    shapes = []
    model.register_forward_pre_hook(lambda m, a, k: shapes.append(tuple(k["position_ids"].shape)), with_kwargs=True)
    batch = tok(["1 + 1 =", "What is two plus three, in words?", "1 + 1 =", "Hi"], padding=True, padding_side="left",
                return_tensors="pt")  # rows 0 and 2: one prompt
    if token_types:
        batch["mm_token_type_ids"] = torch.zeros_like(batch["input_ids"])  # 0: text
    full, _, _ = _generate(model, tok, batch, drop=False, stops=(1, 3, 2, 5), do_sample=True, top_k=0)
    assert shapes[0] == (4, 4, batch["input_ids"].size(1))  # the prefill's: [text + 3 rope axes, B, P]
    cut, _, calls = _generate(model, tok, batch, drop=True, stops=(1, 3, 2, 5), do_sample=True, top_k=0)
    assert torch.equal(cut, full)
    assert [c.forward_rows for c in calls] == [forward_rows] and calls[0].off == (len(forward_rows) == 1)


@pytest.mark.parametrize("extra", ["k_B", "1_B_L", "dict_L_B"])  # [2, B], [1, B, L], {"rows": [L, B]}
def test_a_forward_input_with_the_rows_on_another_axis_keeps_every_row(model_and_batch, extra, monkeypatch):
    """A forward input this class does not cut, holding the B rows on an axis other than 0 (``[k, B]``, ``[1, B, L]``
    as a multimodal layout may lay them out, or inside a dict): no row leaves the forward, and the sequences are the
    full batch's. (The model ignores the input; cutting the three inputs it knows would leave this one's rows
    behind.)"""
    model, tok, batch = model_and_batch
    prepare = model.prepare_inputs_for_generation

    def with_extra(*args, **kwargs):
        inputs = prepare(*args, **kwargs)
        rows, length = inputs["input_ids"].shape  # B, S
        inputs["row_codes"] = {"k_B": lambda: torch.zeros(2, rows), "1_B_L": lambda: torch.zeros(1, rows, length),
                               "dict_L_B": lambda: {"rows": torch.zeros(length, rows)}}[extra]()
        return inputs

    monkeypatch.setattr(model, "prepare_inputs_for_generation", with_extra)
    full, _, _ = _generate(model, tok, batch, drop=False)
    cut, _, calls = _generate(model, tok, batch, drop=True)
    assert torch.equal(cut, full)
    assert len(calls) == 1 and calls[0].off and calls[0].forward_rows == [4]  # the prefill's 4 rows, then off


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
