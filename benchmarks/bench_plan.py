"""Host plan time (the issue's budget: <= 50 us for 256 requests on the 2-core CI CPU).

    python benchmarks/bench_plan.py
"""

from __future__ import annotations

import time

import numpy as np

from jax_mla import PlanTarget, plan_mla


def time_plan(qo, kv, heads, page_size, target, reps=3000):
    for _ in range(200):
        plan_mla(qo, kv, num_heads=heads, page_size=page_size, target=target)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        plan_mla(qo, kv, num_heads=heads, page_size=page_size, target=target)
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
    ]
    print("| case | plan median (us) |\n|---|---|")
    for name, qo, kv, heads in rows:
        print(f"| {name} | {time_plan(qo, kv, heads, 64, gpu):.1f} |")


if __name__ == "__main__":
    main()
