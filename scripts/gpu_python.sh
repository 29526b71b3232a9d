#!/bin/bash
# The Python package's GPU tests on the GPU machine, from the repository root, over the prebuilt libmok
# that `bash scripts/gpu_validate.sh build` copied to .devbin/validate/libmok.so (on the CPU machine):
#
#   bash scripts/gpu_python.sh                 # pytest tests/python (GPU tests included), then the toy model
#   ONLY=pytest bash scripts/gpu_python.sh     # one part only (info, pytest, toy): each fits a 10-minute limit
#   PYTEST_ARGS="-k graph" ONLY=pytest bash scripts/gpu_python.sh
#
# Environment: MOK_LIBRARY (default .devbin/validate/libmok.so), PYTHON (default: python3 if it has torch,
# else /opt/torch/.venv/bin/python), OUT (logs; default python-gpu-out), TOY_STEPS (default 20).
# Writes $OUT/summary.log, pytest.log, junit.xml, toy.log, info.log and prints the summary last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-python-gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

export MOK_LIBRARY=${MOK_LIBRARY:-$PWD/.devbin/validate/libmok.so}
if [ ! -f "$MOK_LIBRARY" ]; then
  echo "gpu_python.sh: no libmok at $MOK_LIBRARY: run 'bash scripts/gpu_validate.sh build' on the CPU machine first" | tee "$OUT/summary.log"
  exit 2
fi
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1 && [ -x /opt/torch/.venv/bin/python ]; then PY=/opt/torch/.venv/bin/python; fi
if ! "$PY" -c "import torch, pytest" >/dev/null 2>&1; then
  echo "gpu_python.sh: $PY lacks torch or pytest (set PYTHON=/path/to/python)" | tee "$OUT/summary.log"
  exit 2
fi
# torch's NCCL (the version mok's headers expect: DESIGN §5) ahead of the system's.
NCCL_LIB=$("$PY" -c "import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], 'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH=${NCCL_LIB:+$NCCL_LIB:}/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONPATH=$PWD/python:$PWD/tests/python${PYTHONPATH:+:$PYTHONPATH}

SUMMARY=()
FAILED=0
step() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc = 0 ] || FAILED=$((FAILED + 1))
  local what
  what=$(grep -E '^(=+ )?[0-9]+ (passed|failed)|(passed|failed|skipped|error)s? in |bitwise identical|toy model:|^mok |NCCL headers' "$OUT/$name.log" | tail -6 | tr '\n' ' ' | cut -c1-300)
  SUMMARY+=("$(printf '%-8s rc=%-4s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$what")")
  printf '%s\n' "${SUMMARY[@]}" > "$OUT/summary.log"
}

step info 60 "$PY" -m mok
# The whole suite; the toy model's pytest file is left to the next step, which runs the same check
# once and prints every loss.
step pytest 570 "$PY" -m pytest -q -rs tests/python --ignore=tests/python/test_gpu_toy.py \
  --junitxml="$OUT/junit.xml" ${PYTEST_ARGS:-}
step toy 570 "$PY" tests/python/toy_model.py --device cuda --steps "${TOY_STEPS:-20}"

echo "==== mok Python GPU tests ($(nvidia-smi -L 2>/dev/null | wc -l) GPU(s); logs in $OUT) ===="
cat "$OUT/summary.log"
grep -h -E "^(FAILED|ERROR) |Error|FAILED" "$OUT/pytest.log" 2>/dev/null | head -20
grep -h -E "run [12]:|vs eager|bitwise" "$OUT/toy.log" 2>/dev/null
echo "$FAILED step(s) failed"
[ $FAILED = 0 ]
