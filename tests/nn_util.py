"""Helpers shared by the jax_mla.nn tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_mla.nn import PagedBatch, PagedCacheManager


def fresh_prefill_logits(model, mgr: PagedCacheManager, prompts, *, num_tokens: int, form: str):
    """Logits at every position of each prompt, from one prefill into an empty paged cache."""
    slots = mgr.admit([len(p) for p in prompts])
    qo = np.zeros(mgr.max_requests, np.int64)
    qo[slots] = [len(p) for p in prompts]
    tokens = np.zeros(num_tokens, np.int32)
    tokens[: qo.sum()] = np.concatenate([np.asarray(prompts[i]) for i in np.argsort(slots)])
    plan = mgr.plan(qo, qo, num_heads=model.cfg.num_attention_heads, num_tokens=num_tokens)
    kv = mgr.init_caches(model.cfg.num_hidden_layers, model.cfg.kv_lora_rank, model.cfg.qk_rope_head_dim)
    logits, _ = model(jnp.asarray(tokens), kv, PagedBatch(mgr.sync(), jnp.asarray(qo, jnp.int32), plan),
                      form=form)
    start = np.cumsum(qo) - qo
    return [np.asarray(logits)[start[s]: start[s] + len(p)] for s, p in zip(slots, prompts)]


def record_transfer_guard_levels(monkeypatch) -> list:
    """The levels every jax.transfer_guard_device_to_host(...) call asks for, from now on."""
    import jax

    seen = []
    real = jax.transfer_guard_device_to_host

    def spy(level):
        seen.append(level)
        return real(level)

    monkeypatch.setattr(jax, "transfer_guard_device_to_host", spy)
    return seen
