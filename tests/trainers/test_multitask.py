"""Entropy bonus sign (I7), multi-task GRPO and CAGrad on a tiny model.

Every mode: single-task GRPOTrainer, MultiTaskGRPOTrainer without CAGrad, CAGrad exact and
low-memory. The entropy tests start from a peaked model (final norm x10: next-token entropy
~1-2 nats at T=0.7 instead of ~log V = 10.8) so that a rise is visible.
"""

import asyncio
import math
from contextlib import contextmanager

import pytest
import torch
from datasets import Dataset

import grpotrl
from grpotrl.errors import InputError, InvariantError
from grpotrl.rewards.tasks import per_task
from grpotrl.trainers.grpo import _check_groups_single_task

MODES = ["single", "multitask", "exact", "low_memory"]


def two_tasks(n: int = 8) -> Dataset:
    rows = []
    for i in range(n):
        rows.append({"prompt": [{"role": "user", "content": f"Is group {i} as good as group {i + 1}?"}],
                     "task": "fairness"})
        rows.append({"prompt": [{"role": "user", "content": "Who wrote book " + "A" * (i % 3 + 1) + "?"}],
                     "task": "hallucination"})
    return Dataset.from_list(rows)


def longer(completions, **kw):
    return [len(c[0]["content"]) / 10 for c in completions]


def shorter(completions, **kw):  # conflicts with `longer`
    return [-len(c[0]["content"]) / 10 for c in completions]


def constant(completions, **kw):  # every advantage 0: only the regularisers act
    return [1.0] * len(completions)


@pytest.fixture(scope="module")
def peaked(tmp_path_factory, tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
    path = tmp_path_factory.mktemp("peaked")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(path)
    return str(path)


def probe_entropy(model, tok, T: float) -> float:
    """Mean next-token entropy at T after a few fixed templated prompts."""
    texts = [[{"role": "user", "content": q}] for q in ("Is it fair?", "Who wrote it?", "What is 2 + 2?")]
    model.eval()
    with torch.no_grad():
        H = []
        for msgs in texts:
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            logits = model(**ids).logits[0, -1].float() / T
            p = logits.log_softmax(-1)
            H.append(-(p.exp() * p).sum())
    return float(torch.stack(H).mean())


def make_trainer(mode: str, model: str, args, rewards, cls=None, dataset=None):
    dataset = dataset if dataset is not None else two_tasks()
    if mode == "single":
        cls = cls or grpotrl.GRPOTrainer
        funcs = rewards["fairness"]
        dataset = dataset.remove_columns("task")
    else:
        cls = cls or grpotrl.MultiTaskGRPOTrainer
        funcs = rewards
    return cls(model, reward_funcs=funcs, args=args, train_dataset=dataset)


def mode_args(grpo_args, mode: str, **kw):
    cagrad = mode if mode in ("exact", "low_memory") else "off"
    base = dict(cagrad=cagrad, beta=0.0, gradient_checkpointing=False, max_completion_length=8,
                health_action="off", health_report_steps=0)
    return grpo_args(**{**base, **kw})


@pytest.mark.parametrize("mode", MODES)
def test_I7_entropy_bonus_alone_raises_entropy(mode, peaked, grpo_args):
    args = mode_args(grpo_args, mode, entropy_coef=1.0, learning_rate=3e-3, max_steps=3)
    trainer = make_trainer(mode, peaked, args, {"fairness": constant, "hallucination": constant})
    tok = trainer.processing_class
    before = probe_entropy(trainer.model, tok, args.temperature)
    trainer.train()
    after = probe_entropy(trainer.model, tok, args.temperature)
    slopes = [h["entropy/dloss_dH"] for h in trainer.state.log_history if "entropy/dloss_dH" in h]
    assert slopes and all(s == pytest.approx(-1.0, abs=1e-4) for s in slopes)  # d loss / d H = -c
    assert after > before + 0.05, (before, after)


class FlippedLoss:
    """A flipped entropy sign in a home-grown loss: ``entropy_loss = -H`` then ``loss - c * entropy_loss``."""

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        H, mask = self.hook_record.loss.entropies, self.hook_record.loss.mask
        entropy_loss = -(H * mask).sum() / mask.sum() / self.current_gradient_accumulation_steps
        return loss + 2 * self.entropy_coef * (-entropy_loss)  # TRL's -cH turned into +cH


class FlippedGRPO(FlippedLoss, grpotrl.GRPOTrainer):
    pass


class FlippedMultiTask(FlippedLoss, grpotrl.MultiTaskGRPOTrainer):
    pass


class FlippedRegulariser(grpotrl.MultiTaskGRPOTrainer):
    """A multi-pass path with the regulariser built with the entropy sign flipped."""

    def _loss_terms(self, model, inputs, coef):
        full, tasks, reg = super()._loss_terms(model, inputs, coef)
        H, mask = self.hook_record.loss.entropies, self.hook_record.loss.mask
        return full, tasks, reg + 2 * coef * (H * mask).sum() / mask.sum() / self.current_gradient_accumulation_steps


class EntropyInsideTasks(grpotrl.MultiTaskGRPOTrainer):
    """The bonus folded into each task's loss, where CAGrad rescales it."""

    def _loss_terms(self, model, inputs, coef):
        full, tasks, reg = super()._loss_terms(model, inputs, coef)
        H, mask = self.hook_record.loss.entropies, self.hook_record.loss.mask
        bonus = coef * (H * mask).sum() / mask.sum() / self.current_gradient_accumulation_steps
        return full, {k: v - bonus / len(tasks) for k, v in tasks.items()}, reg + bonus


class FlippedComposition(grpotrl.MultiTaskGRPOTrainer):
    """Exact mode: the regulariser gradient subtracted from the CAGrad direction."""

    def _compose_update(self, params, direction):
        for p, d in zip(params, direction):
            p.grad = d.clone() if p.grad is None else d - p.grad


@pytest.mark.parametrize("mode,cls,term", [
    ("single", FlippedGRPO, "the GRPO loss"),
    ("multitask", FlippedMultiTask, "the GRPO loss"),
    ("exact", FlippedRegulariser, "the CAGrad exact loss"),
    ("low_memory", FlippedRegulariser, "the CAGrad low_memory loss"),
    ("exact", EntropyInsideTasks, "the policy loss of task"),
    ("low_memory", EntropyInsideTasks, "the policy loss of task"),
    ("exact", FlippedComposition, "_compose_update"),
])
def test_I7_seed_flipped_sign_is_stopped(mode, cls, term, tiny_llama, grpo_args):
    args = mode_args(grpo_args, mode, entropy_coef=0.1, max_steps=1)
    trainer = make_trainer(mode, tiny_llama, args, {"fairness": longer, "hallucination": shorter}, cls=cls)
    with pytest.raises(InvariantError, match="I7") as err:
        trainer.train()
    assert term in str(err.value)


class RowOfNoTask(grpotrl.MultiTaskGRPOTrainer):
    """A wrong split: one row's advantage is in the full loss but in no task's term (as a row whose
    label matches no task would be), so the regulariser ``full - sum_k L_k`` carries its policy loss."""

    def _policy_terms(self, logps, rows, inputs, entropy_mask):
        advantages = inputs["advantages"].clone()
        advantages[advantages.abs().argmax()] = 0.0
        return super()._policy_terms(logps, rows, {**inputs, "advantages": advantages}, entropy_mask)


@pytest.mark.parametrize("mode", ["exact", "low_memory"])
def test_I7_task_terms_must_add_up_to_the_policy_loss(mode, tiny_llama, grpo_args):
    """Guard steps: sum_k L_k == TRL's policy loss of the whole microbatch (the healthy run is every
    other CAGrad test here, guards on every step); a row left out of every term is stopped."""
    args = mode_args(grpo_args, mode, entropy_coef=0.1, beta=0.04, max_steps=1)
    trainer = make_trainer(mode, tiny_llama, args, {"fairness": longer, "hallucination": shorter}, cls=RowOfNoTask)
    with pytest.raises(InvariantError, match=r"I7.*task terms add up to .* but the policy loss of the whole "
                                             r"microbatch is"):
        trainer.train()


# a token the sampler is biased towards (bias 7.3 / T 0.7 against ~49k others: ~40% of tokens),
# so its count varies within groups
X = 1000


def more_x(completion_ids, **kw):
    return [float(sum(t == X for t in ids)) for ids in completion_ids]


def fewer_x(completion_ids, **kw):  # the same feature, the opposite way: the task gradients conflict
    return [-float(sum(t == X for t in ids)) for ids in completion_ids]


class NegatedEntropy(grpotrl.GRPOTrainer):
    """A home-grown entropy hook returning -H: the bonus' node has the right slope but is not the
    policy's entropy, so the bonus lowers entropy; the guard-step value check catches it."""

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        return logps, None if entropies is None else -entropies, aux


def test_I7_entropy_node_must_be_the_policy_entropy(tiny_llama, grpo_args):
    args = mode_args(grpo_args, "single", entropy_coef=0.1, max_steps=1)
    trainer = make_trainer("single", tiny_llama, args, {"fairness": longer}, cls=NegatedEntropy)
    with pytest.raises(InvariantError, match=r"\[I7\].*entropy the loss used is -"):
        trainer.train()


@pytest.mark.parametrize("mode, bf16", [(m, False) for m in MODES] + [("single", True), ("exact", True)])
def test_I7_a_microbatch_whose_bonus_acts_on_no_token_trains_and_is_counted_unchecked(mode, bf16, tiny_llama,
                                                                                     grpo_args):
    """Every completion runs to max_completion_length (3 tokens, no stop bias) and mask_truncated_completions masks
    them all: TRL's bonus is c * 0 / 1, so d loss / d H = 0, which I7 read as "the bonus is missing" and stopped a
    correct run. Now the slope must be 0 there, the microbatch is counted unchecked, and the run trains."""
    args = mode_args(grpo_args, mode, entropy_coef=0.1, max_steps=1, max_completion_length=3, generation_kwargs={},
                     mask_truncated_completions=True, bf16=bf16)
    trainer = make_trainer(mode, tiny_llama, args, {"fairness": longer, "hallucination": shorter})
    trainer.train()
    assert trainer.state.global_step == 1
    shares = [h["guards/entropy_sign_checked_share"] for h in trainer.state.log_history
              if "guards/entropy_sign_checked_share" in h]
    assert shares == [0.0]  # no microbatch had a token for the bonus: none was sign-checked
    assert not any("entropy/dloss_dH" in h for h in trainer.state.log_history)  # no -c to read


class BonusDropped(grpotrl.GRPOTrainer):
    """TRL's loss built without its entropy bonus (its coefficient 0 inside the loss) while c = 0.1 is in force."""

    def _compute_loss(self, model, inputs):
        coef, self.entropy_coef = self.entropy_coef, 0.0
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self.entropy_coef = coef


def test_I7_a_bonus_missing_on_a_microbatch_with_tokens_is_still_stopped_with_truncation_masked(tiny_llama,
                                                                                                grpo_args):
    """Control for the empty-mask case: rows stop early (the stop-token bias), so microbatches hold loss tokens
    under mask_truncated_completions, and a loss without the bonus there stops at step 1."""
    args = mode_args(grpo_args, "single", entropy_coef=0.1, max_steps=1, mask_truncated_completions=True)
    trainer = make_trainer("single", tiny_llama, args, {"fairness": longer}, cls=BonusDropped)
    with pytest.raises(InvariantError, match=r"\[I7\] the GRPO loss.*must be -0.1: the bonus is missing"):
        trainer.train()
    assert trainer.state.global_step == 0


def first_step_grads(mode: str, model: str, grpo_args, rewards=None, **kw) -> list[torch.Tensor]:
    """The gradients the optimizer receives at step 1 (clipping off), same seed and data: both
    tasks ask the same questions, one rewards token X, the other penalises it."""
    from transformers import TrainerCallback

    grads = []

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **k):
            grads.extend(p.grad.detach().clone() for p in model.parameters() if p.requires_grad)

    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Question {i}?"}], "task": task}
                              for i in range(4) for task in ("fairness", "hallucination")])
    kw = {"entropy_coef": 0.01, "beta": 0.02, **kw}
    args = mode_args(grpo_args, mode, max_steps=1, max_grad_norm=0.0, generation_kwargs={"sequence_bias": [[[X], 7.3]]},
                     per_device_train_batch_size=16, **kw)
    trainer = make_trainer(mode, model, args, rewards or {"fairness": more_x, "hallucination": fewer_x}, dataset=data)
    trainer.add_callback(Grab())
    trainer.train()
    return grads, trainer


def _rel(a: list, b: list) -> float:
    num = sum(float((x - y).pow(2).sum()) for x, y in zip(a, b))
    return (num / sum(float(y.pow(2).sum()) for y in b)) ** 0.5


@pytest.mark.parametrize("regularised", [True, False], ids=["kl+entropy", "no-regulariser"])
def test_two_tasks_cagrad_c0_is_the_plain_gradient_and_c05_is_not(regularised, tiny_llama, grpo_args):
    """With KL and an entropy bonus the Trainer's backward carries the regulariser (K + 1 passes);
    without, it carries the last task's gradient (K passes): both must give the same update."""
    reg = {} if regularised else {"entropy_coef": 0.0, "beta": 0.0}
    plain, _ = first_step_grads("multitask", tiny_llama, grpo_args, **reg)
    c0, _ = first_step_grads("exact", tiny_llama, grpo_args, cagrad_c=0.0, **reg)
    cag, trainer = first_step_grads("exact", tiny_llama, grpo_args, cagrad_c=0.5, **reg)
    assert (trainer.task_gradients.carrier is None) == regularised
    assert _rel(c0, plain) < 1e-4  # the K-scaled CAGrad with c = 0 is TRL's summed gradient (+ KL, entropy)
    logs = trainer.state.log_history[0]
    assert logs["cagrad/min_cosine"] < -0.1, logs["cagrad/min_cosine"]  # more X vs fewer X: they conflict
    assert _rel(cag, plain) > 0.05 and logs["cagrad/deviation_from_sum"] > 0.05
    for task in ("fairness", "hallucination"):
        for metric in ("reward", "reward_std", "entropy", "completions/mean_length", "completions/one_token_share",
                       "grad_norm", "cagrad_coef"):
            assert f"tasks/{task}/{metric}" in logs, f"tasks/{task}/{metric}"
    assert logs["tasks/fairness/reward"] > 0 > logs["tasks/hallucination/reward"]  # each task its own reward


def no_reward(completion_ids, **kw):  # every advantage of the task 0: its loss term has no gradient
    return [0.0] * len(completion_ids)


@pytest.mark.parametrize("mode", ["exact", "low_memory"])
def test_cagrad_update_is_the_combination_computed_by_hand(mode, tiny_llama, grpo_args):
    """The trainer's update at cagrad_c = 0.5 against the CAGrad combination computed here from
    each task's own gradient (a plain multi-task run in which only that task is rewarded): exact mode weighs
    them by the Gram matrix of the whole model, low-memory by that of the last block's parameters. Swapping
    the two tasks' weights gives an update this test tells apart."""
    from grpotrl.ops.losses import cagrad_coefficients
    from grpotrl.trainers.multitask import _last_block_params

    reg = {"entropy_coef": 0.0, "beta": 0.0}
    g_fair, _ = first_step_grads("multitask", tiny_llama, grpo_args, {"fairness": more_x, "hallucination": no_reward},
                                 **reg)
    g_hall, _ = first_step_grads("multitask", tiny_llama, grpo_args, {"fairness": no_reward, "hallucination": fewer_x},
                                 **reg)
    got, trainer = first_step_grads(mode, tiny_llama, grpo_args, cagrad_c=0.5, **reg)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    proxy = [i for i, p in enumerate(params) if any(p is q for q in _last_block_params(trainer.model))]
    rows = range(len(params)) if mode == "exact" else proxy
    assert 0 < len(proxy) < len(params)
    g = [g_fair, g_hall]
    gram = torch.tensor([[sum(float((a[i].double() * b[i].double()).sum()) for i in rows) for b in g] for a in g])
    coef, _ = cagrad_coefficients(gram, 0.5)
    w = (coef * 2).tolist()  # scaled by K: cagrad_c = 0 is the plain sum
    expected = [w[0] * a + w[1] * b for a, b in zip(g_fair, g_hall)]
    swapped = [w[1] * a + w[0] * b for a, b in zip(g_fair, g_hall)]
    assert abs(w[0] - w[1]) > 0.05, w  # unequal weights, or a swap could not show
    assert _rel(got, expected) < 1e-4, _rel(got, expected)
    assert _rel(got, swapped) > 0.05
    logs = trainer.state.log_history[0]
    assert [logs["tasks/fairness/cagrad_coef"], logs["tasks/hallucination/cagrad_coef"]] == pytest.approx(w, rel=1e-4)


class BeforeTaskForwards(grpotrl.MultiTaskGRPOTrainer):
    """The CAGrad loss as it was before the per-task forwards (commit 5ab1214), kept as the reference for the
    update: one forward of every row, and each term TRL's loss on all of it, so that every task
    term's backward ran through every row (K + 1 full backward passes in exact mode)."""

    _get_per_token_logps_and_entropies = grpotrl.GRPOTrainer._get_per_token_logps_and_entropies

    def _loss_terms(self, model, inputs, coef):
        import trl

        from grpotrl.trainers import _intercept
        from grpotrl.trainers.grpo import TASK_KEY

        with _intercept.record_calls(self, "_get_per_token_logps_and_entropies") as calls:
            full = grpotrl.GRPOTrainer._compute_loss(self, model, inputs)
        cached = calls[0]
        adv = inputs["advantages"]
        task = inputs[TASK_KEY].view(-1, *[1] * (adv.dim() - 1))
        with _intercept.inject_attr(self, "_get_per_token_logps_and_entropies", lambda *a, **k: cached), \
                self._metrics_dropped():
            with self._terms(beta=0.0, coef=0.0):
                terms = {k: trl.GRPOTrainer._compute_loss(self, model, {**inputs, "advantages": adv * (task == k)})
                         for k in range(len(self.task_names))}
            with self._terms(beta=self.beta, coef=coef):
                reg = trl.GRPOTrainer._compute_loss(self, model, {**inputs, "advantages": torch.zeros_like(adv)})
        return full, terms, reg

    @contextmanager
    def _metrics_dropped(self):  # what TRL's extra loss calls append to _metrics["train"], removed
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

    @contextmanager
    def _terms(self, beta: float, coef: float):
        saved = (self.beta, self.entropy_coef, self._entropy_bonus_enabled, self.use_adaptive_entropy)
        self.beta, self.entropy_coef, self._entropy_bonus_enabled, self.use_adaptive_entropy = \
            beta, coef, coef != 0.0, False
        try:
            yield
        finally:
            self.beta, self.entropy_coef, self._entropy_bonus_enabled, self.use_adaptive_entropy = saved


def one_sgd_step(cls, mode: str, model: str, grpo_args) -> tuple[list[torch.Tensor], dict]:
    """Parameter deltas after one plain SGD step (delta = -lr * grad, no Adam normalisation to
    hide a difference) and the step's logs: KL, entropy bonus, two conflicting tasks, and a
    window of two microbatches."""
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Question {i}?"}], "task": task}
                              for i in range(4) for task in ("fairness", "hallucination")])
    args = mode_args(grpo_args, mode, max_steps=1, max_grad_norm=0.0, optim="sgd", learning_rate=1.0,
                     entropy_coef=0.01, beta=0.04, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                     generation_kwargs={"sequence_bias": [[[X], 7.3]]})
    trainer = cls(model, reward_funcs={"fairness": more_x, "hallucination": fewer_x}, args=args, train_dataset=data)
    before = [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]
    trainer.train()
    after = [p.detach() for p in trainer.model.parameters() if p.requires_grad]
    return [a - b for a, b in zip(after, before)], trainer.state.log_history[0]


@pytest.mark.parametrize("mode", ["exact", "low_memory"])
def test_cagrad_update_unchanged_by_the_per_task_forward(mode, tiny_llama, grpo_args):
    """The loss forward runs per task so that a task term's backward walks its own rows
    only; the update and every logged metric must equal the code before it (BeforeTaskForwards),
    to 1e-5 relative (the per-task forwards multiply smaller matrices: float rounding only)."""
    new, new_logs = one_sgd_step(grpotrl.MultiTaskGRPOTrainer, mode, tiny_llama, grpo_args)
    old, old_logs = one_sgd_step(BeforeTaskForwards, mode, tiny_llama, grpo_args)
    assert _rel(new, old) < 1e-5, _rel(new, old)
    assert sum(float(d.abs().sum()) for d in old) > 0  # a real step
    assert old_logs["cagrad/deviation_from_sum"] > 0.01  # CAGrad really reweighted the tasks
    assert set(new_logs) == set(old_logs)
    for key, value in old_logs.items():
        if isinstance(value, float) and "time" not in key and "runtime" not in key and "per_second" not in key:
            assert new_logs[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_low_memory_two_task_run_completes(tiny_llama, grpo_args, monkeypatch):
    """... and its per-task gradient passes really run with TRL's fused head weight gradient switched off
    (the saving of ``_intercept.skip_head_weight_grad`` reaches the trainer's own graph)."""
    from grpotrl.trainers import _intercept

    switched, skip = [], _intercept.skip_head_weight_grad

    @contextmanager
    def counted(roots, inputs):
        with skip(roots, inputs) as n:
            switched.append(n)
            yield n

    monkeypatch.setattr(_intercept, "skip_head_weight_grad", counted)
    args = mode_args(grpo_args, "low_memory", entropy_coef=0.01, beta=0.02, max_steps=2,
                     gradient_accumulation_steps=2)
    trainer = make_trainer("low_memory", tiny_llama, args, {"fairness": longer, "hallucination": shorter})
    trainer.train()
    logs = trainer.state.log_history[-2]
    assert "cagrad/min_cosine" in logs and "tasks/hallucination/cagrad_coef" in logs
    assert switched and min(switched) >= 1, f"fused-head nodes switched per microbatch: {switched}"


def two_task_prompts() -> Dataset:
    """Four prompts of each task, the same questions: every step's batch usually holds both tasks."""
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"Question {i}?"}], "task": task}
                              for i in range(4) for task in ("fairness", "hallucination")])


class NaNTaskGradient(grpotrl.MultiTaskGRPOTrainer):
    """Every present task's policy term keeps its value and gets a NaN gradient: + sqrt(|L - L|), whose backward is
    inf (sqrt at 0) times 0 (abs at 0). The loss and the terms' sum stay finite; only the gradients are NaN."""

    poisoned: list

    def _policy_terms(self, logps, rows, inputs, entropy_mask):
        terms = super()._policy_terms(logps, rows, inputs, entropy_mask)
        self.poisoned = [self.task_names[k] for k in terms if rows[k].numel()]
        return {k: t + (t - t.detach()).abs().sqrt() if rows[k].numel() else t for k, t in terms.items()}


@pytest.mark.parametrize("mode,regularised", [("exact", True), ("exact", False), ("low_memory", True)],
                         ids=["exact-regulariser", "exact-carrier", "low_memory"])
def test_a_nan_task_gradient_stops_naming_the_task_and_the_step(mode, regularised, tiny_llama, grpo_args):
    """A task whose gradient is NaN has a NaN squared norm in the Gram matrix; read as "not > 0" it got CAGrad weight
    0 and the run trained on (health rules off here, as a user may set them): the update carried 0 * NaN. It must
    stop on the first step, before the optimizer moves a weight, naming each such task and the step. Exact mode
    with a regulariser keeps every task's gradient in its sums; without one the last task's rides in ``.grad``
    (the carrier); low-memory reads the last block's gradients."""
    reg = {"entropy_coef": 0.01, "beta": 0.02} if regularised else {"entropy_coef": 0.0, "beta": 0.0}
    args = mode_args(grpo_args, mode, max_steps=1, per_device_train_batch_size=16, **reg)
    trainer = NaNTaskGradient(tiny_llama, reward_funcs={"fairness": longer, "hallucination": shorter}, args=args,
                              train_dataset=two_task_prompts())
    stop = rf"\[multi-task\] step 1, cagrad='{mode}': the gradient of task\(s\) "
    with pytest.raises(InvariantError, match=stop) as e:
        trainer.train()
    assert trainer.poisoned and all(f"'{name}' (|g|^2 = nan)" in str(e.value) for name in trainer.poisoned), e.value
    assert trainer.state.global_step == 0
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())


def test_non_finite_gram_entries_name_their_tasks():
    """An inf squared norm (a gradient that overflowed) passed ``> 0`` and went into the solver; a NaN one failed it
    and dropped the task. Either names the task; a non-finite entry off the diagonal alone names both of its tasks;
    a finite matrix, zero rows included, passes."""
    from grpotrl.trainers.multitask import _check_gram_finite

    names = ["a", "b", "c"]
    _check_gram_finite(torch.tensor([[1.0, 0.5, 0.0], [0.5, 2.0, 0.0], [0.0, 0.0, 0.0]]), names, 3, "exact")
    inf = torch.tensor([[math.inf, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    with pytest.raises(InvariantError, match=r"step 3, cagrad='low_memory': the gradient of task\(s\) 'a' "
                                             r"\(\|g\|\^2 = inf\) is NaN/inf"):
        _check_gram_finite(inf, names, 3, "low_memory")
    off = torch.tensor([[1.0, 0.0, math.nan], [0.0, 1.0, 0.0], [math.nan, 0.0, 1.0]])
    with pytest.raises(InvariantError, match=r"task\(s\) 'a' \(\|g\|\^2 = 1\), 'c' \(\|g\|\^2 = 1\) is NaN/inf"):
        _check_gram_finite(off, names, 7, "exact")


def test_exact_combination_under_the_fp16_loss_scaler(tiny_llama, grpo_args):
    """fp16=True (on GPU: accelerate's GradScaler): the Trainer's backward leaves S x the carrier task's gradient in
    .grad, the other tasks' sums come unscaled from autograd.grad. Read as they are, the Gram matrix mixed S g_1 with
    g_0 and the direction was added unscaled, then divided by S with the rest: the update must be S x the one
    without a scaler, which the scaler's unscaling turns into the CAGrad update. A carrier gradient that
    overflowed at S >= 1 is the scaler's overflow: .grad is left for the scaler to skip, nothing stops; the same
    inf at S < 1, or without a scaler, is a broken gradient and stops, naming the task. (No GradScaler on a CPU
    accelerator: a CPU one is set on it, as the backward would have used it.)"""
    args = mode_args(grpo_args, "exact", entropy_coef=0.0, beta=0.0)
    trainer = grpotrl.MultiTaskGRPOTrainer(tiny_llama, reward_funcs={"fairness": longer, "hallucination": shorter},
                                           args=args, train_dataset=two_tasks())
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    g0 = [torch.randn(p.shape, generator=gen) for p in params]
    g1 = [-0.5 * a + torch.randn(p.shape, generator=gen) for a, p in zip(g0, params)]  # conflicts with g0

    def combined(scale, carried):
        trainer.accelerator.scaler = None if scale is None else torch.amp.GradScaler("cpu", init_scale=scale)
        trainer.task_gradients.carrier, trainer.task_gradients.sums = 1, {0: [a.clone() for a in g0]}
        for p, g in zip(params, carried):
            p.grad = g.clone() * (1.0 if scale is None else scale)
        trainer._combine_window(trainer.model)
        assert trainer.task_gradients.sums == {}
        return [p.grad.clone() for p in params]

    plain = combined(None, g1)
    scaled = combined(1024.0, g1)
    assert _rel([g / 1024.0 for g in scaled], plain) < 1e-6
    assert _rel(plain, [a + b for a, b in zip(g0, g1)]) > 0.05  # CAGrad moved it off the plain sum
    overflow = [g.clone() for g in g1]
    overflow[0].view(-1)[0] = math.inf
    left = combined(1024.0, overflow)
    assert all(torch.equal(a, b * 1024.0) for a, b in zip(left, overflow))  # untouched: the scaler skips it
    for scale in (0.5, None):
        with pytest.raises(InvariantError, match=r"the gradient of task\(s\) 'hallucination' \(\|g\|\^2 = inf\)"):
            combined(scale, overflow)


class RecordedLowMemory(grpotrl.MultiTaskGRPOTrainer):
    """Each microbatch's step, tasks with rows, Gram matrix and CAGrad weights, as the low-memory loss saw them."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen, self.solved = [], []

    def _low_memory_loss(self, task_losses, reg, present):
        self.seen.append((self.state.global_step + 1, set(present)))
        return super()._low_memory_loss(task_losses, reg, present)

    def _cagrad_weights(self, tasks, gram):
        weights = super()._cagrad_weights(tasks, gram)
        self.solved.append((gram.double().diagonal().clamp(min=0).sqrt(), weights.double()))
        return weights


def test_low_memory_task_metrics_average_only_the_microbatches_holding_the_task(tiny_llama, grpo_args):
    """Low-memory CAGrad solves per microbatch. Four microbatches of 2 rows from a generation batch of 4 prompts x 2:
    a task is often absent from some of them. Its ``grad_norm`` and ``cagrad_coef`` must be the mean over the
    microbatches holding it (over the gradients it has rows in, as exact mode's window sum is), and absent from a
    step's log where no microbatch held it; each absent microbatch's 0 in the mean shrinks the task's logged norm
    and coefficient (here a task held by 2 of 4 microbatches logs half its norm)."""
    args = mode_args(grpo_args, "low_memory", max_steps=2, per_device_train_batch_size=2, num_generations=2,
                     gradient_accumulation_steps=4, entropy_coef=0.01, beta=0.02,
                     generation_kwargs={"sequence_bias": [[[X], 7.3]]})
    trainer = RecordedLowMemory(tiny_llama, reward_funcs={"fairness": more_x, "hallucination": fewer_x}, args=args,
                                train_dataset=two_task_prompts())
    trainer.train()
    assert len(trainer.seen) == len(trainer.solved) == 8
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    partial = 0
    for step in (1, 2):
        mine = [(present, solved) for (s, present), solved in zip(trainer.seen, trainer.solved) if s == step]
        for k, task in enumerate(trainer.task_names):
            held = [(norms[k].item(), w[k].item()) for present, (norms, w) in mine if k in present]
            for i, metric in enumerate(("grad_norm", "cagrad_coef")):
                got = logs[step].get(f"tasks/{task}/{metric}")
                if held:
                    assert got == pytest.approx(sum(h[i] for h in held) / len(held), rel=1e-6), (step, task, metric)
                else:
                    assert got is None, (step, task, metric, got)
            if 0 < len(held) < len(mine):  # zeros in the mean would move it
                zeros_averaged = sum(norms[k].item() for _, (norms, _) in mine) / len(mine)
                partial += abs(zeros_averaged - sum(h[0] for h in held) / len(held)) > 1e-3
    assert partial, "no task was absent from some microbatches of a step and present in others: the test shows nothing"


# ---------------------------------------------------------------- errors before the model loads


@pytest.fixture
def no_model_load(monkeypatch):
    import transformers

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", refuse)  # TRL loads via the architecture class


def test_task_missing_from_the_mapping_is_an_error_before_load(tiny_llama, grpo_args, no_model_load):
    with pytest.raises(InputError, match=r"\['hallucination'\].*no reward functions"):
        grpotrl.MultiTaskGRPOTrainer(tiny_llama, reward_funcs={"fairness": longer}, args=grpo_args(),
                                     train_dataset=two_tasks())


@pytest.mark.parametrize("config,after,match", [
    ({"scale_rewards": "batch"}, {}, "mixes tasks"),
    # set after __post_init__: the config itself would try to set DeepSpeed up, on CPU
    ({"cagrad": "exact"}, {"deepspeed": {"zero_optimization": {"stage": 2}}}, "DeepSpeed"),
])
def test_bad_multitask_settings_are_errors_before_load(config, after, match, tiny_llama, grpo_args, no_model_load):
    args = grpo_args(**config)
    for key, value in after.items():
        setattr(args, key, value)
    with pytest.raises(InputError, match=match):
        grpotrl.MultiTaskGRPOTrainer(tiny_llama, reward_funcs={"fairness": longer, "hallucination": shorter},
                                     args=args, train_dataset=two_tasks())


def test_missing_task_column_and_single_task_cagrad(tiny_llama, grpo_args, no_model_load):
    with pytest.raises(InputError, match="no 'task' column"):
        grpotrl.MultiTaskGRPOTrainer(tiny_llama, reward_funcs=[longer], args=grpo_args(),
                                     train_dataset=two_tasks().remove_columns("task"))
    one = two_tasks().filter(lambda r: r["task"] == "fairness")
    with pytest.raises(InputError, match="one task"):
        grpotrl.MultiTaskGRPOTrainer(tiny_llama, reward_funcs=[longer], args=grpo_args(cagrad="exact"),
                                     train_dataset=one)


def test_cagrad_c_without_cagrad_is_refused_before_load(tiny_llama, grpo_args, no_model_load):
    """A recipe with per-task rewards and cagrad_c: 0.3 but no cagrad: the multi-task trainer trained the plain
    summed loss and ignored it (GRPOTrainer and GAD refuse the same setting); refused before the model loads."""
    with pytest.raises(InputError, match=r"cagrad_c=0.3 with cagrad='off'.*Set cagrad: exact"):
        grpotrl.MultiTaskGRPOTrainer(tiny_llama, reward_funcs={"fairness": longer, "hallucination": shorter},
                                     args=grpo_args(cagrad_c=0.3), train_dataset=two_tasks())


@pytest.mark.parametrize("mode", ["exact", "low_memory"])
def test_cagrad_with_reentrant_checkpointing_is_refused_before_load(mode, tiny_llama, grpo_args, no_model_load):
    """Reentrant activation checkpointing keeps no graph from a layer's output to its parameters, so CAGrad's
    per-task autograd.grad cannot reach them: exact stopped mid-step on torch's RuntimeError, low_memory trained on
    KL + entropy alone. Refused before the model loads; the non-reentrant default is accepted."""
    args = grpo_args(cagrad=mode, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(InputError, match=rf"cagrad='{mode}'.*reentrant activation checkpointing.*use_reentrant: false"):
        grpotrl.MultiTaskGRPOTrainer(tiny_llama, reward_funcs={"fairness": longer, "hallucination": shorter},
                                     args=args, train_dataset=two_tasks())


def test_low_memory_task_loss_that_reaches_no_proxy_parameter_is_stopped(tiny_llama, grpo_args):
    """Reentrant checkpointing switched on after init, past the refusal (as a model's own checkpointing would be):
    each task's autograd.grad to the last block returns None for every parameter. Read as a zero gradient, every
    task's CAGrad weight was 0 and the step applied KL + entropy only (grad_norm ~1e-4 against ~1 here), silently;
    it must stop on the first microbatch, naming the task."""
    args = mode_args(grpo_args, "low_memory", entropy_coef=0.01, beta=0.02, max_steps=1)
    trainer = make_trainer("low_memory", tiny_llama, args, {"fairness": longer, "hallucination": shorter})
    reentrant = {"use_reentrant": True}
    trainer.args.gradient_checkpointing_kwargs = trainer.args.activation_checkpointing_kwargs = reentrant  # TRL's
    trainer.model.activation_checkpointing_enable(activation_checkpointing_kwargs=reentrant)  # re-enable reads it
    with pytest.raises(InvariantError, match=r"\[multi-task\] the policy loss of task '\w+' has no gradient path "
                                             r"to the last block's trainable parameters"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_config_rejects_negative_entropy_coef_and_unknown_mode(tmp_path):
    with pytest.raises(InputError, match="c >= 0"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), entropy_coef=-0.1, use_cpu=True)
    with pytest.raises(InputError, match="cagrad='fast'"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), cagrad="fast", use_cpu=True)


# ---------------------------------------------------------------- pure pieces


def test_groups_mixing_tasks_are_stopped():
    _check_groups_single_task(torch.tensor([0, 0, 1, 1]), 2, ["a", "b"])
    with pytest.raises(InvariantError, match=r"group 1 mixes tasks \['a', 'b'\]"):
        _check_groups_single_task(torch.tensor([0, 0, 0, 1]), 2, ["a", "b"])


def test_low_memory_proxy_gradients_skip_the_head_weight_gradient_and_restore_it():
    """``skip_head_weight_grad``: the block's autograd.grad to the last block gives the same gradients
    with TRL's fused head computing no weight gradient; after the block, the backward still fills the
    head weight's .grad, equal to a graph never switched."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    from grpotrl.trainers._intercept import skip_head_weight_grad

    torch.manual_seed(0)
    block, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 7, bias=False)
    x, targets = torch.randn(5, 4), torch.tensor([0, 6, 2, 3, 1])

    def losses():
        logps = ChunkedLogProbFunction.apply(block(x), head.weight, None, targets, 0.7, 4)[0]
        return (logps[:2].sum(), logps[2:].sum() * 0.5)

    plain = losses()
    want = [torch.autograd.grad(loss, list(block.parameters()), retain_graph=True) for loss in plain]
    sum(plain).backward()
    want_head, head.weight.grad = head.weight.grad.clone(), None
    switched_losses = losses()
    node = switched_losses[0].grad_fn.next_functions[0][0].next_functions[0][0]  # sum <- slice <- fused head
    with skip_head_weight_grad(list(switched_losses), list(block.parameters())) as switched:
        assert switched == 1 and node.needs_input_grad[1] is False
        got = [torch.autograd.grad(loss, list(block.parameters()), retain_graph=True) for loss in switched_losses]
    assert node.needs_input_grad[1] is True
    for g, w in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(g, w))
    sum(switched_losses).backward()
    assert torch.equal(head.weight.grad, want_head)
    with skip_head_weight_grad(list(losses()), [head.weight]) as switched:  # the weight asked for: left alone
        assert switched == 0


def test_min_cosine_compares_only_tasks_with_a_gradient():
    """A task without rows in the step (or whose groups all have equal rewards) has a zero gradient and no direction:
    ``cagrad/min_cosine`` is the worst cosine between the others (here 0.5: a and b agree), NaN when fewer than two
    have a gradient (TRL's log leaves NaN out of its mean), never a 0 that reads as conflict or averages one away."""
    from types import SimpleNamespace

    logged = {}
    stub = SimpleNamespace(task_names=["a", "b", "c"], _record_metrics=lambda m, mode: logged.update(m))
    gram = torch.tensor([[1.0, 0.5, 0.0], [0.5, 1.0, 0.0], [0.0, 0.0, 0.0]])  # task c: rows, every group flat
    grpotrl.MultiTaskGRPOTrainer._log_cagrad(stub, [0, 1, 2], gram, torch.tensor([1.0, 1.0, 0.0]), [0, 1, 2])
    assert logged["cagrad/min_cosine"] == pytest.approx(0.5)
    assert logged["tasks/c/grad_norm"] == 0.0 and logged["tasks/c/cagrad_coef"] == 0.0
    grpotrl.MultiTaskGRPOTrainer._log_cagrad(stub, [0, 1], gram[1:, 1:], torch.tensor([1.0, 0.0]), [0, 1])
    assert math.isnan(logged["cagrad/min_cosine"])


def test_I7_terms_add_up_check_fails_on_a_non_finite_term():
    """The guard's tolerance grows with the terms: 1e-6 + 1e-5 * sum |L_k|. A term of +inf (a restatement that
    overflows where TRL's loss is finite, 5 here) made it inf, and |inf - 5| = inf <= inf passed; a NaN or inf on
    either side cannot be compared and must fail."""
    from grpotrl.trainers.multitask import _check_terms_add_up

    names, t = ["a", "b"], torch.tensor
    _check_terms_add_up({0: t(2.0), 1: t(3.0)}, t(5.0), names)  # 2 + 3 = 5: passes
    for terms, whole in [({0: t(math.inf), 1: t(3.0)}, t(5.0)), ({0: t(math.nan), 1: t(3.0)}, t(5.0)),
                         ({0: t(2.0), 1: t(3.0)}, t(math.inf)), ({0: t(math.inf), 1: t(3.0)}, t(math.inf))]:
        with pytest.raises(InvariantError, match=r"\[I7\] the CAGrad task terms add up to .* NaN/inf"):
            _check_terms_add_up(terms, whole, names)


def test_cagrad_with_no_trainable_parameter_is_a_named_error():
    from grpotrl.trainers.multitask import _trainable

    model = torch.nn.Linear(2, 2)
    assert len(_trainable(model)) == 2
    model.requires_grad_(False)
    with pytest.raises(InputError, match="requires_grad=False"):
        _trainable(model)


def test_per_task_rewards_see_only_their_rows_sync_and_async():
    seen = []

    def judge(prompts, completions, answer, **kw):
        seen.append((prompts, answer))
        return [1.0] * len(prompts)

    async def ajudge(prompts, completions, **kw):
        return [2.0] * len(prompts)

    f, g = per_task({"a": judge, "b": [ajudge]}, "task")
    kw = dict(prompts=["p0", "p1", "p2"], completions=["c0", "c1", "c2"], completion_ids=[[0], [1], [2]],
              task=["a", "b", "a"], answer=["x", "y", "z"], trainer_state=None)
    assert f(**kw) == [1.0, None, 1.0] and seen == [(["p0", "p2"], ["x", "z"])]
    assert asyncio.run(g(**kw)) == [None, 2.0, None] and g.__name__ == "b/ajudge"
    with pytest.raises(InputError, match="must be callables"):
        per_task({"a": "some/reward-model"}, "task")


# ---------------------------------------------------------------- the CLI and its recipe


def test_recipe_runs_multitask_cagrad_through_the_cli(tiny_llama, tmp_path):
    """`task:name` rewards select MultiTaskGRPOTrainer; the shipped two-task data; one CAGrad step."""
    import json
    from pathlib import Path

    from grpotrl import cli

    out, recipe = tmp_path / "mt", Path(__file__).resolve().parents[2] / "recipes/smollm2/grpo_multitask_cagrad.yaml"
    cli.main(["grpo", "--config", str(recipe), "--model_name_or_path", tiny_llama,
              "--output_dir", str(out), "--max_steps", "1", "--max_completion_length", "6"])
    logs = json.loads((out / "trainer_state.json").read_text())["log_history"][0]
    assert logs["entropy/dloss_dH"] == pytest.approx(-0.01, abs=1e-6)
    assert {"rewards/hallucination/exact_answer_reward/mean", "rewards/fairness/even_handed_reward/mean",
            "tasks/fairness/reward", "tasks/hallucination/entropy"} <= set(logs)


def test_per_task_reward_names_in_a_recipe():
    from grpotrl.rewards import resolve
    from grpotrl.rewards import rules

    assert resolve.resolve_reward_funcs(["a:exact_answer", "a:format", "b:even_handed"]) == {
        "a": [rules.exact_answer_reward, rules.format_reward], "b": [rules.even_handed_reward]}
    with pytest.raises(InputError, match="mixes per-task entries"):
        resolve.resolve_reward_funcs(["a:exact_answer", "format"])
    with pytest.raises(InputError, match=r"Unknown reward function\(s\) \['a:exact'\]"):
        resolve.resolve_reward_funcs(["a:exact"])


def test_cagrad_under_an_accelerate_deepspeed_launch_is_refused_before_load(tiny_llama, grpo_args, no_model_load,
                                                                            monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what `accelerate launch` with zero2.yaml sets
    with pytest.raises(InputError, match="DeepSpeed"):
        grpotrl.MultiTaskGRPOTrainer(tiny_llama, reward_funcs={"fairness": longer, "hallucination": shorter},
                                     args=grpo_args(cagrad="low_memory"), train_dataset=two_tasks())


def test_exact_task_metrics_leave_out_a_task_absent_from_the_whole_step(tiny_llama, grpo_args):
    """Exact CAGrad, one prompt group per optimizer step (2 rows, G=2, no accumulation): each step holds one task,
    so the other has no gradient in that step. Its ``grad_norm`` and ``cagrad_coef`` are left out of that step's
    log (a 0 logged for it would pull the task's curve towards 0); the present task's are logged."""
    args = mode_args(grpo_args, "exact", max_steps=4, per_device_train_batch_size=2, num_generations=2,
                     gradient_accumulation_steps=1, entropy_coef=0.01, beta=0.02)
    trainer = grpotrl.MultiTaskGRPOTrainer(tiny_llama, reward_funcs={"fairness": more_x, "hallucination": fewer_x},
                                           args=args, train_dataset=two_task_prompts())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4
    for h in logs:
        logged = [t for t in trainer.task_names if f"tasks/{t}/grad_norm" in h]
        assert len(logged) == 1, h  # the step's one task
        assert f"tasks/{logged[0]}/cagrad_coef" in h
