#!/bin/bash
# Repeats chosen test_backward cases in several builds, to bisect an intermittent failure (the
# simulated-EP-2 timeouts of BackwardDeferredWgrad / BackwardShortCalls, docs/architecture.md).
#   CPU machine, per commit C:  git worktree add /tmp/wt-C C && (cd /tmp/wt-C && bash scripts/setup.sh &&
#                               bash scripts/gpu_validate.sh build) && cp -r /tmp/wt-C/.devbin/validate .devbin/C
#   GPU machine (carry .devbin): BUILDS="0e8f7e9 eef3a5f validate" REPEAT=10 bash scripts/gpu_repeat_backward.sh
# Prints, per build, how many repeats passed and the distinct failure messages.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SYS=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/cuda/lib64
FILTER=${FILTER:-'*Deferred*:*ShortCalls*'}
for b in ${BUILDS:-validate}; do
  echo "== $b ($FILTER, ${REPEAT:-10} repeats)"
  LD_LIBRARY_PATH=$PWD/.devbin/$b:$SYS timeout ${LIMIT:-250} .devbin/$b/test_backward --gtest_repeat=${REPEAT:-10} \
    --gtest_filter="$FILTER" 2>&1 | grep -E "^\[  PASSED|^\[  FAILED  \] [A-Z].*ms\)|timed out on" | sed 's/(.*ms)//' \
    | cut -c1-200 | sort | uniq -c
done
