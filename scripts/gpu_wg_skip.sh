#!/bin/bash
# Sixteenth session (docs/megakernel.md): FusedForwardOptions::skip_padding_wg at EP 1 on one GPU.
#  1. the commit before (.devbin/base: bench_forward + libmok.so) and this one with the skip
#     (.devbin/validate, bench_forward --wg-skip 1: default and skip interleaved), alternating,
#     two rounds;
#  2. test_forward (FusedVsStaged runs the skip: kWgSkip), memcheck and racecheck on it;
#  3. the trace build (.devbin/trace, cmake -DMOK_FORWARD_TRACE=ON) with --trace: tiles by real
#     rows, default and skip (scripts/forward_trace.py).
#   CPU machine: scripts/gpu_validate.sh build; copy the base and trace binaries; carry .devbin
#   GPU machine: MOK_COMMIT=<commit> scripts/gpu_wg_skip.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SYS=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/cuda/lib64
export MOK_COMMIT=${MOK_COMMIT:-unknown}
OUT=${OUT:-wg-skip-out}; mkdir -p "$OUT"; W=$(mktemp -d)
SHAPES=${SHAPES:-dsv3,gptoss,qwen3}
nvidia-smi --query-gpu=name,clocks.max.sm,temperature.gpu,power.draw,power.limit --format=csv,noheader > "$W/gpu.txt"
bench() {  # dir, name, extra args
  local d=$1 name=$2; shift 2
  [ -x $d/bench_forward ] || { echo "$name: $d/bench_forward missing"; return; }
  LD_LIBRARY_PATH=$PWD/$d:$SYS timeout 150 $d/bench_forward --shapes $SHAPES --comm 16 --iters 5 "$@" \
    --out "$W/$name.json" > "$W/$name.log" 2>&1
  echo "$name rc=$?"
}
for r in 1 2; do
  bench .devbin/base base-r$r
  bench .devbin/validate new-r$r --wg-skip 1
done
OUT=$W/validate ONLY="test_forward memcheck_forward racecheck_forward memcheck_fwd_sim" \
  bash scripts/gpu_validate.sh run > "$W/validate.log" 2>&1
echo "validate rc=$?"
if [ -x .devbin/trace/bench_forward ]; then
  SHAPES=dsv3,gptoss bench .devbin/trace trace --wg-skip 1 --iters 3 --trace "$W/tr"
  PY=/opt/torch/.venv/bin/python3; [ -x $PY ] || PY=python3
  for f in "$W"/tr-*.bin; do $PY scripts/forward_trace.py "$f" --bins 10; done > "$W/trace-report.txt" 2>&1
  rm -f "$W"/tr-*.bin
fi
{
  tail -8 "$W/validate.log"
  for n in base-r1 new-r1 base-r2 new-r2 trace; do
    [ -f "$W/$n.log" ] && { echo "== $n"; grep -E "^(dsv3|gptoss|qwen3) " "$W/$n.log"; }
  done
  [ -f "$W/trace-report.txt" ] && grep -E "^==|^span|^by real|^all " "$W/trace-report.txt"
} > "$W/summary.txt"
tar czf "$OUT/wg-skip.tgz" -C "$W" .   # one archive: at most 8 files come back
cp "$W/summary.txt" "$OUT/"
cat "$W/summary.txt"
