#!/bin/bash
# The fused forward with raster groups aligned to experts (MOK_GEMM_RASTER=expert: the task
# list's routed groups never span two experts; the standalone GEMMs of the same process, i.e.
# "GEMMs alone", take it too) against the default global groups, alternating in separate
# processes (the knob is read per process), ROUNDS rounds, steady state. GPU machine, binaries
# of `scripts/gpu_validate.sh build` (carry .devbin). Seventeenth session, docs/megakernel.md.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=$PWD/.devbin/validate:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/cuda/lib64
OUT=${OUT:-raster-out}; mkdir -p "$OUT"; W=$(mktemp -d)
SHAPES=${SHAPES:-dsv3,gptoss,qwen3}
for r in $(seq 1 "${ROUNDS:-2}"); do
  for v in global expert; do
    MOK_GEMM_RASTER=$v timeout 150 .devbin/validate/bench_forward --shapes $SHAPES --comm 16 --iters 5 \
      --out "$W/$v-r$r.json" > "$W/$v-r$r.log" 2>&1
    echo "$v-r$r rc=$?"
  done
done
for f in "$W"/*-r*.log; do echo "== $(basename "$f" .log)"; grep -E "^(dsv3|gptoss|qwen3) " "$f"; done | tee "$W/summary.txt"
tar czf "$OUT/raster.tgz" -C "$W" .
