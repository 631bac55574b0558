#!/usr/bin/env bash
# On the GPU machine: compare builds of the library through JAX, as a user's jitted chain runs them, in one
# lease and interleaved, so that they share one GPU, its clocks and its temperature. The driver's A/B
# (scripts/driver_ab.sh) times a kernel launch by events; this times benchmarks/bench_attention.py's device
# span of a chain, where the two disagreed by up to 3% on the walk (ffi/cuda/NOTES.md, "forty-first session").
#
#   VARIANTS="waves: walk:JAX_MLA_WIDE64_WALK=ON inflight:-DJAX_MLA_MY_MACRO" ONLY="h128 ps64,h64 ps64" \
#     ROUNDS=3 OUT=$OUT bash scripts/jax_ab.sh
#
# A variant is NAME:SPEC, SPEC a comma-separated list of items: NAME=VALUE sets that variable for the build
# (the CMake options pyproject.toml maps, e.g. JAX_MLA_WIDE64_WALK=ON), -D... is passed to nvcc (CUDAFLAGS,
# which CMake reads when it configures the variant's fresh build directory), src=DIR builds the variant from
# another source tree (default: this checkout), e.g. `git archive HEAD~1 | tar -x -C DIR`, for a change in
# the Python side or the planner, which the variant's installed package carries. Each variant is built into
# /tmp/jax_ab/NAME (`pip install --target`), all at once; then each round runs bench_attention.py (no peers,
# no fp8 rows, the shapes whose names contain one of ONLY's comma-separated pieces) from every variant, the
# order reversed every other round. ROUNDS: how many (default 3); BUDGET_S: no round starts after this many
# seconds (default 420). The table (tools/jax_ab_report.py: medians, each variant against the first) is printed
# and written to $OUT/jax_ab.md; the runs' JSON and logs are in $OUT/jax_ab.tar.gz.
set -u
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/local/cuda/bin
OUT=${OUT:-/tmp/jax_mla_out}
W=/tmp/jax_ab
rm -rf "$W" && mkdir -p "$W/runs" "$OUT"
VARIANTS=${VARIANTS:-"base:"}
ROUNDS=${ROUNDS:-3}
BUDGET_S=${BUDGET_S:-420}
t0=$(date +%s)
el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv > "$W/gpu.txt" 2>&1
only=()
IFS=',' read -ra pieces <<< "${ONLY:-}"
for p in "${pieces[@]}"; do [ -n "$p" ] && only+=(--only "$p"); done

names=()
for v in $VARIANTS; do
  name=${v%%:*} spec=${v#*:}
  names+=("$name")
  envs=() flags="" src=.
  IFS=',' read -ra items <<< "$spec"
  for it in "${items[@]}"; do
    case "$it" in
      "") ;;
      -*) flags="$flags $it" ;;
      src=*) src=${it#src=} ;;
      *=*) envs+=("$it") ;;
      *) echo "variant $name: '$it' is neither NAME=VALUE, src=DIR nor an nvcc flag"; exit 2 ;;
    esac
  done
  ( env "${envs[@]}" CUDAFLAGS="${CUDAFLAGS:-}$flags" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-8} \
      timeout 300 python3 -m pip install --no-build-isolation --no-deps --target "$W/$name" "$src" \
      -Cbuild-dir="$PWD/build/jax_ab_$name" > "$W/build_$name.log" 2>&1
    echo "build $name exit $?" ) &
done
wait $(jobs -p)
el built
ok=()
for name in "${names[@]}"; do
  # The variant's own build, or nothing: an editable install of jax_mla (`gpu_check.sh build`, `pip install -e`)
  # puts an import hook ahead of PYTHONPATH, and then every variant runs that one build (a forty-third session
  # A/B compared a build with itself so).
  if ( cd /tmp && PYTHONPATH="$W/$name" python3 -c "import jax_mla, sys; print('$name:', jax_mla.__file__); \
      print('\n'.join(jax_mla.build_info()['cuda']['bodies'])); \
      sys.exit(0 if jax_mla.__file__.startswith('$W/$name/') else 'imports jax_mla from ' + jax_mla.__file__ + \
               ', not from $W/$name (an editable install shadows PYTHONPATH: pip uninstall jax_mla first)')" ) \
      > "$W/bodies_$name.txt" 2>&1; then
    ok+=("$name")
  else
    echo "variant $name: not importable from its build"; tail -2 "$W/bodies_$name.txt"; tail -5 "$W/build_$name.log"
  fi
done
for r in $(seq 1 "$ROUNDS"); do
  order=("${ok[@]}")
  if [ $((r % 2)) -eq 0 ]; then order=(); for ((i = ${#ok[@]} - 1; i >= 0; i--)); do order+=("${ok[$i]}"); done; fi
  for name in "${order[@]}"; do
    [ $(( $(date +%s) - t0 )) -gt "$BUDGET_S" ] && { el "budget spent before round $r $name"; break 2; }
    PYTHONPATH="$W/$name" timeout 200 python3 benchmarks/bench_attention.py --out "$W/runs/r${r}_$name" --no-peers \
      --no-fp8 "${only[@]}" > "$W/runs/r${r}_$name.log" 2>&1
    el "round $r $name exit $?"
    rm -f "$W/runs/r${r}_$name/roofline.png"
  done
done
python3 tools/jax_ab_report.py "$W/runs" "${ok[@]}" | tee "$OUT/jax_ab.md"
tar czf "$OUT/jax_ab.tar.gz" -C "$W" .
