"""jax_mla: paged Multi-head Latent Attention (DeepSeek-V2/V3) for JAX."""

from ._ffi import build_info
from .attention import export_disabled_checks, mla_paged_attention, register_ffi_targets, resolve_backend
from .cache import append_paged_kv
from .paging import PagedBatch, PagedCacheManager, PagedKV, page_table_from_indptr
from .planner import MLAPlan, PlanTarget, default_target, gpu_target, plan_mla
from .quant import FP8_DTYPE, fp8_scale, quantize_fp8
from .reference import mla_paged_attention_reference

__all__ = [
    "build_info",
    "mla_paged_attention",
    "resolve_backend",
    "export_disabled_checks",
    "register_ffi_targets",
    "mla_paged_attention_reference",
    "append_paged_kv",
    "plan_mla",
    "PagedCacheManager",
    "PagedKV",
    "PagedBatch",
    "page_table_from_indptr",
    "MLAPlan",
    "PlanTarget",
    "default_target",
    "gpu_target",
    "FP8_DTYPE",
    "fp8_scale",
    "quantize_fp8",
]
__version__ = "0.1.0"
