#!/usr/bin/env bash
# On the GPU machine: Nsight Compute profile of the CUDA kernels at
# benchmark-like shapes (benchmarks/sanitize_harness.py PROFILE_CASES: 128 x 1024
# keys at 16 heads, 64 x 1024 at 128 heads, 32 x 4096 at 16 heads with splits),
# run through the standalone driver. Report in $OUT/ncu.txt.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jax_mla_out}
mkdir -p "$OUT"
export PATH=$PATH:/usr/local/cuda/bin
nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 -lineinfo -Iffi/include -Iffi/cuda \
  benchmarks/sanitize_harness.cu -o /tmp/mla_harness || exit 1
JAX_PLATFORMS=cpu python3 benchmarks/sanitize_harness.py profile /tmp/mla_prof || exit 1
timeout ${NCU_TIMEOUT:-240} ncu --clock-control none --kernel-name regex:mla_ \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
  --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section SourceCounters \
  /tmp/mla_harness /tmp/mla_prof/case0.bin /tmp/mla_prof/case1.bin /tmp/mla_prof/case2.bin > "$OUT/ncu.txt" 2>&1
echo "ncu exit $?"
grep -E "mla_|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" "$OUT/ncu.txt" | head -60
