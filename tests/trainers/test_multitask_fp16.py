"""CAGrad's per-task gradients under fp16's loss scaler (``fp16=True``: accelerate's GradScaler), exact and low-memory.

The Trainer's backward is of ``loss * S``: the scaler exists because a backward through fp16 activations flushes a
small gradient to 0. The per-task gradients CAGrad weighs (``autograd.grad`` of each task's loss) must be taken the
same way, at S, then divided by S in fp32. The model here runs under CPU fp16 autocast, as the Trainer's forward does
on GPU, and a CPU GradScaler is set on the accelerator (there is none on a CPU run), as the backward would have used.
The same for the entropy's gradient the exact path's composed update is checked on (I7, ``_check_composed_update``).
A loss whose VALUE is NaN/inf in the forward (a task's, the regulariser's) is no overflow at any scale and stops
training; a finite loss whose gradient overflows at S >= 1 stays the scaler's skipped step (full training runs).
"""

import logging
import math

import pytest
import torch
from test_multitask import FlippedComposition, _rel, longer, mode_args, shorter, two_task_prompts, two_tasks

import grpotrl
from grpotrl.errors import InvariantError
from grpotrl.trainers.grpo import TASK_KEY
from grpotrl.trainers.multitask import _trainable
from grpotrl.trainers.records import LossTerms

ROWS = {0: torch.tensor([0, 1]), 1: torch.tensor([2, 3])}  # task -> its rows of the 4-row microbatch
COEF = 0.1  # the entropy bonus c


def make(mode: str, tiny_llama, grpo_args, scale: float | None, cls=grpotrl.MultiTaskGRPOTrainer):
    """A CAGrad trainer (KL in the loss: in exact mode every task's gradient is in the sums, none carried) with a CPU
    GradScaler at ``scale`` on its accelerator (None: none)."""
    args = mode_args(grpo_args, mode, beta=0.04, entropy_coef=0.0)
    trainer = cls(tiny_llama, reward_funcs={"fairness": longer, "hallucination": shorter}, args=args,
                  train_dataset=two_tasks())
    trainer.accelerator.scaler = None if scale is None else torch.amp.GradScaler("cpu", init_scale=scale)
    return trainer


def forward(model, fp16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], logits [B, L, V]) of 4 fixed random rows x 8 tokens, the forward under CPU fp16 autocast (the
    logits fp16) or in fp32."""
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4, 8))  # [B, L]
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        return ids, model(input_ids=ids).logits


def task_losses(model, fp16: bool, size: float = 1e-5) -> dict:
    """Each task's GRPO-like policy loss ``-size * mean(A * logp)`` over its rows (4 rows x 8 tokens, advantages
    +-1, +-0.5), the forward under fp16 autocast or in fp32. At ``size`` 1e-5 a row's loss gradient per token is
    ~1e-5 / 14 ~ 7e-7, and on each of the other 49k logits it is that times their probability (~2e-5): ~1e-11, far
    below fp16's smallest subnormal (6e-8), so an unscaled backward flushes it to 0; times S = 2^16 it is kept."""
    ids, logits = forward(model, fp16)  # [B, L], [B, L, V]
    logps = logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, L - 1]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])  # [B]
    return {k: -size * (adv[r, None] * logps[r]).mean() for k, r in ROWS.items()}


def reference(model, params) -> dict:
    """Each task's gradient of ``params`` with the forward in fp32: what the fp16 gradients must approach."""
    losses = task_losses(model, fp16=False)
    return {k: torch.autograd.grad(loss, params, retain_graph=True) for k, loss in losses.items()}


@pytest.mark.parametrize("mode", ["exact", "low_memory"])
def test_task_gradients_under_the_fp16_loss_scaler_are_taken_at_its_scale(mode, tiny_llama, grpo_args):
    """Taken of the unscaled task loss, the fp16 backward loses most of each task's gradient (relative error > 0.5
    here, checked below: most entries flush to 0), and with it the exact sums, the Gram matrix, the CAGrad weights
    and the update (a task whose last-block gradient flushes to 0 entirely gets weight 0), while the Trainer's scaled
    backward in ``.grad`` is right. Taken at S = 2^16 and divided by S in fp32, they are the fp32 forward's gradients
    within fp16 rounding (2e-2). Exact mode: the window's sums of every trainable parameter; low-memory: the Gram
    matrix of the last block's gradients that the weights are solved from."""
    trainer = make(mode, tiny_llama, grpo_args, scale=2.0 ** 16)
    model = trainer.model
    params = _trainable(model) if mode == "exact" else trainer._proxy
    ref = reference(model, params)
    losses = task_losses(model, fp16=True)
    unscaled = torch.autograd.grad(losses[0], params, retain_graph=True)
    assert _rel(unscaled, ref[0]) > 0.5  # the flaw the scaler exists for: an unscaled fp16 backward underflows
    if mode == "exact":
        trainer._exact_step(model, losses, torch.zeros(()), 0.0, {0, 1})
        assert trainer.task_gradients.carrier is None
        for k in ROWS:
            error = _rel(trainer.task_gradients.sums[k], ref[k])
            assert error < 2e-2, (k, error)
    else:
        grams = []
        solve = trainer._cagrad_weights
        trainer._cagrad_weights = lambda tasks, gram: grams.append(gram) or solve(tasks, gram)
        trainer._low_memory_loss(losses, torch.zeros(()), {0, 1})
        g = [torch.cat([t.flatten() for t in ref[k]]).double() for k in ROWS]
        expected = torch.stack(g) @ torch.stack(g).T  # [K, K]
        assert len(grams) == 1 and float((grams[0] - expected).norm() / expected.norm()) < 2e-2, (grams, expected)


@pytest.mark.parametrize("mode", ["exact", "low_memory"])
def test_a_task_gradient_overflowing_at_the_loss_scale_is_skipped_by_the_scaler(mode, tiny_llama, grpo_args):
    """At S = 2^60 each task's scaled fp16 backward overflows (the unscaled one does not): that is the scaler's
    overflow, which a healthy run meets whenever S has grown too large, not a broken gradient. Nothing stops, and
    ``.grad`` holds an inf, so the real GradScaler's step leaves every weight as it was and halves S. (Exact mode:
    the window combined after its last backward; low-memory: the inf put in ``.grad`` before the Trainer's backward,
    whose loss stays finite.)"""
    scale = 2.0 ** 60
    trainer = make(mode, tiny_llama, grpo_args, scale=scale)
    model = trainer.model
    losses = task_losses(model, fp16=True)
    if mode == "exact":
        trainer._exact_step(model, losses, torch.zeros(()), 0.0, {0, 1})
        trainer._combine_window(model)
        assert trainer.task_gradients.sums == {}
    else:
        loss = trainer._low_memory_loss(losses, torch.zeros(()), {0, 1})
        assert math.isfinite(float(loss))
    assert_scaler_skips(trainer, scale)


def assert_scaler_skips(trainer, scale: float) -> None:
    """``.grad`` holds an inf, so the real GradScaler's step leaves every trainable weight as it was and halves S."""
    params = _trainable(trainer.model)
    assert not all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(params, lr=1.0)
    trainer.accelerator.scaler.scale(torch.zeros(()))  # what the Trainer's backward does first: S's state set up
    trainer.accelerator.scaler.step(optimizer)
    trainer.accelerator.scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # skipped
    assert trainer.accelerator.scaler.get_scale() == scale / 2


# ------------------------------------------------------------------ I7: the composed update's entropy check


def entropies(model, fp16: bool) -> torch.Tensor:
    """The policy's per-token next-token entropy [B, L] (``forward``'s rows), from the logits in fp32 as TRL's loss
    computes it."""
    _, logits = forward(model, fp16)  # [B, L, V]
    logps = logits.float().log_softmax(-1)
    return -(logps.exp() * logps).sum(-1)  # [B, L]


def flatten(model) -> None:
    """The final norm's weight times 0.03: next-token distributions near uniform (H ~ log V), whose entropy gradient
    is small: |dH/dtheta|^2 ~ 1e-8 against ~2e-5 for the tiny model as it is. Its unscaled fp16 backward flushes
    every entry to 0 (checked in the test); at S = 2^16 (times c = 0.1) it is kept."""
    with torch.no_grad():
        model.model.norm.weight.mul_(0.03)


def bonus_terms(entropy: torch.Tensor, acts: bool = True) -> LossTerms:
    """What ``_compute_loss`` records for the guard: every token in the loss; the bonus on every one (``acts``) or on
    none (every token out of TRL's top-entropy mask)."""
    mask = torch.ones_like(entropy)  # [B, L]
    return LossTerms(entropy, mask, mask if acts else torch.zeros_like(mask))


def grads(trainer) -> list:
    """A copy of every trainable parameter's ``.grad`` (None where it has none)."""
    return [None if p.grad is None else p.grad.clone() for p in _trainable(trainer.model)]


def unchecked_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "was not checked to raise the entropy" in r.getMessage()]


@pytest.mark.parametrize("cls", [grpotrl.MultiTaskGRPOTrainer, FlippedComposition], ids=["composed", "flipped"])
def test_I7_composed_update_is_checked_on_the_entropy_gradient_taken_at_the_fp16_loss_scale(cls, tiny_llama,
                                                                                             grpo_args):
    """I7, exact mode, under fp16's loss scaler: the check differentiates the bonus as the Trainer's backward does, at
    S. The unscaled fp16 backward of the flat policy's H is 0 in every entry (checked): a check on it reads a rise
    of 0 and passes a flipped composition (``FlippedComposition``: ``.grad`` subtracted). At S = 2^16 the rise per
    lr, c |dH/dtheta|^2 for the right composition, is the fp32 forward's within fp16 rounding (2e-2), and the
    flipped one, -c |dH/dtheta|^2, stops training."""
    trainer = make("exact", tiny_llama, grpo_args, scale=2.0 ** 16, cls=cls)
    model = trainer.model
    flatten(model)
    params = _trainable(model)
    reference = torch.autograd.grad(entropies(model, fp16=False).mean(), params)  # dH/dtheta, fp32 forward
    expected = COEF * sum(float(g.double().pow(2).sum()) for g in reference)  # dH / lr of the update -c dH/dtheta
    entropy = entropies(model, fp16=True)  # [B, L]
    unscaled = torch.autograd.grad(entropy.mean(), params, retain_graph=True)
    assert not any(bool(g.any()) for g in unscaled)  # the flaw: an unscaled fp16 backward flushes all of it
    trainer.hook_record.loss = bonus_terms(entropy)
    if cls is FlippedComposition:
        with pytest.raises(InvariantError, match="I7.*lowers entropy"):
            trainer._check_composed_update(params, COEF)
        return
    trainer._check_composed_update(params, COEF)
    logged = trainer.metric_values()
    assert logged["entropy/bonus_alone_dH_per_lr"] == [pytest.approx(expected, rel=2e-2)], expected
    assert logged["guards/bonus_alone_checked_share"] == [1.0]


def test_I7_composed_update_overflowing_at_the_loss_scale_is_unchecked_and_changes_nothing(tiny_llama, grpo_args,
                                                                                               caplog):
    """I7, exact mode: at S = 2^60 the bonus's scaled fp16 backward overflows (the unscaled one does not), as the
    Trainer's backward of the regulariser, which carries it, then does: the scaler's overflow. The check cannot read
    this update, even a flipped one (``FlippedComposition``): it stops nothing, says it did not check (a warning
    once, ``guards/bonus_alone_checked_share`` 0, no rise logged), and changes nothing: ``.grad`` is as it was."""
    scale = 2.0 ** 60
    trainer = make("exact", tiny_llama, grpo_args, scale=scale, cls=FlippedComposition)
    trainer.hook_record.loss = bonus_terms(entropies(trainer.model, fp16=True))
    before = grads(trainer)
    with caplog.at_level(logging.WARNING, logger="grpotrl.trainers.multitask"):
        for _ in range(2):  # two guard microbatches
            trainer._check_composed_update(_trainable(trainer.model), COEF)
    warned = unchecked_warnings(caplog)
    assert len(warned) == 1 and f"overflowed at fp16's loss scale {scale:g}" in warned[0], caplog.text
    logged = trainer.metric_values()
    assert logged["guards/bonus_alone_checked_share"] == [0.0, 0.0]
    assert "entropy/bonus_alone_dH_per_lr" not in logged
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(before, grads(trainer)))


@pytest.mark.parametrize("case", ["bonus on no token", "fp16 at loss scale 1"])
def test_I7_composed_update_with_a_zero_entropy_gradient_is_unchecked(case, tiny_llama, grpo_args, caplog):
    """I7, exact mode: a zero gradient of the bonus verifies no sign, so a flipped composition (``FlippedComposition``)
    is counted unchecked (a warning, ``guards/bonus_alone_checked_share`` 0), never passed. Where the bonus acts on no
    token (TRL's bonus is c * 0, while H over the whole loss mask has a gradient: a check on that H judges an update
    the bonus is absent from); and where the scaler's S has fallen to 1, at which the flat policy's fp16 backward
    flushes every entry to 0."""
    scale = 1.0
    trainer = make("exact", tiny_llama, grpo_args, scale=scale, cls=FlippedComposition)
    if case == "fp16 at loss scale 1":
        flatten(trainer.model)
    trainer.hook_record.loss = bonus_terms(entropies(trainer.model, fp16=True), acts=case != "bonus on no token")
    with caplog.at_level(logging.WARNING, logger="grpotrl.trainers.multitask"):
        trainer._check_composed_update(_trainable(trainer.model), COEF)
    warned = unchecked_warnings(caplog)
    assert len(warned) == 1 and "the entropy's gradient at fp16's loss scale 1 is 0" in warned[0], caplog.text
    logged = trainer.metric_values()
    assert logged["guards/bonus_alone_checked_share"] == [0.0]
    assert "entropy/bonus_alone_dH_per_lr" not in logged


@pytest.mark.parametrize("scale", [None, 0.5], ids=["no scaler", "scale 0.5"])
def test_I7_composed_update_with_a_nan_entropy_gradient_stops(scale, tiny_llama, grpo_args):
    """I7, exact mode: a NaN in the policy's forward (one weight of the final norm) makes the entropy's gradient NaN.
    Without a loss scaler, or at S < 1 (where the unscaled gradient is non-finite as well), that is no scaler's
    overflow: the update cannot be checked, and training stops (a NaN |dH/dtheta|^2 must not read as "no gradient",
    nor a NaN rise as "not a fall")."""
    trainer = make("exact", tiny_llama, grpo_args, scale=scale)
    with torch.no_grad():
        trainer.model.model.norm.weight[0] = math.nan
    trainer.hook_record.loss = bonus_terms(entropies(trainer.model, fp16=True))
    with pytest.raises(InvariantError, match=r"I7.*the entropy's gradient.* is NaN/inf"):
        trainer._check_composed_update(_trainable(trainer.model), COEF)


# ------------------------------------------------------------------ a NaN loss is no overflow


class NaNAdvantage(grpotrl.MultiTaskGRPOTrainer):
    """Each training microbatch: every row of its first row's task gets a NaN advantage (what a NaN reward or reward
    weight gives), so that task's loss VALUE is NaN in the forward, and its gradient with it, at any loss scale."""

    poisoned: list

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.model.training:
            task = inputs[TASK_KEY]  # [B]
            inputs = {**inputs, "advantages": inputs["advantages"].masked_fill(task == task[0], math.nan)}
            self.poisoned = getattr(self, "poisoned", []) + [self.task_names[int(task[0])]]
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def train_args(grpo_args, mode: str, precision: str):
    """One optimizer step of CAGrad ``mode`` with KL in the loss (exact mode: no carrier), guards and health rules off
    (as a user may set them), ``precision`` fp16 (fp32 on the CPU, the scaler set on the accelerator by the test) or
    bf16."""
    return mode_args(grpo_args, mode, beta=0.04, entropy_coef=0.0, max_steps=1, guard_steps=0,
                     per_device_train_batch_size=16, bf16=precision == "bf16")


def weights(trainer) -> list:
    return [p.detach().clone() for p in _trainable(trainer.model)]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("mode", ["exact", "low_memory"])
def test_a_task_loss_that_is_nan_in_the_forward_stops_at_the_first_step_at_any_loss_scale(mode, precision, tiny_llama,
                                                                                          grpo_args):
    """A NaN advantage makes its task's loss value NaN in the forward. Under fp16's loss scaler at S = 2^16 its
    gradient at S is NaN too, and was read as the scaler's overflow: the update skipped, S halved, the run went on
    (at every step, until S < 1). No loss scale makes a loss value NaN: it stops on the first microbatch, before any
    backward, naming the task, the step and that the loss itself is non-finite; S stays as it was, no weight moves.
    The same under bf16 (no scaler). Guards off: on guard steps the I11 guard in the full loss stops a NaN loss
    first."""
    scale = 2.0 ** 16
    trainer = NaNAdvantage(tiny_llama, reward_funcs={"fairness": longer, "hallucination": shorter},
                           args=train_args(grpo_args, mode, precision), train_dataset=two_task_prompts())
    if precision == "fp16":
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    before = weights(trainer)
    stop = (rf"\[multi-task\] step 1, cagrad='{mode}': the loss of task\(s\) '(\w+)' \(L = nan\) is NaN/inf in the "
            r"forward: the loss value itself, not its gradient at fp16's loss scale")
    with pytest.raises(InvariantError, match=stop) as e:
        trainer.train()
    assert trainer.poisoned and len(set(trainer.poisoned)) == 1 and f"'{trainer.poisoned[0]}'" in str(e.value)
    assert trainer.state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, weights(trainer)))
    if precision == "fp16":
        assert trainer.accelerator.scaler.get_scale() == scale  # never halved



class NaNReference(grpotrl.MultiTaskGRPOTrainer):
    """Each training microbatch: a NaN reference logprob on its first row's first token, so the KL, in the regulariser
    only (no task's policy loss reads the reference), is NaN in the forward."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.model.training:
            ref = inputs["ref_per_token_logps"].clone()  # [B, C]
            ref[0, 0] = math.nan
            inputs = {**inputs, "ref_per_token_logps": ref}
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def test_a_regulariser_that_is_nan_in_the_forward_stops_at_the_first_step_at_the_loss_scale(tiny_llama, grpo_args):
    """The regulariser's share of the loss (here a NaN KL) under fp16's loss scaler at S = 2^16, exact mode: every task
    gradient is finite, the Trainer's backward of the regulariser puts a NaN in ``.grad``, and the scaler skipped the
    step and halved S, at every step. It stops on the first microbatch, naming the regulariser, the tasks' losses
    finite; S stays as it was, no weight moves."""
    scale = 2.0 ** 16
    trainer = NaNReference(tiny_llama, reward_funcs={"fairness": longer, "hallucination": shorter},
                           args=train_args(grpo_args, "exact", "fp16"), train_dataset=two_task_prompts())
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    before = weights(trainer)
    with pytest.raises(InvariantError, match=r"\[multi-task\] step 1, cagrad='exact': the regulariser \(beta \* KL "
                                             r"- c \* H.*; nan\) is NaN/inf in the forward: the loss value itself"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, weights(trainer)))
    assert trainer.accelerator.scaler.get_scale() == scale

class RecordedLossValues(grpotrl.MultiTaskGRPOTrainer):
    """Each training microbatch's loss values as the forward computed them: the full loss, each task's, the
    regulariser."""

    values: list

    def _loss_terms(self, model, inputs, coef):
        full, tasks, reg = super()._loss_terms(model, inputs, coef)
        self.values = getattr(self, "values", []) + [float(v.detach()) for v in (full, *tasks.values(), reg)]
        return full, tasks, reg


@pytest.mark.parametrize("mode", ["exact", "low_memory"])
def test_a_finite_loss_whose_gradient_overflows_at_the_loss_scale_is_still_the_scalers_skipped_step(mode, tiny_llama,
                                                                                                     grpo_args):
    """The control of the NaN loss above: the loss's forward under CPU fp16 autocast (the Trainer's on GPU) at
    S = 2^60, where every loss value is finite and the backward at S overflows. That is the scaler's overflow: the
    loss check passes it, nothing stops, the real GradScaler's step leaves every weight as it was and halves S."""
    scale = 2.0 ** 60
    trainer = RecordedLossValues(tiny_llama, reward_funcs={"fairness": longer, "hallucination": shorter},
                                 args=train_args(grpo_args, mode, "fp16"), train_dataset=two_task_prompts())
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    trainer.autocast_smart_context_manager = lambda cache_enabled=True: torch.autocast("cpu", dtype=torch.float16)
    before = weights(trainer)
    trainer.train()
    assert trainer.values and all(math.isfinite(v) for v in trainer.values), trainer.values
    assert trainer.state.global_step == 1
    assert all(torch.equal(a, b) for a, b in zip(before, weights(trainer)))  # skipped
    assert trainer.accelerator.scaler.get_scale() == scale / 2
