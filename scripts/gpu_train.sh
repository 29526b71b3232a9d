#!/bin/bash
# The training example and the PyTorch benchmark on the GPU machine, from the repository root, over the
# prebuilt libmok that `bash scripts/gpu_validate.sh build` copied to .devbin/validate/libmok.so (CPU machine):
#
#   bash scripts/gpu_train.sh                  # train_lm --check (300 steps), then python -m mok.bench (3 shapes)
#   ONLY=bench bash scripts/gpu_train.sh       # one part only (train, bench)
#   NPROC=8 bash scripts/gpu_train.sh          # EP 8: one process per GPU under torchrun
#
# Environment: MOK_LIBRARY (default .devbin/validate/libmok.so), PYTHON (default: python3 if it has torch, else
# /opt/torch/.venv/bin/python), OUT (default train-gpu-out), MOK_COMMIT (the records' commit; the device copy
# has no .git), NPROC (default 1), STEPS (default 300), TRAIN_ARGS, BENCH_SHAPES (default dsv3,qwen3,gptoss),
# BENCH_ARGS. Sized for one H200 well inside 8 minutes: each part has a time limit, 8 minutes in all.
# Writes to $OUT (at most 8 files come back): summary.log, logs.txt (both logs), train_lm.png, train_lm.json
# (every curve), torch_step.png, and the records <date>-train_lm-<commit>.json, <date>-torch_step-<commit>.json
# (copy those to bench/results/); prints the summary last.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-train-gpu-out}
mkdir -p "$OUT"
LOGS=$(mktemp -d)

export MOK_LIBRARY=${MOK_LIBRARY:-$PWD/.devbin/validate/libmok.so}
if [ ! -f "$MOK_LIBRARY" ]; then
  echo "gpu_train.sh: no libmok at $MOK_LIBRARY: run 'bash scripts/gpu_validate.sh build' on the CPU machine first" \
    | tee "$OUT/summary.log"
  exit 2
fi
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1 && [ -x /opt/torch/.venv/bin/python ]; then
  PY=/opt/torch/.venv/bin/python
fi
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "gpu_train.sh: $PY lacks torch (set PYTHON=/path/to/python)" | tee "$OUT/summary.log"
  exit 2
fi
# torch's NCCL (the version mok's headers expect: DESIGN §5) ahead of the system's.
NCCL_LIB=$("$PY" -c "import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], 'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH=${NCCL_LIB:+$NCCL_LIB:}/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export MOK_COMMIT=${MOK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
NPROC=${NPROC:-1}
RUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC")

SUMMARY=()
FAILED=0
step() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  local t0=$(date +%s)
  echo "\$ $*" > "$LOGS/$name.log"
  timeout --kill-after=10 "$limit" "$@" >> "$LOGS/$name.log" 2>&1
  local rc=$?
  [ $rc = 0 ] || FAILED=$((FAILED + 1))
  local what
  what=$(grep -E 'train_lm check:|^(bitwise_repeat|resume_equal|torch_within_2pct) |^record:|Error|error:' \
    "$LOGS/$name.log" | tail -6 | tr '\n' ' ' | cut -c1-300)
  SUMMARY+=("$(printf '%-6s rc=%-4s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$what")")
  printf '%s\n' "${SUMMARY[@]}" > "$OUT/summary.log"
  for f in "$LOGS"/*.log; do echo "==== $(basename "$f") ===="; cat "$f"; done > "$OUT/logs.txt"  # one file back
}

step info 30 "$PY" -m mok
step train 270 "${RUN[@]}" examples/train_lm.py --check --steps "${STEPS:-300}" --no-tqdm \
  --out-dir "$OUT" --results-dir "$OUT" ${TRAIN_ARGS:-}
step bench 180 "${RUN[@]}" -m mok.bench --shapes "${BENCH_SHAPES:-dsv3,qwen3,gptoss}" --results-dir "$OUT" \
  --plot "$OUT/torch_step.png" ${BENCH_ARGS:-}

echo "==== mok training example and PyTorch benchmark: $(nvidia-smi -L 2>/dev/null | wc -l) GPU(s)," \
  "$NPROC process(es); files in $OUT ===="
cat "$OUT/summary.log"
sed -n '/^==== train_lm --check ====/,/^train_lm check:/p' "$LOGS/train.log" 2>/dev/null
sed -n '/^shape /,/^dense bf16/p' "$LOGS/bench.log" 2>/dev/null
rm -rf "$LOGS"
echo "$FAILED step(s) failed"
[ $FAILED = 0 ]
