"""The host planner: coverage, merges, buckets, plan reuse, cost-model behaviour."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
        # split j of the tile writes its tokens at base + j * q_len: every j once
        offsets = units[:, P.W_PARTIAL_ROW] - m[P.M_PARTIAL_ROW]
        assert (offsets % m[P.M_QLEN] == 0).all()
        assert sorted(offsets // m[P.M_QLEN]) == list(range(m[P.M_NUM_SPLITS]))
        for u in units:
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


@pytest.mark.parametrize("heads, q_len", [(64, 2), (128, 3), (16, 8)])
@pytest.mark.parametrize("workers", [8, 132])
def test_plan_of_one_q_len_covers_every_visible_key_once(rng, heads, q_len, workers):
    """Requests of one q_len over several tiles (MTP at 64+ heads, or 8 tokens at 16): a ragged batch's
    requests are packed with their tiles as one, cut at the same keys."""
    for _ in range(20):
        r = int(rng.integers(1, 12))
        kv = q_len + rng.integers(0, 2000, r)
        qo = np.where(rng.random(r) < 0.1, 0, q_len)
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


def unit_keys(plan, kv):
    """Keys of each live unit of a plan made for lengths kv, in the plan's order."""
    w = np.asarray(plan.work)
    live = w[w[:, P.W_QLEN] > 0]
    seen = kv[live[:, P.W_REQUEST]] - (live[:, P.W_QEND_OFFSET] - live[:, P.W_QLEN])
    end = np.where(live[:, P.W_KV_END] == P.KV_END_OPEN, seen, np.minimum(live[:, P.W_KV_END], seen))
    return end - live[:, P.W_KV_START]


def dispatched_span(costs, workers):
    """When the last worker finishes if units start in order, each on the worker that frees first
    (how blocks are handed to SMs)."""
    free = [0] * workers
    for c in costs:
        heapq.heapreplace(free, free[0] + int(c))
    return max(free)


def walked_span(plan, kv, overhead, workers):
    """When the last worker finishes if each runs the units the plan names it for (kWorkWorker, modulo
    the workers: the CUDA kernel's walk, mla_wide64_walk_sm90.cuh)."""
    w = np.asarray(plan.work)
    live = w[w[:, P.W_QLEN] > 0]
    return np.bincount(live[:, P.W_WORKER] % workers, unit_keys(plan, kv) + overhead, minlength=workers).max()


def test_even_splits_run_longest_first():
    kv = np.array([1000, 4096, 3000, 4096])
    plan = plan_mla(np.ones(4, int), kv, num_heads=16, page_size=16, target=PlanTarget(num_workers=4))
    assert list(unit_keys(plan, kv)) == [4096, 4096, 3000, 1000]


@pytest.mark.parametrize("planner", ["native", "numpy"])
@pytest.mark.parametrize("q_len, kind", [(2, "whole"), (3, "whole"), (2, "split"), (2, "packed"), (3, "packed")])
def test_tiles_of_one_request_stay_neighbours(planner, q_len, kind):
    """At 128 heads a tile is one token, so q_len 2-3 makes q_len tiles per request, each seeing one key
    fewer than the next. The units that read one request's keys from one start are neighbours in the
    plan, so their blocks run together and share the keys through L2:
    - whole (more tiles than workers): longest first ranks a request's tiles by the request's keys, where
      ranked by their own keys every request's first token went to one wave and its last to the next;
    - split (few requests of one length, equal parts): a request's tiles are cut alike, and its units lie
      within q_len x parts rows;
    - packed (a ragged batch): a request's tiles are packed as one, cut at the same keys onto neighbouring
      workers, where packed one by one they were cut thousands of keys apart."""
    n_req = {"whole": 66, "split": 8, "packed": 48 // q_len}[kind]
    rng = np.random.default_rng(q_len)
    kv = {"whole": rng.integers(3000, 4097, n_req), "split": np.full(n_req, 4000),
          "packed": rng.integers(500, 16385, n_req)}[kind]
    t = PlanTarget(num_workers=132)
    plan_fn = plan_mla if planner == "native" else P.plan_mla_numpy
    plan = plan_fn(np.full(n_req, q_len), kv, num_heads=128, page_size=64, target=t)
    check_plan(plan, kv)
    w = np.asarray(plan.work)
    live = w[w[:, P.W_QLEN] > 0]
    assert len(live) > n_req * q_len if kind != "whole" else len(live) == n_req * q_len
    group = live[:, P.W_REQUEST] * (1 << 20) + live[:, P.W_KV_START]
    _, first, inverse, count = np.unique(group, return_index=True, return_inverse=True, return_counts=True)
    assert (count == q_len).all(), live[:, [P.W_REQUEST, P.W_KV_START]]
    last = np.zeros_like(first)
    np.maximum.at(last, inverse, np.arange(len(group)))
    parts = len(live) // (n_req * q_len)
    window = q_len * parts if kind == "split" else q_len
    assert (last - first < window).all(), live[:, [P.W_REQUEST, P.W_KV_START]]
    if kind == "whole":  # still longest first, by the request's keys
        assert (np.diff(kv[live[:, P.W_REQUEST]]) <= 0).all()
    if kind == "packed":  # a request's units on neighbouring workers, and the workers still balanced
        workers = 132 // 2
        assert (np.diff(live[:, P.W_WORKER].reshape(-1, q_len), axis=1) == 1).all()
        even_share = (q_len * kv.sum() + len(live) * t.unit_overhead) / workers
        assert walked_span(plan, kv, t.unit_overhead, workers) <= 1.08 * even_share


@pytest.mark.parametrize("planner", ["native", "numpy"])
@pytest.mark.parametrize("heads", [64, 128])
def test_ragged_q_len_packs_each_requests_tiles_side_by_side(planner, heads):
    """q_len 1-3 a request at 64-128 heads (a tile is one token): requests of 1, 2 and 3 tiles. Each
    request's tiles are packed as one, on lanes of as many neighbouring workers, cut at the same keys
    (its units read each piece once, side by side), and the workers stay as balanced as packing the tiles
    one by one left them (within 2% of an even share; at 128 heads, lanes shared out in proportion to the
    classes' keys had lost 2-7%)."""
    rng = np.random.default_rng(heads)
    qo, kv = rng.integers(1, 4, 22), rng.integers(500, 16385, 22)
    assert set(qo.tolist()) == {1, 2, 3}
    t = PlanTarget(num_workers=132)
    plan_fn = plan_mla if planner == "native" else P.plan_mla_numpy
    plan = plan_fn(qo, kv, num_heads=heads, page_size=64, target=t)
    check_plan(plan, kv)
    w = np.asarray(plan.work)
    live = w[w[:, P.W_QLEN] > 0]
    assert len(live) > qo.sum()  # some tiles cut
    piece = live[:, P.W_REQUEST] * (1 << 20) + live[:, P.W_KV_START]
    _, first, inverse, count = np.unique(piece, return_index=True, return_inverse=True, return_counts=True)
    assert (count == qo[live[first, P.W_REQUEST]]).all()  # each piece once for each of the request's tiles
    for p in range(count.size):
        rows = np.flatnonzero(inverse == p)
        assert (np.diff(rows) == 1).all(), live[rows]  # neighbours in the plan ...
        assert (np.diff(live[rows, P.W_WORKER]) == 1).all(), live[rows]  # ... and on neighbouring workers
        assert (np.diff(live[rows, P.W_QSTART]) == 1).all(), live[rows]  # tile i on the lane's worker i
    workers = 132 // P.plan_layout.head_blocks(heads)
    even_share = ((qo * kv).sum() + len(live) * t.unit_overhead) / workers
    assert walked_span(plan, kv, t.unit_overhead, workers) <= 1.02 * even_share
    assert dispatched_span(unit_keys(plan, kv) + t.unit_overhead, workers) <= 1.02 * even_share


@pytest.mark.parametrize("planner", ["native", "numpy"])
def test_a_long_extend_keeps_its_tiles_longest_first(planner):
    """An extend of 300 tokens at 128 heads is 300 tiles whose keys differ by up to 299: ranked as one (by
    the request's keys) its shortest tiles would go first and its longest last. Only requests of at most
    one key block of tokens (MTP, spec verify) are ranked as one; here every unit is longest first, the
    two decode requests among the extend's tiles."""
    kv = np.array([4000, 3900, 3800])
    plan_fn = plan_mla if planner == "native" else P.plan_mla_numpy
    plan = plan_fn(np.array([300, 1, 1]), kv, num_heads=128, page_size=64, target=PlanTarget(num_workers=132))
    check_plan(plan, kv)
    keys = unit_keys(plan, kv)
    assert len(keys) == 302 and (np.diff(keys) <= 0).all(), keys


@pytest.mark.parametrize("planner", ["native", "numpy"])
def test_ragged_batch_is_packed_onto_workers(planner):
    """Lengths U[1000, 8192] at 128 heads: equal parts per request leave the longest part ~1.3x the
    mean; packed, the workers finish within a few percent of one another when units start in order."""
    kv = np.random.default_rng(0).integers(1000, 8193, 32)
    t = PlanTarget(num_workers=132)
    plan_fn = plan_mla if planner == "native" else P.plan_mla_numpy
    plan = plan_fn(np.ones(32, int), kv, num_heads=128, page_size=64, target=t)
    check_plan(plan, kv)
    keys = unit_keys(plan, kv)
    workers = 132 // 2  # two head blocks per unit
    span = dispatched_span(keys + t.unit_overhead, workers)
    even_share = (kv.sum() + len(keys) * t.unit_overhead) / workers
    assert span <= 1.08 * even_share, (span, even_share)
    # The same balance when each worker runs the units the plan names it for (a walk).
    w = np.asarray(plan.work)
    assert ((w[:, P.W_WORKER] >= 0) & (w[:, P.W_WORKER] < workers)).all()
    assert walked_span(plan, kv, t.unit_overhead, workers) <= 1.08 * even_share
    # Equal parts of each request with at most one unit per worker (the plan before packing): the
    # smallest such chunk still leaves a part far longer than the packed span.
    chunk = next(c for c in range(64, 8193, 64) if (-(-kv // c)).sum() <= workers)
    parts = -(-kv // chunk)
    longest = (-(-(-(-kv // parts)) // 64) * 64).max()
    assert span < 0.92 * (longest + t.unit_overhead), (span, longest)
    assert len(keys) > 32 and (np.asarray(plan.merge)[:, P.M_QLEN] > 0).sum() >= 16


@pytest.mark.parametrize("planner", ["native", "numpy"])
def test_units_are_dealt_to_workers_back_and_forth(planner):
    """Unsplit units (more tiles than slots) at 16 heads go to the slots in rounds, forwards then backwards:
    264 requests on 132 slots, and a round's longest unit goes with the last round's shortest."""
    kv = np.r_[np.full(132, 4096), np.full(132, 2048)]
    plan_fn = plan_mla if planner == "native" else P.plan_mla_numpy
    plan = plan_fn(np.ones(264, int), kv, num_heads=16, page_size=64, target=PlanTarget(num_workers=132))
    live = np.asarray(plan.work)[:264]
    assert (live[:, P.W_QLEN] > 0).all() and (live[:, P.W_PARTIAL_ROW] < 0).all()
    assert list(live[:132, P.W_WORKER]) == list(range(132))
    assert list(live[132:, P.W_WORKER]) == list(range(131, -1, -1))
    assert walked_span(plan, kv, 0, 132) == 4096 + 2048


@pytest.mark.parametrize("planner", ["native", "numpy"])
def test_walked_plans_give_each_unit_to_the_least_loaded_worker(planner):
    """Where the CUDA kernel walks (a multiple of 64 heads, WALK_FROM_ROWS plan rows a worker: 257+ tiles at
    128 heads on 66 slots) each unit goes to the least loaded slot, as waves hand a block to the SM that
    frees first, so the walked span is the greedy dispatch's; back and forth had been 1-1.3% longer on
    ragged batches. A plan that waves run (128 tiles) keeps the dealing back and forth."""
    plan_fn = plan_mla if planner == "native" else P.plan_mla_numpy
    t = PlanTarget(num_workers=132)
    for n, hi in ((300, 4096), (400, 16384), (512, 8192)):
        kv = np.random.default_rng(n).integers(1, hi + 1, n)
        plan = plan_fn(np.ones(n, int), kv, num_heads=128, page_size=64, target=t)
        assert P.plan_layout.walks_units(128, plan.work.shape[0], 66)
        keys = unit_keys(plan, kv) + t.unit_overhead
        assert list(np.asarray(plan.work)[:66, P.W_WORKER]) == list(range(66))
        assert walked_span(plan, kv, t.unit_overhead, 66) == dispatched_span(keys, 66)
    kv = np.random.default_rng(0).integers(1, 4097, 128)
    plan = plan_fn(np.ones(128, int), kv, num_heads=128, page_size=64, target=t)
    assert not P.plan_layout.walks_units(128, plan.work.shape[0], 66)
    assert list(np.asarray(plan.work)[66:128, P.W_WORKER]) == list(range(65, 3, -1))


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
    # lengths past int32 raise at once, before any allocation sized by them
    (dict(qo_lens=[1], kv_lens=[2**31]), r"kv_lens\[0\] = 2147483648 does not fit int32"),
    (dict(qo_lens=[2**31, 1], kv_lens=[2**31, 5]), r"qo_lens\[0\] = 2147483648"),
    (dict(qo_lens=np.array([1], np.uint64), kv_lens=np.array([2**63], np.uint64)), r"kv_lens\[0\] = 9223372036854775808"),
    (dict(qo_lens=[2**30, 2**30], kv_lens=[2**30, 2**30]), r"sum\(qo_lens\) = 2147483648"),
    (dict(qo_lens=[1], kv_lens=[3], num_tokens=2**31), "num_tokens=2147483648"),
])
@pytest.mark.parametrize("planner", ["native", "numpy"])
def test_plan_errors(kwargs, match, planner):
    kw = dict(num_heads=2, page_size=16, target=PlanTarget(num_workers=2))
    kw.update(kwargs)
    with pytest.raises(ValueError, match=match):
        PLANNERS[planner]()(**kw)


@pytest.mark.parametrize("planner", ["native", "numpy"])
def test_plan_refuses_device_arrays(planner):
    with pytest.raises(TypeError, match="host"):
        PLANNERS[planner]()(jax.numpy.ones(2, jax.numpy.int32), [3, 3], num_heads=2, page_size=16)


def _native_plan_mla():
    if P._native_planner() is None:
        pytest.skip("the native module is not built")
    return plan_mla


PLANNERS = {"native": _native_plan_mla, "numpy": lambda: P.plan_mla_numpy}


def _assert_same_plan(a, b):
    for leaf in ("work", "merge", "tokens"):
        x, y = np.asarray(getattr(a, leaf)), np.asarray(getattr(b, leaf))
        assert x.dtype == y.dtype == np.int32 and x.shape == y.shape, leaf
        np.testing.assert_array_equal(x, y, err_msg=leaf)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_native_planner_makes_the_numpy_plan(data):
    """The C++ planner (ffi/planner/) and plan_mla_numpy: the same tables, bit for bit, over random
    ragged batches, heads, page sizes, targets and buckets."""
    native = _native_plan_mla()
    n = data.draw(st.integers(0, 40), label="requests")
    short = data.draw(st.booleans(), label="short contexts")
    kv = np.array(data.draw(st.lists(st.integers(0, 300 if short else 200_000), min_size=n, max_size=n)),
                  np.int64)
    if data.draw(st.booleans(), label="one q_len (MTP: requests of as many tiles, packed as one)"):
        q = data.draw(st.integers(1, 8))
        qo = np.where(kv >= q, q, 0).astype(np.int64)
    else:
        qo = np.array([data.draw(st.integers(0, min(int(k), 20))) for k in kv], np.int64)
    kw = dict(num_heads=data.draw(st.integers(1, 300), label="heads"),
              page_size=data.draw(st.sampled_from(P.SUPPORTED_PAGE_SIZES)),
              target=PlanTarget(num_workers=data.draw(st.integers(1, 264)),
                                units_per_worker=data.draw(st.sampled_from([0.5, 1.0, 1.5, 4.0])),
                                min_chunk=data.draw(st.sampled_from([1, 64, 256, 512])),
                                chunk_align=data.draw(st.sampled_from([1, 16, 64])),
                                unit_overhead=data.draw(st.sampled_from([0, 128])),
                                wide_unit_overhead=data.draw(st.sampled_from([None, 384]))),
              min_work_units=data.draw(st.sampled_from([1, 16])),
              min_partial_rows=data.draw(st.sampled_from([1, 16])))
    if data.draw(st.booleans(), label="padding tokens"):
        kw["num_tokens"] = int(qo.sum()) + data.draw(st.integers(0, 5))
    a = native(qo, kv, **kw)
    b = P.plan_mla_numpy(qo, kv, **kw)
    _assert_same_plan(a, b)
    assert a.describe() == b.describe()


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.uint64, np.int16])
def test_planners_take_any_integer_dtype(dtype):
    qo, kv = np.array([1, 0, 3], dtype), np.array([100, 7, 250], dtype)
    kw = dict(num_heads=16, page_size=16, target=PlanTarget(num_workers=8))
    _assert_same_plan(_native_plan_mla()(qo, kv, **kw), P.plan_mla_numpy(qo.tolist(), kv.tolist(), **kw))


def test_default_target_matches_platform():
    t = P.default_target()
    assert t.num_workers >= 1


class _FakeDevice:
    def __init__(self, platform, core_count=0):
        self.platform, self.core_count = platform, core_count


def test_default_gpu_target_costs_full_tma_tiles_more():
    t = P.default_target(_FakeDevice("gpu", 132))
    assert t == P.gpu_target(132) and P.default_target(_FakeDevice("gpu", 78)) == P.gpu_target(78)
    assert (t.num_workers, t.unit_overhead, t.wide_unit_overhead) == (132, 256, 384)
    # 64+ heads on pages the kernel reads by TMA take the wide cost; fewer heads or smaller pages do not
    assert t.overhead_for(128, 64) == t.overhead_for(64, 32) == 384
    assert t.overhead_for(63, 64) == t.overhead_for(128, 16) == t.overhead_for(16, 256) == 256
    assert P.default_target(_FakeDevice("cpu")).overhead_for(128, 64) == P.default_target(_FakeDevice("cpu")).unit_overhead


@pytest.mark.parametrize("planner", ["native", "numpy"])
def test_wide_unit_overhead_plans_full_tma_tiles_only(planner):
    """A ragged batch at 128 heads on pages of 64 packs with wide_unit_overhead (its plan differs from
    unit_overhead's), the same batch at 32 heads or on pages of 16 with unit_overhead."""
    plan_fn = PLANNERS[planner]()
    kv = np.random.default_rng(5).integers(1000, 8193, 32)
    qo = np.ones(32, int)
    both = PlanTarget(num_workers=132, unit_overhead=256, wide_unit_overhead=384)
    only = lambda ov: PlanTarget(num_workers=132, unit_overhead=ov)
    for heads, page, ov in ((128, 64, 384), (32, 64, 256), (128, 16, 256)):
        plan = plan_fn(qo, kv, num_heads=heads, page_size=page, target=both)
        check_plan(plan, kv)
        _assert_same_plan(plan, plan_fn(qo, kv, num_heads=heads, page_size=page, target=only(ov)))
    wide = plan_fn(qo, kv, num_heads=128, page_size=64, target=both)
    assert not np.array_equal(np.asarray(wide.work), np.asarray(plan_fn(qo, kv, num_heads=128, page_size=64,
                                                                        target=only(256)).work))


@pytest.mark.parametrize("kwargs, match", [
    (dict(unit_overhead=-1), "unit_overhead must be a non-negative int, got -1"),
    (dict(wide_unit_overhead=-5), "wide_unit_overhead must be a non-negative int, got -5"),
    (dict(wide_unit_overhead=1.5), "wide_unit_overhead must be a non-negative int, got 1.5"),
])
def test_plan_target_rejects_bad_overheads(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanTarget(num_workers=4, **kwargs)


def test_plan_bytes_depend_on_batch_not_context():
    t = PlanTarget(num_workers=132)
    size = lambda kv: sum(a.nbytes for a in jax.tree_util.tree_leaves(
        plan_mla(np.ones(8, int), np.full(8, kv), num_heads=16, page_size=64, target=t)))
    assert size(100) == size(4096) == size(1 << 20)
