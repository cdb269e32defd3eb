"""grpotrl: TRL trainers whose token-level guarantees (INVARIANTS I1-I12) are checked at run time.

Swap ``from trl import GRPOTrainer, GRPOConfig`` for ``from grpotrl import GRPOTrainer,
GRPOConfig``; nothing else changes.
"""

from ._quiet import silence_known_import_noise
from ._threads import apply_cpu_thread_defaults

apply_cpu_thread_defaults()
silence_known_import_noise()  # before TRL imports bitsandbytes (through transformers and PEFT)

from .configs import GADConfig, GRPOConfig, SFTConfig  # noqa: E402
from .errors import HealthStop, InputError, InvariantError  # noqa: E402
from .trainers.grpo import GRPOTrainer  # noqa: E402
from .trainers.gad import GADTrainer  # noqa: E402
from .trainers.multitask import MultiTaskGRPOTrainer  # noqa: E402
from .trainers.sft import SFTTrainer  # noqa: E402

__version__ = "0.1.0"
__all__ = ["GRPOConfig", "SFTConfig", "GADConfig", "GRPOTrainer", "MultiTaskGRPOTrainer", "SFTTrainer", "GADTrainer",
           "InputError",
           "InvariantError", "HealthStop"]
