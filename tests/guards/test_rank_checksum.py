"""I12: every rank holds the same model (grpotrl/guards/ranks.py).

The pure check on hand-made checksums, then two-process CPU launches (gloo) through
tests/dist_worker.py, as tests/test_distributed.py does: under DDP a GRPO trainer that never
all-reduces its gradients (TRL 1.14's bug class: DDP's ``no_sync`` on every step) is stopped after
its first optimizer step naming a parameter, and the healthy GRPO run after it passes (control);
under ZeRO-3 SFT and GRPO compare shard sums against the gathered parameters and pass.
"""

import math

import pytest
import torch
from test_distributed import accelerate_launch, read_evidence

from grpotrl import InvariantError
from grpotrl.guards.ranks import ZERO3_RTOL, check_ranks_agree, tensor_checksum

F64 = torch.float64


def test_I12_tensor_checksum_is_sum_and_abs_sum_in_float64():
    # 0.1 + 0.2 in float32 then float64: 0.10000000149011612 + 0.20000000298023224
    got = tensor_checksum(torch.tensor([0.1, -0.2], dtype=torch.float32)).tolist()
    assert got == [0.10000000149011612 - 0.20000000298023224, 0.10000000149011612 + 0.20000000298023224]


def test_I12_replicas_that_differ_name_the_first_parameter_and_each_ranks_values():
    # W=2 ranks, N=3 parameters; columns [shard sum, shard |x|, full sum, full |x|] (replicas: both halves equal)
    same = [[1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0], [3.0, 3.0, 3.0, 3.0]]
    other = [[1.0, 1.0, 1.0, 1.0], [2.0, 2.5, 2.0, 2.5], [3.5, 3.5, 3.5, 3.5]]  # b differs only in sum|x|
    with pytest.raises(InvariantError, match=r"\[I12\] after optimizer step 1 .* 'b' \(rank 0: sum 2.0, sum\|x\| "
                                             r"2.0; rank 1: sum 2.0, sum\|x\| 2.5\); 2 of 3 parameters differ"):
        check_ranks_agree(["a", "b", "c"], torch.tensor([same, other], dtype=F64), step=1, sharded=False)
    check_ranks_agree(["a", "b", "c"], torch.tensor([same, same], dtype=F64), step=1, sharded=False)  # control


def test_I12_replicas_must_be_bitwise_equal():
    # one float64 ulp apart at 1.0 (2**-52): replicas computed the same bits, so this already differs
    a = torch.tensor([[[1.0, 1.0, 1.0, 1.0]], [[1.0, 1.0, 1.0 + 2**-52, 1.0]]], dtype=F64)
    with pytest.raises(InvariantError, match="'w'"):
        check_ranks_agree(["w"], a, step=2, sharded=False)


def test_I12_zero3_gathered_parameter_must_be_the_sum_of_the_shards():
    # rank 0's shard sums to 1.5 and rank 1's to -0.5, so the gathered parameter must sum to 1.0; sum|x| 4.0
    def rows(full_sum):
        return torch.tensor([[[1.5, 2.0, full_sum, 4.0]], [[-0.5, 2.0, full_sum, 4.0]]], dtype=F64)

    check_ranks_agree(["w"], rows(1.0), step=1, sharded=True)
    check_ranks_agree(["w"], rows(1.0 + 0.5 * ZERO3_RTOL * 4.0), step=1, sharded=True)  # rounding of two orders
    with pytest.raises(InvariantError, match=r"ZeRO-3 parameter 'w' .*sum 1.01\) is not the sum of the shards"):
        check_ranks_agree(["w"], rows(1.01), step=1, sharded=True)
    mixed = rows(1.0)
    mixed[1, 0, 2] = 1.0 + 1e-6  # rank 1 gathered other bits than rank 0
    with pytest.raises(InvariantError, match="ranks hold different values"):
        check_ranks_agree(["w"], mixed, step=1, sharded=True)
    assert math.isclose(ZERO3_RTOL, 1e-9)


def test_I12_ddp_without_gradient_allreduce_is_stopped_at_step_1_and_the_healthy_run_passes(tiny_llama, tmp_path):
    accelerate_launch("ddp", tmp_path, tiny_llama, "grpo_nosync,grpo")
    ev = read_evidence(tmp_path, "grpo_nosync,grpo")
    for rank in (0, 1):
        err = ev["grpo_nosync", rank]["error"]
        print(f"rank {rank}: {err}")
        assert err and err.startswith("[I12] after optimizer step 1 the ranks hold different values of the trainable "
                                      "parameter 'model."), err
        healthy = ev["grpo", rank]
        assert healthy["error"] is None, healthy["error"]
        assert [(s, sharded) for s, _, sharded in healthy["rank_checks"]] == [(1, False), (2, False)]
        assert healthy["rank_checks"][0][1] >= 10  # every trainable tensor of the tiny llama


def test_I12_zero3_sft_and_grpo_compare_shards_with_the_gathered_parameters(tiny_llama, tmp_path):
    accelerate_launch("zero3", tmp_path, tiny_llama, "sft,grpo")
    ev = read_evidence(tmp_path, "sft,grpo")
    for (method, rank), e in ev.items():
        assert e["error"] is None, (method, rank, e["error"])
        assert [(s, sharded) for s, _, sharded in e["rank_checks"]] == [(1, True), (2, True)], (method, rank)
