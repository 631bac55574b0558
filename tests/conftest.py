"""Pytest fixtures; the batch builders live in jax_mla.testing (shared with benchmarks)."""

from __future__ import annotations

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
