"""Times the CPU FFI handler of the op against the jax.numpy reference, in one process.

    python benchmarks/bench_cpu.py [--dtype bfloat16|float16|float32] [--reps N]

Per shape (the `cpu` shapes of jax_mla/arg_specs.py: requests x kv_len x heads x q_len, d_ckv 512,
d_kpe 64, page size 64, random page tables, random normal data): each backend is jitted once, warmed up,
then the two take turns in 3 rounds of N timed calls each (after one untimed
call), with block_until_ready around each call. The table shows the median wall
time and the spread (min..max) of the calls, and the output error of the handler
against the reference (relative norm). Each call takes milliseconds, so dispatch is small against it. Threads of
the handler: JAX_MLA_CPU_THREADS (default: all cores). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla import mla_paged_attention, plan_mla
from jax_mla.arg_specs import arg_specs
from jax_mla.testing import random_paged_batch, rel_err

D_CKV, D_KPE = 512, 64
SCALE = 1.0 / math.sqrt(192.0)
SPECS = arg_specs("cpu")  # the shared shape list (jax_mla/arg_specs.py)


def time_calls(fns: dict, args, reps: int, rounds: int = 3) -> dict[str, list[float]]:
    """Wall times of rounds x reps calls of each function. The machine is shared
    and its load drifts, so the functions take turns in rounds; each round of a
    function starts with an untimed call, so that it does not pay for the
    previous one's threads winding down (XLA's pool spins for a while)."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            jax.block_until_ready(fn(*args))
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reps", type=int, default=5, help="timed calls per round (3 rounds)")
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)

    fns = {
        backend: jax.jit(lambda *a, backend=backend: mla_paged_attention(
            *a, sm_scale=SCALE, backend=backend))
        for backend in ("ffi", "reference")
    }
    threads = os.environ.get("JAX_MLA_CPU_THREADS", f"all {os.cpu_count()} cores")
    print(f"{jax.devices()[0].device_kind}, {dtype.name}, d_ckv {D_CKV}, d_kpe {D_KPE}, "
          f"handler threads: {threads}, median of 3 x {args.reps} calls (min..max)\n")
    print("| requests x kv | heads | q_len | page | ffi ms | reference ms | ffi speed-up | ffi GFLOP/s | rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in SPECS:
        qo_lens, kv_lens = spec.lengths()
        requests, kv_len, q_len, heads = len(qo_lens), int(kv_lens[0]), int(qo_lens[0]), spec.heads
        batch = random_paged_batch(rng, qo_lens, kv_lens, num_heads=heads, page_size=spec.page_size,
                                   d_ckv=D_CKV, d_kpe=D_KPE, dtype=dtype)
        plan = plan_mla(qo_lens, kv_lens, num_heads=heads, page_size=spec.page_size,
                        max_pages_per_request=batch.page_table.shape[1])
        call_args = batch.args(plan)
        err = rel_err(np.asarray(fns["ffi"](*call_args), np.float32),
                      np.asarray(fns["reference"](*call_args), np.float32))
        stats = {name: (statistics.median(t), min(t), max(t))
                 for name, t in time_calls(fns, call_args, args.reps).items()}
        # Keys each query token sees: causal, aligned to the end of its request.
        seen = requests * sum(kv_len - q_len + 1 + i for i in range(q_len))
        flops = 2 * heads * (D_CKV + D_KPE + D_CKV) * seen
        ffi, ref = stats["ffi"], stats["reference"]
        cell = lambda s: f"{1e3 * s[0]:.1f} ({1e3 * s[1]:.1f}..{1e3 * s[2]:.1f})"
        print(f"| {requests} x {kv_len} | {heads} | {q_len} | {spec.page_size} | {cell(ffi)} | {cell(ref)} | "
              f"{ref[0] / ffi[0]:.2f}x | {flops / ffi[0] / 1e9:.1f} | {err:.1e} |")


if __name__ == "__main__":
    main()
