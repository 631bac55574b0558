"""Several devices against one: data-parallel decode, tensor-parallel heads, context-parallel attention.

All on the DeepSeek-V2-Lite-shaped attention stack of bench_decode.py (hidden 2048, kv_lora 512,
rope 64, bf16, no MLP), with random cached latents. Device time: a dependent chain of steps in
one jit, wall time / steps, median of --repeats (after a warm-up chain).

  dp   --layers layers, 16 heads, `--batch` requests of `--context` tokens per device.
       One device: Generator without a mesh; D devices: Generator(mesh=(D, 1)), D x batch requests
       (each data shard its own cache). tokens/s = requests / step time, fully jitted loop
       (`decode_jitted`); the host-planned loop's ms/step is reported beside it.
       dp_speedup = tokens/s on D devices / tokens/s on one.
  tp   one layer, --tp-heads heads, the same per-device batch: Generator(mesh=(1, D)) against one
       device. Step time of the one-layer stack (attention layer + embedding and a 1024-word head);
       both start from the same random caches, so their first step's logits are compared.
  cp   attention op alone, one request of --cp-context tokens, --cp-heads heads, q_len 1: one
       device (mla_paged_attention) against the request's pages spread round robin over D
       devices (jax_mla.parallel.context_parallel_attention, each device its own plan, LSE merge
       over the devices). The chain feeds each step's output back as the next query.

    python benchmarks/bench_parallel.py --json out.json         # every device JAX sees
    python benchmarks/bench_parallel.py --small                  # tiny shapes (CPU check)

On one device every case runs its mesh path on a 1-device mesh against no mesh: what the mesh
machinery itself costs.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_mla import mla_paged_attention, plan_mla, default_target, resolve_backend
from jax_mla.nn import DeepseekModel, Generator, PagedCacheManager
from jax_mla.parallel import (context_parallel_attention, context_parallel_lengths, context_parallel_page_tables,
                              local_plan, make_mesh, shard_map, stack_plans)

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_decode import v2_lite_attention_config  # noqa: E402


def timed_chain(run, repeats: int, steps: int) -> list[float]:
    """run() dispatches `steps` dependent steps and returns something to wait on; seconds per step."""
    jax.block_until_ready(run())  # compile + warm up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        out.append((time.perf_counter() - t0) / steps)
    return out


def filled_generator(model, args, mesh, requests: int, seed: int) -> Generator:
    """A Generator (mesh or not) whose `requests` requests already hold `context` random tokens."""
    slack = (2 + args.repeats) * args.chain + args.host_steps + 2
    pages_per_request = -(-(args.context + slack) // args.page_size)
    shards = 1 if mesh is None else mesh.shape["data"]
    per_shard = requests // shards
    mgr = PagedCacheManager(num_pages=per_shard * pages_per_request, page_size=args.page_size,
                            max_requests=per_shard, max_pages_per_request=pages_per_request)
    gen = Generator(model, mgr, backend="auto", min_token_bucket=per_shard, mesh=mesh)
    slots = gen.manager.admit([args.context] * requests)
    gen.manager.commit(slots, args.context)
    gen.manager.sync()
    key = jax.random.key(seed)
    caches = []
    for kv in gen.caches:
        key, k1, k2 = jax.random.split(key, 3)
        rand = [jax.jit(lambda k, a=a: jax.random.normal(k, a.shape, a.dtype), out_shardings=a.sharding)(k)
                for a, k in ((kv.ckv, k1), (kv.kpe, k2))]
        caches.append(type(kv)(*rand, kv.ckv_scale, kv.kpe_scale))
    gen.caches = tuple(caches)
    jax.block_until_ready(gen.caches)
    return gen


def measure_generator(model, args, mesh, requests: int) -> dict:
    gen = filled_generator(model, args, mesh, requests, seed=1)
    rows = gen._decode_rows()[3]
    first = np.asarray(gen.decode(1, with_logits=True)[0], np.float32)[rows >= 0]  # requests in slot order

    def chain():
        gen.decode_jitted(args.chain)
        return gen.caches

    per_step = timed_chain(chain, args.repeats, args.chain)
    gen.decode(2)
    jax.block_until_ready(gen.caches)
    t0 = time.perf_counter()
    gen.decode(args.host_steps, fetch_lag=args.host_steps + 1)
    jax.block_until_ready(gen.caches)
    loop = (time.perf_counter() - t0) / args.host_steps
    step = float(np.median(per_step))
    return {"requests": requests, "device_ms_per_step": 1e3 * step,
            "device_ms_per_step_all": [1e3 * x for x in per_step],
            "tokens_per_s": requests / step, "host_loop_ms_per_step": 1e3 * loop, "traces": dict(gen.traces),
            "first_step_logits": first}


def measure_cp(args, devices) -> dict:
    """Attention of one long request on one device, and spread over len(devices) devices."""
    c, ps, h, n = len(devices), args.page_size, args.cp_heads, args.cp_context
    rng = np.random.default_rng(0)
    n_pages = -(-(n + 1) // ps)
    per_shard = -(-n_pages // c)
    # Logical page j on shard j % c, shuffled within the shard's pool [d * per_shard, (d+1) * per_shard).
    pools = [list(rng.permutation(per_shard) + d * per_shard) for d in range(c)]
    table = np.array([[pools[j % c].pop() for j in range(n_pages)]], np.int32)
    total_pages = c * per_shard
    key = jax.random.key(2)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    bf16 = jnp.bfloat16
    q_nope = jax.random.normal(k3, (1, h, 512), bf16)
    q_pe = jax.random.normal(k4, (1, h, 64), bf16)
    scale = 1.0 / np.sqrt(192.0)
    target = default_target(devices[0])
    lens = np.array([n])

    def chain_of(attend):
        def run(q_nope, q_pe, *rest):
            def step(q, _):
                return attend(q, q_pe, *rest).astype(bf16), None
            return jax.lax.scan(step, q_nope, None, length=args.chain)[0]
        return run

    results = {}
    # One device: every page, one plan.
    one = devices[0]
    ckv = jax.device_put(jax.random.normal(k1, (total_pages, ps, 512), bf16), one)
    kpe = jax.device_put(jax.random.normal(k2, (total_pages, ps, 64), bf16), one)
    plan = plan_mla([1], lens, num_heads=h, page_size=ps, target=target)
    single = jax.jit(chain_of(lambda q, qp, ckv, kpe, t, kv, plan: mla_paged_attention(
        q, qp, ckv, kpe, t, kv, plan, sm_scale=scale)))
    args_one = jax.device_put((q_nope, q_pe, ckv, kpe, table, lens.astype(np.int32), plan), one)
    ref = np.asarray(jax.jit(lambda *a: mla_paged_attention(*a, sm_scale=scale))(*args_one), np.float32)
    results["one_device_us"] = 1e6 * float(np.median(timed_chain(lambda: single(*args_one), args.repeats,
                                                                  args.chain)))
    # c devices: shard d holds pages [d * per_shard, (d + 1) * per_shard) of the same cache.
    mesh = Mesh(np.array(devices), ("cp",))
    split = NamedSharding(mesh, P("cp"))
    local_tables = context_parallel_page_tables(table, c, pages_per_shard=per_shard)
    local_lens = np.stack([context_parallel_lengths(lens, ps, c, d) for d in range(c)]).astype(np.int32)
    plans = stack_plans([plan_mla([1], np.maximum(local_lens[d], 1), num_heads=h, page_size=ps, target=target)
                         for d in range(c)])

    def attend_cp(q, qp, ckv, kpe, t, kv, plan):
        return context_parallel_attention(q, qp, ckv, kpe, t[0], kv[0], local_plan(plan), axis_name="cp",
                                          sm_scale=scale)

    cp_args = (jax.device_put((q_nope, q_pe), NamedSharding(mesh, P()))
               + jax.device_put((ckv, kpe, local_tables, local_lens, plans), split))
    specs = (P(), P(), P("cp"), P("cp"), P("cp"), P("cp"), P("cp"))
    cp_one = jax.jit(shard_map(attend_cp, mesh=mesh, in_specs=specs, out_specs=P()))
    got = np.asarray(cp_one(*cp_args), np.float32)
    cp_chain = jax.jit(shard_map(chain_of(attend_cp), mesh=mesh, in_specs=specs, out_specs=P()))
    results[f"{c}_devices_us"] = 1e6 * float(np.median(timed_chain(lambda: cp_chain(*cp_args), args.repeats,
                                                                    args.chain)))
    results["speedup"] = results["one_device_us"] / results[f"{c}_devices_us"]
    results["rel_err_vs_one_device"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    results.update(context=n, heads=h, page_size=ps, pages_per_device=per_shard)
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shapes for a CPU check of the script")
    p.add_argument("--devices", type=int, help="devices to use (default: all)")
    p.add_argument("--batch", type=int, help="requests per device (dp, tp)")
    p.add_argument("--context", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--tp-heads", type=int)
    p.add_argument("--cp-heads", type=int)
    p.add_argument("--cp-context", type=int)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--chain", type=int)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--host-steps", type=int)
    p.add_argument("--only", nargs="*", choices=["dp", "tp", "cp"], help="run only these cases")
    p.add_argument("--json", default="bench_parallel.json")
    args = p.parse_args(argv)
    small = dict(batch=4, context=200, layers=2, tp_heads=8, cp_heads=8, cp_context=3000, chain=4, host_steps=4)
    full = dict(batch=64, context=4096, layers=4, tp_heads=128, cp_heads=16, cp_context=131072, chain=16,
                host_steps=32)
    for k, v in (small if args.small else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    devices = jax.devices()[: args.devices or None]
    n = len(devices)
    if n == 1:
        print("one device: each case runs its mesh path on a 1-device mesh against no mesh (the mesh's overhead)")
    dev = devices[0]
    print(f"{n} x {dev.platform} {dev.device_kind}; jax {jax.__version__}; 'auto' runs: "
          f"{resolve_backend('auto', 512, 64)}")
    out = {"command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
           "device": f"{n} x {dev.platform} {dev.device_kind}", "jax": jax.__version__, "host": platform.node(),
           "args": vars(args)}
    cases = args.only or ["dp", "tp", "cp"]
    if "dp" in cases:
        model = DeepseekModel(v2_lite_attention_config(args.layers, 16), rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                              param_dtype=jnp.bfloat16, with_mlp=False)
        one = measure_generator(model, args, None, args.batch)
        many = measure_generator(model, args, make_mesh(n, 1, devices), n * args.batch)
        one.pop("first_step_logits"), many.pop("first_step_logits")  # other requests: not comparable
        out["dp"] = {"one_device": one, f"dp{n}": many}
        out["dp_speedup"] = many["tokens_per_s"] / one["tokens_per_s"]
        print(f"dp: 1 device {one['tokens_per_s']:.0f} tok/s ({one['device_ms_per_step']:.3f} ms/step); "
              f"dp={n} {many['tokens_per_s']:.0f} tok/s ({many['device_ms_per_step']:.3f} ms/step): "
              f"{out['dp_speedup']:.2f}x; host loop {one['host_loop_ms_per_step']:.3f} / "
              f"{many['host_loop_ms_per_step']:.3f} ms/step")
    if "tp" in cases:
        model = DeepseekModel(v2_lite_attention_config(1, args.tp_heads), rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                              param_dtype=jnp.bfloat16, with_mlp=False)
        one = measure_generator(model, args, None, args.batch)
        many = measure_generator(model, args, make_mesh(1, n, devices), args.batch)
        ratio = many["device_ms_per_step"] / one["device_ms_per_step"]
        a, b = many.pop("first_step_logits"), one.pop("first_step_logits")  # same caches: same values
        err = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        out["tp"] = {"one_device": one, f"tp{n}": many, "time_ratio": ratio, "heads": args.tp_heads,
                     "logits_rel_err_vs_one_device": err}
        print(f"tp: {args.tp_heads} heads, 1 layer: 1 device {one['device_ms_per_step']:.3f} ms/step, tp={n} "
              f"{many['device_ms_per_step']:.3f} ms/step: {ratio:.2f}x the time (logits rel err {err:.1e})")
    if "cp" in cases:
        r = measure_cp(args, devices)
        out["cp"] = r
        print(f"cp: 1 x {r['context']} tokens, {r['heads']} heads: 1 device {r['one_device_us']:.1f} us, "
              f"{n} devices {r[f'{n}_devices_us']:.1f} us: {r['speedup']:.2f}x (rel err "
              f"{r['rel_err_vs_one_device']:.1e})")
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
