"""grpotrl/trainers/gad_engine.py without a trainer launch: D's DeepSpeed config derived from the
student's, which discriminator files a checkpoint must hold, and the DeepSpeed engine's step on its own
(2 processes, ZeRO stages the recipes do not launch). The engines run in a trainer in
tests/test_distributed.py (2 processes under zero2, zero3 and ddp) and tests/trainers/test_gad.py."""

import copy
import json
import os
import subprocess
import sys

import pytest
from conftest import free_port

import grpotrl
from grpotrl.checkpoints import discriminator_files as checkpoint_files
from grpotrl.checkpoints import resume_files
from grpotrl.trainers.gad_engine import deepspeed_config


def student_config():
    """recipes/accelerate/deepspeed/zero3.json as transformers leaves it at trainer init: batch
    sizes, clipping and precision filled, the bucket sizes still "auto" (filled at train())."""
    return {
        "bf16": {"enabled": False}, "fp16": {"enabled": False},
        "zero_optimization": {"stage": 3, "overlap_comm": False, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                              "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}, "scheduler": {"type": "WarmupLR"},
        "gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 8, "steps_per_print": 1000000,
    }


def test_discriminator_deepspeed_config_from_the_students():
    student = student_config()
    before = copy.deepcopy(student)
    cfg = deepspeed_config(student, micro_batch=4, world_size=2, max_grad_norm=0.5, hidden_size=64)
    assert student == before  # the student's config (accelerate's plugin holds it) is not touched
    assert "optimizer" not in cfg and "scheduler" not in cfg  # D's own AdamW is passed in
    # one scoring chunk per micro-batch, no accumulation of its own: 4 * 1 * 2
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == \
        (4, 1, 8)
    assert cfg["gradient_clipping"] == 0.5
    zero = cfg["zero_optimization"]
    # as transformers fills the student's: h*h, 0.9*h*h, 10*h for h = 64
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (4096, 3686, 640)
    assert zero["stage"] == 3 and zero["offload_optimizer"] == {"device": "cpu"}  # same sharding and offload
    assert cfg["bf16"] == {"enabled": False}


def test_discriminator_deepspeed_config_refuses_what_it_cannot_fill():
    student = student_config()
    student["zero_optimization"]["sub_group_size"] = "auto"
    with pytest.raises(grpotrl.InputError, match="sub_group_size is 'auto'"):
        deepspeed_config(student, 4, 2, 1.0, 64)
    student = student_config()
    student["bf16"]["enabled"] = "auto"
    with pytest.raises(grpotrl.InputError, match="bf16.enabled is still 'auto'"):
        deepspeed_config(student, 4, 2, 1.0, 64)


def test_resume_checks_the_discriminator_files_of_the_launch(tmp_path, monkeypatch):
    """torch: optimizer.pt; DeepSpeed (config or `accelerate launch`): its own `latest` + shards."""
    args = grpotrl.GADConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert set(checkpoint_files(False)) <= set(resume_files(args, "gad"))
    assert "discriminator/optimizer.pt" in resume_files(args, "gad")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert set(checkpoint_files(True)) == {"discriminator/model.safetensors", "discriminator/latest"}
    assert set(checkpoint_files(True)) <= set(resume_files(args, "gad"))
    assert "discriminator/optimizer.pt" not in resume_files(args, "gad")


# Two ranks step a DeepSpeedDiscriminator (D: two linear layers) three times per ZeRO stage, each rank writing
# what it saw to OUT/rank{r}.json. Rank 1 only: step 1 an inf loss with finite gradients, step 2 a NaN gradient
# with a finite loss; step 3 finite on both. ``finite`` is the loss summed over the ranks, as score_and_step's.
STEP_SCRIPT = """
import contextlib, json, sys, types
import deepspeed, torch
from grpotrl.trainers.gad_engine import DeepSpeedDiscriminator

deepspeed.init_distributed(dist_backend="gloo")
rank, out = torch.distributed.get_rank(), {}
# the student's bf16 block turns DeepSpeed's own gradient check off: D's config turns it on again
for name, stage, bf16 in (("0", 0, False), ("1", 1, False), ("0-bf16", 0, True), ("2-bf16", 2, True)):
    torch.manual_seed(0)
    d = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    d.hf_model = None
    ns = types.SimpleNamespace
    cfg = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16, "check_grad_overflow": False},
           "steps_per_print": 10**9}
    trainer = ns(accelerator=ns(state=ns(deepspeed_plugin=ns(deepspeed_config=cfg)), num_processes=2,
                                device=torch.device("cpu")), args=ns(per_device_train_batch_size=2, max_grad_norm=1.0))
    engine = DeepSpeedDiscriminator(trainer, d, lr=1e-2)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the AdamW DeepSpeed steps
    def state():
        return [p.detach().clone() for p in d.parameters()], [t.clone() for s in inner.state.values()
                                                               for t in s.values() if torch.is_tensor(t)]
    steps = []
    for bad in ("inf_loss", "nan_grad", None):
        w0, s0 = state()
        engine.accumulate(True)
        scores = engine.model(torch.randn(2, 4, dtype=torch.bfloat16 if bf16 else torch.float32))  # [2, 1]
        if bad == "nan_grad" and rank == 1:
            scores = scores.clone()
            scores.register_hook(lambda g: g * float("nan"))
        loss = scores.float().pow(2).sum() + (float("inf") if bad == "inf_loss" and rank == 1 else 0.0)
        engine.backward(loss)
        total = loss.detach().reshape(1)
        torch.distributed.all_reduce(total)
        stepped = engine.step(finite=bool(torch.isfinite(total)))
        w1, s1 = state()
        same = lambda a, b: len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
        steps.append({"stepped": stepped, "weights_kept": same(w0, w1), "state_kept": same(s0, s1),
                      "finite": all(bool(torch.isfinite(w).all()) for w in w1)})
    out[name] = steps
json.dump(out, open(f"{sys.argv[1]}/rank{rank}.json", "w"))
"""


def test_nonfinite_discriminator_step_is_skipped_under_deepspeed_without_zero_and_zero1(tmp_path):
    """Without ZeRO (fp32) DeepSpeed steps its plain AdamW on a NaN gradient, writing NaN into D; under
    ZeRO-1 it drops that step itself, and in bf16 only where ``bf16.check_grad_overflow`` is on (the
    student's config turns it off here); everywhere it steps on an inf loss whose gradients are finite
    (weight decay, Adam's moments). Both steps are skipped on both ranks, D's weights and optimizer state
    kept; the third, finite, steps."""
    script = tmp_path / "step.py"
    script.write_text(STEP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for stage in ("0", "1", "0-bf16", "2-bf16"):
            skipped, control = seen[stage][:2], seen[stage][2]
            assert all(not s["stepped"] and s["weights_kept"] and s["state_kept"] for s in skipped), (rank, stage, seen)
            assert control["stepped"] and not control["weights_kept"] and control["finite"], (rank, stage, seen)
