"""The multi-task CAGrad checks decide on every rank's values, so that every rank reaches one verdict at the same
point: a NaN/inf task loss in the forward (``_check_losses_finite``), a task loss that reaches no parameter
(``_check_reached``) and I7's composed-update check (``_check_composed_update``, and the
``guards/bonus_alone_checked_share`` it logs). A rank that raised alone left the others waiting in their next
all-reduce until the launcher, or NCCL's timeout (10-30 min), killed them, with nothing said on those ranks.

A real 2-process gloo group on CPU (spawned, 127.0.0.1, a free port) calls the checks with rank-dependent inputs:
rank 1 fails, rank 0 passes, and both must raise the same error naming rank 1. Then the real trainer runs one CAGrad
step there under accelerate's CPU DDP with an entropy bonus hidden in rank 1's task loss (I7's per-task check,
``guards.check_slope`` in ``compute_loss``): both ranks stop, rank 1 with its own error, rank 0 naming rank 1 (the
agreement of ``GRPOTrainer``'s loss-side guards, tests/trainers/test_grpo_ranks.py). Every collective has a 15 s
timeout (the group's), and the parent waits at most 120 s for the children, so a rank left waiting fails the test
instead of hanging it. A single process makes no collective call."""

import math
import traceback

import pytest
import torch
import torch.distributed as dist
from test_grpo_ranks import join_group, settings, two_spawned_ranks

from grpotrl.errors import InvariantError
from grpotrl.trainers.multitask import MultiTaskGRPOTrainer, _check_losses_finite, _check_reached

NAMES = ["a", "b"]
COEF = 0.5
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "barrier",
               "reduce_scatter", "gather", "scatter")


class Stub:
    """What ``_check_composed_update`` reads of the trainer: the loss's entropies [1, 4] of one parameter's rows
    (``w`` [4, 5] as logits), the bonus mask, no loss scaler, the metrics it records. ``flipped``: the composition
    subtracts ``.grad`` (the sign error the check exists for)."""

    _check_composed_update = MultiTaskGRPOTrainer._check_composed_update
    _composed_update_unchecked = MultiTaskGRPOTrainer._composed_update_unchecked

    def __init__(self, w: torch.nn.Parameter, flipped: bool = False, bonus_on_no_token: bool = False):
        logp = w.log_softmax(-1)  # [4, 5]
        entropies = -(logp.exp() * logp).sum(-1)[None]  # [1, 4]
        mask = torch.zeros_like(entropies) if bonus_on_no_token else torch.ones_like(entropies)
        self.hook_record = type("Record", (), {"loss": type("Terms", (), {"entropies": entropies,
                                                                          "bonus_mask": mask})})
        self.accelerator = type("Accelerator", (), {"scaler": None, "device": torch.device("cpu")})
        self.state = type("State", (), {"global_step": 0})
        self._warned, self.logged, self.flipped = set(), {}, flipped

    def _record_metrics(self, metrics: dict, mode=None) -> None:
        for k, v in metrics.items():
            self.logged.setdefault(k, []).append(v)

    def _compose_update(self, params: list, direction: list) -> None:
        for p, d in zip(params, direction):
            p.grad = (-p.grad if self.flipped else p.grad) + d


LOGGED = {}  # the metrics the last composed-update check recorded, raised or not


def composed(rank: int, **kw) -> dict:
    torch.manual_seed(0)  # the same w on every rank
    w = torch.nn.Parameter(torch.randn(4, 5))
    stub = Stub(w, **kw)
    LOGGED.clear()
    stub.logged = LOGGED
    stub._check_composed_update([w], COEF)
    return dict(LOGGED)


CASES = {  # name -> what each rank calls; rank 1 is the one that fails
    "nan_task_loss": lambda rank: _check_losses_finite(
        torch.tensor([0.5, math.nan if rank else -0.2, math.nan if rank else 0.3]), NAMES, 3, "exact"),
    "finite_losses": lambda rank: _check_losses_finite(torch.tensor([0.5 + rank, -0.25, 0.125]), NAMES, 3, "exact"),
    "nan_regulariser": lambda rank: _check_losses_finite(
        torch.tensor([0.5, -0.25, math.inf if rank else 0.125]), NAMES, 3, "exact"),
    "unreached": lambda rank: _check_reached({0} if rank else set(), NAMES, "every trainable parameter",
                                             torch.device("cpu")),
    "composed_falls": lambda rank: composed(rank, flipped=rank == 1),
    "composed_zero_on_one_rank": lambda rank: composed(rank, bonus_on_no_token=rank == 1),
}


class TaskBonus(MultiTaskGRPOTrainer):
    """The real trainer, whose task loss (the first task present in the microbatch) carries ``-0.05 H`` on rank 1:
    CAGrad would rescale that bonus with the task's weight."""

    def _policy_terms(self, logps: dict, rows: dict, inputs: dict, entropy_mask):
        terms = super()._policy_terms(logps, rows, inputs, entropy_mask)
        if dist.get_rank() == 1:
            loss = self.hook_record.loss
            k = next(k for k, r in rows.items() if r.numel())
            terms[k] = terms[k] - 0.05 * (loss.entropies * loss.mask).sum() / loss.mask.sum()
        return terms


def task_bonus_on_rank_1(model: str, out: str) -> None:
    """One exact-CAGrad step, no guard due, with an entropy bonus configured (the per-task I7 check decides on every
    rank there too)."""
    from datasets import Dataset

    rows = [{"prompt": [{"role": "user", "content": f"Question {i}?"}], "task": task}
            for i in range(4) for task in ("fairness", "hallucination")]
    args = settings(out, cagrad="exact", guard_steps=0, entropy_coef=0.01, gradient_checkpointing=False)
    TaskBonus(model, reward_funcs={"fairness": rising, "hallucination": falling}, args=args,
              train_dataset=Dataset.from_list(rows)).train()


def child(rank: int, port: int, model: str, out: str, results) -> None:
    join_group(rank, port, timeout_s=15)
    out_dir, out = out, {}
    for name, case in CASES.items():  # the same order on both ranks
        LOGGED.clear()
        try:
            value = case(rank)
            out[name] = ("returned", value.tolist() if isinstance(value, torch.Tensor) else value)
        except InvariantError as e:
            out[name] = ("raised", str(e), dict(LOGGED))
        except Exception:  # noqa: BLE001 -- a wrong signature, a collective that timed out: the parent says which
            out[name] = ("error", traceback.format_exc(limit=3), None)
    try:  # last: a rank left waiting in it spoils no case before
        task_bonus_on_rank_1(model, f"{out_dir}/task_bonus")
        out["task_bonus"] = ("returned", None)
    except InvariantError as e:
        out["task_bonus"] = ("raised", str(e), e.invariant)
    except Exception:  # noqa: BLE001
        out["task_bonus"] = ("error", traceback.format_exc(limit=4), None)
    results.put((rank, out))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tiny_llama, tmp_path_factory) -> dict:
    """case -> (rank 0's outcome, rank 1's): ("returned", value) or ("raised", message, metrics logged first, or
    for ``task_bonus`` the invariant)."""
    got = two_spawned_ranks(child, tiny_llama, str(tmp_path_factory.mktemp("multitask-ranks")), timeout_s=120)
    return {name: (got[0][name], got[1][name]) for name in (*CASES, "task_bonus")}


def same_error_on_both(outcomes) -> str:
    (kind0, msg0, *_), (kind1, msg1, *_) = outcomes
    assert (kind0, kind1) == ("raised", "raised"), outcomes  # rank 0 must not walk on into the next collective
    assert msg0 == msg1
    return msg0


def test_a_nan_task_loss_on_one_rank_stops_every_rank_with_one_error_naming_the_rank(two_ranks):
    msg = same_error_on_both(two_ranks["nan_task_loss"])
    assert msg.startswith("[multi-task] step 3, cagrad='exact': the loss of task(s) 'b' (L = nan) on rank(s) 1 "
                          "(of 2 processes) is NaN/inf in the forward"), msg


def test_a_nan_regulariser_on_one_rank_stops_every_rank(two_ranks):
    msg = same_error_on_both(two_ranks["nan_regulariser"])
    assert "the regulariser (" in msg and "; inf on rank(s) 1 (of 2 processes)) is NaN/inf" in msg, msg


def test_finite_losses_pass_on_every_rank_and_return_every_ranks_values_in_rank_order(two_ranks):
    zero, one = two_ranks["finite_losses"]
    assert zero == one == ("returned", [[0.5, -0.25, 0.125], [1.5, -0.25, 0.125]])  # row r: rank r's


def test_a_task_loss_reaching_no_parameter_on_one_rank_stops_every_rank(two_ranks):
    msg = same_error_on_both(two_ranks["unreached"])
    assert msg.startswith("[multi-task] the policy loss of task 'a' has no gradient path to every trainable "
                          "parameter on rank(s) 1 (of 2 processes): "), msg


def test_I7_composed_update_lowering_entropy_on_one_rank_stops_every_rank(two_ranks):
    """I7: rank 1's composition subtracts the bonus's gradient (a rise of -c |dH/dtheta|^2 per lr), rank 0's adds
    it. Both stop, naming rank 1, after logging the same metrics."""
    outcomes = two_ranks["composed_falls"]
    msg = same_error_on_both(outcomes)
    assert msg.startswith("[I7] with the entropy bonus c=0.5 acting alone, the update the CAGrad exact path "
                          "applies on rank(s) 1 (of 2 processes) changes H by -"), msg
    assert outcomes[0][2] == outcomes[1][2] and outcomes[0][2]["guards/bonus_alone_checked_share"] == [1.0]


def test_I7_composed_update_metrics_are_every_ranks(two_ranks):
    """I7: the bonus acts on no token of rank 1's microbatch (unchecked there), rank 0's is checked: every rank
    logs the share of ranks checked, 0.5, and rank 0's rise, where rank 0 logged 1.0 and rank 1 0.0."""
    zero, one = two_ranks["composed_zero_on_one_rank"]
    assert zero == one, (zero, one)
    logged = zero[1]
    assert logged["guards/bonus_alone_checked_share"] == [0.5]
    assert len(logged["entropy/bonus_alone_dH_per_lr"]) == 1 and logged["entropy/bonus_alone_dH_per_lr"][0] > 0


def test_I7_an_entropy_bonus_in_a_task_loss_on_one_rank_stops_every_rank_naming_it(two_ranks):
    """I7: CAGrad rescales each task's loss, so none may carry the bonus; rank 1's does (``guards.check_slope`` in
    ``compute_loss``, between the loss values' all_gather and the gradient paths'). Rank 0, whose task losses pass,
    stops at the same point with the same invariant, naming rank 1 and quoting its error."""
    (kind0, msg0, inv0), (kind1, msg1, inv1) = two_ranks["task_bonus"]
    assert (kind0, kind1) == ("raised", "raised") and inv0 == inv1 == "I7", two_ranks["task_bonus"]
    own = "[I7] on rank 1 (of 2 processes): the policy loss of task "
    assert msg1.startswith(own) and "on the graph being backpropagated d loss / d H" in msg1, msg1
    assert msg0.startswith("[I7] rank(s) 1 (of 2 processes) failed this check, so every rank stops here; rank 1's "
                           "error: [I7] the policy loss of task "), msg0
    assert msg0.endswith(msg1.split(": ", 1)[1]), (msg0, msg1)


@pytest.fixture
def collective_calls(monkeypatch) -> list:
    """Every torch.distributed collective called, by name (none runs: each is replaced by a counter)."""
    calls = []
    for name in COLLECTIVES:
        monkeypatch.setattr(dist, name, lambda *a, _name=name, **k: calls.append(_name))
    return calls


@pytest.mark.parametrize("group", ["none", "world of 1"])
def test_a_single_process_makes_no_collective_call(group, collective_calls, monkeypatch):
    if group == "world of 1":  # a process group of one process, as a launch with one process may set up
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 1)
    assert _check_losses_finite(torch.tensor([0.5, -0.25, 0.125]), NAMES, 1, "exact").shape == (1, 3)
    with pytest.raises(InvariantError, match=r"the loss of task\(s\) 'b' \(L = nan\) is NaN/inf"):
        _check_losses_finite(torch.tensor([0.5, math.nan, math.nan]), NAMES, 1, "exact")
    _check_reached(set(), NAMES, "every trainable parameter", torch.device("cpu"))
    with pytest.raises(InvariantError, match=r"task 'a' has no gradient path to every trainable parameter: "):
        _check_reached({0}, NAMES, "every trainable parameter", torch.device("cpu"))
    logged = composed(0)
    assert logged["guards/bonus_alone_checked_share"] == [1.0] and logged["entropy/bonus_alone_dH_per_lr"][0] > 0
    with pytest.raises(InvariantError, match=r"I7.*applies changes H by -.*lowers entropy"):
        composed(0, flipped=True)
    assert collective_calls == []


def rising(completions, **kw):
    return [len(c[0]["content"]) / 10 for c in completions]


def falling(completions, **kw):
    return [-len(c[0]["content"]) / 10 for c in completions]


@pytest.mark.parametrize("mode", ["exact", "low_memory"])
def test_a_single_process_cagrad_step_makes_no_collective_call(mode, tiny_llama, grpo_args, collective_calls):
    """One CAGrad step on a guard step with KL and an entropy bonus, in one process: every check above runs (the
    loss values, the terms adding up, the gradient paths; in exact mode I7's composed update) and none calls a
    collective."""
    from datasets import Dataset

    rows = [{"prompt": [{"role": "user", "content": f"Question {i}?"}], "task": task}
            for i in range(4) for task in ("fairness", "hallucination")]
    args = grpo_args(cagrad=mode, beta=0.04, entropy_coef=0.01, max_steps=1, max_completion_length=4,
                     gradient_checkpointing=False, health_action="off", health_report_steps=0)
    trainer = MultiTaskGRPOTrainer(tiny_llama, reward_funcs={"fairness": rising, "hallucination": falling},
                                   args=args, train_dataset=Dataset.from_list(rows))
    trainer.train()
    logged = {k for h in trainer.state.log_history for k in h}
    assert "cagrad/deviation_from_sum" in logged
    assert ("guards/bonus_alone_checked_share" in logged) == (mode == "exact")
    assert collective_calls == []
