#!/bin/bash
# Sixteenth session (docs/megakernel.md): FusedForwardOptions::skip_padding_wg at EP 1 on one GPU,
# the default and the skip interleaved (bench_forward --wg-skip 1), two runs, then the whole
# validation (test_forward's FusedVsStaged runs the skip too; memcheck / racecheck on it).
#   CPU machine: scripts/gpu_validate.sh build   (carry .devbin)
#   GPU machine: MOK_COMMIT=<commit> scripts/gpu_wg_skip.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BIN=.devbin/validate
export LD_LIBRARY_PATH=$PWD/$BIN:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOK_COMMIT=${MOK_COMMIT:-unknown}
OUT=${OUT:-wg-skip-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader > "$OUT/gpu.txt"
for r in 1 2; do
  timeout 200 $BIN/bench_forward --shapes ${SHAPES:-dsv3,gptoss,qwen3} --comm 16 --iters 5 --wg-skip 1 \
    --out "$OUT/forward-wg-skip-r$r.json" > "$OUT/bench-r$r.log" 2>&1
  echo "bench run $r rc=$?"
done
OUT=$OUT/validate bash scripts/gpu_validate.sh run > "$OUT/validate.log" 2>&1
echo "validate rc=$?"
tail -25 "$OUT/validate.log"
for r in 1 2; do echo "== bench run $r"; grep -E "^(dsv3|gptoss|qwen3) " "$OUT/bench-r$r.log"; done
