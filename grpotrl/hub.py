"""Models by local path or Hugging Face Hub id, as ``from_pretrained`` takes them; checked before any weights load.

A model name is what TRL and transformers take: a local directory, or a Hub id (``org/name``)
with an optional revision. grpotrl hands the same string to ``from_pretrained``; it only reads the
small files first (config, tokenizer, chat template, generation config, template fingerprint), so
bad input stops before a weight is read:

* a local directory: ``preflight_model.check_model_dir`` (config.json, every weight shard complete);
* a Hub id: ``config.json`` (or ``adapter_config.json``) through ``transformers.utils.cached_file``,
  the same call ``from_pretrained`` makes (token, revision, ``HF_ENDPOINT``, ``HF_HUB_CACHE`` honoured).
  With ``HF_HUB_OFFLINE=1`` the cached snapshot must also hold complete weights, checked like a local
  directory; offline and not cached is one ``InputError`` naming the id, the cache directory and
  ``HF_HUB_OFFLINE``. Online, the weights are downloaded by ``from_pretrained`` as in TRL.
"""

from __future__ import annotations

import json
import os
import re

from .errors import InputError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$|^[A-Za-z0-9][\w.-]*$")


def is_local(name_or_path: str) -> bool:
    return os.path.exists(os.path.expanduser(name_or_path))


def looks_like_hub_id(name_or_path: str) -> bool:
    """``org/name`` or ``name`` (legacy canonical ids such as ``gpt2``), not a path that exists."""
    return not is_local(name_or_path) and not name_or_path.startswith(("/", ".", "~")) \
        and bool(_HUB_ID.match(name_or_path)) and ".." not in name_or_path


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def model_file(name_or_path: str | None, filename: str, revision: str | None = None) -> str | None:
    """Local path of ``filename`` in a model directory or Hub repo (downloaded if online), or None
    when the model has no such file or it cannot be reached."""
    if not name_or_path:
        return None
    if is_local(name_or_path):
        path = os.path.join(os.path.expanduser(name_or_path), filename)
        return path if os.path.isfile(path) else None
    if not looks_like_hub_id(name_or_path):
        return None
    from transformers.utils import cached_file

    try:
        return cached_file(name_or_path, filename, revision=revision, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)
    except OSError:  # an unknown repo or revision: check_model_source says so, with what to do
        return None


def generation_config(name_or_path: str, revision: str | None = None):
    """The model's ``GenerationConfig`` (its stop ids matter to I4), or None when it has none."""
    from transformers import GenerationConfig

    path = model_file(name_or_path, "generation_config.json", revision)
    return GenerationConfig.from_pretrained(os.path.dirname(path)) if path else None


def check_model_source(name_or_path: str | None, revision: str | None = None, what: str = "Model") -> None:
    """Raise ``InputError`` unless ``name_or_path`` is a complete local checkpoint (or PEFT adapter)
    directory, or a Hub model that can be loaded: reachable, or cached when offline."""
    from .preflight_model import check_model_dir

    if not name_or_path or is_local(name_or_path) or not looks_like_hub_id(name_or_path):
        check_model_dir(name_or_path)  # local checks, and the errors for paths that do not exist
        return
    snapshot = _hub_snapshot(name_or_path, revision, what)
    if snapshot is None:  # online: from_pretrained downloads the weights, as in TRL
        return
    try:
        check_model_dir(snapshot)
    except InputError as err:
        raise InputError(
            f"{what} {name_or_path!r}{_at(revision)} is in the local Hugging Face cache ({_cache_dir()}) but not "
            f"completely: {err} With HF_HUB_OFFLINE=1 nothing can be downloaded: run once with network (or "
            f"`hf download {name_or_path}`) to complete it, or unset HF_HUB_OFFLINE."
        ) from None


def _at(revision: str | None) -> str:
    return f" (revision {revision!r})" if revision not in (None, "main") else ""


def _hub_snapshot(repo_id: str, revision: str | None, what: str) -> str | None:
    """The cached snapshot directory when offline, None when online and the repo answered with a
    config; ``InputError`` when neither works."""
    from huggingface_hub import errors as hf_errors
    from huggingface_hub import snapshot_download
    from transformers.utils import cached_file

    if _offline():
        try:
            snapshot = snapshot_download(repo_id, revision=revision, local_files_only=True)
        except (OSError, ValueError, hf_errors.LocalEntryNotFoundError):
            raise InputError(
                f"{what} {repo_id!r}{_at(revision)} is not in the local Hugging Face cache ({_cache_dir()}) and "
                "HF_HUB_OFFLINE=1 forbids downloading it. Unset HF_HUB_OFFLINE on a machine with network (the "
                f"model is then downloaded as TRL does), download it first (`hf download {repo_id}`), or point "
                "HF_HUB_CACHE / HF_HOME at the cache that holds it."
            ) from None
        found = next((os.path.join(snapshot, n) for n in ("config.json", "adapter_config.json")
                      if os.path.isfile(os.path.join(snapshot, n))), None)
    else:
        try:
            found = None
            for name in ("config.json", "adapter_config.json"):
                found = cached_file(repo_id, name, revision=revision, _raise_exceptions_for_missing_entries=False)
                if found:
                    break
        except (hf_errors.RepositoryNotFoundError, hf_errors.GatedRepoError, hf_errors.RevisionNotFoundError) as err:
            raise InputError(
                f"{what} {repo_id!r}{_at(revision)} cannot be loaded from the Hugging Face Hub: "
                f"{type(err).__name__}: {str(err).splitlines()[0]} Check the id and revision; for a private or "
                "gated repo log in (`hf auth login` or HF_TOKEN)."
            ) from None
        except OSError as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise InputError(
                f"{what} {repo_id!r}{_at(revision)} is not a local directory (relative to {os.getcwd()}) and could "
                f"not be fetched from the Hugging Face Hub: {first} If it is a local path, fix it; if it is a Hub "
                f"id, check the network (or set HF_HUB_OFFLINE=1 to use the cache at {_cache_dir()})."
            ) from None
    if not found:
        raise InputError(
            f"{what} {repo_id!r}{_at(revision)} has neither config.json nor adapter_config.json: it is not a "
            "transformers model or PEFT adapter repo. Check the id (and subfolder)."
        )
    if _offline():
        return os.path.dirname(found)  # check_model_source checks its weights like a local directory
    if os.path.basename(found) == "adapter_config.json":  # the base model must load too
        with open(found) as f:
            base = json.load(f).get("base_model_name_or_path")
        check_model_source(base, None, what=f"The base model of PEFT adapter {repo_id!r}:")
    return None
