#!/usr/bin/env bash
# Installs what mok needs and this machine lacks. Idempotent: a second run installs nothing.
# System packages come from apt (as root); CuTe/CUTLASS headers (and NCCL, when the CUDA
# toolkit has none) come from PyPI into .deps/python inside the checkout; the Python tests' torch and
# pytest into .deps/torch.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
deps="$root/.deps/python"
say() { printf 'setup: %s\n' "$*"; }

# --- system packages ---------------------------------------------------------------------
missing=()
version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }
if ! command -v cmake >/dev/null || ! version_ge "$(cmake --version | head -n1 | awk '{print $3}')" 3.25; then
  missing+=(cmake)
fi
command -v ninja >/dev/null || missing+=(ninja-build)
command -v g++ >/dev/null || missing+=(g++)
command -v python3 >/dev/null || missing+=(python3 python3-pip)
[ -e /usr/include/gtest/gtest.h ] || [ -e /usr/local/include/gtest/gtest.h ] || missing+=(libgtest-dev)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing ${missing[*]} with apt-get"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    say "missing system packages: ${missing[*]}; install them (e.g. sudo apt-get install ${missing[*]}) and re-run"
    exit 1
  fi
fi

# --- CUDA toolkit (not installable from here: a machine requirement) ----------------------
cuda="${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}"
if ! command -v nvcc >/dev/null && [ ! -x "$cuda/bin/nvcc" ]; then
  say "the CUDA 13 toolkit (nvcc, cuBLAS, CCCL) is required: install NVIDIA's cuda-toolkit-13-0 and put nvcc on PATH"
  exit 1
fi

# --- Python packages into .deps/python ----------------------------------------------------
pip_get() {  # pip_get <requirement>
  say "installing $1 into .deps/python"
  python3 -m pip install -q --disable-pip-version-check --no-deps --target "$deps" "$1"
}
if [ ! -e "$deps/cutlass_library/source/include/cute/tensor.hpp" ]; then
  pip_get nvidia-cutlass==4.2.0.0
fi
if [ ! -e "$cuda/include/nccl_device.h" ] && [ ! -e "$deps/nvidia/nccl/include/nccl_device.h" ]; then
  pip_get nvidia-nccl-cu13==2.28.9
fi

# --- the Python tests' packages (tests/python): a pinned torch and pytest, into .deps/torch -------
# Only where the Python in use lacks them (the GPU machine brings its own torch). torch's PyPI wheel
# runs on CPU-only machines too (it brings NVIDIA's CUDA libraries: a few GB, once).
# MOK_PYTHON_TESTS=0 skips this (and ./dev.sh test then skips the Python tests).
if [ "${MOK_PYTHON_TESTS:-1}" != 0 ]; then
  pydeps="$root/.deps/torch"
  py_has() { PYTHONPATH="$pydeps${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import $1" >/dev/null 2>&1; }
  need=()
  py_has torch || need+=(torch==2.11.0 numpy==2.3.5)
  py_has pytest || need+=(pytest==8.4.2)
  if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]} into .deps/torch (the Python tests' torch: a few GB, once)"
    python3 -m pip install -q --disable-pip-version-check --target "$pydeps" "${need[@]}"
  fi
fi
say "dependencies present"
