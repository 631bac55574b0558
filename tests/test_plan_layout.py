"""The plan contract: jax_mla/plan_layout.py and ffi/include/jax_mla/plan_layout.h agree."""

import pathlib
import re

from jax_mla import plan_layout as L

HEADER = (pathlib.Path(__file__).resolve().parents[1] / "ffi" / "include" / "jax_mla" / "plan_layout.h").read_text()


def _enum(name: str) -> dict:
    body = re.search(r"enum " + name + r" : int \{(.*?)\};", HEADER, re.S).group(1)
    return {k: int(v) for k, v in re.findall(r"(k\w+)\s*=\s*(\d+)", body)}


def _constant(name: str) -> int:
    return int(re.search(r"constexpr \w+ " + name + r" = (0x[0-9a-fA-F]+|\d+);", HEADER).group(1), 0)


def test_work_and_merge_columns():
    work = _enum("WorkCol")
    assert [work[k] for k in ("kWorkRequest", "kWorkQStart", "kWorkQLen", "kWorkQEndOffset", "kWorkKvStart",
                              "kWorkKvEnd", "kWorkPartialRow", "kWorkWorker", "kWorkCols")] == [
        L.W_REQUEST, L.W_QSTART, L.W_QLEN, L.W_QEND_OFFSET, L.W_KV_START, L.W_KV_END, L.W_PARTIAL_ROW,
        L.W_WORKER, L.WORK_COLS]
    merge = _enum("MergeCol")
    assert [merge[k] for k in ("kMergeQStart", "kMergeQLen", "kMergePartialRow", "kMergeNumSplits",
                               "kMergeCols")] == [L.M_QSTART, L.M_QLEN, L.M_PARTIAL_ROW, L.M_NUM_SPLITS,
                                                  L.MERGE_COLS]


def test_constants():
    assert _constant("kKvEndOpen") == L.KV_END_OPEN
    assert _constant("kRowsPerTile") == L.ROWS_PER_TILE
    assert _constant("kWalkFromRows") == L.WALK_FROM_ROWS
    assert _constant("kMaxPageSize") == L.MAX_PAGE_SIZE == max(L.SUPPORTED_PAGE_SIZES)
    assert L.SUPPORTED_PAGE_SIZES == (1, 2, 4, 8, 16, 32, 64, 128, 256)
