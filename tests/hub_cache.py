"""A local Hugging Face Hub cache built by the tests: the real cache layout, read by the real loading code.

``add_to_cache(cache_dir, "org/name", src_dir)`` stores the files of a saved model directory as
``models--org--name/blobs/<sha256>`` with ``snapshots/<commit>/<file>`` symlinks and
``refs/<revision>`` naming the commit, which is what ``huggingface_hub`` writes when it downloads.
With ``HF_HUB_CACHE`` pointing there and ``HF_HUB_OFFLINE=1`` (tests/conftest.py sets both for the
whole session), ``from_pretrained("org/name")`` resolves through the Hub client's own cache lookup:
nothing is patched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


_BIG = 16 * 2**20  # larger files are linked, not copied (SmolLM2's 540 MB of weights)


def add_to_cache(cache_dir: str, repo_id: str, src_dir: str, revision: str = "main",
                 skip: tuple[str, ...] = (), extra: dict[str, str] | None = None) -> str:
    """Put the files of ``src_dir`` (minus ``skip``, plus ``extra`` name -> text) in the cache as
    ``repo_id`` at ``revision``; returns the snapshot directory."""
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    sources = {name: Path(src_dir) / name for name in sorted(os.listdir(src_dir))
               if (Path(src_dir) / name).is_file() and name not in skip}
    digests = {name: hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}".encode()).hexdigest()
               if path.stat().st_size > _BIG else hashlib.sha256(path.read_bytes()).hexdigest()
               for name, path in sources.items()}
    digests.update({name: hashlib.sha256(text.encode()).hexdigest() for name, text in (extra or {}).items()})
    commit = hashlib.sha1(f"{repo_id}@{revision}:{sorted(digests.items())}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    if snapshot.exists():
        shutil.rmtree(snapshot)
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, digest in digests.items():
        blob = repo / "blobs" / digest
        if not blob.exists():
            if name in (extra or {}):
                blob.write_text(extra[name])
            elif sources[name].stat().st_size > _BIG:
                os.symlink(sources[name].resolve(), blob)
            else:
                shutil.copyfile(sources[name], blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return str(snapshot)


def mark_missing(cache_dir: str, repo_id: str, filename: str, revision: str = "main") -> str:
    """Record ``filename`` as absent from ``repo_id`` at ``revision`` (added by ``add_to_cache``) as
    ``huggingface_hub`` does after an online 404 for it: an empty ``models--org--name/.no_exist/<commit>/<filename>``;
    returns its path."""
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    marker = repo / ".no_exist" / (repo / "refs" / revision).read_text() / filename
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return str(marker)
