"""The op inside shard_map: heads split over devices (tensor parallel), latent cache replicated.

MLA's latent cache has no head axis, so tensor parallelism shards the queries'
heads and replicates the cache and the plan; each shard plans for its local head
count. Runs in a subprocess with two host devices (the device count is fixed when
JAX starts).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    try:
        from jax import shard_map
    except ImportError:
        from jax.experimental.shard_map import shard_map
    import jax_mla
    from jax_mla import PlanTarget, mla_paged_attention, mla_paged_attention_reference, plan_mla
    from jax_mla.testing import random_paged_batch, rel_err

    assert jax.device_count() == 2, jax.devices()
    rng = np.random.default_rng(7)
    heads, ps = 8, 16
    qo, kv = np.array([1, 3, 2]), np.array([40, 300, 77])
    b = random_paged_batch(rng, qo, kv, num_heads=heads, page_size=ps)
    target = PlanTarget(num_workers=8, min_chunk=32, chunk_align=16)
    local = plan_mla(qo, kv, num_heads=heads // 2, page_size=ps, target=target)
    full = plan_mla(qo, kv, num_heads=heads, page_size=ps, target=target)
    mesh = Mesh(np.array(jax.devices()), ("tp",))

    def attend(q_nope, q_pe, ckv, kpe, page_table, kv_lens, plan):
        return mla_paged_attention(q_nope, q_pe, ckv, kpe, page_table, kv_lens, plan, sm_scale=0.125,
                                   return_lse=True, backend="ffi")

    heads_spec = P(None, "tp", None)
    f = jax.jit(shard_map(attend, mesh=mesh,
                          in_specs=(heads_spec, heads_spec, P(), P(), P(), P(), P()),
                          out_specs=(heads_spec, P(None, "tp"))))
    out, lse = f(b.q_nope, b.q_pe, b.ckv, b.kpe, b.page_table, b.kv_lens, local)
    ref, ref_lse = mla_paged_attention_reference(*b.args(full), sm_scale=0.125, return_lse=True)
    assert out.sharding.spec[1] == "tp", out.sharding
    e, el = rel_err(out, ref), rel_err(lse, ref_lse)
    print("rel err", e, el)
    assert e < 1e-5 and el < 1e-5
    print("SHARDED OK")
""")


def test_heads_sharded_over_two_devices():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip())
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "SHARDED OK" in r.stdout, r.stdout + r.stderr
