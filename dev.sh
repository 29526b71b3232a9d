#!/usr/bin/env bash
# ./dev.sh demo   install what is missing, build, run `mok demo`
# ./dev.sh test   install what is missing, build, run the whole test suite (CTest)
# ./dev.sh build  install what is missing, build
# Environment: MOK_BUILD_DIR (default build), MOK_JOBS (default: all cores).
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
    ctest --test-dir "$build" --output-on-failure -j "$jobs" ;;
  build) ;;
esac
