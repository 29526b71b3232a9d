#!/bin/bash
# Seventeenth session (docs/megakernel.md): FusedForwardOptions::wide_tails at EP 1 on one GPU,
# in one call:
#  1. the commit before (.devbin/base: bench_forward + libmok.so) and this one (.devbin/validate,
#     bench_forward --wide-tails 1: default and wide tails interleaved), alternating, two rounds;
#     base vs this commit's default tells whether the change costs the default path anything;
#  2. test_forward (FusedVsStaged runs kWideTails / kWidePushAll, ForwardMacrobatch the ring with
#     them, case wide_tails), memcheck and racecheck of the fused forward;
#  3. the trace build (.devbin/trace, cmake -DMOK_FORWARD_TRACE=ON) with --trace: tiles by real
#     rows, default and wide tails (scripts/forward_trace.py).
#   CPU machine: scripts/gpu_validate.sh build; copy the base and trace binaries; carry .devbin
#   GPU machine: MOK_COMMIT=<commit> scripts/gpu_wide_tails.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SYS=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/cuda/lib64
export MOK_COMMIT=${MOK_COMMIT:-unknown}
OUT=${OUT:-wide-tails-out}; mkdir -p "$OUT"; W=$(mktemp -d)
SHAPES=${SHAPES:-dsv3,gptoss,qwen3}
ROUNDS=${ROUNDS:-2}
nvidia-smi --query-gpu=name,clocks.max.sm,temperature.gpu,power.draw,power.limit --format=csv,noheader > "$W/gpu.txt"
bench() {  # dir, name, extra args
  local d=$1 name=$2; shift 2
  [ -x $d/bench_forward ] || { echo "$name: $d/bench_forward missing"; return; }
  LD_LIBRARY_PATH=$PWD/$d:$SYS timeout 150 $d/bench_forward --shapes $SHAPES --comm 16 --iters 5 "$@" \
    --out "$W/$name.json" > "$W/$name.log" 2>&1
  echo "$name rc=$?"
}
for r in $(seq 1 "$ROUNDS"); do
  bench .devbin/base base-r$r
  bench .devbin/validate new-r$r --wide-tails 1
done
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  OUT=$W/validate ONLY="test_forward memcheck_forward racecheck_forward memcheck_fwd_sim" \
    bash scripts/gpu_validate.sh run > "$W/validate.log" 2>&1
  echo "validate rc=$?"
fi
if [ -x .devbin/trace/bench_forward ]; then
  SHAPES=dsv3,gptoss bench .devbin/trace trace --wide-tails 1 --iters 3 --trace "$W/tr"
  PY=/opt/torch/.venv/bin/python3; [ -x $PY ] || PY=python3
  for f in "$W"/tr-*.bin; do echo "== $f"; $PY scripts/forward_trace.py "$f" --bins 10; done > "$W/trace-report.txt" 2>&1
  rm -f "$W"/tr-*.bin
fi
{
  cat "$W/gpu.txt"
  [ -f "$W/validate.log" ] && tail -8 "$W/validate.log"
  for n in $(for r in $(seq 1 "$ROUNDS"); do echo base-r$r new-r$r; done) trace; do
    [ -f "$W/$n.log" ] && { echo "== $n"; grep -E "^(dsv3|gptoss|qwen3) " "$W/$n.log"; }
  done
  [ -f "$W/trace-report.txt" ] && grep -E "^==|^span|^by real|^all |real rows" "$W/trace-report.txt"
} > "$W/summary.txt"
tar czf "$OUT/wide-tails.tgz" -C "$W" .   # one archive: at most 8 files come back
cp "$W/summary.txt" "$OUT/"
cat "$W/summary.txt"
