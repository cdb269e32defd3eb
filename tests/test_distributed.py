"""Two-process CPU runs through ``accelerate launch`` with the repo's own recipes/accelerate files:
SFT, GRPO then GAD (2 steps each, tiny llama over the real SmolLM2 tokenizer) under DeepSpeed
ZeRO-2 and ZeRO-3, GRPO then GAD under DDP, over gloo. tests/dist_worker.py trains and writes
per-rank evidence; these tests read it: the guards ran on every rank (I5 comparing the packed
loss logprobs of grpotrl's default padding_free with the padded forward), the weights moved and agree
across ranks, the saved checkpoint holds them, under ZeRO-3 generation ran on TRL's gathered
parameters, and GAD's discriminator trained under the same launch, agrees across ranks and is
restored exactly (weights and this rank's optimizer shard) by a resume.

The multi-node recipe runs as two launches on localhost, one process per "machine". One launch
per config (ZeRO-2's and ZeRO-3's also run the faulty discriminator and ZeRO-2's the NaN loss on one
rank, after the runs the other tests read), 30-45 s each on 2 lightly loaded cores; the first DeepSpeed
launch on a machine also JIT-compiles DeepSpeed's shm comm op (25 s there; ~80 s seen on busier machines), cached in
~/.cache/torch_extensions (TORCH_EXTENSIONS_DIR). ZeRO-3 with CPU offload runs only with
GRPOTRL_TEST_DIST_ALL=1: its first run compiles DeepSpeed's cpu_adam op (37 s to 5 min on 2 cores).
"""

import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

import grpotrl

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2
WORKER_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false",
              "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
ALL = os.environ.get("GRPOTRL_TEST_DIST_ALL") == "1"
needs_all = pytest.mark.skipif(not ALL, reason="compiles DeepSpeed's cpu_adam op first; GRPOTRL_TEST_DIST_ALL=1 runs it")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(config: str, out: Path, model: str, methods: str, launch_args=(), wait=True):
    """``accelerate launch --config_file recipes/accelerate/{config}.yaml tests/dist_worker.py ...``
    from the repo root, on a free port (parallel runs on one machine must not collide); the
    output goes to ``out/launch*.log``."""
    if "--main_process_port" not in launch_args:
        launch_args = (*launch_args, "--main_process_port", str(free_port()))
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch",
           "--config_file", f"recipes/accelerate/{config}.yaml", *launch_args,
           "tests/dist_worker.py", "--model", model, "--out", str(out), "--methods", methods, "--steps", str(STEPS)]
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"launch{len(list(out.glob('launch*.log')))}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **WORKER_ENV}, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group: a timeout ends the ranks too
    proc.log = log
    return finish(proc) if wait else proc


def finish(proc) -> None:
    try:
        proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, f"{' '.join(proc.args)}\nexit {proc.returncode}:\n{proc.log.read_text()[-6000:]}"


def read_evidence(out: Path, methods: str, world_size: int = 2) -> dict:
    """``{(method, rank): evidence}``; every rank must have written its file."""
    return {(m, r): json.loads((out / f"{m}_rank{r}.json").read_text())
            for m in methods.split(",") for r in range(world_size)}


# zero2 first: its launch pays the one-time JIT compile. Per config: the methods every test of ``launched`` reads,
# its ZeRO stage, then the fault runs of the same launch (one launch per config: each start of 2 ranks costs ~10 s
# of imports and process-group setup). A fault run comes after the methods the other tests read, each writes its
# own evidence (dist_worker records an error and goes on to the next method), and grpo_nan_rank1, which stops
# both ranks mid-training, is the launch's last.
CONFIGS = {"zero2": ("sft,grpo,gad", 2, "gad_nonfinite,grpo_nan_rank1"), "zero3": ("sft,grpo,gad", 3, "gad_nonfinite"),
           "ddp": ("grpo,gad", None, "")}


@pytest.fixture(scope="module")
def launch(tiny_llama, tmp_path_factory):
    """``launch(config)``: the config's one launch (all its methods and fault runs), run the first time a test
    asks for it; later tests of the module read the same evidence."""
    done = {}

    def get(config: str) -> dict:
        if config not in done:
            methods, stage, faults = CONFIGS[config]
            out = tmp_path_factory.mktemp(f"dist-{config}")
            accelerate_launch(config, out, tiny_llama, ",".join(filter(None, [methods, faults])))
            done[config] = {"config": config, "stage": stage, "out": out, "model": tiny_llama,
                            "evidence": read_evidence(out, methods),
                            "faults": read_evidence(out, faults) if faults else {}}
        return done[config]

    return get


@pytest.fixture(scope="module", params=list(CONFIGS))
def launched(request, launch):
    return launch(request.param)


def trained(launched):
    """Evidence of the methods that trained; every method of every config must have."""
    errors = {k: v["error"] for k, v in launched["evidence"].items() if v["error"] is not None}
    assert not errors, errors
    return launched["evidence"]


def test_every_rank_ran_under_the_recipes_backend(launched):
    for (method, rank), ev in trained(launched).items():
        assert (ev["world_size"], ev["backend"], ev["global_step"]) == (2, "gloo", STEPS), (method, rank)
        assert ev["zero_stage"] == launched["stage"], (method, rank)
        expected = "DEEPSPEED" if launched["stage"] else "MULTI_CPU"  # ddp.yaml on CPU: use_cpu makes it gloo DDP
        assert ev["distributed_type"].endswith(expected), (method, rank)


def test_I1_to_I5_guards_ran_on_every_rank_every_step(launched):
    for (method, rank), ev in trained(launched).items():
        calls = ev["guard_calls"]
        if method == "sft":  # I2: the collated labels of every step
            assert calls == {"check_sft_labels": STEPS}, rank
            continue
        for guard in ("check_prompts_templated", "check_same_prompt", "check_extraction", "check_reward_text",
                      "check_completion_mask", "check_logprobs_in_precision"):
            assert calls.get(guard, 0) >= STEPS, (rank, guard, calls)
        # I5 on this rank's own microbatches: a gap per step, logged and kept by the trainer; the loss's
        # logprobs came from packed rows (grpotrl's default padding_free), compared with the padded forward
        assert ev["padding_free"] is True, (method, rank)
        assert len(ev["logged_gaps"]) == STEPS, rank
        assert max(ev["logged_gaps"]) < 1e-4, rank


def test_packed_forwards_agree_across_ranks_under_zero3(launched):
    """One packed call planned as 2 forwards on rank 0 and 1 on rank 1 (``dist_worker.probe_packed_forwards``):
    under ZeRO-3, where each forward gathers the parameters from every rank, rank 1 runs a second forward on
    padding (without it the ranks' gathers would not match); under DDP and ZeRO-2 each rank runs its own plan.
    The values equal the padded forward's on every rank."""
    probes = [launched["evidence"]["grpo", r]["probe"] for r in (0, 1)]
    assert [p["plan"] for p in probes] == [2, 1], probes
    expected = [2, 2] if launched["stage"] == 3 else [2, 1]
    assert [p["forwards"] for p in probes] == expected, probes
    assert all(p["gap"] < 1e-5 for p in probes), probes


def test_weights_changed_and_agree_across_ranks(launched):
    for method in {m for m, _ in trained(launched)}:
        ranks = [launched["evidence"][method, r] for r in (0, 1)]
        for ev in ranks:
            assert ev["params_compared"] >= 10, method
            assert ev["max_abs_weight_change"] > 1e-6, (method, ev["rank"])
        assert ranks[0]["weight_checksum"] == pytest.approx(ranks[1]["weight_checksum"], rel=1e-9), method


def test_saved_checkpoint_holds_the_trained_weights(launched):
    """Under ZeRO-3 ``save_model`` gathers the shards (stage3_gather_16bit_weights_on_model_save).
    Only the start checkpoint's tensors are summed: ZeRO-2 also writes the tied lm_head.weight."""
    names = set(load_file(str(Path(launched["model"]) / "model.safetensors")))
    for method in {m for m, _ in trained(launched)}:
        saved = load_file(str(launched["out"] / method / "model.safetensors"))
        checksum = sum(float(t.double().sum()) for name, t in saved.items() if name in names)
        assert checksum == pytest.approx(launched["evidence"][method, 0]["weight_checksum"], rel=1e-7), method
        assert (launched["out"] / method / "grpotrl_template.json").is_file(), method  # I2 fingerprint


def test_generation_under_zero3_runs_on_gathered_parameters(launched):
    """ZeRO-3: parameters are empty shards outside TRL's unwrap_model_for_generation(gather=
    ds3_gather_for_generation) and full inside it, where grpotrl's generate hook still saw every
    call (check_extraction ran on each step, above). ZeRO-2 and DDP never partition parameters."""
    for rank in (0, 1):
        ev = launched["evidence"]["grpo", rank]
        assert len(ev["generations"]) >= STEPS, rank
        assert all(g["gather_deepspeed3_params"] and g["empty_params_inside"] == 0 for g in ev["generations"]), rank
        assert (ev["empty_params_outside_generation"] > 0) == (launched["stage"] == 3), rank
        assert ev["guard_calls"]["check_extraction"] >= STEPS, rank


def test_gad_discriminator_trains_and_agrees_across_ranks(launched):
    """D (its own engine: DDP, or DeepSpeed at the student's ZeRO stage) starts from the same
    weights on both ranks, steps every generation batch, and stays identical across ranks; its
    metrics are reduced over both ranks, so each logs the same values."""
    ranks = [launched["evidence"]["gad", r] for r in (0, 1)]
    for ev in ranks:
        assert ev["d_start"]["n_weights"] >= 10 and ev["d_start"]["weights"] != ev["d_end"]["weights"], ev["rank"]
        assert len(ev["d_logs"]) == STEPS and all(0 < log["gad/d_loss"] < 5 for log in ev["d_logs"]), ev["rank"]
    for key in ("d_start", "d_end"):
        assert ranks[0][key]["weights"] == pytest.approx(ranks[1][key]["weights"], rel=1e-12), key
    assert ranks[0]["d_logs"] == ranks[1]["d_logs"]


def test_gad_resume_restores_the_discriminator_and_its_optimizer(launched):
    """A second trainer resumed from the step-1 checkpoint and trained to step 2 ends with D's
    weights and this rank's optimizer shard equal to the uninterrupted run's. Under ZeRO each rank
    holds its own part of D's optimizer state (the two checksums differ); under DDP a whole copy."""
    deepspeed = launched["stage"] is not None
    ranks = [launched["evidence"]["gad", r] for r in (0, 1)]
    assert (ranks[0]["d_end"]["optimizer"] != ranks[1]["d_end"]["optimizer"]) == deepspeed
    for rank, ev in enumerate(ranks):
        expected = {"ds", "latest", "model.safetensors"} if deepspeed else {"model.safetensors", "optimizer.pt"}
        assert expected <= set(ev["d_checkpoint_files"]), (rank, ev["d_checkpoint_files"])
        assert ev["d_resumed"]["optimizer_tensors"] == ev["d_end"]["optimizer_tensors"] > 0, rank
        assert ev["d_resumed"]["weights"] == pytest.approx(ev["d_end"]["weights"], rel=1e-12), rank
        assert ev["d_resumed"]["optimizer"] == pytest.approx(ev["d_end"]["optimizer"], rel=1e-12), rank


@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_gad_nonfinite_discriminator_step_is_skipped_on_every_rank_under_deepspeed(config, launch):
    """D goes non-finite on rank 1 only (``dist_worker.NonFiniteDGADTrainer``): an inf loss with finite gradients
    in its first step (DeepSpeed steps on it: weight decay, Adam's moments), a NaN gradient with a finite loss in
    its second (DeepSpeed's own overflow check drops it, but nothing said so). Both are skipped on both ranks:
    D's weights and this rank's optimizer state stay as they started, gad/d_step_skipped reads 1 and the warning
    is logged; the third step, finite, trains D. It runs in the config's launch, after the methods the tests
    above read."""
    launched = launch(config)
    ev = launched["faults"]
    for rank in (0, 1):
        e = ev["gad_nonfinite", rank]
        assert e["error"] is None, e["error"]
        assert [s["stepped"] for s in e["d_steps"]] == [False, False, True], rank
        assert [log["gad/d_step_skipped"] for log in e["d_logs"]] == [1.0, 1.0, 0.0], rank
        start, (first, second, third) = e["d_start"], e["d_steps"]
        for kept in (first, second):
            assert (kept["weights"], kept["optimizer"], kept["optimizer_tensors"]) == \
                (start["weights"], start["optimizer"], start["optimizer_tensors"]), rank
        assert math.isfinite(third["weights"]) and third["weights"] != start["weights"], rank
        assert math.isfinite(third["optimizer"]) and third["optimizer_tensors"] > start["optimizer_tensors"], rank
    assert ev["gad_nonfinite", 0]["d_steps"][2]["weights"] == ev["gad_nonfinite", 1]["d_steps"][2]["weights"]
    # 2 steps x 2 ranks; the log is the whole launch's: no other run of it skipped a D step
    assert (launched["out"] / "launch0.log").read_text().count("its step is skipped") == 4


def test_gad_refuses_fsdp_before_loading_a_model(tmp_path, monkeypatch):
    """An ``accelerate launch`` FSDP config (its environment): refused before the model path is
    even looked at; the path below does not exist."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    args = grpotrl.GADConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(grpotrl.InputError, match="GADTrainer with FSDP is not supported"):
        grpotrl.GADTrainer(model=str(tmp_path / "never-loaded"), args=args, train_dataset=None)


@needs_all
def test_zero3_with_cpu_offload_trains_and_guards(tiny_llama, tmp_path):
    """GRPO, then GAD, whose discriminator gets DeepSpeed's CPU Adam (offload_optimizer)."""
    accelerate_launch("zero3_offload", tmp_path, tiny_llama, "grpo,gad")
    ev = read_evidence(tmp_path, "grpo,gad")
    for method in ("grpo", "gad"):
        for rank in (0, 1):
            assert ev[method, rank]["error"] is None, ev[method, rank]["error"]
            assert ev[method, rank]["zero_stage"] == 3
            assert ev[method, rank]["guard_calls"]["check_logprobs_in_precision"] >= STEPS
            assert ev[method, rank]["max_abs_weight_change"] > 1e-6
    for rank in (0, 1):
        gad = ev["gad", rank]
        assert gad["d_start"]["weights"] != gad["d_end"]["weights"]
        assert gad["d_resumed"]["weights"] == pytest.approx(gad["d_end"]["weights"], rel=1e-12)
        assert gad["d_resumed"]["optimizer"] == pytest.approx(gad["d_end"]["optimizer"], rel=1e-12)


def test_a_nan_loss_on_one_rank_under_zero2_stops_every_rank_with_its_checkpoint(launch):
    """Rank 1's loss is NaN, rank 0's finite; under ZeRO the gradients are not in ``.grad``, so each rank sees
    only its own loss. The ``non_finite`` rule's verdict is one for both: both stop at step 1 with the same
    checkpoint, and the launch ends (a rank stopping alone would leave the other waiting until the timeout).
    The last run of the zero2 launch (``CONFIGS``)."""
    launched = launch("zero2")
    ev, tmp_path = launched["faults"], launched["out"]
    for rank in (0, 1):
        assert ev["grpo_nan_rank1", rank]["kind"] == "HealthStop", ev["grpo_nan_rank1", rank]
        assert "[health: non_finite] step 1" in ev["grpo_nan_rank1", rank]["error"]
    assert "NaN/inf on another process" in ev["grpo_nan_rank1", 0]["error"]
    assert "loss nan" in ev["grpo_nan_rank1", 1]["error"]
    assert (tmp_path / "grpo_nan_rank1" / "checkpoint-1" / "trainer_state.json").is_file()


def test_multinode_recipe_as_two_local_machines(tiny_llama, tmp_path):
    """recipes/accelerate/multinode_zero3.yaml, one process on each of two "machines" (localhost)."""
    port = str(free_port())
    procs = [accelerate_launch("multinode_zero3", tmp_path, tiny_llama, "grpo", wait=False, launch_args=(
        "--machine_rank", str(rank), "--num_processes", "2", "--main_process_ip", "127.0.0.1",
        "--main_process_port", port)) for rank in (0, 1)]
    for proc in procs:
        finish(proc)
    ev = read_evidence(tmp_path, "grpo")
    for rank in (0, 1):
        assert (ev["grpo", rank]["world_size"], ev["grpo", rank]["zero_stage"]) == (2, 3)
        assert ev["grpo", rank]["guard_calls"]["check_logprobs_in_precision"] >= STEPS
        assert ev["grpo", rank]["max_abs_weight_change"] > 1e-6
    assert ev["grpo", 0]["weight_checksum"] == pytest.approx(ev["grpo", 1]["weight_checksum"], rel=1e-9)


@pytest.mark.parametrize("cagrad", ["exact", "low_memory"])
def test_multitask_cagrad_recipe_under_ddp(cagrad, tiny_llama, tmp_path):
    """Two processes, the CAGrad recipe through the CLI. Ranks hold different tasks in a
    microbatch; every collective (TRL's metric reductions, the task-gradient averages) must
    still be called the same number of times on each, or the run hangs (it did: the timeout
    below turns a hang into a failure)."""
    out = tmp_path / cagrad
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
           "recipes/accelerate/ddp.yaml", "--main_process_port", str(free_port()), "-m", "grpotrl.cli", "grpo",
           "--config", "recipes/smollm2/grpo_multitask_cagrad.yaml", "--model_name_or_path", tiny_llama,
           "--output_dir", str(out), "--max_steps", "2", "--max_completion_length", "6", "--cagrad", cagrad,
           "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"]
    log = tmp_path / f"{cagrad}-launch.log"  # beside output_dir: the CLI refuses a non-empty one
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **WORKER_ENV}, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    proc.log = log
    finish(proc)
    logs = json.loads((out / "trainer_state.json").read_text())["log_history"]
    steps = [h for h in logs if "entropy/dloss_dH" in h]
    assert len(steps) == 2 and all(h["entropy/dloss_dH"] == pytest.approx(-0.01, abs=1e-6) for h in steps)
    assert any("tasks/fairness/cagrad_coef" in h for h in steps)
