"""Several devices (jax_mla.parallel, Generator(mesh=...)): a (data, tensor) mesh gives the single
device's tokens and logits and moves no data between steps; context parallel attention equals
the unsplit op; per-shard plans stack to common shapes.

The multi-device checks run in a subprocess with 8 fake CPU devices (the device count is fixed
when JAX starts); the host-only pieces run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jax_mla import PlanTarget, plan_mla
from jax_mla.parallel import context_parallel_lengths, context_parallel_page_tables, stack_plans

pytest.importorskip("flax", reason="the Generator needs flax (pip install .[nn])")


def run_on_fake_devices(script: str, devices: int = 8) -> dict:
    """Run `script` with `devices` CPU devices; it prints one JSON line prefixed by RESULT."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"))
    tests = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                       timeout=900, cwd=tests)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-4000:] + r.stderr[-8000:]
    return json.loads(lines[-1][len("RESULT "):])


# ---- data x tensor mesh: the Generator ------------------------------------------------------
MESH_SCRIPT = """
    import json, re, collections
    import jax, numpy as np
    from test_nn_decode import tiny_model, PROMPTS
    from jax_mla.nn import Generator, PagedCacheManager
    from jax_mla.parallel import make_mesh

    def manager():
        return PagedCacheManager(num_pages=48, page_size=4, max_requests=4, max_pages_per_request=16)

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    def run(mesh, backend):
        # prefill 3 prompts, 4 host-planned steps, finish one, admit two more mid-stream, 3 steps,
        # then 3 fully jitted steps. Returns tokens per request (in arrival order) and logits per slot.
        gen = Generator(tiny_model(), manager(), backend=backend, mesh=mesh)
        slots, pre = gen.prefill(PROMPTS, with_logits=True)
        pre = {s: np.asarray(pre)[s] for s in slots}
        steps = gen.decode(4, with_logits=True)
        rows = gen._decode_rows()[3]
        step_logits = [{int(s): np.asarray(x)[i] for i, s in enumerate(rows) if s >= 0} for x in steps]
        done = {slots[1]: gen.finish(slots[1])}
        late = gen.prefill([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7]])
        gen.decode(3)
        gen.decode_jitted(3)
        out = gen.results()
        order = [slots[0], slots[1], slots[2]] + late
        tokens = [done.get(s, out.get(s)) for s in order]
        return gen, tokens, pre, step_logits, slots

    res = {}
    for backend in ("ffi", "reference"):
        one, want, want_pre, want_steps, want_slots = run(None, backend)
        # every mesh shape on the kernel; the reference backend (the same sharding code around another
        # attention) on dp2 x tp2 only, which keeps this subprocess within a CI minute or so
        for shape in ((2, 2), (4, 1), (1, 4), (2, 4)) if backend == "ffi" else ((2, 2),):
            mesh = make_mesh(*shape)
            gen, got, pre, steps, slots = run(mesh, backend)
            pre_err = max(rel(pre[s], want_pre[w]) for s, w in zip(slots, want_slots))
            step_err = max(rel(st[s], wt[w]) for st, wt in zip(steps, want_steps) for s, w in zip(slots, want_slots))
            res[f"{backend} {shape}"] = dict(tokens_equal=got == want, logits_err=max(pre_err, step_err),
                                             traces=dict(gen.traces), one_device_traces=dict(one.traces),
                                             shards=sorted({s // 4 for s in slots}))

    # Nothing moves between devices but the tensor axis' partial sums: inspect the compiled
    # decode step, and run steps with device-to-device and device-to-host transfers disallowed.
    colls = {}
    for shape in ((2, 2), (4, 1)):
        gen = Generator(tiny_model(), manager(), backend="ffi", mesh=make_mesh(*shape))
        gen.prefill(PROMPTS)
        hlo = gen.lower_decode_step().compile().as_text()
        found = re.findall(r"= \\S+ (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                           r"(?:-start)?\\(", hlo)
        colls[str(shape)] = dict(collections.Counter(found))
        with jax.transfer_guard_device_to_device("disallow"), jax.transfer_guard_device_to_host("disallow"):
            gen.decode(3)
            gen.decode_jitted(2)
            gen.decode(4, steps_per_dispatch=2)
        colls[str(shape) + " cache"] = [str(a) for a in gen.caches[0].ckv.sharding.spec]
    res["collectives"] = colls

    # A stream of requests through the data shards' slots gives the one-device stream's tokens.
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 97, rng.integers(2, 10)).tolist() for _ in range(10)]
    budget = rng.integers(1, 7, 10)
    one = Generator(tiny_model(), manager(), backend="ffi").serve(prompts, budget)
    mesh_gen = Generator(tiny_model(), manager(), backend="ffi", mesh=make_mesh(2, 2))
    res["stream"] = dict(equal=mesh_gen.serve(prompts, budget) == one, stats=mesh_gen.stream_stats,
                         lengths=[len(o) for o in one] == budget.tolist())
    # ... and so does one with three steps per dispatch.
    mesh_gen = Generator(tiny_model(), manager(), backend="ffi", mesh=make_mesh(2, 2))
    res["stream"]["multi_step_equal"] = mesh_gen.serve(prompts, budget, steps_per_dispatch=3) == one
    res["stream"]["multi_step_traces"] = dict(mesh_gen.traces)

    # Argument checks.
    errors = []
    for kw in (dict(mesh=make_mesh(1, 3)), dict(mesh=(2,))):
        try:
            Generator(tiny_model(), manager(), backend="ffi", **kw)
        except ValueError as e:
            errors.append(str(e))
    res["errors"] = errors
    print("RESULT " + json.dumps(res))
"""


@pytest.fixture(scope="module")
def mesh_results():
    return run_on_fake_devices(MESH_SCRIPT)


@pytest.mark.parametrize("backend, shape", [("ffi", "(2, 2)"), ("ffi", "(4, 1)"), ("ffi", "(1, 4)"),
                                            ("ffi", "(2, 4)"), ("reference", "(2, 2)")])
def test_mesh_decode_equals_single_device(mesh_results, backend, shape):
    """dp x tp Generator vs one device (fp32): same greedy tokens through prefill, host-planned and
    jitted decode, a finish and a mid-stream admission; logits within 1e-5; each step compiled once
    per bucket, as on one device (two prefill buckets, decode with and without logits)."""
    r = mesh_results[f"{backend} ({shape[1:-1]})"]
    assert r["tokens_equal"]
    assert r["logits_err"] < 1e-5, r["logits_err"]
    assert r["traces"] == r["one_device_traces"] == {"prefill": 2, "decode": 2, "decode_scan": 1}, r
    data = int(shape[1])
    assert len(r["shards"]) == min(data, 3)  # the three prompts were spread over the data shards


def test_mesh_decode_step_moves_no_data(mesh_results):
    """The compiled step's only collectives are the tensor axis' partial sums (o_proj and the MLP's
    down projection, per layer); with data parallelism alone there are none; steps run with
    device-to-device and device-to-host transfers disallowed; the cache stays split over data."""
    c = mesh_results["collectives"]
    layers = 2
    assert c["(2, 2)"] == {"all-reduce": 2 * layers}, c
    assert c["(4, 1)"] == {}, c
    assert c["(2, 2) cache"] == c["(4, 1) cache"] == ["data"]


def test_mesh_stream_of_requests_equals_single_device(mesh_results):
    r = mesh_results["stream"]
    assert r["equal"] and r["lengths"] and r["stats"]["prefill_steps"] > 1
    assert r["multi_step_equal"] and r["multi_step_traces"].get("decode", 0) == 0, r


def test_mesh_bad_arguments(mesh_results):
    e = mesh_results["errors"]
    assert len(e) == 2
    assert "num_attention_heads=4" in e[0] and "tensor size 3" in e[0]
    assert "(data, tensor)" in e[1]


# ---- context parallelism ---------------------------------------------------------------------
CP_SCRIPT = """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jax_mla import PlanTarget, mla_paged_attention_reference, plan_mla
    from jax_mla.parallel import (context_parallel_attention, context_parallel_lengths,
                                  context_parallel_page_tables, shard_map, stack_plans, local_plan)
    from jax_mla.testing import rel_err

    rng = np.random.default_rng(3)
    ps, heads, d_ckv, d_kpe = 16, 8, 64, 16
    target = PlanTarget(num_workers=8, min_chunk=32, chunk_align=16)
    res = {}
    for shards in (2, 4):
        for dtype in (jnp.float32, jnp.bfloat16):
            # Requests: empty, shorter than a page (only shard 0 holds keys), one page + 1, long.
            lens = np.array([0, 5, ps + 1, 1000, 333])
            r = lens.size
            n_pages = -(-lens // ps)
            per_shard = int(max((n_pages + shards - 1) // shards)) * r + 2
            # Shard d's pool is pages [d * per_shard, (d + 1) * per_shard); logical page j of a
            # request comes from shard j % C's pool, in a shuffled order.
            pools = [list(rng.permutation(per_shard) + d * per_shard) for d in range(shards)]
            max_pages = int(n_pages.max())
            table = np.full((r, max_pages), -1, np.int32)
            for i in range(r):
                for j in range(n_pages[i]):
                    table[i, j] = pools[j % shards].pop()
            total = shards * per_shard
            ckv = jnp.asarray(rng.standard_normal((total, ps, d_ckv)), dtype)
            kpe = jnp.asarray(rng.standard_normal((total, ps, d_kpe)), dtype)
            q_nope = jnp.asarray(rng.standard_normal((r, heads, d_ckv)), dtype)
            q_pe = jnp.asarray(rng.standard_normal((r, heads, d_kpe)), dtype)
            qo = np.ones(r, np.int64)
            full = plan_mla(qo, np.maximum(lens, 1), num_heads=heads, page_size=ps, target=target)
            ref, ref_lse = mla_paged_attention_reference(
                q_nope.astype(jnp.float32), q_pe.astype(jnp.float32), ckv.astype(jnp.float32),
                kpe.astype(jnp.float32), jnp.asarray(table), jnp.asarray(lens, jnp.int32), full,
                sm_scale=0.3, return_lse=True)

            local_tables = context_parallel_page_tables(table, shards, pages_per_shard=per_shard)
            local_lens = np.stack([context_parallel_lengths(lens, ps, shards, d) for d in range(shards)])
            plans = stack_plans([plan_mla(qo, np.maximum(local_lens[d], 1), num_heads=heads, page_size=ps,
                                          target=target) for d in range(shards)])
            mesh = Mesh(np.array(jax.devices()[:shards]), ("cp",))

            def attend(q_nope, q_pe, ckv, kpe, tables, lens, plan):
                return context_parallel_attention(q_nope, q_pe, ckv, kpe, tables[0], lens[0], local_plan(plan),
                                                  axis_name="cp", sm_scale=0.3, return_lse=True, backend="ffi")

            f = jax.jit(shard_map(attend, mesh=mesh, in_specs=(P(), P(), P("cp"), P("cp"), P("cp"), P("cp"),
                                                               P("cp")), out_specs=(P(), P())))
            out, lse = f(q_nope, q_pe, ckv, kpe, local_tables, local_lens.astype(np.int32), plans)
            fin = np.isfinite(np.asarray(ref_lse))
            res[f"{shards} {jnp.dtype(dtype).name}"] = dict(
                out=rel_err(out, ref), lse=rel_err(np.asarray(lse)[fin], np.asarray(ref_lse)[fin]),
                empty_zero=bool(np.all(np.asarray(out)[0] == 0)),
                empty_lse=bool(np.all(np.isneginf(np.asarray(lse)[0]))),
                lens_sum=bool(np.array_equal(local_lens.sum(0), lens)))
    print("RESULT " + json.dumps(res))
"""


@pytest.fixture(scope="module")
def cp_results():
    return run_on_fake_devices(CP_SCRIPT, devices=4)


@pytest.mark.parametrize("shards", [2, 4])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 8e-3)])
def test_context_parallel_attention_equals_unsplit(cp_results, shards, dtype, tol):
    """Decode over keys spread round robin over 2 and 4 devices, each with its own plan, merged by
    LSE: equals the unsplit op (float32 reference); an empty request gives 0 and -inf."""
    r = cp_results[f"{shards} {dtype}"]
    assert r["out"] < tol and r["lse"] < tol / 10, r
    assert r["empty_zero"] and r["empty_lse"] and r["lens_sum"]


# ---- host pieces -----------------------------------------------------------------------------
@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_context_parallel_lengths_count_the_pages_each_shard_holds(shards):
    ps = 16
    lens = np.arange(0, 300)
    got = np.stack([context_parallel_lengths(lens, ps, shards, d) for d in range(shards)])
    for i, n in enumerate(lens):
        want = np.zeros(shards, np.int64)
        for pos in range(n):
            want[(pos // ps) % shards] += 1
        assert got[:, i].tolist() == want.tolist(), n


def test_context_parallel_page_tables_split_round_robin():
    table = np.array([[10, 21, 12, 23, 14], [20, 11, -1, -1, -1]])
    local = context_parallel_page_tables(table, 2)
    assert local.tolist() == [[[10, 12, 14], [20, -1, -1]], [[21, 23, -1], [11, -1, -1]]]
    with pytest.raises(ValueError, match="shard 1 holds, not shard 0"):
        context_parallel_page_tables(np.array([[15, 14]]), 2, pages_per_shard=10)
    ok = context_parallel_page_tables(np.array([[5, 14, 7]]), 2, pages_per_shard=10)
    assert ok.tolist() == [[[5, 7]], [[4, -1]]]


def test_stack_plans_pads_to_common_buckets():
    target = PlanTarget(num_workers=16, min_chunk=32, chunk_align=16)
    short = plan_mla([1, 1, 0], [5, 9, 0], num_heads=4, page_size=16, num_tokens=8, target=target)
    long = plan_mla([1, 1, 1], [4000, 77, 3000], num_heads=4, page_size=16, num_tokens=8, target=target)
    s = stack_plans([short, long])
    assert s.work.shape[0] == 2 and s.work.shape[1] == max(short.work.shape[0], long.work.shape[0])
    assert s.num_partial_rows == max(short.num_partial_rows, long.num_partial_rows)
    np.testing.assert_array_equal(s.work[0, : short.work.shape[0]], short.work)
    assert not s.work[0, short.work.shape[0]:].any()  # padding units have no query rows
    np.testing.assert_array_equal(s.tokens[1], long.tokens)
    other = plan_mla([1, 1, 1], [4, 4, 4], num_heads=4, page_size=16, num_tokens=16, target=target)
    with pytest.raises(ValueError, match="num_tokens=16"):
        stack_plans([short, other])


def test_parallel_benchmark_runs_on_two_devices(tmp_path):
    """benchmarks/bench_parallel.py (the 2xH200 measurement) on 2 fake CPU devices, tiny shapes:
    every case runs, the tensor-parallel logits and the context-parallel output match one device."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "bench.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"))
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_parallel.py"), "--small", "--chain",
                        "2", "--repeats", "1", "--host-steps", "2", "--json", str(out)],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    res = json.loads(out.read_text())
    assert res["dp_speedup"] > 0 and res["dp"]["dp2"]["requests"] == 2 * res["dp"]["one_device"]["requests"]
    assert res["dp"]["dp2"]["traces"]["decode_scan"] == 1
    assert res["tp"]["logits_rel_err_vs_one_device"] < 1e-2
    assert res["cp"]["rel_err_vs_one_device"] < 1e-2 and res["cp"]["2_devices_us"] > 0
