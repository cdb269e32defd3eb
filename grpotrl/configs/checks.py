"""A config's own value checks, run once by the config itself (``__post_init__``; a TRL config
completed by ``complete_grpo_config`` / ``trainers.sft.sft_config``), before TRL's own ``__post_init__``
divides by any of them. Nothing here needs the model, the data or the launch.

* ``check_ranges``: every numeric setting of a TRL or grpotrl config within what its field can
  mean (a wrong sign, ``entropy_coef < 0`` for I7 among them, a zero, a NaN).
* ``normalize_generation_kwargs``: ``generation_kwargs``' temperature / repetition_penalty become the
  fields grpotrl reads (I5, I6); the one step here that changes the config.
* ``normalize_kl_estimators``: verl's KL estimator names become ours (``k3`` for ``low_var_kl``).
* ``check_grpotrl_fields``: grpotrl's own GRPO fields (health rules, sampler gap, CAGrad, the
  adaptive entropy range I7, sampling settings grpotrl would otherwise drop, I6, the KL's placement).
"""

from __future__ import annotations

import math

from ..errors import InputError
from ..ops.losses import kl_estimator_name

HEALTH_RULES = ("non_finite", "nonfinite_reward", "chat_header", "entropy_collapse", "one_token", "flat_rewards")
HEALTH_ACTIONS = ("stop", "warn", "off")


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# field -> (test of a value that is set, what it must be); None always passes (TRL's "not set")
RANGES = {
    "learning_rate": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
    "beta": (lambda v: _real(v) and v >= 0, "a finite number >= 0 (a negative KL coefficient rewards leaving the "
             "reference)"),
    "epsilon": (lambda v: _real(v) and v > 0, "a finite number > 0 (the lower clip of the ratio)"),
    "epsilon_high": (lambda v: _real(v) and v > 0, "a finite number > 0 (the upper clip of the ratio)"),
    "temperature": (lambda v: _real(v) and v > 0, "a finite number > 0: the logprobs are log_softmax(logits / T), "
                    "and greedy decoding (T = 0) would give every completion of a group the same text, hence zero "
                    "advantages; for nearly greedy sampling use a small T such as 0.1"),
    "top_p": (lambda v: _real(v) and 0 < v <= 1, "in (0, 1]"),
    "min_p": (lambda v: _real(v) and 0 <= v <= 1, "in [0, 1]"),
    "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0 (0: off)"),
    "repetition_penalty": (lambda v: _real(v) and v > 0, "a finite number > 0 (1.0: off)"),
    "presence_penalty": (_real, "a finite number"),
    "frequency_penalty": (_real, "a finite number"),
    "entropy_coef": (lambda v: _real(v) and v >= 0, "a finite number >= 0: the loss is policy + beta*KL - c*H with "
                     "c >= 0 encouraging exploration (INVARIANT I7); 0 for no bonus"),
    "weight_decay": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
    "max_grad_norm": (lambda v: _real(v) and v >= 0, "a finite number >= 0 (0: no clipping)"),
    "warmup_ratio": (lambda v: _real(v) and 0 <= v <= 1, "in [0, 1]"),
    "num_train_epochs": (lambda v: _real(v) and v > 0, "a finite number > 0"),
    "num_generations": (lambda v: _int(v) and v >= 2, "an integer >= 2 (GRPO normalises rewards within a group)"),
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
    "discriminator_learning_rate": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
    "kl_in_reward_coef": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
}


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_ranges(args) -> None:
    """Raise ``InputError`` for the first numeric setting of ``args`` (any TRL or grpotrl config) that is
    set to something its field cannot mean: a wrong sign, a zero, a NaN, a list. Runs on the config,
    before any weights load, and before TRL's own __post_init__ divides by any of them."""
    for name, (ok, what) in RANGES.items():
        value = getattr(args, name, None)
        if value is not None and not ok(value):
            raise InputError(f"{name}={value!r} ({type(value).__name__}): it must be {what}. Fix it in the recipe, "
                             "on the command line or in the config.")


def _adopt_generation_kwarg(args, kwargs: dict, name: str, why: str) -> None:
    """``generation_kwargs[name]``, where given, becomes ``args.<name>`` (this changes ``args``): checked
    against ``RANGES`` first, refused where the field is set to another value than its default 1.0
    (``temperature=0.7`` with ``generation_kwargs={"temperature": 1.0}`` too: TRL would sample at 1.0)."""
    if name not in kwargs:
        return
    given, field = kwargs[name], getattr(args, name)
    ok, what = RANGES[name]
    if not ok(given):
        raise InputError(f"generation_kwargs['{name}']={given!r}: it must be {what}.")
    if field not in (1.0, given):  # 1.0: the default of both fields
        raise InputError(f"{name}={field} and generation_kwargs['{name}']={given} disagree ({why}): "
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


def normalize_generation_kwargs(args) -> None:
    """Move the two sampling settings grpotrl reads from the fields into those fields, where
    ``generation_kwargs`` gives them (this changes ``args``; run once, by the config, before
    ``check_grpotrl_fields``). A value given in both places differently is an ``InputError``.

    TRL lets ``generation_kwargs`` override the sampling fields. Two of them grpotrl reads elsewhere:
    ``repetition_penalty``, applied response-only like the field (I6; on the transformers path
    grpotrl replaces transformers' own, which counts the prompt), and ``temperature``, at which the
    logprobs are computed (I5: TRL computes them at the field's temperature, so
    ``generation_kwargs={"temperature": 0.7}`` alone sampled at 0.7 and trained on logprobs at 1.0)."""
    kwargs = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
    _adopt_generation_kwarg(args, kwargs, "repetition_penalty", "I6: the penalty counts response tokens only")
    _adopt_generation_kwarg(args, kwargs, "temperature", "I5: completions would be sampled at one temperature "
                            "and their logprobs computed at the other")


def _check_generation_settings(args) -> None:
    """Sampling settings grpotrl would otherwise drop without a word are refused: continuous batching
    runs transformers' own sampler, which takes no logits processors, so the response-only
    penalties and ``min_new_tokens`` cannot be applied there."""
    kwargs = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
    if args.use_transformers_continuous_batching:
        unsupported = {name: value for name, value in (
            ("presence_penalty", args.presence_penalty), ("frequency_penalty", args.frequency_penalty),
            ("repetition_penalty", args.repetition_penalty if args.repetition_penalty != 1.0 else None),
            ("min_new_tokens", args.min_new_tokens or kwargs.get("min_new_tokens"))) if value}
        if unsupported:
            raise InputError(
                f"{', '.join(f'{k}={v}' for k, v in unsupported.items())} with use_transformers_continuous_batching: "
                "continuous batching samples with transformers' own batch scheduler, which takes none of grpotrl's "
                "logits processors, so these would be silently dropped (a repetition penalty there would also count "
                "the prompt, INVARIANT I6). Use the transformers generate path (use_transformers_continuous_batching: "
                "false) or vLLM, or leave these settings at their defaults.")


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
        raise InputError("use_kl_in_reward is on but its coefficient is 0: set kl_in_reward_coef (or beta, its "
                         "default), e.g. 0.001.")
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
