// The portable tensor-core kernel of the paged MLA op (bf16 / fp16, d_ckv 512,
// d_kpe 64): mma.sync only, so it runs on sm_80 and on any build without sm_90a
// code. On compute capability 9.0 with an sm_90a build, mla_wide_sm90.cuh's
// kernel runs instead (its wide body uses wgmma and a producer warpgroup).
//
// One thread block (8 warps) computes one work unit of the host plan for up to
// 64 query rows (rows = tokens x heads of the unit; a unit of a model with more
// than 64 heads is spread over ceil(H/64) blocks). The block walks the unit's
// key range in blocks of BK keys:
//
//   * keys are gathered through the page table with 16-byte cp.async into a
//     STAGES-deep ring of shared-memory tiles [BK][512 | 64]; page ids come
//     STAGES-1 blocks ahead through a second (smem) ring, so the gather never
//     waits on a page-table read;
//   * S = Q K^T (fp32 accumulate): the "S warps" split the rows (16-row tiles)
//     and keys between them with mma.sync m16n8k16 and ldmatrix;
//   * online softmax in base 2: row maxima are combined across warps through
//     shared memory, P is rounded to the input type and shared the same way;
//   * O += P V: every warp owns 64 of the 512 output columns for all rows, so
//     V (the ckv half of the key tile) is read from shared memory once.
//
// The row count decides the body at run time (a 16-head decode unit has 16
// rows, a 4-token causal unit of the same model 64): units of <= 16 rows take
// the narrow body (mla_narrow_kernel.cuh: queries in registers, 64-key stages),
// wider ones this file's body with 32 or 64 rows; one is taken uniformly per block.
//
// Split units write normalised float32 partial outputs and natural-log LSEs to
// the workspace; mla_merge_kernel combines them (mla_merge_kernel.cuh).
#pragma once

#include "mla_common.cuh"
#include "mla_fp8.cuh"
#include "mla_narrow_kernel.cuh"
#include "mla_stages.cuh"

namespace jax_mla {
namespace cuda {

template <int MT_, int BK_, int STAGES_>
struct TileShape {
  static constexpr int MT = MT_;          // 16-row tiles
  static constexpr int BK = BK_;          // keys per pipeline stage
  static constexpr int STAGES = STAGES_;  // depth of the key ring
  static constexpr int MP = MT * 16;      // padded rows
  // S phase: warps = MT row tiles x KG key groups of KW keys (NT n8 tiles each).
  static constexpr int KG = (8 / MT) < (BK / 8) ? (8 / MT) : (BK / 8);
  static constexpr int SW = MT * KG;
  static constexpr int KW = BK / KG;
  static constexpr int NT = KW / 8;
  static constexpr int PASSES = BK / 32;  // 256 threads x 16 B cover 32 keys per pass
  static constexpr int P_STRIDE = BK + 8; // elements; padded like the key rows
  // Query and key tiles: rows padded by 16 bytes (ldmatrix reads them without
  // bank conflicts).
  static constexpr int Q_BYTES = MP * kRowBytes;
  static constexpr int STAGE_BYTES = BK * kRowBytes;
  // Byte offset of 16-byte chunk c (of 72) of row r.
  static __device__ __forceinline__ uint32_t chunk_offset(int r, int c) { return r * kRowBytes + c * 16; }
  // Byte offsets in dynamic shared memory.
  static constexpr int Q_OFF = 0;
  static constexpr int KV_OFF = Q_OFF + Q_BYTES;
  static constexpr int P_OFF = KV_OFF + STAGES * STAGE_BYTES;
  static constexpr int RED_MAX_OFF = P_OFF + MP * P_STRIDE * 2;
  static constexpr int RED_SUM_OFF = RED_MAX_OFF + KG * MP * 4;
  static constexpr int ALPHA_OFF = RED_SUM_OFF + KG * MP * 4;
  static constexpr int M_FINAL_OFF = ALPHA_OFF + MP * 4;
  static constexpr int KEY_OK_OFF = M_FINAL_OFF + MP * 4;
  static constexpr int PAGE_RING = 2 * STAGES;  // blocks of page ids in flight or waiting
  static constexpr int PAGE_RING_OFF = KEY_OK_OFF + STAGES * BK * 4;
  static constexpr int BYTES = PAGE_RING_OFF + PAGE_RING * BK * 4;

  static_assert(NT == 1 || NT == 2, "mma.sync S warps hold one or two n8 tiles");
  static_assert(SW <= kWarps && BK % 32 == 0 && BK <= kThreads, "tile shape");
  static_assert(8 * 64 == kDimCkv, "each warp owns 64 output columns");
};

// The two wide bodies: 32 rows and 64 rows (16 rows: mla_narrow_kernel.cuh).
using Tile32 = TileShape<2, 32, 4>;
using Tile64 = TileShape<4, 32, 3>;

constexpr int cmax(int a, int b) { return a > b ? a : b; }
constexpr int kAttentionSmemBytes =
    cmax(cmax(Tile32::BYTES, Tile64::BYTES), cmax(NarrowShape64x3::BYTES, NarrowShapeFp8::BYTES));
static_assert(kAttentionSmemBytes <= 227 * 1024, "one block per SM must fit");

template <typename T, typename Shape, int kCache = kCacheAsQuery, bool kL2Hint = true>
__device__ __forceinline__ void attend_unit(const Problem& p, const Unit& u, int h0, int hb, char* smem) {
  constexpr int MT = Shape::MT, BK = Shape::BK, STAGES = Shape::STAGES, MP = Shape::MP;
  constexpr int KG = Shape::KG, KW = Shape::KW, NT = Shape::NT, PASSES = Shape::PASSES;

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int rows = u.q_len * hb;

  const uint32_t s_q = smem_addr(smem + Shape::Q_OFF);
  const uint32_t s_kv = smem_addr(smem + Shape::KV_OFF);
  const uint32_t s_p = smem_addr(smem + Shape::P_OFF);
  float* red_max = reinterpret_cast<float*>(smem + Shape::RED_MAX_OFF);
  float* red_sum = reinterpret_cast<float*>(smem + Shape::RED_SUM_OFF);
  float* alpha_s = reinterpret_cast<float*>(smem + Shape::ALPHA_OFF);
  float* m_final = reinterpret_cast<float*>(smem + Shape::M_FINAL_OFF);
  int* key_ok = reinterpret_cast<int*>(smem + Shape::KEY_OK_OFF);
  int* page_ring = reinterpret_cast<int*>(smem + Shape::PAGE_RING_OFF);

  const CacheScales scales = cache_scales<kCache>(p);
  const float scale_log2 = p.scale_log2 * scales.score;

  // ---- queries: rows r = (token r / hb, head h0 + r % hb); padding rows zero ----
  load_query_tile<T, MP, kThreads>(p, u, h0, hb, rows, tid, [&](int r, int c) { return s_q + Shape::chunk_offset(r, c); });

  // ---- key gather: thread -> (key kl = pass*32 + tid/8, chunks tid%8 + 8i) ----
  const int kv_begin = u.kv_begin;
  const int num_keys = u.range_end - kv_begin;
  const int num_blocks = (num_keys + BK - 1) / BK;
  const int* pt_row = page_table_row(p, u);

  // Page ids travel through a shared-memory ring, fetched with 4-byte cp.async
  // S-1 blocks before the keys that need them and waited for together with the
  // keys of an earlier block: the gather never stalls on a page-table read.
  // Slot of block b: b % PAGE_RING; entries past the range are zero-filled and
  // never used (issue_block checks the key index first).
  auto fetch_pages = [&](int blk) {
    fetch_page_ids<BK, Shape::PAGE_RING>(p, pt_row, page_ring, kv_begin, blk, num_blocks, u.range_end, tid);
  };
  auto issue_block = [&](int blk) {
    const int stage = blk % STAGES;
    const uint32_t dst = s_kv + stage * Shape::STAGE_BYTES;
    gather_key_block<kCache, BK, Shape::PAGE_RING, PASSES, 32, kL2Hint>(
        p, u, page_ring, key_ok, kv_begin, blk, stage, tid,
        [&](int kl, int c) { return dst + Shape::chunk_offset(kl, c); });
  };

  // Prologue: the queries and the pages of blocks 0 .. 2S-3 (one round trip),
  // then the keys of blocks 0 .. S-2, one commit group each.
  for (int b = 0; b < 2 * STAGES - 2; ++b) fetch_pages(b);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  scale_rope_queries<T, kCache>([&](int r, int c) { return s_q + Shape::chunk_offset(r, c); }, MP,
                                scales.rope_query);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_blocks) issue_block(s);
    cp_async_commit();
  }

  // ---- per-thread state ----
  // S role (warp < SW): row tile mt, key group kg; rows r0 = mt*16+g, r0+8.
  const bool s_warp = warp < Shape::SW;
  const int mt_s = warp % MT, kg = warp / MT;
  const int r_s[2] = {mt_s * 16 + g, mt_s * 16 + g + 8};
  int row_limit[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = r_s[e];
    row_limit[e] = row_key_limit(u, r, rows, hb);
  }
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};

  // O role (all warps): columns warp*64 .. +64, all MP rows.
  float o[MT][8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][nt][e] = 0.f;

  // ldmatrix lane addresses (byte offsets inside a tile).
  // A operand (16x16, row-major): lanes 0-7 rows 0-7 / 8-15 rows 8-15, cols 0 | 8.
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int a_col = (lane >> 4) * 8;
  const uint32_t q_lane = s_q + (mt_s * 16 + a_row) * kRowBytes + a_col * 2;
  // B operand of S (keys as n): NT==1 -> one key octet, four k8 slices (two k-steps);
  // NT==2 -> two key octets, two k8 slices (one k-step).
  const int kb_key = NT == 1 ? kg * KW + (lane & 7) : kg * KW + (lane & 7) + (lane >> 4) * 8;
  const int kb_col = NT == 1 ? (lane >> 3) * 8 : ((lane >> 3) & 1) * 8;
  // A operand of PV (P, row-major): rows a_row, keys a_col.
  const uint32_t p_lane = s_p + a_row * (Shape::P_STRIDE * 2) + a_col * 2;

  for (int blk = 0; blk < num_blocks; ++blk) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // block blk landed for everyone; block blk-1 fully consumed
    {
      const int nb = blk + STAGES - 1;  // refill the stage block blk-1 used
      if (nb < num_blocks) issue_block(nb);
      fetch_pages(nb + STAGES - 1);     // its pages land with block nb's keys, S-1 iterations early
      cp_async_commit();
    }
    const int stage = blk % STAGES;
    const uint32_t s_k = s_kv + stage * Shape::STAGE_BYTES;
    const int key0 = kv_begin + blk * BK;
    expand_fp8_stage<T, kCache, BK>([&](int key, int c) { return s_k + Shape::chunk_offset(key, c); });

    // ---- S = Q K^T for this warp's rows and keys ----
    float sc[NT][4];
    float mx[2] = {-INFINITY, -INFINITY};
    if (s_warp) {
      {
        float acc[2][NT][4];
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[h][nt][e] = 0.f;
        const uint32_t k_lane = s_k + kb_key * kRowBytes + kb_col * 2;
        if constexpr (NT == 1) {
#pragma unroll 6
          for (int j = 0; j < kDimKey / 32; ++j) {
            uint32_t kb[4], qa[4], qb[4];
            ldmatrix_x4(kb, k_lane + j * 64);
            ldmatrix_x4(qa, q_lane + j * 64);
            ldmatrix_x4(qb, q_lane + j * 64 + 32);
            mma_16816<T>(acc[0][0], qa, kb[0], kb[1]);
            mma_16816<T>(acc[1][0], qb, kb[2], kb[3]);
          }
        } else {
#pragma unroll 6
          for (int j = 0; j < kDimKey / 32; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              uint32_t kb[4], qa[4];
              ldmatrix_x4(kb, k_lane + j * 64 + h * 32);
              ldmatrix_x4(qa, q_lane + j * 64 + h * 32);
              mma_16816<T>(acc[h][0], qa, kb[0], kb[1]);
              mma_16816<T>(acc[h][1], qa, kb[2], kb[3]);
            }
          }
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) sc[nt][e] = acc[0][nt][e] + acc[1][nt][e];
      }
      // Scale, mask, and this warp's row maxima (a row's keys sit in four lanes).
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int kl = kg * KW + nt * 8 + 2 * t4 + (e & 1);
          const bool vis = key_ok[stage * BK + kl] != 0 && key0 + kl < row_limit[e >> 1];
          sc[nt][e] = vis ? sc[nt][e] * scale_log2 : -INFINITY;
          mx[e >> 1] = fmaxf(mx[e >> 1], sc[nt][e]);
        }
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 1));
        mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 2));
        if (KG > 1 && t4 == 0) red_max[kg * MP + r_s[e]] = mx[e];
      }
    }
    if constexpr (KG > 1) __syncthreads();  // row maxima of all key groups visible

    // ---- softmax: P = 2^(S - m), running max and (per-thread partial) sums ----
    if (s_warp) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float m_blk = mx[e];
        if constexpr (KG > 1) {
#pragma unroll
          for (int k = 0; k < KG; ++k) m_blk = fmaxf(m_blk, red_max[k * MP + r_s[e]]);
        }
        const float m_new = fmaxf(m_run[e], m_blk);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;  // no key seen yet: keep zeros, no NaN
        const float alpha = fast_exp2(m_run[e] - m_use);
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          sc[nt][2 * e] = fast_exp2(sc[nt][2 * e] - m_use);
          sc[nt][2 * e + 1] = fast_exp2(sc[nt][2 * e + 1] - m_use);
          sum += sc[nt][2 * e] + sc[nt][2 * e + 1];
        }
        l_run[e] = l_run[e] * alpha + sum;
        m_run[e] = m_new;
        if (kg == 0 && t4 == 0) alpha_s[r_s[e]] = alpha;
      }
      uint32_t* p_words = reinterpret_cast<uint32_t*>(smem + Shape::P_OFF);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int col = kg * KW + nt * 8 + 2 * t4;
        p_words[(r_s[0] * Shape::P_STRIDE + col) >> 1] = pack2<T>(sc[nt][0], sc[nt][1]);
        p_words[(r_s[1] * Shape::P_STRIDE + col) >> 1] = pack2<T>(sc[nt][2], sc[nt][3]);
      }
    }
    __syncthreads();  // P and the rescale factors visible

    // ---- O = alpha * O + P V over this warp's 64 columns ----
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) rescale_rows(o[mt], alpha_s[mt * 16 + g], alpha_s[mt * 16 + g + 8]);
    // V rows: keys ks*16 + a_row, columns warp*64 + np*16 + a_col.
    const uint32_t v_lane = s_k + a_row * kRowBytes + (warp * 64 + a_col) * 2;
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(pa[mt], p_lane + mt * 16 * (Shape::P_STRIDE * 2) + ks * 32);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_lane + ks * 16 * kRowBytes + np * 32);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<T>(o[mt][2 * np], pa[mt], vb[0], vb[1]);
          mma_16816<T>(o[mt][2 * np + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
  }
  cp_async_wait<0>();  // only empty groups can remain; leave nothing in flight

  // ---- combine the per-warp softmax sums; final max per row ----
  if (s_warp) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float l = l_run[e];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      if (t4 == 0) {
        red_sum[kg * MP + r_s[e]] = l;
        if (kg == 0) m_final[r_s[e]] = m_run[e];
      }
    }
  }
  __syncthreads();

  // ---- epilogue: normalise and store (directly, or as a split partial) ----
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = mt * 16 + g + 8 * e;
      if (r >= rows) continue;
      float l = 0.f;
#pragma unroll
      for (int k = 0; k < KG; ++k) l += red_sum[k * MP + r];
      store_tile_row<T, 8>(p, u, h0, hb, r, warp * 64 + 2 * t4, l, m_final[r], scales.out, warp == 0 && t4 == 0,
                           [&](int nt) { return make_float2(o[mt][nt][2 * e], o[mt][nt][2 * e + 1]); });
    }
  }
}

// A unit of more than 16 rows on the portable body (the unit finished): 32- or 64-row tiles. kL2Hint:
// gather_key_row's.
template <typename T, int kCache, bool kL2Hint = true>
__device__ __forceinline__ void attend_unit_wide_portable(const Problem& p, const Unit& u, int h0, int hb,
                                                          char* smem) {
  if (u.q_len * hb <= 32) {
    attend_unit<T, Tile32, kCache, kL2Hint>(p, u, h0, hb, smem);
  } else {
    attend_unit<T, Tile64, kCache, kL2Hint>(p, u, h0, hb, smem);
  }
}

// grid.x = W * head_blocks (the head blocks of one unit are neighbours, so they
// run together and the second one finds the keys in L2); 256 threads.
template <typename T, int kCache = kCacheAsQuery>
__global__ void __launch_bounds__(kThreads, 1) mla_attention_kernel(const Problem p) {
  extern __shared__ __align__(16) char smem[];
  allow_dependent_launch();  // the merge kernel may be scheduled as blocks retire
  JAX_MLA_BLOCK_TRACE_SCOPE(0);
  const int unit_index = blockIdx.x / p.head_blocks;
  const int head_block = blockIdx.x - unit_index * p.head_blocks;
  Unit u;
  if (!start_unit(p, unit_index, u)) return;  // padding unit (or unusable row)
  const int h0 = head_block * kRowsPerTile;
  const int hb = min(kRowsPerTile, p.num_heads - h0);
  const int rows = u.q_len * hb;
  if (rows > kRowsPerTile) return;  // cannot happen with q_len <= q_tile; keeps tiles in bounds
  if (rows <= 16) {
    attend_unit_narrow<T, NarrowShapeFor<kCache>, kCache>(p, u, h0, hb, smem);  // finishes the unit after its first loads
    return;
  }
  finish_unit(p, u);
  attend_unit_wide_portable<T, kCache>(p, u, h0, hb, smem);
}

}  // namespace cuda
}  // namespace jax_mla
