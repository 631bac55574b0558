"""The planner's unit-cost benchmark (benchmarks/bench_unit_overhead.py) runs end to end on tiny ragged
batches on the CPU and writes its JSON."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_unit_overhead_runs(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_unit_overhead.py"), "--small",
                        "--overheads", "0", "4096", "--rounds", "2", "--calls", "2", "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    res = json.loads((tmp_path / "unit_overhead.json").read_text())
    assert res["overheads"] == [0, 4096] and res["rounds"] == 2 and "--small" in res["command"]
    assert len(res["records"]) == 2
    for rec in res["records"]:
        assert rec["us"]["0"] > 0 and len(rec["rounds"]["0"]) == 2
        if 4096 in rec["same_plan_as_first"]:
            assert rec["us"]["4096"] is None
        else:
            assert rec["us"]["4096"] > 0 and len(rec["rounds"]["4096"]) == 2
        assert set(rec["plans"]) == {"0", "4096"} and all(p.startswith("MLAPlan(") for p in rec["plans"].values())
