"""The GPU's power draw and SM clock while a step runs back to back, sampled by nvidia-smi.

Why: run back to back, the fp8 narrow kernel held the H200 at its 700 W power cap, with the SM clock
below its maximum in most samples, where the bf16 kernel of the same shape did not
(ffi/cuda/NOTES.md, "the fp8 body at the power cap"). Its speed then depends on the energy a key
costs, not only on the bytes it moves. `bench_attention.py --power SECONDS` records this summary
beside each shape's time, so that a change's effect on power is measured in the same run.
"""

from __future__ import annotations

import datetime
import shutil
import statistics
import subprocess
import time

# What nvidia-smi is asked for, in this order, every PERIOD_MS.
QUERY = ("timestamp", "clocks.sm", "power.draw", "clocks_event_reasons.active")
PERIOD_MS = 20
# Bits of clocks_event_reasons.active (nvidia-smi --help-query-gpu): the software power cap, and the
# slowdowns that are not about power (thermal, power brake, hardware slowdown).
SW_POWER_CAP = 0x4
OTHER_SLOWDOWN = 0x8 | 0x20 | 0x40 | 0x80


def _timestamp(s: str) -> float:
    return datetime.datetime.strptime(s.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()


def summarize(lines, t0: float, t1: float) -> dict | None:
    """The samples of nvidia-smi's CSV lines (QUERY's columns, no header or units) taken in [t0, t1]:
    medians of power and SM clock, the lowest clock, and the fraction of samples with the software
    power cap (or another slowdown) active. None without a usable sample."""
    power, clock, capped, other = [], [], 0, 0
    for line in lines:
        cols = [c.strip() for c in line.split(",")]
        if len(cols) != len(QUERY):
            continue
        try:
            ts, mhz, watts, reasons = _timestamp(cols[0]), float(cols[1]), float(cols[2]), int(cols[3], 16)
        except ValueError:  # "[N/A]", a partial line
            continue
        if not t0 <= ts <= t1:
            continue
        power.append(watts)
        clock.append(mhz)
        capped += bool(reasons & SW_POWER_CAP)
        other += bool(reasons & OTHER_SLOWDOWN)
    if not power:
        return None
    n = len(power)
    return dict(samples=n, power_W_median=statistics.median(power), power_W_max=max(power),
                sm_MHz_median=statistics.median(clock), sm_MHz_min=min(clock),
                power_capped_fraction=capped / n, other_slowdown_fraction=other / n)


def sample_back_to_back(step, sync, seconds: float, settle: float = 0.3, cooldown: float = 1.0) -> dict | None:
    """Runs step() back to back for `seconds` (sync(result) every fourth call, so the queue stays
    short) while nvidia-smi samples the GPU; the summary of the samples after the first `settle`
    seconds (summarize), or None where nvidia-smi is missing or gave no sample. Then idles `cooldown`
    seconds, so that what is timed next does not start on a GPU just held at its power cap."""
    if seconds <= 0 or shutil.which("nvidia-smi") is None:
        return None
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(QUERY)}", "--format=csv,noheader,nounits",
                            "-lms", str(PERIOD_MS)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        time.sleep(0.2)  # nvidia-smi's first sample
        t0 = time.time()
        n, out = 0, None
        while time.time() - t0 < seconds:
            out = step()
            n += 1
            if n % 4 == 0:
                sync(out)
        sync(out)
        t1 = time.time()
    finally:
        smi.terminate()
    lines = smi.communicate(timeout=10)[0].splitlines()
    time.sleep(cooldown)
    return summarize(lines, t0 + settle, t1)
