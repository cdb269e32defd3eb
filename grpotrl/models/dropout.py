"""The dropout a model samples in training mode: its ``nn.Dropout`` layers and the ``attention_dropout``
numbers that Llama-style attention modules hand to the attention function themselves (TRL's
``disable_dropout`` zeroes the layers only, so a model whose config sets ``attention_dropout`` kept
sampling masks under ``disable_dropout=True``)."""

from __future__ import annotations

from torch import nn


def attention_dropout(module: nn.Module) -> float:
    """``module``'s own ``attention_dropout`` number (0.0 where it has none)."""
    p = getattr(module, "attention_dropout", None)
    return float(p) if isinstance(p, (int, float)) and not isinstance(p, bool) else 0.0


def drops(module: nn.Module) -> bool:
    """Whether ``module`` itself drops anything in training mode: a dropout layer with ``p > 0``, or an
    attention module's ``attention_dropout`` above 0.

    >>> drops(nn.Dropout(0.1)), drops(nn.Dropout(0.0)), drops(nn.Linear(2, 2))
    (True, False, False)
    """
    return (isinstance(module, nn.Dropout) and module.p > 0) or attention_dropout(module) > 0


def has_dropout(model: nn.Module) -> bool:
    """Whether ``model`` (or any DDP/DeepSpeed wrapper around it) holds dropout that its training mode samples."""
    return any(drops(m) for m in model.modules())


def disable_dropout(model: nn.Module) -> None:
    """Every dropout of ``model`` to 0: its ``nn.Dropout`` layers and its attention modules' ``attention_dropout``
    (this changes ``model``; its config, which a checkpoint saves, keeps the user's values).

    >>> class Attention(nn.Module):
    ...     attention_dropout = 0.1
    >>> m = nn.Sequential(nn.Dropout(0.2), Attention())
    >>> disable_dropout(m); has_dropout(m)
    False
    """
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        elif attention_dropout(m) > 0:
            m.attention_dropout = 0.0
