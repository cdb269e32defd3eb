"""Two-step SFT, GRPO and/or GAD runs of grpotrl that write per-rank evidence as JSON; launched by
tests/test_distributed.py and bench/bench_distributed.py through the repo's accelerate recipes:

    OMP_NUM_THREADS=1 accelerate launch --config_file recipes/accelerate/zero3.yaml tests/dist_worker.py \
        --model TINY_MODEL_DIR --out OUT_DIR --methods sft,grpo

Writes ``OUT_DIR/{method}_rank{r}.json`` per method and rank: distributed type and ZeRO stage,
how often each guard ran on this rank and the largest logprob gap it saw, whether the weights
on this rank changed (ZeRO-3 shards are gathered first) with a checksum to compare across
ranks, step times and peak RSS; for GRPO also how generation saw the weights (under ZeRO-3:
through TRL's ``unwrap_model_for_generation`` with ``ds3_gather_for_generation``, full
parameters inside, partitioned ones outside). Each method saves to ``OUT_DIR/{method}`` and the
next starts from there (GRPO after SFT checks the template fingerprint written under ZeRO).
``gad`` also records its discriminator D: full-weight checksums at the start and the end (ZeRO-3
shards gathered), a checksum of this rank's optimizer shard, the logged D metrics, and the same
checksums after resuming a second trainer from the step-1 checkpoint and training to step 2
(D's weights and optimizer state saved and restored by DeepSpeed or torch).
``grpo`` also records one packed logprob call whose forward plan differs between the ranks (``probe``: under
ZeRO-3 every rank must run as many forwards).
A method that stops with ``grpotrl.InputError`` or ``InvariantError`` records the message (``"error"``);
``grpo_nosync`` is GRPO with the gradient all-reduce skipped (I12 must stop it); ``grpo_nan_rank1`` GRPO whose
loss turns NaN on rank 1 only (the ``non_finite`` rule must stop both ranks; a ``HealthStop`` is recorded like an
error, with its ``kind``); ``gad_nonfinite`` GAD whose discriminator goes non-finite on rank 1 only in its first two
steps (``d_steps``: D after each step). ``rank_checks``: the
I12 checks each rank ran.
All trainers use the same per-device batch size and accumulation, because DeepSpeed's "auto"
values are filled once per process.

Instrumentation only: guard functions and TRL's unwrap context are wrapped to count calls;
nothing grpotrl or TRL computes is changed.
"""

from __future__ import annotations

import grpotrl  # noqa: I001  first: sets OMP_WAIT_POLICY before torch is imported

import argparse
import contextlib
import functools
import json
import os
import resource
import time
from collections import Counter

import torch
from accelerate import PartialState
from datasets import Dataset
from safetensors.torch import load_file
from transformers import TrainerCallback

BATCH = 8  # per device, every method (see the module docstring)
GUARD_CALLS: Counter = Counter()
GENERATIONS: list[dict] = []


# ---------------------------------------------------------------- instrumentation


def count_guards() -> None:
    """Count every call of grpotrl's guard functions (looked up by module attribute at call time)."""
    from grpotrl import guards
    from grpotrl.trainers import sft

    def counted(module, name):
        fn = getattr(module, name)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            GUARD_CALLS[name] += 1
            return fn(*args, **kwargs)

        setattr(module, name, wrapper)

    for name in [n for n in vars(guards) if n.startswith("check_")]:
        counted(guards, name)
    counted(sft, "check_sft_labels")


def watch_generation_unwrap() -> None:
    """Record, for each generation, the gather flag TRL passed and whether the parameters were
    full inside the unwrap context (ZeRO-3 keeps empty shards outside it)."""
    import trl.trainer.grpo_trainer as trl_grpo

    original = trl_grpo.unwrap_model_for_generation

    @contextlib.contextmanager
    def watched(model, accelerator, gather_deepspeed3_params=True, **kwargs):
        with original(model, accelerator, gather_deepspeed3_params=gather_deepspeed3_params, **kwargs) as unwrapped:
            GENERATIONS.append({"gather_deepspeed3_params": gather_deepspeed3_params,
                                "empty_params_inside": n_empty(unwrapped)})
            yield unwrapped

    trl_grpo.unwrap_model_for_generation = watched


def n_empty(model) -> int:
    """Parameters whose local tensor is empty: ZeRO-3 partitions outside a gather."""
    return sum(p.numel() == 0 for p in model.parameters())


class StepClock(TrainerCallback):
    def __init__(self):
        self.times, self.t = [], 0.0

    def on_step_begin(self, args, state, control, **kw):
        self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self.t)


@torch.no_grad()
def weight_change(model, start_dir: str) -> dict:
    """Max |w - w0| over the parameters saved in ``start_dir``, and a checksum of the full weights;
    under ZeRO-3 each parameter is gathered first (a collective: every rank calls this)."""
    start = load_file(os.path.join(start_dir, "model.safetensors"))
    gather = contextlib.nullcontext
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        import deepspeed

        gather = functools.partial(deepspeed.zero.GatheredParameters, list(model.parameters()))
    with gather():
        params = dict(model.named_parameters())
        delta = max(float((params[k].float() - v.float()).abs().max()) for k, v in start.items() if k in params)
        checksum = float(sum(p.double().sum() for p in params.values()))
        compared = sum(k in params for k in start)
    return {"max_abs_weight_change": delta, "weight_checksum": checksum, "params_compared": compared}


# ---------------------------------------------------------------- data and rewards


def sft_rows(n: int = 64) -> Dataset:
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
                               "completion": [{"role": "assistant", "content": str(i + 1)}]} for i in range(n)])


def grpo_prompts(n: int = 64) -> Dataset:
    """Prompts of different lengths, so batches are really left-padded (as tests/conftest.py)."""
    return Dataset.from_list([{"prompt": [{"role": "user", "content": "What is " + "1 + " * (i % 5) + "2?"}]}
                              for i in range(n)])


def gad_rows(n: int = 64) -> Dataset:
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
                               "teacher_response": f"It is {i + 1}. Hope this helps!"} for i in range(n)])


def length_reward(completions, **kwargs):
    """Varies with the completion length, so advantages are non-zero and the weights move."""
    return [len(c[0]["content"]) / 10 for c in completions]


# ---------------------------------------------------------------- runs


RL = dict(num_generations=4, max_completion_length=8, temperature=0.7,
          generation_kwargs={"sequence_bias": [[[0], 5.0], [[2], 5.0]]})  # rows stop at different lengths


class ProbedGRPOTrainer(grpotrl.GRPOTrainer):
    """GRPO with, before its first step, one packed logprob call whose forward plan differs between the ranks
    (``probe_packed_forwards``)."""

    probe = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.probe is None:
            self.probe = probe_packed_forwards(self, model)
        return super().training_step(model, inputs, num_items_in_batch)


def probe_packed_forwards(trainer, model) -> dict:
    """One no-grad packed logprob call (the reference's kind) on this rank's own rows: rank 0 a sequence of the
    padded width 300 and five of 20 tokens (packed rows of 300 and 100 used columns: 2 forwards, each cut to its
    row), every other rank six of 20 (1 packed row: 1 forward). Under ZeRO-3 each forward gathers the layers'
    parameters from every rank, so every rank must run as many forwards. The mask path's plan (rows of at most the
    padded width; varlen's trees would make one forward of each rank's rows). Returns this rank's plan, the
    forwards it ran and the largest gap to the padded forward."""
    from grpotrl.ops.packing import forward_plan, pack
    from grpotrl.trainers import padding_free

    rank = trainer.accelerator.process_index
    B, L, K = 6, 300, 280
    ids = torch.randint(3, 1000, (B, L), generator=torch.Generator().manual_seed(rank))  # [B, L]
    attn = torch.zeros(B, L, dtype=torch.long)  # [B, L]
    attn[:, L - K - 10:L - K + 10] = 1  # prompts of 10 + completions of 10
    if rank == 0:
        attn[0] = 1
    plan = forward_plan(pack(ids, attn, K, L).widths, B, padding_free.CPU_FORWARD_OVERHEAD)
    seen = []
    hook = trainer.accelerator.unwrap_model(model).register_forward_pre_hook(lambda m, a: seen.append(1))
    attention, trainer.packed_attention = trainer.packed_attention, "mask"
    try:
        with torch.no_grad():
            packed = trainer._get_per_token_logps_and_entropies(model, ids, attn, K)[0]
            forwards = len(seen)
            trainer.padding_free = False
            padded = trainer._get_per_token_logps_and_entropies(model, ids, attn, K)[0]
    finally:
        trainer.padding_free, trainer.packed_attention = True, attention
        hook.remove()
    return {"plan": len(plan), "forwards": forwards, "gap": float((packed - padded).abs().max())}


class NoSyncGRPOTrainer(grpotrl.GRPOTrainer):
    """TRL 1.14's bug class, reintroduced (method ``grpo_nosync``): every forward and backward under DDP's
    ``no_sync``, so the gradients are never all-reduced and each rank steps its own weights (I12)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        with self.model_wrapped.no_sync():
            return super().training_step(model, inputs, num_items_in_batch)


class NanOnRank1GRPOTrainer(grpotrl.GRPOTrainer):
    """GRPO whose loss forward's logits are NaN on rank 1 only (method ``grpo_nan_rank1``; generation and the
    no-grad forwards are left alone): that rank's loss is NaN, the other's is finite, and under ZeRO no rank
    holds its gradients in ``.grad``. The ``non_finite`` health rule must stop every rank at step 1: a rank
    that stopped alone would leave the other waiting in its next collective."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model.model.norm.register_forward_hook(self._poison)  # the last hidden states: TRL's fused head reads them

    def _poison(self, module, inputs, output):
        if self.accelerator.process_index == 1 and torch.is_grad_enabled():
            return output * float("nan")
        return output


class NonFiniteDGADTrainer(grpotrl.GADTrainer):
    """GAD whose discriminator goes non-finite on rank 1 only (method ``gad_nonfinite``), in the loss's forward
    (gradient enabled; the I9 guard is off): in D's first step the last score, a teacher's, is -inf through a
    path without gradient (the Bradley-Terry loss is inf, its gradients finite), in its second the gradient
    reaching every score is NaN (the loss finite). The students' scores, the rewards, stay finite. Records D
    after each step: whether it stepped, its full-weight and this rank's optimizer checksums (``d_steps``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.d_steps = []
        self.accelerator.unwrap_model(self._d.model).register_forward_hook(self._poison)  # DeepSpeed: .module
        step = self._d.step

        def recorded(finite: bool = True) -> bool:
            stepped = step(finite=finite)
            self.d_steps.append({"stepped": stepped, **discriminator_state(self)})  # every rank: ZeRO-3 gathers
            return stepped

        self._d.step = recorded

    def _poison(self, module, inputs, scores):  # scores: [rows + teachers]
        if self.accelerator.process_index != 1 or not torch.is_grad_enabled() or len(self.d_steps) > 1:
            return scores
        if not self.d_steps:
            return torch.cat([scores[:-1], scores[-1:] * 0 - float("inf")])
        scores = scores.clone()
        scores.register_hook(lambda grad: grad * float("nan"))
        return scores


def rank_checks(trainer) -> list:
    """(step, parameters compared, sharded) of each I12 check ``RankAgreement`` ran on this rank."""
    from grpotrl.guards.ranks import RankAgreement

    return [list(c) for cb in trainer.callback_handler.callbacks if isinstance(cb, RankAgreement) for c in cb.compared]


def common(out: str, steps: int) -> dict:
    return dict(output_dir=out, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1, max_steps=steps,
                logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no", guard_steps=-1,
                seed=0, learning_rate=1e-4)


def run(method: str, model_dir: str, out: str, steps: int) -> tuple:
    clock = StepClock()
    if method == "sft":
        args = grpotrl.SFTConfig(**common(os.path.join(out, "sft"), steps), max_length=64)
        trainer = grpotrl.SFTTrainer(model=model_dir, args=args, train_dataset=sft_rows(), callbacks=[clock])
    elif method == "grpo_nan_rank1":
        args = grpotrl.GRPOConfig(**{**common(os.path.join(out, method), steps), "guard_steps": 0}, **RL)
        trainer = NanOnRank1GRPOTrainer(model=model_dir, reward_funcs=length_reward, args=args,
                                        train_dataset=grpo_prompts(), callbacks=[clock])
    elif method in ("grpo", "grpo_nosync"):
        args = grpotrl.GRPOConfig(**common(os.path.join(out, method), steps), beta=0.04, **RL)
        cls = NoSyncGRPOTrainer if method == "grpo_nosync" else ProbedGRPOTrainer
        trainer = cls(model=model_dir, reward_funcs=length_reward, args=args,
                                      train_dataset=grpo_prompts(), callbacks=[clock])
    elif method == "gad_nonfinite":  # D's steps 1 and 2 non-finite, its step 3 not
        args = grpotrl.GADConfig(**{**common(os.path.join(out, method), 3), "guard_steps": 0},
                                 discriminator_learning_rate=1e-4, **RL)
        trainer = NonFiniteDGADTrainer(model=model_dir, args=args, train_dataset=gad_rows(), callbacks=[clock])
        trainer.d_start = discriminator_state(trainer)
    else:
        trainer = gad_trainer(model_dir, out, steps, clock)
        trainer.d_start = discriminator_state(trainer)
    trainer.train()
    return trainer, clock


def gad_trainer(model_dir: str, out: str, steps: int, clock=None):
    """GAD with a KL loss (k3, TRL's reference model prepared under the same launch) and a
    checkpoint every step."""
    args = grpotrl.GADConfig(**{**common(os.path.join(out, "gad"), steps), "save_strategy": "steps", "save_steps": 1},
                             beta=0.04, discriminator_learning_rate=1e-4, **RL)
    return grpotrl.GADTrainer(model=model_dir, args=args, train_dataset=gad_rows(),
                              callbacks=[clock] if clock else None)


def discriminator_state(trainer) -> dict:
    """D's full-weight checksum (every rank calls this: ZeRO-3 gathers) and this rank's optimizer
    state checksum (the inner optimizer's parameters, i.e. fp32 master shards under ZeRO, and its
    moments)."""
    weights = trainer._d.full_state_dict()
    inner = getattr(trainer.discriminator_optimizer, "optimizer", trainer.discriminator_optimizer)
    tensors = [p for g in inner.param_groups for p in g["params"]]
    tensors += [t for st in inner.state.values() for t in st.values() if torch.is_tensor(t) and t.is_floating_point()]
    return {"weights": float(sum(t.double().sum() for t in weights.values())), "n_weights": len(weights),
            "optimizer": float(sum(t.double().sum() for t in tensors)), "optimizer_tensors": len(tensors)}


def d_logs(trainer) -> list[dict]:
    """The gad/* metrics of each logged step."""
    return [{k: v for k, v in e.items() if k.startswith("gad/")} for e in trainer.state.log_history
            if "gad/d_loss" in e]


def gad_evidence(trainer, model_dir: str, out: str, steps: int) -> dict:
    end = discriminator_state(trainer)
    resumed = gad_trainer(model_dir, out + "-resumed", steps)
    resumed.train(resume_from_checkpoint=os.path.join(out, "gad", "checkpoint-1"))
    return {"d_start": trainer.d_start, "d_end": end, "d_resumed": discriminator_state(resumed),
            "d_logs": d_logs(trainer),
            "d_checkpoint_files": sorted(os.listdir(os.path.join(out, "gad", "checkpoint-1", "discriminator")))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a local model dir with model.safetensors")
    p.add_argument("--out", required=True)
    p.add_argument("--methods", default="sft,grpo", help="comma-separated, run in order: sft, grpo, gad")
    p.add_argument("--steps", type=int, default=2)
    a = p.parse_args()
    count_guards()
    watch_generation_unwrap()

    start_dir = a.model
    trainer = None
    for method in a.methods.split(","):
        GUARD_CALLS.clear()
        GENERATIONS.clear()
        try:
            trainer, clock = run(method, start_dir, a.out, a.steps)
        except (grpotrl.InputError, grpotrl.InvariantError, grpotrl.HealthStop) as err:  # what the user would see
            rank = PartialState().process_index
            with open(os.path.join(a.out, f"{method}_rank{rank}.json"), "w") as f:
                json.dump({"method": method, "rank": rank, "error": str(err), "kind": type(err).__name__}, f,
                          indent=1)
            continue
        acc = trainer.accelerator
        unwrapped = acc.unwrap_model(trainer.model_wrapped)
        plugin = acc.state.deepspeed_plugin
        evidence = {
            "method": method,
            "error": None,
            "rank": acc.process_index,
            "world_size": acc.num_processes,
            "distributed_type": str(acc.distributed_type),
            "zero_stage": plugin.zero_stage if plugin is not None else None,
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
            "global_step": trainer.state.global_step,
            "guard_calls": dict(GUARD_CALLS),
            "padding_free": getattr(trainer, "padding_free", None),
            "logged_gaps": [e["guards/logprob_max_gap"] for e in trainer.state.log_history
                            if "guards/logprob_max_gap" in e],
            "generations": list(GENERATIONS),
            "rank_checks": rank_checks(trainer),
            "empty_params_outside_generation": n_empty(unwrapped),
            "step_times": clock.times,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "start_dir": start_dir,
            **weight_change(unwrapped, start_dir),
        }
        if method == "grpo":
            evidence["probe"] = trainer.probe
        if method == "gad":
            evidence.update(gad_evidence(trainer, start_dir, a.out, a.steps))
        if method == "gad_nonfinite":
            evidence.update(d_start=trainer.d_start, d_steps=trainer.d_steps, d_logs=d_logs(trainer))
        save_dir = os.path.join(a.out, method)
        trainer.save_model(save_dir)  # ZeRO-3: gathers the 16-bit weights on rank 0 (a collective)
        acc.wait_for_everyone()  # the next method loads what rank 0 wrote
        with open(os.path.join(a.out, f"{method}_rank{acc.process_index}.json"), "w") as f:
            json.dump(evidence, f, indent=1)
        start_dir = save_dir
    if trainer is not None:  # as a script ends a run (train() registered the pause for the collective threads)
        trainer.end()


if __name__ == "__main__":
    main()
