"""MLAAttention: absorbed == expanded == the textbook formula; extends over a cached prefix;
nope and rope parts never concatenated."""

import numpy as np
import pytest

pytest.importorskip("flax", reason="jax_mla.nn needs flax (pip install .[nn])")

import jax  # noqa: E402
import jax.extend.core as jax_core  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jax_mla.nn import (DeepseekConfig, MLAAttention, PagedBatch, PagedCacheManager, RopeScaling,  # noqa: E402
                        rope_inv_freq)

# Distinct sizes so that a concatenation of nope+rope parts is recognisable by its width.
H, HIDDEN, Q_LORA, R, DN, DR, DV = 4, 64, 48, 32, 16, 8, 12


def tiny_cfg(**kw):
    base = dict(hidden_size=HIDDEN, num_attention_heads=H, q_lora_rank=Q_LORA, kv_lora_rank=R, qk_nope_head_dim=DN,
                qk_rope_head_dim=DR, v_head_dim=DV, vocab_size=97, intermediate_size=96, num_hidden_layers=1,
                max_position_embeddings=256,
                rope_scaling=RopeScaling(factor=4.0, mscale=0.8, mscale_all_dim=0.6,
                                         original_max_position_embeddings=64))
    base.update(kw)
    return DeepseekConfig(**base)


def make_attention(cfg, seed=0):
    attn = MLAAttention(cfg, rngs=nnx.Rngs(seed))
    # Non-trivial norm weights, so a missing norm cannot go unnoticed.
    rng = np.random.default_rng(seed + 1)
    for norm in (attn.q_a_layernorm, attn.kv_a_layernorm):
        if norm is not None:
            norm.weight[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(norm.weight.shape), jnp.float32)
    return attn


def make_manager(page_size=4):
    return PagedCacheManager(num_pages=64, page_size=page_size, max_requests=4, max_pages_per_request=16)


def caches(mgr, dtype=jnp.float32):
    return mgr.init_caches(1, R, DR, dtype)[0]


def step_batch(mgr, slots, qo_per_slot, num_tokens):
    """Reserve pages for qo tokens per slot, plan, and return the batch (lengths not yet committed)."""
    qo = np.zeros(mgr.max_requests, np.int64)
    qo[slots] = qo_per_slot
    mgr.reserve(slots, qo[slots])
    kv = mgr.lengths + qo
    plan = mgr.plan(qo, kv, num_heads=H, num_tokens=num_tokens)
    return PagedBatch(mgr.sync(), jnp.asarray(kv, jnp.int32), plan), qo


def call(attn, x, kv, batch, form):
    graphdef, state = nnx.split(attn)

    @jax.jit
    def run(state, x, kv, batch):
        return nnx.merge(graphdef, state)(x, kv, batch, form=form, backend="auto")

    return run(state, x, kv, batch)


def rows_of(qo):
    start = np.cumsum(qo) - qo
    return {s: np.arange(start[s], start[s] + qo[s]) for s in np.nonzero(qo)[0]}


# ---- the textbook formula ------------------------------------------------------

def rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def rope_np(x, pos, cfg):
    inv = rope_inv_freq(cfg).astype(np.float64)
    ang = np.float32(pos)[:, None].astype(np.float32) * inv.astype(np.float32)
    z = x[..., 0::2] + 1j * x[..., 1::2]  # interleaved pairs
    rot = np.exp(1j * ang.astype(np.float64)) * cfg.rope_attention_factor
    z = z * rot.reshape(rot.shape[:1] + (1,) * (x.ndim - 2) + rot.shape[1:])
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def textbook_mla(attn, x, cfg):
    """DeepSeek attention of one sequence x [n, hidden], written the way the paper states it
    (per-head keys [k_nope; k_pe], causal softmax), in float64 NumPy."""
    p = lambda v: np.asarray(v[...], np.float64)  # noqa: E731
    n = x.shape[0]
    q = rms(x @ p(attn.q_a_proj.kernel), p(attn.q_a_layernorm.weight)) @ p(attn.q_b_proj.kernel)
    q = q.reshape(n, H, DN + DR)
    pos = np.arange(n)
    q_full = np.concatenate([q[..., :DN], rope_np(q[..., DN:], pos, cfg)], -1)
    kv = x @ p(attn.kv_a_proj_with_mqa.kernel)
    c = rms(kv[:, :R], p(attn.kv_a_layernorm.weight))
    k_pe = rope_np(kv[:, R:], pos, cfg)
    k_nope = np.einsum("sr,hdr->shd", c, p(attn.w_uk))
    v = np.einsum("sr,hvr->shv", c, p(attn.w_uv))
    k_full = np.concatenate([k_nope, np.broadcast_to(k_pe[:, None], (n, H, DR))], -1)
    s = np.einsum("thd,shd->hts", q_full, k_full) * cfg.softmax_scale
    s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = np.einsum("hts,shv->thv", w, v).reshape(n, H * DV)
    return o @ p(attn.o_proj.kernel)


# ---- tests --------------------------------------------------------------------------

def test_absorbed_and_expanded_match_the_textbook_formula():
    cfg = tiny_cfg()
    attn = make_attention(cfg)
    rng = np.random.default_rng(3)
    lens = [5, 1, 11]
    x = rng.standard_normal((32, HIDDEN)).astype(np.float32)
    outs = {}
    for form in ("absorbed", "expanded"):
        mgr = make_manager()
        slots = mgr.admit(lens)
        batch, qo = step_batch(mgr, slots, 0, num_tokens=32)  # admit reserved the pages
        qo[slots] = lens
        batch = PagedBatch(batch.page_table, jnp.asarray(qo, jnp.int32),
                           mgr.plan(qo, qo, num_heads=H, num_tokens=32))
        y, kv = call(attn, jnp.asarray(x), caches(mgr), batch, form)
        outs[form] = (np.asarray(y), np.asarray(kv.ckv), np.asarray(kv.kpe))
    ya, yb = outs["absorbed"][0], outs["expanded"][0]
    np.testing.assert_allclose(ya, yb, rtol=1e-5, atol=1e-5)
    for a, b in zip(outs["absorbed"][1:], outs["expanded"][1:]):
        np.testing.assert_array_equal(a, b)  # both forms write the same cache rows
    for s, rows in rows_of(qo).items():
        want = textbook_mla(attn, x[rows].astype(np.float64), cfg)
        np.testing.assert_allclose(ya[rows], want, rtol=2e-5, atol=2e-5)
    assert np.abs(ya[sum(lens):]).max() == 0  # padding rows: no keys, zero output


def test_extend_over_a_cached_prefix_equals_one_fresh_prefill():
    """Prefill prompts, then extend each by a few tokens (absorbed, q_len > 1, causal over the
    paged prefix): the extension's outputs equal those of prefilling everything at once."""
    cfg = tiny_cfg(q_lora_rank=None)  # the plain q_proj variant
    attn = make_attention(cfg, seed=5)
    rng = np.random.default_rng(4)
    first, more = [6, 3, 9], [4, 0, 7]
    seqs = [rng.standard_normal((a + b, HIDDEN)).astype(np.float32) for a, b in zip(first, more)]

    mgr = make_manager()
    slots = mgr.admit(first)
    qo = np.zeros(4, np.int64)
    qo[slots] = first
    plan = mgr.plan(qo, qo, num_heads=H, num_tokens=32)
    x = np.zeros((32, HIDDEN), np.float32)
    for s, rows in rows_of(qo).items():
        x[rows] = seqs[s][: first[s]]
    _, kv = call(attn, jnp.asarray(x), caches(mgr), PagedBatch(mgr.sync(), jnp.asarray(qo, jnp.int32), plan),
                 "expanded")
    mgr.commit(slots, first)
    batch, qo2 = step_batch(mgr, slots, more, num_tokens=16)
    x2 = np.zeros((16, HIDDEN), np.float32)
    for s, rows in rows_of(qo2).items():
        x2[rows] = seqs[s][first[s]:]
    y2, _ = call(attn, jnp.asarray(x2), kv, batch, "absorbed")

    mgr_all = make_manager()
    whole = [a + b for a, b in zip(first, more)]
    slots_all = mgr_all.admit(whole)
    qo_all = np.zeros(4, np.int64)
    qo_all[slots_all] = whole
    x_all = np.zeros((32, HIDDEN), np.float32)
    for s, rows in rows_of(qo_all).items():
        x_all[rows] = seqs[s]
    plan_all = mgr_all.plan(qo_all, qo_all, num_heads=H, num_tokens=32)
    y_all, _ = call(attn, jnp.asarray(x_all), caches(mgr_all),
                    PagedBatch(mgr_all.sync(), jnp.asarray(qo_all, jnp.int32), plan_all), "expanded")
    rows2, rows_all = rows_of(qo2), rows_of(qo_all)
    for s in slots:
        if more[s]:
            np.testing.assert_allclose(np.asarray(y2)[rows2[s]], np.asarray(y_all)[rows_all[s][first[s]:]],
                                       rtol=1e-5, atol=1e-5)


def _concat_widths(jaxpr, out):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "concatenate":
            out.append(eqn.outvars[0].aval.shape[eqn.params["dimension"]])
        for sub in jax_core.jaxprs_in_params(eqn.params):  # pjit, scan, cond, custom calls...
            _concat_widths(sub, out)
    return out


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_nope_and_rope_are_never_concatenated(form):
    cfg = tiny_cfg(rope_interleave=False)  # the half-split rope concatenates its two halves (width DR)
    attn = make_attention(cfg)
    mgr = make_manager()
    slots = mgr.admit([5, 3])
    qo = np.zeros(4, np.int64)
    qo[slots] = [5, 3]
    batch = PagedBatch(mgr.sync(), jnp.asarray(qo, jnp.int32), mgr.plan(qo, qo, num_heads=H, num_tokens=8))
    graphdef, state = nnx.split(attn)
    x = jnp.ones((8, HIDDEN), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda st, x, kv, b: nnx.merge(graphdef, st)(x, kv, b, form=form))(
        state, x, caches(mgr), batch)
    widths = _concat_widths(jaxpr.jaxpr, [])
    assert DR in widths  # the walk does see concatenations (the rope halves)
    assert DN + DR not in widths and R + DR not in widths, widths


def test_prefill_form_choice():
    from jax_mla.nn import choose_prefill_form

    ds = DeepseekConfig(num_attention_heads=16, q_lora_rank=None)  # DeepSeek dims: 512 / 64 / 128 / 128
    # One fresh prompt: per (query, key) pair the expanded form costs nope + rope + v = 320 MACs a
    # head against 2 * 512 + 64 absorbed, and expanding k/v costs what absorbing q costs.
    one = np.array([2048, 0])
    assert choose_prefill_form(ds, one, one, 2048) == "expanded"
    # ... unless its [H, T, T] float32 scores would not fit the limit.
    assert choose_prefill_form(ds, one, one, 2048, max_score_bytes=16 * 2048 * 2048 * 4 - 1) == "absorbed"
    # Any cached prefix forces the paged op, however long the extension.
    assert choose_prefill_form(ds, one, one + np.array([1, 0]), 2048) == "absorbed"
    # Many short prompts packed together: the dense packed form wastes the cross-request pairs.
    many = np.full(64, 64)
    assert choose_prefill_form(ds, many, many, 4096) == "absorbed"
