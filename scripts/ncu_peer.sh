#!/usr/bin/env bash
# On the GPU machine: Nsight Compute (full set, with source) of our attention kernel beside
# FlashMLA's dense sm90 decode kernel at one shape, both in the same lease. Ours runs through the
# standalone driver on a timing shape of jax_mla/arg_specs.py (`--time`, one warm launch); FlashMLA
# through its peer kit (.peer/flashmla, built here, ~90 s; needs the FlashInfer sdist in .peer/ for
# CUTLASS). Reports, details pages and source-level SASS CSVs land in $OUT/ncu_peer.tar.gz; read the
# CSVs with tools/ncu_source.py.
#
#   SHAPE=time1 FM_SHAPE=3 OUT=$OUT bash scripts/ncu_peer.sh     # (carry .peer)
#   PAIRS="time1:3 time2:5" OUT=$OUT bash scripts/ncu_peer.sh    # several shapes, one build
#
# SHAPE: the prefix of a `cases.py timing --tag wide` file (time1 = 128 x 4096 x 128 heads); FM_SHAPE:
# the index of the same shape in .peer/flashmla/bench.py's SHAPES (3 = 128x4096 h128 q1). PAIRS: SHAPE:FM_SHAPE
# pairs (time2:5 = our 128 x 4096 h32 beside FlashMLA's 128x4096 h16 q2: both 32 rows a unit, the same keys).
# FM_SHAPE (or a pair's second half) may also be a shape the kit does not list, written BxLhHqS (8x4096h128q64:
# tools/flashmla_shape.py runs it), and CASE_TAG picks our timing shapes' tag (default wide), e.g. the compute-bound
# extend shapes: CASE_TAG=extend PAIRS="time1:8x4096h128q64 time0:16x4096h16q128".
# NCU_CACHE: ncu's --cache-control (all: caches flushed before the profiled launch, ncu's default; none: the
# launch finds the caches as the launches before it left them, closer to a chain of calls).
set -u
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/local/cuda/bin PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/jax_mla_out}
ROOT=$PWD
R=/tmp/ncu_peer
rm -rf "$R" && mkdir -p "$R" "$OUT"
fm=.peer/flashmla
if [ -f $fm/bench.py ] && ls .peer/flashinfer_python-*.tar.gz > /dev/null 2>&1; then
  ( bash $fm/extract.sh "$(realpath "$(ls .peer/flashinfer_python-*.tar.gz | head -1)")" && \
    cd $fm && MAX_JOBS=14 TORCH_CUDA_ARCH_LIST=9.0a timeout 300 python3 bench.py --build-only ) > "$R/fm_build.log" 2>&1 &
fi
bash scripts/build_driver.sh "$R/driver" > "$R/driver_build.log" 2>&1 || { tail "$R/driver_build.log"; exit 1; }
JAX_PLATFORMS=cpu python3 tools/sanitize_harness/cases.py timing "$R/cases" --tag "${CASE_TAG:-wide}" \
  > "$R/cases.log" 2>&1
NCU="ncu --clock-control none --cache-control ${NCU_CACHE:-all} --set full --import-source yes"
for pair in ${PAIRS:-${SHAPE:-time1}:${FM_SHAPE:-3}}; do
  ours=${pair%%:*} fm_shape=${pair##*:}
  case_file=$(ls "$R/cases/${ours}"_*.bin | head -1)
  timeout 200 $NCU -k "regex:mla_attention_(sm90|wide64_walk)_kernel" --launch-skip 8 --launch-count 1 \
    -o "$R/ours_$ours" "$R/driver" --time "$case_file" > "$R/ncu_ours_$ours.log" 2>&1
  echo "ours ($case_file): ncu rc=$?"
  wait  # FlashMLA's build, the first time
  if [ -f $fm/bench.py ]; then
    tail -1 "$R/fm_build.log"
    # A warm launch, as ours (--launch-skip 8 above): the kit's first call (which also makes its scheduler metadata)
    # and its warm-up calls are skipped; the 7th of ~15 launches is a graph replay's. Until the forty-ninth session
    # this profiled the first launch (NOTES.md, "forty-ninth session").
    if [[ $fm_shape =~ ^[0-9]+$ ]]; then fm_run=(python3 bench.py --only "$fm_shape")
    else fm_run=(python3 "$ROOT/tools/flashmla_shape.py" . "$fm_shape"); fi
    ( cd $fm && timeout 200 $NCU -k regex:splitkv_mla --launch-skip 6 --launch-count 1 -o "$R/flashmla_$fm_shape" \
        "${fm_run[@]}" --no-check --reps 1 --min-calls 4 --quiet-build ) \
      > "$R/ncu_flashmla_$fm_shape.log" 2>&1
    echo "flashmla ($fm_shape): ncu rc=$?"
  fi
done
for rep in "$R"/*.ncu-rep; do
  [ -f "$rep" ] || continue
  r=$(basename "$rep" .ncu-rep)
  ncu -i "$rep" --page details > "$R/${r}_details.txt" 2>&1
  ncu -i "$rep" --page source --csv --print-source sass 2>&1 | gzip > "$R/${r}_sass.csv.gz"
  ncu -i "$rep" --page raw --csv 2>&1 | gzip > "$R/${r}_raw.csv.gz"
  echo "== $r"
  grep -E "Duration|SM Frequency|Elapsed Cycles|Executed Ipc Active|No Eligible|Registers Per" "$R/${r}_details.txt"
done
tar czf "$OUT/ncu_peer.tar.gz" --exclude="*.ncu-rep" -C /tmp ncu_peer  # the reports are 5-15 MB each
