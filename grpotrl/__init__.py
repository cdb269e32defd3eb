"""grpotrl: TRL trainers whose token-level guarantees (INVARIANTS I1-I12) are checked at run time.

Swap ``from trl import GRPOTrainer, GRPOConfig`` for ``from grpotrl import GRPOTrainer,
GRPOConfig``; nothing else changes.

``import grpotrl`` sets the CPU thread defaults (``_threads``: before torch is imported) and imports
nothing heavy: each export of ``__all__`` is imported from its module on first use (PEP 562
``__getattr__``), as is a subpackage named as an attribute (``grpotrl.guards``). So the ``grpotrl``
command answers Ctrl-C during its imports of torch, transformers and TRL with its own one line
(``grpotrl.cli.main``), and ``grpotrl report`` never imports them.
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING

from ._quiet import silence_known_import_noise
from ._threads import apply_cpu_thread_defaults

apply_cpu_thread_defaults()
silence_known_import_noise()  # before TRL imports bitsandbytes (through transformers and PEFT)

if TYPE_CHECKING:  # what static readers see (type checkers, the API reference); at run time ``__getattr__``
    from .configs import GADConfig, GRPOConfig, SFTConfig
    from .errors import HealthStop, InputError, InvariantError
    from .trainers.gad import GADTrainer
    from .trainers.grpo import GRPOTrainer
    from .trainers.multitask import MultiTaskGRPOTrainer
    from .trainers.sft import SFTTrainer

__version__ = "0.1.0"
__all__ = ["GRPOConfig", "SFTConfig", "GADConfig", "GRPOTrainer", "MultiTaskGRPOTrainer", "SFTTrainer", "GADTrainer",
           "InputError",
           "InvariantError", "HealthStop"]
_HOMES = {"GRPOConfig": ".configs", "SFTConfig": ".configs", "GADConfig": ".configs", "GRPOTrainer": ".trainers.grpo",
          "MultiTaskGRPOTrainer": ".trainers.multitask", "SFTTrainer": ".trainers.sft", "GADTrainer": ".trainers.gad",
          "InputError": ".errors", "InvariantError": ".errors", "HealthStop": ".errors"}


def __getattr__(name: str):
    """An export of ``__all__``, imported from its module (``_HOMES``) the first time it is asked for, then a
    global like any other; or a subpackage of grpotrl (``grpotrl.guards``); anything else is an
    ``AttributeError``."""
    if name in _HOMES:
        value = globals()[name] = getattr(importlib.import_module(_HOMES[name], __name__), name)
        return value
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")  # sets the attribute, as `import grpotrl.x` does
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
