"""The jax.numpy reference itself: memory that scales, keys a token may not see
never reaching its output, NaN confined to the rows it came in on. (Every backend
is compared with the reference in test_attention.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla import mla_paged_attention, mla_paged_attention_reference, plan_mla
from jax_mla import _ffi
from jax_mla.testing import random_paged_batch, rel_err

SCALE = 0.09


def reference(batch, plan, **kw):
    f = jax.jit(lambda *a: mla_paged_attention_reference(*a, plan, sm_scale=SCALE, return_lse=True))
    return f(batch.q_nope, batch.q_pe, batch.ckv, batch.kpe, kw.get("page_table", batch.page_table),
             kw.get("kv_lens", batch.kv_lens))


def test_memory_is_chunked():
    """A 2048-token prefill over a 2048-token cache (8 heads, float32, DeepSeek dims): the one-shot
    reference needed a key copy per query row (16 GB); the chunked one stays far under 1 GB."""
    t, h, ps = 2048, 8, 16
    plan = plan_mla([t], [t], num_heads=h, page_size=ps)
    pages = t // ps
    spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    f = jax.jit(lambda *a: mla_paged_attention_reference(*a, plan, sm_scale=SCALE, return_lse=True))
    compiled = f.lower(spec(t, h, 512), spec(t, h, 64), spec(pages, ps, 512), spec(pages, ps, 64),
                       jax.ShapeDtypeStruct((1, pages), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        pytest.skip("this backend reports no memory analysis")
    assert analysis.temp_size_in_bytes < 2**30, f"{analysis.temp_size_in_bytes / 2**20:.0f} MiB of temporaries"


def test_long_prefix_chunk_runs(rng):
    """A 5000-token chunk over a 5000-token cached prefix, against the kernel where one is built."""
    qo, kv = np.array([5000, 1]), np.array([10000, 300])
    batch = random_paged_batch(rng, qo, kv, num_heads=4, page_size=16, d_ckv=64, d_kpe=16, dtype=jnp.float32)
    plan = plan_mla(qo, kv, num_heads=4, page_size=16)
    out, lse = reference(batch, plan)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(lse)).all()
    if _ffi.has_ffi(jax.default_backend()) and jax.default_backend() == "cpu":
        got = jax.jit(lambda *a: mla_paged_attention(*a, sm_scale=SCALE, backend="ffi"))(*batch.args(plan))
        assert rel_err(got, out) < 1e-5


def test_unseen_cache_slots_never_reach_the_output(rng):
    """NaN and inf in cache rows past kv_len and on pages outside the request: same output bits as
    with clean caches."""
    qo, kv = np.array([2, 1, 3]), np.array([37, 5, 70])
    ps = 16
    batch = random_paged_batch(rng, qo, kv, num_heads=3, page_size=ps, d_ckv=64, d_kpe=16, dtype=jnp.float32)
    plan = plan_mla(qo, kv, num_heads=3, page_size=ps)
    clean_out, clean_lse = reference(batch, plan)
    table = batch.page_table_host
    seen = np.zeros(batch.ckv.shape[:2], bool)
    for r, n in enumerate(kv):
        pos = np.arange(n)
        seen[table[r, pos // ps], pos % ps] = True
    junk = np.where(rng.random(seen.shape) < 0.5, np.nan, np.inf).astype(np.float32)[..., None]
    dirty = lambda c: jnp.where(jnp.asarray(seen)[..., None], c, jnp.asarray(junk))
    out, lse = reference(type(batch)(**{**batch.__dict__, "ckv": dirty(batch.ckv), "kpe": dirty(batch.kpe)}), plan)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(clean_lse))


def test_nan_query_stays_in_its_row(rng):
    qo, kv = np.array([1, 2]), np.array([40, 90])
    batch = random_paged_batch(rng, qo, kv, num_heads=2, page_size=16, d_ckv=64, d_kpe=16, dtype=jnp.float32)
    plan = plan_mla(qo, kv, num_heads=2, page_size=16)
    clean_out, clean_lse = reference(batch, plan)
    q = batch.q_nope.at[1, 0, 5].set(jnp.nan)  # token 1, head 0
    out, lse = reference(type(batch)(**{**batch.__dict__, "q_nope": q}), plan)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.isnan(out[1, 0]).all() and np.isnan(lse[1, 0])
    keep = np.ones(lse.shape, bool)
    keep[1, 0] = False
    np.testing.assert_array_equal(out[keep], np.asarray(clean_out)[keep])
    np.testing.assert_array_equal(lse[keep], np.asarray(clean_lse)[keep])
