"""Config subclasses: TRL's configs plus only the fields grpotrl adds, each with ``help``.

Two TRL defaults change, both for the sampled-equals-scored guarantee (I5) and CPU runs:
``bf16`` defaults to False when no accelerator is present (TRL turns it on even on CPU) and
``disable_dropout`` defaults to True, so the logprob forward computes the function that
sampled the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import trl


def _has_accelerator() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


@dataclass
class GuardFields:
    guard_steps: int = field(
        default=2,
        metadata={"help": "Check INVARIANTS I1-I5 on the trainer's real tensors for the first N optimizer "
                  "steps; -1 checks every step, 0 turns the guards off."},
    )
    guard_logprob_atol: float = field(
        default=1e-5,
        metadata={"help": "I5 tolerance between the loss's per-token logprobs and an independent "
                  "log_softmax(logits / T) recomputation, in nats per nat of logit scale max|logits / T| "
                  "(fp32 rounding grows with it). Raised 100x automatically under bf16/fp16."},
    )
    check_template: bool = field(
        default=True,
        metadata={"help": "I2: stop when the checkpoint was trained with another chat template "
                  "(grpotrl_template.json). Set False only for a deliberate template change."},
    )


@dataclass
class GenerationFields:
    presence_penalty: float = field(
        default=0.0,
        metadata={"help": "OpenAI presence penalty, counting only the tokens generated so far in each response "
                  "(never the prompt or padding; INVARIANT I6). TRL's `repetition_penalty` is made "
                  "response-only the same way on the transformers generate path."},
    )
    frequency_penalty: float = field(
        default=0.0,
        metadata={"help": "OpenAI frequency penalty, counting only the tokens generated so far (I6)."},
    )
    min_new_tokens: int = field(
        default=0,
        metadata={"help": "Block every stop id (eos, end-of-turn, generation_config.eos_token_id) until this many "
                  "tokens are generated; the trigger rate is logged as `generation/min_new_tokens_trigger_rate`."},
    )
    hf_importance_sampling_correction: bool = field(
        default=False,
        metadata={"help": "On the transformers generate path, correct for the gap between the sampler's "
                  "processed distribution and the trainer's with TRL's truncated importance sampling, using "
                  "the same knobs as vLLM: vllm_importance_sampling_mode / _clip_min / _clip_max."},
    )


@dataclass
class GRPOConfig(GenerationFields, GuardFields, trl.GRPOConfig):
    disable_dropout: bool = field(
        default=True,
        metadata={"help": "Disable dropout so the logprob forward computes the same function that sampled "
                  "the tokens (I5). TRL's default is False."},
    )

    def __post_init__(self):
        if self.bf16 is None and not self.fp16 and not _has_accelerator():
            self.bf16 = False
        super().__post_init__()


@dataclass
class SFTConfig(GuardFields, trl.SFTConfig):
    def __post_init__(self):
        if self.bf16 is None and not self.fp16 and not _has_accelerator():
            self.bf16 = False
        super().__post_init__()
