"""One known-harmless message that ``import grpotrl`` would print, silenced by its logger.

``import grpotrl`` imports TRL, whose transformers imports PEFT (``transformers.trainer_utils``),
whose ``peft.helpers`` imports bitsandbytes when it is installed. On a CPU with AVX512-BF16 and
without the optional ``kernels`` package, bitsandbytes' CPU backend
(``bitsandbytes/backends/cpu/ops.py``, logger ``bitsandbytes.backends.cpu.ops``) then logs, at
import time, "Failed to load CPU gemm_4bit_forward from kernels-community: ...". It is harmless:
that Hub kernel is an optional fast path of the bf16 4-bit matmul, bitsandbytes falls back to its
own CPU kernel, and grpotrl keeps 4-bit layers off that bf16 path anyway
(``models.quantization.pin_quantized_kernels``, for I5). Only records of that logger whose message
starts with that text are dropped; everything else bitsandbytes logs passes. Must run before
bitsandbytes is imported (``grpotrl/__init__.py`` calls it first).
"""

import logging

BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
BNB_KERNEL_MESSAGE = "Failed to load CPU gemm_4bit_forward from kernels-community"


class DropMessage(logging.Filter):
    """Drops the records whose unformatted message starts with ``prefix``."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def silence_known_import_noise() -> None:
    """Install the filter on bitsandbytes' CPU-backend logger (idempotent)."""
    logger = logging.getLogger(BNB_CPU_LOGGER)
    if not any(isinstance(f, DropMessage) for f in logger.filters):
        logger.addFilter(DropMessage(BNB_KERNEL_MESSAGE))
