"""The compiled handlers: registering them with XLA, and what they were built with.

Two nanobind modules, built by CMake next to this file (BUILD.md):
  jax_mla._native       the CPU handler and build_info(); always built, imported with jax_mla;
  jax_mla._native_cuda  the CUDA handler and device_status(); built when nvcc was found, imported
                        only when JAX has a CUDA device, and registered only when the library holds
                        code for every device's arch.
Each module's registrations() maps XLA FFI target names to handler capsules.
"""

from __future__ import annotations

import functools
import pathlib
import re

import jax

ATTENTION_TARGET = "jax_mla_paged_attention"

try:
    from . import _native
    _NATIVE_ERROR = None
except ImportError as e:  # a source tree that was never built: the reference still runs
    _native = None
    _NATIVE_ERROR = f"{type(e).__name__}: {e}"


def running_ffi_api() -> tuple[int, int] | None:
    """The XLA FFI API version (major, minor) of the running jaxlib, read from the FFI headers it
    ships (`jax.ffi.include_dir()`); None when they are not there."""
    header = pathlib.Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
    try:
        text = header.read_text()
    except OSError:
        return None
    major = re.search(r"#define\s+XLA_FFI_API_MAJOR\s+(\d+)", text)
    minor = re.search(r"#define\s+XLA_FFI_API_MINOR\s+(\d+)", text)
    if major is None or minor is None:
        return None
    return int(major.group(1)), int(minor.group(1))


def check_ffi_api(built: tuple[int, int], built_jaxlib: str, running: tuple[int, int] | None,
                  running_jaxlib: str) -> None:
    """Raise ImportError when the running jaxlib's XLA FFI API is older than (or of another major
    version than) the one the handlers were compiled against: XLA would reject them, or they would
    read fields the running XLA does not fill in."""
    if running is None:
        return
    if running[0] == built[0] and running >= built:
        return
    fmt = lambda v: f"{v[0]}.{v[1]}"  # noqa: E731
    raise ImportError(
        f"jax_mla's native handlers were built against XLA FFI API {fmt(built)} (jaxlib {built_jaxlib}), "
        f"but the running jaxlib {running_jaxlib} provides XLA FFI API {fmt(running)}. Upgrade jaxlib to "
        f">= {built_jaxlib}, or rebuild jax_mla against this one: "
        f"`pip install --no-build-isolation --force-reinstall .` (BUILD.md).")


def native_build_info() -> dict | None:
    return None if _native is None else _native.build_info()


def _check_at_import() -> None:
    info = native_build_info()
    if info is None:
        return
    import jaxlib
    check_ffi_api(tuple(info["ffi_api"]), info["jaxlib"], running_ffi_api(), jaxlib.__version__)


_check_at_import()

# Why the CUDA handler is not registered, when it is not (None when it is, or was not asked for).
_cuda_error: str | None = None
# What the CUDA module's device_status() said when the handler was registered (or refused).
_cuda_status: dict | None = None


def _register(registrations: dict, platform: str) -> None:
    for name, capsule in registrations.items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)


@functools.lru_cache(maxsize=None)
def _registered_cpu() -> bool:
    if _native is None:
        return False
    _register(_native.registrations(), "cpu")
    return True


@functools.lru_cache(maxsize=None)
def _registered_cuda() -> bool:
    """Import the CUDA module and register its handler; called only for a CUDA device."""
    global _cuda_error, _cuda_status
    info = native_build_info()
    if info is None or not info["cuda"]["built"]:
        _cuda_error = "jax_mla was built without CUDA (no nvcc at build time; BUILD.md)"
        return False
    try:
        from . import _native_cuda
        status = _cuda_status = _native_cuda.device_status()
    except (ImportError, RuntimeError) as e:
        _cuda_error = f"the CUDA module does not load: {e}"
        return False
    bad = [d for d in status["devices"] if d["error"] is not None]
    if bad:
        archs = ", ".join(info["cuda"]["archs"])
        _cuda_error = "; ".join(
            f"device {d['device']} (compute capability {d['compute_capability'][0]}.{d['compute_capability'][1]}):"
            f" {d['error']}" for d in bad) + f" (the library holds code for {archs}; rebuild with " \
            "JAX_MLA_CUDA_ARCHS naming this arch, BUILD.md)"
        return False
    _register(_native_cuda.registrations(), "CUDA")
    return True


def registered_platforms() -> frozenset[str]:
    """The platforms ('cpu', 'cuda') whose handler is registered so far."""
    done = set()
    if _registered_cpu():
        done.add("cpu")
    if _registered_cuda.cache_info().currsize and _registered_cuda():
        done.add("cuda")
    return frozenset(done)


def has_ffi(platform: str) -> bool:
    """platform: 'cpu' or 'gpu'/'cuda' (JAX's names). Registers that platform's handler on first use;
    the CUDA module is imported only here, so only on a machine whose JAX has a CUDA device."""
    if platform == "cpu":
        return _registered_cpu()
    if platform in ("gpu", "cuda"):
        _registered_cpu()  # a CPU-placed computation may run next to the GPU one
        return _registered_cuda()
    return False


def unavailable_reason(platform: str) -> str:
    """Why has_ffi(platform) is False, in words."""
    if _native is None:
        return f"jax_mla's native module is not built ({_NATIVE_ERROR}); BUILD.md"
    if platform in ("gpu", "cuda"):
        return _cuda_error or "not asked for yet"
    return f"no handler for platform {platform!r}"


def build_info() -> dict:
    """What jax_mla's native side was built with and what it runs on here (see README)."""
    import jaxlib

    from . import __version__
    info = {"version": __version__, "native": _native is not None}
    built = native_build_info()
    if built is None:
        info["native_error"] = _NATIVE_ERROR
    else:
        info.update(built)
        info["ffi_api"] = tuple(info["ffi_api"])
    info["running_jaxlib"] = jaxlib.__version__
    info["running_ffi_api"] = running_ffi_api()
    cuda_devices = [d for d in jax.devices() if d.platform == "gpu"] if _has_gpu_backend() else []
    if cuda_devices and built is not None and built["cuda"]["built"]:
        info["cuda_registered"] = has_ffi("gpu")
        info["cuda_devices"] = _cuda_status
        if not info["cuda_registered"]:
            info["cuda_error"] = _cuda_error
    else:
        info["cuda_registered"] = False
    return info


def _has_gpu_backend() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False
