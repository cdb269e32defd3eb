"""Generation: the response-only logits processors (I6) and the sampler-logprob recorder."""
