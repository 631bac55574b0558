"""Prefill and decode loops over the paged cache: host-planned steps, or N steps in one jit.

The host (PagedCacheManager) knows every length; the device holds the caches,
the page table and each slot's next input token. Neither loop reads the device
to decide anything:

* host-planned (`decode`): per dispatch the host reserves pages, plans, sends the
  page-table changes, and dispatches one jitted program (caches donated) under
  `jax.transfer_guard_device_to_host("disallow")`: one step, or `steps_per_dispatch`
  steps on one plan. Sampled tokens stay on the device; the host starts their copy
  at once and reads them `fetch_lag` dispatches later, so it never waits on the
  dispatch it just queued.
* fully jitted (`decode_jitted`): pages for N steps are reserved, one plan is
  made for lengths + N, and a lax.scan runs the N steps in one call.
"""

from __future__ import annotations

import collections
import functools
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..attention import resolve_backend
from jax.sharding import PartitionSpec as P

from ..paging import OutOfPagesError, OutOfSlotsError, PagedBatch, PagedCacheManager, bucket
from ..planner import MLAPlan
from ..parallel import DATA, ShardedCacheManager, make_mesh, mesh_sizes, on_data_shards
from ..quant import FP8_DTYPE, is_fp8
from .attention import FORMS
from .model import DeepseekModel
from .sharding import shard_params

# Latent cache dtypes a Generator can keep.
KV_CACHE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), FP8_DTYPE)

__all__ = ["Generator", "choose_prefill_form"]


def choose_prefill_form(cfg, qo_lens: np.ndarray, kv_lens: np.ndarray, num_tokens: int, *,
                        max_score_bytes: int = 1 << 30) -> str:
    """'expanded' when the batch has no cached prefix and that form costs fewer FLOPs.

    absorbed: every (query, visible key) pair costs H * (2 * kv_lora_rank + rope) MACs.
    expanded: dense attention over the packed batch, T^2 * H * (nope + rope + v),
    plus expanding k/v from the latents, T * kv_lora_rank * H * (nope + v).
    The expanded form materialises float32 scores [H, T, T]; above max_score_bytes
    it is not chosen.
    """
    qo = np.asarray(qo_lens, np.int64)
    kv = np.asarray(kv_lens, np.int64)
    if np.any((qo > 0) & (kv != qo)):
        return "absorbed"  # a cached prefix is only reachable through the paged op
    h, r = cfg.num_attention_heads, cfg.kv_lora_rank
    if 4 * h * num_tokens * num_tokens > max_score_bytes:
        return "absorbed"
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    pairs = int((qo * (qo + 1) // 2).sum())
    absorbed = pairs * h * (2 * r + dr) + num_tokens * h * r * (dn + dv)
    expanded = num_tokens * num_tokens * h * (dn + dr + dv) + num_tokens * r * h * (dn + dv)
    return "expanded" if expanded < absorbed else "absorbed"


def _sample(logits: jax.Array, rng: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array]:
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), rng
    rng, key = jax.random.split(rng)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32), rng


def _count(name: str, value, *, minimum: int = 0) -> int:
    """An integer argument >= minimum (bools refused), or a ValueError naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class Generator:
    """Batched greedy (or temperature) generation with a DeepseekModel over a paged cache.

    backend: the attention op's backend ('auto', 'ffi', 'reference').
    kv_cache_dtype: the latent cache's dtype, the model's dtype by default; ``"float8_e4m3fn"``
      stores ckv in FP8 (e4m3) with one float32 scale per layer, `kv_scale` (jax_mla.quant), and
      kpe in bfloat16 (float16 for a float16 model).
    fp8_products: with an fp8 cache, every decode and prefill step's attention takes the op's lossy
      e4m3 x e4m3 option (`mla_paged_attention(..., fp8_products=True)`: faster at 64+ heads on
      sm_90a, ~3-5e-2 relative error in the attention output); needs kv_cache_dtype="float8_e4m3fn".
    min_token_bucket: smallest number of query rows of a step; rows are padded
      to a power of two so that steps of similar size share one compiled program.
    mesh: run over several devices: a `jax.sharding.Mesh` with axes ``"data"`` and ``"tensor"``
      (jax_mla.parallel.make_mesh), or its sizes ``(data, tensor)``. Each data shard serves its own
      requests from its own paged cache (DP attention): `manager` then describes one shard (its
      pages and slots) and the Generator keeps one such manager per shard
      (jax_mla.parallel.ShardedCacheManager, also accepted directly); slots are global
      (shard d's slot j is ``d * max_requests + j``). Heads are split over ``"tensor"``
      (jax_mla.nn.sharding), the latent cache replicated. Everything is placed once.
    """

    def __init__(self, model: DeepseekModel, manager: PagedCacheManager | ShardedCacheManager, *,
                 backend: str = "auto", kv_cache_dtype=None, kv_scale: float = 1.0, temperature: float = 0.0,
                 seed: int = 0, min_token_bucket: int = 8, mesh=None, fp8_products: bool = False):
        self.cfg = model.cfg
        if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
            try:
                data, tensor = mesh
            except (TypeError, ValueError):
                raise ValueError(f"mesh must be a jax.sharding.Mesh or (data, tensor) sizes, got {mesh!r}") from None
            mesh = make_mesh(data, tensor)
        self.mesh = mesh
        data, tensor = (1, 1) if mesh is None else mesh_sizes(mesh)
        if self.cfg.num_attention_heads % tensor:
            raise ValueError(f"num_attention_heads={self.cfg.num_attention_heads} is not divisible by the "
                             f"mesh's tensor size {tensor}")
        self.num_shards = data
        self.local_heads = self.cfg.num_attention_heads // tensor  # each device plans for its heads
        if mesh is not None and isinstance(manager, PagedCacheManager):
            manager = ShardedCacheManager.like(manager, mesh)
        elif mesh is not None and (not isinstance(manager, ShardedCacheManager) or manager.mesh != mesh):
            raise ValueError("with a mesh, pass a PagedCacheManager (one shard's sizes) or a "
                             "ShardedCacheManager made for that mesh")
        elif mesh is None and isinstance(manager, ShardedCacheManager):
            raise ValueError("a ShardedCacheManager needs the Generator's mesh= (its mesh)")
        self.manager = manager
        if not (np.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        self.temperature = float(temperature)
        self.min_token_bucket = _count("min_token_bucket", min_token_bucket, minimum=1)
        self.graphdef, params = nnx.split(model)
        if mesh is not None:
            params = shard_params(params, self.cfg, mesh)
        # Steps take the parameters as a flat list: flattening an nnx.State on every
        # dispatch costs more host time than the rest of the dispatch.
        self._params_def = jax.tree.structure(params)
        self.params = jax.tree.leaves(params)
        cfg = self.cfg
        try:
            dtype = jnp.dtype(kv_cache_dtype if kv_cache_dtype is not None else model.dtype)
        except TypeError as e:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not a dtype") from e
        if dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={dtype.name} is not one of {[d.name for d in KV_CACHE_DTYPES]}")
        kpe_dtype = jnp.dtype(jnp.float16) if jnp.dtype(model.dtype) == jnp.float16 else None
        # An unknown name (or 'ffi' where no kernel is built) fails here, not at the first step.
        resolve_backend(backend, self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim)
        self.backend = backend
        self.kv_cache_dtype = dtype
        if not isinstance(fp8_products, (bool, np.bool_)):
            raise ValueError(f"fp8_products must be a bool, got {fp8_products!r}")
        if fp8_products and not is_fp8(dtype):
            raise ValueError(f"fp8_products needs kv_cache_dtype='float8_e4m3fn'; got kv_cache_dtype={dtype.name}")
        self.fp8_products = bool(fp8_products)
        self.caches = manager.init_caches(cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype,
                                          kpe_dtype=kpe_dtype if is_fp8(dtype) else None, ckv_scale=kv_scale)
        self.next_tokens = self._put(np.zeros((manager.max_requests,), np.int32))  # per slot: next input token
        self.rng = jax.random.key(seed)
        if mesh is not None:
            self.rng = jax.device_put(self.rng, manager.replicated)
        self.traces: collections.Counter[str] = collections.Counter()
        # Tokens are kept per request id (a slot is reused once its request finishes, possibly while
        # the finished request's last tokens are still on their way back).
        self._tokens: dict[int, list[int]] = collections.defaultdict(list)
        self._slot_request = np.full(manager.max_requests, -1, np.int64)  # request id in each slot
        self._next_request = 0
        # Static signature (form, buffer layout, plan facts) of every prefill step so far: the
        # buckets a prefill compiles for (token rows, and the plan's tables and partial rows).
        self.prefill_shapes: set[tuple] = set()
        self.stream_stats: dict = {}
        self._unread: collections.deque = collections.deque()  # (request id of each row, device tokens)
        self.timings: dict[str, list[float]] = collections.defaultdict(list)
        donate = ("caches", "next_tokens", "rng")
        layout = ("layout", "plan_static")
        self._prefill_step = jax.jit(self._prefill_impl, static_argnames=layout + ("form", "with_logits"),
                                     donate_argnames=donate)
        self._decode_step = jax.jit(self._decode_impl, static_argnames=layout + ("with_logits",),
                                    donate_argnames=donate)
        self._decode_scan = jax.jit(self._decode_scan_impl, static_argnames=layout + ("num_steps", "with_logits"),
                                    donate_argnames=donate)

    # ---- jitted bodies -------------------------------------------------------
    def _model(self, params) -> DeepseekModel:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._params_def, params))

    def _put(self, tree):
        """Host arrays onto the devices: as they are on one device; with a mesh, split over data on
        their leading axis (each shard gets only its part)."""
        return tree if self.mesh is None else jax.device_put(tree, self.manager.sharded)

    def _pack(self, plan, **arrays) -> tuple[np.ndarray | jax.Array, tuple, tuple]:
        """Every host array of a step in one int32 buffer [D, n] (a row per data shard, D = 1 without a
        mesh): one transfer per step instead of one per array, and no plan pytree to flatten at
        dispatch. arrays are per-slot [D * R] or per-shard [D, ...]; the plan's tables (stacked per
        shard with a mesh) go last. Returns the buffer (on the devices with a mesh), its layout
        (names and per-shard shapes) and the plan's static facts: the step's static arguments."""
        d = self.num_shards
        stacked = self.mesh is not None
        parts = [np.asarray(a).reshape(d, -1) if np.ndim(a) == 1 else np.asarray(a) for a in arrays.values()]
        tables = [np.asarray(x) if stacked else np.asarray(x)[None] for x in (plan.work, plan.merge, plan.tokens)]
        names = tuple(arrays) + ("plan.work", "plan.merge", "plan.tokens")
        layout = tuple((n, a.shape[1:]) for n, a in zip(names, parts + tables))
        buf = np.concatenate([a.reshape(d, -1) for a in parts + tables], axis=1).astype(np.int32, copy=False)
        static = (plan.num_tokens, plan.num_heads, plan.page_size, plan.num_requests, plan.q_tile,
                  plan.num_partial_rows)
        return self._put(buf), layout, static

    def _unpack(self, buf, layout, plan_static) -> tuple[dict, MLAPlan]:
        """In the step: the arrays `_pack` put in buf (per-slot ones flat [D * R]) and the plan."""
        out, off = {}, 0
        for name, shape in layout:
            n = math.prod(shape)
            out[name] = buf[:, off: off + n].reshape((buf.shape[0],) + tuple(shape))
            off += n
        work, merge, tokens = (out.pop(k) for k in ("plan.work", "plan.merge", "plan.tokens"))
        if self.mesh is None:
            work, merge, tokens = work[0], merge[0], tokens[0]
        return out, MLAPlan._make(work, merge, tokens, *plan_static)

    def _by_shard(self, x, spec=P(DATA)):
        """Inside a step with a mesh: keep x split over data (rows are shards' rows back to back)."""
        return x if self.mesh is None else jax.lax.with_sharding_constraint(
            x, jax.sharding.NamedSharding(self.mesh, spec))

    def _prefill_impl(self, params, caches, page_table, host, next_tokens, rng, *, layout, plan_static, form,
                      with_logits):
        self.traces["prefill"] += 1
        model = self._model(params)
        a, plan = self._unpack(host, layout, plan_static)
        kv_lens, tokens, last_rows = a["kv_lens"].reshape(-1), a["tokens"].reshape(-1), a["last_rows"]
        logits, caches = model(tokens, caches, PagedBatch(page_table, kv_lens, plan), form=form,
                               backend=self.backend, logits_rows=jnp.maximum(last_rows, 0), mesh=self.mesh,
                               fp8_products=self.fp8_products)
        sampled, rng = _sample(logits, rng, self.temperature)
        fresh = last_rows.reshape(-1) >= 0
        next_tokens = self._by_shard(jnp.where(fresh, sampled, next_tokens))
        emitted = self._by_shard(jnp.where(fresh, sampled, -1))
        return caches, next_tokens, rng, emitted, (self._by_shard(logits) if with_logits else None)

    def _decode_body(self, model, caches, page_table, kv_lens, plan, next_tokens, rng):
        """One decode step on the device: feed each slot's next token, sample, store the new ones.

        Each data shard (the one device without a mesh) feeds and stores its own slots.
        """
        req = jnp.asarray(plan.tokens)[..., 0]  # [T] or, stacked per data shard, [D, T]

        def feed(next_tokens, req):
            return next_tokens[jnp.maximum(req.reshape(-1), 0)]

        def store(next_tokens, req, sampled):
            req = req.reshape(-1)
            valid = req >= 0
            drop = next_tokens.shape[0]  # out of range: padding rows write nothing
            return (next_tokens.at[jnp.where(valid, req, drop)].set(sampled, mode="drop"),
                    jnp.where(valid, sampled, -1))

        tokens = on_data_shards(feed, self.mesh, next_tokens, req)
        logits, caches = model(tokens, caches, PagedBatch(page_table, kv_lens, plan), form="absorbed",
                               backend=self.backend, mesh=self.mesh, fp8_products=self.fp8_products)
        sampled, rng = _sample(logits, rng, self.temperature)
        next_tokens, emitted = on_data_shards(store, self.mesh, next_tokens, req, sampled)
        return caches, next_tokens, rng, emitted, self._by_shard(logits)

    def _decode_impl(self, params, caches, page_table, host, next_tokens, rng, *, layout, plan_static,
                     with_logits):
        self.traces["decode"] += 1
        a, plan = self._unpack(host, layout, plan_static)
        caches, next_tokens, rng, emitted, logits = self._decode_body(
            self._model(params), caches, page_table, a["kv_lens"].reshape(-1), plan, next_tokens, rng)
        return caches, next_tokens, rng, emitted, (logits if with_logits else None)

    def _decode_scan_impl(self, params, caches, page_table, host, next_tokens, rng, *, layout, plan_static,
                          num_steps, with_logits=False):
        self.traces["decode_scan"] += 1
        model = self._model(params)
        a, plan = self._unpack(host, layout, plan_static)
        kv_lens0, step_lens = a["kv_lens"].reshape(-1), a["step_lens"].reshape(-1)

        def step(carry, i):
            caches, next_tokens, rng = carry
            kv_lens = kv_lens0 + (i + 1) * step_lens
            caches, next_tokens, rng, emitted, logits = self._decode_body(model, caches, page_table, kv_lens, plan,
                                                                          next_tokens, rng)
            return (caches, next_tokens, rng), (emitted, logits if with_logits else None)

        (caches, next_tokens, rng), (emitted, logits) = jax.lax.scan(step, (caches, next_tokens, rng),
                                                                     jnp.arange(num_steps, dtype=jnp.int32))
        return caches, next_tokens, rng, emitted, logits

    # ---- host side -----------------------------------------------------------
    def prefill(self, prompts: Sequence[Sequence[int]], *, form: str = "auto", with_logits: bool = False,
                reserve_tokens: Sequence[int] | int = 0):
        """Admit prompts, run them through the model in one step, sample each one's first token.

        Returns the new slots (and, with_logits, the float32 logits [max_requests, vocab]
        of each slot's last prompt token, rows of other slots meaningless).
        reserve_tokens: pages for this many more tokens per prompt are taken at admission too
        (all or nothing), so its decode steps never run out of pages.
        """
        mgr = self.manager
        prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
        lens = np.array([p.size for p in prompts], np.int64)
        for i, p in enumerate(prompts):
            if p.size and (p.min() < 0 or p.max() >= self.cfg.vocab_size):
                raise ValueError(f"prompt {i} has token ids outside [0, {self.cfg.vocab_size})")
        if form not in ("auto",) + FORMS:
            raise ValueError(f"form={form!r} is not 'auto' or one of {FORMS}")
        extra = np.broadcast_to(np.asarray(reserve_tokens), lens.shape)
        if extra.size and (extra.dtype.kind not in "iu" or extra.min() < 0):
            raise ValueError(f"reserve_tokens must be integers >= 0, got {reserve_tokens!r}")
        slots = mgr.admit(lens + extra)
        try:
            return self._prefill_admitted(slots, prompts, lens, form, with_logits)
        except Exception:
            for s in slots:  # give the slots and pages back: a failed prefill leaves no request behind
                mgr.finish(s)
            raise

    def _rows(self, qo: np.ndarray) -> tuple[int, np.ndarray]:
        """Row layout of a step with qo query tokens per (global) slot: each data shard's rows are
        its slots' tokens packed in slot order, padded to a common bucket T. Returns T and each
        slot's first global row (shard d's rows are d*T .. (d+1)*T)."""
        d = self.num_shards
        per_shard = qo.reshape(d, -1)
        num_tokens = bucket(int(per_shard.sum(axis=1).max()), self.min_token_bucket)
        start = np.cumsum(per_shard, axis=1) - per_shard + num_tokens * np.arange(d)[:, None]
        return num_tokens, start.reshape(-1)

    def _prefill_admitted(self, slots, prompts, lens, form, with_logits):
        mgr = self.manager
        qo = np.zeros(mgr.max_requests, np.int64)
        qo[slots] = lens
        kv = mgr.lengths + qo
        num_tokens, start = self._rows(qo)
        tokens = np.zeros(self.num_shards * num_tokens, np.int32)
        for s, p in zip(slots, prompts):
            tokens[start[s]: start[s] + p.size] = p
        # Each shard's last prompt rows, counted within the shard (the model picks among its own rows).
        last_rows = np.full(mgr.max_requests, -1, np.int32)
        last_rows[slots] = start[slots] % num_tokens + lens - 1
        if form == "auto":
            per_shard = zip(qo.reshape(self.num_shards, -1), kv.reshape(self.num_shards, -1))
            forms = {choose_prefill_form(self.cfg, q, k, num_tokens) for q, k in per_shard}
            form = "expanded" if forms == {"expanded"} else "absorbed"
        elif form == "expanded" and np.any((qo > 0) & (kv != qo)):
            raise ValueError("form='expanded' needs requests without a cached prefix")
        plan = mgr.plan(qo, kv, num_heads=self.local_heads, num_tokens=num_tokens)
        page_table = mgr.sync()
        host, layout, static = self._pack(plan, kv_lens=kv, tokens=tokens,
                                          last_rows=last_rows.reshape(self.num_shards, -1))
        self.prefill_shapes.add((form, layout, static))
        self.caches, self.next_tokens, self.rng, emitted, logits = self._prefill_step(
            self.params, self.caches, page_table, host, self.next_tokens, self.rng, layout=layout,
            plan_static=static, form=form, with_logits=with_logits)
        mgr.commit(slots, lens)
        for s in slots:
            self._slot_request[s] = self._next_request
            self._next_request += 1
        self._queue(np.arange(mgr.max_requests), emitted)
        return (slots, logits) if with_logits else slots

    def _decode_rows(self) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
        """Active slots, per-slot query lengths (1 for active), the per-shard token bucket of a
        decode step, and the slot of each row (-1 for padding)."""
        slots = self.manager.active_slots
        if slots.size == 0:
            raise ValueError("no active requests to decode")
        qo = np.zeros(self.manager.max_requests, np.int64)
        qo[slots] = 1
        num_tokens, start = self._rows(qo)
        row_slot = np.full(self.num_shards * num_tokens, -1, np.int64)
        row_slot[start[slots]] = slots
        return slots, qo, num_tokens, row_slot

    def decode(self, num_steps: int, *, fetch_lag: int = 4, with_logits: bool = False,
               on_step: Callable[[int], None] | None = None, steps_per_dispatch: int = 1):
        """Host-planned decode of every active slot for num_steps steps.

        Each dispatch: reserve pages where needed, plan on the host, send page-table
        changes, dispatch one jitted program with no device->host transfer allowed.
        With steps_per_dispatch = k > 1 a dispatch runs k steps (a lax.scan on one plan made
        for the lengths after its last step, as in `decode_jitted`; the kernel clips to each
        step's device lengths): the host's plan and dispatch are paid once per k steps, so a
        host slower than the device's step no longer bounds the loop (the "multi-step
        scheduling" of vLLM). A remainder of fewer than k steps is one more dispatch of that
        many. Tokens are read `fetch_lag` dispatches behind. Returns the per-step logits
        (device arrays [T, vocab], rows in slot order) when with_logits. `timings` holds host
        seconds per step (a dispatch's time / its steps).
        """
        num_steps = _count("num_steps", num_steps)
        fetch_lag = _count("fetch_lag", fetch_lag)
        k = _count("steps_per_dispatch", steps_per_dispatch, minimum=1)
        slots, qo, num_tokens, row_slot = self._decode_rows()
        all_logits = []
        done = 0
        while done < num_steps:
            n = min(k, num_steps - done)
            logits = self._dispatch_decode(slots, qo, num_tokens, row_slot, n, scan=n > 1, with_logits=with_logits,
                                           record=True)
            self._read(keep=fetch_lag)
            if with_logits:
                all_logits.extend([logits] if n == 1 else list(logits))
            if on_step is not None:
                for i in range(done, done + n):
                    on_step(i)
            done += n
        return all_logits if with_logits else None

    def _dispatch_decode(self, slots, qo, num_tokens, row_slot, n, *, scan, with_logits, record):
        """One dispatch of n decode steps of `slots`: reserve their pages, plan for the lengths after
        the last step, send page-table changes, run the single step (n = 1, not scan) or a lax.scan
        of n steps on that plan under the device-to-host guard, commit, queue the sampled tokens.
        Returns the logits (None unless with_logits); with record, the host times per step go to
        `timings`."""
        mgr = self.manager
        t0 = time.perf_counter()
        mgr.reserve(slots, n)
        kv = mgr.lengths + n * qo  # the plan is made for the last step's lengths
        ta = time.perf_counter()
        plan = mgr.plan(qo, kv, num_heads=self.local_heads, num_tokens=num_tokens)
        tb = time.perf_counter()
        page_table = mgr.sync()
        tc = time.perf_counter()
        if scan:
            host, layout, static = self._pack(plan, kv_lens=mgr.lengths, step_lens=qo)
            run = functools.partial(self._decode_scan, num_steps=n)
        else:
            host, layout, static = self._pack(plan, kv_lens=kv)
            run = self._decode_step
        t1 = time.perf_counter()
        with jax.transfer_guard_device_to_host("disallow"):
            self.caches, self.next_tokens, self.rng, emitted, logits = run(
                self.params, self.caches, page_table, host, self.next_tokens, self.rng, layout=layout,
                plan_static=static, with_logits=with_logits)
        t2 = time.perf_counter()
        mgr.commit(slots, n)
        if record:
            # plan_s is the host work before the dispatch; its parts: reserve_s (pages), plan_mla_s,
            # sync_s (page-table changes sent), pack_s (the step's host buffer, and its transfer).
            for name, t in (("plan_s", t1 - t0), ("reserve_s", ta - t0), ("plan_mla_s", tb - ta),
                            ("sync_s", tc - tb), ("pack_s", t1 - tc), ("dispatch_s", t2 - t1),
                            ("h2d_bytes", host.nbytes + 12 * mgr.last_sync_entries)):
                self.timings[name].append(t / n)
        self._queue(row_slot, emitted)
        return logits

    def decode_jitted(self, num_steps: int) -> None:
        """num_steps decode steps of every active slot in one jitted lax.scan, on one plan.

        Pages for all steps are reserved first and the plan is made for the
        lengths after the last step; the kernel clips to the device lengths.
        """
        if _count("num_steps", num_steps) == 0:
            return
        slots, qo, num_tokens, row_slot = self._decode_rows()
        self._dispatch_decode(slots, qo, num_tokens, row_slot, int(num_steps), scan=True, with_logits=False,
                              record=False)

    def lower_decode_step(self, *, with_logits: bool = False) -> jax.stages.Lowered:
        """The jitted decode step for the active requests, lowered, not run (nothing changes): to
        inspect what a step compiles to, e.g. ``gen.lower_decode_step().compile().as_text()``."""
        mgr = self.manager
        _, qo, num_tokens, _ = self._decode_rows()
        plan = mgr.plan(qo, mgr.lengths + qo, num_heads=self.local_heads, num_tokens=num_tokens)
        host, layout, static = self._pack(plan, kv_lens=mgr.lengths + qo)
        return self._decode_step.lower(self.params, self.caches, mgr.device_page_table, host, self.next_tokens,
                                       self.rng, layout=layout, plan_static=static, with_logits=with_logits)

    def finish(self, slot: int) -> list[int]:
        """Release a request; return the tokens it generated (waits for them)."""
        self._read(keep=0)
        return self._tokens.pop(self._release(slot), [])

    def _release(self, slot: int) -> int:
        """Give a request's slot and pages back without waiting; its request id (its tokens keep
        arriving under that id)."""
        self.manager.finish(slot)
        request = int(self._slot_request[slot])
        self._slot_request[slot] = -1
        return request

    @property
    def outputs(self) -> dict[int, list[int]]:
        """Tokens read back so far, per active slot (no wait)."""
        return {int(s): self._tokens[int(r)] for s, r in enumerate(self._slot_request)
                if r >= 0 and int(r) in self._tokens}

    def results(self) -> dict[int, list[int]]:
        """Every generated token so far, per active slot (waits for the device)."""
        self._read(keep=0)
        return {s: list(v) for s, v in self.outputs.items()}

    def serve(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int] | int, *,
              eos_token_id: int | None = None, fetch_lag: int = 4, steps_per_dispatch: int = 1,
              admit: str = "arrival") -> list[list[int]]:
        """Serve a stream of requests through this Generator's slots; their tokens, in arrival order.

        Requests wait in arrival order (admit="arrival") or, for throughput on a known workload,
        longest max_new_tokens first (admit="longest_first": the long ones no longer decode alone at
        the end while slots stand empty); between decode steps the ones that fit (a free slot and
        pages for prompt + max_new_tokens, taken at admission) are admitted and prefilled in one
        step, and requests that are done leave (their slot and pages are reused at once).
        Requests already in the Generator keep decoding alongside and stay when it returns. A request
        is done after max_new_tokens tokens (the first comes from its prefill), known on the host
        without reading the device; with eos_token_id also when it emits that token, seen
        `fetch_lag` dispatches late (tokens after it are dropped). Steps are host-planned as in
        `decode`, steps_per_dispatch at a time: requests are admitted and leave between dispatches, and
        a request that is done inside one keeps its slot until the dispatch ends (its extra tokens are
        dropped; pages for them are taken at admission). Shapes are bucketed, so compilations are
        bounded by the buckets touched (`self.traces`).
        `self.stream_stats` has the steps, wall time and each request's time to first token.
        """
        prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
        n = len(prompts)
        budget = np.broadcast_to(np.asarray(max_new_tokens), (n,))
        if n and (budget.dtype.kind not in "iu" or budget.min() < 1):
            raise ValueError(f"max_new_tokens must be integers >= 1, got {max_new_tokens!r}")
        fetch_lag = _count("fetch_lag", fetch_lag)
        k = _count("steps_per_dispatch", steps_per_dispatch, minimum=1)
        if admit not in ("arrival", "longest_first"):
            raise ValueError(f"admit={admit!r} is not 'arrival' or 'longest_first'")
        mgr = self.manager
        order = range(n) if admit == "arrival" else np.argsort(-budget, kind="stable").tolist()
        waiting = collections.deque(order)
        active: dict[int, int] = {}  # slot -> request index
        made = np.zeros(n, np.int64)  # tokens each request has been given steps for
        first_id = np.full(n, -1, np.int64)  # request id (self._tokens key) of each request
        done: list[int] = []
        out: list[list[int] | None] = [None] * n
        ttft = np.full(n, np.nan)
        t0 = time.perf_counter()
        steps = prefills = 0

        def collect(i, tokens):
            toks = list(tokens)[: int(budget[i])]
            if eos_token_id is not None and eos_token_id in toks:
                toks = toks[: toks.index(eos_token_id) + 1]
            out[i] = toks

        while waiting or active:
            # Admit the longest run of waiting requests that fits.
            take = []
            free_slots = mgr.max_requests - mgr.active_slots.size  # other requests may hold slots too
            while waiting and len(take) < free_slots:
                take.append(waiting.popleft())
            while take:
                try:
                    slots = self.prefill([prompts[i] for i in take],
                                         reserve_tokens=[int(budget[i]) + k - 1 for i in take])
                    break
                except (OutOfPagesError, OutOfSlotsError):
                    waiting.appendleft(take.pop())
            if take:
                prefills += 1
                for s, i in zip(slots, take):
                    active[s] = i
                    first_id[i] = self._slot_request[s]
                    made[i] = 1
            elif not active:
                i = waiting[0]
                raise OutOfPagesError(f"request {i} ({prompts[i].size} prompt + {int(budget[i])} new tokens) "
                                      "does not fit an empty cache")
            # Requests that are done leave; the rest take one decode step.
            self._read(keep=fetch_lag)
            now = time.perf_counter() - t0
            for i in np.nonzero(np.isnan(ttft) & (first_id >= 0))[0]:
                if self._tokens.get(int(first_id[i])):
                    ttft[i] = now  # its first token is back on the host
            for s, i in list(active.items()):
                toks = self._tokens.get(int(first_id[i]), [])
                if made[i] >= budget[i] or (eos_token_id is not None and eos_token_id in toks):
                    del active[s]
                    self._release(s)
                    done.append(i)
            if active:
                self.decode(k, fetch_lag=fetch_lag, steps_per_dispatch=k)
                steps += k
                for i in active.values():
                    made[i] += k
        self._read(keep=0)
        for i in done:
            collect(i, self._tokens.pop(int(first_id[i]), []))
        for i in np.nonzero(np.isnan(ttft))[0]:
            ttft[i] = time.perf_counter() - t0  # first token read only at the end
        self.stream_stats = {"requests": n, "decode_steps": steps, "prefill_steps": prefills,
                             "prefill_buckets": len(self.prefill_shapes),
                             "wall_s": time.perf_counter() - t0,
                             "tokens": int(sum(len(o) for o in out)), "ttft_s": ttft.tolist()}
        return out

    # ---- token transfer --------------------------------------------------------
    def _queue(self, row_slot: np.ndarray, emitted: jax.Array) -> None:
        emitted.copy_to_host_async()
        row_request = np.where(row_slot >= 0, self._slot_request[np.maximum(row_slot, 0)], -1)
        self._unread.append((row_request, emitted))

    def _read(self, keep: int) -> None:
        while len(self._unread) > keep:
            row_request, emitted = self._unread.popleft()
            toks = np.asarray(emitted).reshape(-1, row_request.size)  # [steps, rows]
            for step_toks in toks:
                for r, t in zip(row_request, step_toks):
                    if r >= 0 and t >= 0:
                        self._tokens[int(r)].append(int(t))
