"""Where the host time of one host-planned decode step goes (GPU; runs on CPU too).

bench_decode.py reports the step's host time as plan + dispatch. This splits the dispatch
further, on the same V2-Lite-shaped stack and batch:

  step              Generator.decode's dispatch of the jitted step (median over steps)
  step, buffer on device
                    the same call with the packed host buffer already on the device
                    (what the numpy -> device transfer inside the call costs)
  device_put        the packed buffer's transfer alone
  no-op, all args   a program taking the step's arguments and doing nothing with the big ones
  no-op, 1 arg      a program of one small argument (JAX's fixed cost per call)

then traces a few steps with jax.profiler and sums the host-side events by name (XLA's
thunk execution, command-buffer record / update, PjRt execute), per step.

    python benchmarks/profile_decode_host.py                 # this process's XLA_FLAGS
    python benchmarks/profile_decode_host.py --variants      # also command buffers off / on for all ops
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import subprocess
import sys
import tempfile

VARIANTS = {
    "xla default": "",
    "command buffers off": "--xla_gpu_enable_command_buffer=",
    "command buffers, min graph 1": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL "
                                    "--xla_gpu_graph_min_graph_size=1",
}


def host_events(trace_dir: str) -> list[dict]:
    """Complete events on host threads of the Perfetto trace under trace_dir."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        return []
    with gzip.open(paths[-1], "rt") as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [e for e in events if e.get("ph") == "X" and "GPU" not in names.get(e.get("pid"), "")
            and "device" not in names.get(e.get("pid"), "").lower()]


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_decode import fresh_generator, median_us, noop_dispatch_us, v2_lite_attention_config
    from jax_mla.nn import DeepseekModel

    cfg = v2_lite_attention_config(args.layers, args.heads)
    model = DeepseekModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, with_mlp=False)
    ns = argparse.Namespace(batch=args.batch, context=args.context, page_size=args.page_size)
    # Steps: a warm-up of 4, two loops of --steps, and the fixed-length step timed by itself.
    gen = fresh_generator(model, ns, "auto", seed=3, steps=4 + 2 * args.steps + 1)
    gen.decode(4)
    jax.block_until_ready(gen.caches)
    gen.timings.clear()
    gen.decode(args.steps, fetch_lag=args.steps + 1)
    jax.block_until_ready(gen.caches)
    gen.results()
    out = {"flags": os.environ.get("XLA_FLAGS", ""),
           "step_dispatch_us": 1e6 * float(np.median(gen.timings["dispatch_s"])),
           "plan_us": 1e6 * float(np.median(gen.timings["plan_s"]))}

    mgr = gen.manager
    _, qo, num_tokens, _ = gen._decode_rows()
    plan = mgr.plan(qo, mgr.lengths + qo, num_heads=gen.local_heads, num_tokens=num_tokens)
    host, layout, static = gen._pack(plan, kv_lens=mgr.lengths + qo)
    table = mgr.device_page_table

    # The donating step consumes its inputs, so time it through the generator's own state.
    def donated(buf):
        gen.caches, gen.next_tokens, gen.rng, emitted, _ = gen._decode_step(
            gen.params, gen.caches, table, buf, gen.next_tokens, gen.rng, layout=layout, plan_static=static,
            with_logits=False)
        return emitted

    host_dev = jax.device_put(host)
    out["step_numpy_buffer_us"] = median_us(lambda: donated(host))
    out["step_device_buffer_us"] = median_us(lambda: donated(host_dev))
    out["device_put_us"] = median_us(lambda: jax.device_put(host))
    call = (gen.params, gen.caches, table, host_dev, gen.next_tokens, gen.rng)
    out["noop_all_args_us"] = noop_dispatch_us(call)
    out["noop_arguments"] = len(jax.tree.leaves(call))
    one = jax.jit(lambda t: t + 1)
    out["noop_one_arg_us"] = median_us(lambda: one(gen.next_tokens))

    with tempfile.TemporaryDirectory() as d:
        try:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                gen.decode(args.steps, fetch_lag=args.steps + 1)
                jax.block_until_ready(gen.caches)
            events = host_events(d)
        except Exception as e:  # no profiler plugin: the timings above still stand
            print(f"profiler: {type(e).__name__}: {e}")
            events = []
    gen.results()
    per_name = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        per_name[e["name"]][0] += float(e.get("dur", 0.0))
        per_name[e["name"]][1] += 1
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[: args.top]
    out["host_events_per_step"] = [{"name": n, "us_per_step": t / args.steps, "count_per_step": c / args.steps}
                                   for n, (t, c) in top]
    return out


def report(r: dict) -> None:
    print(f"XLA_FLAGS={r['flags']!r}")
    print(f"  plan {r['plan_us']:.0f} us, step dispatch {r['step_dispatch_us']:.0f} us (in the loop)")
    print(f"  step with the numpy buffer {r['step_numpy_buffer_us']:.0f} us, with it already on the device "
          f"{r['step_device_buffer_us']:.0f} us; device_put alone {r['device_put_us']:.0f} us")
    print(f"  no-op program: {r['noop_arguments']} args {r['noop_all_args_us']:.0f} us, 1 arg "
          f"{r['noop_one_arg_us']:.0f} us")
    for e in r["host_events_per_step"]:
        print(f"    {e['us_per_step']:9.1f} us/step  x{e['count_per_step']:6.1f}  {e['name'][:100]}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--variants", action="store_true", help="run once per XLA_FLAGS variant (subprocesses)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.variants:
        results = {}
        for name, flags in VARIANTS.items():
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--json", f.name] + [
                    f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("variants", "json")]
                env = dict(os.environ, XLA_FLAGS=flags)
                rc = subprocess.run(cmd, env=env).returncode
                if rc == 0:
                    with open(f.name) as g:
                        results[name] = json.load(g)
                else:
                    results[name] = {"error": f"exit {rc}"}
    else:
        r = run(args)
        report(r)
        results = r
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
