#!/bin/bash
# The GPU work of mok in one entry point: build here (CPU machine), run the steps on the GPU machine.
#
#   scripts/gpu.sh build                    # CPU machine: build, stage binaries + libmok.so in .devbin/
#   scripts/gpu.sh all                      # GPU machine, repo root, .devbin carried: the validation
#   scripts/gpu.sh tests bench-forward      # any steps, in the order given
#   scripts/gpu.sh --help                   # the steps and the environment variables
#
# GPU steps keep going after a failing step; the summary table (step, PASS/FAIL/SKIP, seconds) comes
# last and is written to $OUT/summary.log; the exit status is non-zero if any step failed.
set -uo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.." || exit 2
# NVLink multicast stays off everywhere (a program using it can take a shared host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

BIN=.devbin
BUILD=${BUILD:-build}
GPU_STEPS="info tests sanitizers torchrun demo soak python"
GPU_STEPS+=" bench-gemm bench-forward bench-backward bench-comm bench-python profile train trace trace-gemm"
ALL="info tests sanitizers torchrun demo soak python"
SKIP=77  # a step function returns this when it does not apply

usage() {
  cat <<EOF
usage: scripts/gpu.sh STEP...

CPU machine:
  build           configure \$BUILD (default build; Release, Ninja) if needed, build the GPU tests, the
                  benches, mok and libmok.so with -j\$JOBS (default: nproc), stage them in .devbin/;
                  TRACE=1 also builds \$BUILD-trace with -DMOK_FORWARD_TRACE=ON into .devbin/trace/
GPU machine (carry .devbin; each step's log goes to \$OUT/<step>.log, else to .devbin/logs/):
  info            nvidia-smi, mok info, the libraries found
  tests           every GPU test binary (EP >= 2 as simulated ranks when there are fewer GPUs)
  sanitizers      compute-sanitizer memcheck and racecheck on small cases (EP 2 simulated on 1 GPU; FP8 kinds)
  torchrun        test_comm_torchrun under torchrun, one process a GPU; the NCCL_COMM_ID bootstrap
  demo            mok demo --steps 150 (trains, then checks the bits of a second run)
  soak            mok soak --steps \$SOAK_STEPS (default 2000) -> \$OUT/soak.json
  python          python -m mok, pytest tests/python, the toy model on the GPU
  bench-gemm      bench_gemm (bf16 and FP8 kinds side by side) -> \$OUT/bench-gemm.json
  bench-forward   bench_forward --shapes dsv3 --comm 8,12,16,24 -> \$OUT/bench-forward.json
  bench-backward  bench_backward --shapes dsv3,qwen3,gptoss --grad-mode bf16 -> \$OUT/bench-backward.json
  bench-comm      bench_comm --ctas 8,16,24,32 -> \$OUT/bench-comm.json
  bench-python    python -m mok.bench --shapes dsv3,qwen3,gptoss (records and torch_step.png in \$OUT)
  profile         bench/profile_step.py --shapes qwen3,gptoss --engines mok,mok_fp8,mok_fp8_bf16wgrad: CUDA time
                  per kernel of one layer step (where an FP8 or bf16 step's time goes)
  train           examples/train_lm.py --check --steps \$TRAIN_STEPS (default 300), curves in \$OUT
  trace           the trace build's bench_forward --shapes dsv3,qwen3,gptoss --comm 16 --iters 3 --trace and
                  bench_backward --shapes dsv3,qwen3,gptoss --grad-mode bf16 --iters 3 --trace (BENCH_ARGS_BWD
                  replaces the latter's arguments), each read by scripts/forward_trace.py (needs TRACE=1 at build)
  trace-gemm      the trace build's bench_gemm --shape qwen3 --quick --segments uniform (BENCH_ARGS replaces the
                  arguments): per kind, bf16 and FP8, cycles per tile = seed + first stage + K loop + epilogue
                  and the CTAs' spread (needs TRACE=1 at build)
  all             $ALL

Environment: OUT (logs and results), MOK_COMMIT (commit in bench records; default the
build's (.devbin/COMMIT), else git, else unknown), BENCH_ARGS (replaces a bench's or trace's default arguments; set empty for
the binary's own), TESTS (test binaries, default all), TEST_ARGS (e.g. --gtest_repeat=5
--gtest_filter=...), SOAK_STEPS, PYTEST_ARGS, TOY_STEPS (20), TRAIN_STEPS, TRAIN_ARGS, NPROC (processes
for bench-python and train, default 1), PYTHON (default: python3 if it has torch).
EOF
}

# ---- CPU machine -----------------------------------------------------------------------------------
names() { local f n; for f in "$@"; do n=${f##*/}; echo "${n%.*}"; done; }

build_into() (  # build dir, staging folder, binaries, extra cmake options...
  set -e
  local dir=$1 dest=$2 bins=$3; shift 3
  if [ ! -f "$dir/build.ninja" ] || [ $# -gt 0 ]; then
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
  fi
  # shellcheck disable=SC2086  # $bins: a list of target names
  ninja -C "$dir" -j"${JOBS:-$(nproc)}" $bins mok_cli mok
  mkdir -p "$dest"
  rm -f "$dest"/test_* "$dest"/bench_* "$dest/mok" "$dest/libmok.so"
  local b; for b in $bins mok; do cp "$dir/bin/$b" "$dest/"; done
  cp "$dir/src/host/libmok.so" "$dest/"  # the binaries' RUNPATH names this machine's build folder
)

build() {
  local tests benches
  tests=$(names tests/gpu/test_*.cu) benches=$(names bench/bench_*.cu bench/bench_*.cpp)
  build_into "$BUILD" "$BIN" "$tests $benches" || return 1
  if [ "${TRACE:-0}" = 1 ]; then
    build_into "$BUILD-trace" "$BIN/trace" "bench_forward bench_backward bench_gemm" -DMOK_FORWARD_TRACE=ON -DMOK_BUILD_TESTS=OFF \
      || return 1
  fi
  git rev-parse --short HEAD > "$BIN/COMMIT" 2>/dev/null || rm -f "$BIN/COMMIT"
  du -sh "$BIN"
  [ "$(du -sm "$BIN" | cut -f1)" -lt 60 ] || echo "warning: $BIN is near the 64 MiB a device call carries" >&2
}

# ---- GPU machine: running and recording steps ------------------------------------------------------
sub() {  # label, time limit (s), command...: one command of the current step, output into its log
  local label=$1 limit=$2 t0=$SECONDS rc; shift 2
  echo "==== $label: $*" >> "$LOG"
  timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
  rc=$?
  echo "==== $label: rc=$rc, $((SECONDS - t0)) s" >> "$LOG"
  [ $rc = 0 ] || FAILS+="${FAILS:+, }$label rc=$rc"
  return $rc
}

fail() { echo "$1" | tee -a "$LOG"; FAILS+="${FAILS:+, }$1"; return 1; }

run_step() {  # name: step_<name> with its log in $OUTDIR/<name>.log, then one row of the summary
  local name=$1 t0=$SECONDS rc status
  LOG=$OUTDIR/$name.log FAILS="" NOTE=""
  : > "$LOG"
  "step_${name//-/_}"
  rc=$?
  if [ $rc = $SKIP ]; then status=SKIP NOTE=$(tail -n 1 "$LOG" | cut -c1-80)
  elif [ $rc = 0 ] && [ -z "$FAILS" ]; then status=PASS
  else status=FAIL NOTE=${FAILS:-rc=$rc} FAILED=$((FAILED + 1)); fi
  ROWS+=("$(printf '%-15s %-6s %6s  %s' "$name" "$status" "$((SECONDS - t0))" "$NOTE")")
  echo "${ROWS[-1]}"
  { printf '%-15s %-6s %6s  %s\n' step result s note; printf '%s\n' "${ROWS[@]}"; } > "$OUTDIR/summary.log"
  publish_logs
}

publish_logs() {  # at most 8 files come back from $OUT, so past 6 logs they go into one archive
  [ -n "${OUT:-}" ] || return 0
  cp "$LOG" "$KEEP/"
  local kept=("$KEEP"/*.log)
  if [ ${#kept[@]} -gt 6 ]; then
    tar czf "$OUTDIR/logs.tgz" -C "$KEEP" . && rm -f "${kept[@]/#$KEEP/$OUTDIR}"
  fi
}

gpu_env() {
  PY=${PYTHON:-python3}
  if ! "$PY" -c "import torch" >/dev/null 2>&1 && [ -x /opt/torch/.venv/bin/python ]; then
    PY=/opt/torch/.venv/bin/python
  fi
  # torch's NCCL (the version mok's headers expect) ahead of the system's; cuBLAS from the toolkit,
  # else from NVIDIA's wheels.
  local nv libs=$PWD/$BIN d
  nv=$("$PY" -c "import nvidia, os; print(list(nvidia.__path__)[0])" 2>/dev/null \
       || echo /opt/torch/.venv/lib/python3.12/site-packages/nvidia)
  for d in "$nv/nccl/lib" /usr/local/cuda/lib64 "$nv/cu13/lib" "$nv/cublas/lib"; do
    [ -d "$d" ] && libs+=:$d
  done
  export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export MOK_LIBRARY=$PWD/$BIN/libmok.so PYTHONPATH=$PWD/python:$PWD/tests/python${PYTHONPATH:+:$PYTHONPATH}
  export PYTHONUNBUFFERED=1
  # The commit the staged binaries were built from (the GPU machine's checkout may not be it).
  export MOK_COMMIT=${MOK_COMMIT:-$(cat "$BIN/COMMIT" 2>/dev/null || git rev-parse --short HEAD 2>/dev/null \
                                    || echo unknown)}
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node="${NPROC:-1}")
}

# ---- GPU machine: the steps ------------------------------------------------------------------------
step_info() {
  { nvidia-smi; nvidia-smi topo -m; ldd "$BIN/mok"; } >> "$LOG" 2>&1
  echo "MOK_COMMIT=$MOK_COMMIT GPUs=$NGPU python=$PY LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >> "$LOG"
  sub mok-info 30 "$BIN/mok" info
}

test_limit() { case $1 in test_forward | test_backward) echo 300 ;; test_comm) echo 180 ;; *) echo 120 ;; esac; }

step_tests() {
  local t list=${TESTS:-} args
  read -ra args <<< "${TEST_ARGS:-}"
  if [ -z "$list" ]; then  # test_comm_torchrun skips without a launcher: the torchrun step runs it
    for t in "$BIN"/test_*; do [ "${t##*/}" = test_comm_torchrun ] || list+=" ${t##*/}"; done
  fi
  [ -n "$list" ] || fail "no test binaries in $BIN"
  for t in $list; do sub "$t" "$(test_limit "$t")" "$BIN/$t" "${args[@]}"; done
}

step_sanitizers() {
  local san=(compute-sanitizer --error-exitcode 9 --report-api-errors no)  # NCCL's init probes: API errors by design
  local fwd='Ep/FusedVsStaged.*topk8_ep1:Ep/ForwardMacrobatch.*topk8_ep1:Ep/FusedVsStaged.*tails_blocks_ep1'
  local bwd='Shapes/BackwardVsReference.*T200_top2_shared_ep1_fp32acc*'  # both backward engines
  sub memcheck-gemm 60 "${san[@]}" --tool memcheck "$BIN/test_gemm" --gtest_filter='*SanitizerSmall*'
  sub racecheck-gemm 90 "${san[@]}" --tool racecheck "$BIN/test_gemm" \
    --gtest_filter='*SanitizerSmallForward*:*SanitizerSmallDgrad*'
  # The FP8 kinds (one small case of each) and the quantizers.
  sub memcheck-gemm-fp8 90 "${san[@]}" --tool memcheck "$BIN/test_gemm_fp8" \
    --gtest_filter='*Sanitizer*:*DgradInputPartial*:*DgradHiddenRoutedPartial*'
  sub racecheck-gemm-fp8 120 "${san[@]}" --tool racecheck "$BIN/test_gemm_fp8" --gtest_filter='*Sanitizer*'
  sub memcheck-fp8-quantize 90 "${san[@]}" --tool memcheck "$BIN/test_fp8_quantize" \
    --gtest_filter='*RowsMatch*:*BlocksMatch*:*ColsTransposed*'
  # The FP8 layer: one case, EP 1 (and EP 2 simulated below).
  sub memcheck-fp8-layer 300 "${san[@]}" --tool memcheck "$BIN/test_fp8_layer" \
    --gtest_filter='Shapes/Fp8LayerVsReference.*top8_E16_shared_ep1_fp32acc'
  sub memcheck-forward 150 "${san[@]}" --tool memcheck "$BIN/test_forward" --gtest_filter="$fwd"
  sub racecheck-forward 300 "${san[@]}" --tool racecheck "$BIN/test_forward" --gtest_filter="$fwd"
  sub racecheck-comm 60 "${san[@]}" --tool racecheck "$BIN/test_comm" --gtest_filter='Ep1/*Uniform*'
  sub memcheck-comm 120 "${san[@]}" --tool memcheck "$BIN/test_comm" \
    --gtest_filter='Ep1/CommPipeline.*:Ep1/CommCtaCounts.*AllTokens*'
  sub memcheck-backward 300 "${san[@]}" --tool memcheck "$BIN/test_backward" \
    --gtest_filter="$bwd:Shapes/BackwardVsReference.*top8_E16_shared_ep1_bf16*"
  sub racecheck-backward 400 "${san[@]}" --tool racecheck "$BIN/test_backward" --gtest_filter="$bwd"
  if [ "$NGPU" -lt 2 ]; then  # EP 2 as simulated ranks: every peer pointer on this GPU, memcheck sees them
    sub memcheck-backward-ep2 300 "${san[@]}" --tool memcheck "$BIN/test_backward" \
      --gtest_filter='Shapes/BackwardVsReference.*top8_E16_shared_ep2_fp32acc*'
    sub memcheck-forward-ep2 150 "${san[@]}" --tool memcheck "$BIN/test_forward" --gtest_filter="${fwd//ep1/ep2}"
    sub memcheck-fp8-layer-ep2 300 "${san[@]}" --tool memcheck "$BIN/test_fp8_layer" \
      --gtest_filter='Shapes/Fp8LayerVsReference.*T200_top2_shared_ep2_bf16'
  fi
}

step_torchrun() {
  local tr; tr=$(command -v torchrun || echo /opt/torch/.venv/bin/torchrun)
  sub torchrun 60 "$tr" --no-python --nproc_per_node="$NGPU" --master_port 29571 "$BIN/test_comm_torchrun"
  sub nccl-comm-id 30 env WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29573 \
    NCCL_COMM_ID=127.0.0.1:29575 "$BIN/test_comm_torchrun"
}

step_demo() { sub demo 90 "$BIN/mok" demo --steps 150 --log-every 50; }
step_soak() { sub soak 400 "$BIN/mok" soak --steps "${SOAK_STEPS:-2000}" --out "$OUTDIR/soak.json"; }

step_python() {
  local args; read -ra args <<< "${PYTEST_ARGS:-}"
  sub python-m-mok 60 "$PY" -m mok
  # The toy model's pytest file is left out: the toy step runs the same check once, printing every loss.
  # -l: a failing test's locals (which step, which tensor) in the log.
  sub pytest 570 "$PY" -m pytest -q -rs -l tests/python --ignore=tests/python/test_gpu_toy.py "${args[@]}"
  sub toy 300 "$PY" tests/python/toy_model.py --device cuda --steps "${TOY_STEPS:-20}"
}

bench() {  # limit, binary, default arguments (BENCH_ARGS replaces them), arguments always given...
  local limit=$1 bin=$2 args; read -ra args <<< "${BENCH_ARGS-$3}"; shift 3
  sub "$bin" "$limit" "$BIN/$bin" "${args[@]}" "$@"
}
step_bench_gemm() { bench 300 bench_gemm "" --json "$OUTDIR/bench-gemm.json" --commit "$MOK_COMMIT"; }
step_bench_forward() {
  bench 300 bench_forward "--shapes dsv3 --comm 8,12,16,24" --out "$OUTDIR/bench-forward.json"
}
step_bench_backward() {  # bf16: dsv3's fp32 main grads do not fit an 80 GB card at EP 1
  bench 300 bench_backward "--shapes dsv3,qwen3,gptoss --grad-mode bf16" --out "$OUTDIR/bench-backward.json"
}
step_bench_comm() { bench 180 bench_comm "--ctas 8,16,24,32" --out "$OUTDIR/bench-comm.json"; }

step_bench_python() {
  local args; read -ra args <<< "${BENCH_ARGS---shapes dsv3,qwen3,gptoss}"
  sub bench-python 300 "${TORCHRUN[@]}" -m mok.bench "${args[@]}" --results-dir "$OUTDIR" \
    --plot "$OUTDIR/torch_step.png"
}

step_profile() {
  local args; read -ra args <<< "${BENCH_ARGS---shapes qwen3,gptoss --engines mok,mok_fp8,mok_fp8_bf16wgrad}"
  sub profile 300 "$PY" bench/profile_step.py "${args[@]}"
}

step_train() {
  local args; read -ra args <<< "${TRAIN_ARGS:-}"
  sub train 300 "${TORCHRUN[@]}" examples/train_lm.py --check --steps "${TRAIN_STEPS:-300}" --no-tqdm \
    --out-dir "$OUTDIR" --results-dir "$OUTDIR" "${args[@]}"
}

step_trace() {  # the forward and the backward (bf16 weight gradients), read by forward_trace.py
  local t=$BIN/trace dir args pass bin files
  if [ ! -x "$t/bench_forward" ] || [ ! -x "$t/bench_backward" ]; then
    echo "no trace build in $t: run 'TRACE=1 scripts/gpu.sh build'" | tee -a "$LOG"
    return $SKIP
  fi
  dir=$(mktemp -d)
  for pass in forward backward; do
    bin=bench_$pass
    if [ $pass = forward ]; then read -ra args <<< "${BENCH_ARGS---shapes dsv3,qwen3,gptoss --comm 16 --iters 3}"
    else read -ra args <<< "${BENCH_ARGS_BWD---shapes dsv3,qwen3,gptoss --grad-mode bf16 --iters 3}"; fi
    sub "$bin" 300 env LD_LIBRARY_PATH="$PWD/$t:$LD_LIBRARY_PATH" "$t/$bin" "${args[@]}" \
      --trace "$dir/$pass" --out "$OUTDIR/trace-$pass.json"
    files=("$dir/$pass"-*.bin)
    if [ ${#files[@]} -gt 0 ]; then sub "${pass}_trace" 120 "$PY" scripts/forward_trace.py "${files[@]}"
    else fail "no $pass trace files written"; fi
  done
  rm -rf "$dir"
}

step_trace_gemm() {  # the GEMM kinds alone, per-tile phases (bench_gemm's trace lines)
  local t=$BIN/trace args
  if [ ! -x "$t/bench_gemm" ]; then
    echo "no trace build of bench_gemm in $t: run 'TRACE=1 scripts/gpu.sh build'" | tee -a "$LOG"
    return $SKIP
  fi
  read -ra args <<< "${BENCH_ARGS---shape qwen3 --quick --segments uniform}"
  sub trace_gemm 300 env LD_LIBRARY_PATH="$PWD/$t:$LD_LIBRARY_PATH" "$t/bench_gemm" "${args[@]}"
}

# ---- main ------------------------------------------------------------------------------------------
[ $# -gt 0 ] || { usage >&2; exit 2; }
case $1 in -h | --help) usage; exit 0 ;; esac
steps=() build=0
for s in "$@"; do
  case " all build $GPU_STEPS " in
    *" $s "*) ;;
    *) echo "gpu.sh: unknown step '$s'; valid steps: build all $GPU_STEPS" >&2; exit 2 ;;
  esac
  if [ "$s" = build ]; then build=1; elif [ "$s" = all ]; then read -ra a <<< "$ALL"; steps+=("${a[@]}"); else steps+=("$s"); fi
done
if [ $build = 1 ]; then build || { echo "gpu.sh: build failed" >&2; exit 1; }; fi
[ ${#steps[@]} -gt 0 ] || exit 0

[ -f "$BIN/libmok.so" ] || { echo "gpu.sh: no $BIN/libmok.so: run 'scripts/gpu.sh build' and carry $BIN" >&2; exit 2; }
OUTDIR=${OUT:-$BIN/logs}
mkdir -p "$OUTDIR"
if [ -n "${OUT:-}" ]; then KEEP=$(mktemp -d); else KEEP=$OUTDIR; rm -f "$OUTDIR"/*.log; fi
gpu_env
ROWS=() FAILED=0
for s in "${steps[@]}"; do run_step "$s"; done

where=$OUTDIR; [ -f "$OUTDIR/logs.tgz" ] && where=$OUTDIR/logs.tgz
echo "==== mok GPU steps: $NGPU GPU(s), commit $MOK_COMMIT; logs in $where ===="
for f in "$KEEP"/*.log; do
  grep -E '^\[  FAILED  \] [A-Z]|Failure$|mismatch|ERROR SUMMARY: [1-9]|^(FAILED|ERROR) ' "$f" | sed "s|^|${f##*/}: |"
done | head -20
cat "$OUTDIR/summary.log"
[ "$FAILED" = 0 ]
