"""GADTrainer: what a review of the trainer found and pinned (on the real SmolLM2 tokenizer, pad == eos)."""

import pytest
import torch
from datasets import Dataset

import grpotrl
from grpotrl import guards
from grpotrl.ops.masking import pad_sequences
from test_gad import gad_args, toy_rows  # noqa: F401  (gad_args is a fixture)


def test_loss_guards_run_on_the_students_first_steps_after_discriminator_warmup(tiny_llama, gad_args, monkeypatch):
    """The loss-side guards (I1/I3/I4 on the loss's microbatch, I5, I7, I11) and I10 run in ``_compute_loss``,
    which discriminator warmup never calls. With guard_steps=2 (the default) and 2 warmup steps, the student's
    loss is first computed at global step 2, where ``guards.due(2, 2)`` is False: no loss guard would ever run.
    They must run on the student's first guard_steps steps (global steps 2 and 3 here), I10 on its first (2)."""
    seen, identity = [], []
    real = guards.check_loss_inputs
    monkeypatch.setattr(guards, "check_loss_inputs", lambda *a, **k: (seen.append(trainer.state.global_step),
                                                                       real(*a, **k))[1])
    real_identity = grpotrl.GADTrainer._check_step0_identity

    def spy_identity(self, *a, **k):
        identity.append(self.state.global_step)
        return real_identity(self, *a, **k)

    monkeypatch.setattr(grpotrl.GADTrainer, "_check_step0_identity", spy_identity)
    args = gad_args(max_steps=5, discriminator_warmup_steps=2, guard_steps=2, beta=0.1)
    trainer = grpotrl.GADTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(toy_rows(32)))
    trainer.train()
    assert sorted(set(seen)) == [2, 3], seen  # the student's steps 0 and 1; none at step 4
    assert identity == [2], identity


def _bf16_engine(smollm2_path, tok):
    """D on SmolLM2 (fresh score head, fp32 weights) in the torch engine, its forwards under bf16 autocast on CPU
    as accelerate's mixed precision runs them with use_cpu=True, bf16=True (an accelerator of its own would
    change accelerate's process-wide state for the other tests)."""
    from types import SimpleNamespace

    from grpotrl.gad import discriminator as gd
    from grpotrl.trainers.gad_engine import TorchDiscriminator

    torch.manual_seed(0)
    disc = gd.load_discriminator(smollm2_path, tok.pad_token_id, dtype=torch.float32)
    accelerator = SimpleNamespace(prepare_model=lambda m: m, device=torch.device("cpu"),
                                  autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    trainer = SimpleNamespace(accelerator=accelerator, args=SimpleNamespace(
        bf16=True, fp16=False, optim="adamw_torch", max_grad_norm=1.0, per_device_train_batch_size=8))
    return TorchDiscriminator(trainer, disc, 1e-5)


def test_I9_guard_takes_bf16_rounding_of_the_score_heads_terms(smollm2_path, smollm2_tokenizer):
    """In bf16 the score is the rounding of ``sum_i w_i h_i``, whose terms (SmolLM2, fresh head: 9-14 in
    ``sum_i |w_i h_i|``) are far larger than the score (-0.4 .. 1.1). Packed batches of 8 responses + 2
    teachers moved scores by up to 0.033 against the same sequence alone, past 4 eps x max(1, |score|) = 4 x
    2^-7 = 0.031: I9 stopped a correct discriminator. Now the bound is at least eps x scale (~0.07-0.11 here),
    and every sequence of these batches passes alone."""
    import random

    from grpotrl.errors import InvariantError
    from grpotrl.gad import discriminator as gd

    tok = smollm2_tokenizer
    engine = _bf16_engine(smollm2_path, tok)
    engine.model.eval()
    reward = gd.DiscriminatorReward(engine.model, tok, [tok.eos_token_id])
    rows, rng = toy_rows(16), random.Random(0)
    words = "the answer is 27 hope this helps ! I think it 31 maybe sum of and".split()
    failures = []
    for b in range(5):
        group = rows[3 * b:3 * b + 2]
        prompts = [r["prompt"] for r in group for _ in range(4)]
        texts = [" ".join(rng.choices(words, k=rng.randint(1, 25))) for _ in prompts]
        parts = reward.parts(prompts, texts, [rng.random() < 0.5 for _ in prompts])
        parts += reward.parts([r["prompt"] for r in group], [r["teacher_response"] for r in group])
        with torch.no_grad(), engine.accelerator.autocast():
            batched = engine.model(**reward.batch(parts))  # [10], packed: each prompt once
        for k, (p, r) in enumerate(parts):
            try:
                engine.check_score_alone([p + r], batched[k:k + 1], tok)
            except InvariantError as e:
                failures.append(str(e)[:160])
    assert not failures, failures


def test_I9_guard_in_bf16_still_stops_a_score_read_one_token_early(smollm2_path, smollm2_tokenizer):
    """The wider bf16 bound still catches the trap I9 exists for: HF's pooling with pad == eos reads a finished
    response at its last content token, not at its end-of-turn. Read so, these scores move by 0.14-0.46;
    the bound (eps x scale, scale ~14.2) is 0.11."""
    from grpotrl.errors import InvariantError
    from grpotrl.gad import discriminator as gd

    tok = smollm2_tokenizer
    engine = _bf16_engine(smollm2_path, tok)
    engine.model.eval()
    reward = gd.DiscriminatorReward(engine.model, tok, [tok.eos_token_id])
    caught = 0
    for row in toy_rows(6):
        seq = reward.sequences([row["prompt"]], [row["teacher_response"]])[0]
        with torch.no_grad(), engine.accelerator.autocast():
            early = engine.model(*pad_sequences([seq[:-1]], tok.pad_token_id))  # read one token early
        try:
            engine.check_score_alone([seq], early, tok)
        except InvariantError:
            caught += 1
    assert caught == 6
