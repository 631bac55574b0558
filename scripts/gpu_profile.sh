#!/usr/bin/env bash
# On the GPU machine: Nsight Compute profile of the CUDA kernels at
# benchmark-like shapes (the `profile` shapes of jax_mla/arg_specs.py: 128 x 1024
# keys at 16 heads, 64 x 1024 at 128 heads, 32 x 4096 at 16 heads with splits),
# run through the standalone driver. Report in $OUT/ncu.txt; then per-kernel device
# times at the benchmark target shapes through JAX (benchmarks/kernel_probe.py) in
# $OUT/kernel_times.txt.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jax_mla_out}
mkdir -p "$OUT"
export PATH=$PATH:/usr/local/cuda/bin
# The driver is built by the package build with JAX_MLA_BUILD_TOOLS=ON (scripts/gpu_check.sh build).
[ -x build/gpu/sanitize_harness ] || JAX_MLA_BUILD_TOOLS=ON python3 -m pip install -q --no-build-isolation --no-deps \
  -e . -Cbuild-dir=build/gpu || exit 1
JAX_PLATFORMS=cpu python3 tools/sanitize_harness/cases.py profile /tmp/mla_prof || exit 1
timeout ${NCU_TIMEOUT:-240} ncu --clock-control none --kernel-name regex:mla_ \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
  --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section SourceCounters \
  build/gpu/sanitize_harness /tmp/mla_prof/case0.bin /tmp/mla_prof/case1.bin /tmp/mla_prof/case2.bin > "$OUT/ncu.txt" 2>&1
echo "ncu exit $?"
grep -E "mla_|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" "$OUT/ncu.txt" | head -60

# Device time of each kernel (attention, merge) per call at the benchmark's target shapes, through
# JAX (needs the package built: pip install --no-build-isolation --no-deps -e .). ncu runs at base
# clocks with caches flushed between kernels, so these are upper bounds of the in-graph times.
if python3 -c 'import jax_mla' 2> /dev/null; then
  timeout ${PROBE_TIMEOUT:-150} ncu --metrics gpu__time_duration.sum --kernel-name regex:mla_ \
    python3 benchmarks/kernel_probe.py --calls 2 > "$OUT/kernel_times.txt" 2>&1
  echo "kernel probe exit $?"
  grep -E "^shape|mla_|gpu__time" "$OUT/kernel_times.txt" | head -60
fi
