"""A config's own value checks, run once by the config itself (``__post_init__``; a TRL config
completed by ``complete_grpo_config`` / ``trainers.sft.sft_config``), before TRL's own ``__post_init__``
divides by any of them. Nothing here needs the model, the data or the launch.

* ``check_ranges``: every numeric setting of a TRL or grpotrl config within what its field can
  mean (a wrong sign, ``entropy_coef < 0`` for I7 among them, a zero, a NaN), and every string-choice
  field of TRL's GRPO and SFT configs one of the values TRL 1.16 takes (``GRPO_CHOICES``, ``SFT_CHOICES``).
* ``normalize_generation_kwargs``: ``generation_kwargs``' temperature / repetition_penalty / min_new_tokens (or
  vLLM's min_tokens) become the fields grpotrl reads (I5, I6); the one step here that changes the config.
* ``normalize_kl_estimators``: verl's KL estimator names become ours (``k3`` for ``low_var_kl``).
* ``check_grpotrl_fields``: grpotrl's own GRPO fields (health rules, a rule that ``health_rule_actions`` sets to
  stop or warn while its own setting turns it off, or every completion is one token, or its patience is longer than
  the steps of ``max_steps`` that observe its signal, among them; ``rules_beyond_run`` and ``check_patience_fits``
  also serve a run by epochs at train start, ``health.callbacks``), sampler gap, CAGrad, the adaptive entropy range I7,
  sampling settings grpotrl would otherwise drop, I6, greedy decoding, which samples no group, beam sampling where
  the sampler's logprobs are recorded, ``generation_kwargs`` under which ``generate`` cannot return one completion
  per prompt row, the KL's placement). ``UNRUNNABLE_GENERATION`` and ``SAMPLING_CHANGES`` also say what the same
  fields do in a model's own generation_config.json (``preflight``).
"""

from __future__ import annotations

import difflib
import math

import trl
from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

from ..errors import InputError
from ..ops.loss_types import LOSS_TYPES
from ..ops.losses import kl_estimator_name

HEALTH_RULES = ("non_finite", "nonfinite_reward", "chat_header", "entropy_collapse", "one_token", "flat_rewards")
HEALTH_ACTIONS = ("stop", "warn", "off")
# rule -> (its setting, the test of a value that turns the rule off, what to set instead): where
# health_rule_actions sets the rule to 'stop' or 'warn', such a value is refused (``_check_rules_can_fire``)
HEALTH_RULE_OFF = {
    "entropy_collapse": ("health_min_entropy", lambda v: v <= 0, "the mean token entropy (nats) to fire below, e.g. "
                         "0.02 (the default)"),
    "one_token": ("health_max_one_token_share", lambda v: v >= 1, "the share of 1-token completions to fire above, "
                  "e.g. 0.5 (the default)"),
    "flat_rewards": ("health_flat_reward_steps", lambda v: v == 0, "the consecutive flat steps to fire after, e.g. 20 "
                     "(the default)"),
}
# rule -> the setting that is its patience: the consecutive optimizer steps that observed its signal on which its
# condition must hold before it fires (a run with fewer such steps can never fire it: ``rules_beyond_run``)
HEALTH_RULE_PATIENCE = {"entropy_collapse": "health_patience", "one_token": "health_patience",
                        "flat_rewards": "health_flat_reward_steps"}
# the rules whose signal is logged once per generation batch (``completions/one_token_share``,
# ``rewards/flat_group_share``): only the optimizer steps that generate observe it (``generating_steps``); the
# others' (TRL's ``entropy``, logged by every microbatch's loss) is observed on every step
PER_GENERATION_RULES = ("one_token", "flat_rewards")


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# why greedy decoding, however asked for (temperature 0, top_k 1, do_sample false), is refused
GREEDY = ("would give every completion of a group the same text, hence zero advantages; for nearly greedy sampling "
          "use a small temperature such as 0.1")

# field -> (test of a value that is set, what it must be); None always passes (TRL's "not set")
RANGES = {
    "learning_rate": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
    "beta": (lambda v: _real(v) and v >= 0, "a finite number >= 0 (a negative KL coefficient rewards leaving the "
             "reference)"),
    "epsilon": (lambda v: _real(v) and v > 0, "a finite number > 0 (the lower clip of the ratio)"),
    "epsilon_high": (lambda v: _real(v) and v > 0, "a finite number > 0 (the upper clip of the ratio)"),
    "delta": (lambda v: _real(v) and v > 1, "a finite number > 1, or null for none: the cap on a negative-advantage "
              "token's importance ratio in TRL's two-sided clip, a ratio such as 4 (INTELLECT-2), not a margin like "
              "epsilon; TRL advises more than 1 + epsilon, and any cap up to 1 + epsilon_high acts as that bound"),
    "temperature": (lambda v: _real(v) and v > 0, "a finite number > 0: the logprobs are log_softmax(logits / T), "
                    f"and greedy decoding (T = 0) {GREEDY}"),
    "top_p": (lambda v: _real(v) and 0 < v <= 1, "in (0, 1]"),
    "min_p": (lambda v: _real(v) and 0 <= v <= 1, "in [0, 1]"),
    "top_k": (lambda v: _int(v) and v >= 0 and v != 1, "an integer >= 0 other than 1 (0: off; top_k 1 keeps only the "
              f"most likely token, greedy decoding, which {GREEDY})"),
    "repetition_penalty": (lambda v: _real(v) and v > 0, "a finite number > 0 (1.0: off)"),
    "presence_penalty": (_real, "a finite number"),
    "frequency_penalty": (_real, "a finite number"),
    "entropy_coef": (lambda v: _real(v) and v >= 0, "a finite number >= 0: the loss is policy + beta*KL - c*H with "
                     "c >= 0 encouraging exploration (INVARIANT I7); 0 for no bonus"),
    "entropy_coef_delta": (lambda v: _real(v) and v >= 0, "a finite number >= 0 (the adaptive controller's step: it "
                           "raises the entropy coefficient by it while entropy is at or below entropy_target)"),
    "entropy_target": (lambda v: _real(v) and v >= 0, "a finite number of nats >= 0 (a mean token entropy)"),
    "top_entropy_quantile": (lambda v: _real(v) and 0 <= v <= 1, "in [0, 1]: the share of tokens, by entropy, the "
                             "policy loss keeps (1: all; 0: the highest-entropy token only)"),
    "off_policy_mask_threshold": (lambda v: _real(v) and v > 0, "a finite number > 0, or null for no masking: the "
                                  "mean per-token KL (nats) to the sampler above which a sequence with a negative "
                                  "advantage leaves the loss, e.g. 0.5"),
    "sapo_temperature_pos": (lambda v: _real(v) and v > 0, "a finite number > 0 (SAPO's gate divides by it)"),
    "sapo_temperature_neg": (lambda v: _real(v) and v > 0, "a finite number > 0 (SAPO's gate divides by it)"),
    "vespo_k_pos": (lambda v: _real(v) and v >= 0, "a finite number >= 0 (VESPO's power of the ratio)"),
    "vespo_k_neg": (lambda v: _real(v) and v >= 0, "a finite number >= 0 (VESPO's power of the ratio)"),
    "vespo_lambda_pos": (lambda v: _real(v) and v > 0, "a finite number > 0 (VESPO's decay; TRL raises it to 1e-4)"),
    "vespo_lambda_neg": (lambda v: _real(v) and v > 0, "a finite number > 0 (VESPO's decay; TRL raises it to 1e-4)"),
    "vllm_importance_sampling_clip_min": (lambda v: _real(v) and v >= 0, "a finite number >= 0, or null (a lower "
                                          "bound on a ratio of probabilities)"),
    "vllm_importance_sampling_clip_max": (lambda v: _real(v) and v > 0, "a finite number > 0, or null (an upper "
                                          "bound on a ratio of probabilities)"),
    "ref_model_mixup_alpha": (lambda v: _real(v) and 0 <= v <= 1, "in [0, 1]: each sync sets the reference to "
                              "alpha * policy + (1 - alpha) * reference"),
    "ref_model_sync_steps": (lambda v: _int(v) and v >= 1, "an integer >= 1 (optimizer steps between syncs)"),
    "weight_decay": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
    "max_grad_norm": (lambda v: _real(v) and v >= 0, "a finite number >= 0 (0: no clipping)"),
    "warmup_ratio": (lambda v: _real(v) and 0 <= v <= 1, "in [0, 1]"),
    "num_train_epochs": (lambda v: _real(v) and v > 0, "a finite number > 0"),
    "num_generations": (lambda v: _int(v) and v >= 2, "an integer >= 2 (GRPO normalises rewards within a group)"),
    "num_generations_eval": (lambda v: _int(v) and v >= 1, "an integer >= 1, or null for num_generations"),
    "generation_batch_size": (lambda v: _int(v) and v >= 1, "an integer >= 1, or null (from steps_per_generation)"),
    "num_iterations": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "steps_per_generation": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "per_device_train_batch_size": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "per_device_eval_batch_size": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "gradient_accumulation_steps": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "max_steps": (lambda v: _int(v) and (v > 0 or v == -1), "an integer > 0 (or -1: by num_train_epochs)"),
    "max_completion_length": (lambda v: _int(v) and v >= 1, "an integer >= 1 (new tokens per completion)"),
    "max_prompt_length": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "max_length": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "min_new_tokens": (lambda v: _int(v) and v >= 0, "an integer >= 0"),
    "guard_steps": (lambda v: _int(v) and v >= -1, "an integer: -1 every step, 0 off, N the first N steps"),
    "guard_logprob_atol": (lambda v: _real(v) and v > 0, "a finite number > 0"),
    "health_min_entropy": (lambda v: _real(v) and v >= 0, "a finite number of nats >= 0 (a mean token entropy; 0 "
                           "turns the entropy-collapse rule off)"),
    "health_max_one_token_share": (lambda v: _real(v) and 0 <= v <= 1, "in [0, 1] (a share of completions; 1 turns "
                                   "the 1-token rule off)"),
    "health_patience": (lambda v: _int(v) and v >= 1, "an integer >= 1 (consecutive steps that observed a rule's "
                        "signal on which its condition must hold before it fires)"),
    "health_flat_reward_steps": (lambda v: _int(v) and v >= 0, "an integer >= 0 (consecutive flat generation "
                                 "batches; 0 turns the rule off)"),
    "health_report_steps": (lambda v: _int(v) and v >= 0, "an integer >= 0 (0: never)"),
    "health_logit_steps": (lambda v: _int(v) and v >= 0, "an integer >= 0 (0: on guard steps only)"),
    "dynamic_sampling_max_rounds": (lambda v: _int(v) and v >= 0, "an integer >= 0 (0: drop flat groups, no refill)"),
    "discriminator_learning_rate": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
    "discriminator_lora_r": (lambda v: _int(v) and v >= 0, "an integer >= 0 (0: no LoRA, every weight trains)"),
    "discriminator_warmup_steps": (lambda v: _int(v) and v >= 0, "an integer >= 0"),
    "kl_in_reward_coef": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
}

# field -> the values TRL 1.16 takes, where TRL's trainer (or vLLM's wrapper, or transformers' GenerationConfig)
# would refuse any other only once the model has loaded. One table per config family: a name may be another
# field in each (loss_type). Values TRL's __post_init__ converts are taken too (scale_rewards True / False,
# SFT's deprecated 'chunked_nll' and 'bfd-requeue'). tests/configs/test_choices.py compares each with TRL's code.
GRPO_CHOICES = {
    "loss_type": tuple(LOSS_TYPES),
    "importance_sampling_level": ("token", "sequence"),
    "scale_rewards": ("group", "batch", "none", True, False),
    "multi_objective_aggregation": ("sum_then_normalize", "normalize_then_sum"),
    "vllm_importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    "vllm_mode": ("colocate", "server"),
    # handed to vLLM's LLM(model_impl=...) as is; the values TRL's vLLM wrapper documents
    # (trl.generation.vllm_generation.VLLMGeneration), of which GRPOConfig's help names two
    "vllm_model_impl": ("auto", "vllm", "transformers", "terratorch"),
    "cache_implementation": (*ALL_CACHE_IMPLEMENTATIONS, "paged"),  # transformers' GenerationConfig.validate
}
SFT_CHOICES = {
    "loss_type": ("nll", "dft", "chunked_nll"),
    "packing_strategy": ("bfd", "bfd_split", "wrapped", "bfd-requeue"),
    "truncation_mode": ("keep_start", "keep_end"),
}


def choices_of(args) -> dict:
    """The choice table for ``args``' config family: ``SFT_CHOICES``, ``GRPO_CHOICES`` (GAD's too), else none."""
    if isinstance(args, trl.SFTConfig):
        return SFT_CHOICES
    return GRPO_CHOICES if isinstance(args, trl.GRPOConfig) else {}


def check_ranges(args) -> None:
    """Raise ``InputError`` for the first numeric setting of ``args`` (any TRL or grpotrl config) that is
    set to something its field cannot mean (a wrong sign, a zero, a NaN, a list), or the first string-choice
    field set to a value TRL 1.16 does not take (``choices_of``), with the closest value it takes. Runs on
    the config, before any weights load, and before TRL's own __post_init__ divides by any of them. An empty
    ``output_dir`` too: the Trainer's ``makedirs('')`` fails only after the model loaded."""
    if getattr(args, "output_dir", None) == "":
        raise InputError("output_dir is empty ('' in the config or recipe, or --output_dir \"$VAR\" with VAR unset). "
                         "Set it to the directory the run writes to.")
    for name, (ok, what) in RANGES.items():
        value = getattr(args, name, None)
        if value is not None and not ok(value):
            write = f" (write {int(value)})" if isinstance(value, float) and value.is_integer() and ok(int(value)) \
                else ""
            raise InputError(f"{name}={value!r} ({type(value).__name__}): it must be {what}{write}. Fix it in the "
                             "recipe, on the command line or in the config.")
    for name, choices in choices_of(args).items():
        value = getattr(args, name, None)
        if value is not None and not any(isinstance(value, bool) == isinstance(c, bool) and value == c
                                         for c in choices):  # 1 == True, but TRL converts only the bool
            raise InputError(f"{name}={value!r}: TRL 1.16 takes {', '.join(map(repr, choices))}"
                             f"{_closest(value, choices)}. Fix it in the recipe, on the command line or in the config.")


def _closest(value, choices) -> str:
    """`` (did you mean 'sequence'?)`` for a string close to, or a prefix of, one of ``choices``; else ''."""
    if not isinstance(value, str):
        return ""
    names = [c for c in choices if isinstance(c, str)]
    close = [c for c in names if value and c.startswith(value.lower())] or \
        difflib.get_close_matches(value.lower(), names, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _adopt_generation_kwarg(args, kwargs: dict, name: str, why: str, default=1.0, key: str | None = None) -> None:
    """``generation_kwargs[key]`` (``key`` defaults to ``name``), where given, becomes ``args.<name>`` (this
    changes ``args``): checked against ``RANGES`` first, refused where the field is set to another value than its
    ``default`` (``temperature=0.7`` with ``generation_kwargs={"temperature": 1.0}`` too: TRL would sample at 1.0)."""
    key = key or name
    if key not in kwargs:
        return
    given, field = kwargs[key], getattr(args, name)
    ok, what = RANGES[name]
    if not ok(given):
        raise InputError(f"generation_kwargs['{key}']={given!r}: it must be {what}.")
    if field not in (default, given):
        raise InputError(f"{name}={field} and generation_kwargs['{key}']={given} disagree ({why}): "
                         f"set it once, as {name}.")
    setattr(args, name, given)


def check_grpotrl_fields(args) -> None:
    """grpotrl's own checks of a GRPO config (also run on a ``trl.GRPOConfig`` that
    ``complete_grpo_config`` completed): each bad value is an ``InputError`` saying what to use."""
    actions = args.health_rule_actions or {}
    if args.health_action not in ("auto", *HEALTH_ACTIONS):
        raise InputError(f"health_action={args.health_action!r}: use 'auto', 'stop', 'warn' or 'off'.")
    if not isinstance(actions, dict) or any(k not in HEALTH_RULES or v not in HEALTH_ACTIONS
                                            for k, v in actions.items()):
        raise InputError(f"health_rule_actions={actions!r}: map rule names {list(HEALTH_RULES)} to one of "
                         f"{list(HEALTH_ACTIONS)}, e.g. {{'entropy_collapse': 'stop'}}.")
    _check_rules_can_fire(args, actions)
    if args.sampler_gap_action not in ("warn", "stop", "off"):
        raise InputError(f"sampler_gap_action={args.sampler_gap_action!r}: use 'warn', 'stop' or 'off'.")
    if not (isinstance(args.sampler_gap_threshold, (int, float)) and args.sampler_gap_threshold > 0
            and math.isfinite(args.sampler_gap_threshold)):
        raise InputError(f"sampler_gap_threshold={args.sampler_gap_threshold!r}: use a finite number of nats > 0 "
                         "(e.g. 0.1), or sampler_gap_action='off'.")
    if args.cagrad not in ("off", "exact", "low_memory"):
        raise InputError(f"cagrad={args.cagrad!r}: use 'off', 'exact' or 'low_memory'.")
    if not 0.0 <= args.cagrad_c < 10:
        raise InputError(f"cagrad_c={args.cagrad_c}: use a value in [0, 10) (typical 0.4-0.5; 0 = mean gradient).")
    _check_generation_settings(args)
    _check_kl_fields(args)
    check_padding_free(args)
    check_packed_attention(args)
    check_compiled_rollout(args)
    if args.use_adaptive_entropy and not 0 <= args.entropy_coef_min <= args.entropy_coef_max:
        raise InputError(f"entropy_coef_min={args.entropy_coef_min}, entropy_coef_max={args.entropy_coef_max}: "
                         "TRL's adaptive controller moves the entropy bonus coefficient between them, and c < 0 "
                         "would minimise entropy (INVARIANT I7). Use 0 <= entropy_coef_min <= entropy_coef_max.")


def _check_rules_can_fire(args, actions: dict) -> None:
    """A rule that ``health_rule_actions`` sets to 'stop' or 'warn' while its own setting turns it off
    (``HEALTH_RULE_OFF``: ``health_min_entropy`` 0, ``health_max_one_token_share`` 1, ``health_flat_reward_steps``
    0), or that could not tell a broken run from a healthy one (``one_token`` where every completion is one token:
    ``one_token_by_construction``), or whose patience exceeds the steps of ``max_steps`` that observe its signal
    (``check_patience_fits``: the generating ones for one_token and flat_rewards), could never fire or would fire on
    every step: refused, naming both. Under ``health_action`` alone such a value is that
    rule's 'off', as documented, and is taken (``health.callbacks`` turns one_token off there, with one line)."""
    for rule, (name, off, what) in HEALTH_RULE_OFF.items():
        action, value = actions.get(rule), getattr(args, name, None)
        if action in ("stop", "warn") and value is not None and off(value):
            raise InputError(f"health_rule_actions={{'{rule}': '{action}'}} with {name}={value!r}: that value turns "
                             f"the {rule} rule off, so it can never {action}. Set {name} to {what}, or set "
                             f"health_rule_actions' {rule} to 'off' (or drop it).")
    action = actions.get("one_token")
    if action in ("stop", "warn") and one_token_by_construction(args):
        raise InputError(f"health_rule_actions={{'one_token': '{action}'}} with {completion_cap_setting(args)}: every "
                         "completion is one token long by construction, so the share of 1-token completions is 1 "
                         f"on every step and the rule would {action} on a healthy run. Set health_rule_actions' "
                         "one_token to 'off' (or drop it: by default the rule is then off), or allow longer "
                         "completions.")
    if _int(args.max_steps) and args.max_steps > 0:
        check_patience_fits(args, args.max_steps, f"max_steps={args.max_steps}")


def health_action_of(args, rule: str, default: str) -> str:
    """'stop', 'warn' or 'off' for ``rule``: ``health_rule_actions[rule]``, else ``health_action`` unless 'auto',
    else the rule's ``default``."""
    chosen = (args.health_rule_actions or {}).get(rule)
    return chosen or (args.health_action if args.health_action != "auto" else default)


def completion_cap(args) -> int | None:
    """The most tokens a completion can hold: ``generation_kwargs``' ``max_tokens`` (vLLM) or ``max_new_tokens``
    (transformers), which TRL lets override the field, else ``max_completion_length``; None where neither is an
    integer."""
    kwargs = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
    cap = kwargs.get("max_tokens" if args.use_vllm else "max_new_tokens", args.max_completion_length)
    return cap if _int(cap) else None


def one_token_by_construction(args) -> bool:
    """Whether every completion is one token long whatever the model does (``completion_cap`` 1): the one_token
    rule's share is then 1 on every step, healthy or not, and the rule tells nothing."""
    return completion_cap(args) == 1


def completion_cap_setting(args) -> str:
    """The setting ``completion_cap`` read, as the user wrote it."""
    kwargs = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
    key = "max_tokens" if args.use_vllm else "max_new_tokens"
    return f"generation_kwargs['{key}']={kwargs[key]!r}" if key in kwargs \
        else f"max_completion_length={args.max_completion_length!r}"


# each patience setting's default: ``HealthFields`` declares its fields with them, and ``check_patience_fits`` tells a
# patience the user set from one left at its default by them (a plain ``trl.GRPOConfig`` has no such fields)
PATIENCE_DEFAULTS = {"health_patience": 5, "health_flat_reward_steps": 20}


def generating_steps(args, steps: int) -> int:
    """How many of a run's ``steps`` optimizer steps generate, so observe a signal logged once per generation batch
    (``PER_GENERATION_RULES``), as TRL 1.16 schedules them: ``_prepare_inputs`` generates on every microbatch whose
    count since the run began is a multiple of ``steps_per_generation x num_iterations`` (it reuses that batch in
    between), and an optimizer step is ``gradient_accumulation_steps`` microbatches. So the run of ``steps x
    gradient_accumulation_steps`` microbatches generates ``ceil(steps x gradient_accumulation_steps /
    (steps_per_generation x num_iterations))`` times, each in a step of its own where a generation batch spans at
    least one step, and every step generates (once or more) where it spans less. Exact where every optimizer step
    is ``gradient_accumulation_steps`` microbatches; where an epoch's microbatches are not a multiple of it (only
    where ``steps_per_generation x num_iterations`` is not), transformers' shorter last step of an epoch makes the
    run generate on fewer steps: the count is then an upper bound, so a rule refused for it can never fire.

    >>> from types import SimpleNamespace as Args
    >>> generating_steps(Args(gradient_accumulation_steps=4, steps_per_generation=4, num_iterations=2), 6)
    3
    >>> # one generation every 3 microbatches, 2 a step: at microbatches 0, 3, 6, 9 of 12, in steps 1, 2, 4, 5
    >>> generating_steps(Args(gradient_accumulation_steps=2, steps_per_generation=3, num_iterations=1), 6)
    4
    >>> generating_steps(Args(gradient_accumulation_steps=4, steps_per_generation=2, num_iterations=1), 6)
    6
    """
    micro = steps * args.gradient_accumulation_steps
    every = (args.steps_per_generation or args.gradient_accumulation_steps) * args.num_iterations
    return min(steps, -(-micro // every))


def generation_schedule(args) -> str:
    """The settings ``generating_steps`` read, as the user wrote them."""
    spg, mu = args.steps_per_generation or args.gradient_accumulation_steps, args.num_iterations
    return (f"TRL generates once every steps_per_generation x num_iterations = {spg} x {mu} = {spg * mu} "
            f"microbatches, and an optimizer step is gradient_accumulation_steps={args.gradient_accumulation_steps} "
            "of them")


def rules_beyond_run(args, steps: int) -> list[tuple[str, str, int, int]]:
    """``(rule, its patience setting, the setting's value, the steps the run has that observe the rule's signal)`` of
    each warn-by-default rule (``HEALTH_RULE_PATIENCE``) that is on (not 'off', not turned off by its own setting,
    one_token not off by construction) and can never fire in a run of ``steps`` optimizer steps: its patience counts
    consecutive steps that observed its signal, and the run has fewer. Those are all ``steps`` for entropy_collapse
    and the steps that generate (``generating_steps``) for the rules that read a generation batch's signal
    (``PER_GENERATION_RULES``), fewer than ``steps`` under ``num_iterations > 1`` or ``steps_per_generation >
    gradient_accumulation_steps``."""
    found = []
    for rule, setting in HEALTH_RULE_PATIENCE.items():
        value, (own, off, _) = getattr(args, setting, None), HEALTH_RULE_OFF[rule]
        turned_off = getattr(args, own, None) is not None and off(getattr(args, own))
        if health_action_of(args, rule, "warn") == "off" or not _int(value) or turned_off \
                or (rule == "one_token" and one_token_by_construction(args)):
            continue
        observed = generating_steps(args, steps) if rule in PER_GENERATION_RULES else steps
        if value > observed:
            found.append((rule, setting, value, observed))
    return found


def patience_span(args, steps: int, observed: int) -> str:
    """What a rule's patience counts in a run of ``steps`` optimizer steps of which ``observed`` observe its
    signal, as ``rules_beyond_run`` found it: the consecutive optimizer steps where every step observes it, else
    the consecutive generation batches, with the schedule that makes them fewer."""
    if observed == steps:
        return f"consecutive optimizer steps, so in a run of {steps} steps"
    return (f"consecutive generation batches (its signal is logged once per generation batch), and a run of {steps} "
            f"optimizer steps has {observed} ({generation_schedule(args)}), so")


def check_patience_fits(args, steps: int, run: str) -> None:
    """Raise ``InputError`` where a rule that can never fire in a run of ``steps`` optimizer steps
    (``rules_beyond_run``: too few steps observe its signal) was asked for: ``health_rule_actions`` sets it to 'stop'
    or 'warn', or its patience setting is not that setting's default (``PATIENCE_DEFAULTS``). ``run`` says where ``steps`` comes from, as the user wrote it
    (``max_steps=3``). A rule at its default patience under ``health_action`` alone is taken: it is off for this run
    (``health.callbacks`` says so in one line)."""
    beyond = rules_beyond_run(args, steps)
    actions = args.health_rule_actions or {}
    for rule, setting, value, observed in beyond:
        action = actions.get(rule)
        if action in ("stop", "warn"):
            raise InputError(f"health_rule_actions={{'{rule}': '{action}'}} with {setting}={value} and {run}: the rule "
                             f"fires once its condition held on {value} {patience_span(args, steps, observed)} it can "
                             f"never {action}. Set {setting} to at most {observed}, train for more steps, or set "
                             f"health_rule_actions' {rule} to 'off'.")
    for setting in dict.fromkeys(s for _, s, _, _ in beyond):
        value = getattr(args, setting)
        if value != PATIENCE_DEFAULTS[setting]:
            spans = {}  # observed steps -> the rules of this setting that the run has that many steps for
            for rule, s, _, observed in beyond:
                if s == setting:
                    spans.setdefault(observed, []).append(rule)
            parts = [f"{' and '.join(rules)} fire{'s' if len(rules) == 1 else ''} once "
                     f"{'its' if len(rules) == 1 else 'their'} condition held on {value} "
                     f"{patience_span(args, steps, observed)} "
                     f"{'it can never' if len(rules) == 1 else 'neither can ever'} fire"
                     for observed, rules in spans.items()]
            raise InputError(f"{setting}={value} with {run}: {'; '.join(parts)}. Set {setting} to at most "
                             f"{min(spans)} (its default is {PATIENCE_DEFAULTS[setting]}), or train for more steps.")


PADDING_FREE = (True, False, "auto", "true", "false")


def check_padding_free(args) -> None:
    """``padding_free`` and ``balance_microbatches`` are true, false or 'auto' (a recipe may quote them);
    the trainer refuses what it cannot honour once it sees the model (``trainers.padding_free.resolve``,
    ``resolve_balance``)."""
    for name, auto in (("padding_free", "on CPU where the model's attention keeps packed rows apart"),
                       ("balance_microbatches", "on where the loss does not depend on which rows share a microbatch")):
        value = getattr(args, name, False)
        if not (value in (True, False) or (isinstance(value, str) and value.strip().lower() in PADDING_FREE[2:])):
            raise InputError(f"{name}={value!r}: use true, false or 'auto' ({auto}).")


PACKED_ATTENTION = ("auto", "varlen", "mask")


def check_packed_attention(args) -> None:
    """``args.packed_attention`` is 'auto', 'varlen' or 'mask' (any case; a config without the field passes); what
    the model allows is ``trainers.padding_free.resolve_packed_attention``'s, once the model is loaded."""
    value = getattr(args, "packed_attention", "auto")
    if not (isinstance(value, str) and value.strip().lower() in PACKED_ATTENTION):
        raise InputError(f"packed_attention={value!r}: use 'auto', 'varlen' (each forward's packed sequences in one "
                         "row with their boundaries) or 'mask' (rows under transformers' mask).")


def check_compiled_rollout(args) -> None:
    """``compiled_rollout`` is true, false or 'auto' (a recipe may quote it); the trainer refuses what it cannot
    honour once it sees the model and the rollout path (``generation.compiled_rollout.resolve``)."""
    value = getattr(args, "compiled_rollout", False)
    if not (value in (True, False) or (isinstance(value, str) and value.strip().lower() in PADDING_FREE[2:])):
        raise InputError(f"compiled_rollout={value!r}: use true, false or 'auto' (on where it was measured faster "
                         "than TRL's eager rollout: no device yet).")


MIN_LENGTH_KEYS = ("min_new_tokens", "min_tokens")  # generation_kwargs' names of min_new_tokens (transformers', vLLM's)


def normalize_generation_kwargs(args) -> None:
    """Move the three sampling settings grpotrl reads from the fields into those fields, where
    ``generation_kwargs`` gives them (this changes ``args``; run once, by the config, before
    ``check_grpotrl_fields``). A value given in both places differently is an ``InputError``.

    TRL lets ``generation_kwargs`` override the sampling fields. Three of them grpotrl reads elsewhere:
    ``repetition_penalty``, applied response-only like the field (I6; on the transformers path
    grpotrl replaces transformers' own, which counts the prompt); ``temperature``, at which the
    logprobs are computed (I5: TRL computes them at the field's temperature, so
    ``generation_kwargs={"temperature": 0.7}`` alone sampled at 0.7 and trained on logprobs at 1.0); and
    the minimum completion length, which TRL's config has no field for, so a TRL user writes it here, as
    ``min_new_tokens`` (transformers' name) or ``min_tokens`` (vLLM's). Either becomes the field
    ``min_new_tokens`` and leaves ``generation_kwargs`` (a new dict: the caller's is not changed); the trainer
    hands the field to each sampler under its own name (grpotrl's processor on the transformers path, which
    blocks every stop id and logs how often it fired, I6; ``min_tokens`` to vLLM). Left in
    ``generation_kwargs``, TRL passes each name to both samplers as it is: vLLM's ``SamplingParams`` has no
    ``min_new_tokens`` (a TypeError at the first rollout, after the model loaded) and transformers'
    ``GenerationConfig`` ignores ``min_tokens`` without a word."""
    kwargs = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
    _adopt_generation_kwarg(args, kwargs, "repetition_penalty", "I6: the penalty counts response tokens only")
    _adopt_generation_kwarg(args, kwargs, "temperature", "I5: completions would be sampled at one temperature "
                            "and their logprobs computed at the other")
    if set(MIN_LENGTH_KEYS) <= set(kwargs) and kwargs["min_new_tokens"] != kwargs["min_tokens"]:
        raise InputError(f"generation_kwargs['min_new_tokens']={kwargs['min_new_tokens']!r} and "
                         f"generation_kwargs['min_tokens']={kwargs['min_tokens']!r} disagree (transformers' and vLLM's "
                         "names of one setting): set it once, as min_new_tokens.")
    for key in MIN_LENGTH_KEYS:
        _adopt_generation_kwarg(args, kwargs, "min_new_tokens", "I6: every stop id is blocked until then", default=0,
                                key=key)
    if any(key in kwargs for key in MIN_LENGTH_KEYS):
        args.generation_kwargs = {k: v for k, v in kwargs.items() if k not in MIN_LENGTH_KEYS}


# why beam sampling cannot run where the sampler's logprobs are recorded (``generation_kwargs`` or the model's own)
BEAMS_UNRECORDED = ("these settings record the sampler's logprob of every token (the sampler/trainer gap, "
                    "hf_importance_sampling_correction), but beam sampling draws each token from all beams' "
                    "accumulated scores and reorders the rows at every step, so no row has a sampler logprob of its "
                    "own")


_ASSISTED = ("turns on assisted decoding, which transformers runs on one row at a time, and TRL generates a batch (a "
             "ValueError at the first rollout)")
_FROM_HUB = ("selects a decoding mode transformers 5 runs only as remote code from the Hub, which TRL's generate call "
             "does not allow (a ValueError at the first rollout)")
NO_OFF = object()  # no value of the field turns it off: generate fills None from the model's file

# generation_config fields under which transformers' generate, as TRL calls it, cannot return one sampled completion
# per prompt row (transformers 5.24): field -> (test of a value that is set, what it does, the value that turns it
# off, or NO_OFF). Refused in generation_kwargs on the transformers path (``_check_generation_settings``), and in the
# model's own generation_config.json wherever generation_kwargs does not set the field (``preflight``).
UNRUNNABLE_GENERATION = {
    "num_return_sequences": (lambda v: _int(v) and v > 1, "makes generate return that many completions per prompt "
                             "row, while TRL pairs the i-th completion with the i-th prompt (a RuntimeError at the "
                             "first rollout)", 1),
    "return_dict_in_generate": (lambda v: v is True, "makes generate return a GenerateDecoderOnlyOutput instead of "
                                "the token tensor TRL slices (a TypeError at the first rollout)", False),
    "stop_strings": (lambda v: v is not None, "needs the tokenizer passed to generate, which TRL does not pass (a "
                     "ValueError at the first rollout); completions stop on the stop token ids", NO_OFF),
    "token_healing": (lambda v: v is True, "needs the tokenizer passed to generate, which TRL does not pass (a "
                      "ValueError at the first rollout)", False),
    "prompt_lookup_num_tokens": (lambda v: v is not None, _ASSISTED, NO_OFF),
    "assistant_early_exit": (lambda v: v is not None, _ASSISTED, NO_OFF),
    "use_mtp": (lambda v: v is True, _ASSISTED, False),
    "dola_layers": (lambda v: v is not None, _FROM_HUB, NO_OFF),
    "force_words_ids": (lambda v: v is not None, _FROM_HUB, NO_OFF),
    "constraints": (lambda v: v is not None, _FROM_HUB, NO_OFF),
    "num_beam_groups": (lambda v: _int(v) and v > 1, _FROM_HUB, 1),
}

# generation_config fields that change what transformers' generate samples from, beyond GRPOConfig's temperature,
# top_k, top_p, min_p and grpotrl's own processors (I6), and that TRL's generation config leaves unset, so that
# generate takes them from the model's generation_config.json (transformers 5.24, ``_get_logits_processor``;
# ``forced_bos_token_id``, ``remove_invalid_values`` and ``renormalize_logits`` change no sampled token there):
# field -> (test of a value that is set, what it does, the generation_kwargs value that turns it off, or NO_OFF).
# Taken, as TRL takes them and as grpotrl takes them in generation_kwargs, with a warning where they come from the
# model's file (``preflight``).
SAMPLING_CHANGES = {
    "min_p": (lambda v: _real(v) and v > 0, "keeps only tokens with a probability of at least min_p times the top "
              "token's (GRPOConfig's min_p is None: TRL leaves it to the model)", 0.0),
    "top_h": (lambda v: v is not None, "keeps only the most likely tokens whose entropy reaches top_h of the full "
              "distribution's", NO_OFF),
    "typical_p": (lambda v: _real(v) and v < 1, "keeps only the locally typical tokens", 1.0),
    "epsilon_cutoff": (lambda v: _real(v) and 0 < v < 1, "drops every token of a probability below it", 0.0),
    "eta_cutoff": (lambda v: _real(v) and 0 < v < 1, "drops every token of a probability below an entropy-dependent "
                   "cutoff", 0.0),
    "no_repeat_ngram_size": (lambda v: _int(v) and v > 0, "bans every token that would repeat an n-gram of the "
                             "prompt and completion", 0),
    "encoder_no_repeat_ngram_size": (lambda v: _int(v) and v > 0, "bans every token that would repeat an n-gram of "
                                     "the prompt", 0),
    "encoder_repetition_penalty": (lambda v: _real(v) and v != 1, "scales the logits of every token of the prompt",
                                   1.0),
    "bad_words_ids": (lambda v: v is not None, "bans these token sequences", NO_OFF),
    "suppress_tokens": (lambda v: bool(v), "never samples these token ids", []),
    "begin_suppress_tokens": (lambda v: bool(v), "never samples these token ids first", []),
    "sequence_bias": (lambda v: v is not None, "adds these biases to the logits of these token sequences", NO_OFF),
    "forced_eos_token_id": (lambda v: v is not None, "forces this token at the last position max_completion_length "
                            "allows, so no completion is ever truncated", NO_OFF),
    "min_length": (lambda v: _int(v) and v > 0, "bans the eos ids until prompt and completion together hold that "
                   "many tokens", 0),
    "exponential_decay_length_penalty": (lambda v: v is not None, "raises the eos logits more at every token past "
                                         "its start", NO_OFF),
    "guidance_scale": (lambda v: _real(v) and v != 1, "mixes into every step the logits of a second forward on the "
                       "last prompt token alone (classifier-free guidance)", 1.0),
    "watermarking_config": (lambda v: v is not None, "adds a bias to a pseudo-random green list of tokens at every "
                            "step (a watermark)", NO_OFF),
}


# a field refused in the model's generation_config.json only: in generation_kwargs it is the user's own time limit
CUT_SHORT = {
    "max_time": (lambda v: v is not None, "stops every completion after that many seconds, without a stop token, at "
                 "a length the machine's speed decides (INVARIANT I4; past the guard steps they train as truncated); a "
                 "max_time in generation_kwargs is taken as the user's own limit",
                 NO_OFF),
}


def recorded_settings(args) -> dict:
    """The settings that put grpotrl's logits processors and its recorder of the sampler's logprobs into each
    transformers ``generate`` call (``generation.sampled_logprobs.generation_extras``), by name, where set."""
    return {name: value for name, value in (
        ("presence_penalty", args.presence_penalty), ("frequency_penalty", args.frequency_penalty),
        ("repetition_penalty", args.repetition_penalty if args.repetition_penalty != 1.0 else None),
        ("min_new_tokens", args.min_new_tokens),
        ("hf_importance_sampling_correction", args.hf_importance_sampling_correction)) if value}


def _check_generation_settings(args) -> None:
    """Sampling settings grpotrl would otherwise drop without a word, or that sample no group, are refused:

    * continuous batching runs transformers' own sampler, which takes no logits processors, so the
      response-only penalties, ``min_new_tokens`` and the sampler-logprob recorder that
      ``hf_importance_sampling_correction`` reads cannot run there;
    * under vLLM, TRL's own ``vllm_importance_sampling_correction`` corrects the sampler gap, and
      ``hf_importance_sampling_correction`` would correct it a second time, in the advantages;
    * greedy decoding (``generation_kwargs``' ``do_sample`` false, ``top_k`` 1) samples no group: refused as
      temperature 0 is (``RANGES``);
    * beam sampling (``generation_kwargs``' ``num_beams`` > 1) on the transformers path with any setting that
      records the sampler's logprobs: beam search samples each token from every beam's accumulated score and
      reorders its rows at each step, so no row has a sampler logprob to record (the recorder would fail
      after the first rollout, or hand a row another's numbers). Without those settings it is taken, as TRL
      takes it. A ``num_beams`` in the model's own ``generation_config.json`` needs the model: the trainer's
      preflight refuses it (``preflight.check_grpo``);
    * on the transformers path, ``generation_kwargs`` that stop ``generate`` from returning one sampled completion
      per prompt row (``UNRUNNABLE_GENERATION``: ``num_return_sequences`` > 1, a dict return, stop strings,
      assisted decoding, the decoding modes transformers runs from the Hub), each of which fails at the first
      rollout, after the model loaded."""
    kwargs = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
    recorded = recorded_settings(args)
    if args.use_transformers_continuous_batching and recorded:
        raise InputError(
            f"{', '.join(f'{k}={v}' for k, v in recorded.items())} with use_transformers_continuous_batching: "
            "continuous batching samples with transformers' own batch scheduler, which takes none of grpotrl's "
            "logits processors (nor the recorder of the sampler's logprobs that hf_importance_sampling_correction "
            "reads), so these would be silently dropped (a repetition penalty there would also count "
            "the prompt, INVARIANT I6). Use the transformers generate path (use_transformers_continuous_batching: "
            "false) or vLLM, or leave these settings at their defaults.")
    beams = kwargs.get("num_beams", 1)
    if not args.use_vllm and _int(beams) and beams > 1 and recorded:
        raise InputError(
            f"generation_kwargs['num_beams']={beams} with {', '.join(f'{k}={v}' for k, v in recorded.items())}: "
            f"{BEAMS_UNRECORDED}. Drop num_beams (GRPO samples each completion on its own), or leave these settings "
            "at their defaults.")
    if args.use_vllm and args.hf_importance_sampling_correction:
        raise InputError(
            "hf_importance_sampling_correction=True with use_vllm: it is the transformers generate path's correction. "
            "Under vLLM, TRL's own vllm_importance_sampling_correction (on by default, with the same "
            "vllm_importance_sampling_mode / _clip_min / _clip_max) corrects for the sampler's logprobs, and "
            "grpotrl's would correct the same gap a second time, in the advantages. Turn "
            "hf_importance_sampling_correction off (and vllm_importance_sampling_correction on).")
    for name, (is_set, what, _) in UNRUNNABLE_GENERATION.items():
        if not args.use_vllm and kwargs.get(name) is not None and is_set(kwargs[name]):
            raise InputError(f"generation_kwargs['{name}']={kwargs[name]!r} {what}. Drop it from generation_kwargs "
                             "(GRPO samples num_generations completions of every prompt itself).")
    if "do_sample" in kwargs and not kwargs["do_sample"]:
        raise InputError(f"generation_kwargs['do_sample']={kwargs['do_sample']!r}: greedy decoding, like temperature "
                         f"0, {GREEDY}. Drop do_sample from generation_kwargs (GRPO samples).")
    if kwargs.get("top_k") == 1 and not isinstance(kwargs["top_k"], bool):
        raise InputError(f"generation_kwargs['top_k']=1 keeps only the most likely token: greedy decoding "
                         f"{GREEDY}. Drop it, or use a larger top_k.")


def normalize_kl_estimators(args) -> None:
    """``kl_estimator`` / ``kl_in_reward_estimator`` given by verl's name become ours (``low_var_kl`` ->
    ``k3``, ``low_var_kl+`` -> ``k3+``; this changes ``args``); an unknown name is an ``InputError``."""
    for name in ("kl_estimator", "kl_in_reward_estimator"):
        if getattr(args, name) is not None:
            try:
                setattr(args, name, kl_estimator_name(getattr(args, name)))
            except ValueError as err:
                raise InputError(f"{name}: {err}") from None


def _check_kl_fields(args) -> None:
    """Where the KL goes (``KLFields``): every combination that would leave a coefficient unused, a KL
    term with no pull towards the reference, or a check that cannot run, is refused."""
    reward_coef = args.beta if args.kl_in_reward_coef is None else args.kl_in_reward_coef
    in_loss = bool(args.beta and args.use_kl_loss)
    if in_loss and args.kl_estimator == "k1" and not args.use_bias_correction_kl:
        raise InputError("kl_estimator='k1' in the loss with use_bias_correction_kl=False: its gradient, "
                         "d log pi, is zero in expectation, so the KL term would add noise and no pull towards "
                         "the reference. Use use_bias_correction_kl: true (k1 times the importance ratio has "
                         "the gradient of KL(pi || pi_ref)), or kl_estimator: k1+ (k1's value, the KL's gradient) "
                         "or k2.")
    if args.beta and not (args.use_kl_loss or args.use_kl_in_reward):
        raise InputError(f"beta={args.beta} but use_kl_loss and use_kl_in_reward are both off: set one of them, "
                         "or beta: 0.0 for no KL.")
    if args.use_kl_in_reward and not reward_coef:
        raise InputError("use_kl_in_reward is on but its coefficient is 0: set beta, e.g. 0.001 (with use_kl_loss: "
                         "false, for a KL in the reward only), or kl_in_reward_coef for a coefficient of its own (with "
                         "beta 0, only where a LoRA adapter trains: TRL loads a reference model only when beta > 0).")
    if not args.use_kl_in_reward and (args.kl_in_reward_coef is not None or args.kl_in_reward_estimator):
        raise InputError("kl_in_reward_coef / kl_in_reward_estimator are set but use_kl_in_reward is off: turn it "
                         "on, or drop them.")
    if args.beta and not args.use_kl_loss and args.kl_in_reward_coef is not None:
        raise InputError(f"beta={args.beta} is the KL coefficient in the loss, but use_kl_loss is off and the "
                         f"reward has its own kl_in_reward_coef: beta would be unused. Set beta: 0.0 or use_kl_loss.")
    if in_loss and args.kl_estimator == "full" and args.cagrad != "off":
        raise InputError(f"kl_estimator='full' with cagrad={args.cagrad!r}: CAGrad's check that the task terms and "
                         "the regulariser add up to the loss recomputes the KL from per-token logprobs, which "
                         "'full' does not use. Use a sample-based estimator (k3, k2, ...) or cagrad: off.")
