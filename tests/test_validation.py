"""Every bad argument raises before any launch, naming the argument and its value."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla import PlanTarget, mla_paged_attention, plan_mla
from jax_mla.testing import random_paged_batch


@pytest.fixture
def case(rng):
    b = random_paged_batch(rng, [1, 2], [5, 9], num_heads=4, page_size=4, dtype=jnp.bfloat16)
    plan = plan_mla(b.qo_lens, b.kv_lens_host, num_heads=4, page_size=4, target=PlanTarget(num_workers=2))
    return b, plan


def call(b, the_plan, **over):
    args = dict(q_nope=b.q_nope, q_pe=b.q_pe, ckv=b.ckv, kpe=b.kpe, page_table=b.page_table,
                kv_lens=b.kv_lens, plan=the_plan, sm_scale=0.1)
    args.update(over)
    return mla_paged_attention(**args)


BAD = [
    # (override builder, exception, message pattern)
    (lambda b, p: dict(q_nope=b.q_nope[0]), ValueError, r"q_nope must have rank 3, got shape \(4, 64\)"),
    (lambda b, p: dict(q_pe=b.q_pe[:, :3]), ValueError, r"q_pe tokens/heads \(3, 3\) disagree"),
    (lambda b, p: dict(ckv=b.ckv[..., :32]), ValueError, "ckv head dim 32 disagrees with q_nope head dim 64"),
    (lambda b, p: dict(kpe=b.kpe[..., :8]), ValueError, "kpe head dim 8 disagrees"),
    (lambda b, p: dict(kpe=b.kpe[:-1]), ValueError, "kpe pages/page_size"),
    (lambda b, p: dict(q_nope=b.q_nope.astype(jnp.float32)), TypeError, "q_pe dtype bfloat16 differs"),
    (lambda b, p: dict(q_nope=b.q_nope.astype(jnp.int8), q_pe=b.q_pe.astype(jnp.int8)), TypeError,
     "q_nope dtype int8 is not supported"),
    (lambda b, p: dict(ckv=b.ckv.astype(jnp.float16)), TypeError, "ckv dtype float16 differs"),
    (lambda b, p: dict(page_table=b.page_table.astype(jnp.float32)),
     TypeError, "page_table must be int32, got float32"),
    (lambda b, p: dict(kv_lens=b.kv_lens.astype(jnp.int16)), TypeError, "kv_lens must be int32, got int16"),
    (lambda b, p: dict(kv_lens=b.kv_lens[:1]), ValueError, "kv_lens has 1 entries but page_table has 2 rows"),
    (lambda b, p: dict(page_table=b.page_table[:1], kv_lens=b.kv_lens[:1]), ValueError,
     "plan has 2 requests but page_table has only 1 rows"),
    (lambda b, p: dict(plan=plan_mla([2, 2], [5, 9], num_heads=4, page_size=4)), ValueError,
     "plan was made for num_tokens=4, but q_nope has 3 tokens"),
    (lambda b, p: dict(plan=plan_mla([1, 2], [5, 9], num_heads=2, page_size=4)), ValueError,
     "plan was made for num_heads=2, but q_nope has 4 heads"),
    (lambda b, p: dict(plan=plan_mla([1, 2], [5, 9], num_heads=4, page_size=16)), ValueError,
     "plan was made for page_size=16, but the cache has page_size 4"),
    (lambda b, p: dict(plan=object()), TypeError, "plan must be an MLAPlan"),
    (lambda b, p: dict(page_table=b.page_table[:0], kv_lens=b.kv_lens[:0],
                       plan=plan_mla([], [], num_heads=4, page_size=4, num_tokens=3)), ValueError,
     "page_table rows=0"),
    (lambda b, p: dict(sm_scale=-1.0), ValueError, "sm_scale must be a positive finite"),
    (lambda b, p: dict(sm_scale=float("nan")), ValueError, "sm_scale"),
    (lambda b, p: dict(ckv=jnp.zeros((3, 12, 64), jnp.bfloat16), kpe=jnp.zeros((3, 12, 16), jnp.bfloat16)), ValueError,
     r"page_size=12 \(ckv.shape\[1\]\) is not supported"),
    (lambda b, p: dict(page_table=np.where(np.arange(b.page_table_host.shape[1]) == 1, 999,
                                           b.page_table_host).astype(np.int32)), ValueError,
     r"page_table\[0, 1\] = 999 is outside the cache's \d+ pages"),
    (lambda b, p: dict(page_table=np.full_like(b.page_table_host, -2)), ValueError,
     r"page_table\[0, 0\] = -2 is outside"),
    (lambda b, p: dict(kv_lens=np.array([5, 4000], np.int32)), ValueError,
     r"kv_lens\[1\] = 4000 is outside \[0, \d+\]"),
    (lambda b, p: dict(kv_lens=np.array([-1, 4], np.int32)), ValueError, r"kv_lens\[0\] = -1 is outside"),
]


@pytest.mark.parametrize("builder, exc, match", BAD, ids=[m for _, _, m in BAD])
def test_bad_argument_raises_naming_it(case, builder, exc, match):
    b, plan = case
    with pytest.raises(exc, match=match):
        call(b, plan, **builder(b, plan))


def test_unknown_backend(case):
    b, plan = case
    with pytest.raises(ValueError, match="backend='cuda' is not one of"):
        call(b, plan, backend="cuda")


def test_good_call_passes(case):
    b, plan = case
    out = call(b, plan, page_table=b.page_table_host, kv_lens=b.kv_lens_host.astype(np.int32))
    assert out.shape == (3, 4, 64) and out.dtype == jnp.bfloat16


@pytest.mark.parametrize("indptr, indices, kw, match", [
    ([[0, 1]], [3], {}, r"kv_indptr must be a 1-D integer array of requests \+ 1 offsets, got shape \(1, 2\)"),
    ([0.0, 1.0], [3], {}, "kv_indptr must be a 1-D integer array"),
    ([0, 2], [[3, 4]], {}, r"kv_indices must be a 1-D integer array of page ids, got shape \(1, 2\)"),
    ([1, 2], [3, 4], {}, r"kv_indptr must rise from 0 to at most len\(kv_indices\) = 2, got \[1, 2\]"),
    ([0, 2, 1], [3, 4], {}, r"must rise from 0 .* got \[0, 2, 1\]"),
    ([0, 3], [3, 4], {}, r"at most len\(kv_indices\) = 2, got \[0, 3\]"),
    ([0, 1, 3], [3, 4, 5], dict(max_pages=1), "max_pages=1 is less than the 2 pages request 1 has"),
    ([0, 1], [2**31], {}, "kv_indices holds page id 2147483648, outside int32"),
])
def test_page_table_from_indptr_rejects_bad_csr(indptr, indices, kw, match):
    from jax_mla import page_table_from_indptr

    with pytest.raises(ValueError, match=match):
        page_table_from_indptr(np.asarray(indptr), np.asarray(indices), **kw)
