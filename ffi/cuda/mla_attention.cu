// XLA FFI handler of the paged MLA op on CUDA: checks shapes, then launches the
// attention kernel (one block per work unit and head block) and the merge
// kernel on XLA's stream. No allocation, no synchronisation and no read of
// device data on the host, so XLA may record it into a command buffer (CUDA
// graph). The split workspace comes in as two of XLA's result buffers.
#include <cuda_runtime.h>

#include <string>

#include "mla_launch.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_mla {
namespace cuda {
namespace {

std::string dims_str(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

ffi::Error bad(const std::string& msg) { return ffi::Error::InvalidArgument("jax_mla CUDA: " + msg); }

ffi::Error paged_attention_cuda(cudaStream_t stream, ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe, ffi::AnyBuffer ckv,
                                ffi::AnyBuffer kpe, ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> kv_lens,
                                ffi::Buffer<ffi::S32> work, ffi::Buffer<ffi::S32> merge,
                                ffi::Buffer<ffi::F32> ckv_scale, ffi::Buffer<ffi::F32> kpe_scale,
                                ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                ffi::Result<ffi::AnyBuffer> partial_o,
                                ffi::Result<ffi::Buffer<ffi::F32>> partial_lse, float sm_scale,
                                int32_t fp8_products) {
  const auto qd = q_nope.dimensions(), rd = q_pe.dimensions(), cd = ckv.dimensions(), kd = kpe.dimensions();
  const auto pd = page_table.dimensions(), ld = kv_lens.dimensions();
  const auto wd = work.dimensions(), md = merge.dimensions();
  const auto od = out->dimensions(), sd = lse->dimensions();
  const auto pod = partial_o->dimensions(), psd = partial_lse->dimensions();
  if (qd.size() != 3 || rd.size() != 3 || cd.size() != 3 || kd.size() != 3) {
    return bad("q_nope, q_pe, ckv, kpe must have rank 3; got " + dims_str(qd) + ", " + dims_str(rd) + ", " +
               dims_str(cd) + ", " + dims_str(kd));
  }
  if (pd.size() != 2 || ld.size() != 1 || wd.size() != 2 || md.size() != 2) {
    return bad("page_table/kv_lens/work/merge ranks must be 2/1/2/2");
  }
  const int64_t T = qd[0], H = qd[1], P = cd[0], ps = cd[1];
  if (qd[2] != kDimCkv || rd[2] != kDimKpe || cd[2] != kDimCkv || kd[2] != kDimKpe) {
    return bad("built for d_ckv=512, d_kpe=64; got q_nope " + dims_str(qd) + ", q_pe " + dims_str(rd));
  }
  if (rd[0] != T || rd[1] != H || kd[0] != P || kd[1] != ps) return bad("q_pe/kpe disagree with q_nope/ckv");
  if (wd[1] != kWorkCols || md[1] != kMergeCols) return bad("plan tables have the wrong number of columns");
  if (od.size() != 3 || od[0] != T || od[1] != H || od[2] != kDimCkv || sd.size() != 2 || sd[0] != T ||
      sd[1] != H) {
    return bad("out/lse shapes " + dims_str(od) + ", " + dims_str(sd) + " do not match q_nope " + dims_str(qd));
  }
  if (pod.size() != 3 || psd.size() != 2 || pod[1] != H || pod[2] != kDimCkv || psd[0] != pod[0] ||
      psd[1] != H) {
    return bad("workspace shapes " + dims_str(pod) + ", " + dims_str(psd) + " are inconsistent");
  }
  if (ckv_scale.element_count() != 1 || kpe_scale.element_count() != 1) {
    return bad("ckv_scale and kpe_scale must hold one float32 each");
  }
  const ffi::DataType dt = q_nope.element_type();
  if (q_pe.element_type() != dt || out->element_type() != dt || partial_o->element_type() != dt) {
    return bad("q_nope, q_pe, out and the partial_o workspace must share one dtype");
  }
  // The cache: the queries' dtype, or an fp8 ckv (kpe fp8 or the queries' dtype) with bf16 / fp16 queries.
  const bool ckv_fp8 = ckv.element_type() == ffi::DataType::F8E4M3FN;
  const bool kpe_fp8 = kpe.element_type() == ffi::DataType::F8E4M3FN;
  if ((!ckv_fp8 && ckv.element_type() != dt) || (!kpe_fp8 && kpe.element_type() != dt) || (kpe_fp8 && !ckv_fp8)) {
    return bad("ckv and kpe must have q_nope's dtype, or be float8_e4m3fn (ckv, or both)");
  }
  const int cache = !ckv_fp8 ? kCacheAsQuery : kpe_fp8 ? kCacheFp8CkvKpe : kCacheFp8Ckv;
  if (cache != kCacheAsQuery && dt != ffi::DataType::BF16 && dt != ffi::DataType::F16) {
    return bad("an fp8 cache takes bfloat16 or float16 queries");
  }
  if (ps < 1 || ps > kMaxPageSize || (ps & (ps - 1)) != 0) {
    return bad("page_size " + std::to_string(ps) + " is not a power of two <= " + std::to_string(kMaxPageSize));
  }
  if (H < 1) return bad("need at least one head");
  const int64_t R = pd[0], max_pages = pd[1];
  if (T == 0) return ffi::Error::Success();
  if (T > INT32_MAX || P > INT32_MAX || wd[0] > INT32_MAX || md[0] > INT32_MAX || pod[0] > INT32_MAX) {
    return bad("operand too large for 32-bit indexing");
  }

  Problem p{};
  p.q_nope = q_nope.untyped_data();
  p.q_pe = q_pe.untyped_data();
  p.ckv = ckv.untyped_data();
  p.kpe = kpe.untyped_data();
  p.page_table = page_table.typed_data();
  p.kv_lens = kv_lens.typed_data();
  p.work = work.typed_data();
  p.merge = merge.typed_data();
  p.ckv_scale = ckv_scale.typed_data();
  p.kpe_scale = kpe_scale.typed_data();
  p.out = out->untyped_data();
  p.lse = lse->typed_data();
  p.partial_o = partial_o->untyped_data();
  p.partial_lse = partial_lse->typed_data();
  set_problem_sizes(p, T, H, P, ps, R, max_pages, ld[0], wd[0], md[0], pod[0], sm_scale);
  p.fp8_products = fp8_products != 0 && cache == kCacheFp8Ckv;
  if ((int64_t)p.num_work * p.head_blocks > INT32_MAX) return bad("too many work units");

  static const int merge_grid = merge_grid_for(sm_count());
  cudaError_t err;
  switch (dt) {
    case ffi::DataType::BF16:
      err = cache == kCacheFp8Ckv      ? launch<__nv_bfloat16, kCacheFp8Ckv>(p, stream, merge_grid)
            : cache == kCacheFp8CkvKpe ? launch<__nv_bfloat16, kCacheFp8CkvKpe>(p, stream, merge_grid)
                                       : launch<__nv_bfloat16>(p, stream, merge_grid);
      break;
    case ffi::DataType::F16:
      err = cache == kCacheFp8Ckv      ? launch<__half, kCacheFp8Ckv>(p, stream, merge_grid)
            : cache == kCacheFp8CkvKpe ? launch<__half, kCacheFp8CkvKpe>(p, stream, merge_grid)
                                       : launch<__half>(p, stream, merge_grid);
      break;
    case ffi::DataType::F32:
      err = launch<float>(p, stream, merge_grid);
      break;
    default:
      return bad("dtype must be bfloat16, float16 or float32");
  }
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("jax_mla CUDA launch: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cuda
}  // namespace jax_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaPagedAttentionCuda, jax_mla::cuda::paged_attention_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()            // q_nope
                                  .Arg<ffi::AnyBuffer>()            // q_pe
                                  .Arg<ffi::AnyBuffer>()            // ckv
                                  .Arg<ffi::AnyBuffer>()            // kpe
                                  .Arg<ffi::Buffer<ffi::S32>>()     // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()     // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()     // work
                                  .Arg<ffi::Buffer<ffi::S32>>()     // merge
                                  .Arg<ffi::Buffer<ffi::F32>>()     // ckv_scale [1] (fp8 caches; else 1)
                                  .Arg<ffi::Buffer<ffi::F32>>()     // kpe_scale [1]
                                  .Ret<ffi::AnyBuffer>()            // out
                                  .Ret<ffi::Buffer<ffi::F32>>()     // lse
                                  .Ret<ffi::AnyBuffer>()            // partial_o (workspace, out's dtype)
                                  .Ret<ffi::Buffer<ffi::F32>>()     // partial_lse (workspace)
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("fp8_products"),  // 1: e4m3 products allowed (lossy)
                              {xla::ffi::Traits::kCmdBufferCompatible});

// ---- What the Python binding (ffi/bindings/cuda_module.cc) asks before it registers the handler.
// Plain C so that the binding compiles without CUDA headers.

// The CUDA runtime this library was compiled and statically linked with (CUDART_VERSION, e.g. 13000).
extern "C" int JaxMlaCudaRuntimeVersion() { return CUDART_VERSION; }

// cudaGetDeviceCount / cudaDriverGetVersion; return a cudaError_t.
extern "C" int JaxMlaCudaDeviceCount(int* count) {
  const cudaError_t err = cudaGetDeviceCount(count);
  cudaGetLastError();
  return (int)err;
}
extern "C" int JaxMlaCudaDriverVersion(int* version) { return (int)cudaDriverGetVersion(version); }
extern "C" const char* JaxMlaCudaErrorString(int err) { return cudaGetErrorString((cudaError_t)err); }

// Can this library run on `device`? Sets its compute capability (e.g. 90) and which attention kernel
// the launch code picks there (1 portable mma.sync, 2 sm_90a wgmma), and returns the cudaError_t of
// asking for that kernel's attributes: cudaErrorNoKernelImageForDevice when the library holds no code
// for the device's arch. Restores the caller's current device.
extern "C" int JaxMlaCudaDeviceStatus(int device, int* compute_capability, int* kernel) {
  namespace jc = jax_mla::cuda;
  int previous = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err == cudaSuccess) err = cudaSetDevice(device);
  if (err == cudaSuccess) {
    *compute_capability = jc::compute_capability(device);
    cudaFuncAttributes attrs{};
#ifdef JAX_MLA_SM90A_BUILT
    const bool sm90 = *compute_capability == 90;
#else
    const bool sm90 = false;
#endif
    *kernel = sm90 ? 2 : 1;
    err = sm90 ? cudaFuncGetAttributes(&attrs, jc::mla_attention_sm90_kernel<__nv_bfloat16>)
               : cudaFuncGetAttributes(&attrs, jc::mla_attention_kernel<__nv_bfloat16>);
    if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, jc::mla_merge_kernel<__nv_bfloat16>);
    cudaSetDevice(previous);
  }
  cudaGetLastError();  // leave no sticky error behind for XLA
  return (int)err;
}
