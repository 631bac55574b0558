"""Checkpoint reading without torch: safetensors files (incl. bf16 and shards), HF tensor names
and layouts, clear errors."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("flax", reason="jax_mla.nn needs flax (pip install .[nn])")

from flax import nnx  # noqa: E402

from jax_mla.nn import DeepseekConfig, DeepseekModel, MLAAttention, hf  # noqa: E402

CODES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.int64): "I64",
         np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}


def write_safetensors(path, tensors):
    """The format spelled out: u64 header size, JSON header, raw little-endian bytes."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": CODES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_read_safetensors_f32_bf16_int(tmp_path):
    rng = np.random.default_rng(0)
    t = {"a": rng.standard_normal((3, 5)).astype(np.float32),
         "b": rng.standard_normal((4,)).astype(ml_dtypes.bfloat16),
         "c": np.arange(6, dtype=np.int64).reshape(2, 3)}
    write_safetensors(tmp_path / "model.safetensors", t)
    got = hf.read_safetensors(tmp_path / "model.safetensors")
    assert set(got) == set(t)
    for k in t:
        assert got[k].dtype == t[k].dtype
        np.testing.assert_array_equal(got[k], t[k])


def test_sharded_checkpoint_and_fp8_refusal(tmp_path):
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"x": np.ones((2,), np.float32)})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"y": np.zeros((3,), np.float32)})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}}))
    assert sorted(hf.load_checkpoint_tensors(tmp_path)) == ["x", "y"]
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    write_safetensors(fp8 / "model.safetensors", {
        "w.weight": np.zeros((4, 4), ml_dtypes.float8_e4m3fn), "w.weight_scale_inv": np.ones((1, 1), np.float32)})
    with pytest.raises(ValueError, match="FP8"):
        hf.load_checkpoint_tensors(fp8)


def attention_tensors(cfg, rng, prefix="model.layers.0.self_attn."):
    h, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                        cfg.kv_lora_rank)
    shapes = {"q_proj.weight": (h * (dn + dr), cfg.hidden_size), "kv_a_proj_with_mqa.weight": (r + dr, cfg.hidden_size),
              "kv_a_layernorm.weight": (r,), "kv_b_proj.weight": (h * (dn + dv), r),
              "o_proj.weight": (cfg.hidden_size, h * dv)}
    return {prefix + k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def small_cfg(**kw):
    base = dict(hidden_size=32, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=6, vocab_size=50, intermediate_size=40, num_hidden_layers=2)
    base.update(kw)
    return DeepseekConfig(**base)


def test_load_attention_layouts_and_errors():
    cfg = small_cfg()
    t = attention_tensors(cfg, np.random.default_rng(1))
    attn = MLAAttention(cfg, rngs=nnx.Rngs(0))
    p = "model.layers.0.self_attn."
    hf.load_attention(attn, t, p)
    np.testing.assert_array_equal(np.asarray(attn.q_proj.kernel[...]), t[p + "q_proj.weight"].T)
    kv_b = t[p + "kv_b_proj.weight"].reshape(2, 8 + 6, 16)
    np.testing.assert_array_equal(np.asarray(attn.w_uk[...]), kv_b[:, :8])
    np.testing.assert_array_equal(np.asarray(attn.w_uv[...]), kv_b[:, 8:])
    bad = dict(t)
    bad[p + "o_proj.weight"] = bad[p + "o_proj.weight"][:, :-1]
    with pytest.raises(ValueError, match=r"o_proj.weight' has shape \(32, 11\), expected \(32, 12\)"):
        hf.load_attention(attn, bad, p)
    missing = {k: v for k, v in t.items() if "kv_b_proj" not in k}
    with pytest.raises(KeyError, match="kv_b_proj.weight"):
        hf.load_attention(attn, missing, p)
    biased = {**t, p + "o_proj.bias": np.zeros(32, np.float32)}
    with pytest.raises(ValueError, match="no bias"):
        hf.load_attention(attn, biased, p)


def test_moe_layers_are_refused_by_the_dense_model():
    cfg = small_cfg(n_routed_experts=4, first_k_dense_replace=1)
    with pytest.raises(ValueError, match=r"layers \[1\] of this config are MoE"):
        DeepseekModel(cfg, rngs=nnx.Rngs(0))
    DeepseekModel(cfg, rngs=nnx.Rngs(0), with_mlp=False)  # an attention-only stack is fine


def test_unreadable_dtype_is_named(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"w": np.zeros((2,), ml_dtypes.float8_e4m3fn)})
    with pytest.raises(ValueError, match="tensor 'w' has dtype F8_E4M3"):
        hf.read_safetensors(tmp_path / "model.safetensors")
