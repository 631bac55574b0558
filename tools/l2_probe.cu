// How fast can every SM of the GPU pull bytes into shared memory, and does a cluster multicast
// raise it? A question for the 64-key body at 128 heads (ffi/cuda/NOTES.md, "fourth session"):
// there the two head blocks of a request read the same keys, so each SM ingests ~147 KB a pair of
// blocks while HBM supplies half of it, and the loop's waits could be either the SMs' share of the
// L2 -> SM fabric or the copies' latency.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Iffi/include -Iffi/cuda tools/l2_probe.cu \
//     -o /tmp/l2_probe
//   /tmp/l2_probe [--stages 4] [--chunk 32768] [--mb-per-cta 4.5]
//
// One block per SM (the shared memory asks for it), one thread issuing bulk copies
// (cp.async.bulk) into a ring of STAGES chunks and re-issuing each as soon as it lands: no compute,
// so it measures the copy side alone. Modes:
//   own        each block streams its own region (all from HBM: the 64-head case);
//   pair       blocks 2k and 2k+1 stream the same region (one from HBM, one mostly from L2: the
//              128-head case as the body runs it today);
//   multicast  the same pairs as clusters of two: each block copies half of every chunk with
//              .multicast::cluster into both blocks' rings; a chunk is re-issued once both blocks
//              took it (each block arrives on both blocks' "empty" barrier);
//   l2         every block streams the same small region (L2-resident after the first pass);
//   l2mc       l2 in clusters of two with multicast.
// Prints per mode the bytes landed in shared memory per second (ingress) and the unique bytes per
// second (what HBM or L2 had to supply), medians of five runs by events.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "mla_hopper.cuh"  // the kernels' mbarrier helpers (their cta-scope forms)

using jax_mla::cuda::mbar_arrive_expect_tx;
using jax_mla::cuda::mbar_init;
using jax_mla::cuda::mbar_init_fence;
using jax_mla::cuda::smem_addr;

constexpr int kMaxStages = 8;

// Cluster-scope forms the kernels do not need: the wait acquires what the partner block released.
__device__ __forceinline__ void bar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred p;\nW: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra W;\n}" ::"r"(bar), "r"(parity)
      : "memory");
}
// Arrive on the barrier at the same offset in block `cta` of the cluster (itself included).
__device__ __forceinline__ void bar_arrive_cluster(uint32_t bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 r;\nmapa.shared::cluster.u32 r, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [r];\n}" ::"r"(bar), "r"(cta)
      : "memory");
}
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void bulk_load_multicast(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                                    uint16_t mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "h"(mask)
      : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

struct Args {
  const char* data;
  size_t region_bytes;  // bytes a block (or a pair) streams
  int region_of_block_shift;  // region = blockIdx >> shift (0: own, 1: pair), or all the same when -1
  int stages, chunk;
  bool multicast;
  unsigned long long* sink;  // keeps the copies observable
};

__global__ void probe(Args a) {
  extern __shared__ __align__(1024) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + (size_t)a.stages * a.chunk);
  uint64_t* empty = full + kMaxStages;
  const uint32_t rank = a.multicast ? cluster_rank() : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < a.stages; ++s) {
      mbar_init(smem_addr(&full[s]), 1);
      mbar_init(smem_addr(&empty[s]), 2);
    }
    mbar_init_fence();
  }
  if (a.multicast) cluster_sync(); else __syncthreads();
  if (threadIdx.x != 0) return;
  const long region = a.region_of_block_shift < 0 ? 0 : (long)(blockIdx.x >> a.region_of_block_shift);
  const char* src = a.data + region * a.region_bytes;
  const long chunks = a.region_bytes / a.chunk;
  // l2 mode: blocks start at different chunks so that they do not all hit one L2 slice at once.
  const long start = a.region_of_block_shift < 0 ? (blockIdx.x / (a.multicast ? 2 : 1)) * 7 % chunks : 0;
  const uint32_t half = a.chunk / 2;
  auto issue = [&](long i, int s) {
    const char* c = src + ((start + i) % chunks) * a.chunk;
    const uint32_t dst = smem_addr(smem + (size_t)s * a.chunk), bar = smem_addr(&full[s]);
    mbar_arrive_expect_tx(bar, a.chunk);
    if (a.multicast) {
      bulk_load_multicast(dst + rank * half, c + rank * half, half, bar, 3);
    } else {
      bulk_load(dst, c, a.chunk, bar);
    }
  };
  for (int s = 0; s < a.stages && s < chunks; ++s) issue(s, s);
  unsigned long long acc = 0;
  for (long i = 0; i < chunks; ++i) {
    const int s = i % a.stages, parity = (i / a.stages) & 1;
    bar_wait(smem_addr(&full[s]), parity);
    acc += smem[(size_t)s * a.chunk + (i & 127)];
    if (i + a.stages < chunks) {
      if (a.multicast) {  // both blocks took chunk i: the stage is free in both
        bar_arrive_cluster(smem_addr(&empty[s]), 0);
        bar_arrive_cluster(smem_addr(&empty[s]), 1);
        bar_wait(smem_addr(&empty[s]), parity);
      }
      issue(i + a.stages, s);
    }
  }
  a.sink[blockIdx.x] = acc;
  // No block leaves while its partner may still arrive on its barriers or write its ring.
  if (a.multicast) asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

int main(int argc, char** argv) {
  int stages = 4, chunk = 32768;
  double mb_per_cta = 4.5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--stages")) stages = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--chunk")) chunk = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--mb-per-cta")) mb_per_cta = std::atof(argv[i + 1]);
  }
  if (stages > kMaxStages) stages = kMaxStages;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const int grid = sms & ~1;
  const size_t region = ((size_t)(mb_per_cta * 1048576) / chunk) * chunk;
  const size_t total = region * grid;
  char* data;
  CHECK(cudaMalloc(&data, total));
  std::vector<unsigned char> host(total);
  for (size_t i = 0; i < total; ++i) host[i] = (unsigned char)(i * 2654435761u >> 13);
  CHECK(cudaMemcpy(data, host.data(), total, cudaMemcpyHostToDevice));
  unsigned long long* sink;
  CHECK(cudaMalloc(&sink, grid * sizeof(unsigned long long)));
  const int smem = stages * chunk + 2 * kMaxStages * 8;
  CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::printf("%s, %d SMs, grid %d, %d stages x %d B, %.1f MB a block\n", prop.name, sms, grid, stages, chunk,
              region / 1048576.0);
  struct Mode {
    const char* name;
    int shift;
    bool multicast;
  } modes[] = {{"own", 0, false}, {"pair", 1, false}, {"multicast", 1, true}, {"l2", -1, false}, {"l2mc", -1, true}};
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (const Mode& m : modes) {
    Args a{data, region, m.shift, stages, chunk, m.multicast, sink};
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(32);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = m.multicast ? 2 : 1;
    attr[0].val.clusterDim.y = attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    if (m.multicast) CHECK(cudaOccupancyMaxActiveClusters(&clusters, (void*)probe, &cfg));
    std::vector<float> ms;
    for (int rep = 0; rep < 6; ++rep) {
      CHECK(cudaEventRecord(e0));
      CHECK(cudaLaunchKernelEx(&cfg, probe, a));
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float t;
      CHECK(cudaEventElapsedTime(&t, e0, e1));
      if (rep) ms.push_back(t);
    }
    CHECK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    const double t = ms[ms.size() / 2] * 1e-3;
    const double ingress = (double)region * grid / t;
    const double unique = m.shift < 0 ? (double)region : (double)region * grid / (m.shift ? 2 : 1);
    std::printf("%-10s %8.1f us  ingress %5.2f TB/s (%5.1f GB/s an SM)  unique %5.2f TB/s%s\n", m.name, t * 1e6,
                ingress / 1e12, ingress / grid / 1e9, unique / t / 1e12,
                m.multicast ? (" max active clusters " + std::to_string(clusters)).c_str() : "");
  }
  return 0;
}
