#!/bin/bash
# The EP 2 calls that decide the forward's EP >= 2 defaults (docs/megakernel.md, "Open questions:
# what waits for EP 2"), on an nvidia-h200-x2 machine, with the binaries of `scripts/gpu_validate.sh build`
# (carry .devbin):
#   scripts/gpu_ep2_decide.sh a   # test_comm + test_forward at EP 1-2 (real ranks), then the fused sum, the
#                                 # epilogue push and both together against the default (~8 min)
#   scripts/gpu_ep2_decide.sh b   # that bench again, then the macrobatch
#                                 # ring at EP 2 (~7 min)
#   scripts/gpu_ep2_decide.sh c   # the backward's two paths (MOK_BACKWARD_PATH): test_backward on both
#                                 # with real ranks, bench_backward (bwd_fused_ms against bwd_staged_ms,
#                                 # bf16 and fp32 grads) twice (~4 min)
# Logs and bench JSON under $OUT; the summary lines are printed last.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
B=$PWD/.devbin/validate
export LD_LIBRARY_PATH=$B:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi -L
BF="$B/bench_forward --shapes gptoss,qwen3,dsv3 --iters 5"
if [ "${1:-a}" = a ]; then
  # Real ranks only: EP 4/8 as simulated ranks already pass on one GPU (scripts/gpu_simulated_ranks.sh).
  MOK_TEST_SIMULATE_RANKS=0 timeout 120 $B/test_comm > $OUT/test_comm.log 2>&1; echo "test_comm rc=$?"
  grep -E '^\[  (PASSED|FAILED)' $OUT/test_comm.log
  MOK_TEST_SIMULATE_RANKS=0 timeout 240 $B/test_forward > $OUT/test_forward.log 2>&1; echo "test_forward rc=$?"
  grep -E '^\[  (PASSED|FAILED)' $OUT/test_forward.log
  grep -E 'Failure|FAILED  \]' $OUT/test_forward.log | head -8
  timeout 250 $BF --comm 6,8,16 --fused-sum 1 --push 1 --push-sum 1 --out $OUT/forward-a.json > $OUT/bench-a.log 2>&1; echo "bench rc=$?"
  grep -E '^(gptoss|qwen3|dsv3)' $OUT/bench-a.log
elif [ "${1:-a}" = c ]; then
  for path in staged fused; do
    MOK_BACKWARD_PATH=$path MOK_TEST_SIMULATE_RANKS=0 timeout 120 $B/test_backward > $OUT/test_backward-$path.log 2>&1
    echo "test_backward ($path) rc=$?"; grep -E '^\[  (PASSED|FAILED)' $OUT/test_backward-$path.log
  done
  for i in 1 2; do
    for mode in bf16 fp32; do
      timeout 120 $B/bench_backward --shapes dsv3,qwen3,gptoss --grad-mode $mode --out $OUT/backward-$mode-$i.json \
        > $OUT/bench-backward-$mode-$i.log 2>&1; echo "bench_backward $mode $i rc=$?"
      grep -E '^(shape|gptoss |qwen3 |dsv3 )' $OUT/bench-backward-$mode-$i.log | grep -v 'GEMMs\|dx_hash'
    done
  done
else
  # the same bench once more (a second sample of the same build)
  timeout 300 $BF --comm 6,8,16 --fused-sum 1 --push 1 --push-sum 1 --out $OUT/forward-b.json \
    > $OUT/bench-b.log 2>&1; echo "bench rc=$?"
  grep -E '^(gptoss|qwen3|dsv3)' $OUT/bench-b.log
  timeout 200 $BF --comm 6,16 --macrobatch 16384 --ring-sum 1 --out $OUT/forward-ring.json > $OUT/bench-ring.log 2>&1; echo "bench ring rc=$?"
  grep -E '^(gptoss|qwen3|dsv3)' $OUT/bench-ring.log
fi
