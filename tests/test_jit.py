"""The jitted decode step: one trace per bucket, no device->host transfer, one plan for N steps; jax.export."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla import PlanTarget, append_paged_kv, mla_paged_attention, mla_paged_attention_reference, plan_mla
from jax_mla.testing import random_paged_batch, rel_err

HEADS, PAGE, SCALE = 4, 16, 0.125
TARGET = PlanTarget(num_workers=8, min_chunk=32, chunk_align=16)


def make_step(counter):
    @jax.jit
    def step(q_nope, q_pe, ckv, kpe, page_table, kv_lens, plan):
        counter.append(1)  # runs once per trace
        return mla_paged_attention(q_nope, q_pe, ckv, kpe, page_table, kv_lens, plan,
                                   sm_scale=SCALE, return_lse=True)
    return step


def test_no_retrace_and_no_device_to_host_within_a_bucket(rng):
    batch = 6
    b = random_paged_batch(rng, np.ones(batch, int), np.full(batch, 400), num_heads=HEADS, page_size=PAGE,
                           max_pages=40)
    traces = []
    step = make_step(traces)
    for i in range(6):
        kv = rng.integers(1, 600, batch)
        plan = plan_mla(np.ones(batch, int), kv, num_heads=HEADS, page_size=PAGE, target=TARGET)
        kv_dev = jnp.asarray(kv, jnp.int32)
        with jax.transfer_guard_device_to_host("disallow"):
            out, lse = step(b.q_nope, b.q_pe, b.ckv, b.kpe, b.page_table, kv_dev, plan)
        ref, ref_lse = mla_paged_attention_reference(b.q_nope, b.q_pe, b.ckv, b.kpe, b.page_table, kv_dev,
                                                     plan, sm_scale=SCALE, return_lse=True)
        assert rel_err(out, ref) < 1e-5 and rel_err(lse, ref_lse) < 1e-5
    assert len(traces) == 1


def test_new_bucket_retraces_once(rng):
    traces = []
    step = make_step(traces)
    for batch in (4, 4, 40, 40):
        b = random_paged_batch(rng, np.ones(batch, int), np.full(batch, 50), num_heads=HEADS, page_size=PAGE)
        plan = plan_mla(b.qo_lens, b.kv_lens_host, num_heads=HEADS, page_size=PAGE, target=TARGET)
        step(*b.args(plan))
    assert len(traces) == 2


@pytest.mark.parametrize("qo", [1, 3])
def test_one_plan_serves_n_jitted_steps(rng, qo):
    """A fori_loop of N steps on one plan made for lengths + N*qo: append, attend, advance."""
    batch, n_steps = 3, 5
    kv0 = rng.integers(qo, 200, batch)
    kv_final = kv0 + n_steps * qo
    b = random_paged_batch(rng, np.full(batch, qo), kv_final, num_heads=HEADS, page_size=PAGE,
                           num_tokens=batch * qo)
    plan = plan_mla(np.full(batch, qo), kv_final, num_heads=HEADS, page_size=PAGE, target=TARGET)
    news = jnp.asarray(rng.standard_normal((n_steps, batch * qo, 64 + 16)), jnp.float32)
    qs = jnp.asarray(rng.standard_normal((n_steps, batch * qo, HEADS, 64 + 16)), jnp.float32)

    # Everything device-side enters as an argument: a jax.Array closed over by a
    # jitted function becomes a constant, which on GPU is a device->host copy.
    def loop(attn, init, news, qs, page_table):
        def body(i, carry):
            ckv, kpe, kv, outs = carry
            ckv, kpe = append_paged_kv(ckv, kpe, news[i, :, :64], news[i, :, 64:], page_table, kv, plan)
            o = attn(qs[i, ..., :64], qs[i, ..., 64:], ckv, kpe, page_table, kv, plan, sm_scale=SCALE)
            return ckv, kpe, kv + qo, outs.at[i].set(o)
        return jax.lax.fori_loop(0, n_steps, body, init)[3]

    def run(attn):
        outs = jnp.zeros((n_steps, batch * qo, HEADS, 64))
        init = (b.ckv, b.kpe, jnp.asarray(kv0, jnp.int32), outs)
        return jax.jit(functools.partial(loop, attn))(init, news, qs, b.page_table)

    with jax.transfer_guard_device_to_host("disallow"):
        got = run(mla_paged_attention)
    want = run(mla_paged_attention_reference)
    assert rel_err(got, want) < 1e-5
    assert np.isfinite(np.asarray(got)).all() and np.abs(np.asarray(got)).sum() > 0



def _export_case(rng):
    qo, kv = np.array([1, 3]), np.array([40, 200])
    b = random_paged_batch(rng, qo, kv, num_heads=HEADS, page_size=PAGE, d_ckv=512, d_kpe=64, dtype=jnp.bfloat16)
    plan = plan_mla(qo, kv, num_heads=HEADS, page_size=PAGE, target=TARGET)
    return make_step([]), (b.q_nope, b.q_pe, b.ckv, b.kpe, b.page_table, b.kv_lens, plan)


def test_jax_export_with_the_ops_disabled_check(rng):
    """jax.export refuses the op's custom call unless its check is disabled; with
    jax_mla.export_disabled_checks() the exported step gives the jitted step's result, and one target
    serves every platform, so a CPU host exports for CUDA too."""
    from jax import export

    from jax_mla import export_disabled_checks

    step, args = _export_case(rng)
    with pytest.raises(ValueError, match="jax_mla_paged_attention"):
        export.export(step)(*args)
    exported = export.export(step, disabled_checks=export_disabled_checks())(*args)
    for got, want in zip(exported.call(*args), step(*args)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    both = export.export(step, disabled_checks=export_disabled_checks(), platforms=("cpu", "cuda"))(*args)
    assert both.platforms == ("cpu", "cuda") and "jax_mla_paged_attention" in both.mlir_module()


def test_exported_step_survives_serialization(rng):
    pytest.importorskip("flatbuffers")  # jax's serialization format
    from jax import export

    from jax_mla import export_disabled_checks

    step, args = _export_case(rng)
    exported = export.export(step, disabled_checks=export_disabled_checks())(*args)
    again = export.deserialize(exported.serialize())
    for got, want in zip(again.call(*args), step(*args)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
