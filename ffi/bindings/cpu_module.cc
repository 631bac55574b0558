// jax_mla._native: the CPU handler of the op as an XLA FFI capsule, and what the
// native side was built with. Always built; the CUDA handler lives in its own
// module (cuda_module.cc) so that it is loaded only where a CUDA device exists.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "bindings_common.h"
#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* JaxMlaPagedAttentionCpu(XLA_FFI_CallFrame* call_frame);

namespace nb = nanobind;

namespace {

// Facts CMake passes in (CMakeLists.txt): they describe the whole build, CUDA part included, so
// that build_info() answers without loading the CUDA module.
#ifndef JAX_MLA_VERSION
#error "CMake defines JAX_MLA_VERSION"
#endif

nb::dict build_info() {
  nb::dict info;
  info["version"] = JAX_MLA_VERSION;
  info["ffi_api"] = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  info["jaxlib"] = JAX_MLA_JAXLIB_VERSION;  // the jaxlib whose FFI headers we compiled against
  info["cxx_compiler"] = JAX_MLA_CXX_COMPILER;
  nb::dict cuda;
  cuda["built"] = JAX_MLA_CUDA_BUILT != 0;
  cuda["toolkit"] = JAX_MLA_CUDA_TOOLKIT;                   // "" when not built
  cuda["archs"] = jax_mla::split_list(JAX_MLA_CUDA_ARCHS);  // e.g. ["80", "90a"]
  nb::list bodies;
  if (JAX_MLA_CUDA_BUILT) {
    bodies.append("mma.sync portable kernel (every arch)");
    if (JAX_MLA_CUDA_SM90A) bodies.append("wgmma warp-specialised sm_90a kernel (compute capability 9.0)");
  }
  cuda["bodies"] = bodies;
  info["cuda"] = cuda;
  return info;
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "jax_mla's CPU XLA FFI handler and build facts (see jax_mla.build_info()).";
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_mla_paged_attention"] = jax_mla::ffi_capsule(JaxMlaPagedAttentionCpu);
    return targets;
  }, "XLA FFI target name -> handler capsule, for platform 'cpu'.");
  m.def("build_info", &build_info, "What the native libraries were built with and for.");
}
