#!/bin/bash
# Trace build of bench_gemm (PYTHONPATH=.deps/python BIN=.devbin/gemm-trace OBJ=build-gemm-trace/obj
# GEMM_FLAGS=-DMOK_GEMM_TRACE scripts/gpu_gemm.sh build; carry .devbin): GEMM 2 on dsv3 routed
# segments with MOK_GEMM_WIDE_TAILS=0 / 1, per-tile cycles by ring-slot count and per-CTA spans.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
for w in 0 1; do
  MOK_GEMM_WIDE_TAILS=$w timeout 150 .devbin/gemm-trace/bench_gemm --shape dsv3 --segments random --quick \
    > $OUT/trace-wide$w.log 2>&1; echo "wide=$w rc=$?"
done
for w in 0 1; do
  echo "== wide=$w"; grep -E "^trace gemm2 " $OUT/trace-wide$w.log | grep -v "per CTA (block"
  grep -E "^dsv3 +random +gemm2 " $OUT/trace-wide$w.log
done
