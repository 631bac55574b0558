"""Model configuration mirroring the Hugging Face DeepSeek-V2/V3 `config.json` fields."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

__all__ = ["RopeScaling", "DeepseekConfig", "yarn_get_mscale"]

# rope types we implement; anything else in a config is an error, not a silent default.
ROPE_TYPES = ("default", "yarn")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1), as DeepSeek defines it."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN rope scaling (the `rope_scaling` / `rope_parameters` dict of a DeepSeek config).

    factor: context extension factor s; None derives it as
      max_position_embeddings / original_max_position_embeddings (as transformers does).
    mscale, mscale_all_dim: DeepSeek's two magnitude coefficients. cos/sin are
      multiplied by attention_factor = mscale(s, mscale) / mscale(s, mscale_all_dim)
      when both are set (else mscale(s, 1)), and the softmax scale by
      mscale(s, mscale_all_dim)^2 when mscale_all_dim is set.
    attention_factor: explicit cos/sin factor; overrides the derived one.
    truncate: round the correction range to whole dims (transformers' default).
    """

    rope_type: str = "yarn"
    factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES or self.rope_type == "default":
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported; use 'yarn' or no scaling")
        if self.factor is not None and not self.factor > 0:
            raise ValueError(f"rope_scaling factor must be positive, got {self.factor!r}")


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    """The fields of a DeepSeek-V2/V3 `config.json` that attention and the dense model use.

    Field names and defaults follow transformers' DeepseekV3Config; `from_hf_config`
    reads a config.json dict (old `rope_scaling` + `rope_theta` or the newer
    `rope_parameters` form). MoE fields are kept so that a loader can say which
    layers are MoE; the demo model itself has dense MLPs only.
    """

    hidden_size: int = 7168
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    # dense model
    vocab_size: int = 129280
    intermediate_size: int = 18432
    num_hidden_layers: int = 61
    hidden_act: str = "silu"
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    # MoE layout (only to recognise MoE layers)
    first_k_dense_replace: int = 0
    n_routed_experts: int | None = None
    moe_layer_freq: int = 1
    model_type: str = "deepseek_v3"

    def __post_init__(self):
        for name in ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "vocab_size", "num_hidden_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1):
            raise ValueError(f"q_lora_rank must be a positive int or None, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; DeepSeek uses 'silu'")

    # ---- derived -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn_factor(self) -> float | None:
        """The YaRN factor s, derived as transformers does when the config leaves it out."""
        rs = self.rope_scaling
        if rs is None:
            return None
        if rs.factor is not None:
            return float(rs.factor)
        return self.max_position_embeddings / self.original_max_position_embeddings

    @property
    def original_max_position_embeddings(self) -> int:
        rs = self.rope_scaling
        if rs is not None and rs.original_max_position_embeddings is not None:
            return int(rs.original_max_position_embeddings)
        return self.max_position_embeddings

    @property
    def rope_attention_factor(self) -> float:
        """Factor on cos/sin (transformers' `attention_scaling`); 1 without YaRN."""
        rs = self.rope_scaling
        if rs is None:
            return 1.0
        if rs.attention_factor is not None:
            return float(rs.attention_factor)
        s = self.yarn_factor
        if rs.mscale and rs.mscale_all_dim:
            return yarn_get_mscale(s, rs.mscale) / yarn_get_mscale(s, rs.mscale_all_dim)
        return yarn_get_mscale(s)

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(s, mscale_all_dim)^2 under YaRN with mscale_all_dim (DeepSeek)."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_get_mscale(self.yarn_factor, rs.mscale_all_dim)
            scale = scale * m * m
        return float(scale)

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i has a routed-expert MLP in the HF model (DeepSeek-V2/V3 rule)."""
        return (self.n_routed_experts is not None and self.n_routed_experts > 0
                and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0)

    # ---- HF -----------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any] | str | os.PathLike) -> "DeepseekConfig":
        """From a config.json dict, a path to config.json, or a checkpoint folder."""
        if not isinstance(d, Mapping):
            path = os.fspath(d)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                d = json.load(f)
        d = dict(d)
        model_type = d.get("model_type", "deepseek_v3")
        if model_type not in ("deepseek_v2", "deepseek_v3"):
            raise ValueError(f"model_type={model_type!r} is not a DeepSeek-V2/V3 config")
        # Two spellings of rope settings: `rope_scaling` (+ top-level rope_theta), or
        # transformers 5's `rope_parameters` that holds rope_theta as well.
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope = dict(rope)
        rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} in config is not supported; use 'yarn' or 'default'")
        scaling = None
        if rope_type == "yarn":
            orig = rope.get("original_max_position_embeddings", d.get("original_max_position_embeddings"))
            scaling = RopeScaling(
                rope_type="yarn",
                factor=None if rope.get("factor") is None else float(rope["factor"]),
                mscale=None if rope.get("mscale") is None else float(rope["mscale"]),
                mscale_all_dim=None if rope.get("mscale_all_dim") is None else float(rope["mscale_all_dim"]),
                beta_fast=None if rope.get("beta_fast") is None else float(rope["beta_fast"]),
                beta_slow=None if rope.get("beta_slow") is None else float(rope["beta_slow"]),
                original_max_position_embeddings=None if orig is None else int(orig),
                attention_factor=None if rope.get("attention_factor") is None else float(rope["attention_factor"]),
                truncate=bool(rope.get("truncate", True)),
            )
        defaults = cls()
        get = lambda k: d.get(k, getattr(defaults, k))  # noqa: E731
        n_routed = d.get("n_routed_experts")
        q_lora = d.get("q_lora_rank", defaults.q_lora_rank)
        return cls(
            hidden_size=int(get("hidden_size")),
            num_attention_heads=int(get("num_attention_heads")),
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(get("kv_lora_rank")),
            qk_nope_head_dim=int(get("qk_nope_head_dim")),
            qk_rope_head_dim=int(get("qk_rope_head_dim")),
            v_head_dim=int(get("v_head_dim")),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            # DeepSeek-V2 checkpoints always pair rope dims (x0,x1),(x2,x3)...; only V3
            # configs carry the switch (False: the weights were permuted to halves).
            rope_interleave=bool(d.get("rope_interleave", True)) if model_type == "deepseek_v3" else True,
            rms_norm_eps=float(get("rms_norm_eps")),
            attention_bias=bool(get("attention_bias")),
            max_position_embeddings=int(get("max_position_embeddings")),
            vocab_size=int(get("vocab_size")),
            intermediate_size=int(get("intermediate_size")),
            num_hidden_layers=int(get("num_hidden_layers")),
            hidden_act=str(get("hidden_act")),
            mlp_bias=bool(get("mlp_bias")),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            first_k_dense_replace=int(d.get("first_k_dense_replace") or 0),
            n_routed_experts=None if n_routed is None else int(n_routed),
            moe_layer_freq=int(d.get("moe_layer_freq") or 1),
            model_type=model_type,
        )
