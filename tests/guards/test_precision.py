"""The numeric guards in bf16 (grpotrl/guards/precision.py, I5, I7, I10): no false alarm on correct code,
and every planted fault caught (tests/planted.py).

By hand first: the temperature direction and its fit (ops.logprobs), the gap statistics, and the I5 / I7
checks on tensors built to be rounding noise or a fault. Then SmolLM2-135M-Instruct in bf16 on CPU
(``use_cpu=True, bf16=True``, guards on every step): the default config, padding-free forced on and off,
bf16 weights; and the loss scoring at 1.1x and 1.05x the sampling temperature, completion position ids
shifted by one, packed rows that see each other, and a loss prompt other than generation's."""

import math

import pytest
import torch
from conftest import length_reward
from planted import LossAtScaledTemperature, PackedRowsSeeEachOther, ShiftedCompletionPositions

import grpotrl
from grpotrl import InvariantError, guards
from grpotrl.guards import precision
from grpotrl.ops.logprobs import fit_along, temperature_slope, token_logprobs

BF16, FP32 = precision.tolerances(torch.bfloat16), precision.tolerances(torch.float32)


# ---------------------------------------------------------------- by hand


def test_temperature_slope_is_the_derivative_of_the_logprob_in_the_inverse_temperature():
    # z = [2, 0], T = 1, token 0: d/ds log_softmax(s z)[0] = 2 - E_p[z] = 2 - 2 sigmoid(2) = 0.238406
    z = torch.tensor([[[2.0, 0.0]]])
    assert temperature_slope(z, torch.tensor([[0]]), 1.0).item() == pytest.approx(2 - 2 / (1 + math.exp(-2)), abs=1e-6)
    # against a finite difference on real-sized logits, at T = 0.7
    torch.manual_seed(0)
    logits, tokens, T, h = 4 * torch.randn(3, 5, 50), torch.randint(0, 50, (3, 5)), 0.7, 1e-3
    s = 1 / T
    numeric = (token_logprobs(logits, tokens, 1 / (s + h)) - token_logprobs(logits, tokens, 1 / (s - h))) / (2 * h)
    torch.testing.assert_close(temperature_slope(logits, tokens, T), numeric, atol=2e-3, rtol=1e-3)


def test_the_fit_reads_the_temperature_the_logprobs_were_scored_at():
    torch.manual_seed(0)
    logits, tokens, T = 8 * torch.randn(4, 30, 200), torch.randint(0, 200, (4, 30)), 0.9
    mask = torch.ones(4, 30)
    reference, slope = token_logprobs(logits, tokens, T), temperature_slope(logits, tokens, T)
    for factor in (1.0, 1.02, 1.05, 1.1):
        coef, se, _ = fit_along(token_logprobs(logits, tokens, factor * T) - reference, slope, mask)
        fitted = 1 / (1 / T + float(coef))
        assert fitted / T == pytest.approx(factor, abs=2e-3)  # first order in the temperature error


def test_gap_statistics_median_and_worst_row_by_hand():
    gap = torch.tensor([[0.0, 0.0, 0.3, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0], [5.0, 0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    s = precision.gap_statistics(gap, mask, row_min_tokens=4)
    # 11 tokens on, sorted [0, 0, 0, 0, 0, .3, 1, 1, 1, 1, 5]: the 6th is 0.3; rows: 0.06, 1.0, (2 tokens: none)
    assert (s.row, s.tokens) == (1, 11) and s.median == pytest.approx(0.3)
    assert s.row_mean == pytest.approx(1.0) and s.max == pytest.approx(5.0) and s.mean == pytest.approx(9.3 / 11)


def test_compute_dtype_follows_autocast_then_the_weights():
    linear = torch.nn.Linear(2, 2)
    assert precision.compute_dtype(linear) == torch.float32
    assert precision.compute_dtype(linear, bf16=True) == torch.bfloat16
    assert precision.compute_dtype(linear, fp16=True) == torch.float16
    assert precision.compute_dtype(linear.to(torch.bfloat16)) == torch.bfloat16
    assert precision.tolerances(torch.float16).low_precision and not FP32.low_precision


def _logits_and_reference(T=0.9, B=8, C=40, V=300):
    torch.manual_seed(1)
    logits = 10 * torch.randn(B, C, V)
    tokens = torch.distributions.Categorical(logits=logits / T).sample()  # [B, C] tokens the sampler would draw
    return logits, tokens, token_logprobs(logits, tokens, T), temperature_slope(logits, tokens, T)


def _check(used, reference, slope, tokens, smollm2_tokenizer, tol=BF16, T=0.9, packed=False):
    mask = torch.ones_like(used)
    scale = torch.full_like(used, 10.0)
    return guards.check_logprobs_in_precision(smollm2_tokenizer, used, reference, slope, scale, mask, tokens, T, tol,
                                              list(range(used.size(0))), packed=packed)


def test_I5_in_bf16_passes_sparse_rounding_steps_that_fp32_refuses(smollm2_tokenizer):
    logits, tokens, reference, slope = _logits_and_reference()
    noise = torch.zeros_like(reference)
    noise.view(-1)[::37] = 0.25 * torch.tensor([1.0, -1.0]).repeat(20)[: noise.view(-1)[::37].numel()]  # ~3%, 0.25 nats
    noise[3, 7] = 1.0  # one token a whole nat off
    metrics = _check(reference + noise, reference, slope, tokens, smollm2_tokenizer)
    assert metrics["guards/logprob_temperature_ratio"] == pytest.approx(1.0, abs=0.01)
    assert metrics["guards/logprob_median_gap"] < 0.005 and metrics["guards/logprob_row_gap"] < 0.1
    with pytest.raises(InvariantError, match=r"\[I5\].*relative to the logit scale"):
        _check(reference + noise, reference, slope, tokens, smollm2_tokenizer, tol=FP32)


@pytest.mark.parametrize("factor", [1.1, 1.05, 1 / 1.05, 1.03])
def test_I5_in_bf16_reads_a_wrong_temperature_through_the_noise(factor, smollm2_tokenizer):
    logits, tokens, reference, slope = _logits_and_reference()
    torch.manual_seed(2)
    noise = torch.where(torch.rand_like(reference) < 0.05, 0.2 * torch.randn_like(reference), 0.0)
    used = token_logprobs(logits, tokens, factor * 0.9) + noise
    with pytest.raises(InvariantError, match=r"\[I5\].*follow temperature .*not the sampling temperature T=0.9") as err:
        _check(used, reference, slope, tokens, smollm2_tokenizer)
    assert _fitted(err) / 0.9 == pytest.approx(factor, abs=0.005)  # the fit is first order: within 0.5%



def test_I5_in_bf16_a_few_loss_tokens_are_no_evidence_of_a_temperature(smollm2_tokenizer):
    """One loss token (a 1-token completion, one row), its likely token's slope d logprob / d (1 / T) ~1e-3: a
    0.01-nat rounding gap fits "temperature 0.075" with no residual to say how uncertain that is. The fit's
    noise is at least the per-token rounding (``median_gap``), so it passes; 1.1x T on 320 tokens still stops."""
    torch.manual_seed(0)
    logits = 10 * torch.randn(1, 1, 300)  # [B=1, C=1, V]
    tokens = logits.argmax(-1)  # [1, 1]
    reference, slope = token_logprobs(logits, tokens, 0.9), temperature_slope(logits, tokens, 0.9)
    assert slope.abs().item() < 1e-2
    metrics = _check(reference + 0.01, reference, slope, tokens, smollm2_tokenizer)
    assert metrics["guards/logprob_median_gap"] == pytest.approx(0.0, abs=1e-6)  # the fit took the gap
    logits, tokens, reference, slope = _logits_and_reference()
    with pytest.raises(InvariantError, match=r"\[I5\].*follow temperature"):
        _check(token_logprobs(logits, tokens, 1.1 * 0.9), reference, slope, tokens, smollm2_tokenizer)


def _fitted(err) -> float:
    return float(str(err.value).split("follow temperature ")[1].split(",")[0])


def test_I5_in_bf16_stops_gaps_on_most_tokens_and_on_whole_rows(smollm2_tokenizer):
    logits, tokens, reference, slope = _logits_and_reference()
    torch.manual_seed(3)
    bulk = reference + 0.05 * torch.randn_like(reference)  # every token moved: the median
    with pytest.raises(InvariantError, match=r"\[I5\].*median gap is 0\.0[3-4].*rounding: <= 0\.02"):
        _check(bulk, reference, slope, tokens, smollm2_tokenizer)
    row = reference.clone()
    row[5] += torch.randn(row.size(1))  # one row another sequence's: its mean
    with pytest.raises(InvariantError, match=r"(?s)\[I5\].*row 5's mean gap.*padding_free is on"):
        _check(row, reference, slope, tokens, smollm2_tokenizer, packed=True)
    nan = reference.clone()
    nan[2, 4] = math.nan
    with pytest.raises(InvariantError, match=r"\[I5\] row 2, completion token 4 .*the loss's logprob is nan"):
        _check(nan, reference, slope, tokens, smollm2_tokenizer)


def test_I7_entropy_values_in_bf16_pass_rounding_and_stop_a_rescaled_or_negated_entropy():
    torch.manual_seed(4)
    H = 3 * torch.rand(6, 30)  # [B, C]
    mask = torch.ones(6, 30)
    noisy = H + torch.where(torch.rand_like(H) < 0.05, 0.3 * torch.randn_like(H), 0.0)
    guards.check_entropy_values(noisy, H, mask, BF16)
    with pytest.raises(InvariantError, match=r"\[I7\].*gap"):
        guards.check_entropy_values(noisy, H, mask, FP32)
    for wrong in (2 * H, -H, 1.05 * H):
        with pytest.raises(InvariantError, match=r"\[I7\].*x the recomputed one"):
            guards.check_entropy_values(wrong, H, mask, BF16)


# ---------------------------------------------------------------- SmolLM2 in bf16 on CPU


def _bf16_args(tmp_path, **overrides):
    kw = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=16, num_generations=4,
              max_completion_length=48, max_steps=1, logging_steps=1, report_to="none", use_cpu=True, bf16=True,
              guard_steps=-1, temperature=0.9, save_strategy="no", learning_rate=0.0, beta=0.0, seed=0,
              disable_tqdm=True)
    kw.update(overrides)
    return grpotrl.GRPOConfig(**kw)


def _open_questions():
    from datasets import Dataset

    questions = ["Why is the sky blue?", "How do vaccines work?", "Explain how a bicycle stays upright.",
                 "In one short sentence: what is a rainbow?", "Give a one-line definition of gravity.",
                 "Describe your ideal weekend.", "In a few words, why do cats purr?", "What makes a good teacher?"]
    return Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in questions])


def _train(cls, smollm2_path, args, **attrs):
    trainer = cls(model=smollm2_path, reward_funcs=length_reward, args=args, train_dataset=_open_questions())
    for k, v in attrs.items():
        setattr(trainer, k, v)
    trainer.train()
    return trainer


def _guard_metrics(trainer):
    return [e for e in trainer.state.log_history if "guards/logprob_median_gap" in e]


@pytest.mark.parametrize("settings", [dict(),  # bf16 autocast over the checkpoint's fp32 weights
                                      dict(padding_free=True, bf16=False, model_init_kwargs={"dtype": "bfloat16"}),
                                      dict(padding_free=False, beta=0.04, model_init_kwargs={"dtype": "bfloat16"},
                                           per_device_train_batch_size=8)],  # 2 prompts a step, still left-padded
                         ids=["default-config", "padding_free-bf16-weights-no-autocast", "padded-bf16-weights-kl"])
def test_bf16_trains_with_every_guard_on(settings, smollm2_path, tmp_path):
    trainer = _train(grpotrl.GRPOTrainer, smollm2_path, _bf16_args(tmp_path, max_steps=2, **settings))
    assert trainer.guard_tolerances.low_precision and trainer.state.global_step == 2
    logged = _guard_metrics(trainer)
    assert len(logged) == 2  # I5 ran on both steps, in its bf16 form
    for e in logged:
        assert abs(e["guards/logprob_temperature_ratio"] - 1) < 0.01 and e["guards/logprob_median_gap"] < 0.02
    if settings.get("beta"):  # I10 held in bf16 too
        assert any("identity/step0_ref_logp_gap/mean" in e for e in trainer.state.log_history)


@pytest.mark.parametrize("factor,padding_free", [(1.1, "auto"), (1.05, False)], ids=["1.1x-packed", "1.05x-padded"])
def test_bf16_I5_stops_a_loss_at_another_temperature(factor, padding_free, smollm2_path, tmp_path):
    args = _bf16_args(tmp_path, padding_free=padding_free)
    with pytest.raises(InvariantError, match=r"\[I5\].*follow temperature 0\.9") as err:
        _train(LossAtScaledTemperature, smollm2_path, args, factor=factor)
    assert _fitted(err) / 0.9 == pytest.approx(factor, abs=0.01)


@pytest.mark.parametrize("cls", [ShiftedCompletionPositions, PackedRowsSeeEachOther],
                         ids=["completion-positions-shifted", "packed-rows-see-each-other"])
def test_bf16_I5_stops_a_loss_forward_with_other_positions_or_attention(cls, smollm2_path, tmp_path):
    with pytest.raises(InvariantError, match=r"(?s)\[I5\].*by more than bf16 rounding.*padding_free is on"):
        _train(cls, smollm2_path, _bf16_args(tmp_path, padding_free=True))


@pytest.mark.slow  # 36 s; padding_free bf16 training with every guard on is test_bf16_trains_with_every_guard_on's
def test_bf16_planted_loss_hooks_are_harmless_when_off(smollm2_path, tmp_path):
    """The controls of the two hooks above: the same subclasses with the edit off train."""
    for cls in (ShiftedCompletionPositions, PackedRowsSeeEachOther):
        trainer = _train(cls, smollm2_path, _bf16_args(tmp_path, padding_free=True), active=False)
        assert trainer.state.global_step == 1


def test_bf16_I1_stops_a_loss_on_another_prompt(smollm2_path, tmp_path):
    from test_guards import RawPromptForLoss

    with pytest.raises(InvariantError, match=r"(?s)\[I1\].*loss is computed on other prompt ids"):
        _train(RawPromptForLoss, smollm2_path, _bf16_args(tmp_path))
