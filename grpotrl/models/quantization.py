"""Models loaded through bitsandbytes (QLoRA): which, and their kernels pinned so that train and
eval mode compute the same function; a quantization set twice, said. Used by the preflight (a loaded model,
the load settings) and the trainers."""

from __future__ import annotations

import sys


def quantized_bits(model) -> int | None:
    """4 or 8 when ``model`` was loaded through bitsandbytes, else None."""
    return 4 if getattr(model, "is_loaded_in_4bit", False) else 8 if getattr(model, "is_loaded_in_8bit", False) \
        else None


def quantization_written(config) -> str:
    """A ``quantization_config`` as its writer set it: a ``BitsAndBytesConfig`` by the fields that differ from its
    defaults, a dict (a recipe's, ``to_dict()``'s) as given.

    >>> from transformers import BitsAndBytesConfig
    >>> quantization_written(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    "BitsAndBytesConfig(bnb_4bit_quant_type='nf4', load_in_4bit=True)"
    >>> quantization_written({"load_in_8bit": True})
    "{'load_in_8bit': True}"
    """
    if not hasattr(config, "to_diff_dict"):
        return repr(config)
    fields = sorted((k, v) for k, v in config.to_diff_dict().items() if not k.startswith("_"))
    return f"{type(config).__name__}({', '.join(f'{k}={v!r}' for k, v in fields)})"


def quantization_set_twice(trainer_config, init_config) -> str:
    """Why a model cannot load with both the trainer's ``quantization_config`` and
    ``model_init_kwargs['quantization_config']`` (TRL's trainers refuse the pair at their load), each as written
    (``quantization_written``), and what to do."""
    return (f"The model's quantization is set twice: the trainer's quantization_config="
            f"{quantization_written(trainer_config)} and args.model_init_kwargs['quantization_config']="
            f"{quantization_written(init_config)}; TRL loads the model with one only and refuses the pair. Set it in "
            "one place: keep the trainer argument (from a recipe: load_in_4bit / load_in_8bit and the bnb_4bit_* "
            "fields) and drop quantization_config from model_init_kwargs, or drop the trainer argument.")


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
