"""SASS size of the CUDA kernels, and of the wide bodies' hot loops, without a GPU.

The wide bodies pay for their code: after another kernel has run, every SM fetches the loops'
instructions again (ffi/cuda/NOTES.md, "v8f": 5-11 us a call), and in the steady state the two
warpgroups' loops compete for the instruction cache. This compiles ffi/cuda/mla_attention.cu (or
the sources in --src, e.g. a directory made by `scripts/driver_ab.sh --export`) for sm_90a into a
cubin and reads it with nvdisasm:

    python3 tools/sass_size.py [--src DIR] [--defines=-DMACRO,-DOTHER=1] [--cubin PATH]

It prints the SASS instructions of every kernel, then, for each sm_90a kernel, the loops that hold
more than eight wgmma (HGMMA) instructions: their length and their FMUL / R2UR / UTMALDG counts. It
also flags memory instructions whose 64-bit descriptor (`desc[URn]`, which carries the L2 cache
policy) names an odd uniform register: ptxas 13.0 emitted such LDGSTS, from registers it never set,
for a cp.async with an L2 hint in a divergent branch, and the kernel died with an illegal
instruction (ffi/cuda/NOTES.md, "Keys evict-first"); the script exits 1 when it finds one.
With --baseline DIR_OR_CUBIN it compares every kernel's SASS with another build's (a directory of kernel
sources, e.g. from `scripts/driver_ab.sh --export HEAD DIR`, compiled with the same --defines, or a cubin),
label numbers aside, and exits 1 if any kernel differs: a refactor meant to leave the kernels alone can be
checked on a machine without a GPU (helpers that compute the same values have changed ptxas's register
allocation and spilled: ffi/cuda/NOTES.md, "fourth session" and "thirty-third session").
With --first-reads NAME it lists, for the kernels whose mangled name contains NAME, every load into a
register (LDG) with the first instruction that reads the register and the global loads issued in
between: a load written to be read late that ptxas reads at once shows as a first read a few
instructions on with nothing issued between (the device length of every block: NOTES.md, "twenty-eighth
session").
nvdisasm comes from the CUDA toolkit on PATH or from the PyPI wheel `nvidia-cuda-nvdisasm` (its
binary is found inside the installed package); neither is a dependency of jax_mla.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
INSTR = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);")
LABEL = re.compile(r"\s*(\.L_x_\d+):")
BRANCH = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)")


def find_nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for candidate in pathlib.Path(base).glob("cu*/bin/nvdisasm"):
            return str(candidate)
    sys.exit("nvdisasm not found: put the CUDA toolkit on PATH or `pip install nvidia-cuda-nvdisasm`")


def build_cubin(src: pathlib.Path, defines: list[str], out: pathlib.Path) -> None:
    import jax  # the XLA FFI headers the sources include

    cmd = ["nvcc", "-DJAX_MLA_SM90A_BUILT=1", *defines, f"-I{src}", f"-I{ROOT / 'ffi/include'}",
           "-isystem", jax.ffi.include_dir(), "-O3", "-DNDEBUG", "-std=c++17", "-cubin", "-arch=sm_90a",
           "--expt-relaxed-constexpr", "-x", "cu", str(src / "mla_attention.cu"), "-o", str(out)]
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)


def kernels(sass: str) -> dict[str, list[tuple[int, str, dict[str, int]]]]:
    """Each kernel's instructions (address, text) and its labels' addresses."""
    out = {}
    for chunk in re.split(r"\n\s*\.section\s+", sass):
        m = re.search(r"\.text\.(\S+?):", chunk)
        if not m:
            continue
        ins, labels, pending = [], {}, []
        for line in chunk.split("\n"):
            lab = LABEL.match(line)
            if lab:
                pending.append(lab.group(1))
                continue
            i = INSTR.match(line)
            if i:
                addr = int(i.group(1), 16)
                ins.append((addr, i.group(2)))
                labels.update({p: addr for p in pending})
                pending = []
        out[m.group(1)] = (ins, labels)
    return out


DESC = re.compile(r"desc\[UR(\d+)\]")


def odd_descriptors(ins):
    """Instructions (address, text) whose memory descriptor is an odd uniform register (not a pair)."""
    return [(a, t) for a, t in ins if any(int(n) % 2 for n in DESC.findall(t))]


def hot_loops(ins, labels, min_wgmma=8, max_len=4000):
    """Backward branches that close a loop of more than min_wgmma HGMMA (the mbarrier retry stubs
    the compiler puts at the end of the kernel span the whole body and are left out by max_len)."""
    wgmma = [a for a, t in ins if "HGMMA" in t]
    for addr, text in ins:
        m = BRANCH.search(text)
        if not m or m.group(1) not in labels:
            continue
        start = labels[m.group(1)]
        n_wgmma = sum(1 for a in wgmma if start <= a <= addr)
        length = (addr - start) // 16 + 1
        if start < addr and n_wgmma > min_wgmma and length < max_len:
            ops = collections.Counter(t.split()[1 if t.startswith("@") else 0].split(".")[0]
                                      for a, t in ins if start <= a <= addr)
            yield start, length, n_wgmma, ops


LABEL_REF = re.compile(r"\.L_x_\d+")


def canonical(ins, labels) -> list[str]:
    """A kernel's instruction texts with each label named by its address in the kernel instead of its
    number (nvdisasm numbers labels across the whole cubin, so one kernel's change renumbers the next)."""
    return [LABEL_REF.sub(lambda m: f"@{labels.get(m.group(0), -1):#x}", t) for _, t in ins]


def compare(found, base):
    """Per kernel of either build: None where its SASS is the same in both, else a line saying how it
    differs."""
    out = {}
    for name in sorted(set(found) | set(base)):
        if name not in base or name not in found:
            out[name] = "only in " + ("this build" if name in found else "the baseline")
            continue
        a, b = canonical(*found[name]), canonical(*base[name])
        if a != b:
            diff = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
            out[name] = f"{len(b)} -> {len(a)} instructions, {diff} positions differ"
        else:
            out[name] = None
    return out


LOAD = re.compile(r"^(?:@!?U?P\w+\s+)?LDG(?:\.\w+)*\s+(R\d+),")
GLOBAL_LOAD = re.compile(r"^(?:@!?U?P\w+\s+)?(?:LDG|LDGSTS|UTMALDG)\b")


def reads(text: str, reg: str) -> bool:
    """Whether the instruction reads register `reg` (a source operand; stores and branches read all)."""
    body = re.sub(r"^@!?U?P\w+\s+", "", text)
    op, _, args = body.partition(" ")
    operands = [a.strip() for a in args.split(",")]
    sources = operands if op.startswith(("ST", "RED", "ATOM", "BRA")) else operands[1:]
    pattern = re.compile(r"\b%s\b" % reg)
    return any(pattern.search(a) for a in sources)


def first_reads(ins, window=600):
    """For each LDG (address, text): the first later instruction that reads its destination register
    (within `window` instructions, in address order), how many instructions on, and the global loads
    issued in between. None where no read follows in the window."""
    for i, (addr, text) in enumerate(ins):
        m = LOAD.match(text)
        if not m:
            continue
        reg, loads, found = m.group(1), 0, None
        for j in range(i + 1, min(i + 1 + window, len(ins))):
            if reads(ins[j][1], reg):
                found = (ins[j][0], ins[j][1], j - i)
                break
            if GLOBAL_LOAD.match(ins[j][1]):
                loads += 1
        yield addr, text, found, loads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", type=pathlib.Path, default=ROOT / "ffi/cuda")
    ap.add_argument("--defines", default="", help="comma-separated nvcc flags, e.g. --defines=-DA,-DB=2")
    ap.add_argument("--cubin", type=pathlib.Path, help="read this cubin instead of compiling")
    ap.add_argument("--first-reads", metavar="NAME", help="list the loads of the kernels whose name contains NAME")
    ap.add_argument("--baseline", type=pathlib.Path, metavar="DIR_OR_CUBIN",
                    help="compare every kernel's SASS with this build's (kernel sources or a cubin)")
    args = ap.parse_args()
    defines = [d for d in args.defines.split(",") if d]

    def disassemble(cubin: pathlib.Path | None, src: pathlib.Path, tmp: str, name: str) -> str:
        if cubin is None:
            cubin = pathlib.Path(tmp) / name
            build_cubin(src.resolve(), defines, cubin)
        return subprocess.run([find_nvdisasm(), str(cubin)], check=True, capture_output=True, text=True).stdout

    with tempfile.TemporaryDirectory() as tmp:
        sass = disassemble(args.cubin, args.src, tmp, "mla.cubin")
        base_sass = None
        if args.baseline:
            is_dir = args.baseline.is_dir()
            base_sass = disassemble(None if is_dir else args.baseline, args.baseline, tmp, "baseline.cubin")
    found = kernels(sass)
    bad = 0
    for name, (ins, labels) in sorted(found.items(), key=lambda kv: -len(kv[1][0])):
        print(f"{len(ins):6d}  {name}")
        for start, length, n_wgmma, ops in hot_loops(ins, labels):
            print(f"        loop at {start:#x}: {length} instructions, {n_wgmma} HGMMA, FMUL {ops['FMUL']}, "
                  f"R2UR {ops['R2UR']}, UTMALDG {ops['UTMALDG']}")
        for addr, text in odd_descriptors(ins):
            bad += 1
            print(f"        ODD DESCRIPTOR at {addr:#x}: {text}")
    if args.first_reads:
        for name, (ins, _) in sorted(found.items()):
            if args.first_reads not in name:
                continue
            print(f"\nloads of {name}:")
            for addr, text, read, loads in first_reads(ins):
                if read:
                    print(f"  {addr:#07x} {text[:56]:56s} first read {read[2]:4d} on at {read[0]:#x}: "
                          f"{read[1][:48]}; {loads} global loads between")
                else:
                    print(f"  {addr:#07x} {text[:56]:56s} no read in the next 600 instructions")
    changed = 0
    if base_sass is not None:
        print(f"\nSASS against the baseline ({args.baseline}), label numbers aside:")
        for name, how in compare(found, kernels(base_sass)).items():
            changed += how is not None
            print(f"  {'same' if how is None else 'DIFFERS'}  {name}" + (f": {how}" if how else ""))
    if bad:
        sys.exit(f"{bad} instructions with an odd descriptor register (see the header)")
    if changed:
        sys.exit(f"{changed} kernels' SASS differs from the baseline's")


if __name__ == "__main__":
    main()
