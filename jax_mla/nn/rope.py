"""Rotary position embedding as DeepSeek-V2/V3 use it: default or YaRN frequencies,
interleaved or half-split pair layout.

Pairs: with `interleave=True` (every DeepSeek checkpoint) dims (x0, x1), (x2, x3), ...
are rotated by frequencies 0, 1, ...; with `interleave=False` (weights permuted
ahead of time) dims (x_i, x_{i+d/2}) are. The output keeps the input's layout, so
q_pe and k_pe, rotated the same way, give the same dot product either way.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .config import DeepseekConfig

__all__ = ["rope_inv_freq", "rope_cos_sin", "apply_rope"]


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    # The dim index whose wavelength fits `num_rotations` times into max_pos.
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def rope_inv_freq(cfg: DeepseekConfig) -> np.ndarray:
    """Inverse frequencies [qk_rope_head_dim // 2] float32 (YaRN-blended when configured).

    YaRN keeps the fast dims (index < low) at their original frequency, divides
    the slow ones (index > high) by the factor, and ramps linearly between;
    low/high come from beta_fast/beta_slow rotations over the original context.
    """
    dim = cfg.qk_rope_head_dim
    base = float(cfg.rope_theta)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq = 1.0 / pos_freqs
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq.astype(np.float32)
    factor = cfg.yarn_factor
    beta_fast = rs.beta_fast or 32.0
    beta_slow = rs.beta_slow or 1.0
    orig = cfg.original_max_position_embeddings
    low = _yarn_correction_dim(beta_fast, dim, base, orig)
    high = _yarn_correction_dim(beta_slow, dim, base, orig)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid 0/0 in the ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # weight of the original (extrapolated) frequency
    blended = (inv_freq / factor) * (1.0 - keep) + inv_freq * keep
    return blended.astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array | np.ndarray, attention_factor: float = 1.0):
    """cos, sin [..., d/2] float32 of angles position * inv_freq, times attention_factor (YaRN's mscale)."""
    inv = jnp.asarray(inv_freq, jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv.reshape((1,) * positions.ndim + inv.shape)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleave: bool) -> jax.Array:
    """Rotate the last dim of x [..., d] by cos/sin [..., d/2] (broadcast over x's middle dims).

    Computed in float32; the result has x's dtype and layout.
    """
    d = x.shape[-1]
    xf = x.astype(jnp.float32)
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xf.shape)
    else:
        x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
