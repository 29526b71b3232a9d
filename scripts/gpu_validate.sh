#!/bin/bash
# Whole-project GPU validation: every GPU test binary, compute-sanitizer on small 1-GPU cases,
# torchrun launch mode, and the `mok` program (info, GPU demo, bench).
#
#   scripts/gpu_validate.sh build   # CPU machine: builds in build/, copies binaries + libmok.so to .devbin/validate/
#   scripts/gpu_validate.sh run     # GPU machine, repo root (MOK_COMMIT=<commit> recommended)
#   BENCH=1 scripts/gpu_validate.sh run   # also the dsv3 forward and comm benchmarks on every GPU
#                                         # (the scale-out run of issue 5 on a 4- or 8-GPU machine)
#   ONLY="test_comm bench_comm" scripts/gpu_validate.sh run   # only the named steps
#   BENCH_FORWARD_ARGS / BENCH_COMM_ARGS replace the benchmarks' default arguments (--out is added)
#
# `run` writes summary.log and logs.tgz (one log per step) under $OUT and prints the summary last.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.devbin/validate
BUILD=${BUILD:-build}
TESTS="test_gemm test_comm test_comm_errors test_comm_bootstrap test_comm_torchrun test_forward test_backward"

build() {
  set -e
  [ -f $BUILD/build.ninja ] || cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release
  ninja -C $BUILD -j2 $TESTS mok_cli
  mkdir -p $BIN
  for t in $TESTS; do cp $BUILD/bin/$t $BIN/; done
  ninja -C $BUILD -j2 bench_forward bench_backward bench_comm bench_gemm
  cp $BUILD/bin/mok $BUILD/bin/bench_forward $BUILD/bin/bench_backward $BUILD/bin/bench_comm $BUILD/bin/bench_gemm $BUILD/src/host/libmok.so $BIN/
  du -sh $BIN
}

STEPS=()
FAILED=0
step() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  local t0=$(date +%s)
  timeout --kill-after=5 $limit "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  [ $rc = 0 ] || FAILED=$((FAILED + 1))
  local what
  what=$(grep -E '^\[  (PASSED|FAILED) +\]|tests? (passed|failed)|ERROR SUMMARY|RACECHECK SUMMARY|bitwise identical|final loss|^soak:' "$LOGS/$name.log" | tr '\n' ' ' | cut -c1-140)
  STEPS+=("$(printf '%-22s rc=%-4s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$what")")
  printf '%s\n' "${STEPS[@]}" > "$OUT/summary.log"
  tar czf "$OUT/logs.tgz" -C "$LOGS" .  # at most 8 files come back: one archive
}

run() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export LD_LIBRARY_PATH=$PWD/$BIN:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  export MOK_COMMIT=${MOK_COMMIT:-unknown}
  OUT=${OUT:-validate-out}; mkdir -p "$OUT"
  LOGS=$(mktemp -d)
  local NGPU; NGPU=$(nvidia-smi -L | wc -l)
  local SAN="compute-sanitizer --error-exitcode 9 --report-api-errors no"
  local TR; TR=$(command -v torchrun || echo /opt/torch/.venv/bin/torchrun)
  step info              20 $BIN/mok info
  step test_gemm         90 $BIN/test_gemm
  step test_comm        180 $BIN/test_comm
  step test_comm_errors  40 $BIN/test_comm_errors
  step test_comm_boot    20 $BIN/test_comm_bootstrap
  step test_forward     300 $BIN/test_forward
  step test_backward    300 $BIN/test_backward
  # the whole backward suite again on the fused backward (MOK_BACKWARD_PATH, default staged)
  step test_backward_fused 300 env MOK_BACKWARD_PATH=fused $BIN/test_backward
  step torchrun          40 $TR --no-python --nproc_per_node=$NGPU --master_port 29571 $BIN/test_comm_torchrun
  step memcheck_gemm     60 $SAN --tool memcheck $BIN/test_gemm --gtest_filter='*SanitizerSmall*'
  step racecheck_gemm    90 $SAN --tool racecheck $BIN/test_gemm --gtest_filter='*SanitizerSmallForward*:*SanitizerSmallDgrad*'
  step memcheck_forward 150 $SAN --tool memcheck $BIN/test_forward --gtest_filter='Ep/FusedVsStaged.*topk8_ep1:Ep/ForwardMacrobatch.*topk8_ep1:Ep/FusedVsStaged.*tails_blocks_ep1'
  step racecheck_forward 300 $SAN --tool racecheck $BIN/test_forward --gtest_filter='Ep/FusedVsStaged.*topk8_ep1:Ep/ForwardMacrobatch.*topk8_ep1:Ep/FusedVsStaged.*tails_blocks_ep1'
  step racecheck_comm    40 $SAN --tool racecheck $BIN/test_comm --gtest_filter='Ep1/*Uniform*'
  step memcheck_comm    120 $SAN --tool memcheck $BIN/test_comm --gtest_filter='Ep1/CommPipeline.*:Ep1/CommCtaCounts.*AllTokens*'
  step memcheck_bwd     150 $SAN --tool memcheck $BIN/test_backward --gtest_filter='Shapes/BackwardVsReference.*T200_top2_shared_ep1_fp32acc:Shapes/BackwardVsReference.*top8_E16_shared_ep1_bf16'
  step racecheck_bwd    300 $SAN --tool racecheck $BIN/test_backward --gtest_filter='Shapes/BackwardVsReference.*T200_top2_shared_ep1_fp32acc'
  step memcheck_bwd_fused 150 env MOK_BACKWARD_PATH=fused $SAN --tool memcheck $BIN/test_backward --gtest_filter='Shapes/BackwardVsReference.*T200_top2_shared_ep1_fp32acc:Shapes/BackwardVsReference.*top8_E16_shared_ep1_bf16'
  step racecheck_bwd_fused 300 env MOK_BACKWARD_PATH=fused $SAN --tool racecheck $BIN/test_backward --gtest_filter='Shapes/BackwardVsReference.*T200_top2_shared_ep1_fp32acc'
  step demo_gpu          90 $BIN/mok demo --steps 150 --log-every 50
  step soak             400 $BIN/mok soak --steps ${SOAK_STEPS:-2000} --out "$OUT/soak.json"
  # EP 2 as simulated ranks on one GPU (tests/gpu/test_comm_harness.cuh): every peer pointer is
  # on this device, so memcheck sees the cross-rank stores too. Only with fewer GPUs than 2.
  if [ "$NGPU" -lt 2 ]; then
    step memcheck_bwd_sim 150 $SAN --tool memcheck $BIN/test_backward --gtest_filter='Shapes/BackwardVsReference.*top8_E16_shared_ep2_fp32acc'
    step memcheck_bwd_fused_sim 150 env MOK_BACKWARD_PATH=fused $SAN --tool memcheck $BIN/test_backward --gtest_filter='Shapes/BackwardVsReference.*top8_E16_shared_ep2_fp32acc'
    step memcheck_fwd_sim 150 $SAN --tool memcheck $BIN/test_forward --gtest_filter='Ep/FusedVsStaged.*topk8_ep2:Ep/ForwardMacrobatch.*topk8_ep2:Ep/FusedVsStaged.*tails_blocks_ep2'
  fi
  if [ "${BENCH:-0}" = 1 ]; then
    step bench_forward  300 $BIN/bench_forward ${BENCH_FORWARD_ARGS:---shapes dsv3 --comm 8,12,16,24} --out "$OUT/forward.json"
    step bench_backward 300 $BIN/bench_backward ${BENCH_BACKWARD_ARGS:---shapes dsv3,qwen3,gptoss} --out "$OUT/backward.json"
    step bench_comm     180 $BIN/bench_comm ${BENCH_COMM_ARGS:---ctas 8,16,24,32} --out "$OUT/comm.json"
  fi
  echo "==== summary ($NGPU GPU(s); logs in \$OUT/logs.tgz) ===="
  cat "$OUT/summary.log"
  grep -h -E "^\[  FAILED|Failure|mismatch" "$LOGS"/test_*.log 2>/dev/null | head -20
  echo "$FAILED step(s) failed"
  [ $FAILED = 0 ]
}

case "${1:-}" in
  build) build ;;
  run) run ;;
  *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
