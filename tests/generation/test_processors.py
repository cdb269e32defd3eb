"""I6: response-only penalties and min-new-tokens suppression, on the real SmolLM2 tokenizer
(<|im_end|> = 2 is eos AND pad), with hand counts; and the sampler's own logprobs from a real
``generate``: from its ``output_scores`` (the reference) and from ``SampledLogprobRecorder``
(what training uses), equal, the recorder's memory flat in the completion length (output_scores' is not)."""

import math

import pytest
import torch
from transformers import (LlamaForCausalLM, LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper)

from grpotrl import InvariantError
from grpotrl.generation.processors import (FrequencyPenaltyProcessor, MinNewTokensProcessor, PresencePenaltyProcessor,
                                RepetitionPenaltyProcessor, build_processors, generated_counts)
from grpotrl.generation.sampled_logprobs import SampledLogprobRecorder, processed_logprob, sampler_logprobs
from grpotrl.trainers._intercept import inject_recorders_after_warpers

EOS = PAD = 2  # SmolLM2: <|im_end|>, eos and pad
ENDOFTEXT = 0  # SmolLM2's <|endoftext|>, a second stop id


def chat(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True)["input_ids"])


def test_I6_a_prompt_full_of_the_is_not_penalised(smollm2_tokenizer):
    tok = smollm2_tokenizer
    (the,) = tok.encode(" the")
    prompt = chat(tok, "the" + " the" * 20)
    V = len(tok)
    assert prompt.count(the) == 20
    assert prompt.count(EOS) == 2  # the template closes the system and the user turn with <|im_end|>
    input_ids = torch.tensor([prompt])  # first generation step: P = whole input, G = 0
    P = input_ids.size(1)
    scores = torch.zeros(1, V)
    scores[0, the], scores[0, EOS] = 3.0, 1.0

    # response-only (I6): nothing generated yet, so nothing moves; p(eos)/p(the) stays e^(1-3)
    for proc in (PresencePenaltyProcessor(0.4, P), FrequencyPenaltyProcessor(0.4, P),
                 RepetitionPenaltyProcessor(1.3, P)):
        assert torch.equal(proc(input_ids, scores), scores)

    # a whole-sequence count (prompt included), inline: " the" x20 and <|im_end|> x2 in the prompt
    whole_counts = torch.zeros(V).scatter_add_(0, input_ids[0], torch.ones(P))
    seed = scores[0] - 0.4 * whole_counts
    assert seed[the].item() == pytest.approx(3.0 - 0.4 * 20)  # -5: " the" pushed 8 logits down
    assert seed[EOS].item() == pytest.approx(1.0 - 0.4 * 2)  # eos only 0.8 down
    boost = math.exp((seed[EOS] - seed[the]).item()) / math.exp(1.0 - 3.0)
    assert boost == pytest.approx(math.exp(8.0 - 0.8), rel=1e-4)  # eos ~1340x likelier relative to " the"
    # the same processor counting from column 0 is that prompt-counting behaviour
    assert torch.allclose(FrequencyPenaltyProcessor(0.4, prompt_width=0)(input_ids, scores)[0], seed)
    # and transformers' repetition penalty as generate builds it (prompt_ignore_length = left padding = 0 here)
    hf = RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=torch.tensor([0]))(input_ids, scores.clone())
    assert hf[0, the].item() == pytest.approx(3.0 / 1.3)

    # one step later, after the model generated " the" once: only that occurrence counts
    step2 = torch.tensor([prompt + [the]])
    assert FrequencyPenaltyProcessor(0.4, P)(step2, scores)[0, the].item() == pytest.approx(3.0 - 0.4)
    assert FrequencyPenaltyProcessor(0.4, P)(step2, scores)[0, EOS].item() == 1.0


def test_I6_left_padded_batch_counts_generated_tokens_only(smollm2_tokenizer):
    tok = smollm2_tokenizer
    (the,), (cat,) = tok.encode(" the"), tok.encode(" cat")
    short, long = chat(tok, "the cat"), chat(tok, "the cat the cat the cat")
    P = len(long)
    prompts = torch.tensor([[PAD] * (P - len(short)) + short, long])  # left padding with pad == eos
    # row 0 generated " the", " the", " cat"; row 1 generated " cat", stopped on eos, then got a forced pad
    generated = torch.tensor([[the, the, cat], [cat, EOS, PAD]])
    input_ids = torch.cat([prompts, generated], dim=1)
    V = len(tok)
    # hand count over the generated columns only; row 0's left padding and both prompts' <|im_end|>
    # (id 2) and " the"/" cat" are not counted. Row 1's forced pad after its stop is counted
    # (a generated column), harmless: the row is finished and its later scores are unused.
    hand = [{the: 2, cat: 1}, {cat: 1, EOS: 2}]
    want = torch.zeros(2, V)
    for row, counts in enumerate(hand):
        for j, n in counts.items():
            want[row, j] = n
    assert torch.equal(generated_counts(input_ids, P, V), want)

    scores = torch.zeros(2, V)
    assert torch.equal(FrequencyPenaltyProcessor(1.0, P)(input_ids, scores), -want)
    assert torch.equal(PresencePenaltyProcessor(1.5, P)(input_ids, scores), -1.5 * (want > 0).float())
    scores[:, the] = 2.0
    scores[:, cat] = -2.0
    rep = RepetitionPenaltyProcessor(2.0, P)(input_ids, scores)
    # row 0: " the" generated, 2.0 / 2 = 1.0; " cat" generated, -2.0 * 2 = -4.0
    # row 1: " the" only in the prompt, unchanged 2.0; " cat" generated, -4.0
    assert rep[:, [the, cat]].tolist() == [[1.0, -4.0], [2.0, -4.0]]
    # a whole-sequence count (from column 0) sees the prompt: row 1 generated no " the" but holds two
    assert long.count(the) == 2 and generated_counts(input_ids, 0, V)[1, the] == 2


def test_I6_min_new_tokens_blocks_every_stop_id_until_k():
    stops = [ENDOFTEXT, EOS, 7]
    V, P, k = 10, 4, 3
    proc = MinNewTokensProcessor(k, stops, prompt_width=P)
    prompt = torch.tensor([[PAD, 5, 6, 8], [5, 6, 8, 9], [5, 5, 5, 5]])  # B=3
    scores = torch.zeros(3, V)
    scores[0, 7] = 4.0  # row 0: stop id 7 is the top score
    scores[1, ENDOFTEXT], scores[1, 5] = 3.0, 3.5  # row 1: a likely stop, but id 5 is the top
    scores[2, 9] = 1.0  # row 2: no stop in sight
    input_ids = prompt
    for g in range(k):  # G = 0, 1, 2: all three stop ids blocked in every row, the rest untouched
        out = proc(input_ids, scores)
        assert out[:, stops].eq(-math.inf).all()
        keep = [j for j in range(V) if j not in stops]
        assert torch.equal(out[:, keep], scores[:, keep])
        input_ids = torch.cat([input_ids, torch.tensor([[5], [5], [5]])], dim=1)
    assert scores[0, 7] == 4.0  # inputs not modified
    # G = k: free; a stop that is the top now is not a trigger (nothing was blocked)
    scores[2, EOS] = 9.0
    for _ in range(2):
        assert torch.equal(proc(input_ids, scores), scores)
        input_ids = torch.cat([input_ids, torch.tensor([[5], [5], [5]])], dim=1)
    # only row 0 had a stop id as its top score at a blocked step
    assert proc.triggered.tolist() == [True, False, False]
    assert proc.trigger_count == 1 and proc.trigger_rate == pytest.approx(1 / 3)
    assert MinNewTokensProcessor(k, stops, P).trigger_rate == 0.0  # never called: nothing blocked


def test_I6_repetition_penalty_matches_transformers_without_prompt_and_ignores_prompt():
    g = torch.Generator().manual_seed(0)
    V = 12
    input_ids = torch.randint(0, V, (3, 9), generator=g)
    scores = torch.randn(3, V, generator=g) * 3  # both signs
    # P = 0 (no prompt): identical to transformers'
    ours = RepetitionPenaltyProcessor(1.3, prompt_width=0)(input_ids, scores)
    assert torch.equal(ours, RepetitionPenaltyLogitsProcessor(1.3)(input_ids, scores.clone()))
    # P = 4: identical to transformers' with prompt_ignore_length=4 ...
    ours = RepetitionPenaltyProcessor(1.3, prompt_width=4)(input_ids, scores)
    assert torch.equal(ours, RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=4)(input_ids, scores.clone()))
    # ... and not to what generate builds from repetition_penalty (skips left padding only, here none)
    built = RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=torch.zeros(3, dtype=torch.long))
    prompt_only = [set(r[:4].tolist()) - set(r[4:].tolist()) for r in input_ids]
    assert any(prompt_only)  # some id occurs in a prompt but was not generated
    differs = ~torch.isclose(ours, built(input_ids, scores.clone()))
    for row, ids in enumerate(prompt_only):  # they differ exactly on those ids
        assert set(differs[row].nonzero().flatten().tolist()) == ids


def test_I6_frequency_penalty_moves_a_logit_once_by_penalty_times_count():
    """fp32: 1000 repeats of one id at penalty 0.3. 0.3 in fp32 is 0.300000011920929; times 1000 that is
    300.0000119, and fp32's spacing at 300 is 2**-15 (3.05e-5), so the product rounds to 300: 10 - 300 = -290
    exactly. 1000 subtractions of 0.3, each rounded, drift to -290.00046. The prompt's three 5s do not count (I6)."""
    P, V = 3, 8
    prompt = torch.full((2, P), 5)
    generated = torch.stack([torch.full((1000,), 5), torch.full((1000,), 6)])  # row 0: 1000 x id 5, row 1: 1000 x id 6
    scores = torch.zeros(2, V)
    scores[:, 5] = 10.0
    out = FrequencyPenaltyProcessor(0.3, P)(torch.cat([prompt, generated], dim=1), scores)
    want = scores.clone()
    want[0, 5] = -290.0  # 10 - 300
    want[1, 6] = -300.0  # 0 - 300; row 1's id 5 (prompt only) stays 10
    assert torch.equal(out, want)


def test_I6_bf16_penalties_round_once():
    """bf16 logits (8 significant bits): the penalty must not be rounded to bf16 before it is applied.
    Frequency: logit 10, penalty 0.3, 200 repeats: 10 - 60 = -50, a bf16 value, so exactly -50. Rounding 0.3 to
    bf16 first (0.30078125) gives 10 - 60.15625 = -50.15625, which rounds to -50.25 (bf16's spacing at 50 is 0.25).
    Presence: logit 77/256 = 0.30078125 (a bf16 value), penalty 0.3: 0.30078125 - 0.3 = 0.00078125 = 1.6 x 2**-11,
    rounded to 8 significant bits 1.6015625 x 2**-11 = 0.000782012939453125; with 0.3 rounded first it is 0."""
    P, V = 1, 4
    ids = torch.cat([torch.tensor([[2]]), torch.full((1, 200), 1)], dim=1)  # generated: 200 x id 1
    scores = torch.zeros(1, V, dtype=torch.bfloat16)
    scores[0, 1] = 10.0
    out = FrequencyPenaltyProcessor(0.3, P)(ids, scores)
    assert out.dtype == torch.bfloat16
    assert out[0].tolist() == [0.0, -50.0, 0.0, 0.0]
    scores[0, 1] = 77 / 256
    out = PresencePenaltyProcessor(0.3, P)(ids, scores)
    assert out.dtype == torch.bfloat16
    assert out[0].tolist() == [0.0, 0.000782012939453125, 0.0, 0.0]


@pytest.mark.parametrize("make, match", [
    (lambda: PresencePenaltyProcessor(2.5, 3), "presence_penalty"),
    (lambda: FrequencyPenaltyProcessor(float("nan"), 3), "frequency_penalty"),
    (lambda: FrequencyPenaltyProcessor("0.1", 3), "frequency_penalty"),
    (lambda: RepetitionPenaltyProcessor(0.0, 3), "repetition_penalty"),
    (lambda: RepetitionPenaltyProcessor(-1.2, 3), "repetition_penalty"),
    (lambda: PresencePenaltyProcessor(0.1, -1), "prompt_width"),
    (lambda: PresencePenaltyProcessor(0.1, 3.0), "prompt_width"),
    (lambda: MinNewTokensProcessor(0, [2], 3), "min_new_tokens"),
    (lambda: MinNewTokensProcessor(True, [2], 3), "min_new_tokens"),
    (lambda: MinNewTokensProcessor(2, [], 3), "stop_ids"),
    (lambda: MinNewTokensProcessor(2, [2, -1], 3), "stop_ids"),
    (lambda: build_processors(3, min_new_tokens=2), "stop_ids"),
])
def test_I6_init_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_I6_stale_prompt_width_and_reuse_are_errors():
    with pytest.raises(ValueError, match="per generate call"):
        PresencePenaltyProcessor(0.1, prompt_width=5)(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 4))
    proc = MinNewTokensProcessor(2, [2], prompt_width=1)
    proc(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="reused"):
        proc(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="vocabulary"):
        MinNewTokensProcessor(2, [9], 0)(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 4))


def test_I5_I6_sampler_logprobs_through_real_generate(tiny_llama, smollm2_tokenizer):
    tok = smollm2_tokenizer
    model = LlamaForCausalLM.from_pretrained(tiny_llama).eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
             for c in ("Hi", "What is 1 + 1 + 1 + 2?")]
    batch = tok(texts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt")
    assert batch["attention_mask"][0, 0] == 0  # really left-padded
    P = batch["input_ids"].size(1)
    k, stops, T, top_k = 3, [ENDOFTEXT, EOS], 0.7, 20
    kw = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, min_new_tokens=k, stop_ids=stops)
    procs = build_processors(P, **kw)
    bias = {(EOS,): 40.0}  # makes <|im_end|> the top score everywhere: it must still wait for k tokens
    torch.manual_seed(0)
    out = model.generate(**batch, do_sample=True, temperature=T, top_k=top_k, max_new_tokens=6, sequence_bias=bias,
                         eos_token_id=stops, pad_token_id=PAD, logits_processor=procs,
                         output_scores=True, output_logits=True, return_dict_in_generate=True)
    completions = out.sequences[:, P:]  # [B, C]
    # min-new-tokens really ran inside generate: k tokens without a stop, then the biased eos
    assert not torch.isin(completions[:, :k], torch.tensor(stops)).any()
    assert completions[:, k].tolist() == [EOS, EOS] and completions.size(1) == k + 1
    assert procs[-1].trigger_count == 2  # both rows' top score was eos while it was blocked

    # what transformers 5.23 stores as `scores`: raw logits -> sequence bias -> OUR processors ->
    # temperature -> top-k, i.e. exactly the tensor it samples from (replayed with fresh processors)
    replay = LogitsProcessorList([SequenceBiasLogitsProcessor(sequence_bias=bias), *build_processors(P, **kw),
                                  TemperatureLogitsWarper(T), TopKLogitsWarper(top_k)])
    for t, (raw, stored) in enumerate(zip(out.logits, out.scores)):
        want = replay(out.sequences[:, : P + t], raw)
        assert torch.allclose(stored, want, atol=1e-6), t
        assert (stored.isfinite().sum(-1) <= top_k).all()  # top-k applied: warpers are in `scores`

    got = sampler_logprobs(out.scores, out.sequences, P)  # [B, C]
    want = torch.stack(out.scores, dim=1).log_softmax(-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
    assert got.shape == completions.shape
    assert torch.allclose(got, want, atol=1e-6)
    assert got.isfinite().all()  # every column up to and including the stop was sampled, so p > 0
    # the processed logprob is not the trainer's log_softmax(raw / T): penalties and top-k move it
    trainer = torch.stack(out.logits, dim=1).div(T).log_softmax(-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
    assert not torch.allclose(got, trainer, atol=1e-3)


def test_sampler_logprobs_needs_matching_widths():
    with pytest.raises(ValueError, match="score steps"):
        sampler_logprobs([torch.zeros(1, 4)], torch.zeros(1, 5, dtype=torch.long), prompt_width=3)


# ------------------------------------------ SampledLogprobRecorder: memory flat in the completion length

def _left_padded(tok, n: int):
    texts = [tok.apply_chat_template([{"role": "user", "content": "What is " + "1 + " * (i % 5) + "2?"}],
                                     add_generation_prompt=True, tokenize=False) for i in range(n)]
    return tok(texts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt")


def test_I5_recorder_by_hand():
    # P=1, V=3, B=2. Step 0 scores: row 0 [0, 0, -inf] (1/2 each on ids 0, 1), row 1 [ln 3, 0, 0] (3/5, 1/5, 1/5)
    s0 = torch.tensor([[0.0, 0.0, -math.inf], [math.log(3.0), 0.0, 0.0]])
    s1 = torch.tensor([[0.0, -math.inf, -math.inf], [0.0, 0.0, 0.0]])  # step 1: row 0 sure of id 0; row 1 uniform
    s2 = torch.zeros(2, 3)  # step 2: a step generate runs and then undoes (DeferredStopCheck)
    rec = SampledLogprobRecorder()
    rec.placed_last = True
    assert rec(torch.tensor([[7], [7]]), s0) is s0  # scores pass unchanged
    rec(torch.tensor([[7, 1], [7, 0]]), s1)  # sampled at step 0: row 0 id 1 (log 1/2), row 1 id 0 (log 3/5)
    rec(torch.tensor([[7, 1, 0], [7, 0, 2]]), s2)  # step 1: row 0 id 0 (log 1), row 1 id 2 (log 1/3)
    got = rec.logprobs(torch.tensor([[7, 1, 0], [7, 0, 2]]))  # generate kept C=2 columns: step 2 undone
    want = torch.tensor([[math.log(1 / 2), 0.0], [math.log(3 / 5), math.log(1 / 3)]])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert rec._pending is not None  # step 2's scores, never gathered: no column for them


def test_I5_recorder_reads_the_last_step_after_generate_and_refuses_misuse():
    rec = SampledLogprobRecorder()
    assert rec.logprobs(torch.zeros(2, 4, dtype=torch.long)).shape == (2, 0)  # never called: nothing sampled
    rec.placed_last = True
    rec(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[0.0, math.log(3.0)]]))  # P=2, one step
    assert rec.logprobs(torch.tensor([[0, 0, 1]])).tolist() == [[pytest.approx(math.log(3 / 4))]]
    assert rec._pending is None  # the last step's [B, V] scores are let go once read
    with pytest.raises(ValueError, match="columns"):
        rec.logprobs(torch.tensor([[0, 0, 1, 1]]))  # 2 completion columns for 1 recorded step
    with pytest.raises(ValueError, match="reused"):
        rec(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2))  # a new call's prompt: width went back
    assert processed_logprob(torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16), torch.tensor([0])).dtype == torch.float32


def test_I5_recorder_outside_after_warpers_is_an_error(tiny_llama, smollm2_tokenizer):
    """Without inject_recorders_after_warpers the recorder runs before temperature/top-k: its numbers would be wrong."""
    model = LlamaForCausalLM.from_pretrained(tiny_llama).eval()
    rec = SampledLogprobRecorder()
    out = model.generate(**_left_padded(smollm2_tokenizer, 2), do_sample=True, temperature=0.7, max_new_tokens=2,
                         pad_token_id=PAD, logits_processor=LogitsProcessorList([rec]))
    with pytest.raises(InvariantError, match=r"\[I5\].*after_warpers"):
        rec.logprobs(out)
    with inject_recorders_after_warpers(model):
        assert "_get_logits_processor" in vars(model)
    assert "_get_logits_processor" not in vars(model)  # restored: the class's method again


SETTINGS = {  # processors (build_processors), sampling knobs (generate's warpers), a bias on <|im_end|>
    # the bias puts p(stop) at ~0.3 a step under each setting, so rows stop at different lengths
    "penalties+min_new, T=0.7, top_k=20": (dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                                                min_new_tokens=3, stop_ids=[ENDOFTEXT, EOS]),
                                           dict(temperature=0.7, top_k=20), 1.5),
    "repetition, T=1.3, top_p=0.8": (dict(repetition_penalty=1.3), dict(temperature=1.3, top_k=None, top_p=0.8), 13.0),
    "frequency, T=0.9, top_k=50, top_p=0.9, min_p": (dict(frequency_penalty=-0.4),
                                                     dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05), 2.7),
    "none (IS correction), T=1": ({}, dict(temperature=1.0, top_k=None), 10.0),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_I5_recorder_equals_output_scores_path(tiny_llama, smollm2_tokenizer, name):
    """Same seed, two generate calls: today's output_scores path and the recorder. Same sampled
    tokens, same sampler logprobs (padding after a row's stop included), to 1e-6."""
    procs_kw, knobs, bias = SETTINGS[name]
    model = LlamaForCausalLM.from_pretrained(tiny_llama).eval()
    batch = _left_padded(smollm2_tokenizer, 6)
    P, C = batch["input_ids"].size(1), 10
    kw = dict(do_sample=True, max_new_tokens=C, eos_token_id=[ENDOFTEXT, EOS], pad_token_id=PAD,
              sequence_bias={(EOS,): bias}, **knobs)
    torch.manual_seed(0)
    ref = model.generate(**batch, **kw, logits_processor=build_processors(P, **procs_kw),
                         output_scores=True, return_dict_in_generate=True)
    rec = SampledLogprobRecorder()
    torch.manual_seed(0)
    with inject_recorders_after_warpers(model):
        seq = model.generate(**batch, **kw, logits_processor=LogitsProcessorList([*build_processors(P, **procs_kw),
                                                                                  rec]))
    assert torch.equal(seq, ref.sequences)  # recording changes nothing in the sampling
    stopped = torch.isin(seq[:, P:], torch.tensor([ENDOFTEXT, EOS]))  # [B, C]
    assert (stopped[:, :-1].any(1)).any(), "want a row padded after its stop"
    got = rec.logprobs(seq)  # [B, C]
    assert rec.placed_last and got.shape == (6, seq.size(1) - P)
    torch.testing.assert_close(got, sampler_logprobs(ref.scores, ref.sequences, P), atol=1e-6, rtol=0,
                               equal_nan=True)
    # and the independent formula: log_softmax of the stored (fully processed) scores at the token
    want = torch.stack(ref.scores, 1).log_softmax(-1).gather(-1, seq[:, P:, None]).squeeze(-1)  # [B, C]
    first_stop = torch.where(stopped.any(1), stopped.int().argmax(1), stopped.size(1))  # [B]
    mask = torch.arange(stopped.size(1)) <= first_stop[:, None]  # [B, C]: the loss's columns (I4)
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=0)
    assert got[mask].isfinite().all()


@pytest.mark.parametrize("returned", [1, 3])
def test_I5_recorder_refuses_beam_sampling_whose_rows_it_cannot_attribute(tiny_llama, smollm2_tokenizer, returned):
    """Beam sampling runs num_beams rows per prompt, reorders them at every step and returns the best: the recorder
    kept one number per running row and step, so with one sequence returned per prompt (GRPO's) reading it was a
    RuntimeError (9 recorded rows for 3), and with num_beams returned the rows matched in number only: every row's
    recorded logprobs were another row's (0.3 nats off the policy's own on this model). Plain sampling keeps
    its rows (test_I5_recorder_equals_output_scores_path)."""
    model = LlamaForCausalLM.from_pretrained(tiny_llama).eval()
    batch = _left_padded(smollm2_tokenizer, 3)
    rec = SampledLogprobRecorder()
    torch.manual_seed(0)
    with torch.no_grad(), inject_recorders_after_warpers(model):
        seq = model.generate(**batch, do_sample=True, num_beams=3, num_return_sequences=returned, max_new_tokens=5,
                             min_new_tokens=5, pad_token_id=PAD, logits_processor=LogitsProcessorList([rec]))
    assert seq.size(0) == 3 * returned
    with pytest.raises(ValueError, match=rf"recorded 9 rows, but generate returned {3 * returned} completions that "
                                         r"are not those rows.*beam search \(num_beams > 1"):
        rec.logprobs(seq)


def test_I5_recorder_under_peft_records_on_the_base_model(tiny_llama, smollm2_tokenizer):
    """PeftModel.generate runs the base model's generate: inject_recorders_after_warpers shadows the base model."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(LlamaForCausalLM.from_pretrained(tiny_llama),
                           LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")).eval()
    batch = _left_padded(smollm2_tokenizer, 2)
    rec = SampledLogprobRecorder()
    with inject_recorders_after_warpers(model):
        seq = model.generate(**batch, do_sample=True, temperature=0.7, max_new_tokens=3, pad_token_id=PAD,
                             logits_processor=LogitsProcessorList([rec]))
    assert rec.logprobs(seq).shape == (2, seq.size(1) - batch["input_ids"].size(1))


def _peak_allocated_bytes(fn) -> int:
    """Peak of the bytes torch allocates while ``fn()`` runs, above what was live before: the running
    sum of the profiler's CPU allocation (+bytes) and free (-bytes) events, in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    assert events, "the profiler recorded no allocations"
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


@pytest.mark.parametrize("C", [128, pytest.param(512, marks=pytest.mark.slow)])
def test_I5_sampler_logprobs_memory_flat_in_completion_length(tiny_llama, smollm2_tokenizer, C):
    """Penalties + min-new-tokens + the recorder cost a few [B, V] tensors over plain
    sampling, whatever C; output_scores kept C of them (64 x 8 x 49k fp32 = 96 MiB at C=64,
    768 MiB at 512; 34 GB at 64 rows x 1024 tokens x 128k vocab)."""
    model = LlamaForCausalLM.from_pretrained(tiny_llama).eval()
    batch = _left_padded(smollm2_tokenizer, 8)
    B, P, V = 8, batch["input_ids"].size(1), model.config.vocab_size
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.3, min_new_tokens=4, stop_ids=[ENDOFTEXT, EOS])
    kw = dict(do_sample=True, temperature=0.7, top_k=50, pad_token_id=PAD, eos_token_id=[ENDOFTEXT, EOS])
    lengths = []

    def run(n, procs=(), **extra):
        torch.manual_seed(0)
        with torch.no_grad(), inject_recorders_after_warpers(model):
            out = model.generate(**batch, max_new_tokens=n, logits_processor=LogitsProcessorList(procs), **kw, **extra)
        seq = getattr(out, "sequences", out)
        if procs and isinstance(procs[-1], SampledLogprobRecorder):
            procs[-1].logprobs(seq)
        lengths.append(seq.size(1) - P)

    off = _peak_allocated_bytes(lambda: run(C))
    on = _peak_allocated_bytes(lambda: run(C, [*build_processors(P, **penalties), SampledLogprobRecorder()]))
    assert lengths == [C, C], "a row ran to max_new_tokens: the generation really was C long"
    one_step = B * V * 4  # one fp32 [B, V]
    assert on - off < 2 * one_step, f"penalties on: +{(on - off) / 2**20:.1f} MiB over off ({off / 2**20:.1f} MiB)"
    # the measure sees the old path's growth: output_scores at 64 tokens keeps 64 x [B, V]
    if C == 128:
        old = _peak_allocated_bytes(lambda: run(64, build_processors(P, **penalties), output_scores=True,
                                                return_dict_in_generate=True))
        assert old - off > 0.9 * 64 * one_step


def test_I6_stop_ids_error_names_a_helper_that_exists(smollm2_tokenizer):
    """The stop_ids refusal tells the user which function gives every stop id; following it must work: the
    dotted path it names imports, and gives SmolLM2's stop ids (<|im_end|> = eos = the template's end-of-turn)."""
    import importlib
    import re

    with pytest.raises(ValueError, match="stop_ids") as refused:
        MinNewTokensProcessor(2, [], prompt_width=3)
    path = re.search(r"(grpotrl(?:\.\w+)+)\(tokenizer, generation_config\)", str(refused.value)).group(1)
    module, name = path.rsplit(".", 1)
    helper = getattr(importlib.import_module(module), name)
    assert helper(smollm2_tokenizer) == [EOS]
