"""The plan contract, Python side: the columns of the plan's tables, the rows-per-tile rule, the page
sizes and which keys a query token sees. Its C++ twin is ``ffi/include/jax_mla/plan_layout.h`` (same
names; tests/test_plan_layout.py checks that the values agree). The planners write these tables, the
kernels and the reference read them; nothing else defines them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Columns of the work table (plan_layout.h: WorkCol).
W_REQUEST, W_QSTART, W_QLEN, W_QEND_OFFSET, W_KV_START, W_KV_END, W_PARTIAL_ROW, W_WORKER = range(8)
WORK_COLS = 8
# Columns of the merge table (plan_layout.h: MergeCol).
M_QSTART, M_QLEN, M_PARTIAL_ROW, M_NUM_SPLITS = range(4)
MERGE_COLS = 4
# kv_end of a request's last split: "to the end of the visible range" (kKvEndOpen).
KV_END_OPEN = 0x7FFFFFFF

# Query rows (tokens x heads) one work unit holds (kRowsPerTile): a unit takes
# max(1, ROWS_PER_TILE // num_heads) tokens of one request; with more heads than rows the CUDA
# kernel spreads one token's heads over ceil(num_heads / ROWS_PER_TILE) blocks.
ROWS_PER_TILE = 64


def q_tile(num_heads: int) -> int:
    """Query tokens one work unit takes (plan_layout.h: QTile)."""
    return max(1, ROWS_PER_TILE // num_heads)


def head_blocks(num_heads: int) -> int:
    """CUDA blocks one unit's heads are spread over (plan_layout.h: HeadBlocks)."""
    return -(-num_heads // ROWS_PER_TILE)

# Plan rows a worker (SMs / head blocks) from which the CUDA launch walks a 16-bit cache at a multiple of 64
# heads, and the planner deals units to the least loaded worker (kWalkFromRows).
WALK_FROM_ROWS = 6


def walks_units(num_heads: int, plan_rows: int, workers: int) -> bool:
    """Whether the CUDA launch walks a plan of this shape (plan_layout.h: WalksUnits): a multiple of
    ROWS_PER_TILE heads and at least WALK_FROM_ROWS plan rows for each of `workers` (SMs / head blocks).
    The launch also needs a 16-bit cache on pages of 32+ keys, which a plan does not say; the planner deals
    by least load wherever this holds, harmless where the kernel then runs in waves (they ignore workers)."""
    return num_heads % ROWS_PER_TILE == 0 and plan_rows >= WALK_FROM_ROWS * workers

# Powers of two up to kMaxPageSize.
MAX_PAGE_SIZE = 256
SUPPORTED_PAGE_SIZES = tuple(1 << i for i in range(MAX_PAGE_SIZE.bit_length()))


def visible_keys(plan_tokens: jax.Array, kv_lens: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Per query token: its request (clamped to >= 0) and how many keys it sees.

    plan_tokens is the plan's [T, 2] token table (request, offset e from the end of its request's
    query block). A token sees keys [0, min(kv_len, capacity) - e + 1) (causal, aligned to the end;
    decode is e = 1); padding tokens (request -1) see none.
    """
    req = plan_tokens[:, 0]
    e = plan_tokens[:, 1]
    valid = req >= 0
    req_c = jnp.where(valid, req, 0)
    kv = jnp.clip(kv_lens[req_c], 0, capacity)
    n_vis = jnp.where(valid, jnp.maximum(kv - e + 1, 0), 0)
    return req_c, n_vis
