"""The op's shapes, one list shared by the tests, the benchmarks and the GPU tools (in the manner of
tokamax's ``arg_specs``): a shape is named and tagged once here, and each consumer selects by tag.

Tags:
  ``target``   benchmark shapes with performance targets (``benchmarks/bench_attention.py``);
  ``extra``    further benchmark shapes, ragged and held-out kinds, no targets;
  ``planner``  shapes whose planner targets the benchmark's ``--sweep`` compares;
  ``timing``   shapes the standalone CUDA driver times (``tools/sanitize_harness``);
  ``wide``     q_len-1 shapes of the wide body (and one narrow control) that ``scripts/driver_ab.sh``
               times when it compares kernel variants;
  ``profile``  shapes the driver runs under ncu (``scripts/gpu_profile.sh``);
  ``cpu``      the CPU handler's benchmark (``benchmarks/bench_cpu.py``);
  ``sweep``    the CUDA correctness sweep (``tests/test_arg_specs.py``, marked ``gpu``);
  ``small``    the short correctness set: compute-sanitizer's cases, and run on every backend in CI;
  ``fp8``      fp8-cache benchmark shapes, timed beside the bf16 cache of the same shape;
  ``pages``    wide units on pages under 32 keys (blocks gathered by cp.async, or TMA boxes of one page on
               pages of 8-16 keys), which the driver times;
  ``extend``   many query tokens a request (chunked prefill, long verify) over a paged prefix, causal.

A length is an int (every request), a tuple (one per request) or a `Uniform` draw per request.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import numpy as np


@dataclasses.dataclass(frozen=True)
class Uniform:
    """Per-request lengths drawn uniformly from [lo, hi]; `seed` fixes the draw for every run."""
    lo: int
    hi: int
    seed: int | None = None

    def __str__(self):
        return f"U[{self.lo},{self.hi}]"


Length = Union[int, tuple, Uniform]


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    """One shape of the op: per-request query and kv lengths, heads, page size, dtype, plus the
    irregularities a correctness case may carry (padding tokens, device lengths below the planned
    ones, page ids outside the cache) and, for benchmark shapes, their targets."""
    heads: int
    page_size: int
    q_lens: Length
    kv_lens: Length
    batch: int | None = None   # needed when neither length is a tuple
    dtype: str = "bfloat16"
    padding: int = 0           # query tokens after the last request's, covered by no request
    device_kv_lens: tuple | None = None  # what the device sees, below the planned lengths
    bad_pages: bool = False    # page ids outside the cache inside the kv range (mark_bad_pages)
    split: bool = False        # plan for many small units (`case_split_target`): splits and merges everywhere
    whole: bool = False        # one unit per request (`testing.no_split_target`): long units
    kv_dtype: str | None = None  # the latent cache's dtype when not `dtype`: "float8_e4m3fn" (kpe stays dtype)
    kpe_fp8: bool = False      # with an fp8 kv_dtype: kpe in e4m3 too, with its own scale
    tags: frozenset = frozenset()
    # Benchmark targets: ("peer", x) ours >= x times as fast as the fastest peer; ("TB/s", x),
    # ("TFLOP/s", x) floors; ("us", x) a ceiling.
    targets: tuple = ()

    def __post_init__(self):
        if self.split and self.whole:
            raise ValueError(f"an ArgSpec is split or whole, not both: split={self.split}, whole={self.whole}")
        if self.kpe_fp8 and self.kv_dtype != "float8_e4m3fn":
            raise ValueError(f"kpe_fp8 needs kv_dtype='float8_e4m3fn', got kv_dtype={self.kv_dtype!r}")

    @property
    def num_requests(self) -> int:
        for x in (self.q_lens, self.kv_lens):
            if isinstance(x, tuple):
                return len(x)
        if self.batch is None:
            raise ValueError("an ArgSpec without per-request lengths needs `batch`")
        return self.batch

    def lengths(self, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Per-request (q_lens, kv_lens), int64 host arrays, kv_len >= q_len (the new tokens are cached)."""
        b = self.num_requests

        def draw(x, default_seed):
            if isinstance(x, Uniform):
                rng = np.random.default_rng(default_seed if x.seed is None else x.seed)
                return rng.integers(x.lo, x.hi + 1, b)
            return np.asarray(x if isinstance(x, tuple) else [x] * b)

        qo = draw(self.q_lens, seed + 101).astype(np.int64)
        kv = draw(self.kv_lens, seed).astype(np.int64)
        return qo, np.maximum(kv, qo)

    @property
    def name(self) -> str:
        def s(x):
            return f"[{','.join(map(str, x))}]" if isinstance(x, tuple) else str(x)
        irregular = "".join([f" pad{self.padding}" if self.padding else "",
                             " devkv" if self.device_kv_lens is not None else "",
                             " badpages" if self.bad_pages else "", " split" if self.split else "",
                             " whole" if self.whole else ""])
        lead = f"{self.batch}x" if self.batch is not None else ""
        kv = (f" kv:{self.kv_dtype}" if self.kv_dtype else "") + (" kpe:fp8" if self.kpe_fp8 else "")
        return (f"{lead}{s(self.kv_lens)} h{self.heads} ps{self.page_size} q{s(self.q_lens)} "
                f"{self.dtype}{kv}{irregular}")

    def plan_target(self):
        """`case_split_target()` or `testing.no_split_target()` when the spec asks for one, else None
        (the op's default target)."""
        from .testing import no_split_target
        return case_split_target() if self.split else no_split_target() if self.whole else None

    def mark_bad_pages(self, table: np.ndarray, num_pages: int, kv_lens: np.ndarray) -> None:
        """Where `bad_pages`, moves entries of the host page table off the cache, in place: request 0's
        first page to -3, the last request's first to num_pages (the first id past the cache: an
        off-by-one reads the row after it) and, where request 0 has 8+ pages, one in the middle of its
        range to -1 (away from the unit's first block). Every backend skips the keys on them. The JAX
        tests (`build`) and the standalone driver's cases (tools/sanitize_harness/cases.py) both call it."""
        if not self.bad_pages:
            return
        table[0, 0] = -3
        table[-1, 0] = num_pages
        pages0 = -(-int(kv_lens[0]) // self.page_size)
        if pages0 >= 8:
            table[0, pages0 // 2] = -1

    def build(self, rng: np.random.Generator, *, d_ckv: int = 512, d_kpe: int = 64):
        """(batch, plan, page_table, device kv_lens, cache scales): random inputs of this spec and its
        plan; the page table and device lengths carry the spec's irregularities; an fp8 spec's
        batch.ckv is quantized (scale from its data) and the scales are the op's keyword arguments."""
        import jax.numpy as jnp

        from .planner import plan_mla
        from .testing import quantize_cache, random_paged_batch

        qo, kv = self.lengths()
        t = int(qo.sum()) + self.padding
        batch = random_paged_batch(rng, qo, kv, num_heads=self.heads, page_size=self.page_size, d_ckv=d_ckv,
                                   d_kpe=d_kpe, dtype=jnp.dtype(self.dtype), num_tokens=t)
        plan = plan_mla(qo, kv, num_heads=self.heads, page_size=self.page_size, num_tokens=t,
                        target=self.plan_target())
        table = batch.page_table
        if self.bad_pages:
            host = batch.page_table_host.copy()
            self.mark_bad_pages(host, batch.ckv.shape[0], kv)
            table = jnp.asarray(host)
        kv_dev = batch.kv_lens if self.device_kv_lens is None else jnp.asarray(self.device_kv_lens, jnp.int32)
        if self.kv_dtype is not None and jnp.dtype(self.kv_dtype) == jnp.float8_e4m3fn:
            batch = quantize_cache(batch, kpe_fp8=self.kpe_fp8)
        return batch, plan, table, kv_dev, batch.scales


def case_split_target():
    """Splits everywhere: small chunks on a pretend 132-SM GPU (the correctness cases' target; coarser
    than `testing.split_target`, whose 256 workers and 16-key chunks the op-level tests use)."""
    from .planner import PlanTarget
    return PlanTarget(num_workers=132, units_per_worker=2.0, min_chunk=64, chunk_align=32)


def _tags(*names):
    return frozenset(names)


_PEER = (("peer", 1.0),)

ARG_SPECS: tuple[ArgSpec, ...] = (
    # ---- benchmark shapes with targets (issue 9); "timing": also timed by the standalone driver
    ArgSpec(16, 64, 1, 32768, batch=1, tags=_tags("target", "timing", "planner"), targets=_PEER),
    ArgSpec(16, 64, 1, 4096, batch=32, tags=_tags("target", "timing", "planner"), targets=_PEER),
    ArgSpec(16, 64, 1, 4096, batch=128, tags=_tags("target", "timing", "wide"), targets=(("TB/s", 4.1), ("peer", 1.0))),
    ArgSpec(16, 1, 1, 4096, batch=128, tags=_tags("target", "timing"), targets=_PEER),
    ArgSpec(128, 64, 1, 4096, batch=128, tags=_tags("target", "timing", "wide", "walk"),
            targets=(("TFLOP/s", 660.0),)),
    ArgSpec(16, 64, 2, 4096, batch=128, tags=_tags("target"), targets=_PEER),
    ArgSpec(16, 64, 4, 4096, batch=128, tags=_tags("target"), targets=_PEER),
    ArgSpec(32, 64, 1, 4096, batch=128, tags=_tags("target", "wide"), targets=_PEER),
    ArgSpec(64, 64, 1, 4096, batch=128, tags=_tags("target", "wide"), targets=_PEER),
    ArgSpec(128, 64, 1, 4096, batch=32, tags=_tags("target", "wide"), targets=_PEER),
    ArgSpec(128, 64, 1, 32768, batch=1, tags=_tags("target", "planner", "wide"), targets=_PEER),
    ArgSpec(128, 64, 1, 8192, batch=64, tags=_tags("target", "wide"), targets=_PEER),
    # ---- further benchmark shapes: ragged (the first two as in the FlashMLA kit), mixed q_len, odd heads
    ArgSpec(16, 64, 1, 8192, batch=64, tags=_tags("extra")),
    ArgSpec(16, 16, 1, 8192, batch=8, tags=_tags("extra")),
    ArgSpec(32, 64, 1, Uniform(1, 8192, 7), batch=48, tags=_tags("extra", "wide")),
    ArgSpec(128, 64, 1, Uniform(1000, 8192, 5), batch=32, tags=_tags("extra", "wide")),
    ArgSpec(20, 64, Uniform(1, 3), Uniform(256, 8192, 3), batch=64, tags=_tags("extra")),
    ArgSpec(40, 16, Uniform(1, 3), Uniform(64, 4096, 4), batch=96, tags=_tags("extra")),
    ArgSpec(128, 64, 1, Uniform(500, 16384, 7), batch=64, tags=_tags("extra")),
    ArgSpec(16, 64, 1, Uniform(1, 4096, 3), batch=100, tags=_tags("extra")),
    # MTP at 128 heads on a ragged batch: two one-token tiles a request, fewer than the workers, so split
    # and packed (whether a request's two tiles read its keys together; forty-second session)
    ArgSpec(128, 64, 2, Uniform(500, 16384, 7), batch=32, tags=_tags("extra")),
    # ... and with q_len 1-3 a request: requests of one, two and three tiles, packed as one each on lanes of
    # their own width (forty-fourth session)
    ArgSpec(128, 64, Uniform(1, 3), Uniform(500, 16384, 7), batch=24, tags=_tags("extra")),
    # wide units on pages under 32 keys (SGLang's FlashInfer MLA path runs on pages of one key): the
    # kernel cannot read these blocks by TMA
    ArgSpec(128, 1, 1, 4096, batch=128, tags=_tags("extra", "pages")),
    ArgSpec(64, 16, 1, 4096, batch=128, tags=_tags("extra", "pages")),
    ArgSpec(16, 1, 2, 4096, batch=128, tags=_tags("extra", "pages")),
    # ---- more 64-row units than workers (132 SMs / head blocks): data-parallel attention's large batches and
    # MTP at 128 heads, each an exact number of units a worker; the standalone driver times them
    # (`cases.py timing DIR --tag walk`) for the 64-key body's walk (mla_wide64_walk_sm90.cuh), where a block
    # runs several units (ffi/cuda/NOTES.md, "thirty-seventh session"); 128 x 4096 h128 is the fourth. The two
    # 128-head ones are benchmark rows too: every other 128-head row gives a worker one or two units, and the
    # walk's A/B through JAX saw only those (forty-first session)
    ArgSpec(128, 64, 1, 2048, batch=264, tags=_tags("walk", "extra")),
    ArgSpec(128, 64, 2, 4096, batch=66, tags=_tags("walk", "extra")),
    ArgSpec(64, 64, 1, 4096, batch=264, tags=_tags("walk")),
    # ... and a ragged one: 300 requests at 128 heads, a plan of 512 rows, walked (kWalkFromRows), each unit
    # dealt to the least loaded worker (forty-fourth session)
    ArgSpec(128, 64, 1, Uniform(1, 4096, 9), batch=300, tags=_tags("walk", "extra")),
    # ---- extend: many query tokens a request over a paged prefix, causal (chunked prefill and long speculative
    # verify through the absorbed op); each request's queries see its whole prefix, so these are compute-bound
    ArgSpec(16, 64, 128, 4096, batch=16, tags=_tags("extend", "extra")),
    ArgSpec(128, 64, 64, 4096, batch=8, tags=_tags("extend", "extra")),
    ArgSpec(32, 64, Uniform(16, 256, 5), Uniform(1024, 8192, 5), batch=16, tags=_tags("extend", "extra")),
    # ---- planner sweep only
    ArgSpec(16, 64, 1, 8192, batch=8, tags=_tags("planner")),
    ArgSpec(128, 64, 1, 2048, batch=16, tags=_tags("planner")),
    ArgSpec(16, 64, 4, 4096, batch=8, tags=_tags("planner")),
    # ---- the CPU handler's benchmark (benchmarks/bench_cpu.py): shapes a CPU times in milliseconds
    ArgSpec(16, 64, 1, 4096, batch=8, tags=_tags("cpu")),
    ArgSpec(128, 64, 1, 4096, batch=8, tags=_tags("cpu")),
    ArgSpec(16, 64, 4, 2048, batch=8, tags=_tags("cpu")),
    # ---- kernel profiles (ncu) at benchmark-like shapes
    ArgSpec(16, 64, 1, 1024, batch=128, tags=_tags("profile")),
    ArgSpec(128, 64, 1, 1024, batch=64, tags=_tags("profile")),
    ArgSpec(16, 64, 1, 4096, batch=32, tags=_tags("profile")),
    # ---- correctness: the short set (compute-sanitizer's cases, every backend in CI) ...
    # varlen decode, page sizes 1 and 64, heads 16 and 128, empty requests, padding
    ArgSpec(16, 1, (1, 1, 0, 1, 1), (700, 1, 0, 333, 96), padding=2, split=True, tags=_tags("small", "sweep")),
    ArgSpec(128, 64, (1, 1, 1, 0), (900, 64, 5, 0), split=True, tags=_tags("small", "sweep")),
    # causal q_len 4 and 2, ragged; device lengths below the plan's and page ids outside the cache
    ArgSpec(16, 64, (4, 2, 4, 1), (530, 77, 4, 260), padding=3, split=True, tags=_tags("small", "sweep")),
    ArgSpec(16, 1, (4, 3), (300, 45), dtype="float16", device_kv_lens=(297, 2), bad_pages=True, split=True,
            tags=_tags("small", "sweep")),
    ArgSpec(128, 1, (1, 1), (200, 31), dtype="float32", padding=1, split=True, tags=_tags("small", "sweep")),
    # one long request over many units (> 16 splits: the merge's four-part path) beside a short one
    ArgSpec(16, 16, (1, 2), (5000, 300), split=True, tags=_tags("small", "sweep")),
    # the wide body with odd block counts
    ArgSpec(32, 16, (2, 1, 2, 1), (333, 190, 64, 2), dtype="float16", padding=1, bad_pages=True, split=True,
            tags=_tags("small", "sweep")),
    # wide units of many blocks ending in a partial one, unsplit: every stage of the wgmma body's
    # ring is reused, and the partial last block is gathered by cp.async into a stage just released
    ArgSpec(32, 64, (1, 2, 1), (700, 450, 129), whole=True, tags=_tags("small", "sweep")),
    # 64+ heads (mla_wide64_sm90.cuh): a 16-row head block beside a full one (padding rows), causal
    # q_len 3, long unsplit ranges with a bad page in the middle of one
    ArgSpec(80, 64, (3, 1), (1500, 700), dtype="float16", bad_pages=True, whole=True,
            tags=_tags("small", "sweep")),
    # ... and on pages of 32 keys (two TMA boxes per block instead of one)
    ArgSpec(64, 32, (2, 1), (700, 300), bad_pages=True, whole=True, tags=_tags("small", "sweep")),
    # the fp8 cache (e4m3 ckv, kpe in the query dtype): narrow and wide units, splits, bad pages
    ArgSpec(16, 16, (1, 4, 0, 2), (700, 90, 0, 33), kv_dtype="float8_e4m3fn", padding=1, split=True,
            tags=_tags("small", "sweep")),
    ArgSpec(64, 1, (1, 1, 2), (260, 31, 77), dtype="float16", kv_dtype="float8_e4m3fn", bad_pages=True,
            split=True, tags=_tags("small", "sweep")),
    # ... narrow fp8 units on pages of 64 keys (the benchmarks' page size), split, a partial last block
    ArgSpec(16, 64, (1, 1, 1), (900, 64, 130), kv_dtype="float8_e4m3fn", split=True, tags=_tags("small", "sweep")),
    # ... and wide fp8 units of many blocks ending in a partial one: the wgmma body's producer turns
    # each latent half into fp16 in its stage (TMA for whole blocks, cp.async for the partial one)
    ArgSpec(32, 64, (1, 2, 1), (700, 450, 129), kv_dtype="float8_e4m3fn", whole=True, tags=_tags("small", "sweep")),
    # ---- ... and the rest of the CUDA sweep: long ranges (many trips round the key ring) on the
    # default plan, two head blocks of unequal size, odd head counts, one head with 64-token tiles
    ArgSpec(16, 16, 1, (20000, 3000, 129), tags=_tags("sweep")),
    ArgSpec(128, 64, 1, (9000, 2500), tags=_tags("sweep")),
    ArgSpec(128, 128, (1, 2, 1, 1, 2, 1), Uniform(300, 3000, 11), whole=True, bad_pages=True, tags=_tags("sweep")),
    ArgSpec(100, 32, 1, (1500, 40, 700), split=True, tags=_tags("sweep")),
    ArgSpec(20, 128, (3, 1, 2), (900, 128, 2), split=True, tags=_tags("sweep")),
    ArgSpec(1, 16, (64, 9), (700, 9), split=True, tags=_tags("sweep")),
    ArgSpec(64, 256, 1, (3000, 700), dtype="float16", padding=1, tags=_tags("sweep")),
    ArgSpec(8, 2, (8, 5, 1), (400, 5, 1000), dtype="float16", device_kv_lens=(404, 3, 0), split=True,
            tags=_tags("sweep")),
    ArgSpec(16, 64, 4, (2048, 1000, 64), dtype="float32", tags=_tags("sweep")),
    ArgSpec(128, 64, 1, (9000, 2500), kv_dtype="float8_e4m3fn", tags=_tags("sweep")),
    ArgSpec(16, 16, 1, (20000, 3000, 129), kv_dtype="float8_e4m3fn", tags=_tags("sweep")),
    # ---- fp8 cache benchmark shapes (issue 10): against bf16 of the same shape in the same run
    ArgSpec(16, 64, 1, 4096, batch=128, kv_dtype="float8_e4m3fn", tags=_tags("fp8"),
            targets=(("bf16", 1.7),)),
    ArgSpec(128, 64, 1, 4096, batch=128, kv_dtype="float8_e4m3fn", tags=_tags("fp8"),
            targets=(("bf16", 1.0),)),
    ArgSpec(16, 64, 1, Uniform(1, 8192, 11), batch=256, kv_dtype="float8_e4m3fn", tags=_tags("fp8")),
    # a wide unit that is memory-bound at bf16 (the wgmma body, its producer converting fp8 to fp16)
    ArgSpec(64, 64, 1, 4096, batch=128, kv_dtype="float8_e4m3fn", tags=_tags("fp8")),
    ArgSpec(16, 64, 1, 131072, batch=1, kv_dtype="float8_e4m3fn", tags=_tags("fp8")),
    # (last, so the cases before it keep their random draws) wide units on pages of >= 32 keys,
    # where whole blocks come by TMA: page ids outside the cache, partial last blocks, splits
    ArgSpec(64, 64, (1, 2, 1), (300, 129, 40), bad_pages=True, split=True, tags=_tags("small", "sweep")),
    # (after it) fp8 narrow units of several tokens (8 heads x 2 = 16 rows, causal) on pages of one key
    ArgSpec(8, 1, (2, 1, 1), (300, 5, 77), dtype="float16", kv_dtype="float8_e4m3fn", bad_pages=True, split=True,
            tags=_tags("small", "sweep")),
    # (after it) kpe in e4m3 too: narrow units (q_len 1) and, at 2 tokens x 16 heads, the portable wide body
    ArgSpec(16, 16, (1, 2, 1), (200, 61, 700), kv_dtype="float8_e4m3fn", kpe_fp8=True, split=True,
            tags=_tags("small", "sweep")),
    # (after it) fp8 wide units of 64+ heads on TMA pages (mla_wide64_sm90.cuh converts each block in its
    # buffer): a 16-row head block beside a full one, causal q_len 3, bad pages, long unsplit ranges;
    # pages of 32 keys (two boxes a block); 128 heads split, with partial last blocks
    ArgSpec(80, 64, (3, 1), (1500, 700), dtype="float16", kv_dtype="float8_e4m3fn", bad_pages=True, whole=True,
            tags=_tags("small", "sweep")),
    ArgSpec(64, 32, (2, 1), (700, 300), kv_dtype="float8_e4m3fn", bad_pages=True, whole=True,
            tags=_tags("small", "sweep")),
    ArgSpec(128, 64, (1, 2, 1), (300, 129, 40), kv_dtype="float8_e4m3fn", bad_pages=True, split=True,
            tags=_tags("small", "sweep")),
    # (after it) fp8 narrow units on TMA pages (mla_narrow_fp8_sm90.cuh's producer issues 32-key boxes):
    # pages of 32 keys with page ids outside the cache, 8 heads x 2 tokens, long unsplit ranges ending
    # inside a box; pages of 128 keys, split
    ArgSpec(8, 32, (2, 1, 1), (700, 97, 33), kv_dtype="float8_e4m3fn", bad_pages=True, whole=True,
            tags=_tags("small", "sweep")),
    ArgSpec(16, 128, (1, 1), (1500, 130), dtype="float16", kv_dtype="float8_e4m3fn", split=True,
            tags=_tags("small", "sweep")),
    # (after it) units of 17-32 rows on a 16-bit cache: 24 heads on pages of one key with page ids
    # outside the cache (the producer body's cp.async path); 16 heads x 2 tokens (causal within a unit)
    # on pages of 128 keys, split, a partial last block (the 64-key body)
    ArgSpec(24, 1, (1, 1, 1), (300, 45, 2), dtype="float16", bad_pages=True, split=True,
            tags=_tags("small", "sweep")),
    ArgSpec(16, 128, (2, 2, 1), (900, 130, 257), split=True, tags=_tags("small", "sweep")),
    # (after it) the 64-key body's blocks as boxes of one page (pages of 8 and 16 keys): 64 heads on pages
    # of 8, split, page ids outside the cache, partial last blocks; 128 heads (two head blocks), causal
    # q_len 2, on pages of 16, fp16, long unsplit ranges ending in a partial block, a bad page mid-range
    ArgSpec(64, 8, (1, 2, 1), (700, 300, 45), bad_pages=True, split=True, tags=_tags("small", "sweep")),
    ArgSpec(128, 16, (2, 1), (900, 333), dtype="float16", bad_pages=True, whole=True, tags=_tags("small", "sweep")),
    # ... and timed: 128 heads on pages of 16 keys
    ArgSpec(128, 16, 1, 4096, batch=128, tags=_tags("extra", "pages")),
    # (after it) the gathers of four keys' lines on pages of 4 keys (no box fits): 48 heads (a partial
    # 64-row tile), causal q_len 3 and 2, page ids outside the cache, split, a range of 2 keys
    ArgSpec(48, 4, (1, 3, 2), (1000, 37, 2), bad_pages=True, split=True, tags=_tags("small", "sweep")),
    # (after it) more cp.async gathers (pages under 8 keys): 128 heads on pages of one key, causal q_len 2,
    # long unsplit ranges of odd block counts (many turns of each buffer's barriers), a bad page mid-range;
    # 16 heads x 2-4 tokens (32-64 rows) on pages of 2 keys, fp16, split, a partial last block
    ArgSpec(128, 1, (2, 1), (1413, 333), bad_pages=True, whole=True, tags=_tags("small", "sweep")),
    ArgSpec(16, 2, (2, 4, 1), (700, 129, 300), dtype="float16", split=True, tags=_tags("small", "sweep")),
    # (after it) 128 heads on pages of 32 keys: the 64-key body's two head blocks with two TMA boxes a block (no
    # other case had both), split, page ids outside the cache, a partial last block, causal q_len 2
    ArgSpec(128, 32, (1, 2, 1), (700, 97, 300), bad_pages=True, split=True, tags=_tags("small", "sweep")),
)


def arg_specs(tag: str) -> list[ArgSpec]:
    """The specs carrying `tag`, in the list's order."""
    found = [s for s in ARG_SPECS if tag in s.tags]
    if not found:
        raise ValueError(f"no ArgSpec is tagged {tag!r}")
    return found
