"""CAGrad's per-task gradients under fp16's loss scaler (``fp16=True``: accelerate's GradScaler), exact and low-memory.

The Trainer's backward is of ``loss * S``: the scaler exists because a backward through fp16 activations flushes a
small gradient to 0. The per-task gradients CAGrad weighs (``autograd.grad`` of each task's loss) must be taken the
same way, at S, then divided by S in fp32. The model here runs under CPU fp16 autocast, as the Trainer's forward does
on GPU, and a CPU GradScaler is set on the accelerator (there is none on a CPU run), as the backward would have used.
"""

import math

import pytest
import torch
from test_multitask import _rel, longer, mode_args, shorter, two_tasks

import grpotrl
from grpotrl.trainers.multitask import _trainable

ROWS = {0: torch.tensor([0, 1]), 1: torch.tensor([2, 3])}  # task -> its rows of the 4-row microbatch


def make(mode: str, tiny_llama, grpo_args, scale: float):
    """A CAGrad trainer (KL in the loss: in exact mode every task's gradient is in the sums, none carried) with a CPU
    GradScaler at ``scale`` on its accelerator."""
    args = mode_args(grpo_args, mode, beta=0.04, entropy_coef=0.0)
    trainer = grpotrl.MultiTaskGRPOTrainer(tiny_llama, reward_funcs={"fairness": longer, "hallucination": shorter},
                                           args=args, train_dataset=two_tasks())
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    return trainer


def task_losses(model, fp16: bool, size: float = 1e-5) -> dict:
    """Each task's GRPO-like policy loss ``-size * mean(A * logp)`` over its rows (4 rows x 8 tokens, advantages
    +-1, +-0.5), the forward under fp16 autocast or in fp32. At ``size`` 1e-5 a row's loss gradient per token is
    ~1e-5 / 14 ~ 7e-7, and on each of the other 49k logits it is that times their probability (~2e-5): ~1e-11, far
    below fp16's smallest subnormal (6e-8), so an unscaled backward flushes it to 0; times S = 2^16 it is kept."""
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4, 8))  # [B, L]
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        logits = model(input_ids=ids).logits  # [B, L, V], fp16 under autocast
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
    params = _trainable(model)
    assert not all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(params, lr=1.0)
    trainer.accelerator.scaler.scale(torch.zeros(()))  # what the Trainer's backward does first: S's state set up
    trainer.accelerator.scaler.step(optimizer)
    trainer.accelerator.scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # skipped
    assert trainer.accelerator.scaler.get_scale() == scale / 2
