"""Pure tensor math: functions of tensors and plain values, never a trainer, tokenizer or config."""
