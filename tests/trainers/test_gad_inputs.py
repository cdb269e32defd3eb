"""GADTrainer's discriminator D against what the user set for the student, and D's scores as rewards:
D loads at the student's revision, a non-finite D score takes grpotrl's non-finite reward handling,
and teacher responses the student cannot reach within max_completion_length are named before training."""

import logging

import pytest
import torch
import transformers
from datasets import Dataset
from hub_cache import add_to_cache
from test_gad import toy_rows

import grpotrl
from grpotrl.errors import InputError
from grpotrl.preflight import check_gad
from conftest import HUB_CACHE


@pytest.fixture
def gad_args(grpo_args):
    def make(**overrides):
        base = {k: v for k, v in vars(grpo_args()).items() if k in {
            "output_dir", "per_device_train_batch_size", "num_generations", "max_completion_length", "logging_steps",
            "report_to", "use_cpu", "temperature", "save_strategy", "seed", "generation_kwargs"}}
        base.update(beta=0.0, disable_tqdm=True, max_steps=1, guard_steps=0)
        base.update(overrides)
        return grpotrl.GADConfig(**base)

    return make


# ---------------------------------------------------------------- D at the student's revision

def _backbone_weight(model) -> torch.Tensor:
    return dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]


def test_discriminator_loads_at_the_students_revision(tiny_llama, gad_args, tmp_path):
    """model_init_kwargs={'revision': 'v2'}: the student is v2, and D, from the student's checkpoint, was
    loaded at main (other weights)."""
    v2 = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        _backbone_weight(v2).add_(0.5)
    v2.save_pretrained(tmp_path / "v2")
    transformers.AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(tmp_path / "v2")
    add_to_cache(HUB_CACHE, "grpotrl-test/gad-two-revisions", tiny_llama)
    add_to_cache(HUB_CACHE, "grpotrl-test/gad-two-revisions", str(tmp_path / "v2"), revision="v2")
    trainer = grpotrl.GADTrainer(model="grpotrl-test/gad-two-revisions",
                                 args=gad_args(model_init_kwargs={"revision": "v2"}),
                                 train_dataset=Dataset.from_list(toy_rows(8)))
    d = trainer.accelerator.unwrap_model(trainer.discriminator).hf_model
    torch.testing.assert_close(_backbone_weight(trainer.model), _backbone_weight(v2), atol=0, rtol=0)
    torch.testing.assert_close(_backbone_weight(d), _backbone_weight(v2), atol=0, rtol=0)


def test_discriminator_source_is_checked_at_the_students_revision(tiny_llama, gad_args):
    """The preflight checked D's source (the student's checkpoint) at main, complete here, while D loads v2,
    cached without its weights."""
    add_to_cache(HUB_CACHE, "grpotrl-test/gad-v2-incomplete", tiny_llama)
    add_to_cache(HUB_CACHE, "grpotrl-test/gad-v2-incomplete", tiny_llama, revision="v2", skip=("model.safetensors",))
    with pytest.raises(InputError, match=r"Discriminator model \(the student's own checkpoint\) "
                                         r"'grpotrl-test/gad-v2-incomplete' \(revision 'v2'\).*not completely"):
        check_gad("grpotrl-test/gad-v2-incomplete", gad_args(model_init_kwargs={"revision": "v2"}),
                  Dataset.from_list(toy_rows(8)), None, {})


# ---------------------------------------------------------------- a non-finite D score

@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nonfinite_discriminator_score_is_counted_and_missing(bad, tiny_llama, gad_args):
    """D scoring one response inf (or NaN: D has no 'no score') skipped grpotrl's non-finite reward
    handling: nothing counted, no nonfinite_reward rule, inf in TRL's advantages. It is now counted
    (rewards/discriminator/nonfinite_share, 1 of 8 rows) and left out as missing, as any reward's."""
    args = gad_args(health_rule_actions={"nonfinite_reward": "warn"})
    trainer = grpotrl.GADTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(toy_rows(8)))
    d = trainer.accelerator.unwrap_model(trainer.discriminator)
    forward, calls = d.forward, []

    def one_bad_row(**batch):
        scores = forward(**batch)  # [rows + teachers]; the first chunk's first row is a student response
        calls.append(1)
        return torch.cat([scores[:1] * 0 + bad, scores[1:]]) if len(calls) == 1 else scores

    d.forward = one_bad_row
    trainer.train()
    step = trainer.state.log_history[0]
    assert step["rewards/discriminator/nonfinite_share"] == pytest.approx(1 / 8)
    assert torch.isfinite(torch.tensor(step["reward"]))  # the row was left out, not averaged in


# ---------------------------------------------------------------- teacher responses over the cap

def test_teacher_responses_over_max_completion_length_are_named_before_training(tiny_llama, gad_args, caplog,
                                                                                 smollm2_tokenizer):
    """'27. Hope this helps!' is 7 tokens, 8 with the end-of-turn token the student must generate to finish.
    At max_completion_length=7 the student is cut before it and never ends such a response; the teacher's
    always ends, so D can tell them apart by length alone."""
    rows = [{**r, "teacher_response": "27" if i == 3 else "27. Hope this helps!"} for i, r in enumerate(toy_rows(8))]
    assert len(smollm2_tokenizer("27. Hope this helps!", add_special_tokens=False)["input_ids"]) == 7
    with caplog.at_level(logging.WARNING, logger="grpotrl.trainers.gad"):
        grpotrl.GADTrainer(model=tiny_llama, args=gad_args(max_completion_length=7),
                           train_dataset=Dataset.from_list(rows))
    warned = [r.getMessage() for r in caplog.records if "max_completion_length" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert "7 of 8 teacher responses in the 'train' split (88%)" in warned[0]
    assert "max_completion_length=7" in warned[0] and "longest" in warned[0] and "filter" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpotrl.trainers.gad"):
        grpotrl.GADTrainer(model=tiny_llama, args=gad_args(max_completion_length=8),
                           train_dataset=Dataset.from_list(rows))
    assert not [r for r in caplog.records if "max_completion_length" in r.getMessage()], caplog.text


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_nonfinite_discriminator_loss_skips_its_step_and_keeps_its_weights(bad, tiny_llama, gad_args):
    """A NaN or inf in D's forward makes its Bradley-Terry loss and gradients non-finite; stepping on them
    wrote NaN into D's weights (and into the checkpoint a stop saves). The step is skipped, logged as
    gad/d_step_skipped 1, and the next step trains D again."""
    args = gad_args(max_steps=2, health_rule_actions={"nonfinite_reward": "warn"})
    trainer = grpotrl.GADTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(toy_rows(8)))
    d = trainer.accelerator.unwrap_model(trainer.discriminator)
    before = {k: v.detach().clone() for k, v in d.state_dict().items()}
    forward, calls = d.forward, []

    def first_step_bad(**batch):
        scores = forward(**batch)  # [rows + teachers]: the first row is a student response's
        calls.append(1)
        return torch.cat([scores[:1] * 0 + bad, scores[1:]]) if len(calls) == 1 else scores

    d.forward = first_step_bad
    trainer.train()
    skipped = [h["gad/d_step_skipped"] for h in trainer.state.log_history if "gad/d_step_skipped" in h]
    assert skipped == [1.0, 0.0], skipped
    after = d.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before), "the second step trained D"
