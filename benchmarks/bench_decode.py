"""Decode-step benchmark of a DeepSeek-V2-Lite-shaped MLA attention stack: our op vs the jnp reference.

Model: hidden 2048, 16 heads, q_proj (no q LoRA), kv_lora_rank 512, rope 64, nope 128,
v 128, --layers layers of [RMSNorm, MLAAttention, residual] (no MLP), small lm_head,
bf16. Batch --batch requests, each with --context cached tokens (random latents).

Per backend ('auto' = the FFI kernel of this platform, and 'reference'):
  device ms/step   a dependent chain of --chain decode steps in one jit (lax.scan on one
                   plan, caches donated), wall time / steps; median of --repeats.
  host us/step     the host-planned loop: reserve + plan + page-table update ("plan") and
                   the jitted step's dispatch ("dispatch"), medians over --host-steps steps;
                   "loop ms/step" is that loop's wall time per step (host and device overlap).
  check            relative L2 norm of one step's logits against the reference backend,
                   from identical caches and tokens.

    python benchmarks/bench_decode.py                  # GPU, batch 64 x 4096
    python benchmarks/bench_decode.py --small          # quick CPU run of the same code
    python benchmarks/bench_decode.py --stream 256     # also a stream of 256 requests through the slots
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_mla import resolve_backend
from jax_mla.nn import DeepseekConfig, DeepseekModel, Generator, PagedCacheManager

BYTES_PER_KV_TOKEN = (512 + 64) * 2  # bf16 ckv + kpe


def v2_lite_attention_config(layers: int, heads: int) -> DeepseekConfig:
    return DeepseekConfig(hidden_size=2048, num_attention_heads=heads, q_lora_rank=None, kv_lora_rank=512,
                          qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=1024,
                          intermediate_size=1, num_hidden_layers=layers, model_type="deepseek_v2")


def fresh_generator(model, args, backend, seed, steps):
    """A generator whose requests already hold `context` tokens of random latents, with pages for
    `steps` more decode steps."""
    pages_per_request = -(-(args.context + steps + 2) // args.page_size)
    mgr = PagedCacheManager(num_pages=args.batch * pages_per_request, page_size=args.page_size,
                            max_requests=args.batch, max_pages_per_request=pages_per_request)
    gen = Generator(model, mgr, backend=backend, min_token_bucket=args.batch)
    slots = mgr.admit([args.context] * args.batch)
    mgr.commit(slots, args.context)
    mgr.sync()
    key = jax.random.key(seed)
    caches = []
    for kv in gen.caches:
        key, k1, k2 = jax.random.split(key, 3)
        caches.append(type(kv)(jax.random.normal(k1, kv.ckv.shape, kv.ckv.dtype),
                               jax.random.normal(k2, kv.kpe.shape, kv.kpe.dtype)))
    gen.caches = tuple(caches)
    key, k3 = jax.random.split(key)
    gen.next_tokens = jax.random.randint(k3, gen.next_tokens.shape, 0, model.cfg.vocab_size, jnp.int32)
    jax.block_until_ready((gen.caches, gen.next_tokens))
    return gen


def median_us(fn, reps: int = 50) -> float:
    """Median host time of fn() in us (what handing over a call costs), after a warm-up call; each
    result is waited for outside the timing."""
    jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        r = fn()
        ts.append(time.perf_counter() - t0)
        jax.block_until_ready(r)
    return 1e6 * float(np.median(ts))


def noop_dispatch_us(call) -> float:
    """Median host time of handing the decode step's arguments `call` (params, caches, page table,
    host buffer, tokens, rng) to a compiled program that does nothing with the big ones: the dispatch
    cost of the arguments alone."""
    noop = jax.jit(lambda params, caches, table, host, tokens, rng: tokens + host[0, 0])
    return median_us(lambda: noop(*call))


def measure(model, args, backend):
    # One step's logits, for the check against the reference.
    gen = fresh_generator(model, args, backend, seed=1, steps=1)
    logits = np.asarray(gen.decode(1, with_logits=True)[0], np.float32)[: args.batch]
    del gen

    # Steps: the chains (a warm-up and --repeats), then each host loop's compile and timed steps.
    k = args.steps_per_dispatch
    gen = fresh_generator(model, args, backend, seed=2,
                          steps=(1 + args.repeats) * args.chain + (2 * k + args.host_steps) + (2 + args.host_steps))
    gen.decode_jitted(args.chain)  # compile + warm up
    jax.block_until_ready(gen.caches)
    per_step = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        gen.decode_jitted(args.chain)
        jax.block_until_ready(gen.caches)
        per_step.append((time.perf_counter() - t0) / args.chain)

    def host_loop(k):
        """The host-planned loop, k steps per dispatch: medians of the per-step host times, loop wall
        time per step."""
        gen.decode(2 * k, steps_per_dispatch=k)  # compile
        jax.block_until_ready(gen.caches)
        gen.timings.clear()
        t0 = time.perf_counter()
        gen.decode(args.host_steps, fetch_lag=args.host_steps + 1, steps_per_dispatch=k)
        jax.block_until_ready(gen.caches)
        loop = (time.perf_counter() - t0) / args.host_steps
        gen.results()
        med = {name: 1e6 * float(np.median(v)) for name, v in gen.timings.items() if name.endswith("_s")}
        return med, loop, int(np.median(gen.timings["h2d_bytes"]))

    med_k, loop_k, h2d_k = host_loop(args.steps_per_dispatch)
    med, loop, h2d = host_loop(1)
    # Dispatch = handing the step's arguments to the compiled program + launching it. A program with
    # the same arguments that does nothing with the big ones separates the two.
    mgr = gen.manager
    _, qo, num_tokens, _ = gen._decode_rows()
    plan = mgr.plan(qo, mgr.lengths + qo, num_heads=gen.local_heads, num_tokens=num_tokens)
    host, _, _ = gen._pack(plan, kv_lens=mgr.lengths + qo)
    call = (gen.params, gen.caches, mgr.device_page_table, host, gen.next_tokens, gen.rng)
    args_us = noop_dispatch_us(call)
    breakdown = {"reserve_us": med["reserve_s"], "plan_mla_us": med["plan_mla_s"], "sync_us": med["sync_s"],
                 "pack_and_transfer_us": med["pack_s"], "dispatch_arguments_us": args_us,
                 "dispatch_launch_us": med["dispatch_s"] - args_us, "arguments": len(jax.tree.leaves(call))}
    return logits, {
        "device_ms_per_step": 1e3 * float(np.median(per_step)),
        "device_ms_per_step_all": [1e3 * x for x in per_step],
        # The host-planned loop with --steps-per-dispatch steps per dispatch: host times per step
        # (a dispatch's time / its steps).
        "steps_per_dispatch": args.steps_per_dispatch,
        "host_plan_us": med_k["plan_s"],
        "host_dispatch_us": med_k["dispatch_s"],
        "loop_ms_per_step": 1e3 * loop_k,
        # The step's one packed host buffer (plan tables + lengths) and the page-table entries sent.
        "h2d_bytes_per_step_plan_and_lengths": h2d_k,
        # One step per dispatch: the same, and where its host time goes.
        "one_step_per_dispatch": {
            "host_plan_us": med["plan_s"], "host_dispatch_us": med["dispatch_s"], "loop_ms_per_step": 1e3 * loop,
            "h2d_bytes_per_step_plan_and_lengths": h2d, "host_breakdown": breakdown},
        "traces": dict(gen.traces),
    }


def measure_stream(model, args, admit: str) -> dict:
    """`Generator.serve` of --stream requests (random prompt and output lengths) through --batch slots,
    admitted in `admit` order, against the steady-state host-planned decode of --batch requests of the
    mean length."""
    rng = np.random.default_rng(0)
    n = args.stream
    prompts = [rng.integers(0, model.cfg.vocab_size, rng.integers(args.prompt_min, args.prompt_max + 1)).tolist()
               for _ in range(n)]
    new = rng.integers(args.new_min, args.new_max + 1, n)
    k = args.steps_per_dispatch
    longest = args.prompt_max + args.new_max + k - 1  # a request done inside a dispatch runs to its end
    pages_per_request = -(-longest // args.page_size)
    mgr = PagedCacheManager(num_pages=args.batch * pages_per_request, page_size=args.page_size,
                            max_requests=args.batch, max_pages_per_request=pages_per_request)
    gen = Generator(model, mgr, backend="auto", min_token_bucket=args.batch)
    gen.serve(prompts, new, steps_per_dispatch=k, admit=admit)  # compiles every bucket the stream touches
    compiles = dict(gen.traces)
    gen.timings.clear()
    out = gen.serve(prompts, new, steps_per_dispatch=k, admit=admit)  # the same stream again: timed
    st = gen.stream_stats
    assert [len(o) for o in out] == new.tolist()
    stream_tps = st["tokens"] / st["wall_s"]

    # Steady state: --batch requests of the stream's mean final length, host-planned decode.
    context = int(np.mean([len(p) for p in prompts]) + new.mean() / 2)
    steady_args = argparse.Namespace(**{**vars(args), "context": context})
    # Warm up past a page boundary: every request crosses it in the same step, and that page-table
    # update's size class compiles once.
    warm = args.page_size + 2 * k
    steady = fresh_generator(model, steady_args, "auto", seed=3, steps=warm + args.host_steps)
    steady.decode(warm, steps_per_dispatch=k)
    steady.results()
    t0 = time.perf_counter()
    steady.decode(args.host_steps, fetch_lag=4, steps_per_dispatch=k)
    steady.results()
    steady_tps = args.batch / ((time.perf_counter() - t0) / args.host_steps)
    ttft = np.asarray(st["ttft_s"]) * 1e3
    return {
        "requests": n, "slots": args.batch, "steps_per_dispatch": k, "admit": admit,
        # Mean busy slots per decode step (tokens from decode steps / steps / slots).
        "slot_use": (st["tokens"] - n) / max(st["decode_steps"], 1) / args.batch, "prompt_len": [args.prompt_min, args.prompt_max],
        "new_tokens": [args.new_min, args.new_max], "tokens": st["tokens"],
        "tokens_per_s": stream_tps, "steady_tokens_per_s": steady_tps, "steady_context": context,
        "ratio_to_steady": stream_tps / steady_tps,
        "ttft_ms_median": float(np.median(ttft)), "ttft_ms_p90": float(np.percentile(ttft, 90)),
        "compilations": compiles, "prefill_buckets": st["prefill_buckets"],
        "decode_steps": st["decode_steps"], "prefill_steps": st["prefill_steps"],
        "host_plan_us": 1e6 * float(np.median(gen.timings["plan_s"])),
        "host_dispatch_us": 1e6 * float(np.median(gen.timings["dispatch_s"])),
        "h2d_bytes_per_decode_step": int(np.median(gen.timings["h2d_bytes"])),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shapes for a CPU check of the script")
    p.add_argument("--batch", type=int)
    p.add_argument("--context", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--chain", type=int, help="decode steps per timed jit")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--host-steps", type=int, help="steps of the host-planned loop")
    p.add_argument("--json", default="bench_decode.json", help="where to write the results")
    p.add_argument("--steps-per-dispatch", type=int,
                   help="decode steps per dispatch of the host-planned loop (also measured: 1)")
    p.add_argument("--extra-batches", default="",
                   help="comma-separated batch sizes whose host-planned loop is also measured ('auto')")
    p.add_argument("--stream", type=int, default=0,
                   help="also serve this many requests through --batch slots (Generator.serve)")
    p.add_argument("--prompt-min", type=int)
    p.add_argument("--prompt-max", type=int)
    p.add_argument("--new-min", type=int)
    p.add_argument("--new-max", type=int)
    args = p.parse_args(argv)
    small = dict(batch=4, context=200, layers=2, chain=4, host_steps=8, prompt_min=4, prompt_max=40, new_min=2,
                 new_max=12, steps_per_dispatch=4)
    full = dict(batch=64, context=4096, layers=4, chain=16, host_steps=32, prompt_min=64, prompt_max=1024,
                new_min=64, new_max=512, steps_per_dispatch=8)
    for k, v in (small if args.small else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    dev = jax.devices()[0]
    cfg = v2_lite_attention_config(args.layers, args.heads)
    model = DeepseekModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, with_mlp=False)
    # Which implementation 'auto' runs here (the FFI kernel, or the reference where none is built).
    resolved = resolve_backend("auto", 512, 64)
    print(f"device: {dev.platform} {dev.device_kind}; jax {jax.__version__}; 'auto' runs: {resolved}")
    print(f"stack: {args.layers} layers, {args.heads} heads, kv_lora 512, rope 64, bf16; batch {args.batch} x "
          f"context {args.context}, page size {args.page_size}")

    results = {}
    logits = {}
    for backend in ("auto", "reference"):
        logits[backend], results[backend] = measure(model, args, backend)
    ref = logits["reference"]
    for backend in results:
        err = float(np.linalg.norm(logits[backend] - ref) / np.linalg.norm(ref))
        results[backend]["logits_rel_err_vs_reference"] = err

    kv_bytes = args.batch * args.context * BYTES_PER_KV_TOKEN * args.layers
    k = args.steps_per_dispatch
    print(f"\nhost-planned loop: {k} steps per dispatch (host us per step = a dispatch's / {k}); in brackets: "
          f"one step per dispatch")
    print(f"{'backend':<10} {'device ms/step':>15} {'plan us':>13} {'dispatch us':>13} {'loop ms/step':>15} "
          f"{'loop/device':>12} {'kv GB/s':>9} {'rel err':>9}")

    def row(label, r):
        one = r["one_step_per_dispatch"]
        return (f"{label:<10} {r['device_ms_per_step']:>15.3f} {r['host_plan_us']:>5.0f} ({one['host_plan_us']:>4.0f}) "
                f"{r['host_dispatch_us']:>5.0f} ({one['host_dispatch_us']:>4.0f}) {r['loop_ms_per_step']:>6.3f} "
                f"({one['loop_ms_per_step']:.3f}) {r['loop_ms_per_step'] / r['device_ms_per_step']:>12.2f}")

    for backend, r in results.items():
        gbs = kv_bytes / (r["device_ms_per_step"] * 1e-3) / 1e9
        r["kv_gb_per_s_whole_step"] = gbs
        print(f"{row(backend, r)} {gbs:>9.1f} {r['logits_rel_err_vs_reference']:>9.2e}")
    extra = {}
    for b in [int(x) for x in args.extra_batches.split(",") if x.strip()]:
        args_b = argparse.Namespace(**{**vars(args), "batch": b})
        _, r = measure(model, args_b, "auto")
        extra[f"batch{b}"] = r
        print(row(f"batch {b}", r))
    b = results["auto"]["one_step_per_dispatch"]["host_breakdown"]
    print(f"\nhost per step ('auto', one step per dispatch): reserve {b['reserve_us']:.0f} us, plan_mla {b['plan_mla_us']:.0f} us, "
          f"page-table sync {b['sync_us']:.0f} us, pack + transfer {b['pack_and_transfer_us']:.0f} us; dispatch: "
          f"{b['dispatch_arguments_us']:.0f} us handing over {b['arguments']} arguments (a no-op program with "
          f"the same arguments), {b['dispatch_launch_us']:.0f} us launching the step")
    speedup = results["reference"]["device_ms_per_step"] / results["auto"]["device_ms_per_step"]
    print(f"\nour op vs reference, device time per decode step: {speedup:.2f}x")
    print("(kv GB/s = cached kv bytes of all layers / whole-step device time: a lower bound for the attention op)")
    out = {"device": f"{dev.platform} {dev.device_kind}", "jax": jax.__version__, "host": platform.node(),
           "auto_backend": resolved,
           "args": vars(args), "speedup_device_time": speedup, "results": results, "extra_batches": extra}
    for admit in ("arrival", "longest_first") if args.stream else ():
        st = measure_stream(model, args, admit)
        out["stream" if admit == "arrival" else f"stream_{admit}"] = st
        print(f"\nstream ({admit} admission): {st['requests']} requests (prompts {args.prompt_min}-{args.prompt_max}, "
              f"{args.new_min}-{args.new_max} new tokens) through {st['slots']} slots ({st['slot_use']:.0%} busy): "
              f"{st['tokens_per_s']:.0f} tokens/s = {st['ratio_to_steady']:.2f}x steady-state decode at that "
              f"batch ({st['steady_tokens_per_s']:.0f}); time to first token median {st['ttft_ms_median']:.1f} ms, "
              f"p90 {st['ttft_ms_p90']:.1f} ms; compilations {st['compilations']} "
              f"({st['prefill_buckets']} prefill buckets); host per decode step: plan {st['host_plan_us']:.0f} us, "
              f"dispatch {st['host_dispatch_us']:.0f} us, H2D {st['h2d_bytes_per_decode_step']} bytes")
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
