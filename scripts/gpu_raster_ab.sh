#!/bin/bash
# The fused forward with its routed raster groups aligned to experts (the default since 2ef3df7)
# against groups of global row tiles, in separate processes alternating (`bench_forward
# --expert-raster 1|0`: each process keeps its own clock, where the interleaved variant
# `--global-raster 1` shares one between both and so understates an energy effect), ROUNDS
# rounds, steady state. The standalone GEMMs ("GEMMs alone") keep their default in both.
# (Measured first at c6ec2bd through MOK_GEMM_RASTER=expert, which then also reached the fused
# task list; docs/megakernel.md, seventeenth session.) GPU machine, binaries of
# `scripts/gpu_validate.sh build` (carry .devbin).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=$PWD/.devbin/validate:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/cuda/lib64
OUT=${OUT:-raster-out}; mkdir -p "$OUT"; W=$(mktemp -d)
SHAPES=${SHAPES:-dsv3,gptoss,qwen3}
for r in $(seq 1 "${ROUNDS:-2}"); do
  for v in global expert; do
    timeout 150 .devbin/validate/bench_forward --shapes $SHAPES --comm 16 --iters 5 \
      --expert-raster "$([ $v = expert ] && echo 1 || echo 0)" \
      --out "$W/$v-r$r.json" > "$W/$v-r$r.log" 2>&1
    echo "$v-r$r rc=$?"
  done
done
for f in "$W"/*-r*.log; do echo "== $(basename "$f" .log)"; grep -E "^(dsv3|gptoss|qwen3) " "$f"; done | tee "$W/summary.txt"
tar czf "$OUT/raster.tgz" -C "$W" .
