"""The README's usage example, checked against the jax.numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_mla

T, H, P, PS = 3, 16, 64, 16  # tokens, heads, pages, page size
qo_lens, kv_lens = np.array([1, 2]), np.array([40, 100])  # host-known, per request
k = jax.random.split(jax.random.key(0), 4)
q_nope = jax.random.normal(k[0], (T, H, 512), jnp.bfloat16)
q_pe = jax.random.normal(k[1], (T, H, 64), jnp.bfloat16)
ckv = jax.random.normal(k[2], (P, PS, 512), jnp.bfloat16)  # latent cache (keys and values)
kpe = jax.random.normal(k[3], (P, PS, 64), jnp.bfloat16)  # rope key cache
page_table = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)  # request -> pages
plan = jax_mla.plan_mla(qo_lens, kv_lens, num_heads=H, page_size=PS)  # NumPy, on the host

attend = jax.jit(jax_mla.mla_paged_attention, static_argnames=("sm_scale", "return_lse"))
out, lse = attend(q_nope, q_pe, ckv, kpe, page_table, jnp.asarray(kv_lens, jnp.int32), plan,
                  sm_scale=192**-0.5, return_lse=True)  # [T, H, 512], [T, H]

ref, ref_lse = jax_mla.mla_paged_attention_reference(
    q_nope, q_pe, ckv, kpe, page_table, jnp.asarray(kv_lens, jnp.int32), plan,
    sm_scale=192**-0.5, return_lse=True)
err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref.astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
print(f"out {out.shape} {out.dtype}, lse {lse.shape}; relative error vs reference {err:.2e}")
assert err < 1e-2
