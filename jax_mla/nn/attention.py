"""Flax NNX Multi-head Latent Attention with DeepSeek-V2/V3 semantics over a paged latent cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ..attention import mla_paged_attention
from ..cache import append_paged_kv
from ..paging import PagedBatch, PagedKV, token_positions
from ..parallel import DATA, TENSOR, local_plan, mesh_sizes, shard_map
from ..quant import dequantize, is_fp8, quantize_fp8
from .config import DeepseekConfig
from .rope import apply_rope, rope_cos_sin, rope_inv_freq

__all__ = ["PagedKV", "PagedBatch", "RMSNorm", "MLAAttention", "token_positions", "FORMS"]

FORMS = ("absorbed", "expanded")


def stored_values(x: jax.Array, dtype, scale, compute_dtype) -> jax.Array:
    """x as the cache holds it, in compute_dtype: cast to the cache dtype, or for an fp8 cache
    quantized and dequantized (so the expanded form sees the values the cache stores)."""
    if scale is None:
        return x.astype(dtype).astype(compute_dtype)
    return dequantize(quantize_fp8(x, scale), scale).astype(compute_dtype)


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, normalised in float32 (as transformers' DeepseekV3RMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, dtype=None, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = float(eps)
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        out_dtype = self.dtype or x.dtype
        w = self.weight[...].reshape((1,) * (x.ndim - 1) + (-1,))
        return (w * y.astype(x.dtype)).astype(out_dtype)


class MLAAttention(nnx.Module):
    """DeepSeek-V2/V3 Multi-head Latent Attention.

    Weights (HF names): q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj;
    kv_a_proj_with_mqa (-> compressed kv [kv_lora_rank] and k_pe [rope dim]);
    kv_a_layernorm; kv_b_proj held as its two halves per head,
    w_uk [H, qk_nope_head_dim, kv_lora_rank] and w_uv [H, v_head_dim, kv_lora_rank];
    o_proj. nnx.Linear kernels are [in, out] (HF's weight transposed).

    The cache holds the normalised compressed kv and the roped k_pe of every
    token, in two arrays. Two ways to attend, same result:
      absorbed: q_nope @ W_UK -> [T, H, kv_lora_rank], the paged op over the
        cache, then @ W_UV. For decode and extends over a cached prefix.
      expanded: k_nope = ckv @ W_UK^T and v = ckv @ W_UV^T for this step's tokens,
        standard attention among them. Only for batches whose requests have no
        cached prefix (fresh prompts: kv_len == q_len); cheaper for long prompts.
    Scores are q_nope.k_nope + q_pe.k_pe on both paths: the nope and rope parts
    are never concatenated.
    """

    def __init__(self, cfg: DeepseekConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32,
                 precision=None):
        self.cfg = cfg
        self.dtype = dtype
        self.precision = precision
        h, r = cfg.num_attention_heads, cfg.kv_lora_rank
        dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim

        def linear(n_in, n_out, bias):
            return nnx.Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                              precision=precision, rngs=rngs)

        if cfg.q_lora_rank is None:
            self.q_proj = linear(cfg.hidden_size, h * cfg.qk_head_dim, False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = linear(cfg.hidden_size, cfg.q_lora_rank, cfg.attention_bias)
            # DeepSeek builds the two latent norms with the default eps (1e-6), not rms_norm_eps.
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, dtype=dtype, param_dtype=param_dtype)
            self.q_b_proj = linear(cfg.q_lora_rank, h * cfg.qk_head_dim, False)
        self.kv_a_proj_with_mqa = linear(cfg.hidden_size, r + dr, cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(r, dtype=dtype, param_dtype=param_dtype)
        init = nnx.initializers.normal(stddev=r ** -0.5)
        self.w_uk = nnx.Param(init(rngs.params(), (h, dn, r), param_dtype))
        self.w_uv = nnx.Param(init(rngs.params(), (h, dv, r), param_dtype))
        self.o_proj = linear(h * dv, cfg.hidden_size, cfg.attention_bias)

    # ---- pieces -------------------------------------------------------------
    def queries(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """q_nope [T, H, qk_nope_head_dim] and unroped q_pe [T, H, qk_rope_head_dim]."""
        cfg = self.cfg
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(x.shape[0], cfg.num_attention_heads, cfg.qk_head_dim)
        return q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]

    def latents(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Normalised compressed kv [T, kv_lora_rank] and unroped k_pe [T, qk_rope_head_dim]."""
        kv = self.kv_a_proj_with_mqa(x)
        r = self.cfg.kv_lora_rank
        return self.kv_a_layernorm(kv[:, :r]), kv[:, r:]

    def rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Rope x [T, ..., rope_dim] at positions [T]."""
        cfg = self.cfg
        cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg), cfg.rope_attention_factor)
        extra = (1,) * (x.ndim - 2)
        cos = cos.reshape(cos.shape[:1] + extra + cos.shape[1:])
        sin = sin.reshape(sin.shape[:1] + extra + sin.shape[1:])
        return apply_rope(x, cos, sin, interleave=cfg.rope_interleave)

    # ---- forward ------------------------------------------------------------
    def __call__(self, x: jax.Array, kv: PagedKV, batch: PagedBatch, *, form: str = "absorbed",
                 backend: str = "auto", mesh: jax.sharding.Mesh | None = None,
                 fp8_products: bool = False) -> tuple[jax.Array, PagedKV]:
        """x [T, hidden] (the plan's T query tokens) -> (y [T, hidden], updated cache).

        This step's compressed kv and k_pe are written to the cache at their
        positions (kv_len - e) before attending, so queries see them. Pass the
        cache arrays donated into the jitted step and the writes happen in place.

        mesh: a (data, tensor) mesh (jax_mla.parallel): x holds the data shards' tokens back to back,
        the cache, page table and kv lengths are sharded over data, the plan is one plan per data
        shard stacked (`stack_plans`) for the local heads, and the paged part (positions, append,
        attention) runs per shard in a `shard_map`; the projections follow the parameters'
        shardings (heads over tensor, jax_mla.nn.sharding).

        fp8_products: with an fp8 cache, the op's lossy e4m3 x e4m3 option (`mla_paged_attention`) for
        the absorbed form's paged attention; the expanded form ignores it.
        """
        if form not in FORMS:
            raise ValueError(f"form={form!r} is not one of {FORMS}")
        cfg = self.cfg
        t = x.shape[0]
        shards = 1 if mesh is None else mesh_sizes(mesh)[0]
        if t != shards * batch.plan.num_tokens:
            raise ValueError(f"x has {t} tokens but the plan was made for {batch.plan.num_tokens}"
                             + ("" if mesh is None else f" per data shard x {shards} shards"))
        h, dv = cfg.num_attention_heads, cfg.v_head_dim
        q_nope, q_pe = self.queries(x)
        ckv_new, kpe_new = self.latents(x)
        w_uk = self.w_uk[...].astype(self.dtype)
        w_uv = self.w_uv[...].astype(self.dtype)
        if form == "absorbed":
            q_nope = jnp.einsum("thd,hdr->thr", q_nope, w_uk, precision=self.precision)
        attend = functools.partial(self._attend_paged, form=form, backend=backend, fp8_products=fp8_products)
        if mesh is None:
            o, kv = attend(q_nope, q_pe, ckv_new, kpe_new, kv, batch, w_uk, w_uv)
        else:
            heads, rows, shard = P(DATA, TENSOR, None), P(DATA, None), P(DATA)
            kv_spec = PagedKV(shard, shard, P(), P())
            o, kv = shard_map(
                lambda q, qr, c, k, kv, b, wk, wv: attend(q, qr, c, k, kv, b._replace(plan=local_plan(b.plan)),
                                                          wk, wv),
                mesh=mesh, in_specs=(heads, heads, rows, rows, kv_spec, PagedBatch(shard, shard, shard),
                                     P(TENSOR), P(TENSOR)),
                out_specs=(heads, kv_spec))(q_nope, q_pe, ckv_new, kpe_new, kv, batch, w_uk, w_uv)
        if form == "absorbed":
            o = jnp.einsum("thr,hvr->thv", o.astype(self.dtype), w_uv, precision=self.precision)
        y = self.o_proj(o.reshape(t, h * dv).astype(self.dtype))
        return y, kv

    def _attend_paged(self, q, q_pe, ckv_new, kpe_new, kv: PagedKV, batch: PagedBatch, w_uk, w_uv, *,
                      form: str, backend: str, fp8_products: bool = False) -> tuple[jax.Array, PagedKV]:
        """One device's paged part: rope at the tokens' positions, append, attend.

        q is q_nope with W_UK absorbed (absorbed form) or q_nope itself (expanded). Returns the
        latent output [T, H, kv_lora_rank] (absorbed) or the values [T, H, v_head_dim] (expanded),
        and the cache with this step's rows written.
        """
        cfg = self.cfg
        # Queries and new rows go to the op in the cache's dtype; with an fp8 cache (jax_mla.quant),
        # in kpe's dtype (bf16 / f16; bf16 for an fp8 kpe), and the append quantizes them.
        cache_dtype = kv.kpe.dtype if not is_fp8(kv.kpe.dtype) else jnp.dtype(jnp.bfloat16)
        positions = token_positions(batch)
        q_pe = self.rope(q_pe, positions)
        kpe_new = self.rope(kpe_new, positions)
        # The append casts (or quantizes) the new rows once.
        ckv, kpe = append_paged_kv(kv.ckv, kv.kpe, ckv_new, kpe_new, batch.page_table, batch.kv_lens,
                                   batch.plan, ckv_scale=kv.ckv_scale, kpe_scale=kv.kpe_scale)
        if form == "absorbed":
            o = mla_paged_attention(q.astype(cache_dtype), q_pe.astype(cache_dtype), ckv, kpe,
                                    batch.page_table, batch.kv_lens, batch.plan, sm_scale=cfg.softmax_scale,
                                    backend=backend, ckv_scale=kv.ckv_scale, kpe_scale=kv.kpe_scale,
                                    fp8_products=fp8_products)
        else:
            # Both forms attend to the values as stored (cache dtype) so they agree in bf16 and fp8 too.
            o = self._expanded_attention(q, q_pe, stored_values(ckv_new, kv.ckv.dtype, kv.ckv_scale, cache_dtype),
                                         stored_values(kpe_new, kv.kpe.dtype, kv.kpe_scale, cache_dtype),
                                         jnp.asarray(batch.plan.tokens), w_uk, w_uv)
        return o, PagedKV(ckv, kpe, kv.ckv_scale, kv.kpe_scale)

    def _expanded_attention(self, q_nope, q_pe, ckv_new, kpe_new, tokens, w_uk, w_uv):
        """Standard attention among this step's tokens, k/v expanded from the latents.

        Token j is visible to token i when both belong to the same request and j
        is not later (offset from the end e_j >= e_i). Float32 softmax; tokens
        that see nothing (padding) give zeros.
        """
        f32 = jnp.float32
        hp = self.precision
        c = ckv_new.astype(self.dtype)
        k_nope = jnp.einsum("sr,hdr->shd", c, w_uk, precision=hp).astype(f32)
        v = jnp.einsum("sr,hvr->shv", c, w_uv, precision=hp).astype(f32)
        s = (jnp.einsum("thd,shd->hts", q_nope.astype(f32), k_nope, precision=hp)
             + jnp.einsum("thd,sd->hts", q_pe.astype(f32), kpe_new.astype(f32), precision=hp))
        s = s * jnp.float32(self.cfg.softmax_scale)
        req, e = tokens[:, 0], tokens[:, 1]
        visible = (req[:, None] == req[None, :]) & (req[:, None] >= 0) & (e[None, :] >= e[:, None])
        s = jnp.where(visible[None], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - m)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(denom > 0, denom, 1.0)
        return jnp.einsum("hts,shv->thv", p, v, precision=hp)
