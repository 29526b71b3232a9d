#!/bin/bash
# Communication layer (issue 6): build here, run on the GPU machine.
#
#   scripts/gpu_comm.sh build   # CPU machine: nvcc straight (no CMake needed), binaries -> .devbin/comm/
#   scripts/gpu_comm.sh run     # GPU machine, repo root: tests, compute-sanitizer, torchrun mode, bench
#   STEPS_ONLY="test_comm bench_comm" scripts/gpu_comm.sh run   # a subset of the steps
#
# `run` writes logs to $OUT (default ./comm-out) and bench JSON to bench/results/ and $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-}
BIN=.devbin/comm

build() {
  set -e
  local O=build-comm/obj
  mkdir -p $O $BIN
  local NV="/usr/local/cuda/bin/nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo -Xptxas=--warn-on-spills -Xcompiler=-Wall -Iinclude -Isrc -Itests -Ibench"
  local objs=()
  compile() {  # source object
    if [ ! -f "$2" ] || [ "$1" -nt "$2" ] || [ -n "$(find src/comm include/mok src/host/workspace_impl.hpp -newer "$2" 2>/dev/null | head -1)" ]; then
      echo "nvcc $1"; $NV -c "$1" -o "$2"
    fi
  }
  for f in src/common/config.cpp src/common/error.cpp src/common/shape.cpp src/common/routing_checks.cpp \
           src/reference/schedule.cpp src/host/workspace.cpp src/comm/error_record.cpp; do
    o=$O/$(basename $(dirname $f))_$(basename ${f%.*}).o; compile $f $o & objs+=($o)
    [ $(jobs -r | wc -l) -ge 2 ] && wait -n
  done
  wait
  for f in src/comm/*.cu; do
    o=$O/$(basename $(dirname $f))_$(basename ${f%.*}).o; compile $f $o & objs+=($o)
    [ $(jobs -r | wc -l) -ge 2 ] && wait -n
  done
  wait
  rm -f $O/libmok_comm_all.a && ar rcs $O/libmok_comm_all.a "${objs[@]}"
  local LIBS="$O/libmok_comm_all.a -L/usr/local/cuda/lib -lnccl -lpthread"
  for t in test_comm test_comm_errors test_comm_torchrun test_comm_bootstrap; do
    if [ ! -f $BIN/$t ] || [ -n "$(find tests/gpu/$t.cu tests/gpu/test_comm_harness.cuh $O/libmok_comm_all.a -newer $BIN/$t | head -1)" ]; then
      echo "nvcc $t"; $NV tests/gpu/$t.cu $LIBS -lgtest -lgtest_main -o $BIN/$t &
    fi
    [ $(jobs -r | wc -l) -ge 2 ] && wait -n
  done
  if [ -f bench/bench_comm.cu ]; then
    if [ ! -f $BIN/bench_comm ] || [ -n "$(find bench/bench_comm.cu $O/libmok_comm_all.a -newer $BIN/bench_comm | head -1)" ]; then
      echo "nvcc bench_comm"; $NV bench/bench_comm.cu $LIBS -o $BIN/bench_comm &
    fi
  fi
  wait
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

run() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  local SYSLIB=${LD_LIBRARY_PATH:-}
  export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}
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
  step nccl_version_lock    10 env LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:$SYSLIB $BIN/test_comm_errors --gtest_filter='CommVersion.*'
  step test_comm_bootstrap  10 $BIN/test_comm_bootstrap
  echo "==== summary (logs in $OUT/logs.tgz) ===="
  cat "$OUT/summary.log"
  grep -h -A12 "^bench_comm: EP" "$LOGS/bench_comm.log" | head -16
}

case "$MODE" in
  build) build ;;
  run) run ;;
  *) echo "usage: $0 build|run"; exit 2 ;;
esac
