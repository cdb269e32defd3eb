"""The two errors grpotrl raises on purpose.

``InputError``: bad input found before any model is loaded or compute is spent (what, which
value, what to do). ``InvariantError``: a guard of ``INVARIANTS.md`` saw the trainer's real
tensors break a guarantee; the message names the invariant and shows the offending sample.
"""


class InputError(ValueError):
    """Bad user input, caught before compute is spent."""


class InvariantError(RuntimeError):
    """A run-time guard found a broken guarantee (I1..I9)."""

    def __init__(self, invariant: str, message: str):
        self.invariant = invariant
        super().__init__(f"[{invariant}] {message}")
