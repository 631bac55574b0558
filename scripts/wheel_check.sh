#!/usr/bin/env bash
# Build jax_mla's wheel (`pip wheel .`, an isolated build as a user's would be), install it into a
# fresh venv (no editable install, no build tree on the path) and run the quickstart and a few op
# tests against it. CI runs it after the README's test command (.ci/run).
#   scripts/wheel_check.sh [python]   (JAX_MLA_CUDA / JAX_MLA_CUDA_ARCHS pass through to the build)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-python3}
repo=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

start=$SECONDS
# A build dir of its own: the editable install's (build/<tag>) is configured for another Python.
"$PYTHON" -m pip wheel -q --no-deps . -w "$work/dist" -Cbuild-dir=build/wheel
wheel=$(ls "$work"/dist/jax_mla-*.whl)
echo "wheel: $(basename "$wheel") built in $((SECONDS - start)) s; holds:"
"$PYTHON" -m zipfile -l "$wheel" | awk '{print "  " $1}' | grep -E '\.so|\.py$' | grep -v '/nn/' | head -20

"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/pip" install -q "$wheel" pytest
cd "$work"  # not the source tree: `import jax_mla` must find the installed wheel
"$work/venv/bin/python" - <<'PY'
import jax_mla, pprint
assert "site-packages" in jax_mla.__file__, jax_mla.__file__
pprint.pprint(jax_mla.build_info())
PY
"$work/venv/bin/python" "$repo/examples/quickstart.py"
"$work/venv/bin/python" -m pytest -q -p no:cacheprovider "$repo/tests/test_native.py" \
  "$repo/tests/test_attention.py" -k "native or build_info or ffi_api or decode_batch or empty_requests or cpu_threads"
echo "wheel check passed in $((SECONDS - start)) s"
