// The body of the paged MLA kernel for units of at most 16 query rows: decode
// of a model with <= 16 heads (the memory-bound case the targets are about).
//
// Why a separate body: with 16 rows the tensor-core work per key is tiny and
// the 64-row body spent its time re-reading the queries from shared memory
// and waiting at three barriers per 32 keys. Here
//
//   * the queries live in registers for the whole unit: warp w keeps the A
//     fragments of one slice of the 576 query dims (DS slices) and computes
//     the partial scores of one 16-key group over that slice, so every key
//     byte in shared memory is read once for S and once for PV, queries never;
//   * the DS partial scores meet in shared memory, where each warp then owns
//     two of the 16 rows across the whole key block: max, exp2 and the running
//     sum are warp-local (shuffles), no per-row reduction across warps;
//   * P V as in the wide body: warp w owns output columns 64w .. 64w+63;
//   * 64 keys per pipeline stage, three stages; three barriers per stage.
//
// Keys are gathered with cp.async through the same page-id ring as the wide
// body (mla_attention_kernel.cuh); split units write the same float32
// partials for mla_merge_kernel.
//
// fp8 in registers. With an e4m3 ckv (kpe in the query type) the key rows stay
// raw in shared memory (640 bytes a key instead of 1152) and each warp converts
// the fragments it loads, in registers (one cvt a pair, exact): nothing is
// written back, no barrier is added, and every ldmatrix brings twice the keys.
// The latent MMAs multiply in fp16 (e4m3 -> fp16 is one
// cvt; to bf16 it is four operations), so the queries' latent part is brought
// into fp16 once per unit by a power of two per row (narrow_prepare_queries_fp8).
// The fragments' element order is what ldmatrix gives from bytes, which the
// MMAs then see as a permutation of the summed dims (S) and of the output
// columns (P V):
//   * S: a lane's word holds dims 4t .. 4t+3 of one key, i.e. k-slots 2t, 2t+1
//     (b0) and 2t+8, 2t+9 (b1) of a 16-dim step are dims 4t, 4t+1 and 4t+2,
//     4t+3; the query's A fragment is loaded in that same order, so each product
//     pairs the right dims and the sum is unchanged.
//   * P V: ldmatrix.trans of bytes gives a lane (key 2t, dims 2g, 2g+1) and
//     (key 2t+1, same dims); one byte permute makes dim 2g of both keys the B
//     fragment of one n8 tile and dim 2g+1 that of a second, so the tiles of a
//     16-dim chunk hold its even and its odd columns, and a lane ends with four
//     adjacent output columns (store_tile_row's GROUP 2).
// An fp8 kpe keeps the path of the portable body: the stage expanded in place
// to T (expand_fp8_stage).
#pragma once

#include "mla_common.cuh"
#include "mla_fp8.cuh"
#include "mla_stages.cuh"

namespace jax_mla {
namespace cuda {

// Shared-memory key rows here are unpadded (1152 bytes) and swizzled instead:
// 16-byte chunk c of row k lives at chunk c ^ (k & 7). Every ldmatrix phase
// reads eight consecutive rows at one logical chunk, which then land in eight
// distinct bank groups, and the 16 bytes of padding per row that the wide body
// spends buy the third 64-key stage here (3 x 72 KiB).
constexpr int kNarrowRowBytes = kDimKey * 2;  // 1152

template <int BK_, int STAGES_, int ROW_BYTES_ = kNarrowRowBytes>
struct NarrowShape {
  static constexpr int BK = BK_;
  static constexpr int STAGES = STAGES_;
  static constexpr int ROW_BYTES = ROW_BYTES_;            // a key row of a stage (the queries' staging rows: 1152)
  static constexpr int ROWS = 16;
  static constexpr int KGROUPS = BK / 16;                 // 16-key groups per stage
  static constexpr int DS = kWarps / KGROUPS;             // dim slices per key group
  static constexpr int KSTEPS = (kDimKey / 16) / DS;      // k16 steps a warp owns
  static constexpr int KPL = BK / 32;                     // keys per lane in the softmax
  static constexpr int PASSES = BK / 32;                  // 256 threads x 16 B cover 32 keys per pass
  static constexpr int S_STRIDE = BK + 8;                 // floats; rows g, g+4 land in distinct banks
  // P (the probabilities, in the input type) overlays the first bytes of row r
  // of slice 0 of the partial scores: only the warp that owns row r reads that
  // row, and it has read it before it writes P.
  static constexpr int P_STRIDE = S_STRIDE * 2;           // elements
  // Byte offsets. The queries are staged once in the last key stage, which the
  // prologue leaves empty, on their way into registers.
  static constexpr int KV_OFF = 0;
  static constexpr int S_OFF = KV_OFF + STAGES * BK * ROW_BYTES;
  static constexpr int ALPHA_OFF = S_OFF + DS * ROWS * S_STRIDE * 4;
  static constexpr int LSUM_OFF = ALPHA_OFF + ROWS * 4;
  static constexpr int MFIN_OFF = LSUM_OFF + ROWS * 4;
  static constexpr int KEY_OK_OFF = MFIN_OFF + ROWS * 4;           // one byte per key of each stage
  static constexpr int PAGE_RING = 2 * STAGES;
  static constexpr int PAGE_RING_OFF = KEY_OK_OFF + ((STAGES * BK + 15) / 16) * 16;
  static constexpr int BYTES = PAGE_RING_OFF + PAGE_RING * BK * 4;

  static_assert(KGROUPS * DS == kWarps && DS * KSTEPS * 16 == kDimKey, "warps tile keys x dims");
  static_assert(BK % 32 == 0 && ROWS == 2 * kWarps, "softmax: two rows per warp, whole lanes per key");
  static_assert(STAGES >= 2 && BK * ROW_BYTES >= ROWS * kNarrowRowBytes, "queries are staged in the last key stage");
  static_assert(ROW_BYTES % 128 == 0, "the swizzle spreads eight rows over all banks");
  static_assert(S_OFF % 16 == 0 && (S_STRIDE * 4) % 16 == 0, "ldmatrix rows are 16-byte aligned");
};

// 64 keys x 3 stages: the best of the shapes compared across the target shapes (ffi/cuda/NOTES.md).
using NarrowShape64x3 = NarrowShape<64, 3>;
// An fp8 ckv kept raw: 640-byte rows (32 chunks of e4m3 latent, 8 of kpe). Three stages, as for 16-bit
// rows: four and five took the same time (ffi/cuda/NOTES.md, "fp8 in registers"): the body, not the
// copy, bounds it.
using NarrowShapeFp8 = NarrowShape<64, 3, kDimCkv + 2 * kDimKpe>;
// Whether the narrow body keeps the cache's key rows raw and converts fragments in registers.
template <int kCache>
constexpr bool kNarrowRawFp8 = kCache == kCacheFp8Ckv;
template <int kCache>
using NarrowShapeFor = std::conditional_t<kNarrowRawFp8<kCache>, NarrowShapeFp8, NarrowShape64x3>;

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile of ROW_BYTES-byte rows.
template <int ROW_BYTES = kNarrowRowBytes>
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return (uint32_t)(row * ROW_BYTES + ((chunk ^ (row & 7)) << 4));
}

template <typename T, typename Shape, int kCache = kCacheAsQuery>
__device__ __forceinline__ void attend_unit_narrow(const Problem& p, Unit u, int h0, int hb, char* smem) {
  constexpr int BK = Shape::BK, STAGES = Shape::STAGES, DS = Shape::DS, KSTEPS = Shape::KSTEPS;
  constexpr int KPL = Shape::KPL, PASSES = Shape::PASSES, ROW = Shape::ROW_BYTES;
  // fp8 in registers (the file's head): raw rows, fp16 latent MMAs and P.
  constexpr bool kRaw8 = kNarrowRawFp8<kCache>;
  static_assert(!kRaw8 || ROW == kDimCkv + 2 * kDimKpe, "raw fp8 rows: 32 chunks of latent, 8 of kpe");
  static_assert(kRaw8 || ROW == kNarrowRowBytes, "rows of T");
  static_assert(!kRaw8 || (DS == 2 && KSTEPS == 18), "a dim slice: 16 fp8 latent steps, then 2 rope steps");
  using PT = std::conditional_t<kRaw8, __half, T>;  // P, and the latent MMAs' type
  // gather_key_row puts an fp8 row's raw latent at chunk CacheFormat::kRaw (where the expansion
  // wants it) and kpe at 64; a raw row starts at the latent: chunk c of the gather is c - C0 here.
  constexpr int C0 = kRaw8 ? CacheFormat<kCache>::kRaw : 0;

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int rows = u.q_len * hb;

  const uint32_t s_kv = smem_addr(smem + Shape::KV_OFF);
  const uint32_t s_q = s_kv + (STAGES - 1) * BK * ROW;  // staging only (rows of kNarrowRowBytes)
  float* s_part = reinterpret_cast<float*>(smem + Shape::S_OFF);
  float* alpha_s = reinterpret_cast<float*>(smem + Shape::ALPHA_OFF);
  float* lsum_s = reinterpret_cast<float*>(smem + Shape::LSUM_OFF);
  float* mfin_s = reinterpret_cast<float*>(smem + Shape::MFIN_OFF);
  unsigned char* key_ok = reinterpret_cast<unsigned char*>(smem + Shape::KEY_OK_OFF);
  int* page_ring = reinterpret_cast<int*>(smem + Shape::PAGE_RING_OFF);

  const CacheScales scales = cache_scales<kCache>(p);
  const float scale_log2 = p.scale_log2 * scales.score;

  const int kv_begin = u.kv_begin;
  const int* pt_row = page_table_row(p, u);
  int key_bound = early_key_bound(p, u);  // until finish_unit below
  int num_blocks = INT_MAX;

  auto fetch_pages = [&](int blk) {
    fetch_page_ids<BK, Shape::PAGE_RING>(p, pt_row, page_ring, kv_begin, blk, num_blocks, key_bound, tid);
  };
  auto issue_block = [&](int blk) {
    const int stage = blk % STAGES;
    gather_key_block<kCache, BK, Shape::PAGE_RING, PASSES>(
        p, u, page_ring, key_ok, kv_begin, blk, stage, tid,
        [&](int kl, int c) { return s_kv + (stage * BK + kl) * ROW + (((c - C0) ^ (kl & 7)) << 4); });
  };

  // Prologue: the pages of blocks 0 .. 2S-3, then the queries (staged: rows r = (token r / hb, head
  // h0 + r % hb), padding rows zero), two cp.async groups in one round trip with the device length in
  // flight beside them. Blocks 0 .. S-2 are gathered as soon as their page ids land (before the
  // queries, which arrive later: more bytes), into stages 0 .. S-2, beside the queries' staging stage;
  // the queries then move to registers while those keys are in flight.
#pragma unroll 1
  for (int b = 0; b < 2 * STAGES - 2; ++b) fetch_pages(b);
  cp_async_commit();
  load_query_tile<T, Shape::ROWS, kThreads>(p, u, h0, hb, rows, tid, [&](int r, int c) { return s_q + swz(r, c); });
  cp_async_commit();
  finish_unit(p, u);
  key_bound = u.range_end;
  num_blocks = (u.range_end - kv_begin + BK - 1) / BK;
  cp_async_wait<1>();  // the page ids (the queries may still be in flight)
  __syncthreads();
#pragma unroll 1  // one copy of the gather code besides the loop's (instruction-cache footprint)
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_blocks) issue_block(s);
    cp_async_commit();
  }
  cp_async_wait<STAGES - 1>();  // the queries (only the S - 1 key groups may still be in flight)
  __syncthreads();
  float row_scale[2] = {1.f, 1.f};  // softmax rows 2w, 2w+1: the queries' power of two (fp8 in registers)
  if constexpr (kRaw8) {
    narrow_prepare_queries_fp8<T>([&](int r, int c) { return s_q + swz(r, c); }, warp, lane, scales.rope_query,
                                  row_scale);
    __syncthreads();
  } else {
    scale_rope_queries<T, kCache>([&](int r, int c) { return s_q + swz(r, c); }, Shape::ROWS, scales.rope_query);
  }

  // ---- roles ----
  // S: key group kgrp (keys 16 kgrp .. +16 of the stage), dim slice ds (k16 steps
  // ds*KSTEPS .. +KSTEPS, i.e. 16-byte chunks 2 ds KSTEPS .. ). In every ldmatrix
  // below the lane's row is = lane (mod 8), so its swizzle term is lane & 7.
  const int kgrp = warp / DS, ds = warp - (warp / DS) * DS;
  const int sw = lane & 7;
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int a_chunk = lane >> 4;  // A operand: column 8 * a_chunk of the 16-wide step
  uint32_t qf[KSTEPS][4];
  if constexpr (kRaw8) {
    // Slice ds: latent steps 16 ds .. 16 ds + 15 (fp16, in the order of the keys' words: dims 4 t4 ..
    // 4 t4 + 3 of a step as k-slots 2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9), then rope steps 2 ds, 2 ds + 1.
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int c = 2 * (16 * ds + j) + (t4 >> 1), off = 8 * (t4 & 1);
      const uint2 lo = ld_shared_v2(s_q + swz(g, c) + off), hi = ld_shared_v2(s_q + swz(g + 8, c) + off);
      qf[j][0] = lo.x;
      qf[j][1] = hi.x;
      qf[j][2] = lo.y;
      qf[j][3] = hi.y;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = 64 + 2 * (2 * ds + j) + a_chunk;
      ldmatrix_x4(qf[16 + j], s_q + a_row * kNarrowRowBytes + ((c ^ sw) << 4));
    }
  } else {
#pragma unroll
    for (int j = 0; j < KSTEPS; ++j) {
      const int c = (ds * KSTEPS + j) * 2 + a_chunk;
      ldmatrix_x4(qf[j], s_q + a_row * kNarrowRowBytes + ((c ^ sw) << 4));
    }
  }
  const int kb_key = kgrp * 16 + (lane & 7) + (lane >> 4) * 8;
  const int kb_chunk = (ds * KSTEPS) * 2 + ((lane >> 3) & 1);
  // fp8 latent: matrices (keys 0-7, step j), (8-15, j), (0-7, j + 1), (8-15, j + 1) of the key group.
  const int k8_key = kgrp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;

  // Softmax: rows 2w and 2w+1, keys lane*KPL .. +KPL of the stage.
  int row_limit[2];
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_lane[2] = {0.f, 0.f};
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = 2 * warp + rr;
    row_limit[rr] = row_key_limit(u, r, rows, hb);
    row_scale[rr] *= scale_log2;
  }

  // PV: columns 64w .. 64w+63, all 16 rows.
  float o[8][4];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[nt][e] = 0.f;
  const uint32_t p_lane = smem_addr(s_part) + a_row * (Shape::S_STRIDE * 4) + a_chunk * 16;
  __syncthreads();  // every warp holds its queries: the staging stage (block S-1's) may be refilled

  for (int blk = 0; blk < num_blocks; ++blk) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // block blk landed for all; block blk-1 (its stage, P, S) fully consumed
    {
      const int nb = blk + STAGES - 1;
      if (nb < num_blocks) issue_block(nb);
      fetch_pages(nb + STAGES - 1);
      cp_async_commit();
    }
    const int stage = blk % STAGES;
    const uint32_t s_k = s_kv + stage * BK * ROW;
    const int key0 = kv_begin + blk * BK;
    if constexpr (!kRaw8)
      expand_fp8_stage<T, kCache, BK>([&](int key, int c) { return s_k + key * ROW + ((c ^ (key & 7)) << 4); });

    // ---- partial S over this warp's dim slice; four independent mma chains ----
    {
      float acc[2][2][4];
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[c][nt][e] = 0.f;
      const uint32_t k_row = s_k + kb_key * ROW;
      if constexpr (kRaw8) {
        const uint32_t k8_row = s_k + k8_key * ROW;
#pragma unroll
        for (int j = 0; j < 16; j += 2) {
          uint32_t kb[4];
          ldmatrix_x4(kb, k8_row + (((16 * ds + j + (lane >> 4)) ^ sw) << 4));
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            const uint2 b = fp8x4_to_half2x2(kb[m]);
            mma_16816<__half>(acc[m >> 1][m & 1], qf[j + (m >> 1)], b.x, b.y);
          }
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {  // rope: chunks 32 + 2 (2 ds + j) of the raw row, in T
          uint32_t kb[4];
          ldmatrix_x4(kb, k_row + (((32 + 2 * (2 * ds + j) + ((lane >> 3) & 1)) ^ sw) << 4));
          mma_16816<T>(acc[j][0], qf[16 + j], kb[0], kb[1]);
          mma_16816<T>(acc[j][1], qf[16 + j], kb[2], kb[3]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < KSTEPS; ++j) {
          uint32_t kb[4];
          ldmatrix_x4(kb, k_row + (((kb_chunk + 2 * j) ^ sw) << 4));
          mma_16816<T>(acc[j & 1][0], qf[j], kb[0], kb[1]);
          mma_16816<T>(acc[j & 1][1], qf[j], kb[2], kb[3]);
        }
      }
      float* sp = s_part + ds * Shape::ROWS * Shape::S_STRIDE;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = kgrp * 16 + nt * 8 + 2 * t4;
        *reinterpret_cast<float2*>(sp + g * Shape::S_STRIDE + col) =
            make_float2(acc[0][nt][0] + acc[1][nt][0], acc[0][nt][1] + acc[1][nt][1]);
        *reinterpret_cast<float2*>(sp + (g + 8) * Shape::S_STRIDE + col) =
            make_float2(acc[0][nt][2] + acc[1][nt][2], acc[0][nt][3] + acc[1][nt][3]);
      }
    }
    __syncthreads();  // partial scores of all slices visible

    // ---- softmax of rows 2w, 2w+1 over the whole stage (base 2) ----
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int r = 2 * warp + rr;
      float s[KPL];
#pragma unroll
      for (int kk = 0; kk < KPL; ++kk) s[kk] = 0.f;
#pragma unroll
      for (int d = 0; d < DS; ++d) {
        const float* src = s_part + (d * Shape::ROWS + r) * Shape::S_STRIDE + lane * KPL;
        if constexpr (KPL == 2) {
          const float2 v = *reinterpret_cast<const float2*>(src);
          s[0] += v.x;
          s[1] += v.y;
        } else {
#pragma unroll
          for (int kk = 0; kk < KPL; ++kk) s[kk] += src[kk];
        }
      }
      float mx = -INFINITY;
#pragma unroll
      for (int kk = 0; kk < KPL; ++kk) {
        const int kl = lane * KPL + kk;
        const bool vis = key_ok[stage * BK + kl] != 0 && key0 + kl < row_limit[rr];
        s[kk] = vis ? s[kk] * (kRaw8 ? row_scale[rr] : scale_log2) : -INFINITY;
        mx = fmaxf(mx, s[kk]);
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m_run[rr], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // nothing seen yet: zeros, no NaN
      const float alpha = fast_exp2(m_run[rr] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int kk = 0; kk < KPL; ++kk) {
        s[kk] = fast_exp2(s[kk] - m_use);
        sum += s[kk];
      }
      l_lane[rr] = l_lane[rr] * alpha + sum;
      m_run[rr] = m_new;
      // P row r overwrites the slice-0 scores of row r, which this warp alone reads
      // (all lanes have: the shuffles above waited for every lane's loads).
      __syncwarp();
      PT* prow = reinterpret_cast<PT*>(s_part) + r * Shape::P_STRIDE + lane * KPL;
      if constexpr (KPL == 2) {
        *reinterpret_cast<uint32_t*>(prow) = pack2<PT>(s[0], s[1]);
      } else {
#pragma unroll
        for (int kk = 0; kk < KPL; ++kk) prow[kk] = from_float<PT>(s[kk]);
      }
      if (lane == 0) alpha_s[r] = alpha;
    }
    __syncthreads();  // P and the rescale factors visible

    // ---- O = alpha O + P V over this warp's 64 columns ----
    {
      rescale_rows(o, alpha_s[g], alpha_s[g + 8]);
      const uint32_t v_row = s_k + a_row * ROW;
#pragma unroll
      for (int ks = 0; ks < BK / 16; ++ks) {
        uint32_t pa[4];
        ldmatrix_x4(pa, p_lane + ks * 32);
        if constexpr (kRaw8) {
          // V rows (keys) ks*16 + a_row; fp8 chunks 4w + 2np + a_chunk (16 columns each). o[2 cl + e]:
          // chunk 4w + cl of the warp, its even (e = 0) or odd (e = 1) columns.
#pragma unroll
          for (int np = 0; np < 2; ++np) {
            uint32_t vb[4];
            ldmatrix_x4_trans(vb, v_row + ks * 16 * ROW + (((warp * 4 + np * 2 + a_chunk) ^ sw) << 4));
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // vb[2h]: keys 0-7 of chunk 2np + h, vb[2h + 1]: keys 8-15
              const uint2 lo = fp8x4_trans_to_half2x2(vb[2 * h]), hi = fp8x4_trans_to_half2x2(vb[2 * h + 1]);
              mma_16816<__half>(o[4 * np + 2 * h], pa, lo.x, hi.x);
              mma_16816<__half>(o[4 * np + 2 * h + 1], pa, lo.y, hi.y);
            }
          }
        } else {
          // V rows (keys) ks*16 + a_row; columns 64w + 16 np + 8 a_chunk, i.e. chunk 8w + 2np + a_chunk.
#pragma unroll
          for (int np = 0; np < 4; ++np) {
            uint32_t vb[4];
            ldmatrix_x4_trans(vb, v_row + ks * 16 * ROW + (((warp * 8 + np * 2 + a_chunk) ^ sw) << 4));
            mma_16816<T>(o[2 * np], pa, vb[0], vb[1]);
            mma_16816<T>(o[2 * np + 1], pa, vb[2], vb[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();  // only empty groups can remain; leave nothing in flight

  // ---- row sums and maxima for the epilogue ----
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float l = l_lane[rr];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
    if (lane == 0) {
      lsum_s[2 * warp + rr] = l;
      mfin_s[2 * warp + rr] = m_run[rr];
    }
  }
  __syncthreads();

  // ---- epilogue: normalise and store (directly, or as a split partial) ----
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = g + 8 * e;
    if (r >= rows) continue;
    if constexpr (kRaw8) {  // pair j: columns 64w + 16 (j / 2) + 4 t4 + 2 (j % 2) + {0, 1}
      store_tile_row<T, 8, 2>(p, u, h0, hb, r, warp * 64 + 4 * t4, lsum_s[r], mfin_s[r], scales.out,
                              warp == 0 && t4 == 0, [&](int j) {
                                const int cl = j >> 1, x = 2 * e + (j & 1);
                                return make_float2(o[2 * cl][x], o[2 * cl + 1][x]);
                              });
    } else {
      store_tile_row<T, 8>(p, u, h0, hb, r, warp * 64 + 2 * t4, lsum_s[r], mfin_s[r], scales.out,
                           warp == 0 && t4 == 0, [&](int nt) { return make_float2(o[nt][2 * e], o[nt][2 * e + 1]); });
    }
  }
}

}  // namespace cuda
}  // namespace jax_mla
