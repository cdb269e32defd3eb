"""Every rank stops at one guard's failure (``guards.ranks``: ``decided_together``, ``caught``, ``fail_together``,
``agreed_error``), in one process and with the agreement itself replaced by a recorder. A real 2-process group runs in
tests/trainers/test_grpo_ranks.py and test_multitask_ranks.py."""

import pytest
from test_multitask_ranks import collective_calls  # noqa: F401 -- the fixture: every collective called, by name

from grpotrl.errors import InvariantError
from grpotrl.guards import ranks


def test_one_process_raises_the_failure_itself_at_once_and_gathers_nothing(collective_calls):
    first, ran = InvariantError("I5", "row 3"), []
    with pytest.raises(InvariantError) as raised:
        with ranks.decided_together(True):
            with ranks.caught():
                raise first
            ran.append("after")  # not reached: nothing to agree with, the check raises where it failed
    assert raised.value is first and str(raised.value) == "[I5] row 3" and ran == []
    ranks.fail_together(None)
    assert collective_calls == []


@pytest.fixture
def two_processes(monkeypatch) -> list:
    """``world_size`` 2, and ``fail_together`` recording what it was handed."""
    agreed = []
    monkeypatch.setattr(ranks, "world_size", lambda: 2)
    monkeypatch.setattr(ranks, "fail_together", lambda failure, device=None: agreed.append(failure))
    return agreed


def test_a_deferring_section_keeps_the_first_failure_runs_on_and_agrees_once(two_processes):
    first, ran = InvariantError("I4", "row 0"), []
    with ranks.decided_together(True):
        with ranks.caught():
            raise first
        ran.append("the collectives after the check")
        with ranks.decided_together(True):  # a nested section joins the outer one
            with ranks.caught():
                raise InvariantError("I5", "row 1")
        ran.append("end")
    assert ran == ["the collectives after the check", "end"] and two_processes == [first]


def test_a_section_where_no_rank_agrees_raises_at_once(two_processes):
    with pytest.raises(InvariantError, match=r"\[I7\] sign"):
        with ranks.decided_together(False):
            with ranks.caught():
                raise InvariantError("I7", "sign")
    assert two_processes == []


def test_an_error_that_is_no_invariant_error_propagates_without_agreement(two_processes):
    with pytest.raises(ValueError, match="shape"):
        with ranks.decided_together(True):
            with ranks.caught():
                raise ValueError("shape")
    assert two_processes == []


def test_a_failure_held_when_another_error_leaves_the_section_goes_with_it(two_processes):
    """A caught I4, then an error raised outside ``caught()`` on the same rank (a check decided on every rank's values,
    a crash): the section is left unagreed, and the I4 is not lost: it is a note of the error that left."""
    with pytest.raises(ValueError, match="later") as raised:
        with ranks.decided_together(True):
            with ranks.caught():
                raise InvariantError("I4", "row 0 mask")
            raise ValueError("later, on this rank only")
    assert two_processes == []
    assert any("[I4] row 0 mask" in note for note in getattr(raised.value, "__notes__", []))


def test_every_failing_rank_is_named_and_the_first_ones_message_quoted():
    failures = [None, ("I10", "[I10] ref differs"), ("I4", "[I4] mask")]
    assert str(ranks.agreed_error(0, failures)) == ("[I10] rank(s) 1, 2 (of 3 processes) failed this check, so every "
                                                    "rank stops here; rank 1's error: [I10] ref differs")
    assert str(ranks.agreed_error(2, failures)) == "[I4] on rank 2 (of 3 processes; rank(s) 1 failed too): mask"
