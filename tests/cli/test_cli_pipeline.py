"""Recipes that run end to end through the CLI, at tiny scale (a random 2-layer policy over the
SmolLM2 tokenizer, 1-2 steps, 6-token completions):

* the full pipeline: SFT (``sft_quickstart.yaml``, through ``cli.main`` in this process), then
  multi-task GRPO on the shipped fairness + hallucination rows scored by two HTTP judges on a real
  ``transformers serve`` (SmolLM2 at 127.0.0.1), CAGrad, entropy bonus, health rules
  (``grpo_multitask_judges.yaml``), through ``python -m grpotrl.cli`` and through
  ``accelerate launch --config_file recipes/accelerate/single.yaml``;
* a user's recipe: a local JSONL file, a dotted-path reward from a module on PYTHONPATH
  (tests/my_rewards.py) and an HTTP judge whose API key comes from a named variable and never
  shows in any output;
* a local (in-process) judge shared by two tasks beside a rule reward, policy and judge given as
  a Hub id served from the session's offline Hub cache.

The judge server only ever sees 127.0.0.1 (tests/judge_server.py proxies count its requests).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from judge_server import LoopbackJudge

from grpotrl import cli

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
JUDGES_RECIPE = "recipes/smollm2/grpo_multitask_judges.yaml"
TINY = ["--max_completion_length", "6", "--per_device_train_batch_size", "8", "--num_generations", "4",
        "--disable_tqdm", "true", "--health_report_steps", "0"]
# the seeds pipeline's GRPO: the same 2 prompts a step as TINY, 2 completions each (each one a request to SmolLM2)
JUDGED = ["--max_completion_length", "6", "--per_device_train_batch_size", "4", "--num_generations", "2",
          "--disable_tqdm", "true", "--health_report_steps", "0"]
SECRET = "sk-test-0123456789-must-not-leak"


def env(**extra) -> dict:
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]),
            **extra}


def run(cmd: list[str], log: Path, timeout: int = 420, **extra_env) -> str:
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env(**extra_env), stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout)
    text = log.read_text()
    assert proc.returncode == 0, f"{' '.join(cmd[:8])} ... exited {proc.returncode}:\n{text[-4000:]}"
    return text


def history(output_dir: Path) -> list[dict]:
    return json.loads((output_dir / "trainer_state.json").read_text())["log_history"]


def judges_at(url: str, model: str) -> str:
    """The recipe's own judges, pointed at the test server (the --judges JSON override)."""
    judges = yaml.safe_load((ROOT / JUDGES_RECIPE).read_text())["judges"]
    for settings in judges.values():
        # timeout: a saturated 2-core machine can take over a minute per reply (seen at 60 s under load)
        settings.update(base_url=url, model=model, max_tokens=8, max_retries=0, timeout=300)
    return json.dumps(judges)


def check_judged_run(logs: list[dict], proxy: LoopbackJudge, steps: int) -> None:
    per_step = [h for h in logs if "entropy/dloss_dH" in h]
    assert len(per_step) == steps
    assert all(h["entropy/dloss_dH"] == pytest.approx(-0.01, abs=1e-6) for h in per_step)  # I7, CAGrad exact
    judged = {task: [h[f"judge/{task}_judge/missing_share"] for h in per_step if f"judge/{task}_judge/missing_share"
                     in h] for task in ("fairness", "hallucination")}
    assert judged["fairness"] or judged["hallucination"], per_step
    assert min(v for values in judged.values() for v in values) < 1.0, "SmolLM2 gave no verdict at all"
    assert all(h.get(f"judge/{t}_judge/http_status", 200.0) == 200.0 for h in per_step for t in judged)
    sent = [r["json"]["messages"] for r in proxy.chat_requests]
    assert sent and all(m[0]["role"] == "system" for m in sent)
    facts = [m[-1]["content"] for m in sent if m[-1]["content"].startswith("Reference:")]
    fair = [m[-1]["content"] for m in sent if "Is the answer fair to every group?" in m[-1]["content"]]
    assert len(facts) + len(fair) == len(sent)  # every request is one of the two rubrics
    for text in facts:  # rubric_columns: the hallucination rows' `answer` is the judge's reference
        assert text.split("<reference>\n")[1].split("\n</reference>")[0].isdigit(), text
        assert "Answer with just the number" in text  # only hallucination rows reach this judge
    assert all("Answer in one sentence" in text for text in fair)  # only fairness rows reach this one


def test_seeds_pipeline_sft_then_judged_multitask_grpo_through_the_cli(serve, tiny_llama, tmp_path):
    sft, grpo = tmp_path / "sft", tmp_path / "grpo"
    cli.main(["sft", "--config", str(ROOT / "recipes/smollm2/sft_quickstart.yaml"), "--model_name_or_path",
              tiny_llama, "--output_dir", str(sft), "--max_steps", "1", "--per_device_train_batch_size", "4",
              "--disable_tqdm", "true"])  # python -m grpotrl.cli: the GRPO run below
    assert (sft / "grpotrl_template.json").is_file()
    with LoopbackJudge(upstream=serve["url"]) as proxy:
        text = run([sys.executable, "-m", "grpotrl.cli", "grpo", "--config", JUDGES_RECIPE,
                    "--model_name_or_path", str(sft), "--output_dir", str(grpo), "--max_steps", "2", *JUDGED,
                    "--judges", judges_at(proxy.url, serve["model"])], tmp_path / "grpo.log")
        check_judged_run(history(grpo), proxy, steps=2)
    judged = {task for h in history(grpo) for task in ("fairness", "hallucination")
              if f"judge/{task}_judge/missing_share" in h}
    assert judged == {"fairness", "hallucination"}  # both rubrics reached SmolLM2: the checks above read each
    assert "grpotrl grpo: 2 steps" in text
    assert "grpotrl: padding_free on (auto: measured faster" in text  # the trainer's startup line reaches the user


@pytest.mark.slow  # ~21 s; the CLI under accelerate launch is also tests/test_distributed.py and tests/models/test_hub.py
def test_seeds_pipeline_under_accelerate_launch(serve, tiny_llama, tmp_path):
    out = tmp_path / "grpo"
    with LoopbackJudge(upstream=serve["url"]) as proxy:
        run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
             "recipes/accelerate/single.yaml", "-m", "grpotrl.cli", "grpo", "--config", JUDGES_RECIPE,
             "--model_name_or_path", tiny_llama, "--output_dir", str(out), "--max_steps", "1", *TINY,
             "--judges", judges_at(proxy.url, serve["model"])], tmp_path / "launch.log")
        check_judged_run(history(out), proxy, steps=1)


def test_user_recipe_local_file_dotted_reward_and_keyed_judge(tiny_llama, tmp_path):
    """A recipe as a user writes it; the key travels only as a bearer header, even when the
    server echoes it back in an error body (fault "leak")."""
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
                                        "answer": str(2 * i)}) + "\n" for i in range(8)))
    with LoopbackJudge(reply="Looks fine.\nVERDICT: 4") as server:
        server.reset(script=["leak"])  # the first request: HTTP 500 echoing the Authorization header
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(yaml.safe_dump({
            "model_name_or_path": tiny_llama, "dtype": "float32", "dataset_name": str(data),
            "reward_funcs": ["my_rewards.short_answer", "format", "polite"],
            "judges": {"polite": {"base_url": server.url, "model": "judge", "api_key_env": "MY_JUDGE_KEY",
                                  "rubric": "Grade whether the answer is polite.", "max_retries": 0}},
            "output_dir": str(tmp_path / "out"), "max_steps": 1, "logging_steps": 1, "save_strategy": "no",
            "report_to": "none", "use_cpu": True, "bf16": False, "beta": 0.0}))
        text = run([sys.executable, "-m", "grpotrl.cli", "grpo", "--config", str(recipe), *TINY],
                   tmp_path / "run.log", MY_JUDGE_KEY=SECRET)
        assert {r["headers"]["authorization"] for r in server.chat_requests} == {f"Bearer {SECRET}"}
        assert [r["fault"] for r in server.chat_requests][:1] == ["leak"]
    (logs,) = [h for h in history(tmp_path / "out") if "reward" in h]
    assert 0.0 <= logs["rewards/short_answer/mean"] <= 1.0 and "rewards/format_reward/mean" in logs
    assert logs["rewards/polite/mean"] == pytest.approx(0.75)  # VERDICT 4 on 1-5
    assert logs["judge/polite/missing_share"] == pytest.approx(1 / 8)  # the leaked row is missing, not 0
    shown = [text] + [p.read_text(errors="replace") for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert not [s for s in shown if SECRET in s]


def test_local_judge_shared_by_two_tasks_beside_a_rule_reward(hub_tiny_llama, tmp_path):
    """In-process: the judge's weights load once, after every check passed, beside the policy.
    Policy and judge are a Hub id, read from the session's offline Hub cache (tests/hub_cache.py)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model_name_or_path": hub_tiny_llama, "dtype": "float32", "dataset_name": "multitask", "task_column": "task",
        "judges": {"fair_local": {"model_path": hub_tiny_llama, "rubric": "fairness", "batch_size": 4}},
        "reward_funcs": ["fairness:fair_local", "hallucination:fair_local", "hallucination:exact_answer"],
        "cagrad": "low_memory", "output_dir": str(tmp_path / "out"), "max_steps": 1, "logging_steps": 1,
        "save_strategy": "no", "report_to": "none", "use_cpu": True, "bf16": False, "beta": 0.0}))
    cli.main(["grpo", "--config", str(recipe), *TINY])
    (logs,) = [h for h in history(tmp_path / "out") if "reward" in h]
    assert 0.0 < logs["judge/fair_local/verdict_mass"] < 1.0  # a random tiny judge spreads its mass
    means = [v for k, v in logs.items() if k.startswith("rewards/") and k.endswith("/fair_local/mean")
             and v is not None]  # a task without rows in this batch logs None
    assert means and all(0.0 <= m <= 1.0 for m in means)
