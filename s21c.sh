#!/usr/bin/env bash
# Session 21: merge kernel without the grid wait when the plan has no merge rows. A (always waits) vs B.
export PATH=$PATH:/usr/local/cuda/bin PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
probe() { timeout 150 python3 chain_probe2.py 2>&1 | grep -v "^WARNING\|^I0000\|^E0000\|^W0000" > $OUT/probe_$1.txt; echo "== $1"; tail -8 $OUT/probe_$1.txt; }
CUDAFLAGS=-DJAX_MLA_MERGE_ALWAYS_WAITS python3 -m pip install -q --no-build-isolation --no-deps -e . -Cbuild-dir=build/a > $OUT/build_a.log 2>&1 || { tail -20 $OUT/build_a.log; exit 1; }
probe A1
OUT=$OUT bash scripts/gpu_check.sh build check > $OUT/gpu_check.txt 2>&1; rc=$?
grep -E "passed|failed|error|BUILD" $OUT/gpu_check.txt | tail -5; echo "gpu_check rc=$rc"
probe B1
