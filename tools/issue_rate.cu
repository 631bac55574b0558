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
//   mma_e4m3   mma.sync m16n8k32 e4m3 x e4m3 -> f32, operands new every trip (an xor each). sm_90 has
//              no such tensor-core instruction: ptxas emits 12 F2FP.F16.E4M3.UNPACK_B and two
//              HMMA.16816 (only wgmma multiplies e4m3 natively)
//   word_bpv   word_bits for P V's words (the even and the odd columns apart, as word_pv)
//   to_e4m3    cvt.rn.satfinite.e4m3x2.f32 (two floats to an e4m3 pair)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "mla_fp8.cuh"

using namespace jax_mla::cuda;

enum Op { kCvt, kWordS, kWordPv, kWordBits, kMmaF16, kMmaE4m3, kWordBitsPv, kToE4m3, kNumOps };
static const char* kNames[kNumOps] = {"cvt", "word_s", "word_pv", "word_bits", "mma_f16", "mma_e4m3", "word_bpv", "to_e4m3"};
constexpr int kChains = 8;

__device__ __forceinline__ uint2 word_bits(uint32_t w) {  // exact but for NaN, values x 2^-8
  const uint32_t q = __byte_perm(w, 0u, 0x1302);         // halves: b0 << 8 | b2, b1 << 8 | b3
  const uint32_t r = q << 8;                              // halves: b2 << 8, b3 << 8
  return make_uint2((q & 0x80008000u) | ((q & 0x7f007f00u) >> 1), (r & 0x80008000u) | ((r & 0x7f007f00u) >> 1));
}

__device__ __forceinline__ uint2 word_bits_pv(uint32_t w) {  // word_bits, P V's order (word_pv's)
  const uint32_t q = __byte_perm(w, 0u, 0x2301);             // halves: b0 << 8 | b1, b2 << 8 | b3
  const uint32_t r = q << 8;                                 // halves: b1 << 8, b3 << 8
  return make_uint2((q & 0x80008000u) | ((q & 0x7f007f00u) >> 1), (r & 0x80008000u) | ((r & 0x7f007f00u) >> 1));
}

__device__ __forceinline__ void mma_16832_e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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
      } else if constexpr (OP == kWordBitsPv) {
        const uint2 v = word_bits_pv(x[k]);
        x[k] = (v.x ^ v.y) & 0x3c3c3c3cu;
      } else if constexpr (OP == kToE4m3) {
        const float f = __uint_as_float(x[k] | 0x3f000000u);
        x[k] = (x[k] & 0xffff0000u) | (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(f, -f), __NV_SATFINITE, __NV_E4M3);
      } else if constexpr (OP == kMmaF16) {
        if (k < kChains / 2) mma_16816<__half>(acc[k], a, x[k], x[k + kChains / 2]);
      } else if constexpr (OP == kMmaE4m3) {
        if (k < kChains / 2) {
          const uint32_t m = (uint32_t)it * 0x01010101u & 0x1c1c1c1cu;  // new operands: no hoisted conversion
          const uint32_t av[4] = {a[0] ^ m, a[1] ^ m, a[2] ^ m, a[3] ^ m};
          mma_16832_e4m3(acc[k], av, x[k] ^ m, x[k + kChains / 2] ^ m);
        }
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
    const int per_trip = OP == kMmaF16 || OP == kMmaE4m3 ? kChains / 2 : kChains;  // warp-wide operations a thread issues a trip
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
        case kMmaE4m3: r = run<kMmaE4m3>(warps, sms, cycles); break;
        case kWordBitsPv: r = run<kWordBitsPv>(warps, sms, cycles); break;
        case kToE4m3: r = run<kToE4m3>(warps, sms, cycles); break;
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
