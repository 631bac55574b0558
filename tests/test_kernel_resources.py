"""What ptxas says about the sm_90a kernels, checked without a GPU (where nvcc is on the PATH, as in CI).

Two ways a kernel change loses speed that no CPU test sees and that ptxas reports at compile time:
- register spills (the wide bodies hold 128 O accumulators a thread and run at 230-255 registers, so a
  small change in a shared helper can tip one over: ffi/cuda/NOTES.md, "fourth session");
- wgmma serialised by ptxas (its "Potential Performance Loss" notes C7510-C7515: a wgmma behind a branch,
  one in flight across a loop's back edge or a call, makes ptxas serialise every wgmma of the kernel:
  NOTES.md, "v5" and "ninth session"; C7520: a spin-wait loop in a divergent branch between them, NOTES.md,
  "fifty-first session").
The compile is the library's sm_90a one (CMakeLists.txt's flags for ffi/cuda/mla_attention.cu), with the
nvcc release the kernels are tuned with.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc")
# The kernels' register budgets are tuned with this ptxas (CI's and the H200 machine's); another release
# allocates registers differently, so there the test would judge the compiler, not the change.
TUNED_RELEASE = "13.0"


def _nvcc_release() -> str | None:
    if NVCC is None:
        return None
    m = re.search(r"release (\d+\.\d+)", subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout)
    return m.group(1) if m else None


tuned_nvcc = pytest.mark.skipif(_nvcc_release() != TUNED_RELEASE,
                                reason=f"needs nvcc {TUNED_RELEASE} on the PATH (found: {_nvcc_release()})")


def parse_ptxas(log: str) -> tuple[dict[str, dict], list[str]]:
    """Per kernel (mangled name): registers and (stack, spill store, spill load) bytes; and ptxas's
    warnings and performance notes (which ptxas prints as "info")."""
    kernels: dict[str, dict] = {}
    warnings = []
    cur = None
    for line in log.splitlines():
        if "ptxas" in line and ("warning" in line or "Potential Performance Loss" in line):
            warnings.append(line.strip())
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            cur = kernels.setdefault(m.group(1), {})
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur is not None:
            cur["stack_spill"] = tuple(int(v) for v in m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m and cur is not None:
            cur["registers"] = int(m.group(1))
    return kernels, warnings


def test_parse_ptxas_reads_spills_registers_and_warnings():
    log = """ptxas info    : Compiling entry function '_Z1kv' for 'sm_90a'
ptxas info    : Function properties for _Z1kv
    16 bytes stack frame, 12 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 400 bytes cmem[0]
ptxas info    : (C7510) Potential Performance Loss: wgmma.mma_async instructions are serialized due to {why}
ptxas info    : Compiling entry function '_Z1jv' for 'sm_90a'
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers
""".format(why="wgmma pipeline crossing function boundary at a function call in the function '_Z1kv'")
    kernels, warnings = parse_ptxas(log)
    assert kernels == {"_Z1kv": {"stack_spill": (16, 12, 20), "registers": 255},
                       "_Z1jv": {"stack_spill": (0, 0, 0), "registers": 40}}
    assert len(warnings) == 1 and "C7510" in warnings[0]


def _demangle(names):
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    if not tool:
        return list(names)
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else list(names)


def _compile_sm90a(out_dir):
    out = out_dir / "mla_attention.o"
    cmd = [NVCC, "-std=c++17", "--expt-relaxed-constexpr", "-O3", "-DJAX_MLA_SM90A_BUILT=1",
           "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-c",
           "-I", str(ROOT / "ffi" / "include"), "-isystem", jax.ffi.include_dir(),
           str(ROOT / "ffi" / "cuda" / "mla_attention.cu"), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-4000:]
    return parse_ptxas(r.stdout + r.stderr)


@pytest.fixture(scope="module")
def sm90a_ptxas(tmp_path_factory):
    return _compile_sm90a(tmp_path_factory.mktemp("ptxas"))


def _spilling(kernels):
    spilling = [k for k, v in kernels.items() if v.get("stack_spill", (0, 0, 0))[1:] != (0, 0)]
    return [f"{n}: {kernels[k]}" for k, n in zip(spilling, _demangle(spilling))]


@tuned_nvcc
def test_sm90a_kernels_do_not_spill(sm90a_ptxas):
    kernels, _ = sm90a_ptxas
    assert len(kernels) >= 10, f"ptxas listed {len(kernels)} kernels"
    # The walk, the default for plans of many units a worker since the forty-fifth session (an A/B build,
    # compiled here as one, before it), is among them.
    assert any("mla_attention_wide64_walk_kernel" in k for k in kernels), sorted(kernels)
    report = _spilling(kernels)
    assert not report, "ptxas spills in:\n" + "\n".join(report)


@tuned_nvcc
def test_sm90a_wgmma_is_not_serialised(sm90a_ptxas):
    _, warnings = sm90a_ptxas
    assert not warnings, "\n".join(warnings)
