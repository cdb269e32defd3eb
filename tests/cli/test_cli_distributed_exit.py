"""A process that trained under a process group gives torch's collective threads a pause at interpreter exit
(``trainers._common.settle_collectives_at_exit``, registered by ``train()``), however it exits: after its last
line, or with the CLI's exit code after a stop, or on an uncaught exception; a process without a process group
exits without it. The SIGABRT the pause prevents is a race (a gloo thread freeing a finished all-reduce during
interpreter shutdown: tests/test_distributed.py's launches exit through it); these tests run real processes
with a real gloo group and read the handler's own log line, written after the script's last output."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import logging, sys
    import torch, torch.distributed as dist
    import grpotrl.cli as cli
    from grpotrl.errors import HealthStop
    from grpotrl.trainers._common import settle_collectives_at_exit

    logging.getLogger("grpotrl.trainers._common").setLevel(logging.DEBUG)  # shown by the CLI's grpotrl handler
    group, ending = sys.argv[1] == "group", sys.argv[2]
    if group:
        dist.init_process_group("gloo", init_method="file://" + sys.argv[3], rank=0, world_size=1)

    def run(command, argv):  # the trainer's train(), as far as the pause goes: registers it, runs a collective
        if dist.is_initialized():
            settle_collectives_at_exit()
            total = torch.ones(4)
            dist.all_reduce(total)
        if ending == "health-stop":
            raise HealthStop("non_finite", 3, "loss is NaN")
        if ending == "bug":
            raise RuntimeError("a bug")

    cli.run = run
    try:
        cli.main(["grpo", "--config", "recipe.yaml"])
    finally:
        print("LAST LINE", flush=True)
""")
PAUSE = "for torch's collective threads to free their last work before exit"


def exit_of(tmp_path, group: bool, ending: str) -> tuple[int, list[str]]:
    (tmp_path / "script.py").write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(tmp_path / "script.py"), "group" if group else "none", ending,
                           str(tmp_path / "store")], capture_output=True, text=True, timeout=120)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "LAST LINE" in line or PAUSE in line]
    return done.returncode, lines


@pytest.mark.parametrize("ending, code", [("finished", 0), ("health-stop", 3), ("bug", 1)])
def test_a_process_that_trained_under_a_process_group_pauses_at_exit_however_it_ends(tmp_path, ending, code):
    returncode, lines = exit_of(tmp_path, True, ending)
    assert returncode == code
    assert lines[0] == "LAST LINE" and len(lines) == 2 and PAUSE in lines[1]  # once, after everything else


def test_a_process_without_a_process_group_exits_without_the_pause(tmp_path):
    returncode, lines = exit_of(tmp_path, False, "health-stop")
    assert returncode == 3 and lines == ["LAST LINE"]
