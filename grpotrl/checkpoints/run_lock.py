"""One run per ``output_dir``: an OS lock on ``output_dir/_grpotrl.lock``, taken before anything
is written (the CLI: before the model loads; the Python API: at ``trainer.train()``), held until
``trainer.end()``, until ``trainer.train()`` raises (a health stop, a full disk, Ctrl-C: the run is over,
and the resume a ``HealthStop`` invites may come from another process), or until the process exits.

Two runs into one ``output_dir`` would write each other's checkpoints and final model, and both
would report success. The second one is refused instead, with an ``InputError`` naming the
first (pid, host, start time, command), which the lock file holds.

* The lock is ``fcntl.flock`` on the file, taken without waiting. The kernel releases it when its
  process dies (SIGKILL, OOM kill, a crash), so a lock file left by a dead run is no reason to
  refuse: the next run locks it again. The file is removed on a normal release; one left by a
  killed run is ignored by the output-dir checks (``checkpoints``) and by resume.
* Under ``accelerate launch`` only the main process takes the lock; it sends the outcome to the
  other ranks (``broadcast_object_list``), so every rank proceeds or raises the same error.
* A process that holds the lock takes it again as a no-op: the CLI takes it, then ``train()``.
* Where the file system has no ``flock`` (Lustre mounted without ``-o flock``, some FUSE mounts),
  the run goes on unlocked with a warning. NFS has it (the kernel maps it to NFS byte-range locks),
  unless mounted ``nolock``, where the lock is seen by processes on the same host only.

Which run the ``checkpoint-N`` dirs of an ``output_dir`` belong to (``GrpotrlRun``, added by ``add_run_record``):
a run that starts afresh into a used ``output_dir`` (``overwrite_output_dir``, or the Python API into a dir
holding checkpoints only) leaves the earlier run's checkpoints where they are, and ``resume_from_checkpoint:
true`` must not take one of them for its own.

* Each run has an id. When it starts training (``on_train_begin``) it writes ``output_dir/_grpotrl_run.json``
  (``RUN_FILE``: the id and the time the run first wrote there; ``_*``, which push_to_hub leaves out). A run
  resumed from a checkpoint continues that checkpoint's run and keeps its id; any other run gets a new one.
* Every checkpoint it saves carries the id in ``trainer_state.json`` (``stateful_callbacks``, what the
  Trainer writes last), with the number of processes that saved it (each saves its ``rng_state_<rank>.pth``)
  and, with ``save_on_each_node``, the ranks whose RNG files the directory holds: every process writes its own
  into its machine's ``output_dir``, so each machine's copy holds the ranks that run on that machine.
* ``checkpoint_record`` reads that record back; ``read_run_file`` the run file (``checkpoints`` decides).
* A full disk while the lock file or the run file is written: the lock is given back (a refusal naming the lock
  file) and no temporary file is left behind.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import socket
import sys
import time
import uuid

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..errors import InputError
from ..models.sources import LOCK_FILE

logger = logging.getLogger(__name__)

_CONTENTION = {errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES}
# output_dir (its real path) -> this process's lock fd; None: the main rank holds it, or it cannot be locked
_held: dict[str, int | None] = {}


def lock_output_dir(path: str, process_index: int = 0, num_processes: int = 1) -> bool:
    """Make this run the only one writing into ``path`` (created if missing), or raise ``InputError``
    naming the run that holds it. ``process_index`` / ``num_processes``: this rank and the world
    size under a multi-process launch (rank 0 decides, the others receive its outcome). Returns
    whether this call took it (False: this process held it already), so that a caller whose own
    checks then refuse the run can release it and leave ``output_dir`` as it found it."""
    directory = os.path.realpath(os.path.expanduser(path))
    if directory in _held:  # this process took it already (the CLI, then train()), on every rank alike
        return False
    outcome = _take(path, directory) if process_index == 0 else None
    if num_processes > 1:
        from accelerate.utils import broadcast_object_list

        box = [outcome]
        broadcast_object_list(box, from_process=0)
        outcome = box[0]
    if outcome is not None:
        raise InputError(outcome)
    _held.setdefault(directory, None)
    return True


def release_output_dir(path: str) -> None:
    """Release the lock this process holds on ``path`` (a no-op when it holds none): remove the
    file, then unlock. A run that locked the old file in between sees it unlinked and retries."""
    fd = _held.pop(os.path.realpath(os.path.expanduser(path)), None)
    if fd is not None:
        lock_file = os.path.join(os.path.realpath(os.path.expanduser(path)), LOCK_FILE)
        try:
            if os.stat(lock_file).st_ino == os.fstat(fd).st_ino:
                os.unlink(lock_file)
        except OSError:
            pass
        os.close(fd)  # closing the last descriptor releases the flock


@atexit.register
def _release_all() -> None:
    """At exit, remove the lock files this process holds (the kernel would release the locks anyway)."""
    for directory in list(_held):
        release_output_dir(directory)


def _take(path: str, directory: str) -> str | None:
    """Lock ``directory`` for this process: None when locked (or unlockable, with a warning), else
    the refusal's message. Never raises, so that the other ranks always hear the outcome."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        fcntl = None
    if os.path.exists(directory) and not os.path.isdir(directory):
        return f"output_dir {path!r} is a file, not a directory. Point output_dir at a new directory."
    lock_file = os.path.join(directory, LOCK_FILE)
    for _ in range(10):  # a retry only when the file was replaced between open and lock
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            return f"output_dir {path!r} cannot be created or written: {err}. Fix its permissions or choose another."
        try:
            if fcntl is None:
                raise OSError(errno.ENOSYS, "no fcntl on this system")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in _CONTENTION:
                return _refusal(path, lock_file)
            logger.warning("Could not lock output_dir %s (%s): this file system has no flock, so a second run into "
                           "the same output_dir would not be refused. Do not start two runs into it.", path, err)
            _held[directory] = None
            return None
        try:
            same = os.fstat(fd).st_nlink > 0 and os.stat(lock_file).st_ino == os.fstat(fd).st_ino
        except OSError:
            same = False
        if not same:  # the holder released and removed it between our open and flock: lock the new file
            os.close(fd)
            continue
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                 "command": _command(sys.argv)}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(owner).encode(), 0)
        except OSError as err:  # a full disk, a quota: give the lock back, or this process would refuse itself
            try:
                os.unlink(lock_file)  # ours: locked, and checked to be the file at this path
            except OSError:
                pass
            os.close(fd)
            return (f"output_dir {path!r}: cannot write the run lock {lock_file}: {err}. Nothing else was written; "
                    "free space (or fix the quota) there, or choose another output_dir.")
        _held[directory] = fd
        return None
    return _refusal(path, lock_file)


def _command(argv: list[str]) -> str:
    """The program and its subcommand (``grpotrl grpo``, ``grpo.py``), never its arguments: a command
    line may hold a secret (``--hub_token``), and the lock file is written into ``output_dir``.

    >>> _command(["/venv/bin/grpotrl", "grpo", "--hub_token", "hf_secret"]), _command(["grpo.py", "--hub_token=x"])
    ('grpotrl grpo', 'grpo.py')
    """
    words = [os.path.basename(argv[0]) if argv else "python"]
    if len(argv) > 1 and argv[1].isidentifier():
        words.append(argv[1])
    return " ".join(words)


def _refusal(path: str, lock_file: str) -> str:
    try:
        with open(lock_file) as f:
            owner = json.load(f)
        who = (f"pid {owner.get('pid')} on host {owner.get('host')}, started {owner.get('started')} "
               f"({owner.get('command')})")
    except (OSError, ValueError, AttributeError):
        who = "a process that has not written its name yet"
    return (f"output_dir {path!r} is in use by another run: {who}. Two runs into one output_dir would overwrite "
            f"each other's checkpoints and final model. Wait for that run to end (or stop it), or choose another "
            f"output_dir. The lock ({lock_file}) is released when that process exits.")


# ---------------------------------------------------------------------------------------------
# Which run a checkpoint belongs to
# ---------------------------------------------------------------------------------------------

RUN_FILE = "_grpotrl_run.json"


class GrpotrlRun(TrainerCallback, ExportableState):
    """The run's id and the number of processes that save its checkpoints, in every checkpoint's
    ``trainer_state.json`` (``stateful_callbacks["GrpotrlRun"]``, an ``ExportableState``: the Trainer writes
    ``state()`` at each save), and the id in ``output_dir/RUN_FILE``. The constructor's arguments are the
    state's attributes, so that ``restore_callback_states_from_checkpoint`` can rebuild it."""

    def __init__(self, run: str | None = None, processes: int | None = None, save_on_each_node: bool = False,
                 node_ranks: list[int] | None = None):
        self.run, self.processes, self.save_on_each_node = run, processes, save_on_each_node
        self.node_ranks = node_ranks

    def state(self) -> dict:
        return {"args": {}, "attributes": {"run": self.run, "processes": self.processes,
                                           "save_on_each_node": self.save_on_each_node, "node_ranks": self.node_ranks}}

    def on_train_begin(self, args, state, control, **kwargs):
        """Take the id of the checkpoint this ``train()`` resumed (its state is loaded by now: ``global_step``
        > 0), else a new one, the same on every process; record it in the state the Trainer saves (also when
        the resumed checkpoint had no record: the Trainer's save looks the entry up), and in ``RUN_FILE``."""
        saved = _attributes(state.stateful_callbacks.get(type(self).__name__)) if state.global_step > 0 else None
        run = saved["run"] if saved else None
        if run is None:
            run = uuid.uuid4().hex[:12]
            if args.world_size > 1:  # every process must record the main process's id
                from accelerate.utils import broadcast_object_list

                box = [run]
                broadcast_object_list(box, from_process=0)
                run = box[0]
        self.run, self.processes, self.save_on_each_node = run, args.world_size, bool(args.save_on_each_node)
        self.node_ranks = host_ranks(args.process_index) if self.save_on_each_node and args.world_size > 1 else None
        state.stateful_callbacks[type(self).__name__] = self.state()
        if args.should_save:
            _write_run_file(args.output_dir, run)


def host_ranks(process_index: int) -> list[int]:
    """The ranks that run on this process's machine (its host name), this one among them: the processes whose
    ``rng_state_<rank>.pth`` land in this machine's ``output_dir`` under ``save_on_each_node``. A collective: every
    process calls it."""
    from accelerate.utils import gather_object

    hosts = gather_object([(process_index, socket.gethostname())])  # [(rank, host)] of every process
    here = dict(hosts)[process_index]
    return sorted(rank for rank, host in hosts if host == here)


def add_run_record(trainer) -> None:
    """Add ``GrpotrlRun`` to ``trainer`` unless it has one."""
    if not any(isinstance(cb, GrpotrlRun) for cb in trainer.callback_handler.callbacks):
        trainer.add_callback(GrpotrlRun())


def _attributes(entry) -> dict | None:
    """A ``GrpotrlRun`` state's attributes (the first, were there several), or None when it is not one."""
    entry = entry[0] if isinstance(entry, list) and entry else entry
    attributes = entry.get("attributes") if isinstance(entry, dict) else None
    if not isinstance(attributes, dict) or not isinstance(attributes.get("run"), str):
        return None
    return attributes


def checkpoint_record(checkpoint: str) -> dict | None:
    """What the run that saved ``checkpoint`` recorded in its ``trainer_state.json``: ``run`` (its id),
    ``processes`` (how many saved it), ``save_on_each_node`` and then ``node_ranks`` (the ranks that saved into
    this machine's copy; absent from older records); None when there is no record (plain TRL or
    transformers, or no readable ``trainer_state.json``: a save cut short)."""
    try:
        with open(os.path.join(checkpoint, "trainer_state.json")) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None
    callbacks = state.get("stateful_callbacks") if isinstance(state, dict) else None
    return _attributes(callbacks.get(GrpotrlRun.__name__)) if isinstance(callbacks, dict) else None


def read_run_file(output_dir: str) -> dict | None:
    """``output_dir/RUN_FILE``: ``{"run": id, "since": the time (s since the epoch) that run first wrote
    there}``, or None when no grpotrl run has trained there. ``InputError`` when it cannot be read."""
    path = os.path.join(os.path.expanduser(output_dir), RUN_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            run = json.load(f)
    except (OSError, ValueError) as err:
        run = err
    if not (isinstance(run, dict) and isinstance(run.get("run"), str) and isinstance(run.get("since"), (int, float))):
        raise InputError(
            f"{path} does not say which run the checkpoints in output_dir {output_dir!r} belong to (it holds "
            f"{run!r}, not {{'run': ..., 'since': ...}}), so resume_from_checkpoint: true cannot tell the current "
            "run's from an earlier one's. Name the checkpoint to resume (--resume_from_checkpoint "
            "PATH/checkpoint-N), or delete that file to resume the highest checkpoint-N there."
        )
    return run


def _write_run_file(output_dir: str, run: str) -> None:
    """Write ``RUN_FILE`` naming ``run``: its ``since`` kept when the file names that run already (a resume),
    else now. Written whole or not at all (a temporary file, then renamed); a failed write (a full disk) removes
    the temporary file and raises an ``OSError`` naming ``RUN_FILE``."""
    directory = os.path.realpath(os.path.expanduser(output_dir))
    try:
        since = read_run_file(directory)
    except InputError:  # unreadable: this run's record replaces it
        since = None
    since = since["since"] if since and since["run"] == run else time.time()
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(directory, f"{RUN_FILE}.{os.getpid()}")
    try:
        with open(temporary, "w") as f:
            json.dump({"run": run, "since": since, "started": time.strftime("%Y-%m-%d %H:%M:%S %z",
                                                                            time.localtime(since))}, f)
        os.replace(temporary, os.path.join(directory, RUN_FILE))
    except OSError as err:  # a full disk: no half-written file left behind (the CLI would count it as the user's)
        try:
            os.remove(temporary)
        except OSError:
            pass
        raise OSError(err.errno, err.strerror, os.path.join(directory, RUN_FILE)) from err
