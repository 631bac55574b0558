"""benchmarks/bench_attention.py's fp8 rows on the CPU handler: a tiny fp8 shape timed with and without the
op's fp8_products option, its errors against the dequantized reference, and the fp8 table's two rows."""

import jax


def test_fp8_products_apply_only_to_64_key_units(bench_attention):
    bench = bench_attention
    assert bench.fp8_products_apply((128, 4096, 128, 64, 1))
    assert bench.fp8_products_apply((128, 4096, 64, 32, 1))
    assert not bench.fp8_products_apply((128, 4096, 16, 64, 1))  # narrow units ignore the option
    assert not bench.fp8_products_apply((128, 4096, 128, 16, 1))  # pages under 32 keys: no 64-key body


def test_fp8_rows_run_with_and_without_fp8_products(bench_attention):
    bench = bench_attention
    shape = (2, 100, 64, 32, 1)
    copy_bps = 1e11
    recs = []
    for products in (False, True):
        rec = bench.bench_shape(shape, {}, copy_bps, kv_dtype=bench.FP8, fp8_products=products)
        assert rec["fp8_products"] is products and rec["kv_dtype"] == bench.FP8
        assert rec["ours_us"] > 0
        # the CPU handler computes exactly with or without the option (bf16 rounding of the output only);
        # on sm_90a the option's e4m3 products cost ~4e-2
        lossy = products and jax.default_backend() != "cpu"
        assert rec["rel_err_vs_dequantized_ref"] < (8e-2 if lossy else 5e-3)
        assert 1e-3 < rec["rel_err_vs_bf16_cache"] < 0.1  # what the e4m3 cache itself costs
        rec.update(bf16_us=2 * rec["ours_us"], speedup_vs_bf16=2.0, targets=[">= 1x bf16"], met=[True])
        recs.append(rec)
    lines = bench.fp8_table(recs).strip().splitlines()
    assert lines[-2].startswith("| 2x100 h64 ps32 q1 | ")
    assert lines[-1].startswith("| 2x100 h64 ps32 q1 fp8_products | ") and lines[-1].endswith("| >= 1x bf16 | yes |")
