"""The ``non_finite`` stop under DeepSpeed ZeRO-3, one process on CPU, where a parameter lives as this process's
shard (``ds_tensor``) and ``p`` itself is an empty placeholder outside a forward: a NaN planted in a weight's shard
on the second step (what an update DeepSpeed applied would leave) makes that step's loss NaN, the rule stops the
run, reads the shards (``health.callbacks.nonfinite_parameters``), saves no checkpoint of the NaN weights and names
the last complete one. ZeRO-3 drops a NaN-gradient update itself (its gradient-norm check runs whatever the
precision, bf16 with ``check_grad_overflow: false`` too), so the NaN is planted rather than stepped. The worker runs in its own process (``deepspeed``
initialises a process group), as ``test_nonfinite_zero.py``'s ZeRO-2 runs do."""

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

    model, out = sys.argv[1], sys.argv[2]
    # bf16 with DeepSpeed's overflow check off: ZeRO-3 still skips a NaN-gradient update (by its gradient norm)
    ds = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
          "bf16": {"enabled": True, "check_grad_overflow": False}, "fp16": {"enabled": False},
          "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
          "steps_per_print": 10**9}

    class NanWeightOnStep2(grpotrl.GRPOTrainer):
        """On the second optimizer step, after its generation, the final norm's shard gets a NaN."""

        def compute_loss(self, model, inputs, *args, **kwargs):
            if self.state.global_step == 1:
                weight = self.model.model.norm.weight
                self.sizes = (weight.numel(), weight.ds_tensor.numel())  # outside a forward: placeholder, shard
                with torch.no_grad():
                    weight.ds_tensor[0] = float("nan")
            return super().compute_loss(model, inputs, *args, **kwargs)

    args = grpotrl.GRPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=4,
                              max_completion_length=6, max_steps=3, logging_steps=1, report_to="none",
                              use_cpu=True, bf16=True, save_strategy="steps", save_steps=1, guard_steps=0, seed=0,
                              temperature=0.7, deepspeed=ds, health_report_steps=0)
    trainer = NanWeightOnStep2(model=model, reward_funcs=length_reward, args=args,
                               train_dataset=arithmetic_prompts())
    evidence = {"error": None}
    try:
        trainer.train()
    except grpotrl.HealthStop as err:
        evidence["error"] = str(err)
    evidence.update(zero_stage=trainer.model_wrapped.zero_optimization_stage(), sizes=trainer.sizes,
                    skipped=trainer.model_wrapped.skipped_steps, global_step=trainer.state.global_step)
    json.dump(evidence, open(os.path.join(out, "evidence.json"), "w"))
''')


@pytest.mark.slow
def test_a_nan_weight_under_zero3_saves_no_checkpoint_and_names_the_last_one(tiny_llama, tmp_path):
    from test_nonfinite_zero import free_port

    (tmp_path / "worker.py").write_text(WORKER)
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "ACCELERATE_USE_DEEPSPEED": "true",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(tmp_path / "worker.py"), tiny_llama, str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    ev = json.loads((out / "evidence.json").read_text())
    assert ev["zero_stage"] == 3 and ev["sizes"] == [0, 64], ev  # the weight (64 values) lives in its shard only
    assert ev["skipped"] == 1, ev  # DeepSpeed dropped the NaN-gradient update: the NaN is the planted one
    error = ev["error"]
    assert error is not None and "[health: non_finite] step 2" in error and "loss nan" in error, ev
    assert "the weights are not finite now (model.norm.weight)" in error, error
    assert "no checkpoint was saved at this step" in error, error
    assert f"resume_from_checkpoint={str(out / 'checkpoint-1')!r}" in error, error
    assert not (out / "checkpoint-2").exists() and ev["global_step"] == 2
    first = load_file(out / "checkpoint-1" / "model.safetensors")
    assert first and all(t.isfinite().all() for t in first.values())
