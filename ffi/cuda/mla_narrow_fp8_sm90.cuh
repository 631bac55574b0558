// The narrow body (units of at most 16 query rows) for an e4m3 ckv on sm_90a: both products
// transposed, so that the keys are wgmma's register operand and are converted in registers.
//
// Status: an experiment, built only with -DJAX_MLA_NARROW_FP8_WGMMA (the sm90 kernel otherwise runs
// the mma.sync body). It is correct on every driver case (tools/sanitize_harness, errors equal to the
// mma.sync body's) and memcheck / synccheck clean, and its attention kernel alone is faster (128 x
// 4096 x 16 heads 105.8 against 107.7 us, 256 x U[1, 8192] 206.5 against 217.6), but the op is not:
// after the merge kernel of the previous call the attention runs ~15 us slower than alone (the
// mma.sync body ~6), so the op took 121.2 against 114.7 us. racecheck also reports hazards between
// accesses that named barriers order (after the kernel's third warpgroup has exited). Both are open;
// ffi/cuda/NOTES.md, "A transposed wgmma narrow body for fp8", has the numbers.
//
// Why. The mma.sync narrow body with an fp8 ckv (mla_narrow_kernel.cuh, "fp8 in registers") is
// bound by its own latency at ~1.75 us a 64-key block even with the keys in L2: eight warps run its
// steps in lock step between three block barriers, so the conversions, the MMAs, the partial
// scores' exchange and the softmax add up (ffi/cuda/NOTES.md). fp8 at 1.7x of bf16 needs ~1.35 us.
//
// What. wgmma needs M = 64 and takes A from registers, B only from shared memory. With 16 query
// rows the keys are the 64 of M:
//   * S^T = K Q^T: A = a 64-key block's latent rows, ldmatrix'd raw and converted in registers
//     (one cvt a pair, exact, fp16); B = the queries, K-major, stored once per unit with each
//     16-dim step's dims in the order a converted word holds them (dims 4t .. 4t+3 of one key as
//     k-slots 2t, 2t+1, 2t+8, 2t+9). The rope part: A = kpe rows (the query type), B = q_pe.
//   * O^T = V^T P^T: A = the same raw rows through ldmatrix.trans and a byte permute (a register
//     holds two consecutive keys of one dim); B = P, 16 rows x 64 keys, K-major, written by the
//     softmax with stmatrix.trans. Warp w of the warpgroup holds dims 64 j + 16 w + {2g, 2g + 1}
//     of every output tile j (8 tiles of 64 dims x 16 rows, 64 floats a thread).
//   * The two warpgroups are two independent pipelines over the unit's even and odd blocks, each
//     with its own two stages, cp.async gathers, page-id ring, running max and sum and O, and its
//     own named barriers (four a block): one warpgroup's softmax and exchanges overlap the other's
//     conversions and MMAs. Their halves meet once, in the epilogue.
// The row maxima cross the warpgroup's four warps through shared memory once a block (each warp
// holds 16 keys of every row); the row sums stay per thread until the epilogue.
//
// Scales and precision are the mma.sync fp8 body's: latent MMAs in fp16 with the queries brought
// into fp16 by a power of two per row (narrow_prepare_queries_fp8), rope MMAs in the query type, P
// in fp16, s_c on the softmax scale and the output (mla_fp8.cuh).
#pragma once

#include "mla_hopper.cuh"
#include "mla_narrow_kernel.cuh"

namespace jax_mla {
namespace cuda {

struct NarrowFp8Sm90 {
  static constexpr int ROWS = 16;
  static constexpr int BK = 64;                      // keys a block: wgmma's M
  static constexpr int ROW = kDimCkv + 2 * kDimKpe;  // a raw key row: 32 chunks of e4m3 latent, 8 of kpe
  static constexpr int STAGE = BK * ROW;             // 40 KB
  static constexpr int STAGES = 2;                   // per warpgroup
  static constexpr int RING = 8;                     // page-id slots per warpgroup (global block mod 8)
  static constexpr int PANEL = ROWS * 128;           // 16 rows x 64 16-bit values, 128-byte swizzle
  static constexpr int KV_OFF = 0;                   // warpgroup w's stages at KV_OFF + w STAGES STAGE
  static constexpr int QP_OFF = KV_OFF + 2 * STAGES * STAGE;  // 8 latent panels (fp16, permuted dims), rope panel (T)
  static constexpr int P_OFF = QP_OFF + 9 * PANEL;            // P panels [warpgroup][block parity]
  static constexpr int RED_OFF = P_OFF + 4 * PANEL;           // float [warpgroup][parity][warp][16]: block maxima
  static constexpr int RSCALE_OFF = RED_OFF + 2 * 2 * 4 * ROWS * 4;  // float [16]: the rows' 2^-k
  static constexpr int MSTAT_OFF = RSCALE_OFF + ROWS * 4;             // float [warpgroup][16]: final maxima
  static constexpr int LSTAT_OFF = MSTAT_OFF + 2 * ROWS * 4;          // float [warpgroup][warp][16]: sums
  static constexpr int KEY_OK_OFF = LSTAT_OFF + 2 * 4 * ROWS * 4;     // u8 [warpgroup][stage][BK]
  static constexpr int RING_OFF = KEY_OK_OFF + 2 * STAGES * BK;       // int [warpgroup][RING][BK]
  static constexpr int BYTES = RING_OFF + 2 * RING * BK * 4;
  static constexpr int SMEM_BYTES = BYTES + 1024 - 16;  // room to align the base
  // The queries' staging rows (kNarrowRowBytes each): warpgroup 1's second stage, first gathered
  // into after the queries have moved to their panels.
  static constexpr int STAGING_OFF = KV_OFF + 3 * STAGE;

  static_assert(ROWS * kNarrowRowBytes <= STAGE, "the queries are staged in one stage");
  static_assert(2 * 16 * 128 * 4 <= 9 * PANEL, "a round of the epilogue's O exchange fits in the query panels");
  static_assert(STAGE % 1024 == 0 && QP_OFF % 1024 == 0 && P_OFF % 1024 == 0 && PANEL % 1024 == 0,
                "swizzle atoms stay aligned");
  static_assert(ROW % 128 == 0, "the swizzle spreads eight rows over all banks");
};

// Query row (column of S^T and O^T) of accumulator element e of a 64 x 16 tile: R[acc_row(e)] with
// R = {2t, 2t + 1, 8 + 2t, 9 + 2t}; its M-row (key, or dim) is g + 8 ((e >> 1) & 1) of the warp's 16.
__device__ __forceinline__ constexpr int acc_row(int e) { return (e & 1) + 2 * (e >> 2); }

// Two A fragments (m64 x k16, the mma.sync A layout per warp) from the four converted words of one
// ldmatrix.x4: c0, c1 the first fragment's matrices (its rows g and g + 8 of the warp's 16), c2, c3
// the second's. kKeys (S^T: rows are keys): a word's .x holds k-slots 2t, 2t+1 and .y k-slots 2t+8,
// 2t+9 of its row. Otherwise (O^T: rows are dims; ldmatrix.trans): a word's .x is row g (dim 2g) and
// .y row g + 8 (dim 2g + 1), for k-slots 2t, 2t+1 (c0, c2) or 2t+8, 2t+9 (c1, c3).
template <bool kKeys>
__device__ __forceinline__ void transposed_a_fragments(uint32_t (&a0)[4], uint32_t (&a1)[4], uint2 c0, uint2 c1,
                                                       uint2 c2, uint2 c3) {
  if constexpr (kKeys) {
    a0[0] = c0.x, a0[1] = c1.x, a0[2] = c0.y, a0[3] = c1.y;
    a1[0] = c2.x, a1[1] = c3.x, a1[2] = c2.y, a1[3] = c3.y;
  } else {
    a0[0] = c0.x, a0[1] = c0.y, a0[2] = c1.x, a0[3] = c1.y;
    a1[0] = c2.x, a1[1] = c2.y, a1[2] = c3.x, a1[3] = c3.y;
  }
}

template <typename T>
__device__ __forceinline__ void attend_unit_narrow_fp8_sm90(const Problem& p, Unit u, int h0, int hb, char* smem) {
  using N = NarrowFp8Sm90;
  constexpr int kCache = kCacheFp8Ckv;
  constexpr int C0 = CacheFormat<kCache>::kRaw;  // gather_key_row's first raw chunk: chunk c is c - C0 here
  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform, as wgmma needs
  const int wtid = tid & 127;
  const int warp = wtid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int rows = u.q_len * hb;
  const int bar = 1 + wg;  // this warpgroup's named barrier
  // Both warpgroups: a named barrier of 256 threads (the kernel's third warpgroup has left).
  constexpr int kBothWarpgroups = 3;

  uint32_t base = smem_addr(smem);
  const uint32_t pad = (1024 - (base & 1023)) & 1023;  // the 128-byte swizzle's atoms are 1024-byte aligned
  base += pad;
  char* gbase = smem + pad;
  const uint32_t s_kv = base + N::KV_OFF + wg * N::STAGES * N::STAGE;
  const uint32_t s_q = base + N::STAGING_OFF;
  unsigned char* key_ok = reinterpret_cast<unsigned char*>(gbase + N::KEY_OK_OFF) + wg * N::STAGES * N::BK;
  int* ring = reinterpret_cast<int*>(gbase + N::RING_OFF) + wg * N::RING * N::BK;
  float* red = reinterpret_cast<float*>(gbase + N::RED_OFF);
  float* rscale = reinterpret_cast<float*>(gbase + N::RSCALE_OFF);
  float* mstat = reinterpret_cast<float*>(gbase + N::MSTAT_OFF);
  float* lstat = reinterpret_cast<float*>(gbase + N::LSTAT_OFF);

  const CacheScales scales = cache_scales<kCache>(p);
  const float scale_log2 = p.scale_log2 * scales.score;
  const int kv_begin = u.kv_begin;
  const int* pt_row = page_table_row(p, u);
  int key_bound = early_key_bound(p, u);  // until finish_unit below
  int num_blocks = INT_MAX;
  // This warpgroup's local block i is the unit's block 2 i + wg.
  auto fetch_pages = [&](int i) {
    fetch_page_ids<N::BK, N::RING>(p, pt_row, ring, kv_begin, 2 * i + wg, num_blocks, key_bound, wtid);
  };
  auto issue_block = [&](int i) {
    const uint32_t stage = s_kv + (i & 1) * N::STAGE;
    gather_key_block<kCache, N::BK, N::RING, N::BK / 16, 16>(
        p, u, ring, key_ok, kv_begin, 2 * i + wg, i & 1, wtid,
        [&](int kl, int c) { return stage + swz<N::ROW>(kl, c - C0); });  // the narrow body's swizzle
  };

  // ---- prologue (both warpgroups): page ids of local blocks 0-2, the queries, block 0 ----
#pragma unroll 1
  for (int i = 0; i < 3; ++i) fetch_pages(i);
  cp_async_commit();
  load_query_tile<T, N::ROWS, kThreads>(p, u, h0, hb, rows, tid, [&](int r, int c) { return s_q + swz(r, c); });
  cp_async_commit();
  finish_unit(p, u);
  key_bound = u.range_end;
  num_blocks = (u.range_end - kv_begin + N::BK - 1) / N::BK;
  const int my_blocks = num_blocks > wg ? (num_blocks - wg + 1) / 2 : 0;
  cp_async_wait<1>();  // the page ids
  named_barrier_sync(kBothWarpgroups, 256);
  if (my_blocks > 0) issue_block(0);
  cp_async_commit();
  cp_async_wait<1>();  // the queries (block 0 may still be in flight)
  named_barrier_sync(kBothWarpgroups, 256);
  {
    float rs2[2];
    narrow_prepare_queries_fp8<T>([&](int r, int c) { return s_q + swz(r, c); }, tid >> 5, lane, scales.rope_query,
                                  rs2);
    if (lane == 0) {
      rscale[2 * (tid >> 5)] = rs2[0];
      rscale[2 * (tid >> 5) + 1] = rs2[1];
    }
  }
  named_barrier_sync(kBothWarpgroups, 256);
  // The queries into their panels: each 16-dim latent step as its two chunks of k-slots (dim pairs
  // 0, 2, 4, 6, then 1, 3, 5, 7 of the step: the order of a converted key word), the rope as is.
  for (int idx = tid; idx < N::ROWS * 40; idx += kThreads) {
    const int r = idx / 40, s = idx - r * 40;
    if (s < 32) {
      const uint4 a = ld_shared_v4(s_q + swz(r, 2 * s)), b = ld_shared_v4(s_q + swz(r, 2 * s + 1));
      const uint32_t row = base + N::QP_OFF + (s >> 2) * N::PANEL + r * 128;
      const int c = 2 * (s & 3);
      st_shared_v4(row + ((c ^ (r & 7)) << 4), make_uint4(a.x, a.z, b.x, b.z));
      st_shared_v4(row + (((c + 1) ^ (r & 7)) << 4), make_uint4(a.y, a.w, b.y, b.w));
    } else {
      const int c = s - 32;
      st_shared_v4(base + N::QP_OFF + 8 * N::PANEL + r * 128 + ((c ^ (r & 7)) << 4),
                   ld_shared_v4(s_q + swz(r, 64 + c)));
    }
  }
  fence_proxy_async_shared();  // the panels reach wgmma's reads
  named_barrier_sync(kBothWarpgroups, 256);

  // ---- per thread: rows R[k] of the accumulators (S^T's and O^T's columns; acc_row) ----
  int R[4], row_limit[4];
  float row_scale[4], m_run[4], l_thr[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    R[k] = 2 * t4 + (k & 1) + 8 * (k >> 1);
    row_limit[k] = row_key_limit(u, R[k], rows, hb);
    row_scale[k] = scale_log2 * rscale[R[k]];
    m_run[k] = -INFINITY;
    l_thr[k] = 0.f;
  }
  float o[8][8];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) o[j][e] = 0.f;
  const uint32_t q_lo = sw128_desc_lo(base + N::QP_OFF);
  // ldmatrix addresses: lanes 0-7 keys 0-7, lanes 8-15 keys 8-15 (of 16), lanes 16-31 the same keys
  // one chunk on; every row's swizzle term is lane & 7.
  const int k8 = (lane & 7) + ((lane >> 3) & 1) * 8, hi = lane >> 4, sw = lane & 7;
  uint32_t fa[2][8][4];  // A fragments, two windows of eight k16 steps (one in flight while one fills)

#pragma unroll 1
  for (int i = 0; i < my_blocks; ++i) {
    const int blk = 2 * i + wg;
    // Every warp is done with block i - 1's stage and P: block i + 1 goes into that stage now, before
    // block i has landed, so that two blocks are in flight while block i waits (a gather issued only
    // once the previous one had landed kept one in flight: latency-bound when L2 was cold).
    named_barrier_sync(bar, 128);
    if (i + 1 < my_blocks) issue_block(i + 1);
    fetch_pages(i + 3);
    cp_async_commit();
    cp_async_wait<1>();
    named_barrier_sync(bar, 128);  // block i landed for the whole warpgroup
    const int stage = i & 1;
    const int key0 = kv_begin + blk * N::BK;

    // ---- S^T = K Q^T: four windows of eight latent steps (fp16), then the rope's four (T) ----
    float s[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) s[e] = 0.f;
    const uint32_t k_row = s_kv + stage * N::STAGE + (16 * warp + k8) * N::ROW;
    // Two trips of two windows of eight latent steps (one window's registers fill while the other's
    // wgmmas run), then the rope's four steps; every trip ends with its wgmmas done, so nothing is in
    // flight across a back edge (C7514). Looped rather than unrolled: the instruction footprint.
#pragma unroll 1
    for (int qq = 0; qq < 2; ++qq) {
#pragma unroll
      for (int w2 = 0; w2 < 2; ++w2) {
        uint32_t(&a)[8][4] = fa[w2];
        const int q = 2 * qq + w2;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {  // steps 8q + 2jj and + 1: chunks of keys g, g + 8
          uint32_t kb[4];
          ldmatrix_x4(kb, k_row + (((8 * q + 2 * jj + hi) ^ sw) << 4));
          transposed_a_fragments<true>(a[2 * jj], a[2 * jj + 1], fp8x4_to_half2x2(kb[0]), fp8x4_to_half2x2(kb[1]),
                                       fp8x4_to_half2x2(kb[2]), fp8x4_to_half2x2(kb[3]));
        }
        wgmma_fence();
        const uint32_t q_step = q_lo + ((2 * q * N::PANEL) >> 4);  // steps 8q .. 8q + 7: panels 2q, 2q + 1
#pragma unroll
        for (int j = 0; j < 8; ++j)
          wgmma_64x16_rs<__half>(s, a[j], sw128_desc_at(q_step, (j >> 2) * N::PANEL + (j & 3) * 32), q + j > 0);
        wgmma_commit();
      }
      wgmma_wait<0>();
      fence_registers(s);
      fence_fragments(fa[0]);
      fence_fragments(fa[1]);
    }
    {
      uint32_t(&a)[8][4] = fa[0];
#pragma unroll
      for (int r = 0; r < 4; ++r) ldmatrix_x4(a[r], k_row + (((32 + 2 * r + hi) ^ sw) << 4));
      wgmma_fence();
#pragma unroll
      for (int r = 0; r < 4; ++r) wgmma_64x16_rs<T>(s, a[r], sw128_desc_at(q_lo, 8 * N::PANEL + r * 32), 1);
      wgmma_commit();
    }
    wgmma_wait<0>();
    fence_registers(s);
    fence_fragments(fa[0]);
    fence_fragments(fa[1]);

    // ---- softmax (base 2): the block's row maxima across the four warps ----
    const unsigned char* ok = key_ok + stage * N::BK + 16 * warp + g;
    const bool ok0 = ok[0] != 0, ok1 = ok[8] != 0;
    float mx[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int k = acc_row(e), up = (e >> 1) & 1;
      const bool vis = (up ? ok1 : ok0) && key0 + 16 * warp + g + 8 * up < row_limit[k];
      s[e] = vis ? s[e] * row_scale[k] : -INFINITY;
      mx[k] = fmaxf(mx[k], s[e]);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) mx[k] = fmaxf(mx[k], __shfl_xor_sync(0xffffffffu, mx[k], off));
    float* red_b = red + (wg * 2 + (i & 1)) * 4 * N::ROWS;  // [warp][16]; by parity: no second barrier
    if (g == 0) {
#pragma unroll
      for (int k = 0; k < 4; ++k) red_b[warp * N::ROWS + R[k]] = mx[k];
    }
    named_barrier_sync(bar, 128);
    float alpha[4], m_use[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float bm = fmaxf(fmaxf(red_b[R[k]], red_b[N::ROWS + R[k]]),
                             fmaxf(red_b[2 * N::ROWS + R[k]], red_b[3 * N::ROWS + R[k]]));
      const float m_new = fmaxf(m_run[k], bm);
      m_use[k] = m_new == -INFINITY ? 0.f : m_new;  // nothing seen yet: zeros, no NaN
      alpha[k] = fast_exp2(m_run[k] - m_use[k]);
      m_run[k] = m_new;
    }
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      s[e] = fast_exp2(s[e] - m_use[acc_row(e)]);
      sum[acc_row(e)] += s[e];
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) l_thr[k] = l_thr[k] * alpha[k] + sum[k];
    // P (fp16) as the 16 x 64 K-major panel of P V's B: element (key, row) of this thread's
    // fragments lands at row `row`, key column `key` (stmatrix.trans).
    const uint32_t p_panel = base + N::P_OFF + (wg * 2 + (i & 1)) * N::PANEL;
    {
      const int mtx = lane >> 3, qr = (lane & 7) + 8 * (mtx >> 1), kc = 2 * warp + (mtx & 1);
      stmatrix_x4_trans(p_panel + qr * 128 + ((kc ^ (qr & 7)) << 4), pack2<__half>(s[0], s[1]),
                        pack2<__half>(s[2], s[3]), pack2<__half>(s[4], s[5]), pack2<__half>(s[6], s[7]));
    }
    fence_proxy_async_shared();
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 8; ++e) o[j][e] *= alpha[acc_row(e)];
    named_barrier_sync(bar, 128);  // P of every warp is in the panel

    // ---- O^T += V^T P^T: per 16 keys, tiles 2jp and 2jp + 1 from one ldmatrix.trans ----
    const uint32_t p_lo = sw128_desc_lo(p_panel);
    const uint32_t v_row = s_kv + stage * N::STAGE + k8 * N::ROW;
#pragma unroll 1
    for (int kp = 0; kp < 2; ++kp) {
#pragma unroll
      for (int w2 = 0; w2 < 2; ++w2) {
        uint32_t(&a)[8][4] = fa[w2];
        const int ks = 2 * kp + w2;
#pragma unroll
        for (int jp = 0; jp < 4; ++jp) {
          uint32_t vb[4];
          ldmatrix_x4_trans(vb, v_row + ks * 16 * N::ROW + (((4 * (2 * jp + hi) + warp) ^ sw) << 4));
          // vb[0]: keys 0-7 of the step, vb[1]: keys 8-15 (tile 2jp); vb[2], vb[3] the same of tile 2jp + 1.
          transposed_a_fragments<false>(a[2 * jp], a[2 * jp + 1], fp8x4_trans_to_half2x2(vb[0]),
                                        fp8x4_trans_to_half2x2(vb[1]), fp8x4_trans_to_half2x2(vb[2]),
                                        fp8x4_trans_to_half2x2(vb[3]));
        }
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 8; ++j) wgmma_64x16_rs<__half>(o[j], a[j], sw128_desc_at(p_lo, ks * 32), 1);
        wgmma_commit();
      }
      wgmma_wait<0>();
#pragma unroll
      for (int j = 0; j < 8; ++j) fence_registers(o[j]);
      fence_fragments(fa[0]);
      fence_fragments(fa[1]);
    }
    // Nothing stays in flight across a back edge: with P V running into the next block, ptxas
    // serialised every wgmma of the kernel (C7514: the loop's register moves read O). The other
    // warpgroup's work covers these waits.
  }
  cp_async_wait<0>();  // only empty groups can remain; leave nothing in flight

  // ---- epilogue: the warpgroups' sums and maxima, then O halves exchanged and combined ----
#pragma unroll
  for (int k = 0; k < 4; ++k)
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) l_thr[k] += __shfl_xor_sync(0xffffffffu, l_thr[k], off);
  if (g == 0) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      lstat[(wg * 4 + warp) * N::ROWS + R[k]] = l_thr[k];
      if (warp == 0) mstat[wg * N::ROWS + R[k]] = m_run[k];
    }
  }
  named_barrier_sync(kBothWarpgroups, 256);  // both warpgroups are done: stages, panels, sums
  // Warpgroup 0 combines and stores tiles 0-3, warpgroup 1 tiles 4-7: in two rounds of two tiles,
  // each hands the other its two through the query panels (every wgmma has completed).
  float comb_m[4], comb_l[4], a_own[4], a_other[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int r = R[k];
    const float m0 = mstat[r], m1 = mstat[N::ROWS + r];
    float l0 = 0.f, l1 = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      l0 += lstat[w * N::ROWS + r];
      l1 += lstat[(4 + w) * N::ROWS + r];
    }
    const float m = fmaxf(m0, m1), mu = m == -INFINITY ? 0.f : m;
    const float a0 = fast_exp2(m0 - mu), a1 = fast_exp2(m1 - mu);
    comb_m[k] = m;
    comb_l[k] = l0 * a0 + l1 * a1;
    a_own[k] = wg == 0 ? a0 : a1;
    a_other[k] = wg == 0 ? a1 : a0;
  }
  float* xbuf = reinterpret_cast<float*>(gbase + N::QP_OFF);  // float [warpgroup][16][128]
  const float* x_in = xbuf + (1 - wg) * 16 * 128;
#pragma unroll
  for (int round = 0; round < 2; ++round) {
    if (round > 0) named_barrier_sync(kBothWarpgroups, 256);  // the last round's halves are read
#pragma unroll
    for (int jj = 0; jj < 2; ++jj)
#pragma unroll
      for (int e = 0; e < 8; ++e)
        xbuf[(wg * 16 + jj * 8 + e) * 128 + wtid] = wg == 0 ? o[4 + 2 * round + jj][e] : o[2 * round + jj][e];
    named_barrier_sync(kBothWarpgroups, 256);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = R[k];
      if (r >= rows) continue;
      const int e0 = (k & 1) + 4 * (k >> 1);  // dims 2g (e0) and 2g + 1 (e0 + 2) of row r
      store_tile_row<T, 2, 1, 32>(p, u, h0, hb, r, 256 * wg + 128 * round + 16 * warp + 2 * g, comb_l[k], comb_m[k],
                                  scales.out, round == 0 && wg == 0 && warp == 0 && g == 0, [&](int jj) {
                                    const float x = wg == 0 ? o[2 * round + jj][e0] : o[4 + 2 * round + jj][e0];
                                    const float y = wg == 0 ? o[2 * round + jj][e0 + 2] : o[4 + 2 * round + jj][e0 + 2];
                                    const float* other = x_in + jj * 8 * 128 + wtid;
                                    return make_float2(x * a_own[k] + other[e0 * 128] * a_other[k],
                                                       y * a_own[k] + other[(e0 + 2) * 128] * a_other[k]);
                                  });
    }
  }
}

}  // namespace cuda
}  // namespace jax_mla
