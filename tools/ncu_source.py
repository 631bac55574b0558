"""Where a kernel's warps stall, from Nsight Compute's source page (SASS, with stall samples).

Reads the CSV that `ncu -i REPORT --page source --csv --print-source sass` writes (gzipped or not;
scripts/ncu_peer.sh makes them for our kernel and FlashMLA's) and prints one of:

    python3 tools/ncu_source.py ops FILE             # stall samples by opcode
    python3 tools/ncu_source.py top FILE [--min N] [--match REGEX]   # instructions, top reasons
    python3 tools/ncu_source.py waits FILE           # mbarrier wait sites (try-wait) and their samples
    python3 tools/ncu_source.py phases FILE [--lo HEX --hi HEX] [--min N]
        # samples between phase marks (wgmma of S or PV, wgmma waits, mbarrier and named-barrier waits)
    python3 tools/ncu_source.py warps FILE           # samples by how many times an instruction ran
        # (code one warp runs alone shows as 1/4 of the warpgroup's count)

Addresses are offsets from the kernel's first instruction, as tools/sass_size.py and nvdisasm print.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
PRED = re.compile(r"^@!?U?P\w+\s+")


def load(path: str) -> list[dict]:
    raw = gzip.open(path, "rb").read() if path.endswith(".gz") else open(path, "rb").read()
    rows = list(csv.reader(io.StringIO(raw.decode("utf-8", "replace"))))
    header_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr = rows[header_at]
    data = [dict(zip(hdr, r)) for r in rows[header_at + 1:] if len(r) == len(hdr)]
    base = int(data[0]["Address"], 16)
    for d in data:
        d["off"] = int(d["Address"], 16) - base
        d["n"] = int(d[SAMPLES] or 0)
        d["ran"] = int(d["Instructions Executed"] or 0)
        d["src"] = d["Source"].strip()
        d["op"] = (PRED.sub("", d["src"]).split() or ["?"])[0]
    return data


def reasons(d: dict, k: int = 3) -> str:
    """The instruction's top stall reasons. The source page has no column for some (warpgroup arrive:
    a wgmma waiting for the other warps of its warpgroup); their samples show as `other`."""
    cols = [(int(v or 0), c[6:]) for c, v in d.items() if c.startswith("stall_") and "Not Issued" not in c]
    other = d["n"] - sum(n for n, _ in cols)
    if other > 0:
        cols.append((other, "other"))
    return ", ".join(f"{name} {n}" for n, name in sorted(cols, reverse=True)[:k] if n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("ops", "top", "waits", "phases", "warps"))
    ap.add_argument("file")
    ap.add_argument("--min", type=int, default=100, help="smallest sample count shown (top, phases)")
    ap.add_argument("--match", default=".", help="regex on the instruction (top)")
    ap.add_argument("--lo", default="0", help="first address, hex (phases)")
    ap.add_argument("--hi", default="ffffffff", help="end address, hex (phases)")
    a = ap.parse_args()
    data = load(a.file)
    total = sum(d["n"] for d in data)
    print(f"{a.file}: {len(data)} instructions, {total} stall samples")
    if a.what == "ops":
        by = collections.Counter()
        for d in data:
            by[d["op"]] += d["n"]
        for op, n in by.most_common(20):
            print(f"{op:32s} {n:7d} {100 * n / total:5.1f}%")
    elif a.what == "top":
        for d in data:
            if d["n"] >= a.min and re.search(a.match, d["src"]):
                print(f"{d['off']:6x} {d['n']:6d} ran {d['ran']:7d}  {d['src'][:72]:72s} {reasons(d)}")
    elif a.what == "waits":
        for i, d in enumerate(data):
            if "TRYWAIT" in d["src"] and d["ran"]:
                # the wait, its branch to the retry loop and the instructions up to the next few
                n = sum(x["n"] for x in data[max(0, i - 2):i + 6])
                print(f"{d['off']:6x} {n:6d} ran {d['ran']:7d}  {d['src'][:80]}")
    elif a.what == "phases":
        lo, hi = int(a.lo, 16), int(a.hi, 16)
        marks = (("PV", "HGMMA.64x256"), ("S", "HGMMA.64x64"), ("wgmma wait", "WARPGROUP.DEPBAR"),
                 ("mbarrier wait", "TRYWAIT"), ("named barrier", "BAR.SYNC"), ("named barrier", "BAR.ARV"))
        start, kind, acc = 0, "start", 0
        for d in data:
            mark = next((name for name, key in marks if key in d["src"]), None)
            if mark and mark != kind:
                if lo <= start < hi and acc >= a.min:
                    print(f"{start:6x}-{d['off']:6x} after {kind:14s} {acc:6d}")
                start, kind, acc = d["off"], mark, 0
            acc += d["n"]
    elif a.what == "warps":
        by, count = collections.Counter(), collections.Counter()
        for d in data:
            by[d["ran"]] += d["n"]
            count[d["ran"]] += 1
        for ran, n in by.most_common(12):
            print(f"ran {ran:8d} times: {count[ran]:5d} instructions, {n:6d} samples")


if __name__ == "__main__":
    main()
