"""grpotrl.GADTrainer and its discriminator on tiny models over the real SmolLM2 tokenizer
(pad == eos == <|im_end|>): I9 padding, bad input, warmup, learning, KL, checkpoints."""

import copy
import inspect
import json
import os
from pathlib import Path

import pytest
import torch
import transformers
import trl
from conftest import perturbed_batch
from datasets import Dataset
from transformers import TrainerCallback

import grpotrl
from grpotrl.gad import discriminator as gd
from grpotrl.chat import templates
from grpotrl.errors import InputError
from grpotrl.ops.losses import KL_ESTIMATORS, kl_full, kl_penalty
from grpotrl.ops.masking import pad_sequences

TOY = Path(grpotrl.__file__).parent / "data" / "gad_toy.jsonl"
PROMPT = [{"role": "user", "content": "What is 13 + 14? Answer with just the number."}]


def toy_rows(n=16):
    with open(TOY) as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


@pytest.fixture
def gad_args(grpo_args):
    """grpo_args' small settings as a GADConfig (same fields, GSPO defaults)."""

    def make(**overrides):
        base = {k: v for k, v in vars(grpo_args()).items() if k in {
            "output_dir", "per_device_train_batch_size", "num_generations", "max_completion_length", "max_steps",
            "logging_steps", "report_to", "use_cpu", "guard_steps", "temperature", "save_strategy", "seed",
            "generation_kwargs"}}
        base.update(beta=0.0, disable_tqdm=True)
        base.update(overrides)
        return grpotrl.GADConfig(**base)

    return make


# ---------------------------------------------------------------- I9: where D reads its score

@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gpt2"])
def test_I9_score_is_the_same_alone_left_padded_and_right_padded(arch, request, smollm2_tokenizer):
    """GPT-2 has absolute positions: without position ids from the mask, left padding would move it."""
    tok = smollm2_tokenizer
    d = gd.load_discriminator(request.getfixturevalue(arch), tok.pad_token_id)
    seqs = [gd.sequence_ids(tok, PROMPT, text) for text in ("27", "27. Hope this helps!", "I think 26?")]
    with torch.no_grad():
        alone = torch.cat([d(*pad_sequences([s], tok.pad_token_id)) for s in seqs])  # [3]
        for side in ("left", "right"):
            batched = d(*pad_sequences(seqs, tok.pad_token_id, side))  # [3]
            torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)
    assert len(set(alone.tolist())) == 3


def test_I9_hf_pooling_reads_the_wrong_token_when_pad_is_eos(tiny_llama, smollm2_tokenizer):
    """HF's seq-cls pooling takes the rightmost token != pad_token_id. Every scored sequence ends
    with <|im_end|> == pad, so HF reads one token early (the response's last content token)."""
    tok = smollm2_tokenizer
    d = gd.load_discriminator(tiny_llama, tok.pad_token_id)
    seq = gd.sequence_ids(tok, PROMPT, "27. Hope this helps!")
    assert seq[-1] == tok.pad_token_id == tok.eos_token_id  # ends with <|im_end|>
    ids, mask = pad_sequences([seq], tok.pad_token_id)
    with torch.no_grad():
        ours = d(ids, mask)  # [1] at the last real token: <|im_end|>
        hf = d.model(input_ids=ids, attention_mask=mask).logits[:, 0]  # [1]
        hidden = d.model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state  # [1, L, H]
        one_early = d.model.score(hidden[:, -2]).squeeze(-1)  # at '!', before <|im_end|>
    assert (ours - hf).abs().item() > 1e-3
    torch.testing.assert_close(hf, one_early, atol=1e-5, rtol=0)


def test_I9_teacher_and_student_text_take_the_same_template_path(smollm2_tokenizer):
    tok = smollm2_tokenizer
    stop = templates.stop_token_ids(tok)
    reward = gd.DiscriminatorReward(None, tok, stop)
    teacher, student = reward.sequences([PROMPT, PROMPT], ["27", "27"])
    prompt_ids = templates.prompt_ids(tok, PROMPT)
    assert teacher == student and teacher[: len(prompt_ids)] == prompt_ids  # the RL prompt, then the response
    assert tok.decode(teacher[len(prompt_ids):]) == "27<|im_end|>"


def test_I9_runtime_guard_stops_a_discriminator_that_reads_the_last_position(tiny_llama, gad_args):
    """A scorer that reads position L-1 (padding included) passes on unpadded rows only."""
    trainer = grpotrl.GADTrainer(model=tiny_llama, args=gad_args(max_steps=1),
                                 train_dataset=Dataset.from_list(toy_rows(16)))
    d = trainer.accelerator.unwrap_model(trainer.discriminator)
    with torch.no_grad():
        d.hf_model.score.weight.mul_(100)  # the random head's scores are ~0.03: make any misread visible

    def last_position(input_ids, attention_mask):
        hidden = d.hf_model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return d.hf_model.score(hidden[:, -1]).squeeze(-1).float()

    d.forward = last_position
    d.can_pack = lambda: False  # this scorer takes plain padded rows
    with pytest.raises(grpotrl.InvariantError, match=r"\[I9\]"):
        trainer.train()


def test_lora_discriminator_trains_adapter_and_head_only(tiny_llama, smollm2_tokenizer):
    d = gd.load_discriminator(tiny_llama, smollm2_tokenizer.pad_token_id, lora_r=4)
    trainable = [n for n, p in d.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or "score" in n for n in trainable)
    assert any("score" in n for n in trainable)
    ids, mask = pad_sequences([[1, 2, 3], [4, 5]], smollm2_tokenizer.pad_token_id, "left")
    assert d(ids, mask).shape == (2,)


def test_discriminator_reward_is_a_trl_reward_function(tiny_llama, smollm2_tokenizer):
    tok = smollm2_tokenizer
    d = gd.load_discriminator(tiny_llama, tok.pad_token_id)
    reward = gd.DiscriminatorReward(d, tok, templates.stop_token_ids(tok))
    completions = [[{"role": "assistant", "content": "27"}], [{"role": "assistant", "content": "26"}]]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in ("27", "26")]
    scores = reward(prompts=[PROMPT, PROMPT], completions=completions, completion_ids=[ids[0], ids[1] + [im_end]])
    with torch.no_grad():  # the first response was cut (no stop id): scored without an end-of-turn
        seqs = reward.sequences([PROMPT, PROMPT], ["27", "26"], finished=[False, True])
        direct = d(*pad_sequences(seqs, tok.pad_token_id))
    assert scores == pytest.approx(direct.tolist(), abs=1e-6)
    assert reward(prompts=[PROMPT, PROMPT], completions=completions) == pytest.approx(  # text only: finished
        d(*pad_sequences(reward.sequences([PROMPT, PROMPT], ["27", "26"]), tok.pad_token_id)).tolist(), abs=1e-6)
    assert trl.trainer.utils.get_callable_name(reward) == "discriminator"


def test_discriminator_reads_the_special_tokens_the_student_generated(tiny_llama, gad_args, smollm2_tokenizer):
    """A student sampling <file_sep> and <reponame> (SmolLM2 special tokens, no stop token): TRL's
    completions skip special tokens, so D read all 8 responses as the same empty cut answer (48
    generated, 0 read). D now reads the generated ids: each response's tokens as sampled."""
    tok = smollm2_tokenizer
    specials = tok.convert_tokens_to_ids(["<file_sep>", "<reponame>"])
    args = gad_args(max_steps=1, guard_steps=0, max_completion_length=6,
                    generation_kwargs={"sequence_bias": [[[specials[0]], 12.0], [[specials[1]], 11.5]]})
    trainer = Recorded(model=tiny_llama, args=args, train_dataset=Dataset.from_list(toy_rows(16)))
    d = trainer.accelerator.unwrap_model(trainer.discriminator)
    read = []
    d.register_forward_pre_hook(lambda module, args, kwargs: read.append(kwargs["input_ids"]), with_kwargs=True)
    trainer.train()
    (_, _, generated), = trainer.batches
    assert len(read) == 1  # one forward: 8 students and 2 teachers
    for special in specials:
        sampled = sum(ids.count(special) for ids in generated)
        assert sampled > 0 and int((read[0] == special).sum()) == sampled, special
    texts = trainer._d_reward.texts(generated)
    assert [trainer._d_reward.parts([PROMPT], [t])[0][1][:-1] for t in texts] == generated  # cut: no stop


def test_reward_is_the_discriminators_score_without_dropout(tiny_gpt2, gad_args):
    """disable_dropout off and GPT-2's dropout 0.1: D's step runs in train mode, and the reward was read
    from that forward, a dropout sample (up to 0.16 away from D's score, on scores of ~0.2). The reward
    is now D's eval-mode score before the step, and D still steps."""
    args = gad_args(max_steps=1, guard_steps=-1, disable_dropout=False, discriminator_learning_rate=1e-3)
    trainer = Recorded(model=tiny_gpt2, args=args, train_dataset=Dataset.from_list(toy_rows(16)))
    d = trainer.accelerator.unwrap_model(trainer.discriminator)
    assert any(isinstance(m, torch.nn.Dropout) and m.p == 0.1 for m in d.modules())
    before, rewards = [], []
    calculate = trainer._calculate_rewards

    def recorded(inputs, prompts, completions, completion_ids_list):
        before.append(copy.deepcopy(d).eval())
        rewards.append(calculate(inputs, prompts, completions, completion_ids_list)[:, 0])  # [N]
        return rewards[-1][:, None]

    trainer._calculate_rewards = recorded
    trainer.train()
    (prompts, completions, ids), = trainer.batches
    fixed = gd.DiscriminatorReward(before[0], trainer._d_reward.tokenizer, trainer.stop_token_ids)
    assert rewards[0].tolist() == pytest.approx(fixed(prompts, completions, completion_ids=ids), abs=1e-5)
    assert not torch.equal(d.hf_model.score.weight, before[0].hf_model.score.weight)  # D stepped


def test_disable_dropout_zeroes_the_discriminators_attention_dropout(tiny_llama, gad_args, tmp_path):
    """A discriminator checkpoint with attention_dropout 0.1 (Llama's attention applies it itself in
    training mode; TRL's disable_dropout zeroes nn.Dropout layers only): its scores in training were
    random, and the I9 guard stopped training with a false 'not the last real token' (gap 2.4)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    model.config.attention_dropout = 0.1
    model.save_pretrained(tmp_path / "d")
    args = gad_args(max_steps=1, guard_steps=-1, discriminator_model_name_or_path=str(tmp_path / "d"))
    trainer = grpotrl.GADTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(toy_rows(16)))
    d = trainer.accelerator.unwrap_model(trainer.discriminator)
    with torch.no_grad():
        d.hf_model.score.weight.mul_(100)  # the random head's scores are ~0.03: make dropout's noise visible
    trainer.train()  # the guard scores two sequences alone on this step
    assert "gad/d_loss" in trainer.state.log_history[0]
    assert [m.attention_dropout for m in d.modules() if hasattr(m, "attention_dropout")] == [0.0, 0.0]


# ---------------------------------------------------------------- D's cost: shared prompts, frozen embeddings

OTHER = [{"role": "user", "content": "Hi"}]


def _scores_and_grads(d, fn):
    d.zero_grad()
    scores = fn()  # [N]
    scores.pow(2).sum().backward()
    return scores.detach(), {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("max_row_tokens", [1024, 40])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gpt2"])
def test_packed_batch_gives_the_scores_and_gradients_of_whole_sequences(arch, attention, max_row_tokens, request,
                                                                        smollm2_tokenizer):
    """D scores a batch packed with each shared prompt once (one row, or with a 40-token cap four
    rows, a prompt written again where its responses overflow a row): scores and gradients are
    those of the whole sequences, for prompts of two lengths, a cut response and an empty one
    (scored at its prompt's last token); eager attention gets the mask as added scores."""
    tok = smollm2_tokenizer
    d = gd.load_discriminator(request.getfixturevalue(arch), tok.pad_token_id)
    d.hf_model.set_attn_implementation(attention)
    for m in d.modules():  # GPT-2 has dropout 0.1; GADTrainer's disable_dropout sets it to 0
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    d.train()
    reward = gd.DiscriminatorReward(d, tok, templates.stop_token_ids(tok))
    parts = reward.parts([PROMPT, PROMPT, OTHER, OTHER, PROMPT, OTHER],
                         ["27", "27. Hope this helps!", "Hello there", "x", "26", ""],
                         finished=[True, False, True, True, True, False])
    assert d.can_pack()
    batch = gd.scoring_batch(parts, tok.pad_token_id, max_row_tokens=max_row_tokens)
    prompt_tokens = len(templates.prompt_ids(tok, PROMPT)) + len(templates.prompt_ids(tok, OTHER))
    real = int((batch["block"] >= 0).sum())
    if max_row_tokens == 1024:
        assert batch["input_ids"].size(0) == 1 and real == prompt_tokens + sum(len(r) for _, r in parts)
    else:
        assert batch["input_ids"].size(0) > 2 and real > prompt_tokens + sum(len(r) for _, r in parts)  # repeated
    packed, packed_grads = _scores_and_grads(d, lambda: d(**batch))
    whole, whole_grads = _scores_and_grads(d, lambda: d(*pad_sequences([p + r for p, r in parts],
                                                                         tok.pad_token_id)))
    torch.testing.assert_close(packed, whole, atol=1e-5, rtol=0)
    assert len(set(whole.tolist())) == 6
    assert packed_grads.keys() == whole_grads.keys() and len(whole_grads) == len(list(d.parameters()))
    for name, g in whole_grads.items():
        assert (packed_grads[name] - g).abs().max() <= 1e-4 * g.abs().max() + 1e-9, name


def test_no_packing_while_dropout_is_active(tiny_gpt2, smollm2_tokenizer):
    """In a packed row the sequences would share their prompt's dropout mask: with dropout on in
    training (GPT-2's default 0.1), the batch is plain rows and a packed one is refused."""
    tok = smollm2_tokenizer
    d = gd.load_discriminator(tiny_gpt2, tok.pad_token_id).train()
    reward = gd.DiscriminatorReward(d, tok, templates.stop_token_ids(tok))
    parts = reward.parts([PROMPT, PROMPT, OTHER], ["27", "I think 26?", "Hello"])
    assert not d.can_pack() and "block" not in reward.batch(parts)
    with pytest.raises(InputError, match="cannot score a packed batch"):
        d(**gd.scoring_batch(parts, tok.pad_token_id))
    assert d.eval().can_pack() and "block" in reward.batch(parts)


def test_gad_step_packs_each_prompt_once_into_the_discriminator(tiny_llama, gad_args):
    """One generation batch (2 prompts x 4 students, 2 teachers): D's one forward reads both prompts
    once, in one row with the 10 responses; the I9 guard (every step here) scores two of them alone
    and agrees."""
    trainer = grpotrl.GADTrainer(model=tiny_llama, args=gad_args(max_steps=1, guard_steps=-1),
                                 train_dataset=Dataset.from_list(toy_rows(16)))
    d = trainer.accelerator.unwrap_model(trainer.discriminator)
    calls = []
    d.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs), with_kwargs=True)
    trainer.train()
    packed = [kw for kw in calls if "block" in kw]
    assert len(packed) == 1 and packed[0]["input_ids"].size(0) == 1 and packed[0]["score_index"].numel() == 10
    assert packed[0]["block"].max().item() == 1  # two prompts, each once
    assert len(calls) == 3  # and two sequences alone (the guard)
    assert "gad/d_loss" in trainer.state.log_history[0]


def test_I9_runtime_guard_stops_a_wrong_packing_mask(tiny_llama, gad_args, monkeypatch):
    """A packed row under a plain causal mask lets a sequence see the ones before it: the guard,
    which scores the batch's last sequence alone, stops training."""
    monkeypatch.setattr(gd, "packed_attention", lambda block, member: torch.ones(
        block.size(1), block.size(1), dtype=torch.bool).tril()[None, None].expand(block.size(0), 1, -1, -1))
    trainer = grpotrl.GADTrainer(model=tiny_llama, args=gad_args(max_steps=1, guard_steps=-1),
                                 train_dataset=Dataset.from_list(toy_rows(16)))
    d = trainer.accelerator.unwrap_model(trainer.discriminator)
    with torch.no_grad():
        d.hf_model.score.weight.mul_(100)  # the random head's scores are ~0.03: make any misread visible
    with pytest.raises(grpotrl.InvariantError, match=r"\[I9\]"):
        trainer.train()


def test_frozen_discriminator_embeddings_stay_as_loaded_while_the_rest_trains(tiny_llama, smollm2_tokenizer):
    tok = smollm2_tokenizer
    for freeze in (False, True):
        d = gd.load_discriminator(tiny_llama, tok.pad_token_id, freeze_embeddings=freeze).train()
        embedding = d.hf_model.get_input_embeddings().weight
        start = {n: p.detach().clone() for n, p in d.named_parameters()}
        optimizer = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-2)
        reward = gd.DiscriminatorReward(d, tok, templates.stop_token_ids(tok))
        batch = reward.batch(reward.parts([PROMPT, PROMPT], ["27", "I think 26?"]))
        for _ in range(2):
            scores = d(**batch)  # [teacher, student]
            gd.bradley_terry_loss(scores[:1], scores[1:]).backward()
            optimizer.step()
            optimizer.zero_grad()
        moved = {n for n, p in d.named_parameters() if not torch.equal(p, start[n])}
        name = next(n for n, p in d.named_parameters() if p is embedding)
        assert moved == {n for n, p in d.named_parameters() if p.requires_grad}  # every trainable weight
        assert (name in moved) is not freeze and embedding.requires_grad is not freeze
        assert all(p is not embedding for group in optimizer.param_groups for p in group["params"]) is freeze


def test_trainer_freezes_the_discriminator_embeddings_when_asked(tiny_llama, gad_args):
    assert grpotrl.GADConfig(output_dir="x").discriminator_freeze_embeddings is False  # the paper trains all of D
    args = gad_args(max_steps=1, guard_steps=0, discriminator_freeze_embeddings=True, discriminator_learning_rate=1e-3)
    trainer = grpotrl.GADTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(toy_rows(16)))
    d = trainer.accelerator.unwrap_model(trainer.discriminator)
    embedding = d.hf_model.get_input_embeddings().weight
    start, head = embedding.detach().clone(), d.hf_model.score.weight.detach().clone()
    assert not embedding.requires_grad
    trainer.train()
    assert torch.equal(embedding, start) and not torch.equal(d.hf_model.score.weight, head)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("bad, match", [({"teacher_response": None}, "teacher_response"),
                                        ({"teacher_response": "  "}, "Row 3"),
                                        ({"prompt": "text"}, "chat messages")])
def test_bad_teacher_rows_stop_before_any_model_loads(bad, match, tiny_llama, gad_args, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the input check")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", no_load)  # every architecture class's
    rows = toy_rows(8)
    if bad.get("teacher_response", "") is None:
        rows = [{k: v for k, v in r.items() if k != "teacher_response"} for r in rows]
    elif "prompt" in bad:  # a plain-text prompt column
        rows = [{**r, "prompt": r["prompt"][0]["content"]} for r in rows]
    else:
        rows[3] = {**rows[3], **bad}
    with pytest.raises(InputError, match=match):
        grpotrl.GADTrainer(model=tiny_llama, args=gad_args(), train_dataset=Dataset.from_list(rows))


def test_config_refuses_a_kl_without_a_place_and_unknown_estimators(tmp_path):
    with pytest.raises(InputError, match="use_kl_loss and use_kl_in_reward"):
        grpotrl.GADConfig(output_dir=str(tmp_path), beta=0.1, use_kl_loss=False)
    with pytest.raises(InputError, match="kl_estimator"):
        grpotrl.GADConfig(output_dir=str(tmp_path), kl_estimator="k4")
    with pytest.raises(InputError, match="its coefficient is 0: set beta"):
        grpotrl.GADConfig(output_dir=str(tmp_path), use_kl_in_reward=True)
    args = grpotrl.GADConfig(output_dir=str(tmp_path))
    assert (args.importance_sampling_level, args.loss_type) == ("sequence", "grpo")  # GSPO


# ---------------------------------------------------------------- warmup, then learning

TRAIT = [" Hope", " this", " helps", "!"]  # the toy task's closing phrase, one token each
DISTRACTORS = ["?", " no", " vision", " kids"]


class Recorded(grpotrl.GADTrainer):
    """Keeps each generation batch's prompts and completions."""

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self.batches = getattr(self, "batches", []) + [(prompts, completions, completion_ids_list)]
        return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)


class AtStep(TrainerCallback):
    def __init__(self, step, fn):
        self.step, self.fn = step, fn

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.fn()


def test_warmup_trains_only_the_discriminator_then_the_students_reward_rises(tiny_llama, gad_args, smollm2_tokenizer):
    """The toy task's trait, on a tiny random student. A random 2-layer model samples from ~50k
    tokens, so sampling is biased towards the trait's four tokens, four distractors and the stop
    token (the student can then emit the trait by chance; the trainer's logprobs stay unbiased).
    The teacher's response is the closing phrase alone (the tiny student cannot do arithmetic).

    D is adversarial: its own score of the student falls as it learns, by design. "The
    student's reward rises" is measured under a fixed reward function: D as it was at the end of
    warmup scores every step's responses afterwards. Seeds 0-3 all rose when this was written
    (mean of the last four steps minus the warmup mean: +0.4, +1.1, +0.2, +1.0); seed 1 is used."""
    tok = smollm2_tokenizer
    W = 4
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TRAIT + DISTRACTORS]
    assert all(len(i) == 1 for i in ids)
    bias = [[i, 10.0] for i in ids] + [[[tok.eos_token_id], 9.0]]
    rows = [{**r, "teacher_response": "".join(TRAIT)} for r in toy_rows(64)]
    args = gad_args(max_steps=16, discriminator_warmup_steps=W, discriminator_learning_rate=1e-3, learning_rate=1e-2,
                    lr_scheduler_type="constant", max_completion_length=6, temperature=1.0, guard_steps=1, seed=1,
                    generation_kwargs={"sequence_bias": bias})
    trainer = Recorded(model=tiny_llama, args=args, train_dataset=Dataset.from_list(rows))
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    seen = {}

    def end_of_warmup():
        seen["unchanged"] = all(torch.equal(p, start[n]) for n, p in trainer.model.named_parameters())
        seen["d"] = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.discriminator))

    trainer.add_callback(AtStep(W, end_of_warmup))
    trainer.train()

    logs = [h for h in trainer.state.log_history if "gad/d_acc" in h]
    warm, gad = logs[:W], logs[W:]
    assert seen["unchanged"], "a student weight changed during discriminator warmup"
    assert all(h["grad_norm"] == 0 and h["loss"] == 0 for h in warm)
    assert warm[-1]["gad/d_acc"] >= 0.85 and warm[-1]["gad/d_loss"] < warm[0]["gad/d_loss"]
    assert all(h["grad_norm"] > 0 for h in gad)
    assert not all(torch.equal(p, start[n]) for n, p in trainer.model.named_parameters())

    fixed = gd.DiscriminatorReward(seen["d"], tok, trainer.stop_token_ids)
    score = [sum(fixed(p, c, completion_ids=i)) / len(c) for p, c, i in trainer.batches]  # per step, D of warmup end
    assert sum(score[-4:]) / 4 > sum(score[:W]) / W + 0.3, score


def test_warmup_with_gradient_accumulation_steps_D_once_per_generation_batch(tiny_llama, gad_args):
    """D steps mid-window (at generation), while the student accumulates: a plain optimizer, since
    accelerate's would skip step() there. Two optimizer steps of two microbatches: two D steps."""
    args = gad_args(max_steps=2, discriminator_warmup_steps=2, gradient_accumulation_steps=2,
                    per_device_train_batch_size=4, guard_steps=0)
    trainer = grpotrl.GADTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(toy_rows(16)))
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    d_start = {k: v.clone() for k, v in trainer.discriminator.state_dict().items()}
    trainer.train()
    steps = {int(s["step"]) for s in trainer.discriminator_optimizer.state.values()}
    assert steps == {2}
    assert all(torch.equal(p, start[n]) for n, p in trainer.model.named_parameters())
    assert not all(torch.equal(v, d_start[k]) for k, v in trainer.discriminator.state_dict().items())


def test_discriminator_of_a_bf16_student_keeps_fp32_weights_and_learns_at_a_small_lr(tiny_llama, gad_args):
    """D in bf16 with a plain AdamW at lr 1e-6 changed 18 of 1,000 weights in 10 steps (updates
    below bf16's resolution round away). D now keeps fp32 master weights: every trained weight moves."""
    student = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    args = gad_args(max_steps=2, discriminator_warmup_steps=2, discriminator_learning_rate=1e-6, guard_steps=0)
    trainer = grpotrl.GADTrainer(model=student, args=args, train_dataset=Dataset.from_list(toy_rows(16)))
    d = trainer.accelerator.unwrap_model(trainer.discriminator)
    assert {p.dtype for p in d.parameters()} == {torch.float32}
    start = {n: p.detach().clone() for n, p in d.named_parameters()}
    trainer.train()
    moved = sum(int((p != start[n]).sum()) for n, p in d.named_parameters())
    total = sum(p.numel() for p in d.parameters())
    # embeddings of tokens never seen get no gradient: most, not all, of the weights move
    trained = sum(p.numel() for n, p in d.named_parameters() if "embed" not in n)
    assert moved >= 0.9 * trained, f"{moved} of {total} discriminator weights moved"


def test_student_lr_schedule_starts_after_discriminator_warmup(tiny_llama, gad_args):
    """Linear decay over the 2 steps after a 2-step warmup: the student trains at lr, lr/2 (the
    schedule spans the student's steps only); during warmup it stands at its step 0."""
    args = gad_args(max_steps=4, discriminator_warmup_steps=2, learning_rate=1e-3, lr_scheduler_type="linear",
                    guard_steps=0)
    trainer = grpotrl.GADTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(toy_rows(16)))
    trainer.train()
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert lrs == pytest.approx([1e-3, 1e-3, 1e-3, 5e-4]), lrs


# ---------------------------------------------------------------- checkpoints

def _d_state(trainer):
    d = trainer.accelerator.unwrap_model(trainer.discriminator)
    weights = {k: v.detach().clone() for k, v in d.state_dict().items()}
    return weights, copy.deepcopy(trainer.discriminator_optimizer.state_dict())


def _assert_same_state(a, b, exact=True):
    (wa, oa), (wb, ob) = a, b
    assert wa.keys() == wb.keys()
    for k in wa:
        if exact:
            assert torch.equal(wa[k], wb[k]), k
        else:
            torch.testing.assert_close(wa[k], wb[k], atol=1e-5, rtol=1e-4)
    assert oa["param_groups"] == ob["param_groups"] and oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            if exact:
                assert torch.equal(oa["state"][i][name], ob["state"][i][name]), (i, name)
            else:
                torch.testing.assert_close(oa["state"][i][name], ob["state"][i][name], atol=1e-5, rtol=1e-4)


class OnTrainBegin(TrainerCallback):
    """Runs after the trainer restored a checkpoint's states, before the first step."""

    def __init__(self, fn):
        self.fn = fn

    def on_train_begin(self, args, state, control, **kwargs):
        self.fn()


def test_checkpoint_holds_the_discriminator_and_resume_restores_it(tiny_llama, gad_args, tmp_path):
    rows = Dataset.from_list(toy_rows(32))
    args = dict(max_steps=3, save_strategy="steps", save_steps=2, discriminator_warmup_steps=1,
                discriminator_learning_rate=1e-3, guard_steps=0, output_dir=str(tmp_path / "run"))
    first = grpotrl.GADTrainer(model=tiny_llama, args=gad_args(**args), train_dataset=rows)
    states = {}
    first.add_callback(AtStep(2, lambda: states.update(saved=_d_state(first))))
    first.train()
    states["end"] = _d_state(first)
    ckpt = tmp_path / "run" / "checkpoint-2"
    assert (ckpt / "discriminator" / "model.safetensors").is_file()
    assert (ckpt / "discriminator" / "optimizer.pt").is_file()

    resumed = grpotrl.GADTrainer(model=tiny_llama, args=gad_args(**args), train_dataset=rows)
    assert not all(torch.equal(v, states["saved"][0][k]) for k, v in _d_state(resumed)[0].items())  # fresh D
    resumed.add_callback(OnTrainBegin(lambda: states.update(restored=_d_state(resumed))))
    resumed.train(resume_from_checkpoint=str(ckpt))  # step 3 again, from the restored D
    _assert_same_state(states["restored"], states["saved"])
    _assert_same_state(_d_state(resumed), states["end"], exact=False)

    # a checkpoint without D's optimizer state: refused by train() before anything is loaded
    (ckpt / "discriminator" / "optimizer.pt").unlink()
    again = grpotrl.GADTrainer(model=tiny_llama, args=gad_args(**args), train_dataset=rows)
    with pytest.raises(InputError, match="no discriminator/optimizer.pt"):
        again.train(resume_from_checkpoint=str(ckpt))


# ---------------------------------------------------------------- KL to the reference policy

def _kl_trainer(tiny_llama, gad_args, **overrides):
    """A GAD trainer whose policy is perturbed away from its reference, and one prepared batch."""
    # the policy is moved by hand at step 0, which is what I10 exists to catch: off here
    args = gad_args(beta=0.1, guard_steps=0, check_step0_identity=False, **overrides)
    trainer = grpotrl.GADTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(toy_rows(16)))
    return trainer, perturbed_batch(trainer)


def _independent_kl(trainer, prompt_ids, prompt_mask, completion_ids, completion_mask, estimator):
    """Per-token KL [B, C] from plain forwards of both models (not the trainer's code path)."""
    ids, attn = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    width, T = completion_ids.size(1), trainer.temperature
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = trainer.model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -width - 1:-1]
    with torch.no_grad():
        ref = trainer.ref_model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -width - 1:-1]
    if estimator == "full":
        return kl_full(logits, ref, T)
    logp = torch.log_softmax(logits.float() / T, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    ref_logp = torch.log_softmax(ref.float() / T, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    return kl_penalty(logp, ref_logp, estimator)


def _independent_logp(trainer, inputs):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    width = inputs["completion_ids"].size(1)
    logits = trainer.model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
    logp = torch.log_softmax(logits[:, -width - 1:-1].float() / trainer.temperature, -1)
    return logp.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)


def test_kl_loss_k3_equals_trls_own_kl_term(tiny_llama, gad_args):
    """GAD computes every in-loss KL itself; for k3 it must reproduce TRL's own beta * k3 term,
    value and gradient, for a per-sequence (grpo) and a per-token (dapo) aggregation. At the token
    level: under "sequence" TRL's bias correction broadcasts the sequence's ratio, GAD keeps the
    token's (the next test), so only the token level is where the two must agree."""
    trainer, inputs = _kl_trainer(tiny_llama, gad_args, importance_sampling_level="token")
    assert trainer.args.use_bias_correction_kl  # TRL's default: the KL times the importance ratio
    head = trainer.model.get_output_embeddings().weight
    for loss_type in ("grpo", "dapo"):
        trainer.loss_type = loss_type
        ours = trainer._compute_loss(trainer.model, inputs)
        trainer.beta = trainer.kl_coef  # TRL's own KL, on the same batch and reference logprobs
        theirs = trl.GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
        trainer.beta = 0.0
        assert abs(trainer._metrics["train"]["kl"][-1]) > 1e-4  # the policy really differs from the reference
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(torch.autograd.grad(ours, head)[0], torch.autograd.grad(theirs, head)[0],
                                   atol=1e-7, rtol=1e-4)


def test_every_kl_estimator_in_the_loss_matches_an_independent_recomputation(tiny_llama, gad_args):
    """Value and gradient of the added term, for k1/abs/k2/k3 and k1+/k3+/abs+ (sampled-token
    logprobs) and full (the policy's logits rebuilt from the loss's own forward, the reference's from
    its own), under GAD's defaults: use_bias_correction_kl, sequence-level policy ratio. The
    KL's ratio is per token, differentiable for k1/k3 only (tests/ops/test_losses.py: the gradient
    that gives, by exact enumeration); it was the sequence's, differentiable for every estimator."""
    trainer, inputs = _kl_trainer(tiny_llama, gad_args)
    assert trainer.args.use_bias_correction_kl and trainer.importance_sampling_level == "sequence"
    mask = inputs["completion_mask"].float()
    head = trainer.model.get_output_embeddings().weight
    for estimator in KL_ESTIMATORS + ("k1+", "k3+", "abs+"):
        trainer.args.kl_estimator = estimator
        trainer.args.guard_steps = -1 if estimator == "full" else 0  # checks the rebuilt logits
        trainer._kl_in_loss = True
        with_kl = trainer._compute_loss(trainer.model, inputs)
        trainer._kl_in_loss = False
        without = trainer._compute_loss(trainer.model, inputs)
        (ours,) = torch.autograd.grad(with_kl - without, head)
        kl = _independent_kl(trainer, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"],
                             inputs["completion_mask"], estimator)  # [B, C]
        logp = _independent_logp(trainer, inputs)  # [B, C]
        if estimator in ("k1", "k3"):  # the token's ratio exp(logp - old): value 1, gradient kl * d logp
            kl = kl * torch.exp(logp - logp.detach())  # [B, C]
        expected = trainer.kl_coef * ((kl * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()  # loss_type grpo
        (want,) = torch.autograd.grad(expected, head)
        torch.testing.assert_close((with_kl - without).detach(), expected.detach(), atol=1e-6, rtol=1e-4,
                                   msg=estimator)
        torch.testing.assert_close(ours, want, atol=1e-7, rtol=1e-3, msg=estimator)
        assert want.abs().max() > 0


@pytest.mark.parametrize("separate", [False, True], ids=["beta", "own-coef-and-estimator"])
def test_kl_in_reward_is_minus_its_coef_times_the_summed_kl(tiny_llama, gad_args, separate):
    """By default the reward's KL takes beta and kl_estimator; with kl_in_reward_coef /
    kl_in_reward_estimator (verl's kl_ctrl.kl_coef / kl_penalty) its own, while the loss keeps beta."""
    own = dict(kl_in_reward_coef=0.3, kl_estimator="k1") if separate else dict(use_kl_loss=False)
    trainer, inputs = _kl_trainer(tiny_llama, gad_args, use_kl_in_reward=True, **own)
    assert trainer.kl_coef == 0.1 and trainer.kl_reward_coef == (0.3 if separate else 0.1)
    tok = trainer._tokenizer
    # the batch was shuffled: recover each row's prompt from its ids
    prompts = {json.dumps(templates.prompt_ids(tok, r["prompt"])): r["prompt"] for r in toy_rows(16)}
    prompt_ids = [[t for t, m in zip(p, pm) if m] for p, pm in zip(inputs["prompt_ids"].tolist(),
                                                                    inputs["prompt_mask"].tolist())]
    rows = [prompts[json.dumps(p)] for p in prompt_ids]
    completion_ids = [c[: int(m.sum())] for c, m in zip(inputs["completion_ids"].tolist(), inputs["completion_mask"])]
    completions = [[{"role": "assistant", "content": tok.decode(c, skip_special_tokens=True)}]
                   for c in completion_ids]
    for estimator in KL_ESTIMATORS:
        setattr(trainer.args, "kl_in_reward_estimator" if separate else "kl_estimator", estimator)
        rewards = trainer.kl_reward(rows, completions, completion_ids)
        with torch.no_grad():
            kl = _independent_kl(trainer, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"],
                                 inputs["completion_mask"], estimator)  # [B, C]
        expected = (-trainer.kl_reward_coef * (kl * inputs["completion_mask"]).sum(-1)).tolist()
        assert rewards == pytest.approx(expected, abs=1e-5), estimator
        if estimator != "k1":  # the others are never negative
            assert all(r <= 0 for r in rewards), estimator


def test_kl_in_reward_is_its_own_reward_column(tiny_llama, gad_args):
    args = gad_args(beta=0.1, use_kl_in_reward=True, use_kl_loss=False, kl_estimator="k3", max_steps=1)
    trainer = grpotrl.GADTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(toy_rows(16)))
    trainer.train()
    log = trainer.state.log_history[0]
    assert trainer.reward_func_names == ["discriminator", "kl_penalty"]
    assert log["rewards/kl_penalty/mean"] == 0.0  # step 1: the policy is its reference
    assert log["reward"] == pytest.approx(log["rewards/discriminator/mean"] + log["rewards/kl_penalty/mean"])
    assert "kl" not in log  # nothing in the loss


def test_config_takes_verl_estimator_names_and_refuses_unused_or_negative_kl_settings(tmp_path):
    make = lambda **kw: grpotrl.GADConfig(output_dir=str(tmp_path), use_cpu=True, **kw)  # noqa: E731
    args = make(beta=0.1, kl_estimator="low_var_kl+", use_kl_in_reward=True, kl_in_reward_estimator="kl")
    assert (args.kl_estimator, args.kl_in_reward_estimator) == ("k3+", "k1")
    for bad, match in ((dict(beta=-0.1), r"must be a finite number >= 0"),
                       (dict(beta=0.1, use_kl_in_reward=True, kl_in_reward_coef=-1.0), r"must be a finite number >= 0"),
                       (dict(beta=0.1, kl_in_reward_coef=0.2), r"use_kl_in_reward is off"),
                       (dict(beta=0.1, use_kl_loss=False, use_kl_in_reward=True, kl_in_reward_coef=0.2),
                        r"beta would be unused"),
                       (dict(kl_estimator="full+"), r"KL estimator 'full\+'")):
        with pytest.raises(InputError, match=match):
            make(**bad)


@pytest.mark.parametrize("name", ["k1", "kl"])
def test_config_refuses_k1_in_the_loss_without_the_importance_ratio(tmp_path, name):
    """k1's gradient in the loss, d log pi, is zero in expectation without the ratio's
    score term (tests/ops/test_losses.py enumerates it): noise with no pull to the reference."""
    make = lambda **kw: grpotrl.GADConfig(output_dir=str(tmp_path), use_cpu=True, beta=0.1, **kw)  # noqa: E731
    with pytest.raises(InputError, match=r"kl_estimator='k1' in the loss with use_bias_correction_kl=False: .*"
                                         r"zero in expectation.*use_bias_correction_kl: true.*k1\+"):
        make(kl_estimator=name, use_bias_correction_kl=False)
    make(kl_estimator=name)  # with the ratio: the KL's gradient
    make(kl_estimator="k1+", use_bias_correction_kl=False)  # k2's gradient, the KL's
    make(kl_estimator="k3", use_bias_correction_kl=False)  # the other KL's gradient: allowed, documented
    # in the reward only k1's value counts, and it is unbiased
    make(kl_estimator=name, use_bias_correction_kl=False, use_kl_loss=False, use_kl_in_reward=True)


# ---------------------------------------------------------------- CLI, recipe, hooks

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2" / "gad_quickstart.yaml"


def test_gad_recipe_parses_into_gadconfig():
    from grpotrl import cli

    _, args, model_args = cli.parse_args("gad", ["--config", str(RECIPE), "--max_steps", "3"])
    assert type(args) is grpotrl.GADConfig and args.max_steps == 3 and args.discriminator_warmup_steps == 10
    assert args.use_cpu and not args.bf16 and model_args.model_name_or_path == "smollm2-135m-instruct"
    assert "grpotrl gad --config recipes/smollm2/gad_quickstart.yaml" in RECIPE.read_text()


def test_cli_gad_on_data_without_teacher_responses_stops_before_loading(capsys, monkeypatch):
    from grpotrl import cli

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the input check")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", no_load)  # every architecture class's
    with pytest.raises(SystemExit) as exit_:
        cli.main(["gad", "--config", str(RECIPE), "--dataset_name", "quickstart"])
    assert exit_.value.code == 2
    assert "teacher_response" in capsys.readouterr().err


# hook -> the parameter names GADTrainer's override was written against (TRL 1.16 / transformers 5)
GAD_HOOKS = {
    "_calculate_rewards": ["self", "inputs", "prompts", "completions", "completion_ids_list"],
    "_generate_and_score_completions": ["self", "inputs"],
    "_compute_loss": ["self", "model", "inputs"],
    "training_step": ["self", "model", "inputs", "num_items_in_batch"],
    "_prepare_inputs": ["self", "generation_batch"],
    "save_model": ["self", "output_dir", "_internal_call"],
    "_save_optimizer_and_scheduler": ["self", "output_dir"],
    "_load_optimizer_and_scheduler": ["self", "checkpoint"],
    "create_scheduler": ["self", "num_training_steps", "optimizer"],
    "_load_best_model": ["self"],
}


def test_trl_hooks_gad_overrides_are_unchanged():
    for name, want in GAD_HOOKS.items():
        assert list(inspect.signature(getattr(trl.GRPOTrainer, name)).parameters) == want, name
    # training_step during warmup keeps TRL's bookkeeping of these
    src = inspect.getsource(trl.GRPOTrainer.training_step)
    assert "self._step += 1" in src and "_current_train_step_time" in src
    assert "self.beta != 0.0" in inspect.getsource(trl.GRPOTrainer._compute_loss)  # beta=0 turns TRL's KL off


@pytest.mark.parametrize("text", ["\n\n2", "  \n2", " 27", "27"])
def test_I9_sequence_starts_with_the_rl_prompt_whatever_the_response_starts_with(text, smollm2_tokenizer):
    """Re-rendering the whole turn merged a leading '\\n\\n' with the generation prompt's newline
    and raised I2 mid-training; the response is now tokenized on its own after the RL prompt."""
    tok = smollm2_tokenizer
    p = templates.prompt_ids(tok, PROMPT)
    seq = gd.sequence_ids(tok, PROMPT, text)
    assert seq[:len(p)] == p and seq[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(seq[len(p):-1]) == text


def test_I9_a_truncated_student_response_gets_no_end_of_turn(smollm2_tokenizer):
    tok = smollm2_tokenizer
    reward = gd.DiscriminatorReward(None, tok, templates.stop_token_ids(tok))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert reward.finished([[5, 6, im_end], [5, 6], []]) == [True, False, False]
    done, cut = reward.sequences([PROMPT, PROMPT], ["27 is", "27 is"], finished=[True, False])
    assert done[-1] == im_end and cut == done[:-1]
