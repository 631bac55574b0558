"""Reads where every block of one op call ran, as a JAX_MLA_BLOCK_TRACE driver prints it.

Build the standalone driver with the block trace and time cases (on the GPU machine):

    bash scripts/build_driver.sh /tmp/bt -DJAX_MLA_BLOCK_TRACE
    /tmp/bt --time /tmp/cases/time*.bin > bt.log
    python3 tools/block_trace_report.py bt.log

or let `BLOCK_TRACE=1 bash scripts/driver_ab.sh` do all three for every variant on its timed cases.

The driver prints, per case, every attention and merge block's SM and globaltimer start and end (ns
from the first attention block's start; mla_common.cuh, BlockTraceScope) and the work table. This
prints, per case:
- the attention kernel's span, the merge's tail after it, and how busy the SMs were in between;
- a least-squares fit of a block's time against its keys, per body (<= 16 rows: narrow, else wide):
  the per-key cost and the fixed cost per block (also in keys: the planner's `unit_overhead`);
- the blocks that ended last, i.e. what set the span.
"""

from __future__ import annotations

import argparse
import collections
import re

import numpy as np

HEADER = re.compile(r"blocktrace (\S+) sms (\d+) heads (\d+) head_blocks (\d+) work (\d+) merge_grid (\d+)")
BLOCK = re.compile(r"blocktrace (\S+) kind (\d) block (\d+) sm (\d+) start (-?\d+) end (-?\d+)")
WORK = re.compile(r"blockwork (\S+) unit (\d+): (.*)")
KV = re.compile(r"blockkv (\S+):(.*)")
# Work-table columns (ffi/include/jax_mla/plan_layout.h); a unit's KV_END may be kKvEndOpen (its
# request's end).
REQUEST, Q_START, Q_LEN, Q_END_OFFSET, KV_START, KV_END, PARTIAL_ROW = range(7)


def read(lines):
    """Cases by name: sms, heads, head_blocks, blocks [attention, merge] as (block, sm, start, end) in ns,
    work {unit: row}, kv (the requests' lengths)."""
    cases = collections.defaultdict(lambda: {"blocks": [[], []], "work": {}, "kv": []})
    for line in lines:
        if m := HEADER.search(line):
            c = cases[m.group(1)]
            c["sms"], c["heads"], c["head_blocks"] = int(m.group(2)), int(m.group(3)), int(m.group(4))
        elif m := BLOCK.search(line):
            cases[m.group(1)]["blocks"][int(m.group(2))].append(tuple(int(m.group(i)) for i in range(3, 7)))
        elif m := WORK.search(line):
            cases[m.group(1)]["work"][int(m.group(2))] = [int(x) for x in m.group(3).split()]
        elif m := KV.search(line):
            cases[m.group(1)]["kv"] = [int(x) for x in m.group(2).split()]
    return cases


def unit_blocks(c):
    """The attention blocks that ran a unit (not padding), each (block, sm, start, end, keys, body, split)."""
    hb, kv, rows_per_block = c["head_blocks"], c["kv"], min(c["heads"], 64)
    out = []
    for block, sm, t0, t1 in c["blocks"][0]:
        w = c["work"].get(block // hb)
        if w is None or w[Q_LEN] <= 0:
            continue
        kv_len = kv[w[REQUEST]] if 0 <= w[REQUEST] < len(kv) else w[KV_END]
        keys = max(0, min(w[KV_END], kv_len) - w[KV_START])
        body = "narrow" if w[Q_LEN] * rows_per_block <= 16 else "wide"
        out.append((block, sm, t0, t1, keys, body, w[PARTIAL_ROW] >= 0))
    return out


def fit(keys, us):
    """Least squares us = fixed + per_key * keys: (per_key, fixed, residual rms)."""
    a = np.vstack([np.ones_like(keys), keys]).T
    (fixed, per_key), *_ = np.linalg.lstsq(a, us, rcond=None)
    return per_key, fixed, float(np.sqrt(np.mean((us - a @ np.array([fixed, per_key])) ** 2)))


def report(name, c, last=6):
    """The lines printed for one case."""
    units = unit_blocks(c)
    if not units:
        return [f"== {name}: no unit's block traced"]
    start = min(u[2] for u in units)
    end = max(b[3] for b in c["blocks"][0])
    span = end - start
    merge_end = max((b[3] for b in c["blocks"][1]), default=end)
    per_sm = collections.defaultdict(list)
    for u in units:
        per_sm[u[1]].append(u)
    busy = sum(u[3] - u[2] for u in units)
    sms = c["sms"]
    out = [f"== {name}: {len(units)} unit blocks on {len(per_sm)} of {sms} SMs; attention span {span / 1000:.1f} us, "
           f"merge tail {(merge_end - end) / 1000:.1f} us; SMs busy {busy / (sms * span):.1%} of the span"]
    finishes = sorted(max(u[3] for u in v) for v in per_sm.values())
    q = lambda f: finishes[min(len(finishes) - 1, int(f * len(finishes)))] / 1000.0
    counts = [len(v) for v in per_sm.values()]
    out.append(f"   SMs' last unit ends (us): first {finishes[0] / 1000:.1f}, 10% {q(0.1):.1f}, median {q(0.5):.1f}, "
               f"90% {q(0.9):.1f}, last {finishes[-1] / 1000:.1f}; units per SM {min(counts)}-{max(counts)}")
    for body in ("narrow", "wide"):
        s = [u for u in units if u[5] == body]
        if len(s) < 3:
            continue
        keys = np.array([u[4] for u in s], float)
        us = np.array([(u[3] - u[2]) / 1000.0 for u in s])
        if np.ptp(keys) == 0:
            out.append(f"   {body}: {len(s)} blocks of {int(keys[0])} keys, {np.median(us):.2f} us median "
                       f"({us.min():.2f}-{us.max():.2f})")
            continue
        per_key, fixed, rms = fit(keys, us)
        out.append(f"   {body}: {len(s)} blocks, {per_key * 1000:.2f} ns a key + {fixed:.2f} us a block "
                   f"(= {fixed / per_key:.0f} keys); residual rms {rms:.2f} us; {sum(u[6] for u in s)} split")
    for block, sm, t0, t1, keys, body, split in sorted(units, key=lambda u: -u[3])[:last]:
        out.append(f"   ended late: block {block} ({body}, {keys} keys{', split' if split else ''}) on SM {sm}: "
                   f"{t0 / 1000:.1f} -> {t1 / 1000:.1f} us; SM {sm} ran {len(per_sm[sm])} units")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--last", type=int, default=6, help="list this many of the last-ending blocks")
    args = ap.parse_args()
    with open(args.log) as f:
        cases = read(f)
    for name, c in cases.items():
        print("\n".join(report(name, c, args.last)))


if __name__ == "__main__":
    main()
