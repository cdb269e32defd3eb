"""Training-health callbacks for ``grpotrl.GRPOTrainer``, one concern each.

The trainer computes the health signals (``grpotrl.health``) from tensors its step already
has and appends them to TRL's metrics, so they are logged like TRL's own. The callbacks here
read the values of the optimizer step that just ended and act on them:

* ``BoundaryReport``: prints ``trainer.boundary_report()`` after each of the first
  ``health_report_steps`` steps, as one checks a new run's first steps by eye.
* ``RunLength``: at train start, refuses a rule that was asked for and whose patience exceeds the run's optimizer
  steps that observe its signal (it could never fire), and says in one line which rules on by default are off for
  such a run.
* Health rules, each a ``HealthRule``. Three only fire on a broken run and stop it by default:
  ``NonFiniteRule`` (loss or grad norm NaN/inf), ``NonFiniteRewardRule`` (a reward function
  returned +-inf), ``HeaderRule`` (a completion starts with the chat header). Three may be the task itself (a task with one right answer sharpens entropy; a
  yes/no task has 1-token answers; a hard task starts with every reward 0) and warn by default,
  training on as TRL would: ``OneTokenRule`` (1-token share above
  ``health_max_one_token_share``), ``EntropyRule`` (mean entropy below ``health_min_entropy``),
  ``FlatRewardRule`` (every group's rewards equal).

A rule fires when its condition held for ``patience`` consecutive steps that observed the
signal: every optimizer step observes TRL's ``entropy`` (logged by each microbatch's loss), but only a step that
generates observes a signal logged once per generation batch (``completions/*``, ``rewards/*``,
``frac_reward_zero_std``): under ``num_iterations > 1`` or ``steps_per_generation > gradient_accumulation_steps``
the steps that reuse a batch are skipped, and ``one_token`` or ``flat_rewards``' patience counts generation
batches (``configs.checks.generating_steps``). Its action (``rule_action``: ``health_rule_actions`` over
``health_action`` over the rule's default): ``'warn'`` logs a warning (again after every further ``patience`` steps
while the condition holds); ``'stop'`` asks the Trainer to save a checkpoint of that step through its own
``_save_checkpoint`` and to stop, and once that checkpoint is on disk (``on_save``) raises
``grpotrl.HealthStop`` naming the rule, the values, the step and the checkpoint (rules that stop on the same
step share that checkpoint and one ``HealthStop``, which names each of them with its reason; ``rules``: their
names, in order). Whatever the save and
evaluation strategies, the stop yields its checkpoint: where the Trainer skips the step's save
(``save_strategy='best'`` saves only a new best when the step evaluates), the rule saves at the epoch's
end, which the Trainer reaches right after the stop, before anything else is trained or logged. That save
(``stop_save_settings``, applied by ``CheckedResume._save_checkpoint``) deletes no earlier checkpoint
(``save_total_limit`` suspended: the last one before the stop may be the one to go back to) and is a full,
resumable one even under ``save_only_model=True``.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..checkpoints import last_complete_checkpoint
from ..configs.checks import (PER_GENERATION_RULES, check_patience_fits, completion_cap_setting, generating_steps,
                              generation_schedule, health_action_of, one_token_by_construction, rules_beyond_run)
from ..errors import HealthStop

logger = logging.getLogger(__name__)


class BoundaryReport(TrainerCallback):
    """Prints the boundary report of the step's generation batch after the first ``steps`` steps."""

    def __init__(self, trainer, steps: int):
        self.trainer, self.steps = trainer, steps

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step <= self.steps and state.is_world_process_zero:
            print(f"step {state.global_step}: " + self.trainer.boundary_report())


def rule_action(args, rule: type["HealthRule"]) -> str:
    """'stop', 'warn' or 'off' for ``rule``: ``health_rule_actions[rule.name]``, else
    ``health_action`` unless 'auto', else the rule's default (``configs.checks.health_action_of``)."""
    return health_action_of(args, rule.name, rule.default_action)


def _taken_level(args) -> int:
    """The level of the one line that says a rule on by default is off for this run: INFO under
    ``health_action: auto`` (nothing to do about a default), WARNING where ``health_action`` asked every
    rule to stop or warn."""
    return logging.INFO if args.health_action == "auto" else logging.WARNING


class RunLength(TrainerCallback):
    """At train start, where the run's optimizer steps are known (``state.max_steps``, also under
    ``num_train_epochs``): a rule whose patience exceeds the steps that observe its signal can never fire
    (``configs.checks.rules_beyond_run``: every step for entropy_collapse, the steps that generate for one_token and
    flat_rewards, fewer under ``num_iterations > 1`` or ``steps_per_generation > gradient_accumulation_steps``).
    One that was asked for (``health_rule_actions``, or a patience other than its default) is refused with an
    ``InputError`` before the first step (``check_patience_fits``; a grpotrl config with ``max_steps`` > 0 was
    refused when it was made); the others are off for this run, said in one line. A resumed run is judged on
    its whole length."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        steps = state.max_steps
        run = f"max_steps={args.max_steps}" if args.max_steps > 0 else \
            f"num_train_epochs={args.num_train_epochs} ({steps} optimizer steps)"
        check_patience_fits(args, steps, run)
        beyond = rules_beyond_run(args, steps)
        if not beyond:
            return
        sparse = [rule for rule, _, _, observed in beyond if observed < steps]  # they count the generating steps
        generating = f", {generating_steps(args, steps)} of which generate" if sparse else ""
        counted = f"; {' and '.join(sparse)} count{'s' if len(sparse) == 1 else ''} only the steps that generate: " \
            f"{generation_schedule(args)}" if sparse else ""
        logger.log(_taken_level(args), "grpotrl health: %s cannot fire in this run of %d optimizer steps%s (%s "
                   "consecutive steps needed%s), so %s off for it.", ", ".join(r for r, _, _, _ in beyond), steps,
                   generating, ", ".join(f"{s}={v}" for s, v in dict((s, v) for _, s, v, _ in beyond).items()),
                   counted, "it is" if len(beyond) == 1 else "they are")


class HealthRule(TrainerCallback):
    """One health rule over one signal of TRL's training metrics (``trainer.metric_values()``), per
    optimizer step.

    Subclasses set ``name``, ``default_action`` and ``advice`` and implement ``check()``: ``None``
    when the step did not observe the signal (no generation this step), else
    ``(broken, value, condition)``."""

    name = "rule"
    default_action = "warn"
    advice = ""

    def __init__(self, trainer, patience: int = 1):
        self.trainer, self.patience = trainer, max(int(patience), 1)
        self.action = rule_action(trainer.args, type(self))
        self.streak: list[float] = []
        self._start: dict[str, int] = {}
        self._stop: tuple[int, str] | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        """A new ``train()`` (a resume on the same trainer) starts with no streak and no stop pending."""
        self.streak, self._stop = [], None

    # values of this step: what was appended to the metric lists since the step began
    def on_step_begin(self, args, state, control, **kwargs):
        self._start = {k: len(v) for k, v in self.trainer.metric_values().items()}

    def step_values(self, key: str) -> list[float]:
        values = self.trainer.metric_values().get(key, [])
        return [v for v in values[self._start.get(key, 0):] if v is not None]

    def step_mean(self, key: str) -> float | None:
        values = self.step_values(key)
        return sum(values) / len(values) if values else None

    def check(self) -> tuple[bool, float, str] | None:
        raise NotImplementedError

    def on_step_end(self, args, state, control, **kwargs):
        seen = self.check()
        if seen is None:
            return
        broken, value, condition = seen
        self.streak = self.streak + [value] if broken else []
        if len(self.streak) < self.patience:
            return
        values = ", ".join(f"{v:.4g}" for v in self.streak[-self.patience:])
        span = f" for {self.patience} consecutive {self.counted()} (values {values})" if self.patience > 1 \
            else f" ({values})"
        message = f"{condition}{span}. {self.advice}"
        self.streak = []
        if self.action == "warn":
            logger.warning("grpotrl health [%s] step %d: %s", self.name, state.global_step, message)
        elif self.action == "stop":
            control.should_save = True  # the step's save, unless save_strategy='best' resets it (on_epoch_end)
            control.should_training_stop = True
            self._stop = (state.global_step, message)

    def counted(self) -> str:
        """What ``patience`` counts, as the message names it: optimizer steps, or generation batches for a rule whose
        signal is logged once per generation batch where one spans more than a step
        (``configs.checks.PER_GENERATION_RULES``)."""
        args = self.trainer.args
        spans = ((getattr(args, "steps_per_generation", None) or args.gradient_accumulation_steps)
                 * getattr(args, "num_iterations", 1) > args.gradient_accumulation_steps)
        return "generation batches" if self.name in PER_GENERATION_RULES and spans else "steps"

    @property
    def stopping(self) -> bool:
        """Whether this rule stopped the run and its checkpoint is not saved yet."""
        return self._stop is not None

    def on_epoch_end(self, args, state, control, **kwargs):
        """The Trainer skipped the stop step's save (``save_strategy='best'``: an evaluation at that step that
        found no new best resets ``should_save``): save it now, as the Trainer would have, after the step's log
        and evaluation (the Trainer breaks out of its epoch right after a stop and calls this first), then
        ``on_save`` raises ``HealthStop``."""
        if self._stop is not None:
            self.trainer._save_checkpoint(self.trainer.model_wrapped, None)
            self.trainer.callback_handler.on_save(args, state, control)

    def on_save(self, args, state, control, **kwargs):
        """Once the stop's checkpoint is saved, raise one ``HealthStop`` for every rule that stopped the run on
        this step (the first of them to see the save raises; the others would never be called), each rule's
        reason in it."""
        if self._stop is None:
            return
        rules = [cb for cb in self.trainer.callback_handler.callbacks if isinstance(cb, HealthRule) and cb.stopping]
        stops = [(rule.name, *rule._stop) for rule in rules]
        for rule in rules:
            rule._stop = None
        step = stops[0][1]
        message = stops[0][2] if len(stops) == 1 else "\n".join(f"{name}: {text}" for name, _, text in stops)
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        resumable = not args.save_only_model or "save_only_model" in stop_save_settings(self.trainer, True)
        raise HealthStop(tuple(name for name, _, _ in stops), step, message,
                         checkpoint if os.path.isdir(checkpoint) else None, resumable)


def stop_save_settings(trainer, stopping: bool | None = None) -> dict:
    """The ``TrainingArguments`` fields a health stop's checkpoint is saved with, over the run's own (empty
    when no rule of ``trainer`` is stopping the run; ``stopping`` given: whether one is).
    ``save_total_limit`` None: the save deletes no earlier checkpoint, since the last one before the
    stop may be the state to go back to. ``save_only_model`` False: the checkpoint resumes (optimizer,
    scheduler and RNG state saved), except for a model sharded at load time, whose optimizer state
    transformers cannot checkpoint (``HealthStop`` then says it is weights only)."""
    if stopping is None:
        stopping = any(isinstance(cb, HealthRule) and cb.stopping for cb in trainer.callback_handler.callbacks)
    if not stopping:
        return {}
    settings = {"save_total_limit": None}
    if not getattr(trainer, "is_distributed_loading_by_transformers", False):
        settings["save_only_model"] = False
    return settings


class HeaderRule(HealthRule):
    name = "chat_header"
    default_action = "stop"
    advice = ("The model writes the chat header itself: the template adds no generation prompt, or SFT trained on "
              "another template (INVARIANTS I1/I2). Compare `trainer.boundary_report()` with the template.")

    def check(self):
        share = self.step_mean("completions/header_share")
        if share is None:
            return None
        report = self.trainer.boundary_report(n=2) if share > 0 else ""
        return share > 0, share, f"{share:.0%} of completions start with the chat header\n{report}\n"


class OneTokenRule(HealthRule):
    """Share of 1-token completions above ``max_share`` (``health_max_one_token_share``). Its signal,
    ``completions/one_token_share``, is logged once per generation batch: ``patience`` (``health_patience``) counts
    the steps that generated, consecutive generation batches."""

    name = "one_token"
    advice = ("Completions stop at once (penalties that count prompt tokens make EOS relatively "
              "likely). Check logits processors and min_new_tokens, and that SFT trained the response before its "
              "stop token.")

    def __init__(self, trainer, patience: int, max_share: float):
        super().__init__(trainer, patience)
        self.max_share = max_share

    def check(self):
        share = self.step_mean("completions/one_token_share")
        if share is None or self.max_share >= 1:
            return None
        return share > self.max_share, share, (f"1-token completions {share:.0%} > health_max_one_token_share="
                                               f"{self.max_share}")


class EntropyRule(HealthRule):
    name = "entropy_collapse"
    advice = ("The policy collapsed (an entropy bonus with a flipped sign drives entropy from ~1 to 0.005). "
              "Check the entropy bonus sign and coefficient, the learning rate and the temperature; logits/* show "
              "how peaked the distribution is.")

    def __init__(self, trainer, patience: int, min_entropy: float):
        super().__init__(trainer, patience)
        self.min_entropy = min_entropy

    def measured(self) -> list[tuple[float, float]]:
        """(TRL's ``entropy``, its loss tokens) of each of the step's microbatches that held a loss token. TRL's
        value is a token mean over every process's microbatch; the step's entropy is their token mean, each
        weighted by its loss tokens (``entropy/loss_tokens``, logged beside it by grpotrl's trainers): a
        microbatch of 3 tokens counts for 3, one of 3000 for 3000. TRL logs 0.0 for a microbatch without a loss
        token (its token mean's count is clamped to 1): every row truncated under ``mask_truncated_completions``,
        an all-zero tool mask. That 0.0 is no entropy at all (weight 0), and a healthy run whose completions all
        hit the cap read as collapsed. A NaN entropy (NaN logits) stays, and counts as broken. Where the token
        counts were not logged side by side, each microbatch counts once, and grpotrl's ``entropy/sample_mean``
        (NaN exactly where no row has a token) tells the empty ones apart."""
        entropy, tokens = self.step_values("entropy"), self.step_values("entropy/loss_tokens")
        if len(tokens) == len(entropy):
            return [(h, n) for h, n in zip(entropy, tokens) if n > 0 or math.isnan(h)]
        samples = self.step_values("entropy/sample_mean")
        if len(samples) != len(entropy):  # not logged side by side: TRL's values as they are
            return [(h, 1.0) for h in entropy]
        return [(h, 1.0) for h, s in zip(entropy, samples) if not (h == 0 and math.isnan(s))]

    def check(self):
        measured = self.measured()
        if not measured or self.min_entropy <= 0:
            return None
        if any(math.isnan(h) for h, _ in measured):
            return True, math.nan, "mean token entropy is NaN (the policy's logits are not finite)"
        entropy = sum(h * n for h, n in measured) / sum(n for _, n in measured)
        return entropy < self.min_entropy, entropy, (f"mean token entropy {entropy:.4g} < health_min_entropy="
                                                     f"{self.min_entropy}")


class FlatRewardRule(HealthRule):
    """Every group's rewards all equal. Its signal is logged once per generation batch: ``patience``
    (``health_flat_reward_steps``) counts the steps that generated, consecutive generation batches."""

    name = "flat_rewards"
    advice = ("With every group's rewards equal GRPO has no policy gradient. Check the reward functions on a few "
              "completions (a judge failing to 0, a format no completion matches; see rewards/zero_share), or "
              "raise num_generations, or turn on dynamic_sampling.")

    def check(self):
        """Reads grpotrl's ``rewards/flat_group_share`` (``health.flat_group_share``: per group whatever
        ``scale_rewards``) where the step logged it, else TRL's ``frac_reward_zero_std``, which under
        ``scale_rewards='batch'`` is 1 only when the whole batch is flat: groups each flat at different values
        (easy prompts all solved, hard ones all failed) train nothing and read 0 there."""
        share = self.step_mean("rewards/flat_group_share")
        if share is None:
            share = self.step_mean("frac_reward_zero_std")
        if share is None:
            return None
        zero = self.step_mean("rewards/zero_share")
        extra = f" ({zero:.0%} of rewards exactly 0)" if zero is not None and not math.isnan(zero) else ""
        return share >= 1.0, share, f"every group's rewards are all equal{extra}"


class NonFiniteRule(HealthRule):
    """Loss or gradient norm NaN/inf. Checked before the optimizer step: under 'stop' the
    gradients are dropped so the saved checkpoint holds the last finite weights. Under ZeRO
    (DeepSpeed) the gradients live outside ``.grad`` and only the loss is checked; there DeepSpeed's engine
    has already stepped (inside ``accelerator.backward`` of the window's last microbatch), and what drops a
    non-finite update is DeepSpeed's own gradient check (fp16, fp32 ZeRO-1/2 by the gradient norm, bf16 with
    ``check_grad_overflow``, its default; ZeRO-3 by the gradient norm in every precision;
    ``tests/health/test_nonfinite_zero.py``, ``test_nonfinite_zero3.py``): with that check off the update is applied
    before the stop, which then reads the weights (each process's shards under ZeRO-3) and saves no checkpoint of
    non-finite ones (``on_step_end``). What was not
    recorded is not checked, and said so: a step with neither a loss (the trainer records each
    backpropagated one in ``step_findings``) nor a gradient in ``.grad`` is unchecked, never finite
    (a warning the first time), and a step with one of them is judged on that one alone. On several
    processes the verdict is one for all (``agreed``): each judges its own loss, and a process that
    stopped alone would leave the others waiting in their next collective. Under fp16's loss scaler
    (``fp16=True``) a non-finite gradient with a finite loss at a loss scale >= 1 is the scaler's overflow,
    which a healthy run meets whenever its scale has grown too large: the scaler skips that update and halves
    the scale, and the rule lets it. At a scale < 1 the unscaled gradient overflows as well: broken."""

    name = "non_finite"
    default_action = "stop"
    advice = "Lower the learning rate, look for fp16 overflow and for inf/NaN rewards, keep max_grad_norm > 0."

    def __init__(self, trainer):
        super().__init__(trainer, patience=1)
        self._seen: tuple[bool, float, str] | None = None
        self._warned_unchecked = False

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        losses = self.trainer.step_findings.take_losses()
        loss = torch.stack([x.float() for x in losses]).sum().item() if losses else None
        grads = [p.grad.detach() for p in self.trainer.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads).item() if grads else None
        scale = loss_scale(self.trainer.accelerator)
        # fp16's loss scaler: a gradient that overflowed at a scale >= 1 (the loss finite) is the scaler's to
        # handle, it skips that update and halves its scale; at a scale < 1 the unscaled gradient overflows too
        scaler_skips = scale is not None and scale >= 1 and norm is not None and not math.isfinite(norm) \
            and (loss is None or math.isfinite(loss))
        broken, observed, elsewhere = agreed(self.trainer.accelerator,
                                             not scaler_skips and any(v is not None and not math.isfinite(v)
                                                                      for v in (loss, norm)),
                                             loss is not None or norm is not None)
        if not observed:
            self._seen = None
            if not self._warned_unchecked:
                self._warned_unchecked = True
                logger.warning("grpotrl health [%s] step %d: no loss was recorded and no parameter holds a "
                               "gradient in .grad, so NaN/inf is not checked on this step (nor on later ones "
                               "like it; warned once).", self.name, state.global_step + 1)
            return
        seen = [f"loss {loss:.4g}" if loss is not None else "loss not recorded",
                f"gradient norm {norm:.4g}" if norm is not None else "gradient norm not in .grad"]
        if elsewhere:
            seen.append("NaN/inf on another process")
        if scale is not None:
            seen.append(f"fp16 loss scale {scale:g}" + (": the scaler skips this update" if scaler_skips else ""))
        where = "after clipping, before the optimizer step"
        value = next((v for v in (norm, loss) if v is not None), math.nan)  # nan: observed on another process only
        self._seen = (broken, value, f"{', '.join(seen)} ({where})")
        if broken and self.action == "stop":
            self.trainer.model.zero_grad(set_to_none=True)  # the optimizer skips parameters without a grad

    def check(self):
        seen, self._seen = self._seen, None
        return seen

    def on_step_end(self, args, state, control, **kwargs):
        """``HealthRule``'s; then, where this step stops the run, the trainable parameters are read (this process's
        shards under ZeRO-3; one verdict for all processes): where the update was applied already and made them
        non-finite (DeepSpeed's engine steps inside the backward, before ``on_pre_optimizer_step``, and its own
        overflow check was off: bf16's ``check_grad_overflow: false``), the stop saves no checkpoint (it would hold
        those weights, and ``resume_from_checkpoint: true`` would take it) and ``HealthStop`` names the last
        complete checkpoint of this run instead."""
        super().on_step_end(args, state, control, **kwargs)
        if self._stop is None:
            return
        bad = nonfinite_parameters(self.trainer.model)
        broken, _, _ = agreed(self.trainer.accelerator, bool(bad), True)
        if not broken:
            return
        step, message = self._stop
        self._stop, control.should_save = None, False
        last = last_complete_checkpoint(args.output_dir)
        where = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "") if bad \
            else "parameters on another process"
        raise HealthStop(self.name, step, (
            f"{message} The optimizer applied this step's non-finite update before the rule could drop it (under "
            "DeepSpeed the engine steps inside the backward, and only its own overflow check drops such an update), "
            f"and the weights are not finite now ({where}), so no checkpoint was saved at this step. "
            + (f"The last checkpoint of this run is {last}: resume_from_checkpoint={last!r} continues from it."
               if last else "This run saved no checkpoint before it: start it again.")
            + " Keep DeepSpeed's overflow check on (bf16: `check_grad_overflow: true`, its default)."))


def nonfinite_parameters(model) -> list[str]:
    """The names of ``model``'s trainable parameters holding a NaN or inf (this process's shard, ``ds_tensor``,
    where DeepSpeed ZeRO-3 partitions a parameter).

    >>> m = torch.nn.Linear(2, 1)
    >>> with torch.no_grad(): _ = m.bias.fill_(float("nan"))
    >>> nonfinite_parameters(m)
    ['bias']
    """
    return [name for name, p in model.named_parameters() if p.requires_grad
            and not bool(torch.isfinite(getattr(p, "ds_tensor", None) if getattr(p, "ds_tensor", None) is not None
                                        else p.detach()).all())]


def loss_scale(accelerator) -> float | None:
    """The scale of fp16's loss scaler (accelerate's ``GradScaler``) this step's backward ran at; None without
    one (bf16, fp32, DeepSpeed, which scales its own loss)."""
    scaler = getattr(accelerator, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None


def agreed(accelerator, broken: bool, observed: bool) -> tuple[bool, bool, bool]:
    """This process's ``broken`` / ``observed`` made every process's: (broken on any, observed on any,
    broken on another but not here). One all-reduce of two numbers where there are several processes;
    every process must call it at the same point of the step."""
    if accelerator.num_processes == 1:
        return broken, observed, False
    flags = accelerator.reduce(torch.tensor([float(broken), float(observed)], device=accelerator.device),
                               reduction="sum")  # [2]: processes broken, processes that observed
    anywhere, seen = bool(flags[0] > 0), bool(flags[1] > 0)
    return anywhere, seen, anywhere and not broken


class NonFiniteRewardRule(HealthRule):
    """A reward function returned +-inf on some row. TRL 1.16 would give that row's whole group a
    NaN advantage and zero it (the group trains nothing; when every group has such a row the step
    trains nothing at all) and log ``reward: inf``. While the rule is on (stop or warn), the trainer
    (``GRPOTrainer._calculate_rewards``) counts each such value as missing -- NaN, as TRL reads a
    ``None``: left out of the group baseline, the rest of the group trains -- and logs
    ``rewards/<name>/nonfinite_share``; ``stop`` then stops after that step with a checkpoint.
    'off' leaves TRL's handling as it is. A NaN is TRL's "no score" (what ``None`` becomes) and is
    not counted here."""

    name = "nonfinite_reward"
    default_action = "stop"
    advice = ("A reward must be a finite number, or None for 'no score' (left out of its group's baseline). "
              "Those values were counted as missing. Fix the reward function (a division by zero, log(0), a "
              "score of float('inf') for 'perfect'), or set health_rule_actions: {nonfinite_reward: warn} to train "
              "on with them counted as missing.")

    def check(self):
        names = getattr(self.trainer, "reward_func_names", [])
        shares = [v for name in names for v in self.step_values(f"rewards/{name}/nonfinite_share")]
        if not shares:
            return None
        found = self.trainer.step_findings.take_nonfinite_rewards()
        return max(shares) > 0, max(shares), "; ".join(dict.fromkeys(found))


@dataclass
class StepFindings:
    """What the trainer found during one optimizer step for the health rules, which take it at the step's
    end: ``losses``, the losses it backpropagated (None: no rule reads them, NonFiniteRule is off), and
    ``nonfinite_rewards``, the names of the reward functions that returned +-inf."""

    losses: list | None = None
    nonfinite_rewards: list[str] = field(default_factory=list)

    def take_losses(self) -> list:
        """The step's losses, emptied for the next step."""
        if self.losses is None:
            return []
        losses, self.losses = self.losses, []
        return losses

    def take_nonfinite_rewards(self) -> list[str]:
        """The step's +-inf reward names, emptied for the next step."""
        found, self.nonfinite_rewards = self.nonfinite_rewards, []
        return found


def add_health_callbacks(trainer, args) -> StepFindings:
    """Adds to ``trainer`` the boundary report (``health_report_steps``), the train-start check of the rules'
    patience against the run's length (``RunLength``) and every health rule not turned off. ``one_token`` on by
    default where every completion is one token (``configs.checks.one_token_by_construction``) is off, said in one
    line (asked for in ``health_rule_actions``, the config refused it). Returns the ``StepFindings`` the trainer
    fills and the rules take (as ``trainer.step_findings``); its ``losses`` are collected only while NonFiniteRule
    is on."""
    if args.health_report_steps:
        trainer.add_callback(BoundaryReport(trainer, args.health_report_steps))
    trainer.add_callback(RunLength(trainer))
    one_token = OneTokenRule(trainer, args.health_patience, args.health_max_one_token_share)
    rules = [NonFiniteRule(trainer), NonFiniteRewardRule(trainer), HeaderRule(trainer), one_token,
             EntropyRule(trainer, args.health_patience, args.health_min_entropy)]
    if args.health_flat_reward_steps:
        rules.append(FlatRewardRule(trainer, args.health_flat_reward_steps))
    if one_token.action != "off" and one_token_by_construction(args):  # asked for in health_rule_actions: refused
        logger.log(_taken_level(args), "grpotrl health: one_token is off for this run: with %s every completion is "
                   "one token long, so the share of 1-token completions is 1 on every step, healthy or not.",
                   completion_cap_setting(args))
        one_token.action = "off"
    for rule in rules:
        if rule.action != "off":
            trainer.add_callback(rule)
    return StepFindings(losses=[] if rules[0].action != "off" else None)  # NonFiniteRule reads the step's losses
