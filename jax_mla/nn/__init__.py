"""Flax NNX layer for DeepSeek-V2/V3 Multi-head Latent Attention over jax_mla's paged cache.

Needs flax (the `nn` extra). Pieces:
  DeepseekConfig      HF config fields (`from_hf_config`), YaRN softmax scale
  MLAAttention        the NNX module (absorbed and expanded forms)
  DeepseekModel       a small dense DeepSeek-style LM built on it (the demo model)
  PagedCacheManager   (from jax_mla.paging, which needs no flax) host-side pages, slots, lengths,
                      incremental page-table updates, plans
  Generator           prefill + host-planned or fully jitted decode loops
  hf                  config.json + safetensors loading
"""

from ..paging import (OutOfPagesError, OutOfSlotsError, PagedBatch, PagedCacheManager, PagedKV, bucket,
                      token_positions)
from .attention import FORMS, MLAAttention, RMSNorm
from .config import DeepseekConfig, RopeScaling, yarn_get_mscale
from .decode import Generator, choose_prefill_form
from .model import DecoderLayer, DeepseekModel, SwiGLU
from .rope import apply_rope, rope_cos_sin, rope_inv_freq
from . import hf

__all__ = [
    "DeepseekConfig", "RopeScaling", "yarn_get_mscale",
    "MLAAttention", "RMSNorm", "PagedKV", "PagedBatch", "token_positions", "FORMS",
    "DeepseekModel", "DecoderLayer", "SwiGLU",
    "PagedCacheManager", "OutOfPagesError", "OutOfSlotsError", "bucket",
    "Generator", "choose_prefill_form",
    "rope_inv_freq", "rope_cos_sin", "apply_rope",
    "hf",
]
