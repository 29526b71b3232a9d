#!/bin/bash
# Where the fp32 weight-gradient epilogue's time goes (issue 29): ncu metrics of every grouped
# GEMM launch of one dsv3 backward with fp32 main grads (the routed wgrad adds ~90 GB into the
# main grads through TMA reduce-add). GPU machine, binaries of `scripts/gpu_validate.sh build`
# (carry .devbin):
#   SHAPE=dsv3 MODE=fp32 bash scripts/gpu_wgrad_ncu.sh     # wgrad_ncu.csv under $OUT, the table printed
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-wgrad-ncu-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SYS=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/cuda/lib64
W=$(mktemp -d)
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_red.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
LD_LIBRARY_PATH=$PWD/.devbin/validate:$SYS timeout 400 ncu --clock-control none -k regex:grouped_gemm_kernel -c ${COUNT:-8} \
  --metrics $M --csv .devbin/validate/bench_backward --shapes ${SHAPE:-dsv3} --grad-mode ${MODE:-fp32} --iters 1 --warmup 0 \
  --warm-ms 0 > $W/ncu.csv 2> $W/ncu.err
echo "ncu rc=$?"
python3 - "$W/ncu.csv" <<'PY'
import csv, re, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    sys.exit("no ncu rows")
hdr = rows[0]; rows = rows[1:]
ki, ni, vi, idi = hdr.index("Kernel Name"), hdr.index("Metric Name"), hdr.index("Metric Value"), hdr.index("ID")
by = {}
for r in rows:
    by.setdefault(r[idi], {"k": r[ki]})[r[ni]] = r[vi].replace(",", "")
f = lambda d, k: float(d.get(k, "nan"))
print(f"{'id':>3} {'kind':28} {'ms':>7} {'DRAM rd GB':>10} {'wr GB':>6} {'L2 red GB':>9} {'DRAM %':>6} {'L2 %':>5} {'TC %':>5}")
for i, d in sorted(by.items(), key=lambda x: int(x[0])):
    m = re.search(r"grouped_gemm_kernel<mok::gemm::(\w+)", d["k"])
    kind = m.group(1) if m else d["k"][:28]
    print(f"{i:>3} {kind:28} {f(d,'gpu__time_duration.sum')/1e6:7.3f} {f(d,'dram__bytes_read.sum')/1e9:10.2f} "
          f"{f(d,'dram__bytes_write.sum')/1e9:6.2f} {f(d,'lts__t_sectors_op_red.sum')*32/1e9:9.2f} "
          f"{f(d,'dram__throughput.avg.pct_of_peak_sustained_elapsed'):6.1f} {f(d,'lts__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f} "
          f"{f(d,'sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed'):5.1f}")
PY
tail -3 $W/ncu.err
cp $W/ncu.csv $OUT/wgrad_ncu.csv
