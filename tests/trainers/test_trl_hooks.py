"""Fails loudly if a TRL hook grpotrl overrides or relies on changes name or signature.

grpotrl is pinned to trl 1.16.x (setup.cfg). When TRL moves, this file says which hook moved
before any trainer silently stops being guarded: every TRL hook the trainers override, every TRL
method or model method grpotrl wraps at run time (``grpotrl/trainers/_intercept.py``), every
private TRL attribute it reads or sets, and the layout of the tuples it indexes."""

import inspect
import re

import torch
import trl
from transformers import AutoModelForCausalLM

import grpotrl
from grpotrl.ops.loss_types import LOSS_TYPES, Normaliser, PerToken
from grpotrl.trainers import _intercept

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
    "prediction_step": ["self", "model", "inputs", "prediction_loss_only", "ignore_keys"],
    "_load_optimizer_and_scheduler": ["self", "checkpoint"],
    "_save_checkpoint": ["self", "model", "trial"],
    "_push_from_checkpoint": ["self", "checkpoint_folder"],  # _common.CheckedResume: the fingerprint uploaded
    "_finalize_training": ["self", "trial", "num_train_samples", "start_time"],  # the end cleanup, this run's only
    "save_model": ["self", "output_dir", "_internal_call"],
    "train": ["self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"],
    "_load_from_checkpoint": ["self", "resume_from_checkpoint", "model"],
    "compute_loss": ["self", "model", "inputs", "return_outputs", "num_items_in_batch"],
    # GADTrainer's (create_scheduler, the optimizer save/load and the best model's load are transformers.Trainer's)
    "_prepare_inputs": ["self", "generation_batch"],
    "create_scheduler": ["self", "num_training_steps", "optimizer"],
    "_save_optimizer_and_scheduler": ["self", "output_dir"],
    "_load_best_model": ["self"],  # load_best_model_at_end: D from the best checkpoint too
}
SFT_HOOKS = {
    "compute_loss": ["self", "model", "inputs", "return_outputs", "num_items_in_batch"],
    "_prepare_dataset": ["self", "dataset", "processing_class", "args", "packing", "formatting_func", "dataset_name"],
    "save_model": ["self", "output_dir", "_internal_call"],
    "train": ["self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"],
    "_load_from_checkpoint": ["self", "resume_from_checkpoint", "model"],
    "_save_checkpoint": ["self", "model", "trial"],  # _common.CheckedResume: a full disk named
    "_push_from_checkpoint": ["self", "checkpoint_folder"],  # the template fingerprint uploaded with the weights
    "_finalize_training": ["self", "trial", "num_train_samples", "start_time"],  # the end cleanup, this run's only
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


def test_fused_head_backward_reads_needs_input_grad_when_it_runs():
    """``_intercept.skip_head_weight_grad`` (CAGrad low_memory) relies on TRL's fused head: its backward
    node's name, the weight and bias at input/saved positions 1 and 2, and a backward that reads
    ``ctx.needs_input_grad`` when it runs, returning no weight gradient when that flag is off."""
    import torch
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    from grpotrl.trainers._intercept import FUSED_HEAD_NODE, HEAD_BIAS, HEAD_WEIGHT

    assert list(inspect.signature(ChunkedLogProbFunction.forward).parameters)[:4] == ["ctx", "hidden", "weight",
                                                                                     "bias"]
    hidden, weight, bias = torch.randn(3, 4, requires_grad=True), torch.randn(6, 4, requires_grad=True), torch.randn(6)
    logps = ChunkedLogProbFunction.apply(hidden, weight, bias, torch.tensor([0, 5, 2]), 1.0, 4)[0]
    node = logps.grad_fn
    assert type(node).__name__ == FUSED_HEAD_NODE
    assert node.saved_tensors[HEAD_WEIGHT] is weight and torch.equal(node.saved_tensors[HEAD_BIAS], bias)
    assert node.needs_input_grad[:3] == (True, True, False)
    with torch.no_grad():  # as the autograd engine runs a backward
        full = node.apply(torch.ones(3), None)
        assert full[HEAD_WEIGHT] is not None
        node.needs_input_grad = (True, False, *node.needs_input_grad[2:])
        skipped = node.apply(torch.ones(3), None)
    assert skipped[HEAD_WEIGHT] is None and torch.equal(skipped[0], full[0])


def test_our_overrides_keep_the_signatures():
    for name in ("_generate", "_generate_and_score_completions", "_compute_loss", "compute_loss", "save_model",
                 "_get_per_token_logps_and_entropies",  # padding_free's packed forward
                 "_prepare_inputs",  # balance_microbatches
                 "training_step", "prediction_step"):  # the head's CPU tiles
        assert _params(grpotrl.GRPOTrainer, name) == GRPO_HOOKS[name]
    for name in ("_calculate_rewards", "_generate_and_score_completions", "_compute_loss", "training_step",
                 "create_scheduler", "save_model", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler",
                 "_load_best_model"):
        assert _params(grpotrl.GADTrainer, name) == GRPO_HOOKS[name], f"GADTrainer.{name}"
    for name in ("compute_loss", "_prepare_dataset", "save_model"):
        assert _params(grpotrl.SFTTrainer, name) == SFT_HOOKS[name]
    for name in ("_save_checkpoint", "_load_from_checkpoint", "_finalize_training"):  # _common.CheckedResume
        assert _params(grpotrl.GRPOTrainer, name) == GRPO_HOOKS[name], f"GRPOTrainer.{name}"
        assert _params(grpotrl.SFTTrainer, name) == SFT_HOOKS[name], f"SFTTrainer.{name}"


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
                   "self._get_per_token_logps_and_entropies(", "advantages = inputs[\"advantages\"]",
                   "if self.aux_loss_enabled:"):
        assert needle in src, f"trl.GRPOTrainer._compute_loss no longer has {needle!r}"
    init = inspect.getsource(trl.GRPOTrainer.__init__)
    assert "self._entropy_bonus_enabled = " in init and "self._last_world_entropy = " in init
    assert "self.aux_loss_enabled = " in init  # MultiTaskGRPOTrainer._policy_only turns the MoE aux loss off per term


def test_returned_loss_is_backpropagated_unscaled():
    """CAGrad exact adds its direction to .grad on the scale of the returned loss: the Trainer
    must not divide GRPO's loss by the accumulation steps again."""
    assert trl.GRPOTrainer.loss_is_scaled_for_ga is True


def test_generate_builds_its_processor_list_in_get_logits_processor():
    """_intercept.inject_recorders_after_warpers shadows ``_get_logits_processor`` so the sampler-logprob
    recorder runs after transformers' warpers; generate must still build its list there, from
    the caller's ``logits_processor``, and sample from what that list returns."""
    from transformers import GenerationMixin

    src = inspect.getsource(GenerationMixin.generate)
    assert "self._get_logits_processor(" in src and "logits_processor=logits_processor" in src
    sample = inspect.getsource(GenerationMixin._sample)
    assert "next_token_scores = logits_processor(input_ids, next_token_logits)" in sample
    assert "probs = nn.functional.softmax(next_token_scores, dim=-1)" in sample


def test_decoding_loop_pads_finished_rows_as_skip_finished_rows_expects():
    """``_intercept.skip_finished_rows`` (padding_free's rollout) shadows ``_get_stopping_criteria`` to see each
    step's stopping decision, drops the finished rows from the model's forward and its ``cache`` argument, and
    hands back zeros as their logits: transformers' loop must still build its criteria there, stop rows with
    ``unfinished & ~criteria``, pad every finished row whatever its logits, and call the model on keyword
    arguments (forward hooks see them) with the cache named ``cache``."""
    from transformers import GenerationMixin
    from transformers.generation.configuration_utils import GenerationMode
    from transformers.generation.utils import GENERATION_MODES_MAPPING

    assert list(inspect.signature(GenerationMixin._get_stopping_criteria).parameters)[:3] == [
        "self", "generation_config", "stopping_criteria"]
    assert "self._get_stopping_criteria(" in inspect.getsource(GenerationMixin.generate)
    assert GENERATION_MODES_MAPPING[GenerationMode.SAMPLE] == GENERATION_MODES_MAPPING[GenerationMode.GREEDY_SEARCH] \
        == "_sample"
    sample = inspect.getsource(GenerationMixin._sample)
    assert "unfinished_sequences = unfinished_sequences & ~stopping_criteria(input_ids, scores)" in sample
    assert "next_tokens = next_tokens * unfinished_sequences + pad_token_id * (1 - unfinished_sequences)" in sample
    assert 'has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)' \
        in sample
    assert "outputs = model_forward(**model_inputs, return_dict=True)" in sample
    assert 'model_inputs["cache"] = cache' in inspect.getsource(GenerationMixin.prepare_inputs_for_generation)


def test_generate_return_tuple_layout():
    """``_intercept.TRLGenerate`` names the positions of ``_generate``'s tuple (grpotrl replaces its
    ``logprobs`` and reads ``prompt_ids``, ``completion_ids``, ``tool_mask``, ``completions``): TRL
    must still return, and unpack, exactly these in this order."""
    from grpotrl.trainers._intercept import TRLGenerate

    fields = list(TRLGenerate._fields)
    assert fields == ["prompt_ids", "completion_ids", "tool_mask", "completions", "logprobs", "extra_fields", "images",
                      "tool_images"]
    assert "return " + ", ".join(fields) in inspect.getsource(trl.GRPOTrainer._generate)
    src = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    unpacked = src[:src.index(") = self._generate(prompts)")].rsplit("(", 1)[1]
    assert [x.strip() for x in unpacked.split(",") if x.strip()] == [
        "prompt_ids_list", "completion_ids_list", "tool_mask_list", "completions", "sampling_per_token_logps_list",
        "extra_fields", "images", "tool_images"]


def test_methods_wrapped_at_run_time_are_still_called_where_grpotrl_wraps_them():
    """``_intercept.record_calls`` on ``_calculate_rewards`` (inside ``_generate_and_score_completions``, its
    result [N_global, n_funcs] gathered) and on ``_get_per_token_logps_and_entropies`` (inside
    ``_compute_loss``, ``(logps, entropies, ...)``); ``record_generate`` on the unwrapped policy's
    ``generate`` (inside ``_generate``, through ``_generate_single_turn`` and the tool loop)."""
    score = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    assert "self._calculate_rewards(inputs, prompts, completions, completion_ids_list)" in score
    rewards = inspect.getsource(trl.GRPOTrainer._calculate_rewards)
    assert "rewards_per_func = gather(rewards_per_func)\n        return rewards_per_func" in rewards
    loss = inspect.getsource(trl.GRPOTrainer._compute_loss)
    assert "per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(" in loss
    single = inspect.getsource(trl.GRPOTrainer._generate_single_turn)
    assert "unwrapped_model.generate(" in single and "self.model_wrapped" in single


def test_private_trl_state_grpotrl_reads_and_sets():
    """Attributes of trl.GRPOTrainer that grpotrl.GRPOTrainer reads (or, for eos_token_ids,
    generation_kwargs and the vLLM generation kwargs, extends) after TRL's __init__."""
    init = inspect.getsource(trl.GRPOTrainer.__init__)
    for needle in ("self.eos_token_ids = ", "self.generation_config = ", "self.generation_kwargs = ",
                   "self.rollout_func = ", "self.use_transformers_continuous_batching = ", "self._is_vlm = ",
                   "self.environment_factories = ", "self._env_tools = ", "self.vllm_generation = ",
                   "self.mask_truncated_completions = ", "self.reward_weights = ", "self.chat_template_kwargs = ",
                   "self.num_generations = ", "self.temperature = ", "self.max_completion_length = ",
                   "self.ref_model = ", "self._metrics = ", "self.loss_type = ", "self.importance_sampling_level = ",
                   "self._tokenizer = "):
        assert needle in init, f"trl.GRPOTrainer.__init__ no longer sets {needle!r}"
    prepare = inspect.getsource(trl.GRPOTrainer._prepare_inputs)
    assert "self._batch_environments" in inspect.getsource(trl.GRPOTrainer) and "self._buffered_inputs" in prepare
    # balance_microbatches regroups the buffer TRL just cut, then picks the microstep's slice as TRL does
    for needle in ("generation_batch = shuffle_sequence_dict(generation_batch)",
                   "split_tensor_dict(generation_batch, self.args.steps_per_generation)",
                   "inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]"):
        assert needle in prepare, f"trl.GRPOTrainer._prepare_inputs no longer has {needle!r}"


def test_gad_relies_on_trl_training_step_bookkeeping():
    """GADTrainer.training_step (discriminator warmup) runs ``_prepare_inputs`` without a loss and
    restates TRL's step bookkeeping (``_intercept.set_microstep_done``): ``_step`` counts microsteps for
    the generation schedule, and ``step_time`` is logged from ``_current_train_step_time`` once per
    accumulation window."""
    src = inspect.getsource(trl.GRPOTrainer.training_step)
    for needle in ("self._step += 1", "self._current_train_step_time += time_after - time_before",
                   "if self._step % self.current_gradient_accumulation_steps == 0:",
                   'self._metrics["train"]["step_time"].append(self._current_train_step_time)',
                   "self._current_train_step_time = 0.0"):
        assert needle in src, f"trl.GRPOTrainer.training_step no longer has {needle!r}"
    prepare = inspect.getsource(trl.GRPOTrainer._prepare_inputs)
    assert "self._generate_and_score_completions(" in prepare and "self._step % " in prepare
    gad = inspect.getsource(grpotrl.GADTrainer.training_step)
    assert "self._prepare_inputs(inputs)" in gad and "_intercept.set_microstep_done(self, " in gad
    ours = inspect.getsource(_intercept.set_microstep_done)  # the same lines on trainer.*
    for needle in ("trainer._step += 1", "trainer._current_train_step_time += seconds",
                   "if trainer._step % trainer.current_gradient_accumulation_steps == 0:",
                   'trainer._metrics["train"]["step_time"].append(trainer._current_train_step_time)',
                   "trainer._current_train_step_time = 0.0"):
        assert needle in ours


def test_gad_kl_reduction_restates_trl_per_loss_type():
    """``ops.reduction.aggregate_like_trl`` (GAD adds its KL term through it) restates TRL's reduction of
    its per-token loss (the importance ratio of ``use_bias_correction_kl`` is GAD's own, per token:
    ``losses.kl_loss_term``): TRL's reductions must read as they did, one per loss_type grpotrl knows."""
    from grpotrl.ops import reduction

    src = inspect.getsource(trl.GRPOTrainer._compute_loss)
    for needle in (
        'if self.loss_type in ["grpo", "sapo"]:',
        "loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()",
        'elif self.loss_type == "bnpo":', "loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)",
        'elif self.loss_type == "dr_grpo":',
        "loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * self.max_completion_length)",
        'elif self.loss_type in ["cispo", "dapo", "vespo"]:',
        'normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes',
        "normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation",
        'elif self.loss_type == "luspo":', "loss = (per_token_loss * mask).sum(-1).mean()",
        "normalizer = self.current_gradient_accumulation_steps if mode == \"train\" else 1.0",
        "if self.args.use_bias_correction_kl:",  # the field GADConfig reads with TRL's meaning
    ):
        assert needle in src, f"trl.GRPOTrainer._compute_loss no longer has {needle!r}"
    known = {"grpo", "sapo", "bnpo", "dr_grpo", "cispo", "dapo", "vespo", "luspo"}
    assert set(LOSS_TYPES) == known
    # every normaliser of the table has its branch in grpotrl's reduction
    assert all(f"Normaliser.{n.name}" in inspect.getsource(reduction.reduce_rows) for n in Normaliser)
    start = src.index('if self.loss_type in ["grpo", "sapo"]:')
    reduced = src[start:src.index('raise ValueError(f"Unknown loss type', start)]  # the reduction's branches
    trl_types = set(re.findall(r'"(\w+)"', " ".join(re.findall(r"self\.loss_type (?:==|in) ([^:]+):", reduced))))
    assert trl_types == known, f"TRL's loss types changed: {sorted(trl_types ^ known)}"


def _trl_loss_type_choices() -> set[str]:
    """The ``loss_type`` values TRL 1.16 accepts: the ``GRPOConfig`` field's ``choices`` where TRL declares
    them, else the help's "Supported values are ..." sentence (TRL 1.16 has no choices, and refuses any
    other value only in ``_compute_loss``'s ``Unknown loss type``)."""
    import dataclasses

    field = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}["loss_type"]
    if "choices" in field.metadata:
        return set(field.metadata["choices"])
    sentence = re.search(r"Supported values are (.+?)\.\s", field.metadata["help"])
    assert sentence, f"trl.GRPOConfig.loss_type's help no longer lists its values: {field.metadata['help']!r}"
    return set(re.findall(r"'(\w+)'", sentence.group(1)))


def _trl_loss_type_branches(start: str) -> list[tuple[set[str], str]]:
    """``(loss types, body)`` per branch of the ``self.loss_type`` chain of ``trl.GRPOTrainer._compute_loss``
    that opens with ``start``, up to its ``Unknown loss type`` error."""
    src = inspect.getsource(trl.GRPOTrainer._compute_loss)
    assert start in src, f"trl.GRPOTrainer._compute_loss no longer has {start!r}"
    chain = src[src.index(start):src.index('raise ValueError(f"Unknown loss type', src.index(start))]
    branches = []
    for line in chain.splitlines():
        test = re.match(r"\s*(?:if|elif) self\.loss_type (?:==|in) (.+):$", line)
        if test:
            branches.append((set(re.findall(r'"(\w+)"', test.group(1))), ""))
        elif branches:
            branches[-1] = (branches[-1][0], branches[-1][1] + line + "\n")
    return branches


def _branch_kind(body: str, needles: dict) -> object:
    """The one table value whose TRL line ``body`` holds (``needles``: TRL's line -> table value)."""
    found = [kind for needle, kind in needles.items() if needle in body]
    assert len(found) == 1, f"a loss_type branch of trl.GRPOTrainer._compute_loss reads unlike the table:\n{body}"
    return found[0]


def test_loss_type_table_is_trls_choices():
    """``ops.loss_types.LOSS_TYPES`` holds exactly TRL 1.16's ``loss_type`` choices: a loss type TRL adds
    (or drops) fails here, before a run trains on a loss grpotrl's guards and restatements do not know."""
    table, trl_choices = set(LOSS_TYPES), _trl_loss_type_choices()
    assert table == trl_choices, (f"TRL's loss_type choices and grpotrl's table differ: only TRL's "
                                  f"{sorted(trl_choices - table)}, only grpotrl's {sorted(table - trl_choices)}")
    for start in ('if self.loss_type == "cispo":', 'if self.loss_type in ["grpo", "sapo"]:'):
        branched = set().union(*(names for names, _ in _trl_loss_type_branches(start)))
        assert branched == table, f"TRL's _compute_loss branches on {sorted(branched ^ table)} unlike the table"


def test_loss_type_table_takes_trls_branch_per_loss_type():
    """Each table entry's ``per_token`` and ``normaliser`` are the branches TRL 1.16's ``_compute_loss``
    takes for that name (told apart by one TRL line each), and ``folds_sampler_ratio`` holds for exactly
    the loss types TRL exempts from multiplying the per-token loss by vLLM's importance ratio."""
    per_token = {"torch.clamp(coef_1, max=self.epsilon_high).detach()": PerToken.CISPO,
                 "per_token_loss = -torch.min(per_token_loss1, per_token_loss2)": PerToken.CLIPPED,
                 "torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures": PerToken.SAPO,
                 "phi_seq = self.get_gamma_weights(": PerToken.VESPO}
    normaliser = {
        "loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()": Normaliser.ROW_TOKEN_MEAN,
        "loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)": Normaliser.MICROBATCH_TOKENS,
        "(per_token_loss.size(0) * self.max_completion_length)": Normaliser.MAX_LENGTH_ROWS,
        "loss = (per_token_loss * mask).sum(-1).mean()": Normaliser.ROWS,
        'normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes':
            Normaliser.WINDOW_TOKENS}
    for start, needles, field in (('if self.loss_type == "cispo":', per_token, "per_token"),
                                  ('if self.loss_type in ["grpo", "sapo"]:', normaliser, "normaliser")):
        for names, body in _trl_loss_type_branches(start):
            kind = _branch_kind(body, needles)
            for name in names:
                assert getattr(LOSS_TYPES[name], field) is kind, (name, field, kind)
    src = inspect.getsource(trl.GRPOTrainer._compute_loss)
    exempt = re.findall(r"if self\.use_vllm and self\.vllm_importance_sampling_correction and "
                        r'self\.loss_type != "(\w+)":', src)
    assert exempt and {t.name for t in LOSS_TYPES.values() if t.folds_sampler_ratio} == set(exempt), exempt
    assert 'importance_sampling_ratio=inputs.get("importance_sampling_ratio")' in src  # the folded ratio, if any


def test_gad_reference_forward_and_adapter_helper():
    """GAD computes reference logprobs with TRL's ``_get_per_token_logps_and_entropies`` under
    ``trl.trainer.utils.use_adapter`` (PEFT: adapter off, or the ``ref`` adapter), as TRL does."""
    from trl.trainer.utils import use_adapter

    assert list(inspect.signature(use_adapter).parameters) == ["model", "adapter_name"]
    assert "use_adapter(" in inspect.getsource(trl.GRPOTrainer)


# TRL's private fields each ``_intercept`` helper reads or writes -> the TRL method whose source sets them
INTERCEPT_FIELDS = {
    "read_tokenizer": {"_tokenizer": [trl.GRPOTrainer.__init__, trl.SFTTrainer.__init__]},
    "read_is_vlm": {"_is_vlm": [trl.GRPOTrainer.__init__, trl.SFTTrainer.__init__]},
    "read_row_tools": {"_env_tools": [trl.GRPOTrainer.__init__], "_batch_environments": [trl.GRPOTrainer]},
    "read_tool_sets": {"_env_tools": [trl.GRPOTrainer.__init__]},
    "read_entropy_bonus": {"_entropy_bonus_enabled": [trl.GRPOTrainer.__init__],
                           "_last_world_entropy": [trl.GRPOTrainer.__init__]},
    "read_metrics": {"_metrics": [trl.GRPOTrainer.__init__]},
    "set_metrics": {"_metrics": [trl.GRPOTrainer.__init__]},
    "read_buffered_inputs": {"_buffered_inputs": [trl.GRPOTrainer.__init__, trl.GRPOTrainer._prepare_inputs]},
    "set_buffered_inputs": {"_buffered_inputs": [trl.GRPOTrainer._prepare_inputs], "_step": [trl.GRPOTrainer.__init__]},
    "set_microstep_done": {"_step": [trl.GRPOTrainer.__init__],
                           "_current_train_step_time": [trl.GRPOTrainer.__init__],
                           "_metrics": [trl.GRPOTrainer.__init__]},
}


def test_intercept_reads_and_sets_only_fields_trl_still_sets():
    """Each ``_intercept`` helper over a private field of TRL reads the field TRL's source still assigns
    (``self.<field> = ``): a rename in TRL fails here, not as an AttributeError mid-run."""
    for helper, fields in INTERCEPT_FIELDS.items():
        ours = inspect.getsource(getattr(_intercept, helper))
        for name, setters in fields.items():
            assert f"trainer.{name}" in ours, f"_intercept.{helper} no longer reads {name}"
            for setter in setters:
                assert f"self.{name} = " in inspect.getsource(setter), f"trl {setter.__qualname__} no longer sets {name}"
    init = inspect.getsource(trl.GRPOTrainer.__init__)  # the metric lists set_metrics appends to, per mode
    assert 'self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}' in init
    log = inspect.getsource(trl.GRPOTrainer.log)  # and TRL logs their means, then clears them
    assert "self._metrics[mode].items()" in log and "self._metrics[mode].clear()" in log
    generate = inspect.getsource(trl.GRPOTrainer._generate)  # read_row_tools reads what _generate renders with
    assert "self._env_tools[name]" in generate and "self._batch_environments" in generate


def test_intercept_wraps_the_trl_methods_it_names():
    """``record_rewards``, ``record_loss_forward``, ``record_entropy_mask`` and ``inject_forward_per_task``
    wrap these TRL methods, which ``_generate_and_score_completions`` / ``_compute_loss`` still call;
    the per-task forward passes the first four arguments positionally and only the text-only keywords
    (``_intercept._TEXT_ONLY``) keep its split."""
    wrapped = {"record_rewards": "_calculate_rewards", "record_loss_forward": "_get_per_token_logps_and_entropies",
               "record_entropy_mask": "get_high_entropy_mask",
               "inject_forward_per_task": "_get_per_token_logps_and_entropies"}
    for helper, name in wrapped.items():
        assert f'"{name}"' in inspect.getsource(getattr(_intercept, helper)), f"_intercept.{helper}"
        assert hasattr(trl.GRPOTrainer, name), f"trl.GRPOTrainer.{name} no longer exists"
    loss = inspect.getsource(trl.GRPOTrainer._compute_loss)
    assert "self.get_high_entropy_mask(" in loss
    params = _params(trl.GRPOTrainer, "_get_per_token_logps_and_entropies")
    assert params[:5] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep"]
    assert set(_intercept._TEXT_ONLY) <= set(params)


def _trl_private_fields() -> set[str]:
    """Names TRL's and transformers' trainers assign as private attributes (``self._x = ...``), less
    their methods (grpotrl overrides and calls TRL's private methods as hooks, pinned above)."""
    import transformers.trainer
    import trl.trainer.grpo_trainer
    import trl.trainer.sft_trainer

    src = "".join(inspect.getsource(m) for m in (trl.trainer.grpo_trainer, trl.trainer.sft_trainer,
                                                   transformers.trainer))
    assigned = set(re.findall(r"self\.(_\w+)\s*(?:=|\+=|:)", src))
    return {n for n in assigned
            if not any(callable(getattr(c, n, None)) for c in (trl.GRPOTrainer, trl.SFTTrainer))}


def test_only_intercept_touches_trl_private_fields():
    """No module of grpotrl but ``trainers/_intercept.py`` reads or writes a private field of TRL's or
    transformers' trainers (``self._metrics``, ``trainer._tokenizer``, ...): each goes through one
    pinned helper there. grpotrl's own attributes (``self.hook_record``) are not TRL's."""
    import ast
    import pathlib

    trl_fields = _trl_private_fields()
    assert {"_metrics", "_tokenizer", "_step", "_is_vlm"} <= trl_fields  # the scan sees TRL's fields
    root = pathlib.Path(grpotrl.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == pathlib.Path(_intercept.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in trl_fields:
                found.append(f"{path.relative_to(root)}:{node.lineno} .{node.attr}")
    assert not found, "TRL's private fields outside trainers/_intercept.py:\n" + "\n".join(found)


def test_fused_head_shifts_labels_as_padding_free_assumes():
    """``ops.packing.unpack`` reads the fused head's output at the position before each scored token: the
    head scores ``labels[:, 1:]`` from ``hidden[:, :-1]`` and returns zeros where a label is -100."""
    from trl.trainer.utils import add_fused_lm_head

    src = inspect.getsource(add_fused_lm_head)
    assert "hidden_states = backbone_outputs.last_hidden_state[:, :-1]" in src
    assert "labels = labels[:, 1:]" in src and "mask = labels != -100" in src


def test_fused_head_reads_its_tile_sizes_at_call_time_inject_head_tiles_sets():
    """``_intercept.inject_head_tiles`` shadows ``trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE``, which the fused
    head's forward and backward read at call time (the backward runs after the forward's block), and
    ``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``, the vocabulary columns TRL's fused forward hands the head
    at call time (its backward takes them from ``ctx``)."""
    import trl.kernels.chunked_logprob as ck
    import trl.trainer.utils as trl_utils

    assert trl_utils._ChunkedLogProbFunction is ck.ChunkedLogProbFunction
    assert isinstance(ck.TOKEN_CHUNK_SIZE, int) and ck.TOKEN_CHUNK_SIZE >= _intercept.CPU_HEAD_TOKENS
    assert isinstance(trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE, int)
    assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE >= _intercept.CPU_HEAD_COLUMNS
    for method in (ck.ChunkedLogProbFunction.forward, ck.ChunkedLogProbFunction.backward):
        src = inspect.getsource(method)
        assert "range(0, N, TOKEN_CHUNK_SIZE)" in src and "min(N, TOKEN_CHUNK_SIZE)" in src
        assert "range(0, vocab, chunk_size)" in src
    assert "chunk_size = ctx.chunk_size" in inspect.getsource(ck.ChunkedLogProbFunction.backward)
    fused = inspect.getsource(trl_utils.add_fused_lm_head)
    assert "_ChunkedLogProbFunction.apply(" in fused and "_CHUNKED_LOGPROB_CHUNK_SIZE," in fused
    src = inspect.getsource(_intercept.inject_head_tiles)
    assert '"TOKEN_CHUNK_SIZE"' in src and '"_CHUNKED_LOGPROB_CHUNK_SIZE"' in src


def test_fused_head_reads_the_compact_switch_inject_compact_head_sets():
    """``_intercept.inject_compact_head`` shadows ``trl.trainer.utils._use_triton``, which TRL's fused forward
    reads at call time to choose between projecting the scored positions only and every position."""
    import trl.trainer.utils as trl_utils

    src = inspect.getsource(trl_utils.add_fused_lm_head)
    assert callable(trl_utils._use_triton)
    assert "compact = _use_triton(hidden_states.device)" in src
    assert "hidden_states[mask] if compact else" in src and "labels[mask] if compact else" in src
    assert "x.new_zeros(mask.shape).masked_scatter(mask, x)" in src  # zeros where nothing is scored, as before
    assert '"_use_triton"' in inspect.getsource(_intercept.inject_compact_head)


def test_transformers_compile_path_the_compiled_rollout_goes_through():
    """``generation.compiled_rollout`` hands ``generate`` ``cache_implementation='static'``, ``max_cache_len``,
    ``compile_config`` and ``disable_compile=False`` (over TRL's ``disable_compile=True``): transformers' ``_sample``
    must still compile the decoding forward through ``get_compiled_call`` where ``_valid_auto_compile_criteria``
    holds (a compileable, non-dynamic cache; CUDA or ``_compile_all_devices``; the quantizer's ``is_compileable``),
    size the static cache as the largest of the call's length, ``max_cache_len`` and earlier calls'
    (``_prepare_cache_for_generation`` -> ``_prepare_static_cache``, ``_previous_max_cache_length``), and its
    ``DeferredStopCheck.is_supported`` (which ``_intercept.inject_deferred_stop_check`` shadows) must keep its
    arguments and be asked once per call after the prefill. ``model_facts`` reads ``_can_compile_fullgraph``,
    ``_supports_default_dynamic_cache`` and ``hf_quantizer.is_compileable``."""
    import transformers
    from transformers import CompileConfig, GenerationConfig, GenerationMixin
    from transformers.generation import utils as generation_utils
    from transformers.quantizers.base import HfQuantizer

    init = inspect.getsource(trl.GRPOTrainer.__init__)
    assert "GenerationConfig(**generation_kwargs, disable_compile=True)" in init
    assert '"cache_implementation": args.cache_implementation' in init
    assert list(inspect.signature(GenerationMixin._valid_auto_compile_criteria).parameters) == [
        "self", "model_kwargs", "generation_config"]
    criteria = inspect.getsource(GenerationMixin._valid_auto_compile_criteria)
    assert "if generation_config.disable_compile:" in criteria
    assert "generation_config.compile_config._compile_all_devices" in criteria
    assert "can_compile &= self.hf_quantizer.is_compileable" in criteria
    assert list(inspect.signature(transformers.PreTrainedModel.get_compiled_call).parameters) == [
        "self", "compile_config"]
    sample = inspect.getsource(GenerationMixin._sample)
    assert "self.get_compiled_call(generation_config.compile_config)\n" \
           "            if self._valid_auto_compile_criteria(model_kwargs, generation_config)" in sample
    assert "if DeferredStopCheck.is_supported(\n            input_ids.device, cache, cache_is_returned, " \
           "is_assistant=generation_config.is_assistant\n        ):" in sample
    assert "steps_to_undo = stop_check.finish()" in sample
    # _intercept.inject_draw_one shadows torch.multinomial, which the sampling step looks up on the torch module
    assert "next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)" in sample
    supported = generation_utils.DeferredStopCheck.__dict__["is_supported"]
    assert isinstance(supported, staticmethod)
    assert list(inspect.signature(supported.__func__).parameters) == [
        "device", "cache", "cache_is_returned", "is_assistant"]
    prepare = inspect.getsource(GenerationMixin._prepare_cache_for_generation)
    assert "max_cache_length = max(max_cache_length, generation_config.max_cache_len)" in prepare
    assert "self._prepare_static_cache(" in prepare
    static = inspect.getsource(GenerationMixin._prepare_static_cache)
    assert "effective_length = max(max_cache_len, previous_max_len)" in static
    assert "self._previous_max_cache_length = effective_length" in static
    config = GenerationConfig(cache_implementation="static", max_cache_len=64, disable_compile=False,
                              compile_config=CompileConfig(dynamic=False))
    assert config.max_cache_len == 64 and config.disable_compile is False
    assert CompileConfig._compile_all_devices is None and {"fullgraph", "dynamic", "mode"} <= set(
        CompileConfig().to_dict())
    assert isinstance(transformers.PreTrainedModel._can_compile_fullgraph, bool)
    assert callable(GenerationMixin._supports_default_dynamic_cache)
    assert "is_compileable" in dir(HfQuantizer)


def test_transformers_input_grad_hooks_the_compiled_rollout_skips(tiny_llama):
    """``_intercept.skip_input_grad_hooks`` (and ``skip_stacked_input_grad_hooks``) rely on transformers'
    ``enable_input_require_grads`` keeping the forward hooks it adds on the input embeddings in the model's
    ``_require_grads_hooks`` (a private list) and ``disable_input_require_grads`` removing exactly those; inside the
    block the embeddings run without them, and the block puts them back."""

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    names = lambda: [h.__name__ for h in model.get_input_embeddings()._forward_hooks.values()]  # noqa: E731
    embed = lambda: model.get_input_embeddings()(torch.tensor([[1, 2]]))  # noqa: E731
    model.enable_input_require_grads()
    assert len(model._require_grads_hooks) == 1 and names() == ["make_inputs_require_grads"]
    with torch.no_grad():
        assert embed().requires_grad  # the hook marks even a no-grad output
        with _intercept.skip_input_grad_hooks(model):
            assert names() == [] and not model._require_grads_hooks and not embed().requires_grad
    assert names() == ["make_inputs_require_grads"] and len(model._require_grads_hooks) == 1
    model.disable_input_require_grads()
    assert names() == [] and model._require_grads_hooks == []


def test_trl_bonus_mask_and_advantages_grpotrl_reads_are_as_pinned():
    """I7 expects ``d loss / d H = 0`` where TRL's bonus acts on no token: TRL's bonus must average the entropy
    over ``mask * entropy_mask`` with the count clamped at 1 (so an empty mask gives ``c * 0``). Dynamic sampling
    reads "no gradient" from the advantages TRL returns: they must be in the output, after either aggregation."""
    loss = inspect.getsource(trl.GRPOTrainer._compute_loss)
    for needle in ("effective_mask = mask if entropy_mask is None else mask * entropy_mask",
                   "(entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation_factor"):
        assert needle in loss, f"trl.GRPOTrainer._compute_loss no longer has {needle!r}"
    scored = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    for needle in ('if self.multi_objective_aggregation == "sum_then_normalize":',
                   'elif self.multi_objective_aggregation == "normalize_then_sum":',
                   "advantages = advantages[process_slice]", '"advantages": advantages,'):
        assert needle in scored, f"trl.GRPOTrainer._generate_and_score_completions no longer has {needle!r}"


def test_transformers_checkpoint_rotation_grpotrl_replaces():
    """``_common.CheckedResume._save_checkpoint`` runs transformers' save with ``save_total_limit`` None, so that
    its rotation (every ``checkpoint-N`` in the run dir) deletes nothing, then rotates this run's own checkpoints
    (``checkpoints.rotate_run_checkpoints``, with transformers' ``sort_checkpoints`` and ``_get_output_dir``)."""
    import transformers
    from transformers import trainer_utils

    source = inspect.getsource(transformers.Trainer._save_checkpoint)
    assert "save_total_limit=self.args.save_total_limit" in source and "rotate_checkpoints(" in source
    assert "run_dir = self._get_output_dir(trial=trial)" in source
    assert list(inspect.signature(transformers.Trainer._get_output_dir).parameters) == ["self", "trial"]
    assert list(inspect.signature(trainer_utils.sort_checkpoints).parameters) == [
        "output_dir", "checkpoint_prefix", "use_mtime", "best_model_checkpoint"]


def test_transformers_end_of_training_cleanup_grpotrl_restricts_to_this_run(tmp_path):
    """``_common.CheckedResume._finalize_training`` runs transformers' with ``_intercept.inject_end_checkpoints``:
    its cleanup under ``save_total_limit == 1`` with a best checkpoint deletes every checkpoint that
    ``transformers.trainer.sort_checkpoints`` lists but the best, and that call in ``_finalize_training`` is the
    only one of that name in ``transformers.trainer`` (the shadow changes nothing else). TRL's trainers inherit
    it; the training loop ends in it."""
    import threading

    import transformers
    import transformers.trainer as transformers_trainer
    from transformers import trainer_utils

    finalize = inspect.getsource(transformers.Trainer._finalize_training)
    for needle in ("checkpoints_sorted = sort_checkpoints(",
                   "output_dir=self._get_output_dir(trial), best_model_checkpoint=self.state.best_model_checkpoint",
                   "self.state.best_model_checkpoint is not None and self.args.save_total_limit == 1",
                   "for checkpoint in checkpoints_sorted:", "shutil.rmtree(checkpoint, ignore_errors=True)"):
        assert needle in finalize, f"transformers.Trainer._finalize_training no longer has {needle!r}"
    assert inspect.getsource(transformers_trainer).count("sort_checkpoints(") == 1
    assert transformers_trainer.sort_checkpoints is trainer_utils.sort_checkpoints
    assert "return self._finalize_training(trial, num_train_samples, start_time)" in inspect.getsource(
        transformers.Trainer._inner_training_loop)
    for cls in (trl.GRPOTrainer, trl.SFTTrainer):
        assert cls._finalize_training is transformers.Trainer._finalize_training, f"{cls.__name__} overrides it"
    assert '"sort_checkpoints"' in inspect.getsource(_intercept.inject_end_checkpoints)

    for n in (1, 2):
        (tmp_path / f"checkpoint-{n}").mkdir()
    listed, elsewhere = [], []
    with _intercept.inject_end_checkpoints(lambda output_dir, found: listed.append((output_dir, found)) or found[1:]):
        assert transformers_trainer.sort_checkpoints(output_dir=str(tmp_path)) == [str(tmp_path / "checkpoint-2")]
        other = threading.Thread(target=lambda: elsewhere.append(transformers_trainer.sort_checkpoints(str(tmp_path))))
        other.start()
        other.join()
    both = [str(tmp_path / "checkpoint-1"), str(tmp_path / "checkpoint-2")]
    assert listed == [(str(tmp_path), both)] and elsewhere == [both]
    assert transformers_trainer.sort_checkpoints is trainer_utils.sort_checkpoints
