#!/bin/bash
# The EP >= 2 GPU tests as simulated ranks on ONE GPU (tests/gpu/test_comm_harness.cuh,
# docs/comm.md "Launch modes" (c)), repeated to catch rare hangs: test_comm's EP 2/4/8 cases and
# test_forward's EP >= 2 cases, D3 and the 2-rank error paths. Functional only: no NVLink, no
# performance. With as many GPUs as ranks the same tests run on real ranks instead.
#
#   scripts/gpu_validate.sh build          # CPU machine: binaries into .devbin/validate
#   REPEAT=5 scripts/gpu_simulated_ranks.sh   # GPU machine (carry .devbin); logs under $OUT
#   FULL=1 REPEAT=4 scripts/gpu_simulated_ranks.sh   # the whole binaries (NCCL-backed EP 1 tests
#                                                    # first) at ep up to 8: the case that once
#                                                    # timed out at ep 8 (docs/comm.md, mode (c))
#   PROCS=12 scripts/gpu_simulated_ranks.sh   # the whole test_forward in 12 fresh processes: the
#                                             # ep 8 first-pass timeout came only at a process's
#                                             # first ep 8 pass; the stream rendezvous (RankPool)
#                                             # prints when it had to retry
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B=.devbin/validate
export LD_LIBRARY_PATH=$PWD/$B:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
OUT=${OUT:-sim-out}; mkdir -p "$OUT"
REPEAT=${REPEAT:-5}
export MOK_TEST_SIMULATE_MAX_EP=${MOK_TEST_SIMULATE_MAX_EP:-8}  # the harness default too
rc=0
run() {  # name, limit, command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local r=$?
  [ $r = 0 ] || rc=1
  printf '%-14s rc=%-4s %4ss  %s\n' "$name" "$r" "$(( $(date +%s) - t0 ))" \
    "$(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$name.log" | sort | uniq -c | tr -s ' ' | tr '\n' ' ')"
  grep -E "failed at|Failure" "$OUT/$name.log" | sort | uniq -c | head -5 | cut -c1-240
}
nvidia-smi -L
if [ -n "${PROCS:-}" ]; then
  for i in $(seq 1 "$PROCS"); do run "test_forward_p$i" 200 $B/test_forward; done
elif [ "${FULL:-0}" = 1 ]; then
  run test_forward 500 $B/test_forward --gtest_repeat="$REPEAT"
  run test_comm    500 $B/test_comm --gtest_repeat="$REPEAT"
else
  run test_comm    300 $B/test_comm --gtest_repeat="$REPEAT" --gtest_filter='Ep2/*:Ep4/*:Ep8/*'
  run test_forward 300 $B/test_forward --gtest_repeat="$REPEAT" \
    --gtest_filter='*ep2:*ep4:*ep8:Ep/ForwardDeterminism.*:Ep/ForwardEpInvariance.*:ForwardErrors.*'
fi
echo "stream rendezvous retries: $(cat "$OUT"/*.log | grep -c 'rank streams did not all run together')"
grep -h 'rank streams' "$OUT"/*.log | sort | uniq -c | head -10
echo "simulated ranks: $(cat "$OUT"/*.log | grep -c '^\[ SIMULATED\] ep [0-9]* as') simulated test runs; rc=$rc"
exit $rc
