"""What a recipe may name, checked before any model loads: datasets (shipped, local files and
folders, ``save_to_disk`` folders, Hub ids served by a loopback Hub), rewards (grpotrl's and
``trl grpo``'s names, dotted paths, ``reward_model_name_or_path``) and judges (HTTP and local,
rubrics, API keys by variable name only). No model is loaded here except where a test says so."""

import io
import re
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
import yaml
from datasets import Dataset, DatasetDict

from grpotrl import cli
from grpotrl.configs import recipe_types
from grpotrl.data import SHIPPED, load_shipped, load_splits, pick_split
from grpotrl.errors import InputError
from grpotrl.rewards import resolve, rules
from grpotrl.rewards.judges import HttpJudge
from grpotrl.rewards.recipe import LocalJudgeSpec, parse_judges
from grpotrl.rewards.rubrics import FAIRNESS, HALLUCINATION

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
USER = [{"role": "user", "content": "What is 7 + 5?"}]
SECRET = "sk-test-0123456789-never-shown"


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was validated")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", refuse)


def rows(split: str, n: int = 3) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"{split} question {i}?"}], "answer": f"{split}{i}"}
            for i in range(n)]


# ---------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------

def test_shipped_names_include_gad_toy_and_ship_in_the_package():
    assert set(SHIPPED) == {"quickstart", "multitask", "gad_toy"}
    splits = load_splits("gad_toy")
    assert list(splits) == ["train"] and len(splits["train"]) == 200
    assert "teacher_response" in load_shipped("gad_toy").column_names
    with pytest.raises(InputError, match=r"Dataset 'gad_toy' has splits \['train'\], not 'test'"):
        load_shipped("gad_toy", "test")
    assert {len(s) for s in load_splits("multitask").values()} == {120, 24}
    cfg = (ROOT / "setup.cfg").read_text()
    assert "grpotrl = data/*.jsonl" in cfg  # package_data: every shipped file, gad_toy.jsonl included
    assert all(path.suffix == ".jsonl" and path.parent == ROOT / "grpotrl" / "data" for path in SHIPPED.values())
    for recipe in (ROOT / "recipes").rglob("*.yaml"):  # no recipe depends on the working directory for data
        name = yaml.safe_load(recipe.read_text()).get("dataset_name")
        assert name is None or name in SHIPPED, f"{recipe}: dataset_name {name!r}"


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_local_data_file_is_the_train_split(tmp_path, fmt):
    ds = Dataset.from_list([{"question": r["prompt"][0]["content"], "answer": r["answer"]} for r in rows("train")])
    path = tmp_path / f"data.{fmt}"
    {"jsonl": ds.to_json, "json": ds.to_json, "parquet": ds.to_parquet, "csv": ds.to_csv}[fmt](str(path))
    splits = load_splits(str(path))
    assert list(splits) == ["train"] and splits["train"]["answer"] == ["train0", "train1", "train2"]
    with pytest.raises(InputError, match=r"has splits \['train'\], not 'test' \(a single data file is the 'train'"):
        pick_split(splits, "test", str(path))


def test_local_folder_and_save_to_disk_folder(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(split)))
    splits = load_splits(str(folder))
    assert pick_split(splits, "test", str(folder))["answer"] == ["test0", "test1", "test2"]
    with pytest.raises(InputError, match=r"has splits \['train', 'test'\], not 'validation'"):
        pick_split(splits, "validation", str(folder))

    saved = tmp_path / "saved"
    DatasetDict({"train": Dataset.from_list(rows("train")), "dev": Dataset.from_list(rows("dev", 2))}).save_to_disk(
        str(saved))
    splits = load_splits(str(saved))
    assert set(splits) == {"train", "dev"} and splits["dev"]["answer"] == ["dev0", "dev1"]
    one = tmp_path / "one"
    Dataset.from_list(rows("x")).save_to_disk(str(one))  # a single saved Dataset is the train split
    assert load_splits(str(one))["train"]["answer"] == ["x0", "x1", "x2"]


def test_missing_dataset_or_config_is_one_input_error(tmp_path):
    with pytest.raises(InputError, match=r"Cannot load dataset_name '\S+nope.jsonl'.*Use a shipped dataset"):
        load_splits(str(tmp_path / "nope.jsonl"))  # not there: not a file, so it goes to load_dataset as is
    (tmp_path / "data.xlsx").write_text("x")
    with pytest.raises(InputError, match=r"file of unknown format '.xlsx'"):
        load_splits(str(tmp_path / "data.xlsx"))
    with pytest.raises(InputError, match="shipped dataset 'quickstart' has no configs"):
        load_splits("quickstart", "main")


def _parquet(data: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(data), buf)
    return buf.getvalue()


HUB_LOAD = """
import json, sys
from grpotrl.data import load_splits, pick_split
from grpotrl.errors import InputError
for case in sys.argv[1:]:  # one process for every case: importing grpotrl (torch) is the slow part
    name, _, config = case.partition("@")
    try:
        splits = load_splits(name, config or None)
        print(json.dumps({k: list(v["answer"]) for k, v in splits.items()}))
        pick_split(splits, "validation", name)
    except InputError as err:
        print("InputError:", err)
"""


def test_hub_dataset_id_goes_to_load_dataset_unchanged(tmp_path):
    """A real ``datasets.load_dataset("tester/arith")`` against a loopback Hub (HF_ENDPOINT):
    repo info, file listing and parquet downloads over HTTP, then the datasets cache."""
    from hub_server import LoopbackHub

    files = {"data/train-00000-of-00001.parquet": _parquet(rows("train")),
             "data/test-00000-of-00001.parquet": _parquet(rows("test", 2)),
             "README.md": b"---\nlicense: mit\n---\n# arith\n"}
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
           "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}

    def load(*cases):
        out = subprocess.run([sys.executable, "-c", HUB_LOAD, *cases], env=env, capture_output=True, text=True,
                             timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip().splitlines()

    with LoopbackHub({"tester/arith": files}) as hub:
        env["HF_ENDPOINT"] = hub.url
        first, error, missing, config = load("tester/arith", "tester/missing", "tester/arith@nope")
        assert json.loads(first) == {"train": ["train0", "train1", "train2"], "test": ["test0", "test1"]}
        assert "has splits ['train', 'test'], not 'validation'" in error
        fetched = [p for m, p in hub.requests if m == "GET" and p.endswith(".parquet")]
        assert len(fetched) == 2, hub.requests  # really downloaded, over the loopback Hub
        assert missing.startswith("InputError: Cannot load dataset_name 'tester/missing'")
        assert "a dataset on the Hugging Face Hub" in missing
        assert config.startswith("InputError: Cannot load dataset_name 'tester/arith' with dataset_config 'nope'")

    env["HF_HUB_OFFLINE"] = env["HF_DATASETS_OFFLINE"] = "1"  # the server is gone: the cache answers
    assert json.loads(load("tester/arith")[0])["test"] == ["test0", "test1"]


def test_cli_dataset_error_comes_before_the_model_load(tmp_path, smollm2_path, no_model_load):
    with pytest.raises(InputError, match=r"has splits \['train'\], not 'test'"):
        cli.run("grpo", ["--model_name_or_path", smollm2_path, "--dataset_name", "gad_toy",
                         "--eval_strategy", "steps", "--output_dir", str(tmp_path), "--use_cpu", "true",
                         "--reward_funcs", "exact_answer"])


def test_cli_data_errors_name_the_split_as_the_recipe_does(tmp_path, tiny_llama, no_model_load):
    """A save_to_disk folder's splits (and the shipped ones) carry no name of their own
    (``Dataset.split`` is None): an error about the eval rows names the recipe's
    ``dataset_test_split``, not 'eval'."""
    saved = tmp_path / "saved"
    test = [{**r, "prompt": []} for r in rows("dev")]  # no message to answer
    DatasetDict({"train": Dataset.from_list(rows("train")), "dev": Dataset.from_list(test)}).save_to_disk(str(saved))
    with pytest.raises(InputError, match=r"'dev' split"):
        cli.run("grpo", ["--model_name_or_path", tiny_llama, "--dataset_name", str(saved),
                         "--dataset_test_split", "dev", "--eval_strategy", "steps", "--output_dir",
                         str(tmp_path / "out"), "--use_cpu", "true", "--reward_funcs", "exact_answer"])


def test_cli_sft_takes_chat_template_path_for_a_tokenizer_without_one(tmp_path, tiny_llama, no_model_load):
    """The "no chat template" error tells the user to give SFT one with `chat_template_path`: the CLI
    takes that path (TRL installs the template), and only conversational data needs a template."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(cfg))
    template = tmp_path / "chatml.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}?"}],
                                        "completion": [{"role": "assistant", "content": str(i)}]}) + "\n"
                            for i in range(4)))
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"{i} plus one is {i + 1}."}) + "\n" for i in range(4)))
    args = ["--model_name_or_path", str(base), "--use_cpu", "true", "--max_steps", "1"]
    with pytest.raises(InputError, match="has no chat template, and the data is conversational"):
        cli.run("sft", [*args, "--dataset_name", str(chat), "--output_dir", str(tmp_path / "o1")])
    for i, extra in enumerate((["--dataset_name", str(chat), "--chat_template_path", str(template)],
                               ["--dataset_name", str(text)])):  # every check passed: the model load is next
        with pytest.raises(AssertionError, match="a model was loaded"):
            cli.run("sft", [*args, *extra, "--output_dir", str(tmp_path / f"out{i}")])


# ---------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------

def test_rewards_resolve_like_trl_grpo_plus_grpotrl_names(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    import my_rewards

    from trl.rewards import accuracy_reward, think_format_reward

    funcs = resolve.resolve_reward_funcs(["exact_answer", "accuracy_reward", "think_format_reward",
                                             "my_rewards.short_answer"])
    assert funcs == [rules.exact_answer_reward, accuracy_reward, think_format_reward, my_rewards.short_answer]
    assert resolve.resolve_reward_funcs(["format"], reward_model="some/reward-model") == [
        "some/reward-model", rules.format_reward]  # the reward model first, as trl grpo puts it
    assert resolve.resolve_reward_funcs(None, reward_model="rm") == ["rm"]
    per_task = resolve.resolve_reward_funcs(["a:my_rewards.short_answer", "b:get_soft_overlong_punishment"])
    assert per_task["a"] == [my_rewards.short_answer] and callable(per_task["b"][0])


def test_reward_errors_list_the_options():
    with pytest.raises(InputError, match=r"GRPO needs at least one reward.*reward_model_name_or_path"):
        resolve.resolve_reward_funcs(None)
    with pytest.raises(InputError, match=r"Unknown reward function\(s\) \['exact'\].*Known: \['j', 'exact_answer'"):
        resolve.resolve_reward_funcs(["exact"], judges={"j": lambda **kw: []})
    with pytest.raises(InputError, match=r"cannot import module 'no_such_lib.rewards'.*PYTHONPATH"):
        resolve.resolve_reward_funcs(["no_such_lib.rewards.f"])
    with pytest.raises(InputError, match=r"has no callable 'nope'; its callables: \[.*'exact_answer_reward'"):
        resolve.resolve_reward_funcs(["grpotrl.rewards.rules.nope"])
    with pytest.raises(InputError, match="scores every row, but `reward_funcs` gives rewards per task"):
        resolve.resolve_reward_funcs(["a:format"], reward_model="rm")
    with pytest.raises(InputError, match=r"Judge name\(s\) \['format'\].*also built-in"):
        resolve.resolve_reward_funcs(["format"], judges={"format": lambda **kw: []})


@pytest.mark.parametrize("entry, expected", [
    ("os.system", r"reward_funcs entry 'os\.system': Reward posix\.system\(command\) cannot be called as TRL calls a "
                  r"reward function"),
    ("a:os.system", r"reward_funcs entry 'a:os\.system': Reward posix\.system\(command\) cannot be called"),
    ("collections.Counter", r"reward_funcs entry 'collections\.Counter': Reward collections\.Counter is a class"),
    ("builtins.getattr", r"reward_funcs entry 'builtins\.getattr': Reward builtins\.getattr: its signature cannot "
                         r"be read"),
    ("a:no_such_lib.rewards.f", r"reward_funcs entry 'a:no_such_lib\.rewards\.f': cannot import module "
                                r"'no_such_lib\.rewards'"),
    ("grpotrl.rewards.rules.exact_answer", r"reward_funcs entry 'grpotrl\.rewards\.rules\.exact_answer': module "
                                           r"'grpotrl\.rewards\.rules' \(\S+rules\.py\) has no callable 'exact_answer' "
                                           r"\(did you mean 'exact_answer_reward'\?\)"),
    ("os.sep", r"reward_funcs entry 'os\.sep': .* has no callable 'sep'.*; its callables: \[.*\] and \d+ more\.$"),
    (".my_reward", r"reward_funcs entry '\.my_reward' is not a dotted import path: write it as module\.function"),
    ("my-lib.f", r"reward_funcs entry 'my-lib\.f' is not a dotted import path"),
])
def test_a_reward_entry_that_cannot_be_used_is_named_as_the_recipe_writes_it(entry, expected):
    """``os.system`` resolves to ``posix.system``: the error leads with the entry as written (task prefix
    included), then what it resolved to and why TRL could not call it."""
    with pytest.raises(InputError, match="^" + expected):
        resolve.resolve_reward_funcs([entry])


# ---------------------------------------------------------------------------------------------
# Judges
# ---------------------------------------------------------------------------------------------

HTTP = {"base_url": "http://127.0.0.1:9/v1", "model": "m", "rubric": "fairness"}


def test_judges_parse_into_http_judges_and_local_specs(tmp_path, tiny_llama):
    (tmp_path / "crit.txt").write_text("Grade whether the answer is polite.")
    fields = {"name": "kind", "system": "Grade kindness. VERDICT: <1-3>", "low": 1, "high": 3,
              "template": "Q: {prompt}\nA: <response>{completion}</response>\nRef: {ref}\nVERDICT?",
              "columns": {"ref": "answer"}, "examples": [{"prompt": "p", "completion": "c", "ref": "r", "verdict": 3}]}
    (tmp_path / "kind.yaml").write_text(yaml.safe_dump(fields))
    judges = parse_judges({
        "fair": {**HTTP, "max_concurrency": 2, "timeout": 5, "max_retries": 0, "max_tokens": 8, "max_reply_bytes": 4096},
        "facts": {**HTTP, "rubric": "hallucination", "rubric_columns": {"reference": "answer"}},
        "polite": {**HTTP, "rubric": str(tmp_path / "crit.txt")},
        "inline": {**HTTP, "rubric": "Grade whether the answer is short and correct."},
        "kind": {**HTTP, "rubric": str(tmp_path / "kind.yaml")},
        "local": {"model_path": tiny_llama, "rubric": "fairness", "batch_size": 2},
    })
    fair = judges["fair"]
    assert isinstance(fair, HttpJudge) and fair.rubric is FAIRNESS and fair.name == "fair"
    assert (fair.max_concurrency, fair.timeout, fair.max_retries, fair.max_tokens) == (2, 5.0, 0, 8)
    assert fair.max_reply_bytes == 4096 and judges["facts"].max_reply_bytes == 1 << 20  # the recipe key, the default
    assert judges["facts"].rubric.columns == {"reference": "answer"} and judges["facts"].rubric.system == \
        HALLUCINATION.system
    assert judges["polite"].rubric.system.startswith("Grade whether the answer is polite. You never answer")
    assert judges["polite"].rubric.name == "polite" and "VERDICT: <1-5>" in judges["inline"].rubric.template
    assert judges["kind"].rubric.high == 3 and judges["kind"].rubric.examples[0]["verdict"] == 3
    assert isinstance(judges["local"], LocalJudgeSpec) and judges["local"].batch_size == 2
    # the command line gives JSON
    assert list(parse_judges(json.dumps({"fair": HTTP}))) == ["fair"]


@pytest.mark.parametrize("settings, error", [
    ({"model": "m", "rubric": "fairness"}, "needs exactly one of `base_url`"),
    ({**HTTP, "model_path": "x"}, "needs exactly one of `base_url`"),
    ({**HTTP, "timeout_s": 3}, r"Unknown key\(s\) 'timeout_s' \(did you mean 'timeout'\?\)"),
    ({**HTTP, "rubric": "fairnes"}, r"not a built-in rubric \['fairness', 'hallucination'\] \(did you mean 'fairness'"),
    ({**HTTP, "rubric": "missing.yaml"}, "file 'missing.yaml' does not exist"),
    ({**HTTP, "rubric": {"system": "s", "template": "{prompt} {completion} {context}"}},
     r"template fills \['completion', 'context', 'prompt'\].*rubric_columns"),
    ({"base_url": "u", "rubric": "fairness"}, "has no `model`"),
    ({**HTTP, "timeout": "soon"}, r"timeout must be a number, got 'soon'"),
    ({**HTTP, "max_reply_bytes": 1.5}, r"max_reply_bytes must be an integer, got 1.5"),
    ({**HTTP, "api_key_env": "JUDGE_KEY_NOT_SET_ANYWHERE"}, "'JUDGE_KEY_NOT_SET_ANYWHERE'.* is not set"),
    ({"model_path": "/no/such/judge", "rubric": "fairness"},
     r"^judges\.j\.model_path '/no/such/judge': Model dir '/no/such/judge' does not exist"),
])
def test_bad_judge_settings_are_clear_errors(settings, error):
    with pytest.raises(InputError, match=error):
        parse_judges({"j": settings})


@pytest.mark.parametrize("settings", [
    {**HTTP, "api_key": SECRET}, {**HTTP, "api_token": SECRET}, {**HTTP, "api_key_env": SECRET},
    {**HTTP, "headers": {"Authorization": SECRET}},
])
def test_an_api_key_in_a_recipe_is_refused_without_being_shown(settings, tmp_path, smollm2_path, no_model_load,
                                                               capsys):
    with pytest.raises(InputError) as err:
        parse_judges({"j": settings})
    assert SECRET not in str(err.value)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model_name_or_path": smollm2_path, "output_dir": str(tmp_path / "out"),
                                      "use_cpu": True, "judges": {"j": settings}, "reward_funcs": ["j"]}))
    with pytest.raises(SystemExit):
        cli.main(["grpo", "--config", str(recipe)])
    shown = capsys.readouterr()
    assert "error" in shown.err and SECRET not in shown.out + shown.err


def test_judge_columns_are_checked_against_the_dataset():
    judges = parse_judges({"facts": {**HTTP, "rubric": "hallucination", "rubric_columns": {"reference": "context"}}})
    funcs = resolve.resolve_reward_funcs(["hallucination:facts", "fairness:format"], judges)
    assert funcs["hallucination"] == [judges["facts"]]
    with pytest.raises(InputError, match=r"Judge 'facts' \(rubric 'hallucination'\) reads the dataset column\(s\) "
                                         r"\['context'\].*rubric_columns"):
        resolve.check_reward_columns(funcs, load_shipped("multitask"), "train")
    good = parse_judges({"facts": {**HTTP, "rubric": "hallucination", "rubric_columns": {"reference": "answer"}}})
    resolve.check_reward_columns(resolve.resolve_reward_funcs(["facts"], good), load_shipped("multitask"),
                                    "train")


# ``python -m MODULE grpo --help`` for each module, in one fresh interpreter: runpy.run_module(run_name="__main__")
# is what ``-m`` runs (a package without __main__ fails it the same way); the second pays no torch/TRL import.
HELP_OF_EACH = """
import contextlib, io, json, runpy, sys

results = {}
for module in sys.argv[1:]:
    sys.argv, out, code = [module, "grpo", "--help"], io.StringIO(), None
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit_:
            code = exit_.code
    results[module] = {"code": code, "stdout": out.getvalue()}
print(json.dumps(results))
"""
HELP_MODULES = ["grpotrl.cli", "grpotrl"]


@pytest.fixture(scope="module")
def help_of_each() -> dict:
    out = subprocess.run([sys.executable, "-c", HELP_OF_EACH, *HELP_MODULES], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", HELP_MODULES)
def test_help_describes_datasets_rewards_and_judges(module, help_of_each):
    """``python -m grpotrl`` is the ``grpotrl`` command too (it was 'No module named grpotrl.__main__')."""
    out = help_of_each[module]
    assert out["code"] == 0, out
    text = " ".join(out["stdout"].split())
    for phrase in ("--dataset_config", "save_to_disk", "Hugging Face Hub dataset id", "--reward_model_name_or_path",
                   "dotted import path", "--judges", "api_key_env", "rubric_columns"):
        assert phrase in text, phrase


# huggingface_hub 2.x imports httpx2 itself, so grpotrl's imports alone are refused it here; huggingface_hub
# 1.x (which TRL 1.16 accepts) imports httpx, and there no package imports httpx2 at all.
WITHOUT_HTTPX2 = """
import builtins

real_import = builtins.__import__


def without_httpx2(name, globals=None, *args, **kwargs):
    if name.partition(".")[0] == "httpx2" and (globals or {}).get("__name__", "").startswith("grpotrl"):
        raise ModuleNotFoundError("No module named 'httpx2'", name="httpx2")
    return real_import(name, globals, *args, **kwargs)


builtins.__import__ = without_httpx2
import grpotrl.cli
from grpotrl.errors import InputError
from grpotrl.rewards.recipe import parse_judges

try:
    grpotrl.cli.main(["sft", "--help"])
except SystemExit as exit_:
    print("help exit", exit_.code)
try:
    parse_judges({"j": {"base_url": "http://127.0.0.1:9/v1", "model": "m", "rubric": "fairness"}})
except InputError as err:
    print("InputError:", err)
"""


def test_the_cli_runs_without_the_judge_extra_and_an_http_judge_says_what_to_install():
    """Without httpx2 (the ``judge`` extra) ``grpotrl sft`` loads and answers --help; a recipe's HTTP judge is
    an InputError naming the package and the extra, where it is built (before any model loads)."""
    out = subprocess.run([sys.executable, "-c", WITHOUT_HTTPX2], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--dataset_name" in out.stdout and "help exit 0" in out.stdout
    assert re.search(r"InputError: (judges\.j: )?HttpJudge needs the package httpx2", out.stdout), out.stdout
    assert "pip install 'grpotrl[judge]'" in out.stdout


# ---------------------------------------------------------------------------------------------
# Bad input is one `grpotrl CMD: error:` line (exit 2) before any weights are read
# ---------------------------------------------------------------------------------------------

def cli_error(capsys, argv: list[str]) -> str:
    """The one error line ``grpotrl ...`` prints for ``argv`` (exit 2, nothing else on stderr
    but progress bars)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln or "Traceback" in ln]
    assert exit_.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"grpotrl {argv[0]}: error: "), lines[0]
    return lines[0]


def recipe(tmp_path, model: str, text: str = "", name: str = "recipe.yaml", **fields) -> str:
    path = tmp_path / name
    body = {"model_name_or_path": model, "output_dir": str(tmp_path / "out"), "use_cpu": True,
            "reward_funcs": ["exact_answer"], **fields}
    path.write_text(yaml.safe_dump(body) + text)
    return str(path)


@pytest.mark.parametrize("text, expected", [
    ("learning_rate: [1]\n", r"learning_rate: \[1\] is a list, but learning_rate takes a number"),
    ("bf16: 2\n", r"bf16: 2 is an int, but bf16 takes true or false"),
    ("max_steps: 1.5\n", r"max_steps: 1.5 is a float, but max_steps takes an integer"),
    ("learning_rate: .nan\n", r"learning_rate: \.nan is a NaN, but learning_rate takes a number"),
    ("reward_weights: [1, .nan]\n", r"reward_weights: \[1, \.nan\] is a list"),
    ("learning_rate: fast\n", r"learning_rate: 'fast' is a str, but learning_rate takes a number"),
    ("use_peft: maybe\n", r"use_peft: 'maybe' is a str, but use_peft takes true or false"),
    ("lora_r: 1.5\n", r"lora_r: 1.5 is a float, but lora_r takes an integer"),
    ("report_to: 3\n", r"report_to: 3 is an int, but report_to takes null or a string or a list of strings"),
    ("logging_steps: {a: 1}\n", r"logging_steps: \{'a': 1\} is a dict"),
    ("reward_funcs: [1, 2]\n", r"reward_funcs: \[1, 2\] is a list, but reward_funcs takes a list of strings"),
    ("dataset_name: 7\n", r"dataset_name: 7 is an int, but dataset_name takes a string \(quote it"),
    ("max_steps: true\n", r"max_steps: true is a bool, but max_steps takes an integer"),
])
def test_recipe_value_of_the_wrong_type_is_one_error_naming_field_value_and_type(
        text, expected, tmp_path, smollm2_path, no_model_load, capsys):
    """argparse converts only strings, so YAML values reached the trainer as they were."""
    base = yaml.safe_dump({"model_name_or_path": smollm2_path, "output_dir": str(tmp_path / "out"), "use_cpu": True})
    (tmp_path / "r.yaml").write_text(base + text)
    line = cli_error(capsys, ["grpo", "--config", str(tmp_path / "r.yaml")])
    assert re.search(r"Recipe \S+r.yaml: " + expected, line), line


def test_recipe_values_argparse_would_convert_pass(tmp_path):
    """A quoted number, an int for a float field, one string for a list of strings, yes/no for a bool."""
    path = tmp_path / "r.yaml"
    path.write_text("learning_rate: '1.0e-5'\nbeta: 0\nreward_funcs: exact_answer\nuse_peft: 'yes'\n"
                    "lora_target_modules: all-linear\nreport_to: none\nmax_steps: -1\n"
                    f"output_dir: {tmp_path / 'out'}\n")
    script_args, args, model_args = cli.parse_args("grpo", ["--config", str(path)])
    assert args.learning_rate == 1e-5 and model_args.use_peft is True and args.beta == 0


@pytest.mark.parametrize("value, expected", [
    ({"reward_weights": [1.0, "x"]}, r"reward_weights: \[1\.0, 'x'\] is a list, but reward_weights takes a list of "
                                     r"numbers or null \(reward_weights\[1\] is 'x', a str\)"),
    ({"reward_weights": [1, float("nan")]}, r"reward_weights: \[1, \.nan\] is a list, .* \(reward_weights\[1\] is \.nan, "
                                            r"a NaN\)"),
    ({"report_to": ["wandb", 3]}, r"report_to: \['wandb', 3\] is a list, but report_to takes null or a string or a list "
                                  r"of strings \(report_to\[1\] is 3, an int\)"),
    ({"liger_kernel_config": {"rope": 2}}, r"liger_kernel_config: \{'rope': 2\} is a dict, but liger_kernel_config "
                                           r"takes a mapping \(keys: strings, values: true or false\) or null "
                                           r"\(liger_kernel_config\['rope'\] is 2, an int\)"),
    ({"model_init_kwargs": {1: "bf16"}}, r"model_init_kwargs: \{1: 'bf16'\} is a dict, .*\(model_init_kwargs has the "
                                         r"key 1, an int\)"),
    ({"eval_steps": "often"}, r"eval_steps: 'often' is a str, but eval_steps takes a number or null\."),
    ({"dataset_config": 3}, r"dataset_config: 3 is an int, but dataset_config takes a string or null \(quote it"),
    ({"trackio_static_space_id": True}, r"trackio_static_space_id: true is a bool, but trackio_static_space_id takes "
                                        r"a string or null or one of false"),
    ({"bf16": 2, "max_steps": 1.0}, r"bf16: 2 is an int, but bf16 takes true or false or null; max_steps: 1\.0 is a "
                                    r"float, but max_steps takes an integer \(write 1\)\."),
])
def test_recipe_value_of_the_wrong_type_names_the_wrong_item(value, expected):
    """Inside a list or mapping the error names the wrong item by index or key (the value itself is
    shown too); an Optional field takes null besides its type, a Literal one its choices."""
    from grpotrl.configs.recipe_types import check_recipe_types

    with pytest.raises(InputError, match=r"^Recipe r\.yaml: " + expected):
        check_recipe_types(value, cli.make_parser("grpo").dataclass_types, "r.yaml")


def test_recipe_and_config_values_that_passed_before_pass(tmp_path):
    """An int for a float, inf (the range checks judge it), a quoted number, yes for a bool, one string for
    a list of strings, 'auto' or true where TRL takes them beyond the annotation, False for the Literal,
    an enum's value in a list, null for an Optional; in Python also a tuple for a list and numpy's ints."""
    import numpy as np

    import grpotrl
    from grpotrl.configs.recipe_types import check_recipe_types

    check_recipe_types({"reward_weights": [1, 2.5], "max_grad_norm": float("inf"), "learning_rate": "1e-5",
                        "use_peft": "Yes", "reward_funcs": "exact_answer", "padding_free": "auto",
                        "scale_rewards": True, "trackio_static_space_id": False, "debug": ["underflow_overflow"],
                        "liger_kernel_config": {"rope": True}, "model_init_kwargs": {"dtype": "float32"},
                        "eval_steps": None, "max_steps": -1}, cli.make_parser("grpo").dataclass_types, "r.yaml")
    args = grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, reward_weights=(1, 2.0),
                              logging_steps=np.int64(2))
    assert args.reward_weights == (1, 2.0) and args.logging_steps == 2


def test_config_written_with_an_equals_sign_reads_the_recipe(tmp_path, smollm2_path, no_model_load, capsys):
    """argparse takes `--key=value` for every key, but TrlParser looks for `--config` alone: `grpotrl grpo
    --config=recipe.yaml` was refused as an unknown argument 'config'. The recipe's dataset error shows it is read."""
    path = recipe(tmp_path, smollm2_path, dataset_name="gad_toy", eval_strategy="steps", max_steps=3)
    for argv in (["grpo", "--config", path], ["grpo", f"--config={path}"], ["grpo", "--max_steps=4", f"--config={path}"]):
        line = cli_error(capsys, argv)
        assert "Dataset 'gad_toy' has splits ['train'], not 'test'" in line, line
    spaced = cli.parse_args("grpo", ["--config", path, "--learning_rate", "2e-5"])[1]
    joined = cli.parse_args("grpo", [f"--config={path}", "--learning_rate=2e-5"])[1]
    assert (joined.max_steps, joined.learning_rate, joined.output_dir) == (spaced.max_steps, 2e-5, spaced.output_dir)
    line = cli_error(capsys, ["grpo", f"--config={path}", "--config", path])
    assert "--config is given more than once: pass one recipe" in line, line


def test_command_line_value_of_the_wrong_type_is_one_error_line(tmp_path, capsys):
    line = cli_error(capsys, ["grpo", "--output_dir", str(tmp_path), "--learning_rate", "fast"])
    assert "Argument --learning_rate/--learning-rate: invalid float value: 'fast'" in line


@pytest.mark.parametrize("text, expected", [
    ("learning_rate: [1\n", r"not valid YAML at line \d+, column 1: expected ',' or '\]'.*flow sequence opened at "
                            r"line 1, column 16"),
    ("use_cpu: true\n\tmax_steps: 1\n", r"not valid YAML at line 2, column 1: found character '\\t'"),
    ("- learning_rate: 1\n", r"holds a YAML list, not a mapping of settings"),
    ("key: [unclosed\n  other: {\n", r"not valid YAML"),
])
def test_recipe_yaml_syntax_error_is_one_line_with_the_place(text, expected, tmp_path, capsys):
    (tmp_path / "r.yaml").write_text(text)
    line = cli_error(capsys, ["sft", "--config", str(tmp_path / "r.yaml")])
    assert re.search(expected, line), line


@pytest.mark.parametrize("text, expected", [
    ("max_steps: 1\nmax_steps: 2\n", r"sets 'max_steps' twice \(lines \d+ and \d+\)"),  # YAML kept 2: two steps ran
    ("judges:\n  j:\n    model: a\n    model: b\n", r"sets 'model' twice"),  # inside a judge's settings too
])
def test_recipe_key_set_twice_is_one_error_line_before_the_load(text, expected, tmp_path, tiny_llama, no_model_load,
                                                                capsys):
    line = cli_error(capsys, ["grpo", "--config", recipe(tmp_path, tiny_llama, text)])
    assert re.search(expected, line), line


def test_a_config_path_that_is_missing_or_a_folder_says_which(tmp_path, capsys):
    """``--config`` naming no file said "needs a recipe YAML file" whether the path was mistyped, a folder, or
    missing after the flag; each now says which, and a missing file where it was looked for."""
    line = cli_error(capsys, ["grpo", "--config", str(tmp_path / "nonexist.yaml")])
    assert f"--config {tmp_path / 'nonexist.yaml'}: no such file" in line, line
    line = cli_error(capsys, ["grpo", "--config", str(tmp_path)])
    assert "not a file (a directory?)" in line, line
    for argv in (["grpo", "--config"], ["grpo", "--config", "--max_steps", "1"]):
        line = cli_error(capsys, argv)
        assert "--config needs a recipe YAML file after it, got nothing" in line, line


def test_an_argparse_error_ends_in_one_period(tmp_path, capsys):
    """argparse's own messages end in a period or not: the line had two where they did."""
    for message in ("expected one argument", "ambiguous option: --x could match --xa, --xb."):
        with pytest.raises(InputError) as err:
            cli._argparse_error(message)
        assert str(err.value).endswith(". `--help` describes every key.") and ".." not in str(err.value), err.value
    line = cli_error(capsys, ["grpo", "--output_dir", str(tmp_path), "--learning_rate"])
    assert "Argument --learning_rate/--learning-rate: expected one argument. `--help`" in line, line


def test_an_unknown_command_is_named(capsys):
    """``grpotrl grop`` printed the usage alone; it now names the command it did not know, exit 2; ``--help``
    prints the usage, exit 0."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["grop", "--config", "x.yaml"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "grpotrl: error: unknown command 'grop'; the commands are sft, grpo, gad, " \
        "report." in err, err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    err = capsys.readouterr().err
    assert exit_.value.code == 0 and "unknown command" not in err and err.strip(), err


def test_a_merge_key_may_be_overridden(tmp_path):
    (tmp_path / "r.yaml").write_text("base: &b {x: 1}\nc:\n  <<: *b\n  x: 2\n")
    assert recipe_types.read_recipe(str(tmp_path / "r.yaml"))["c"] == {"x": 2}


def test_an_empty_output_dir_is_one_error_line_before_the_load(tmp_path, tiny_llama, no_model_load, capsys,
                                                                monkeypatch):
    """``--output_dir "$OUT"`` with OUT unset: the Trainer's ``makedirs('')`` failed after the model loaded."""
    monkeypatch.chdir(tmp_path)
    line = cli_error(capsys, ["grpo", "--config", recipe(tmp_path, tiny_llama), "--output_dir", ""])
    assert "output_dir is empty" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]  # no lock file left in the working dir


def test_python_config_field_of_the_wrong_type_is_an_input_error(tmp_path):
    import grpotrl

    with pytest.raises(InputError, match=r"GRPOConfig: bf16: 2 is an int, but bf16 takes true or false"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), bf16=2)
    with pytest.raises(InputError, match=r"SFTConfig: logging_steps: 'often' is a str"):
        grpotrl.SFTConfig(output_dir=str(tmp_path), logging_steps="often")
    grpotrl.GRPOConfig(output_dir=str(tmp_path), logging_steps=2, report_to=["none"], use_cpu=True)  # plain values pass


@pytest.mark.parametrize("name, content, expected", [
    ("empty.jsonl", b"", r"Data file \S+empty.jsonl is empty \(0 bytes, no rows\)"),
    ("blank.json", b"\n\n", r"Data file \S+blank.json is empty"),
    ("empty.csv", b"", r"Data file \S+empty.csv is empty"),
    ("latin1.jsonl", b'{"prompt": "caf\xe9?", "answer": "1"}\n', r"is not UTF-8: byte b'\\xe9' at byte offset 15 "
                                                                   r"\(line 1, column 16: invalid continuation byte\)"),
    ("latin1.csv", b"prompt,answer\ncaf\xe9,1\n", r"is not UTF-8: .*\(line 2, column 4"),
    ("cut.jsonl", b'{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n',
     r"as the local path \S+cut.jsonl: line 2, column 27: Expecting value"),
    ("list.jsonl", b'{"prompt": "a", "answer": "1"}\n[1, 2]\n', r"line 2 is a JSON list, not an object"),
    ("cut.json", b'[{"prompt": "a", "answer": "1"}, {"prompt": ', r"cut.json: line 1, column 45: Expecting value"),
    ("fields.csv", b"prompt,answer\na,1\nb,2,3,4\n",
     r"ParserError: Error tokenizing data. C error: Expected 2 fields in line 3, saw 4"),
    ("quote.csv", b'prompt,answer\n"a,1\n', r"ParserError: .*EOF inside string"),
    ("junk.parquet", b"not parquet", r"ArrowInvalid: Parquet magic bytes not found"),
])
def test_unreadable_data_file_is_one_error_with_the_cause_file_and_line(name, content, expected, tmp_path,
                                                                         smollm2_path, no_model_load, capsys):
    """An empty JSONL was a StopIteration, non-UTF-8 data a UnicodeDecodeError at the first row read, a
    malformed file a generic DatasetGenerationError whose cause was 68 lines up."""
    (tmp_path / name).write_bytes(content)
    with pytest.raises(InputError, match=expected):
        load_splits(str(tmp_path / name))
    line = cli_error(capsys, ["grpo", "--config", recipe(tmp_path, smollm2_path, dataset_name=str(tmp_path / name))])
    assert re.search(expected, line), line


def test_a_folder_with_an_empty_file_names_it(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps(rows("train")[0]) + "\n")
    (tmp_path / "test.jsonl").write_text("")
    with pytest.raises(InputError, match=r"test.jsonl is empty"):
        load_splits(str(tmp_path))


def write_rows(tmp_path, data: list[dict], name: str = "data.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return str(path)


def test_mixed_chat_and_plain_prompts_are_refused_before_load(tmp_path, smollm2_path, tiny_llama, no_model_load,
                                                              capsys):
    """A mix failed at the first step with `TypeError: string indices must be integers`."""
    import grpotrl

    data = [{"prompt": "plain?", "answer": "1"}, *rows("train", 2), {"prompt": "also plain", "answer": "2"}]
    expected = r"mixes chat prompts \(lists of messages: rows 1, 2\) with plain-text prompts \(rows 0, 3\)"
    path = write_rows(tmp_path, data)
    line = cli_error(capsys, ["grpo", "--config", recipe(tmp_path, smollm2_path, dataset_name=path)])
    assert re.search(expected, line), line
    with pytest.raises(InputError, match=expected):  # datasets' JSON loader keeps each row's own kind
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=rules.exact_answer_reward,
                            args=grpotrl.GRPOConfig(output_dir=str(tmp_path / "py"), use_cpu=True, report_to="none"),
                            train_dataset=load_splits(path)["train"])


def test_a_reward_column_empty_on_every_row_is_refused_and_on_some_rows_named(tmp_path, smollm2_path,
                                                                              no_model_load, capsys, caplog):
    """Every `answer` empty trained with zero signal and no word."""
    from grpotrl.rewards.resolve import check_reward_signal

    useless = [{**r, "answer": value} for r, value in zip(rows("train", 4), ["", None, "  ", ""])]
    line = cli_error(capsys, ["grpo", "--config", recipe(tmp_path, smollm2_path,
                                                         dataset_name=write_rows(tmp_path, useless))])
    assert "Column 'answer' of the 'train' split, which reward exact_answer_reward reads, is empty or None on " \
           "every row it scores (4 rows)" in line
    some = Dataset.from_list([{**r, "answer": value} for r, value in zip(rows("train", 4), ["1", "", "2", None])])
    with caplog.at_level("WARNING"):
        check_reward_signal([rules.exact_answer_reward], some, "train")
    assert "empty or None on 2 of 4 rows (rows 1, 3)" in caplog.text
    # per task: a column only one task's reward reads is checked on that task's rows
    multitask = load_shipped("multitask")
    caplog.clear()
    check_reward_signal({"hallucination": [rules.exact_answer_reward], "fairness": [rules.even_handed_reward]},
                        multitask, "train")
    assert "answer" not in caplog.text


def test_a_prompt_longer_than_the_context_is_refused_naming_rows(tmp_path, tiny_llama, no_model_load, capsys):
    """A prompt longer than the model's context passed every check. tiny_llama's context is 512 tokens
    (max_position_embeddings, read from its config)."""
    import grpotrl

    data = [*rows("train", 3), {"prompt": [{"role": "user", "content": "word " * 600}], "answer": "1"}]
    path = write_rows(tmp_path, data)
    line = cli_error(capsys, ["grpo", "--config", recipe(tmp_path, tiny_llama, dataset_name=path)])
    assert re.search(r"longer than the model's context of 512 tokens \(max_position_embeddings in the config of "
                     r"\S+\): row 3, with 6\d\d tokens", line), line
    with pytest.raises(InputError, match=r"context of 512 tokens .*row 3"):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=rules.exact_answer_reward,
                            args=grpotrl.GRPOConfig(output_dir=str(tmp_path / "py"), use_cpu=True, report_to="none"),
                            train_dataset=Dataset.from_list(data))


def test_unknown_task_label_is_refused_before_the_model_loads(tmp_path, smollm2_path, no_model_load, capsys):
    """A task label with no rewards was caught only at trainer init, after the model loaded."""
    line = cli_error(capsys, ["grpo", "--config", recipe(tmp_path, smollm2_path, dataset_name="multitask",
                                                         reward_funcs=["hallucination:exact_answer"])])
    assert "task(s) ['fairness'] in the data have no reward functions" in line


@pytest.mark.parametrize("disc, expected", [
    ("/no/such/discriminator", r"discriminator_model_name_or_path '/no/such/discriminator': Model dir .* does not "
                               r"exist"),
    ("nobody/no-discriminator", r"discriminator_model_name_or_path 'nobody/no-discriminator': Discriminator model "
                                r"'nobody/no-discriminator' is not in the local Hugging Face cache"),
])
def test_missing_gad_discriminator_is_refused_before_the_model_loads(disc, expected, tmp_path, smollm2_path,
                                                                      no_model_load, capsys):
    path = tmp_path / "gad.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": smollm2_path, "output_dir": str(tmp_path / "out"),
                                    "use_cpu": True, "dataset_name": "gad_toy",
                                    "discriminator_model_name_or_path": disc}))
    assert re.search(expected, cli_error(capsys, ["gad", "--config", str(path)]))


def test_checkpoint_without_tokenizer_files_says_so(tmp_path, tiny_llama, no_model_load, capsys):
    """transformers said to install sentencepiece or tiktoken."""
    import shutil

    import grpotrl

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if os.path.exists(os.path.join(tiny_llama, name)):
            shutil.copy(os.path.join(tiny_llama, name), ckpt / name)
    expected = r"Model dir \S+ckpt' has no tokenizer files \(none of \['tokenizer.json'.*saved without its tokenizer"
    line = cli_error(capsys, ["grpo", "--config", recipe(tmp_path, str(ckpt))])
    assert re.search(expected, line) and "sentencepiece or tiktoken" not in line, line
    with pytest.raises(InputError, match=expected):
        grpotrl.GRPOTrainer(model=str(ckpt), reward_funcs=rules.exact_answer_reward,
                            args=grpotrl.GRPOConfig(output_dir=str(tmp_path / "py"), use_cpu=True, report_to="none"),
                            train_dataset=Dataset.from_list(rows("train")))


def test_end_of_run_summary_never_fails_a_saved_run(tmp_path, smollm2_path, monkeypatch, capsys):
    """The summary crashed on a None metric after a successful save (exit 1, trainer.end() skipped).
    The trainer is a stand-in that 'trains' instantly and logs metrics a judge-only run can log."""
    import types

    import grpotrl

    calls = []

    class FakeTrainer:
        def __init__(self, **kwargs):
            self.args = kwargs["args"]
            self.state = types.SimpleNamespace(global_step=2, log_history=[
                {"reward": None, "completions/mean_length": "n/a"}, {"reward": float("nan")}, {"loss": [1]}, {}])
            self.accelerator = types.SimpleNamespace(print=print)

        def train(self, resume_from_checkpoint=None, overwrite_output_dir=False):
            return types.SimpleNamespace(metrics={"train_runtime": None})

        def save_model(self, output_dir):
            os.makedirs(output_dir, exist_ok=True)
            open(os.path.join(output_dir, "model.safetensors"), "w").close()

        def save_state(self):
            calls.append("save_state")

        def end(self):
            calls.append("end")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: object())
    monkeypatch.setattr(grpotrl, "GRPOTrainer", FakeTrainer)
    cli.main(["grpo", "--config", recipe(tmp_path, smollm2_path, max_steps=2)])  # returns: exit status 0
    out = capsys.readouterr().out
    assert calls == ["save_state", "end"] and "no metric logged at a logging step" in out
    assert "grpotrl grpo: 2 steps, stop ids" in out


@pytest.mark.parametrize("command, fields, expected", [
    ("grpo", {"temperature": 0}, r"temperature=0 \(int\): it must be a finite number > 0"),
    ("grpo", {"temperature": -0.5}, r"temperature=-0.5 \(float\): it must be"),
    ("gad", {"temperature": 0.0}, r"temperature=0.0 \(float\): it must be"),
    ("grpo", {"max_completion_length": 0}, r"max_completion_length=0 \(int\): it must be an integer >= 1"),
    ("grpo", {"num_generations": 0}, r"num_generations=0 \(int\): it must be an integer >= 2"),
    ("grpo", {"beta": -1.0}, r"beta=-1.0 \(float\): it must be a finite number >= 0"),
    ("sft", {"learning_rate": -1e-5}, r"learning_rate=-1e-05 \(float\): it must be a finite number >= 0"),
    ("sft", {"max_length": 0}, r"max_length=0 \(int\): it must be an integer >= 1"),
    ("grpo", {"importance_sampling_level": "seq"}, r"importance_sampling_level='seq': TRL 1.16 takes 'token', "
                                                   r"'sequence' \(did you mean 'sequence'\?\)"),
    ("grpo", {"scale_rewards": "grp"}, r"scale_rewards='grp': TRL 1.16 takes .*\(did you mean 'group'\?\)"),
    ("gad", {"vllm_importance_sampling_mode": "seq_mask"}, r"vllm_importance_sampling_mode='seq_mask': TRL 1.16 takes"),
    ("sft", {"packing_strategy": "bfd-split"}, r"packing_strategy='bfd-split': .*\(did you mean 'bfd_split'\?\)"),
    ("sft", {"truncation_mode": "keep_left"}, r"truncation_mode='keep_left': TRL 1.16 takes 'keep_start', 'keep_end'"),
    ("grpo", {"top_entropy_quantile": 1.5}, r"top_entropy_quantile=1.5 \(float\): it must be in \[0, 1\]"),
    ("grpo", {"health_patience": 0}, r"health_patience=0 \(int\): it must be an integer >= 1"),
    ("grpo", {"generation_kwargs": {"do_sample": False}}, r"generation_kwargs\['do_sample'\]=False: greedy decoding"),
    ("sft", {"max_length": 512.0}, r"max_length: 512.0 is a float, but max_length takes an integer or null "
                                   r"\(write 512\)"),
])
def test_settings_caught_after_the_load_before_now_stop_before_it(command, fields, expected, tmp_path, smollm2_path,
                                                                  no_model_load, capsys):
    """These were caught only after the model loaded (max_completion_length as `max_new_tokens`, a misspelled
    choice where TRL's trainer branches on it, max_length 512.0 when slicing), or inside TRL (num_generations 0:
    ZeroDivisionError), or never (health_patience 0, do_sample false trained on identical completions)."""
    extra = {"dataset_name": "gad_toy"} if command == "gad" else {}
    path = recipe(tmp_path, smollm2_path, **extra, **fields)
    if command != "grpo":  # only grpo takes reward_funcs
        body = yaml.safe_load(open(path))
        body.pop("reward_funcs")
        open(path, "w").write(yaml.safe_dump(body))
    line = cli_error(capsys, [command, "--config", path])
    assert re.search(expected, line) and "max_new_tokens" not in line, line


def test_recipe_env_variables_read_at_import_are_refused_and_others_set(tmp_path, smollm2_path, no_model_load,
                                                                        capsys, monkeypatch):
    """TrlParser sets a recipe's `env:` after torch, transformers and huggingface_hub were imported: HF_HUB_OFFLINE
    there was set in os.environ while huggingface_hub stayed online, OMP_NUM_THREADS left torch's threads as they
    were."""
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": 1, "WANDB_PROJECT": "mine"}
    line = cli_error(capsys, ["grpo", "--config", recipe(tmp_path, smollm2_path, env=env)])
    assert re.search(r"Recipe \S+recipe.yaml: env: sets HF_HUB_OFFLINE, OMP_NUM_THREADS, which .* read when they are "
                     r"imported, before the recipe is read.*Export them before the command instead "
                     r"\(`HF_HUB_OFFLINE=<value> OMP_NUM_THREADS=<value> grpotrl \.\.\.`", line), line
    token = "hf_SeCrEtToKeN0123456789abcdef"  # the error shows names, never values: HF_TOKEN is one of them
    line = cli_error(capsys, ["grpo", "--config", recipe(tmp_path, smollm2_path, env={"HF_TOKEN": token})])
    assert "env: sets HF_TOKEN," in line and "SeCrEt" not in line, line
    for name in ("CUDA_VISIBLE_DEVICES", "TRANSFORMERS_OFFLINE", "MKL_NUM_THREADS", "HUGGINGFACE_HUB_CACHE"):
        assert f"env: sets {name}," in cli_error(capsys, ["grpo", "--config", recipe(tmp_path, smollm2_path,
                                                                                      env={name: "0"})])
    for name in ("WANDB_PROJECT", "TOKENIZERS_PARALLELISM"):  # TrlParser writes os.environ: restored after the test
        monkeypatch.setenv(name, "")
    cli.parse_args("grpo", ["--config", recipe(tmp_path, smollm2_path,
                                               env={"WANDB_PROJECT": "mine", "TOKENIZERS_PARALLELISM": "false"})])
    assert os.environ["WANDB_PROJECT"] == "mine" and os.environ["TOKENIZERS_PARALLELISM"] == "false"


def test_recipe_fsdp_as_a_list_of_options_is_taken_as_trl_takes_it(tmp_path):
    """transformers takes `fsdp: [full_shard, auto_wrap]` (and turns it into fsdp=True); the type check refused
    it. Other types stay refused."""
    from grpotrl.configs.recipe_types import check_recipe_types

    for command in ("grpo", "sft"):
        check_recipe_types({"fsdp": ["full_shard", "auto_wrap"]}, cli.make_parser(command).dataclass_types, "r.yaml")
    with pytest.raises(InputError, match=r"fsdp: \[1\] is a list, but fsdp takes .*a list of strings"):
        check_recipe_types({"fsdp": [1]}, cli.make_parser("grpo").dataclass_types, "r.yaml")


def test_output_dir_that_is_a_file_is_one_error_line_and_the_file_is_kept(tmp_path, smollm2_path, no_model_load,
                                                                         capsys):
    (tmp_path / "afile").write_text("mine")
    line = cli_error(capsys, ["grpo", "--config", recipe(tmp_path, smollm2_path, output_dir=str(tmp_path / "afile"),
                                                         overwrite_output_dir=True)])
    assert "is a file, not a directory" in line and (tmp_path / "afile").read_text() == "mine"


def test_header_only_csv_empty_folder_and_empty_recipe_say_so(tmp_path, capsys):
    (tmp_path / "h.csv").write_text("prompt,answer\n")
    with pytest.raises(InputError, match=r"h.csv: it holds no rows \(a header line at most\)"):
        load_splits(str(tmp_path / "h.csv"))
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.md").write_text("x")
    with pytest.raises(InputError, match=r"is a folder with no data files \(found: notes.md\)"):
        load_splits(str(tmp_path / "folder"))
    (tmp_path / "r.yaml").write_text("# nothing yet\n")
    assert re.search(r"Recipe \S+r.yaml is empty", cli_error(capsys, ["grpo", "--config", str(tmp_path / "r.yaml")]))


def test_python_api_refuses_a_reward_column_empty_on_every_row(tmp_path, tiny_llama):
    import grpotrl

    data = Dataset.from_list([{**r, "answer": ""} for r in rows("train", 4)])
    args = grpotrl.GRPOConfig(output_dir=str(tmp_path / "py"), use_cpu=True, report_to="none")
    with pytest.raises(InputError, match=r"Column 'answer' .*exact_answer_reward reads, is empty or None on every row"):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=rules.exact_answer_reward, args=args, train_dataset=data)
    tasks = Dataset.from_list([{**r, "task": t} for r, t in zip(data, ["a", "a", "b", "b"])])
    with pytest.raises(InputError, match=r"exact_answer_reward \(task 'a'\) reads, is empty or None on every row it "
                                         r"scores \(2 rows\)"):
        grpotrl.MultiTaskGRPOTrainer(model=tiny_llama, reward_funcs={"a": [rules.exact_answer_reward],
                                                                     "b": [rules.format_reward]},
                                     args=args, train_dataset=tasks)


def test_python_api_output_dir_file_and_missing_discriminator_stop_before_the_load(tmp_path, tiny_llama):
    import grpotrl
    from grpotrl.data import load_shipped

    (tmp_path / "afile").write_text("mine")
    with pytest.raises(InputError, match=r"output_dir '\S+afile' is a file, not a directory"):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=rules.exact_answer_reward,
                            args=grpotrl.GRPOConfig(output_dir=str(tmp_path / "afile"), use_cpu=True, report_to="none"),
                            train_dataset=Dataset.from_list(rows("train")))
    with pytest.raises(InputError, match=r"output_dir '\S+afile' is a file"):
        grpotrl.SFTTrainer(model=tiny_llama, train_dataset=load_shipped("quickstart"),
                           args=grpotrl.SFTConfig(output_dir=str(tmp_path / "afile"), use_cpu=True, report_to="none"))
    assert (tmp_path / "afile").read_text() == "mine"
    args = grpotrl.GADConfig(output_dir=str(tmp_path / "gad"), use_cpu=True, report_to="none",
                             discriminator_model_name_or_path=str(tmp_path / "no-discriminator"))
    with pytest.raises(InputError, match=r"Model dir '\S+no-discriminator' does not exist"):
        grpotrl.GADTrainer(model=tiny_llama, args=args, train_dataset=load_shipped("gad_toy"))


def test_prompt_length_check_on_a_large_dataset_tokenizes_only_prompts_that_could_be_too_long(
        tmp_path, tiny_llama, smollm2_tokenizer, monkeypatch):
    from grpotrl.data import checks as preflight_data

    monkeypatch.setattr(preflight_data, "EXACT_ROWS", 2)  # 4 rows count as large here
    seen = []
    apply = smollm2_tokenizer.apply_chat_template
    monkeypatch.setattr(smollm2_tokenizer, "apply_chat_template", lambda m, **kw: seen.append(m) or apply(m, **kw))
    data = Dataset.from_list([*rows("train", 3), {"prompt": [{"role": "user", "content": "word " * 600}]}])
    with pytest.raises(InputError, match=r"context of 512 tokens .*: row 3, with 6\d\d tokens"):
        preflight_data.check_prompt_lengths(data, "train", smollm2_tokenizer, tiny_llama)
    assert len(seen) == 1  # the three short prompts were not rendered


# ---------------------------------------------------------------------------------------------
# A rubric file that is not plain YAML, a reward that is not a reward function: one error line
# before the model loads (they were tracebacks, the non-reward only after load and generation)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, content, expected", [
    ("tag.yaml", b"!!python/object/apply:os.system ['touch PWNED']\n",
     r"tag\.yaml\): not plain YAML: could not determine a constructor for the tag .*python/object/apply:os\.system"
     r"' at line 1, column 1\. A rubric file holds plain values .* remove the tag\."),
    ("syntax.yaml", b"system: [unclosed\ntemplate: x\n",
     r"syntax\.yaml\): not valid YAML: expected ',' or '\]', but got ':' at line 2, column 9\. Fix the file"),
    ("list.yaml", b"- system: a\n- template: b\n",
     r"list\.yaml\): the file holds a list, not a mapping of Rubric fields .* at the top level\."),
    ("latin1.yaml", "system: caf\u00e9\ntemplate: x\n".encode("latin-1"),
     r"latin1\.yaml\): the file is not UTF-8 text \(byte 0xe9 at offset 11\)\. Save it as UTF-8\."),
    ("types.json", b'{"system": ["a"], "template": "{prompt} {completion}", "low": "1"}',
     r"types\.json\): field\(s\) system \(list\), low \(str\) of the wrong type"),
    ("brace.yaml", b"system: s\ntemplate: '{prompt {completion}'\n",
     r": the rubric's template is not a format string \(unexpected '\{' in field name\)"),
])
def test_I8_rubric_file_that_is_not_plain_yaml_is_one_error_before_the_load(name, content, expected, tmp_path,
                                                                              smollm2_path, no_model_load, capsys):
    (tmp_path / name).write_bytes(content)
    judges = {"j": {"base_url": "http://127.0.0.1:9/v1", "model": "m", "rubric": str(tmp_path / name)}}
    line = cli_error(capsys, ["grpo", "--config", recipe(tmp_path, smollm2_path, judges=judges, reward_funcs=["j"])])
    assert re.search(r"grpotrl grpo: error: judges\.j.*" + expected, line), line
    assert not (tmp_path / "PWNED").exists() and not (ROOT / "PWNED").exists()


class CallableClass:
    def __call__(self, prompts, completions, **kwargs):
        return [0.0] * len(completions)


def no_keywords(prompts, completions):
    return [0.0] * len(completions)


@pytest.mark.parametrize("func, expected", [
    (os.system, r"Reward posix\.system\(command\) cannot be called as TRL calls a reward function, with the keywords "
                r"prompts, completions, .*\(got an unexpected keyword argument 'prompts'\)\. Give it the signature "
                r"def my_reward\(prompts, completions, \*\*kwargs\)"),
    (getattr, r"Reward builtins\.getattr: its signature cannot be read \(a builtin or C function\).*Wrap it in a "
              r"Python function def my_reward\(prompts, completions, \*\*kwargs\)"),
    (CallableClass, r"Reward test_cli_inputs\.CallableClass is a class, not a reward function: .*Pass an instance "
                    r"\(CallableClass\(\.\.\.\)\)"),
    (3, r"A reward in reward_funcs is 3 \(of type int\), not a function"),
    (no_keywords, r"no_keywords\(prompts, completions\) cannot be called as TRL calls a reward function.*"
                  r"\(got an unexpected keyword argument "),
])
def test_a_reward_that_trl_cannot_call_is_refused_before_the_load(func, expected, tmp_path, tiny_llama,
                                                                  no_model_load):
    """os.system passed the pre-load check and failed after the model loaded and generated."""
    import grpotrl

    with pytest.raises(InputError, match=expected):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=[func],
                            args=grpotrl.GRPOConfig(output_dir=str(tmp_path / "py"), use_cpu=True, report_to="none"),
                            train_dataset=Dataset.from_list(rows("train")))
    # a callable instance and a function with TRL's keywords pass the same check
    resolve.check_reward_callables([CallableClass(), rules.exact_answer_reward], ["prompt", "answer"])


def test_cli_reward_builtin_by_dotted_path_is_one_error_before_the_load(tmp_path, smollm2_path, no_model_load, capsys):
    line = cli_error(capsys, ["grpo", "--config", recipe(tmp_path, smollm2_path, reward_funcs=["os.system"])])
    assert re.search(r"grpotrl grpo: error: reward_funcs entry 'os\.system': Reward posix\.system\(command\) cannot be "
                     r"called as TRL calls a reward function", line), line


def test_no_reward_funcs_reaches_trls_own_rule(tmp_path, tiny_llama):
    """``reward_funcs=None`` is TRL's to judge (an ``environment_factory`` may own the reward; without one
    TRL raises "No reward source provided"): the callable check took None for a reward and refused it,
    which broke TRL's own test_no_reward_source_raises and environment-owned rewards."""
    import grpotrl

    resolve.check_reward_callables(None, ["prompt", "answer"])  # nothing to check
    with pytest.raises(ValueError, match="No reward source provided"):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=None,
                            args=grpotrl.GRPOConfig(output_dir=str(tmp_path / "py"), use_cpu=True, report_to="none"),
                            train_dataset=Dataset.from_list(rows("train")))


def test_cli_resuming_another_runs_checkpoint_does_not_replace_a_finished_run(tmp_path, capsys, tiny_llama,
                                                                              no_model_load):
    """``--resume_from_checkpoint`` lifts the finished-run refusal only for a checkpoint of that run: one from
    another output_dir would continue the other run and replace this one's model and log."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"weights")
    (out / "trainer_state.json").write_text('{"global_step": 5}')
    (out / "checkpoint-5").mkdir()
    (tmp_path / "other" / "checkpoint-1").mkdir(parents=True)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    line = cli_error(capsys, ["grpo", "--config", recipe(tmp_path, tiny_llama),
                              "--resume_from_checkpoint", str(tmp_path / "other" / "checkpoint-1")])
    assert "already holds a finished run of 5 steps" in line and "lies outside it" in line, line
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


@pytest.mark.parametrize("command", ["grpo", "sft", "gad"])
def test_command_line_false_reaches_a_field_that_takes_false_as_false(command, tmp_path):
    """``trackio_static_space_id`` takes a Space id or False (no static Space); HfArgumentParser hands the
    command line's ``false`` in as the string 'false', a Space of that name. It is False, as a recipe's
    ``false`` is; a Space id and any other text pass as typed."""
    out = str(tmp_path / "o")
    for typed, expected in (("false", False), ("False", False), ("me/dashboard", "me/dashboard")):
        args = cli.parse_args(command, ["--output_dir", out, "--trackio_static_space_id", typed])[1]
        assert args.trackio_static_space_id == expected and type(args.trackio_static_space_id) is type(expected)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"output_dir: {out}\ntrackio_static_space_id: false\n")
    assert cli.parse_args(command, ["--config", str(recipe)])[1].trackio_static_space_id is False
