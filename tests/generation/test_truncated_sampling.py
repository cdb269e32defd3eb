"""Truncated sampling and the importance ratio (I5; trl#6789).

With top_p the sampler draws from the renormalised nucleus while the trainer scores the full
softmax: at the same weights the ratio ``pi / q_trunc`` of a kept token is the kept mass ``m``, so the
ratio's mean is the mean kept mass, not 1. grpotrl hands the trainer the sampler's logprob under the
full softmax (``truncated_sampling_correction``, default on): the ratio's mean is 1 to rounding. The
kept mass is derived here independently (the model's logits at T, transformers' top-p rule by hand).
The gate's warning names the cause it measured: truncation with the correction off, temperature when
the trainer scores at another T than the sampler ran at; no warning without truncation.
"""

import logging

import pytest
import torch
from test_generation import Observed, _logged, _train  # the same observed trainer and log reader
from transformers import AutoModelForCausalLM

import grpotrl

TOP_P, T = 0.8, 0.7
GATE = "grpotrl.guards.identity"


def _args(grpo_args, **kw):
    # one step, one microbatch: the loss scores the weights that sampled; no sequence_bias (a processor)
    return grpo_args(max_steps=1, generation_kwargs=None, hf_importance_sampling_correction=True,
                     temperature=T, **kw)


def kept_mass_by_hand(model_dir: str, batch: dict) -> float:
    """Mean over the loss's tokens of the top-p nucleus's mass under softmax(logits / T), with
    transformers' rule (TopPLogitsWarper): sort ascending, drop the tokens whose cumulative probability
    is <= 1 - top_p, keep at least the most likely one."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)  # [B, P+C]
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)  # [B, P+C]
    P, C = batch["prompt_ids"].size(1), batch["completion_ids"].size(1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0)).logits
    probs = torch.softmax(logits[:, P - 1:P + C - 1].float() / T, dim=-1)  # [B, C, V] the ones that scored each token
    ascending, _ = probs.sort(dim=-1)
    dropped = ascending.cumsum(-1) <= 1 - TOP_P  # [B, C, V]
    dropped[..., -1] = False
    mass = torch.where(dropped, 0.0, ascending).sum(-1)  # [B, C]
    mask = batch["completion_mask"].bool()
    return float(mass[mask].mean())


def test_I5_top_p_ratio_mean_is_one_with_the_correction_and_was_the_kept_mass(tiny_llama, grpo_args, caplog):
    caplog.set_level(logging.WARNING, logger=GATE)
    before = _train(tiny_llama, _args(grpo_args, top_p=TOP_P, truncated_sampling_correction=False))
    m = kept_mass_by_hand(tiny_llama, before.seen[0])
    ratio = _logged(before, "sampling/raw_ratio/token/mean")[0]
    warned = [r.getMessage() for r in caplog.records if "sampler/trainer mismatch" in r.getMessage()]
    print(f"correction off: ratio mean {ratio:.4f}, kept mass by hand {m:.4f}, warning: {warned[0][:400]!r}")
    assert m < 0.95 and ratio == pytest.approx(m, abs=2e-3)  # the ratio's mean IS the kept mass
    assert "Measured causes: truncation: TopPLogitsWarper kept on average" in warned[0]
    assert "temperature" not in warned[0].split("Measured causes:")[1]

    caplog.clear()
    after = _train(tiny_llama, _args(grpo_args, top_p=TOP_P))
    ratio = _logged(after, "sampling/raw_ratio/token/mean")[0]
    is_ratio = _logged(after, "sampling/importance_sampling_ratio/mean")[0]
    kept = _logged(after, "sampling/causes/kept_mass")[0]
    print(f"correction on: ratio mean {ratio:.6f}, TRL IS ratio mean {is_ratio:.6f}, logged kept mass {kept:.4f}")
    assert ratio == pytest.approx(1.0, abs=1e-4) and is_ratio == pytest.approx(1.0, abs=1e-4)
    assert kept == pytest.approx(kept_mass_by_hand(tiny_llama, after.seen[0]), abs=2e-3)
    assert max(_logged(after, "sampling/sampler_trainer_logp_gap/max")) < 1e-4
    assert not [r for r in caplog.records if "sampler/trainer mismatch" in r.getMessage()]


def test_I5_no_truncation_no_warning(tiny_llama, grpo_args, caplog):
    caplog.set_level(logging.WARNING, logger=GATE)
    trainer = _train(tiny_llama, _args(grpo_args, sampler_gap_threshold=1e-3, truncated_sampling_correction=False))
    assert _logged(trainer, "sampling/causes/kept_mass")[0] == pytest.approx(1.0, abs=1e-6)
    assert not [r for r in caplog.records if "sampler/trainer mismatch" in r.getMessage()]


class SamplesAtOtherTemperature(Observed):
    """The fault: the loss scores at T=0.7 what generate sampled at T=1.3."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.generation_config.temperature = 1.3
        if "temperature" in self.generation_kwargs:
            self.generation_kwargs["temperature"] = 1.3


def test_I5_temperature_mismatch_is_named(tiny_llama, grpo_args, caplog):
    caplog.set_level(logging.WARNING, logger=GATE)
    _train(tiny_llama, _args(grpo_args, sampler_gap_threshold=1e-3), cls=SamplesAtOtherTemperature)
    warned = [r.getMessage() for r in caplog.records if "sampler/trainer mismatch" in r.getMessage()]
    print(warned[0][:400])
    assert "Measured causes: temperature: the sampler ran at T=1.3 (its TemperatureLogitsWarper), the trainer " \
           "scores at T=0.7" in warned[0]
    assert "truncation" not in warned[0].split("Measured causes:")[1]
