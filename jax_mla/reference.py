"""Pure `jax.numpy` paged MLA attention: the ground truth for every backend.

It follows the op's contract literally (per-token request, causal limit from the
device kv length, page gather) and ignores how the plan splits the work; only
the plan's per-token table is read. Computes in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .plan_layout import visible_keys
from .planner import MLAPlan
from .quant import check_scale, dequantize


# The reference walks the keys in chunks of whole pages (about KEY_CHUNK keys) with an
# online softmax, for blocks of TOKEN_BLOCK query tokens at a time, so that its memory
# is O(tokens x chunk + cache), not O(tokens x capacity): each token gathers its own
# request's keys, and a 2048-token prefill over a 2048-token cache at once would take
# gigabytes (16 GB at 8 heads, measured with the one-shot version).
KEY_CHUNK = 512
TOKEN_BLOCK = 128


def _varying_like(tree, *refs):
    """tree (float32 constants) made to vary over every manual mesh axis that any of refs varies over.

    Inside a shard_map the scan's carry must start with the type it ends with; constants are
    invariant, the step's values vary with the operands (e.g. over "data" and "tensor"). A select
    whose branch is a ref's element takes on the ref's variation and keeps the constant's value
    (JAX inserts the casts; XLA folds the select away). Without a mesh nothing changes.
    """
    zero = jnp.zeros((), jnp.float32)
    for r in refs:
        if r is not None and r.size:
            zero = jnp.where(True, zero, jnp.ravel(r)[0].astype(jnp.float32))
    return jax.tree.map(lambda x: x + zero, tree)


def mla_paged_attention_reference(
    q_nope: jax.Array,
    q_pe: jax.Array,
    ckv: jax.Array,
    kpe: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    plan: MLAPlan,
    *,
    sm_scale: float,
    return_lse: bool = False,
    ckv_scale: jax.Array | float | None = None,
    kpe_scale: jax.Array | float | None = None,
):
    """Same signature and contract as `jax_mla.mla_paged_attention`.

    Keys a token may not see (past its causal limit or its request's length, or
    on a page id outside the cache) never reach the output, whatever the cache
    holds there (garbage, NaN); a NaN in a query gives NaN in that row only.
    An fp8 cache is dequantized (fp8 x scale, float32) as it is gathered.
    """
    ckv_scale = check_scale("ckv_scale", ckv_scale, "ckv", ckv.dtype)
    kpe_scale = check_scale("kpe_scale", kpe_scale, "kpe", kpe.dtype)
    num_pages, page_size, d_ckv = ckv.shape
    d_kpe = kpe.shape[-1]
    num_tokens, num_heads = q_nope.shape[:2]
    max_pages = page_table.shape[1]
    capacity = max_pages * page_size
    req, n_vis = visible_keys(jnp.asarray(plan.tokens), kv_lens, capacity)

    pages_per_chunk = max(1, min(max_pages, KEY_CHUNK // page_size))
    n_chunks = -(-max_pages // pages_per_chunk)
    chunk = pages_per_chunk * page_size
    # Page-table columns padded to whole chunks with an id that is never valid.
    table = jnp.pad(page_table, ((0, 0), (0, n_chunks * pages_per_chunk - max_pages)), constant_values=-1)
    block = max(1, min(num_tokens, TOKEN_BLOCK))
    n_blocks = -(-num_tokens // block)
    pad_t = n_blocks * block - num_tokens
    f32 = jnp.float32
    hp = jax.lax.Precision.HIGHEST
    scale = f32(sm_scale)

    def blocks(x):  # [T, ...] -> [n_blocks, block, ...]; padding tokens see no key
        x = jnp.pad(x, ((0, pad_t),) + ((0, 0),) * (x.ndim - 1))
        return x.reshape((n_blocks, block) + x.shape[1:])

    def one_block(args):
        qn, qp, rq, nv = args
        qn, qp = qn.astype(f32), qp.astype(f32)
        pages = table[rq]  # [block, n_chunks * pages_per_chunk]

        def step(carry, c):
            m, l, acc = carry  # [block, H], [block, H], [block, H, d_ckv]
            pg = jax.lax.dynamic_slice_in_dim(pages, c * pages_per_chunk, pages_per_chunk, axis=1)
            ok = (pg >= 0) & (pg < num_pages)
            pg = jnp.clip(pg, 0, num_pages - 1)  # in bounds; masked below, never used
            pos = c * chunk + jnp.arange(chunk)
            seen = (pos[None, :] < nv[:, None]) & jnp.repeat(ok, page_size, axis=1)  # [block, chunk]
            k_c = jnp.where(seen[..., None], dequantize(ckv[pg].reshape(block, chunk, d_ckv), ckv_scale), 0.0)
            k_r = jnp.where(seen[..., None], dequantize(kpe[pg].reshape(block, chunk, d_kpe), kpe_scale), 0.0)
            s = (jnp.einsum("thd,tkd->thk", qn, k_c, precision=hp)
                 + jnp.einsum("thd,tkd->thk", qp, k_r, precision=hp)) * scale
            s = jnp.where(seen[:, None, :], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: zeros, not NaN
            alpha = jnp.exp(m - m_use)
            p = jnp.exp(s - m_use[..., None])
            l = l * alpha + jnp.sum(p, axis=-1)
            acc = acc * alpha[..., None] + jnp.einsum("thk,tkd->thd", p, k_c, precision=hp)
            return (m_new, l, acc), None

        init = _varying_like((jnp.full((block, num_heads), -jnp.inf, f32), jnp.zeros((block, num_heads), f32),
                              jnp.zeros((block, num_heads, d_ckv), f32)),
                             qn, qp, pages, nv, ckv, kpe, ckv_scale, kpe_scale)
        (m, l, acc), _ = jax.lax.scan(step, init, jnp.arange(n_chunks))
        out = acc / jnp.where(l > 0, l, 1.0)[..., None]
        m_use = jnp.where(m == -jnp.inf, 0.0, m)
        lse = jnp.where(l > 0, jnp.log(l) + m_use, -jnp.inf)
        lse = jnp.where(jnp.isnan(l), jnp.nan, lse)
        return out, lse

    out, lse = jax.lax.map(one_block, (blocks(q_nope), blocks(q_pe), blocks(req), blocks(n_vis)))
    out = out.reshape((-1, num_heads, d_ckv))[:num_tokens].astype(q_nope.dtype)
    lse = lse.reshape((-1, num_heads))[:num_tokens]
    return (out, lse) if return_lse else out
