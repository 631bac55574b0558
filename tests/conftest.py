"""Pytest fixtures; the batch builders live in jax_mla.testing (shared with benchmarks)."""

from __future__ import annotations

import zlib

import jax
import numpy as np
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")
# Float32 comparisons mean float32: on GPUs XLA's default runs f32 matmuls in
# TF32 (about 1e-3 relative), which would swamp the tolerances of the f32 tests.
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def rng(request):
    # A fresh, reproducible stream per test (crc32: str hash() is salted per process).
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
