"""grpotrl/trainers/gad_engine.py without a launch: D's DeepSpeed config derived from the
student's, and which discriminator files a checkpoint must hold. The engines themselves run in
tests/test_distributed.py (2 processes under zero2, zero3 and ddp) and tests/trainers/test_gad.py."""

import copy

import pytest

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
