// The op's fp8_products (Problem::fp8_products; ffi/cuda/NOTES.md, "The core of a lossy e4m3 x e4m3 wide
// body, probed" and "the lossy e4m3 wide body, built"): the 64-key body for an fp8 ckv with both products
// on e4m3 wgmma, lossy, in a kernel instance of its own (launch_attention picks it). The latent queries are rounded to e4m3 per row (times 2^k_r, largest magnitude under
// 2^8), P is rounded to e4m3, and P V runs transposed, O^T += V^T P^T, with V^T's A fragments taken from
// the raw key panels by ldmatrix.trans and two byte permutes (the narrow fp8 body's vt_e4m3_fragment), so
// no key is converted or transposed in shared memory. ~3-5e-2 from the float32 reference on random data
// (tools/e4m3_lossy_error.py), against ~2e-3 for the accurate path.
//
// The schedule is the 64-key body's (mla_wide64_sm90.cuh): blocks in pairs, WG0 computes S of block A
// and WG1 of block B, both multiply P V of both blocks for their 256 dims, the same four hand-offs. What
// differs:
//   * a buffer holds the raw block: four e4m3 panels (tiles raw_tile0(buf) + q, dims 128 q ..) and the
//     rope tile; WG0 loads and refills the panels of dims 0-255 (q = 0, 1), WG1 those of dims 256-511 and
//     the rope tile, each after its own P V of the block has read them;
//   * P goes through shared memory for both warpgroups as e4m3 (rows of 128 bytes, 64 used, each 16 keys
//     in vt_e4m3_fragment's order); WG0 keeps its own P_A (m_A's frame) in a third panel, P2;
//   * O^T's rows are the query rows (columns 8 n + 2 t + b of a thread), so a row factor reaches the 16
//     rows a thread holds through shared memory (alpha_a, alpha_r) or from the row maxima there (alpha_b);
//   * the epilogue writes O^T's fragments as rows.
#pragma once

#include "mla_wide64_sm90.cuh"

namespace jax_mla {
namespace cuda {

struct Wide64E4m3 {
  using W = Wide64Sm90;
  static constexpr int P2_OFF = W::Q_OFF + 4 * W::QPANEL;      // WG0's own P_A (the e4m3 queries take panels 0-3)
  // float [2 parities][3][64 rows]: which 0: WG0's factors to m_A, 1: WG1's to m_B, 2: m_A itself. m_A is
  // kept by parity here (not in the stats): WG0 reads it for 16 rows a thread after the m_B hand-off, and a
  // faster thread's next m_A must not land before that read.
  static constexpr int ALPHA_OFF = W::Q_OFF + 5 * W::QPANEL;
  static __device__ __forceinline__ uint32_t alpha_addr(uint32_t base, int parity, int which, int row) {
    return base + ALPHA_OFF + ((parity * 3 + which) * 64 + row) * 4;
  }
  static __device__ __forceinline__ float* max_a(uint32_t base, int parity, int row) {
    return reinterpret_cast<float*>(__cvta_shared_to_generic(alpha_addr(base, parity, 2, row)));
  }
};

// Eight values of T (a 16-byte chunk) times f, rounded to e4m3 (satfinite): eight bytes.
template <typename T>
__device__ __forceinline__ uint2 chunk_to_e4m3(uint4 v, float f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t b[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 x = unpack2<T>(w[e]);
    b[e] = (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(x.x * f, x.y * f), __NV_SATFINITE, __NV_E4M3);
  }
  return make_uint2(b[0] | (b[1] << 16), b[2] | (b[3] << 16));
}

// P (the block's 64 x 64 scores after the softmax step, S's accumulator layout) as e4m3 into a panel
// of 64 rows x 128 bytes (keys 0-63 used, 128-byte swizzle): key 8 h + 2 t + b of each 16 at byte
// 4 t + 2 h + b, the order of V^T's A fragments. A thread's keys 8 n + 2 t4 + b of rows r[e] give one
// 4-byte word per pair of n.
__device__ __forceinline__ void e4m3_store_p(uint32_t panel, const float (&s)[Wide64Sm90::SACC], const int (&r)[2],
                                             int t4, bool zero) {
  panel = opaque(panel);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int n0 = 2 * m, n1 = n0 + 1;
      const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(s[4 * n0 + 2 * e], s[4 * n0 + 2 * e + 1]),
                                                   __NV_SATFINITE, __NV_E4M3);
      const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(s[4 * n1 + 2 * e], s[4 * n1 + 2 * e + 1]),
                                                   __NV_SATFINITE, __NV_E4M3);
      st_shared_u32(panel + r[e] * 128 + ((m ^ (r[e] & 7)) << 4) + 4 * t4, zero ? 0u : (lo | (hi << 16)));
    }
  }
}

// O^T[256 dims of the warpgroup] += V^T P^T of one block, issued and committed (async): V^T's A fragments
// (4 tiles of 64 dims x 2 k32 steps) into `a` from the raw panels at `panel0` (dims 0-127 of the half)
// and panel0 + TILE (128-255), tile jj, warp w: dims 64 jj + 16 w .. + 15 (row g: dim 2 g, row g + 8:
// dim 2 g + 1); B = the P panel. `a` must live until the wgmmas are waited for.
__device__ __forceinline__ void e4m3_pv(float (&o)[128], uint32_t (&a)[8][4], uint32_t panel0, uint32_t p_panel,
                                        int warp, int lane) {
  using W = Wide64Sm90;
  panel0 = opaque(panel0);
#pragma unroll
  for (int jj = 0; jj < 4; ++jj)
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      const int kr = 32 * ks + lane, c = 4 * (jj & 1) + warp;
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, panel0 + (jj >> 1) * W::TILE + kr * 128 + ((c ^ (kr & 7)) << 4));
      vt_e4m3_fragment(a[2 * jj + ks], vb);
    }
  const uint32_t p_lo = sw128_desc_lo(opaque(p_panel));
  float(&ot)[4][32] = *reinterpret_cast<float(*)[4][32]>(&o[0]);
  wgmma_fence();
#pragma unroll
  for (int jj = 0; jj < 4; ++jj)
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) wgmma_64x64_rs_e4m3(ot[jj], a[2 * jj + ks], sw128_desc_at(p_lo, 32 * ks), 1);
  wgmma_commit();
}

// O^T's columns (query rows 8 n + 2 t4 + b) times their factors, 16 a thread: al[2 n + b].
__device__ __forceinline__ void e4m3_rescale(float (&o)[128], const float (&al)[16]) {
  bool ones = true;
#pragma unroll
  for (int i = 0; i < 16; ++i) ones &= al[i] == 1.f;
  if (__all_sync(0xffffffffu, ones)) return;
#pragma unroll
  for (int jj = 0; jj < 4; ++jj)
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[32 * jj + 4 * n + e] *= al[2 * n + (e & 1)];
}
__device__ __forceinline__ void e4m3_load_alpha(float (&al)[16], uint32_t base, int parity, int which, int t4) {
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    const uint2 v = ld_shared_v2(Wide64E4m3::alpha_addr(base, parity, which, 8 * n + 2 * t4));
    al[2 * n] = __uint_as_float(v.x);
    al[2 * n + 1] = __uint_as_float(v.y);
  }
}

// Raw panels [Q0, Q1) of a block (and its rope tile with kRope) into buffer `buf`.
template <int Q0, int Q1, bool kRope>
__device__ __forceinline__ void e4m3_load_block(const KeyTensorMaps& maps, uint32_t base, int buf,
                                                const Wide64Rows& b) {
  using W = Wide64Sm90;
#pragma unroll
  for (int q = Q0; q < Q1; ++q) wide64_load_tile(maps, base, buf, W::raw_tile0(buf) + q, &maps.ckv, 128 * q, b);
  if constexpr (kRope) wide64_load_tile(maps, base, buf, W::ROPE_TILE, &maps.kpe, 0, b);
}

// S = Q K^T of the block in `kbuf` on e4m3 (queries in Q panels 0-3, raw panels as they landed), then the
// rope part from registers. Without `wait`, kbuf is the query panels and the product is thrown away (the
// loop issues every wgmma on every trip). Async: the caller commits.
template <typename T>
__device__ __forceinline__ void e4m3_scores(float (&s)[Wide64Sm90::SACC], const uint32_t (&q_rope)[4][4],
                                            uint32_t base, uint32_t kbuf, int buf, int parity, bool wait) {
  using W = Wide64Sm90;
  base = opaque(base);
  kbuf = opaque(kbuf);
  const uint32_t q_lo = sw128_desc_lo(base + W::Q_OFF), k_lo = sw128_desc_lo(kbuf);
  const int raw0 = wait ? W::raw_tile0(buf) : 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (wait) mbar_wait(W::full_bar(base, buf, raw0 + q), parity);
    if (q == 0) wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_64x64_ss_e4m3(s, sw128_desc_at(q_lo, q * W::QPANEL + kk * 32), sw128_desc_at(k_lo, (raw0 + q) * W::TILE + kk * 32),
                          q + kk > 0);
  }
  if (wait) mbar_wait(W::full_bar(base, buf, W::ROPE_TILE), parity);
  const uint32_t rope = wait ? W::ROPE_TILE * W::TILE : 0;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_64x64_rs<T>(s, q_rope[kk], sw128_desc_at(k_lo, rope + kk * 32), 1);
}

// The end of the body: as store_two_halves, with O^T's fragments written as rows.
template <typename T, int HALF>
__device__ __forceinline__ void e4m3_store(const Problem& p, const Unit& u, int h0, int hb, int rows, const int (&r)[2],
                                           int warp, int g, int t4, const float (&l_run)[2], const float (&m_run)[2],
                                           const float (&o)[128], float out_scale, uint32_t base) {
  using W = Wide64Sm90;
  auto sum_ptr = [&](int half, int row) -> float* {
    return reinterpret_cast<float*>(__cvta_shared_to_generic(base + W::STATS_OFF + ((W::kSum0 + half) * W::ROWS + row) * 4));
  };
  publish_row_sums<HALF>(l_run, r, t4, sum_ptr);
  named_barrier_sync(W::kBoth, W::kThreads);
  constexpr int pitch = kStagedRowPitch<T>;
  const uint32_t stage = base + W::K_OFF;
  float inv[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int row = 8 * (i >> 1) + 2 * t4 + (i & 1);
    const float l = *sum_ptr(0, row) + *sum_ptr(1, row);
    inv[i] = l != 0.f ? out_scale / l : 0.f;
  }
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    const int d0 = 256 * HALF + 64 * jj + 16 * warp + 2 * g;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const float* f = &o[32 * jj + 4 * n];
#pragma unroll
      for (int b = 0; b < 2; ++b) {  // rows 8 n + 2 t4 + b: (dim d0, d0 + 1) = f[b], f[2 + b]
        const int row = 8 * n + 2 * t4 + b;
        st_shared_u32(stage + row * pitch + d0 * (int)sizeof(T),
                      pack2<T>(f[b] * inv[2 * n + b], f[2 + b] * inv[2 * n + b]));
      }
    }
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (HALF == 0 && t4 == 0 && r[e] < rows) {
      store_row_lse(p, u, h0, hb, r[e], m_run[e], *sum_ptr(0, r[e]) + *sum_ptr(1, r[e]));
    }
  }
  fence_proxy_async_shared();  // the rows reach the bulk copies' reads
  named_barrier_sync(W::kBoth, W::kThreads);
  copy_staged_rows<T>(p, u, h0, hb, rows, stage, threadIdx.x);
}

// One warpgroup of the e4m3 body (HALF = 0: WG0, block A; 1: WG1, block B).
template <typename T, int HALF>
__device__ __forceinline__ void wide64_warpgroup_e4m3(const Problem& p, const KeyTensorMaps& maps, const Unit& u, int h0,
                                                      int hb, uint32_t base) {
  using W = Wide64Sm90;
  using E = Wide64E4m3;
  constexpr int kCache = kCacheFp8Ckv;
  const int tid = threadIdx.x - 128 * HALF;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int rows = u.q_len * hb;
  int r[2], limit[2];
  accumulator_rows(u, warp, g, rows, hb, r, limit);
  const int num_blocks = __shfl_sync(0xffffffffu, (u.range_end - u.kv_begin + W::BK - 1) / W::BK, 0);
  const int last_rows = u.range_end - u.kv_begin - (num_blocks - 1) * W::BK;
  auto stat_ptr = [&](int which, int row) { return W::stat(base, which, row); };
  const uint32_t kb0 = W::buf_addr(base, 0), kb1 = W::buf_addr(base, 1), q_panels = base + W::Q_OFF;
  const uint32_t p0 = base + W::P0_OFF, p1 = base + W::P1_OFF, p2 = base + E::P2_OFF;
  // This warpgroup's raw panels (dims 256 HALF ..) of buffer `buf`.
  auto half_panels = [&](int buf) { return W::buf_addr(base, buf) + (W::raw_tile0(buf) + 2 * HALF) * W::TILE; };

  // ---- prologue: the first two blocks (WG0: panels 0-1 and the masks; WG1: panels 2-3 and rope) ----
  Wide64Pages first[2] = {}, ahead_a = {}, ahead_b = {};
  if (tid == 0) {
    if (num_blocks > 0) first[0] = wide64_block_pages(p, maps, u, 0);
    if (num_blocks > 1) first[1] = wide64_block_pages(p, maps, u, 1);
    if (HALF == 0 && num_blocks > 2) ahead_a = wide64_block_pages(p, maps, u, 2);
    if (HALF == 0 && num_blocks > 3) ahead_b = wide64_block_pages(p, maps, u, 3);
  }
  // Staged query row rr's chunk c: the latent part in the query panels, the rope part in P1's panel.
  auto chunk = [&](int rr, int c) {
    return c < 64 ? base + W::Q_OFF + WideSm90::chunk_offset(rr, c, W::QPANEL)
                  : base + W::P1_OFF + WideSm90::chunk_offset(rr, c - 64, 0);
  };
  load_query_tile<T, W::ROWS, W::kThreads>(p, u, h0, hb, rows, threadIdx.x, chunk);
  if (tid == 0) {
#pragma unroll
    for (int blk = 0; blk < 2; ++blk) {
      if (blk >= num_blocks) break;
      const Wide64Rows b = wide64_block_rows(p, maps, u, blk, first[blk]);
      if constexpr (HALF == 0) {
        st_shared_u32(W::mask_addr(base, blk), b.ok);
        e4m3_load_block<0, 2, false>(maps, base, blk, b);
      } else {
        e4m3_load_block<2, 4, true>(maps, base, blk, b);
      }
    }
  }
  const CacheScales scales = cache_scales<kCache>(p);  // read while the queries land (wide64_warpgroup)
  cp_async_wait_all();
  named_barrier_sync(W::kBoth, W::kThreads);

  // The queries: row r's latent part times 2^k_r (largest magnitude under 2^8) in e4m3 into Q panels 0-3
  // (dims 128 q ..), its rope part times 2^k_r rope_factor in T, in place. Both warpgroups hold rows
  // 16 warp + g (+ 8) and find the same k_r; each writes half of the row (latent chunks 32 HALF + t4 + 4 j,
  // rope chunk 64 + 4 HALF + t4) once every staged chunk is read.
  float scale_log2[2] = {p.scale_log2 * scales.score, p.scale_log2 * scales.score};
  {
    float factor[2];
    uint2 q8[2][8];
    uint4 rope_v[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float amax = 0.f;
#pragma unroll 4
      for (int c = t4; c < 64; c += 4) amax = fmaxf(amax, chunk_amax<T>(ld_shared_v4(chunk(r[e], c))));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      const int k = fp8_query_exponent<8>(amax);
      factor[e] = exp2_int(k);
      // The cvt saturates: a row holding an infinity or NaN is NaN by its scale (as the narrow split's).
      scale_log2[e] = amax <= 3.0e38f ? scale_log2[e] * exp2_int(-k) : __int_as_float(0x7fc00000);
#pragma unroll
      for (int j = 0; j < 8; ++j) q8[e][j] = chunk_to_e4m3<T>(ld_shared_v4(chunk(r[e], 32 * HALF + t4 + 4 * j)), factor[e]);
      rope_v[e] = ld_shared_v4(chunk(r[e], 64 + 4 * HALF + t4));
    }
    named_barrier_sync(W::kBoth, W::kThreads);  // every staged chunk is read
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int c = 32 * HALF + t4 + 4 * j;  // bf16 chunk: e4m3 dims 8 c .. 8 c + 7
        const int q = c >> 4, cc = (c & 15) >> 1;
        st_shared_v2(base + W::Q_OFF + q * W::QPANEL + r[e] * 128 + ((cc ^ (r[e] & 7)) << 4) + 8 * (c & 1),
                         q8[e][j]);
      }
      st_shared_v4(chunk(r[e], 64 + 4 * HALF + t4), scale_query_chunk<T>(rope_v[e], factor[e] * scales.rope_query, true));
    }
  }
  fence_proxy_async_shared();  // the e4m3 query panels reach wgmma's reads
  named_barrier_sync(W::kBoth, W::kThreads);
  uint32_t q_rope[4][4];
  wide64_load_fragments(base + W::P1_OFF, q_rope, warp, lane);  // WG1 overwrites P1 only after the m_A hand-off

  auto mask = [&](int blk, int key0) {
    return [&, blk, key0](float (&x)[W::SACC]) { wide64_mask_scores(x, base, blk, key0, limit, scale_log2, t4); };
  };

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};
  float s[W::SACC];
  uint32_t a8[8][4];

  if constexpr (HALF == 0) {
    if (num_blocks > 0) {
      e4m3_scores<T>(s, q_rope, base, kb0, 0, 0, true);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(s);
    }
  } else if (num_blocks > 1) {
    e4m3_scores<T>(s, q_rope, base, kb1, 1, 0, true);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(s);
  }

#pragma unroll 1
  for (int pair = 0; 2 * pair < num_blocks; ++pair) {
    const int blk_a = 2 * pair, blk_b = blk_a + 1;
    const bool has_b = blk_b < num_blocks, next_a = blk_a + 2 < num_blocks, next_b = blk_b + 2 < num_blocks;
    const int parity = pair & 1;
    const int key0 = u.kv_begin + blk_a * W::BK;
    const bool a_partial = blk_a == num_blocks - 1 && last_rows < W::BK;
    const bool b_partial = blk_b == num_blocks - 1 && last_rows < W::BK;
    Wide64Pages pages_a = ahead_a, pages_b = ahead_b;
    if (HALF == 1 && tid == 0) {
      if (next_a) pages_a = wide64_block_pages(p, maps, u, blk_a + 2);
      if (next_b) pages_b = wide64_block_pages(p, maps, u, blk_b + 2);
    }
    if constexpr (HALF == 0) {
      // ---- block A: softmax, m_A out; P_A (m_A's frame) into P2; O^T to m_A; P_A V_A ----
      wgmma_wait<0>();  // this warpgroup's S of block A, left in flight by the last trip (as the 64-key body)
      fence_registers(s);
      float m_a[2], alpha_a[2], sum_a[2];
      softmax_block<true>(s, mask(blk_a, key0), m_run, m_a, alpha_a, sum_a);
      if (t4 == 0) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          *E::max_a(base, parity, r[e]) = m_a[e];
          st_shared_u32(E::alpha_addr(base, parity, 0, r[e]), __float_as_uint(alpha_a[e]));
        }
      }
      handoff_signal(W::kAReady, base);
      e4m3_store_p(p2, s, r, t4, false);
#pragma unroll
      for (int e = 0; e < 2; ++e) l_run[e] = l_run[e] * alpha_a[e] + sum_a[e];
      if (a_partial) zero_key_panel_rows<2>(half_panels(0), last_rows, tid);
      fence_proxy_async_shared();  // P2 reaches wgmma's reads (and zeros precede the next TMA)
      named_barrier_sync(W::kWarpgroup0, 128);
      {
        float al[16];
        e4m3_load_alpha(al, base, parity, 0, t4);
        e4m3_rescale(o, al);
      }
      e4m3_pv(o, a8, half_panels(0), p2, warp, lane);
      wgmma_wait<0>();
      fence_registers(o);
      fence_fragments(a8);
      if (tid == 0 && next_a) {  // block A's panels 0-1 are read: block A + 2's go in
        const Wide64Rows b = wide64_block_rows(p, maps, u, blk_a + 2, pages_a);
        st_shared_u32(W::mask_addr(base, blk_a + 2), b.ok);
        e4m3_load_block<0, 2, false>(maps, base, 0, b);
      }
      // ---- m_B from WG1: P_A in its frame for WG1, O^T to it ----
      handoff_wait(W::kBReady, base, parity);
      float alpha_b[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float m_b = *stat_ptr(W::kMaxB, r[e]);
        alpha_b[e] = m_b == m_a[e] ? 1.f : wide_alpha(m_a[e], m_b);
        m_run[e] = m_b;
      }
      if (alpha_b[0] != 1.f || alpha_b[1] != 1.f) {
#pragma unroll
        for (int i = 0; i < W::SACC; ++i) s[i] *= alpha_b[(i >> 1) & 1];
      }
      e4m3_store_p(p0, s, r, t4, false);
      fence_proxy_async_shared();  // P_A reaches WG1's wgmma reads
      handoff_signal(W::kP0Ready, base);
#pragma unroll
      for (int e = 0; e < 2; ++e) l_run[e] *= alpha_b[e];
      {
        float al[16];  // the 16 rows' m_A -> m_B factors (m_A of every row is here since the barrier above)
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const int row = 8 * (i >> 1) + 2 * t4 + (i & 1);
          const float ma = *E::max_a(base, parity, row), mb = *stat_ptr(W::kMaxB, row);
          al[i] = mb == ma ? 1.f : wide_alpha(ma, mb);
        }
        e4m3_rescale(o, al);
      }
      // (a partial block B's rows past the range: WG1 zeroed both halves before signalling P_B, so that
      // both warpgroups pass the same number of named barriers: racecheck stops seeing a barrier order
      // once the counts differ; NOTES.md, "twelfth session")
      handoff_wait(W::kP1Ready, base, parity);
      // Without a block B, WG1 stored P_B = 0 and this adds 0 times block A's panels (already multiplied,
      // rows past the range zeroed); not the query panels, whose NaN or inf element times 0 is NaN
      // (mla_wide64_sm90.cuh).
      e4m3_pv(o, a8, half_panels(has_b ? 1 : 0), p1, warp, lane);
      if (tid == 0) {
        if (blk_a + 4 < num_blocks) ahead_a = wide64_block_pages(p, maps, u, blk_a + 4);
        if (blk_b + 4 < num_blocks) ahead_b = wide64_block_pages(p, maps, u, blk_b + 4);
      }
      wgmma_wait<0>();
      fence_registers(o);
      fence_fragments(a8);
      if (tid == 0 && next_b) {  // block B's panels 0-1 are read (WG1's S before m_B, our P V now)
        e4m3_load_block<0, 2, false>(maps, base, 1, wide64_block_rows(p, maps, u, blk_b + 2, pages_b));
      }
      e4m3_scores<T>(s, q_rope, base, next_a ? kb0 : q_panels, 0, parity ^ 1, next_a);
      wgmma_commit();
    } else {
      // ---- block B: softmax against m_A, m_B out; P_B into P1; O^T to m_B; P_B V_B, P_A V_A ----
      handoff_wait(W::kAReady, base, parity);
      wgmma_wait<0>();  // this warpgroup's S of block B
      fence_registers(s);
      float m_a[2], m_b[2], alpha_ab[2], sum_b[2] = {0.f, 0.f};
#pragma unroll
      for (int e = 0; e < 2; ++e) m_b[e] = m_a[e] = *E::max_a(base, parity, r[e]);
      if (has_b) softmax_block<true>(s, mask(blk_b, key0 + W::BK), m_a, m_b, alpha_ab, sum_b);
      if (t4 == 0) {
#pragma unroll
        for (int e = 0; e < 2; ++e) *stat_ptr(W::kMaxB, r[e]) = m_b[e];
      }
      handoff_signal(W::kBReady, base);
      float alpha_r[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        alpha_r[e] = m_b[e] == m_run[e] ? 1.f : wide_alpha(m_run[e], m_b[e]);
        l_run[e] = l_run[e] * alpha_r[e] + sum_b[e];
        m_run[e] = m_b[e];
        if (t4 == 0) st_shared_u32(E::alpha_addr(base, parity, 1, r[e]), __float_as_uint(alpha_r[e]));
      }
      e4m3_store_p(p1, s, r, t4, !has_b);
      // A partial block's rows past the range: block B's in both halves (WG0's P V reads its half after
      // the P_B hand-off below), block A's in this half (WG0 zeroed its own).
      if (b_partial) zero_key_panel_rows(W::buf_addr(base, 1) + W::raw_tile0(1) * W::TILE, last_rows, tid);
      if (a_partial) zero_key_panel_rows<2>(half_panels(0), last_rows, tid);
      fence_proxy_async_shared();  // P_B reaches both warpgroups' wgmma reads
      named_barrier_sync(W::kWarpgroup0 + 1, 128);
      handoff_signal(W::kP1Ready, base);
      {
        float al[16];
        e4m3_load_alpha(al, base, parity, 1, t4);
        e4m3_rescale(o, al);
      }
      e4m3_pv(o, a8, half_panels(has_b ? 1 : 0), p1, warp, lane);  // (as WG0's: 0 times block A's)
      handoff_wait(W::kP0Ready, base, parity);
      uint32_t a8b[8][4];
      e4m3_pv(o, a8b, half_panels(0), p0, warp, lane);
      wgmma_wait<1>();
      fence_fragments(a8);
      if (tid == 0 && next_b) {  // block B's panels 2-3 and rope are read: block B + 2's go in
        const Wide64Rows b = wide64_block_rows(p, maps, u, blk_b + 2, pages_b);
        st_shared_u32(W::mask_addr(base, blk_b + 2), b.ok);
        e4m3_load_block<2, 4, true>(maps, base, 1, b);
      }
      wgmma_wait<0>();
      fence_registers(o);
      fence_fragments(a8b);
      if (tid == 0 && next_a) {  // block A's panels 2-3 and rope are read
        e4m3_load_block<2, 4, true>(maps, base, 0, wide64_block_rows(p, maps, u, blk_a + 2, pages_a));
      }
      e4m3_scores<T>(s, q_rope, base, next_b ? kb1 : q_panels, 1, parity ^ 1, next_b);
      wgmma_commit();
    }
  }
  e4m3_store<T, HALF>(p, u, h0, hb, rows, r, warp, g, t4, l_run, m_run, o, scales.out, base);
  // The last trip's S, thrown away, read query panels 0-3 only (P2 and the factors, which the loop writes,
  // are panels 4-5; the epilogue stages rows in the key buffers): waited for before the exit.
  wgmma_wait<0>();
}

}  // namespace cuda
}  // namespace jax_mla
