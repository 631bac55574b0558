"""Writing new latent-cache rows into their pages, in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._validate import check_host_tables
from .planner import MLAPlan
from .quant import check_scale, quantize_fp8


def cache_slots(page_table: jax.Array, kv_lens: jax.Array, plan: MLAPlan, num_pages: int) -> jax.Array:
    """Flat slot (page * page_size + offset) of each new token, or an out-of-range
    index (dropped by the scatter) for padding tokens, invalid pages and positions
    outside the request's page-table row.

    Token with offset e from its request's end sits at position kv_len - e: the
    kv lengths already include the new tokens, as in the op. A device length past
    the row's capacity drops the tokens that do not fit; it is never clipped onto
    the row's last positions (that would overwrite cached keys).
    """
    ps = plan.page_size
    capacity = page_table.shape[1] * ps
    tokens = jnp.asarray(plan.tokens)
    req, e = tokens[:, 0], tokens[:, 1]
    req_c = jnp.where(req >= 0, req, 0)
    pos = kv_lens[req_c] - e  # int32: a length is < 2^31 and e >= 1
    in_row = (req >= 0) & (pos >= 0) & (pos < capacity)
    page = page_table[req_c, jnp.clip(pos, 0, capacity - 1) // ps]
    ok = in_row & (page >= 0) & (page < num_pages)
    # Dropped rows get distinct out-of-range slots so the scatter's indices stay unique.
    dropped = num_pages * ps + jnp.arange(req.shape[0], dtype=page.dtype)
    return jnp.where(ok, page * ps + pos % ps, dropped)


def append_paged_kv(
    ckv: jax.Array,
    kpe: jax.Array,
    ckv_new: jax.Array,
    kpe_new: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    plan: MLAPlan,
    *,
    ckv_scale: jax.Array | float | None = None,
    kpe_scale: jax.Array | float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Write new rows ckv_new [T, d_ckv] and kpe_new [T, d_kpe] into the caches.

    Token t of the plan goes to its request's position ``kv_lens[r] - e_t``.
    A float8_e4m3fn cache tensor takes its scale (``ckv_scale`` / ``kpe_scale``, float32 scalars)
    and the rows are quantized as they are written (jax_mla.quant.quantize_fp8: x / scale, round
    to nearest even, saturate to ±448, NaN stays NaN); other caches take the rows cast to their dtype.
    Returns the updated (ckv, kpe). Inside `jax.jit` with the caches donated
    (``donate_argnums``) XLA updates them in place: only T rows are written, the
    cache is never copied (tests/test_cache.py checks the buffer and the HLO).
    """
    num_pages, ps, d_ckv = ckv.shape
    d_kpe = kpe.shape[-1]
    t = plan.num_tokens
    if ckv_new.shape != (t, d_ckv):
        raise ValueError(f"ckv_new must have shape {(t, d_ckv)}, got {ckv_new.shape}")
    if kpe_new.shape != (t, d_kpe):
        raise ValueError(f"kpe_new must have shape {(t, d_kpe)}, got {kpe_new.shape}")
    if kpe.shape[:2] != (num_pages, ps):
        raise ValueError(f"kpe pages/page_size {kpe.shape[:2]} disagree with ckv's {(num_pages, ps)}")
    if plan.page_size != ps:
        raise ValueError(f"plan was made for page_size={plan.page_size}, but the cache has page_size {ps}")
    if plan.num_requests > np.shape(page_table)[0] or plan.num_requests > np.shape(kv_lens)[0]:
        raise ValueError(f"plan has {plan.num_requests} requests but page_table has {np.shape(page_table)[0]} rows "
                         f"and kv_lens {np.shape(kv_lens)[0]} entries")
    check_host_tables(page_table, kv_lens, num_pages, ps)  # as the op does: a bad host value raises
    ckv_scale = check_scale("ckv_scale", ckv_scale, "ckv", ckv.dtype)
    kpe_scale = check_scale("kpe_scale", kpe_scale, "kpe", kpe.dtype)

    def stored(rows, cache, scale):
        return rows.astype(cache.dtype) if scale is None else quantize_fp8(rows, scale)

    slots = cache_slots(page_table, kv_lens, plan, num_pages)
    ckv = ckv.reshape(num_pages * ps, d_ckv).at[slots].set(stored(ckv_new, ckv, ckv_scale), mode="drop",
                                                           unique_indices=True)
    kpe = kpe.reshape(num_pages * ps, d_kpe).at[slots].set(stored(kpe_new, kpe, kpe_scale), mode="drop",
                                                           unique_indices=True)
    return ckv.reshape(num_pages, ps, d_ckv), kpe.reshape(num_pages, ps, d_kpe)
