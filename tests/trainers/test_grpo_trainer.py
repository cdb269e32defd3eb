"""grpotrl.GRPOTrainer end to end on tiny models over the real SmolLM2 tokenizer: the guards
run on every step of a healthy run and pass, on batches with left-padded prompts of
different lengths, early stops, rows that never stop, and several stop ids."""

import pytest
import torch
import transformers
import trl
from conftest import arithmetic_prompts, length_reward, logged_max
from peft import LoraConfig

import grpotrl
from grpotrl import guards
from grpotrl.trainers import _intercept


class Observed(grpotrl.GRPOTrainer):
    """Keeps each microbatch the loss saw, to assert the run covered the hard cases."""

    def _compute_loss(self, model, inputs):
        self.seen = getattr(self, "seen", []) + [{k: inputs[k].detach().clone() for k in (
            "prompt_mask", "completion_ids", "completion_mask")}]
        return super()._compute_loss(model, inputs)


def _cases(seen, stop_ids):
    stop = torch.tensor(stop_ids)
    lengths, padded_prompts, no_stop = set(), False, False
    for b in seen:
        padded_prompts |= bool((b["prompt_mask"] == 0).any())
        for ids, m in zip(b["completion_ids"], b["completion_mask"]):
            n = int(m.sum())
            lengths.add(n)
            no_stop |= not bool(torch.isin(ids[:n], stop).any())
    return lengths, padded_prompts, no_stop


def test_I1_I3_I4_I5_healthy_run_passes_every_guard(tiny_llama, grpo_args):
    trainer = Observed(model=tiny_llama, reward_funcs=length_reward, args=grpo_args(max_steps=3),
                       train_dataset=arithmetic_prompts())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    lengths, padded_prompts, no_stop = _cases(trainer.seen, trainer.eos_token_ids)
    assert padded_prompts, "the batches must hold left-padded prompts"
    assert len(lengths) >= 3 and 1 <= min(lengths) < 12, f"need early stops at several lengths: {lengths}"
    assert logged_max(trainer) < 1e-5  # I5 in fp32
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed, "weights did not change"
    assert [h for h in trainer.state.log_history if "guards/logprob_max_gap" in h]


def test_I4_several_stop_ids_pad_equal_to_one_of_them(tiny_multistop, grpo_args):
    trainer = Observed(model=tiny_multistop, reward_funcs=length_reward, args=grpo_args(max_steps=3),
                       train_dataset=arithmetic_prompts())
    assert trainer.stop_token_ids == [0, 2]  # <|endoftext|> as eos, <|im_end|> from the template
    assert set(trainer.generation_config.eos_token_id) == {0, 2}
    trainer.train()
    finals = {int(ids[int(m.sum()) - 1]) for b in trainer.seen for ids, m in zip(b["completion_ids"],
                                                                                  b["completion_mask"])}
    assert {0, 2} <= finals, f"both stop ids should end some completion: {finals}"


def test_I5_positions_fixed_on_absolute_position_model(tiny_gpt2, grpo_args):
    """With generate's position ids, GPT-2's loss logprobs equal the recomputation (TRL's differ)."""
    trainer = grpotrl.GRPOTrainer(model=tiny_gpt2, reward_funcs=length_reward, args=grpo_args(),
                                  train_dataset=arithmetic_prompts())
    trainer.train()
    assert logged_max(trainer) < 1e-5


def test_I1_I3_I4_I5_streaming_dataset_trains_with_the_guards_on(tiny_llama, grpo_args):
    """An IterableDataset (streaming), as TRL takes it: checked on its first rows, guards on every step."""
    trainer = Observed(model=tiny_llama, reward_funcs=length_reward, args=grpo_args(max_steps=2),
                       train_dataset=arithmetic_prompts().to_iterable_dataset())
    trainer.train()
    assert trainer.state.global_step == 2 and len(trainer.seen) == 2
    assert len([h for h in trainer.state.log_history if "guards/logprob_max_gap" in h]) == 2


def test_dynamic_sampling_still_needs_a_map_style_dataset(tiny_llama, grpo_args):
    with pytest.raises(grpotrl.InputError, match="dynamic_sampling draws refill prompts by index"):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=grpo_args(dynamic_sampling=True),
                            train_dataset=arithmetic_prompts().to_iterable_dataset())


def test_I3_I4_I5_plain_text_prompts_on_a_tokenizer_without_chat_template(tiny_gpt2, grpo_args):
    """A base model's tokenizer (no chat template) and standard text prompts, as TRL takes them: no template
    is applied or required (I1's template comparison does not apply), the other guards hold."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_gpt2, padding_side="left", truncation_side="left")
    tok.chat_template = None
    rows = Dataset.from_list([{"prompt": "Q: what is " + "1 + " * (i % 4) + "2?\nA:"} for i in range(8)])
    trainer = grpotrl.GRPOTrainer(model=tiny_gpt2, processing_class=tok, args=grpo_args(max_steps=1),
                                  reward_funcs=lambda completions, **kw: [len(c) / 10.0 for c in completions],
                                  train_dataset=rows)
    trainer.train()
    assert trainer.state.global_step == 1 and logged_max(trainer) < 1e-5


def test_I5_is_not_checked_while_dropout_is_active(tiny_gpt2, grpo_args, caplog):
    """TRL's default disable_dropout=False on a model with dropout (GPT-2: 0.1): the loss's forward samples
    dropout masks, so there is no deterministic reference to compare with; said once, never an error."""
    import logging

    with caplog.at_level(logging.WARNING, logger="grpotrl"):
        trainer = grpotrl.GRPOTrainer(model=tiny_gpt2, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                                      args=grpo_args(disable_dropout=False, max_steps=2))
        trainer.train()
    assert trainer.state.global_step == 2
    assert not [h for h in trainer.state.log_history if "guards/logprob_max_gap" in h]
    assert sum("I5 (and the I7 entropy values) are not checked while dropout is active" in r.getMessage()
               for r in caplog.records) == 1


def test_I5_disable_dropout_zeroes_the_attention_modules_own_dropout_and_the_guard_runs(tiny_llama, grpo_args):
    """A Llama whose config sets attention_dropout 0.1: its attention modules hand that number to the attention
    function in training mode, which TRL's disable_dropout (nn.Dropout layers only) leaves on. Under
    disable_dropout=True grpotrl zeroes it in the policy and the reference, so the loss scores the function
    that sampled and I5 runs; the saved config keeps the user's 0.1."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, attention_dropout=0.1)
    trainer = grpotrl.GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                                  args=grpo_args(max_steps=1))
    for m in (trainer.model, trainer.ref_model):
        assert [x.attention_dropout for x in m.modules() if hasattr(x, "attention_dropout")] == [0.0, 0.0]
    trainer.train()
    assert logged_max(trainer) < 1e-4
    assert trainer.model.config.attention_dropout == 0.1


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_I5_recompute_logits_are_freed_before_the_loss_forward(tiny_llama, grpo_args, monkeypatch, bf16):
    """On a guard step I5's padded recompute (its [B, C, V] logits) runs before the loss's forward and its logits
    are gone when that forward starts: read next to the loss's autograd graph, they and what the guard step reads
    from them (the logit signals, the scale, the temperature slope, the entropies) raised a guard step's peak
    over a later step's (an H100 in bf16 at 8 x 8 x 256: 1.250x plain TRL's peak, against 1.034x after the guard
    steps). I5 and I7 still compare (the metrics are logged, in fp32 and in bf16, where the slope is read)."""
    import weakref

    events, alive = [], []
    recompute = guards.recompute_logprobs

    def spy_recompute(*args, **kwargs):
        out = recompute(*args, **kwargs)
        events.append("recompute")
        alive.append(weakref.ref(out[2]))  # the [B, C, V] logits
        return out

    forward = grpotrl.GRPOTrainer._get_per_token_logps_and_entropies

    def spy_forward(self, model, *args, **kwargs):
        if torch.is_grad_enabled():  # the loss's forward (the reference and old-policy forwards run under no_grad)
            events.append("loss")
            assert alive and all(ref() is None for ref in alive), "I5's recompute logits outlived it"
        return forward(self, model, *args, **kwargs)

    monkeypatch.setattr(guards, "recompute_logprobs", spy_recompute)
    monkeypatch.setattr(grpotrl.GRPOTrainer, "_get_per_token_logps_and_entropies", spy_forward)
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                                  args=grpo_args(guard_steps=-1, max_steps=2, bf16=bf16, entropy_coef=0.01))
    assert trainer.guard_tolerances.low_precision == bf16
    trainer.train()
    assert events and events[0] == "recompute" and events.count("recompute") == events.count("loss"), events
    assert all(a == "recompute" and b == "loss" for a, b in zip(events[::2], events[1::2])), events
    logged = [h for h in trainer.state.log_history if "guards/logprob_max_gap" in h]
    assert len(logged) == 2 and all("logits/top5_mass" in h for h in logged), logged


def test_default_guard_schedule_runs_first_steps_only(tiny_llama, grpo_args):
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward,
                                  args=grpo_args(guard_steps=1, max_steps=2), train_dataset=arithmetic_prompts())
    trainer.train()
    guarded = [h["step"] for h in trainer.state.log_history if "guards/logprob_max_gap" in h]
    assert guarded == [1]


def test_drop_in_for_trl_config(tiny_llama, tmp_path):
    """A user's TRL config works unchanged; grpotrl's defaults differ only where documented."""
    args = grpotrl.GRPOConfig(output_dir=str(tmp_path))
    assert isinstance(args, trl.GRPOConfig)
    assert args.bf16 is False and args.disable_dropout is True and args.guard_steps == 2
    assert issubclass(grpotrl.GRPOTrainer, trl.GRPOTrainer) and issubclass(grpotrl.SFTTrainer, trl.SFTTrainer)


class EmbeddingHooks(transformers.TrainerCallback):
    """The number of forward hooks on the model's input embeddings at each step's end."""

    def __init__(self):
        self.counts = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.counts.append(len(model.get_input_embeddings()._forward_hooks))


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_a_checkpointed_run_keeps_its_input_embedding_hooks_where_trl_stacks_two_a_step(tiny_llama, grpo_args, peft):
    """TRL switches gradient checkpointing off and back on around generate and around the rollout's no-grad logprob
    forwards; transformers' switch on adds a hook on the input embeddings and its switch off leaves it, so plain
    TRL's model gains two hooks a step that every forward calls (and a compiled decoding step recompiles on). This
    test fails on the TRL side once transformers or TRL stop stacking them: then ``skip_stacked_input_grad_hooks``
    can go."""
    extra = {"peft_config": LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")} if peft else {}
    common = dict(output_dir=grpo_args().output_dir, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=8, max_steps=3, logging_steps=1, report_to="none", use_cpu=True,
                  save_strategy="no", beta=0.04, seed=0, bf16=False)
    counts = {}
    for name, cls, args in (("trl", trl.GRPOTrainer, trl.GRPOConfig(**common)),
                            ("grpotrl", grpotrl.GRPOTrainer, grpo_args(**common))):
        hooks = EmbeddingHooks()
        trainer = cls(model=tiny_llama, reward_funcs=length_reward, args=args, train_dataset=arithmetic_prompts(),
                      callbacks=[hooks], **extra)
        assert trainer.args.gradient_checkpointing
        trainer.train()
        counts[name] = hooks.counts
    trl_counts = counts["trl"]
    assert [b - a for a, b in zip(trl_counts, trl_counts[1:])] == [2, 2], counts
    assert len(set(counts["grpotrl"])) == 1 and counts["grpotrl"][0] <= trl_counts[0], counts
    # grpotrl's: what TRL's held before its first step's two switches (full: 1; LoRA: 2, one more from TRL's init)
    assert counts["grpotrl"] == [trl_counts[0] - 2] * 3, counts


def test_guard_record_helpers_restore_attributes(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with _intercept.record_generate(model) as calls:
        model.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    assert len(calls) == 1 and calls[0]["output"].shape[1] == 5
    assert "generate" not in vars(model)


def test_check_logprobs_reports_row_and_token(smollm2_tokenizer):
    used = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.0, -2.5]])
    with pytest.raises(grpotrl.InvariantError, match="completion token 1"):
        guards.check_logprobs(smollm2_tokenizer, used, ref, torch.ones(1, 2), torch.tensor([[5, 6]]),
                              0.7, 1e-5, [0])


def test_I3_loss_completion_must_be_the_generated_one(smollm2_tokenizer):
    generated = [[520, 33, 2]]
    guards.check_same_completions(smollm2_tokenizer, [[1, 2]], generated, torch.tensor([[520, 33, 2, 2]]), [0])
    with pytest.raises(grpotrl.InvariantError, match="other completion ids"):  # shifted by one prompt token
        guards.check_same_completions(smollm2_tokenizer, [[1, 2]], generated, torch.tensor([[198, 520, 33, 2]]),
                                      [0])


@pytest.mark.parametrize("shared", [{"num_iterations": 2}, {"steps_per_generation": 2}])
def test_I1_I11_an_evaluation_between_two_steps_on_one_generation_batch_leaves_its_guard_record(
        tiny_llama, grpo_args, shared):
    """Two optimizer steps train on one generation batch (``num_iterations=2``, or ``steps_per_generation=2`` over
    a window of 1) and an evaluation on other prompts runs between them. Its generation batch must not replace
    the training batch's record: step 2's microbatches are checked (I1/I3/I4, and I11's dapo window tokens)
    against the batch they come from, and pass; the eval batch keeps its own."""
    from datasets import Dataset

    evaluation = Dataset.from_list([{"prompt": [{"role": "user", "content": "Name a colour of the sky at dusk, in "
                                                                               "one word please."}]}] * 8)
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                                  eval_dataset=evaluation,
                                  args=grpo_args(max_steps=2, loss_type="dapo", eval_strategy="steps", eval_steps=1,
                                                 per_device_eval_batch_size=8, **shared))
    trainer.train()
    assert trainer.state.global_step == 2
    assert len([h for h in trainer.state.log_history if "eval_loss" in h]) == 2  # after step 1 and step 2
    checked = [h["guards/denominator_max_rel_error"] for h in trainer.state.log_history
               if "guards/denominator_max_rel_error" in h]
    assert len(checked) == 2 and max(checked) < 1e-4  # I11 ran on both steps, on the training batch's tokens
    train, evaluated = trainer.hook_record.batch("train"), trainer.hook_record.batch("eval")
    assert train.guard is not None and evaluated.guard is not None and train.guard is not evaluated.guard
    assert evaluated.window_tokens is None  # I11 is a training check


def test_I2_a_push_to_hub_during_grpo_training_uploads_the_fingerprint_with_the_weights(tiny_llama, grpo_args,
                                                                                      hub_uploads):
    """push_to_hub with checkpoints: each save copies the checkpoint's weights, config and tokenizer to output_dir
    and uploads that folder; GRPO's fingerprint (the template its prompts were rendered with) must go with them,
    as SFT's does, or a run trained from the Hub repo finds none."""
    from grpotrl.chat import templates

    args = grpo_args(max_steps=1, save_strategy="steps", save_steps=1, push_to_hub=True, hub_model_id="me/grpo")
    grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args,
                        train_dataset=arithmetic_prompts()).train()
    assert len(hub_uploads) == 1 and "model.safetensors" in hub_uploads[0], hub_uploads
    assert templates.FINGERPRINT_FILE in hub_uploads[0], hub_uploads
