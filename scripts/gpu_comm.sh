#!/bin/bash
# Communication layer (issue 6): build here, run on the GPU machine.
#
#   scripts/gpu_comm.sh build   # CPU machine: nvcc straight (no CMake needed), binaries -> .devbin/comm/
#   scripts/gpu_comm.sh run     # GPU machine, repo root: tests, compute-sanitizer, torchrun mode, bench
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
    compile $f $O/$(basename ${f%.*}).o & objs+=($O/$(basename ${f%.*}).o)
    [ $(jobs -r | wc -l) -ge 2 ] && wait -n
  done
  wait
  for f in src/comm/*.cu; do
    compile $f $O/$(basename ${f%.*}).o & objs+=($O/$(basename ${f%.*}).o)
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

case "$MODE" in
  build) build ;;
  *) echo "usage: $0 build|run"; exit 2 ;;
esac
