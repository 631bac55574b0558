"""Times the CUDA paged MLA op against FlashInfer 0.2.5 (fa2, fa3), FlashMLA's dense
sm90 decode and a copy ceiling.

    python3 benchmarks/bench_attention.py [--out benchmarks/results] [--sweep] [--quick]
        [--flashmla .peer/flashmla] [--fa2] [--power SECONDS]
    python3 benchmarks/bench_attention.py --replot benchmarks/results/h200.json  # the plot again, no GPU

Per shape (batch x kv_len x heads x page_size x q_len, bf16, d_ckv 512, d_kpe 64,
random page tables, random normal data; kv_len and q_len may be ranges drawn per
request, "U[lo,hi]"):

* ours: K calls of the op inside one jit, recorded by XLA into a command buffer
  (XLA_FLAGS below, unless set) (each call on its own query array and
  cycling over enough cache copies that the working set is several times the
  L2). Device time: the jit runs under JAX's profiler, whose CUPTI kernel
  timestamps give each chain's span on the device, from the start of its first
  kernel to the end of its last; per call = span / K, median over repetitions.
  Also recorded ("chain wall"): wall time per call, (t(K2) - t(K1)) / (K2 - K1)
  of two jits, which adds the host's per-argument cost of a K-call jit (each
  call brings its own query arrays and outputs; benchmarks/results/README.md)
  and is what the device-time column leaves out.
* FlashInfer (when importable): BatchMLAPagedAttentionWrapper on the same
  arrays (shared through DLPack), K calls captured in a CUDA graph (eager if
  capture fails), CUDA events, median over repetitions.
* FlashMLA (with --flashmla DIR, the peer kit of ../shared/peers/flashmla copied
  to DIR, built by its bench.build()): dense_decode_fwd on the same data in its
  layout (ckv | kpe in one [pages, 64, 1, 576] buffer, made once, outside the
  timing), scheduler metadata made once as in FlashMLA's own use, K calls in a
  CUDA graph, events, median. Page size 64 and one q_len per batch only.
* copy ceiling: device-to-device copy of 1 GiB, bytes read + written.
* power (with --power SECONDS): ours' K-call chain run back to back for SECONDS
  while nvidia-smi samples the GPU every 20 ms (benchmarks/gpu_power.py): median
  power and SM clock, the lowest clock, the fraction of samples at the software
  power cap; a record's "power" field and the fp8 table's last column. Each
  peer's CUDA graph is run back to back the same way ("fa3_power",
  "flashmla_power"), so that a shape's clock under the cap can be compared.

Bytes = kv tokens x 576 x 2 (each request's keys read once); FLOPs =
2 * H * (576 + 512) * sum over query tokens of the keys each sees.
Writes a markdown table to stdout and <out>/bench.md, records to
<out>/h200.json and a roofline to <out>/roofline.png.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # FlashInfer (torch) shares the GPU
# Ours runs where a jitted decode step runs it: XLA records the chain of custom
# calls into a command buffer (a CUDA graph), as FlashInfer's calls are graphed.
os.environ.setdefault("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                                   "--xla_gpu_graph_min_graph_size=1")

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import glob  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_mla import build_info, default_target, mla_paged_attention, plan_mla  # noqa: E402
from jax_mla import fp8_scale, mla_paged_attention_reference, quantize_fp8  # noqa: E402
from jax_mla.arg_specs import Uniform, arg_specs  # noqa: E402
from jax_mla.planner import full_tiles_by_tma  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import call_anatomy  # noqa: E402  (a chain's kernels split per call)
import gpu_power  # noqa: E402

D_CKV, D_KPE = 512, 64
SCALE = 1.0 / math.sqrt(192.0)
L2_BYTES = 60 * 2**20

# A shape here: (batch, kv_len, heads, page_size, q_len), as the records store it; kv_len may be
# ("U", lo, hi, seed) and q_len ("U", lo, hi): drawn per request. The shapes and their targets come
# from jax_mla.arg_specs (shared with the tests and the GPU tools). Targets (issue 9): "us" a ceiling;
# "TB/s", "TFLOP/s" floors; "peer": ours at least this many times as fast as the faster peer measured
# in the same run.
def _length(x):
    if isinstance(x, Uniform):
        return ("U", x.lo, x.hi) + (() if x.seed is None else (x.seed,))
    return x


def _shape(spec):
    return spec.batch, _length(spec.kv_lens), spec.heads, spec.page_size, _length(spec.q_lens)


TARGETS = {_shape(s): list(s.targets) for s in arg_specs("target")}
EXTRA_SHAPES = [_shape(s) for s in arg_specs("extra")]
# q_len 2 against q_len 1 at the same batch: costs at most this much more.
Q2_OVER_Q1 = ((128, 4096, 16, 64, 2), (128, 4096, 16, 64, 1), 1.05)
SWEEP_SHAPES = [_shape(s) for s in arg_specs("planner")]
FP8 = "float8_e4m3fn"
# fp8-cache shapes (issue 10) and their targets: ("bf16", x) = at least x times as fast as the bf16
# cache of the same shape, measured in the same run.
FP8_SHAPES = [(_shape(s), list(s.targets)) for s in arg_specs("fp8")]
SWEEP_TARGETS = [  # (units_per_worker, min_chunk, unit_overhead); chunk_align 64
    (1.0, 256, 128),
    (1.0, 128, 0),
    (1.1, 256, 128),
    (1.25, 256, 128),
    (1.5, 256, 128),
    (2.0, 256, 128),
]


def _spec(x):
    return f"U[{x[1]},{x[2]}]" if isinstance(x, tuple) else str(x)


def shape_name(s):
    b, l, h, ps, q = s
    return f"{b}x{_spec(l)} h{h} ps{ps} q{_spec(q)}"


def lengths_of(s, seed=0):
    """Per-request (q_len, kv_len) of a shape, as host int64 arrays (kv_len >= q_len)."""
    b, l, h, ps, q = s
    if isinstance(l, tuple):
        kv = np.random.default_rng(l[3] if len(l) > 3 else seed).integers(l[1], l[2] + 1, b)
    else:
        kv = np.full(b, l)
    qo = np.random.default_rng(seed + 101).integers(q[1], q[2] + 1, b) if isinstance(q, tuple) else np.full(b, q)
    return qo.astype(np.int64), np.maximum(kv, qo).astype(np.int64)


def work_of(s, kv_dtype="bfloat16"):
    b, l, h, ps, q = s
    qo, kv = lengths_of(s)
    seen = int((qo * kv - qo * (qo - 1) // 2).sum())  # causal, aligned to the end
    flops = 2.0 * h * (D_CKV + D_CKV + D_KPE) * seen
    ckv_bytes = 1 if kv_dtype == FP8 else 2  # fp8 ckv, bf16 kpe: 640 bytes a key instead of 1152
    nbytes = float(kv.sum()) * (D_CKV * ckv_bytes + D_KPE * 2)
    return flops, nbytes


class Inputs:
    """Random queries (one array per call) and cache copies for one shape."""

    def __init__(self, s, n_calls, seed=0, kv_dtype="bfloat16", fp8_products=False):
        b, l, h, ps, q = s
        self.kv_dtype = kv_dtype
        self.fp8_products = fp8_products  # the op's lossy e4m3 x e4m3 option (fp8 cache only)
        rng = np.random.default_rng(seed)
        self.shape = s
        self.qo_lens, self.kv_lens_host = lengths_of(s, seed)
        self.pages = -(-self.kv_lens_host // ps)  # per request
        self.pages_per_req = int(self.pages.max())
        num_pages = int(self.pages.sum())
        perm = rng.permutation(num_pages).astype(np.int32)
        self.table_host = np.zeros((b, self.pages_per_req), np.int32)  # unused entries: page 0, never read
        at = 0
        for r, n in enumerate(self.pages):
            self.table_host[r, :n] = perm[at:at + n]
            at += n
        self.page_table = jnp.asarray(self.table_host)
        self.kv_lens = jnp.asarray(self.kv_lens_host, jnp.int32)
        cache_bytes = num_pages * ps * (D_CKV + D_KPE) * 2
        self.n_sets = int(min(8, max(1, math.ceil(4 * L2_BYTES / cache_bytes))))
        key = jax.random.PRNGKey(seed)
        k_c, k_r, k_q = jax.random.split(key, 3)
        self.ckv = [jax.random.normal(jax.random.fold_in(k_c, i), (num_pages, ps, D_CKV), jnp.bfloat16)
                    for i in range(self.n_sets)]
        self.kpe = [jax.random.normal(jax.random.fold_in(k_r, i), (num_pages, ps, D_KPE), jnp.bfloat16)
                    for i in range(self.n_sets)]
        t = int(self.qo_lens.sum())
        self.q_nope = [jax.random.normal(jax.random.fold_in(k_q, 2 * i), (t, h, D_CKV), jnp.bfloat16)
                       for i in range(n_calls)]
        self.q_pe = [jax.random.normal(jax.random.fold_in(k_q, 2 * i + 1), (t, h, D_KPE), jnp.bfloat16)
                     for i in range(n_calls)]
        # fp8: the same draws quantized with one scale from the data (the bf16 copy of set 0 kept for
        # the error against the unquantized cache)
        self.ckv_scale = None
        self.ckv_bf16 = self.ckv[0]
        if kv_dtype == FP8:
            self.ckv_scale = fp8_scale(self.ckv[0])
            self.ckv = [quantize_fp8(c, self.ckv_scale) for c in self.ckv]
        jax.block_until_ready((self.ckv, self.kpe, self.q_nope, self.q_pe))

    @property
    def uniform_q(self):
        return int(self.qo_lens[0]) if (self.qo_lens == self.qo_lens[0]).all() else None

    def plan(self, target=None, min_work_units=None):
        b, l, h, ps, q = self.shape
        knobs = {} if min_work_units is None else dict(min_work_units=min_work_units)
        return plan_mla(self.qo_lens, self.kv_lens_host, num_heads=h, page_size=ps,
                        max_pages_per_request=self.pages_per_req, target=target, **knobs)


def _wall_median(f, args, reps):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


@functools.lru_cache(maxsize=None)
def _chain(n, n_sets, fp8_products=False):
    """n calls of the op, each on its own queries (so XLA cannot merge equal calls)."""
    def f(qn, qp, ckv, kpe, pt, kvl, plan, ckv_scale):
        return [mla_paged_attention(qn[k], qp[k], ckv[k % n_sets], kpe[k % n_sets], pt, kvl, plan,
                                    sm_scale=SCALE, backend="ffi", ckv_scale=ckv_scale, fp8_products=fp8_products)
                for k in range(n)]
    return jax.jit(f)


def _chain_args(inp: Inputs, plan, k):
    """Arguments of _chain(k, inp.n_sets): the first k query arrays, every cache copy."""
    return (inp.q_nope[:k], inp.q_pe[:k], inp.ckv, inp.kpe, inp.page_table, inp.kv_lens, plan, inp.ckv_scale)


def time_ours(inp: Inputs, plan, k1, k2, reps=9):
    """Seconds per call from the difference of two jitted chains."""
    f1, f2 = _chain(k1, inp.n_sets, inp.fp8_products), _chain(k2, inp.n_sets, inp.fp8_products)
    a1, a2 = _chain_args(inp, plan, k1), _chain_args(inp, plan, k2)
    for _ in range(2):
        jax.block_until_ready(f1(*a1))
        jax.block_until_ready(f2(*a2))
    t1 = _wall_median(f1, a1, reps)
    t2 = _wall_median(f2, a2, reps)
    return max(t2 - t1, 1e-9) / (k2 - k1)


def _trace_kernels(trace_dir):
    """Complete events of the Perfetto trace JAX's profiler wrote under trace_dir (None if none), of the devices'
    processes only where the trace names any."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        return None
    with gzip.open(paths[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    # Only the devices' timelines where the trace names them: call_anatomy's first GPU run found 64 events of
    # ~1 us named after our kernels beside the 80 kernels of its 5 x 16 calls (forty-ninth session, NOTES.md).
    names = {e.get("pid"): str((e.get("args") or {}).get("name", "")) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, name in names.items() if name.startswith("/device:")}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    if not devices:
        return complete
    off = collections.Counter(e.get("pid") for e in complete
                              if e.get("pid") not in devices and our_kernel(e.get("name", "")))
    if off:
        print("  trace: left out events named after our kernels off the device timelines: "
              + ", ".join(f"{n} in {names.get(pid, pid)}" for pid, n in off.items()), flush=True)
    return [e for e in complete if e.get("pid") in devices]


def our_kernel(name):
    """"attention", "merge" or None: what a kernel of the trace is to ours. Every attention kernel's name
    starts with mla_attention and ends with _kernel (mla_attention_kernel, _sm90_kernel, _f32_kernel,
    _wide64_walk_kernel, ...): a name list here missed the walk's when it became the default, and its rows
    fell back to chain wall time (forty-first session)."""
    if "mla_merge_kernel" in name:
        return "merge"
    m = re.search(r"mla_attention\w*_kernel", name)
    return "attention" if m else None


def our_attention_kernel(name):
    """Whether a kernel of the trace is one of our attention kernels (a call's main kernel)."""
    return our_kernel(name) == "attention"


def traced_kernels(body):
    """(body(), our kernels in the JAX profiler's trace of it as (name, start us, duration us) in start order),
    the second None where the trace holds no events."""
    d = tempfile.mkdtemp(prefix="jax_mla_trace_")
    try:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            out = body()
        events = _trace_kernels(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    if not events:
        return out, None
    return out, sorted(((e["name"], float(e["ts"]), float(e["dur"])) for e in events if our_kernel(e["name"])),
                       key=lambda kernel: kernel[1])


def device_time_ours(inp: Inputs, plan, k, reps=7):
    """Seconds per call on the device (module docstring), or None without kernel timestamps."""
    f = _chain(k, inp.n_sets, inp.fp8_products)
    a = _chain_args(inp, plan, k)
    jax.block_until_ready(f(*a))
    try:
        _, kernels = traced_kernels(lambda: [jax.block_until_ready(f(*a)) for _ in range(reps)])
    except Exception as e:  # no profiler plugin / CUPTI: the caller falls back to wall time
        print(f"  device trace unavailable: {type(e).__name__}: {e}", flush=True)
        kernels = None
    if kernels is None:
        return None
    n = sum(our_attention_kernel(name) for name, _, _ in kernels)
    if n != k * reps:
        print(f"  device trace: {n} attention kernels, not {k} x {reps}: timing falls back to wall", flush=True)
        return None
    # each chain's span (its first attention kernel's start to its last kernel's end) over its calls, median
    return call_anatomy.per_call(kernels, our_attention_kernel, k)["span_us"] * 1e-6


def ours_output(inp: Inputs, plan):
    """One call on the first queries and cache copy (the chain of one: compiled once per shape)."""
    f = _chain(1, 1, inp.fp8_products)
    return f(inp.q_nope[:1], inp.q_pe[:1], inp.ckv[:1], inp.kpe[:1], inp.page_table, inp.kv_lens, plan,
             inp.ckv_scale)[0]


# ---- peers (torch) ---------------------------------------------------------------------

def _torch():
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


def _to_torch(torch, x):
    try:
        return torch.from_dlpack(x)
    except Exception:
        return torch.from_numpy(np.asarray(x.astype(jnp.float32))).to("cuda").to(torch.bfloat16)


def _event_time(torch, fn, reps):
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(ts)


def graph_time(torch, calls, name, n_calls, reps, power_s=0.0):
    """(seconds per call of `calls` (n_calls launches) replayed as one CUDA graph (eager if capture fails),
    the power summary of the replay run back to back for power_s seconds (gpu_power; None at 0))."""
    calls()
    torch.cuda.synchronize()
    fn = calls
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            calls()
        g.replay()
        torch.cuda.synchronize()
        fn = g.replay
    except Exception as e:  # eager launches then; slower on small shapes
        print(f"  ({name}: no graph capture: {type(e).__name__}: {e})", flush=True)
        torch.cuda.synchronize()
    t = _event_time(torch, fn, reps) / n_calls
    power = gpu_power.sample_back_to_back(fn, lambda _: torch.cuda.synchronize(), power_s) if power_s > 0 else None
    return t, power


def copy_ceiling(torch):
    """Bytes read + written per second of a 1 GiB device-to-device copy."""
    if torch is not None:
        src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize()
        t = _event_time(torch, lambda: dst.copy_(src), 20)
        return 2 * src.numel() * 2 / t
    x = jax.random.normal(jax.random.PRNGKey(1), (2**29,), jnp.bfloat16)
    f = jax.jit(lambda v: v + jnp.bfloat16(1))
    jax.block_until_ready(f(x))
    return 2 * x.size * 2 / _wall_median(f, (x,), 20)


def matmul_peak(torch):
    if torch is None:
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 / _event_time(torch, lambda: a @ b, 10)


class FlashInferPeer:
    def __init__(self, torch):
        import flashinfer  # noqa: F401  (raises if missing)
        from flashinfer.mla import BatchMLAPagedAttentionWrapper
        self.torch = torch
        self.cls = BatchMLAPagedAttentionWrapper
        self.version = getattr(flashinfer, "__version__", "?")
        self.workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")

    def run(self, backend, inp: Inputs, n_calls, reps=9, power_s=0.0):
        """(seconds per call, output of the first call as float32 numpy, power summary or None)."""
        torch = self.torch
        b, l, h, ps, q = inp.shape
        w = self.cls(self.workspace, backend=backend)
        i32 = dict(dtype=torch.int32, device="cuda")
        cum = lambda x: torch.from_numpy(np.concatenate([[0], np.cumsum(x)]).astype(np.int32)).to("cuda")
        indices = np.concatenate([inp.table_host[r, :n] for r, n in enumerate(inp.pages)])
        w.plan(cum(inp.qo_lens), cum(inp.pages), torch.from_numpy(indices.astype(np.int32)).to("cuda"),
               torch.from_numpy(inp.kv_lens_host.astype(np.int32)).to("cuda"),
               h, D_CKV, D_KPE, ps, bool((inp.qo_lens > 1).any()), SCALE, torch.bfloat16, torch.bfloat16)
        qn = [_to_torch(torch, x) for x in inp.q_nope[:n_calls]]
        qp = [_to_torch(torch, x) for x in inp.q_pe[:n_calls]]
        ckv = [_to_torch(torch, x) for x in inp.ckv]
        kpe = [_to_torch(torch, x) for x in inp.kpe]
        outs = [torch.empty_like(qn[0]) for _ in range(2)]

        def calls():
            for k in range(n_calls):
                w.run(qn[k], qp[k], ckv[k % inp.n_sets], kpe[k % inp.n_sets], out=outs[k % 2])

        w.run(qn[0], qp[0], ckv[0], kpe[0], out=outs[0])
        first = outs[0].float().cpu().numpy()
        t, power = graph_time(torch, calls, f"flashinfer {backend}", n_calls, reps, power_s)
        return t, first, power


class FlashMLAPeer:
    """FlashMLA's dense sm90 decode, built from the peer kit (module docstring)."""

    def __init__(self, torch, kit_dir):
        sys.path.insert(0, os.path.abspath(kit_dir))
        import bench as kit  # the kit's bench.py: build() JIT-compiles (cached in the kit's build dir)
        self.torch = torch
        self.mod = kit.build(verbose=False)
        commit = os.path.join(kit_dir, "src", "COMMIT")
        self.version = open(commit).readline().strip() if os.path.exists(commit) else "?"

    def unsupported(self, inp: Inputs):
        if inp.shape[3] != 64:
            return "page size 64 only"
        if inp.uniform_q is None:
            return "one q_len per batch only"
        return None

    def run(self, name, inp: Inputs, n_calls, reps=9, power_s=0.0):
        torch = self.torch
        b, l, h, ps, q = inp.shape
        sq = inp.uniform_q
        # FlashMLA's layout: ckv | kpe in one buffer, queries [B, q_len, H, 576] (made outside the timing).
        kc = [torch.cat([_to_torch(torch, c), _to_torch(torch, r)], dim=-1).unsqueeze(2).contiguous()
              for c, r in zip(inp.ckv, inp.kpe)]
        qs = [torch.cat([_to_torch(torch, a), _to_torch(torch, c)], dim=-1).reshape(b, sq, h, D_CKV + D_KPE)
              for a, c in zip(inp.q_nope[:n_calls], inp.q_pe[:n_calls])]
        seqlens = torch.from_numpy(inp.kv_lens_host.astype(np.int32)).to("cuda")
        table = torch.from_numpy(inp.table_host).to("cuda")
        causal = sq > 1
        meta, nsplits = self.mod.get_decode_sched_meta(seqlens, sq, h, 1)
        first = self.mod.dense_decode_fwd(qs[0], kc[0], D_CKV, seqlens, table, SCALE, causal, meta, nsplits)[0]
        first = first.reshape(-1, h, D_CKV).float().cpu().numpy()

        def calls():
            for k in range(n_calls):
                self.mod.dense_decode_fwd(qs[k], kc[k % inp.n_sets], D_CKV, seqlens, table, SCALE, causal,
                                          meta, nsplits)

        t, power = graph_time(torch, calls, "flashmla", n_calls, reps, power_s)
        del kc, qs
        return t, first, power


# ---- driver ------------------------------------------------------------------------------

def fp8_errors(inp: Inputs, plan, ours):
    """An fp8 run's relative errors: against the float32 reference on the dequantized cache (what the
    kernel adds), and against our op on the unquantized bf16 cache it was made from (what fp8 costs)."""
    f32 = jnp.float32
    args = (inp.q_nope[0], inp.q_pe[0])
    ref = mla_paged_attention_reference(*(a.astype(f32) for a in args), inp.ckv[0].astype(f32) * inp.ckv_scale,
                                        inp.kpe[0].astype(f32), inp.page_table, inp.kv_lens, plan, sm_scale=SCALE)
    bf16 = mla_paged_attention(*args, inp.ckv_bf16, inp.kpe[0], inp.page_table, inp.kv_lens, plan, sm_scale=SCALE,
                               backend="ffi")
    rel = lambda a, b: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    return dict(rel_err_vs_dequantized_ref=rel(ours, np.asarray(ref)),
                rel_err_vs_bf16_cache=rel(ours, np.asarray(bf16.astype(f32))))


def calls_for(s, copy_bps):
    """(calls of the short chain, calls of the long one): the long one ~4 ms of estimated device time, from
    the bytes at 70% of the copy ceiling or the FLOPs at ~525 TFLOP/s (extend shapes), whichever is more."""
    flops, nbytes = work_of(s)
    est = max(nbytes / (0.7 * copy_bps), flops / 525e12) + 8e-6
    k2 = int(min(100, max(8, round(4e-3 / est))))
    return max(2, k2 // 4), k2


def bench_shape(s, peers, copy_bps, sweep_targets=None, kv_dtype="bfloat16", power_s=0.0, fp8_products=False):
    k1, k2 = calls_for(s, copy_bps)
    inp = Inputs(s, k2, kv_dtype=kv_dtype, fp8_products=fp8_products)
    flops, nbytes = work_of(s, kv_dtype)
    rec = dict(shape=shape_name(s), batch=s[0], kv_len=s[1], heads=s[2], page_size=s[3], q_len=s[4], dtype="bfloat16",
               kv_dtype=kv_dtype, fp8_products=fp8_products, d_ckv=D_CKV, d_kpe=D_KPE, flops=flops, bytes=nbytes,
               calls=[k1, k2], cache_sets=inp.n_sets)
    plan = inp.plan()
    rec["plan"] = plan.describe()
    rec["ours_wall_us"] = time_ours(inp, plan, k1, k2) * 1e6
    dev_s = device_time_ours(inp, plan, k2)
    rec["ours_timing"] = "device" if dev_s is not None else "wall"
    rec["ours_us"] = dev_s * 1e6 if dev_s is not None else rec["ours_wall_us"]
    if power_s > 0:
        f, a = _chain(k2, inp.n_sets, inp.fp8_products), _chain_args(inp, plan, k2)
        rec["power"] = gpu_power.sample_back_to_back(lambda: f(*a), jax.block_until_ready, power_s)
    ours = np.asarray(ours_output(inp, plan).astype(jnp.float32))
    if kv_dtype == FP8:
        rec.update(fp8_errors(inp, plan, ours))
    for name, peer in peers.items():
        why = peer.unsupported(inp) if hasattr(peer, "unsupported") else None
        if why:
            rec[f"{name}_us"] = None
            rec[f"{name}_skipped"] = why
            continue
        try:
            t, out, power = peer.run(name, inp, k2, power_s=power_s)
            rec[f"{name}_us"] = t * 1e6
            if power is not None:
                rec[f"{name}_power"] = power
            rec[f"{name}_vs_ours_rel_err"] = float(np.linalg.norm(out - ours) / max(np.linalg.norm(out), 1e-30))
        except Exception as e:
            print(f"  {name} failed on {shape_name(s)}: {type(e).__name__}: {e}", flush=True)
            rec[f"{name}_us"] = None
    done = [(rec[f"{n}_us"], n) for n in ("fa3", "flashmla") if rec.get(f"{n}_us")]
    rec["best_peer_us"], rec["best_peer"] = min(done) if done else (None, None)
    if sweep_targets:
        rec["sweep"] = []
        for upw, mc, ov in sweep_targets:
            # The GPU's default target with the swept knobs (one unit cost for every body, as swept)
            tgt = dataclasses.replace(default_target(), units_per_worker=upw, min_chunk=mc, unit_overhead=ov,
                                      wide_unit_overhead=None)
            p = inp.plan(tgt)
            dev_s = device_time_ours(inp, p, k2, reps=5)
            us = (dev_s if dev_s is not None else time_ours(inp, p, k1, k2, reps=7)) * 1e6
            rec["sweep"].append(dict(units_per_worker=upw, min_chunk=mc, unit_overhead=ov, us=us,
                                     plan=p.describe()))
    del inp
    return rec


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def shape_of(rec):
    """The shape tuple (TARGETS' key) a record was measured at."""
    return rec["batch"], rec["kv_len"], rec["heads"], rec["page_size"], rec["q_len"]


def target_rows(rec):
    """(target text, met) for each of the record's targets."""
    us = rec["ours_us"]
    out = []
    for unit, bound in TARGETS.get(shape_of(rec), []):
        if unit == "peer":
            best = rec.get("best_peer_us")
            out.append((f">= {bound:g}x best peer", None if best is None else best / us >= bound))
        else:
            val = {"us": us, "TB/s": rec["bytes"] / us / 1e6, "TFLOP/s": rec["flops"] / us / 1e6}[unit]
            out.append((f"{'<=' if unit == 'us' else '>='} {bound:g} {unit}",
                        val <= bound if unit == "us" else val >= bound))
    return out


def table(records, copy_bps):
    lines = ["| shape (B x L, heads, page, q_len) | ours us | GB/s | TFLOP/s | fa3 us | FlashMLA us | "
             "best peer / ours | % copy ceiling | target | met | fa2 us | ours chain wall us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        s = shape_of(r)
        us = r["ours_us"]
        gbs = r["bytes"] / us / 1e3
        tfs = r["flops"] / us / 1e6
        best = r.get("best_peer_us")
        tg = target_rows(r)
        tgt_s = "; ".join(t for t, _ in tg) or "-"
        met = "; ".join("-" if m is None else ("yes" if m else "NO") for _, m in tg) or "-"
        # A row whose device trace was missing says so: its time is the chain's wall time.
        us_s = f"{us:.1f}" if r.get("ours_timing", "device") == "device" else f"{us:.1f} (wall)"
        lines.append(f"| {shape_name(s)} | {us_s} | {gbs:.0f} | {tfs:.1f} | {fmt(r.get('fa3_us'), '.1f')} | "
                     f"{fmt(r.get('flashmla_us'), '.1f')} | {fmt(best / us if best else None, '.2f')} | "
                     f"{100 * gbs * 1e9 / copy_bps:.0f}% | {tgt_s} | {met} | {fmt(r.get('fa2_us'), '.1f')} | "
                     f"{fmt(r.get('ours_wall_us'), '.1f')} |")
    by_shape = {shape_of(r): r for r in records}
    a, b, bound = Q2_OVER_Q1
    if a in by_shape and b in by_shape:
        ratio = by_shape[a]["ours_us"] / by_shape[b]["ours_us"]
        lines.append(f"\n{shape_name(a)} costs {ratio:.3f}x {shape_name(b)} (target <= {bound}: "
                     f"{'yes' if ratio <= bound else 'NO'})")
    return "\n".join(lines)


PEER_TITLES = {"fa3": "fa3", "flashmla": "FlashMLA"}


def power_table(records):
    """Power and SM clock of ours and each peer run back to back (--power), where any was sampled."""
    names = [n for n in PEER_TITLES if any(r.get(f"{n}_power") for r in records)]
    if not any(r.get("power") for r in records) and not names:
        return ""
    lines = ["\n\nRun back to back (--power): W, SM MHz median, % of samples at the power cap\n",
             "| shape | ours | " + " | ".join(PEER_TITLES[n] for n in names) + " |",
             "|---|---|" + "---|" * len(names)]
    for r in records:
        lines.append(f"| {shape_name(shape_of(r))} | {power_cell(r.get('power'))} | "
                     + " | ".join(power_cell(r.get(f"{n}_power")) for n in names) + " |")
    return "\n".join(lines)


def fp8_products_apply(s):
    """Whether mla_paged_attention(..., fp8_products=True) changes anything on shape s: only the sm_90a 64-key
    units read e4m3 x e4m3 (64 heads or more, pages of 32 keys or more); other units ignore the option."""
    b, l, h, ps, q = s
    return full_tiles_by_tma(h, ps)


def fp8_name(rec):
    """An fp8 record's shape name, marked where it ran with the lossy fp8_products option."""
    return shape_name(shape_of(rec)) + (" fp8_products" if rec.get("fp8_products") else "")


def fp8_table(recs):
    if not recs:
        return ""
    power = any(r.get("power") or r.get("bf16_power") for r in recs)
    lines = ["\n\n| shape, fp8 cache (e4m3 ckv, bf16 kpe) | bf16 us | fp8 us | fp8 / bf16 speed | fp8 TB/s | "
             "rel err vs dequantized f32 ref | rel err vs bf16 cache | target | met |"
             + (" W, SM MHz, at power cap: fp8 / bf16 |" if power else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if power else "")]
    for r in recs:
        lines.append(f"| {fp8_name(r)} | {r['bf16_us']:.1f} | {r['ours_us']:.1f} | "
                     f"{r['speedup_vs_bf16']:.2f}x | {r['bytes'] / r['ours_us'] / 1e6:.2f} | "
                     f"{r['rel_err_vs_dequantized_ref']:.2e} | {r['rel_err_vs_bf16_cache']:.2e} | "
                     f"{'; '.join(r['targets']) or '-'} | "
                     f"{'; '.join('yes' if m else 'NO' for m in r['met']) or '-'} |"
                     + (f" {power_cell(r.get('power'))} / {power_cell(r.get('bf16_power'))} |" if power else ""))
    return "\n".join(lines)


def power_cell(p):
    """A power summary (gpu_power.summarize) as "W, MHz, % of samples at the power cap"."""
    if not p:
        return "-"
    return f"{p['power_W_median']:.0f} W, {p['sm_MHz_median']:.0f} MHz, {100 * p['power_capped_fraction']:.0f}%"


def roofline(records, copy_bps, peak, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print("no matplotlib:", e)
        return
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = np.logspace(0, 3, 200)
    roof = np.minimum(copy_bps * xs, peak if peak else np.inf) / 1e12
    ax.loglog(xs, roof, "k-", lw=1, label=f"copy {copy_bps / 1e12:.2f} TB/s"
              + (f", matmul {peak / 1e12:.0f} TFLOP/s" if peak else ""))
    marks = {"ours": ("o", "C0"), "fa2": ("s", "C1"), "fa3": ("^", "C2"), "flashmla": ("D", "C3")}
    for name, (m, c) in marks.items():
        pts = [(r["flops"] / r["bytes"], r["flops"] / (r[f"{name}_us"] * 1e-6) / 1e12)
               for r in records if r.get(f"{name}_us")]
        if pts:
            ax.scatter(*zip(*pts), marker=m, color=c, label=name, zorder=3)
    for r in records:
        ax.annotate(f"{r['batch']}x{_spec(r['kv_len'])} h{r['heads']} p{r['page_size']} q{_spec(r['q_len'])}",
                    (r["flops"] / r["bytes"], r["flops"] / (r["ours_us"] * 1e-6) / 1e12), fontsize=6,
                    xytext=(3, -8), textcoords="offset points")
    ax.set_xlabel("FLOP / byte of kv cache")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("paged MLA, H200, bf16, d_ckv 512 / d_kpe 64")
    ax.grid(True, which="both", lw=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def replot(json_path, png_path):
    """The roofline of a saved run: the plot is a function of its records and meta alone."""
    with open(json_path) as f:
        run = json.load(f)
    records = run["records"]
    for r in records:  # JSON turned the drawn-length specs ("U", lo, hi, seed) into lists
        for k in ("kv_len", "q_len"):
            if isinstance(r[k], list):
                r[k] = tuple(r[k])
    meta = run["meta"]
    peak = meta["matmul_TFLOPs"] * 1e12 if meta.get("matmul_TFLOPs") else None
    roofline(records, meta["copy_ceiling_GBps"] * 1e9, peak, png_path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--sweep", action="store_true", help="also time planner targets on split-sensitive shapes")
    ap.add_argument("--quick", action="store_true", help="target shapes only")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--fa2", action="store_true", help="also time FlashInfer's fa2 backend")
    ap.add_argument("--flashmla", default=None, help="FlashMLA peer kit directory (built on first use)")
    ap.add_argument("--fp8-only", action="store_true", help="only the fp8-cache shapes and their bf16 baselines")
    ap.add_argument("--no-fp8", action="store_true", help="skip the fp8-cache shapes")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="only the shapes whose name (as printed, e.g. '128x4096 h128', or 128x4096_h128) contains "
                         "NAME; repeatable")
    ap.add_argument("--power", type=float, default=0.0, metavar="SECONDS",
                    help="also run each shape's chain back to back this long, sampling power and SM clock")
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="only draw <out>/roofline.png again from a run's h200.json (no GPU)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.replot:
        replot(args.replot, os.path.join(args.out, "roofline.png"))
        return

    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}, jax {jax.__version__}, default target {default_target()}", flush=True)
    torch = _torch()
    copy_bps = copy_ceiling(torch)
    peak = matmul_peak(torch)
    print(f"copy ceiling {copy_bps / 1e9:.0f} GB/s; bf16 matmul {fmt(peak and peak / 1e12, '.0f')} TFLOP/s",
          flush=True)
    peers = {}
    if torch is not None and not args.no_peers:
        try:
            fi = FlashInferPeer(torch)
            peers = {"fa2": fi, "fa3": fi} if args.fa2 else {"fa3": fi}
            print(f"flashinfer {fi.version}", flush=True)
        except Exception as e:
            print(f"flashinfer not importable: {type(e).__name__}: {e}", flush=True)
        if args.flashmla:
            try:
                t0 = time.time()
                peers["flashmla"] = FlashMLAPeer(torch, args.flashmla)
                print(f"flashmla {peers['flashmla'].version} ({time.time() - t0:.0f} s to build/load)", flush=True)
            except (Exception, SystemExit) as e:  # the kit's build() exits when its sources are missing
                print(f"flashmla not available: {type(e).__name__}: {e}", flush=True)

    shapes = [] if args.fp8_only else list(TARGETS) + ([] if args.quick else EXTRA_SHAPES)
    # (underscores for spaces, so that a name passes through a shell variable unquoted)
    picked = lambda s: not args.only or any(n.replace("_", " ") in shape_name(s) for n in args.only)
    shapes = [s for s in shapes if picked(s)]
    records = []
    for s in shapes:
        t0 = time.time()
        rec = bench_shape(s, peers, copy_bps, power_s=args.power)
        records.append(rec)
        print(f"{shape_name(s)}: ours {rec['ours_us']:.1f} us ({rec['ours_timing']}; chain wall "
              f"{rec['ours_wall_us']:.1f}), fa3 {fmt(rec.get('fa3_us'), '.1f')}, "
              f"flashmla {fmt(rec.get('flashmla_us'), '.1f')} ({time.time() - t0:.0f} s) {rec['plan']}",
              flush=True)

    fp8_records = []
    if not args.no_fp8:
        print("\nfp8 cache (e4m3 ckv, bf16 kpe) against the bf16 cache of the same shape:", flush=True)
        for s, targets in FP8_SHAPES:
            if not picked(s):
                continue
            base = next((r for r in records if shape_of(r) == s), None)
            if base is None:
                base = bench_shape(s, {}, copy_bps, power_s=args.power)
                records.append(base)
            # the accurate path, then (where it applies) the lossy e4m3 x e4m3 option, against one bf16 run
            for products in (False, True) if fp8_products_apply(s) else (False,):
                rec = bench_shape(s, {}, copy_bps, kv_dtype=FP8, power_s=args.power, fp8_products=products)
                rec["bf16_us"] = base["ours_us"]
                rec["bf16_power"] = base.get("power")
                rec["speedup_vs_bf16"] = base["ours_us"] / rec["ours_us"]
                rec["targets"] = [f">= {b:g}x bf16" for _, b in targets]
                rec["met"] = [rec["speedup_vs_bf16"] >= b for _, b in targets]
                fp8_records.append(rec)
                print(f"{fp8_name(rec)}: {rec['ours_us']:.1f} us vs bf16 {base['ours_us']:.1f} us "
                      f"({rec['speedup_vs_bf16']:.2f}x), {rec['bytes'] / rec['ours_us'] / 1e6:.2f} TB/s; rel err vs "
                      f"dequantized f32 ref {rec['rel_err_vs_dequantized_ref']:.2e}, vs bf16 cache "
                      f"{rec['rel_err_vs_bf16_cache']:.2e}"
                      + (f"; fp8 / bf16 run back to back: {power_cell(rec.get('power'))} / "
                         f"{power_cell(rec['bf16_power'])}" if args.power else ""), flush=True)

    sweep = []
    if args.sweep:
        print("\nplanner sweep (ours, us per call):", flush=True)
        hdr = " | ".join(f"u{u:g} mc{m} ov{o}" for u, m, o in SWEEP_TARGETS)
        print(f"| shape | {hdr} |")
        for s in SWEEP_SHAPES:
            rec = bench_shape(s, {}, copy_bps, SWEEP_TARGETS)
            sweep.append(rec)
            print(f"| {shape_name(s)} | " + " | ".join(f"{x['us']:.1f}" for x in rec["sweep"]) + " |", flush=True)

    md = table(records, copy_bps) + power_table(records) + fp8_table(fp8_records)
    meta = dict(device=dev.device_kind, jax=jax.__version__, copy_ceiling_GBps=copy_bps / 1e9,
                matmul_TFLOPs=peak / 1e12 if peak else None, default_target=str(default_target()),
                flashinfer=peers["fa3"].version if "fa3" in peers else None,
                flashmla=peers["flashmla"].version if "flashmla" in peers else None,
                # which CUDA bodies the library holds (an experimental one, when built with it)
                cuda_bodies=build_info().get("cuda", {}).get("bodies"),
                command="python3 benchmarks/bench_attention.py " + " ".join(sys.argv[1:]),
                method="ours_us: jit of K calls in an XLA command buffer under jax.profiler, device span of each "
                       "chain (first kernel start to last kernel end, CUPTI) / K, median of 7 (ours_timing says "
                       "'wall' where no trace was available); ours_wall_us: (t(K2)-t(K1))/(K2-K1) of two such "
                       "jits, wall clock, median of 9; flashinfer and flashmla: CUDA graph of K calls, events, median "
                       "of 9; copy: 1 GiB D2D, events")
    with open(os.path.join(args.out, "h200.json"), "w") as f:
        json.dump(dict(meta=meta, records=records, fp8=fp8_records, sweep=sweep), f, indent=1)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(md + "\n")
    roofline(records, copy_bps, peak, os.path.join(args.out, "roofline.png"))
    print("\n" + md, flush=True)


if __name__ == "__main__":
    main()
