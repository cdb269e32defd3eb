"""Reward functions that return +-inf, named in the tests' recipes by dotted path (tests/ is on
PYTHONPATH), as a user's buggy reward module would be."""

import math


def inf_every_fourth(completions, **kwargs) -> list[float]:
    """inf on rows 0, 4, 8, ... -- with num_generations 4 one row of every group -- and the
    completion's length in characters / 10 elsewhere (finite, different within a group)."""
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
    return [math.inf if i % 4 == 0 else len(t) / 10 for i, t in enumerate(texts)]
