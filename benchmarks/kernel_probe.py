"""Runs each target shape of bench_attention.py a few times, one op call per jit
call, so that a kernel profiler sees a short, labelled launch sequence:

    ncu --metrics gpu__time_duration.sum --kernel-name regex:mla_ \
        python3 benchmarks/kernel_probe.py [--calls 3]

(the durations ncu prints are device times of the attention and merge kernels
per call, free of the host launch gaps that the wall-clock chain includes).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

from bench_attention import TARGETS, Inputs, ours_output, shape_name  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    for s in TARGETS:
        inp = Inputs(s, 1)
        plan = inp.plan()
        print(f"shape {shape_name(s)}: {plan.describe()}", flush=True)
        for _ in range(args.calls):
            jax.block_until_ready(ours_output(inp, plan))
        del inp


if __name__ == "__main__":
    main()
