// CPU handler of jax_mla's paged MLA attention (absorbed form).
//
// It follows the host plan exactly as the CUDA kernel does (plan_layout.h):
// every work unit computes one query tile of one request against one kv range
// with an online softmax in float32, writing either the final output or a
// float32 partial; then every merge row combines the partials of a split tile
// by their LSEs. Running the plan this way on CPU means the planner's split and
// merge logic is exercised in CI, not only on the GPU.
//
// Robustness: the handler never reads out of bounds, whatever the device
// values. Page ids outside [0, P) contribute nothing, kv lengths are clipped to
// the page table's capacity, unknown requests see no keys, and plan rows that
// point outside the output or workspace are skipped.
//
// The pieces: problem.h (operands and plan rows decoded), unit_kernel.h (one
// work unit), merge.h (split tiles combined), parallel_for.h (threads).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "common.h"
#include "element_types.h"
#include "jax_mla/plan_layout.h"
#include "merge.h"
#include "parallel_for.h"
#include "problem.h"
#include "unit_kernel.h"
#include "xla/ffi/api/ffi.h"

namespace jax_mla {
namespace cpu {

namespace ffi = xla::ffi;

std::string ShapeStr(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

ffi::Error CheckRank(const char* name, ffi::AnyBuffer::Dimensions d, size_t rank) {
  if (d.size() != rank) {
    return ffi::Error::InvalidArgument(std::string(name) + " must have rank " + std::to_string(rank) +
                                       ", got shape " + ShapeStr(d));
  }
  return ffi::Error::Success();
}

ffi::Error Mismatch(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_mla paged attention (cpu): " + what);
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool& pool, ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe, ffi::AnyBuffer ckv,
                              ffi::AnyBuffer kpe, ffi::Buffer<ffi::S32> page_table,
                              ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> work,
                              ffi::Buffer<ffi::S32> merge, ffi::Buffer<ffi::F32> ckv_scale,
                              ffi::Buffer<ffi::F32> kpe_scale, float sm_scale,
                              ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                              ffi::Result<ffi::AnyBuffer> partial_o,
                              ffi::Result<ffi::Buffer<ffi::F32>> partial_lse) {
  const struct {
    const char* name;
    ffi::AnyBuffer::Dimensions dims;
    size_t rank;
  } ranks[] = {
      {"q_nope", q_nope.dimensions(), 3},     {"q_pe", q_pe.dimensions(), 3},
      {"ckv", ckv.dimensions(), 3},           {"kpe", kpe.dimensions(), 3},
      {"page_table", page_table.dimensions(), 2}, {"kv_lens", kv_lens.dimensions(), 1},
      {"work", work.dimensions(), 2},         {"merge", merge.dimensions(), 2},
      {"out", out->dimensions(), 3},          {"lse", lse->dimensions(), 2},
      {"partial_o", partial_o->dimensions(), 3}, {"partial_lse", partial_lse->dimensions(), 2},
  };
  for (const auto& r : ranks) {
    if (ffi::Error e = CheckRank(r.name, r.dims, r.rank); !e.success()) return e;
  }

  Problem pb;
  switch (q_nope.element_type()) {
    case ffi::F32: pb.elem = Elem::kF32; break;
    case ffi::BF16: pb.elem = Elem::kBF16; break;
    case ffi::F16: pb.elem = Elem::kF16; break;
    default: return Mismatch("q_nope must be float32, bfloat16 or float16");
  }
  for (ffi::DataType t : {q_pe.element_type(), out->element_type(), partial_o->element_type()}) {
    if (t != q_nope.element_type()) return Mismatch("q_pe, out and the partial_o workspace must have q_nope's dtype");
  }
  pb.elem_bytes = ElemBytes(pb.elem);
  // The caches: q's dtype, or float8_e4m3fn (value = fp8 x scale; the Python side checks the rest).
  const bool ckv_fp8 = ckv.element_type() == ffi::F8E4M3FN, kpe_fp8 = kpe.element_type() == ffi::F8E4M3FN;
  if ((!ckv_fp8 && ckv.element_type() != q_nope.element_type()) ||
      (!kpe_fp8 && kpe.element_type() != q_nope.element_type())) {
    return Mismatch("ckv and kpe must have q_nope's dtype or be float8_e4m3fn");
  }
  if (ckv_scale.element_count() != 1 || kpe_scale.element_count() != 1) {
    return Mismatch("ckv_scale and kpe_scale must hold one float32 each");
  }
  pb.ckv_elem = ckv_fp8 ? Elem::kF8E4M3 : pb.elem;
  pb.kpe_elem = kpe_fp8 ? Elem::kF8E4M3 : pb.elem;
  pb.ckv_bytes = ElemBytes(pb.ckv_elem);
  pb.kpe_bytes = ElemBytes(pb.kpe_elem);
  // Host memory on the CPU platform: the scales are read here, once per call.
  pb.ckv_scale = ckv_fp8 ? ckv_scale.typed_data()[0] : 1.0f;
  pb.kpe_scale = kpe_fp8 ? kpe_scale.typed_data()[0] : 1.0f;

  const auto qn = q_nope.dimensions(), qp = q_pe.dimensions();
  const auto kc = ckv.dimensions(), kr = kpe.dimensions();
  pb.num_tokens = qn[0];
  pb.num_heads = qn[1];
  pb.d_ckv = qn[2];
  pb.d_kpe = qp[2];
  pb.num_pages = kc[0];
  pb.page_size = kc[1];
  if (qp[0] != qn[0] || qp[1] != qn[1]) {
    return Mismatch("q_pe " + ShapeStr(qp) + " disagrees with q_nope " + ShapeStr(qn));
  }
  if (kc[2] != pb.d_ckv || kr[0] != kc[0] || kr[1] != kc[1] || kr[2] != pb.d_kpe) {
    return Mismatch("caches ckv " + ShapeStr(kc) + " / kpe " + ShapeStr(kr) +
                    " disagree with q_nope " + ShapeStr(qn) + " / q_pe " + ShapeStr(qp));
  }
  if (pb.page_size < 1) return Mismatch("page_size must be >= 1");
  if (work.dimensions()[1] != kWorkCols || merge.dimensions()[1] != kMergeCols) {
    return Mismatch("plan tables must be [W, 8] and [M, 4], got work " + ShapeStr(work.dimensions()) +
                    " and merge " + ShapeStr(merge.dimensions()));
  }
  const auto od = out->dimensions(), ld = lse->dimensions();
  const auto pod = partial_o->dimensions(), pld = partial_lse->dimensions();
  if (od[0] != qn[0] || od[1] != qn[1] || od[2] != qn[2] || ld[0] != qn[0] || ld[1] != qn[1]) {
    return Mismatch("out " + ShapeStr(od) + " / lse " + ShapeStr(ld) + " do not match q_nope " + ShapeStr(qn));
  }
  if (pod[1] != qn[1] || pod[2] != qn[2] || pld[0] != pod[0] || pld[1] != qn[1]) {
    return Mismatch("workspace partial_o " + ShapeStr(pod) + " / partial_lse " + ShapeStr(pld) +
                    " do not match q_nope " + ShapeStr(qn));
  }
  pb.max_pages = page_table.dimensions()[1];
  pb.num_requests = std::min<int64_t>(page_table.dimensions()[0], kv_lens.dimensions()[0]);
  pb.num_work = work.dimensions()[0];
  pb.num_merge = merge.dimensions()[0];
  pb.num_partial_rows = pod[0];
  pb.sm_scale = sm_scale;
  pb.q_nope = static_cast<const char*>(q_nope.untyped_data());
  pb.q_pe = static_cast<const char*>(q_pe.untyped_data());
  pb.ckv = static_cast<const char*>(ckv.untyped_data());
  pb.kpe = static_cast<const char*>(kpe.untyped_data());
  pb.page_table = page_table.typed_data();
  pb.kv_lens = kv_lens.typed_data();
  pb.work = work.typed_data();
  pb.merge = merge.typed_data();
  pb.out = static_cast<char*>(out->untyped_data());
  pb.lse = lse->typed_data();
  pb.partial_o = static_cast<char*>(partial_o->untyped_data());
  pb.partial_lse = partial_lse->typed_data();

  // Tokens no unit covers (padding) come out as zeros with LSE -inf; workspace
  // LSEs start at -inf so a split that a bad plan row skipped weighs nothing.
  const int64_t rows_total = pb.num_tokens * pb.num_heads;
  if (rows_total > 0) {
    std::memset(pb.out, 0, static_cast<size_t>(rows_total * pb.d_ckv * pb.elem_bytes));
    std::fill(pb.lse, pb.lse + rows_total, kNegInf);
  }
  std::fill(pb.partial_lse, pb.partial_lse + pb.num_partial_rows * pb.num_heads, kNegInf);

  // Live units, their size, and the work they amount to.
  std::vector<Unit> units;
  units.reserve(static_cast<size_t>(pb.num_work));
  int64_t max_q_len = 0, macs = 0;
  for (int64_t w = 0; w < pb.num_work; ++w) {
    Unit u;
    if (!DecodeUnit(pb, w, &u)) continue;
    units.push_back(u);
    max_q_len = std::max(max_q_len, u.q_len);
    macs += u.q_len * pb.num_heads * (UnitKeys(u) * (2 * pb.d_ckv + pb.d_kpe) + pb.d_ckv);
  }

  const int available = AvailableThreads(pool);
  const int unit_threads = ThreadsFor(static_cast<int64_t>(units.size()), macs, available);
  std::vector<Scratch> scratch;
  scratch.reserve(unit_threads);
  for (int t = 0; t < unit_threads; ++t) scratch.emplace_back(pb, max_q_len * pb.num_heads, max_q_len);
  ParallelFor(pool, static_cast<int64_t>(units.size()), unit_threads,
              [&](int64_t i, int tid) { RunUnit(pb, units[i], scratch[tid]); });

  // Merges read what the units wrote: only after the join above.
  int64_t merge_macs = 0;
  for (int64_t m = 0; m < pb.num_merge; ++m) {
    const int32_t* row = pb.merge + m * kMergeCols;
    merge_macs += std::max(row[kMergeQLen], 0) * int64_t{std::max(row[kMergeNumSplits], 0)} *
                  pb.num_heads * pb.d_ckv;
  }
  const int merge_threads = ThreadsFor(pb.num_merge, merge_macs, available);
  std::vector<std::vector<float>> merge_acc(merge_threads, std::vector<float>(2 * pb.d_ckv));
  ParallelFor(pool, pb.num_merge, merge_threads,
              [&](int64_t m, int tid) { RunMerge(pb, m, merge_acc[tid]); });
  return ffi::Error::Success();
}

// No C++ exception may cross into XLA.
ffi::Error PagedAttentionCpu(ffi::ThreadPool pool, ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe, ffi::AnyBuffer ckv,
                             ffi::AnyBuffer kpe, ffi::Buffer<ffi::S32> page_table,
                             ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> work,
                             ffi::Buffer<ffi::S32> merge, ffi::Buffer<ffi::F32> ckv_scale,
                             ffi::Buffer<ffi::F32> kpe_scale, float sm_scale, int32_t fp8_products,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                             ffi::Result<ffi::AnyBuffer> partial_o,
                             ffi::Result<ffi::Buffer<ffi::F32>> partial_lse) {
  // fp8_products allows e4m3 x e4m3 products where a kernel has them (the CUDA 64-key body); this handler
  // has none and computes every product in float32 either way.
  (void)fp8_products;
  try {
    return PagedAttentionImpl(pool, q_nope, q_pe, ckv, kpe, page_table, kv_lens, work, merge, ckv_scale,
                              kpe_scale, sm_scale, out, lse, partial_o, partial_lse);
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jax_mla paged attention (cpu): ") + e.what());
  }
}

}  // namespace cpu
}  // namespace jax_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaPagedAttentionCpu, jax_mla::cpu::PagedAttentionCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()                     // XLA's intra-op pool
                                  .Arg<xla::ffi::AnyBuffer>()                      // q_nope
                                  .Arg<xla::ffi::AnyBuffer>()                      // q_pe
                                  .Arg<xla::ffi::AnyBuffer>()                      // ckv
                                  .Arg<xla::ffi::AnyBuffer>()                      // kpe
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()          // page_table
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()          // kv_lens
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()          // work
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()          // merge
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()          // ckv_scale [1]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()          // kpe_scale [1]
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("fp8_products")                   // (no e4m3 products here)
                                  .Ret<xla::ffi::AnyBuffer>()                      // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()          // lse
                                  .Ret<xla::ffi::AnyBuffer>()                      // partial_o (out's dtype)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());        // partial_lse
