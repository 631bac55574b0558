#!/usr/bin/env bash
# On the GPU machine: build jax_mla (CUDA for sm_90a) and the standalone driver
# (tools/sanitize_harness), check the CUDA kernels against the reference on the
# shared correctness shapes (tests/test_arg_specs.py), run the test suite,
# compute-sanitizer (memcheck, racecheck, synccheck) on the driver, and the benchmark. Logs, the
# benchmark JSON and the roofline land in $OUT (default /tmp/jax_mla_out).
#
#   scripts/gpu_check.sh [build] [decode] [hostprofile] [check|quickcheck] [test] [sanitize] [parallel] [timing]
#                        [bench] [sweep] [anatomy]
#   (no arguments: all but sweep; PYTEST_PATHS, PYTEST_ARGS narrow the tests, SANITIZE_WIDE=1 the
#   sanitizers' cases, HARNESS / SANITIZE_TOOLS / SANITIZER_ARGS their driver, tools and options,
#   TEST_XLA_FLAGS the tests' XLA flags (TEST_JAX_CACHE: tests/conftest.py); a failed check skips
#   the steps after it unless KEEP_GOING is set; each timed step ends with a line "NAME exit RC", which
#   says when a timeout or a signal ended it; anatomy: benchmarks/call_anatomy.py on ANATOMY_SHAPES, ours
#   then FlashMLA's, ANATOMY_ROUNDS rounds, one JSON line a run in $OUT/anatomy.jsonl)
#
# FlashInfer 0.2.5 for the benchmark's peers: its sdist in .peer/ (git-ignored;
# `pip download --no-deps flashinfer-python==0.2.5 -d .peer`), installed here
# into /tmp/fi; its kernels are JIT-built on first use.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jax_mla_out}
LOGS=$OUT/logs
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
export PATH=$PATH:/usr/local/cuda/bin
steps=${*:-build check test sanitize bench}
# The steps' time limits (seconds), overridable from the environment. Set here, not as ${X:=N} inside a
# step's pipeline: a pipeline runs in subshells, so such a default never reached the step's `finished`
# line, where set -u then stopped the script (CHECK_TIMEOUT, fortieth session).
: "${DECODE_TIMEOUT:=180}"
: "${HOSTPROFILE_TIMEOUT:=300}"
: "${CHECK_TIMEOUT:=360}"
: "${TEST_TIMEOUT:=300}"
: "${PARALLEL_TIMEOUT:=300}"
: "${BENCH_TIMEOUT:=400}"
: "${ANATOMY_TIMEOUT:=300}"
: "${ANATOMY_SHAPES:=128x4096h128q1 128x4096h32q1 128x4096h16q1}"
has() { [[ " $steps " == *" $1 "* ]]; }
status=0
note() { echo "== $* ($(date +%T))" | tee -a "$LOGS/summary.txt"; }
# A step's exit status, said in the output and the summary: a pytest killed by its timeout, or one that died
# without its summary line, otherwise looks like a run that simply stopped (thirty-sixth session).
# finished NAME RC TIMEOUT_S; returns RC.
finished() {
  local why=""
  case $2 in
    124) why=" (timed out after $3 s)" ;;
    129|1[3-9][0-9]) why=" (killed by signal $(($2 - 128)))" ;;
  esac
  echo "$1 exit $2$why ($(date +%T))" | tee -a "$LOGS/summary.txt"
  return $2
}

# The driver's cases (planning only, on the CPU): jax_mla from this checkout, so that the sanitize and timing
# steps run without the build step too (a driver built by hand, HARNESS=...); without the native module
# the NumPy planner makes the same plans.
cases_py() { PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} JAX_PLATFORMS=cpu python3 tools/sanitize_harness/cases.py "$@"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$LOGS/gpu.txt" 2>&1
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' >> "$LOGS/gpu.txt" 2>&1

# FlashInfer: install and JIT-build its MLA backend(s) in the background
# (CPU work, overlaps the build and the tests; the cache stays on this machine).
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=12 FLASHINFER_WORKSPACE_BASE=/tmp
fi_pid=
if ls .peer/flashinfer_python-*.tar.gz > /dev/null 2>&1 && [ ! -f /tmp/fi/.jit_done ]; then
  (
    [ -d /tmp/fi/flashinfer ] || python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/fi \
      .peer/flashinfer_python-*.tar.gz
    echo "install exit $?"
    PYTHONPATH=/tmp/fi python3 -c '
import time, torch
from flashinfer.mla import get_batch_mla_module
for b in ("fa3", "fa2") if "--fa2" in "${BENCH_ARGS:-}" else ("fa3",):
    t = time.time()
    get_batch_mla_module(b)(torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, 512, 64, False)
    print("flashinfer", b, "built in", round(time.time() - t), "s", flush=True)
' && touch /tmp/fi/.jit_done
  ) > "$LOGS/flashinfer_setup.log" 2>&1 &
  fi_pid=$!
fi

# FlashMLA (peer kit in .peer/flashmla, README in ../shared/peers/flashmla): CUTLASS from the
# FlashInfer sdist, then its JIT build in the background (~110 s on 16 cores).
fm_pid=
fm_dir=.peer/flashmla
if (has bench || has sweep || has anatomy) && [ -f $fm_dir/bench.py ] \
    && ls .peer/flashinfer_python-*.tar.gz > /dev/null 2>&1; then
  (
    bash $fm_dir/extract.sh "$(realpath "$(ls .peer/flashinfer_python-*.tar.gz | head -1)")" && \
      MAX_JOBS=12 TORCH_CUDA_ARCH_LIST=9.0a python3 -c "import sys; sys.path.insert(0, '$fm_dir'); import bench; bench.build(verbose=False)"
  ) > "$LOGS/flashmla_setup.log" 2>&1 &
  fm_pid=$!
fi

if has build; then
  note build
  if JAX_MLA_BUILD_TOOLS=ON python3 -m pip install --no-build-isolation --no-deps -v -e . -Cbuild-dir=build/gpu \
      > "$LOGS/build.log" 2>&1; then
    grep -E "ptxas info|spill|jax_mla:" "$LOGS/build.log" | head -40
  else
    tail -40 "$LOGS/build.log"; echo "BUILD FAILED"; status=1
  fi
  python3 -c 'import jax_mla, pprint; pprint.pprint(jax_mla.build_info())' 2>&1 | tee -a "$LOGS/summary.txt"
fi

built=$status
if has decode && [ $built -eq 0 ]; then
  # Issue 4's benchmark: jitted decode step of a V2-Lite-shaped stack, our op vs the reference.
  note "bench_decode"
  timeout $DECODE_TIMEOUT python3 benchmarks/bench_decode.py --json "$OUT/bench_decode.json" ${DECODE_ARGS:-} 2>&1 \
    | tee "$LOGS/bench_decode.log" | tail -20
  finished "bench_decode" "${PIPESTATUS[0]}" $DECODE_TIMEOUT || status=1
fi
if has hostprofile && [ $built -eq 0 ]; then
  # Issue 11: where a host-planned decode step's host time goes, per XLA_FLAGS variant.
  note "profile_decode_host"
  timeout $HOSTPROFILE_TIMEOUT python3 benchmarks/profile_decode_host.py --variants \
    --json "$OUT/profile_decode_host.json" ${HOSTPROFILE_ARGS:-} 2>&1 | tee "$LOGS/profile_decode_host.log" | tail -150
  finished "profile_decode_host" "${PIPESTATUS[0]}" $HOSTPROFILE_TIMEOUT || status=1
fi
# The tests' XLA flags (TEST_XLA_FLAGS, empty for XLA's own defaults): no GEMM autotuning. On a GPU every new
# shape compiles the float32 reference again, and a property-test example took 10-15 s (thirty-fifth
# session); autotuning picks among GEMM kernels for speed, which the reference does not need. Whether it was
# the cost is for the next run to say: pytest's --durations below lists the slowest tests.
# Joined without a stray space: XLA reads an XLA_FLAGS that does not start with "--" as a file name (" " made
# pytest die before its first line, thirty-ninth session).
test_xla_flags=$(echo ${XLA_FLAGS:-} ${TEST_XLA_FLAGS---xla_gpu_autotune_level=0})
if (has check || has quickcheck) && [ $built -eq 0 ]; then
  note check
  subset=(); has check || subset=(-k small_spec)  # quickcheck: the `small` shapes only
  XLA_FLAGS=$test_xla_flags timeout $CHECK_TIMEOUT python3 -m pytest -q -p no:cacheprovider --durations=10 \
    tests/test_arg_specs.py ${subset[@]+"${subset[@]}"} 2>&1 \
    | tee "$LOGS/check.log" | tail -20
  finished "check" "${PIPESTATUS[0]}" $CHECK_TIMEOUT || { status=1; [ -n "${KEEP_GOING:-}" ] || built=1; }  # wrong kernels: skip the rest
fi

if has test && [ $built -eq 0 ]; then
  note pytest
  XLA_FLAGS=$test_xla_flags timeout $TEST_TIMEOUT python3 -m pytest ${PYTEST_ARGS:--x} -q -p no:cacheprovider \
    --durations=15 ${PYTEST_PATHS:-tests/} 2>&1 | tee "$LOGS/pytest.log" | tail -25
  finished "pytest" "${PIPESTATUS[0]}" $TEST_TIMEOUT || status=1
fi

if has sanitize && [ $built -eq 0 ]; then
  # Standalone driver (no JAX): one cudaMalloc per operand, so memcheck sees each
  # operand's true bounds; outputs then checked against NumPy.
  # HARNESS: another driver build, e.g. build/gpu/sanitize_harness_narrow_fp8_mma_sync (fp8
  # narrow units on the mma.sync body); SANITIZE_TOOLS: which tools (default all three); SANITIZER_ARGS: more
  # compute-sanitizer options, e.g. SANITIZE_TOOLS=racecheck SANITIZER_ARGS="--racecheck-report hazard".
  harness=${HARNESS:-build/gpu/sanitize_harness}
  [ -x $harness ] || { echo "no $harness: run the build step"; status=1; }
  # SANITIZE_WIDE=1: only the cases with units of > 16 rows (the wgmma bodies; the driver built, 13 cases
  # made and all three tools run in 53 s on 2026-12-02), so that
  # `build check test sanitize bench` fits in one 600 s device call.
  cases_py make /tmp/mla_cases ${SANITIZE_WIDE:+--wide} \
    | tee "$LOGS/harness_cases.log"
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
    note "compute-sanitizer --tool $tool $harness"
    timeout ${SANITIZE_TIMEOUT:-240} compute-sanitizer --tool $tool --error-exitcode 9 ${SANITIZER_ARGS:-} $harness \
      /tmp/mla_cases/case*.bin \
      > "$LOGS/sanitizer_$tool.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || status=1
    tail -4 "$LOGS/sanitizer_$tool.log"
    echo "compute-sanitizer $tool exit $rc" | tee -a "$LOGS/summary.txt"
  done
  cases_py check /tmp/mla_cases 2>&1 | tee -a "$LOGS/summary.txt"
  finished "cases.py check" "${PIPESTATUS[0]}" - || status=1
  if [ -n "${JAX_SANITIZE:-}" ]; then  # the same kernels under JAX (segfaulted here once)
    note "compute-sanitizer memcheck (JAX process)"
    timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider tests/test_arg_specs.py -k small_spec \
      > "$LOGS/sanitizer_jax_memcheck.log" 2>&1
    echo "compute-sanitizer memcheck (JAX) exit $?" | tee -a "$LOGS/summary.txt"
    tail -6 "$LOGS/sanitizer_jax_memcheck.log"
  fi
fi

if has parallel && [ $built -eq 0 ]; then
  # Issue 12: several GPUs against one (on a single GPU: the mesh path's own cost).
  note "bench_parallel ${PARALLEL_ARGS:-}"
  timeout $PARALLEL_TIMEOUT python3 benchmarks/bench_parallel.py --json "$OUT/bench_parallel.json" \
    ${PARALLEL_ARGS:-} 2>&1 | tee "$LOGS/bench_parallel.log" | tail -12
  finished "bench_parallel" "${PIPESTATUS[0]}" $PARALLEL_TIMEOUT || status=1
fi

if has timing && [ $built -eq 0 ]; then
  # The target shapes through the standalone driver: device time per call of the op, of each of its
  # kernels alone and with other merge grids, CUDA graphs and events (no JAX).
  note "driver timing"
  # TIMING_L2=1: the same plans again with the keys in L2 (cases.py timing --l2).
  for l2 in "" ${TIMING_L2:+_l2}; do
    cases_py timing /tmp/mla_timing$l2 ${l2:+--l2} \
      > "$LOGS/timing${l2}_cases.log" 2>&1
    timeout 240 build/gpu/sanitize_harness --time /tmp/mla_timing$l2/time*.bin 2>&1 | tee "$LOGS/timing$l2.log"
    finished "driver timing$l2" "${PIPESTATUS[0]}" 240 || status=1
  done
fi

[ -n "$fi_pid" ] && { wait $fi_pid; tail -4 "$LOGS/flashinfer_setup.log"; }
[ -n "$fm_pid" ] && { wait $fm_pid; tail -3 "$LOGS/flashmla_setup.log"; }
if (has bench || has sweep) && [ $built -eq 0 ]; then
  export PYTHONPATH=/tmp/fi${PYTHONPATH:+:$PYTHONPATH}
  args="${BENCH_ARGS:-}"
  has sweep && args="$args --sweep"
  [ -f $fm_dir/bench.py ] && args="$args --flashmla $fm_dir"
  note "bench $args"
  timeout $BENCH_TIMEOUT python3 benchmarks/bench_attention.py --out "$OUT" $args 2>&1 | tee "$LOGS/bench.log" \
    | grep -v "^  \|INFO" | tail -45
  finished "bench" "${PIPESTATUS[0]}" $BENCH_TIMEOUT || status=1
fi

if has anatomy && [ $built -eq 0 ]; then
  # Where a call's device time goes, kernel by kernel, ours beside FlashMLA's (ffi/cuda/NOTES.md, "forty-eighth
  # session"): each run its own process, the sides interleaved; the step stops starting runs at its time limit.
  note "call_anatomy $ANATOMY_SHAPES"
  whos=ours; [ -f $fm_dir/bench.py ] && whos="ours flashmla"
  t0=$(date +%s) anatomy_rc=0
  for round in $(seq ${ANATOMY_ROUNDS:-2}); do
    for shape in $ANATOMY_SHAPES; do
      for who in $whos; do
        [ $(( $(date +%s) - t0 )) -lt $ANATOMY_TIMEOUT ] || break 3
        timeout 120 python3 benchmarks/call_anatomy.py --who $who --shape $shape --flashmla $fm_dir \
          2>> "$LOGS/anatomy_$who.log" | tail -1 | tee -a "$OUT/anatomy.jsonl" | cut -c1-400
        rc=${PIPESTATUS[0]}
        [ $rc -eq 0 ] || { echo "call_anatomy $who $shape exit $rc (logs/anatomy_$who.log)"; anatomy_rc=1; }
      done
    done
  done
  finished "anatomy" $anatomy_rc $ANATOMY_TIMEOUT || status=1
fi

tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
exit $status
