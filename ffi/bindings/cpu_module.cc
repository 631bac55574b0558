// jax_mla._native: the CPU handler of the op as an XLA FFI capsule, and what the
// native side was built with. Always built; the CUDA handler lives in its own
// module (cuda_module.cc) so that it is loaded only where a CUDA device exists.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <string>
#include <utility>
#include <vector>

#include "bindings_common.h"
#include "jax_mla/plan_layout.h"
#include "plan_mla.h"
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
    if (JAX_MLA_CUDA_SM90A) {
      bodies.append("wgmma warp-specialised sm_90a kernel (compute capability 9.0)");
      // Units of more than 16 rows on a 16-bit cache, every page size.
      bodies.append("16-bit wide units: 64-key body, blocks by TMA on pages of 32+ keys, as TMA boxes of a page "
                    "on pages of 8-16 keys, gathered by cp.async on smaller pages; those gathers issued by a "
                    "producer warpgroup above 16 heads (sm_90a)");
      // The walk (ffi/cuda/mla_wide64_walk_sm90.cuh): where the plan holds many units a worker, or for every
      // such call in the A/B build (CMake option JAX_MLA_WIDE64_WALK=ON).
      bodies.append(JAX_MLA_CUDA_WIDE64_WALK
                        ? "16-bit wide units at a multiple of 64 heads on pages of 32+ keys: the 64-key body's walk, "
                          "one block per SM and head block (sm_90a, JAX_MLA_WIDE64_WALK=ON, an A/B build)"
                        : "16-bit wide units at a multiple of 64 heads on pages of 32+ keys: the 64-key body in "
                          "waves, one block a unit, or walked (one block per SM and head block) where the plan "
                          "has 6+ rows a worker (sm_90a)");
      // Units of at most 16 rows on an e4m3 ckv (CMake option JAX_MLA_NARROW_FP8_MMA_SYNC picks).
      bodies.append(JAX_MLA_CUDA_NARROW_FP8_MMA_SYNC ? "fp8 narrow units: mma.sync body (sm_90a)"
                                                     : "fp8 narrow units: transposed e4m3 wgmma body (sm_90a)");
      // Units of 64 heads or more on an e4m3 ckv (pages of >= 32 keys).
      bodies.append("fp8 wide units of 64+ heads: 64-key body, each block turned into fp16 in its buffer (sm_90a)");
      bodies.append("fp8 wide units of 64+ heads with fp8_products: 64-key body on e4m3 products, lossy (sm_90a)");
    }
  }
  cuda["bodies"] = bodies;
  info["cuda"] = cuda;
  return info;
}

using Lengths = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Table = nb::ndarray<nb::numpy, int32_t, nb::ndim<2>>;

// A NumPy array that owns the vector's buffer (no copy).
Table to_numpy(std::vector<int32_t>&& v, size_t rows, size_t cols) {
  auto* held = new std::vector<int32_t>(std::move(v));
  nb::capsule owner(held, [](void* p) noexcept { delete static_cast<std::vector<int32_t>*>(p); });
  return Table(held->data(), {rows, cols}, owner);
}

// jax_mla.planner.plan_mla's native path: its Python wrapper has checked dtypes, ranks, shapes and
// the scalar arguments, and builds the MLAPlan from the returned tuple.
nb::tuple plan(Lengths qo_lens, Lengths kv_lens, int64_t num_heads, int64_t page_size, int64_t num_tokens,
               int64_t max_pages_per_request, int64_t num_workers, double units_per_worker, int64_t min_chunk,
               int64_t chunk_align, int64_t unit_overhead, int64_t min_work_units, int64_t min_partial_rows) {
  if (qo_lens.shape(0) != kv_lens.shape(0)) throw nb::value_error("qo_lens and kv_lens differ in length");
  jax_mla::PlanRequest req;
  req.qo_lens = qo_lens.data();
  req.kv_lens = kv_lens.data();
  req.num_requests = (int64_t)qo_lens.shape(0);
  req.num_heads = num_heads;
  req.page_size = page_size;
  req.num_tokens = num_tokens;
  req.max_pages_per_request = max_pages_per_request;
  req.num_workers = num_workers;
  req.units_per_worker = units_per_worker;
  req.min_chunk = min_chunk;
  req.chunk_align = chunk_align;
  req.unit_overhead = unit_overhead;
  req.min_work_units = min_work_units;
  req.min_partial_rows = min_partial_rows;
  jax_mla::Plan p;
  try {
    p = jax_mla::plan_mla(req);
  } catch (const jax_mla::PlanError& e) {
    throw nb::value_error(e.what());
  }
  return nb::make_tuple(to_numpy(std::move(p.work), p.num_work, jax_mla::kWorkCols),
                        to_numpy(std::move(p.merge), p.num_merge, jax_mla::kMergeCols),
                        to_numpy(std::move(p.tokens), p.num_tokens, 2), p.num_tokens, p.q_tile,
                        p.num_partial_rows);
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "jax_mla's CPU XLA FFI handler and build facts (see jax_mla.build_info()).";
  m.def("registrations", []() { return jax_mla::attention_registrations(JaxMlaPagedAttentionCpu); },
        "XLA FFI target name -> handler capsule, for platform 'cpu'.");
  m.def("build_info", &build_info, "What the native libraries were built with and for.");
  m.def("plan_mla", &plan,
        "The host planner's native path (ffi/planner/plan_mla.h): (work, merge, tokens, num_tokens, "
        "q_tile, num_partial_rows). Use jax_mla.plan_mla.");
}
