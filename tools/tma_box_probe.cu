// How fast do 64-key blocks of scattered keys land in shared memory, by which copy? A question for the 64-key
// body on pages of one key (ffi/cuda/NOTES.md, "forty-third" and "forty-fifth session"): its cp.async gathers
// land a half ~2,000+ cycles after issue, TMA boxes of 64 keys ~1,300-1,400; a TMA box of one key per 128-byte
// panel would be 512 boxes a block of latent keys, and two things about them are not known: how many cycles a
// box's issue takes (the pages-of-16 trace suggests ~40 from one thread) and whether many issuing threads go
// faster; and whether a one-row box lands in the 128-byte swizzle as that row of a 64-row box would (the TMA unit
// swizzling by the destination address), at rows that are 128-byte but not 1024-byte aligned.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Iffi/include -Iffi/cuda tools/tma_box_probe.cu \
//     -o /tmp/tma_box_probe
//   /tmp/tma_box_probe [--blocks 256] [mode ...]
//
// One block of 128 threads per SM streams --blocks blocks of 64 keys x 512 16-bit dims (64 KB: eight panels of
// 64 keys x 128 bytes, the wgmma bodies' layout) through two buffers, the next block's copies issued before the
// block's wait: no compute, so it measures the copy side alone. Keys come from a 1 GB tensor of 2^20 rows. Modes
// (default: all, in this order, the one-key boxes last since a fault there would end the process):
//   box64      a block is 64 consecutive keys (a page of 64): 8 boxes of 64 rows, thread 0 issues;
//   box16      four random runs of 16 keys (pages of 16): 32 boxes of 16 rows, thread 0 issues;
//   cpasync    64 random keys (pages of one key): 16-byte cp.async by all 128 threads into the swizzle, as the
//              body's gathers do, each thread arriving on the block's barrier when its copies land;
//   box1x1, box1x4, box1x32, box1x128
//              64 random keys as 512 one-row boxes issued by 1, 4, 32 or 128 threads.
// Prints per mode the op time (median of five by events), the landing rate (TB/s over the GPU), cycles a block
// per SM (thread 0's clock over its loop) and thread 0's cycles issuing a block, and the 16-byte chunks of the
// first four blocks of every SM that are not where the 128-byte swizzle puts them (0 means TMA swizzles by
// address; for boxes of 64 rows, a check of the check).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "mix32.h"
#include "mla_hopper.cuh"  // the kernels' mbarrier and TMA helpers

using namespace jax_mla::cuda;

constexpr int kRowsLog2 = 20;
constexpr int kRows = 1 << kRowsLog2;
constexpr int kDims = 512;                        // 16-bit elements a key row: 1 KB
constexpr int kPanelBytes = 64 * 128;             // 64 keys x 128 bytes
constexpr int kBlockBytes = 8 * kPanelBytes;      // a block's latent keys: 64 KB
constexpr int kSmemBytes = 2 * kBlockBytes + 1024 + 64;  // two buffers, room to align them, two barriers
constexpr int kChecked = 4;                       // blocks of every SM whose bytes are checked

enum Mode { kBox64, kBox16, kCpAsync, kBox1 };

// Key k of block b of SM s: its tensor row. One random draw per run of consecutive keys: the block (box64), its
// run of 16 (box16), the key itself (pages of one key).
__device__ __forceinline__ int key_row(int mode, int s, int b, int k) {
  const uint32_t run = mode == kBox64 ? 0u : mode == kBox16 ? (uint32_t)(k >> 4) : (uint32_t)k;
  const uint32_t h = mix32((uint32_t)s * 0x9e3779b9u ^ mix32((uint32_t)b * 64u + run));
  if (mode == kBox64) return (int)((h & ((kRows >> 6) - 1)) << 6) + k;
  if (mode == kBox16) return (int)((h & ((kRows >> 4) - 1)) << 4) + (k & 15);
  return (int)(h & (kRows - 1));
}

__global__ void fill(uint16_t* data) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)kRows * kDims;
       i += (size_t)gridDim.x * blockDim.x)
    data[i] = (uint16_t)mix32((uint32_t)i);
}

struct Args {
  const uint16_t* data;
  int mode, issuers, blocks;
  unsigned long long* cycles;  // [SM]: thread 0's loop
  unsigned long long* issue;   // [SM]: thread 0's cycles issuing
  unsigned int* wrong;         // chunks not where the swizzle puts them
};

// Issue block b's copies into buffer `dst` (its barrier `bar`).
__device__ __forceinline__ void issue_block(const Args& a, const CUtensorMap* map, uint32_t dst, uint32_t bar, int b) {
  const int tid = threadIdx.x, s = blockIdx.x;
  if (a.mode == kCpAsync) {
    // 64 keys x 64 chunks of 16 bytes, chunk c of row k at (c % 8) ^ (k % 8) in panel c / 8.
    for (int i = tid; i < 64 * 64; i += 128) {
      const int k = i >> 6, c = i & 63;
      const char* src = reinterpret_cast<const char*>(a.data + (size_t)key_row(a.mode, s, b, k) * kDims) + c * 16;
      const uint32_t d = dst + (c >> 3) * kPanelBytes + k * 128 + (((c & 7) ^ (k & 7)) << 4);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
    }
    mbar_arrive_on_cp_async(bar);
    return;
  }
  if (tid == 0) mbar_arrive_expect_tx(bar, kBlockBytes);
  if (tid >= a.issuers) return;
  const int rows = a.mode == kBox64 ? 64 : a.mode == kBox16 ? 16 : 1;  // a box's keys
  const int boxes = 8 * (64 / rows);
  for (int i = tid; i < boxes; i += a.issuers) {
    const int run = i >> 3, panel = i & 7, k = run * rows;
    tma_load_2d(dst + panel * kPanelBytes + k * 128, map, panel * 64, key_row(a.mode, s, b, k), bar);
  }
}

__global__ void __launch_bounds__(128, 1) probe(const __grid_constant__ CUtensorMap map, Args a) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;  // the 128-byte swizzle repeats every 1024 bytes
  const uint32_t bars = base + 2 * kBlockBytes;
  const int tid = threadIdx.x, s = blockIdx.x;
  if (tid == 0) {
    for (int j = 0; j < 2; ++j) mbar_init(bars + 8 * j, a.mode == kCpAsync ? 128 : 1);
    mbar_init_fence();
  }
  __syncthreads();
  unsigned long long issue = 0;
  const long long t0 = clock64();
  long long ti = clock64();
  issue_block(a, &map, base, bars, 0);
  if (tid == 0) issue += clock64() - ti;
  for (int b = 0; b < a.blocks; ++b) {
    const int buf = b & 1;
    if (b + 1 < a.blocks) {  // the other buffer was released by the barrier at the end of the last trip
      ti = clock64();
      issue_block(a, &map, base + (buf ^ 1) * kBlockBytes, bars + 8 * (buf ^ 1), b + 1);
      if (tid == 0) issue += clock64() - ti;
    }
    mbar_wait(bars + 8 * buf, (b >> 1) & 1);
    if (b < kChecked) {
      unsigned int wrong = 0;
      for (int i = tid; i < 64 * 64; i += 128) {
        const int k = i >> 6, c = i & 63;
        const uint4 want = *reinterpret_cast<const uint4*>(a.data + (size_t)key_row(a.mode, s, b, k) * kDims + c * 8);
        const uint4 got =
            ld_shared_v4(base + buf * kBlockBytes + (c >> 3) * kPanelBytes + k * 128 + (((c & 7) ^ (k & 7)) << 4));
        wrong += (want.x != got.x) | (want.y != got.y) | (want.z != got.z) | (want.w != got.w);
      }
      if (wrong) atomicAdd(a.wrong, wrong);
    }
    __syncthreads();  // every thread is done with this buffer before it is refilled
  }
  if (tid == 0) {
    a.cycles[s] = clock64() - t0;
    a.issue[s] = issue;
  }
}

int main(int argc, char** argv) {
  int blocks = 256;
  std::vector<std::string> names;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--blocks") && i + 1 < argc) blocks = std::atoi(argv[++i]);
    else names.push_back(argv[i]);
  }
  if (names.empty()) names = {"box64", "box16", "cpasync", "box1x1", "box1x4", "box1x32", "box1x128"};
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  uint16_t* data;
  CHECK(cudaMalloc(&data, (size_t)kRows * kDims * sizeof(uint16_t)));
  fill<<<4 * sms, 256>>>(data);
  CHECK(cudaGetLastError());
  unsigned long long *cycles, *issue;
  unsigned int* wrong;
  CHECK(cudaMalloc(&cycles, sms * sizeof(unsigned long long)));
  CHECK(cudaMalloc(&issue, sms * sizeof(unsigned long long)));
  CHECK(cudaMalloc(&wrong, sizeof(unsigned int)));

  // The tensor as the kernels see a 16-bit ckv: rows of 512 elements, boxes of 64 elements x R rows, 128-byte swizzle.
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
  const auto encode = reinterpret_cast<decltype(&cuTensorMapEncodeTiled)>(fn);
  auto make_map = [&](int box_rows) {
    CUtensorMap map;
    const cuuint64_t size[2] = {kDims, kRows};
    const cuuint64_t stride[1] = {kDims * sizeof(uint16_t)};
    const cuuint32_t box[2] = {64, (cuuint32_t)box_rows};
    const cuuint32_t step[2] = {1, 1};
    if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, data, size, stride, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      std::fprintf(stderr, "cuTensorMapEncodeTiled failed for boxes of %d rows\n", box_rows);
      std::exit(1);
    }
    return map;
  };
  CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  std::printf("%s, %d SMs, %d blocks of 64 keys x 1 KB an SM, keys from %d rows (1 GB)\n", prop.name, sms, blocks,
              kRows);
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (const std::string& name : names) {
    Args a{data, 0, 1, blocks, cycles, issue, wrong};
    int box_rows = 64;
    if (name == "box64") a.mode = kBox64;
    else if (name == "box16") a.mode = kBox16, box_rows = 16;
    else if (name == "cpasync") a.mode = kCpAsync;
    else if (name.rfind("box1x", 0) == 0) a.mode = kBox1, box_rows = 1, a.issuers = std::atoi(name.c_str() + 5);
    else {
      std::fprintf(stderr, "unknown mode %s\n", name.c_str());
      return 2;
    }
    if (a.issuers < 1 || a.issuers > 128) {
      std::fprintf(stderr, "%s: 1 to 128 issuing threads\n", name.c_str());
      return 2;
    }
    const CUtensorMap map = make_map(box_rows);
    std::vector<float> ms;
    for (int rep = 0; rep < 6; ++rep) {
      CHECK(cudaMemset(wrong, 0, sizeof(unsigned int)));
      CHECK(cudaEventRecord(e0));
      probe<<<sms, 128, kSmemBytes>>>(map, a);
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      CHECK(cudaGetLastError());
      float t;
      CHECK(cudaEventElapsedTime(&t, e0, e1));
      if (rep) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    std::vector<unsigned long long> cyc(sms), iss(sms);
    unsigned int bad = 0;
    CHECK(cudaMemcpy(cyc.data(), cycles, sms * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(iss.data(), issue, sms * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(&bad, wrong, sizeof(unsigned int), cudaMemcpyDeviceToHost));
    std::sort(cyc.begin(), cyc.end());
    std::sort(iss.begin(), iss.end());
    const double t = ms[ms.size() / 2] * 1e-3;
    std::printf("%-9s %9.1f us  %5.2f TB/s  %7.0f cycles a block an SM  %6.0f issuing (thread 0)  %u of %d chunks "
                "misplaced\n",
                name.c_str(), t * 1e6, (double)blocks * kBlockBytes * sms / t / 1e12, (double)cyc[sms / 2] / blocks,
                (double)iss[sms / 2] / blocks, bad, sms * kChecked * 64 * 64);
  }
  return 0;
}
