"""Compiled jax_mla FFI libraries (installed by CMake; see BUILD.md)."""
