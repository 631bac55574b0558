"""benchmarks/gpu_power.py (bench_attention.py --power): the summary of nvidia-smi's samples, and the
sampling loop against a stand-in nvidia-smi on the PATH (this machine has no GPU)."""

import datetime
import importlib.util
import os
import pathlib
import stat

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _gpu_power():
    spec = importlib.util.spec_from_file_location("gpu_power", ROOT / "benchmarks" / "gpu_power.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stamp(t):
    return datetime.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def test_summary_keeps_the_window_and_reads_the_reason_bits():
    gp = _gpu_power()
    t = 1_700_000_000.0
    lines = [
        f"{_stamp(t - 1.0)}, 1980, 300.0, 0x0000000000000000",  # before the window
        f"{_stamp(t + 0.02)}, 1935, 694.0, 0x0000000000000004",  # software power cap
        f"{_stamp(t + 0.04)}, 1545, 704.0, 0x0000000000000004",
        f"{_stamp(t + 0.06)}, 1980, 650.0, 0x0000000000000000",
        f"{_stamp(t + 0.08)}, 1700, 698.0, 0x0000000000000044",  # power cap and hardware thermal
        f"{_stamp(t + 0.10)}, [N/A], 690.0, 0x0000000000000004",  # unreadable: skipped
        f"{_stamp(t + 0.12)}, 1800",  # a partial line
        f"{_stamp(t + 5.0)}, 1980, 100.0, 0x0000000000000000",  # after the window
    ]
    s = gp.summarize(lines, t, t + 1.0)
    assert s["samples"] == 4
    assert s["power_W_median"] == 696.0 and s["power_W_max"] == 704.0
    assert s["sm_MHz_median"] == (1700 + 1935) / 2 and s["sm_MHz_min"] == 1545
    assert s["power_capped_fraction"] == 0.75 and s["other_slowdown_fraction"] == 0.25
    assert gp.summarize(lines, t + 2.0, t + 3.0) is None


def test_sampling_without_nvidia_smi_runs_nothing(monkeypatch):
    gp = _gpu_power()
    monkeypatch.setenv("PATH", "/nonexistent")
    calls = []
    assert gp.sample_back_to_back(lambda: calls.append(1), lambda x: None, 0.2) is None
    assert not calls


def test_sampling_reads_a_stand_in_nvidia_smi(tmp_path, monkeypatch):
    """A script that prints what `nvidia-smi --query-gpu=... -lms 20` prints (now's timestamp, 1800 MHz,
    699.5 W, the power cap bit) stands in for nvidia-smi; the step runs and every sample is summarised."""
    gp = _gpu_power()
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n"
                    "while true; do\n"
                    "  echo \"$(date +'%Y/%m/%d %H:%M:%S.%3N'), 1800, 699.5, 0x0000000000000004\"\n"
                    "  sleep 0.02\n"
                    "done\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    calls, synced = [], []
    s = gp.sample_back_to_back(lambda: calls.append(1) or len(calls), synced.append, 0.8, settle=0.1,
                               cooldown=0)
    assert calls and synced and synced[-1] == len(calls)
    assert s is not None and s["samples"] >= 5, s
    assert s["power_W_median"] == 699.5 and s["sm_MHz_min"] == 1800 and s["power_capped_fraction"] == 1.0


def test_power_table_has_a_column_per_peer_sampled(bench_attention):
    """bench_attention.power_table: ours and every peer with a power summary get a column; shapes without
    one read "-"; no summary anywhere, no table."""
    bench = bench_attention
    p = lambda w, mhz, cap: dict(power_W_median=w, sm_MHz_median=mhz, power_capped_fraction=cap)
    shape = dict(batch=128, kv_len=4096, heads=128, page_size=64, q_len=1)
    recs = [dict(shape, power=p(692, 1635, 1.0), flashmla_power=p(691.5, 1500, 1.0)),
            dict(shape, heads=16, power=p(693, 1965, 0.79))]
    lines = bench.power_table(recs).strip().splitlines()
    assert lines[-4] == "| shape | ours | FlashMLA |"
    assert lines[-2] == "| 128x4096 h128 ps64 q1 | 692 W, 1635 MHz, 100% | 692 W, 1500 MHz, 100% |"
    assert lines[-1] == "| 128x4096 h16 ps64 q1 | 693 W, 1965 MHz, 79% | - |"
    assert bench.power_table([dict(shape)]) == ""
