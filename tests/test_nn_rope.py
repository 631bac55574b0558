"""Rope / YaRN and config parsing of jax_mla.nn against formulas written out directly."""

import cmath
import math

import numpy as np
import pytest

pytest.importorskip("flax", reason="jax_mla.nn needs flax (pip install .[nn])")

import jax.numpy as jnp  # noqa: E402

from jax_mla.nn import DeepseekConfig, RopeScaling, apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402

# Field values of the published DeepSeek-V3 and DeepSeek-V2-Lite config.json files.
V3_JSON = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "rope_theta": 10000, "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "attention_bias": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "vocab_size": 129280, "intermediate_size": 18432, "num_hidden_layers": 61, "first_k_dense_replace": 3,
    "n_routed_experts": 256, "moe_layer_freq": 1, "hidden_act": "silu", "tie_word_embeddings": False,
}
V2_LITE_JSON = {
    "model_type": "deepseek_v2", "hidden_size": 2048, "num_attention_heads": 16, "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "rope_theta": 10000, "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "attention_bias": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "vocab_size": 102400, "intermediate_size": 10944, "num_hidden_layers": 27, "first_k_dense_replace": 1,
    "n_routed_experts": 64, "moe_layer_freq": 1, "hidden_act": "silu",
}


def test_from_hf_config_v3():
    cfg = DeepseekConfig.from_hf_config(V3_JSON)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.v_head_dim) == (1536, 512, 192, 128)
    assert cfg.rope_interleave and cfg.rope_scaling.factor == 40.0
    assert cfg.original_max_position_embeddings == 4096
    m = 0.1 * 1.0 * math.log(40) + 1.0
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * m * m, rel=1e-12)
    assert cfg.rope_attention_factor == pytest.approx(1.0)
    assert [cfg.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]


def test_from_hf_config_v2_lite_and_new_rope_parameters_form():
    cfg = DeepseekConfig.from_hf_config(V2_LITE_JSON)
    assert cfg.q_lora_rank is None and cfg.num_attention_heads == 16 and cfg.model_type == "deepseek_v2"
    m = 0.1 * 0.707 * math.log(40) + 1.0
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * m * m, rel=1e-12)
    # transformers 5 writes `rope_parameters` (with rope_theta inside, `rope_type` key).
    d = dict(V2_LITE_JSON)
    rs = d.pop("rope_scaling")
    d.pop("rope_theta")
    d["rope_parameters"] = {**{k: v for k, v in rs.items() if k != "type"}, "rope_type": "yarn", "rope_theta": 500.0}
    cfg2 = DeepseekConfig.from_hf_config(d)
    assert cfg2.rope_theta == 500.0 and cfg2.rope_scaling == cfg.rope_scaling
    # V2 checkpoints always rotate interleaved pairs, whatever the dict says.
    assert DeepseekConfig.from_hf_config({**V2_LITE_JSON, "rope_interleave": False}).rope_interleave
    assert not DeepseekConfig.from_hf_config({**V3_JSON, "rope_interleave": False}).rope_interleave


def test_mscale_ratio_and_derived_factor():
    cfg = DeepseekConfig(qk_rope_head_dim=64, max_position_embeddings=8192,
                         rope_scaling=RopeScaling(factor=None, mscale=0.8, mscale_all_dim=0.6,
                                                  original_max_position_embeddings=1024))
    assert cfg.yarn_factor == 8.0
    ms = lambda s, m: 0.1 * m * math.log(s) + 1.0  # noqa: E731
    assert cfg.rope_attention_factor == pytest.approx(ms(8, 0.8) / ms(8, 0.6), rel=1e-12)
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * ms(8, 0.6) ** 2, rel=1e-12)
    assert DeepseekConfig().softmax_scale == pytest.approx(192 ** -0.5)


def test_unsupported_rope_type_is_an_error():
    with pytest.raises(ValueError, match="dynamic"):
        DeepseekConfig.from_hf_config({**V3_JSON, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="model_type"):
        DeepseekConfig.from_hf_config({**V3_JSON, "model_type": "llama"})


def _yarn_direct(dim, base, factor, orig, beta_fast, beta_slow):
    """The YaRN blend of DeepSeek / transformers, element by element."""
    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), dim - 1)
    out = []
    for i in range(dim // 2):
        theta = base ** (-2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(theta / factor * ramp + theta * (1 - ramp))
    return np.array(out), low, high


@pytest.mark.parametrize("dim,base,factor,orig", [(64, 10000.0, 40.0, 4096), (16, 10000.0, 4.0, 1024),
                                                  (32, 500.0, 8.0, 2048)])
def test_yarn_inv_freq_matches_direct_formula(dim, base, factor, orig):
    cfg = DeepseekConfig(qk_rope_head_dim=dim, rope_theta=base,
                         rope_scaling=RopeScaling(factor=factor, mscale=1.0, mscale_all_dim=1.0,
                                                  original_max_position_embeddings=orig))
    ours = rope_inv_freq(cfg)
    want, low, high = _yarn_direct(dim, base, factor, orig, 32.0, 1.0)
    np.testing.assert_allclose(ours, want, rtol=2e-7)
    # YaRN's point: fast dims (many rotations over the original context) keep their
    # frequency, slow dims are interpolated by the factor, and in between they blend.
    theta = base ** (-np.arange(0, dim, 2) / dim)
    assert 0 <= low < high < dim // 2
    np.testing.assert_allclose(ours[: low + 1], theta[: low + 1], rtol=2e-7)
    np.testing.assert_allclose(ours[high:], theta[high:] / factor, rtol=2e-7)
    mid = ours[low + 1: high] / theta[low + 1: high]
    assert np.all((mid < 1) & (mid > 1 / factor))


def test_default_inv_freq():
    cfg = DeepseekConfig(qk_rope_head_dim=64, rope_theta=10000.0)
    np.testing.assert_allclose(rope_inv_freq(cfg), 10000.0 ** (-np.arange(0, 64, 2) / 64), rtol=2e-7)


@pytest.mark.parametrize("interleave", [True, False])
def test_apply_rope_is_the_pairwise_rotation(interleave):
    rng = np.random.default_rng(0)
    d, t, h = 16, 5, 3
    x = rng.standard_normal((t, h, d)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 4095])
    inv = (10000.0 ** (-np.arange(0, d, 2) / d)).astype(np.float32)
    factor = 1.0256
    cos, sin = rope_cos_sin(jnp.asarray(pos), inv, factor)
    got = np.asarray(apply_rope(jnp.asarray(x), cos[:, None], sin[:, None], interleave=interleave))
    want = np.empty_like(x)
    for ti in range(t):
        for hi in range(h):
            for k in range(d // 2):
                a, b = (2 * k, 2 * k + 1) if interleave else (k, k + d // 2)
                # The angle is formed in float32, as transformers forms it.
                angle = float(np.float32(pos[ti]) * inv[k])
                z = complex(x[ti, hi, a], x[ti, hi, b]) * cmath.exp(1j * angle) * factor
                want[ti, hi, a], want[ti, hi, b] = z.real, z.imag
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
