"""A small, representative set of CUDA op calls checked against the reference.

Run plainly it is a quick correctness sweep of the CUDA kernels (more shapes
than the unit tests: long kv ranges that wrap the key ring many times, heads
that need two head blocks, every tile shape, fp16). Under compute-sanitizer
(scripts/gpu_check.sh) it is the workload for memcheck and racecheck: pass
--small to keep the instrumented run short.

    python3 benchmarks/sanitize_case.py [--small]

Exits non-zero if any case misses its tolerance or has NaN.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_mla import PlanTarget, mla_paged_attention, mla_paged_attention_reference, plan_mla  # noqa: E402
from jax_mla.testing import random_paged_batch, rel_err  # noqa: E402

SCALE = 0.0723
OUT_TOL = {"bfloat16": 6e-3, "float16": 2e-3, "float32": 1e-5}
# Splits everywhere: small chunks on a pretend 132-SM GPU.
SPLIT = PlanTarget(num_workers=132, units_per_worker=2.0, min_chunk=64, chunk_align=32)


def run_case(rng, *, heads, page_size, qo, kv, dtype, target=None, device_kv=None, padding=0, bad_pages=False):
    qo = np.asarray(qo)
    kv = np.asarray(kv)
    t = int(qo.sum()) + padding
    batch = random_paged_batch(rng, qo, kv, num_heads=heads, page_size=page_size, d_ckv=512, d_kpe=64,
                               dtype=dtype, num_tokens=t)
    plan = plan_mla(qo, kv, num_heads=heads, page_size=page_size, num_tokens=t, target=target)
    table = batch.page_table
    if bad_pages:  # ids outside the cache inside the kv range: those keys are skipped
        host = batch.page_table_host.copy()
        host[0, 0] = -3
        host[-1, 0] = batch.ckv.shape[0] + 7
        table = jnp.asarray(host)
    kv_dev = batch.kv_lens if device_kv is None else jnp.asarray(device_kv, jnp.int32)
    # Leave garbage where the outputs will be allocated: unwritten rows show up as NaN.
    junk = jnp.full((t, heads, 512), jnp.nan, dtype)
    junk.block_until_ready()
    del junk
    f = jax.jit(lambda *a: mla_paged_attention(*a, sm_scale=SCALE, return_lse=True, backend="ffi"))
    out, lse = f(batch.q_nope, batch.q_pe, batch.ckv, batch.kpe, table, kv_dev, plan)
    up = lambda x: x.astype(jnp.float32)
    ref, ref_lse = mla_paged_attention_reference(up(batch.q_nope), up(batch.q_pe), up(batch.ckv), up(batch.kpe),
                                                 table, kv_dev, plan, sm_scale=SCALE, return_lse=True)
    out = np.asarray(out.astype(jnp.float32))
    lse, ref, ref_lse = np.asarray(lse), np.asarray(ref), np.asarray(ref_lse)
    err = rel_err(out, ref)
    empty = np.isneginf(ref_lse)
    ok = bool(np.isfinite(out).all() and not np.isnan(lse).any() and (out[empty] == 0).all()
              and (np.isneginf(lse) == empty).all() and err < OUT_TOL[jnp.dtype(dtype).name])
    lse_err = float(np.abs(lse[~empty] - ref_lse[~empty]).max()) if (~empty).any() else 0.0
    ok = ok and lse_err < 2e-3
    w = np.asarray(plan.work)
    splits = int((w[w[:, 2] > 0, 6] >= 0).sum())
    print(f"{'ok  ' if ok else 'FAIL'} heads={heads:3d} ps={page_size:3d} dtype={jnp.dtype(dtype).name:8s} "
          f"T={t:4d} units={int((w[:, 2] > 0).sum()):4d} split_units={splits:4d} "
          f"out_err={err:.2e} lse_err={lse_err:.2e}", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="the short set for compute-sanitizer")
    args = ap.parse_args()
    print("device:", jax.devices()[0].device_kind, "backend:", jax.default_backend(), flush=True)
    rng = np.random.default_rng(7)
    bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32
    ok = True
    # varlen decode, page size 1 and 64, heads 16 and 128, with splits
    ok &= run_case(rng, heads=16, page_size=1, qo=[1, 1, 0, 1, 1], kv=[700, 1, 0, 333, 96], dtype=bf16, target=SPLIT,
                   padding=2)
    ok &= run_case(rng, heads=128, page_size=64, qo=[1, 1, 1, 0], kv=[900, 64, 5, 0], dtype=bf16, target=SPLIT)
    # q_len 4 causal (64-row tiles) and q_len 2 (32-row tiles), ragged, split
    ok &= run_case(rng, heads=16, page_size=64, qo=[4, 2, 4, 1], kv=[530, 77, 4, 260], dtype=bf16, target=SPLIT,
                   padding=3)
    ok &= run_case(rng, heads=16, page_size=1, qo=[4, 3], kv=[300, 45], dtype=f16, target=SPLIT,
                   device_kv=[297, 2], bad_pages=True)
    ok &= run_case(rng, heads=128, page_size=1, qo=[1, 1], kv=[200, 31], dtype=f32, target=SPLIT)
    # one long request over many SMs (> 16 splits: the merge's four-part path) beside a short one
    ok &= run_case(rng, heads=16, page_size=16, qo=[1, 2], kv=[5000, 300], dtype=bf16, target=SPLIT)
    if not args.small:
        # long ranges (many trips round the key ring), default GPU plan
        ok &= run_case(rng, heads=16, page_size=16, qo=[1] * 3, kv=[20000, 3000, 129], dtype=bf16)
        ok &= run_case(rng, heads=128, page_size=64, qo=[1] * 2, kv=[9000, 2500], dtype=bf16)
        # two head blocks of unequal size; odd head counts; one head with 64-token tiles
        ok &= run_case(rng, heads=100, page_size=32, qo=[1, 1, 1], kv=[1500, 40, 700], dtype=bf16, target=SPLIT)
        ok &= run_case(rng, heads=20, page_size=128, qo=[3, 1, 2], kv=[900, 128, 2], dtype=bf16, target=SPLIT)
        ok &= run_case(rng, heads=1, page_size=16, qo=[64, 9], kv=[700, 9], dtype=bf16, target=SPLIT)
        ok &= run_case(rng, heads=64, page_size=256, qo=[1, 1], kv=[3000, 700], dtype=f16, padding=1)
        ok &= run_case(rng, heads=8, page_size=2, qo=[8, 5, 1], kv=[400, 5, 1000], dtype=f16, target=SPLIT,
                       device_kv=[404, 3, 0])
        ok &= run_case(rng, heads=16, page_size=64, qo=[4] * 3, kv=[2048, 1000, 64], dtype=f32)
    print("ALL OK" if ok else "SOME CASES FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
