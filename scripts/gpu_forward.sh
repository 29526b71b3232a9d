#!/bin/bash
# Forward megakernel (issue 4): build here, run on the GPU machine.
#
#   scripts/gpu_forward.sh build   # CPU machine: CMake targets in build-mk/, binaries + libmok.so -> .devbin/mk/
#   scripts/gpu_forward.sh run     # GPU machine, repo root: smoke, tests (fused and staged), racecheck, bench
#   STEPS_ONLY="smoke bench" scripts/gpu_forward.sh run    # a subset of the steps
#
# `run` writes logs to $OUT (default ./forward-out): summary.log, logs.tgz, forward.json.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-}
BIN=.devbin/mk
BUILD=${BUILD:-build-mk}

build() {
  set -e
  [ -f $BUILD/build.ninja ] || cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release
  ninja -C $BUILD -j2 test_forward bench_forward mok_cli
  mkdir -p $BIN
  cp $BUILD/bin/test_forward $BUILD/bin/bench_forward $BUILD/bin/mok $BUILD/src/host/libmok.so $BIN/
  ls -la $BIN
}

STEPS=()
step() {  # name, timeout (s), command...; log to $LOGS/<name>.log, one summary line
  local name=$1 limit=$2; shift 2
  if [ -n "${STEPS_ONLY:-}" ] && [[ " $STEPS_ONLY " != *" $name "* ]]; then return 0; fi
  local t0=$(date +%s.%N)
  timeout --kill-after=5 $limit "$@" > "$LOGS/$name.log" 2>&1
  local rc=$? t1=$(date +%s.%N)
  STEPS+=("$(printf '%-16s rc=%-4s %6.1fs  %s' $name $rc $(awk "BEGIN{print $t1 - $t0}") "$(grep -E '^\[  (PASSED|FAILED) +\]|RACECHECK SUMMARY|ERROR SUMMARY|wrote ' "$LOGS/$name.log" | tr '\n' ' ' | cut -c1-150)")")
  printf '%s\n' "${STEPS[@]}" > "$OUT/summary.log"
  tar czf "$OUT/logs.tgz" -C "$LOGS" .
  return $rc
}

run() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export LD_LIBRARY_PATH=$PWD/$BIN:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}
  if ldd $BIN/bench_forward | grep -q "not found"; then  # cuBLAS: the toolkit's, else PyTorch's wheel
    local wheel
    wheel=$(python3 -c "import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__))" 2>/dev/null)
    export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:/usr/local/cuda/lib64${wheel:+:$wheel/lib}
  fi
  OUT=${OUT:-forward-out}; mkdir -p "$OUT"
  LOGS=$(mktemp -d)
  export MOK_COMMIT=${MOK_COMMIT:-unknown}
  { nvidia-smi -L; nvidia-smi topo -m; ldd $BIN/bench_forward; } > "$LOGS/env.log" 2>&1
  local SAN="compute-sanitizer --error-exitcode 9 --report-api-errors no"
  local T=$BIN/test_forward
  # Smoke first: the fused path on one small case per EP size (a hang would cost the timeouts).
  if step smoke 60 $T --gtest_filter='Ep/FusedVsStaged.*uniform_shared*'; then
    step test_fused 150 $T
    step bench 200 $BIN/bench_forward --comm 4,6,8,12,16,24,32 --out "$OUT/forward.json"
  fi
  step test_staged 90 env MOK_FORWARD_PATH=staged $T \
    --gtest_filter='Ep/ForwardVsReference.*:Ep/ForwardEpInvariance.*:ForwardErrors.*:Ep/ForwardDeterminism.*'
  step racecheck 120 $SAN --tool racecheck $T --gtest_filter='Ep/FusedVsStaged.*topk8_ep1'
  step mok_bench 60 $BIN/mok bench --shape dsv3 --iters 5
  echo "==== summary (logs in $OUT/logs.tgz) ===="
  cat "$OUT/summary.log"
  grep -h -B3 -A12 "^bench_forward: EP" "$LOGS/bench.log" 2>/dev/null | head -20
  grep -h -E "FAILED|Failure|error|mismatch" "$LOGS"/smoke.log "$LOGS"/test_*.log 2>/dev/null | head -20
  grep -h -A4 "^mok bench" "$LOGS/mok_bench.log" 2>/dev/null
}

case "$MODE" in
  build) build ;;
  run) run ;;
  *) echo "usage: $0 build|run"; exit 2 ;;
esac
