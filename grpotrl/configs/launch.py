"""How a run is launched, known from its config and ``accelerate launch``'s environment before anything loads."""

from __future__ import annotations


def sharded_launch(args) -> str | None:
    """"DeepSpeed" or "FSDP" when this run is set up for it, by the training arguments or by
    ``accelerate launch`` (its environment), known before anything loads; else None."""
    from accelerate.utils import parse_flag_from_env

    if args.deepspeed or parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        return "DeepSpeed"
    if args.fsdp or parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return "FSDP"
    return None
