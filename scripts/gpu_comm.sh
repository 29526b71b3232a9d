#!/bin/bash
# Communication layer (issue 6): build here, run on the GPU machine.
#
#   scripts/gpu_comm.sh build   # CPU machine: CMake/Ninja in build-commperf, binaries + libmok.so -> .devbin/commperf/
#   scripts/gpu_comm.sh run     # GPU machine, repo root: tests, compute-sanitizer, torchrun mode, bench
#   scripts/gpu_comm.sh perf    # GPU machine: test_comm, test_comm_errors, bench_comm sweep (one short call)
#   scripts/gpu_comm.sh v3      # GPU machine: comm + forward tests, bench_comm sweep, bench_forward dsv3,qwen3
#   STEPS_ONLY="test_comm bench_comm" scripts/gpu_comm.sh run   # a subset of the steps
#   BIN=.devbin/comm2 BUILD=build-comm2 scripts/gpu_comm.sh ...  # other binary / build folders
#
# `run`/`perf` write logs to $OUT (default ./comm-out) and the bench JSON to $OUT. Set MOK_COMMIT
# (the device copy of the tree has no .git) so the record names the commit.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-}
BIN=${BIN:-.devbin/commperf}
BUILD=${BUILD:-build-commperf}

build() {
  set -e
  [ -f $BUILD/build.ninja ] || cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release
  local targets="test_comm test_comm_errors test_comm_torchrun test_comm_bootstrap bench_comm"
  ninja -C $BUILD -j2 $targets
  mkdir -p $BIN
  for t in $targets; do cp $BUILD/bin/$t $BIN/; done
  cp $BUILD/src/host/libmok.so $BIN/  # the binaries' RUNPATH names this machine's build folder
  ls -la $BIN
}

# One step: name, timeout (s), command...; log to $LOGS/<name>.log, result line to the summary.
# Few files come back from the GPU machine, so the logs are re-bundled into $OUT/logs.tgz after
# every step (a step killed by the outer time limit still leaves the earlier logs).
STEPS=()
step() {
  local name=$1 limit=$2; shift 2
  if [ -n "${STEPS_ONLY:-}" ] && [[ " $STEPS_ONLY " != *" $name "* ]]; then return; fi
  local t0=$(date +%s.%N)
  timeout --kill-after=5 $limit "$@" > "$LOGS/$name.log" 2>&1
  local rc=$? t1=$(date +%s.%N)
  STEPS+=("$(printf '%-28s rc=%-4s %6.1fs  %s' $name $rc $(awk "BEGIN{print $t1 - $t0}") "$(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\]|ERROR SUMMARY|RACECHECK SUMMARY|wrote ' "$LOGS/$name.log" | tr '\n' ' ' | cut -c1-160)")")
  printf '%s\n' "${STEPS[@]}" > "$OUT/summary.log"
  tar czf "$OUT/logs.tgz" -C "$LOGS" .
}

gpu_env() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  SYSLIB=${LD_LIBRARY_PATH:-}
  export LD_LIBRARY_PATH=$PWD/$BIN:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}
}

# The short device call of the performance work: correctness of the roles, then the sweep.
perf() {
  gpu_env
  OUT=${OUT:-comm-out}; mkdir -p "$OUT"
  LOGS=$(mktemp -d)
  local NGPU=$(nvidia-smi -L | wc -l)
  { nvidia-smi -L; nvidia-smi topo -m; } > "$LOGS/env.log" 2>&1
  step test_comm         55 $BIN/test_comm
  step test_comm_errors  25 $BIN/test_comm_errors
  step bench_comm        50 $BIN/bench_comm --ctas 8,12,16,20,24,32 --out "$OUT/comm_dsv3_ep$NGPU.json"
  echo "==== summary (logs in $OUT/logs.tgz) ===="
  cat "$OUT/summary.log"
  grep -E "^\[  FAILED|Failure|mismatch|not run" "$LOGS/test_comm.log" | head -20
  sed -n '/^bench_comm: EP=.*T=/,$p' "$LOGS/bench_comm.log" | head -80
}

# The v3 call (one short device call, <= 150 s): comm and forward tests, the bench_comm sweep of
# every kept variant (warp / warp_dedup dispatch, warp / warp_inplace combine, the plain copies),
# bench_forward. Needs test_forward and bench_forward in $BIN too.
v3() {
  gpu_env
  OUT=${OUT:-comm-out}; mkdir -p "$OUT"
  LOGS=$(mktemp -d)
  export MOK_COMMIT=${MOK_COMMIT:-unknown}
  if ldd $BIN/bench_forward | grep -q "not found"; then  # cuBLAS: the toolkit's, else PyTorch's wheel
    local wheel
    wheel=$(python3 -c "import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__))" 2>/dev/null)
    export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:/usr/local/cuda/lib64${wheel:+:$wheel/lib}
  fi
  local NGPU=$(nvidia-smi -L | wc -l)
  { nvidia-smi -L; nvidia-smi topo -m; } > "$LOGS/env.log" 2>&1
  step test_comm         20 $BIN/test_comm
  step bench_comm        22 $BIN/bench_comm --ctas 8,12,16,24,32 --out "$OUT/comm_v3_ep$NGPU.json"
  step test_forward      35 $BIN/test_forward --gtest_filter='Ep/FusedVsStaged.*:Ep/ForwardVsReference.*:Ep/ForwardDeterminism.*:FusedForward.*'
  step bench_forward     55 $BIN/bench_forward --shapes dsv3,qwen3 --comm 8,16,24 --iters 5 --warmup 2 --out "$OUT/forward_v2.json"
  step test_comm_errors  12 $BIN/test_comm_errors
  echo "==== summary (logs in $OUT/logs.tgz) ===="
  cat "$OUT/summary.log"
  grep -h -E "^\[  FAILED|Failure|mismatch|not run" "$LOGS"/test_*.log | head -20
  sed -n '/^bench_comm: EP=.*T=/,$p' "$LOGS/bench_comm.log" | head -70
  grep -h -A14 "^bench_forward: EP" "$LOGS/bench_forward.log" 2>/dev/null | head -30
}

run() {
  gpu_env
  OUT=${OUT:-comm-out}; mkdir -p "$OUT"
  LOGS=$(mktemp -d)
  local NGPU=$(nvidia-smi -L | wc -l)
  { nvidia-smi -L; nvidia-smi topo -m; } > "$LOGS/env.log" 2>&1
  # API errors are off: NCCL's own init probes (kernel images for other GPUs, cuMemCreate
  # capabilities) return errors by design; device memory errors and hazards are what we check.
  local SAN="compute-sanitizer --error-exitcode 9 --report-api-errors no"
  local TR=$(command -v torchrun || echo /opt/torch/.venv/bin/torchrun)
  step test_comm            30 $BIN/test_comm
  step test_comm_errors     25 $BIN/test_comm_errors
  step bench_comm           40 $BIN/bench_comm --out "$OUT/comm_dsv3_ep$NGPU.json"
  step torchrun_tcp         25 $TR --no-python --nproc_per_node=$NGPU --master_port 29561 $BIN/test_comm_torchrun
  step memcheck_pipeline    45 $SAN --tool memcheck $BIN/test_comm --gtest_filter='Ep1/*Uniform*:Ep1/*TokensNotMultiple*:Ep1/*OneToken*:Ep1/*EmptyExperts*'
  step racecheck_pipeline   30 $SAN --tool racecheck $BIN/test_comm --gtest_filter='Ep1/*Uniform*:Ep1/*TopK1*'
  step memcheck_errors      45 $SAN --tool memcheck $BIN/test_comm_errors --gtest_filter='CommErrors.BadRouting*:CommErrors.CapacityOverflowIs*'
  step torchrun_nccl_comm_id 10 env WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29563 NCCL_COMM_ID=127.0.0.1:29565 $BIN/test_comm_torchrun
  step nccl_version_lock    10 env LD_LIBRARY_PATH=$PWD/$BIN:/usr/lib/x86_64-linux-gnu:$SYSLIB $BIN/test_comm_errors --gtest_filter='CommVersion.*'
  step test_comm_bootstrap  10 $BIN/test_comm_bootstrap
  echo "==== summary (logs in $OUT/logs.tgz) ===="
  cat "$OUT/summary.log"
  grep -h -A12 "^bench_comm: EP" "$LOGS/bench_comm.log" | head -16
}

case "$MODE" in
  build) build ;;
  run) run ;;
  perf) perf ;;
  v3) v3 ;;
  *) echo "usage: $0 build|run|perf|v3"; exit 2 ;;
esac
