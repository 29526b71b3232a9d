#!/bin/bash
# Grouped GEMM engine (issue 3): build here, run on the GPU machine.
#
#   scripts/gpu_gemm.sh build            # CPU machine: nvcc straight (no CMake), binaries -> .devbin/gemm/
#   scripts/gpu_gemm.sh run [what...]    # GPU machine, repo root; what = tests sanitizer sass bench (default all)
#   BIN=.devbin/gemm-x OBJ=build-gemm-x/obj GEMM_FLAGS="-DMOK_GEMM_EPI_BUFFERS=2" scripts/gpu_gemm.sh build
#                                        # a variant build for an A/B run (run with the same BIN)
#
# `run` writes logs to $OUT (default ./gemm-out) and the bench JSON to $OUT/gemm.json.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-}
shift || true
BIN=${BIN:-.devbin/gemm}
OUT=${OUT:-./gemm-out}

build() {
  set -e
  local O=${OBJ:-build-gemm/obj}
  local CUT
  CUT=$(python3 -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))")
  mkdir -p $O $BIN
  local NV="/usr/local/cuda/bin/nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo -Xptxas=--warn-on-spills -Xcompiler=-Wall -Iinclude -Isrc -Itests -Ibench -I$CUT ${GEMM_FLAGS:-}"
  compile() {  # source object [extra flags]
    if [ ! -f "$2" ] || [ -n "$(find "$1" src/gemm include/mok -newer "$2" 2>/dev/null | head -1)" ]; then
      echo "nvcc $1"; rm -f "$2"; $NV ${3:-} -c "$1" -o "$2" 2>&1 | tee "$2.log" | grep -E "error|warning|C7510|C7515|C7518|spill" || true
      [ -f "$2" ] || { cat "$2.log"; return 1; }
    fi
  }
  compile src/common/error.cpp $O/error.o
  compile src/gemm/gemm_host.cpp $O/gemm_host.o
  compile src/gemm/gemm_fwd.cu $O/gemm_fwd.o -Xptxas=-v &
  compile src/gemm/gemm_dgrad.cu $O/gemm_dgrad.o -Xptxas=-v &
  wait
  compile src/gemm/gemm_wgrad.cu $O/gemm_wgrad.o -Xptxas=-v
  for f in src/gemm/gemm_fwd.cu src/gemm/gemm_dgrad.cu src/gemm/gemm_wgrad.cu; do
    local o=$O/$(basename ${f%.*}).o
    [ -f $o ] || { echo "missing $o"; exit 1; }
    # ptxas must neither spill nor serialise wgmma (C7510: a call; C7515/C7518: divergent accumulator
    # use; C7512: register shortage).
    # The trace build (-DMOK_GEMM_TRACE, measurement only) may spill a little: not fatal there.
    local bad="C7510|C7512|C7515|C7518|[1-9][0-9]* bytes spill"
    [[ "${GEMM_FLAGS:-}" == *MOK_GEMM_TRACE* ]] && bad="C7510|C7512|C7515|C7518"
    if grep -qE "$bad" $o.log; then
      echo "ptxas: serialised wgmma or spills in $f"; rm -f $o; exit 1
    fi
  done
  rm -f $O/libmok_gemm.a && ar rcs $O/libmok_gemm.a $O/error.o $O/gemm_host.o $O/gemm_fwd.o $O/gemm_dgrad.o $O/gemm_wgrad.o
  grep -hE "Compiling entry|Used [0-9]+ registers|spill" $O/gemm_*.o.log > $BIN/ptxas.txt || true
  echo "nvcc test_gemm"; $NV tests/gpu/test_gemm.cu $O/libmok_gemm.a -lgtest -lgtest_main -lpthread -o $BIN/test_gemm &
  echo "nvcc bench_gemm"; $NV bench/bench_gemm.cu $O/libmok_gemm.a -lcublas -lpthread -o $BIN/bench_gemm &
  wait
  ls -la $BIN
}

run() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  mkdir -p "$OUT"
  # cuBLAS: the toolkit's, else the one in PyTorch's wheels.
  if ldd $BIN/bench_gemm | grep -q "not found"; then
    local wheel
    wheel=$(python3 -c "import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__))" 2>/dev/null)
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${wheel:+$wheel/lib:}${LD_LIBRARY_PATH:-}
  fi
  local what=("$@")
  [ ${#what[@]} -eq 0 ] && what=(tests sanitizer sass bench)
  nvidia-smi -L | tee -a "$OUT/summary.txt"
  for w in "${what[@]}"; do
    case $w in
      tests)
        local t0=$SECONDS
        $BIN/test_gemm > "$OUT/tests.log" 2>&1
        echo "tests: rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests.log" | tr '\n' ' ') ($((SECONDS - t0)) s)" | tee -a "$OUT/summary.txt"
        grep -E "FAILED|Failure|error" "$OUT/tests.log" | head -20 ;;
      sanitizer)
        local t0=$SECONDS
        compute-sanitizer --tool memcheck --error-exitcode 9 $BIN/test_gemm --gtest_filter='GemmGrouped.SanitizerSmall*' \
          > "$OUT/sanitizer.log" 2>&1
        echo "memcheck: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1) ($((SECONDS - t0)) s)" | tee -a "$OUT/summary.txt"
        t0=$SECONDS
        compute-sanitizer --tool racecheck --error-exitcode 9 $BIN/test_gemm --gtest_filter='GemmGrouped.SanitizerSmallForward' \
          >> "$OUT/sanitizer.log" 2>&1
        echo "racecheck: rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1) ($((SECONDS - t0)) s)" | tee -a "$OUT/summary.txt" ;;
      sass)
        cuobjdump --dump-sass $BIN/bench_gemm > "$OUT/sass.txt" 2>&1
        echo "sass: HGMMA instructions: $(grep -c HGMMA "$OUT/sass.txt"), $(grep -oE 'HGMMA\.[0-9x]+\.F32\.BF16' "$OUT/sass.txt" | sort | uniq -c | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
        grep -E "Function :|HGMMA" "$OUT/sass.txt" | grep -B1 -m 12 HGMMA > "$OUT/sass_hgmma.txt"
        rm -f "$OUT/sass.txt" ;;
      bench)
        $BIN/bench_gemm --json "$OUT/gemm.json" --commit "${GEMM_COMMIT:-unknown}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -40
        cat "$OUT/bench.log" >> "$OUT/summary.txt" ;;
    esac
  done
  cp $BIN/ptxas.txt "$OUT/" 2>/dev/null || true
}

case $MODE in
  build) build ;;
  run) run "$@" ;;
  *) echo "usage: $0 build | run [tests sanitizer sass bench]"; exit 2 ;;
esac
