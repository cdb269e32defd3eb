"""GADTrainer: what a review of the trainer found and pinned (on the real SmolLM2 tokenizer, pad == eos)."""

import functools
import json

import pytest
import torch
from datasets import Dataset

import grpotrl
from grpotrl import guards
from planted import PlantedBest
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
    accelerator = SimpleNamespace(prepare_model=lambda m: m, device=torch.device("cpu"), gather=lambda t: t,
                                  autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    trainer = SimpleNamespace(accelerator=accelerator, args=SimpleNamespace(
        bf16=True, fp16=False, optim="adamw_torch", max_grad_norm=1.0, per_device_train_batch_size=8))
    return TorchDiscriminator(trainer, disc, 1e-5)


WORDS = "the answer is 27 hope this helps ! I think it 31 maybe sum of and".split()


def _generation_batches(tok, n: int):
    """``n`` generation batches as GAD's D step takes them (``score_and_step``'s ``inputs``, ``prompts``,
    ``completion_ids``): 2 prompts x 4 student responses of 1-25 random words, half of them cut before their
    end-of-turn (no stop id), with each prompt's teacher response."""
    import random

    rows, rng = toy_rows(2 * n), random.Random(0)
    for b in range(n):
        group = rows[2 * b:2 * b + 2]
        prompts = [r["prompt"] for r in group for _ in range(4)]
        texts = [" ".join(rng.choices(WORDS, k=rng.randint(1, 25))) for _ in prompts]
        stops = [rng.random() < 0.5 for _ in prompts]
        ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] * s for t, s in zip(texts, stops)]
        yield [{"teacher_response": r["teacher_response"]} for r in group for _ in range(4)], prompts, ids


def test_I9_guard_takes_bf16_rounding_of_the_read_hidden_state(smollm2_path, smollm2_tokenizer, monkeypatch):
    """Control. In bf16 the score is the rounding of ``sum_i w_i h_i``, whose terms (SmolLM2, fresh head: 9-14 in
    ``sum_i |w_i h_i|``) are far larger than the score (-0.4 .. 2): batch shape alone moved scores by up to 0.07,
    past 4 bf16 epsilons of the score, and a bound on the score wide enough for that let reads one token early
    through. The guard compares the hidden state the head reads (``state_gap``, bound 10 eps = 0.078), which
    rounding moves by at most ~3 eps here. Every sequence of these packed and right-padded batches (two of each,
    40 sequences) passes alone, and the largest gap measured stays under half the bound. The guard checks two
    sequences a call (the batch's shortest and its last), so each call here gets two: every sequence once."""
    from grpotrl.errors import InvariantError
    from grpotrl.gad import discriminator as gd
    from grpotrl.trainers import gad_engine

    failures, gaps = [], []

    def measured(read, reference):
        gap = gd.state_gap(read, reference)  # [1]
        gaps.append(gap.item())
        return gap

    monkeypatch.setattr(gad_engine, "state_gap", measured)
    tok = smollm2_tokenizer
    engine = _bf16_engine(smollm2_path, tok)
    engine.model.eval()
    reward = gd.DiscriminatorReward(engine.model, tok, [tok.eos_token_id])
    for j, (inputs, prompts, ids) in enumerate(_generation_batches(tok, 4)):
        parts = reward.parts(prompts, reward.texts(ids), reward.finished(ids))
        parts += reward.parts(prompts[::4], [x["teacher_response"] for x in inputs[::4]])
        batch = gd.scoring_batch(parts, tok.pad_token_id, pack=j % 2 == 0)  # packed, then padded
        assert ("block" in batch) == (j % 2 == 0)
        with torch.no_grad(), engine.accelerator.autocast(), engine.model.reading() as seen:
            batched = engine.model(**batch)  # [10]
        for k in range(0, len(parts), 2):
            two = {key: [seen[key][0][k:k + 2]] for key in ("head_input", "scores")}
            try:
                engine.check_score_alone([p + r for p, r in parts[k:k + 2]], batched[k:k + 2], two, tok)
            except InvariantError as e:
                failures.append(str(e)[:200])
    assert not failures, failures
    assert len(gaps) == 40  # each sequence's read state compared with its own alone
    assert max(gaps) < gd.state_tolerance(torch.bfloat16) / 2, max(gaps)


def _hf_pooling(d):
    """D's forward with transformers' own pooling rule for plain batches: the rightmost token that is not
    ``pad_token_id``. SmolLM2's pad is its end-of-turn, so a finished response is read at its last content
    token, alone as in any batch."""
    from grpotrl.ops.masking import position_ids_from_mask

    inner, pad = d.hf_model, d.hf_model.config.pad_token_id

    def forward(input_ids, attention_mask):
        hidden = inner.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                  position_ids=position_ids_from_mask(attention_mask)).last_hidden_state
        last = ((input_ids != pad) * torch.arange(input_ids.size(1))).argmax(-1)  # [B]
        return inner.score(hidden[torch.arange(input_ids.size(0)), last]).squeeze(-1).float()

    return forward


def test_I9_guard_in_bf16_stops_transformers_pooling_that_reads_one_token_early(smollm2_path, smollm2_tokenizer):
    """The trap I9 exists for: HF's pooling with pad == eos reads a finished response at its last content token,
    not at its end-of-turn. It reads so alone too, so comparing D's score alone with D's score in the batch
    cannot see it. The guard's reference is the backbone's state at the last position of the sequence alone,
    found without D's pooling: in D's steps on these batches (the last sequence checked is a teacher's, always
    finished) the guard stops it."""
    from grpotrl.errors import InvariantError
    from grpotrl.gad import discriminator as gd

    tok = smollm2_tokenizer
    engine = _bf16_engine(smollm2_path, tok)
    d = engine.model
    d.forward, d.can_pack = _hf_pooling(d), lambda: False  # plain padded rows
    reward = gd.DiscriminatorReward(d, tok, [tok.eos_token_id])
    caught = 0
    for inputs, prompts, ids in _generation_batches(tok, 3):
        try:
            engine.score_and_step(reward, inputs, prompts, ids, update=False, check_alone=True)
        except InvariantError as e:
            assert "[I9]" in str(e) and "last real token" in str(e)
            caught += 1
    assert caught == 3


# finished responses whose score moves by under 0.03 when read one token early (fresh head, torch.manual_seed(0))
BARELY_MOVED = [("What is 13 + 3?", "of it the ! this it the it"), ("What is 10 + 12?", "27 answer ! answer"),
                ("What is 6 + 6?", "sum of sum helps is ! hope"),
                ("What is 13 + 14?", "maybe and I 31 think is answer answer sum this I this this it 27 I ! I the of")]


@pytest.mark.parametrize("question,text", BARELY_MOVED, ids=range(len(BARELY_MOVED)))
def test_I9_guard_in_bf16_stops_a_packed_read_one_token_early_the_score_hides(question, text, smollm2_path,
                                                                              smollm2_tokenizer, monkeypatch):
    """A packed batch whose score index is one token early (each response read at its previous token: the last
    content token of a finished one). For these responses that moved D's score by under 0.03, less than batch
    shape alone moves a score in bf16 (up to 0.056 over 400 sequences of batches as the control's) and than the
    0.10-0.11 a bound on the score took: comparing scores passed them, as it passed 12% of those 400 sequences
    read one token early. The state the head read moved by 75% or more; the guard's bound is 7.8%."""
    from grpotrl.errors import InvariantError
    from grpotrl.gad import discriminator as gd

    real = gd.scoring_batch

    def early(*args, **kwargs):
        batch = real(*args, **kwargs)
        return {**batch, "score_index": batch["score_index"] - 1} if "score_index" in batch else batch

    tok = smollm2_tokenizer
    engine = _bf16_engine(smollm2_path, tok)
    reward = gd.DiscriminatorReward(engine.model, tok, [tok.eos_token_id])
    prompts = [[{"role": "user", "content": f"{question} Answer with just the number."}]] * 4
    ids = [tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]] * 4  # 4 finished students
    step = functools.partial(engine.score_and_step, reward, [{"teacher_response": text}] * 4, prompts, ids,
                             update=False)  # one packed row: the prompt, 4 students, the teacher
    right = step(check_alone=False)[0]  # [4]
    monkeypatch.setattr(gd, "scoring_batch", early)
    assert (step(check_alone=False)[0] - right).abs().max() < 0.03
    with pytest.raises(InvariantError, match=r"\[I9\].*last real token"):
        step(check_alone=True)


def _d_weights(trainer) -> dict[str, torch.Tensor]:
    d = trainer.accelerator.unwrap_model(trainer.discriminator)
    return {k: v.detach().cpu() for k, v in d.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("save_only_model", [False, True], ids=["full-checkpoints", "save_only_model"])
def test_best_model_at_end_restores_the_discriminator_of_the_same_checkpoint(tiny_llama, gad_args, tmp_path,
                                                                             save_only_model):
    """Evaluated and saved at steps 2 and 4, the planted metric best at step 2: ``load_best_model_at_end`` puts
    checkpoint-2's student back, and D must come from checkpoint-2 too. D kept its step-4 weights, so
    ``save_model()`` wrote checkpoint-2's student beside step 4's D, a pair that never trained together.
    A ``save_only_model`` checkpoint holds D's weights and no D optimizer: the weights are all it takes."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    args = gad_args(max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2,
                    per_device_eval_batch_size=8, load_best_model_at_end=True, metric_for_best_model="planted",
                    greater_is_better=True, save_only_model=save_only_model, discriminator_learning_rate=1e-3,
                    guard_steps=0, output_dir=str(out))
    trainer = grpotrl.GADTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(toy_rows(32)),
                                 eval_dataset=Dataset.from_list(toy_rows(4)), callbacks=[PlantedBest(2)])
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-2")
    best, last = (load_file(out / f"checkpoint-{n}" / "discriminator" / "model.safetensors") for n in (2, 4))
    assert (out / "checkpoint-2" / "discriminator" / "optimizer.pt").is_file() != save_only_model
    assert not _same(best, last)  # D trained between the two checkpoints
    student_best = load_file(out / "checkpoint-2" / "model.safetensors")
    student = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    assert all(torch.equal(student[k], v) for k, v in student_best.items())  # transformers' own part
    assert _same(_d_weights(trainer), best)
    trainer.save_model()
    assert _same(load_file(out / "discriminator" / "model.safetensors"), best)


# The same run under DeepSpeed, one CPU process launched by ``accelerate launch`` with the repo's ZeRO recipe; it
# writes what it saw to OUT/result.json.
BEST_UNDER_DEEPSPEED = """
import grpotrl  # first: sets OMP_WAIT_POLICY before torch is imported
import json, sys
from pathlib import Path
import torch
from datasets import Dataset
from safetensors.torch import load_file
from planted import PlantedBest
from test_gad import toy_rows

model, out = sys.argv[1], Path(sys.argv[2])
args = grpotrl.GADConfig(
    output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=12, max_steps=4,
    logging_steps=1, report_to="none", use_cpu=True, bf16=False, guard_steps=0, seed=0, temperature=0.7, beta=0.0,
    disable_tqdm=True, generation_kwargs={"sequence_bias": [[[0], 5.0], [[2], 5.0]]}, save_strategy="steps",
    save_steps=2, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8, load_best_model_at_end=True,
    metric_for_best_model="planted", greater_is_better=True, discriminator_learning_rate=1e-3)
trainer = grpotrl.GADTrainer(model=model, args=args, train_dataset=Dataset.from_list(toy_rows(32)),
                             eval_dataset=Dataset.from_list(toy_rows(4)), callbacks=[PlantedBest(2)])
trainer.train()
same = lambda a, b: a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
best, last = (load_file(out / f"checkpoint-{n}" / "discriminator" / "model.safetensors") for n in (2, 4))
d = trainer._d.full_state_dict()  # ZeRO-3: gathered
trainer.save_model()
json.dump({"stage": trainer._d.stage, "best_checkpoint": trainer.state.best_model_checkpoint,
           "checkpoints_differ": not same(best, last), "d_is_best": same(d, best),
           "saved_is_best": same(load_file(out / "discriminator" / "model.safetensors"), best)},
          open(out / "result.json", "w"))
"""


@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_best_model_at_end_restores_the_discriminator_under_deepspeed(config, tiny_llama, tmp_path):
    """As above, D in DeepSpeed's engine at the student's ZeRO stage: its weights from the best checkpoint's
    ``model.safetensors`` (under ZeRO-3 rank 0's copy partitioned) after transformers loaded the student's
    DeepSpeed checkpoint, and so the D ``save_model()`` writes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from conftest import free_port

    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "best.py"
    script.write_text(BEST_UNDER_DEEPSPEED)
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(root / "tests"),
                                          os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
           f"recipes/accelerate/{config}.yaml", "--num_processes", "1", "--main_process_port", str(free_port()),
           str(script), str(tiny_llama), str(out)]
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
    seen = json.loads((out / "result.json").read_text())
    assert seen["stage"] == int(config[-1]) and seen["best_checkpoint"] == str(out / "checkpoint-2"), seen
    assert seen["checkpoints_differ"] and seen["d_is_best"] and seen["saved_is_best"], seen
