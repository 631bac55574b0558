"""Where a call's device time goes, kernel by kernel, for ours and for FlashMLA, in the same conditions.

Why: Nsight Compute (scripts/ncu_peer.sh: one launch, caches flushed) put our 64-key kernel and FlashMLA's
splitkv kernel within 2% of each other in cycles at 128 x 4096 h128 on an H100, while the benchmark's chains
had FlashMLA 8% faster. This script times both as the benchmark runs them, back to back, and splits each call
into its kernels from CUPTI's timestamps: the attention (splitkv) kernel's own duration, the merge (combine)
kernel's, the gap from one call's attention end to the next call's attention start; and, run back to back
for a while, the SM clock and power (nvidia-smi, benchmarks/gpu_power.py), so that a kernel's duration can be
read as cycles.

    python3 benchmarks/call_anatomy.py --who ours --shape 128x4096h128q1 [--calls 16 --reps 5 --power 1.5]
    python3 benchmarks/call_anatomy.py --who flashmla --flashmla .peer/flashmla --shape 128x4096h128q1

One JSON line per run on stdout (the last line). `ours` runs the op's jitted chain under JAX's profiler, with
the benchmark's inputs (bench_attention.Inputs: random data, a random page permutation, cache copies cycled
past L2); `flashmla` imports torch only (no JAX in that process: two CUPTI clients in one process are not
tried), draws the same kind of inputs in its own layout and runs its calls under torch's profiler, eagerly
("burst", "sustained": the launches stay ahead of the device at these sizes) and as one CUDA graph, as the
benchmark times them ("burst_graph": empty where the profiler shows no graph kernel nodes).
Page size 64 and one q_len a batch (FlashMLA's limits).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

D_CKV, D_KPE, PAGE = 512, 64, 64
L2_BYTES = 60 * 2**20  # bench_attention.L2_BYTES (not imported here: that would bring JAX into the torch process)


def parse_shape(text: str):
    """'128x4096h128q1' -> (batch, kv_len, heads, q_len)."""
    m = re.fullmatch(r"(\d+)x(\d+)h(\d+)q(\d+)", text)
    if not m:
        raise ValueError(f"--shape must look like 128x4096h128q1, got {text!r}")
    return tuple(int(v) for v in m.groups())


def per_call(kernels, is_main, calls):
    """Medians over the trace's chains of (main kernel us, other kernels' us, gap us, span per call us).

    kernels: (name, start_us, dur_us) of one process, in start order; is_main(name) picks the attention
    (splitkv) kernel, every other kernel of the chain counts as its merge (combine). Chains are runs of
    `calls` main kernels; gap = next main start - this main end (what the merge and the launch add)."""
    mains = [k for k in kernels if is_main(k[0])]
    main_us = [k[2] for k in mains]
    others = [k[2] for k in kernels if not is_main(k[0])]
    gaps, spans = [], []
    for c in range(len(mains) // calls):
        chain = mains[c * calls:(c + 1) * calls]
        gaps += [b[1] - (a[1] + a[2]) for a, b in zip(chain, chain[1:])]
        last_end = max(k[1] + k[2] for k in kernels if chain[0][1] <= k[1] < (
            mains[(c + 1) * calls][1] if (c + 1) * calls < len(mains) else math.inf))
        spans.append((last_end - chain[0][1]) / calls)
    med = lambda xs: statistics.median(xs) if xs else None
    return dict(main_us=med(main_us), main_min_us=min(main_us) if main_us else None, other_us=med(others),
                gap_us=med(gaps), span_us=med(spans), main_kernels=len(mains), other_kernels=len(others))


def run_ours(shape, calls, reps, power_s, min_work_units=None):
    import bench_attention as ba  # first: it sets the benchmark's XLA_FLAGS (command buffers) before JAX starts
    import gpu_power
    import jax
    b, l, h, q = shape
    inp = ba.Inputs((b, l, h, PAGE, q), calls)
    plan = inp.plan(min_work_units=min_work_units)
    f, a = ba._chain(calls, inp.n_sets), ba._chain_args(inp, plan, calls)
    for _ in range(2):
        jax.block_until_ready(f(*a))

    def traced(body):
        out, kernels = ba.traced_kernels(body)
        return per_call(kernels or [], ba.our_attention_kernel, calls), out

    rec = dict(plan=plan.describe())
    rec["burst"], _ = traced(lambda: [jax.block_until_ready(f(*a)) for _ in range(reps)])
    if power_s:
        rec["sustained"], rec["power"] = traced(
            lambda: gpu_power.sample_back_to_back(lambda: f(*a), jax.block_until_ready, power_s))
    return rec


def run_flashmla(shape, calls, reps, power_s, kit_dir):
    import numpy as np
    import torch
    import gpu_power
    sys.path.insert(0, os.path.abspath(kit_dir))
    import bench as kit  # the peer kit's bench.py; build() JIT-compiles (cached in FLASHMLA_BUILD_DIR)
    mod = kit.build(verbose=False)
    b, l, h, q = shape
    pages = -(-l // PAGE)
    copy_bytes = b * pages * PAGE * (D_CKV + D_KPE) * 2
    n_sets = int(min(8, max(1, math.ceil(4 * L2_BYTES / copy_bytes))))  # as bench_attention.Inputs
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    caches, tables = [], []
    for _ in range(n_sets):
        caches.append(torch.randn(b * pages, PAGE, 1, D_CKV + D_KPE, dtype=torch.bfloat16, device="cuda"))
        tables.append(torch.from_numpy(rng.permutation(b * pages).astype(np.int32).reshape(b, pages)).cuda())
    qs = [torch.randn(b, q, h, D_CKV + D_KPE, dtype=torch.bfloat16, device="cuda") for _ in range(calls)]
    seqlens = torch.full((b,), l, dtype=torch.int32, device="cuda")
    scale, causal = 192 ** -0.5, q > 1
    meta, nsplits = mod.get_decode_sched_meta(seqlens, q, h, 1)

    def chain():
        for k in range(calls):
            mod.dense_decode_fwd(qs[k], caches[k % n_sets], D_CKV, seqlens, tables[k % n_sets], scale, causal, meta,
                                 nsplits)

    for _ in range(2):
        chain()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    def traced(body):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = body()
            torch.cuda.synchronize()
        d = tempfile.mkdtemp(prefix="anatomy_")
        try:
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            events = json.load(open(path))["traceEvents"]
        finally:
            shutil.rmtree(d, ignore_errors=True)
        kernels = sorted(((e["name"], float(e["ts"]), float(e["dur"])) for e in events
                          if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda k: k[1])
        return per_call(kernels, lambda n: "splitkv_mla" in n, calls), out, sorted({k[0][:60] for k in kernels})

    rec = dict(sm_parts=int(meta.shape[0]))
    rec["burst"], _, rec["kernel_names"] = traced(lambda: [(chain(), torch.cuda.synchronize()) for _ in range(reps)])
    # As the benchmark times it: the chain as one CUDA graph (empty where the profiler shows no graph kernel nodes).
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    g.replay()
    torch.cuda.synchronize()
    rec["burst_graph"], _, _ = traced(lambda: [(g.replay(), torch.cuda.synchronize()) for _ in range(reps)])
    if power_s:
        rec["sustained"], rec["power"], _ = traced(
            lambda: gpu_power.sample_back_to_back(chain, lambda _: torch.cuda.synchronize(), power_s))
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--who", choices=("ours", "flashmla"), required=True)
    ap.add_argument("--shape", required=True, help="BxLhHqQ, e.g. 128x4096h128q1 (page size 64)")
    ap.add_argument("--calls", type=int, default=16, help="calls a chain")
    ap.add_argument("--reps", type=int, default=5, help="chains traced")
    ap.add_argument("--power", type=float, default=1.5, help="seconds back to back for the clock (0: none)")
    ap.add_argument("--flashmla", default=".peer/flashmla", help="the FlashMLA peer kit")
    ap.add_argument("--min-work-units", type=int, default=None,
                    help="ours: the plan's smallest work-table bucket (e.g. 512 at 128 heads: a plan the launch walks)")
    args = ap.parse_args()
    shape = parse_shape(args.shape)
    if args.who == "ours":
        rec = run_ours(shape, args.calls, args.reps, args.power, args.min_work_units)
    else:
        rec = run_flashmla(shape, args.calls, args.reps, args.power, args.flashmla)
    rec.update(who=args.who, shape=args.shape, calls=args.calls, reps=args.reps)
    if args.min_work_units is not None:
        rec["min_work_units"] = args.min_work_units
    clock = (rec.get("power") or {}).get("sm_MHz_median")
    if clock and (rec.get("sustained") or {}).get("main_us"):
        rec["sustained_main_kcycles"] = rec["sustained"]["main_us"] * clock / 1e3
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
