"""The planner's unit cost (PlanTarget.unit_overhead / wide_unit_overhead) A/B'd on ragged batches, device time.

Each shape is planned with every unit cost given, on the GPU's default target otherwise, and the plans
are timed in interleaved rounds through the op's jitted chain (`bench_attention.device_time_ours`),
so that the costs' times share the device's clocks. Plans equal to the first cost's are not timed again.

    python benchmarks/bench_unit_overhead.py [--overheads 256 384 512] [--rounds 3] [--out DIR] [--small]

(--small: two tiny batches, for a smoke run on the CPU.)

Prints a Markdown table; with --out, also writes DIR/unit_overhead.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as B  # noqa: E402

from jax_mla import default_target  # noqa: E402

# Ragged batches at 16-128 heads, both page sizes the kernels treat apart (16: cp.async; 64: TMA).
SHAPES = [
    (32, ("U", 1000, 8192, 5), 128, 64, 1),
    (24, ("U", 2000, 32768, 11), 64, 64, 1),
    (64, ("U", 500, 16384, 7), 128, 64, 1),
    (48, ("U", 1, 8192, 7), 32, 64, 1),
    (64, ("U", 256, 8192, 3), 20, 64, ("U", 1, 3)),
    (100, ("U", 1, 4096, 3), 16, 64, 1),
    (40, ("U", 64, 8192, 13), 128, 16, 1),
]
SMALL_SHAPES = [(6, ("U", 100, 900, 5), 64, 64, 1), (4, ("U", 50, 600, 3), 16, 16, ("U", 1, 2))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--overheads", type=int, nargs="+", default=[256, 384, 512])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=8, help="calls per timed chain")
    ap.add_argument("--out", default=None, help="write unit_overhead.json here")
    ap.add_argument("--small", action="store_true", help="two tiny batches (a smoke run)")
    args = ap.parse_args()
    if args.calls < 2 or args.rounds < 1 or not args.overheads:
        ap.error("--calls must be >= 2, --rounds >= 1, and --overheads name at least one cost")
    base = default_target()
    print(f"default target {base}", flush=True)
    records = []
    for s in SMALL_SHAPES if args.small else SHAPES:
        inp = B.Inputs(s, args.calls)
        # the default target with one cost for every unit
        plans = {ov: inp.plan(dataclasses.replace(base, unit_overhead=ov, wide_unit_overhead=None))
                 for ov in args.overheads}
        first = args.overheads[0]
        same = {ov: ov != first and np.array_equal(np.asarray(plans[ov].work), np.asarray(plans[first].work))
                for ov in args.overheads}
        timed = [ov for ov in args.overheads if not same[ov]]

        def once(ov):
            d = B.device_time_ours(inp, plans[ov], args.calls, reps=3)
            # without kernel timestamps (no profiler, the CPU): wall time from two chain lengths
            return (d if d is not None else B.time_ours(inp, plans[ov], max(1, args.calls // 4), args.calls,
                                                        reps=5)) * 1e6

        once(first)  # warm-up: compile, first trace
        us = {ov: [] for ov in timed}
        for r in range(args.rounds):
            for ov in (timed[::-1] if r % 2 == 0 else timed):
                us[ov].append(once(ov))
        rec = dict(shape=B.shape_name(s), us={str(ov): (statistics.median(us[ov]) if ov in us else None)
                                             for ov in args.overheads},
                   rounds={str(ov): us.get(ov) for ov in args.overheads},
                   same_plan_as_first=[ov for ov in args.overheads if same[ov]],
                   plans={str(ov): plans[ov].describe() for ov in args.overheads})
        records.append(rec)
        cells = " | ".join("= " + str(first) if same[ov] else f"{statistics.median(us[ov]):.1f}"
                           for ov in args.overheads)
        print(f"| {rec['shape']} | {cells} |", flush=True)
        del inp
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "unit_overhead.json"), "w") as f:
            json.dump(dict(default_target=str(base), overheads=args.overheads, rounds=args.rounds,
                           command="python benchmarks/bench_unit_overhead.py " + " ".join(sys.argv[1:]),
                           records=records), f, indent=1)


if __name__ == "__main__":
    main()
