"""A recipe's ``dataset_name`` with ``dataset_config`` and ``dataset_train_split`` / ``dataset_test_split``, read as
TRL's scripts read them (``load_dataset(dataset_name, name=dataset_config)[split]``): each config and split honoured, or
refused before any weights load with the configs or splits there are. A dataset with two configs (``easy``: splits
train and extra; ``hard``: train only) as a local folder, and as a Hub id over a loopback Hub (tests/hub_server.py),
then offline from the datasets cache."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

import grpotrl
from grpotrl.data import load_splits, pick_split
from grpotrl.errors import InputError

PACKAGE_ROOT = Path(grpotrl.__file__).resolve().parents[1]  # the grpotrl under test, in the subprocess too

README = """---
configs:
- config_name: easy
  data_files:
  - split: train
    path: easy/train.jsonl
  - split: extra
    path: easy/extra.jsonl
- config_name: hard
  data_files:
  - split: train
    path: hard/train.jsonl
---
# Two configs, one with a split besides train
"""


def _rows(tag: str, n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"{tag} question {i}?"}], "answer": f"{tag}{i}"} for i in range(n)]


def two_configs() -> dict[str, bytes]:
    """The files of the two-config dataset, by path in its repo or folder."""
    jsonl = {"easy/train.jsonl": _rows("easy", 3), "easy/extra.jsonl": _rows("extra", 2),
             "hard/train.jsonl": _rows("hard", 4)}
    return {"README.md": README.encode(),
            **{path: "".join(json.dumps(r) + "\n" for r in rows).encode() for path, rows in jsonl.items()}}


@pytest.fixture
def two_config_folder(tmp_path) -> str:
    for path, data in two_configs().items():
        (tmp_path / "ds" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "ds" / path).write_bytes(data)
    return str(tmp_path / "ds")


def test_each_config_and_its_splits_are_honoured(two_config_folder):
    """Controls: the config picks the files, the split picks among that config's splits."""
    easy = load_splits(two_config_folder, "easy")
    assert list(easy) == ["train", "extra"]
    assert pick_split(easy, "extra", two_config_folder)["answer"] == ["extra0", "extra1"]
    hard = load_splits(two_config_folder, "hard")
    assert pick_split(hard, "train", two_config_folder)["answer"] == ["hard0", "hard1", "hard2", "hard3"]
    with pytest.raises(InputError, match=r"has splits \['train'\], not 'extra'. Set dataset_train_split"):
        pick_split(hard, "extra", two_config_folder)  # the split is the other config's


def test_a_missing_or_unknown_config_names_the_configs_there_are(two_config_folder):
    """datasets lists the configs on the second line of its message ("Config name is missing.\\nPlease pick one
    among the available configs: [...]"): the refusal keeps it, and says which setting to change."""
    with pytest.raises(InputError, match=r"without a dataset_config .*available configs: \['easy', 'hard'\]\. Set "
                                         r"dataset_config to one of the configs named there"):
        load_splits(two_config_folder)
    with pytest.raises(InputError, match=r"with dataset_config 'medium' .*\['easy', 'hard'\]\. Set dataset_config"):
        load_splits(two_config_folder, "medium")


def test_a_config_for_a_source_without_configs_is_refused_not_ignored(tmp_path):
    """A single data file and a save_to_disk folder have no configs: datasets labelled the file's cache with the
    name, load_from_disk was never given it, and either way the rows loaded were those without it."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows("file", 2)))
    assert list(load_splits(str(data))) == ["train"]  # control: without a config it loads
    with pytest.raises(InputError, match=r"dataset_config 'easy' was given, but dataset_name '.*train.jsonl' is a "
                                         r"single data file, which has no configs"):
        load_splits(str(data), "easy")
    saved = tmp_path / "saved"
    DatasetDict({"train": Dataset.from_list(_rows("saved", 2))}).save_to_disk(str(saved))
    assert list(load_splits(str(saved))) == ["train"]
    with pytest.raises(InputError, match=r"dataset_config 'easy' was given, but dataset_name '.*saved' is a "
                                         r"save_to_disk folder, which has no configs"):
        load_splits(str(saved), "easy")


HUB_LOAD = """
import json, sys
from grpotrl.data import load_splits, pick_split
from grpotrl.errors import InputError
for case in sys.argv[1:]:  # one process for every case: name[@config][:split]
    name, _, split = case.partition(":")
    name, _, config = name.partition("@")
    try:
        splits = load_splits(name, config or None)
        print(json.dumps(list(pick_split(splits, split or "train", name)["answer"])))
    except InputError as err:
        print("InputError:", err)
"""


def test_a_hub_dataset_with_two_configs_online_and_then_offline_from_the_cache(tmp_path):
    """The same dataset as the Hub id ``tester/two-configs``: downloaded by ``datasets.load_dataset`` over a
    loopback Hub (HF_ENDPOINT), then offline, where datasets' cache answers with other words ("There are multiple
    configurations in the cache", "Couldn't find cache ... Available configs in the cache"): every refusal names
    the configs, online and offline."""
    from hub_server import LoopbackHub

    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
           "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(PACKAGE_ROOT)}
    cases = ["tester/two-configs@easy:extra", "tester/two-configs@hard", "tester/two-configs@hard:extra",
             "tester/two-configs", "tester/two-configs@medium"]

    def load():
        out = subprocess.run([sys.executable, "-c", HUB_LOAD, *cases], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip().splitlines()

    with LoopbackHub({"tester/two-configs": two_configs()}) as hub:
        env["HF_ENDPOINT"] = hub.url
        online = load()
        assert any(p.endswith("hard/train.jsonl") for m, p in hub.requests if m == "GET")  # really downloaded
    env["HF_HUB_OFFLINE"] = env["HF_DATASETS_OFFLINE"] = "1"  # the server is gone: the datasets cache answers
    offline = load()
    for extra, hard, hard_extra, no_config, unknown in (online, offline):
        assert json.loads(extra) == ["extra0", "extra1"] and json.loads(hard) == ["hard0", "hard1", "hard2", "hard3"]
        assert "'tester/two-configs' has splits ['train'], not 'extra'" in hard_extra
        assert no_config.startswith("InputError: Cannot load dataset_name 'tester/two-configs' without a "
                                    "dataset_config")
        assert unknown.startswith("InputError: Cannot load dataset_name 'tester/two-configs' with dataset_config "
                                  "'medium'")
        for refusal in (no_config, unknown):
            assert ("['easy', 'hard']" in refusal or "easy, hard" in refusal) and "Set dataset_config" in refusal
    assert "Available configs in the cache: ['easy', 'hard']" in offline[4]


def test_the_cli_reads_dataset_config_and_split_before_the_model_loads(two_config_folder, tmp_path, tiny_llama,
                                                                       monkeypatch):
    """``grpotrl grpo --dataset_config --dataset_train_split``: a split of another config is refused before the
    model loads; the config's own split gets as far as the load (control: both settings reach load_dataset)."""
    import transformers

    from grpotrl import cli

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", refuse)
    args = ["--model_name_or_path", tiny_llama, "--dataset_name", two_config_folder, "--use_cpu", "true",
            "--reward_funcs", "exact_answer", "--per_device_train_batch_size", "2", "--num_generations", "2"]
    with pytest.raises(InputError, match=r"has splits \['train'\], not 'extra'"):
        cli.run("grpo", [*args, "--dataset_config", "hard", "--dataset_train_split", "extra",
                         "--output_dir", str(tmp_path / "o1")])
    with pytest.raises(AssertionError, match="a model was loaded"):
        cli.run("grpo", [*args, "--dataset_config", "easy", "--dataset_train_split", "extra",
                         "--output_dir", str(tmp_path / "o2")])


def test_a_split_that_only_another_config_has_names_that_config(two_config_folder, tmp_path):
    """A Hub-layout folder (README ``configs``): the refusal of a split the chosen config lacks names the config(s)
    whose README data_files hold it, and the setting that picks one; a split no config has names none."""
    with pytest.raises(InputError, match=r"has splits \['train'\], not 'extra'\. Set dataset_train_split .*\. Split "
                                         r"'extra' is in config 'easy', not 'hard': set dataset_config: easy"):
        pick_split(load_splits(two_config_folder, "hard"), "extra", two_config_folder)
    with pytest.raises(InputError, match=r"not 'validation'\. Set dataset_train_split") as err:
        pick_split(load_splits(two_config_folder, "hard"), "validation", two_config_folder)
    assert "dataset_config" not in str(err.value)  # control: no config holds it
    three = tmp_path / "three"
    for path, data in two_configs().items():
        (three / path).parent.mkdir(parents=True, exist_ok=True)
        (three / path).write_bytes(data)
    (three / "mid").mkdir()
    (three / "mid" / "train.jsonl").write_text(json.dumps(_rows("mid", 1)[0]) + "\n")
    (three / "mid" / "extra.jsonl").write_text(json.dumps(_rows("midx", 1)[0]) + "\n")
    (three / "README.md").write_text(README.replace("- config_name: hard", "- config_name: mid\n  data_files:\n"
                                                    "  - split: train\n    path: mid/train.jsonl\n  - split: extra\n"
                                                    "    path: mid/extra.jsonl\n- config_name: hard"))
    with pytest.raises(InputError, match=r"Split 'extra' is in configs 'easy', 'mid', not 'hard': set dataset_config: "
                                         r"easy"):
        pick_split(load_splits(str(three), "hard"), "extra", str(three))


def test_a_hub_split_that_only_another_config_has_names_it_online_and_offline_or_says_it_cannot_know(tmp_path):
    """The Hub id ``tester/two-configs`` over the loopback Hub, then offline, through datasets' own loading: online
    the README's data_files name the config that holds the split; offline (datasets loads from its cache, whose
    builder lists no configs) the config names come from the README in the Hugging Face cache and each config's
    splits from the dataset_info.json of its prepared cache: a config never prepared is said to be unknown, not
    guessed; without the README, the refusal says the other configs cannot be listed."""
    import shutil

    from hub_server import LoopbackHub

    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
           "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets"), "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0",
           "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(PACKAGE_ROOT)}

    def load(*cases, offline):
        env["HF_HUB_OFFLINE"] = env["HF_DATASETS_OFFLINE"] = "1" if offline else "0"
        out = subprocess.run([sys.executable, "-c", HUB_LOAD, *cases], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip().splitlines()

    named = "Split 'extra' is in config 'easy', not 'hard': set dataset_config: easy"
    with LoopbackHub({"tester/two-configs": two_configs()}) as hub:
        env["HF_ENDPOINT"] = hub.url
        [online] = load("tester/two-configs@hard:extra", offline=False)  # prepares 'hard' only
    assert "has splits ['train'], not 'extra'" in online and named in online
    [only_hard] = load("tester/two-configs@hard:extra", offline=True)
    assert "has splits ['train'], not 'extra'" in only_hard and "is in config" not in only_hard
    assert "Config 'easy' (ValueError: Couldn't find cache for tester/two-configs for config 'easy') may hold it: " \
           "its splits cannot be known without loading data" in only_hard
    with LoopbackHub({"tester/two-configs": two_configs()}) as hub:
        env["HF_ENDPOINT"] = hub.url
        assert json.loads(load("tester/two-configs@easy:extra", offline=False)[0]) == ["extra0", "extra1"]
    both, nowhere = load("tester/two-configs@hard:extra", "tester/two-configs@hard:validation", offline=True)
    assert named in both and "cannot be known" not in both
    assert "not 'validation'" in nowhere and "dataset_config" not in nowhere
    shutil.rmtree(tmp_path / "hf" / "hub")  # the README goes; datasets' cache still loads 'hard'
    [no_card] = load("tester/two-configs@hard:extra", offline=True)
    assert "not 'extra'" in no_card and "Other configs of 'tester/two-configs', if any, cannot be listed: it loaded " \
        "from the datasets cache, and no README in the Hugging Face cache names its configs" in no_card
