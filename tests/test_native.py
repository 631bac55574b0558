"""The native side: the nanobind modules, build_info(), the import-time FFI API check, and that the
CUDA module is loaded only where JAX has a CUDA device."""

import subprocess
import sys
import textwrap

import jax
import jaxlib
import pytest

import jax_mla
from jax_mla import _ffi


def test_build_info_describes_the_build():
    info = jax_mla.build_info()
    assert info["native"] is True
    assert info["version"] == jax_mla.__version__
    major, minor = info["ffi_api"]
    assert isinstance(major, int) and isinstance(minor, int)
    # The running jaxlib is at least as new as the headers we built against (else import raised).
    assert info["running_ffi_api"] is None or info["running_ffi_api"] >= info["ffi_api"]
    assert info["running_jaxlib"] == jaxlib.__version__
    assert info["jaxlib"] and info["cxx_compiler"]
    cuda = info["cuda"]
    if cuda["built"]:
        assert cuda["archs"] and all(a[:2].isdigit() for a in cuda["archs"])
        assert cuda["toolkit"].count(".") >= 1
        assert any("mma.sync" in b for b in cuda["bodies"])
        assert any("wgmma" in b for b in cuda["bodies"]) == ("90a" in cuda["archs"])
    else:
        assert cuda["archs"] == [] and cuda["bodies"] == []
    assert info["cuda_registered"] == (jax.default_backend() == "gpu" and cuda["built"])


def test_registrations_are_ffi_capsules():
    from jax_mla import _native
    regs = _native.registrations()
    assert list(regs) == [_ffi.ATTENTION_TARGET]
    assert type(regs[_ffi.ATTENTION_TARGET]).__name__ == "PyCapsule"


def test_running_ffi_api_matches_the_headers_of_this_jaxlib():
    v = _ffi.running_ffi_api()
    assert v is not None, "jaxlib ships its XLA FFI headers (jax.ffi.include_dir())"
    # We build against the jaxlib we run with in CI, so the versions agree here.
    assert v == jax_mla.build_info()["ffi_api"]


@pytest.mark.parametrize("running, ok", [((0, 3), True), ((0, 4), True), ((0, 2), False), ((1, 3), False),
                                         (None, True)])
def test_ffi_api_check(running, ok):
    if ok:
        _ffi.check_ffi_api((0, 3), "0.10.2", running, "9.9.9")
        return
    with pytest.raises(ImportError) as e:
        _ffi.check_ffi_api((0, 3), "0.10.2", running, "9.9.9")
    msg = str(e.value)
    # Both versions and what to do.
    assert "0.3" in msg and f"{running[0]}.{running[1]}" in msg
    assert "0.10.2" in msg and "9.9.9" in msg and "rebuild" in msg


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})


def test_import_fails_clearly_when_jaxlib_is_older():
    # Pretend the running jaxlib's headers say 0.0: importing jax_mla must raise, naming both versions.
    r = _run("""
        import jax, pathlib, tempfile
        d = pathlib.Path(tempfile.mkdtemp()) / "xla/ffi/api"; d.mkdir(parents=True)
        (d / "c_api.h").write_text("#define XLA_FFI_API_MAJOR 0\\n#define XLA_FFI_API_MINOR 0\\n")
        jax.ffi.include_dir = lambda: str(d.parents[2])
        try:
            import jax_mla
        except ImportError as e:
            print("RAISED", e)
    """)
    assert r.returncode == 0, r.stderr
    assert "RAISED" in r.stdout and "XLA FFI API 0.0" in r.stdout and "rebuild" in r.stdout


def test_cpu_run_never_loads_the_cuda_module():
    r = _run("""
        import sys, numpy as np, jax, jax.numpy as jnp
        import jax_mla
        from jax_mla import plan_mla, mla_paged_attention
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((2, 4, 512)), jnp.float32)
        qp = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
        ckv = jnp.asarray(rng.standard_normal((4, 16, 512)), jnp.float32)
        kpe = jnp.asarray(rng.standard_normal((4, 16, 64)), jnp.float32)
        pt = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
        lens = np.array([20, 9], np.int32)
        plan = plan_mla(np.array([1, 1]), lens, num_heads=4, page_size=16)
        out = mla_paged_attention(q, qp, ckv, kpe, pt, jnp.asarray(lens), plan, sm_scale=0.1, backend="ffi")
        print("finite", bool(jnp.isfinite(out).all()))
        print("cuda module loaded", "jax_mla._native_cuda" in sys.modules)
        print("registered", sorted(jax_mla._ffi.registered_platforms()))
    """)
    assert r.returncode == 0, r.stderr
    assert "finite True" in r.stdout
    assert "cuda module loaded False" in r.stdout
    assert "registered ['cpu']" in r.stdout


def test_cuda_module_without_a_device_gives_a_message_not_a_crash():
    if not jax_mla.build_info()["cuda"]["built"]:
        pytest.skip("built without CUDA")
    if jax_mla.build_info()["cuda_registered"]:
        pytest.skip("this machine has a CUDA device")
    r = _run("""
        from jax_mla import _native_cuda
        try:
            print(_native_cuda.device_status())
        except RuntimeError as e:
            print("RuntimeError:", e)
    """)
    assert r.returncode == 0, r.stderr
    assert "RuntimeError: jax_mla CUDA: no usable device" in r.stdout
    assert "needs a driver for CUDA >=" in r.stdout


def test_a_device_without_code_for_its_arch_gets_the_reference_and_a_message():
    """A library built for other archs: the CUDA handler is not registered, build_info-style reason,
    backend='auto' warns and runs the reference, backend='ffi' raises naming the device. (Simulated:
    the CUDA module's device_status reports what cudaFuncGetAttributes says on such a device.)"""
    r = _run("""
        import sys, types, warnings
        import jax
        fake = types.ModuleType("jax_mla._native_cuda")
        fake.device_status = lambda: {"driver": "13.0", "runtime": "13.0", "devices": [
            {"device": 0, "compute_capability": (8, 6), "kernel": "mma.sync portable",
             "error": "no kernel image is available for execution on the device"}]}
        fake.registrations = lambda: (_ for _ in ()).throw(AssertionError("must not register"))
        sys.modules["jax_mla._native_cuda"] = fake
        import jax_mla
        from jax_mla import _ffi, attention
        real = _ffi._native.build_info()
        _ffi._native = types.SimpleNamespace(build_info=lambda: {**real, "cuda": {
            "built": True, "archs": ["90a"], "toolkit": "13.0", "bodies": []}}, registrations=lambda: {})
        jax.default_backend = lambda: "gpu"
        print("has_ffi", _ffi.has_ffi("gpu"))
        print("reason", _ffi.unavailable_reason("gpu"))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            print("auto", attention.resolve_backend("auto", 512, 64))
            print("warned", any("runs the jax.numpy reference" in str(x.message) for x in w))
        try:
            attention.resolve_backend("ffi", 512, 64)
        except ValueError as e:
            print("ffi raised", e)
    """)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "has_ffi False" in out
    assert "device 0 (compute capability 8.6): no kernel image" in out and "90a" in out
    assert "auto reference" in out and "warned True" in out
    assert "ffi raised backend='ffi' has no kernel for platform 'gpu'" in out
