// Host-side launch of the op's kernels for one problem (used by the XLA FFI
// handler and by the standalone sanitizer harness, benchmarks/sanitize_harness.cu).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "mla_attention_f32_kernel.cuh"
#include "mla_attention_kernel.cuh"
#include "mla_merge_kernel.cuh"
#include "mla_sm90_kernel.cuh"
#include "mla_wide64_walk_sm90.cuh"

namespace jax_mla {
namespace cuda {

constexpr int kMaxDevices = 64;

inline int sm_count() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count <= 0) {
    cudaGetLastError();  // clear; fall back to the H200's count
    return 132;
  }
  return count;
}

// A property of the current device, computed once per device (legal during
// stream capture: no call here enqueues work). `compute` returns 1 (no) or 2 (yes).
template <typename Compute>
inline bool per_device_once(std::atomic<int> (&cache)[kMaxDevices], Compute compute) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (device >= 0 && device < kMaxDevices) {
    const int c = cache[device].load(std::memory_order_acquire);
    if (c != 0) return c == 2;
  }
  const int v = compute(device);
  if (v != 0 && device >= 0 && device < kMaxDevices) cache[device].store(v, std::memory_order_release);
  return v == 2;
}

inline int compute_capability(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return 10 * major + minor;
}

// Programmatic dependent launch needs compute capability 9.0.
inline bool supports_dependent_launch() {
  static std::atomic<int> cached[kMaxDevices] = {};
  return per_device_once(cached, [](int device) { return compute_capability(device) >= 90 ? 2 : 1; });
}

// The sm_90a kernel (warp-specialised wgmma body for wide units) runs on
// compute capability 9.0 when the library holds sm_90a code (CMake defines
// JAX_MLA_SM90A_BUILT when CMAKE_CUDA_ARCHITECTURES names 90a); otherwise the
// portable kernel (mma.sync) runs.
inline bool use_sm90_kernel() {
#ifdef JAX_MLA_SM90A_BUILT
  static std::atomic<int> cached[kMaxDevices] = {};
  return per_device_once(cached, [](int device) { return compute_capability(device) == 90 ? 2 : 1; });
#else
  return false;
#endif
}

// Launches kKernel with `smem_bytes` of dynamic shared memory, raising its limit first (once per
// device and kernel: the cache is this instance's own).
template <auto kKernel, typename... Args>
inline cudaError_t launch_with_smem(int blocks, int threads, int smem_bytes, cudaStream_t stream, const Args&... args) {
  static std::atomic<int> raised[kMaxDevices] = {};
  cudaError_t err = cudaSuccess;
  per_device_once(raised, [&](int) {
    err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    return err == cudaSuccess ? 2 : 0;
  });
  if (err != cudaSuccess) return err;
  kKernel<<<blocks, threads, smem_bytes, stream>>>(args...);
  return cudaGetLastError();
}

// cuTensorMapEncodeTiled from the driver, found once through the runtime (no
// link against libcuda); null where the driver lacks it.
inline decltype(&cuTensorMapEncodeTiled) tensor_map_encoder() {
  static const auto fn = []() -> decltype(&cuTensorMapEncodeTiled) {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<decltype(&cuTensorMapEncodeTiled)>(f);
  }();
  return fn;
}

// A 2-D tensor map of `rows` rows of `dims` elements (`bytes` each) at `data`, in boxes of 128 bytes x box_rows
// rows in the 128-byte swizzle (the wgmma bodies' panels); false where encoding fails.
inline bool encode_row_boxes(decltype(&cuTensorMapEncodeTiled) encode, CUtensorMap* map, CUtensorMapDataType dtype,
                             const void* data, uint64_t dims, uint64_t rows, int bytes, int box_rows,
                             CUtensorMapL2promotion promotion) {
  const cuuint64_t size[2] = {dims, rows};
  const cuuint64_t stride[1] = {dims * bytes};  // bytes between rows
  const cuuint32_t box[2] = {128u / bytes, (cuuint32_t)box_rows};
  const cuuint32_t step[2] = {1, 1};
  return encode(map, dtype, 2, const_cast<void*>(data), size, stride, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The wide body's TMA descriptors of the caches (a host computation: no device
// work, legal during stream capture). Left disabled for an fp8 kpe (that cache takes the
// portable body), page sizes below a key block, and where encoding fails. An fp8 ckv is
// described as bytes in boxes of 128 (one 128-byte swizzled row of raw e4m3 per key,
// wide_producer_fp8); kpe and a ckv of the queries' type in boxes of 64 dims (128 bytes). A box
// is box_rows keys (at most a page): the producer body's 32-key blocks (and the fp8 narrow body's
// halves), the 64-key body's blocks in one box on pages of 64 keys or more (half the copies), or a
// page of 8-16 keys for that body's gathering instance.
// L2 promotion: an fp8 ckv's box rows are 128 bytes of a 512-byte key row, and 256-byte promotion
// made the fp8 narrow body's boxes ~6% slower from DRAM than its cp.async gathers, 128 bytes (a box
// row) or none as fast (ffi/cuda/NOTES.md, "TMA for the fp8 narrow producer"): an fp8 cache's maps
// promote 128 bytes. 16-bit caches keep 256 (half of a 1024-byte row; not measured against less).
template <typename T, int kCache>
inline KeyTensorMaps key_tensor_maps(const Problem& p, int box_rows = WideSm90::BK) {
  KeyTensorMaps maps = {};
  maps.box_rows = box_rows;
  const uint64_t rows = (uint64_t)p.num_pages * (uint64_t)p.page_size;
  if constexpr (kCache != kCacheFp8CkvKpe && (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>)) {
    const auto encode = tensor_map_encoder();
    if (encode == nullptr || p.page_size < box_rows || rows == 0 || rows > (1ull << 31)) return maps;
    const CUtensorMapL2promotion promotion =
        kCache == kCacheFp8Ckv ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
    const CUtensorMapDataType type =
        std::is_same_v<T, __nv_bfloat16> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    auto make = [&](CUtensorMap* map, const void* data, uint64_t dims, CUtensorMapDataType dtype, int bytes) {
      return encode_row_boxes(encode, map, dtype, data, dims, rows, bytes, box_rows, promotion);  // one key block
    };
    const bool ckv_ok = kCache == kCacheFp8Ckv ? make(&maps.ckv, p.ckv, kDimCkv, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1)
                                               : make(&maps.ckv, p.ckv, kDimCkv, type, (int)sizeof(T));
    maps.enabled = ckv_ok && make(&maps.kpe, p.kpe, kDimKpe, type, (int)sizeof(T)) ? 1 : 0;
  }
  return maps;
}

// The walk's query maps (mla_wide64_walk_sm90.cuh): q_nope and q_pe as [tokens * heads] rows, boxes of
// 64 rows x 128 bytes in the 128-byte swizzle. Disabled where the encoder is missing or fails, or the
// rows do not fit the kernel's int row index.
template <typename T>
inline QueryTensorMaps query_tensor_maps(const Problem& p) {
  QueryTensorMaps maps = {};
  const auto encode = tensor_map_encoder();
  const uint64_t rows = (uint64_t)p.num_tokens * (uint64_t)p.num_heads;
  if (encode == nullptr || rows == 0 || rows >= (1ull << 31)) return maps;
  const CUtensorMapDataType type =
      std::is_same_v<T, __nv_bfloat16> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  auto make = [&](CUtensorMap* map, const void* data, uint64_t dims) {
    return encode_row_boxes(encode, map, type, data, dims, rows, (int)sizeof(T), kRowsPerTile,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
  };
  maps.enabled = make(&maps.nope, p.q_nope, kDimCkv) && make(&maps.pe, p.q_pe, kDimKpe) ? 1 : 0;
  return maps;
}

// A gathering instance of the 64-key body (kGather; kPageBoxes: boxes of one page), with or without its
// producer warpgroup: the instance and its thread count chosen together.
template <typename T, int kCache, bool kPageBoxes>
inline cudaError_t launch_gathered(bool producer, int blocks, cudaStream_t stream, const Problem& p,
                                   const KeyTensorMaps& maps) {
  return producer ? launch_with_smem<mla_attention_sm90_kernel<T, kCache, true, false, true, kPageBoxes, true>>(
                        blocks, sm90_kernel_threads<true, true>(), kSm90SmemBytes, stream, p, maps)
                  : launch_with_smem<mla_attention_sm90_kernel<T, kCache, true, false, true, kPageBoxes>>(
                        blocks, sm90_kernel_threads<true>(), kSm90SmemBytes, stream, p, maps);
}

// The attention kernel: one block per work unit and head block. kCache: how the
// cache is stored (mla_fp8.cuh; fp8 only with bf16 / fp16 queries).
template <typename T, int kCache = kCacheAsQuery>
inline cudaError_t launch_attention(const Problem& p, cudaStream_t stream) {
  const int blocks = p.num_work * p.head_blocks;
  if (blocks <= 0) return cudaSuccess;
  if constexpr (std::is_same_v<T, float>) {
    static_assert(kCache == kCacheAsQuery, "fp8 caches take bf16 / fp16 queries");
    mla_attention_f32_kernel<<<blocks, kThreads, 0, stream>>>(p);
  } else {
    if (use_sm90_kernel()) {
#ifndef JAX_MLA_NO_WIDE64  // (an A/B switch: every wide unit on the producer / two-consumer body)
#ifdef JAX_MLA_FP8_NO_WIDE64  // (an A/B switch: fp8 wide units on the producer body, which converts)
      constexpr bool kWide64Cache = kCache == kCacheAsQuery;
#else
      constexpr bool kWide64Cache = kCache != kCacheFp8CkvKpe;
#endif
      if constexpr (kWide64Cache) {
        // A cache read by TMA: the instance with the 64-key body. A 16-bit cache takes it at every
        // head count: its units of 17-63 rows (16 heads x 2-4 tokens, 20-32 heads; q_len folded into
        // the rows) ran 6-11% faster on the 64-key body than on v5b's producer body in the driver
        // (0.4-7% through JAX), and its narrow units run the same narrow body here
        // (ffi/cuda/NOTES.md, "wide units of every head count on the 64-key body"). An fp8 ckv takes
        // it at 64 heads or more; with fewer, its narrow units want the fp8 narrow body's producer
        // warpgroup (the 384-thread instance), and its wider units v5b's converting producer. An fp8
        // block is converted to fp16 in its buffer by the warpgroup that multiplies it ("fp8 on the
        // 64-key body"). -DJAX_MLA_WIDE64_FROM_64_HEADS: a 16-bit cache too only at 64 heads or more
        // (the rule before; an A/B switch).
#ifdef JAX_MLA_WIDE64_FROM_64_HEADS
        if (p.num_heads >= Wide64Sm90::ROWS) {
#else
        if (kCache == kCacheAsQuery || p.num_heads >= Wide64Sm90::ROWS) {
#endif
          const KeyTensorMaps maps =
              key_tensor_maps<T, kCache>(p, p.page_size >= Wide64Sm90::BK ? Wide64Sm90::BK : WideSm90::BK);
          if (maps.enabled) {
#ifndef JAX_MLA_WIDE64_NO_WALK  // (an A/B switch: waves always)
            // A 16-bit cache at a multiple of 64 heads, where the plan holds many units a worker: one block per
            // SM and head block running its worker's units one after another (the walk,
            // mla_wide64_walk_sm90.cuh), the next unit's loads issued while the last one's rows are written.
            // The live unit count is device data; the plan's row capacity (a power of two under twice the
            // tiles) is what the launch sees: kWalkFromRows (plan_layout.h) rows a worker mean more than three
            // live units a worker on average (on 132 SMs 512 rows: over 3.9), and there the planner deals the
            // units to the least loaded worker. Against waves through JAX (H100): 264 x 2048 h128 (four units a
            // worker) 2.7% faster, 300 x U[1, 4096] h128 even (forty-fifth session); walked at one or two units
            // a worker, every other 64- and 128-head page-64 shape of the benchmark ran 1.3-3.2% slower, so those
            // stay in waves (ffi/cuda/NOTES.md, "thirty-ninth" to "forty-fifth session"). -DJAX_MLA_WIDE64_WALK:
            // every such call walks; -DJAX_MLA_WIDE64_NO_WALK: none (A/B builds; with
            // -DJAX_MLA_WIDE64_WALK_WORKERS=N on N blocks a head block, a test build in which every walk is long).
            if constexpr (kCache == kCacheAsQuery) {
              static_assert(Wide64Sm90::ROWS == kRowsPerTile, "the walk's head block is a plan tile's rows");
#ifdef JAX_MLA_WIDE64_WALK_WORKERS
              const int most = JAX_MLA_WIDE64_WALK_WORKERS;
#else
              const int most = std::max(1, sm_count() / p.head_blocks);
#endif
#ifdef JAX_MLA_WIDE64_WALK
              const bool walk = p.num_heads % kRowsPerTile == 0;
#else
              const bool walk = WalksUnits(p.num_heads, p.num_work, most);  // plan_layout.h, as the planners
#endif
              const QueryTensorMaps qmaps = walk ? query_tensor_maps<T>(p) : QueryTensorMaps{};
              if (qmaps.enabled) {
                const int workers = std::max(1, std::min(p.num_work, most));
                return launch_with_smem<mla_attention_wide64_walk_kernel<T>>(
                    workers * p.head_blocks, Wide64Sm90::kThreads, std::max(kSm90SmemBytes, kWalkSmemBytes), stream,
                    p, maps, qmaps);
              }
            }
#endif
            if constexpr (kCache == kCacheFp8Ckv) {
              // fp8_products: the instance whose 64-key units multiply on e4m3 (lossy; the caller's choice).
              if (p.fp8_products) {
                return launch_with_smem<mla_attention_sm90_kernel<T, kCache, true, true>>(
                    blocks, Wide64Sm90::kThreads, kSm90SmemBytes, stream, p, maps);
              }
            }
#ifndef JAX_MLA_WIDE64_NO_TMA_PRODUCER  // (an A/B switch: the consumers issue their boxes at every head count)
            // Above 16 heads a third warpgroup issues the boxes (wide64_tma_producer), as it gathers on small
            // pages, so that the consumers' trips carry no copies. On an H100, over the P_A-first schedule
            // alone, 2.1% and 3.8% faster at the 32-head extend shape in two calls, 1.5% and 2.1% at 32 x 4096
            // h128, decode within 1% (NOTES.md, "fifty-third" to "fifty-fifth session"). At 16 heads or fewer a launch may hold narrow units, which keep the
            // 256-thread instance.
            if constexpr (kCache == kCacheAsQuery) {
              if (p.num_heads > 16) {
                return launch_with_smem<mla_attention_sm90_kernel<T, kCache, true, false, false, false, true>>(
                    blocks, sm90_kernel_threads<true, true>(), kSm90SmemBytes, stream, p, maps);
              }
            }
#endif
            return launch_with_smem<mla_attention_sm90_kernel<T, kCache, true>>(blocks, Wide64Sm90::kThreads,
                                                                                 kSm90SmemBytes, stream, p, maps);
          }
#ifndef JAX_MLA_WIDE64_NO_GATHER  // (an A/B switch: pages under 32 keys on v5b's producer body, as before)
          // A 16-bit cache whose maps could not be made (pages of fewer than 32 keys: no box fits a
          // page) takes the same body with its blocks gathered by cp.async (kGather). On v5b's
          // producer body such units ran at 0.70-0.82x of FlashInfer's fa3 (128 x 4096, 128 heads on
          // pages of one key, 64 heads on pages of 16, 16 heads x 2 tokens on pages of one key;
          // ffi/cuda/NOTES.md, "the 64-key body on small pages").
          // On pages of 8 or 16 keys its blocks come as boxes of one page instead (TMA, issued by a few
          // lanes; maps of that box; mla_wide64_sm90.cuh, wide64_gather_half): 8-10% faster than the
          // gathers at 64 and 128 heads on pages of 16. An instance of its own (kPageBoxes), so that the
          // cp.async instance's code is the one measured without the boxes' branch (NOTES.md,
          // "twenty-fifth session").
          if constexpr (kCache == kCacheAsQuery) {
            // Above 16 heads the units are wide (but a last head block of 16 heads or fewer, at 65-80 heads),
            // and a third warpgroup gathers their blocks (kProducer: 384 threads), so that the consumers' trips
            // carry no gathers: through JAX 0.8-4.2% faster at 40-128 heads on pages of 1 and 16 keys. With 16
            // heads or fewer a launch may hold narrow units, which ran 2.5% slower in the 384-thread instance
            // (8 x 8192 h16 on pages of 16), so the consumers gather there (NOTES.md, "forty-third session").
            // -DJAX_MLA_GATHER_NO_PRODUCER: never (an A/B switch).
#ifdef JAX_MLA_GATHER_NO_PRODUCER
            const bool producer = false;
#else
            const bool producer = p.num_heads > 16;
#endif
#ifndef JAX_MLA_GATHER_NO_BOXES  // (an A/B switch: pages of 8-16 keys gathered by cp.async, as before)
            if (p.page_size >= Wide64Sm90::MIN_PAGE_BOX && p.page_size < WideSm90::BK) {
              return launch_gathered<T, kCache, true>(producer, blocks, stream, p,
                                                      key_tensor_maps<T, kCache>(p, p.page_size));
            }
#endif
            return launch_gathered<T, kCache, false>(producer, blocks, stream, p, maps);
          }
#endif
        }
      }
#endif
      const KeyTensorMaps maps = key_tensor_maps<T, kCache>(p);
      return launch_with_smem<mla_attention_sm90_kernel<T, kCache>>(blocks, WideSm90::kThreads, kSm90SmemBytes,
                                                                    stream, p, maps);
    }
    return launch_with_smem<mla_attention_kernel<T, kCache>>(blocks, kThreads, kAttentionSmemBytes, stream, p);
  }
  return cudaGetLastError();
}

// Blocks of the merge kernel: one wave. It holds 128 registers a thread at 256 threads, so two
// blocks fit on an SM; the old grid of 4 x SMs was two waves, and the second wave's blocks, which
// mostly find no task, still pay their launch and their scan of the plan after the attention grid
// ends: 4 x SMs was slower than 2 x SMs on every ragged shape measured, 0.2-4.5 us (NOTES.md, "The
// merge's grid").
inline int merge_grid_for(int sms) {
#ifdef JAX_MLA_MERGE_BLOCKS_PER_SM  // (an A/B switch)
  return JAX_MLA_MERGE_BLOCKS_PER_SM * sms;
#else
  return 2 * sms;
#endif
}

// The merge kernel (split partials, padding tokens): a programmatic dependent
// launch on sm_90+, so its blocks start as attention blocks retire and wait
// (griddepcontrol.wait) for the whole attention grid, which hides its launch
// latency behind the tail of the attention kernel.
template <typename T>
inline cudaError_t launch_merge(const Problem& p, cudaStream_t stream, int merge_grid) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(merge_grid);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = supports_dependent_launch() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, mla_merge_kernel<T>, p);
}

// The op: attention, then merge. Enqueues only: no sync, no alloc.
template <typename T, int kCache = kCacheAsQuery>
inline cudaError_t launch(const Problem& p, cudaStream_t stream, int merge_grid) {
  const cudaError_t err = launch_attention<T, kCache>(p, stream);
  if (err != cudaSuccess) return err;
  return launch_merge<T>(p, stream, merge_grid);
}

}  // namespace cuda
}  // namespace jax_mla
