"""Pytest fixtures; the batch builders live in jax_mla.testing (shared with benchmarks)."""

from __future__ import annotations

import os
import pathlib
import sys
import zlib

import jax
import numpy as np
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")
# Float32 comparisons mean float32: on GPUs XLA's default runs f32 matmuls in
# TF32 (about 1e-3 relative), which would swamp the tolerances of the f32 tests.
jax.config.update("jax_default_matmul_precision", "highest")

# JAX's persistent compilation cache (TEST_JAX_CACHE, default build/jax-test-cache; empty turns it off): a
# second run (`make test` again, scripts/cpu_sanitize.sh after it, a GPU call on the same warm machine) loads
# the tests' executables instead of compiling them. On the 2-core CI machine the sanitized run's tests took
# 268.8 s after `make test` had filled it, 402.0 s without it. The kernels are found by their FFI target names
# when an executable loads, so an edited handler is the one that runs; the Python side's changes change the
# HLO and so the cache key.
_compilation_cache = os.environ.get("TEST_JAX_CACHE", str(pathlib.Path(__file__).resolve().parents[1] / "build"
                                                          / "jax-test-cache"))
if _compilation_cache:
    jax.config.update("jax_compilation_cache_dir", _compilation_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

# `pytest --hypothesis-profile=no-shrink`: a failing example is reported as drawn, not shrunk. On a GPU an
# example of the property tests costs 10-15 s (new shapes compile), and shrinking one outlasted a device
# call (ffi/cuda/NOTES.md, "thirty-fifth session"). The tests' own @settings keep their other values.
try:
    from hypothesis import Phase, settings
except ImportError:  # scripts/wheel_check.sh runs the tests that need no hypothesis with pytest alone
    pass
else:
    settings.register_profile("no-shrink", phases=[Phase.explicit, Phase.reuse, Phase.generate])


@pytest.fixture
def rng(request):
    # A fresh, reproducible stream per test (crc32: str hash() is salted per process).
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def bench_attention():
    """benchmarks/bench_attention.py as a module (it imports its neighbour gpu_power, so benchmarks/ is put on
    the path while it loads)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import bench_attention
    finally:
        sys.path.pop(0)
    return bench_attention
