"""Pure `jax.numpy` paged MLA attention: the ground truth for every backend.

It follows the op's contract literally (per-token request, causal limit from the
device kv length, page gather) and ignores how the plan splits the work; only
the plan's per-token table is read. Computes in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .planner import MLAPlan


def visible_keys(plan_tokens: jax.Array, kv_lens: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Per query token: its request (clamped to >= 0) and how many keys it sees.

    A token with offset e from the end of its request's query block sees keys
    [0, min(kv_len, capacity) - e + 1); padding tokens (request -1) see none.
    """
    req = plan_tokens[:, 0]
    e = plan_tokens[:, 1]
    valid = req >= 0
    req_c = jnp.where(valid, req, 0)
    kv = jnp.clip(kv_lens[req_c], 0, capacity)
    n_vis = jnp.where(valid, jnp.maximum(kv - e + 1, 0), 0)
    return req_c, n_vis


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
):
    """Same signature and contract as `jax_mla.mla_paged_attention`."""
    num_pages, page_size, d_ckv = ckv.shape
    max_pages = page_table.shape[1]
    capacity = max_pages * page_size
    req, n_vis = visible_keys(jnp.asarray(plan.tokens), kv_lens, capacity)

    # Gather each token's request's keys: [T, capacity, d]. Out-of-range page ids
    # are masked, never read (clip keeps the gather in bounds).
    pages = page_table[req]  # [T, max_pages]
    page_ok = (pages >= 0) & (pages < num_pages)
    pages_c = jnp.clip(pages, 0, num_pages - 1)
    k_c = ckv[pages_c].reshape(pages.shape[0], capacity, d_ckv).astype(jnp.float32)
    k_r = kpe[pages_c].reshape(pages.shape[0], capacity, kpe.shape[-1]).astype(jnp.float32)
    pos = jnp.arange(capacity)
    mask = (pos[None, :] < n_vis[:, None]) & jnp.repeat(page_ok, page_size, axis=1)

    qn = q_nope.astype(jnp.float32)
    qp = q_pe.astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    s = (jnp.einsum("thd,tkd->thk", qn, k_c, precision=hp)
         + jnp.einsum("thd,tkd->thk", qp, k_r, precision=hp)) * jnp.float32(sm_scale)
    s = jnp.where(mask[:, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("thk,tkd->thd", p, k_c, precision=hp) / jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom[..., 0] > 0, jnp.log(denom[..., 0]) + m_safe[..., 0], -jnp.inf)
    out = out.astype(q_nope.dtype)
    return (out, lse) if return_lse else out
