"""The ``non_finite`` stop under DeepSpeed ZeRO-2, one process on CPU: a NaN loss on the second step stops the
run with that step's checkpoint, and the checkpoint holds the first step's weights, finite: the NaN gradients
were dropped, not stepped. Under ZeRO the gradients live in DeepSpeed's partitions, not ``.grad``, and DeepSpeed's
engine steps inside ``accelerator.backward`` of the accumulation window's last microbatch, before the rule's
``on_pre_optimizer_step``: the drop is DeepSpeed's own check of the gradient norm (fp32; bf16 with its
``check_grad_overflow``, on by default), which this pins. With bf16 and ``check_grad_overflow: false`` DeepSpeed
applies the NaN update: the stop then finds the weights non-finite, saves no checkpoint of them and names the last
one. The worker runs in its own process (``deepspeed``
initialises a process group). ~25 s on 2 cores once DeepSpeed's shm comm op is compiled (``test_distributed.py``
pays that)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytest.importorskip("deepspeed")
ROOT = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent('''
    import json, os, sys
    import grpotrl
    import torch
    from conftest import arithmetic_prompts, length_reward

    model, out, bf16 = sys.argv[1], sys.argv[2], sys.argv[3] == "bf16"
    # bf16 here with DeepSpeed's overflow check off: the engine applies the NaN update
    ds = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": bf16, "check_grad_overflow": False},
          "fp16": {"enabled": False},
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
          "train_micro_batch_size_per_gpu": "auto", "steps_per_print": 10**9}

    class NanOnStep2(grpotrl.GRPOTrainer):
        """The loss forward's last hidden states are NaN on the second optimizer step only."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.model.model.norm.register_forward_hook(self._poison)

        def _poison(self, module, inputs, output):
            return output * float("nan") if self.state.global_step == 1 and torch.is_grad_enabled() else output

    args = grpotrl.GRPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=4,
                              max_completion_length=6, max_steps=3, logging_steps=1, report_to="none",
                              use_cpu=True, bf16=bf16,
                              save_strategy="steps", save_steps=1, guard_steps=0, seed=0, learning_rate=1e-2,
                              temperature=0.7, deepspeed=ds, health_report_steps=0)
    trainer = NanOnStep2(model=model, reward_funcs=length_reward, args=args, train_dataset=arithmetic_prompts())
    try:
        trainer.train()
        error = None
    except grpotrl.HealthStop as err:
        error = str(err)
    engine = trainer.model_wrapped
    json.dump({"error": error, "zero_stage": engine.zero_optimization_stage(), "skipped": engine.skipped_steps,
               "global_step": trainer.state.global_step}, open(os.path.join(out, "evidence.json"), "w"))
''')


def _run(tiny_llama, tmp_path, precision: str) -> tuple[dict, Path]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "ACCELERATE_USE_DEEPSPEED": "true",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), tiny_llama, str(out), precision], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    ev = json.loads((out / "evidence.json").read_text())
    assert ev["zero_stage"] == 2
    return ev, out


@pytest.mark.slow  # 10 s; a NaN loss under ZeRO-2 stopping with its checkpoint is also test_distributed's, on 2 ranks
def test_a_nan_loss_under_zero2_stops_with_the_last_finite_weights(tiny_llama, tmp_path):
    ev, out = _run(tiny_llama, tmp_path, "fp32")
    assert ev["error"] is not None and "[health: non_finite] step 2" in ev["error"] and "loss nan" in ev["error"], ev
    assert ev["skipped"] == 1  # DeepSpeed's engine skipped the NaN step
    first = load_file(out / "checkpoint-1" / "model.safetensors")
    stop = load_file(out / "checkpoint-2" / "model.safetensors")
    assert all(t.isfinite().all() for t in stop.values())
    assert all(stop[name].equal(t) for name, t in first.items())  # the NaN update was not applied


def test_a_nan_update_that_deepspeed_applied_saves_no_checkpoint_and_names_the_last_one(tiny_llama, tmp_path):
    """bf16 with ``check_grad_overflow: false``: DeepSpeed steps the NaN update inside the backward, before the rule
    could drop it. The stop reads the weights, saves no checkpoint of them (``resume_from_checkpoint: true`` would
    take it) and names the run's last one, whose weights are finite."""
    ev, out = _run(tiny_llama, tmp_path, "bf16")
    assert ev["skipped"] == 0  # DeepSpeed applied the update
    error = ev["error"]
    assert error is not None and "[health: non_finite] step 2" in error, ev
    assert "the weights are not finite now (" in error and "no checkpoint was saved at this step" in error, error
    assert f"resume_from_checkpoint={str(out / 'checkpoint-1')!r}" in error, error
    assert not (out / "checkpoint-2").exists() and "Checkpoint saved to" not in error
    assert all(t.isfinite().all() for t in load_file(out / "checkpoint-1" / "model.safetensors").values())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
