"""A small dense DeepSeek-style causal LM built on MLAAttention (the demo model).

embed -> N x [RMSNorm, MLAAttention, +residual, RMSNorm, SwiGLU MLP, +residual] -> RMSNorm -> lm_head,
with the parameter names of transformers' DeepseekV3ForCausalLM, so dense HF
checkpoints (every layer below first_k_dense_replace) load one to one. MoE layers
are not implemented.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ..paging import PagedBatch, PagedKV
from ..parallel import on_data_shards
from .attention import MLAAttention, RMSNorm
from .config import DeepseekConfig

__all__ = ["SwiGLU", "DecoderLayer", "DeepseekModel"]


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, *, bias: bool, rngs: nnx.Rngs, dtype, param_dtype,
                 precision=None):
        kw = dict(use_bias=bias, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.gate_proj = nnx.Linear(hidden, intermediate, **kw)
        self.up_proj = nnx.Linear(hidden, intermediate, **kw)
        self.down_proj = nnx.Linear(intermediate, hidden, **kw)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DeepseekConfig, *, rngs: nnx.Rngs, dtype, param_dtype, precision=None,
                 with_mlp: bool = True):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.self_attn = MLAAttention(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype, precision=precision)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype,
                                                param_dtype=param_dtype)
        self.mlp = (SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, rngs=rngs, dtype=dtype,
                           param_dtype=param_dtype, precision=precision) if with_mlp else None)

    def __call__(self, x, kv: PagedKV, batch: PagedBatch, *, form: str, backend: str, mesh=None,
                 fp8_products: bool = False):
        a, kv = self.self_attn(self.input_layernorm(x), kv, batch, form=form, backend=backend, mesh=mesh,
                               fp8_products=fp8_products)
        x = x + a
        if self.mlp is not None:
            x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv


class DeepseekModel(nnx.Module):
    """Dense DeepSeek-V2/V3-style causal LM over a paged latent cache.

    `with_mlp=False` drops the MLPs (an attention-only stack, for benchmarks).
    """

    def __init__(self, cfg: DeepseekConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32,
                 precision=None, with_mlp: bool = True):
        moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        if moe and with_mlp:
            raise ValueError(f"layers {moe} of this config are MoE layers; DeepseekModel implements dense MLPs "
                             "only (load the attention weights alone with jax_mla.nn.hf.load_attention)")
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype,
                                      rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                                             precision=precision, with_mlp=with_mlp)
                                for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dtype,
                                   param_dtype=param_dtype, precision=precision, rngs=rngs))

    def __call__(self, tokens: jax.Array, caches: Sequence[PagedKV], batch: PagedBatch, *,
                 form: str = "absorbed", backend: str = "auto", logits_rows: jax.Array | None = None,
                 mesh: jax.sharding.Mesh | None = None,
                 fp8_products: bool = False) -> tuple[jax.Array, tuple[PagedKV, ...]]:
        """tokens [T] int32 (the plan's query tokens) -> (float32 logits, updated caches).

        logits_rows picks the rows to project to the vocabulary (e.g. the last token of
        each prompt); default all T rows. [n] int32: rows of tokens; [S, n] (S data shards,
        S = 1 without a mesh): each shard's rows, counted within the shard's own tokens,
        giving S * n rows.
        mesh: run over a (data, tensor) mesh; see MLAAttention.
        fp8_products: with fp8 caches, the attention op's lossy e4m3 x e4m3 option; see MLAAttention.
        """
        if len(caches) != len(self.layers):
            raise ValueError(f"got {len(caches)} layer caches for {len(self.layers)} layers")
        x = self.embed_tokens(tokens)
        new_caches = []
        for layer, kv in zip(self.layers, caches):
            x, kv = layer(x, kv, batch, form=form, backend=backend, mesh=mesh, fp8_products=fp8_products)
            new_caches.append(kv)
        x = self.norm(x)
        if logits_rows is not None and jnp.ndim(logits_rows) == 2:
            x = on_data_shards(lambda x, rows: x[rows.reshape(-1)], mesh, x, logits_rows)
        elif logits_rows is not None:
            x = x[logits_rows]
        logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        return logits.astype(jnp.float32), tuple(new_caches)
