"""Batched generation with a small DeepSeek-style model on jax_mla's paged MLA attention.

Builds the model (random weights, or an HF DeepSeek-V2/V3 checkpoint with --hf),
prefills a batch of prompts of different lengths, decodes --new-tokens tokens per
prompt with the host-planned loop (progress bar; --steps-per-dispatch steps per
dispatch), repeats the decode with the fully jitted loop, and checks both against the
same model on the jnp reference attention. With --stream N it also serves N requests
through the slots (admitted and finished between dispatches) and checks them against
the reference too.

    python examples/demo.py                 # CPU here; the GPU when JAX has one
    python examples/demo.py --hf /path/to/checkpoint --new-tokens 32
    python examples/demo.py --stream 64     # a longer stream of requests through the --batch slots (0: none)
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_mla import resolve_backend
from jax_mla.nn import DeepseekConfig, DeepseekModel, Generator, PagedCacheManager, RopeScaling, hf

try:
    from tqdm import tqdm
except ImportError:  # the bar is decoration; the demo runs without it
    tqdm = None


def demo_config(layers: int) -> DeepseekConfig:
    """DeepSeek attention shapes (kv_lora_rank 512, rope 64: what the CUDA kernel is built for),
    narrow everywhere else so that it runs on a laptop CPU."""
    return DeepseekConfig(hidden_size=512, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=512,
                          qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, vocab_size=4096,
                          intermediate_size=1024, num_hidden_layers=layers, max_position_embeddings=16384,
                          rope_scaling=RopeScaling(factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                                                   original_max_position_embeddings=4096),
                          model_type="deepseek_v3")


def make_manager(args, max_len: int) -> PagedCacheManager:
    pages_per_request = -(-max_len // args.page_size)
    return PagedCacheManager(num_pages=args.batch * pages_per_request, page_size=args.page_size,
                             max_requests=args.batch, max_pages_per_request=pages_per_request)


def parts_at_near_ties(model, args, cache, max_len, prompts, outs, refs, tol) -> bool:
    """Greedy decoding follows the reference token for token, except where the reference itself has a
    near tie (two tokens within the logit tolerance): kernels that round differently (bf16 / TF32 on a
    GPU) may then take the other one, and the sequences part. True if every parting is such a tie."""
    ok = True
    for p, o, r in zip(prompts, outs, refs):
        if o == r:
            continue
        k = next((j for j in range(min(len(o), len(r))) if o[j] != r[j]), None)
        if k is None:  # one is a prefix of the other: a length bug, never a tie
            return False
        probe = Generator(model, make_manager(args, max_len), backend="reference", **cache)
        (s,), logits = probe.prefill([list(p) + list(r[:k])], with_logits=True)
        row = np.asarray(logits)[s]
        ok &= bool(row[r[k]] - row[o[k]] <= tol * max(float(np.abs(row).max()), 1.0))
    return ok


def serve_stream(model, args, cache, rng, tol: float) -> bool:
    """A stream of requests through the slots, on the chosen backend and on the reference; same tokens?"""
    n = args.stream
    s_lens = rng.integers(args.min_prompt, args.max_prompt + 1, n)
    prompts = [rng.integers(0, model.cfg.vocab_size, k).tolist() for k in s_lens]
    new = rng.integers(1, args.new_tokens + 1, n)
    max_len = args.max_prompt + args.new_tokens + args.steps_per_dispatch - 1
    gen = Generator(model, make_manager(args, max_len), backend=args.backend, **cache)
    out = gen.serve(prompts, new, steps_per_dispatch=args.steps_per_dispatch)
    st = gen.stream_stats
    ref = Generator(model, make_manager(args, max_len), backend="reference", **cache).serve(prompts, new)
    same = sum(o == r for o, r in zip(out, ref))
    ties_ok = parts_at_near_ties(model, args, cache, max_len, prompts, out, ref, tol)
    print(f"stream: {n} requests ({s_lens.min()}..{s_lens.max()} prompt tokens, 1..{args.new_tokens} new) through "
          f"{args.batch} slots: {st['prefill_steps']} prefill and {st['decode_steps']} decode steps, "
          f"{st['tokens'] / st['wall_s']:,.0f} tokens/s (includes compiles: {dict(gen.traces)}), time to first "
          f"token median {1e3 * float(np.median(st['ttft_s'])):.0f} ms; requests identical to the reference path: "
          f"{same}/{n}" + ("" if same == n else f" (the others part at near ties: {ties_ok})"))
    return ties_ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", metavar="PATH", help="HF DeepSeek-V2/V3 checkpoint folder (dense layers only)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--min-prompt", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--layers", type=int, default=4, help="layers of the random model")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--backend", choices=["auto", "ffi", "reference"], default="auto")
    p.add_argument("--kv-cache-dtype", choices=["float32", "bfloat16", "float8_e4m3fn"], default=None,
                   help="latent cache dtype (default: --dtype); float8_e4m3fn: FP8 ckv with a per-layer scale")
    p.add_argument("--kv-scale", type=float, default=1.0, help="the FP8 cache's scale (value = fp8 x scale)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps-per-dispatch", type=int, default=8, metavar="K",
                   help="decode steps per dispatch of the host-planned loop and the stream")
    p.add_argument("--stream", type=int, default=16, metavar="N",
                   help="also serve N requests of random prompt and output lengths through the --batch slots "
                        "(Generator.serve: admitted and finished between steps), checked against the reference")
    args = p.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    kv_dtype = jnp.dtype(args.kv_cache_dtype or args.dtype)
    cache = dict(kv_cache_dtype=kv_dtype, kv_scale=args.kv_scale)

    dev = jax.devices()[0]
    if args.hf:
        model = hf.load_hf_model(args.hf, dtype=dtype, param_dtype=dtype)
        source = args.hf
    else:
        model = DeepseekModel(demo_config(args.layers), rngs=nnx.Rngs(args.seed), dtype=dtype, param_dtype=dtype)
        source = "random weights"
    cfg = model.cfg
    print(f"model: {source}; {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} "
          f"heads, kv_lora_rank {cfg.kv_lora_rank}, rope {cfg.qk_rope_head_dim}, vocab {cfg.vocab_size}, {args.dtype}")

    rng = np.random.default_rng(args.seed)
    lens = np.linspace(args.min_prompt, args.max_prompt, args.batch).astype(int)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lens]
    max_len = int(lens.max()) + args.new_tokens
    steps = args.new_tokens - 1  # the prefill samples the first new token
    runs = resolve_backend(args.backend, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    print(f"device: {dev.platform} ({dev.device_kind}); attention backend: {args.backend} -> {runs}"
          + (" (no FFI kernel for this platform and these head dims)" if args.backend == "auto" and runs == "reference"
             else ""))
    print(f"latent cache: {kv_dtype.name}" + (f" (scale {args.kv_scale:g})" if kv_dtype.itemsize == 1 else ""))
    print(f"prompts: {args.batch} of {lens.min()}..{lens.max()} tokens; {args.new_tokens} new tokens each")

    # ---- host-planned loop on the chosen backend -------------------------------------
    gen = Generator(model, make_manager(args, max_len), backend=args.backend, **cache)
    t0 = time.perf_counter()
    slots, _ = gen.prefill(prompts, with_logits=True)
    gen.results()
    t_prefill = time.perf_counter() - t0
    bar = tqdm(total=steps, desc="decode", unit="step", leave=False) if tqdm else None
    # Timed: the whole dispatches after the first (which compiles); a shorter last one compiles too.
    k = args.steps_per_dispatch
    first = min(k, steps)
    timed_end = first + (steps - first) // k * k
    t_first = t_end = None

    def tick(i):
        nonlocal t_first, t_end
        if i == first - 1:
            gen.results()
            t_first = time.perf_counter()
        if i == timed_end - 1 and timed_end > first:
            gen.results()
            t_end = time.perf_counter()
        if bar is not None:
            bar.update(1)

    logits = gen.decode(steps, with_logits=True, on_step=tick, steps_per_dispatch=k)
    out = gen.results()
    if bar is not None:
        bar.close()
    logits = [np.asarray(x) for x in logits]
    host_tps = args.batch * (timed_end - first) / (t_end - t_first) if t_end is not None else float("nan")
    plan_us = 1e6 * float(np.median(gen.timings["plan_s"]))
    dispatch_us = 1e6 * float(np.median(gen.timings["dispatch_s"]))

    # ---- fully jitted loop: two scans of half the steps (the first one compiles) ----------
    gen_j = Generator(model, make_manager(args, max_len), backend=args.backend, **cache)
    gen_j.prefill(prompts)
    half = steps // 2
    gen_j.decode_jitted(half)
    gen_j.results()
    t0 = time.perf_counter()
    gen_j.decode_jitted(half)
    gen_j.results()
    jit_tps = args.batch * half / (time.perf_counter() - t0) if half else float("nan")
    if steps - 2 * half:
        gen_j.decode_jitted(steps - 2 * half)
    out_j = gen_j.results()

    # ---- the same model on the jnp reference attention ---------------------------------
    gen_r = Generator(model, make_manager(args, max_len), backend="reference", **cache)
    gen_r.prefill(prompts)
    ref_logits = [np.asarray(x) for x in gen_r.decode(steps, with_logits=True)]
    out_r = gen_r.results()
    n = args.batch
    # Step j's logits are compared for the requests whose tokens so far equal the reference's (after
    # a parting at a near tie the inputs differ); partings must be near ties (parts_at_near_ties).
    rows = np.argsort(np.argsort(slots))  # request i's row in a step's logits: rows are in slot order
    diff = max([float(np.abs(a[rows[i]] - b[rows[i]]).max()) for j, (a, b) in enumerate(zip(logits, ref_logits))
                for i, s in enumerate(slots) if out[s][: j + 1] == out_r[s][: j + 1]], default=0.0)
    scale = max(float(np.abs(b[:n]).max()) for b in ref_logits) if steps else 1.0
    same_host = sum(out[s] == out_r[s] for s in slots)
    same_jit = sum(out_j[s] == out_r[s] for s in slots)
    tol = 1e-3 if dtype == jnp.float32 and kv_dtype == jnp.float32 else 5e-2
    ties = parts_at_near_ties(model, args, cache, max_len, prompts * 2,
                              [out[s] for s in slots] + [out_j[s] for s in slots], [out_r[s] for s in slots] * 2, tol)

    print(f"prefill: {int(lens.sum())} tokens in {t_prefill:.2f} s (includes compile)")
    print(f"decode, host-planned loop: {host_tps:,.0f} tokens/s (batch {n}, {k} steps per dispatch, after the "
          f"first dispatch); per step: plan {plan_us:.0f} us, dispatch {dispatch_us:.0f} us (medians)")
    print(f"decode, fully jitted loop: {jit_tps:,.0f} tokens/s ({half} steps in one jit)")
    print(f"max |logit difference| vs reference attention: {diff:.3g} (logits up to {scale:.3g})")
    print(f"requests identical to the reference path: host-planned {same_host}/{n}, jitted {same_jit}/{n}"
          + ("" if same_host == same_jit == n else f" (the others part at near ties: {ties})"))
    print(f"request 0 continues with: {out[slots[0]][:16]}{' ...' if len(out[slots[0]]) > 16 else ''}")
    ok = ties and diff <= tol * max(scale, 1.0)
    if args.stream:
        ok = serve_stream(model, args, cache, rng, tol) and ok
    if ok:
        what = "both loops and the stream match" if args.stream else "both loops match"
        print(f"PASS: {what} the reference attention path (logit tolerance {tol * max(scale, 1.0):.3g})")
    else:
        print(f"FAIL: mismatch against the reference attention path (partings at near ties only: {ties}; "
              f"logit difference {diff:.3g}, tolerance {tol * max(scale, 1.0):.3g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
