"""The GPU-analysis tools that run on this machine: tools/ncu_source.py on a small source page,
tools/trace_report.py on a small timeline, tools/block_trace_report.py on a small block trace,
tools/sass_size.py on a few lines of SASS (odd descriptors, loads' first reads, a build against a baseline); tools/e4m3_lossy_error.py's LSE bound; the standalone driver's timing
plans and case sets (cases.py); tools/flashmla_shape.py's shape names; the scripts parse, and gpu_check.sh's
step-status helper."""

import gzip
import importlib.util
import os
import pathlib
import re
import subprocess

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tool(name, folder="tools"):
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ncu_source():
    return _tool("ncu_source")


# The shape of `ncu --page source --csv --print-source sass`: a kernel line, the header, one row per
# instruction (only the columns the tool reads, plus two stall reasons).
PAGE = """\
"Kernel Name","k",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_wait","stall_long_sb","stall_wait (Not Issued)"
"0x7f0000000100","      SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x10], R3","5","256","1","4","1"
"0x7f0000000110","@!P0  BRA 0x7f0000000900","40","256","0","40","0"
"0x7f0000000120","      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT","30","256","2","0","2"
"0x7f0000000130","@P1   UTMALDG.2D [UR16], [UR20]","7","64","7","0","7"
"""


def test_ncu_source_reads_offsets_samples_and_unlisted_reasons(tmp_path):
    ncu = _ncu_source()
    path = tmp_path / "page.csv.gz"
    path.write_bytes(gzip.compress(PAGE.encode()))
    data = ncu.load(str(path))
    assert [d["off"] for d in data] == [0, 0x10, 0x20, 0x30]
    assert [d["op"] for d in data] == ["SYNCS.PHASECHK.TRANS64.TRYWAIT", "BRA", "HGMMA.64x64x16.F32.BF16", "UTMALDG.2D"]
    assert [d["n"] for d in data] == [5, 40, 30, 7] and data[3]["ran"] == 64
    # The wgmma's 28 samples outside the listed reasons (warpgroup arrive has no column) show as `other`.
    assert ncu.reasons(data[2]) == "other 28, wait 2"
    assert ncu.reasons(data[1]) == "long_sb 40"


def test_ncu_source_commands_print_their_tables(tmp_path, capsys, monkeypatch):
    ncu = _ncu_source()
    path = tmp_path / "page.csv"
    path.write_text(PAGE)
    for argv, expect in ((["ops"], "BRA"), (["warps"], "ran       64 times:     1 instructions,      7 samples"),
                         (["waits"], "    82 ran     256"), (["phases", "--min", "1"], "after mbarrier wait")):
        monkeypatch.setattr("sys.argv", ["ncu_source.py", argv[0], str(path), *argv[1:]])
        ncu.main()
        out = capsys.readouterr().out
        assert "4 instructions, 82 stall samples" in out
        assert expect in out, (argv, out)


def test_trace_report_periods_and_intervals():
    tr = _tool("trace_report")
    # One traced warp (slot 2: block 0, warpgroup 1, warp 0), three pairs 1,000 cycles apart whose
    # marks are 10 * i cycles after the pair's top (the last one 200), and a prologue row.
    lines = ["trace c slot 2 globaltimer 5000 9000",
             "trace c slot 2 row 0: 0 40 50 60 3000 3100 10 20 -1 -1"]
    for n in range(3):
        top = 100 + 1000 * n
        stamps = [top + 10 * i for i in range(11)] + [top + 200]
        lines.append(f"trace c slot 2 row {n + 1}: " + " ".join(map(str, stamps)))
    rows, timers = tr.read(lines)
    assert timers[("c", 2)] == (5000, 9000, 1)  # no body id: an older driver's wide body
    out = tr.report(rows, timers, 0, 3)
    assert out[0].startswith("c slot 2 (block 0, WG1, warp 0): start 0 queries issued 40")
    assert out[0].endswith("| 4000 ns")
    assert "pair period 1000 cycles (median over trips 0..1)" in out[1]
    assert out[2].split() == ["top", "->", "m_A", "received", "10"]
    assert out[-2].split()[-1] == "100"  # A 4-8 refilled -> S issued: 10; S issued -> trip end: 100
    assert out[-1].split()[-1] == "800"  # trip end -> next top


def test_trace_report_pa_first_body_labels():
    tr = _tool("trace_report")
    # Body id 3 (the P_A-first schedule, the default): warpgroup 1's marks are labelled by that schedule.
    lines = ["trace c slot 2 globaltimer 5000 9000 body 3", "trace c slot 2 row 0: 0 40 50 60 3000 3100 10 20"]
    for n in range(3):
        top = 100 + 1000 * n
        lines.append(f"trace c slot 2 row {n + 1}: " + " ".join(str(top + 10 * i) for i in range(12)))
    rows, timers = tr.read(lines)
    out = tr.report(rows, timers, 0, 3)
    assert out[2].split() == ["top", "->", "m_A", "received", "10"]
    assert out[3].split() == ["m_A", "received", "->", "PV_A", "issued", "10"]


def test_trace_report_narrow_fp8_body_and_first_trips():
    tr = _tool("trace_report")
    # The opt-in fp8 narrow body (body 2) in slot 0, after a merge; slot 4 (a block that did not exist)
    # was never written: body 0, skipped. Trips 500 cycles apart, marks 20 * i after the top.
    lines = ["trace c@merge slot 0 globaltimer 100 2100 body 2",
             "trace c@merge slot 0 row 0: 0 30 60 90 1900 1950 -1 -1 -1",
             "trace c@merge slot 4 globaltimer 0 0 body 0",
             "trace c@merge slot 4 row 0: 0 0 0 0 0 0 0 0 0"]
    for n in range(4):
        top = 200 + 500 * n
        lines.append(f"trace c@merge slot 4 row {n + 1}: 0 0 0 0 0 0")
        lines.append(f"trace c@merge slot 0 row {n + 1}: " + " ".join(str(top + 20 * i) for i in range(6)))
    rows, timers = tr.read(lines)
    assert timers[("c@merge", 0)] == (100, 2100, 2)
    out = tr.report(rows, timers, 1, 3, first=2)
    assert out[0] == ("c@merge slot 0 (block 0, WG0, warp 0): start 0 page ids landed 30 queries landed 60 "
                      "panels built 90 loop end 1900 stored 1950 | 2000 ns")
    assert out[1] == "   trip 0: top 200 block landed 220 S done 240 maxima shared 260 P in panel 280 P V done 300"
    assert out[2].startswith("   trip 1: top 700 ")
    assert "trip period 500 cycles (median over trips 1..2)" in out[3]
    assert out[4].split() == ["top", "->", "block", "landed", "20"]
    assert out[-1].split()[-1] == "400"  # P V done -> next top
    assert not any("slot 4" in line for line in out)


def test_trace_report_walk_boundary():
    tr = _tool("trace_report")
    # A walk's block 0: its first unit in slot 1 (WG0, warp 3), its second in slot 5, which starts 700 ns
    # after the first ended; beside them a trace of waves, where block B (slot 6) runs beside block 0
    # (slot 2): no boundary there.
    lines = ["trace w slot 1 globaltimer 1000 5000 body 1",
             "trace w slot 1 row 0: 0 40 50 60 3000 3400 10 20",
             "trace w slot 5 globaltimer 5700 9000 body 1",
             "trace w slot 5 row 0: 0 30 45 2500 6000 6300 10 20",
             "trace v slot 2 globaltimer 1000 5000 body 1",
             "trace v slot 2 row 0: 0 40 50 60 3000 3400 10 20",
             "trace v slot 6 globaltimer 1100 5100 body 1",
             "trace v slot 6 row 0: 0 40 50 60 3000 3400 10 20"]
    rows, timers = tr.read(lines)
    out = tr.walk_boundaries(rows, timers)
    assert out == ["w walk boundary, WG0 warp 3: loop end -> stored 400 cycles, then 700 ns to the next unit's "
                   "start, then 2500 cycles to its first S done"]
    assert out[0] in tr.report(rows, timers, 0, 3)


def test_block_trace_report_span_tail_and_cost_fit():
    bt = _tool("block_trace_report")
    # Four SMs; units of 500 + 100 b keys costing 2 us + 30 ns a key, each started on the SM that is
    # free first; a padding block (q_len 0) that must not count; the merge ends 5 us after the last unit.
    name = "/c/time1_8x8192_h16_ps16.bin"
    lines = [f"blocktrace {name} sms 4 heads 16 head_blocks 1 work 7 merge_grid 8",
             f"blockkv {name}: 8192 4000"]
    free = {sm: 0 for sm in range(4)}
    for b in range(6):
        keys = 500 + 100 * b
        sm = min(free, key=free.get)
        lines.append(f"blocktrace {name} kind 0 block {b} sm {sm} start {free[sm]} end {free[sm] + 2000 + 30 * keys}")
        free[sm] += 2000 + 30 * keys
        # request b % 2, token 0, q_len 1, keys [0, keys); the first three are splits
        lines.append(f"blockwork {name} unit {b}: {b % 2} 0 1 0 0 {keys} {b if b < 3 else -1} 0")
    lines.append(f"blocktrace {name} kind 0 block 6 sm 3 start 0 end 100")
    lines.append(f"blockwork {name} unit 6: 0 0 0 0 0 0 -1 0")
    lines += [f"blocktrace {name} kind 1 block {b} sm {b % 4} start 0 end {max(free.values()) + 5000}" for b in range(8)]
    cases = bt.read(lines)
    units = bt.unit_blocks(cases[name])
    assert sorted(u[0] for u in units) == list(range(6))  # the padding block is not a unit
    per_key, fixed, rms = bt.fit(np.array([u[4] for u in units], float),
                                 np.array([(u[3] - u[2]) / 1000 for u in units]))
    assert abs(per_key - 0.030) < 1e-9 and abs(fixed - 2.0) < 1e-6 and rms < 1e-6
    out = bt.report(name, cases[name], last=2)
    assert "6 unit blocks on 4 of 4 SMs; attention span 52.0 us, merge tail 5.0 us" in out[0]
    assert out[1].endswith("last 52.0; units per SM 1-2")
    assert out[2].startswith("   narrow: 6 blocks, 30.00 ns a key + 2.00 us a block (= 67 keys)")
    assert out[2].endswith("3 split")
    assert out[3].startswith("   ended late: block 5 (narrow, 1000 keys) on SM 1: 20.0 -> 52.0 us")


# nvdisasm's layout: a section per kernel, instructions as /*addr*/ text ; (the odd descriptor is the
# ptxas 13.0 miscompile of a hinted cp.async in a divergent branch, ffi/cuda/NOTES.md).
SASS = """\
        .section        .text.kernel_a,"ax",@progbits
.text.kernel_a:
        /*0000*/                   LDGSTS.E.BYPASS.128 [R23], desc[UR8][R14.64], !P0 ;
        /*0010*/                   LDGSTS.E.BYPASS.128 [R13+UR0+0x12840], desc[UR1][R2.64], P2 ;
        /*0020*/                   LDG.E desc[UR4][R2.64] ;
        .section        .text.kernel_b,"ax",@progbits
.text.kernel_b:
        /*0000*/                   STG.E desc[UR14][R2.64], R5 ;
"""


def test_sass_size_flags_odd_descriptor_registers():
    tool = _tool("sass_size")
    found = tool.kernels(SASS)
    assert sorted(found) == ["kernel_a", "kernel_b"]
    assert [a for a, _ in tool.odd_descriptors(found["kernel_a"][0])] == [0x10]
    assert tool.odd_descriptors(found["kernel_b"][0]) == []


def test_driver_times_the_plans_the_op_runs_on_an_h200(monkeypatch):
    """cases.py plans its timing cases with the op's default target on a 132-SM GPU, so a driver A/B
    times the plans the op runs there (an older copy of the target's fields costed units at 128 keys)."""
    from jax_mla.planner import default_target

    class H200:
        platform, core_count = "gpu", 132

    # cases.py defaults JAX_PLATFORMS to cpu for its own process; keep that out of this one's
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", ""))
    cases = _tool("cases", "tools/sanitize_harness")
    assert cases.TIMING_TARGET == default_target(H200())


FIRST_READS = """\
        .section        .text.kernel_c,"ax",@progbits
.text.kernel_c:
        /*0000*/                   LDG.E.CONSTANT R12, desc[UR24][R12.64] ;
        /*0010*/                   IADD3 R3, R4, 0x1, RZ ;
        /*0020*/              @!P0 R2UR UR6, R12 ;
        /*0030*/              @!P1 LDG.E.CONSTANT R26, desc[UR24][R10.64] ;
        /*0040*/                   LDGSTS.E.BYPASS.128 [R19], desc[UR24][R12.64], !P5 ;
        /*0050*/                   UTMALDG.2D [UR12], [UR16], desc[UR10] ;
        /*0060*/                   STS [R11+0x38200], R26 ;
        /*0070*/                   LDG.E.128.CONSTANT R8, desc[UR24][R4.64] ;
"""


def test_sass_size_first_reads_of_loads():
    """A load read two instructions on with nothing issued between (the hoisted length of NOTES.md's
    twenty-eighth session), one read by a store after two loads, one never read."""
    tool = _tool("sass_size")
    ins, _ = tool.kernels(FIRST_READS)["kernel_c"]
    got = [(addr, read[0] if read else None, read[2] if read else None, loads)
           for addr, _, read, loads in tool.first_reads(ins)]
    assert got == [(0x00, 0x20, 2, 0), (0x30, 0x60, 3, 2), (0x70, None, None, 0)]
    assert tool.reads("@!P0 R2UR UR6, R12", "R12") and not tool.reads("LDG.E R12, desc[UR2][R4.64]", "R12")
    assert tool.reads("STS [R11+0x38200], R26", "R26") and not tool.reads("IADD3 R12, R4, 0x1, RZ", "R12")


def _two_kernels(first_label: int, add_in_b: str = "") -> str:
    """Two kernels whose branches name labels by cubin-wide numbers starting at first_label."""
    a, b = first_label, first_label + 1
    return f"""\
        .section        .text.kernel_a,"ax",@progbits
.text.kernel_a:
        /*0000*/                   ISETP.GE.AND P0, PT, R0, RZ, PT ;
        /*0010*/               @P0 BRA `(.L_x_{a}) ;
        /*0020*/                   IADD3 R1, R1, 0x1, RZ ;
.L_x_{a}:
        /*0030*/                   EXIT ;
        .section        .text.kernel_b,"ax",@progbits
.text.kernel_b:
        /*0000*/                   BRA `(.L_x_{b}) ;
{add_in_b}.L_x_{b}:
        /*0010*/                   EXIT ;
"""


def test_sass_size_baseline_ignores_label_numbers_and_names_what_differs():
    """The same code with labels numbered from elsewhere in the cubin is the same; an added instruction,
    or a kernel only one build has, is not."""
    tool = _tool("sass_size")
    base = tool.kernels(_two_kernels(7))
    assert tool.compare(tool.kernels(_two_kernels(1200)), base) == {"kernel_a": None, "kernel_b": None}
    grown = tool.kernels(_two_kernels(1200, "        /*0010*/                   NOP ;\n"))
    got = tool.compare(grown, base)
    assert got["kernel_a"] is None and got["kernel_b"].startswith("2 -> 3 instructions")
    # a branch to another place is a difference, though the label's number is the same
    moved = tool.kernels(_two_kernels(7).replace("@P0 BRA `(.L_x_7)", "@P0 BRA `(.L_x_8)"))
    assert tool.compare(moved, base)["kernel_a"] is not None
    del base["kernel_b"]
    assert tool.compare(grown, base)["kernel_b"] == "only in this build"


def test_e4m3_lossy_lse_error_sits_inside_the_fp8_products_bounds():
    """tools/e4m3_lossy_error.py --lse, emulated: the LSE error of rows that see one key (where it is largest)
    at the tests' sm_scale stays well inside the bounds check_against_reference holds fp8_products to, and is
    the size those bounds were set for, not near zero (an e4m3 query keeps 3 mantissa bits)."""
    from test_attention import FP8_PRODUCTS_LSE_ATOL, FP8_PRODUCTS_LSE_RMS
    rms, p999, top = _tool("e4m3_lossy_error").lse_error(np.random.default_rng(1), 1, 2.16, rows=2000)
    assert 0.03 < rms < FP8_PRODUCTS_LSE_RMS / 1.3
    assert p999 <= top < 0.8 * FP8_PRODUCTS_LSE_ATOL  # (over 10^5 rows the largest was 0.24-0.25)


def test_driver_cases_replace_the_previous_set(tmp_path, monkeypatch):
    """`cases.py make` into a folder that holds an earlier set leaves only its own cases: the driver and
    `check` take every case*.bin there, so `make --wide` after a full `make` ran the full set again."""
    from jax_mla.arg_specs import arg_specs

    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", ""))
    cases = _tool("cases", "tools/sanitize_harness")
    for name in ("case99.bin", "case99.bin.out", "case99.npz", "time3_old.bin"):
        (tmp_path / name).write_bytes(b"old")
    spec = arg_specs("small")[0]
    cases.make(str(tmp_path), [spec, spec], keep=lambda s: s is not spec)  # keeps neither
    assert sorted(p.name for p in tmp_path.iterdir()) == ["time3_old.bin"]  # timing cases are make_timing's
    cases.make(str(tmp_path), [spec])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["case0.bin", "case0.npz", "time3_old.bin"]


def test_flashmla_shape_reads_our_extend_names():
    """scripts/ncu_peer.sh hands FlashMLA's peer kit a shape it does not list by our BxLhHqS name."""
    fm = _tool("flashmla_shape")
    assert fm.parse("8x4096h128q64") == ("8x4096 h128 q64", (8, 4096), 128, 64)
    assert fm.parse("16x4096h16q128")[1:] == ((16, 4096), 16, 128)
    with pytest.raises(ValueError, match="8x4096 h128"):
        fm.parse("8x4096 h128")


SCRIPTS = sorted([*(ROOT / "scripts").glob("*.sh"), ROOT / ".ci" / "run"])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse(script):
    """The scripts CI does not run (the GPU machine's among them) at least parse: a syntax error found there
    costs a device call."""
    run = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_gpu_check_names_how_a_step_ended(tmp_path):
    """gpu_check.sh's `finished NAME RC TIMEOUT` (each timed step's last line): a timeout and a signal are
    named, and the step's status is returned."""
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    helper = re.search(r"^finished\(\) \{\n.*?^\}\n", text, re.M | re.S).group(0)
    body = helper + 'for rc in 0 1 124 139; do finished step "$rc" 42; echo "returned $?"; done'
    run = subprocess.run(["bash", "-c", body], capture_output=True, text=True, env={**os.environ, "LOGS": str(tmp_path)})
    lines = [re.sub(r" \(\d\d:\d\d:\d\d\)$", "", l) for l in run.stdout.splitlines()]
    assert lines == ["step exit 0", "returned 0", "step exit 1", "returned 1",
                     "step exit 124 (timed out after 42 s)", "returned 124",
                     "step exit 139 (killed by signal 11)", "returned 139"]
    assert len((tmp_path / "summary.txt").read_text().splitlines()) == 4


def test_gpu_check_step_limits_reach_their_finished_line():
    """Each timed step's limit has its default set in the script's own shell. A `${X_TIMEOUT:=N}` inside the
    step's pipeline set it in a subshell only, so the step's `finished ... $X_TIMEOUT` line stopped the script
    under set -u (fortieth session: the check step, after its tests had passed)."""
    lines = (ROOT / "scripts" / "gpu_check.sh").read_text().splitlines()
    used = {m for line in lines for m in re.findall(r"\$\{?([A-Z_]+_TIMEOUT)\b", line)}
    assert used, "no step limits found"
    defaults = {m for line in lines for m in re.findall(r'^: "\$\{([A-Z_]+_TIMEOUT):=\d+\}"$', line)}
    inline = [line for line in lines if re.search(r"\$\{[A-Z_]+:=", line) and not line.startswith((": \"", "#"))]
    assert not inline, inline
    assert used <= defaults | {"SANITIZE_TIMEOUT"}, used - defaults
