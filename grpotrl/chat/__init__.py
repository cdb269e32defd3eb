"""Chat templates (I2), their stop tokens and fingerprint, the prompt/completion boundary, SFT rows. Templates take
what was read (a model source's files are ``models.sources``)."""
