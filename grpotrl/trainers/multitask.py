"""``grpotrl.MultiTaskGRPOTrainer``: GRPO over rows of several tasks, optionally with CAGrad.

Overrides (everything else is ``grpotrl.GRPOTrainer``'s, hence TRL's):
  * ``__init__``: ``reward_funcs`` may map each task label (``task_column``, default ``task``)
    to its reward functions (``grpotrl.rewards.tasks``); a task of the data missing from the
    mapping, a missing column, ``scale_rewards='batch'`` (a std over every task) and CAGrad
    under DeepSpeed/FSDP are errors before the model loads. Groups never mix tasks (checked
    on every batch by ``grpotrl.GRPOTrainer``), and metrics come per task.
  * ``training_step``: in exact mode, combines the window's task gradients after its last
    backward.
  * ``compute_loss``: with ``cagrad`` on, one forward; TRL's own ``_compute_loss`` is evaluated
    on the cached logprobs once as is (metrics, guards, the adaptive entropy controller) and
    then once per term: each task's policy loss (advantages of the other tasks' rows zeroed,
    no KL, no entropy bonus) and the regulariser (zero advantages, ``beta * KL - c * H``).
    The terms must add up to the full loss (checked). CAGrad combines the task terms only:
      - ``exact``: per-task gradients of all trainable parameters, accumulated over the
        gradient-accumulation window, combined after its last backward and added to ``.grad``,
        where the Trainer's own backward of the regulariser puts KL and entropy: K + 1 backward
        passes, K when there is no regulariser (``beta = 0``, no entropy bonus: the Trainer's
        backward then carries the last task's gradient);
      - ``low_memory``: CAGrad weights from the per-task gradients of the last transformer
        block's trainable parameters only (K backward passes that stop at that block), then
        one backward of ``sum_k coef_k L_k + regulariser``. The approximation: the weights see
        the conflict between tasks in one block, not the whole model, and with gradient
        accumulation they are computed per microbatch.
    The coefficients are scaled by K, so ``cagrad_c=0`` is exactly the plain summed GRPO
    gradient (the reference averages the task gradients; only the step size differs).

INVARIANT I7 in these modes: ``d loss / d H == -c`` on every graph that is backpropagated
(the regulariser in exact mode, the weighted loss in low-memory mode), ``0`` on each task
term that CAGrad rescales, and in exact mode, on guard steps, the update the combination
applies raises H to first order when the bonus acts alone (a flipped sign anywhere stops
training with an ``InvariantError`` naming the term).

Supported: one process or DDP (task gradients are averaged over processes before the Gram
matrix). Not supported: DeepSpeed (any ZeRO stage: its engine owns the gradients) and FSDP;
the Liger loss (no ``_compute_loss`` to evaluate per term).
"""

from __future__ import annotations

import re
from contextlib import contextmanager

import torch
import trl

from .. import guards
from ..configs import GRPOConfig, complete_grpo_config
from ..errors import InputError, InvariantError
from ..losses import cagrad_coefficients
from .grpo import TASK_KEY, GRPOTrainer


class MultiTaskGRPOTrainer(GRPOTrainer):
    _tag_names = ["trl", "grpo", "grpotrl", "multi-task"]
    _reads_cagrad = True

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, **kwargs):
        args = complete_grpo_config(args if args is not None else GRPOConfig(output_dir="grpotrl-output"))
        self._task_rewards = True  # GRPO's preflight runs check_tasks; reward_funcs may map tasks to functions
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, **kwargs)
        if args.cagrad != "off" and (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            raise InputError(_DISTRIBUTED_ERROR.format(mode=args.cagrad))
        self._task_grads: dict[int, list[torch.Tensor]] = {}  # exact mode: task -> summed grads over the window
        self._carrier: int | None = None  # exact mode: the task whose gradient the Trainer's backward carries
        self._present: set[int] = set()  # tasks with rows in the current microbatch
        self._proxy = _last_block_params(self.model) if args.cagrad == "low_memory" else None

    # ------------------------------------------------------------------ the loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.args.cagrad == "off" or not self.model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        coef = self.entropy_coef_in_force()
        full, task_losses, reg = self._loss_terms(model, inputs, coef)
        entropies = self._loss_entropies[0] if self._loss_entropies is not None else None
        for k, loss in task_losses.items():  # CAGrad rescales these: the bonus must not hide in them
            guards.check_entropy_sign(loss, entropies, 0.0, self.current_gradient_accumulation_steps,
                                      f"the policy loss of task {self.task_names[k]!r}")
        if self.args.cagrad == "exact":
            loss = self._exact_step(model, task_losses, reg, coef)
        else:
            loss = self._low_memory_loss(task_losses, reg)
        self._check_entropy_sign(loss, entropies, coef, f"the CAGrad {self.args.cagrad} loss")
        return loss + (full - loss).detach()  # logs the GRPO loss; backpropagates ``loss``

    def _loss_terms(self, model, inputs: dict, coef: float):
        """(full loss, {task: its policy loss}, regulariser) from one forward; the terms are
        TRL's ``_compute_loss`` on the cached logprobs, their metrics dropped. Every task gets a
        term on every process, present in this microbatch or not: TRL's loss reduces its metrics
        across processes, so all must make the same calls (``self._present`` says which tasks
        have rows here)."""
        with guards.record_calls(self, "_get_per_token_logps_and_entropies") as calls:
            full = GRPOTrainer._compute_loss(self, model, inputs)  # guards, health, metrics, entropy controller
        cached = calls[0]
        advantages = inputs["advantages"]
        task = inputs[TASK_KEY].view(-1, *[1] * (advantages.dim() - 1))  # [B] or [B, 1]
        with guards._instance_attr(self, "_get_per_token_logps_and_entropies", lambda *a, **k: cached), \
                self._metrics_dropped():
            with self._terms(beta=0.0, coef=0.0):
                task_losses = {k: trl.GRPOTrainer._compute_loss(self, model, {**inputs,
                                                                              "advantages": advantages * (task == k)})
                               for k in range(len(self.task_names))}
            with self._terms(beta=self.beta, coef=coef):
                reg = trl.GRPOTrainer._compute_loss(self, model, {**inputs, "advantages": torch.zeros_like(advantages)})
        self._present = set(inputs[TASK_KEY].unique().tolist())
        total = sum(task_losses.values()) + reg
        if not torch.allclose(total.detach(), full.detach(), rtol=1e-4, atol=1e-6):
            raise InvariantError("I7", f"the loss terms add up to {float(total):.6g}, not the full loss "
                                 f"{float(full):.6g}: the per-task split or the regulariser is wrong, so CAGrad "
                                 "would combine something other than the loss being reported.")
        return full, task_losses, reg

    @contextmanager
    def _terms(self, beta: float, coef: float):
        """TRL's loss with only some terms: KL coefficient ``beta``, entropy bonus ``coef``, no
        adaptive update (the full-loss call made it)."""
        saved = (self.beta, self.entropy_coef, self._entropy_bonus_enabled, self.use_adaptive_entropy)
        self.beta, self.entropy_coef, self._entropy_bonus_enabled, self.use_adaptive_entropy = \
            beta, coef, coef != 0.0, False
        try:
            yield
        finally:
            self.beta, self.entropy_coef, self._entropy_bonus_enabled, self.use_adaptive_entropy = saved

    @contextmanager
    def _metrics_dropped(self):
        metrics = self._metrics["train"]
        before = {k: len(v) for k, v in metrics.items()}
        try:
            yield
        finally:
            for k in list(metrics):
                if k not in before:
                    del metrics[k]
                else:
                    del metrics[k][before[k]:]

    # ------------------------------------------------------------------ CAGrad exact

    def _exact_step(self, model, task_losses: dict, reg: torch.Tensor, coef: float) -> torch.Tensor:
        """Accumulate each task's gradient over the window; returns what the Trainer's backward
        carries into ``.grad``: the regulariser, or, when it has no gradient (``beta = 0``, no
        entropy bonus, no aux loss), the last task's loss, which saves one backward pass.
        ``training_step`` combines the window after its last backward."""
        params = _trainable(model)
        self._carrier = None if (self.beta or coef or self.aux_loss_enabled) else len(self.task_names) - 1
        if not self._task_grads:  # every task, present or not, so processes reduce the same tensors
            self._task_grads = {k: [torch.zeros_like(p) for p in params]
                                for k in range(len(self.task_names)) if k != self._carrier}
        for k, loss in task_losses.items():
            if k == self._carrier or k not in self._present:  # an absent task's gradient is 0
                continue
            grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            for b, g in zip(self._task_grads[k], grads):
                if g is not None:
                    b.add_(g)
        if self._guard_now() and coef:
            self._check_composed_update(params, coef)
        return task_losses.get(self._carrier, reg)  # reg has no gradient when it carries nothing

    def training_step(self, model, inputs, num_items_in_batch):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.args.cagrad == "exact" and self.accelerator.sync_gradients and self._task_grads:
            self._combine_window(model)
        return loss

    def _combine_window(self, model) -> None:
        """After the window's last backward: CAGrad over the summed task gradients (averaged over
        processes), its direction added to ``.grad`` (which holds the regularisers' gradient, or
        the carrier task's: then its share is swapped for its CAGrad coefficient)."""
        params = _trainable(model)
        tasks = list(range(len(self.task_names)))
        carried = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
        bufs = [carried if k == self._carrier else [self._reduced(b) for b in self._task_grads[k]] for k in tasks]
        gram = torch.stack([torch.stack([sum(map(_dot, a, b)) for b in bufs]) for a in bufs])  # [K, K]
        weights = self._cagrad_weights(tasks, gram)  # [K]
        shares = [w - (k == self._carrier) for k, w in zip(tasks, weights.tolist())]  # the carrier is in .grad
        direction = [sum(s * b[i] for s, b in zip(shares, bufs)) for i in range(len(params))]
        self._log_cagrad(tasks, gram, weights)
        self._compose_update(params, direction)
        self._task_grads = {}

    def _compose_update(self, params: list, direction: list) -> None:
        """The applied update: the CAGrad direction plus what the regularisers' backward puts in
        ``.grad`` (KL, entropy bonus), outside the combination."""
        for p, d in zip(params, direction):
            p.grad = d.clone() if p.grad is None else p.grad + d

    def _check_composed_update(self, params: list, coef: float) -> None:
        """I7, exact mode: with the bonus acting alone (no task direction, ``.grad`` holding what
        the backward of ``-c H`` gives), the update ``_compose_update`` applies must raise H to
        first order: ``dH = -lr <u, dH/dtheta> > 0``. One extra backward of H (guard steps only)."""
        entropies, mask = self._loss_entropies
        H = (entropies * mask).sum() / mask.sum().clamp(min=1.0)
        grad_h = torch.autograd.grad(H, params, retain_graph=True, allow_unused=True)
        grad_h = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grad_h)]
        saved = [p.grad for p in params]
        try:
            for p, g in zip(params, grad_h):
                p.grad = -coef * g
            self._compose_update(params, [torch.zeros_like(p) for p in params])
            rise = -sum(_dot(p.grad, g) for p, g in zip(params, grad_h)).item()  # dH / lr, first order
        finally:
            for p, g in zip(params, saved):
                p.grad = g
        norm = sum(_dot(g, g) for g in grad_h).item()
        self._metrics["train"]["entropy/bonus_alone_dH_per_lr"].append(rise)
        if norm > 0 and rise <= 0:
            raise InvariantError("I7", f"with the entropy bonus c={coef:g} acting alone, the update the CAGrad "
                                 f"exact path applies changes H by {rise:+.4g} x lr to first order (|dH/dtheta|^2 = "
                                 f"{norm:.4g}): it lowers entropy. The regulariser gradient must be added to the "
                                 "combined task direction with a + sign, outside the combination "
                                 "(`_compose_update`).")

    # ------------------------------------------------------------------ CAGrad low-memory

    def _low_memory_loss(self, task_losses: dict, reg: torch.Tensor) -> torch.Tensor:
        """``sum_k coef_k L_k + regulariser`` with CAGrad coefficients from the last block's
        per-task gradients (this microbatch)."""
        tasks = list(range(len(self.task_names)))  # every task, so processes reduce the same tensors
        flat = []
        for k in tasks:
            grads = (torch.autograd.grad(task_losses[k], self._proxy, retain_graph=True, allow_unused=True)
                     if k in self._present else [None] * len(self._proxy))
            flat.append(self._reduced(torch.cat([(torch.zeros_like(p) if g is None else g).flatten()
                                                 for p, g in zip(self._proxy, grads)])))
        G = torch.stack(flat).double()  # [K, N_proxy]
        gram = G @ G.T  # [K, K]
        weights = self._cagrad_weights(tasks, gram)
        self._log_cagrad(tasks, gram, weights)
        return sum(w * task_losses[k] for w, k in zip(weights.tolist(), tasks)) + reg

    # ------------------------------------------------------------------ shared

    def _cagrad_weights(self, tasks: list[int], gram: torch.Tensor) -> torch.Tensor:
        """Coefficients on the task gradients, scaled by K (``cagrad_c=0`` = the plain sum).
        A task whose gradient is zero (no rows, or all its groups' rewards equal) is left out."""
        live = (gram.diagonal() > 0).nonzero().flatten().tolist()
        weights = torch.zeros(len(tasks))
        if len(live) == 1:
            weights[live[0]] = 1.0
        elif live:
            coef, _ = cagrad_coefficients(gram[live][:, live], self.args.cagrad_c)
            weights[live] = coef * len(live)
        return weights

    def _reduced(self, t: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(t, reduction="mean") if self.accelerator.num_processes > 1 else t

    def _log_cagrad(self, tasks: list[int], gram: torch.Tensor, weights: torch.Tensor) -> None:
        """Per task: gradient norm and CAGrad coefficient; the worst pairwise cosine; and how far
        the update is from the plain sum, |d - sum g| / |sum g|."""
        metrics = self._metrics["train"]
        gram = gram.double()
        norms = gram.diagonal().clamp(min=0).sqrt()
        for k, n, w in zip(tasks, norms.tolist(), weights.tolist()):
            metrics[f"tasks/{self.task_names[k]}/grad_norm"].append(n)
            metrics[f"tasks/{self.task_names[k]}/cagrad_coef"].append(w)
        if len(tasks) > 1:
            cos = gram / (norms[:, None] * norms[None, :]).clamp(min=1e-30)
            metrics["cagrad/min_cosine"].append(cos[~torch.eye(len(tasks), dtype=torch.bool)].min().item())
        ones, w = torch.ones(len(tasks), dtype=torch.float64), weights.double()
        plain = (ones @ gram @ ones).clamp(min=1e-30)
        deviation = ((w - ones) @ gram @ (w - ones)).clamp(min=0).div(plain).sqrt()
        metrics["cagrad/deviation_from_sum"].append(deviation.item())


_DISTRIBUTED_ERROR = ("cagrad={mode!r} runs in one process or under DDP (accelerate's multi-GPU/multi-CPU); DeepSpeed "
                      "(any ZeRO stage) and FSDP own the gradients it combines and are not supported. Use "
                      "recipes/accelerate/ddp.yaml, or cagrad: off under ZeRO.")


def _trainable(model) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double() * b.double()).sum()


def _last_block_params(model) -> list[torch.Tensor]:
    """The trainable parameters of the highest-numbered block (``...layers.N...``): the proxy
    whose per-task gradients give the low-memory CAGrad weights."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    index = {n: int(m.group(1)) for n, _ in named if (m := re.search(r"\.(\d+)\.", n))}
    if not index:
        raise InputError("cagrad='low_memory' takes its weights from the last transformer block, but no trainable "
                         "parameter name has a block number (`...layers.N...`); use cagrad='exact'.")
    last = max(index.values())
    return [p for n, p in named if index.get(n) == last]
