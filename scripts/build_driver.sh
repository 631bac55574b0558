#!/usr/bin/env bash
# The standalone kernel driver (tools/sanitize_harness) for sm_90a, straight from nvcc, with line
# info for ncu and compute-sanitizer: scripts/driver_ab.sh and scripts/ncu_peer.sh build it here.
#
#   bash scripts/build_driver.sh OUT [NVCC_FLAGS ...]
#
# The extra flags come before ffi/cuda's include path, so a directory given as -IDIR (a variant's
# kernel sources) shadows ffi/cuda. Run from the repository root.
out=$1
shift
exec nvcc -gencode=arch=compute_90a,code=sm_90a -DJAX_MLA_SM90A_BUILT=1 "$@" -Iffi/include -Iffi/cuda \
  --expt-relaxed-constexpr -O3 -lineinfo -std=c++17 tools/sanitize_harness/sanitize_harness.cu -o "$out"
