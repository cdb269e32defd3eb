"""The errors grpotrl raises on purpose.

``InputError``: bad input found before any model is loaded or compute is spent (what, which
value, what to do). ``InvariantError``: a guard of ``INVARIANTS.md`` saw the trainer's real
tensors break a guarantee; the message names the invariant and shows the offending sample.
``HealthStop``: a health rule set to stop (``grpotrl.health.callbacks``) stopped training after a
checkpoint was saved; the message names the rule, the values and the step.
"""


class InputError(ValueError):
    """Bad user input, caught before compute is spent."""


class InvariantError(RuntimeError):
    """A run-time guard found a broken guarantee (I1..I9)."""

    def __init__(self, invariant: str, message: str):
        self.invariant = invariant
        super().__init__(f"[{invariant}] {message}")


class HealthStop(RuntimeError):
    """Health rules stopped training; ``checkpoint`` holds the state they saved first: resumable, unless
    ``resumable`` is False (weights only: a model sharded at load time, whose optimizer state the
    Trainer cannot save); the message says which. ``rules``: the name of every rule that stopped on this
    step, in order (``rule`` given as one name or a sequence of names); ``rule``: them joined by ", "."""

    def __init__(self, rule: str | tuple[str, ...], step: int, message: str, checkpoint: str | None = None,
                 resumable: bool = True):
        self.rules = (rule,) if isinstance(rule, str) else tuple(rule)
        rule = ", ".join(self.rules)
        self.rule, self.step, self.checkpoint, self.resumable = rule, step, checkpoint, resumable
        how = ("resume_from_checkpoint works" if resumable else
               "weights only, no optimizer or RNG state: it cannot resume this run, only start a new one as "
               "model_name_or_path")
        where = f" Checkpoint saved to {checkpoint} ({how})." if checkpoint else ""
        super().__init__(f"[health: {rule}] step {step}: {message}{where}")


class DiskFullError(InputError):
    """A checkpoint or the final model could not be written: no space left on the device. The message
    names the file, the last complete checkpoint and what to do; the write's own error is the
    ``__cause__``. An ``InputError`` so the CLI prints it as one line: the fix (free space, another
    ``output_dir``) is the user's, as for bad input, though compute was spent."""
