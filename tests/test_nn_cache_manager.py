"""Host-side paged cache manager: allocation, release, out-of-pages, incremental device updates."""

import copy

import numpy as np
import pytest

pytest.importorskip("flax", reason="jax_mla.nn needs flax (pip install .[nn])")

from jax_mla.nn import OutOfPagesError, OutOfSlotsError, PagedCacheManager  # noqa: E402


def make(num_pages=16, page_size=4, max_requests=4, max_pages=6):
    return PagedCacheManager(num_pages=num_pages, page_size=page_size, max_requests=max_requests,
                             max_pages_per_request=max_pages)


def snapshot(m: PagedCacheManager):
    return copy.deepcopy((m._free_pages, m._free_slots, m.page_table, m.pages_held, m.lengths, m.active,
                          m._pending, m.entries_sent))


def assert_same(a, b):
    for x, y in zip(a, b):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


def owned_pages(m):
    return [m.page_table[s, : m.pages_held[s]].tolist() for s in range(m.max_requests)]


def test_admit_reserve_commit_finish():
    m = make()
    slots = m.admit([5, 4, 9])  # 2 + 1 + 3 pages
    assert slots == [0, 1, 2]
    assert m.pages_held[:3].tolist() == [2, 1, 3] and m.num_free_pages == 10
    m.commit(slots, [5, 4, 9])
    assert m.lengths[:3].tolist() == [5, 4, 9]
    pages = sum(owned_pages(m), [])
    assert len(set(pages)) == len(pages) == 6 and all(0 <= p < 16 for p in pages)
    assert (m.page_table[m.page_table >= 0].size == 6) and (m.page_table[3] == -1).all()
    # Decode: a page is taken only when a request crosses a page boundary.
    m.reserve(slots, 1)
    assert m.pages_held[:3].tolist() == [2, 2, 3] and m.num_free_pages == 9
    m.commit(slots, 1)
    m.reserve(slots, 3)
    assert m.pages_held[:3].tolist() == [3, 2, 4]  # lengths 9, 8, 13
    with pytest.raises(ValueError, match="reserve first"):
        m.commit([1], 4)
    # Release: pages return to the free list, the row is cleared, the slot is reusable.
    freed = owned_pages(m)[1]
    m.finish(1)
    assert m.num_free_pages == 16 - 9 + 2
    assert (m.page_table[1] == -1).all() and m.lengths[1] == 0 and not m.active[1]
    (s,) = m.admit([8])
    assert s == 1 and sorted(owned_pages(m)[1]) == sorted(freed)
    with pytest.raises(ValueError, match="holds no request"):
        m.finish(3)


def test_out_of_pages_leaves_state_unchanged():
    m = make(num_pages=8, page_size=4, max_pages=8)
    slots = m.admit([9, 9])  # 6 of 8 pages
    m.commit(slots, [9, 9])
    m.sync()
    before = snapshot(m)
    with pytest.raises(OutOfPagesError, match=r"6 more pages needed for 2 requests but 2 of 8 are free"):
        m.reserve(slots, 12)  # 21 tokens each: 3 + 3 more pages; only 2 free
    assert_same(before, snapshot(m))
    with pytest.raises(OutOfPagesError, match="needs 3 pages but 2"):
        m.admit([4, 5])
    assert_same(before, snapshot(m))
    with pytest.raises(ValueError, match="at most 32"):
        m.reserve(slots[:1], 24)  # beyond the request's page-table row
    assert_same(before, snapshot(m))
    m.reserve(slots, 4)  # 13 tokens each: one more page each still fits
    assert m.num_free_pages == 0


def test_out_of_slots_and_too_long():
    m = make(max_requests=2)
    m.admit([1, 1])
    before = snapshot(m)
    with pytest.raises(OutOfSlotsError):
        m.admit([1])
    assert_same(before, snapshot(m))
    m2 = make(max_pages=2)
    with pytest.raises(ValueError, match="prompt 1 has 9 tokens"):
        m2.admit([3, 9])
    assert m2.num_free_pages == 16 and not m2.active.any()


def test_device_table_updated_incrementally_and_in_place():
    m = make(num_pages=64, page_size=2, max_requests=8, max_pages=16)
    np.testing.assert_array_equal(np.asarray(m.device_page_table), m.page_table)
    slots = m.admit([3, 1, 4])  # 2 + 1 + 2 entries
    table = m.sync()
    assert m.entries_sent == 5
    np.testing.assert_array_equal(np.asarray(table), m.page_table)
    m.commit(slots, [3, 1, 4])
    ptr = m.device_page_table.unsafe_buffer_pointer()
    sent = m.entries_sent
    for step in range(6):
        m.reserve(slots, 1)
        new_entries = m.pending_entries
        m.sync()
        m.commit(slots, 1)
        assert m.entries_sent - sent == new_entries  # only the changed entries travel
        sent = m.entries_sent
        np.testing.assert_array_equal(np.asarray(m.device_page_table), m.page_table)
    # 6 steps on lengths 3, 1, 4 with pages of 2: every request took exactly 3 more pages.
    assert m.pages_held[slots].tolist() == [5, 4, 5]
    assert m.entries_sent == 5 + 9
    # Nothing pending: no call, the same array.
    before = m.device_page_table
    assert m.sync() is before
    # The donated scatter wrote into the same buffer: the table never moved.
    assert m.device_page_table.unsafe_buffer_pointer() == ptr
    m.finish(slots[1])
    m.sync()
    np.testing.assert_array_equal(np.asarray(m.device_page_table), m.page_table)
    assert (np.asarray(m.device_page_table)[slots[1]] == -1).all()


def test_plan_covers_every_slot():
    m = make(max_requests=4, max_pages=6)
    slots = m.admit([5, 2])
    m.commit(slots, [5, 2])
    qo = np.zeros(4, np.int64)
    qo[slots] = 1
    plan = m.plan(qo, m.lengths + qo, num_heads=3, num_tokens=8)
    assert plan.num_requests == 4 and plan.num_tokens == 8 and plan.page_size == 4
    np.testing.assert_array_equal(np.asarray(plan.tokens)[:, 0], [0, 1, -1, -1, -1, -1, -1, -1])
    with pytest.raises(ValueError, match="exceeds the page table's capacity"):
        m.plan(qo, np.array([25, 3, 0, 0]), num_heads=3, num_tokens=8)


@pytest.mark.parametrize("call, match", [
    (lambda m: m.finish(-1), r"slot -1 is not in \[0, 4\)"),
    (lambda m: m.finish(4), r"slot 4 is not in \[0, 4\)"),
    (lambda m: m.finish(2), "slot 2 holds no request"),
    (lambda m: m.finish(True), "slot must be an int"),
    (lambda m: m.finish(1.0), "slot must be an int"),
    (lambda m: m.reserve([0, -1], 1), r"slot -1 is not in \[0, 4\)"),
    (lambda m: m.reserve([0], -2), "new_tokens must be >= 0, got -2"),
    (lambda m: m.reserve([0], 1.5), "new_tokens must be integers"),
    (lambda m: m.commit([1], -1), "new_tokens must be >= 0, got -1"),
    (lambda m: m.commit([7], 1), r"slot 7 is not in \[0, 4\)"),
    (lambda m: m.commit([3], 1), "slot 3 holds no request"),
    (lambda m: m.pages_needed([-4], 1), r"slot -4 is not in \[0, 4\)"),
])
def test_bad_ids_and_counts_raise_and_change_nothing(call, match):
    """A bad id or count raises and leaves the manager as it was: a negative id must not wrap (NumPy
    indexing would free another slot's row and put the id on the free list), a negative count must not
    shrink a request."""
    m = make()
    m.admit([5, 4])
    before = snapshot(m)
    with pytest.raises(ValueError, match=match):
        call(m)
    assert_same(snapshot(m), before)
