"""Checks both trainers run before TRL loads anything (bad input stops before compute)."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, GenerationConfig

from .. import templates


def _is_conversational(dataset) -> bool:
    if dataset is None or not hasattr(dataset, "column_names"):
        return True
    try:
        row = next(iter(dataset))
    except StopIteration:
        return True
    value = row.get("prompt", row.get("messages"))
    return isinstance(value, list)


def prepare_model_and_tokenizer(model, processing_class, args, train_dataset, kind: str):
    """Resolve aliases and validate model path, tokenizer, stop tokens and dataset.

    Returns ``(model, processing_class, stop_token_ids, model_dir)``; ``model`` is a resolved
    path when it was given as a string, ``model_dir`` the local directory it came from (or None).
    """
    from ..models import resolve_model_path
    from ..validation import check_dataset, check_model_dir

    if train_dataset is not None:
        check_dataset(train_dataset, "train", kind=kind)
    if isinstance(model, str):
        model = resolve_model_path(model)
        check_model_dir(model)
        model_dir = model
        generation_config = None
        if os.path.isfile(os.path.join(model, "generation_config.json")):
            generation_config = GenerationConfig.from_pretrained(model)
    else:
        model_dir = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
        generation_config = getattr(model, "generation_config", None)
    if model_dir is not None and not os.path.isdir(model_dir):
        model_dir = None
    if processing_class is None:
        if model_dir is None:
            raise ValueError("Pass `processing_class` (the tokenizer) when the model is not loaded from a local dir.")
        processing_class = AutoTokenizer.from_pretrained(model_dir)
    if _is_conversational(train_dataset):
        templates.require_chat_template(processing_class)
    stop_ids = templates.stop_token_ids(processing_class, generation_config)
    return model, processing_class, stop_ids, model_dir
