"""The table of an interleaved A/B through JAX (scripts/jax_ab.sh): for each shape, every variant's device time
per round (benchmarks/bench_attention.py's `ours_us`), its median, and the median against the first variant's.

    python3 tools/jax_ab_report.py RUNS_DIR NAME [NAME ...]

RUNS_DIR holds one directory per run, `r<round>_<name>`, each with the benchmark's JSON (`h200.json`, whatever
the device), whose records carry their shape's name (`shape`, written by bench_attention.py since this tool
came). A time the benchmark took from the wall clock (no device trace) is marked "w": it is not comparable
with device times.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import statistics


def shape_key(rec) -> str:
    """A record's row: the shape's name as the benchmark wrote it, and the cache dtype where it is not bf16
    (an fp8 run of a shape is another row than its bf16 one)."""
    if rec.get("kv_dtype", "bfloat16") == "bfloat16":
        return rec["shape"]
    return f"{rec['shape']} {rec['kv_dtype']}" + (" fp8_products" if rec.get("fp8_products") else "")


def collect(runs: pathlib.Path, names):
    """{shape: {name: [(round, us, timing), ...]}} in the order the shapes first appear."""
    times: dict = collections.OrderedDict()
    for d in sorted(runs.iterdir(), key=lambda p: p.name):
        m = re.fullmatch(r"r(\d+)_(.+)", d.name)
        if not m or m[2] not in names or not (d / "h200.json").is_file():
            continue
        for rec in json.loads((d / "h200.json").read_text())["records"]:
            times.setdefault(shape_key(rec), {}).setdefault(m[2], []).append(
                (int(m[1]), rec["ours_us"], rec.get("ours_timing", "device")))
    return times


def table(times, names) -> str:
    lines = ["| shape | " + " | ".join(f"{n}: rounds, us | {n} median" for n in names) + " | "
             + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |",
             "|---|" + "---|---|" * len(names) + "---|" * (len(names) - 1)]
    for shape, by_name in times.items():
        cells, medians = [], {}
        for n in names:
            runs = sorted(by_name.get(n, []))
            cells.append(", ".join(f"{us:.1f}" + ("" if t == "device" else "w") for _, us, t in runs) or "-")
            if runs:
                medians[n] = statistics.median(us for _, us, _ in runs)
            cells.append(f"{medians[n]:.1f}" if n in medians else "-")
        ratios = [f"{medians[n] / medians[names[0]]:.3f}" if n in medians and names[0] in medians else "-"
                  for n in names[1:]]
        lines.append(f"| {shape} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=pathlib.Path)
    ap.add_argument("names", nargs="+")
    args = ap.parse_args(argv)
    print(table(collect(args.runs, args.names), args.names))


if __name__ == "__main__":
    main()
