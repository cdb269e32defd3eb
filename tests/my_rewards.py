"""A user's own reward module, named in recipes by dotted path (``my_rewards.short_answer``) the
way ``trl grpo`` takes ``my_lib.rewards.custom_reward``; tests put tests/ on PYTHONPATH."""


def short_answer(completions, answer, **kwargs) -> list[float]:
    """1.0 for a completion no longer than its reference answer plus 4 characters, else 0.0."""
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
    return [float(len(t.strip()) <= len(a) + 4) for t, a in zip(texts, answer)]
