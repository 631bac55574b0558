"""Host paging: the paged latent cache's bookkeeping (pages, request slots, lengths, plans) and the
device-side views a model layer takes (`PagedKV`, `PagedBatch`). Needs no flax.

Everything here is NumPy on the host: the decode loop never reads the device to
learn a length. The device page table is created once and afterwards changed
only entry by entry (a jitted scatter into the donated table), so a step sends
the device a few changed entries, not the table.

Request slots are the rows of the page table (and of kv_lens); every plan covers
all `max_requests` slots, idle ones with zero tokens, so a plan's request index
is the slot.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .plan_layout import visible_keys
from .planner import MLAPlan, PlanTarget, SUPPORTED_PAGE_SIZES, bucket, default_target, plan_mla
from .quant import is_fp8

__all__ = ["OutOfPagesError", "OutOfSlotsError", "PagedCacheManager", "PagedKV", "PagedBatch", "token_positions",
           "bucket", "page_table_from_indptr"]

class PagedKV(NamedTuple):
    """One layer's latent cache: ckv [P, page_size, kv_lora_rank], kpe [P, page_size, rope_dim], and for
    a float8_e4m3fn tensor its float32 scale [1] (value = fp8 x scale; None for other dtypes)."""

    ckv: jax.Array
    kpe: jax.Array
    ckv_scale: jax.Array | None = None
    kpe_scale: jax.Array | None = None


class PagedBatch(NamedTuple):
    """Where this step's tokens sit: shared by every layer.

    page_table [R, max_pages] int32 and kv_lens [R] int32 live on the device
    (kv_lens include this step's tokens); plan comes from `plan_mla` on host lengths.
    """

    page_table: jax.Array
    kv_lens: jax.Array
    plan: MLAPlan


def token_positions(batch: PagedBatch) -> jax.Array:
    """Position of each query token in its sequence, read from the device kv lengths.

    The token with offset e from the end of its request's block sits at
    kv_len - e; padding tokens get 0 (their results are dropped).
    """
    capacity = batch.page_table.shape[1] * batch.plan.page_size
    _, n_vis = visible_keys(jnp.asarray(batch.plan.tokens), batch.kv_lens, capacity)
    return jnp.maximum(n_vis - 1, 0)


NO_PAGE = -1  # unallocated page-table entry: cache writes there are dropped, reads masked


class OutOfPagesError(RuntimeError):
    """Not enough free pages; raised before anything changed."""


class OutOfSlotsError(RuntimeError):
    """No free request slot; raised before anything changed."""


@functools.partial(jax.jit, donate_argnums=0)
def _set_entries(table, rows, cols, values):
    # Padding entries carry row = table.shape[0] and are dropped.
    return table.at[rows, cols].set(values, mode="drop", unique_indices=True)


def slot_array(slots, num_slots: int) -> np.ndarray:
    """slots as a 1-D int64 array of integers in [0, num_slots), or a ValueError naming the bad one."""
    a = np.asarray(slots)
    if a.size and a.dtype.kind not in "iu":
        raise ValueError(f"slots must be integers, got {slots!r}")
    a = a.astype(np.int64).reshape(-1)
    bad = np.nonzero((a < 0) | (a >= num_slots))[0]
    if bad.size:
        raise ValueError(f"slot {int(a[bad[0]])} is not in [0, {num_slots})")
    return a


def page_table_from_indptr(kv_indptr, kv_indices, max_pages: int | None = None, pad: int = 0) -> np.ndarray:
    """A dense page table [requests, max_pages] (int32, the op's layout) from FlashInfer's CSR one.

    FlashInfer's paged wrappers take request r's pages as kv_indices[kv_indptr[r]:kv_indptr[r + 1]]; the op
    takes them as row r of a dense table (vLLM's block table). Entries past a request's pages are `pad` (never
    read: the op reads only the pages of a request's length). max_pages: the table's width (default: the most
    pages any request has; a fixed width keeps a jitted step's shapes fixed). NumPy, on the host. With
    qo_lens = np.diff(qo_indptr) and FlashInfer's kv_len_arr as kv_lens, a FlashInfer MLA call's operands are
    the op's (q_nope, q_pe, ckv, kpe: the same shapes).
    """
    indptr = np.asarray(kv_indptr)
    indices = np.asarray(kv_indices)
    if indptr.ndim != 1 or indptr.size < 1 or indptr.dtype.kind not in "iu":
        raise ValueError(f"kv_indptr must be a 1-D integer array of requests + 1 offsets, got shape {indptr.shape} "
                         f"{indptr.dtype}")
    if indices.ndim != 1 or (indices.size and indices.dtype.kind not in "iu"):
        raise ValueError(f"kv_indices must be a 1-D integer array of page ids, got shape {indices.shape} "
                         f"{indices.dtype}")
    indptr = indptr.astype(np.int64)
    counts = np.diff(indptr)
    if indptr[0] != 0 or (counts < 0).any() or indptr[-1] > indices.size:
        raise ValueError(f"kv_indptr must rise from 0 to at most len(kv_indices) = {indices.size}, got "
                         f"{indptr.tolist() if indptr.size <= 16 else indptr}")
    used = indices[:int(indptr[-1])].astype(np.int64)
    int32 = np.iinfo(np.int32)
    outside = (used < int32.min) | (used > int32.max)
    if outside.any():
        raise ValueError(f"kv_indices holds page id {int(used[outside][0])}, outside int32 (the page table's type)")
    most = int(counts.max()) if counts.size else 0
    width = most if max_pages is None else int(max_pages)
    if width < most:
        raise ValueError(f"max_pages={max_pages} is less than the {most} pages request {int(counts.argmax())} has")
    table = np.full((counts.size, width), pad, np.int32)
    if counts.size and most:
        rows = np.repeat(np.arange(counts.size), counts)
        cols = np.arange(int(indptr[-1])) - np.repeat(indptr[:-1], counts)
        table[rows, cols] = used
    return table


class PagedCacheManager:
    """Page allocator, per-request page tables and lengths, and the device page table.

    Lifecycle of a request: `admit` (slot + pages for its prompt) -> prefill step
    -> `commit` -> per decode step `reserve` + plan + step + `commit` ... ->
    `finish` (pages back to the free list). `sync` pushes pending page-table
    changes to the device; `plan` makes the step's MLAPlan from host lengths.
    """

    def __init__(self, *, num_pages: int, page_size: int, max_requests: int, max_pages_per_request: int,
                 target: PlanTarget | None = None, device=None):
        if page_size not in SUPPORTED_PAGE_SIZES:
            raise ValueError(f"page_size={page_size!r} is not supported; use one of {SUPPORTED_PAGE_SIZES}")
        for name, v in (("num_pages", num_pages), ("max_requests", max_requests),
                        ("max_pages_per_request", max_pages_per_request)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.max_requests = int(max_requests)
        self.max_pages_per_request = int(max_pages_per_request)
        self.target = target if target is not None else default_target(device)
        # Pop from the end: page 0 is handed out first.
        self._free_pages: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._free_slots: list[int] = list(range(self.max_requests - 1, -1, -1))
        self.page_table = np.full((self.max_requests, self.max_pages_per_request), NO_PAGE, np.int32)
        self.pages_held = np.zeros(self.max_requests, np.int64)
        self.lengths = np.zeros(self.max_requests, np.int64)  # tokens stored in the cache
        self.active = np.zeros(self.max_requests, bool)
        self._pending: dict[tuple[int, int], int] = {}
        self.device_page_table = jax.device_put(self.page_table, device)
        self.entries_sent = 0  # page-table entries sent to the device so far (after creation)
        self.last_sync_entries = 0  # entries (with padding) the last `sync` sent

    # ---- queries ------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def active_slots(self) -> np.ndarray:
        return np.nonzero(self.active)[0]

    @property
    def capacity_per_request(self) -> int:
        return self.max_pages_per_request * self.page_size

    # ---- argument checks (every public method; nothing changes before they pass) ----
    def _slots(self, slots, *, active: bool = True) -> np.ndarray:
        """Slots as a 1-D int64 array: integers in [0, max_requests), holding a request if `active`."""
        a = slot_array(slots, self.max_requests)
        if active:
            idle = np.nonzero(~self.active[a])[0]
            if idle.size:
                raise ValueError(f"slot {int(a[idle[0]])} holds no request")
        return a

    @staticmethod
    def _counts(new_tokens, shape) -> np.ndarray:
        """Token counts broadcast to `shape`: non-negative integers."""
        a = np.asarray(new_tokens)
        if a.size and a.dtype.kind not in "iu":
            raise ValueError(f"new_tokens must be integers, got {new_tokens!r}")
        a = np.broadcast_to(a.astype(np.int64), shape)
        if a.size and a.min() < 0:
            raise ValueError(f"new_tokens must be >= 0, got {int(a.min())}")
        return a

    def pages_needed(self, slots: Sequence[int], new_tokens: Sequence[int] | int) -> np.ndarray:
        """Extra pages each slot needs to hold `new_tokens` more tokens."""
        slots = self._slots(slots, active=False)
        want = self.lengths[slots] + self._counts(new_tokens, slots.shape)
        return np.maximum(-(-want // self.page_size) - self.pages_held[slots], 0)

    # ---- requests -----------------------------------------------------------
    def admit(self, prompt_lens: Sequence[int]) -> list[int]:
        """Take a slot and pages for each prompt; all or nothing.

        Raises OutOfSlotsError / OutOfPagesError / ValueError (a prompt longer
        than a request's page-table row) with every structure unchanged.
        """
        lens = np.asarray(prompt_lens, np.int64).reshape(-1)
        if lens.size and lens.min() < 1:
            raise ValueError(f"prompt lengths must be >= 1, got {lens.tolist()}")
        too_long = np.nonzero(lens > self.capacity_per_request)[0]
        if too_long.size:
            i = int(too_long[0])
            raise ValueError(f"prompt {i} has {int(lens[i])} tokens; a request holds at most "
                             f"{self.max_pages_per_request} pages x {self.page_size} = {self.capacity_per_request}")
        if lens.size > len(self._free_slots):
            raise OutOfSlotsError(f"{lens.size} requests to admit but only {len(self._free_slots)} of "
                                  f"{self.max_requests} slots are free")
        need = int((-(-lens // self.page_size)).sum())
        if need > len(self._free_pages):
            raise OutOfPagesError(f"admitting {lens.size} prompts ({int(lens.sum())} tokens) needs {need} pages "
                                  f"but {len(self._free_pages)} of {self.num_pages} are free")
        slots = [self._free_slots.pop() for _ in range(lens.size)]
        for s in slots:
            self.active[s] = True
            self.lengths[s] = 0
        self._allocate(slots, lens)
        return slots

    def reserve(self, slots: Sequence[int], new_tokens: Sequence[int] | int) -> None:
        """Make sure each slot has pages for `new_tokens` more tokens (e.g. the next N decode steps).

        All or nothing: OutOfPagesError (not enough free pages in all) or
        ValueError (a request would outgrow its page-table row) leave every
        structure unchanged.
        """
        if self._holds_pages_for(slots, new_tokens):
            return  # most decode steps
        slots = self._slots(slots)
        new = self._counts(new_tokens, slots.shape)
        want = self.lengths[slots] + new
        over = np.nonzero(want > self.capacity_per_request)[0]
        if over.size:
            i = int(over[0])
            raise ValueError(f"slot {int(slots[i])} would hold {int(want[i])} tokens; a request holds at most "
                             f"{self.capacity_per_request}")
        per_slot = self.pages_needed(slots, new)
        need = int(per_slot.sum())
        if need > len(self._free_pages):
            raise OutOfPagesError(f"{need} more pages needed for {len(slots)} requests but "
                                  f"{len(self._free_pages)} of {self.num_pages} are free")
        grow = per_slot > 0  # most decode steps: none, and nothing below runs
        if grow.any():
            self._allocate(slots[grow].tolist(), want[grow])

    def _holds_pages_for(self, slots, new_tokens) -> bool:
        """The decode loop's fast path: slots is an int array of active slots and each already has
        pages for new_tokens (a non-negative int) more tokens. False sends the caller through the
        full checks (which also raise for bad arguments)."""
        if (type(slots) is not np.ndarray or slots.dtype.kind not in "iu" or slots.ndim != 1 or not slots.size
                or isinstance(new_tokens, (bool, np.bool_)) or not isinstance(new_tokens, (int, np.integer))
                or new_tokens < 0 or slots.min() < 0 or slots.max() >= self.max_requests):
            return False
        return bool(self.active[slots].all()
                    and (self.lengths[slots] + new_tokens <= self.pages_held[slots] * self.page_size).all())

    def commit(self, slots: Sequence[int], new_tokens: Sequence[int] | int) -> None:
        """Record that `new_tokens` tokens were written for each slot (after the step ran)."""
        if self._holds_pages_for(slots, new_tokens):
            self.lengths[slots] += new_tokens
            return
        slots = self._slots(slots)
        want = self.lengths[slots] + self._counts(new_tokens, slots.shape)
        short = np.nonzero(want > self.pages_held[slots] * self.page_size)[0]
        if short.size:
            s = int(slots[short[0]])
            raise ValueError(f"slot {s} would hold {int(want[short[0]])} tokens but has pages for "
                             f"{int(self.pages_held[s] * self.page_size)}; reserve first")
        self.lengths[slots] = want

    def finish(self, slot: int) -> None:
        """Release a request: its pages go back to the free list and its row is cleared."""
        if isinstance(slot, (bool, np.bool_)) or not isinstance(slot, (int, np.integer)):
            raise ValueError(f"slot must be an int, got {slot!r}")
        slot = int(self._slots([slot])[0])
        n = int(self.pages_held[slot])
        # Give pages back in reverse so the next request reuses them in order.
        self._free_pages.extend(int(p) for p in self.page_table[slot, :n][::-1])
        for j in range(n):
            self._set(slot, j, NO_PAGE)
        self.pages_held[slot] = 0
        self.lengths[slot] = 0
        self.active[slot] = False
        self._free_slots.append(slot)

    def _allocate(self, slots, want_tokens) -> None:
        # Callers checked that enough pages are free.
        want_pages = -(-np.asarray(want_tokens, np.int64) // self.page_size)
        for s, w in zip(slots, want_pages):
            for j in range(int(self.pages_held[s]), int(w)):
                self._set(s, j, self._free_pages.pop())
            self.pages_held[s] = max(int(self.pages_held[s]), int(w))

    def _set(self, row: int, col: int, page: int) -> None:
        self.page_table[row, col] = page
        self._pending[(row, col)] = page

    # ---- device -------------------------------------------------------------
    @property
    def pending_entries(self) -> int:
        return len(self._pending)

    def sync(self) -> jax.Array:
        """Send pending page-table changes to the device table, in place; return the table.

        Sends only the changed entries (padded to a power of two so the scatter
        compiles once per size class); no call at all when nothing changed.
        """
        self.last_sync_entries = 0
        if self._pending:
            n = len(self._pending)
            rows, cols, vals = self.take_pending(bucket(n, 8))
            self.device_page_table = _set_entries(self.device_page_table, rows, cols, vals)
            self.entries_sent += n
            self.last_sync_entries = rows.size
        return self.device_page_table

    def take_pending(self, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The pending page-table changes as (rows, cols, values) int32 arrays of `size` entries, and
        forget them. Entries past the pending ones have row = max_requests (out of range: a scatter
        with mode='drop' skips them)."""
        n = len(self._pending)
        if size < n:
            raise ValueError(f"size={size} is less than the {n} pending entries")
        rows = np.full(size, self.max_requests, np.int32)
        cols = np.zeros(size, np.int32)
        vals = np.zeros(size, np.int32)
        keys = list(self._pending)
        rows[:n] = [k[0] for k in keys]
        cols[:n] = [k[1] for k in keys]
        vals[:n] = list(self._pending.values())
        self._pending.clear()
        return rows, cols, vals

    # ---- plans ----------------------------------------------------------------
    def plan(self, qo_lens: np.ndarray, kv_lens: np.ndarray, *, num_heads: int, num_tokens: int) -> MLAPlan:
        """plan_mla over all slots, for this manager's page size, table width and target."""
        return plan_mla(qo_lens, kv_lens, num_heads=num_heads, page_size=self.page_size, num_tokens=num_tokens,
                        max_pages_per_request=self.max_pages_per_request, target=self.target)

    def init_caches(self, num_layers: int, kv_lora_rank: int, rope_dim: int, dtype=jnp.float32, device=None, *,
                    kpe_dtype=None, ckv_scale: float = 1.0, kpe_scale: float = 1.0):
        """Zeroed per-layer `PagedKV` page buffers, shapes [num_pages, page_size, d].

        dtype is the latent (ckv) cache's dtype. For ``float8_e4m3fn`` (jax_mla.quant) each layer
        also gets its float32 scale, `ckv_scale` (1.0 by default, as serving stacks use uncalibrated;
        `jax_mla.fp8_scale` computes one from sample data), and kpe is kept in `kpe_dtype`, bfloat16
        by default (rope dims are few and precision-sensitive); an fp8 kpe takes `kpe_scale`.
        Without fp8, kpe_dtype defaults to dtype."""
        dtype = jnp.dtype(dtype)
        kpe_dtype = jnp.dtype(kpe_dtype if kpe_dtype is not None else (jnp.bfloat16 if is_fp8(dtype) else dtype))
        if is_fp8(kpe_dtype) and not is_fp8(dtype):
            raise ValueError(f"kpe_dtype float8_e4m3fn needs an fp8 ckv cache, got dtype {dtype.name}")
        shape = (self.num_pages, self.page_size)

        def zeros(d, dt):
            return jax.device_put(jnp.zeros(shape + (d,), dt), device)

        def scale(dt, value, name):
            if not is_fp8(dt):
                return None
            if not (np.isfinite(value) and value > 0):
                raise ValueError(f"{name} = {value!r} must be finite and > 0")
            return jax.device_put(jnp.full((1,), value, jnp.float32), device)

        return tuple(PagedKV(zeros(kv_lora_rank, dtype), zeros(rope_dim, kpe_dtype),
                             scale(dtype, ckv_scale, "ckv_scale"), scale(kpe_dtype, kpe_scale, "kpe_scale"))
                     for _ in range(num_layers))
