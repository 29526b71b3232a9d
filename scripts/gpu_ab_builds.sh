#!/bin/bash
# Side-by-side A/B of two builds' benchmark binaries in one lease, runs alternated A B A B (so the
# power-capped clock drifts equally over both): bench_forward (fused, staged, GEMMs alone; the
# default's bits compare through its y_hash) and bench_gemm. Each folder holds bench_forward,
# bench_gemm and the libmok.so they were built with (e.g. `scripts/gpu_validate.sh build` for
# the current tree into .devbin/validate, and a worktree of the other commit copied into .devbin/a).
#   A=.devbin/a B=.devbin/validate scripts/gpu_ab_builds.sh      # GPU machine (carry .devbin)
# PASSES=backward runs bench_backward instead (each of BWD_SHAPES, default dsv3 qwen3 gptoss, as
# A B A B, BWD_ROUNDS rounds; BWD_ARGS adds options such as --grad-mode bf16).
# Writes ab.tgz (every log and JSON) under $OUT and prints the forward lines last.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SYS=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/cuda/lib64
OUT=${OUT:-ab-out}; mkdir -p "$OUT"
A=${A:?folder of build A} B=${B:?folder of build B}
nvidia-smi -L
if [ "${PASSES:-forward}" = backward ]; then
  for shape in ${BWD_SHAPES:-dsv3 qwen3 gptoss}; do
    for round in $(seq 1 ${BWD_ROUNDS:-2}); do
      for v in a b; do
        dir=$A; [ $v = b ] && dir=$B
        LD_LIBRARY_PATH=$PWD/$dir:$SYS timeout 200 $dir/bench_backward --shapes $shape ${BWD_ARGS:-} \
          --out "$OUT/bwd-$shape-$v-$round.json" > "$OUT/bwd-$shape-$v-$round.log" 2>&1; echo "bwd $shape $v $round rc=$?"
      done
    done
  done
  for f in "$OUT"/bwd-*.log; do echo "== $f"; grep -E "^(dsv3|qwen3|gptoss)|wgrad|staged" "$f" | head -12; done
  (cd "$OUT" && tar czf ab.tgz bwd-* && rm -f bwd-*)
  exit 0
fi
for round in 1 2; do
  for v in a b; do
    dir=$A; [ $v = b ] && dir=$B
    LD_LIBRARY_PATH=$PWD/$dir:$SYS timeout 150 $dir/bench_forward --shapes dsv3,qwen3,gptoss --comm 16 --iters 10 \
      --out "$OUT/fwd-$v-$round.json" > "$OUT/fwd-$v-$round.log" 2>&1; echo "fwd $v $round rc=$?"
  done
done
for round in 1 2; do
  for v in a b; do
    dir=$A; [ $v = b ] && dir=$B
    LD_LIBRARY_PATH=$PWD/$dir:$SYS timeout 100 $dir/bench_gemm --shape dsv3 --segments uniform,random --quick \
      --warm-ms 300 --json "$OUT/gemm-$v-$round.json" > "$OUT/gemm-$v-$round.log" 2>&1; echo "gemm $v $round rc=$?"
  done
done
for f in "$OUT"/fwd-*.log; do echo "== $f"; grep -E "^(dsv3|qwen3|gptoss) " "$f"; done
(cd "$OUT" && tar czf ab.tgz fwd-* gemm-* && rm -f fwd-* gemm-*)
