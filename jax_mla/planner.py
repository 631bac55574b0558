"""Host-side planning of paged MLA attention.

The plan says which worker (a CUDA thread block, or a CPU task) computes which
(request, query tile, kv range) slice, and where split slices are merged. It is
made in NumPy from *host-known* lengths, never from device arrays, and reaches
the kernel as ordinary int32 operands whose shapes are bucketed: lengths that
change within a bucket change the plan's values, not its shapes, so a jitted
step neither retraces nor syncs with the device. The kernel reads the true kv
lengths from the device and clips every slice to them, and the last split of
every request is open-ended, so a plan made for lengths ``L_r + N`` serves the
next ``N`` decode steps (indeed any lengths ``>= L_r``; shorter ones just leave
some slices empty).

The table layout is fixed in ``ffi/include/jax_mla/plan_layout.h``.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import json
import os
from typing import Any, Sequence

import jax
import numpy as np
from jax import export

# The table layout, the tile rule and the page sizes are the plan contract (plan_layout.py);
# re-exported here (planner.W_QLEN etc.) for the planner's readers.
from . import plan_layout
from .plan_layout import (  # noqa: F401
    KV_END_OPEN, M_NUM_SPLITS, M_PARTIAL_ROW, M_QLEN, M_QSTART, MERGE_COLS, ROWS_PER_TILE,
    SUPPORTED_PAGE_SIZES, W_KV_END, W_KV_START, W_PARTIAL_ROW, W_QEND_OFFSET, W_QLEN, W_QSTART,
    W_REQUEST, W_WORKER, WORK_COLS)

__all__ = ["MLAPlan", "PlanTarget", "plan_mla", "plan_mla_numpy", "default_target", "gpu_target", "bucket",
           "SUPPORTED_PAGE_SIZES"]

INT32_MAX = 2**31 - 1


# Smallest page size whose blocks the CUDA kernel reads by TMA (its boxes are 32 keys of one page).
WIDE_TMA_MIN_PAGE = 32


def full_tiles_by_tma(num_heads: int, page_size: int) -> bool:
    """Whether a call's units are full 64-row tiles whose blocks come by TMA (64+ heads, pages of 32+ keys):
    on sm_90a the CUDA kernel's 64-key body, the units `fp8_products` changes."""
    return num_heads >= ROWS_PER_TILE and page_size >= WIDE_TMA_MIN_PAGE


@dataclasses.dataclass(frozen=True)
class PlanTarget:
    """What the plan is balanced for.

    num_workers: concurrent workers (SMs on a GPU, threads on a CPU).
    units_per_worker: how many units to aim for per worker (more gives better
      balance, fewer gives less merge work).
    min_chunk: smallest kv split, in tokens; below it splitting costs more than
      it saves.
    chunk_align: split boundaries are multiples of this (the kernels' kv block).
    unit_overhead: fixed cost of a unit in kv-token equivalents (launch, q load,
      output and merge traffic); used to decide whether splitting pays, and
      what a cut costs when a ragged batch is packed onto the workers.
    wide_unit_overhead: the same for units of full 64-row tiles read by TMA
      (num_heads >= 64 on pages of >= 32 keys: the CUDA kernel's 64-key body,
      whose query tile and 64-row epilogue cost more a unit); None: unit_overhead.
    """

    num_workers: int
    units_per_worker: float = 1.0
    min_chunk: int = 256
    chunk_align: int = 64
    unit_overhead: int = 128
    wide_unit_overhead: int | None = None

    def __post_init__(self):
        for name in ("num_workers", "min_chunk", "chunk_align"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"PlanTarget.{name} must be a positive int, got {v!r}")
        for name in ("unit_overhead", "wide_unit_overhead"):
            v = getattr(self, name)
            if v is None and name == "wide_unit_overhead":
                continue  # unit_overhead for every unit
            if not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"PlanTarget.{name} must be a non-negative int, got {v!r}")

    def overhead_for(self, num_heads: int, page_size: int) -> int:
        """The unit cost the planner uses for a call of num_heads heads on pages of page_size keys."""
        if self.wide_unit_overhead is not None and full_tiles_by_tma(num_heads, page_size):
            return int(self.wide_unit_overhead)
        return int(self.unit_overhead)


def gpu_target(num_sms: int = 132) -> PlanTarget:
    """The plan target of a CUDA GPU with num_sms SMs (default: an H100 / H200's 132), without a device:
    what `default_target` gives on such a GPU, for planning elsewhere (the standalone CUDA driver's cases
    are planned on the host for the H200 with it).

    One unit per SM (the CUDA kernel's measured sweet spot), a unit's fixed cost taken as 256 keys, and
    384 for full 64-row tiles read by TMA (64+ heads, pages of 32+ keys). On an H200, ragged batches
    packed with 256 ran within 2% of the best of 128 / 256 / 512 on every shape tried; at 64 and 128 heads
    384 ran 1.2-2.0% faster than 256 on three ragged batches, while below 64 heads a larger cost gained
    under 1% or lost, and on pages of 16 keys it lost (ffi/cuda/NOTES.md, "a unit cost per body").
    """
    return PlanTarget(num_workers=num_sms, units_per_worker=1.0, min_chunk=256, chunk_align=64, unit_overhead=256,
                      wide_unit_overhead=384)


def default_target(device: Any = None) -> PlanTarget:
    """The plan target for `device` (default: JAX's first device).

    GPU: `gpu_target` of its SM count. CPU: a few units per thread so that uneven requests still balance.
    """
    if device is None:
        device = jax.devices()[0]
    if device.platform == "gpu":
        return gpu_target(int(getattr(device, "core_count", 0) or 132))
    threads = os.cpu_count() or 1
    return PlanTarget(num_workers=threads, units_per_worker=4.0, min_chunk=512, chunk_align=64)


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum): the shape buckets of per-step arrays."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class MLAPlan:
    """A host plan: int32 tables (pytree leaves) plus static shape facts.

    Leaves (int32, fixed bucketed shapes; pass the plan straight into `jax.jit`):
      work   [W, 8]  work units (see plan_layout.h)
      merge  [M, 4]  merges of split tiles
      tokens [T, 2]  per query token: request (-1 for padding tokens) and its
                     offset from the end of its request's query block (last = 1)
    Static (part of the jit cache key; equal within a bucket):
      num_tokens, num_heads, page_size, num_requests, q_tile, num_partial_rows.
    """

    work: Any
    merge: Any
    tokens: Any
    num_tokens: int
    num_heads: int
    page_size: int
    num_requests: int
    q_tile: int
    num_partial_rows: int

    def tree_flatten(self):
        static = (self.num_tokens, self.num_heads, self.page_size, self.num_requests,
                  self.q_tile, self.num_partial_rows)
        return (self.work, self.merge, self.tokens), static

    @classmethod
    def tree_unflatten(cls, static, leaves):
        return cls._make(*leaves, *static)

    @classmethod
    def _make(cls, work, merge, tokens, num_tokens, num_heads, page_size, num_requests, q_tile,
              num_partial_rows) -> "MLAPlan":
        # The frozen dataclass's __init__ sets each field through object.__setattr__ (~3 us for
        # nine fields); a plan is built before every decode step and unflattened at every jit
        # dispatch, so fill the instance dict at once instead (same fields, same object).
        plan = object.__new__(cls)
        plan.__dict__.update(work=work, merge=merge, tokens=tokens, num_tokens=num_tokens,
                             num_heads=num_heads, page_size=page_size, num_requests=num_requests,
                             q_tile=q_tile, num_partial_rows=num_partial_rows)
        return plan

    def describe(self) -> str:
        """Human summary (host plans only)."""
        w = np.asarray(self.work)
        live = w[w[:, W_QLEN] > 0]
        split = int((live[:, W_PARTIAL_ROW] >= 0).sum())
        return (f"MLAPlan(tokens={self.num_tokens}, heads={self.num_heads}, page_size={self.page_size}, "
                f"requests={self.num_requests}, q_tile={self.q_tile}, units={len(live)}/{len(w)}, "
                f"split_units={split}, merges={int((np.asarray(self.merge)[:, M_QLEN] > 0).sum())}/"
                f"{np.shape(self.merge)[0]}, partial_rows={self.num_partial_rows})")


def _serialize_plan_static(static: tuple) -> bytes:
    return json.dumps([int(v) for v in static]).encode()


def _deserialize_plan_static(data: bytes) -> tuple:
    return tuple(json.loads(data))


# An exported function that takes a plan (jax.export) serializes the plan's tree: its static facts go
# as six ints (attention.export_disabled_checks has the rest of what export needs).
export.register_pytree_node_serialization(MLAPlan, serialized_name="jax_mla.MLAPlan",
                                          serialize_auxdata=_serialize_plan_static,
                                          deserialize_auxdata=_deserialize_plan_static)


def _as_lengths(name: str, x: Any, check_values: bool = True) -> np.ndarray:
    """x as a 1-D int64 NumPy array; check_values: also its int32 range and sign (the native planner
    checks those itself)."""
    if isinstance(x, jax.Array) and not isinstance(x, np.ndarray):
        # Planning must never read device memory: that is the sync we exist to avoid.
        raise TypeError(f"{name} must be host data (list / NumPy), got a jax.Array; "
                        "keep a host copy of the lengths")
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.dtype != np.int64:
        if a.size and a.dtype.kind not in "iu":
            raise ValueError(f"{name} must be integers, got dtype {a.dtype}")
        if a.size and a.dtype == np.uint64 and a.max() > INT32_MAX:  # the int64 cast would wrap it
            i = int(np.argmax(a))
            raise ValueError(f"{name}[{i}] = {int(a[i])} does not fit int32 (the kernels' lengths)")
        a = a.astype(np.int64)
    if check_values and a.size:
        if a.max() > INT32_MAX:
            i = int(np.argmax(a))
            raise ValueError(f"{name}[{i}] = {int(a[i])} does not fit int32 (the kernels' lengths)")
        if a.min() < 0:
            i = int(np.argmin(a))
            raise ValueError(f"{name}[{i}] = {int(a[i])} is negative")
    return a


@functools.cache
def _native_planner():
    """The native module's planner, or None where the native side is not built."""
    from . import _ffi
    native = _ffi._native
    return None if native is None else native.plan_mla


def plan_mla(
    qo_lens: Sequence[int] | np.ndarray,
    kv_lens: Sequence[int] | np.ndarray,
    *,
    num_heads: int,
    page_size: int,
    num_tokens: int | None = None,
    max_pages_per_request: int | None = None,
    target: PlanTarget | None = None,
    min_work_units: int = 16,
    min_partial_rows: int = 16,
) -> MLAPlan:
    """Plan one paged MLA attention call.

    Args:
      qo_lens: [R] query tokens per request (host ints). Request r owns query
        rows ``sum(qo_lens[:r]) : sum(qo_lens[:r+1])``. Pad the batch with
        zero-length requests to keep R fixed.
      kv_lens: [R] kv lengths to plan for (host ints), *including* the new
        tokens. To reuse the plan for N decode steps, pass lengths + N.
      num_heads, page_size: as in the op.
      num_tokens: query rows of the op (default ``sum(qo_lens)``); rows past
        ``sum(qo_lens)`` are padding and come out as zeros.
      max_pages_per_request: the page table's width; if given, kv lengths beyond
        ``max_pages_per_request * page_size`` raise here.
      target: parallelism to balance for (default: `default_target()`).
      min_work_units, min_partial_rows: smallest buckets.

    Runs the C++ planner of the native module (``ffi/planner/``, a few microseconds) when it is
    built, else `plan_mla_numpy`; both make the same plan (tests/test_planner.py).
    """
    native = _native_planner()
    if native is None:
        return plan_mla_numpy(qo_lens, kv_lens, num_heads=num_heads, page_size=page_size,
                              num_tokens=num_tokens, max_pages_per_request=max_pages_per_request,
                              target=target, min_work_units=min_work_units,
                              min_partial_rows=min_partial_rows)
    # The native planner checks the lengths' values itself.
    qo, kv, target = _prepare(qo_lens, kv_lens, num_heads, page_size, num_tokens, max_pages_per_request,
                              target, check_values=False)
    work, merge, tokens, n_tok, q_tile, n_partial = native(
        qo, kv, num_heads, page_size, -1 if num_tokens is None else num_tokens,
        -1 if max_pages_per_request is None else max_pages_per_request, target.num_workers,
        float(target.units_per_worker), target.min_chunk, target.chunk_align,
        target.overhead_for(num_heads, page_size),
        min_work_units, min_partial_rows)
    return MLAPlan._make(work, merge, tokens, n_tok, int(num_heads), int(page_size), qo.size, q_tile,
                         n_partial)


def _prepare(qo_lens, kv_lens, num_heads, page_size, num_tokens, max_pages_per_request, target,
             check_values: bool):
    """What both planners check first: the scalar arguments, the lengths as 1-D int64 arrays of one
    size (check_values: also their int32 range and sign), and the target (default_target() if None)."""
    _check_scalars(num_heads, page_size, num_tokens, max_pages_per_request)
    qo = _as_lengths("qo_lens", qo_lens, check_values)
    kv = _as_lengths("kv_lens", kv_lens, check_values)
    if qo.shape != kv.shape:
        raise ValueError(f"qo_lens has {qo.size} requests but kv_lens has {kv.size}")
    return qo, kv, default_target() if target is None else target


def _check_scalars(num_heads, page_size, num_tokens, max_pages_per_request) -> None:
    if not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    if page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"page_size={page_size!r} is not supported; use one of {SUPPORTED_PAGE_SIZES}")
    if num_tokens is not None and (not isinstance(num_tokens, (int, np.integer)) or num_tokens > INT32_MAX):
        raise ValueError(f"num_tokens={num_tokens!r} must be an int that fits int32")
    if max_pages_per_request is not None and (not isinstance(max_pages_per_request, (int, np.integer))
                                              or not 0 <= max_pages_per_request <= INT32_MAX):
        raise ValueError(f"max_pages_per_request={max_pages_per_request!r} must be an int in [0, 2**31)")


def _pack_groups_at(classes: list, slots: int, span: int, ovh: int, align: int, min_piece: int):
    """Groups of tiles in order onto `slots` workers of `span` each (a unit costs its keys + ovh), each
    group packed as one. classes: (g, the keys of its groups' last tiles, their first tiles), widest
    first. A class's groups go in order onto lanes of g neighbouring workers: a group's last tile that
    does not fit where the lane is is cut at a multiple of `align`, both parts >= min_piece, or goes
    whole to the next lane; each of its units runs once for each of the group's tiles, tile i on the
    lane's worker i; the class's last lane takes whatever is left. A narrower class goes on where the
    wider left off: the lane it stopped in, the lanes it did not reach, and the workers too few for one
    of its lanes, cut into lanes of its own width. Returns the units (tile, first key, keys, start on its
    worker, worker, index in its tile; a lane's in order), whether each class's last lane held within
    the span, and the makespan (the largest load)."""
    segs = [(0, slots, 0)]  # (first worker, workers, load of each): the workers still open, in order
    loads = [0] * slots
    units, fits = [], True
    for g, kvs, firsts in classes:
        lanes, rest = [], []
        for f, n, u in segs:
            lanes += [[f + k * g, u] for k in range(n // g)]
            if n % g:
                rest.append((f + n - n % g, n % g, u))
        if not lanes:
            return units, False, 0
        li, end = 0, len(lanes) - 1
        used = lanes[0][1]
        for kv, first in zip(kvs, firsts):
            s = j = 0
            while True:
                r = kv - s
                if used + r + ovh <= span or li == end:
                    take = r
                else:
                    # as much as fits, leaving at least min_piece of the tile for the next lane; an empty
                    # lane takes the tile whole when it cannot be cut (-1: nothing here, next lane)
                    piece = min((span - used - ovh) // align, (r - min_piece) // align) * align
                    take = piece if piece >= min_piece else r if used == 0 else -1
                if take >= 0:
                    units += [(first + i, s, take, used, lanes[li][0] + i, j) for i in range(g)]
                    s, j, used = s + take, j + 1, used + take + ovh
                if s == kv:
                    break
                lanes[li][1] = used
                li += 1
                used = lanes[li][1]
        lanes[li][1] = used
        for f, u in lanes[: li + 1]:
            loads[f : f + g] = [u] * g
        fits = fits and lanes[end][1] <= span
        segs = []  # the open workers in order, neighbours of one load as one
        for f, n, u in sorted([(f, g, u) for f, u in lanes[li:]] + rest):
            if segs and segs[-1][0] + segs[-1][1] == f and segs[-1][2] == u:
                segs[-1] = (segs[-1][0], segs[-1][1] + n, u)
            else:
                segs.append((f, n, u))
    return units, fits, max(loads)


def _pack_groups(tile_kv: np.ndarray, sizes: np.ndarray, slots: int, ovh: int, align: int, min_piece: int,
                 most: int):
    """Groups of tiles (sizes: each group's tile count; a group's tiles consecutive) packed as one
    (`_pack_groups_at`: a group's last tile, which sees the most keys, cut onto a lane of as many workers)
    at the smallest span (bisected) up to `most` where every class fits; None if even `most` does not.
    Returns the units as arrays and the makespan."""
    last = np.cumsum(sizes) - 1
    kv_last, first = tile_kv[last], last - sizes + 1
    classes = [(g, kv_last[sizes == g].tolist(), first[sizes == g].tolist())
               for g in sorted(set(sizes.tolist()), reverse=True)]
    usable = slots - slots % classes[-1][0]  # the narrowest class's lanes
    least = np.maximum(1, -(-kv_last // (most - ovh)))  # units of a group's last tile, each within `most`
    if usable < 1 or int((sizes * (kv_last + least * ovh)).sum()) > usable * most:
        return None
    lo, hi = -(-int((sizes * (kv_last + ovh)).sum()) // usable), most
    if lo > hi or not _pack_groups_at(classes, slots, hi, ovh, align, min_piece)[1]:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if _pack_groups_at(classes, slots, mid, ovh, align, min_piece)[1]:
            hi = mid
        else:
            lo = mid + 1
    units, _, span = _pack_groups_at(classes, slots, hi, ovh, align, min_piece)
    return tuple(np.array(x, np.int64) for x in zip(*units)), span


def _write_split_units(w, m, n_split, unit_tile, unit_j, kv_start, kv_len, tile_req, tile_qstart, tile_qlen,
                       tile_eoff) -> tuple[int, int]:
    """Fills the work columns w ([WORK_COLS, W] view) with units j of tiles unit_tile (a tile's units
    consecutive, keys [kv_start, kv_start + kv_len), the last open) and the merge columns m with the
    tiles of more than one unit, their partial rows in tile order. Returns the unit count and the
    partial rows used."""
    n_units = unit_tile.size
    u_ns = n_split[unit_tile]
    u_qlen = tile_qlen[unit_tile]
    part_rows = np.where(n_split > 1, n_split * tile_qlen, 0)
    part_base = np.cumsum(part_rows) - part_rows
    w[W_REQUEST, :n_units] = tile_req[unit_tile]
    w[W_QSTART, :n_units] = tile_qstart[unit_tile]
    w[W_QLEN, :n_units] = u_qlen
    w[W_QEND_OFFSET, :n_units] = tile_eoff[unit_tile]
    w[W_KV_START, :n_units] = kv_start
    w[W_KV_END, :n_units] = np.where(unit_j == u_ns - 1, KV_END_OPEN, kv_start + kv_len)
    w[W_PARTIAL_ROW, :n_units] = np.where(u_ns > 1, part_base[unit_tile] + unit_j * u_qlen, -1)
    split_idx = np.flatnonzero(n_split > 1)
    assert split_idx.size <= m.shape[1], "merge bucket overflow"
    m[M_QSTART, : split_idx.size] = tile_qstart[split_idx]
    m[M_QLEN, : split_idx.size] = tile_qlen[split_idx]
    m[M_PARTIAL_ROW, : split_idx.size] = part_base[split_idx]
    m[M_NUM_SPLITS, : split_idx.size] = n_split[split_idx]
    return n_units, int(part_rows.sum())


def plan_mla_numpy(
    qo_lens: Sequence[int] | np.ndarray,
    kv_lens: Sequence[int] | np.ndarray,
    *,
    num_heads: int,
    page_size: int,
    num_tokens: int | None = None,
    max_pages_per_request: int | None = None,
    target: PlanTarget | None = None,
    min_work_units: int = 16,
    min_partial_rows: int = 16,
) -> MLAPlan:
    """`plan_mla` in NumPy: the planner's readable definition, and its path where the native module
    is not built. Same arguments, same plan."""
    qo, kv, target = _prepare(qo_lens, kv_lens, num_heads, page_size, num_tokens, max_pages_per_request,
                              target, check_values=True)
    if (qo > kv).any():
        i = int(np.argmax(qo > kv))
        raise ValueError(f"qo_lens[{i}] = {int(qo[i])} exceeds kv_lens[{i}] = {int(kv[i])} "
                         "(kv lengths include the new tokens)")
    if max_pages_per_request is not None:
        cap = int(max_pages_per_request) * page_size
        if (kv > cap).any():
            i = int(np.argmax(kv > cap))
            raise ValueError(f"kv_lens[{i}] = {int(kv[i])} exceeds the page table's capacity "
                             f"{int(max_pages_per_request)} pages x {page_size} = {cap} tokens")
    qo_end = np.cumsum(qo)
    total_q = int(qo_end[-1]) if qo.size else 0
    if total_q > INT32_MAX:
        raise ValueError(f"sum(qo_lens) = {total_q} query tokens does not fit int32")
    if num_tokens is None:
        num_tokens = total_q
    if num_tokens < total_q:
        raise ValueError(f"num_tokens={num_tokens} is less than sum(qo_lens)={total_q}")

    num_req = qo.size
    q_tile = plan_layout.q_tile(num_heads)
    head_blocks = plan_layout.head_blocks(num_heads)
    max_q = int(qo.max()) if num_req else 0

    # ---- query tiles: ceil(qo / q_tile) per request -----------------------------
    # (The NumPy here is counted in microseconds: it runs before every step. The
    # common decode / verify case, one tile per request, skips the general path.)
    req_tiles = None  # each request's tile count, where some request has several (below: packing)
    hidden = 0  # keys a tile's causal mask hides from it, where ranked as its request (below: "Longest first")
    if max_q <= q_tile:
        if num_req and qo.min() > 0:
            tile_req, tile_qlen, tile_kv = np.arange(num_req), qo, kv
        else:
            tile_req = np.flatnonzero(qo)
            tile_qlen, tile_kv = qo[tile_req], kv[tile_req]
        tile_qstart = qo_end[tile_req] - tile_qlen
        tile_eoff = tile_qlen
    else:
        n_tiles = -(-qo // q_tile)
        req_tiles = n_tiles[n_tiles > 0]
        tile_req = np.repeat(np.arange(num_req), n_tiles)
        tile_first = np.cumsum(n_tiles) - n_tiles
        tile_off = (np.arange(tile_req.size) - tile_first[tile_req]) * q_tile  # token index in request
        tile_qlen = np.minimum(q_tile, qo[tile_req] - tile_off)
        tile_qstart = qo_end[tile_req] - qo[tile_req] + tile_off
        tile_eoff = qo[tile_req] - tile_off
        # Keys the tile's last token sees (causal, aligned to the end).
        behind = tile_eoff - tile_qlen  # the request's tokens after the tile's
        tile_kv = kv[tile_req] - behind
        hidden = behind if max_q <= target.chunk_align else np.where(qo[tile_req] <= target.chunk_align, behind, 0)
    n_t = tile_req.size

    # ---- split sizes ---------------------------------------------------------
    # Fill the slots (units_per_worker * num_workers blocks): start from the
    # chunk that spreads all keys evenly over them, grow it until the unit count
    # sum(ceil(kv / chunk)) fits, then cut every tile into equal parts. (A single
    # batch-wide chunk leaves a short last split per tile and idles SMs.)
    slots = int(target.num_workers * target.units_per_worker) // head_blocks
    ovh = target.overhead_for(num_heads, page_size)  # a unit's fixed cost, in keys
    max_kv = int(tile_kv.max()) if n_t else 0
    align = target.chunk_align
    chunk = 0  # no split
    if slots > n_t and max_kv > target.min_chunk:
        c = -(-(int(tile_kv.sum()) + n_t * ovh) // slots)
        c = -(-max(c, target.min_chunk) // align) * align
        for _ in range(16):
            units = int(np.maximum(1, -(-tile_kv // c)).sum())
            if units <= slots or c >= max_kv:
                break
            c = -(-max(c + align, -(-c * units // slots)) // align) * align
        if c < max_kv and units <= slots:
            chunk = c

    # Buckets from bounds that depend on the batch's tile count and the target
    # only, never on kv lengths, so growing contexts keep every shape:
    #   units <= max(n_t, slots)  (chunk was sized so that sum(ceil(kv/c)) <= slots)
    #   split tiles <= slots - 1 (each split of a packed plan ends a worker's share)
    #   partial rows <= (longest tile) * slots
    # (a packed plan, below, is taken only where it fits them)
    max_qlen = min(max_q, q_tile) if n_t else 1
    n_work = bucket(max(n_t, slots), min_work_units)
    n_merge = bucket(min(n_t, slots - 1) if slots > n_t else 0, min_work_units)
    n_partial = bucket(max_qlen * slots if slots > n_t else 0, min_partial_rows)
    work = np.zeros((n_work, WORK_COLS), np.int32)
    merge = np.zeros((n_merge, MERGE_COLS), np.int32)
    w = work.T  # column views: one strided store per column

    # ---- a ragged batch: pack the keys onto the workers --------------------------
    # Equal parts per tile (above) leave workers idle when lengths differ: the makespan is the longest
    # unit. Packing walks the tiles in order and fills each worker up to one makespan T, cutting a tile
    # where a worker is full (as FlashMLA's scheduler does), so a worker may run several units of
    # different tiles one after another. Blocks start in index order on the SMs that free first, so
    # units are ordered by their start on their worker: a worker's next unit is the next one handed
    # out when it frees. Taken when the cost model says it is clearly shorter and it fits the
    # buckets above (which depend on the tile count only).
    #
    # Where requests have several tiles of few tokens (q_len 2-4 at 64-128 heads: MTP, spec verify), a
    # request's tiles are packed as one: its last tile's keys are cut onto g workers at once (g: its tile
    # count), at the same keys, so the g units that read a piece run side by side and read it from HBM
    # once. Packed one by one, the tiles of a request were cut at different keys and read them at
    # different times (up to thousands of keys apart, more than L2 holds across the workers). Requests of
    # different tile counts (a ragged q_len) pack onto lanes of their own width, widest first, the narrower
    # going on where the wider left off (`_pack_groups_at`). A group's tiles see at most (g - 1) * q_tile
    # keys fewer than its last, less than a cut piece (min_chunk), so each of its units but the last
    # (open-ended) ends within its own tile. Where the groups do not pack well, the tiles are packed one by
    # one.
    packed = None
    if chunk:  # equal parts of each tile, aligned
        n_split = np.maximum(1, -(-tile_kv // chunk))
        tile_chunk = np.maximum(-(-(-(-tile_kv // n_split)) // align) * align, align)
        n_split = np.maximum(1, -(-tile_kv // tile_chunk))
    if slots > n_t and max_kv > target.min_chunk:
        longest_a = int(np.minimum(tile_kv, tile_chunk).max()) if chunk else max_kv
        # The longest span worth packing for; at that span a tile of kv keys is at least
        # ceil(kv / (most - ovh)) units, each with its overhead, which all workers must hold.
        most = (32 * (longest_a + ovh) - 1) // 33
        grouped = req_tiles is not None and (int(req_tiles.max()) - 1) * q_tile < target.min_chunk
        tries = ([req_tiles] if grouped else []) + [np.ones(n_t, np.int64)] if most - ovh >= align else []
        for sizes in tries:
            got = _pack_groups(tile_kv, sizes, slots, ovh, align, target.min_chunk, most)
            if got is None:
                continue
            units_b, span_b = got
            n_split_b = np.bincount(units_b[0], minlength=n_t)
            split_b = n_split_b > 1
            if (33 * span_b < 32 * (longest_a + ovh) and units_b[0].size <= n_work
                    and int(split_b.sum()) <= n_merge and int((n_split_b * tile_qlen)[split_b].sum()) <= n_partial):
                packed = units_b
                break

    if packed is not None:
        u_tile, u_start, u_len, u_t0, u_w, unit_j = packed
        n_units, _ = _write_split_units(w, merge.T, n_split_b, u_tile, unit_j, u_start, u_len, tile_req,
                                        tile_qstart, tile_qlen, tile_eoff)
        w[W_WORKER, :n_units] = u_w
        # By start on the worker (ties: worker order, which is the order _pack made them in).
        work[:n_units] = work[np.argsort(np.minimum(u_t0, INT32_MAX), kind="stable")]
    elif chunk == 0:
        n_units = n_t
        w[W_REQUEST, :n_t] = tile_req
        w[W_QSTART, :n_t] = tile_qstart
        w[W_QLEN, :n_t] = tile_qlen
        w[W_QEND_OFFSET, :n_t] = tile_eoff
        w[W_KV_END, :n_t] = KV_END_OPEN
        w[W_PARTIAL_ROW, :n_t] = -1
        u_cost = tile_kv + hidden  # see "Longest first" below
    else:
        unit_tile = np.repeat(np.arange(n_t), n_split)
        unit_j = np.arange(unit_tile.size) - (np.cumsum(n_split) - n_split)[unit_tile]
        u_chunk = tile_chunk[unit_tile]
        kv_start = unit_j * u_chunk
        n_units, n_rows = _write_split_units(w, merge.T, n_split, unit_tile, unit_j, kv_start, u_chunk, tile_req,
                                             tile_qstart, tile_qlen, tile_eoff)
        u_cost = np.where(unit_j == n_split[unit_tile] - 1,
                          (tile_kv + hidden)[unit_tile] - kv_start, u_chunk)
        assert n_rows <= n_partial, "partial-row bucket overflow"
    if packed is None:
        # Longest first: blocks are dispatched in order, so big units must not trail. Where a request has
        # several tiles but at most one key block of query tokens (q_len 2-64 at 64-128 heads: MTP, spec
        # verify), a tile's last unit is ranked by the keys its request's last token sees there, not its
        # own token's: the request's tiles then tie, and the stable sort keeps them neighbours, so their
        # blocks run together and read the request's keys from HBM once. Ranked by their own keys (one
        # fewer per earlier token) every request's first tiles went to one wave and its last tiles to the
        # next, and each wave read all keys (ffi/cuda/NOTES.md, "forty-second session"). A longer extend
        # keeps its own ranks: its tiles' keys differ by more than a block, and its shortest go last.
        order = np.argsort(-u_cost, kind="stable")
        work[:n_units] = work[order]
        # Their workers (a walk's blocks, plan_layout.h). Where the CUDA kernel walks (plan_layout.walks_units:
        # a multiple of 64 heads, WALK_FROM_ROWS plan rows a worker), each unit in turn to the least loaded
        # slot (ties: the lowest), as waves hand the next block to the SM that frees first: on ragged batches
        # dealing balanced 1-1.3% worse (ffi/cuda/NOTES.md, "forty-fourth session"). Elsewhere no kernel
        # walks, and the slots are dealt back and forth (round k forwards when k is even, backwards when
        # odd), so that the longest of a round goes with the shortest of the last, without a loop over the
        # units.
        g = max(slots, 1)
        if plan_layout.walks_units(num_heads, n_work, g):
            loads = [(0, k) for k in range(g)]  # a heap: (load, slot)
            dealt = []
            for c in (u_cost[order] + ovh).tolist():
                load, k = loads[0]
                dealt.append(k)
                heapq.heapreplace(loads, (load + c, k))
            w[W_WORKER, :n_units] = dealt
        else:
            pos = np.arange(n_units)
            w[W_WORKER, :n_units] = np.where((pos // g) % 2 == 0, pos % g, g - 1 - pos % g)
    assert n_units <= n_work

    tokens = np.empty((num_tokens, 2), np.int32)
    if max_q == 1 and n_t == num_req:
        tokens[:total_q, 0] = tile_req
        tokens[:total_q, 1] = 1
    else:
        tokens[:total_q, 0] = np.repeat(np.arange(num_req), qo)
        tokens[:total_q, 1] = np.repeat(qo_end, qo) - np.arange(total_q)
    tokens[total_q:] = (-1, 0)

    return MLAPlan(work=work, merge=merge, tokens=tokens, num_tokens=int(num_tokens),
                   num_heads=int(num_heads), page_size=int(page_size), num_requests=int(num_req),
                   q_tile=q_tile, num_partial_rows=n_partial)
