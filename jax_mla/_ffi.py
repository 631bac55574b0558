"""Loading the compiled FFI libraries and registering their handlers with XLA.

The CPU library is always built; the CUDA one whenever nvcc was found at build
time (BUILD.md). Handlers are plain C symbols (XLA_FFI_DEFINE_HANDLER_SYMBOL),
loaded with ctypes and wrapped as PyCapsules for `jax.ffi.register_ffi_target`.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib

import jax

ATTENTION_TARGET = "jax_mla_paged_attention"

# (library stem, platform for XLA, exported symbol)
_LIBRARIES = (
    ("jax_mla_cpu", "cpu", "JaxMlaPagedAttentionCpu"),
    ("jax_mla_cuda", "CUDA", "JaxMlaPagedAttentionCuda"),
)


def _native_dir() -> pathlib.Path | None:
    try:
        from . import _native  # installed by CMake next to the libraries
    except ImportError:
        return None
    return pathlib.Path(_native.__file__).parent


def _find(stem: str) -> pathlib.Path | None:
    d = _native_dir()
    if d is None:
        return None
    for cand in sorted(d.glob(f"lib{stem}*.so")) + sorted(d.glob(f"{stem}*.dll")):
        return cand
    return None


@functools.lru_cache(maxsize=None)
def registered_platforms() -> frozenset[str]:
    """Register every handler that was built; return the platforms that have one."""
    done = set()
    for stem, platform, symbol in _LIBRARIES:
        path = _find(stem)
        if path is None:
            continue
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform=platform)
        done.add(platform.lower())
    return frozenset(done)


def has_ffi(platform: str) -> bool:
    """platform: 'cpu' or 'gpu' (JAX's names)."""
    want = "cuda" if platform in ("gpu", "cuda") else platform
    return want in registered_platforms()
