"""Models by local path or Hugging Face Hub id, as ``from_pretrained`` takes them; checked before any weights load.

A model name is what TRL and transformers take: a local directory, or a Hub id (``org/name``)
with an optional revision. grpotrl hands the same string to ``from_pretrained``; it only reads the
small files first (config, tokenizer, chat template, generation config, template fingerprint), so
bad input stops before a weight is read:

* a local directory: ``check_model_dir`` (config.json, every weight shard complete);
* a Hub id: ``config.json`` (or ``adapter_config.json``) through ``transformers.utils.cached_file``,
  the same call ``from_pretrained`` makes (token, revision, ``HF_ENDPOINT``, ``HF_HUB_CACHE`` honoured).
  With ``HF_HUB_OFFLINE=1`` the cached snapshot must also hold complete weights, checked like a local
  directory; offline and not cached is one ``InputError`` naming the id, the cache directory and
  ``HF_HUB_OFFLINE``. Online, the weights are downloaded by ``from_pretrained`` as in TRL.

A PEFT adapter (a directory or Hub repo holding ``adapter_config.json``, as a LoRA SFT saves it): ``find_adapter``
reads its config once per run start into a ``PeftAdapter``, which the preflight and the trainer's load are handed
(each lookup of a Hub id is a ``cached_file`` request, a 404 for a plain model; ``AdapterLookup`` records the
answer, a plain model's too, for a later step of the same start); ``adapter_config`` reads the config,
``PeftAdapter.peft_config`` makes PEFT's config object of it (PEFT then reads
no config file; it still reads the weights), ``adapter_base`` the base
model it names, ``adapter_tokenizer_source`` where its tokenizer loads from (a Hub id: one listing of its files, or
where listing fails a request per ``TOKENIZER_FILES`` name; worked out only where the tokenizer loads from the model); ``generation_config`` falls back to the base model's.

Where the tokenizer is loaded from the model (no ``processing_class`` given), ``check_tokenizer_source`` asks for a
tokenizer vocabulary (``TOKENIZER_FILES``) in the local directory, or offline in the Hub id's cached snapshot.
"""

from __future__ import annotations

import copy
import json
import os
import re
from typing import NamedTuple

from ..errors import InputError
from . import ALIASES, resolve_model_path, safetensors_problem

# the lock an output_dir holds while a run writes it (checkpoints/run_lock.py): left out of listings, as not
# the model's; "_*", so the Trainer's push_to_hub never uploads it
LOCK_FILE = "_grpotrl.lock"

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


def generation_config(name_or_path: str, revision: str | None, adapter: PeftAdapter | None):
    """The model's ``GenerationConfig`` (its stop ids matter to I4), or None when it has none. A PEFT adapter
    (``adapter``: what ``find_adapter`` found for ``name_or_path``, None for a plain model) without its own is its
    base model's, which the loaded model generates with."""
    from transformers import GenerationConfig

    path = model_file(name_or_path, "generation_config.json", revision)
    if path is None and adapter is not None and adapter.base:
        path = model_file(adapter.base, "generation_config.json", adapter.base_revision)
    return GenerationConfig.from_pretrained(os.path.dirname(path)) if path else None


class PeftAdapter(NamedTuple):
    """A PEFT adapter named as the model, as ``find_adapter`` read it: ``name`` its directory or Hub id (an alias
    resolved), ``revision`` the revision it was read at (``model_init_kwargs``'), ``config`` its
    ``adapter_config.json``. Read once per run start and handed to every check and load that needs it."""

    name: str
    revision: str | None
    config: dict

    @property
    def base(self) -> str | None:
        """The base model it names (``adapter_base``)."""
        return adapter_base(self.config)

    @property
    def base_revision(self) -> str | None:
        """The base model's revision, as PEFT loads it: the adapter's record."""
        return self.config.get("revision")

    def peft_config(self):
        """A new ``peft.PeftConfig`` of ``config``, built as PEFT's load builds it from the file
        (``<the class of its peft_type>.from_pretrained``: that class's ``check_kwargs``; ``runtime_config`` dropped,
        without PEFT's warning), without reading the file again: for
        ``PeftModel.from_pretrained(config=...)`` and the discriminator's merge, which may change the copy."""
        from peft import PeftConfig
        from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

        kwargs = {k: v for k, v in copy.deepcopy(self.config).items() if k != "runtime_config"}
        cls = PEFT_TYPE_TO_CONFIG_MAPPING[kwargs["peft_type"]] if "peft_type" in kwargs else PeftConfig
        return cls.from_peft_type(**cls.check_kwargs(**kwargs))


class AdapterLookup(NamedTuple):
    """What ``find_adapter`` answered for ``name`` at ``revision``: ``adapter``, or None for a plain model (or a
    name that cannot be reached). A step that looked the model up hands this on, so that a later step of the same
    run start asks no second time (``preflight.prepare_model_and_tokenizer``'s ``adapter_lookup``)."""

    name: str
    revision: str | None
    adapter: PeftAdapter | None


def find_adapter(name_or_path: str | None, revision: str | None = None) -> PeftAdapter | None:
    """The PEFT adapter ``name_or_path`` names (``adapter_config``: one lookup), None for a plain model or a name
    that cannot be reached."""
    config = adapter_config(name_or_path, revision)
    return None if config is None else PeftAdapter(name_or_path, revision, config)


def adapter_config(name_or_path: str | None, revision: str | None = None) -> dict | None:
    """The ``adapter_config.json`` of a PEFT adapter (a local directory or Hub repo that holds one, as
    ``check_model_dir`` reads it), None for a model or a name that cannot be reached (``check_model_source`` says
    why); ``InputError`` when the file is not a JSON object."""
    path = model_file(name_or_path, "adapter_config.json", revision)
    if path is None:
        return None
    try:
        with open(path) as f:
            config = json.load(f)
    except ValueError as err:
        raise InputError(f"PEFT adapter {name_or_path!r}: {path} is not valid JSON ({err}). Copy the adapter again "
                         "or pick another checkpoint.") from None
    if not isinstance(config, dict):
        raise InputError(f"PEFT adapter {name_or_path!r}: {path} holds a {type(config).__name__}, not the JSON "
                         "object PEFT writes. Copy the adapter again or pick another checkpoint.")
    return config


def adapter_base(adapter: dict) -> str | None:
    """The base model a PEFT adapter's config (``adapter_config``) names, an alias resolved to its directory."""
    base = adapter.get("base_model_name_or_path")
    return resolve_model_path(base) if base else None


def adapter_tokenizer_source(adapter: PeftAdapter) -> str:
    """Where a PEFT adapter's tokenizer loads from: the adapter when it holds tokenizer files (``TOKENIZER_FILES``,
    any ``*.model`` / ``*.tiktoken``: grpotrl's SFT saves its tokenizer beside the adapter), else its base model
    (transformers' ``AutoProcessor`` cannot load one from an adapter that holds none). A Hub id's files are its
    cached snapshot's offline, the Hub's listing online (``_hub_files``)."""
    if is_local(adapter.name):
        own = _tokenizer_files_in(os.listdir(os.path.expanduser(adapter.name)))
    else:
        names = _hub_files(adapter.name, adapter.revision)
        own = _tokenizer_files_in(names) if names is not None else \
            any(model_file(adapter.name, n, adapter.revision) for n in TOKENIZER_FILES)
    return adapter.name if own or not adapter.base else adapter.base


def adapter_tokenizer_path(adapter: PeftAdapter) -> str:
    """What ``AutoProcessor.from_pretrained`` is handed to load a PEFT adapter's own tokenizer (where
    ``adapter_tokenizer_source`` is the adapter): with ``HF_HUB_OFFLINE=1`` a Hub id's cached snapshot directory,
    which loads as a local adapter directory does; else ``adapter.name``. An adapter holds no config.json, and
    transformers' AutoProcessor, then its AutoTokenizer, each look one up: a local directory's is missing (a
    ValueError both pass over), and so is a Hub id's online (a 404 for config.json alone: ``cached_files`` returns
    None), but offline a Hub id's is an OSError ("We couldn't connect to ...") that neither catches, unless the
    cache holds huggingface_hub's ``.no_exist`` marker for it. The base's config as AutoProcessor's ``config``
    does not help: AutoProcessor does not hand it on to AutoTokenizer."""
    if is_local(adapter.name) or not _offline():
        return adapter.name
    return _hub_snapshot(adapter.name, adapter.revision, "PEFT adapter")


def adapter_tokenizer_unloadable(adapter: PeftAdapter, err: Exception) -> str:
    """The error for a PEFT adapter's own tokenizer that transformers could not load (``err``, an OSError: online,
    the Hub refused or did not answer a request for one of its files, config.json included)."""
    download = f"hf download {adapter.name}" + ("" if adapter.revision in (None, "main")
                                                 else f" --revision {adapter.revision}")
    return (f"The tokenizer of the PEFT adapter {adapter.name!r}{_at(adapter.revision)} (its own tokenizer files; "
            f"an adapter has no config.json) could not be loaded: {type(err).__name__}: {_first_line(err)} "
            "Download the adapter "
            f"(`{download}`) and run with HF_HUB_OFFLINE=1 (it then loads from the cache), pass its local directory "
            "as the model, or from Python pass processing_class=AutoTokenizer.from_pretrained(<that directory>).")


def _first_line(err: Exception) -> str:
    """The first line of ``err``'s message for an error of ours, with any URL's user:password (an ``HF_ENDPOINT``
    holding a credential, which huggingface_hub's messages name) replaced by ``***``.

    >>> _first_line(OSError("We couldn't connect to 'http://u:tok@host:9' to load the files.\\nCheck it."))
    "We couldn't connect to 'http://***@host:9' to load the files."
    """
    lines = str(err).strip().splitlines()
    return re.sub(r"(://)[^/@\s'\"]+@", r"\1***@", lines[0]) if lines else ""


def _hub_files(repo_id: str, revision: str | None) -> list[str] | None:
    """The top-level file names of the Hub repo ``repo_id`` at ``revision``: its cached snapshot's with
    ``HF_HUB_OFFLINE=1`` (what can be loaded then), the Hub's listing online; None where neither can be read
    (``adapter_tokenizer_source`` then asks for each of ``TOKENIZER_FILES``)."""
    from huggingface_hub import list_repo_files, snapshot_download

    try:
        if _offline():
            return os.listdir(snapshot_download(repo_id, revision=revision, local_files_only=True))
        return [n for n in list_repo_files(repo_id, revision=revision) if "/" not in n]
    except Exception:  # noqa: BLE001 (a listing refused or unreachable: the names are asked for one by one)
        return None


def check_model_source(name_or_path: str | None, revision: str | None = None, what: str = "Model") -> None:
    """Raise ``InputError`` unless ``name_or_path`` is a complete local checkpoint (or PEFT adapter)
    directory, or a Hub model that can be loaded: reachable, or cached when offline."""
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


# the files a tokenizer's vocabulary comes in (tokenizers' JSON, sentencepiece, tiktoken, BPE / WordPiece vocab);
# tokenizer_config.json alone holds none
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.tiktoken")


def _holds_tokenizer(directory: str) -> bool:
    """Whether ``directory`` holds a tokenizer vocabulary (``TOKENIZER_FILES``, or any ``*.model`` / ``*.tiktoken``),
    or is a PEFT adapter's (its tokenizer may come from its base model)."""
    names = os.listdir(directory)
    return "adapter_config.json" in names or _tokenizer_files_in(names)


def _tokenizer_files_in(names: list[str]) -> bool:
    """Whether the file ``names`` hold a tokenizer vocabulary (``TOKENIZER_FILES``, any ``*.model`` / ``*.tiktoken``)."""
    return any(n in TOKENIZER_FILES or n.endswith((".tiktoken", ".model")) for n in names)


def check_tokenizer_source(name_or_path: str, revision: str | None = None,
                           elsewhere: str = "from Python pass processing_class=") -> None:
    """Raise ``InputError`` when the model ``name_or_path`` has no tokenizer vocabulary to load the tokenizer
    from (a checkpoint saved, or a snapshot downloaded, without one): a local directory, or a Hub id's cached
    snapshot with ``HF_HUB_OFFLINE=1``, holds none of ``TOKENIZER_FILES`` (transformers would say
    "Unrecognized processing class", or to install sentencepiece or tiktoken). Call it only where the tokenizer
    is loaded from the model (no ``processing_class`` given). Online a Hub id passes: ``from_pretrained``
    downloads what the repo has. A path that does not exist passes: ``check_model_source`` refuses it.
    ``elsewhere``: how this model's user gives a tokenizer loaded from elsewhere (the policy's ``processing_class``,
    a reward model's ``reward_processing_classes[i]``, a judge's ``LocalJudge(model, tokenizer, ...)``)."""
    if is_local(name_or_path):
        directory = os.path.expanduser(name_or_path)
        if os.path.isdir(directory) and not _holds_tokenizer(directory):
            raise InputError(
                f"Model dir {name_or_path!r} has no tokenizer files (none of {list(TOKENIZER_FILES)}; found: "
                f"{file_listing(directory)}): it was saved without its tokenizer. Save the tokenizer of the model it "
                f"was trained from into it (`AutoTokenizer.from_pretrained(base).save_pretrained(dir)`), or {elsewhere} "
                "(a tokenizer loaded from elsewhere)."
            )
        return
    if not looks_like_hub_id(name_or_path) or not _offline():
        return
    snapshot = _hub_snapshot(name_or_path, revision, "Model")  # the errors check_model_source raised first
    if snapshot is not None and not _holds_tokenizer(snapshot):
        raise InputError(
            f"Model {name_or_path!r}{_at(revision)} is in the local Hugging Face cache without tokenizer files: its "
            f"snapshot {snapshot} holds none of {list(TOKENIZER_FILES)} (found: {file_listing(snapshot)}), and "
            "HF_HUB_OFFLINE=1 forbids downloading them. Run once with network (or `hf download "
            f"{name_or_path}{'' if revision in (None, 'main') else ' --revision ' + revision}`) to fetch them, point "
            f"HF_HUB_CACHE / HF_HOME at a cache that holds them, or {elsewhere} (a tokenizer loaded from elsewhere)."
        )


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
            first = _first_line(err) or type(err).__name__
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


# ---------------------------------------------------------------------------------------------
# Local model directories: config.json and complete weights (headers only, no weights read)
# ---------------------------------------------------------------------------------------------

WEIGHT_FILES = {"model": ("model.safetensors", "pytorch_model.bin"),
                "adapter": ("adapter_model.safetensors", "adapter_model.bin")}


def weights_problem(directory: str, kind: str = "model") -> str | None:
    """Why ``directory`` lacks complete ``kind`` weights (single file or every shard of an index), or None."""
    safetensors, bin_name = WEIGHT_FILES[kind]
    for index_name in (safetensors + ".index.json", bin_name + ".index.json"):
        index_path = os.path.join(directory, index_name)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                shards = sorted(set(json.load(f).get("weight_map", {}).values()))
            if not shards:
                return f"{index_name} has an empty weight_map"
            missing = [s for s in shards if not os.path.isfile(os.path.join(directory, s))]
            if missing:
                return f"{index_name} lists shards that are missing: {missing}"
            for shard in shards:
                if shard.endswith(".safetensors") and (problem := safetensors_problem(os.path.join(directory, shard))):
                    return problem
            return None
    if os.path.isfile(os.path.join(directory, safetensors)):
        return safetensors_problem(os.path.join(directory, safetensors))
    if os.path.isfile(os.path.join(directory, bin_name)):
        return None
    return f"no {safetensors}, {bin_name} or sharded index"


def file_listing(directory: str) -> str:
    """The names in ``directory`` for an error message (the first 12, and how many), or "nothing"."""
    names = sorted(n for n in os.listdir(directory) if n != LOCK_FILE)  # the run lock is grpotrl's
    return ", ".join(names[:12]) + (f", ... ({len(names)} files)" if len(names) > 12 else "") if names else "nothing"


def check_model_dir(path: str | None) -> None:
    """Raise ``InputError`` unless ``path`` is a local, complete checkpoint (or PEFT adapter) dir."""
    if not path:
        raise InputError("No model given. Set `model_name_or_path` in the recipe (or pass --model_name_or_path "
                         "DIR): a local checkpoint directory or the alias 'smollm2-135m-instruct'.")
    directory = os.path.expanduser(path)
    if os.path.isdir(directory):
        if os.path.isfile(os.path.join(directory, "adapter_config.json")):
            problem = weights_problem(directory, "adapter")
            if problem:
                raise InputError(f"PEFT adapter dir {path!r} has incomplete weights: {problem} (found: "
                                 f"{file_listing(directory)}). Copy the adapter again or pick another checkpoint.")
            with open(os.path.join(directory, "adapter_config.json")) as f:
                base = json.load(f).get("base_model_name_or_path")
            try:
                check_model_source(resolve_model_path(base) if base else base)
            except InputError as err:
                raise InputError(f"The base model of PEFT adapter {path!r} is not usable: {err}") from None
            return
        if not os.path.isfile(os.path.join(directory, "config.json")):
            raise InputError(
                f"Model dir {path!r} has no config.json (found: {file_listing(directory)}). Point "
                "`model_name_or_path` at the directory that holds config.json and the weights (for a training "
                "run, its output_dir or one of its checkpoint-N dirs)."
            )
        problem = weights_problem(directory, "model")
        if problem:
            raise InputError(
                f"Model dir {path!r} has incomplete weights: {problem} (found: {file_listing(directory)}). The save or "
                "copy that made it did not finish: save or copy it again, or pick another checkpoint."
            )
        return
    if os.path.exists(directory):
        raise InputError(f"Model path {path!r} is a file; `model_name_or_path` must be a directory holding "
                         "config.json and the weights, or a Hugging Face Hub id.")
    aliases = ", ".join(repr(a) for a in ALIASES)
    raise InputError(
        f"Model dir {path!r} does not exist (absolute: {os.path.abspath(directory)}). If it is the output of "
        "an earlier run (the GRPO quickstart starts from the SFT quickstart's output), run that first, from the "
        f"directory the path is relative to; otherwise fix the path. Known aliases: {aliases}; a Hugging Face "
        "Hub id (org/name) is loaded from the Hub."
    )
