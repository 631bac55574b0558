"""The host planner: coverage, merges, buckets, plan reuse, cost-model behaviour."""

from __future__ import annotations

import numpy as np
import pytest

import jax
from jax_mla import PlanTarget, plan_mla
from jax_mla import planner as P


def coverage(plan, kv_device, capacity):
    """Per query token, how many times each visible key is covered by a unit,
    following plan_layout.h literally. Returns (counts per token, visible per token)."""
    toks = np.asarray(plan.tokens)
    vis = np.zeros(plan.num_tokens, np.int64)
    for t, (r, e) in enumerate(toks):
        if r >= 0:
            vis[t] = max(min(kv_device[r], capacity) - e + 1, 0)
    counts = [np.zeros(max(v, 1), np.int64) for v in vis]
    for row in np.asarray(plan.work):
        n = row[P.W_QLEN]
        for i in range(n):
            t = row[P.W_QSTART] + i
            assert toks[t, 0] == row[P.W_REQUEST]
            assert toks[t, 1] == row[P.W_QEND_OFFSET] - i
            lo = row[P.W_KV_START]
            hi = vis[t] if row[P.W_KV_END] == P.KV_END_OPEN else min(row[P.W_KV_END], vis[t])
            if hi > lo:
                counts[t][lo:hi] += 1
    return counts, vis


def check_plan(plan, kv_device, capacity=1 << 30):
    counts, vis = coverage(plan, kv_device, capacity)
    for t, c in enumerate(counts):
        assert np.all(c[: vis[t]] == 1), f"token {t}: keys covered {c[: vis[t]]}"
    work = np.asarray(plan.work)
    live = work[work[:, P.W_QLEN] > 0]
    # Every token belongs to exactly one tile; split tiles have exactly one merge.
    rows = []
    for m in np.asarray(plan.merge):
        if m[P.M_QLEN] == 0:
            continue
        units = live[(live[:, P.W_QSTART] == m[P.M_QSTART])]
        assert len(units) == m[P.M_NUM_SPLITS] >= 2
        assert sorted(units[:, P.W_SPLIT]) == list(range(m[P.M_NUM_SPLITS]))
        for u in units:
            assert u[P.W_PARTIAL_ROW] == m[P.M_PARTIAL_ROW] + u[P.W_SPLIT] * m[P.M_QLEN]
            rows.extend(range(u[P.W_PARTIAL_ROW], u[P.W_PARTIAL_ROW] + u[P.W_QLEN]))
    assert len(rows) == len(set(rows)), "partial rows overlap"
    assert all(0 <= r < plan.num_partial_rows for r in rows)
    direct = live[live[:, P.W_PARTIAL_ROW] < 0]
    assert not set(direct[:, P.W_QSTART]) & set(np.asarray(plan.merge)[:, P.M_QSTART][
        np.asarray(plan.merge)[:, P.M_QLEN] > 0])
    assert np.all(live[:, P.W_QLEN] <= plan.q_tile)


@pytest.mark.parametrize("heads", [1, 3, 16, 128])
@pytest.mark.parametrize("workers", [1, 8, 132])
def test_plan_covers_every_visible_key_once(rng, heads, workers):
    r = int(rng.integers(1, 12))
    qo = rng.integers(0, 9, r)
    kv = qo + rng.integers(0, 700, r)
    plan = plan_mla(qo, kv, num_heads=heads, page_size=16,
                    target=PlanTarget(num_workers=workers, min_chunk=32, chunk_align=16))
    check_plan(plan, kv)


def test_plan_reuse_for_n_steps_and_longer_device_lengths(rng):
    kv = rng.integers(1, 3000, 5)
    n = 8
    plan = plan_mla(np.ones(5, int), kv + n, num_heads=16, page_size=64,
                    target=PlanTarget(num_workers=32, min_chunk=64))
    for step in range(n + 1):
        check_plan(plan, kv + step)
    check_plan(plan, kv + 5 * n)  # open last split: longer lengths stay covered


def test_long_request_spreads_over_all_workers():
    plan = plan_mla([1], [32768], num_heads=16, page_size=64, target=PlanTarget(num_workers=132))
    live = np.asarray(plan.work)[np.asarray(plan.work)[:, P.W_QLEN] > 0]
    assert 100 <= len(live) <= 132
    check_plan(plan, [32768])


def test_many_short_requests_are_not_split():
    plan = plan_mla(np.ones(256, int), np.full(256, 512), num_heads=16, page_size=16,
                    target=PlanTarget(num_workers=132))
    w = np.asarray(plan.work)
    assert (w[:, P.W_PARTIAL_ROW] < 0).all() and (np.asarray(plan.merge)[:, P.M_QLEN] == 0).all()


def test_heads_over_tile_rows_count_as_several_blocks():
    a = plan_mla([1], [32768], num_heads=16, page_size=64, target=PlanTarget(num_workers=132))
    b = plan_mla([1], [32768], num_heads=128, page_size=64, target=PlanTarget(num_workers=132))
    n = lambda p: int((np.asarray(p.work)[:, P.W_QLEN] > 0).sum())
    assert n(b) * 2 <= n(a) + 2


def test_units_longest_first():
    plan = plan_mla([1, 1, 1], [100, 5000, 900], num_heads=16, page_size=16,
                    target=PlanTarget(num_workers=4, min_chunk=64))
    w = np.asarray(plan.work)
    live = w[w[:, P.W_QLEN] > 0]
    kv = np.array([100, 5000, 900])
    cost = np.minimum(np.where(live[:, P.W_KV_END] == P.KV_END_OPEN, kv[live[:, P.W_REQUEST]],
                               live[:, P.W_KV_END]), kv[live[:, P.W_REQUEST]]) - live[:, P.W_KV_START]
    assert np.all(np.diff(cost) <= 0)


def test_shapes_are_bucketed(rng):
    t = PlanTarget(num_workers=132)
    shapes = set()
    for _ in range(20):
        kv = rng.integers(1, 4096, 64)
        p = plan_mla(np.ones(64, int), kv, num_heads=16, page_size=64, target=t)
        shapes.add((p.work.shape, p.merge.shape, p.tokens.shape, p.num_partial_rows,
                    jax.tree_util.tree_structure(p)))
    assert len(shapes) <= 2, shapes
    for w, m, _, pr, _ in shapes:
        assert w[0] & (w[0] - 1) == 0 and m[0] & (m[0] - 1) == 0 and pr & (pr - 1) == 0
    assert all(s[0][1] == 8 and s[1][1] == 4 for s in shapes)


def test_padding_tokens_and_zero_requests():
    plan = plan_mla([0, 2, 0], [0, 5, 7], num_heads=4, page_size=1, num_tokens=5,
                    target=PlanTarget(num_workers=2))
    toks = np.asarray(plan.tokens)
    assert toks.tolist() == [[1, 2], [1, 1], [-1, 0], [-1, 0], [-1, 0]]
    check_plan(plan, [0, 5, 7])
    assert plan.work.dtype == np.int32 and plan.merge.dtype == np.int32 and plan.tokens.dtype == np.int32


@pytest.mark.parametrize("kwargs, match", [
    (dict(qo_lens=[1, 2], kv_lens=[3]), "requests"),
    (dict(qo_lens=[-1], kv_lens=[3]), r"qo_lens\[0\] = -1"),
    (dict(qo_lens=[4], kv_lens=[3]), r"qo_lens\[0\] = 4 exceeds kv_lens\[0\] = 3"),
    (dict(qo_lens=[1], kv_lens=[3], page_size=48), "page_size=48"),
    (dict(qo_lens=[1], kv_lens=[3], num_heads=0), "num_heads"),
    (dict(qo_lens=[1], kv_lens=[3.5]), "integers"),
    (dict(qo_lens=[[1]], kv_lens=[[3]]), "1-D"),
    (dict(qo_lens=[1, 1], kv_lens=[3, 65], max_pages_per_request=4), r"kv_lens\[1\] = 65 exceeds"),
    (dict(qo_lens=[2], kv_lens=[3], num_tokens=1), "num_tokens=1"),
    # lengths past int32 raise at once (they used to run the planner out of memory)
    (dict(qo_lens=[1], kv_lens=[2**31]), r"kv_lens\[0\] = 2147483648 does not fit int32"),
    (dict(qo_lens=[2**31, 1], kv_lens=[2**31, 5]), r"qo_lens\[0\] = 2147483648"),
    (dict(qo_lens=np.array([1], np.uint64), kv_lens=np.array([2**63], np.uint64)), r"kv_lens\[0\] = 9223372036854775808"),
    (dict(qo_lens=[2**30, 2**30], kv_lens=[2**30, 2**30]), r"sum\(qo_lens\) = 2147483648"),
    (dict(qo_lens=[1], kv_lens=[3], num_tokens=2**31), "num_tokens=2147483648"),
])
def test_plan_errors(kwargs, match):
    kw = dict(num_heads=2, page_size=16, target=PlanTarget(num_workers=2))
    kw.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan_mla(**kw)


def test_plan_refuses_device_arrays():
    with pytest.raises(TypeError, match="host"):
        plan_mla(jax.numpy.ones(2, jax.numpy.int32), [3, 3], num_heads=2, page_size=16)


def test_default_target_matches_platform():
    t = P.default_target()
    assert t.num_workers >= 1


def test_plan_bytes_depend_on_batch_not_context():
    t = PlanTarget(num_workers=132)
    size = lambda kv: sum(a.nbytes for a in jax.tree_util.tree_leaves(
        plan_mla(np.ones(8, int), np.full(8, kv), num_heads=16, page_size=64, target=t)))
    assert size(100) == size(4096) == size(1 << 20)
