"""How far a lossy e4m3 x e4m3 wide body would land from the float32 reference (issue 10's explicit
fp8 x fp8 option; ffi/cuda/NOTES.md, "The core of a lossy e4m3 x e4m3 wide body, probed").

Emulated in NumPy for one request of 128 heads over L keys of an e4m3 ckv (raw e4m3 values times a
per-tensor scale) and a bf16 kpe, as the kernel would compute it: the latent queries brought under
448 by a power of two per row and rounded to e4m3 (or kept exact), the rope queries in bf16 in the
same frame, S over all keys, then 64-key blocks with a running max, P = exp(s - m) times 2^8 rounded
to e4m3 (or kept exact), O += P V on the raw keys, the row sums from P before rounding, the output
rounded to bf16. The reference is float32 attention on the dequantized cache (the issue's measure).
Random data as the tests draw it, queries times `query scale` (sharper attention).

    .venv/bin/python tools/e4m3_lossy_error.py
    .venv/bin/python tools/e4m3_lossy_error.py --lse

--lse: the LSE's error instead, by the number of keys a row sees (one block, the row's own maximum), over
many rows: with few keys the LSE is close to one score, whose error from the e4m3 queries does not average
out (the bounds of tests/test_attention.py's FP8_PRODUCTS_LSE_* rest on it).
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
SCALE = 1 / np.sqrt(576)
CKV_SCALE = 0.05


def rounded(x, dtype):
    return x.astype(dtype).astype(np.float32)


def body_frame(q_nope, q_pe, top, queries_e4m3=True):
    """Queries in the body's frame: each row's latent part times 2^k (its largest magnitude brought under
    `top`) rounded to e4m3 (or kept exact), its rope part times 2^k / CKV_SCALE in bf16 (the latent part's
    frame). Returns (latent, rope, 2^k); scores in this frame are the true ones times 2^k / CKV_SCALE."""
    factor = 2.0 ** np.floor(np.log2(top / np.abs(q_nope).max(1, keepdims=True)))
    latent = rounded(q_nope * factor, E4M3) if queries_e4m3 else q_nope * factor
    return latent, rounded(q_pe * factor / CKV_SCALE, BF16), factor


def relative_error(rng, keys, query_scale, queries_e4m3, p_e4m3, heads=128, block=64):
    q_nope = rounded(rng.standard_normal((heads, 512)) * query_scale, BF16)
    q_pe = rounded(rng.standard_normal((heads, 64)) * query_scale, BF16)
    raw = rounded(rng.standard_normal((keys, 512)) / CKV_SCALE, E4M3)  # the cache's e4m3 values
    kpe = rounded(rng.standard_normal((keys, 64)), BF16)
    ckv = raw * CKV_SCALE

    s = (q_nope @ ckv.T + q_pe @ kpe.T) * SCALE
    p = np.exp(s - s.max(1, keepdims=True))
    ref = (p @ ckv) / p.sum(1, keepdims=True)

    q8, rope, factor = body_frame(q_nope, q_pe, 448.0, queries_e4m3)
    s = (q8 @ raw.T + rope @ kpe.T) * (SCALE * CKV_SCALE / factor)
    m = np.full((heads, 1), -np.inf)
    l = np.zeros((heads, 1))
    o = np.zeros((heads, 512))
    for k0 in range(0, keys, block):
        sb = s[:, k0:k0 + block]
        m_new = np.maximum(m, sb.max(1, keepdims=True))
        alpha = np.exp(m - m_new)
        pb = np.exp(sb - m_new)
        p8 = rounded(pb * 256.0, E4M3) if p_e4m3 else pb * 256.0
        l = l * alpha + pb.sum(1, keepdims=True)
        o = o * alpha + p8 @ raw[k0:k0 + block]
        m = m_new
    out = rounded(o / 256.0 * CKV_SCALE / l, BF16)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def lse_error(rng, keys, query_scale, rows=4000):
    """(rms, 99.9th percentile, max) over `rows` rows of |LSE - reference LSE| for rows that see `keys` keys
    of one block, each row its own random query and keys (natural log, as the op's LSE)."""
    q_nope = rounded(rng.standard_normal((rows, 512)) * query_scale, BF16)
    q_pe = rounded(rng.standard_normal((rows, 64)) * query_scale, BF16)
    raw = rounded(rng.standard_normal((rows, keys, 512)) / CKV_SCALE, E4M3)  # the cache's e4m3 values
    kpe = rounded(rng.standard_normal((rows, keys, 64)), BF16)

    def lse(s):
        m = s.max(1, keepdims=True)
        return (m + np.log(np.exp(s - m).sum(1, keepdims=True)))[:, 0]

    ref = lse((np.einsum("rd,rkd->rk", q_nope, raw * CKV_SCALE) + np.einsum("rd,rkd->rk", q_pe, kpe)) * SCALE)
    q8, rope, factor = body_frame(q_nope, q_pe, 256.0)  # the kernel's: under 2^8
    got = lse((np.einsum("rd,rkd->rk", q8, raw) + np.einsum("rd,rkd->rk", rope, kpe)) * (SCALE * CKV_SCALE / factor))
    d = np.abs(got - ref)
    return float(np.sqrt((d ** 2).mean())), float(np.quantile(d, 0.999)), float(d.max())


def main_lse():
    rng = np.random.default_rng(0)
    # query scale 2.16: the tests' sm_scale 0.09 (= 2.16 / sqrt(576)) on unit-variance queries and keys
    print("| keys a row sees | query scale | LSE error rms | 99.9th percentile | max (4000 rows) |")
    print("|---|---|---|---|---|")
    for query_scale in (1.0, 2.16):
        for keys in (1, 4, 16, 64):
            rms, p999, top = lse_error(rng, keys, query_scale)
            print(f"| {keys} | {query_scale} | {rms:.3f} | {p999:.3f} | {top:.3f} |")


def main():
    if "--lse" in sys.argv[1:]:
        main_lse()
        return
    rng = np.random.default_rng(0)
    cases = [("e4m3", "e4m3", True, True), ("e4m3", "exact", True, False), ("exact", "e4m3", False, True),
             ("exact", "exact", False, False)]
    print("| keys | query scale | queries | P | relative error (mean of 3 draws) |")
    print("|---|---|---|---|---|")
    for keys in (1000, 4096):
        for query_scale in (1.0, 3.0):
            for q_name, p_name, q8, p8 in cases:
                err = np.mean([relative_error(rng, keys, query_scale, q8, p8) for _ in range(3)])
                print(f"| {keys} | {query_scale} | {q_name} | {p_name} | {err:.2e} |")


if __name__ == "__main__":
    main()
