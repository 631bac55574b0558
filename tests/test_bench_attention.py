"""benchmarks/bench_attention.py without a GPU: `--replot` draws a saved run's roofline from its JSON alone."""

import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"


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
