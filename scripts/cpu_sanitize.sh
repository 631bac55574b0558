#!/usr/bin/env bash
# The CPU handler and the native planner under AddressSanitizer and UndefinedBehaviorSanitizer:
# the CPU side's counterpart of compute-sanitizer (scripts/gpu_check.sh sanitize). It builds
# jax_mla's C++ (CUDA off) with -fsanitize=address,undefined and libstdc++'s checked containers into
# a venv of its own, build/cpu-sanitize/venv, which sees .venv's packages (jax, flax, pytest, ...)
# through a .pth line but not .venv's editable jax_mla, so the developer's install is left alone.
# Then it runs the tests that drive the op, the planner and the cache writes on the CPU with the
# sanitizer runtimes preloaded (python itself is not instrumented); the first report fails the run.
#
#   bash scripts/cpu_sanitize.sh                 # after `make install` (or `make test`)
#   bash scripts/cpu_sanitize.sh tests/test_fp8.py -k page   # other pytest arguments
#
# Needs gcc (its libasan / libubsan) and .venv with the test extra.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_PY=.venv/bin/python
[ -x "$BASE_PY" ] || { echo "cpu_sanitize: no .venv; run 'make install' first" >&2; exit 2; }
SAN=build/cpu-sanitize
CXX=${CXX:-g++}
ASAN_LIB=$("$CXX" -print-file-name=libasan.so)
UBSAN_LIB=$("$CXX" -print-file-name=libubsan.so)
for lib in "$ASAN_LIB" "$UBSAN_LIB"; do
  [ -f "$lib" ] || { echo "cpu_sanitize: $CXX has no $lib" >&2; exit 2; }
done

if [ ! -x "$SAN/venv/bin/python" ]; then
  "$BASE_PY" -m venv "$SAN/venv"
fi
SITE=$("$SAN/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
BASE_SITE=$("$BASE_PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# A plain path line: .venv's packages become importable here, while the .pth files in that folder
# (the editable install's import hook among them) are not run.
echo "$(cd "$BASE_SITE" && pwd)" > "$SITE/jax_mla_base_venv.pth"

FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -D_GLIBCXX_ASSERTIONS -g"
JAX_MLA_CUDA=OFF JAX_MLA_BUILD_TOOLS=OFF "$SAN/venv/bin/python" -m pip install -q --no-deps . -Cbuild-dir="$SAN/build" -Ccmake.build-type=RelWithDebInfo \
  -Ccmake.define.JAX_MLA_CUDA=OFF -Ccmake.define.JAX_MLA_BUILD_TOOLS=OFF "-Ccmake.define.CMAKE_CXX_FLAGS=$FLAGS"

export LD_PRELOAD="$ASAN_LIB:$UBSAN_LIB"
# Reports go to files (pytest captures the tests' stderr, and an aborted process would lose it);
# they are printed below. No leak check: CPython and jaxlib keep allocations until exit by design.
# protect_shadow_gap=0: jaxlib maps memory there.
REPORTS="$(pwd)/$SAN/reports"
rm -rf "$REPORTS" && mkdir -p "$REPORTS"
export ASAN_OPTIONS="detect_leaks=0:protect_shadow_gap=0:abort_on_error=1:log_path=$REPORTS/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$REPORTS/ubsan"
export JAX_PLATFORMS=cpu
# Python's -P for this process and the interpreters the tests start: the checkout's own jax_mla/ (no
# native module in it) must not shadow the installed one.
export PYTHONSAFEPATH=1
"$SAN/venv/bin/python" -c "
import jax_mla, jax_mla._native as n, sys
site = sys.argv[1]
assert jax_mla.__file__.startswith(site) and n.__file__.startswith(site), (jax_mla.__file__, n.__file__)
assert jax_mla.build_info()['native'], 'the sanitized build has no CPU handler'
print('cpu_sanitize: testing', n.__file__)
" "$(cd "$SITE" && pwd)"

if [ $# -eq 0 ]; then
  # test_native.py is left out: its tests start interpreters with a bare environment (no preload).
  # Up to 4 pytest-xdist workers (the preload reaches them), stealing tests from each other: on 2 cores with a
  # warm JAX cache the tests took 159 s, 304 s with a file a worker (one file ran alone at the end), and one
  # process took 565 s in CI with a cold cache (fifty-fifth session).
  workers=$(nproc); [ "$workers" -le 4 ] || workers=4
  set -- -n "$workers" --dist worksteal tests/test_planner.py tests/test_validation.py tests/test_attention.py \
    tests/test_fp8.py tests/test_properties.py tests/test_cache.py tests/test_arg_specs.py tests/test_sharding.py
fi
status=0
"$SAN/venv/bin/python" -m pytest -q -p no:cacheprovider "$@" || status=$?
if compgen -G "$REPORTS/*" > /dev/null; then
  for f in "$REPORTS"/*; do echo "==== $f"; cat "$f"; done
  echo "cpu_sanitize: the sanitizers reported an error (above)" >&2
  exit 1
fi
exit $status
