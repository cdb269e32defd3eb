"""Models loaded through bitsandbytes (QLoRA): which, and their kernels pinned so that train and
eval mode compute the same function. Used by the preflight (a loaded model) and the trainers."""

from __future__ import annotations

import sys


def quantized_bits(model) -> int | None:
    """4 or 8 when ``model`` was loaded through bitsandbytes, else None."""
    return 4 if getattr(model, "is_loaded_in_4bit", False) else 8 if getattr(model, "is_loaded_in_8bit", False) \
        else None


def _training_kernel(module, args):
    """Forward pre-hook of a bitsandbytes ``Linear8bitLt``: it reads ``self.training`` only to pick
    its matmul, so eval forwards use the training kernel too."""
    module.training = True


def pin_quantized_kernels(model) -> int:
    """Make bitsandbytes compute the same function in train and eval mode; returns the layers pinned.

    On CPU, bitsandbytes 0.50 picks its kernel by mode. A ``Linear4bit`` that sees an eval-mode,
    no-grad forward on an AVX512-BF16 CPU repacks its weights for a bf16 kernel for good: that
    forward differs from the training one (0.34 nats per token on SmolLM2), and every later
    training forward runs a kernel without autograd, so no gradient reaches any LoRA weight
    (measured: 0 of 120 LoRA tensors get one) while training runs on. The I5 guard's eval-mode
    recomputation is such a forward, and so is evaluation. A ``Linear8bitLt`` runs int8 matmuls
    with fp16 inputs in eval mode and dequantizes in training mode (1.2 nats apart). Pinned: 4-bit
    layers never repack, 8-bit layers always take their training kernel (the repacking is CPU-only;
    on CUDA the 8-bit layers run the same matmul in both modes). Idempotent.
    """
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:  # nothing quantized by bitsandbytes can exist
        return 0
    pinned = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            pinned += 1
        elif isinstance(module, bnb.nn.Linear8bitLt) and not getattr(module, "_grpotrl_pinned", False):
            module.register_forward_pre_hook(_training_kernel)
            module._grpotrl_pinned = True
            pinned += 1
    return pinned
