"""The public op: paged MLA attention in the absorbed form."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from . import _ffi
from ._validate import check_attention_args
from .planner import MLAPlan
from .reference import mla_paged_attention_reference

__all__ = ["mla_paged_attention", "resolve_backend", "export_disabled_checks", "register_ffi_targets", "BACKENDS"]

BACKENDS = ("auto", "ffi", "reference")

# Head dims the CUDA kernels are compiled for (ffi/cuda). Other dims use the
# CPU handler on CPU and the reference on GPU.
CUDA_DIMS = ((512, 64),)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def resolve_backend(backend: str, d_ckv: int, d_kpe: int) -> str:
    """What `backend` ('auto', 'ffi' or 'reference') runs as on JAX's default platform for these head
    dims: 'ffi' or 'reference'. Raises ValueError for 'ffi' where no kernel is built for them."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "reference":
        return backend
    platform = jax.default_backend()
    built = _ffi.has_ffi(platform)
    ok = built and (platform == "cpu" or (d_ckv, d_kpe) in CUDA_DIMS)
    if not ok:
        why = (_ffi.unavailable_reason(platform) if not built else
               f"the CUDA kernels are built for (d_ckv, d_kpe) in {CUDA_DIMS}")
        if backend == "ffi":
            raise ValueError(f"backend='ffi' has no kernel for platform {platform!r} with "
                             f"d_ckv={d_ckv}, d_kpe={d_kpe}: {why}")
        if not built and platform != "cpu":
            _warn_once(f"jax_mla: no {platform} kernel ({why}); backend='auto' runs the jax.numpy reference")
    return "ffi" if ok else "reference"


def export_disabled_checks() -> list:
    """The `disabled_checks` that `jax.export.export` needs for a function that calls the op.

    JAX exports only custom calls with a compatibility guarantee, and the op's (target
    ``jax_mla_paged_attention``, the same on every platform) has none across jax_mla versions: its
    operands, attributes and the plan's layout may change. An artifact exported with these checks
    disabled runs where the same jax_mla version is installed (CPU, or a GPU the CUDA handler was
    built for), with plans of the bucket shapes it was exported with, once `register_ffi_targets`
    has run in that process::

        exported = jax.export.export(jax.jit(step), disabled_checks=jax_mla.export_disabled_checks())(*args)
    """
    return [export.DisabledSafetyCheck.custom_call(_ffi.ATTENTION_TARGET)]


def register_ffi_targets(platform: str | None = None) -> frozenset[str]:
    """Registers the op's handlers with XLA for `platform` ('cpu', or 'gpu' / 'cuda'; default: JAX's
    default backend) and returns the platforms registered so far.

    The op registers them itself when it is traced. Call this first where a process runs the custom
    call without tracing the op: a deserialized `jax.export` artifact. Raises RuntimeError, saying
    why, when the platform has no handler (a build without CUDA, or no code for the GPU's arch).
    """
    platform = jax.default_backend() if platform is None else platform
    if platform not in ("cpu", "gpu", "cuda"):
        raise ValueError(f"platform={platform!r}: jax_mla has handlers for 'cpu' and 'gpu' / 'cuda'")
    if not _ffi.has_ffi(platform):
        raise RuntimeError(f"jax_mla: no {platform} handler: {_ffi.unavailable_reason(platform)}")
    return _ffi.registered_platforms()


def mla_paged_attention(
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
    backend: str = "auto",
    ckv_scale: jax.Array | float | None = None,
    kpe_scale: jax.Array | float | None = None,
    fp8_products: bool = False,
):
    """Paged Multi-head Latent Attention (absorbed form) over a paged latent cache.

    Shapes (T query tokens of all requests back to back, H heads, P pages):
      q_nope     [T, H, d_ckv]  queries with W_UK absorbed (d_ckv = kv_lora_rank, 512 in DeepSeek)
      q_pe       [T, H, d_kpe]  rotary part of the queries (64 in DeepSeek)
      ckv        [P, page_size, d_ckv]  compressed kv cache; keys *and* values
      kpe        [P, page_size, d_kpe]  rotary key cache
      page_table [R, max_pages] int32   page ids of request r's positions
                                        [j*page_size, (j+1)*page_size)
      kv_lens    [>=R] int32            kv length of each request, *including*
                                        its new tokens (read on the device)
      plan       MLAPlan from `plan_mla` (host-made; which tokens belong to which
                 request, how the work is split)
    Keys are the two caches side by side; they are never concatenated:
      score(t, h, k) = sm_scale * (q_nope[t,h]·ckv[k] + q_pe[t,h]·kpe[k])
      out(t, h)      = sum_k softmax_k(score) * ckv[k]
    Request r's query tokens are rows qo_indptr[r]:qo_indptr[r+1] (from the
    plan). Query i of a request's n tokens sees keys [0, L - n + i + 1), L its
    kv length (causal, aligned to the end; decode is n = 1). A token that sees
    no key (L = 0, or a padding token) gets output 0 and LSE -inf, never NaN.
    NaN in, NaN out: a NaN (or inf) in a query row, or NaN in a cache row that a
    token sees, makes exactly those (token, head) rows NaN in out and LSE, on
    every backend; cache slots a token does not see never reach its output.
    q, ckv and kpe share one dtype: bfloat16, float16 or float32, except for an
    FP8 cache (jax_mla.quant): ckv stored as float8_e4m3fn with its float32 scale
    `ckv_scale` (shape () or (1,), a device operand: a new value does not retrace),
    kpe in the query dtype or float8_e4m3fn with `kpe_scale`; the cache's value is
    fp8 x scale. Queries are then bfloat16 or float16.

    Returns out [T, H, d_ckv] in the query dtype, and with return_lse=True also
    lse [T, H] float32: the natural-log log-sum-exp of the scaled scores
    (log base e; FlashInfer reports log2). Scores, softmax and sums are float32.
    Where the plan splits a request's keys over several units, each split's
    output rows are rounded to the query dtype before the merge combines them by
    their float32 LSEs (as FlashInfer's split-KV partials are), so a split row
    carries two roundings of that dtype where an unsplit row carries one (bf16:
    ~2.4e-3 against ~1.8e-3 relative norm from the float32 reference).

    backend: 'auto' (the FFI kernel of the current platform when it has one for
    these head dims, else the reference), 'ffi' or 'reference'.

    fp8_products (an fp8 ckv only; off by default): allows e4m3 x e4m3 products, lossy. Where a
    kernel has them, the latent queries are rounded to e4m3 per row (times a power of two) and the
    probabilities to e4m3, and both products run on fp8 tensor cores: today the sm_90a body of
    units of 64 heads or more on pages of >= 32 keys, which then runs ~1.2x as fast as a bf16 cache
    at 128 heads instead of ~0.8x (H200). The output moves ~3-5e-2 (relative norm, random data)
    from the float32 reference on the dequantized cache, against ~2e-3 without it; the LSE of a row
    that sees few keys moves by about the error of one score (emulated with scores of std ~2: ~0.05
    rms, up to ~0.25; tools/e4m3_lossy_error.py --lse). Everywhere else
    (other units, archs, the CPU handler, the reference) the op computes as without it.
    """
    t, h, d_ckv, d_kpe, ckv_scale, kpe_scale = check_attention_args(
        q_nope, q_pe, ckv, kpe, page_table, kv_lens, plan, sm_scale, ckv_scale, kpe_scale, fp8_products)
    which = resolve_backend(backend, d_ckv, d_kpe)
    if which == "reference":
        return mla_paged_attention_reference(q_nope, q_pe, ckv, kpe, page_table, kv_lens, plan,
                                             sm_scale=sm_scale, return_lse=return_lse, ckv_scale=ckv_scale,
                                             kpe_scale=kpe_scale)
    out_types = (
        jax.ShapeDtypeStruct((t, h, d_ckv), q_nope.dtype),
        jax.ShapeDtypeStruct((t, h), jnp.float32),
        # Workspace for split partials, sized by the plan's bucket: XLA allocates
        # it with the other buffers, so the handler never allocates. A split's
        # rows are normalised and rounded to the output's dtype (as FlashInfer's
        # split-KV partials are): half the bytes of float32 for the split units
        # to write and the merge to read; their LSEs stay float32.
        jax.ShapeDtypeStruct((plan.num_partial_rows, h, d_ckv), q_nope.dtype),
        jax.ShapeDtypeStruct((plan.num_partial_rows, h), jnp.float32),
    )
    call = jax.ffi.ffi_call(_ffi.ATTENTION_TARGET, out_types, vmap_method="sequential")
    # Scales are operands of every call (1 for an unquantized tensor: a constant of the program).
    one = jnp.ones((1,), jnp.float32)
    out, lse, _, _ = call(q_nope, q_pe, ckv, kpe, page_table, kv_lens,
                          jnp.asarray(plan.work, jnp.int32), jnp.asarray(plan.merge, jnp.int32),
                          one if ckv_scale is None else ckv_scale, one if kpe_scale is None else kpe_scale,
                          sm_scale=np.float32(sm_scale), fp8_products=np.int32(bool(fp8_products)))
    return (out, lse) if return_lse else out
