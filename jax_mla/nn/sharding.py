"""Where a DeepseekModel's parameters live on a (data, tensor) mesh: Megatron-style tensor parallelism.

Heads are split over ``"tensor"``: the query projection's output columns (q_proj, or q_b_proj
after the q LoRA), W_UK and W_UV by head, and o_proj's input rows, so each device computes its
heads' queries, attention and a partial o_proj whose sum over ``"tensor"`` XLA inserts. The dense
MLP is split the same way (gate/up by columns, down by rows) when the tensor size divides its
width. Everything else (embeddings, norms, the latent down projection kv_a_proj_with_mqa whose
output feeds the replicated cache, lm_head) is replicated. Nothing is split over ``"data"``.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from ..parallel import TENSOR, mesh_sizes

__all__ = ["param_specs", "shard_params"]

_HEAD_COLUMNS = ("q_proj", "q_b_proj")
_MLP_COLUMNS = ("gate_proj", "up_proj")


def _names(path) -> tuple[str, ...]:
    out = []
    for k in path:
        key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
        out.append(str(key))
    return tuple(n for n in out if n != "value")


def param_specs(params, cfg, tensor: int):
    """PartitionSpecs for a parameter pytree (nnx.split's state, or its leaves' tree) of a
    DeepseekModel with config `cfg` over a tensor axis of size `tensor`."""
    h = cfg.num_attention_heads
    if h % tensor:
        raise ValueError(f"num_attention_heads={h} is not divisible by the tensor axis size {tensor}")
    split_mlp = cfg.intermediate_size % tensor == 0

    def spec(path, leaf):
        names = _names(path)
        if len(names) < 2:
            return P()
        owner, name = names[-2], names[-1]
        if name in ("w_uk", "w_uv"):
            return P(TENSOR, None, None)
        if owner in _HEAD_COLUMNS:
            return P(None, TENSOR) if name == "kernel" else P(TENSOR)
        if owner == "o_proj" and name == "kernel":
            return P(TENSOR, None)
        if split_mlp and owner in _MLP_COLUMNS:
            return P(None, TENSOR) if name == "kernel" else P(TENSOR)
        if split_mlp and owner == "down_proj" and name == "kernel":
            return P(TENSOR, None)
        return P()

    return jax.tree_util.tree_map_with_path(spec, params)


def shard_params(params, cfg, mesh: jax.sharding.Mesh):
    """Place a parameter pytree on the mesh by `param_specs` (once; steps never move it)."""
    _, tensor = mesh_sizes(mesh)
    specs = param_specs(params, cfg, tensor)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    return jax.device_put(params, shardings)
