"""Shared test setup. Thread and offline settings are set before anything imports torch:
OpenMP reads ``OMP_WAIT_POLICY`` once, and a busy neighbour process slows an active-wait
torch 30-100x on 2 cores (see grpotrl/_threads.py). The whole session is offline against a Hugging
Face cache of its own (``HF_HUB_CACHE``, filled by ``tests/hub_cache.py``): Hub ids resolve through
the real loading code, and nothing a user has cached leaks in (``HF_DATASETS_CACHE`` too: ``datasets``'
prepared tables). ``serve`` is the real judge server of
tests/rewards/test_judges.py and tests/cli/test_cli_pipeline.py (one per module)."""

import os
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# A test's child process that imports this module (a worker script's ``from conftest import ...``) keeps the
# session's caches: it inherits them, and a fresh pair would be left behind (no session end removes it).
_OWNER = "GRPOTRL_TEST_CACHES_OWNER"
if os.environ.get(_OWNER) and os.path.isdir(os.environ.get("HF_HUB_CACHE", "")):
    HUB_CACHE, DATASETS_CACHE = os.environ["HF_HUB_CACHE"], os.environ["HF_DATASETS_CACHE"]
else:
    os.environ["HF_HUB_CACHE"] = HUB_CACHE = tempfile.mkdtemp(prefix="grpotrl-test-hub-")
    os.environ["HF_DATASETS_CACHE"] = DATASETS_CACHE = tempfile.mkdtemp(prefix="grpotrl-test-datasets-")
    os.environ[_OWNER] = str(os.getpid())

import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

# tests/ mirrors the package (tests/ops/ for grpotrl/ops/, ...); a test module may reuse another's helpers by
# module name (``from test_gad import toy_rows``), whichever folder it is in, and run alone
for _folder in sorted(Path(__file__).resolve().parent.iterdir()):
    if _folder.is_dir() and _folder.name.isidentifier() and not _folder.name.startswith("_") \
            and str(_folder) not in sys.path:
        sys.path.append(str(_folder))

import pytest  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    """The session's HF caches go with it (a directory each a run; the Hub cache's large blobs are links)."""
    import shutil

    if os.environ.get(_OWNER) != str(os.getpid()):  # a pytest run inside a test's child: the parent's caches
        return
    for cache in (HUB_CACHE, DATASETS_CACHE):
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Converted SmolLM2-135M-Instruct in the default cache (converted once, ~30 s, then reused)."""
    from grpotrl.models import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def _save_tiny(path, tokenizer, arch: str):
    """A random 2-layer model over the real SmolLM2 tokenizer (fast, exercises the real vocab)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    if arch == "llama":  # rotary positions
        cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          tie_word_embeddings=True, **ids)
        model = LlamaForCausalLM(cfg)
    else:  # absolute positions: shows position-id errors that rotary models hide
        cfg = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=512, **ids)
        model = GPT2LMHeadModel(cfg)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm2_tokenizer):
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), smollm2_tokenizer, "llama")


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory, smollm2_tokenizer):
    return _save_tiny(tmp_path_factory.mktemp("tiny-gpt2"), smollm2_tokenizer, "gpt2")


@pytest.fixture(scope="session")
def hub_tiny_llama(tiny_llama) -> str:
    """``tiny_llama`` as the Hub id ``grpotrl-test/tiny-llama`` in the session's HF cache."""
    from hub_cache import add_to_cache

    add_to_cache(HUB_CACHE, "grpotrl-test/tiny-llama", tiny_llama)
    return "grpotrl-test/tiny-llama"


SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def hub_smollm2(smollm2_path) -> str:
    """SmolLM2-135M-Instruct under its real Hub id in the session's HF cache (weights linked, not copied)."""
    from hub_cache import add_to_cache

    add_to_cache(HUB_CACHE, SMOLLM2_HUB_ID, smollm2_path)
    return SMOLLM2_HUB_ID


@pytest.fixture(scope="session")
def tiny_multistop(tmp_path_factory, smollm2_path):
    """SmolLM2's tokenizer with eos = <|endoftext|> (id 0) while the template still ends turns
    with <|im_end|> (id 2 = pad): two stop ids, one of them equal to pad."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.eos_token = "<|endoftext|>"
    return _save_tiny(tmp_path_factory.mktemp("tiny-multistop"), tok, "llama")


def arithmetic_prompts(n: int = 16) -> "Dataset":
    """Prompts of different lengths, so batches are really left-padded."""
    from datasets import Dataset

    rows = [{"prompt": [{"role": "user", "content": "What is " + "1 + " * (i % 5) + "2?"}], "answer": str(2 + i % 5)}
            for i in range(n)]
    return Dataset.from_list(rows)


def logged_max(trainer, name: str = "guards/logprob_max_gap") -> float:
    """The largest value of metric ``name`` the trainer logged; fails when it logged none (the guard never ran)."""
    values = [e[name] for e in trainer.state.log_history if name in e]
    assert values, f"{name} was never logged"
    return max(values)


def length_reward(completions, **kwargs):
    return [len(c[0]["content"]) / 10 for c in completions]


@pytest.fixture
def grpo_args(tmp_path):
    """Small GRPO settings: 2 prompts x 4 generations per step, guards on every step, and a
    bias towards the stop tokens at sampling time so rows stop early, at different lengths."""
    import grpotrl

    def make(**overrides):
        kw = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=12, max_steps=2, logging_steps=1, report_to="none", use_cpu=True,
                  guard_steps=-1, temperature=0.7, save_strategy="no", beta=0.04, seed=0,
                  generation_kwargs={"sequence_bias": [[[0], 5.0], [[2], 5.0]]})
        kw.update(overrides)
        return grpotrl.GRPOConfig(**kw)

    return make


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve(smollm2_path, tmp_path_factory):
    """``transformers serve`` on SmolLM2-135M-Instruct at 127.0.0.1:<free port>, offline. Its
    HTTP(S) proxy variables point at a loopback listener: any outbound request it tried would
    be recorded there (``outbound``)."""
    import httpx2 as httpx
    from judge_server import LoopbackJudge
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        pytest.fail("transformers serve needs its serving dependencies: pip install -e '.[judge]'")
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with LoopbackJudge() as outbound:
        port = free_port()
        dead = f"http://127.0.0.1:{outbound.port}"
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_UPDATE_CHECK="1",
                   OMP_WAIT_POLICY="PASSIVE", HTTP_PROXY=dead, HTTPS_PROXY=dead, ALL_PROXY=dead, NO_PROXY="",
                   http_proxy=dead, https_proxy=dead, all_proxy=dead, no_proxy="")
        cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", smollm2_path, "--host", "127.0.0.1",
               "--port", str(port), "--device", "cpu", "--dtype", "float32"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 180
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"transformers serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.time() > deadline:
                    pytest.fail(f"transformers serve not ready after 180 s:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
            yield {"url": f"http://127.0.0.1:{port}", "model": smollm2_path, "outbound": outbound}
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)


def perturbed_batch(trainer):
    """Moves ``trainer``'s policy away from its reference (0.05 x N(0, 1) on every weight, seed 0), puts it
    in train mode and returns one prepared batch (``_prepare_inputs``): a KL that is not 0, for the KL tests
    of GRPO and GAD (which turn I10 off: moving the policy at step 0 is what it catches)."""
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which these tests skip
    trainer.model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    return trainer._prepare_inputs(batch)


class CounterEnvironment:
    """An environment (TRL's ``environment_factory``): ``reset`` builds the prompt from the row, its
    public method is the tool."""

    def reset(self, start: int = 0, **kwargs) -> str:
        self.count = start
        return f"The counter is at {start}. Multiply it by 4."

    def multiply(self, a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of the two integers.
        """
        self.count = a * b
        return self.count


@pytest.fixture
def hub_uploads(monkeypatch) -> list[list[str]]:
    """transformers' Hub API replaced by one that records, per ``upload_folder``, the sorted names the uploaded
    folder holds (before transformers' ``ignore_patterns``: ``_*`` and ``checkpoint-*`` are left out there)."""
    import concurrent.futures
    import types

    import transformers.trainer

    uploads: list[list[str]] = []

    class Hub:
        def create_repo(self, repo_id, **kwargs):
            return types.SimpleNamespace(repo_id=repo_id)

        def upload_folder(self, folder_path, **kwargs):
            uploads.append(sorted(os.listdir(folder_path)))
            done = concurrent.futures.Future()
            done.set_result(None)
            return done

    monkeypatch.setattr(transformers.trainer, "hf_api", Hub)
    return uploads
