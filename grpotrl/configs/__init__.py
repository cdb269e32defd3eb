"""Config subclasses: TRL's configs plus only the fields grpotrl adds, each with ``help``.

Two TRL defaults change, both for the sampled-equals-scored guarantee (I5) and CPU runs:
``bf16`` defaults to False when no accelerator is present (TRL turns it on even on CPU) and
``disable_dropout`` defaults to True, so the logprob forward computes the function that
sampled the tokens.

Each config checks its own values once, at construction (``checks``: ranges, TRL's string
choices, grpotrl's GRPO fields; ``recipe_types``: a value its field's type cannot hold), after its
numpy scalars became the Python numbers they print as (``recipe_types.python_numbers``). What
needs the world (model, data, launch) is the preflight's (``grpotrl.preflight``).
``launch.sharded_launch``: DeepSpeed or FSDP, from the config and ``accelerate launch``'s
environment.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields

import torch
import trl

from ..errors import InputError
from .checks import (HEALTH_ACTIONS, HEALTH_RULES, PATIENCE_DEFAULTS, check_grpotrl_fields, check_ranges, normalize_generation_kwargs,
                     normalize_kl_estimators)
from .recipe_types import check_config_types, python_numbers


def _has_accelerator() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


@dataclass
class OutputDirFields:
    """``TrainingArguments.overwrite_output_dir`` as transformers 4 had it (transformers 5 dropped it): a
    recipe key, a command-line flag and a config field, so a script's user can lift the refusal too."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Replace what output_dir holds. Without it the CLI refuses a non-empty output_dir (a "
                  "finished run, checkpoints, other files) before anything loads, and train() refuses an output_dir "
                  "holding a finished run (final weights and trainer_state.json), unless the run resumes from it. "
                  "Never lifts the lock of a run still writing there."},
    )


@dataclass
class TemplateGuardFields:
    guard_steps: int = field(
        default=2,
        metadata={"help": "Check INVARIANTS I1-I7 and I9-I12 on the trainer's real tensors for the first N "
                  "optimizer steps; -1 checks every step, 0 turns the guards off."},
    )
    check_template: bool = field(
        default=True,
        metadata={"help": "I2: stop when the checkpoint was trained with another chat template "
                  "(grpotrl_template.json). Set False only for a deliberate template change."},
    )


@dataclass
class GuardFields(TemplateGuardFields):
    guard_logprob_atol: float = field(
        default=1e-5,
        metadata={"help": "I5 tolerance in fp32 between the loss's per-token logprobs and an independent "
                  "log_softmax(logits / T) recomputation, in nats per nat of logit scale max|logits / T| "
                  "(fp32 rounding grows with it). In bf16/fp16 (autocast, or weights loaded in them) I5 is "
                  "statistical instead: the temperature fitted over the loss's tokens within a relative 0.01 of T, the median "
                  "gap <= 0.02 nats and no row's mean gap > 0.5 (grpotrl/guards/precision.py, docs/guarantees.md)."},
    )
    check_step0_identity: bool = field(
        default=True,
        metadata={"help": "I10: on the first microbatch of step 0, before any update, the reference's and the old "
                  "policy's per-token logprobs (where the run computes them: beta > 0; num_iterations > 1 or IS "
                  "correction) must equal the loss's own (KL 0, ratio 1), within 1e-4 nats per token in fp32 and "
                  "0.05 mean, 0.02 median, 0.5 on any row's mean under bf16/fp16. Costs one comparison of tensors the step computes anyway. "
                  "Off with the other guards when guard_steps=0."},
    )
    sampler_gap_threshold: float = field(
        default=0.1,
        metadata={"help": "Where the sampler's own logprobs exist (the transformers path with penalties, "
                  "min_new_tokens or hf_importance_sampling_correction), the mean |logp_sampler - logp_trainer| over "
                  "the loss's tokens above which sampler_gap_action applies (slime's CI uses 0.1 nats). The raw, "
                  "untruncated importance ratios are logged as sampling/raw_ratio/{token,seq}/{mean,min,max,"
                  "outside_share} either way."},
    )
    sampler_gap_action: str = field(
        default="warn",
        metadata={"help": "'warn' (once, with the likely causes), 'stop' (InvariantError I5: the loss would not "
                  "score the distribution that sampled) or 'off'.", "choices": ["warn", "stop", "off"]},
    )


@dataclass
class SFTFields:
    """SFT has no sampled logprobs, so no I5 tolerance (``guard_logprob_atol``)."""

    _VALID_DICT_FIELDS = [*trl.SFTConfig._VALID_DICT_FIELDS, "chat_template_kwargs"]

    chat_template_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments of `apply_chat_template` for every conversational row (e.g. Qwen3's "
                  "{'enable_thinking': false}), like GRPOConfig.chat_template_kwargs; a row's own "
                  "`chat_template_kwargs` column (trl's per-row way) wins key by key. Recorded in the checkpoint's "
                  "grpotrl_template.json, so GRPO with other kwargs stops (I2)."},
    )


@dataclass
class GenerationFields:
    presence_penalty: float = field(
        default=0.0,
        metadata={"help": "OpenAI presence penalty, counting only the tokens generated so far in each response "
                  "(never the prompt or padding; INVARIANT I6). TRL's `repetition_penalty` is made "
                  "response-only the same way on the transformers generate path."},
    )
    frequency_penalty: float = field(
        default=0.0,
        metadata={"help": "OpenAI frequency penalty, counting only the tokens generated so far (I6)."},
    )
    min_new_tokens: int = field(
        default=0,
        metadata={"help": "Block every stop id (eos, end-of-turn, generation_config.eos_token_id) until this many "
                  "tokens are generated; the trigger rate is logged as `generation/min_new_tokens_trigger_rate`. "
                  "generation_kwargs' min_new_tokens (transformers' name) or min_tokens (vLLM's) becomes this field; "
                  "under vLLM it is passed as min_tokens."},
    )
    truncated_sampling_correction: bool = field(
        default=True,
        metadata={"help": "On the transformers generate path with top_k / top_p / min_p (any truncation warper), "
                  "the sampler's logprob of each token is taken under the full softmax of its processed scores "
                  "(the truncated logprob + log of the kept mass), so the importance ratio and the sampler gap "
                  "are 1 and 0 at the same weights. False: the truncated, renormalised logprob (as vLLM returns "
                  "it), whose ratio's mean is the kept mass (trl#6789)."},
    )
    hf_importance_sampling_correction: bool = field(
        default=False,
        metadata={"help": "On the transformers generate path, correct for the gap between the sampler's "
                  "processed distribution and the trainer's with TRL's truncated importance sampling, using "
                  "the same knobs as vLLM: vllm_importance_sampling_mode / _clip_min / _clip_max. Refused with "
                  "use_vllm (TRL's own vllm_importance_sampling_correction corrects that path) and with "
                  "use_transformers_continuous_batching (its sampler records no logprobs for it)."},
    )


@dataclass
class HealthFields:
    health_action: str = field(
        default="auto",
        metadata={"help": "What the health rules (grpotrl.health.callbacks) do when they fire. 'auto': the rules that "
                  "only fire on a broken run stop it (non_finite: loss or grad norm NaN/inf, the bad update not "
                  "applied; nonfinite_reward: a reward function returned +-inf, counted as missing; chat_header: a completion starts with the chat header), the rules that may be the task "
                  "itself warn and training goes on, as TRL would (entropy_collapse, one_token, flat_rewards). "
                  "'stop' / 'warn' / 'off': every rule does that. A stop saves a resumable checkpoint with the "
                  "Trainer's own saving and raises grpotrl.HealthStop naming the rule, the values and the step; a "
                  "warning is logged (logger grpotrl.health.callbacks). The signals are logged either way.",
                  "choices": ["auto", "stop", "warn", "off"]},
    )
    health_rule_actions: dict | str | None = field(
        default=None,
        metadata={"help": "Per-rule action, over health_action: e.g. {'entropy_collapse': 'stop', 'flat_rewards': "
                  f"'stop'}}. Rules: {', '.join(HEALTH_RULES)}; actions: {', '.join(HEALTH_ACTIONS)}."},
    )
    health_min_entropy: float = field(
        default=0.02,
        metadata={"help": "Entropy-collapse rule: mean token entropy (nats, TRL's `entropy`) below this for "
                  "health_patience consecutive steps. A run whose entropy bonus had a flipped sign collapsed to 0.005-0.05; healthy runs show "
                  "0.3-1.5. 0 turns the rule off."},
    )
    health_max_one_token_share: float = field(
        default=0.5,
        metadata={"help": "1-token rule: share of 1-token completions above this for health_patience consecutive "
                  "steps (penalties that counted prompt tokens gave 1-token answers). 1 turns the rule off."},
    )
    health_patience: int = field(
        default=PATIENCE_DEFAULTS["health_patience"],
        metadata={"help": "Consecutive optimizer steps that observed the rule's signal on which the entropy and "
                  "1-token rules must hold before they fire. The 1-token share is logged once per generation batch: "
                  "under num_iterations > 1 or steps_per_generation > gradient_accumulation_steps its patience counts "
                  "generation batches."},
    )
    health_flat_reward_steps: int = field(
        default=PATIENCE_DEFAULTS["health_flat_reward_steps"],
        metadata={"help": "Flat-reward rule: every group's rewards all equal (TRL's frac_reward_zero_std == 1, "
                  "no policy gradient at all) for this many consecutive generation batches (optimizer steps, "
                  "where every step generates), e.g. a judge that always returns 0. Small batches are flat by chance "
                  "for a few steps; 0 turns the rule off."},
    )
    health_report_steps: int = field(
        default=1,
        metadata={"help": "Print the boundary report (prompt tail and completion head with special tokens, ids "
                  "around the boundary, stop-token counts) after each of the first N steps; 0 never. "
                  "`trainer.boundary_report()` prints it on demand."},
    )
    health_logit_steps: int = field(
        default=0,
        metadata={"help": "Log the logit signals (logits/max, logits/top1_top2_gap, logits/top1_prob, "
                  "logits/top5_mass) every N steps with one extra no-grad forward per microbatch that "
                  "materialises the completion logits [B, C, V] (TRL's fused loss head never does): N=1 cost "
                  "1.15x the step time on SmolLM2-135M (bench/bench_health.py --logit-steps 1) and B*C*V*4 bytes. "
                  "0: only on guard steps, where the I5 guard's forward provides them for free."},
    )


@dataclass
class DynamicSamplingFields:
    """DAPO dynamic sampling (``grpotrl/trainers/dynamic_sampling.py``), read by ``GRPOTrainer`` and
    ``MultiTaskGRPOTrainer``; ``GADConfig`` refuses it."""

    dynamic_sampling: bool = field(
        default=False,
        metadata={"help": "DAPO dynamic sampling (TRL issue #3708): drop the groups whose rewards are all equal "
                  "from the loss (out of every normaliser, KL and entropy included) and refill the batch with "
                  "groups of fresh prompts drawn from train_dataset, for up to dynamic_sampling_max_rounds "
                  "extra generation rounds. The dropped share is logged as dynamic_sampling/dropped_share."},
    )
    dynamic_sampling_max_rounds: int = field(
        default=3,
        metadata={"help": "Cap on extra generation rounds per step under dynamic_sampling; 0 only drops."},
    )


@dataclass
class MultiTaskFields:
    """``task_column`` labels rows for per-task metrics (every GRPO trainer) and per-task rewards.
    ``cagrad`` / ``cagrad_c`` are read by ``MultiTaskGRPOTrainer`` only; they sit on every GRPO
    config (one config class for the CLI's ``grpotrl grpo``), and a trainer that would ignore them
    refuses them when set (``GRPOTrainer``: ``preflight.check_grpo``; ``GADConfig``: at construction)."""

    task_column: str = field(
        default="task",
        metadata={"help": "Dataset column holding each row's task label. When present, metrics are also logged per "
                  "task (tasks/<task>/reward, reward_std, entropy, completions/mean_length, one_token_share); "
                  "grpotrl.MultiTaskGRPOTrainer takes reward functions per task from it."},
    )
    cagrad: str = field(
        default="off",
        metadata={"help": "MultiTaskGRPOTrainer only (GRPOTrainer and GADTrainer refuse it). 'off': one backward "
                  "of the summed loss. 'exact': CAGrad (Liu et al. 2021) over the per-task policy gradients of all "
                  "trainable parameters, accumulated over the gradient-accumulation window (K task backward passes "
                  "+ 1 for KL and the entropy bonus, which are added after the combination). 'low_memory': CAGrad "
                  "weights from the per-task gradients of the last transformer block's trainable parameters only (K "
                  "short backward passes), "
                  "then one weighted backward of everything, weights per microbatch.",
                  "choices": ["off", "exact", "low_memory"]},
    )
    cagrad_c: float = field(
        default=0.5,
        metadata={"help": "CAGrad's c (alpha in the reference code): radius of the ball around the mean gradient "
                  "the update may move in, as a fraction of its norm; 0 is the mean gradient. Typical 0.4-0.5."},
    )


@dataclass
class KLFields:
    """The KL to the reference policy, for every GRPO trainer (GAD included): which estimator, in the
    loss and / or in the reward (verl's ``actor.use_kl_loss`` / ``algorithm.use_kl_in_reward``).
    ``beta`` (TRL's) is the coefficient in the loss. grpotrl computes the in-loss term itself
    (``losses.kl_loss_term``), reduced as TRL reduces its loss for ``loss_type``: the default, k3 in
    the loss, is TRL's own term except that verl's clamps apply (``losses.KL_LOG_RATIO_CLAMP``,
    ``KL_VALUE_CLAMP``) and the importance ratio is per token under ``importance_sampling_level=
    "sequence"`` too."""

    kl_estimator: str = field(
        default="k3",
        metadata={"help": "Per-token KL to the reference policy: k1, abs, k2 (mse), k3 (low_var_kl, TRL's) or full "
                  "(exact over the vocabulary from both models' logits; costs a [B, C, V] logits tensor per "
                  "microbatch for each model), or k1+, k3+, abs+ (the value of k1/k3/abs, the gradient of k2). k3 is "
                  "clamped as verl clamps it: log pi_ref - log pi to [-20, 20] before the exp, the value to [-10, 10] "
                  "after (a clamped token adds the bound and no gradient of its own; with use_bias_correction_kl the ratio's score term, bound * d log pi, remains); TRL's unclamped k3 is inf, with a NaN "
                  "gradient, at a log-ratio of 100. In "
                  "the loss, with use_bias_correction_kl (TRL's default: times the per-token importance ratio), all "
                  "but abs have the gradient of KL(pi || pi_ref) in expectation; without it k2, full and the '+' "
                  "variants keep it, k3 has the gradient of the other KL(pi_ref || pi), and k1 none (refused). abs's "
                  "gradient is that of sum_v |pi(v) - pi_ref(v)|, not of a KL (grpotrl.ops.losses.kl_loss_term). "
                  "Logged as `kl` (the estimator in force, times the ratio)."},
    )
    use_kl_loss: bool = field(
        default=True,
        metadata={"help": "Add beta * KL (kl_estimator, per token, aggregated like the policy loss) to the loss."},
    )
    use_kl_in_reward: bool = field(
        default=False,
        metadata={"help": "Subtract kl_in_reward_coef * sum_t KL_t (kl_in_reward_estimator, clamped as in the loss) "
                  "from each response's reward, as the reward column `kl_penalty` (last; with reward_weights, give it "
                  "a weight too); costs a no-grad forward of the policy and of the reference. Chat prompts only, no "
                  "tools."},
    )
    kl_in_reward_coef: float | None = field(
        default=None,
        metadata={"help": "KL coefficient in the reward (verl's algorithm.kl_ctrl.kl_coef); default: beta, which is "
                  "the coefficient in the loss (verl's actor.kl_loss_coef)."},
    )
    kl_in_reward_estimator: str | None = field(
        default=None,
        metadata={"help": "Estimator of the KL in the reward (verl's algorithm.kl_penalty); default: kl_estimator. "
                  "Both take ours (k1, abs, k2, k3, full) or verl's names (kl, abs, mse, low_var_kl, full), with "
                  "'+' for verl's straight-through variant (the value of the estimator, the gradient of k2: in the reward, "
                  "where only the value counts, the same as without '+')."},
    )


@dataclass
class PaddingFreeFields:
    """The padding-free logprob forwards (``grpotrl/trainers/padding_free.py``) and rollout
    (``grpotrl/generation/finished_rows.py``): TRL's SFT name."""

    padding_free: str = field(
        default="auto",
        metadata={"help": "Run the policy's, old policy's and reference's logprob forwards (and the backward) on "
                  "packed rows without padding: each completion with its prompt, position ids restarting per "
                  "sequence, rows no wider than the padded batch; the per-token logprobs go back into TRL's layout, "
                  "so the loss is the padded one's. 'auto' (default): on where it was measured faster than TRL's "
                  "padded forward, on CPU (off on CUDA and every other device: slower there in bf16, docs/cost.md), "
                  "where the model's attention keeps packed rows apart (sdpa, eager) and there are no image inputs "
                  "or MoE router losses; true: on, on any device (refused for those and for FlashAttention, which "
                  "keeps packed sequences apart in a forward of one row only); false: TRL's padded forward. A "
                  "trl.GRPOConfig handed to a grpotrl trainer keeps TRL's padded forward unless it sets padding_free. "
                  "The I5 guard compares it with the padded forward token by token on guard steps. With padding_free "
                  "on (auto or true), on the transformers generate path the rollout is padding-free too: a row that "
                  "has stopped leaves the decoding batch (its KV cache and its forward), and is padded as before "
                  "(generation/finished_rows.py). The trainer logs what it chose, and why, at init."},
    )
    balance_microbatches: str = field(
        default="auto",
        metadata={"help": "With padding_free on, regroup the rows of each optimizer step's microbatches (after TRL's "
                  "shuffle) so that their token counts are even: the same rows per optimizer step and per "
                  "microbatch count, so the step's loss and gradient are the same sum, and the heaviest microbatch, "
                  "which sets the peak memory, is lighter; under packed_attention 'varlen' with shared prompts (a "
                  "forward then costs its tokens, each prompt once), a prompt's rows go together instead. 'auto' "
                  "(default): on where the loss does not depend on which rows share a microbatch (not "
                  "loss_type='bnpo', top_entropy_quantile < 1, an entropy bonus, CAGrad, or steps_per_generation not "
                  "a multiple of gradient_accumulation_steps); true: on (refused for those); false: TRL's grouping. "
                  "A trl.GRPOConfig handed in keeps TRL's grouping unless it sets it."},
    )
    packed_attention: str = field(
        default="auto",
        metadata={"help": "How the padding-free forwards keep their packed sequences apart. 'mask': rows no wider "
                  "than the padded batch, transformers' mask built from the restarting position ids, and under sdpa "
                  "each prompt run once for its group under a tree mask. 'varlen': each forward's sequences end to "
                  "end in one row, their boundaries handed to an attention function grpotrl registers with "
                  "transformers (torch's FlashAttention varlen kernel on CUDA in bf16/fp16, one causal sdpa per "
                  "sequence elsewhere; sdpa in a forward without boundaries, so gradient checkpointing's recompute "
                  "works): no mask; where the kernel does not run it, each prompt runs once for all of its group's "
                  "rows (a tree attention: each row over the prompt's keys and its own); needs padding_free on, sdpa "
                  "attention through transformers' AttentionInterface, no sliding window, softcapping or attention "
                  "dropout, and no continuous batching (refused otherwise); on CUDA in bf16/fp16 refused while the "
                  "guards run (the kernel's rounding is beyond what I5 can tell from a fault; guard_steps: 0 runs "
                  "it unchecked); balance_microbatches then regroups by prompt. 'auto' (default): 'varlen' only "
                  "on the devices where it was measured faster than 'mask' (CPU, in fp32; docs/cost.md), else "
                  "'mask'."},
    )


@dataclass
class CompiledRolloutFields:
    """The compiled rollout (``grpotrl/generation/compiled_rollout.py``) on transformers' generate path."""

    compiled_rollout: str = field(
        default="auto",
        metadata={"help": "On the transformers generate path, give each rollout generate call a static KV cache "
                  "(its length rounded up to 64, 96, 128, 192, 256, ... positions, so a run compiles a few times) "
                  "and compile its decoding step through transformers' own compile path (CUDA graphs on CUDA; on "
                  "CUDA the stop decision is also read one step late, so the loop never waits on the device). "
                  "grpotrl's processors and the sampler-logprob recorder run in the loop as before. 'auto' "
                  "(default): on only on a kind of device where it was measured faster than TRL's eager rollout: "
                  "CUDA (an H100 in bf16: the GRPO step 0.296x TRL's), and there not under DeepSpeed or a PEFT "
                  "adapter, which were not measured; off on CPU (docs/cost.md); true: on, on any device (CPU "
                  "too), refused with vLLM, continuous batching, a rollout_func, tools, a cache_implementation "
                  "other than 'static', a multimodal processing class, FSDP or ZeRO-3, a quantizer transformers "
                  "cannot compile, or an offloaded model; false: TRL's eager rollout. With it on, the finished-row "
                  "rollout of padding_free is off (the static cache keeps every row). A trl.GRPOConfig handed to a "
                  "grpotrl trainer keeps TRL's rollout unless it sets compiled_rollout. The trainer logs what it "
                  "chose, and why, at init."},
    )


@dataclass
class GRPOConfig(CompiledRolloutFields, KLFields, PaddingFreeFields, MultiTaskFields, DynamicSamplingFields,
                 HealthFields, GenerationFields, GuardFields, OutputDirFields, trl.GRPOConfig):
    disable_dropout: bool = field(
        default=True,
        metadata={"help": "Disable dropout so the logprob forward computes the same function that sampled "
                  "the tokens (I5). TRL's default is False."},
    )
    _VALID_DICT_FIELDS = trl.GRPOConfig._VALID_DICT_FIELDS + ["health_rule_actions"]

    def __post_init__(self):
        python_numbers(self)  # np.float32(1e-6) -> 1e-06: checked, and saved, as the Python number
        check_ranges(self)  # before TRL's own __post_init__ divides by num_generations
        check_config_types(self)  # a field set to a value its type cannot hold (bf16=2)
        self._check_own_fields()
        if self.bf16 is None and not self.fp16 and not _has_accelerator():
            self.bf16 = False
        _checkpointing_by_its_new_name(self)
        super().__post_init__()
        normalize_generation_kwargs(self)
        normalize_kl_estimators(self)
        check_grpotrl_fields(self)

    def _check_own_fields(self) -> None:
        """A subclass's checks of its own fields, after the ranges and types, before TRL's ``__post_init__``."""


def complete_grpo_config(args, config_class: type = GRPOConfig):
    """Give a ``trl.GRPOConfig`` (or a user's subclass of it: open-r1's, a TrlParser script's) every
    field of ``config_class`` it lacks, with grpotrl's default, on the same object; returns it.

    The user's object stays theirs (``trainer.args is args``); its TRL fields and its own fields
    keep their values, TRL's defaults included (``bf16``, ``disable_dropout=False``: I5 is then
    not checked while dropout is active). A grpotrl config was checked when it was made: a no-op.
    A TRL config is checked here, once (``checks``), its numpy scalars made Python numbers
    (``recipe_types.python_numbers``) and its generation kwargs normalised."""
    if isinstance(args, config_class):
        return args
    missing = [f for f in fields(config_class) if not hasattr(args, f.name)]
    for f in missing:
        setattr(args, f.name, f.default_factory() if f.default is MISSING else f.default)
    if any(f.name == "padding_free" for f in missing):
        args.padding_free = False  # a TRL config keeps TRL's padded forward unless it asks for padding_free
    if any(f.name == "compiled_rollout" for f in missing):
        args.compiled_rollout = False  # and TRL's eager rollout
    if any(f.name == "packed_attention" for f in missing):
        args.packed_attention = "mask"  # and the packed rows' mask where it sets padding_free
    if any(f.name == "balance_microbatches" for f in missing):
        args.balance_microbatches = False  # and TRL's grouping of rows into microbatches
    if isinstance(args.health_rule_actions, str):  # JSON from a command line, as TrainingArguments parses its dicts
        args.health_rule_actions = json.loads(args.health_rule_actions)
    python_numbers(args)  # numpy scalars TRL took (its to_json_string cannot write them)
    check_ranges(args)  # TRL's fields' ranges (entropy_coef >= 0 among them), then grpotrl's own
    normalize_generation_kwargs(args)
    normalize_kl_estimators(args)
    check_grpotrl_fields(args)
    return args


def _checkpointing_by_its_new_name(args) -> None:
    """TRL defaults ``gradient_checkpointing`` to True, which transformers 5 has renamed
    ``activation_checkpointing``: at TRL's default, set the new name instead (transformers then
    mirrors it into the old one: the same values TRL's own config ends with, without the
    FutureWarning every TRL config prints). A user who sets either name gets transformers' usual handling."""
    if args.activation_checkpointing is None and args.gradient_checkpointing is True:
        args.activation_checkpointing = True


@dataclass
class SFTConfig(SFTFields, TemplateGuardFields, OutputDirFields, trl.SFTConfig):
    def __post_init__(self):
        python_numbers(self)
        check_ranges(self)
        check_config_types(self)
        if self.bf16 is None and not self.fp16 and not _has_accelerator():
            self.bf16 = False
        _checkpointing_by_its_new_name(self)
        super().__post_init__()


@dataclass
class GADConfig(GRPOConfig):
    """GRPOConfig plus the discriminator of generative adversarial distillation (GADTrainer).

    Defaults change to GSPO (``importance_sampling_level="sequence"``, ``loss_type="grpo"``,
    clip range 3e-4 / 4e-4 as in the GSPO paper and the GAD scripts). ``beta`` is the KL
    coefficient, applied with ``kl_estimator`` in the loss (``use_kl_loss``, default, like TRL),
    in the reward (``use_kl_in_reward``) or both.
    """

    discriminator_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Checkpoint the discriminator starts from (a causal LM works: its backbone is reused "
                  "under a new one-output score head). Default: the student's own path, as in the GAD paper."},
    )
    discriminator_learning_rate: float = field(
        default=1e-6,
        metadata={"help": "AdamW learning rate of the discriminator (its own optimizer, constant)."},
    )
    discriminator_lora_r: int = field(
        default=0,
        metadata={"help": "Train the discriminator as a LoRA adapter of this rank on every linear layer (alpha = 2r; "
                  "the score head stays fully trainable); 0 trains all its weights."},
    )
    discriminator_freeze_embeddings: bool = field(
        default=False,
        metadata={"help": "Keep the discriminator's input token embeddings as initialised: no gradient (a dense "
                  "vocab x hidden tensor each step, however few tokens a batch holds) and no AdamW state for them, "
                  "a fifth of SmolLM2-135M's weights. Mostly a memory saving: ~0.1 s of D's ~3 s CPU per step in "
                  "bench/bench_gad.py. Off by default: the GAD paper trains all of D. A LoRA discriminator's "
                  "embeddings are frozen anyway."},
    )
    discriminator_warmup_steps: int = field(
        default=0,
        metadata={"help": "For the first N optimizer steps only the discriminator learns: responses are generated "
                  "and scored, the student gets no gradient and does not change (verl's critic_warmup)."},
    )
    importance_sampling_level: str = field(
        default="sequence",
        metadata={"help": "GSPO's sequence-level ratio by default (TRL's default is 'token')."},
    )
    loss_type: str = field(
        default="grpo",
        metadata={"help": "Per-sequence mean, as GSPO prescribes with the sequence-level ratio (TRL's default: dapo)."},
    )
    epsilon: float = field(default=3e-4, metadata={"help": "Lower clip of the sequence-level ratio (GSPO)."})
    epsilon_high: float | None = field(default=4e-4,
                                       metadata={"help": "Upper clip of the sequence-level ratio (GSPO)."})

    def _check_own_fields(self) -> None:
        """GAD's own fields, run by ``GRPOConfig.__post_init__`` after the ranges (its counts among them) and
        types (once)."""
        if self.fp16:
            raise InputError("fp16 is not supported by GAD: the discriminator's update has no loss scaler. "
                             "Use bf16: true or fp32.")
        if self.dynamic_sampling:
            raise InputError("dynamic_sampling is not supported by GAD: each refill round would score fresh responses "
                             "and step the discriminator again within one student step. Turn it off.")
        if self.cagrad != "off" or self.cagrad_c != 0.5:
            raise InputError(f"cagrad={self.cagrad!r}, cagrad_c={self.cagrad_c}: CAGrad is MultiTaskGRPOTrainer's "
                             "(per-task gradients); GAD has one task, so these would be ignored. Drop them.")


def sft_option(args, name: str):
    """grpotrl's SFT field ``name`` of ``args``, or its grpotrl default when ``args`` is a plain
    ``trl.SFTConfig`` (or a user's subclass of it) that lacks it."""
    return getattr(args, name, SFTConfig.__dataclass_fields__[name].default)
