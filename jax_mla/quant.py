"""The FP8 (e4m3) latent cache format: value = fp8 x scale, one float32 scale per cache tensor.

A cache tensor stored as ``float8_e4m3fn`` comes with its scale, a float32 device scalar (shape
``()`` or ``(1,)``) passed as an operand, not a static argument: a new scale (recalibration) does not
retrace. Writing quantizes (`quantize_fp8`: x / scale, rounded to nearest even, saturated to ±448,
NaN kept NaN); reading dequantizes (`dequantize`), in float32 in the reference and the CPU handler.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FP8_DTYPE", "FP8_MAX", "fp8_scale", "quantize_fp8", "dequantize", "is_fp8"]

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0  # largest finite e4m3fn value


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) == FP8_DTYPE


def fp8_scale(x: jax.Array) -> jax.Array:
    """A calibration scale for `x`: amax(|x|) / 448 as a float32 scalar (1.0 when x is all zeros or
    not finite), so that x's largest magnitude lands on e4m3's largest value."""
    amax = jnp.max(jnp.abs(jnp.asarray(x, jnp.float32)))
    return jnp.where(jnp.isfinite(amax) & (amax > 0), amax / FP8_MAX, 1.0).astype(jnp.float32)


def quantize_fp8(x: jax.Array, scale) -> jax.Array:
    """x / scale as float8_e4m3fn: round to nearest even, saturate to ±448 (inf included), NaN stays NaN."""
    y = jnp.asarray(x, jnp.float32) / jnp.reshape(jnp.asarray(scale, jnp.float32), ())
    return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)  # clip keeps NaN


def dequantize(x: jax.Array, scale) -> jax.Array:
    """float32 values of a cache tensor: fp8 x scale, or x itself when `scale` is None."""
    x = x.astype(jnp.float32)
    return x if scale is None else x * jnp.reshape(jnp.asarray(scale, jnp.float32), ())


def check_scale(name: str, scale, cache_name: str, cache_dtype):
    """The scale operand of a cache tensor as a float32 [1] array, or None for an unquantized one.

    An fp8 tensor needs its scale; a scale for a tensor that is not fp8 is refused rather than
    silently ignored. Host-known scales must be finite and positive."""
    if not is_fp8(cache_dtype):
        if scale is not None:
            raise ValueError(f"{name} is given but {cache_name} is {jnp.dtype(cache_dtype).name}, not "
                             f"float8_e4m3fn (scales belong to fp8 caches only)")
        return None
    if scale is None:
        raise ValueError(f"{cache_name} is float8_e4m3fn: pass {name} (a float32 scalar; value = fp8 x scale)")
    if isinstance(scale, (float, int, np.floating, np.integer)) and not isinstance(scale, bool):
        scale = np.float32(scale)
    dtype = getattr(scale, "dtype", None)
    if dtype is None or jnp.dtype(dtype) != jnp.float32:
        raise ValueError(f"{name} must be float32, got {dtype if dtype is not None else type(scale).__name__}")
    if np.shape(scale) not in ((), (1,)):
        raise ValueError(f"{name} must be a scalar (shape () or (1,)), got shape {np.shape(scale)}")
    if isinstance(scale, (np.ndarray, np.floating)):
        v = float(np.reshape(scale, ()))
        if not (np.isfinite(v) and v > 0):
            raise ValueError(f"{name} = {v} must be finite and > 0")
    return jnp.reshape(jnp.asarray(scale, jnp.float32), (1,))
