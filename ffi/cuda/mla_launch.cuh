// Host-side launch of the op's kernels for one problem (used by the XLA FFI
// handler and by the standalone sanitizer harness, benchmarks/sanitize_harness.cu).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <type_traits>

#include "mla_attention_f32_kernel.cuh"
#include "mla_attention_kernel.cuh"
#include "mla_merge_kernel.cuh"

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

// Programmatic dependent launch needs compute capability 9.0 (cached per device).
inline bool supports_dependent_launch() {
  static std::atomic<int> cached[kMaxDevices] = {};  // 0 unknown, 1 no, 2 yes
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (device >= 0 && device < kMaxDevices) {
    const int c = cached[device].load(std::memory_order_acquire);
    if (c != 0) return c == 2;
  }
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    major = 0;
  }
  if (device >= 0 && device < kMaxDevices) cached[device].store(major >= 9 ? 2 : 1, std::memory_order_release);
  return major >= 9;
}

// The attention kernel: one block per work unit and head block.
template <typename T>
inline cudaError_t launch_attention(const Problem& p, cudaStream_t stream) {
  const int blocks = p.num_work * p.head_blocks;
  if (blocks <= 0) return cudaSuccess;
  if constexpr (std::is_same_v<T, float>) {
    mla_attention_f32_kernel<<<blocks, kThreads, 0, stream>>>(p);
  } else {
    // Opt in to > 48 KiB of shared memory, once per device (legal during capture too).
    static std::atomic<bool> raised[kMaxDevices] = {};
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    if (device < 0 || device >= kMaxDevices || !raised[device].load(std::memory_order_acquire)) {
      err = cudaFuncSetAttribute(mla_attention_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 kAttentionSmemBytes);
      if (err != cudaSuccess) return err;
      if (device >= 0 && device < kMaxDevices) raised[device].store(true, std::memory_order_release);
    }
    mla_attention_kernel<T><<<blocks, kThreads, kAttentionSmemBytes, stream>>>(p);
  }
  return cudaGetLastError();
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
template <typename T>
inline cudaError_t launch(const Problem& p, cudaStream_t stream, int merge_grid) {
  const cudaError_t err = launch_attention<T>(p, stream);
  if (err != cudaSuccess) return err;
  return launch_merge<T>(p, stream, merge_grid);
}

}  // namespace cuda
}  // namespace jax_mla
