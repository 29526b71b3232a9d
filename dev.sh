#!/usr/bin/env bash
# ./dev.sh demo   install what is missing, build, run `mok demo`
# ./dev.sh test   install what is missing, build, run the whole test suite (CTest, then pytest tests/python)
# ./dev.sh build  install what is missing, build
# Environment: MOK_BUILD_DIR (default build), MOK_JOBS (default: all cores), MOK_PYTHON_TESTS=0 (skip pytest).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$root"
cmd="${1:-}"
case "$cmd" in demo|test|build) ;; *) echo "usage: ./dev.sh demo|test|build" >&2; exit 2 ;; esac
build="${MOK_BUILD_DIR:-build}"
jobs="${MOK_JOBS:-$(nproc)}"

bash scripts/setup.sh
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then export PATH="/usr/local/cuda/bin:$PATH"; fi
if [ ! -f "$build/CMakeCache.txt" ]; then
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$build" -j "$jobs"

case "$cmd" in
  demo) exec "$build/bin/mok" demo ;;
  test)
    if ! nvidia-smi -L >/dev/null 2>&1; then
      echo "dev.sh: no CUDA GPU on this machine: every test labelled 'gpu' reports Skipped (reason in its log)."
    fi
    rc=0
    ctest --test-dir "$build" --output-on-failure -j "$jobs" || rc=$?
    if [ "${MOK_PYTHON_TESTS:-1}" != 0 ]; then
      # The Python package's tests (tests/python) against this build's libmok; GPU ones skip, saying why.
      MOK_BUILD_DIR="$build" PYTHONPATH="$root/python:$root/.deps/torch${PYTHONPATH:+:$PYTHONPATH}" \
        python3 -m pytest -q -rs tests/python || rc=$?
    fi
    exit $rc ;;
  build) ;;
esac
