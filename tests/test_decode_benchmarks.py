"""The decode-loop benchmarks (benchmarks/bench_decode.py, benchmarks/profile_decode_host.py) run end
to end on tiny shapes on the CPU and write what the committed results are read from."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("flax", reason="the benchmarks build a jax_mla.nn model")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name, *argv):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", name), *argv], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]


def test_bench_decode_runs(tmp_path):
    out = tmp_path / "bench_decode.json"
    run_script("bench_decode.py", "--small", "--chain", "2", "--repeats", "1", "--host-steps", "4",
               "--steps-per-dispatch", "2", "--stream", "3", "--extra-batches", "2", "--json", str(out))
    res = json.loads(out.read_text())
    auto = res["results"]["auto"]
    assert auto["steps_per_dispatch"] == 2 and auto["host_plan_us"] > 0 and auto["loop_ms_per_step"] > 0
    assert auto["one_step_per_dispatch"]["host_breakdown"]["arguments"] > 0
    assert res["results"]["reference"]["logits_rel_err_vs_reference"] == 0.0
    assert auto["logits_rel_err_vs_reference"] < 2e-2  # bf16
    assert set(res["extra_batches"]) == {"batch2"}
    assert res["stream"]["admit"] == "arrival" and res["stream_longest_first"]["admit"] == "longest_first"
    assert res["stream"]["tokens"] == res["stream_longest_first"]["tokens"] > 0


def test_profile_decode_host_runs(tmp_path):
    out = tmp_path / "profile.json"
    run_script("profile_decode_host.py", "--batch", "2", "--context", "64", "--layers", "1", "--steps", "2",
               "--top", "3", "--json", str(out))
    res = json.loads(out.read_text())
    assert res["step_dispatch_us"] > 0 and res["noop_arguments"] > 0 and res["device_put_us"] > 0
