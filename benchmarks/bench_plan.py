"""Host plan time per call, warm, on this machine's CPU (issue 11's budget: <= 25 us for every case on
the 2-core CI CPU): `plan_mla` (the native planner, ffi/planner/) and `plan_mla_numpy` side by side.

    python benchmarks/bench_plan.py
"""

from __future__ import annotations

import time

import numpy as np

from jax_mla import PlanTarget, plan_mla
from jax_mla.planner import plan_mla_numpy


def time_plan(plan, qo, kv, heads, page_size, target, reps=3000):
    for _ in range(200):
        plan(qo, kv, num_heads=heads, page_size=page_size, target=target)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        plan(qo, kv, num_heads=heads, page_size=page_size, target=target)
        samples.append(time.perf_counter_ns() - t0)
    return float(np.median(samples)) / 1e3


def main():
    rng = np.random.default_rng(0)
    gpu = PlanTarget(num_workers=132)
    rows = [
        ("decode 256 x U(1,4096), 16 heads", np.ones(256, int), rng.integers(1, 4096, 256), 16),
        ("decode 256 x 4096, 128 heads", np.ones(256, int), np.full(256, 4096), 128),
        ("decode 32 x 4096, 16 heads", np.ones(32, int), np.full(32, 4096), 16),
        ("decode 1 x 32768, 16 heads", np.ones(1, int), np.full(1, 32768), 16),
        ("verify 256 x q4 x U(4,4096), 16 heads", np.full(256, 4), rng.integers(4, 4096, 256), 16),
        ("decode 1 x U(1,131072), 128 heads", np.ones(1, int), rng.integers(1, 131072, 1), 128),
        ("decode 8 x U(1,8192), 16 heads", np.ones(8, int), rng.integers(1, 8192, 8), 16),
        ("decode 512 x U(1,4096), 16 heads", np.ones(512, int), rng.integers(1, 4096, 512), 16),
        ("ragged 512 x q U(0,3) x U(3,4096), 64 heads", rng.integers(0, 4, 512), rng.integers(3, 4096, 512), 64),
        # ragged batches packed onto the workers, a request's tiles as one (q_len 1 at 128 heads: one tile each)
        ("packed 32 x U(500,16384), 128 heads", np.ones(32, int), rng.integers(500, 16385, 32), 128),
        ("packed 32 x q2 x U(500,16384), 128 heads", np.full(32, 2), rng.integers(500, 16385, 32), 128),
        ("packed 24 x q U(1,3) x U(500,16384), 128 heads", rng.integers(1, 4, 24), rng.integers(500, 16385, 24), 128),
    ]
    print("| case | plan_mla (native) median us | plan_mla_numpy median us |\n|---|---|---|")
    for name, qo, kv, heads in rows:
        native = time_plan(plan_mla, qo, kv, heads, 64, gpu)
        numpy = time_plan(plan_mla_numpy, qo, kv, heads, 64, gpu, reps=1000)
        print(f"| {name} | {native:.1f} | {numpy:.1f} |", flush=True)


if __name__ == "__main__":
    main()
