// How many cycles does a pair of 64-key blocks cost one SM in the MMA core of a transposed fp8 body
// for 64-row units (64-128 heads), or of a lossy e4m3 x e4m3 one, against the core of today's 16-bit
// 64-key body? A question for issue 10's "128 x 4096 h128: fp8 time <= bf16 time" (ffi/cuda/NOTES.md,
// "fp8 at 64-128 heads", "The MMA core of a transposed fp8 body for 64-row units, probed" and "The core
// of a lossy e4m3 x e4m3 wide body, probed"). Timing only: the shared memory holds random bytes and
// no product is checked (only the layout of e4m3_vt's shared-memory transpose, check_transpose).
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Iffi/include -Iffi/cuda \
//     tools/wide_fp8_core_probe.cu -o /tmp/wide_fp8_core_probe
//   /tmp/wide_fp8_core_probe
//
// One block of two warpgroups per SM, ITERS pairs of blocks; each warpgroup per pair (block 2k + w):
//   t_mma    S^T = K Q^T of its block: 36 m64n64k16 fp16 wgmma with A from registers (32 latent k-steps
//            from the raw e4m3 panel by ldmatrix + cvt, 4 rope k-steps from registers), B = Q^T in shared
//            memory (fp16, 128-byte swizzle); then O^T[256 dims of the warpgroup] += V^T P^T for both
//            blocks of the pair: 4 tiles x 2 blocks x 4 k-steps, A from the raw panels by ldmatrix.trans +
//            byte permute + cvt, B = the block's P^T panel. A fragments in groups of four k-steps, two
//            groups in flight.
//   t_full   t_mma plus the softmax's work and exchanges as the symmetric schedule needs them: row maxima
//            down the keys (shuffles, then shared memory across both warpgroups' eight warps, three
//            256-thread barriers a pair), exp2 of the 32 scores, P^T stored as fp16, O^T rescaled.
//   ss_bf16  the 16-bit 64-key body's core for comparison (v8f, mla_wide64_sm90.cuh): S = Q K^T of its
//            block, 36 m64n64k16 bf16 wgmma from shared memory, then O[:, 256 w:] += P V of both blocks:
//            4 m64n256k16 with P from registers and 4 with P from shared memory. No softmax.
//   ss_n256  calibration: 17 m64n256k16 bf16 wgmma from shared memory a warpgroup (the same FMAs, 80 bytes a
//            clock of operands: the tensor pipe's own rate).
//   rs_const calibration: t_mma's 68 m64n64k16 with A from fixed registers (no ldmatrix, no cvt).
//   rs_e4m3  calibration: the same FMAs as 34 m64n64k32 e4m3 wgmma with A from fixed registers (half the
//            A bytes a multiply-add of rs_const's).
// The e4m3 modes: the core of a lossy e4m3 x e4m3 body (issue 10's explicit fp8 x fp8 option: queries
// quantized to e4m3 per row, P in e4m3). S = Q K^T of its block in ss_bf16's orientation, as 16 m64n64k32
// e4m3 wgmma from shared memory (A = the e4m3 query panels, B = the raw key panels as TMA lands them) plus
// the rope's 4 bf16 k16 steps from registers; P to e4m3 into the pair's P panel (rows x 128 keys, K-major),
// one 256-thread barrier; then P V of both blocks. No softmax (as ss_bf16).
//   e4m3_vt   P V as O[:, 256 w:] += P V, 4 m64n256k32 e4m3 wgmma from shared memory, A = the P panel,
//             B = V^T: while S runs, the warpgroup transposes its 256 dims of both blocks' raw keys into
//             V^T (dims as rows, the pair's 128 keys along them: the K-major B that e4m3 wgmma needs) by
//             ldmatrix.trans, byte permutes and stmatrix (transpose_half_ldsm; -DPROBE_T_U32: by u32
//             loads, byte permutes and u32 stores, transpose_half).
//   e4m3_rs   P V transposed, as O^T[256 dims] += V^T P^T: 16 m64n64k32 e4m3 wgmma with A = V^T from the
//             raw panels by ldmatrix.trans and two byte permutes a register pair (the narrow fp8 body's
//             vt_e4m3_fragment), B = the P panel. No transpose in shared memory.
//   e4m3_q2rs e4m3_rs with the queries in two e4m3 terms (S read to bf16 accuracy: 32 latent k32 steps).
// -DPROBE_NO_S / -DPROBE_NO_T / -DPROBE_NO_PV leave out S's latent wgmmas / the transposes / P V of the
// e4m3 modes (where their time goes).
// t_mma folds each S^T into a register sum: an accumulator nothing reads lets ptxas drop its wgmmas
// (the first run of this probe lost 27 of a warpgroup's 68 that way).
// Prints cycles a pair per SM (median over SMs) and what the tensor pipe needs at 2048 16-bit FMA a clock
// (4096 e4m3).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "mla_fp8.cuh"
#include "mla_hopper.cuh"

using namespace jax_mla::cuda;

enum Mode { kTMma, kTFull, kSsBf16, kSsN256, kRsConst, kRsE4m3, kSsE4m3T, kSsE4m3, kSsE4m3Q2, kNumModes };
static const char* kNames[kNumModes] = {"t_mma",   "t_full",  "ss_bf16", "ss_n256",   "rs_const",
                                        "rs_e4m3", "e4m3_vt", "e4m3_rs", "e4m3_q2rs"};

constexpr int kPanel = 64 * 128;           // 64 rows x 128 bytes
constexpr int kQOff = 0;                   // 8 fp16 latent panels (Q^T, B of S^T) + the rope panel
constexpr int kStageOff = 9 * kPanel;      // 4 stages of 4 raw e4m3 panels (32 KB)
constexpr int kPOff = kStageOff + 16 * kPanel;  // 2 P^T panels
constexpr int kRedOff = kPOff + 2 * kPanel;     // float [8 warps][64 rows]
constexpr int kStatOff = kRedOff + 8 * 64 * 4;  // float2 [64]: max, alpha
constexpr int kSmemBytes = kStatOff + 64 * 8 + 1024;

// Four k16 steps of S^T's A for this warp's 16 keys from raw panel `panel` (128 dims): `half` 0 or 1
// picks the panel's dims 64 half .. 64 half + 63 (chunks 4 half .. 4 half + 3).
__device__ __forceinline__ void s_fragments(uint32_t (&a)[4][4], uint32_t panel, int half, int warp, int lane) {
  const int row = 16 * warp + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    uint32_t r[4];
    const int chunk = 4 * half + 2 * j + (lane >> 4);
    ldmatrix_x4(r, panel + row * 128 + ((chunk ^ (row & 7)) << 4));
    const uint2 r0 = fp8x4_to_half2x2(r[0]), r1 = fp8x4_to_half2x2(r[1]);
    const uint2 r2 = fp8x4_to_half2x2(r[2]), r3 = fp8x4_to_half2x2(r[3]);
    a[2 * j][0] = r0.x, a[2 * j][1] = r1.x, a[2 * j][2] = r0.y, a[2 * j][3] = r1.y;
    a[2 * j + 1][0] = r2.x, a[2 * j + 1][1] = r3.x, a[2 * j + 1][2] = r2.y, a[2 * j + 1][3] = r3.y;
  }
}

// Four k16 steps (the block's 64 keys) of V^T's A for this warp's 16 dims of chunk c of raw panel `panel`.
__device__ __forceinline__ void pv_fragments(uint32_t (&a)[4][4], uint32_t panel, int c, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t r[4];
    const int row = 32 * h + lane;
    ldmatrix_x4_trans(r, panel + row * 128 + ((c ^ (row & 7)) << 4));
    const uint2 m0 = fp8x4_trans_to_half2x2(r[0]), m1 = fp8x4_trans_to_half2x2(r[1]);
    const uint2 m2 = fp8x4_trans_to_half2x2(r[2]), m3 = fp8x4_trans_to_half2x2(r[3]);
    a[2 * h][0] = m0.x, a[2 * h][1] = m0.y, a[2 * h][2] = m1.x, a[2 * h][3] = m1.y;
    a[2 * h + 1][0] = m2.x, a[2 * h + 1][1] = m2.y, a[2 * h + 1][2] = m3.x, a[2 * h + 1][3] = m3.y;
  }
}

// S^T += K Q^T over one k32 step on e4m3, A from registers: D 64 x 64.
__device__ __forceinline__ void wgmma_64x64_rs_e4m3(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, "
      "%35}, %36, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

#define PROBE_F8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                    "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define PROBE_D32 PROBE_F8(0), PROBE_F8(8), PROBE_F8(16), PROBE_F8(24)
#define PROBE_D128 PROBE_D32, PROBE_F8(32), PROBE_F8(40), PROBE_F8(48), PROBE_F8(56), PROBE_F8(64), PROBE_F8(72), \
                   PROBE_F8(80), PROBE_F8(88), PROBE_F8(96), PROBE_F8(104), PROBE_F8(112), PROBE_F8(120)
#define PROBE_R8(a) "%" #a "0, %" #a "1, %" #a "2, %" #a "3, %" #a "4, %" #a "5, %" #a "6, %" #a "7, %" #a "8, %" #a "9"
// S += Q K^T over one k32 step on e4m3, both from shared memory (K-major): D 64 x 64.
__device__ __forceinline__ void wgmma_64x64_ss_e4m3(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, 1, 1, "
      "1;\n"
      : PROBE_D32
      : "l"(desc_a), "l"(desc_b));
}
// O += P V over one k32 step of keys on e4m3: A = P (64 rows x 32 keys), B = V^T (256 dims x 32 keys), both
// K-major in shared memory: D 64 x 256.
__device__ __forceinline__ void wgmma_64x256_ss_e4m3(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, "
      PROBE_R8(1) ", " PROBE_R8(2) ", " PROBE_R8(3) ", " PROBE_R8(4) ", " PROBE_R8(5) ", " PROBE_R8(6) ", "
      PROBE_R8(7) ", " PROBE_R8(8) ", " PROBE_R8(9) ", " PROBE_R8(10) ", " PROBE_R8(11) ", "
      "%120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, 1, 1, 1;\n"
      : PROBE_D128
      : "l"(desc_a), "l"(desc_b));
}
#undef PROBE_R8
#undef PROBE_D128
#undef PROBE_D32
#undef PROBE_F8

__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}

// V^T of 256 dims (raw panels `raw`, `raw` + kPanel: dims 0-127, 128-255 of the half) of one 64-key block
// into rows of `vt` (one row a dim, 128 bytes: the pair's 128 keys, this block's at key word 16 b), 128-byte
// swizzle, by the warpgroup's 128 threads. A lane moves 4 x 4 byte tiles (keys 4 kw .., dims 4 dw ..): four
// u32 loads (one a key; conflict-free: the lanes of a load cover 32 banks), eight byte permutes, four u32
// stores (one a dim; two lanes a bank).
__device__ __forceinline__ void transpose_half(uint32_t vt, uint32_t raw, int b, int warp, int lane) {
  const int kw = lane & 15, p = warp >> 1;
  const uint32_t panel = raw + p * kPanel;
#pragma unroll 1
  for (int j = 0; j < 8; ++j) {
    const int jj = j & 3, ro = 2 * (warp & 1) + (j >> 2);
    const int dw = ((lane + ro) & 3) + 4 * (((lane >> 2) + jj) & 7);
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 4 * kw + i;
      w[i] = ld_shared_u32(panel + r * 128 + (((dw >> 2) ^ (r & 7)) << 4) + 4 * (dw & 3));
    }
    const uint32_t t0 = __byte_perm(w[0], w[1], 0x5140), t1 = __byte_perm(w[2], w[3], 0x5140);
    const uint32_t t2 = __byte_perm(w[0], w[1], 0x7362), t3 = __byte_perm(w[2], w[3], 0x7362);
    const uint32_t o4[4] = {__byte_perm(t0, t1, 0x5410), __byte_perm(t0, t1, 0x7632), __byte_perm(t2, t3, 0x5410),
                            __byte_perm(t2, t3, 0x7632)};
    const int kword = 16 * b + kw;
#pragma unroll
    for (int d = 0; d < 4; ++d) {
      const int row = 128 * p + 4 * dw + d;
      st_shared_u32(vt + row * 128 + (((kword >> 2) ^ (row & 7)) << 4) + 4 * (kword & 3), o4[d]);
    }
  }
}

// The same V^T by ldmatrix.trans and stmatrix, as the transposed body's A fragments are made
// (vt_e4m3_fragment): a warp takes 16 dims x 32 keys (512 bytes) per ldmatrix.x4.trans, four byte
// permutes and one stmatrix.x4. A V^T row (dim) then holds each group of 16 keys permuted (key 8 h + 2 t
// + b at byte 4 t + 2 h + b), the order P's panel would be written in.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}
__device__ __forceinline__ void transpose_half_ldsm(uint32_t vt, uint32_t raw, int b, int warp, int lane) {
#pragma unroll
  for (int u = 0; u < 8; ++u) {  // this warp's 16-dim chunks 4 u' + warp (u' = u / 2) x k32 steps u % 2
    const int ks = u & 1, cc = 4 * (u >> 1) + warp;  // chunk of the half's 256 dims (16 of them)
    const int row = 32 * ks + lane;                   // key
    uint32_t vb[4], a[4];
    ldmatrix_x4_trans(vb, raw + (cc >> 3) * kPanel + row * 128 + (((cc & 7) ^ (row & 7)) << 4));
    a[0] = __byte_perm(vb[0], vb[1], 0x6420);  // dim 2g, keys 2t, 2t + 1, 2t + 8, 2t + 9
    a[1] = __byte_perm(vb[0], vb[1], 0x7531);  // dim 2g + 1
    a[2] = __byte_perm(vb[2], vb[3], 0x6420);  // the same of keys 16 ..
    a[3] = __byte_perm(vb[2], vb[3], 0x7531);
    const int j = lane >> 3, r = lane & 7;    // this lane's address: matrix j, row r
    const int vrow = 16 * cc + 2 * r + (j & 1), chunk = 4 * b + 2 * ks + (j >> 1);
    stmatrix_x4(vt + vrow * 128 + ((chunk ^ (vrow & 7)) << 4), a);
  }
}

// A check of transpose_half_ldsm's layout (one warpgroup): two raw panels of known bytes (key k, dim d:
// 7 k + 13 d), both blocks of a pair, then every V^T byte against the key its slot should hold.
__global__ void check_transpose(int* bad) {
  extern __shared__ __align__(16) char smem[];
  uint32_t base = smem_addr(smem);
  base += (1024 - (base & 1023)) & 1023;
  const uint32_t raw = base, vt = base + 2 * kPanel;
  const int tid = threadIdx.x;
  for (int i = tid; i < 64 * 256; i += 128) {
    const int k = i >> 8, d = i & 255;
    st_shared_u8(raw + (d >> 7) * kPanel + k * 128 + ((((d & 127) >> 4) ^ (k & 7)) << 4) + (d & 15), (7 * k + 13 * d) & 255);
  }
  __syncthreads();
  for (int b = 0; b < 2; ++b) transpose_half_ldsm(vt, raw, b, tid >> 5, tid & 31);
  __syncthreads();
  for (int i = tid; i < 256 * 128; i += 128) {
    const int row = i >> 7, slot = i & 127, kk = slot & 63, pos = kk & 15;
    const int key = 16 * (kk >> 4) + 8 * ((pos >> 1) & 1) + 2 * (pos >> 2) + (pos & 1);
    const uint8_t got = *reinterpret_cast<const uint8_t*>(
        smem + (vt - smem_addr(smem)) + row * 128 + (((slot >> 4) ^ (row & 7)) << 4) + (slot & 15));
    if (got != ((7 * key + 13 * row) & 255)) atomicAdd(bad, 1);
  }
}

template <int MODE>
__global__ void __launch_bounds__(256, 1) core(int iters, long long* cycles, uint32_t* sink) {
  extern __shared__ __align__(16) char smem[];
  uint32_t base = smem_addr(smem);
  base += (1024 - (base & 1023)) & 1023;
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0), t = tid & 127;
  const int warp = t >> 5, lane = t & 31, g = lane >> 2, t4 = lane & 3;
  // Random bytes: e4m3 values of modest size in the raw panels, fp16 ones elsewhere.
  for (int i = tid; i < (kSmemBytes - 1024) / 4; i += 256) {
    const uint32_t x = (i * 2654435761u) ^ (blockIdx.x * 40503u);
    st_shared_u32(base + 4 * i, x & 0x3b3b3b3bu);
  }
  fence_proxy_async_shared();
  __syncthreads();
  float o[4][32];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int k = 0; k < 32; ++k) o[i][k] = 0.f;
  float l_part[16] = {};
  uint32_t rope[4][4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
#pragma unroll
    for (int e = 0; e < 4; ++e) rope[k][e] = 0x3c003c00u ^ (uint32_t)(lane * 7 + k + e);
  const uint32_t q_lo = sw128_desc_lo(base + kQOff);
  const long long t0 = clock64();
#pragma unroll 1
  for (int it = 0; it < iters; ++it) {
    const int blk = 2 * it + wg;
    const uint32_t stage = base + kStageOff + (blk & 3) * 4 * kPanel;
    if constexpr (MODE == kSsN256) {
      float* of = &o[0][0];
      float(&o128)[128] = *reinterpret_cast<float(*)[128]>(of);
      const uint32_t k_lo = sw128_mn_desc_lo(stage, kPanel);
      wgmma_fence();
#pragma unroll
      for (int step = 0; step < 17; ++step)
        wgmma_64x256_ss_mn<__nv_bfloat16>(o128, sw128_desc_at(q_lo, (step % 9) * kPanel + (step & 3) * 32),
                                          sw128_desc_at(k_lo, (step & 3) * 2048), 1);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(o128);
      named_barrier_sync(1, 256);
    } else if constexpr (MODE == kRsConst || MODE == kRsE4m3) {
      // A pair's FMAs from fixed A registers: 68 fp16 k16 steps, or 34 e4m3 k32 steps.
      constexpr int kSteps = MODE == kRsE4m3 ? 34 : 68;
      wgmma_fence();
#pragma unroll
      for (int step = 0; step < kSteps; ++step) {
        const uint64_t desc_b = sw128_desc_at(q_lo, ((step >> 2) % 9) * kPanel + (step & 3) * 32);
        if constexpr (MODE == kRsE4m3) {
          wgmma_64x64_rs_e4m3(o[step & 3], rope[step & 3], desc_b);
        } else {
          wgmma_64x64_rs<__half>(o[step & 3], rope[step & 3], desc_b, 1);
        }
      }
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 4; ++i) fence_registers(o[i]);
      named_barrier_sync(1, 256);
    } else if constexpr (MODE == kSsE4m3T || MODE == kSsE4m3 || MODE == kSsE4m3Q2) {
      constexpr bool kRsPv = MODE != kSsE4m3T;
      constexpr int kQTerms = MODE == kSsE4m3Q2 ? 2 : 1;
      // Shared memory of these modes (timing only; e4m3_q2rs's second term overlaps e4m3_vt's V^T): e4m3 queries in Q panels 0-3, warpgroup 1's V^T in Q panels 4-7;
      // stage s (block A: 0, B: 1) = 4 raw panels + the rope panel at kStageOff + 5 s panels; warpgroup
      // 0's V^T at stage panels 10-13; the pair's P panel (parity) at kPOff.
      float s[32];
      const uint32_t q8 = base + kQOff, st_mine = base + kStageOff + wg * 5 * kPanel;
      const uint32_t vt = wg == 0 ? base + kStageOff + 10 * kPanel : base + kQOff + 4 * kPanel;
      const uint32_t q_lo8 = sw128_desc_lo(q8), k_lo8 = sw128_desc_lo(st_mine);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_64x64_rs<__nv_bfloat16>(s, rope[kk], sw128_desc_at(k_lo8, 4 * kPanel + kk * 32), kk > 0);
#ifndef PROBE_NO_S
#pragma unroll
      for (int kk = 0; kk < 16 * kQTerms; ++kk)
        wgmma_64x64_ss_e4m3(s, sw128_desc_at(q_lo8, (kk >> 2) * kPanel + (kk & 3) * 32),
                            sw128_desc_at(k_lo8, ((kk >> 2) & 3) * kPanel + (kk & 3) * 32));
#endif
      wgmma_commit();
#ifndef PROBE_NO_T
#pragma unroll
      for (int b = 0; b < 2 && !kRsPv; ++b) {
        const uint32_t raw = base + kStageOff + b * 5 * kPanel + 2 * wg * kPanel;
#ifdef PROBE_T_U32
        transpose_half(vt, raw, b, warp, lane);
#else
        transpose_half_ldsm(vt, raw, b, warp, lane);
#endif
      }
#endif
      wgmma_wait<0>();
      fence_registers(s);
      // P in e4m3 into the pair's panel: the even lane of a pair (t4 0, 2) stores keys 2 t4 .. 2 t4 + 3 of
      // row g, the odd one keys 2 t4 - 2 .. 2 t4 + 1 of row g + 8.
      const uint32_t pp = base + kPOff + (it & 1) * kPanel;
      const bool odd = t4 & 1;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(s[4 * n] * 0.01f, s[4 * n + 1] * 0.01f),
                                                     __NV_SATFINITE, __NV_E4M3);
        const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(s[4 * n + 2] * 0.01f, s[4 * n + 3] * 0.01f),
                                                     __NV_SATFINITE, __NV_E4M3);
        const uint32_t other = __shfl_xor_sync(0xffffffffu, odd ? lo : hi, 1);
        const uint32_t word = odd ? (other | (hi << 16)) : (lo | (other << 16));
        const int row = 16 * warp + g + 8 * (odd ? 1 : 0), col = 64 * wg + 8 * n + 2 * (t4 & 2);
        st_shared_u32(pp + row * 128 + (((col >> 4) ^ (row & 7)) << 4) + (col & 15), word);
      }
      fence_proxy_async_shared();
      named_barrier_sync(1, 256);
      const uint32_t p_lo8 = sw128_desc_lo(pp);
#ifndef PROBE_NO_PV
      if constexpr (kRsPv) {
        // O^T[256 dims of the warpgroup] += V^T P^T, A = V^T from the raw panels by ldmatrix.trans and two
        // byte permutes a register pair (the narrow fp8 body's vt_e4m3_fragment), B = the P panel: 64 rows
        // x 32 keys a k32 step, K-major. A group of 8 wgmmas a block (4 dim tiles x 2 k32 steps), both
        // groups in flight. O^T in o[4][32] (4 tiles of 64 dims x 64 rows).
        uint32_t a8[2][8][4];
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const uint32_t st_b = base + kStageOff + b * 5 * kPanel;
#pragma unroll
          for (int jj = 0; jj < 4; ++jj)
#pragma unroll
            for (int ks = 0; ks < 2; ++ks) {
              uint32_t vb[4];
              const int row = 32 * ks + lane, cc = 4 * (4 * wg + jj) + warp;  // 16 dims of this warp
              ldmatrix_x4_trans(vb, st_b + (cc >> 3) * kPanel + row * 128 + (((cc & 7) ^ (row & 7)) << 4));
              a8[b][2 * jj + ks][0] = __byte_perm(vb[0], vb[1], 0x6420);
              a8[b][2 * jj + ks][1] = __byte_perm(vb[0], vb[1], 0x7531);
              a8[b][2 * jj + ks][2] = __byte_perm(vb[2], vb[3], 0x6420);
              a8[b][2 * jj + ks][3] = __byte_perm(vb[2], vb[3], 0x7531);
            }
          wgmma_fence();
#pragma unroll
          for (int jj = 0; jj < 4; ++jj)
#pragma unroll
            for (int ks = 0; ks < 2; ++ks)
              wgmma_64x64_rs_e4m3(o[jj], a8[b][2 * jj + ks], sw128_desc_at(p_lo8, 64 * b + 32 * ks));
          wgmma_commit();
        }
        wgmma_wait<0>();
        fence_fragments(a8[0]);
        fence_fragments(a8[1]);
      } else {
        float(&o128)[128] = *reinterpret_cast<float(*)[128]>(&o[0][0]);
        const uint32_t v_lo8 = sw128_desc_lo(vt);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_64x256_ss_e4m3(o128, sw128_desc_at(p_lo8, kk * 32), sw128_desc_at(v_lo8, kk * 32));
        wgmma_commit();
        wgmma_wait<0>();
      }
#endif
#pragma unroll
      for (int i = 0; i < 4; ++i) fence_registers(o[i]);
    } else if constexpr (MODE == kSsBf16) {
      // S = Q K^T: K as bf16 panels (the raw stages read as 16-bit: timing only).
      float s[32];
      const uint32_t k_lo = sw128_desc_lo(stage);
      wgmma_fence();
#pragma unroll
      for (int step = 0; step < 36; ++step)
        wgmma_64x64_ss<__nv_bfloat16>(s, sw128_desc_at(q_lo, (step >> 2) * kPanel + (step & 3) * 32),
                                      sw128_desc_at(k_lo, ((step >> 2) & 3) * kPanel + (step & 3) * 32), step > 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(s);
      uint32_t pa[4][4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int e = 0; e < 4; ++e) pa[k][e] = pack2<__nv_bfloat16>(s[8 * k + 2 * e], s[8 * k + 2 * e + 1]);
      named_barrier_sync(1, 256);
      float* of = &o[0][0];
      float(&o128)[128] = *reinterpret_cast<float(*)[128]>(of);
      const uint32_t v_lo = sw128_mn_desc_lo(stage, kPanel), v2_lo = sw128_mn_desc_lo(base + kStageOff + ((blk ^ 1) & 3) * 4 * kPanel, kPanel);
      const uint32_t p_lo = sw128_desc_lo(base + kPOff + (wg ^ 1) * kPanel);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_64x256_rs_mn<__nv_bfloat16>(o128, pa[kk], sw128_desc_at(v_lo, kk * 2048), 1);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_64x256_ss_mn<__nv_bfloat16>(o128, sw128_desc_at(p_lo, kk * 32), sw128_desc_at(v2_lo, kk * 2048), 1);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(o128);
      fence_fragments(pa);
    } else {
      // ---- S^T = K Q^T ----
      float s[32];
      uint32_t fa[2][4][4];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_64x64_rs<__half>(s, rope[kk], sw128_desc_at(q_lo, 8 * kPanel + kk * 32), kk > 0);
      wgmma_commit();
#pragma unroll
      for (int grp = 0; grp < 8; ++grp) {  // 8 groups of four k16 steps: raw panel grp / 2, 64 dims each
        uint32_t(&a)[4][4] = fa[grp & 1];
        if (grp >= 2) {
          wgmma_wait<1>();
          fence_fragments(a);
        }
        s_fragments(a, stage + (grp >> 1) * kPanel, grp & 1, warp, lane);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const int step = 4 * grp + kk;  // latent k16 step: Q panel step / 4
          wgmma_64x64_rs<__half>(s, a[kk], sw128_desc_at(q_lo, (step >> 2) * kPanel + (step & 3) * 32), 1);
        }
        wgmma_commit();
      }
      wgmma_wait<0>();
      fence_registers(s);
      fence_fragments(fa[0]);
      fence_fragments(fa[1]);
      if constexpr (MODE == kTFull) {
        // ---- softmax: row maxima down the keys, across the eight warps ----
        float mx[16];
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int j = 0; j < 2; ++j) mx[2 * n + j] = fmaxf(s[4 * n + j], s[4 * n + 2 + j]);
#pragma unroll
        for (int off = 4; off < 32; off <<= 1)
#pragma unroll
          for (int i = 0; i < 16; ++i) mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], off));
        float* red = reinterpret_cast<float*>(smem + (base - smem_addr(smem)) + kRedOff);
        float2* stat = reinterpret_cast<float2*>(smem + (base - smem_addr(smem)) + kStatOff);
        if (g == 0) {
#pragma unroll
          for (int n = 0; n < 8; ++n)
            *reinterpret_cast<float2*>(&red[(4 * wg + warp) * 64 + 8 * n + 2 * t4]) = make_float2(mx[2 * n], mx[2 * n + 1]);
        }
        named_barrier_sync(1, 256);
        if (tid < 64) {
          float m = red[tid];
#pragma unroll
          for (int w8 = 1; w8 < 8; ++w8) m = fmaxf(m, red[w8 * 64 + tid]);
          const float old = stat[tid].x;
          const float mn = fmaxf(old, m);
          stat[tid] = make_float2(mn, exp2f(old - mn));
        }
        named_barrier_sync(1, 256);
        float m_row[16], alpha[16];
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float2 st = stat[8 * n + 2 * t4 + j];
            m_row[2 * n + j] = st.x, alpha[2 * n + j] = st.y;
          }
        uint32_t ph[16];  // P as fp16: this thread's keys g and g + 8 of row 8 n + 2 t4 + j
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float p0 = exp2f(s[4 * n + j] * 0.0625f - m_row[2 * n + j]);
            const float p1 = exp2f(s[4 * n + 2 + j] * 0.0625f - m_row[2 * n + j]);
            l_part[2 * n + j] = l_part[2 * n + j] * alpha[2 * n + j] + p0 + p1;
            ph[2 * n + j] = pack2<__half>(p0, p1);
          }
        // P^T [row][key]: the even-g lane stores row 8 n + 2 t4 (keys g, g + 1, then g + 8, g + 9), the odd one row + 1.
        const uint32_t pt = base + kPOff + wg * kPanel;
        const bool odd = g & 1;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const uint32_t mine = odd ? ph[2 * n] : ph[2 * n + 1], other = __shfl_xor_sync(0xffffffffu, mine, 4);
          const uint32_t keep = odd ? ph[2 * n + 1] : ph[2 * n];
          // keep: (key g, key g + 8) of my row; other: (key g^1, key g^1 + 8) of my row
          const uint32_t lo = odd ? __byte_perm(other, keep, 0x5410) : __byte_perm(keep, other, 0x5410);
          const uint32_t hi = odd ? __byte_perm(other, keep, 0x7632) : __byte_perm(keep, other, 0x7632);
          const int row = 8 * n + 2 * t4 + (odd ? 1 : 0), k0 = 16 * warp + (g & ~1);
          st_shared_u32(pt + row * 128 + (((k0 >> 3) ^ (row & 7)) << 4) + (k0 & 7) * 2, lo);
          st_shared_u32(pt + row * 128 + ((((k0 + 8) >> 3) ^ (row & 7)) << 4) + (k0 & 7) * 2, hi);
        }
        fence_proxy_async_shared();
        named_barrier_sync(1, 256);
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int k = 0; k < 32; ++k) o[i][k] *= alpha[((k >> 2) << 1) | (k & 1)];
      } else {
#pragma unroll
        for (int k = 0; k < 32; ++k) l_part[k & 15] += s[k];  // keeps S^T's wgmmas
        named_barrier_sync(1, 256);  // the pair's hand-over, as any schedule has one
      }
      // ---- O^T += V^T P^T, both blocks of the pair ----
#pragma unroll
      for (int grp = 0; grp < 8; ++grp) {  // (block, tile) = (grp / 4, grp % 4)
        const int b = grp >> 2, i = grp & 3;
        uint32_t(&a)[4][4] = fa[grp & 1];
        if (grp >= 2) {
          wgmma_wait<1>();
          fence_fragments(a);
        }
        const uint32_t st_b = base + kStageOff + ((2 * it + b) & 3) * 4 * kPanel;
        pv_fragments(a, st_b + (2 * wg + (i >> 1)) * kPanel, 4 * (i & 1) + warp, lane);
        const uint32_t p_lo = sw128_desc_lo(base + kPOff + b * kPanel);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_64x64_rs<__half>(o[i], a[kk], sw128_desc_at(p_lo, kk * 32), 1);
        wgmma_commit();
      }
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 4; ++i) fence_registers(o[i]);
      fence_fragments(fa[0]);
      fence_fragments(fa[1]);
    }
  }
  __syncthreads();
  const long long t1 = clock64();
  uint32_t fold = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int k = 0; k < 32; ++k) fold ^= __float_as_uint(o[i][k]);
#pragma unroll
  for (int i = 0; i < 16; ++i) fold ^= __float_as_uint(l_part[i]);
  if (fold == 0x12345678u) sink[blockIdx.x] = fold;  // keeps the work
  if (tid == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int MODE>
static void run(int sms, int iters, long long* cycles) {
  cudaFuncSetAttribute(core<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  uint32_t* sink;
  cudaMalloc(&sink, sms * 4);
  std::vector<double> per_pair;
  for (int rep = 0; rep < 5; ++rep) {
    core<MODE><<<sms, 256, kSmemBytes>>>(iters, cycles, sink);
    if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
      std::printf("%s: %s\n", kNames[MODE], cudaGetErrorString(e));
      return;
    }
    std::vector<long long> host(sms);
    cudaMemcpy(host.data(), cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost);
    std::sort(host.begin(), host.end());
    if (rep > 0) per_pair.push_back((double)host[sms / 2] / iters);
  }
  std::sort(per_pair.begin(), per_pair.end());
  // A pair: 2 x 64 rows x 64 keys x (576 + 512) FMA = 8.9 M; the tensor pipe does 2048 fp16 FMA a clock.
  // The e4m3 modes: S's latent part and P V on e4m3 (4096 FMA a clock), the rope part on bf16.
  const int floor = MODE == kRsE4m3 ? 2176 : MODE == kSsE4m3Q2 ? 3328 : MODE >= kSsE4m3T ? 2304 : 4352;
  std::printf("%-9s %7.0f cycles a pair per SM (median of 4 runs over %d SMs; tensor floor %d)\n", kNames[MODE],
              per_pair[per_pair.size() / 2], sms, floor);
  cudaFree(sink);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  long long* cycles;
  cudaMalloc(&cycles, sms * sizeof(long long));
  {
    int* bad;
    cudaMalloc(&bad, 4);
    cudaMemset(bad, 0, 4);
    const int bytes = 6 * kPanel + 1024;
    cudaFuncSetAttribute(check_transpose, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    check_transpose<<<1, 128, bytes>>>(bad);
    int h = -1;
    cudaMemcpy(&h, bad, 4, cudaMemcpyDeviceToHost);
    std::printf("V^T by ldmatrix.trans + stmatrix: %d of 32768 bytes wrong\n", h);
    cudaFree(bad);
  }
  const int iters = 2048;
  run<kSsBf16>(sms, iters, cycles);
  run<kTMma>(sms, iters, cycles);
  run<kTFull>(sms, iters, cycles);
  run<kSsN256>(sms, iters, cycles);
  run<kRsConst>(sms, iters, cycles);
  run<kRsE4m3>(sms, iters, cycles);
  run<kSsE4m3T>(sms, iters, cycles);
  run<kSsE4m3>(sms, iters, cycles);
  run<kSsE4m3Q2>(sms, iters, cycles);
  cudaFree(cycles);
  return 0;
}
