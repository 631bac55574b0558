"""Session 21: per call in a jitted chain (CUPTI): attention kernel, merge end after it, gap to the next attention."""
import sys, statistics, tempfile, shutil
sys.path.insert(0, "benchmarks")
import bench_attention as B
import jax

shapes = [(128, 4096, 16, 64, 1), (32, 4096, 16, 64, 1), (128, 4096, 128, 64, 1), (128, 4096, 16, 64, 2),
          (64, 8192, 128, 64, 1), (1, 32768, 16, 64, 1)]
K = 8
for s in shapes:
    inp = B.Inputs(s, K)
    plan = inp.plan()
    f = B._chain(K, inp.n_sets)
    a = B._chain_args(inp, plan, K)
    jax.block_until_ready(f(*a))
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(5):
            jax.block_until_ready(f(*a))
    ev = B._trace_kernels(d)
    shutil.rmtree(d, ignore_errors=True)
    kern = sorted((e for e in ev if "mla_" in e["name"]), key=lambda e: e["ts"])
    att = [e for e in kern if "attention" in e["name"]]
    mer = [e for e in kern if "merge" in e["name"]]
    a_end = [e["ts"] + e["dur"] for e in att]
    m_end = [e["ts"] + e["dur"] for e in mer]
    tail = [m - a for a, m in zip(a_end, m_end)]
    gap = [att[i + 1]["ts"] - a_end[i] for i in range(len(att) - 1) if (i + 1) % K]
    overlap = sum(1 for g in gap if g < 0)
    med = statistics.median
    print(f"{B.shape_name(s):28s} attention {med(e['dur'] for e in att):7.1f} us | merge end - attention end "
          f"{med(tail):5.2f} (min {min(tail):5.2f}, max {max(tail):5.2f}) | attention end -> next attention start "
          f"{med(gap):5.2f} (min {min(gap):5.2f}; {overlap} of {len(gap)} negative) | device_time_ours "
          f"{B.device_time_ours(inp, plan, K) * 1e6:6.1f} us", flush=True)
