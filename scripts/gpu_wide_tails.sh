#!/bin/bash
# GEMM 2's wide tail tiles (MOK_GEMM_WIDE_TAILS, docs/gemm.md fifteenth session), one GPU call:
# test_gemm (the knob's bits against the default, ForwardTails), compute-sanitizer memcheck of
# the small forward with the knob on, then bench_gemm on routed (random) segments with the
# knob off / on alternating (A B A B) in separate processes. Binaries of
# `scripts/gpu_validate.sh build` (carry .devbin); logs and JSON under $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
B=$PWD/.devbin/validate
export LD_LIBRARY_PATH=$B:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPES=${SHAPES:-dsv3 gptoss}
nvidia-smi -L
timeout 120 $B/test_gemm > $OUT/test_gemm.log 2>&1; echo "test_gemm rc=$?"; grep -E '^\[  (PASSED|FAILED)' $OUT/test_gemm.log
grep -E 'Failure|FAILED  \]' $OUT/test_gemm.log | head -8
MOK_GEMM_WIDE_TAILS=1 timeout 120 compute-sanitizer --tool memcheck $B/test_gemm --gtest_filter='*ForwardTails*:*SanitizerSmallForward*' \
  > $OUT/memcheck_wide.log 2>&1; echo "memcheck wide rc=$?"; grep -E 'ERROR SUMMARY|PASSED|FAILED' $OUT/memcheck_wide.log | head -3
for round in 1 2; do
  for w in 0 1; do
    for s in $SHAPES; do
      MOK_GEMM_WIDE_TAILS=$w timeout 120 $B/bench_gemm --shape $s --segments random \
        --json $OUT/gemm-wide$w-$s-r$round.json --commit ${MOK_COMMIT:-unknown} > $OUT/bench-wide$w-$s-r$round.log 2>&1
      echo "bench wide=$w $s round $round rc=$?"
    done
  done
done
echo "==== routed (random) segments, rounds in order; columns: shape segments kind ms TFLOP/s ... ===="
for round in 1 2; do for w in 0 1; do for s in $SHAPES; do
  grep -E "^$s +random +(gemm2|gemm1_swiglu|dgrad_dx) " $OUT/bench-wide$w-$s-r$round.log | sed "s/^/r$round wide=$w  /"
done; done; done
