"""Every rank holds the same model (INVARIANTS.md I12), and every rank stops at one guard's failure.

TRL 1.14 shipped a fused loss that, under plain DDP, never all-reduced the gradients: each rank
stepped its own weights on its own data and nothing said so. After the first optimizer step and on
every guard step, ``RankAgreement`` (a ``TrainerCallback``) compares a checksum of the trainable
parameters across ranks with one small collective (an ``all_gather`` of ``[N, 4]`` float64 values,
N = the number of trainable parameter tensors) and stops naming the first parameter that differs.

What is compared, and what it proves:

* **Full replicas** (DDP, DeepSpeed ZeRO-0/1/2, any launch that keeps a whole copy per rank): per
  parameter the float64 sum and sum of ``|x|`` of this rank's copy, which must be **bitwise equal**
  on every rank. No tolerance is needed or given: the replicas start from one broadcast, every rank
  receives the same all-reduced gradient bits (a ring or tree all-reduce hands each rank the same
  result), and runs the same optimizer arithmetic on the same device type (ZeRO-1/2: each rank steps
  its fp32 partition and all-gathers the result, so every rank copies the same bits); a float64 sum of
  identical bits in identical order is identical. A rank that skipped the gradient all-reduce differs
  after one step by its own update (~ lr per element), which moves these sums; two copies that differ
  only by a permutation of equal-sum, equal-``|x|``-sum values would pass (no real failure does that).
* **ZeRO-3** (each element stored on exactly one rank, ``p.ds_tensor``): stored shards have no
  replicas that could drift apart, so the skipped-reduce bug leaves one (wrong) model rather than
  several. What can differ is what a rank computes with. Each rank gathers each parameter
  (``deepspeed.zero.GatheredParameters``) and sums it; the check proves that (a) every rank gathered
  the same bits (bitwise, as above) and (b) the gathered parameter is the union of the shards the
  ranks hold: the sum over ranks of each shard's sum equals the gathered sum to float64 rounding of
  two summation orders (``ZERO3_RTOL`` x sum of ``|x|``). It does not prove that the shards were
  updated with all-reduced gradients (under ZeRO-3 that reduce-scatter is DeepSpeed's own, not a
  loss's). A gather per parameter tensor: slower than the replica case, on guard steps only.
* Not compared: FSDP (DTensor shards; the callback is not added), frozen parameters, buffers.

Every rank stops at one guard's failure (``decided_together``, ``caught``, ``fail_together``): under DDP a guard
that fails on one rank and raises there alone leaves the others waiting in their next collective (DDP's buffer
broadcast or gradient all-reduce, the next gather) until the launcher kills them, with the reason printed by one
rank only. A section of checks that every rank runs at the same point instead keeps this rank's first
``InvariantError`` (``caught``) and, where it ends, decides on every rank's: one ``all_gather`` of a one-byte flag,
the messages only when some rank failed, and then every rank raises (``agreed_error``). In a single process
nothing is gathered and a failing check raises at once, unchanged.

Letters: N trainable parameter tensors, W ranks.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch
from transformers import TrainerCallback

from ..errors import InvariantError

CHUNK = 1 << 22  # elements summed at a time: float64 copies stay <= 32 MiB whatever the parameter's size
ZERO3_RTOL = 1e-9  # float64 rounding of two summation orders over <= 1e10 elements, relative to sum |x|


def tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """``[sum(x), sum(|x|)]`` of ``t`` in float64, ``[2]`` on ``t``'s device (chunked: no full float64 copy).

    >>> tensor_checksum(torch.tensor([1.0, -2.5, 0.25])).tolist()
    [-1.25, 3.75]
    """
    flat = t.detach().reshape(-1)
    out = torch.zeros(2, dtype=torch.float64, device=t.device)
    for chunk in flat.split(CHUNK):
        c = chunk.double()
        out += torch.stack([c.sum(), c.abs().sum()])
    return out


def trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def is_zero3(params) -> bool:
    return any(hasattr(p, "ds_id") and hasattr(p, "ds_tensor") for _, p in params)


def replica_checksums(params, device) -> torch.Tensor:
    """``[N, 4]``: each parameter's ``tensor_checksum`` twice (columns 2-3 mirror 0-1, so replicas and
    ZeRO-3 gather one shape)."""
    if not params:
        return torch.zeros(0, 4, dtype=torch.float64, device=device)
    sums = torch.stack([tensor_checksum(p).to(device) for _, p in params])  # [N, 2]
    return torch.cat([sums, sums], dim=1)  # [N, 4]


def zero3_checksums(params, device) -> torch.Tensor:
    """``[N, 4]``: per parameter, this rank's shard checksum (its valid part of ``ds_tensor``) and the
    gathered parameter's checksum. A collective per parameter: every rank calls it."""
    import deepspeed

    rows = []
    for _, p in params:
        shard = p.ds_tensor.reshape(-1)
        start = shard.numel() * torch.distributed.get_rank()
        valid = shard[: max(0, min(shard.numel(), p.ds_numel - start))]  # the last shards carry padding
        with deepspeed.zero.GatheredParameters([p]):
            full = tensor_checksum(p)
        rows.append(torch.cat([tensor_checksum(valid).to(device), full.to(device)]))
    return torch.stack(rows) if rows else torch.zeros(0, 4, dtype=torch.float64, device=device)


def gather_checksums(local: torch.Tensor) -> torch.Tensor:
    """``[W, N, 4]`` from each rank's ``[N, 4]``: the one collective."""
    parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, local.contiguous())
    return torch.stack(parts)


def check_ranks_agree(names: list[str], gathered: torch.Tensor, step: int, sharded: bool) -> None:
    """I12 on every rank's checksums ``gathered`` ``[W, N, 4]`` (``replica_checksums`` or
    ``zero3_checksums``, in ``names`` order): columns 2-3 (the copy each rank computes with) bitwise
    equal across ranks; when ``sharded`` (ZeRO-3), columns 0-1 summed over ranks equal rank 0's
    columns 2-3 within ``ZERO3_RTOL`` x sum |x|. Raises ``InvariantError`` naming the first parameter
    (in ``names`` order) that fails, with every rank's values. Changes nothing.

    >>> ok = torch.tensor([[[1.0, 2.0, 1.0, 2.0]], [[1.0, 2.0, 1.0, 2.0]]], dtype=torch.float64)  # W=2, N=1
    >>> check_ranks_agree(["w"], ok, step=1, sharded=False)
    """
    full = gathered[:, :, 2:]  # [W, N, 2]
    differs = (full != full[:1]).any(dim=2).any(dim=0)  # [N]
    shard_total = gathered[:, :, :2].sum(dim=0)  # [N, 2]
    off_shards = torch.zeros_like(differs)
    if sharded:
        tol = ZERO3_RTOL * full[0, :, 1].abs() + 1e-300  # [N]
        off_shards = ((shard_total - full[0]).abs() > tol[:, None]).any(dim=1)  # [N]
    bad = differs | off_shards  # [N]
    if not bool(bad.any()):
        return
    i = int(bad.nonzero()[0])
    per_rank = "; ".join(f"rank {r}: sum {float(full[r, i, 0])!r}, sum|x| {float(full[r, i, 1])!r}"
                         for r in range(full.size(0)))
    if bool(differs[i]):
        raise InvariantError(
            "I12",
            f"after optimizer step {step} the ranks hold different values of the trainable parameter "
            f"{names[i]!r} ({per_rank}); {int(differs.sum())} of {len(names)} parameters differ. Each rank is "
            "training its own model: the gradients were not all-reduced (a loss or training step that "
            "bypasses DDP's/DeepSpeed's backward, a `no_sync` that never ends, a custom optimizer step), or a "
            "rank changed its weights alone. Every update since the last agreeing step is suspect.")
    raise InvariantError(
        "I12",
        f"after optimizer step {step} the ZeRO-3 parameter {names[i]!r} that the ranks gather (sum "
        f"{float(full[0, i, 0])!r}) is not the sum of the shards they hold ({float(shard_total[i, 0])!r}, "
        f"allowed {ZERO3_RTOL} x sum|x|): a rank computes with a copy that is not DeepSpeed's partitions "
        "(a parameter kept outside the engine, or changed in place outside a gather).")


def checksum_due(guard_steps: int, global_step: int, first_update: int = 0) -> bool:
    """After the first optimizer step, and after every guard step (``guards.due`` of the step just
    finished); never with ``guard_steps == 0``. ``first_update``: the step at which the trained model's
    own updates begin (GAD's discriminator warmup changes none of the student's weights): its guard
    steps are checked too.

    >>> [checksum_due(2, s) for s in (1, 2, 3)], checksum_due(-1, 50), checksum_due(0, 1)
    ([True, True, False], True, False)
    >>> [s for s in range(1, 9) if checksum_due(2, s, first_update=5)]
    [1, 2, 6, 7]
    """
    if guard_steps == 0:
        return False
    return any(global_step == start + 1 or guard_steps < 0 or 0 <= global_step - 1 - start < guard_steps
               for start in {0, first_update})


class RankAgreement(TrainerCallback):
    """I12 at the end of each due optimizer step (``checksum_due``): gathers ``replica_checksums`` or
    (ZeRO-3) ``zero3_checksums`` of ``model``'s trainable parameters and runs ``check_ranks_agree``.
    ``compared`` keeps (step, N, sharded) of each check. Added only when there is more than one rank."""

    def __init__(self, trainer, guard_steps: int, first_update: int = 0):
        self.trainer, self.guard_steps, self.first_update = trainer, guard_steps, first_update
        self.compared: list[tuple[int, int, bool]] = []

    def on_step_end(self, args, state, control, **kwargs):
        if not checksum_due(self.guard_steps, state.global_step, self.first_update):
            return
        model = self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped)
        params = trainable(model)
        device = self.trainer.accelerator.device
        sharded = is_zero3(params)
        with torch.no_grad():
            local = zero3_checksums(params, device) if sharded else replica_checksums(params, device)
            check_ranks_agree([n for n, _ in params], gather_checksums(local), state.global_step, sharded)
        self.compared.append((state.global_step, len(params), sharded))


def add_rank_agreement(trainer, guard_steps: int, first_update: int = 0) -> None:
    """Adds ``RankAgreement`` to ``trainer`` when it runs on several ranks outside FSDP; a
    single-process run compares nothing and pays nothing. ``first_update``: ``checksum_due``'s."""
    acc = trainer.accelerator
    if acc.num_processes > 1 and guard_steps != 0 and not getattr(trainer, "is_fsdp_enabled", False) \
            and torch.distributed.is_initialized():
        trainer.add_callback(RankAgreement(trainer, guard_steps, first_update))


# ---------------------------------------------------------------- every rank stops at one guard's failure


def world_size() -> int:
    """The processes of the default process group; 1 without one."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agreed_error(rank: int, failures: list[tuple[str, str] | None]) -> InvariantError:
    """The error rank ``rank`` raises when some rank failed: ``failures[r]`` is rank r's ``(invariant, message)``
    (``str`` of its ``InvariantError``), None where its checks passed. A failing rank's own error, naming its rank and
    any other rank that failed too; a passing rank's, of the first failing rank's invariant, naming every failing
    rank and quoting the first one's message in full.

    >>> failed = [None, ("I5", "[I5] row 3")]
    >>> print(agreed_error(1, failed))
    [I5] on rank 1 (of 2 processes): row 3
    >>> print(agreed_error(0, failed))
    [I5] rank(s) 1 (of 2 processes) failed this check, so every rank stops here; rank 1's error: [I5] row 3
    >>> print(agreed_error(0, [("I10", "[I10] ref differs"), ("I4", "[I4] mask")]))
    [I10] on rank 0 (of 2 processes; rank(s) 1 failed too): ref differs
    """
    W, failed = len(failures), [r for r, f in enumerate(failures) if f is not None]
    own = failures[rank]
    if own is not None:
        invariant, message = own
        others = [r for r in failed if r != rank]
        also = f"; rank(s) {', '.join(map(str, others))} failed too" if others else ""
        body = message.removeprefix(f"[{invariant}] ")
        return InvariantError(invariant, f"on rank {rank} (of {W} processes{also}): {body}")
    invariant, message = failures[failed[0]]
    return InvariantError(invariant, f"rank(s) {', '.join(map(str, failed))} (of {W} processes) failed this check, "
                          f"so every rank stops here; rank {failed[0]}'s error: {message}")


def fail_together(failure: InvariantError | None, device=None) -> None:
    """Every rank calls this at the same point with its own ``failure`` (None where its checks passed); it returns
    on every rank or raises on every rank. In a single process it raises ``failure`` itself, unchanged, and gathers
    nothing. Under a process group: one ``all_gather`` of a ``[1]`` uint8 flag (on ``device``, the collective's: the
    accelerator's) and, only when some rank failed, one ``all_gather_object`` of the messages; then each rank raises
    ``agreed_error`` (a failing rank with its own error's traceback).

    >>> fail_together(None)
    >>> e = InvariantError("I5", "row 3")
    >>> try:
    ...     fail_together(e)
    ... except InvariantError as raised:
    ...     print(raised is e, raised)
    True [I5] row 3
    """
    W = world_size()
    if W == 1:
        if failure is not None:
            raise failure
        return
    flags = gather_checksums(torch.tensor([failure is not None], dtype=torch.uint8, device=device))  # [W, 1]
    if not bool(flags.any()):
        return
    failures: list = [None] * W
    torch.distributed.all_gather_object(failures, None if failure is None else (failure.invariant, str(failure)))
    error = agreed_error(torch.distributed.get_rank(), failures)
    raise error if failure is None else error.with_traceback(failure.__traceback__)


class Verdict:
    """The first ``InvariantError`` a ``decided_together`` section caught on this rank (``failure``), and whether
    the section defers it to one agreement at its end (``deferred``: several processes and the caller's condition)."""

    def __init__(self, deferred: bool):
        self.deferred, self.failure = deferred, None


_OPEN: ContextVar[Verdict | None] = ContextVar("grpotrl_open_verdict", default=None)


@contextlib.contextmanager
def decided_together(agree: bool, device=None):
    """A section of checks decided on every rank at its end: inside it, a check run in ``caught()`` that fails keeps
    its ``InvariantError`` (the first) and the section goes on, so that this rank reaches the same collectives as the
    others; a section that ends normally then calls ``fail_together`` (``device``: the collective's). ``agree`` must
    be equal on every rank (a config, the step, train or eval: never this rank's data), so that every rank reaches
    that agreement equally often; with ``agree`` False, or in a single process, nothing is deferred: a failing check
    raises at once, as outside a section. A section opened inside another joins the outer one (the outermost
    decides). An exception raised outside ``caught()`` (a check decided on every rank's values already, an error that
    is no ``InvariantError``) leaves the section at once and is not agreed on; a failure the section held by then
    goes with it as a note (``add_note``), not lost.

    >>> with decided_together(True):  # one process: the check raises at once
    ...     with caught():
    ...         raise InvariantError("I4", "row 0")
    Traceback (most recent call last):
    grpotrl.errors.InvariantError: [I4] row 0
    """
    if _OPEN.get() is not None:
        yield
        return
    verdict = Verdict(deferred=agree and world_size() > 1)
    token = _OPEN.set(verdict)
    try:
        yield
    except BaseException as raised:  # leaves the section unagreed: the failure it holds goes with it, as a note
        if verdict.failure is not None and verdict.failure is not raised:
            raised.add_note(f"grpotrl: before this, a check on this rank had failed: {verdict.failure}")
        raise
    finally:
        _OPEN.reset(token)
    if verdict.deferred:
        fail_together(verdict.failure, device)


@contextlib.contextmanager
def caught():
    """Around one check inside a deferring ``decided_together`` section: its ``InvariantError`` is kept for the
    section's agreement (the first one only) and the code after it runs on. Elsewhere the error propagates."""
    verdict = _OPEN.get()
    if verdict is None or not verdict.deferred:
        yield
        return
    try:
        yield
    except InvariantError as e:
        if verdict.failure is None:
            verdict.failure = e
