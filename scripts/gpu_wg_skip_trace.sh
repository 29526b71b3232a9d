#!/bin/bash
# Sixteenth session (docs/megakernel.md): why skip_padding_wg helps gptoss and costs dsv3.
#  1. the default path before the change (.devbin/base: bench_forward + libmok.so of the commit
#     before) and after it, with the skip, alternating, two rounds (one GPU, EP 1);
#  2. the trace build (.devbin/trace: cmake -DMOK_FORWARD_TRACE=ON) with --trace: per-task
#     stamps of the default and of the skip, read by scripts/forward_trace.py (tiles by real rows).
#   GPU machine: MOK_COMMIT=<commit> scripts/gpu_wg_skip_trace.sh   (carry .devbin)
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SYS=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/cuda/lib64
OUT=${OUT:-wg-skip-trace-out}; mkdir -p "$OUT"
SHAPES=${SHAPES:-dsv3,gptoss}
nvidia-smi --query-gpu=name,clocks.max.sm,temperature.gpu,power.draw,power.limit --format=csv,noheader > "$OUT/gpu.txt"
bench() {  # dir, name, extra args
  local d=$1 name=$2; shift 2
  LD_LIBRARY_PATH=$PWD/$d:$SYS timeout 150 $d/bench_forward --shapes $SHAPES --comm 16 --iters 5 "$@" \
    --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"
}
for r in 1 2; do
  bench .devbin/base base-r$r
  bench .devbin/validate new-r$r --wg-skip 1
done
bench .devbin/trace trace --wg-skip 1 --iters 3 --trace "$OUT/tr"
PY=/opt/torch/.venv/bin/python3; [ -x $PY ] || PY=python3
for f in "$OUT"/tr-*.bin; do $PY scripts/forward_trace.py "$f" --bins 10; done > "$OUT/trace-report.txt" 2>&1
tar czf "$OUT/traces.tgz" -C "$OUT" $(cd "$OUT" && ls tr-*.bin) && rm -f "$OUT"/tr-*.bin
for n in base-r1 new-r1 base-r2 new-r2 trace; do echo "== $n"; grep -E "^(dsv3|gptoss|qwen3) " "$OUT/$n.log"; done
grep -E "^==|^span|^by real|^all " "$OUT/trace-report.txt"
