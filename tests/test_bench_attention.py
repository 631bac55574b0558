"""benchmarks/bench_attention.py's fp8 rows on the CPU handler: a tiny fp8 shape timed with and without the
op's fp8_products option, its errors against the dequantized reference, and the fp8 table's two rows. Also
`--replot`, which draws a saved run's roofline from its JSON alone."""

import json
import pathlib

import jax

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"


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
        assert rec["shape"] == "2x100 h64 ps32 q1"  # the name tools/jax_ab_report.py's rows go by
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


def test_replot_passes_the_saved_records_and_ceilings(bench_attention, monkeypatch, tmp_path):
    """The plot's inputs come back from the JSON as the run had them: drawn-length specs as tuples (the
    labels' `U[lo,hi]`), the copy ceiling in B/s and the matmul rate in FLOP/s."""
    drawn = {}
    monkeypatch.setattr(bench_attention, "roofline",
                        lambda records, copy_bps, peak, path: drawn.update(records=records, copy_bps=copy_bps,
                                                                           peak=peak, path=path))
    rec = dict(batch=48, kv_len=("U", 1, 8192, 7), heads=32, page_size=64, q_len=1, flops=1.0, bytes=2.0,
               ours_us=3.0)
    run = tmp_path / "run.json"
    run.write_text(json.dumps(dict(meta=dict(copy_ceiling_GBps=4154.0, matmul_TFLOPs=766.0), records=[rec])))
    bench_attention.replot(str(run), str(tmp_path / "roofline.png"))
    assert drawn["records"][0]["kv_len"] == ("U", 1, 8192, 7) and drawn["records"][0]["q_len"] == 1
    assert drawn["copy_bps"] == 4154e9 and drawn["peak"] == 766e12
    assert drawn["path"] == str(tmp_path / "roofline.png")
    assert bench_attention.shape_name((48, drawn["records"][0]["kv_len"], 32, 64, 1)) == "48xU[1,8192] h32 ps64 q1"


def test_replot_reads_the_committed_run(bench_attention, monkeypatch, tmp_path):
    """The committed `h200.json` replots: every record, each ragged one with its spec as a tuple."""
    drawn = {}
    monkeypatch.setattr(bench_attention, "roofline", lambda records, *a: drawn.update(records=records))
    bench_attention.replot(str(RESULTS / "h200.json"), str(tmp_path / "roofline.png"))
    committed = json.loads((RESULTS / "h200.json").read_text())["records"]
    assert len(drawn["records"]) == len(committed) > 0
    ragged = [r for r in drawn["records"] if not isinstance(r["kv_len"], int)]
    assert ragged and all(isinstance(r["kv_len"], tuple) and r["kv_len"][0] == "U" for r in ragged)


def test_every_attention_kernel_of_the_cuda_sources_is_timed_as_ours(bench_attention):
    """The device time sums the kernels our_kernel names; one it misses makes its rows fall back to wall time,
    as the walk kernel's did when it became the default (forty-first session)."""
    import re

    sources = pathlib.Path(__file__).resolve().parents[1] / "ffi" / "cuda"
    text = "\n".join(p.read_text() for p in sorted(sources.glob("*.cu*")))
    names = set(re.findall(r"__global__\b[^;{]*?\b(mla_\w*kernel)\s*\(", text))
    assert {"mla_attention_kernel", "mla_attention_wide64_walk_kernel", "mla_merge_kernel"} <= names, names
    for name in names:
        # as a trace names it: demangled, with the template arguments and parameters
        traced = f"void jax_mla::cuda::{name}<__nv_bfloat16>(jax_mla::cuda::Problem)"
        want = "merge" if "merge" in name else "attention"
        assert bench_attention.our_kernel(traced) == want, name
    assert bench_attention.our_kernel("void flash::mla_combine_kernel<cutlass::bfloat16_t>()") is None
    assert bench_attention.our_kernel("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN") is None


def test_jax_ab_report_tables_rounds_medians_and_ratios(tmp_path):
    """tools/jax_ab_report.py (scripts/jax_ab.sh's table) keys rows by the benchmark's shape names, takes each
    variant's median over its rounds and marks wall-clock times."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "jax_ab_report", pathlib.Path(__file__).resolve().parents[1] / "tools" / "jax_ab_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    fixed = dict(shape="128x4096 h128 ps64 q1", kv_dtype="bfloat16")
    ragged = dict(shape="64xU[500,16384] h20 ps64 qU[1,3]", kv_dtype="bfloat16")
    assert report.shape_key(dict(fixed, kv_dtype="float8_e4m3fn", fp8_products=True)) == \
        "128x4096 h128 ps64 q1 float8_e4m3fn fp8_products"
    times = {("a", 1): (260.0, 80.0), ("a", 2): (262.0, 82.0), ("a", 3): (261.0, 90.0),
             ("b", 1): (250.0, 88.0), ("b", 2): (254.0, 86.0), ("b", 3): (252.0, 84.0)}
    for (name, r), (t_fixed, t_ragged) in times.items():
        d = tmp_path / f"r{r}_{name}"
        d.mkdir()
        recs = [dict(fixed, ours_us=t_fixed, ours_timing="device"),
                dict(ragged, ours_us=t_ragged, ours_timing="wall" if (name, r) == ("b", 2) else "device")]
        (d / "h200.json").write_text(json.dumps({"records": recs}))
    (tmp_path / "r1_c").mkdir()  # a variant not asked for is left out
    lines = report.table(report.collect(tmp_path, ["a", "b"]), ["a", "b"]).splitlines()
    assert lines[0] == "| shape | a: rounds, us | a median | b: rounds, us | b median | b / a |"
    assert lines[2] == "| 128x4096 h128 ps64 q1 | 260.0, 262.0, 261.0 | 261.0 | 250.0, 254.0, 252.0 | 252.0 | 0.966 |"
    assert lines[3] == "| 64xU[500,16384] h20 ps64 qU[1,3] | 80.0, 82.0, 90.0 | 82.0 | 88.0, 86.0w, 84.0 | 86.0 | 1.049 |"
