"""Fails loudly if a TRL hook grpotrl overrides or relies on changes name or signature.

grpotrl is pinned to trl 1.16.x (setup.cfg). When TRL moves, this file says which hook moved
before any trainer silently stops being guarded."""

import inspect

import trl

import grpotrl

# hook -> the parameter names grpotrl's override was written against
GRPO_HOOKS = {
    "_generate": ["self", "prompts"],
    "_generate_and_score_completions": ["self", "inputs"],
    "_compute_loss": ["self", "model", "inputs"],
    "_get_per_token_logps_and_entropies": [
        "self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
        "compute_aux_loss", "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
        "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
    ],
    "_generate_single_turn": ["self", "prompt_ids", "images", "multimodal_fields", "num_generations",
                              "has_tool_images"],
    "_tokenize_prompts": ["self", "prompts"],
    "_calculate_rewards": ["self", "inputs", "prompts", "completions", "completion_ids_list"],
    "training_step": ["self", "model", "inputs", "num_items_in_batch"],
    "_load_optimizer_and_scheduler": ["self", "checkpoint"],
    "_save_checkpoint": ["self", "model", "trial"],
    "save_model": ["self", "output_dir", "_internal_call"],
    "train": ["self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"],
    "_load_from_checkpoint": ["self", "resume_from_checkpoint", "model"],
}
SFT_HOOKS = {
    "compute_loss": ["self", "model", "inputs", "return_outputs", "num_items_in_batch"],
    "_prepare_dataset": ["self", "dataset", "processing_class", "args", "packing", "formatting_func", "dataset_name"],
    "save_model": ["self", "output_dir", "_internal_call"],
    "train": ["self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"],
    "_load_from_checkpoint": ["self", "resume_from_checkpoint", "model"],
}


def _params(cls, name):
    assert hasattr(cls, name), f"{cls.__name__}.{name} no longer exists in trl {trl.__version__}"
    return list(inspect.signature(getattr(cls, name)).parameters)


def test_trl_version_is_the_tested_minor():
    assert trl.__version__.startswith("1.16."), f"grpotrl was tested on trl 1.16.x, found {trl.__version__}"


def test_grpo_hooks_unchanged():
    for name, want in GRPO_HOOKS.items():
        assert _params(trl.GRPOTrainer, name) == want, f"trl.GRPOTrainer.{name} changed signature"


def test_sft_hooks_unchanged():
    for name, want in SFT_HOOKS.items():
        assert _params(trl.SFTTrainer, name) == want, f"trl.SFTTrainer.{name} changed signature"


def test_fused_head_still_used_for_logprobs():
    """The position-id pre-hook keys on TRL calling the model with ``fused_lm_head=True``."""
    src = inspect.getsource(trl.GRPOTrainer._get_per_token_logps_and_entropies)
    assert "fused_lm_head=True" in src


def test_our_overrides_keep_the_signatures():
    for name in ("_generate", "_generate_and_score_completions", "_compute_loss", "save_model"):
        assert _params(grpotrl.GRPOTrainer, name) == GRPO_HOOKS[name]
    for name in ("compute_loss", "_prepare_dataset", "save_model"):
        assert _params(grpotrl.SFTTrainer, name) == SFT_HOOKS[name]


def test_sft_preparation_state_grpotrl_reads():
    """grpotrl.SFTTrainer._prepare_dataset runs inside trl's __init__ and reads what trl set before
    it: the resolved completion_only_loss, the {% generation %} template, the tokenizer, _is_vlm; and
    trl's own preparation must still take rows with input_ids as tokenized (labels from the masks)."""
    init = inspect.getsource(trl.SFTTrainer.__init__)
    order = [init.index(n) for n in ("self._tokenizer = processing_class", "self.chat_template = ",
                                     "self.completion_only_loss = ", "train_dataset = self._prepare_dataset(")]
    assert order == sorted(order)
    prep = inspect.getsource(trl.SFTTrainer._prepare_dataset)
    assert 'is_processed = "input_ids" in column_names' in prep and '"completion_mask"' in prep


def test_entropy_bonus_state_grpotrl_reads_and_toggles():
    """I7 (grpotrl.GRPOTrainer.entropy_coef_in_force) and MultiTaskGRPOTrainer's per-term losses
    read and temporarily set these attributes of TRL's loss; the bonus must still be ``- c * H``."""
    src = inspect.getsource(trl.GRPOTrainer._compute_loss)
    for needle in ("self._entropy_bonus_enabled", "self.use_adaptive_entropy", "self._last_world_entropy",
                   "self.entropy_coef", "self.beta", "loss = loss - apply_coef * entropy_loss",
                   "self._get_per_token_logps_and_entropies(", "advantages = inputs[\"advantages\"]"):
        assert needle in src, f"trl.GRPOTrainer._compute_loss no longer has {needle!r}"
    init = inspect.getsource(trl.GRPOTrainer.__init__)
    assert "self._entropy_bonus_enabled = " in init and "self._last_world_entropy = " in init


def test_returned_loss_is_backpropagated_unscaled():
    """CAGrad exact adds its direction to .grad on the scale of the returned loss: the Trainer
    must not divide GRPO's loss by the accumulation steps again."""
    assert trl.GRPOTrainer.loss_is_scaled_for_ga is True


def test_generate_builds_its_processor_list_in_get_logits_processor():
    """processors.after_warpers shadows ``_get_logits_processor`` so the sampler-logprob recorder
    runs after transformers' warpers (issue 17); generate must still build its list there, from
    the caller's ``logits_processor``, and sample from what that list returns."""
    from transformers import GenerationMixin

    src = inspect.getsource(GenerationMixin.generate)
    assert "self._get_logits_processor(" in src and "logits_processor=logits_processor" in src
    sample = inspect.getsource(GenerationMixin._sample)
    assert "next_token_scores = logits_processor(input_ids, next_token_logits)" in sample
    assert "probs = nn.functional.softmax(next_token_scores, dim=-1)" in sample
