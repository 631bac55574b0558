"""Argument checks shared by every backend of the op, run before any launch."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from .planner import MLAPlan, SUPPORTED_PAGE_SIZES
from .quant import check_scale, is_fp8

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _shape(name, x, rank):
    s = tuple(np.shape(x))
    if len(s) != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {s}")
    return s


def _dtype(x):
    d = getattr(x, "dtype", None)
    return jnp.dtype(d if d is not None else np.asarray(x).dtype)


def check_attention_args(q_nope, q_pe, ckv, kpe, page_table, kv_lens, plan, sm_scale, ckv_scale=None,
                         kpe_scale=None, fp8_products=False):
    """Raise ValueError / TypeError naming the offending argument and value. Returns
    (T, H, d_ckv, d_kpe, ckv_scale, kpe_scale), the scales as float32 [1] arrays or None."""
    t, h, d_ckv = _shape("q_nope", q_nope, 3)
    t2, h2, d_kpe = _shape("q_pe", q_pe, 3)
    p, ps, d_ckv2 = _shape("ckv", ckv, 3)
    p2, ps2, d_kpe2 = _shape("kpe", kpe, 3)
    r, max_pages = _shape("page_table", page_table, 2)
    (r2,) = _shape("kv_lens", kv_lens, 1)
    if (t2, h2) != (t, h):
        raise ValueError(f"q_pe tokens/heads {(t2, h2)} disagree with q_nope's {(t, h)}")
    if d_ckv2 != d_ckv:
        raise ValueError(f"ckv head dim {d_ckv2} disagrees with q_nope head dim {d_ckv}")
    if d_kpe2 != d_kpe:
        raise ValueError(f"kpe head dim {d_kpe2} disagrees with q_pe head dim {d_kpe}")
    if (p2, ps2) != (p, ps):
        raise ValueError(f"kpe pages/page_size {(p2, ps2)} disagree with ckv's {(p, ps)}")
    if ps not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"page_size={ps} (ckv.shape[1]) is not supported; use one of {SUPPORTED_PAGE_SIZES}")
    if min(d_ckv, d_kpe, p, max_pages, r) < 1:
        raise ValueError(f"empty dimension: d_ckv={d_ckv}, d_kpe={d_kpe}, pages={p}, max_pages={max_pages}, "
                         f"page_table rows={r} (pad the batch with idle requests instead)")
    qd = _dtype(q_nope)
    if is_fp8(qd):
        raise ValueError(f"q_nope dtype {qd.name}: queries are bfloat16 or float16 (only the cache may be fp8)")
    if qd not in FLOAT_DTYPES:
        raise TypeError(f"q_nope dtype {qd} is not supported; use bfloat16, float16 or float32")
    if _dtype(q_pe) != qd:
        raise TypeError(f"q_pe dtype {_dtype(q_pe)} differs from q_nope dtype {qd}")
    # The cache: q's dtype, or an fp8 ckv (kpe fp8 or q's dtype) with float32 scales.
    ckv_fp8, kpe_fp8 = is_fp8(_dtype(ckv)), is_fp8(_dtype(kpe))
    if (ckv_fp8 or kpe_fp8) and qd == jnp.dtype(jnp.float32):
        raise ValueError("an fp8 cache takes bfloat16 or float16 queries, got float32 q_nope")
    if fp8_products and not ckv_fp8:
        raise ValueError(f"fp8_products needs a float8_e4m3fn ckv; got ckv of dtype {_dtype(ckv).name}")
    if kpe_fp8 and not ckv_fp8:
        raise ValueError(f"kpe is float8_e4m3fn but ckv is {_dtype(ckv).name}: an fp8 kpe needs an fp8 ckv")
    for name, x, fp8 in (("ckv", ckv, ckv_fp8), ("kpe", kpe, kpe_fp8)):
        if not fp8 and _dtype(x) != qd:
            raise TypeError(f"{name} dtype {_dtype(x)} differs from q_nope dtype {qd} (and is not float8_e4m3fn)")
    ckv_scale = check_scale("ckv_scale", ckv_scale, "ckv", _dtype(ckv))
    kpe_scale = check_scale("kpe_scale", kpe_scale, "kpe", _dtype(kpe))
    for name, x in (("page_table", page_table), ("kv_lens", kv_lens)):
        if _dtype(x) != jnp.dtype(jnp.int32):
            raise TypeError(f"{name} must be int32, got {_dtype(x)}")
    if r2 < r:
        raise ValueError(f"kv_lens has {r2} entries but page_table has {r} rows")
    if not isinstance(plan, MLAPlan):
        raise TypeError(f"plan must be an MLAPlan from jax_mla.plan_mla, got {type(plan).__name__}")
    if plan.num_tokens != t:
        raise ValueError(f"plan was made for num_tokens={plan.num_tokens}, but q_nope has {t} tokens")
    if plan.num_heads != h:
        raise ValueError(f"plan was made for num_heads={plan.num_heads}, but q_nope has {h} heads")
    if plan.page_size != ps:
        raise ValueError(f"plan was made for page_size={plan.page_size}, but the cache has page_size {ps}")
    if plan.num_requests > r:
        raise ValueError(f"plan has {plan.num_requests} requests but page_table has only {r} rows")
    if not isinstance(sm_scale, (float, int, np.floating)) or not np.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite Python float, got {sm_scale!r}")
    check_host_tables(page_table, kv_lens, p, ps)
    return t, h, d_ckv, d_kpe, ckv_scale, kpe_scale


def check_host_tables(page_table, kv_lens, num_pages: int, page_size: int) -> None:
    """Value checks of host-known (NumPy) page tables and lengths; traced ones were checked when
    made, and device ones are clipped by every kernel (and dropped by the cache append)."""
    max_pages = np.shape(page_table)[1]
    pt = _host_value(page_table)
    if pt is not None and pt.size:
        bad = np.argwhere((pt < 0) | (pt >= num_pages))
        if bad.size:
            i, j = (int(v) for v in bad[0])
            raise ValueError(f"page_table[{i}, {j}] = {int(pt[i, j])} is outside the cache's {num_pages} pages")
    kl = _host_value(kv_lens)
    if kl is not None and kl.size:
        cap = max_pages * page_size
        over = np.nonzero((kl > cap) | (kl < 0))[0]
        if over.size:
            i = int(over[0])
            raise ValueError(f"kv_lens[{i}] = {int(kl[i])} is outside [0, {cap}] "
                             f"(page_table holds {max_pages} pages x {page_size} tokens per request)")


def _host_value(x):
    """The value of x if it lives on the host (NumPy), else None.

    jax.Arrays are never read back here: that would be the device->host sync
    the whole design avoids. Kernels clip instead, so bad device values cannot
    cause out-of-bounds reads.
    """
    if isinstance(x, np.ndarray):
        return x
    return None
