#!/usr/bin/env bash
# The speed settings' GPU check, in commands that each end inside a lent machine's 10-minute limit:
#   bash bench/gpu_check.sh bench   # about 5 minutes at 8 x 8 x 256: plain TRL, grpotrl's defaults (the compiled
#                                   # rollout on CUDA) and the compiled rollout with padding_free's varlen kernel (fastest)
#   bash bench/gpu_check.sh tests   # about 4-5 minutes: tests/test_gpu.py's speed settings with every guard on, I5
#                                   # under the compiled rollout and under the varlen kernel
#   bash bench/gpu_check.sh all     # one command of at most 9 minutes (a lease's one long call): the bench (each
#                                   # child at most 150 s), the guard readings' peak (bench_guard_readings.py), then
#                                   # as many of the speed tests as the time left allows, the varlen kernel's first
# on a CUDA machine with grpotrl, TRL and the model installed (a bare machine: stage it, then prefix each command
# with the stage script, as the GPU notes in docs/cost.md say). Each part runs under a timeout and leaves its output
# in $OUT (or /tmp/grpotrl-gpu-check): a variant that fails or hangs is killed and reported, the others go on.
# What to read in it: docs/cost.md, "Defaults per device, CPU and GPU side by side".
set -u
part=${1:-bench}
out=${OUT:-/tmp/grpotrl-gpu-check}
mkdir -p "$out"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
case "$part" in
  bench)
    # the guard steps (1-2) run I5 against the padded recompute: a variant whose logprobs are off stops with I5
    timeout 510 python3 bench/bench_padding_free.py --variants trl,default,fastest --steps 5 \
      --child-timeout 200 2>&1 | tee "$out/bench.txt"
    exit "${PIPESTATUS[0]}" ;;
  tests)
    timeout 540 python3 -m pytest -q -rs tests/test_gpu.py -k "speed_settings or compiled_rollout or varlen_kernel" \
      2>&1 | tee "$out/tests.txt"
    exit "${PIPESTATUS[0]}" ;;
  all)
    start=$SECONDS
    timeout 420 python3 bench/bench_padding_free.py --variants trl,default,fastest --steps 5 \
      --child-timeout 150 2>&1 | tee "$out/bench.txt"
    bench=${PIPESTATUS[0]}
    timeout 60 python3 bench/bench_guard_readings.py --device cuda 2>&1 | tee "$out/readings.txt"
    left=$(( 530 - (SECONDS - start) ))
    echo "bench exited $bench; $left s left for the tests" | tee -a "$out/bench.txt"
    # the tests least covered first: those the time left cuts are the last ones
    t=tests/test_gpu.py
    [ "$left" -gt 60 ] && timeout "$left" python3 -m pytest -q -rs \
      "$t::test_the_varlen_kernel_trains_with_every_guard_and_I5_stops_a_shifted_position" \
      "$t::test_I5_stops_a_loss_at_1_1x_the_sampling_temperature_under_the_compiled_rollout" \
      "$t::test_I5_passes_the_same_trainer_at_the_sampling_temperature_under_the_compiled_rollout" \
      "$t::test_speed_settings_on_cuda_bf16_pass_every_guard" \
      2>&1 | tee "$out/tests.txt"
    exit "$bench" ;;
  *)
    echo "usage: bash bench/gpu_check.sh bench|tests|all" >&2
    exit 2 ;;
esac
