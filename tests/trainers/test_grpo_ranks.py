"""GRPOTrainer's loss-side guards decide on every rank: a guard that fails on rank 1 and passes on rank 0 stops both
ranks at the same point, with the same invariant, each naming rank 1, rather than rank 1 raising alone while rank 0
waits in its next collective (DDP's gradient all-reduce, the next gather) until the launcher kills it.

Two spawned processes (a fork of the suite's process can hang before the group forms) run the real trainer on a tiny
random model under accelerate's CPU DDP over gloo (127.0.0.1, a free port), one optimizer step of two microbatches per
case, with rank 1's fault planted in its own microbatch or loss:

* ``I4``: rank 1's completion mask drops its first row's first token (``guards.check_loss_inputs``, before the
  loss's forward);
* ``I10``: rank 1's reference model is moved off the policy (``_check_step0_identity``: the reference's logprobs at
  step 0 are the policy's), after the forward;
* ``I7``: rank 1's loss carries an extra ``+0.5 H`` (``_check_entropy_sign``), on a step with no guard due and an
  entropy bonus configured.

Every collective waits at most 20 s (the group's timeout) and the parent at most 60 s for the children, so a rank left
waiting fails the test instead of hanging it. ``torch.distributed.all_gather`` and ``all_gather_object`` are counted
on each rank: the agreement gathers one uint8 flag per microbatch (``guards.ranks.fail_together``), and the messages
only when a rank failed. A single-process run calls no collective at all."""

import multiprocessing
import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import arithmetic_prompts, free_port, length_reward

from grpotrl import GRPOConfig, GRPOTrainer
from grpotrl.errors import InvariantError

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "barrier",
               "reduce_scatter", "gather", "scatter")
CASES = {  # case -> (rank 1's fault, settings); every case runs one optimizer step of two microbatches per rank
    "I4_mask": ("mask", dict(guard_steps=1)),
    "I10_reference": ("reference", dict(guard_steps=1, beta=0.04)),
    "I7_sign": ("sign", dict(guard_steps=0, entropy_coef=0.01)),
    "I5_full_kl": ("full_kl", dict(guard_steps=1, beta=0.04, kl_estimator="full")),
    "passing_with_bonus": (None, dict(guard_steps=1, entropy_coef=0.01, max_steps=2)),
    "passing_no_bonus": (None, dict(guard_steps=1, max_steps=2)),
}


def settings(out: str, **overrides) -> GRPOConfig:
    kw = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_generations=4,
              max_completion_length=6, max_steps=1, logging_steps=1, report_to="none", use_cpu=True, beta=0.0,
              temperature=0.7, save_strategy="no", seed=0, health_action="off", health_report_steps=0,
              generation_kwargs={"sequence_bias": [[[0], 5.0], [[2], 5.0]]})
    return GRPOConfig(**{**kw, **overrides})


class Planted(GRPOTrainer):
    """The real trainer, with rank 1's fault (``fault``) planted in its microbatch (``mask``) or loss (``sign``);
    ``reference`` moves rank 1's reference weights at init."""

    def __init__(self, *args, fault: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fault = fault if dist.get_rank() == 1 else None
        if self.fault == "reference":
            with torch.no_grad():
                for p in self.ref_model.parameters():
                    p.add_(0.05 * torch.randn_like(p))

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if self.fault == "mask":  # row 0's first completion token out of the loss (I4: it is always in)
            mask = inputs["completion_mask"].clone()
            mask[0, 0] = 0
            inputs = {**inputs, "completion_mask": mask}
        return inputs

    def _full_kl_logits(self, model, inputs, hidden, logp, width):
        if self.fault == "full_kl":  # only the rebuilt-logits check sees it (I5): a 1-nat gap, before the KL reduce
            logp = logp + 1.0
        return super()._full_kl_logits(model, inputs, hidden, logp, width)

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if self.fault == "sign":  # d loss / d H moves by +0.5 / tokens: no longer -entropy_coef
            terms = self.hook_record.loss
            loss = loss + 0.5 * (terms.entropies * terms.mask).sum() / terms.mask.sum()
        return loss


def counted(calls: list) -> None:
    """``torch.distributed``'s collectives, each still run, recorded by name (a gather of one uint8 element as
    ``flag``, the agreement's gather of the messages, ``(invariant, message)`` or None, as ``message``)."""
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def wrapper(*a, _name=name, _real=real, **k):
            tensor = a[1] if _name == "all_gather" and len(a) > 1 else None
            flag = isinstance(tensor, torch.Tensor) and tensor.dtype == torch.uint8 and tensor.numel() == 1
            message = _name == "all_gather_object" and (a[1] is None or isinstance(a[1], tuple))  # TRL's are lists
            calls.append("flag" if flag else "message" if message else _name)
            return _real(*a, **k)

        setattr(dist, name, wrapper)


def join_group(rank: int, port: int, timeout_s: float) -> None:
    """This spawned process as rank ``rank`` of a 2-process gloo group on 127.0.0.1:``port``, each collective waiting
    at most ``timeout_s``; the environment says so too, so that accelerate runs CPU DDP on this group."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout_s))


def two_spawned_ranks(child, *args, timeout_s: float) -> dict:
    """rank -> what ``child(rank, port, *args, results)`` put on ``results``, run in two spawned processes (spawn, not
    fork: a process forked from the suite's, its threads and the locks they held at the fork, can hang before it
    reaches the group; each child imports torch and grpotrl afresh, a few seconds, in parallel); waits at most
    ``timeout_s`` for them, then kills what is left."""
    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=child, args=(rank, port, *args, results), daemon=True) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        return dict(results.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def child(rank: int, port: int, model: str, out: str, results) -> None:
    join_group(rank, port, timeout_s=20)
    calls: list = []
    counted(calls)
    got = {}
    for name, (fault, overrides) in CASES.items():  # the same order on both ranks
        calls.clear()
        try:
            trainer = Planted(model, reward_funcs=length_reward, args=settings(f"{out}/{name}", **overrides),
                              train_dataset=arithmetic_prompts(8), fault=fault)
            calls.clear()  # what the step calls, not the init
            trainer.train()
            got[name] = ("returned", None, list(calls))
        except InvariantError as e:
            got[name] = ("raised", e.invariant, str(e), list(calls))
        except Exception:  # noqa: BLE001 -- a collective that timed out, a wrong signature: the parent says which
            got[name] = ("error", traceback.format_exc(limit=4), list(calls))
    results.put((rank, got))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tiny_llama, tmp_path_factory) -> dict:
    """case -> (rank 0's outcome, rank 1's): ("returned", None, collectives) or ("raised", invariant, message,
    collectives)."""
    got = two_spawned_ranks(child, tiny_llama, str(tmp_path_factory.mktemp("grpo-ranks")), timeout_s=60)
    return {name: (got[0][name], got[1][name]) for name in CASES}


def stopped_together(outcomes, invariant: str) -> tuple[str, str]:
    """Both ranks raised ``invariant``: rank 1 its own error, rank 0 one naming rank 1 and quoting it."""
    (kind0, *rest0), (kind1, *rest1) = outcomes
    assert (kind0, kind1) == ("raised", "raised"), outcomes  # rank 0 must not walk on into the next collective
    (inv0, msg0, _), (inv1, msg1, _) = rest0, rest1
    assert inv0 == inv1 == invariant, (inv0, inv1)
    own = f"[{invariant}] on rank 1 (of 2 processes): "
    assert msg1.startswith(own), msg1
    assert msg0 == (f"[{invariant}] rank(s) 1 (of 2 processes) failed this check, so every rank stops here; rank 1's "
                    f"error: [{invariant}] {msg1.removeprefix(own)}"), msg0  # rank 1's message as its check raised it
    return msg0, msg1


def test_I4_a_completion_mask_wrong_on_one_rank_stops_every_rank_naming_it(two_ranks):
    _, msg = stopped_together(two_ranks["I4_mask"], "I4")
    assert "completion_mask is wrong at completion position 0" in msg, msg


def test_I10_a_reference_off_the_policy_on_one_rank_stops_every_rank_naming_it(two_ranks):
    stopped_together(two_ranks["I10_reference"], "I10")


def test_I5_full_kl_logits_wrong_on_one_rank_stop_every_rank_naming_it(two_ranks):
    """kl_estimator='full': its rebuilt-logits check fails on rank 1 before the KL's reduce, which rank 1 still
    reaches; every rank stops at the agreement."""
    _, msg = stopped_together(two_ranks["I5_full_kl"], "I5")
    assert "kl_estimator='full' rebuilt the policy's logits" in msg, msg


def test_I7_an_entropy_sign_wrong_on_one_rank_stops_every_rank_naming_it(two_ranks):
    """I7 off guard steps (``guard_steps=0``): with a bonus configured the sign check still decides on every rank."""
    _, msg = stopped_together(two_ranks["I7_sign"], "I7")
    assert "the GRPO loss: on the graph being backpropagated d loss / d H" in msg, msg


def test_every_rank_gathers_one_flag_per_microbatch_and_no_message_when_every_guard_passes(two_ranks):
    """Two optimizer steps of two microbatches, guards due on the first: with an entropy bonus one flag per
    microbatch (4), without one on the guard step's only (2); no message is gathered where no rank failed."""
    for name, flags in (("passing_with_bonus", 4), ("passing_no_bonus", 2)):
        for kind, _, calls in two_ranks[name]:
            assert kind == "returned", two_ranks[name]
            assert calls.count("flag") == flags and "message" not in calls, (name, calls)


def test_a_failing_rank_costs_one_message_gather_besides_the_flags(two_ranks):
    """The I7 case fails on step 0's first microbatch: one flag, then one all_gather_object of the messages."""
    for outcome in two_ranks["I7_sign"]:
        calls = outcome[-1]
        assert calls.count("flag") == 1 and calls.count("message") == 1, calls


def test_a_single_process_run_with_guards_and_a_bonus_calls_no_collective(tiny_llama, tmp_path, monkeypatch):
    calls = []
    for name in COLLECTIVES:
        monkeypatch.setattr(dist, name, lambda *a, _name=name, **k: calls.append(_name))
    trainer = GRPOTrainer(tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(8),
                          args=settings(str(tmp_path / "out"), guard_steps=1, entropy_coef=0.01, beta=0.04))
    trainer.train()
    assert any("guards/logprob_max_gap" in h for h in trainer.state.log_history)  # the guards ran
    assert calls == []
