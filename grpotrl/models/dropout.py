"""The dropout a model samples in training mode: its ``nn.Dropout`` layers and the dropout numbers that modules
hand to the attention function or to ``nn.functional.dropout`` themselves (``DROPOUT_ATTRIBUTES``: Llama-style
attention's ``attention_dropout``; the ``dropout`` of OPT, BioGPT and Bart-style attention and decoder layers).
TRL's ``disable_dropout`` zeroes the layers only, so a model whose config sets such a number kept sampling masks
under ``disable_dropout=True``."""

from __future__ import annotations

from torch import nn


# float attributes a module passes as a dropout probability itself, each sampled in training mode only
DROPOUT_ATTRIBUTES = ("attention_dropout", "dropout", "dropout_p", "dropout_prob", "attn_dropout")


def _probability(module: nn.Module, name: str) -> float:
    """``module``'s own number ``name`` (0.0 where it has none, or that attribute is not a number)."""
    p = getattr(module, name, None)
    return float(p) if isinstance(p, (int, float)) and not isinstance(p, bool) else 0.0


def attention_dropout(module: nn.Module) -> float:
    """``module``'s own ``attention_dropout`` number (0.0 where it has none)."""
    return _probability(module, "attention_dropout")


def dropout_numbers(module: nn.Module) -> dict[str, float]:
    """``module``'s own dropout probabilities above 0, by attribute name (``DROPOUT_ATTRIBUTES``; not a child
    ``nn.Dropout`` layer's ``p``)."""
    return {name: p for name in DROPOUT_ATTRIBUTES if (p := _probability(module, name)) > 0}


def drops(module: nn.Module) -> bool:
    """Whether ``module`` itself drops anything in training mode: a dropout layer with ``p > 0``, or a dropout
    number of its own above 0 (``dropout_numbers``).

    >>> drops(nn.Dropout(0.1)), drops(nn.Dropout(0.0)), drops(nn.Linear(2, 2))
    (True, False, False)
    """
    return (isinstance(module, nn.Dropout) and module.p > 0) or bool(dropout_numbers(module))


def has_dropout(model: nn.Module) -> bool:
    """Whether ``model`` (or any DDP/DeepSpeed wrapper around it) holds dropout that its training mode samples."""
    return any(drops(m) for m in model.modules())


def disable_dropout(model: nn.Module) -> None:
    """Every dropout of ``model`` to 0: its ``nn.Dropout`` layers and its modules' own dropout numbers
    (``dropout_numbers``; this changes ``model``; its config, which a checkpoint saves, keeps the user's values).

    >>> class Attention(nn.Module):
    ...     attention_dropout = 0.1
    >>> class DecoderLayer(nn.Module):  # OPT's: nn.functional.dropout(x, p=self.dropout, training=self.training)
    ...     dropout = 0.1
    >>> m = nn.Sequential(nn.Dropout(0.2), Attention(), DecoderLayer())
    >>> disable_dropout(m); has_dropout(m)
    False
    """
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for name in dropout_numbers(m):
            setattr(m, name, 0.0)
