"""The shared correctness shapes (jax_mla.arg_specs) through the op, against the float32 reference.

The `small` set runs on every backend (the CPU handler in CI, the CUDA kernels on a GPU); the whole
`sweep` set, with long kv ranges that wrap the CUDA key ring many times, is marked `gpu` and runs
where JAX's default backend is a GPU (scripts/gpu_check.sh: `pytest -m gpu`).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla import mla_paged_attention, mla_paged_attention_reference
from jax_mla._ffi import has_ffi
from jax_mla.arg_specs import ARG_SPECS, arg_specs
from jax_mla.testing import rel_err
from test_attention import FP8_LSE_ATOL, FP8_OUT_TOL

SCALE = 0.0723
OUT_TOL = {"bfloat16": 6e-3, "float16": 2e-3, "float32": 1e-5}
LSE_TOL = 2e-3


def check_spec(spec):
    rng = np.random.default_rng(zlib.crc32(spec.name.encode()))
    batch, plan, table, kv_dev, scales = spec.build(rng)
    t, h = batch.q_nope.shape[:2]
    # Leave NaN where the outputs will be allocated: a row the op never writes shows up.
    jax.block_until_ready(jnp.full((t, h, 512), jnp.nan, spec.dtype))
    f = jax.jit(lambda *a, **s: mla_paged_attention(*a, sm_scale=SCALE, return_lse=True, backend="ffi", **s))
    out, lse = f(batch.q_nope, batch.q_pe, batch.ckv, batch.kpe, table, kv_dev, plan, **scales)
    up = lambda x: x.astype(jnp.float32)
    ckv = up(batch.ckv) * scales.get("ckv_scale", 1.0)  # the cache's values (fp8: dequantized)
    kpe = up(batch.kpe) * scales.get("kpe_scale", 1.0)
    ref, ref_lse = mla_paged_attention_reference(up(batch.q_nope), up(batch.q_pe), ckv, kpe,
                                                 table, kv_dev, plan, sm_scale=SCALE, return_lse=True)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    ref, ref_lse = np.asarray(ref), np.asarray(ref_lse)
    empty = np.isneginf(ref_lse)
    assert np.isfinite(out).all() and not np.isnan(lse).any()
    assert (out[empty] == 0).all() and (np.isneginf(lse) == empty).all()
    tol = OUT_TOL[spec.dtype] if not scales else FP8_OUT_TOL  # fp8: fp8 x scale rounded once to the MMA type
    assert rel_err(out, ref) < tol, rel_err(out, ref)
    if (~empty).any():  # fp8 on CUDA: the rope queries are rescaled by 1 / ckv_scale in the query type
        assert np.abs(lse[~empty] - ref_lse[~empty]).max() < (LSE_TOL if not scales else FP8_LSE_ATOL)


def test_every_spec_is_well_formed():
    names = [s.name for s in ARG_SPECS]
    for s in ARG_SPECS:
        assert s.tags, s.name
        qo, kv = s.lengths()
        assert len(qo) == len(kv) == s.num_requests and (kv >= qo).all() and (qo >= 0).all()
        if s.device_kv_lens is not None:
            assert len(s.device_kv_lens) == s.num_requests
    # correctness cases are distinct
    correctness = [s.name for s in ARG_SPECS if "sweep" in s.tags]
    assert len(set(correctness)) == len(correctness), names
    assert set(s.name for s in arg_specs("small")) <= set(correctness)


@pytest.mark.parametrize("spec", arg_specs("small"), ids=lambda s: s.name)
def test_small_spec_matches_reference(spec):
    if not has_ffi(jax.default_backend()):
        pytest.skip("no FFI kernel for this platform")
    check_spec(spec)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [s for s in arg_specs("sweep") if "small" not in s.tags], ids=lambda s: s.name)
def test_cuda_sweep_spec_matches_reference(spec):
    if jax.default_backend() != "gpu" or not has_ffi("gpu"):
        pytest.skip("needs the CUDA kernels on a GPU")
    check_spec(spec)
