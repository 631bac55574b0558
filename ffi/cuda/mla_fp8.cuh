// The FP8 (e4m3) latent cache in the kernels: the one place where every body
// gathers a key row, turns fp8 into its MMA type and applies the scales. Four
// ways to turn it, by body:
//   * narrow (<= 16 rows), fp8 ckv and kpe in T: the rows stay raw in shared
//     memory, each warp converts its MMA fragments in registers
//     (fp8x4_to_half2x2; "fp8 in registers" in mla_narrow_kernel.cuh);
//   * wgmma wide body: its producer converts whole stages to fp16 (fp8x8_to;
//     wide_producer_fp8 in mla_wide_sm90.cuh);
//   * 64-key wide body (64+ heads): the raw block lands in half of its buffer
//     and the warpgroup that multiplies it next rewrites it as fp16 in place
//     (fp8x8_to; wide64_convert_block in mla_wide64_sm90.cuh);
//   * portable wide body, and any body with an fp8 kpe: the stage expanded in
//     place to T (expand_fp8_stage), as follows.
//
// A stage row holds one key as 72 16-byte chunks of the MMA type T (bf16 or
// fp16): chunks 0-63 the latent (ckv), 64-71 the rope part (kpe). An fp8 row is
// half as many bytes: it is gathered raw (cp.async, so the ring keeps its
// depth) into the upper half of the row, NRAW chunks at NRAW .. 2 NRAW - 1
// (NRAW = 32 ckv chunks, plus the 4 kpe chunks when kpe is fp8 too; a bf16 /
// fp16 kpe goes straight to chunks 64-71 as before). Once the stage has landed,
// expand_fp8_stage rewrites the row in place as T: output chunk j is raw bytes
// 8j .. 8j+7, exactly (every e4m3 value is a bf16 and an fp16 value; NaN stays
// NaN).
//
// The scales stay out of the MMAs, so the keys are not rounded again:
//   S = s_c (q_nope . c) + s_r (q_pe . r) = s_c (q_nope . c + (s_r / s_c) q_pe . r)
// The rope queries are multiplied by s_r / s_c once per unit (rope_query_factor,
// rounded to T: 64 of the 576 dims), s_c joins the softmax scale, and
// O = s_c (P . c) is applied in the epilogue (CacheScales).
//
// Cost of the expansion: per key a raw write of 512 B, a read of 512 B and a
// write of 1 KiB of shared memory on top of the MMAs' reads, in series with the
// MMAs (two barriers per stage). In the narrow body it made an fp8 cache slower
// than bf16 (0.80x); converting in registers made it 1.31x (ffi/cuda/NOTES.md,
// "FP8 cache, first version" and "fp8 in registers").
#pragma once

#include <cuda_fp8.h>

#include <type_traits>

#include "mla_common.cuh"

namespace jax_mla {
namespace cuda {

// How the cache is stored: as the queries (T), or fp8 ckv (kpe T or fp8).
enum CacheKind : int { kCacheAsQuery = 0, kCacheFp8Ckv = 1, kCacheFp8CkvKpe = 2 };

template <int kCache>
struct CacheFormat {
  static constexpr bool kFp8Ckv = kCache != kCacheAsQuery;
  static constexpr bool kFp8Kpe = kCache == kCacheFp8CkvKpe;
  // Raw fp8 chunks of a row, parked at chunks kRaw .. 2 kRaw - 1 until expanded.
  static constexpr int kRaw = kFp8Ckv ? (kFp8Kpe ? 36 : 32) : 0;
  static constexpr int kCkvBytes = kFp8Ckv ? kDimCkv : 2 * kDimCkv;  // bytes of one cached key
  static constexpr int kKpeBytes = kFp8Kpe ? kDimKpe : 2 * kDimKpe;
};

// Issues thread `sub` (0-7)'s share of the cp.async gather of one key row (8
// threads per key). `chunk(c)` is the shared address of chunk c of the row in
// the body's layout; `bytes` 0 zero-fills (keys outside the range, bad pages).
// kL2Hint false: plain copies (the portable body in the TMA producer's instance, mla_sm90_kernel.cuh).
template <int kCache, bool kL2Hint = true, typename ChunkAddr>
__device__ __forceinline__ void gather_key_row(ChunkAddr chunk, const char* ckv_row, const char* kpe_row, int sub,
                                               int bytes) {
  using F = CacheFormat<kCache>;
  // L2 evict-first: the keys stream through once (a second head block of the unit reads them while
  // they are fresh). Left normal they pushed the kernel's own code and page table out of L2, and a
  // launch after another kernel (an op's merge, the model's next layer) then fetched its code from
  // DRAM: 7-17 us a launch at 1024-4096 keys a unit (ffi/cuda/NOTES.md, "Keys evict-first").
  const uint64_t pol = kL2Hint ? l2_evict_first_policy() : 0;
  auto copy = [&](uint32_t dst, const char* src) {
    if constexpr (kL2Hint) {
      cp_async16_hint(dst, src, bytes, pol);
    } else {
      cp_async16(dst, src, bytes);
    }
  };
  if constexpr (!F::kFp8Ckv) {
#pragma unroll
    for (int i = 0; i < 8; ++i) copy(chunk(sub + 8 * i), ckv_row + (sub + 8 * i) * 16);
    copy(chunk(64 + sub), kpe_row + sub * 16);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) copy(chunk(F::kRaw + sub + 8 * i), ckv_row + (sub + 8 * i) * 16);
    if constexpr (F::kFp8Kpe) {
      // Without the hint: ptxas 13.0 gave the hinted copy in this branch an L2 descriptor in
      // uniform registers it never set (desc[UR1] in SASS), and the kernel died with an illegal
      // instruction on the H200 (tests/test_fp8.py and the arg_specs case with kpe_fp8, 16 heads).
      if (sub < 4) cp_async16(chunk(F::kRaw + 32 + sub), kpe_row + sub * 16, bytes);
    } else {
      copy(chunk(64 + sub), kpe_row + sub * 16);
    }
  }
}

// Four e4m3 values (one word, lowest byte first) as two fp16 pairs, exactly: bytes 0-1 -> .x,
// bytes 2-3 -> .y (one cvt a pair on sm_89+). The narrow body's B fragments of S: a word that
// ldmatrix gives a lane from fp8 rows holds dims 4 t .. 4 t + 3 of one key.
__device__ __forceinline__ uint2 fp8x4_to_half2x2(uint32_t w) {
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffffu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w >> 16), __NV_E4M3);
  return make_uint2((uint32_t)lo.x | ((uint32_t)lo.y << 16), (uint32_t)hi.x | ((uint32_t)hi.y << 16));
}

// Eight e4m3 values (two words, lowest byte first) as four words of T pairs, exactly (to bf16 by
// way of fp16, which holds every e4m3 value).
template <typename T>
__device__ __forceinline__ uint4 fp8x8_to(uint2 raw) {
  const uint2 lo = fp8x4_to_half2x2(raw.x), hi = fp8x4_to_half2x2(raw.y);
  uint32_t w[4] = {lo.x, lo.y, hi.x, hi.y};
  if constexpr (!std::is_same_v<T, __half>) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[k]));
      w[k] = pack2<T>(f.x, f.y);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The 8-bit A fragment of O^T (the transposed P V of the e4m3 bodies: mla_narrow_fp8_sm90.cuh,
// mla_wide64_e4m3_sm90.cuh) for one
// output tile and k32 step (rows are dims: row g is dim 2g, row
// g + 8 dim 2g + 1, of the warp's 16) from one ldmatrix.trans.x4 of raw key rows: vb[m] holds keys
// 8 m + 2t and 8 m + 2t + 1 of dims 2g, 2g + 1. A register takes four k-slots 4t .. 4t + 3 of one row:
// keys 2t, 2t + 1, 2t + 8, 2t + 9 (of each 16), so P's panel puts key 8 h + 2 t + b at slot 4 t + 2 h + b.
__device__ __forceinline__ void vt_e4m3_fragment(uint32_t (&a)[4], const uint32_t (&vb)[4]) {
  a[0] = __byte_perm(vb[0], vb[1], 0x6420);
  a[1] = __byte_perm(vb[0], vb[1], 0x7531);
  a[2] = __byte_perm(vb[2], vb[3], 0x6420);
  a[3] = __byte_perm(vb[2], vb[3], 0x7531);
}

// The same for a word that ldmatrix.trans gives from fp8 rows: (key k, dims d, d + 1), then (key k + 1,
// dims d, d + 1). Returns dim d of both keys (.x) and dim d + 1 of both (.y): the B fragments of P V
// for two output columns.
__device__ __forceinline__ uint2 fp8x4_trans_to_half2x2(uint32_t w) {
  return fp8x4_to_half2x2(__byte_perm(w, 0u, 0x3120));
}

// The power of two k that brings a query row of largest magnitude `amax` just under 2^15 (amax
// 2^k < 2^15), where fp16 keeps every value a bf16 row holds down to 2^-24 of its largest at full
// precision (smaller ones cannot move a score). An all-zero (padding) or non-finite row keeps 0.
// TOP = 8 brings it under 2^8 instead (the e4m3 split below).
template <int TOP = 15>
__device__ __forceinline__ int fp8_query_exponent(float amax) {
  int k = 0;
  if (amax > 0.f && amax <= 3.0e38f) {
    int ex;
    frexpf(amax, &ex);  // amax < 2^ex
    k = min(max(TOP - ex, -100), 100);
  }
  return k;
}

// 2^k as a float, exact for the exponents fp8_query_exponent returns (|k| <= 100: a normal float).
__device__ __forceinline__ float exp2_int(int k) { return __int_as_float((127 + k) << 23); }

// The largest magnitude of a 16-byte chunk of T (eight values).
template <typename T>
__device__ __forceinline__ float chunk_amax(uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float m = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = unpack2<T>(w[e]);
    m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
  }
  return m;
}

// A 16-byte query chunk of T times f: a latent chunk into fp16 (the latent MMAs' type with an fp8
// ckv), a rope chunk rounded once back to T (kpe stays T).
template <typename T>
__device__ __forceinline__ uint4 scale_query_chunk(uint4 v, float f, bool rope) {
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 x = unpack2<T>(w[e]);
    w[e] = rope ? pack2<T>(x.x * f, x.y * f) : pack2<__half>(x.x * f, x.y * f);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The narrow body's queries with an fp8 ckv kept raw (mla_narrow_kernel.cuh), in place in their
// staging rows (16 rows of T; chunk(r, c) the shared address of chunk c of row r): row r's latent
// part times 2^k_r into fp16 (the latent MMAs multiply fp16 by fp16 keys), its rope part times
// rope_factor 2^k_r, rounded once to T (kpe stays T). Warp w rewrites rows 2 w and 2 w + 1, a lane
// its chunks lane + 32 i, and returns 2^-k_r for them: the factor on those rows' softmax scale (the
// softmax rows of warp w are the same two). The caller synchronises the block before fragments are read.
// kSplit: the latent MMAs are e4m3 x e4m3 (split_e4m3x4; mla_narrow_fp8_sm90.cuh): the row's largest
// value is brought under 2^8 instead, and the latent part stays T (times a power of two: exact in
// bf16; in fp16 but for values 2^-24 below the row's largest).
template <typename T, bool kSplit = false, typename RowChunkAddr>
__device__ __forceinline__ void narrow_prepare_queries_fp8(RowChunkAddr chunk, int warp, int lane, float rope_factor,
                                                           float (&row_scale)[2]) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = 2 * warp + rr;
    uint4 v[3];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      const int c = lane + 32 * i;
      if (c >= kChunksPerKey) break;
      v[i] = ld_shared_v4(chunk(r, c));
      const float m = chunk_amax<T>(v[i]);
      amax = fmaxf(amax, c < 64 ? m : m * fabsf(rope_factor));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const int k = fp8_query_exponent<kSplit ? 8 : 15>(amax);
    const float factor = exp2_int(k);
    row_scale[rr] = exp2_int(-k);
    // The split saturates (its cvt is satfinite): a row holding an infinity (or NaN) is NaN, by its scale.
    if (kSplit && !(amax <= 3.0e38f)) row_scale[rr] = __int_as_float(0x7fc00000);  // fp8_query_exponent's bound
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      const int c = lane + 32 * i;
      if (c >= kChunksPerKey) break;
      st_shared_v4(chunk(r, c), scale_query_chunk<T>(v[i], c < 64 ? factor : factor * rope_factor, kSplit || c >= 64));
    }
  }
}

// Four query values (x, of T, scaled under 2^8 by narrow_prepare_queries_fp8) as TERMS words of four
// e4m3 bytes each, x = sum_t term_t 16^-t: each term is the previous remainder times 16, rounded to
// e4m3, so a term holds four more significant bits of x. A bf16 value (8 bits) is exact in two terms
// and an fp16 value (11 bits) in three, down to 2^-6 (terms below that are subnormal: an error under
// 2^-14 of the row's largest value, which is at least 2^7). The latent MMAs (wgmma e4m3 x e4m3) then
// read the raw key bytes as they landed: no conversion of keys at all. The cvt saturates (the only
// e4m3 cvt in hardware; finite values under 2^8 cannot overflow): a NaN stays NaN, an infinity does
// not, so narrow_prepare_queries_fp8 makes a non-finite row's scale NaN.
template <typename T, int TERMS>
__device__ __forceinline__ void split_e4m3x4(uint2 x, uint32_t (&term)[TERMS]) {
  float2 a = unpack2<T>(x.x), b = unpack2<T>(x.y);
#pragma unroll
  for (int t = 0; t < TERMS; ++t) {
    const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(a, __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(b, __NV_SATFINITE, __NV_E4M3);
    term[t] = (uint32_t)lo | ((uint32_t)hi << 16);
    if (t + 1 < TERMS) {
      const float2 ra = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(lo, __NV_E4M3)));
      const float2 rb = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(hi, __NV_E4M3)));
      a = make_float2((a.x - ra.x) * 16.f, (a.y - ra.y) * 16.f);  // exact: the remainder has few bits
      b = make_float2((b.x - rb.x) * 16.f, (b.y - rb.y) * 16.f);
    }
  }
}

// The type the wgmma body (mla_wide_sm90.cuh) multiplies the latent part in: the queries' type, or
// fp16 with an fp8 ckv. e4m3 -> fp16 is one cvt a pair and exact (to bf16 it is four operations a
// pair); the queries' latent part is brought into fp16's range by a power of two per row
// (wide_prepare_queries_fp8), and P is in [0, 1], where fp16 is the finer of the two.
template <typename T, int kCache>
using LatentMmaType = std::conditional_t<CacheFormat<kCache>::kFp8Ckv, __half, T>;

// The factors an fp8 cache's scales put on the scores and the output (1 for other caches).
struct CacheScales {
  float score = 1.f;       // multiplies the softmax scale: s_c
  float out = 1.f;         // multiplies the normalised output: s_c
  float rope_query = 1.f;  // multiplies q_pe: s_r / s_c
};

template <int kCache>
__device__ __forceinline__ CacheScales cache_scales(const Problem& p) {
  CacheScales s;
  if constexpr (CacheFormat<kCache>::kFp8Ckv) {
    const float ckv = __ldg(p.ckv_scale);
    const float kpe = CacheFormat<kCache>::kFp8Kpe ? __ldg(p.kpe_scale) : 1.f;
    s.score = ckv;
    s.out = ckv;
    s.rope_query = kpe / ckv;
  }
  return s;
}

// Multiplies the rope part (chunks 64-71) of `rows` staged query rows by `factor`, in place,
// rounded once to T; all 256 threads take part, the call ends with a barrier. No-op for other caches.
template <typename T, int kCache, typename RowChunkAddr>
__device__ __forceinline__ void scale_rope_queries(RowChunkAddr chunk, int rows, float factor) {
  if constexpr (CacheFormat<kCache>::kFp8Ckv) {
    for (int idx = threadIdx.x; idx < rows * 8; idx += kThreads) {
      const uint32_t addr = chunk(idx >> 3, 64 + (idx & 7));
      uint4 v = ld_shared_v4(addr);
      uint32_t* w = &v.x;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const T* pair = reinterpret_cast<const T*>(&w[k]);
        w[k] = pack2<T>(static_cast<float>(pair[0]) * factor, static_cast<float>(pair[1]) * factor);
      }
      st_shared_v4(addr, v);
    }
    __syncthreads();
  }
}

// Expands the fp8 rows of one landed stage (BK keys) in place to T. Every
// thread of the block's 256 takes part and the call ends with a barrier, so the
// stage is ready for ldmatrix when it returns. Output chunks [0, kRaw) are
// written first: they never overlap the raw chunks. The rest overlap the raw
// area, so their raw bytes are all read (and the first half's) before a barrier.
template <typename T, int kCache, int BK, typename RowChunkAddr>
__device__ __forceinline__ void expand_fp8_stage(RowChunkAddr chunk) {
  using F = CacheFormat<kCache>;
  if constexpr (F::kFp8Ckv) {
    constexpr int N = F::kRaw;
    constexpr int PER_ROUND = BK * N;  // output chunks per round
    constexpr int LATE = (PER_ROUND + kThreads - 1) / kThreads;
    const int tid = threadIdx.x;
    auto source = [&](int key, int j) {  // raw bytes 8j .. 8j+7 of the row
      return ld_shared_v2(chunk(key, N + (j >> 1)) + 8 * (j & 1));
    };
    auto store = [&](int key, int j, uint2 raw) {
      st_shared_v4(chunk(key, j), fp8x8_to<T>(raw));
    };
    // Round 1: output chunks 0 .. N-1 (raw chunks N .. N + N/2 - 1).
#pragma unroll 2
    for (int idx = tid; idx < PER_ROUND; idx += kThreads) {
      const int key = idx / N, j = idx - (idx / N) * N;
      store(key, j, source(key, j));
    }
    // Round 2: output chunks N .. 2N-1, over the raw area: read all, barrier, write.
    uint2 late[LATE];
#pragma unroll
    for (int k = 0; k < LATE; ++k) {
      const int idx = tid + k * kThreads;
      if (idx < PER_ROUND) late[k] = source(idx / N, N + idx - (idx / N) * N);
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < LATE; ++k) {
      const int idx = tid + k * kThreads;
      if (idx < PER_ROUND) store(idx / N, N + idx - (idx / N) * N, late[k]);
    }
    __syncthreads();
  }
}

}  // namespace cuda
}  // namespace jax_mla
