// How many of the narrow body's fp8 instructions can one SM issue per clock? A question for the fp8
// cache's 1.7x target (ffi/cuda/NOTES.md, "fp8 in registers"): with the keys in L2 the narrow body
// still takes ~1.75 us a 64-key block, and each warp converts 64 words of raw keys a block (32 for S,
// 32 for P V) beside its 68 MMAs. If the e4m3 -> fp16 conversion is a slow pipe, it bounds the body.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Iffi/include -Iffi/cuda tools/issue_rate.cu \
//     -o /tmp/issue_rate
//   /tmp/issue_rate
//
// One block per SM, WARPS warps, each thread running 8 independent chains of one operation for ITERS
// trips; the block's clock64 span gives operations per clock per SM (a warp-wide operation counts
// once). Operations:
//   cvt        one cvt.rn.f16x2.e4m3x2 (two e4m3 values to an fp16 pair)
//   word_s     fp8x4_to_half2x2: four e4m3 values of a word as two fp16 pairs (S's B fragment)
//   word_pv    fp8x4_trans_to_half2x2: a byte permute, then the same (P V's B fragments)
//   word_bits  the same four values by integer operations (byte permute, masks, shifts; NaN lost)
//   mma_f16    mma.sync m16n8k16 fp16 x fp16 -> f32 (the narrow body's MMA)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "mla_fp8.cuh"

using namespace jax_mla::cuda;

enum Op { kCvt, kWordS, kWordPv, kWordBits, kMmaF16, kNumOps };
static const char* kNames[kNumOps] = {"cvt", "word_s", "word_pv", "word_bits", "mma_f16"};
constexpr int kChains = 8;

__device__ __forceinline__ uint2 word_bits(uint32_t w) {  // exact but for NaN, values x 2^-8
  const uint32_t q = __byte_perm(w, 0u, 0x1302);         // halves: b0 << 8 | b2, b1 << 8 | b3
  const uint32_t r = q << 8;                              // halves: b2 << 8, b3 << 8
  return make_uint2((q & 0x80008000u) | ((q & 0x7f007f00u) >> 1), (r & 0x80008000u) | ((r & 0x7f007f00u) >> 1));
}

template <int OP>
__global__ void rate(uint32_t seed, int iters, long long* cycles, uint32_t* sink) {
  uint32_t x[kChains];
  float acc[kChains / 2][4] = {};
  uint32_t a[4];
#pragma unroll
  for (int k = 0; k < kChains; ++k) x[k] = (seed + threadIdx.x * 977u + k * 131u) * 2654435761u & 0x3c3c3c3cu;
#pragma unroll
  for (int k = 0; k < 4; ++k) a[k] = x[k];
  __syncthreads();
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int k = 0; k < kChains; ++k) {
      if constexpr (OP == kCvt) {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(x[k] & 0xffffu), __NV_E4M3);
        x[k] = ((uint32_t)h.x | ((uint32_t)h.y << 16)) ^ 0x3c3cu;  // keep the low bytes e4m3-sized
      } else if constexpr (OP == kWordS || OP == kWordPv || OP == kWordBits) {
        const uint2 v = OP == kWordS ? fp8x4_to_half2x2(x[k]) : OP == kWordPv ? fp8x4_trans_to_half2x2(x[k])
                                                                              : word_bits(x[k]);
        x[k] = (v.x ^ v.y) & 0x3c3c3c3cu;
      } else if constexpr (OP == kMmaF16) {
        if (k < kChains / 2) mma_16816<__half>(acc[k], a, x[k], x[k + kChains / 2]);
      }
    }
  }
  __syncthreads();
  const long long t1 = clock64();
  uint32_t fold = 0;
#pragma unroll
  for (int k = 0; k < kChains; ++k) fold ^= x[k];
#pragma unroll
  for (int k = 0; k < kChains / 2; ++k) fold ^= __float_as_uint(acc[k][0] + acc[k][1] + acc[k][2] + acc[k][3]);
  if (fold == 0x12345678u) sink[blockIdx.x] = fold;  // keeps the work
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int OP>
static double run(int warps, int sms, long long* cycles) {
  const int iters = 4096;
  std::vector<long long> host(sms);
  uint32_t* sink = nullptr;
  cudaMalloc(&sink, sms * sizeof(uint32_t));
  double best = 0.0;
  for (int rep = 0; rep < 5; ++rep) {
    rate<OP><<<sms, 32 * warps>>>(0x9e3779b9u + rep, iters, cycles, sink);
    cudaMemcpy(host.data(), cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost);
    std::sort(host.begin(), host.end());
    const int per_trip = OP == kMmaF16 ? kChains / 2 : kChains;  // warp-wide operations a thread issues a trip
    const double ops = (double)warps * iters * per_trip;
    best = std::max(best, ops / (double)host[sms / 2]);  // median block
  }
  cudaFree(sink);
  return best;
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  long long* cycles = nullptr;
  cudaMalloc(&cycles, sms * sizeof(long long));
  printf("warp-wide operations per clock per SM (best of 5 runs, median block), %d SMs\n", sms);
  printf("%-10s %10s %10s %10s\n", "op", "8 warps", "16 warps", "32 warps");
  for (int op = 0; op < kNumOps; ++op) {
    printf("%-10s", kNames[op]);
    for (int warps : {8, 16, 32}) {
      double r = 0.0;
      switch (op) {
        case kCvt: r = run<kCvt>(warps, sms, cycles); break;
        case kWordS: r = run<kWordS>(warps, sms, cycles); break;
        case kWordPv: r = run<kWordPv>(warps, sms, cycles); break;
        case kWordBits: r = run<kWordBits>(warps, sms, cycles); break;
        case kMmaF16: r = run<kMmaF16>(warps, sms, cycles); break;
      }
      printf(" %10.3f", r);
    }
    printf("\n");
  }
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    printf("CUDA error: %s\n", cudaGetErrorString(err));
    return 1;
  }
  return 0;
}
