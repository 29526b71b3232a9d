#!/bin/bash
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SYS=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/cuda/lib64
export LD_LIBRARY_PATH=$PWD/.devbin/trace:$SYS
timeout 150 .devbin/trace/bench_backward --shapes qwen3,gptoss,dsv3 --grad-mode bf16 --iters 5 --trace $OUT/bt --out $OUT/trace-bench.json > $OUT/trace-bench.txt 2>&1
echo rc=$?; grep -E "^(shape|dsv3 |qwen3 |gptoss )" $OUT/trace-bench.txt | grep -v "GEMMs\|dx_hash" | cut -c1-140; ls -la $OUT
