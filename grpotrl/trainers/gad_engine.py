"""How GADTrainer's discriminator D is prepared, stepped and checkpointed under the launch the
student runs under: one object per way, the same calls, and the D step on them
(``_Engine.score_and_step``: score student and teacher responses, step D on the Bradley-Terry loss).

* ``TorchDiscriminator``: single process and DDP. ``accelerator.prepare_model`` (DDP-wrapped when
  there are several processes) and a plain ``torch.optim.AdamW`` (weight decay ``D_WEIGHT_DECAY``
  under every launch, not the student's ``weight_decay``), not accelerate's: an
  AcceleratedOptimizer skips ``step()`` while the student accumulates gradients, and D steps once
  per generation batch, mid-window.
* ``DeepSpeedDiscriminator``: ``deepspeed.initialize`` with the student's DeepSpeed config (same
  ZeRO stage, precision, offload; TRL prepares its reference model the same way), its own AdamW
  (DeepSpeed's CPU Adam when the optimizer is offloaded), ``train_micro_batch_size_per_gpu`` one
  scoring chunk, and the accumulation boundary set by the caller (the last chunk of a D step).

Both skip a D step whose loss (summed over processes) or gradients are not finite, keeping D's weights
and optimizer state, and log ``gad/d_step_skipped``.

D's update is chunked: ``accumulate(last)`` around each chunk's forward and ``backward``, then
one ``step()``. Checkpoints (``discriminator/`` in ``checkpoint-N``): the full weights
``model.safetensors`` (ZeRO-3 shards gathered), and the optimizer state, ``optimizer.pt`` or
DeepSpeed's own sharded checkpoint (``latest`` + ``ds/``), restored on resume; ``load_weights`` reads the
weights alone (``model.safetensors``, in every checkpoint, ``save_only_model`` ones included).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os

import torch
from safetensors.torch import load_file, save_file

from ..checkpoints import D_OPTIMIZER, D_WEIGHTS, DS_TAG
from ..errors import InputError, InvariantError
from ..gad.discriminator import Discriminator, bradley_terry_loss, state_gap, state_tolerance
from ..models.dropout import has_dropout

logger = logging.getLogger(__name__)

# D's AdamW weight decay under every launch (torch AdamW's default; DeepSpeed's CPU Adam would default to 0). Not
# the student's ``weight_decay``: D's optimizer is its own, as its constant ``discriminator_learning_rate`` is.
D_WEIGHT_DECAY = 0.01


def prepare_discriminator(trainer, disc: torch.nn.Module, lr: float):
    return (DeepSpeedDiscriminator if trainer.is_deepspeed_enabled else TorchDiscriminator)(trainer, disc, lr)


class _Engine:
    """What both engines share: the D step, and the full weights written once, by the main process."""

    def score_and_step(self, reward, inputs: list[dict], prompts: list, completion_ids: list,
                       update: bool, check_alone: bool) -> tuple[torch.Tensor, dict[str, float]]:
        """Score each student response (decoded from its generated ids, special tokens kept:
        ``reward.texts``) and its row's teacher response (``inputs[i]["teacher_response"]``) with D through
        ``reward`` (a ``DiscriminatorReward``: parts, packed batches); with ``update``, step D on the
        Bradley-Terry loss. ``check_alone``: I9 on the first chunk (``check_score_alone``).

        The scores are D's function, without dropout: where D holds dropout and steps (``disable_dropout``
        off), each chunk is read first in eval mode without gradient, then run again in train mode for
        the loss; otherwise one forward gives both. Returns the student scores [N] of D before the step,
        and the gad/* metrics over every process (``d_loss`` from the loss's forward, the rest from the
        scores)."""
        student_parts = reward.parts(prompts, reward.texts(completion_ids), reward.finished(completion_ids))
        # one teacher sequence per distinct (prompt, teacher_response): a group shares it
        keys = [json.dumps(p, sort_keys=True) + "\x00" + x["teacher_response"] for p, x in zip(prompts, inputs)]
        first: dict[str, int] = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        slot = {k: j for j, k in enumerate(first)}
        teacher_of = [slot[k] for k in keys]  # row -> index into teacher_parts
        order = list(first.values())  # teacher_parts[j] comes from row order[j]
        teacher_parts = reward.parts([prompts[i] for i in order], [inputs[i]["teacher_response"] for i in order])

        device = self.accelerator.device
        n, chunk = len(student_parts), self.args.per_device_train_batch_size
        student_scores = torch.empty(n, device=device)
        teacher_scores = torch.empty(len(teacher_parts), device=device)
        sums = torch.zeros(3, device=device)  # loss sum, correct pairs, pairs
        d = self.model
        read_apart = update and has_dropout(d)  # the loss's forward drops; the reward must not
        d.train(update)
        starts = list(range(0, n, chunk))
        for j, start in enumerate(starts):
            rows = list(range(start, min(start + chunk, n)))
            needed = sorted({teacher_of[r] for r in rows})
            pair = [needed.index(teacher_of[r]) for r in rows]  # [rows] each row's teacher among needed
            parts = [student_parts[r] for r in rows] + [teacher_parts[t] for t in needed]
            read = None
            watch = self._reading() if j == 0 and check_alone else contextlib.nullcontext()
            if read_apart:
                d.eval()
                with torch.no_grad(), self.accelerator.autocast(), watch as seen:
                    read = d(**reward.batch(parts, device=device))  # [rows + teachers] D itself, no dropout
                d.train()
                watch = contextlib.nullcontext(seen)
            batch = reward.batch(parts, device=device)  # a prompt several rows share runs once
            last = j == len(starts) - 1
            sync = self.accumulate(last) if update else contextlib.nullcontext()
            grad = torch.enable_grad() if update else torch.no_grad()
            with sync, grad, self.accelerator.autocast(), watch as seen:
                scores = d(**batch)  # [rows + teachers]
                loss = bradley_terry_loss(scores[len(rows):][pair], scores[: len(rows)]) * len(rows) / n
                if update:  # this chunk's share of the mean over pairs
                    self.backward(loss)
            read = scores.detach() if read is None else read
            if j == 0 and check_alone:
                self.check_score_alone([p + r for p, r in parts], read, seen, reward.tokenizer)
            s, t = read[: len(rows)], read[len(rows):][pair]  # [rows], [rows]
            student_scores[rows] = s
            teacher_scores[needed] = read[len(rows):]
            sums += torch.stack([loss.detach() * n, (t > s).sum().float(), torch.tensor(len(rows), device=device)])
        stats = torch.cat([sums, torch.stack([teacher_scores.sum(), torch.tensor(float(len(teacher_scores)),
                                                                                  device=device),
                                              student_scores.sum()])])
        total = self.accelerator.gather(stats).view(-1, 6).sum(0).tolist()
        metrics = {"gad/d_loss": total[0] / total[2], "gad/d_acc": total[1] / total[2],
                   "gad/teacher_score": total[3] / total[4], "gad/student_score": total[5] / total[2]}
        if update:  # every process sees the same loss sum, and (after DDP's average) the same gradients
            metrics["gad/d_step_skipped"] = float(not self.step(finite=math.isfinite(total[0])))
        return student_scores, metrics

    def _reading(self):
        """``Discriminator.reading`` of D under any DDP or DeepSpeed wrapper."""
        d = self.model.module if isinstance(getattr(self.model, "module", None), Discriminator) else self.model
        if not isinstance(d, Discriminator):
            raise InvariantError("I9", f"The discriminator is a {type(d).__name__}, not a grpotrl Discriminator: the "
                                       "I9 guard cannot read the hidden state its score head reads.")
        return d.reading()

    def check_score_alone(self, seqs: list[list[int]], batched: torch.Tensor, seen: dict, tokenizer) -> None:
        """I9 at run time, on the most padded sequence of the batch and its last one (the furthest from its prompt
        when the batch is packed, ``scoring_batch``): the hidden state D's score head read for it inside the
        batch equals, within ``state_tolerance`` of the compute dtype (``state_gap``, relative), the backbone's
        hidden state at the last position of the sequence run alone, unpadded, in eval mode: its last token,
        found without D's pooling or mask. And the score the batch used (``batched``, D's scores without
        dropout) is its head's output on that state, exactly. ``seen``: ``Discriminator.reading`` of the forward
        that gave ``batched``. A sequence whose batch score is not finite is left to the non-finite reward
        handling (counted, its row missing: ``nonfinite_reward``); any other NaN stops the run."""
        head_input, head_scores = self._one_forward(seen, "head_input"), self._one_forward(seen, "scores")
        if head_input.size(0) != batched.numel() or head_scores.numel() != batched.numel():
            raise InvariantError("I9", f"The discriminator's score head read {head_input.size(0)} rows for "
                                       f"{batched.numel()} scores: the guard cannot tell which state gave which score.")
        shortest = min(range(len(seqs)), key=lambda i: len(seqs[i]))
        last = len(seqs) - 1 if len(seqs) - 1 != shortest else 0
        training = self.model.training
        self.model.eval()
        dtype = self._compute_dtype()
        tf32 = dtype == torch.float32 and batched.is_cuda and torch.backends.cuda.matmul.allow_tf32
        tol = state_tolerance(dtype, tf32)
        for k in (shortest, last):  # always two forwards (ZeRO-3: every process must run as many)
            ids = torch.tensor([seqs[k]], dtype=torch.long, device=batched.device)  # [1, L], no padding
            with torch.no_grad(), self.accelerator.autocast(), self._reading() as alone:
                alone_score = self.model(ids, torch.ones_like(ids))[0]
            if not torch.isfinite(batched[k]):
                continue
            reference = self._one_forward(alone, "last_position")  # [1, H] the sequence's last token
            gap = state_gap(head_input[k:k + 1], reference).item()
            end = repr(tokenizer.decode(seqs[k][-12:]))
            if not gap <= tol:
                raise InvariantError(
                    "I9", f"For a sequence inside its batch (padded, or packed with shared prompts) the "
                    f"discriminator's score head read a hidden state {gap:.3g} away (relative; > {tol:.1e}) from the "
                    f"backbone's at the sequence's last token alone (score {batched[k].item():.6f} in the batch, "
                    f"{alone_score.item():.6f} alone): it does not read the last real token. Sequence end: {end}. "
                    "A custom discriminator must pool by the attention mask (grpotrl.gad.discriminator.Discriminator "
                    "does); a packed batch needs an attention that takes its 4D mask as given (sdpa, eager).")
            if not torch.equal(batched[k], head_scores[k]):
                raise InvariantError(
                    "I9", f"The discriminator's batch scored a sequence {batched[k].item():.6f}, but its score head "
                    f"gave {head_scores[k].item():.6f} for the state read for it: the scores used are not the "
                    f"head's at the last real token. Sequence end: {end}.")
        self.model.train(training)

    @staticmethod
    def _one_forward(seen: dict, key: str) -> torch.Tensor:
        """What the one forward watched read (``Discriminator.reading``): none, or several, cannot be paired."""
        if len(seen[key]) != 1:
            part = "backbone" if key == "last_position" else "score head"
            raise InvariantError("I9", f"The discriminator's {part} ran {len(seen[key])} times in one forward: the "
                                       "I9 guard cannot tell which run read the scored sequences.")
        return seen[key][0]

    def _compute_dtype(self) -> torch.dtype:
        """The precision D's forward runs in: the mixed-precision setting, else its weights' dtype."""
        if self.args.bf16 or self.args.fp16:
            return torch.bfloat16 if self.args.bf16 else torch.float16
        return next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def save_weights(self, directory: str) -> None:
        """Called on every process (ZeRO-3 gathers); the main one writes ``directory/model.safetensors``."""
        state = self.full_state_dict()
        if self.args.should_save:
            os.makedirs(directory, exist_ok=True)
            save_file(state, os.path.join(directory, D_WEIGHTS), metadata={"format": "pt"})


class TorchDiscriminator(_Engine):
    def __init__(self, trainer, disc: torch.nn.Module, lr: float):
        self.accelerator, self.args, self.lr = trainer.accelerator, trainer.args, lr
        self.model = self.accelerator.prepare_model(disc)
        # Fused, like the student's default optimizer (adamw_torch_fused).
        fused = str(getattr(self.args.optim, "value", self.args.optim)).endswith("fused")
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr,
                                           weight_decay=D_WEIGHT_DECAY, fused=fused)

    def accumulate(self, last: bool):
        """DDP averages gradients on the last chunk's backward only."""
        return contextlib.nullcontext() if last else self.accelerator.no_sync(self.model)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, finite: bool = True) -> bool:
        """One optimizer step on the accumulated gradients, unless the loss (``finite``: its sum over every
        process) or a gradient is not finite: then the gradients are dropped and D's weights stay as they
        were (a NaN or inf in D's forward would write NaN into every weight it reaches). Returns whether
        it stepped."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if finite and grads:
            finite = bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))
        if finite:
            if self.args.max_grad_norm and self.args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
            self.optimizer.step()
        else:
            logger.warning("The discriminator's loss or gradients are not finite: its step is skipped and its "
                           "weights are kept (gad/d_step_skipped).")
        self.optimizer.zero_grad(set_to_none=True)
        return finite

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights on CPU."""
        state = self.accelerator.unwrap_model(self.model).state_dict()
        return {k: v.detach().contiguous().cpu() for k, v in state.items()}

    def save_optimizer(self, directory: str) -> None:
        if self.args.should_save:
            os.makedirs(directory, exist_ok=True)
            torch.save(self.optimizer.state_dict(), os.path.join(directory, D_OPTIMIZER))

    def load_weights(self, directory: str) -> bool:
        """D's weights from ``directory/model.safetensors`` on this process, the optimizer state left as it is;
        returns False, loading nothing, where the file is not there."""
        path = os.path.join(directory, D_WEIGHTS)
        if not os.path.isfile(path):
            return False
        # read to CPU, copied to D's device by load_state_dict (under multi-CPU DDP the device
        # is "cpu:0", which safetensors refuses)
        self.accelerator.unwrap_model(self.model).load_state_dict(load_file(path, device="cpu"))
        return True

    def load(self, directory: str) -> None:
        """D's weights and optimizer state (both checked there before anything loaded, ``CheckedResume.train``)."""
        self.load_weights(directory)
        self.optimizer.load_state_dict(torch.load(os.path.join(directory, D_OPTIMIZER), map_location="cpu",
                                                  weights_only=True))
        for group in self.optimizer.param_groups:  # the recipe's lr holds, as for the student
            group["lr"] = self.lr


@contextlib.contextmanager
def _update_held(optimizer: torch.optim.Optimizer):
    """Inside, ``optimizer.step()`` changes nothing (no weight, no moment, no step count): DeepSpeed's step
    around it still runs (drops its gradient buffers, copies the unchanged master weights back)."""
    own = vars(optimizer).get("step")  # a step of the instance's own (an LR scheduler wraps it so), else the class's
    optimizer.step = lambda *args, **kwargs: None
    try:
        yield
    finally:
        if own is None:
            del optimizer.step
        else:
            optimizer.step = own


def deepspeed_config(student_config: dict, micro_batch: int, world_size: int, max_grad_norm: float,
                     hidden_size: int | None) -> dict:
    """D's DeepSpeed config from the student's: the same ZeRO stage, precision and offload; D's own
    optimizer (any ``optimizer``/``scheduler`` block is dropped); one chunk per micro-batch, no
    accumulation of its own (the caller marks the boundary); "auto" bucket sizes filled from the
    hidden size as transformers fills the student's."""
    cfg = copy.deepcopy(student_config)
    cfg.pop("optimizer", None)
    cfg.pop("scheduler", None)
    cfg.update(train_micro_batch_size_per_gpu=micro_batch, gradient_accumulation_steps=1,
               train_batch_size=micro_batch * world_size, gradient_clipping=float(max_grad_norm or 0.0))
    zero = cfg.setdefault("zero_optimization", {})
    h = hidden_size or 1024
    fill = {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h}
    for key, value in list(zero.items()):
        if value == "auto":
            if key not in fill:
                raise InputError(f"The DeepSpeed config's zero_optimization.{key} is 'auto', which the GAD "
                                 "discriminator cannot fill; give it a value.")
            zero[key] = fill[key]
    for key in ("bf16", "fp16"):
        if isinstance(cfg.get(key), dict) and cfg[key].get("enabled") == "auto":
            raise InputError(f"The DeepSpeed config's {key}.enabled is still 'auto' when the GAD discriminator is "
                             "set up; set it to true or false.")
    if isinstance(cfg.get("bf16"), dict) and cfg["bf16"].get("enabled"):
        cfg["bf16"]["check_grad_overflow"] = True  # D's step is skipped on a non-finite gradient norm (``step``)
    return cfg


class DeepSpeedDiscriminator(_Engine):
    def __init__(self, trainer, disc: torch.nn.Module, lr: float):
        import deepspeed

        self.accelerator, self.args, self.lr = trainer.accelerator, trainer.args, lr
        student_cfg = self.accelerator.state.deepspeed_plugin.deepspeed_config
        hidden = getattr(getattr(disc.hf_model, "config", None), "hidden_size", None)
        cfg = deepspeed_config(student_cfg, self.args.per_device_train_batch_size, self.accelerator.num_processes,
                               self.args.max_grad_norm, hidden)
        self.stage = cfg["zero_optimization"].get("stage", 0)
        params = [p for p in disc.parameters() if p.requires_grad]
        offload = cfg["zero_optimization"].get("offload_optimizer", {}).get("device", "none") not in ("none", None)
        if offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(params, lr=lr, weight_decay=D_WEIGHT_DECAY, adamw_mode=True)
        else:
            optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=D_WEIGHT_DECAY)
        self.base_optimizer = optimizer  # the one DeepSpeed's ZeRO/bf16 wrapper steps on its master weights
        self.model, self.optimizer, _, _ = deepspeed.initialize(model=disc, optimizer=optimizer, config=cfg)
        # no ZeRO, no bf16/fp16: DeepSpeed steps the optimizer as it is, with no check of the gradient norm
        self.unchecked = self.stage == 0 and not (self.model.bfloat16_enabled() or self.model.fp16_enabled())

    def accumulate(self, last: bool):
        self.model.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss)  # gradient_accumulation_steps 1: the loss is not rescaled

    def step(self, finite: bool = True) -> bool:
        """DeepSpeed's step (it clips with ``gradient_clipping``, steps and zeroes the gradients), skipped as the
        torch engine's is where the loss (``finite``: its sum over every process) or a gradient is not finite;
        every process takes the same decision. A non-finite gradient: ZeRO-1/2/3 and DeepSpeed's bf16 and fp16
        optimizers skip the step themselves from the global norm they compute anyway (``bf16.check_grad_overflow``
        is set in D's config, ``deepspeed_config``), reported by ``was_step_applied()``; without ZeRO in fp32 no
        wrapper checks, so the gradients are read here (whole on every process there: no extra communication).
        A non-finite loss whose gradients are finite would still step (weight decay and Adam's moments move):
        that step still runs ``engine.step()``, so that DeepSpeed drops the gradients it holds (partitioned,
        offloaded) and ends its accumulation, with the wrapped optimizer's update held: D's weights and
        optimizer state stay as they were. Returns whether it stepped."""
        if finite and self.unchecked:
            finite = self._gradients_finite()
        if finite:
            self.model.step()
            finite = self.model.was_step_applied()
        else:
            with _update_held(self.base_optimizer):
                self.model.step()
        if not finite:
            logger.warning("The discriminator's loss or gradients are not finite: its step is skipped and its "
                           "weights are kept (gad/d_step_skipped).")
        return finite

    def _gradients_finite(self) -> bool:
        """Whether D's gradients (whole on every process: no ZeRO) are finite on every process (a collective of
        one number)."""
        grads = [p.grad for p in self.model.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        bad = (~torch.isfinite(norm)).float().reshape(1).to(self.accelerator.device)  # [1]
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        return not bad.item()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every process calls this: under ZeRO-3 the shards are gathered (a collective)."""
        import deepspeed

        module = self.model.module
        gather = (deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
                  if self.stage == 3 else contextlib.nullcontext())
        with gather:
            return {k: v.detach().contiguous().cpu().clone() for k, v in module.state_dict().items()}

    def save_optimizer(self, directory: str) -> None:
        """DeepSpeed's checkpoint (every process writes its shard): ``latest`` and ``ds/``."""
        self.model.save_checkpoint(directory, tag=DS_TAG)

    def load_weights(self, directory: str) -> bool:
        """D's weights from ``directory/model.safetensors`` (every process calls this: under ZeRO-3 a collective),
        the full weights every checkpoint holds, read one way at every stage; not DeepSpeed's
        ``load_checkpoint(load_module_only=True)``, which under ZeRO-3 rebuilds them from every rank's optimizer
        shards and, its docstring says, cannot load into an engine that has saved (its module is partitioned).
        The optimizer's fp32 master weights are set from them (``refresh_fp32_params``), its moments left as they
        are. Under ZeRO-3 rank 0 reads the file and its copy is partitioned to every rank (rank 0 tells the
        others whether it found one); otherwise each process reads its own. Returns False, loading nothing,
        where the file is not there."""
        import deepspeed

        path, module = os.path.join(directory, D_WEIGHTS), self.model.module
        found = os.path.isfile(path)
        if self.stage == 3:
            flag = torch.tensor([float(found)], device=self.accelerator.device)  # [1]
            torch.distributed.broadcast(flag, src=0)
            found = bool(flag.item())
            if found:
                with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
                    if torch.distributed.get_rank() == 0:
                        module.load_state_dict(load_file(path, device="cpu"))
        elif found:
            module.load_state_dict(load_file(path, device="cpu"))
        if found and hasattr(self.optimizer, "refresh_fp32_params"):  # ZeRO, bf16/fp16: their own fp32 master weights
            self.optimizer.refresh_fp32_params()
        return found

    def load(self, directory: str) -> None:
        path, _ = self.model.load_checkpoint(directory, tag=DS_TAG, load_optimizer_states=True,
                                             load_lr_scheduler_states=False)
        if path is None:
            raise InputError(f"DeepSpeed found no discriminator state in {directory!r} (tag {DS_TAG!r}).")
        for group in self.optimizer.param_groups:  # the recipe's lr holds, as for the student
            group["lr"] = self.lr
