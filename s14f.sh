#!/usr/bin/env bash
# session 14, call 6: where each block of the fp8 shapes ran (SM spread) with the producer
cd "$(dirname "$0")"
export OUT=${OUT:-/tmp/out}
VARIANTS="prod:" CASE_TAG="fp8" ROUNDS="1" BLOCK_TRACE=1 timeout 230 bash scripts/driver_ab.sh > $OUT/ab.txt 2>&1
grep -v "^ *trip\|^   " $OUT/ab.txt | head -80
