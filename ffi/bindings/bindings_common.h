// Helpers shared by the two nanobind modules (cpu_module.cc, cuda_module.cc).
#pragma once

#include <nanobind/nanobind.h>

#include <string>
#include <type_traits>

#include "xla/ffi/api/c_api.h"

namespace jax_mla {

// An XLA FFI handler as the capsule jax.ffi.register_ffi_target takes.
template <typename Fn>
nanobind::capsule ffi_capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "an XLA FFI handler takes an XLA_FFI_CallFrame*");
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

// The XLA FFI target of the op (jax_mla/_ffi.py: ATTENTION_TARGET).
constexpr const char* kAttentionTarget = "jax_mla_paged_attention";

// What each module's registrations() returns: target name -> handler capsule.
template <typename Fn>
nanobind::dict attention_registrations(Fn* handler) {
  nanobind::dict targets;
  targets[kAttentionTarget] = ffi_capsule(handler);
  return targets;
}

// "80,90a" -> ["80", "90a"].
inline nanobind::list split_list(const std::string& s) {
  nanobind::list out;
  size_t start = 0;
  while (start < s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    if (end > start) out.append(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace jax_mla
