"""Reads the timeline of a body (the 64-key wide body, the opt-in fp8 narrow body) that a JAX_MLA_TRACE driver prints.

Build the standalone driver with the trace and time one case (on the GPU machine):

    bash scripts/build_driver.sh /tmp/trace -DJAX_MLA_TRACE
    /tmp/trace --time /tmp/cases/time1_128x4096_h128_ps64.bin > trace.log
    python3 tools/trace_report.py trace.log [--pairs 4 28]

or let `TRACE_CASES="wide/time1_128x4096_h128_ps64" bash scripts/driver_ab.sh` do all three for every variant.

The driver prints, for each traced warp (lane 0 of warps 0 and 3 of each warpgroup, in two
blocks), clock64 stamps at fixed points of the body (ffi/cuda/mla_common.cuh, JAX_MLA_TRACE_AT):
row 0 is the prologue and the epilogue, row 1 + n trip n of the loop (a pair of blocks in the
wide body, a warpgroup's block in the narrow one); it does so for a launch after another attention
launch (CASE) and for one after an op's merge kernel (CASE@merge). This prints the prologue's and
epilogue's marks and, over the trips asked for, the period and the median cycles between
consecutive marks: where a warp waits, and for what. --first N also prints the first N trips' marks
from the warp's start (a cold start shows there).
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics

# The marks of a pair, in program order (JAX_MLA_TRACE_AT(pair + 1, i) in mla_wide64_sm90.cuh). A trip's S
# is left in flight at its end ("trip end", just after its issue) and waited for where the next trip first
# reads it: within "top -> m_A signalled" in WG0, "m_A received -> m_B signalled" in WG1.
PAIR_MARKS = {
    0: ["top", "m_A signalled", "PV_A issue", "PV_A done", "A 0-3 refilled", "m_B received", "P_A signalled",
        "P_B received", "PV_B + S 0-3 issued", "PV_B done", "S 4-8 issued", "trip end"],
    1: ["top", "m_A received", "m_B signalled", "P_B signalled", "PV_B issued", "P_A received", "PV_B done",
        "B 4-8 refilled", "PV_A done", "A 4-8 refilled", "S issued", "trip end"],
}
# The same body's default schedule, P_A first (body id 3; id 1 is -DJAX_MLA_WIDE64_NO_PA_FIRST's): P_A comes right
# after m_A, WG1 issues P_A V_A before its softmax of block B, P_B goes with m_B.
PAIR_MARKS_PA_FIRST = {
    0: ["top", "m_A signalled", "PV_A issue", "PV_A done", "A 0-3 refilled", "m_B + P_B received",
        "O_L rescaled", "(as before)", "PV_B + S 0-3 issued", "PV_B done", "S 4-8 issued", "trip end"],
    1: ["top", "m_A received", "PV_A issued", "m_B + P_B signalled", "PV_A done", "PV_B issued",
        "A 4-8 refilled", "PV_B done", "B 4-8 refilled", "(as before)", "S issued", "trip end"],
}
# Row 0's marks in the order the driver prints them (events 0-5, then 8-10; 6-7 are globaltimer).
PROLOGUE_MARKS = ["start", "queries issued", "queries landed", "first S done", "loop end", "stored", "set up",
                  "page ids issued"]
# The opt-in fp8 narrow body (ffi/cuda/mla_narrow_fp8_sm90.cuh): the same for every warp.
NARROW_FP8_MARKS = ["top", "block landed", "S done", "maxima shared", "P in panel", "P V done"]
NARROW_FP8_PROLOGUE = ["start", "page ids landed", "queries landed", "panels built", "loop end", "stored"]
# Row 0's event 11 (mla_common.cuh: kTraceWide64, kTraceNarrowFp8, kTraceWide64PaFirst).
BODY_WIDE64, BODY_NARROW_FP8, BODY_WIDE64_PA_FIRST = 1, 2, 3
WIDE64_BODIES = {BODY_WIDE64: PAIR_MARKS, BODY_WIDE64_PA_FIRST: PAIR_MARKS_PA_FIRST}

LINE = re.compile(r"trace (\S+) slot (\d+) row (\d+): (.*)")
TIMER = re.compile(r"trace (\S+) slot (\d+) globaltimer (-?\d+) (-?\d+)(?: body (-?\d+))?")


def read(lines):
    """{(case, slot): {row: [stamps]}} and {(case, slot): (start ns, end ns, body)}."""
    rows, timers = collections.defaultdict(dict), {}
    for line in lines:
        if m := LINE.match(line):
            rows[(m.group(1), int(m.group(2)))][int(m.group(3))] = [int(x) for x in m.group(4).split()]
        elif m := TIMER.match(line):
            body = int(m.group(5)) if m.group(5) is not None else BODY_WIDE64  # (older drivers: wide only)
            timers[(m.group(1), int(m.group(2)))] = (int(m.group(3)), int(m.group(4)), body)
    return rows, timers


def slot_warp(slot: int) -> tuple[int, int]:
    """The warpgroup and the warp a slot traces (lane 0 of warps 0 and 3 of each warpgroup)."""
    return (slot // 2) % 2, 3 if slot % 2 else 0


def slot_name(slot: int) -> str:
    wg, warp = slot_warp(slot)
    return f"block {'0' if slot < 4 else 'B'}, WG{wg}, warp {warp}"


def report(rows, timers, first_pair: int, last_pair: int, first: int = 0) -> list[str]:
    out = []
    for (case, slot), r in sorted(rows.items()):
        start, end, body = timers.get((case, slot), (0, 0, BODY_WIDE64))
        if body not in (BODY_NARROW_FP8, *WIDE64_BODIES):
            continue  # a slot no traced body wrote (e.g. a block that does not exist)
        narrow = body == BODY_NARROW_FP8
        marks = NARROW_FP8_MARKS if narrow else WIDE64_BODIES[body][slot_warp(slot)[0]]
        pro = dict(zip(NARROW_FP8_PROLOGUE if narrow else PROLOGUE_MARKS, r.get(0, [])))
        out.append(f"{case} slot {slot} ({slot_name(slot)}): "
                   + " ".join(f"{k} {v}" for k, v in pro.items()) + f" | {end - start} ns")
        for n in range(first):
            if n + 1 in r and r[n + 1][0] > 0:
                out.append(f"   trip {n}: " + " ".join(f"{k} {v}" for k, v in zip(marks, r[n + 1])))
        pairs = [n for n in range(first_pair, last_pair)
                 if n + 1 in r and n + 2 in r and r[n + 1][0] > 0 and r[n + 2][0] > 0]
        if not pairs:
            continue
        period = statistics.median(r[n + 2][0] - r[n + 1][0] for n in pairs)
        out.append(f"   {'trip' if narrow else 'pair'} period {period:.0f} cycles (median over trips {pairs[0]}..{pairs[-1]})")
        for i in range(1, len(marks)):
            d = statistics.median(r[n + 1][i] - r[n + 1][i - 1] for n in pairs)
            out.append(f"   {marks[i - 1]:>22} -> {marks[i]:<22} {d:7.0f}")
        d = statistics.median(r[n + 2][0] - r[n + 1][-1] for n in pairs)
        out.append(f"   {marks[-1]:>22} -> {'next top':<22} {d:7.0f}")
    out += walk_boundaries(rows, timers)
    return out


def walk_boundaries(rows, timers) -> list[str]:
    """A walk's trace (a -DJAX_MLA_TRACE -DJAX_MLA_WIDE64_WALK driver) holds block 0's first unit in slots 0-3
    and its second in slots 4-7, which then starts after the first has ended (in a trace of waves, the
    default, block B runs beside block 0): the boundary from the first unit's loop end to the second's first S, for
    each traced warp."""
    out = []
    for (case, slot), r in sorted(rows.items()):
        if slot < 4 or (case, slot - 4) not in rows:
            continue
        start, _, body = timers.get((case, slot), (0, 0, 0))
        _, end_before, _ = timers.get((case, slot - 4), (0, 0, 0))
        first = dict(zip(PROLOGUE_MARKS, rows[(case, slot - 4)].get(0, [])))
        second = dict(zip(PROLOGUE_MARKS, r.get(0, [])))
        if body not in WIDE64_BODIES or not end_before or start < end_before:
            continue
        wg, warp = slot_warp(slot)
        out.append(f"{case} walk boundary, WG{wg} warp {warp}: loop end -> stored "
                   f"{first['stored'] - first['loop end']} cycles, then {start - end_before} ns to the next "
                   f"unit's start, then {second['first S done']} cycles to its first S done")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log")
    ap.add_argument("--pairs", nargs=2, type=int, default=(4, 28), metavar=("FIRST", "LAST"),
                    help="trips (pairs) whose intervals are summarised (steady state: past the first few)")
    ap.add_argument("--first", type=int, default=0, metavar="N",
                    help="also print the first N trips' marks, in cycles from the warp's start")
    args = ap.parse_args()
    with open(args.log) as f:
        rows, timers = read(f)
    print("\n".join(report(rows, timers, *args.pairs, first=args.first)))


if __name__ == "__main__":
    main()
