"""benchmarks/call_anatomy.py's split of a chain's kernel timestamps (no GPU: synthetic traces)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import call_anatomy  # noqa: E402


def test_per_call_splits_kernels_gaps_and_spans():
    # two chains of 3 calls: attention 10 us, merge 2 us starting 8 us in, next attention 1 us after the merge
    kernels = []
    for chain, t0 in enumerate((0.0, 1000.0)):
        t = t0
        for _ in range(3):
            kernels += [("attn", t, 10.0), ("merge", t + 8.0, 3.0 + chain)]
            t += 12.0 + chain
    rec = call_anatomy.per_call(sorted(kernels, key=lambda k: k[1]), lambda n: n == "attn", 3)
    assert rec["main_kernels"] == 6 and rec["other_kernels"] == 6
    assert rec["main_us"] == 10.0
    assert rec["other_us"] == pytest.approx(3.5)
    assert rec["gap_us"] == pytest.approx(2.5)  # 2.0 in the first chain, 3.0 in the second
    # span: first attention start to the last kernel's end, over the calls: (2 * 12 + 11) / 3, (2 * 13 + 12) / 3
    assert rec["span_us"] == pytest.approx(((24 + 11) / 3 + (26 + 12) / 3) / 2)


def test_parse_shape():
    assert call_anatomy.parse_shape("128x4096h128q1") == (128, 4096, 128, 1)
    with pytest.raises(ValueError, match="128x4096h128q1"):
        call_anatomy.parse_shape("128x4096")


def test_ours_runs_end_to_end():
    # The script's JAX path end to end (inputs, plan, jitted chain, profiler trace, split). On the CPU no CUDA
    # kernel is in the trace, so nothing is timed; on a GPU every call's attention kernel is.
    import jax
    rec = call_anatomy.run_ours((2, 128, 16, 1), calls=2, reps=1, power_s=0)
    assert "MLAPlan" in rec["plan"]
    if jax.default_backend() == "gpu":
        assert rec["burst"]["main_kernels"] == 2 and rec["burst"]["main_us"] > 0
    else:
        assert rec["burst"]["main_kernels"] == 0 and rec["burst"]["main_us"] is None
    # --min-work-units: the plan's work-table bucket (a plan the launch walks at 64+ heads)
    walked = call_anatomy.run_ours((2, 128, 64, 1), calls=1, reps=1, power_s=0, min_work_units=512)
    assert "/512," in walked["plan"]


def test_flashmla_inputs_cycle_as_many_cache_copies_as_ours(bench_attention):
    # The torch-only FlashMLA side keeps its own copy of the benchmark's constants; they must not drift apart.
    assert call_anatomy.L2_BYTES == bench_attention.L2_BYTES
    assert (call_anatomy.D_CKV, call_anatomy.D_KPE) == (bench_attention.D_CKV, bench_attention.D_KPE)


def test_trace_keeps_only_the_devices_timelines(bench_attention, tmp_path, capsys):
    # A trace with a device process and a host process, both holding an event named after our attention kernel:
    # only the device's counts. A trace that names no device process (the CPU backend) keeps every event.
    import gzip
    import json
    name = "void jax_mla::cuda::mla_attention_sm90_kernel<...>"
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    events = [{"ph": "X", "name": name, "pid": 1, "tid": 7, "ts": 10.0, "dur": 250.0},
              {"ph": "X", "name": name, "pid": 2, "tid": 3, "ts": 5.0, "dur": 1.1}]
    for sub, trace in (("both", meta + events), ("host_only", meta[1:] + events)):
        d = tmp_path / sub / "plugins" / "profile" / "run"
        d.mkdir(parents=True)
        with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
            json.dump({"traceEvents": trace}, f)
        kept = bench_attention._trace_kernels(str(tmp_path / sub))
        assert [e["dur"] for e in kept] == ([250.0] if sub == "both" else [250.0, 1.1])
        said = capsys.readouterr().out
        assert ("1 in /host:CPU" in said) == (sub == "both")
