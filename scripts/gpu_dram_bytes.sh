#!/bin/bash
# DRAM bytes and L2 hit rate of the fused forward kernel and of the standalone grouped GEMMs on
# the same routed rows (the staged forward's and forward_gemms_only's launches), one line per
# launch (docs/megakernel.md, 2026-12-02, 6724e9a). GPU machine, binaries of
# `scripts/gpu_validate.sh build` (carry .devbin):
#   SHAPE=dsv3 scripts/gpu_dram_bytes.sh      # ncu.csv under $OUT, the table printed
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-dram-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SYS=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/cuda/lib64
W=$(mktemp -d)
LD_LIBRARY_PATH=$PWD/.devbin/validate:$SYS timeout 400 ncu --clock-control none -k regex:"fused_forward_kernel|grouped_gemm_kernel" -c 16 \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum --csv \
  .devbin/validate/bench_forward --shapes ${SHAPE:-dsv3} --comm 16 --iters 1 --warmup 1 --warm-ms 0 > $W/ncu.csv 2> $W/ncu.err
echo "ncu rc=$?"
python3 - "$W/ncu.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; rows = rows[1:]
ki, ni, vi, idi = hdr.index("Kernel Name"), hdr.index("Metric Name"), hdr.index("Metric Value"), hdr.index("ID")
by = {}
for r in rows:
    by.setdefault(r[idi], {"k": r[ki][:60]})[r[ni]] = r[vi].replace(",", "")
for i, d in sorted(by.items(), key=lambda x: int(x[0])):
    print(f"{i:>3} {d['k']:60} read {float(d['dram__bytes_read.sum'])/1e9:7.2f} GB write {float(d['dram__bytes_write.sum'])/1e9:6.2f} GB "
          f"L2 hit {d['lts__t_sector_hit_rate.pct']:>6} % {float(d['gpu__time_duration.sum'])/1e6:7.3f} ms")
PY
tail -3 $W/ncu.err
cp $W/ncu.csv $OUT/
