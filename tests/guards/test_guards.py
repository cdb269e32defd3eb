"""Each guard against the seed bug it exists for: a trainer subclass reintroduces the bug and
the guard must stop it. A guard that cannot fail is no guard, so each bug test has a healthy
control run beside it (tests/trainers/test_grpo_trainer.py)."""

import pytest
import torch
from conftest import arithmetic_prompts, length_reward, logged_max
from trl.models.utils import unwrap_model_for_generation
from trl.trainer.utils import pad

import grpotrl
from grpotrl import InvariantError


def _run(cls, model, args):
    trainer = cls(model=model, reward_funcs=length_reward, args=args, train_dataset=arithmetic_prompts())
    trainer.train()
    return trainer


class RawPromptForLoss(grpotrl.GRPOTrainer):
    """Generation on the templated prompt, loss/KL on the raw prompt text."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        raw = [torch.tensor(self._tokenizer(x["prompt"][-1]["content"])["input_ids"]) for x in inputs]
        out["prompt_ids"] = pad(raw, padding_value=self._tokenizer.pad_token_id, padding_side="left")
        out["prompt_mask"] = pad([torch.ones_like(r) for r in raw], padding_value=0, padding_side="left")
        return out


class RawPromptForGeneration(grpotrl.GRPOTrainer):
    """The same mismatch the other way round: generation from the untemplated text."""

    def _tokenize_prompts(self, prompts):
        return [self._tokenizer(p[-1]["content"])["input_ids"] for p in prompts], None, {}


class DoubledBOS(grpotrl.GRPOTrainer):
    """A template that already writes BOS, tokenized again with add_special_tokens."""

    def _tokenize_prompts(self, prompts):
        ids, images, fields = super()._tokenize_prompts(prompts)
        return [[self._tokenizer.bos_token_id, *p] for p in ids], images, fields


class CountNotWidth(grpotrl.GRPOTrainer):
    """The completion is cut at the count of non-pad prompt tokens."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        tok = self._tokenizer
        ids = pad([torch.tensor(p) for p in prompt_ids], padding_value=tok.pad_token_id, padding_side="left")
        attn = pad([torch.ones(len(p), dtype=torch.long) for p in prompt_ids], padding_value=0, padding_side="left")
        with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as model, torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attn, generation_config=self.generation_config)
        src_lens = (ids != tok.pad_token_id).sum(dim=1)  # the bug: a count used as a position
        completions = []
        for i in range(out.size(0)):
            c = out[i, src_lens[i]:].tolist()
            stops = [t for t, x in enumerate(c) if x in self.eos_token_ids]
            completions.append(c[: stops[0] + 1] if stops else c)
        return completions, None


class PadTokenMask(grpotrl.GRPOTrainer):
    """A wrong 'fix': mask[first_eos:] = 0 and mask *= (token != pad)."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        ids = out["completion_ids"]
        mask = (ids != self._tokenizer.pad_token_id).long()
        for i in range(ids.size(0)):
            eos = (ids[i] == self._tokenizer.eos_token_id).nonzero()
            if len(eos):
                mask[i, int(eos[0]):] = 0
        out["completion_mask"] = mask
        return out


class NoTemperature(grpotrl.GRPOTrainer):
    """Logprobs as log_softmax(logits), the sampling temperature dropped."""

    divide_by_temperature = False

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False, **kwargs):
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).logits
        logits = logits[:, -logits_to_keep - 1 : -1].float()
        if self.divide_by_temperature:
            logits = logits / self.temperature
        logps = torch.log_softmax(logits, -1)
        tokens = input_ids[:, -logits_to_keep:]
        entropy = -(logps.exp() * logps).sum(-1) if compute_entropy else None
        return logps.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropy, None


class WithTemperature(NoTemperature):
    """The same hand-written hook, done right: the guard must let it through."""

    divide_by_temperature = True


def test_I1_guard_stops_loss_on_raw_prompt(tiny_llama, grpo_args):
    with pytest.raises(InvariantError, match=r"(?s)\[I1\].*loss is computed on other prompt ids"):
        _run(RawPromptForLoss, tiny_llama, grpo_args())


def test_I1_guard_stops_generation_from_untemplated_prompt(tiny_llama, grpo_args):
    with pytest.raises(InvariantError, match=r"(?s)\[I1\].*not the chat template"):
        _run(RawPromptForGeneration, tiny_llama, grpo_args())


def test_I1_guard_stops_doubled_bos(tiny_llama, grpo_args):
    with pytest.raises(InvariantError, match=r"(?s)\[I1\].*two BOS tokens"):
        _run(DoubledBOS, tiny_llama, grpo_args())


def test_I3_guard_stops_extraction_at_non_pad_count(tiny_llama, grpo_args):
    with pytest.raises(InvariantError, match=r"(?s)\[I3\].*padded prompt width") as err:
        _run(CountNotWidth, tiny_llama, grpo_args())
    assert "prompt tail" in str(err.value)  # the boundary report is in the message


def test_I4_guard_stops_a_pad_token_mask(tiny_llama, grpo_args):
    with pytest.raises(InvariantError, match=r"(?s)\[I4\].*first stop token stays in the loss"):
        _run(PadTokenMask, tiny_llama, grpo_args(max_steps=3))


def test_I5_guard_stops_dropped_temperature(tiny_llama, grpo_args):
    with pytest.raises(InvariantError, match=r"(?s)\[I5\].*T=0.7"):
        _run(NoTemperature, tiny_llama, grpo_args())


def test_I5_guard_passes_a_correct_custom_hook(tiny_llama, grpo_args):
    trainer = _run(WithTemperature, tiny_llama, grpo_args())
    assert logged_max(trainer) < 1e-4


def test_I5_guard_catches_trl_positions_on_absolute_position_model(tiny_gpt2, grpo_args, monkeypatch):
    """TRL's padded logprob forward uses positions 0..L-1; generate used cumsum(mask) - 1. GPT-2 shows it
    (``padding_free=False``: the packed forward sets its own positions, restarting per sequence)."""
    import grpotrl.trainers._intercept as intercept

    monkeypatch.setattr(intercept, "_positions_from_attention_mask", lambda module, args, kwargs: (args, kwargs))
    with pytest.raises(InvariantError, match=r"(?s)\[I5\]"):
        _run(grpotrl.GRPOTrainer, tiny_gpt2, grpo_args(padding_free=False))


class RecordedNoTemperature(NoTemperature):
    """NoTemperature that keeps what its loss used, to show afterwards that the bug went through."""

    def _compute_loss(self, model, inputs):
        self.loss_inputs = {k: inputs[k].detach().clone() for k in
                            ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        self.loss_logps = self._get_per_token_logps_and_entropies(
            model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
            inputs["completion_ids"].size(1))[0].detach()
        return super()._compute_loss(model, inputs)


def test_guards_off_lets_the_bug_through(tiny_llama, grpo_args):
    """guard_steps=0 really turns the checks off (and so the checks above are what stops the bugs): the
    run completes and its loss used logprobs far from log_softmax(logits / T), which I5 would have caught."""
    trainer = _run(RecordedNoTemperature, tiny_llama, grpo_args(guard_steps=0, max_steps=1, temperature=0.7))
    assert trainer.state.global_step == 1 and "guards/logprob_max_gap" not in trainer.state.log_history[-2]
    x = trainer.loss_inputs
    reference = grpotrl.guards.recompute_logprobs(
        trainer.model, torch.cat([x["prompt_ids"], x["completion_ids"]], 1),
        torch.cat([x["prompt_mask"], x["completion_mask"]], 1), x["completion_ids"].size(1), 0.7)[0]
    gap = ((trainer.loss_logps - reference).abs() * x["completion_mask"]).max().item()
    assert gap > 0.1, f"the temperature bug should move the loss's logprobs by far more than I5's 1e-5: {gap}"


class DroppedStopToken(grpotrl.GRPOTrainer):
    """A sampler wrapper that hands TRL each completion without its stop token (TRL's lengths then
    agree with the ids it got, so a guard that reads those lengths passes)."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        completions, logprobs = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                              has_tool_images)
        stops = set(self.eos_token_ids)
        return [c[:-1] if len(c) > 1 and c[-1] in stops else c for c in completions], logprobs


def _pad_not_a_stop(tiny_llama):
    """SmolLM2's tokenizer with pad = <|endoftext|> (0), not a stop id (eos = <|im_end|> = 2)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama, padding_side="left", truncation_side="left")
    tok.pad_token = "<|endoftext|>"
    return tok


def test_I4_guard_stops_a_completion_whose_stop_token_was_dropped(tiny_llama, grpo_args):
    with pytest.raises(InvariantError, match=r"(?s)\[I4\].*holds no stop token but is \d+ tokens long"):
        _run(DroppedStopToken, tiny_llama, grpo_args())


def test_I4_guard_stops_a_sampler_that_writes_pad_for_its_stop_token(tiny_llama, grpo_args):
    """The sampler itself ends rows with pad instead of the stop token (pad != eos): generate's raw output
    and TRL's completions agree, TRL's lengths agree with the mask, and only the tokens show the stop is gone.
    The old I4 guard read TRL's lengths and let this through."""
    from transformers import AutoModelForCausalLM

    tok = _pad_not_a_stop(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    real = model.generate

    def stop_written_as_pad(*args, **kwargs):
        out = real(*args, **kwargs)
        seq = out.sequences if hasattr(out, "sequences") else out  # [B, P+C]
        tail = seq[:, kwargs["input_ids"].size(1):]  # [B, C], a view
        tail[torch.isin(tail, torch.tensor([tok.eos_token_id]))] = tok.pad_token_id
        return out

    model.generate = stop_written_as_pad
    # every row stops well before the cap (a strong bias on <|im_end|>), so no row is a cut-off one
    args = grpo_args(max_completion_length=64, generation_kwargs={"sequence_bias": [[[2], 10.0]]})
    trainer = grpotrl.GRPOTrainer(model=model, processing_class=tok, reward_funcs=length_reward, args=args,
                                  train_dataset=arithmetic_prompts())
    with pytest.raises(InvariantError, match=r"(?s)\[I4\].*holds no stop token"):
        trainer.train()


def test_I4_healthy_run_with_pad_not_a_stop_id_passes(tiny_llama, grpo_args):
    """The control: the same tokenizer (pad 0 is no stop id, and the bias makes the model write 0 inside
    completions) with an honest sampler passes every guard."""
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, processing_class=_pad_not_a_stop(tiny_llama),
                                  reward_funcs=length_reward, args=grpo_args(max_steps=2),
                                  train_dataset=arithmetic_prompts())
    assert trainer.eos_token_ids == [2]
    trainer.train()
    assert trainer.state.global_step == 2


def test_I4_mask_expectation_comes_from_the_tokens_not_from_reported_lengths(smollm2_tokenizer):
    """Row 1 lost its stop token (pad 0 is no stop id here): its reported length 2 and mask agree, which the
    old guard (expectation from the reported lengths) accepted; from the tokens it must be 4 long."""
    ids = torch.tensor([[7, 2, 0, 0], [7, 8, 0, 0], [7, 8, 9, 6]])  # [B=3, C=4]; stop 2, max_completion_length 4
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    with pytest.raises(InvariantError, match=r"(?s)\[I4\] row 1.*used: \[1, 1, 0, 0\]\n +expected: +\[1, 1, 1, 1\]"):
        grpotrl.guards.check_completion_mask(smollm2_tokenizer, ids, mask, [2], [0, 1, 2], max_length=4)
    grpotrl.guards.check_completion_mask(smollm2_tokenizer, ids[[0, 2]], mask[[0, 2]], [2], [0, 2], max_length=4)
    with pytest.raises(InvariantError, match=r"(?s)\[I4\] row 1: the completion holds no stop token in its 2 col"):
        grpotrl.guards.check_completion_mask(smollm2_tokenizer, ids[:, :2], mask[:, :2], [2], [0, 1, 2], max_length=4)
    with pytest.raises(InvariantError, match=r"\[I4\] row 0: .* goes on for 1 tokens after its first stop"):
        grpotrl.guards.check_stops(smollm2_tokenizer, [[7, 2, 5]], [2], 4)
    grpotrl.guards.check_stops(smollm2_tokenizer, [[7, 2], [7, 8, 9, 6], [7, 8]], [2], None)  # stop strings: short ok


def test_I4_guard_checks_continuous_batching_completions(tiny_llama, grpo_args):
    """transformers' continuous batching returns token lists grpotrl cannot observe in generate; the I4 check
    reads the completions' tokens, so a dropped stop token is caught on that sampler too."""
    with pytest.raises(InvariantError, match=r"(?s)\[I4\].*holds no stop token but is \d+ tokens long"):
        _run(DroppedStopToken, tiny_llama, grpo_args(use_transformers_continuous_batching=True))


def test_I4_healthy_continuous_batching_run_passes(tiny_llama, grpo_args):
    """The control: continuous batching's own completions keep their stop token and pass."""
    trainer = _run(grpotrl.GRPOTrainer, tiny_llama, grpo_args(use_transformers_continuous_batching=True,
                                                              max_steps=1))
    assert trainer.state.global_step == 1
