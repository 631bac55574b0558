"""Several devices: the mesh axes, one plan per shard, and context-parallel attention.

The op itself is single-device; these pieces let it run under `jax.shard_map`:

* ``make_mesh(data, tensor)``: a `jax.sharding.Mesh` with the two axes the rest of
  jax_mla uses, ``"data"`` (each shard owns its requests and its own paged cache:
  DP attention) and ``"tensor"`` (heads split over devices, the latent cache
  replicated: MLA's cache has no head axis).
* ``stack_plans``: per-shard plans padded to common buckets and stacked on a
  leading axis, so every shard of a `shard_map` sees the same static shapes.
  Inside the map, ``local_plan`` drops the leading axis.
* Context parallelism (one long request's keys spread over the devices of an
  axis): logical page j of a request lives on shard ``j % C`` at column ``j // C``
  of that shard's page-table row (round robin: every shard holds an equal share
  of a long context, and the newest page moves from shard to shard). Each shard
  attends its keys with its own plan and returns out + LSE; ``merge_over_axis``
  combines them exactly (the split-kv merge, over devices). Decode only: a query
  with offset e from its request's end must see the first ``L - e`` global
  positions, which on a shard is not ``L_local - e`` unless e = 1.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .planner import MLAPlan

try:  # jax >= 0.7
    from jax import shard_map
except ImportError:  # pragma: no cover
    from jax.experimental.shard_map import shard_map

__all__ = ["DATA", "TENSOR", "make_mesh", "mesh_sizes", "stack_plans", "local_plan", "on_data_shards", "shard_map",
           "context_parallel_lengths", "context_parallel_page_tables", "merge_over_axis",
           "context_parallel_attention"]

DATA = "data"
TENSOR = "tensor"


def make_mesh(data: int = 1, tensor: int = 1, devices: Sequence | None = None) -> jax.sharding.Mesh:
    """A (data, tensor) mesh over the first data * tensor devices (default: jax.devices())."""
    for name, v in (("data", data), ("tensor", tensor)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    devices = list(jax.devices() if devices is None else devices)
    n = int(data) * int(tensor)
    if n > len(devices):
        raise ValueError(f"a mesh of data={data} x tensor={tensor} needs {n} devices, {len(devices)} available")
    return jax.sharding.Mesh(np.array(devices[:n]).reshape(int(data), int(tensor)), (DATA, TENSOR))


def mesh_sizes(mesh: jax.sharding.Mesh) -> tuple[int, int]:
    """(data, tensor) sizes of a mesh that has both axes (a ValueError names what is missing)."""
    missing = [a for a in (DATA, TENSOR) if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"the mesh needs axes {DATA!r} and {TENSOR!r}; it has {mesh.axis_names} "
                         "(jax_mla.parallel.make_mesh makes one)")
    return int(mesh.shape[DATA]), int(mesh.shape[TENSOR])


def stack_plans(plans: Sequence[MLAPlan]) -> MLAPlan:
    """One plan per shard, stacked: leaves [S, ...], work/merge padded to the largest bucket.

    Padding rows are zeros (units with no query rows, merges of nothing), which every backend skips,
    exactly like the planner's own bucket padding. The shards must agree on the static facts that
    fix the op's shapes (tokens, heads, page size, requests); the partial-row workspace takes the
    largest.
    """
    plans = list(plans)
    if not plans:
        raise ValueError("stack_plans needs at least one plan")
    first = plans[0]
    for i, p in enumerate(plans[1:], 1):
        for f in ("num_tokens", "num_heads", "page_size", "num_requests", "q_tile"):
            if getattr(p, f) != getattr(first, f):
                raise ValueError(f"plan {i} has {f}={getattr(p, f)} but plan 0 has {getattr(first, f)}; "
                                 "plan every shard with the same num_tokens, heads and slots")

    def stacked(name):
        arrays = [np.asarray(getattr(p, name)) for p in plans]
        rows = max(a.shape[0] for a in arrays)
        out = np.zeros((len(arrays), rows) + arrays[0].shape[1:], np.int32)
        for i, a in enumerate(arrays):
            out[i, : a.shape[0]] = a
        return out

    return MLAPlan._make(stacked("work"), stacked("merge"), np.stack([np.asarray(p.tokens) for p in plans]),
                         first.num_tokens, first.num_heads, first.page_size, first.num_requests, first.q_tile,
                         max(p.num_partial_rows for p in plans))


def on_data_shards(fn, mesh: jax.sharding.Mesh | None, *args):
    """fn on each data shard's part of args (every arg split over ``"data"`` on its leading axis,
    replicated over the other axes), the results split the same way: per-shard bookkeeping
    (gathers and scatters by shard-local index) with no communication. Without a mesh, fn(*args)
    on the arrays with a leading axis of size 1 where they are stacked per shard."""
    if mesh is None:
        return fn(*args)
    from jax.sharding import PartitionSpec as P

    return shard_map(fn, mesh=mesh, in_specs=P(DATA), out_specs=P(DATA))(*args)


def local_plan(plan: MLAPlan) -> MLAPlan:
    """Inside a shard_map over a stacked plan: this shard's plan (the leading axis, of size 1, dropped)."""
    return jax.tree.map(lambda x: x[0], plan)


# ---- context parallelism ---------------------------------------------------------------
def context_parallel_lengths(kv_lens, page_size: int, num_shards: int, shard):
    """Tokens of each request that shard `shard` holds when logical page j lives on shard j % C.

    Works on NumPy (host lengths, for planning) and on jax arrays (device lengths, inside the step;
    `shard` may be `jax.lax.axis_index`). A request of L tokens has n = ceil(L / page_size) pages;
    the shard holds pages shard, shard + C, ... < n, all full except the last page overall.
    """
    xp = jnp if isinstance(kv_lens, jax.Array) or isinstance(shard, jax.Array) else np
    lens = xp.asarray(kv_lens)
    n_pages = (lens + page_size - 1) // page_size
    held = xp.maximum(n_pages - shard + num_shards - 1, 0) // num_shards
    owns_last = (n_pages > 0) & ((n_pages - 1) % num_shards == shard)
    return (held * page_size - xp.where(owns_last, n_pages * page_size - lens, 0)).astype(lens.dtype)


def context_parallel_page_tables(page_table, num_shards: int, pages_per_shard: int | None = None) -> np.ndarray:
    """Host: a table of each request's logical pages [R, max_pages] -> per-shard tables
    [C, R, ceil(max_pages / C)]: column k of shard d is logical page k * C + d (-1 past the row).

    pages_per_shard: when the cache is one array [C * P, ...] split over the axis (shard d holds
    pages d*P .. (d+1)*P), give P: ids become local to their shard, and a page held by another
    shard than its logical position's raises a ValueError.
    """
    pt = np.asarray(page_table)
    if pt.ndim != 2:
        raise ValueError(f"page_table must be [requests, max_pages], got shape {pt.shape}")
    if isinstance(num_shards, (bool, np.bool_)) or not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
    r, m = pt.shape
    cols = -(-m // num_shards)
    padded = np.full((r, cols * num_shards), -1, np.int32)
    padded[:, :m] = pt
    tables = np.ascontiguousarray(padded.reshape(r, cols, num_shards).transpose(2, 0, 1))
    if pages_per_shard is not None:
        shard = np.arange(num_shards)[:, None, None]
        held = tables >= 0
        wrong = held & (tables // pages_per_shard != shard)
        if wrong.any():
            d, req, k = (int(i[0]) for i in np.nonzero(wrong))
            raise ValueError(f"request {req}'s logical page {k * num_shards + d} is page {int(tables[d, req, k])}, "
                             f"which shard {int(tables[d, req, k]) // pages_per_shard} holds, not shard {d} "
                             f"(pages_per_shard={pages_per_shard})")
        tables = np.where(held, tables - shard * pages_per_shard, -1).astype(np.int32)
    return tables


def merge_over_axis(out: jax.Array, lse: jax.Array, axis_name) -> tuple[jax.Array, jax.Array]:
    """Exact merge of partial attention over the devices of `axis_name` (inside a shard_map).

    out [T, H, d], lse [T, H] (natural log, -inf where a shard saw no key) of each shard's keys ->
    the attention over the union: lse = log sum_d exp(lse_d), out = sum_d exp(lse_d - lse) out_d.
    Rows no shard saw give 0 and -inf; NaN stays NaN.
    """
    m = jax.lax.pmax(lse, axis_name)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m_safe)  # 0 for a shard that saw nothing
    total = jax.lax.psum(w, axis_name)
    o = jax.lax.psum(out.astype(jnp.float32) * w[..., None], axis_name)
    safe_total = jnp.where(total > 0, total, 1.0)
    o = o / safe_total[..., None]
    lse_all = jnp.where(total > 0, m_safe + jnp.log(safe_total), -jnp.inf)
    lse_all = jnp.where(jnp.isnan(m), m, lse_all)
    return o.astype(out.dtype), lse_all


def context_parallel_attention(q_nope, q_pe, ckv, kpe, page_table, kv_lens, plan: MLAPlan, *, axis_name,
                               sm_scale: float, return_lse: bool = False, backend: str = "auto",
                               ckv_scale=None, kpe_scale=None):
    """Decode attention over keys spread round robin over `axis_name` (call inside a shard_map).

    Each shard passes its own cache pages, its page-table rows (`context_parallel_page_tables`), its
    local kv lengths (`context_parallel_lengths`) and its own plan made from those lengths; queries
    are replicated over the axis. The result (replicated) equals `mla_paged_attention` over the
    whole context. Query tokens must be decode tokens (one per request).
    """
    from .attention import mla_paged_attention

    out, lse = mla_paged_attention(q_nope, q_pe, ckv, kpe, page_table, kv_lens, plan, sm_scale=sm_scale,
                                   return_lse=True, backend=backend, ckv_scale=ckv_scale, kpe_scale=kpe_scale)
    out, lse = merge_over_axis(out, lse, axis_name)
    return (out, lse) if return_lse else out


# ---- data-parallel paging ----------------------------------------------------------------
class ShardedCacheManager:
    """One `PagedCacheManager` per shard of the mesh's ``"data"`` axis, behind global slot numbers.

    Each data shard owns its requests, its page pool and its page-table rows (DP attention: no
    cache is duplicated over ``"data"``; it is replicated over ``"tensor"``). Global slot
    ``s = d * slots_per_shard + j`` is slot j of shard d; host arrays over slots (lengths, query
    counts) are the shards' arrays back to back. Device arrays are global arrays sharded on their
    leading axis over ``"data"``: the page table [D * R, max_pages], each cache [D * P, page_size, d]
    (page ids in a shard's table are local to its P pages), plans stacked [D, ...]
    (`stack_plans`). They are placed once; a step sends each shard only its own changes.

    `admit` puts each prompt on the shard with the fewest requests (then the most free pages).
    """

    def __init__(self, mesh: jax.sharding.Mesh, *, num_pages: int, page_size: int, max_requests: int,
                 max_pages_per_request: int, target=None):
        from .paging import PagedCacheManager
        from jax.sharding import NamedSharding, PartitionSpec as P

        self.mesh = mesh
        self.num_shards, _ = mesh_sizes(mesh)
        dev = mesh.devices.reshape(self.num_shards, -1)[:, 0]
        self.shards = [PagedCacheManager(num_pages=num_pages, page_size=page_size, max_requests=max_requests,
                                         max_pages_per_request=max_pages_per_request, target=target,
                                         device=dev[d]) for d in range(self.num_shards)]
        first = self.shards[0]
        self.page_size = first.page_size
        self.slots_per_shard = first.max_requests
        self.pages_per_shard = first.num_pages
        self.max_requests = self.num_shards * self.slots_per_shard
        self.max_pages_per_request = first.max_pages_per_request
        self.target = first.target
        self.sharded = NamedSharding(mesh, P(DATA))  # leading axis over data, replicated over tensor
        self.replicated = NamedSharding(mesh, P())
        self.device_page_table = jax.device_put(
            np.concatenate([s.page_table for s in self.shards]), self.sharded)
        self.entries_sent = 0
        self.last_sync_entries = 0
        self._last_split = None

        def set_entries(table, rows, cols, vals):
            return table.at[rows[0], cols[0]].set(vals[0], mode="drop", unique_indices=True)

        self._set_entries = jax.jit(shard_map(set_entries, mesh=mesh, in_specs=(P(DATA),) * 4,
                                              out_specs=P(DATA)), donate_argnums=0)

    @classmethod
    def like(cls, manager, mesh: jax.sharding.Mesh) -> "ShardedCacheManager":
        """A sharded manager whose every shard has `manager`'s sizes and target (manager holds no request)."""
        if manager.active.any():
            raise ValueError("the manager to copy holds requests; pass a fresh PagedCacheManager")
        return cls(mesh, num_pages=manager.num_pages, page_size=manager.page_size,
                   max_requests=manager.max_requests, max_pages_per_request=manager.max_pages_per_request,
                   target=manager.target)

    # ---- global views ---------------------------------------------------------------------
    @property
    def lengths(self) -> np.ndarray:
        return np.concatenate([s.lengths for s in self.shards])

    @property
    def active(self) -> np.ndarray:
        return np.concatenate([s.active for s in self.shards])

    @property
    def active_slots(self) -> np.ndarray:
        return np.nonzero(self.active)[0]

    @property
    def num_free_pages(self) -> int:
        return sum(s.num_free_pages for s in self.shards)

    @property
    def capacity_per_request(self) -> int:
        return self.shards[0].capacity_per_request

    @property
    def pending_entries(self) -> int:
        return sum(s.pending_entries for s in self.shards)

    def _split(self, slots) -> dict[int, np.ndarray]:
        """Global slots -> {shard: local slots}, ValueError for a slot out of range. The last answer
        is kept: a decode loop passes the same slots every step."""
        a = np.asarray(slots)
        key = (a.dtype.str, a.shape, a.tobytes())
        if self._last_split is not None and self._last_split[0] == key:
            return self._last_split[1]
        from .paging import slot_array

        a = slot_array(slots, self.max_requests)
        shard = a // self.slots_per_shard
        groups = {int(d): a[shard == d] - d * self.slots_per_shard for d in np.unique(shard)}
        self._last_split = (key, groups)
        return groups

    def _groups(self, slots, new_tokens):
        """[(shard, local slots, their token counts)] for global slots and counts (one, or one each)."""
        slots = np.asarray(slots).reshape(-1)
        groups = self._split(slots)
        if np.ndim(new_tokens) == 0:
            return [(d, local, new_tokens) for d, local in groups.items()]
        counts = np.broadcast_to(np.asarray(new_tokens), slots.shape)
        shard_of = slots.astype(np.int64) // self.slots_per_shard
        return [(d, local, counts[shard_of == d]) for d, local in groups.items()]

    # ---- requests ---------------------------------------------------------------------------
    def admit(self, prompt_lens: Sequence[int]) -> list[int]:
        """Slots (global) and pages for each prompt, spread over the shards; all or nothing."""
        from .paging import OutOfPagesError, OutOfSlotsError

        lens = np.asarray(prompt_lens, np.int64).reshape(-1)
        free_slots = [len(s._free_slots) for s in self.shards]
        free_pages = [s.num_free_pages for s in self.shards]
        busy = [int(s.active.sum()) for s in self.shards]
        where = []
        for n in lens:
            pages = -(-max(int(n), 0) // self.page_size)
            ok = [d for d in range(self.num_shards) if free_slots[d] > 0 and free_pages[d] >= pages]
            if not ok:
                if not any(free_slots):
                    raise OutOfSlotsError(f"{lens.size} requests to admit but the {self.num_shards} shards' "
                                          f"slots run out")
                raise OutOfPagesError(f"no shard has {pages} free pages for a {int(n)}-token prompt "
                                      f"(free pages per shard: {free_pages})")
            d = min(ok, key=lambda d: (busy[d], -free_pages[d]))
            where.append(d)
            free_slots[d] -= 1
            free_pages[d] -= pages
            busy[d] += 1
        where = np.asarray(where, np.int64)
        slots = np.zeros(lens.size, np.int64)
        done = []
        try:
            for d in np.unique(where):
                pick = np.nonzero(where == d)[0]
                local = self.shards[d].admit(lens[pick])
                done.append((d, local))
                slots[pick] = np.asarray(local) + d * self.slots_per_shard
        except Exception:
            for d, local in done:
                for s in local:
                    self.shards[d].finish(s)
            raise
        return [int(s) for s in slots]

    def reserve(self, slots: Sequence[int], new_tokens) -> None:
        """Pages for `new_tokens` more tokens per slot; all or nothing over every shard."""
        from .paging import OutOfPagesError

        groups = self._groups(slots, new_tokens)
        ps = self.page_size
        if all(np.all((self.shards[d].lengths[local] + n <= self.shards[d].pages_held[local] * ps)
                      & self.shards[d].active[local] & (np.asarray(n) >= 0)) for d, local, n in groups):
            return  # every slot holds a request and has its pages already (most decode steps)
        for d, local, n in groups:
            shard = self.shards[d]
            n = np.broadcast_to(np.asarray(n, np.int64), local.shape)
            shard._slots(local)  # idle or out-of-range slots raise here, before any change
            over = np.nonzero(shard.lengths[local] + n > shard.capacity_per_request)[0]
            if over.size:
                s = int(local[over[0]]) + d * self.slots_per_shard
                raise ValueError(f"slot {s} would hold {int(shard.lengths[local[over[0]]] + n[over[0]])} tokens; "
                                 f"a request holds at most {shard.capacity_per_request}")
            need = int(shard.pages_needed(local, n).sum())
            if need > shard.num_free_pages:
                raise OutOfPagesError(f"shard {d} needs {need} more pages but {shard.num_free_pages} of "
                                      f"{shard.num_pages} are free")
        for d, local, n in groups:
            self.shards[d].reserve(local, n)

    def commit(self, slots: Sequence[int], new_tokens) -> None:
        for d, local, n in self._groups(slots, new_tokens):
            self.shards[d].commit(local, n)

    def finish(self, slot: int) -> None:
        if isinstance(slot, (bool, np.bool_)) or not isinstance(slot, (int, np.integer)):
            raise ValueError(f"slot must be an int, got {slot!r}")
        ((d, local),) = self._split([slot]).items()
        self.shards[d].finish(int(local[0]))

    # ---- device -----------------------------------------------------------------------------
    def sync(self) -> jax.Array:
        """Send every shard's pending page-table changes to its rows of the device table, in place."""
        n = [s.pending_entries for s in self.shards]
        self.last_sync_entries = 0
        if any(n):
            from .planner import bucket

            size = bucket(max(n), 8)
            rows, cols, vals = (np.stack(x) for x in zip(*(s.take_pending(size) for s in self.shards)))
            rows, cols, vals = jax.device_put((rows, cols, vals), self.sharded)
            self.device_page_table = self._set_entries(self.device_page_table, rows, cols, vals)
            self.entries_sent += sum(n)
            self.last_sync_entries = rows.size
        return self.device_page_table

    def plan(self, qo_lens: np.ndarray, kv_lens: np.ndarray, *, num_heads: int, num_tokens: int) -> MLAPlan:
        """Each shard's plan over its slots (num_tokens rows each, `num_heads` local heads), stacked."""
        r = self.slots_per_shard
        qo = np.asarray(qo_lens).reshape(self.num_shards, r)
        kv = np.asarray(kv_lens).reshape(self.num_shards, r)
        return stack_plans([s.plan(qo[d], kv[d], num_heads=num_heads, num_tokens=num_tokens)
                            for d, s in enumerate(self.shards)])

    def init_caches(self, num_layers: int, kv_lora_rank: int, rope_dim: int, dtype=jnp.float32, *,
                    kpe_dtype=None, ckv_scale: float = 1.0, kpe_scale: float = 1.0):
        """`PagedCacheManager.init_caches`, each buffer [D * P, page_size, d] sharded over data
        (scales replicated): every shard's pages are made on its own devices."""
        like = self.shards[0].init_caches(1, 1, 1, dtype, kpe_dtype=kpe_dtype, ckv_scale=ckv_scale,
                                          kpe_scale=kpe_scale)[0]  # validates, gives dtypes and scales
        shape = (self.num_shards * self.pages_per_shard, self.page_size)

        def zeros(d, dt):
            return jax.jit(lambda: jnp.zeros(shape + (d,), dt), out_shardings=self.sharded)()

        def scale(s):
            return None if s is None else jax.device_put(np.asarray(s), self.replicated)

        return tuple(type(like)(zeros(kv_lora_rank, like.ckv.dtype), zeros(rope_dim, like.kpe.dtype),
                                scale(like.ckv_scale), scale(like.kpe_scale))
                     for _ in range(num_layers))
