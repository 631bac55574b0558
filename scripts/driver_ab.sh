#!/usr/bin/env bash
# On the GPU machine: compare variants of the CUDA kernels through the standalone driver
# (tools/sanitize_harness), all in one lease so that they share one GPU and its clocks.
#
#   VARIANTS="base: lazy:-DMY_MACRO,-DOTHER=2 prev:@exp/prev_cuda" bash scripts/driver_ab.sh
#
# A variant is NAME:SPEC. SPEC is a comma-separated list of nvcc flags (macros the sources test),
# or @DIR: the kernel sources in DIR replace ffi/cuda (make DIR on your machine with
# `bash scripts/driver_ab.sh --export REV DIR`, leave it untracked and unignored so it travels).
# Each variant's driver is built, run on the wide correctness cases (`cases.py make --wide`; with
# CHECK_ALL=1 on every case, narrow units too) and checked against the NumPy reference; then every
# variant that passed is timed on the shapes tagged CASE_TAG (default `wide`; several tags,
# space-separated: "extra timing fp8") in ROUNDS interleaved rounds (default "1 2 3"). Prints the
# median op time (and attention-alone time) per shape (TAG/timeN_...) and variant; logs in
# $OUT/driver_ab.tar.gz.
# TIMING_L2=1: also time every shape with its page ids drawn from 32 pages (TAG-L2/...), the keys in L2:
# how fast the body runs when the copy is free.
# TRACE_CASES="wide/time1_128x4096_h128_ps64 ...": also build every variant that passed with -DJAX_MLA_TRACE,
# time those cases once more and print the body's timeline (tools/trace_report.py; after another attention
# launch, and after an op's merge kernel: CASE@merge), with TRACE_ARGS (e.g. "--first 4 --pairs 1 6").
# UNCHECKED="name ...": variants timed whether or not their checks pass (probes that skip work, e.g.
# -DJAX_MLA_NARROW_FP8_COPY_ONLY).
# TIME_LIMIT: seconds each variant's timing run may take (default 240); a run that stops early says after how
# many cases (the driver prints a line a case, so the next case is the one it hung or crashed in).
# BLOCK_TRACE=1: also build every variant with -DJAX_MLA_BLOCK_TRACE, run every timed case once more and
# print where each block ran (tools/block_trace_report.py).
set -u
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--export" ]; then  # local helper: the ffi/cuda of git revision $2 into directory $3
  rev=$2 dir=$3
  mkdir -p "$dir"
  for f in $(git ls-tree --name-only "$rev" ffi/cuda/); do git show "$rev:$f" > "$dir/$(basename "$f")"; done
  echo "ffi/cuda of $(git rev-parse --short "$rev") in $dir"
  exit 0
fi
export PATH=$PATH:/usr/local/cuda/bin PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/jax_mla_out}
LOGS=/tmp/driver_ab
rm -rf "$LOGS" && mkdir -p "$LOGS" "$OUT"
VARIANTS=${VARIANTS:-"base:"}
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv > "$LOGS/gpu.txt" 2>&1

JAX_PLATFORMS=cpu python3 tools/sanitize_harness/cases.py make /tmp/driver_ab_check $([ -n "${CHECK_ALL:-}" ] || echo --wide) \
  > "$LOGS/cases.log" 2>&1 &
rm -rf /tmp/driver_ab_time
for tag in ${CASE_TAG:-wide}; do
  JAX_PLATFORMS=cpu python3 tools/sanitize_harness/cases.py timing "/tmp/driver_ab_time/$tag" --tag "$tag" \
    >> "$LOGS/cases.log" 2>&1 &
  if [ -n "${TIMING_L2:-}" ]; then  # the same shapes with every page id drawn from 32 pages (keys in L2)
    JAX_PLATFORMS=cpu python3 tools/sanitize_harness/cases.py timing "/tmp/driver_ab_time/${tag}-L2" --tag "$tag" --l2 \
      >> "$LOGS/cases.log" 2>&1 &
  fi
done
names=""
for v in $VARIANTS; do
  name=${v%%:*} spec=${v#*:}
  names="$names $name"
  if [[ $spec == @* ]]; then flags="-I${spec#@}"; else flags=${spec//,/ }; fi
  # The variant's flags come before ffi/cuda, so a source directory shadows it.
  bash scripts/build_driver.sh "/tmp/driver_ab_$name" $flags > "$LOGS/build_$name.log" 2>&1 &
  if [ -n "${TRACE_CASES:-}" ]; then
    bash scripts/build_driver.sh "/tmp/driver_ab_trace_$name" $flags -DJAX_MLA_TRACE > "$LOGS/build_trace_$name.log" 2>&1 &
  fi
  if [ -n "${BLOCK_TRACE:-}" ]; then
    bash scripts/build_driver.sh "/tmp/driver_ab_bt_$name" $flags -DJAX_MLA_BLOCK_TRACE > "$LOGS/build_bt_$name.log" 2>&1 &
  fi
done
wait
passed=""
for name in $names; do
  if [ ! -x "/tmp/driver_ab_$name" ]; then
    echo "$name: BUILD FAILED"; tail -5 "$LOGS/build_$name.log"; continue
  fi
  # ptxas's "Potential Performance Loss" notes (C7510-C7520: wgmma serialised, e.g. behind a wait loop in a
  # divergent branch) mean a variant's times measure the serialisation, not the idea (NOTES.md, "fifty-first
  # session"); tests/test_kernel_resources.py fails on them in the library's build.
  if grep -q "Potential Performance Loss" "$LOGS/build_$name.log"; then
    echo "$name: ptxas serialises wgmma:"
    grep "Potential Performance Loss" "$LOGS/build_$name.log" | grep -o "(C75[0-9]*).*in the function '[^']*'" | sort -u |
      cut -c1-200
  fi
  rm -f /tmp/driver_ab_check/*.out
  timeout 120 "/tmp/driver_ab_$name" /tmp/driver_ab_check/case*.bin > "$LOGS/check_$name.log" 2>&1
  JAX_PLATFORMS=cpu python3 tools/sanitize_harness/cases.py check /tmp/driver_ab_check >> "$LOGS/check_$name.log" 2>&1
  if [[ " ${UNCHECKED:-} " == *" $name "* ]]; then  # a timing probe whose output is wrong by design
    passed="$passed $name"
    echo "$name: not checked (UNCHECKED)"
  elif grep -q "HARNESS OK" "$LOGS/check_$name.log"; then
    passed="$passed $name"
    echo "$name: checks ok (largest out_err $(grep -o 'out_err=[0-9.e+-]*' "$LOGS/check_$name.log" | cut -d= -f2 | sort -g | tail -1))"
  else
    echo "$name: CHECKS FAILED"; grep -E "FAIL|error" "$LOGS/check_$name.log" | head -5
  fi
done
for round in ${ROUNDS:-1 2 3}; do
  for name in $passed; do
    timeout "${TIME_LIMIT:-240}" "/tmp/driver_ab_$name" --time /tmp/driver_ab_time/*/time*.bin \
      > "$LOGS/time_${name}_$round.log" 2>&1
    rc=$?
    if [ $rc -ne 0 ]; then  # a hang or a crash: the case it stopped in is the one after its last line
      echo "$name round $round: timing exit $rc after $(grep -c '^time ' "$LOGS/time_${name}_$round.log") cases"
    fi
  done
done
CASE_TAGS="${CASE_TAG:-wide}" python3 - "$LOGS" $passed <<'EOF'
import collections, glob, os, re, statistics, sys
logs, names = sys.argv[1], sys.argv[2:]
t, ev, after = ({} for _ in range(3))
# What each table reads from a timing line of the harness (its numbers, in order).
PATTERNS = (
    (t, r"op ([\d.]+) us \| attention alone ([\d.]+)"),
    (ev, r"events: attention ([\d.]+) chained / ([\d.]+) alone, merge ([\d.]+) chained / ([\d.]+) alone"),
    (after, r"attention after an empty kernel ([\d.]+), after an L2 sweep ([\d.]+), after a code sweep ([\d.]+)"),
)
for n in names:
    for f in glob.glob(f"{logs}/time_{n}_*.log"):
        for line in open(f):
            shape = re.search(r"/driver_ab_time/(\S+?/time\d+_\S+?)\.bin", line)
            for data, pattern in PATTERNS:
                m = re.search(pattern, line)
                if shape and m:
                    data.setdefault(shape.group(1), collections.defaultdict(list))[n].append(tuple(map(float, m.groups())))
TAGS = os.environ.get("CASE_TAGS", "").split()  # in CASE_TAG's order
order = lambda s: (TAGS.index(s.split("/")[0]) if s.split("/")[0] in TAGS else len(TAGS),
                   int(re.match(r"time(\d+)", s.split("/")[1]).group(1)))


def table(title, data, width, cell):
    """One row per shape, one column per variant: cell(list of the rounds' tuples) or "-"."""
    print(title)
    print("shape".ljust(40) + "".join(n.rjust(width) for n in names))
    for shape in sorted(data, key=order):
        cells = [cell(data[shape][n]) if data[shape][n] else "-" for n in names]
        print(shape.ljust(40) + "".join(c.rjust(width) for c in cells))


med = lambda v, i: statistics.median(x[i] for x in v)
table("median over rounds, us: op / attention alone", t, 16, lambda v: f"{med(v, 0):.1f}/{med(v, 1):.1f}")
if ev:
    table("median over rounds, us, by events: attention chained/alone, merge chained/alone", ev, 26,
          lambda v: f"{med(v, 0):.1f}/{med(v, 1):.1f}, {med(v, 2):.1f}/{med(v, 3):.1f}")
if after:
    table("median over rounds, us, by events: attention after an empty kernel / an L2 sweep / a code sweep", after,
          22, lambda v: f"{med(v, 0):.1f}/{med(v, 1):.1f}/{med(v, 2):.1f}")
EOF
for name in $passed; do
  for c in ${TRACE_CASES:-}; do
    [ -x "/tmp/driver_ab_trace_$name" ] || { echo "$name: no trace build"; break; }
    log="$LOGS/trace_${name}_${c//\//_}"
    timeout 120 "/tmp/driver_ab_trace_$name" --time "/tmp/driver_ab_time/$c.bin" > "$log.log" 2>&1
    echo "== timeline of $name on $c"
    python3 tools/trace_report.py "$log.log" ${TRACE_ARGS:-} | tee "${log}_report.txt"
  done
  if [ -n "${BLOCK_TRACE:-}" ]; then
    [ -x "/tmp/driver_ab_bt_$name" ] || { echo "$name: no block-trace build"; continue; }
    timeout 240 "/tmp/driver_ab_bt_$name" --time /tmp/driver_ab_time/*/time*.bin > "$LOGS/block_trace_$name.log" 2>&1
    echo "== blocks of $name"
    python3 tools/block_trace_report.py "$LOGS/block_trace_$name.log" | tee "$LOGS/block_trace_report_$name.txt"
  fi
done
tar czf "$OUT/driver_ab.tar.gz" -C /tmp driver_ab
