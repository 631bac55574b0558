"""Random paged batches for tests and benchmarks (one builder, shared shapes)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class PagedBatch:
    q_nope: jax.Array
    q_pe: jax.Array
    ckv: jax.Array
    kpe: jax.Array
    page_table: jax.Array
    kv_lens: jax.Array
    qo_lens: np.ndarray
    kv_lens_host: np.ndarray
    page_table_host: np.ndarray
    ckv_scale: jax.Array | None = None  # an fp8 ckv's scale (value = fp8 x scale); None: ckv in the query dtype
    kpe_scale: jax.Array | None = None  # an fp8 kpe's

    def args(self, plan):
        return (self.q_nope, self.q_pe, self.ckv, self.kpe, self.page_table, self.kv_lens, plan)

    @property
    def scales(self) -> dict:
        """The cache's scales as the op's keyword arguments (empty for a cache in the query dtype)."""
        return {k: v for k, v in (("ckv_scale", self.ckv_scale), ("kpe_scale", self.kpe_scale)) if v is not None}


def random_paged_batch(rng: np.random.Generator, qo_lens, kv_lens, *, num_heads, page_size,
                       d_ckv=64, d_kpe=16, dtype=jnp.float32, extra_pages=3, num_tokens=None,
                       max_pages=None) -> PagedBatch:
    """Random queries and caches; every request's pages are a random disjoint set."""
    qo_lens = np.asarray(qo_lens, np.int64)
    kv_lens = np.asarray(kv_lens, np.int64)
    need = -(-kv_lens // page_size)
    if max_pages is None:
        max_pages = max(1, int(need.max(initial=0)) + 1)
    num_pages = int(need.sum()) + extra_pages
    perm = rng.permutation(num_pages)
    table = rng.integers(0, num_pages, size=(len(qo_lens), max_pages)).astype(np.int32)
    at = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[at:at + n]
        at += n
    t = int(qo_lens.sum()) if num_tokens is None else num_tokens
    f = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32), dtype)
    return PagedBatch(q_nope=f(t, num_heads, d_ckv), q_pe=f(t, num_heads, d_kpe),
                      ckv=f(num_pages, page_size, d_ckv), kpe=f(num_pages, page_size, d_kpe),
                      page_table=jnp.asarray(table), kv_lens=jnp.asarray(kv_lens, jnp.int32),
                      qo_lens=qo_lens, kv_lens_host=kv_lens, page_table_host=table)


def quantize_cache(batch: PagedBatch, kpe_fp8: bool = False) -> PagedBatch:
    """`batch` with its ckv (and its kpe where kpe_fp8) in float8_e4m3fn, each with a scale from its data
    (amax / 448, `fp8_scale`), kept in `batch.ckv_scale` / `batch.kpe_scale`: the fp8 cache of these values."""
    from .quant import fp8_scale, quantize_fp8
    ckv_scale = fp8_scale(batch.ckv)
    kpe_scale = fp8_scale(batch.kpe) if kpe_fp8 else None
    kpe = batch.kpe if kpe_scale is None else quantize_fp8(batch.kpe, kpe_scale)
    return dataclasses.replace(batch, ckv=quantize_fp8(batch.ckv, ckv_scale), kpe=kpe, ckv_scale=ckv_scale,
                               kpe_scale=kpe_scale)


def poison_unseen(cache, page_table, kv_lens, page_size):
    """NaN in every cache slot that no request may read under `kv_lens`."""
    page_table = np.asarray(page_table)
    num_pages = cache.shape[0]
    capacity = page_table.shape[1] * page_size
    seen = np.zeros((num_pages, page_size), bool)
    for r, n in enumerate(np.clip(np.asarray(kv_lens)[: page_table.shape[0]], 0, capacity)):
        pos = np.arange(n)
        pages = page_table[r, pos // page_size]
        ok = (pages >= 0) & (pages < num_pages)
        seen[pages[ok], (pos % page_size)[ok]] = True
    return jnp.where(jnp.asarray(seen)[..., None], cache, jnp.nan).astype(cache.dtype)


def with_bad_pages(batch: PagedBatch, count: int, rng: np.random.Generator) -> PagedBatch:
    """`batch` with `count` of the page-table entries its requests use replaced by ids outside the
    cache: -1, -3, the first id past it (num_pages: an off-by-one reads the row after the buffer),
    num_pages + 1, 2^31 - 1. Every backend skips the keys on them (the reference masks them)."""
    num_pages, page_size = batch.ckv.shape[0], batch.ckv.shape[1]
    used = [(r, j) for r, n in enumerate(np.asarray(batch.kv_lens_host)) for j in range(-(-int(n) // page_size))]
    if not used or count <= 0:
        return batch
    ids = (-1, -3, num_pages, num_pages + 1, 2**31 - 1)
    table = batch.page_table_host.copy()
    for k in rng.choice(len(used), size=min(count, len(used)), replace=False):
        r, j = used[k]
        table[r, j] = ids[rng.integers(len(ids))]
    return dataclasses.replace(batch, page_table=jnp.asarray(table), page_table_host=table)


def rel_err(x, ref) -> float:
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_nan_rows_match(out, lse, ref_out, ref_lse, tol: float) -> None:
    """NaN in, NaN out: exactly the rows the reference makes NaN are NaN (every output column and the
    LSE), some rows but not all (the premise of a NaN test), and the other rows match within `tol`."""
    out, lse = np.asarray(jnp.asarray(out, jnp.float32)), np.asarray(lse)
    ref_out, ref_lse = np.asarray(ref_out), np.asarray(ref_lse)
    nan_rows = np.isnan(ref_lse)
    assert nan_rows.any() and not nan_rows.all(), "the test's premise: some rows, not all, are NaN"
    np.testing.assert_array_equal(np.isnan(lse), nan_rows)
    np.testing.assert_array_equal(np.isnan(out).all(-1), nan_rows)
    assert not np.isnan(out[~nan_rows]).any()
    assert rel_err(out[~nan_rows], ref_out[~nan_rows]) < tol


def split_target():
    """A plan target of many small units: every long request is split and merged."""
    from .planner import PlanTarget
    return PlanTarget(num_workers=256, min_chunk=16, chunk_align=16)


def no_split_target():
    """A plan target of one worker: no request is ever split."""
    from .planner import PlanTarget
    return PlanTarget(num_workers=1, units_per_worker=1.0, min_chunk=1 << 20)


# The caches a random problem may hold: in the query dtype, an e4m3 ckv (kpe in the query dtype), both e4m3.
CACHE_KINDS = ("query", "fp8_ckv", "fp8_ckv_kpe")


@dataclasses.dataclass(frozen=True)
class ProblemSpec:
    """One random op problem: what `paged_problems` draws and `build` turns into a batch and a plan."""
    qo_lens: tuple
    kv_lens: tuple
    num_heads: int
    page_size: int
    dtype: str
    padding_tokens: int
    split: bool
    seed: int
    bad_pages: int = 0  # page-table entries of the requests' ranges on ids outside the cache
    cache: str = "query"  # one of CACHE_KINDS
    # The lengths the op gets on the device, each at most the plan's (kv_lens); None: the plan's.
    device_kv_lens: tuple | None = None
    return_lse: bool = True

    def __post_init__(self):
        if self.cache not in CACHE_KINDS:
            raise ValueError(f"cache={self.cache!r} is not one of {CACHE_KINDS}")
        if self.cache != "query" and self.dtype == "float32":
            raise ValueError(f"cache={self.cache!r} takes bfloat16 or float16 queries, not dtype='float32'")
        if self.device_kv_lens is not None and (
                len(self.device_kv_lens) != len(self.kv_lens)
                or any(not 0 <= d <= k for d, k in zip(self.device_kv_lens, self.kv_lens))):
            raise ValueError(f"device_kv_lens={self.device_kv_lens!r} must give each request a length in "
                             f"[0, kv_lens] (kv_lens={self.kv_lens!r})")

    def build(self, d_ckv: int, d_kpe: int):
        """(batch, plan): random inputs of this spec; `split` plans for many small units (every long
        request is split and merged), else for one worker (nothing is split); `bad_pages` entries of
        the page table moved off the cache (`with_bad_pages`); an fp8 `cache` quantized from the random
        values with scales from the data (`quantize_cache`); batch.kv_lens, the device lengths, are
        `device_kv_lens` where given (the plan is made for kv_lens)."""
        from .planner import plan_mla
        qo, kv = np.array(self.qo_lens, np.int64), np.array(self.kv_lens, np.int64)
        num_tokens = int(qo.sum()) + self.padding_tokens
        batch = random_paged_batch(np.random.default_rng(self.seed), qo, kv, num_heads=self.num_heads,
                                   page_size=self.page_size, d_ckv=d_ckv, d_kpe=d_kpe,
                                   dtype=jnp.dtype(self.dtype), num_tokens=num_tokens)
        if self.cache != "query":
            batch = quantize_cache(batch, kpe_fp8=self.cache == "fp8_ckv_kpe")
        batch = with_bad_pages(batch, self.bad_pages, np.random.default_rng([self.seed, 1]))
        if self.device_kv_lens is not None:
            batch = dataclasses.replace(batch, kv_lens=jnp.asarray(self.device_kv_lens, jnp.int32))
        target = split_target() if self.split else no_split_target()
        plan = plan_mla(qo, kv, num_heads=self.num_heads, page_size=self.page_size, num_tokens=num_tokens,
                        target=target)
        return batch, plan


def paged_problems(max_requests: int = 5, max_kv: int = 300, max_heads: int = 130, caches=("query",),
                   min_heads: int = 1):
    """A hypothesis strategy of `ProblemSpec`s over random ragged batches: zero-length requests and
    padding tokens, page sizes 1-256, `min_heads`-`max_heads` heads (odd counts included), q_len 0-8,
    fp16 / bf16 / f32, split or not, up to three page ids outside the cache, a cache of one of `caches`
    (from CACHE_KINDS; fp8 caches with fp16 / bf16 queries), device lengths below the plan's for some
    requests, with or without the LSE. Shared by the property tests (tests/test_properties.py), which
    also run on the GPU through scripts/gpu_check.sh. Needs hypothesis (a test dependency)."""
    from hypothesis import strategies as st

    from .planner import SUPPORTED_PAGE_SIZES

    caches = tuple(caches)
    if not caches or any(c not in CACHE_KINDS for c in caches):
        raise ValueError(f"caches={caches!r} must be a non-empty selection of {CACHE_KINDS}")
    dtypes = ["float32", "bfloat16", "float16"] if "query" in caches else ["bfloat16", "float16"]

    @st.composite
    def problem(draw):
        n = draw(st.integers(1, max_requests))
        qo = draw(st.lists(st.integers(0, 8), min_size=n, max_size=n))
        # kv includes the new tokens; a zero-length request has none of either
        kv = [q + draw(st.integers(0, max_kv)) if q or draw(st.booleans()) else 0 for q in qo]
        spec = dict(num_heads=draw(st.integers(min_heads, max_heads)),
                    page_size=draw(st.sampled_from(SUPPORTED_PAGE_SIZES)), dtype=draw(st.sampled_from(dtypes)),
                    padding_tokens=draw(st.integers(0, 3)), split=draw(st.booleans()),
                    seed=draw(st.integers(0, 2**32 - 1)), bad_pages=draw(st.integers(0, 3)))
        cache = "query" if spec["dtype"] == "float32" else draw(st.sampled_from(caches))
        device = None  # some requests' device lengths below the plan's: keys past them are never read
        if draw(st.booleans()):
            device = tuple(draw(st.integers(0, k)) if draw(st.booleans()) else k for k in kv)
        return ProblemSpec(qo_lens=tuple(qo), kv_lens=tuple(kv), cache=cache, device_kv_lens=device,
                           return_lse=draw(st.booleans()), **spec)

    return problem()
