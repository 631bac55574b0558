"""Cases for the standalone kernel driver (tools/sanitize_harness/sanitize_harness.cu) that
compute-sanitizer runs, and the check of its outputs against NumPy.

    python3 tools/sanitize_harness/cases.py make DIR     # writes DIR/case*.bin
    build/gpu/sanitize_harness DIR/case*.bin             # (under compute-sanitizer)
    python3 tools/sanitize_harness/cases.py check DIR    # compares DIR/case*.bin.out
    python3 tools/sanitize_harness/cases.py timing DIR   # plans of the `timing` and `fp8` shapes (--time)
    python3 tools/sanitize_harness/cases.py timing DIR --l2  # ... with every page id drawn from 32 pages
    python3 tools/sanitize_harness/cases.py timing DIR --tag wide  # ... of the shapes tagged `wide` instead
    python3 tools/sanitize_harness/cases.py timing DIR --tag fp8 --batches 124,128,132  # each at these batches
    python3 tools/sanitize_harness/cases.py make DIR --wide  # only the cases with units of > 16 rows
    python3 tools/sanitize_harness/cases.py profile DIR  # the `profile` shapes (ncu)

Cases are the `small` shapes of jax_mla/arg_specs.py: varlen batches with splits, page sizes 1 to
64, heads 16 to 128, q_len 1 to 4, an empty request, padding tokens, page ids outside the cache,
device lengths below the planned ones; bf16, fp16 and f32.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # planning only; the GPU belongs to the driver

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from jax_mla import PlanTarget, gpu_target, plan_mla  # noqa: E402
from jax_mla import plan_layout  # noqa: E402
from jax_mla.arg_specs import arg_specs, case_split_target  # noqa: E402

SCALE = 0.0723
DTYPES = {"bfloat16": 0, "float16": 1, "float32": 2}
TOL = {0: 6e-3, 1: 2e-3, 2: 1e-5}
# The op's default target on an H200 for timing (so the driver times the plans the op runs there), one
# unit per worker for profiles (whole requests, so a profile sees long units).
TIMING_TARGET = gpu_target(132)
PROFILE_TARGET = PlanTarget(num_workers=132, units_per_worker=1.0, min_chunk=256, chunk_align=64,
                            unit_overhead=128)


def _round(x, code):
    if code == 0:  # bfloat16: round to nearest even on the top 16 bits
        b = x.astype(np.float32).view(np.uint32)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.view(np.float32)
    if code == 1:
        return x.astype(np.float16).astype(np.float32)
    return x.astype(np.float32)


def _write_case(path, header, float_arrays, int_arrays):
    """One driver case: 16 int32 header words, the scale, float32 arrays, then int32 arrays."""
    hdr = np.zeros(16, np.int32)
    hdr[:len(header)] = header
    with open(path, "wb") as f:
        f.write(hdr.tobytes())
        f.write(np.float32(SCALE).tobytes())
        for a in float_arrays:
            f.write(a.astype(np.float32).tobytes())
        for a in int_arrays:
            f.write(np.ascontiguousarray(a, np.int32).tobytes())


L2_PROBE_PAGES = 32  # timing --l2: the pages every page id is drawn from (their keys stay in L2)


def _fresh_dir(d, prefix):
    """d, made if missing, without the files a previous set left in it (`prefix`*: the driver runs and
    `check` reads every such file, so a smaller set written over a larger one, e.g. `make --wide` after a
    full `make` in the same lease, would run the old cases again; thirty-sixth session)."""
    os.makedirs(d, exist_ok=True)
    for path in glob.glob(os.path.join(d, prefix + "*")):
        os.remove(path)


def make_timing(d, l2_probe=False, tag=None, batches=None):
    """Timing cases (no data: the driver draws it on the device) of the `timing` and `fp8` shapes, or
    of the shapes tagged `tag`. `l2_probe`: the same plans with every page id drawn from L2_PROBE_PAGES
    pages, so the keys come from L2: how fast a body runs when memory latency and bandwidth are taken
    away (ffi/cuda/NOTES.md uses it to tell memory-bound from not). `batches`: each shape of equal
    lengths and more than one request once per batch size instead (the 124 / 128 / 132 requests of
    NOTES.md, "bound per SM or by the aggregate copy"); the other shapes are left out."""
    _fresh_dir(d, "time")
    rng = np.random.default_rng(5)
    specs = arg_specs(tag) if tag else arg_specs("timing") + arg_specs("fp8")  # fp8: e4m3 ckv (bf16 q, kpe)
    if batches:
        specs = [dataclasses.replace(s, batch=b) for s in specs
                 if (s.batch or 0) > 1 and isinstance(s.kv_lens, int) for b in batches]
    for k, spec in enumerate(specs):
        b, h, ps = spec.num_requests, spec.heads, spec.page_size
        qo, kv = spec.lengths()
        per = int(-(-kv.max() // ps))
        table = rng.permutation(b * per).astype(np.int32).reshape(b, per)
        if l2_probe:
            table = rng.integers(0, min(L2_PROBE_PAGES, b * per), (b, per)).astype(np.int32)
        plan = plan_mla(qo, kv, num_heads=h, page_size=ps, max_pages_per_request=per, target=TIMING_TARGET)
        cache = 1 if spec.kv_dtype == "float8_e4m3fn" else 0
        header = (0x4D4C4131, 0, int(qo.sum()), h, b * per, ps, b, per, b, plan.work.shape[0], plan.merge.shape[0],
                  plan.num_partial_rows, 1, cache)  # word 12 = 1: no data arrays; 13: the cache kind
        kind = ("_fp8" if cache else "") + ("_L2" if l2_probe else "")
        _write_case(os.path.join(d, f"time{k}_{b}x{int(kv.max())}_h{h}_ps{ps}{kind}.bin"), header, (),
                    (table, kv.astype(np.int32), plan.work, plan.merge))
        print(f"time{k}: {spec.name}: {plan.describe()}")


def _e4m3(x):
    """x as e4m3 values (floats on its grid) and the scale they take (amax / 448): value = e4m3 x scale."""
    scale = np.float32(np.abs(x).max() / 448.0)
    return (x / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32), scale


def make(d, specs, checked=True, keep=None):
    """Driver cases of `specs` (case{k}: the k-th spec), with reference inputs where `checked`. `keep`:
    write only the specs it accepts; every spec still draws its data, so a kept case has the same
    name and data as in the full set."""
    _fresh_dir(d, "case")
    rng = np.random.default_rng(11)
    for k, spec in enumerate(specs):
        qo, kv = spec.lengths()
        h, ps, dt = spec.heads, spec.page_size, spec.dtype
        t = int(qo.sum()) + spec.padding
        need = -(-kv // ps)
        maxp = int(need.max()) + 1
        num_pages = int(need.sum()) + 3
        perm = rng.permutation(num_pages)
        table = rng.integers(0, num_pages, (len(qo), maxp)).astype(np.int32)
        at = 0
        for r, n in enumerate(need):
            table[r, :n] = perm[at:at + n]
            at += n
        spec.mark_bad_pages(table, num_pages, kv)
        target = (spec.plan_target() or case_split_target()) if checked else PROFILE_TARGET
        plan = plan_mla(qo, kv, num_heads=h, page_size=ps, num_tokens=t, target=target)
        code = DTYPES[dt]
        arrays = [_round(rng.standard_normal(s, dtype=np.float32), code) for s in
                  ((t, h, 512), (t, h, 64), (num_pages, ps, 512), (num_pages, ps, 64))]
        cache, ckv_scale, kpe_scale = 0, np.float32(1.0), np.float32(1.0)
        if spec.kv_dtype == "float8_e4m3fn":  # ckv as e4m3 values (floats on its grid) and their scale
            cache = 2 if spec.kpe_fp8 else 1  # kpe as e4m3 too (mla_fp8.cuh's cache kinds)
            arrays[2], ckv_scale = _e4m3(arrays[2])
            if spec.kpe_fp8:
                arrays[3], kpe_scale = _e4m3(arrays[3])
        kv_dev = np.asarray(kv if spec.device_kv_lens is None else spec.device_kv_lens, np.int32)
        bits = lambda x: int(np.float32(x).view(np.int32))
        header = (0x4D4C4131, code, t, h, num_pages, ps, len(qo), maxp, len(kv_dev), plan.work.shape[0],
                  plan.merge.shape[0], plan.num_partial_rows, 0, cache, bits(ckv_scale), bits(kpe_scale))
        if keep is not None and not keep(spec):
            continue
        _write_case(os.path.join(d, f"case{k}.bin"), header, arrays, (table, kv_dev, plan.work, plan.merge))
        if checked:  # reference inputs for `check`
            np.savez(os.path.join(d, f"case{k}.npz"), qn=arrays[0], qp=arrays[1], ckv=arrays[2] * ckv_scale,
                     kpe=arrays[3] * kpe_scale, table=table, kv=kv_dev, tokens=np.asarray(plan.tokens), code=code)
        w = np.asarray(plan.work)
        print(f"case{k}: {spec.name} T={t} units={(w[:, 2] > 0).sum()} "
              f"split_units={((w[:, 2] > 0) & (w[:, 6] >= 0)).sum()}")


def reference(z):
    qn, qp, ckv, kpe = (z[k].astype(np.float64) for k in ("qn", "qp", "ckv", "kpe"))
    table, kv, tokens = z["table"], z["kv"], z["tokens"]
    t, h, _ = qn.shape
    num_pages, ps, _ = ckv.shape
    cap = table.shape[1] * ps
    out = np.zeros((t, h, 512))
    lse = np.full((t, h), -np.inf)
    for i in range(t):
        r, e = tokens[i]
        if r < 0:
            continue
        n = max(min(int(kv[r]), cap) - e + 1, 0)
        pos = np.arange(n)
        pages = table[r, pos // ps]
        ok = (pages >= 0) & (pages < num_pages)
        if not ok.any():
            continue
        kc = ckv[pages[ok], pos[ok] % ps]
        kr = kpe[pages[ok], pos[ok] % ps]
        s = SCALE * (qn[i] @ kc.T + qp[i] @ kr.T)
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        out[i] = p @ kc / p.sum(axis=1, keepdims=True)
        lse[i] = (m[:, 0] + np.log(p.sum(axis=1)))
    return out, lse


def check(d):
    # JAX_MLA_CHECK_TOL / JAX_MLA_CHECK_LSE_TOL: looser bounds for a driver built with -DJAX_MLA_E4M3_WIDE
    # (every fp8 ckv's 64-key units on e4m3 products, as the op's fp8_products: ~4e-2).
    out_tol = float(os.environ["JAX_MLA_CHECK_TOL"]) if "JAX_MLA_CHECK_TOL" in os.environ else None
    lse_tol = float(os.environ.get("JAX_MLA_CHECK_LSE_TOL", 2e-3))
    ok = True
    for path in sorted(glob.glob(os.path.join(d, "case*.bin"))):
        z = np.load(path[:-4] + ".npz")
        t, h, _ = z["qn"].shape
        res = np.fromfile(path + ".out", np.float32)
        out, lse = res[: t * h * 512].reshape(t, h, 512), res[t * h * 512:].reshape(t, h)
        ref, ref_lse = reference(z)
        err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
        empty = np.isneginf(ref_lse)
        lse_err = np.abs(lse[~empty] - ref_lse[~empty]).max() if (~empty).any() else 0.0
        good = (np.isfinite(out).all() and (out[empty] == 0).all() and (np.isneginf(lse) == empty).all()
                and err < (out_tol or TOL[int(z["code"])]) and lse_err < lse_tol)
        ok &= bool(good)
        print(f"{'ok  ' if good else 'FAIL'} {os.path.basename(path)} out_err={err:.2e} lse_err={lse_err:.2e}")
    print("HARNESS OK" if ok else "HARNESS FAILED")
    return 0 if ok else 1


def is_wide(spec):
    """Whether some unit of `spec` has more than 16 rows (tokens x heads of a head block, by the plan's
    tile rule): the wide body."""
    qo, _ = spec.lengths()
    tokens = min(int(qo.max()), plan_layout.q_tile(spec.heads))
    return tokens * min(spec.heads, plan_layout.ROWS_PER_TILE) > 16


if __name__ == "__main__":
    cmd, d, opts = sys.argv[1], sys.argv[2], sys.argv[3:]
    if cmd == "timing":
        value = lambda flag: opts[opts.index(flag) + 1] if flag in opts else None
        batches = value("--batches")
        sys.exit(make_timing(d, l2_probe="--l2" in opts, tag=value("--tag"),
                             batches=[int(b) for b in batches.split(",")] if batches else None))
    if cmd == "profile":
        sys.exit(make(d, arg_specs("profile"), checked=False))
    if cmd == "make":
        sys.exit(make(d, arg_specs("small"), keep=is_wide if "--wide" in opts else None))
    sys.exit(check(d))
