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

    def args(self, plan):
        return (self.q_nope, self.q_pe, self.ckv, self.kpe, self.page_table, self.kv_lens, plan)


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


def rel_err(x, ref) -> float:
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))
