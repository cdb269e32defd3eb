"""``grpotrl.rewards.tasks``: per-task reward functions, each called on its task's rows only."""

import pytest

from grpotrl.rewards import tasks


@pytest.mark.parametrize("returned", [None, 0.5, "1.0", {"a": 1.0}])
def test_a_per_task_reward_that_returns_no_list_names_itself_and_its_task(returned):
    """A per-task reward function returning None (a forgotten ``return``) or one number raised a bare
    ``TypeError: 'NoneType' object is not iterable`` from inside the wrapper; it now names the function, its task
    and what a reward function returns. A list of one value per row, None among them, is taken as before."""
    def forgetful(prompts, completions, **kwargs):
        return returned

    def fine(prompts, completions, **kwargs):
        return [1.0, None][:len(completions)]

    wrapped, ok = tasks.per_task({"math": [forgetful, fine]}, "task")
    batch = dict(prompts=["p", "q", "r"], completions=["a", "b", "c"], task=["math", "code", "math"])
    with pytest.raises(ValueError, match=r"reward math/forgetful returned .* for 2 rows of task 'math': a reward "
                                         r"function returns a list with one float \(or None"):
        wrapped(**batch)
    assert ok(**batch) == [1.0, None, None]
