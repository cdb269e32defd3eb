"""Generative adversarial distillation: the discriminator D (a sequence scorer over the chat template, I9).
Its engine under DDP/DeepSpeed is the trainer's D step (``trainers.gad_engine``)."""
