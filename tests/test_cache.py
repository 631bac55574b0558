"""append_paged_kv: rows land in their pages, in place, nothing else changes."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla import PlanTarget, append_paged_kv, plan_mla
from jax_mla.testing import random_paged_batch


def expected_append(ckv, kpe, new_c, new_p, table, kv, qo, num_tokens):
    ckv, kpe = np.array(ckv), np.array(kpe)
    ps = ckv.shape[1]
    t = 0
    for r, n in enumerate(qo):
        for i in range(n):
            pos = kv[r] - n + i
            ckv[table[r, pos // ps], pos % ps] = new_c[t]
            kpe[table[r, pos // ps], pos % ps] = new_p[t]
            t += 1
    return ckv, kpe


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_append_writes_each_token_at_its_position(rng, page_size):
    qo = np.array([1, 3, 0, 2])
    kv = qo + rng.integers(0, 100, 4)
    b = random_paged_batch(rng, qo, kv, num_heads=2, page_size=page_size, dtype=jnp.bfloat16,
                           num_tokens=int(qo.sum()) + 2)
    plan = plan_mla(qo, kv, num_heads=2, page_size=page_size, num_tokens=int(qo.sum()) + 2,
                    target=PlanTarget(num_workers=2))
    t = plan.num_tokens
    new_c = jnp.asarray(rng.standard_normal((t, 64)), jnp.bfloat16)
    new_p = jnp.asarray(rng.standard_normal((t, 16)), jnp.bfloat16)
    want = expected_append(b.ckv, b.kpe, new_c, new_p, b.page_table_host, kv, qo, t)
    got = jax.jit(append_paged_kv)(b.ckv, b.kpe, new_c, new_p, b.page_table, b.kv_lens, plan)
    np.testing.assert_array_equal(np.asarray(got[0]), want[0])  # padding tokens wrote nothing
    np.testing.assert_array_equal(np.asarray(got[1]), want[1])


def test_append_is_in_place_when_donated(rng):
    qo, kv = np.array([1, 1]), np.array([7, 30])
    b = random_paged_batch(rng, qo, kv, num_heads=2, page_size=16, extra_pages=200)
    plan = plan_mla(qo, kv, num_heads=2, page_size=16, target=PlanTarget(num_workers=2))
    new_c = jnp.ones((2, 64), jnp.float32)
    new_p = jnp.ones((2, 16), jnp.float32)
    # Caches made by XLA itself: a NumPy-backed array may be zero-copy on CPU, and
    # a buffer XLA does not own cannot be donated.
    k1, k2 = jax.random.split(jax.random.key(int(rng.integers(1 << 30))))
    b.ckv = jax.random.normal(k1, b.ckv.shape, b.ckv.dtype)
    b.kpe = jax.random.normal(k2, b.kpe.shape, b.kpe.dtype)
    step = jax.jit(append_paged_kv, donate_argnums=(0, 1))
    hlo = step.lower(b.ckv, b.kpe, new_c, new_p, b.page_table, b.kv_lens, plan).compile().as_text()
    # No instruction produces (or copies) a full cache-sized buffer beyond the in-place scatter.
    for cache in (b.ckv, b.kpe):
        shape = ",".join(map(str, cache.shape))
        assert not re.search(rf"f32\[{shape}\]\S* copy\(", hlo), hlo
    assert "scatter" in hlo
    ptr_c, ptr_p = b.ckv.unsafe_buffer_pointer(), b.kpe.unsafe_buffer_pointer()
    ckv, kpe = step(b.ckv, b.kpe, new_c, new_p, b.page_table, b.kv_lens, plan)
    assert b.ckv.is_deleted() and b.kpe.is_deleted()  # donated
    assert ckv.unsafe_buffer_pointer() == ptr_c and kpe.unsafe_buffer_pointer() == ptr_p
    np.testing.assert_array_equal(np.asarray(ckv[b.page_table_host[1, 1], 13]), np.ones(64))


def test_append_rejects_bad_rows(rng):
    b = random_paged_batch(rng, [1], [3], num_heads=2, page_size=16)
    plan = plan_mla([1], [3], num_heads=2, page_size=16, target=PlanTarget(num_workers=2))
    with pytest.raises(ValueError, match=r"ckv_new must have shape \(1, 64\), got \(2, 64\)"):
        append_paged_kv(b.ckv, b.kpe, jnp.zeros((2, 64)), jnp.zeros((1, 16)), b.page_table, b.kv_lens, plan)
    with pytest.raises(ValueError, match=r"kpe_new must have shape \(1, 16\)"):
        append_paged_kv(b.ckv, b.kpe, jnp.zeros((1, 64)), jnp.zeros((1, 8)), b.page_table, b.kv_lens, plan)


def test_append_drops_tokens_past_the_row_and_changes_nothing_else(rng):
    """Device lengths past the page table's capacity: the tokens that do not fit are dropped (not clipped
    onto the row's last positions, which would overwrite cached keys), and every other row is unchanged."""
    ps, max_pages = 16, 3
    qo = np.array([2, 1, 3])
    kv = np.array([20, 9, 40])
    b = random_paged_batch(rng, qo, kv, num_heads=2, page_size=ps, max_pages=max_pages)
    plan = plan_mla(qo, kv, num_heads=2, page_size=ps, target=PlanTarget(num_workers=2))
    cap = max_pages * ps
    device_kv = np.array([20, cap + 5, cap + 2], np.int32)  # request 1 entirely, request 2 partly past the row
    new_c = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)
    new_p = jnp.asarray(rng.standard_normal((6, 16)), jnp.float32)
    got_c, got_p = jax.jit(append_paged_kv)(b.ckv, b.kpe, new_c, new_p, b.page_table, jnp.asarray(device_kv), plan)
    want_c, want_p = np.array(b.ckv), np.array(b.kpe)
    table = b.page_table_host
    t = 0
    for r, n in enumerate(qo):
        for i in range(n):
            pos = device_kv[r] - n + i
            if pos < cap:
                want_c[table[r, pos // ps], pos % ps] = new_c[t]
                want_p[table[r, pos // ps], pos % ps] = new_p[t]
            t += 1
    np.testing.assert_array_equal(np.asarray(got_c), want_c)
    np.testing.assert_array_equal(np.asarray(got_p), want_p)
    assert (device_kv[1] - 1 >= cap) and (device_kv[2] - 3 < cap <= device_kv[2] - 1)  # the premise


def test_append_checks_host_tables_as_the_op_does(rng):
    b = random_paged_batch(rng, [1, 1], [3, 5], num_heads=2, page_size=16)
    plan = plan_mla([1, 1], [3, 5], num_heads=2, page_size=16, target=PlanTarget(num_workers=2))
    new_c, new_p = jnp.zeros((2, 64)), jnp.zeros((2, 16))
    table = b.page_table_host.copy()
    table[1, 0] = b.ckv.shape[0] + 3
    with pytest.raises(ValueError, match=rf"page_table\[1, 0\] = {b.ckv.shape[0] + 3} is outside"):
        append_paged_kv(b.ckv, b.kpe, new_c, new_p, table, b.kv_lens, plan)
    with pytest.raises(ValueError, match=r"kv_lens\[0\] = 99 is outside"):
        append_paged_kv(b.ckv, b.kpe, new_c, new_p, b.page_table_host, np.array([99, 5], np.int32), plan)
