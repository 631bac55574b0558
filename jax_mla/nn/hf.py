"""Loading Hugging Face DeepSeek-V2/V3 checkpoints (config.json + safetensors).

Layout differences handled here:
* HF linear weights are [out, in]; nnx.Linear kernels are [in, out].
* kv_b_proj.weight [H * (nope + v), kv_lora_rank] is split per head into
  W_UK [H, nope, kv_lora_rank] and W_UV [H, v, kv_lora_rank].
* Rope pair layout stays as in the checkpoint: the module rotates interleaved
  pairs when config.rope_interleave (every DeepSeek checkpoint), half-split
  pairs otherwise, exactly as transformers does.

Checkpoints are read with the safetensors library into NumPy (bf16 as
ml_dtypes.bfloat16), so they load without torch.
"""

from __future__ import annotations

import json
import os
from typing import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .attention import MLAAttention, RMSNorm
from .config import DeepseekConfig
from .model import DeepseekModel

__all__ = ["read_safetensors", "load_checkpoint_tensors", "load_attention", "load_model", "load_hf_model"]

# safetensors dtypes NumPy (with ml_dtypes for bf16) holds; others are refused by name.
_READABLE = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")


def _tensor_names(path: str) -> list[str]:
    from safetensors import safe_open
    with safe_open(path, framework="numpy") as f:
        return list(f.keys())


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as NumPy arrays, read with the safetensors library."""
    from safetensors import safe_open
    path = os.fspath(path)
    out = {}
    with safe_open(path, framework="numpy") as f:
        for name in f.keys():
            dt = f.get_slice(name).get_dtype()
            if dt not in _READABLE:
                raise ValueError(f"{path}: tensor {name!r} has dtype {dt}, which this loader does not read "
                                 f"(it reads {', '.join(_READABLE)})")
            out[name] = f.get_tensor(name)
    return out


def load_checkpoint_tensors(folder: str | os.PathLike) -> dict[str, np.ndarray]:
    """Tensors of a checkpoint folder: model.safetensors, or the shards of model.safetensors.index.json."""
    folder = os.fspath(folder)
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(x for x in os.listdir(folder) if x.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    paths = [os.path.join(folder, name) for name in files]
    # Refuse a block-quantised FP8 checkpoint by its tensor names, before reading any weight.
    quantised = [k for p in paths for k in _tensor_names(p) if k.endswith("weight_scale_inv")]
    if quantised:
        raise ValueError(f"{folder} holds block-quantised FP8 weights ({quantised[0]}, ...); dequantise the "
                         "checkpoint to bf16/fp32 first")
    tensors: dict[str, np.ndarray] = {}
    for p in paths:
        tensors.update(read_safetensors(p))
    return tensors


class _Source:
    """Tensor lookup under a name prefix with clear errors for missing or misshapen weights."""

    def __init__(self, tensors: Mapping[str, np.ndarray], prefix: str):
        self.tensors = tensors
        self.prefix = prefix

    def has(self, name: str) -> bool:
        return self.prefix + name in self.tensors

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        key = self.prefix + name
        if key not in self.tensors:
            raise KeyError(f"checkpoint has no tensor {key!r}")
        t = self.tensors[key]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"tensor {key!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        return np.asarray(t, np.float32)


def _assign(var: nnx.Variable, value: np.ndarray) -> None:
    var[...] = jnp.asarray(value, var.dtype)  # same shape enforced


def _load_linear(lin: nnx.Linear, src: _Source, name: str) -> None:
    n_in, n_out = lin.kernel.shape
    _assign(lin.kernel, src.get(f"{name}.weight", (n_out, n_in)).T)
    if lin.bias is not None:
        _assign(lin.bias, src.get(f"{name}.bias", (n_out,)))
    elif src.has(f"{name}.bias"):
        raise ValueError(f"checkpoint has {src.prefix}{name}.bias but the config says no bias")


def _load_norm(norm: RMSNorm, src: _Source, name: str) -> None:
    _assign(norm.weight, src.get(f"{name}.weight", norm.weight.shape))


def load_attention(attn: MLAAttention, tensors: Mapping[str, np.ndarray], prefix: str) -> None:
    """Fill an MLAAttention from HF tensors named `{prefix}q_a_proj.weight` etc. (prefix e.g.
    'model.layers.0.self_attn.')."""
    cfg = attn.cfg
    src = _Source(tensors, prefix)
    if cfg.q_lora_rank is None:
        _load_linear(attn.q_proj, src, "q_proj")
    else:
        _load_linear(attn.q_a_proj, src, "q_a_proj")
        _load_norm(attn.q_a_layernorm, src, "q_a_layernorm")
        _load_linear(attn.q_b_proj, src, "q_b_proj")
    _load_linear(attn.kv_a_proj_with_mqa, src, "kv_a_proj_with_mqa")
    _load_norm(attn.kv_a_layernorm, src, "kv_a_layernorm")
    h, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    kv_b = src.get("kv_b_proj.weight", (h * (dn + dv), r)).reshape(h, dn + dv, r)
    _assign(attn.w_uk, kv_b[:, :dn, :])
    _assign(attn.w_uv, kv_b[:, dn:, :])
    _load_linear(attn.o_proj, src, "o_proj")


def load_model(model: DeepseekModel, tensors: Mapping[str, np.ndarray]) -> None:
    """Fill a DeepseekModel from the tensors of a transformers DeepseekV2/V3ForCausalLM checkpoint."""
    cfg = model.cfg
    root = _Source(tensors, "model.")
    _assign(model.embed_tokens.embedding, root.get("embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)))
    for i, layer in enumerate(model.layers):
        src = _Source(tensors, f"model.layers.{i}.")
        _load_norm(layer.input_layernorm, src, "input_layernorm")
        load_attention(layer.self_attn, tensors, f"model.layers.{i}.self_attn.")
        _load_norm(layer.post_attention_layernorm, src, "post_attention_layernorm")
        if layer.mlp is not None:
            for name in ("gate_proj", "up_proj", "down_proj"):
                _load_linear(getattr(layer.mlp, name), src, f"mlp.{name}")
    _load_norm(model.norm, root, "norm")
    if model.lm_head is not None:
        _load_linear(model.lm_head, _Source(tensors, ""), "lm_head")


def load_hf_model(folder: str | os.PathLike, *, dtype=jnp.float32, param_dtype=jnp.float32,
                  precision=None) -> DeepseekModel:
    """DeepseekModel with the config and weights of an HF checkpoint folder (dense layers only)."""
    cfg = DeepseekConfig.from_hf_config(folder)
    model = DeepseekModel(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype, precision=precision)
    load_model(model, load_checkpoint_tensors(folder))
    return model
