// The narrow body (units of at most 16 query rows) for an e4m3 ckv on sm_90a: both products
// transposed, so that the keys are wgmma's M, and both on e4m3 wgmma: S^T multiplies the raw e4m3
// keys by the queries split into e4m3 terms, O^T multiplies V^T (the raw key bytes, permuted in
// registers) by P split into two e4m3 terms. No key is ever converted.
//
// Status: the sm_90a kernel's body for these units since 2026-12-03 (-DJAX_MLA_NARROW_FP8_MMA_SYNC,
// CMake option JAX_MLA_NARROW_FP8_MMA_SYNC, puts them back on the mma.sync body for A/B runs).
// Since 2026-12-03 (fourteenth session) the 384-thread kernel instance keeps its third warpgroup as
// the gatherer of both (kProducer; -DJAX_MLA_NARROW_FP8_NO_PRODUCER sends it away, an A/B switch):
// standalone driver, H200, op us: 89.7 at 128 x 4096 x 16 heads, 170.8 at 256 x U[1, 8192], 38.7 at
// 1 x 131072; without the producer 92.1, 176.5, 40.9 (the mma.sync body, earlier: 111.1, 212.9,
// 41.3). Since the sixteenth session the producer issues each block as ten TMA boxes where the
// launch's key maps serve (pages of >= 32 keys; -DJAX_MLA_NARROW_FP8_NO_TMA keeps its cp.async
// gathers, an A/B switch): op 89.0 -> 90.3, 169.9 -> 163.3, 37.6 -> 37.9 (attention chained 97.2
// -> 93.2 at 128 x 4096); with every key in L2 (maps at 256-byte promotion then) 81.1 -> 68.4
// at 128 x 4096: the body's own work is lighter, and the copy now sets its time. ffi/cuda/NOTES.md
// ("S on e4m3 wgmma", "Keys evict-first", "The e4m3 wgmma body becomes the default", "A producer
// warpgroup for the fp8 narrow body", "TMA for the fp8 narrow producer") has the numbers.
//
// Why. The mma.sync narrow body with an fp8 ckv (mla_narrow_kernel.cuh, "fp8 in registers") is
// bound by its own instruction stream: eight warps run its steps in lock step between three block
// barriers, and each converts every key it multiplies, twice (S and P V). fp8 at 1.7x of bf16
// needs ~1.35 us a 64-key block per SM.
//
// What. wgmma needs M = 64; with 16 query rows the keys are the 64 of M:
//   * A stage is five 128-byte-swizzled panels of 64 keys (NarrowFp8Sm90): four of e4m3 latent,
//     one of kpe, the canonical K-major layout the TMA maps' 128-byte swizzle writes (or cp.async).
//   * S^T = K Q^T on e4m3 wgmma, A and B from shared memory: A = the latent panels as they landed,
//     B = the queries' e4m3 terms (split_e4m3x4: two terms hold a bf16 query exactly, three an fp16
//     one), N = 16 rows x terms; each 128-dim panel is a fresh accumulator added in float32 (the
//     e4m3 wgmma's running sum keeps ~14 bits). The rope part: kpe x q_pe in the query type.
//   * O^T = V^T P^T on e4m3 wgmma (m64n32k32): A = the raw rows through ldmatrix.trans and two byte
//     permutes a register pair (vt_e4m3_fragment; fp8 wgmma takes K-major operands only, and V^T is
//     not, so A comes from registers); the keys inside each 16 are in a permuted order, which P's
//     panel follows. B = P x 2^8 as two e4m3 terms (hi + lo / 16), 32 rows x 64 keys, K-major,
//     written by the softmax. Each half of the output tiles is a fresh accumulator over the block,
//     added into O in float32. Warp w of the warpgroup holds dims 64 j + 16 w + {2g, 2g + 1} of
//     every output tile j (8 tiles of 64 dims x 16 rows, 64 floats a thread).
//   * The two warpgroups are two independent pipelines over the unit's even and odd blocks, each
//     with its own two stages, running max and sum and O, and its own named barriers: one
//     warpgroup's softmax and exchanges overlap the other's MMAs. Their halves meet once, in the
//     epilogue. The blocks' copies (and page ids) are the third warpgroup's where the kernel has
//     one (384 threads): it fills the four stages in the unit's block order, on full and empty
//     mbarriers, by TMA (one warp) or cp.async gathers (all four). In the 256-thread instance each
//     warpgroup gathers its own next block.
// The row maxima cross the warpgroup's four warps through shared memory once a block (each warp
// holds 16 keys of every row); the row sums stay per thread until the epilogue.
//
// Scales and precision: the queries are brought under 2^8 by a power of two per row
// (narrow_prepare_queries_fp8), S is exact up to float32 sums of 128 products, P keeps about eight
// significant bits (two e4m3 terms; values under 2^-21 of the row's running maximum drop out), s_c
// on the softmax scale and the output (mla_fp8.cuh). Errors against the float32 reference on the
// dequantized cache: 1.90e-3 (bf16 queries) and 4.7e-4 (fp16) on the driver's cases.
#pragma once

#include "mla_hopper.cuh"
#include "mla_narrow_kernel.cuh"

namespace jax_mla {
namespace cuda {

struct NarrowFp8Sm90 {
  static constexpr int ROWS = 16;
  static constexpr int BK = 64;                      // keys a block: wgmma's M
  static constexpr int BOX = 32;                     // keys a TMA box (the 384-thread instance's key maps)
  // A stage holds a block's keys as five panels of 64 keys x 128 bytes in the 128-byte swizzle (the
  // canonical K-major layout wgmma reads): slabs 0-3 the e4m3 latent (128 dims each), slab 4 kpe (64
  // dims of T). The latent slabs are S^T's A as they land, and V^T's rows for ldmatrix.trans.
  static constexpr int SLAB = BK * 128;
  static constexpr int STAGE = 5 * SLAB;             // 40 KB
  static constexpr int STAGES = 2;                   // per warpgroup
  static constexpr int RING = 8;                     // page-id slots per warpgroup (global block mod 8)
  static constexpr int PANEL = ROWS * 128;           // 16 rows x 64 16-bit values, 128-byte swizzle
  static constexpr int QSLAB = 3 * PANEL;            // a latent query slab: up to 3 e4m3 terms x 16 rows x 128 dims
  static constexpr int KV_OFF = 0;                   // warpgroup w's stages at KV_OFF + w STAGES STAGE
  static constexpr int QP_OFF = KV_OFF + 2 * STAGES * STAGE;  // 4 latent query slabs (e4m3 terms), rope panel (T)
  // A P panel: two e4m3 terms x 16 rows x 64 keys in rows of 128 bytes (the first 64 used), the
  // 128-byte swizzle (a query slab's layout).
  static constexpr int P_PANEL = 2 * PANEL;
  static constexpr int P_OFF = QP_OFF + 4 * QSLAB + PANEL;    // P panels [warpgroup][block parity]
  static constexpr int RED_OFF = P_OFF + 4 * P_PANEL;         // float [warpgroup][parity][warp][16]: block maxima
  static constexpr int RSCALE_OFF = RED_OFF + 2 * 2 * 4 * ROWS * 4;  // float [16]: the rows' 2^-k
  static constexpr int MSTAT_OFF = RSCALE_OFF + ROWS * 4;             // float [warpgroup][16]: final maxima
  static constexpr int LSTAT_OFF = MSTAT_OFF + 2 * ROWS * 4;          // float [warpgroup][warp][16]: sums
  static constexpr int KEY_OK_OFF = LSTAT_OFF + 2 * 4 * ROWS * 4;     // u8 [warpgroup][stage][BK]
  static constexpr int RING_OFF = KEY_OK_OFF + 2 * STAGES * BK;       // int [warpgroup][RING][BK]
  // With a producer warpgroup (attend_unit_narrow_fp8_sm90<T, true>): one ring of 2 RING slots (unit
  // block mod 2 RING) over the same bytes, and mbarriers: full and empty per [warpgroup][stage], and
  // the staging rows' "free" (the queries have left them).
  static constexpr int MBAR_OFF = RING_OFF + 2 * RING * BK * 4;
  static constexpr int BYTES = MBAR_OFF + 9 * 8;
  static __device__ __forceinline__ uint32_t full_bar(uint32_t base, int wg, int stage) {
    return base + MBAR_OFF + 8 * (2 * wg + stage);
  }
  static __device__ __forceinline__ uint32_t empty_bar(uint32_t base, int wg, int stage) {
    return base + MBAR_OFF + 32 + 8 * (2 * wg + stage);
  }
  static __device__ __forceinline__ uint32_t staging_free_bar(uint32_t base) { return base + MBAR_OFF + 64; }
  static __device__ __forceinline__ uint32_t stage_addr(uint32_t base, int wg, int stage) {
    return base + KV_OFF + (wg * STAGES + stage) * STAGE;
  }
  // Before the producer fills unit block j's stage: that stage's previous block (local block i - 2 of
  // warpgroup j % 2, i = j / 2) is done, and block 3's stage (warpgroup 1's stage 1) no longer holds
  // the queries.
  static __device__ __forceinline__ void producer_wait_for_stage(uint32_t base, int j) {
    const int w = j & 1, i = j >> 1;
    if (i >= 2) mbar_wait(empty_bar(base, w, i & 1), ((i >> 1) - 1) & 1);
    if (j == 3) mbar_wait(staging_free_bar(base), 0);
  }
  static constexpr int SMEM_BYTES = BYTES + 1024 - 16;  // room to align the base
  // The queries' staging rows (kNarrowRowBytes each): warpgroup 1's second stage, first gathered
  // into after the queries have moved to their panels.
  static constexpr int STAGING_OFF = KV_OFF + 3 * STAGE;

  static_assert(ROWS * kNarrowRowBytes <= STAGE, "the queries are staged in one stage");
  static_assert(BK == 2 * BOX, "a block is two TMA boxes a slab");
  static_assert(SLAB == kKeyPanelBytes, "the latent slabs are key panels (zero_key_panel_rows)");
  static_assert(2 * 32 * 128 * 4 <= 2 * STAGES * STAGE, "the epilogue's O exchange fits in the stages");
  static_assert(MBAR_OFF % 8 == 0, "mbarriers are 8-byte aligned");
  static_assert(SLAB % 1024 == 0 && QP_OFF % 1024 == 0 && P_OFF % 1024 == 0 && PANEL % 1024 == 0,
                "swizzle atoms stay aligned");
};

// Shared address of raw chunk cc (0-31 latent, 32-39 kpe) of key kl in a stage (NarrowFp8Sm90's slabs).
__device__ __forceinline__ uint32_t fp8_slab_chunk(uint32_t stage, int kl, int cc) {
  return stage + (cc >> 3) * NarrowFp8Sm90::SLAB + kl * 128 + (((cc & 7) ^ (kl & 7)) << 4);
}

// Query row (column of S^T and O^T) of accumulator element e of a 64 x 16 tile: R[acc_row(e)] with
// R = {2t, 2t + 1, 8 + 2t, 9 + 2t}; its M-row (key, or dim) is g + 8 ((e >> 1) & 1) of the warp's 16.
__device__ __forceinline__ constexpr int acc_row(int e) { return (e & 1) + 2 * (e >> 2); }

// The producer's blocks by TMA, one warp, where the launch's key maps serve (kProducer; pages of 32
// keys or more, a unit start on a box boundary): block j of the unit into stage (j / 2) % 2 of
// warpgroup j % 2 as ten boxes of 32 keys x 128 bytes (two a slab: four latent slabs, the kpe
// slab; the stage's 40 KB), issued by lane 0 on the stage's full barrier, where every lane writes
// the flags of two keys and arrives (32 arrivals). The maps' 128-byte swizzle is the slabs' layout.
// A box on a bad page id, or wholly past the range, reads rows before the tensor, which TMA fills
// with zeros. A box the range ends in comes whole from its page: the consumers zero its rows past
// the range before P V reads them (zero_key_panel_rows; 0 times a NaN is NaN). Page ids: lane l
// holds box l of a group of 16 blocks (block 16 g + l / 2, box l % 2), the next group loaded a
// group ahead. It replaces 128 threads' 2,560 cp.async a block and their address arithmetic.
__device__ __forceinline__ void narrow_fp8_tma_producer(const Problem& p, const KeyTensorMaps& maps, Unit u,
                                                        uint32_t base, unsigned char* ok_all, int lane) {
  using N = NarrowFp8Sm90;
  constexpr int GROUP = 32 / (N::BK / N::BOX);  // blocks whose page ids a warp holds: a box a lane
  const int* pt_row = page_table_row(p, u);
  auto group_pages = [&](int grp, int bound) {
    const int key = u.kv_begin + grp * GROUP * N::BK + lane * N::BOX;
    return key < bound ? __ldg(pt_row + (key >> p.log2_page_size)) : -1;
  };
  int pages = group_pages(0, early_key_bound(p, u));  // issued before the length arrives
  finish_unit(p, u);
  const int nb = (u.range_end - u.kv_begin + N::BK - 1) / N::BK;
  int pages_next = group_pages(1, u.range_end);
  const uint64_t pol = l2_evict_first_policy();  // as the cp.async gathers (gather_key_row)
#pragma unroll 1
  for (int j = 0; j < nb; ++j) {
    const int w = j & 1, i = j >> 1, st = i & 1;
    if (j > 0 && j % GROUP == 0) {
      pages = pages_next;
      pages_next = group_pages(j / GROUP + 1, u.range_end);
    }
    N::producer_wait_for_stage(base, j);
    const int key0 = u.kv_begin + j * N::BK;
    int row[2];
    bool ok[2];
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int page = __shfl_sync(0xffffffffu, pages, 2 * (j % GROUP) + b);
      const int key = key0 + b * N::BOX;
      ok[b] = key < u.range_end && page_in_cache(p, page);
      row[b] = tma_box_row(ok[b], page, key, p.page_size, N::BOX);
    }
    // The flags of keys 2 lane and 2 lane + 1 (box lane / 16), published by this lane's arrival.
    const int k = key0 + 2 * lane;
    const bool box_ok = lane < 16 ? ok[0] : ok[1];
    const uint32_t flags = (uint32_t)(box_ok && k < u.range_end) | (uint32_t)(box_ok && k + 1 < u.range_end) << 8;
    reinterpret_cast<uint16_t*>(ok_all + (w * N::STAGES + st) * N::BK)[lane] = (uint16_t)flags;
    const uint32_t full = N::full_bar(base, w, st);
    if (lane == 0) {
      mbar_arrive_expect_tx(full, N::STAGE);
      const uint32_t stage = N::stage_addr(base, w, st);
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const uint32_t dst = stage + b * N::BOX * 128;
#pragma unroll
        for (int s = 0; s < 4; ++s) tma_load_2d_hint(dst + s * N::SLAB, &maps.ckv, 128 * s, row[b], full, pol);
        tma_load_2d_hint(dst + 4 * N::SLAB, &maps.kpe, 0, row[b], full, pol);
      }
    } else {
      mbar_arrive(full);
    }
  }
}

// kProducer: the kernel's third warpgroup (384 threads) gathers every block for both, ahead of them
// (below); without it (the 256-thread instance) each warpgroup gathers its own next block.
template <typename T, bool kProducer = false>
__device__ __forceinline__ void attend_unit_narrow_fp8_sm90(const Problem& p, const KeyTensorMaps& maps, Unit u,
                                                            int h0, int hb, char* smem) {
  using N = NarrowFp8Sm90;
  constexpr int kCache = kCacheFp8Ckv;
  constexpr int QTERMS = std::is_same_v<T, __half> ? 3 : 2;  // split_e4m3x4: exact for the query type
  constexpr int C0 = CacheFormat<kCache>::kRaw;  // gather_key_row's first raw chunk: chunk c is c - C0 here
  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform, as wgmma needs
  const int wtid = tid & 127;
  const int warp = wtid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int rows = u.q_len * hb;
  const int bar = 1 + wg;  // this warpgroup's named barrier
#ifdef JAX_MLA_TRACE  // (mla_common.cuh) row 0: start, page ids, queries, panels, loop end, stored;
  // row 1 + i: top, block i landed, S, maxima shared, P in its panel, P V done
  const int trace_slot = wg < 2 ? jax_mla_trace_slot(wg, warp, lane, kTraceNarrowFp8) : -1;
#endif
  // Both warpgroups: a named barrier of 256 threads (the kernel's third warpgroup has left).
  constexpr int kBothWarpgroups = 3;

  uint32_t base = smem_addr(smem);
  const uint32_t pad = (1024 - (base & 1023)) & 1023;  // the 128-byte swizzle's atoms are 1024-byte aligned
  base += pad;
  char* gbase = smem + pad;
  const uint32_t s_kv = N::stage_addr(base, wg, 0);
  const uint32_t s_q = base + N::STAGING_OFF;
  unsigned char* key_ok = reinterpret_cast<unsigned char*>(gbase + N::KEY_OK_OFF) + wg * N::STAGES * N::BK;
  int* ring = reinterpret_cast<int*>(gbase + N::RING_OFF) + wg * N::RING * N::BK;
  float* red = reinterpret_cast<float*>(gbase + N::RED_OFF);
  float* rscale = reinterpret_cast<float*>(gbase + N::RSCALE_OFF);
  float* mstat = reinterpret_cast<float*>(gbase + N::MSTAT_OFF);
  float* lstat = reinterpret_cast<float*>(gbase + N::LSTAT_OFF);

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
        [&](int kl, int c) { return fp8_slab_chunk(stage, kl, c - C0); });
  };

  // The producer's blocks by TMA (narrow_fp8_tma_producer) where the maps' boxes fit the unit;
  // otherwise (pages under 32 keys, another plan's unaligned split) by its cp.async gathers.
#ifdef JAX_MLA_NARROW_FP8_NO_TMA  // (an A/B switch: every block by cp.async)
  const bool by_tma = false;
#else
  const bool by_tma = kProducer && maps.enabled && maps.box_rows == N::BOX && (u.kv_begin & (N::BOX - 1)) == 0;
#endif
  if constexpr (kProducer) {
    if (tid == 0) {
      for (int w = 0; w < 2; ++w)
        for (int st = 0; st < N::STAGES; ++st) {
          // Full: every producer thread twice, once when its copies land (noinc) and once to publish
          // its key flags; by TMA each lane of the producer warp once (lane 0 with the bytes).
          // Empty: every thread of the stage's warpgroup, its block done.
          mbar_init(N::full_bar(base, w, st), by_tma ? 32 : 256);
          mbar_init(N::empty_bar(base, w, st), 128);
        }
      mbar_init(N::staging_free_bar(base), 1);
      mbar_init_fence();
    }
    __syncthreads();
    if (wg == 2) {
      release_registers<40>();
      if (by_tma) {
        unsigned char* ok_all = reinterpret_cast<unsigned char*>(gbase + N::KEY_OK_OFF);
        if (tid < 288) narrow_fp8_tma_producer(p, maps, u, base, ok_all, lane);  // one warp
        return;
      }
      // ---- the producer: block j of the unit into stage (j / 2) % 2 of warpgroup j % 2 ----
      // Its page ids come L blocks ahead through one ring of 2 RING slots (unit block mod 2 RING).
      // Each thread's copies arrive on the stage's full barrier as they land; the consumer's proxy
      // fence after its wait makes them visible to wgmma (as v5's producer and consumers do,
      // mla_wide_sm90.cuh). A stage is refilled once its warpgroup has arrived on its empty barrier.
      constexpr int L = 4, PRING = 2 * N::RING;
      static_assert(L < PRING, "a block's page-id slot outlives its gather");
      const int ptid = tid - 256;
      int* pring = reinterpret_cast<int*>(gbase + N::RING_OFF);
      unsigned char* ok_all = reinterpret_cast<unsigned char*>(gbase + N::KEY_OK_OFF);
      const int bound = early_key_bound(p, u);
      // A group a block, here and in the loop, so that block j's page ids are always L - 1 groups back.
#pragma unroll 1
      for (int j = 0; j < L; ++j) {
        fetch_page_ids<N::BK, PRING>(p, pt_row, pring, kv_begin, j, INT_MAX, bound, ptid);
        cp_async_commit();
      }
      finish_unit(p, u);
      const int nb = (u.range_end - kv_begin + N::BK - 1) / N::BK;
#pragma unroll 1
      for (int j = 0; j < nb; ++j) {
        const int w = j & 1, i = j >> 1, st = i & 1;
        cp_async_wait<L - 1>();       // block j's page ids (a group L back; at most L - 1 newer ones)
        named_barrier_sync(4, 128);   // from every producer thread
        N::producer_wait_for_stage(base, j);
        fetch_page_ids<N::BK, PRING>(p, pt_row, pring, kv_begin, j + L, nb, u.range_end, ptid);
        const uint32_t stage = N::stage_addr(base, w, st);
        gather_key_block<kCache, N::BK, PRING, N::BK / 16, 16>(
            p, u, pring, ok_all + w * N::STAGES * N::BK, kv_begin, j, st, ptid,
            [&](int kl, int c) { return fp8_slab_chunk(stage, kl, c - C0); });
        cp_async_commit();
        mbar_arrive_on_cp_async(N::full_bar(base, w, st));
        mbar_arrive(N::full_bar(base, w, st));  // publishes the key flags
      }
      cp_async_wait<0>();
      return;
    }
    claim_registers<232>();
  }

  // ---- prologue (both warpgroups): the queries; without the producer also the page ids of local
  // blocks 0-2 and block 0 ----
  if constexpr (!kProducer) {
#pragma unroll 1
    for (int i = 0; i < 3; ++i) fetch_pages(i);
    cp_async_commit();
  }
  load_query_tile<T, N::ROWS, kThreads>(p, u, h0, hb, rows, tid, [&](int r, int c) { return s_q + swz(r, c); });
  cp_async_commit();
  // The cache's scales, read once the prologue's copies are in flight: each thread waits for the load
  // where the value is first used, and read at the top (before the producer warpgroup left) every block
  // waited for them before it requested a page id (SASS; NOTES.md, "twenty-eighth session").
  const CacheScales scales = cache_scales<kCache>(p);
  const float scale_log2 = p.scale_log2 * scales.score;
  finish_unit(p, u);
  key_bound = u.range_end;
  num_blocks = (u.range_end - kv_begin + N::BK - 1) / N::BK;
  const int my_blocks = num_blocks > wg ? (num_blocks - wg + 1) / 2 : 0;
  if constexpr (kProducer) {
    cp_async_wait<0>();  // the queries
    named_barrier_sync(kBothWarpgroups, 256);
    JAX_MLA_TRACE_AT(0, 1);
  } else {
    cp_async_wait<1>();  // the page ids
    named_barrier_sync(kBothWarpgroups, 256);
    JAX_MLA_TRACE_AT(0, 1);
    if (my_blocks > 0) issue_block(0);
    cp_async_commit();
    cp_async_wait<1>();  // the queries (block 0 may still be in flight)
    named_barrier_sync(kBothWarpgroups, 256);
  }
  JAX_MLA_TRACE_AT(0, 2);
  {
    float rs2[2];
    narrow_prepare_queries_fp8<T, true>([&](int r, int c) { return s_q + swz(r, c); }, tid >> 5, lane,
                                        scales.rope_query, rs2);
    if (lane == 0) {
      rscale[2 * (tid >> 5)] = rs2[0];
      rscale[2 * (tid >> 5) + 1] = rs2[1];
    }
  }
  named_barrier_sync(kBothWarpgroups, 256);
  // The queries into their panels: latent dims 16 s .. 16 s + 15 of row r as one 16-byte chunk of e4m3
  // per term (term t is row 16 t + r of slab s / 8), the rope as is.
  for (int idx = tid; idx < N::ROWS * 40; idx += kThreads) {
    const int r = idx / 40, s = idx - r * 40;
    if (s < 32) {
      const uint4 a = ld_shared_v4(s_q + swz(r, 2 * s)), b = ld_shared_v4(s_q + swz(r, 2 * s + 1));
      uint32_t w[4][QTERMS];
      split_e4m3x4<T, QTERMS>(make_uint2(a.x, a.y), w[0]);
      split_e4m3x4<T, QTERMS>(make_uint2(a.z, a.w), w[1]);
      split_e4m3x4<T, QTERMS>(make_uint2(b.x, b.y), w[2]);
      split_e4m3x4<T, QTERMS>(make_uint2(b.z, b.w), w[3]);
#pragma unroll
      for (int t = 0; t < QTERMS; ++t) {
        const int n = 16 * t + r;
        st_shared_v4(base + N::QP_OFF + (s >> 3) * N::QSLAB + n * 128 + (((s & 7) ^ (n & 7)) << 4),
                     make_uint4(w[0][t], w[1][t], w[2][t], w[3][t]));
      }
    } else {
      const int c = s - 32;
      st_shared_v4(base + N::QP_OFF + 4 * N::QSLAB + r * 128 + ((c ^ (r & 7)) << 4),
                   ld_shared_v4(s_q + swz(r, 64 + c)));
    }
  }
  fence_proxy_async_shared();  // the panels reach wgmma's reads
  named_barrier_sync(kBothWarpgroups, 256);
  // The staging rows are free: the producer may fill warpgroup 1's stage 1 (unit block 3).
  if constexpr (kProducer) {
    if (tid == 0 && num_blocks > 3) mbar_arrive(N::staging_free_bar(base));
  }
  JAX_MLA_TRACE_AT(0, 3);

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

#pragma unroll 1
  for (int i = 0; i < my_blocks; ++i) {
    const int blk = 2 * i + wg;
    JAX_MLA_TRACE_AT(i + 1, 0);
    // Block i landed (this thread's copies, then a proxy fence: wgmma reads the stage) and every warp
    // is done with block i - 1's stage and P; block i + 1 goes into that stage now. Issued after the
    // fence (whether a proxy fence waits for later copies is not documented), so one block is in
    // flight per warpgroup while the other computes. Issued before the wait (two in flight, behind a
    // barrier that frees block i - 1's stage) it was at most 1.5% faster (ffi/cuda/NOTES.md, "Keys
    // evict-first": the body is bound by its own work).
    if constexpr (kProducer) {
      // The producer's copies and key flags of block i. No warpgroup barrier here: the maxima's
      // barrier below orders the P panel and maxima slots of this parity after block i - 2's reads.
      mbar_wait(N::full_bar(base, wg, i & 1), (i >> 1) & 1);
      fence_proxy_async_shared();
      JAX_MLA_TRACE_AT(i + 1, 1);
#ifdef JAX_MLA_NARROW_FP8_COPY_ONLY  // a timing probe, wrong output: the producer's copies with no body
      if (i + 2 < my_blocks) mbar_arrive(N::empty_bar(base, wg, i & 1));
      continue;
#endif
    } else {
      cp_async_wait<0>();
      fence_proxy_async_shared();
      named_barrier_sync(bar, 128);
      JAX_MLA_TRACE_AT(i + 1, 1);
      if (i + 1 < my_blocks) issue_block(i + 1);
      fetch_pages(i + 3);
      cp_async_commit();
    }
    const int stage = i & 1;
    const int key0 = kv_begin + blk * N::BK;

    // ---- S^T = K Q^T: the rope (T), then the raw e4m3 latent times the queries' e4m3 terms ----
    // Hopper's e4m3 wgmma keeps only ~14 bits of its running sum (DeepSeek-V3's technical report;
    // one chain over all 512 dims put an LSE off by 2.25e-3 where the mma.sync body's is 2.5e-4), so
    // each 128-dim slab starts a fresh accumulator and is added into s in float32, two slabs in
    // flight (sa, sb) while the previous one is added.
    const uint32_t stage_base = s_kv + stage * N::STAGE;
    float s[8], sa[8 * QTERMS], sb[8 * QTERMS];
    {
      const uint32_t k_lo = sw128_desc_lo(stage_base);
      auto slab = [&](float(&d)[8 * QTERMS], int j) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_64xN_ss_e4m3<16 * QTERMS>(d, sw128_desc_at(k_lo, j * N::SLAB + kk * 32),
                                          sw128_desc_at(q_lo, j * N::QSLAB + kk * 32), kk > 0);
        wgmma_commit();
      };
      // Column n of a slab's tile is term n / 16 of query row n % 16: this thread's register 8 (n / 16) on.
      auto add = [&](float(&d)[8 * QTERMS]) {
        fence_registers(d);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          float x = d[e] + d[8 + e] * (1.f / 16.f);
          if constexpr (QTERMS == 3) x += d[16 + e] * (1.f / 256.f);
          s[e] += x;
        }
      };
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_64x16_ss<T>(s, sw128_desc_at(k_lo, 4 * N::SLAB + kk * 32), sw128_desc_at(q_lo, 4 * N::QSLAB + kk * 32),
                          kk > 0);
      wgmma_commit();
      slab(sa, 0);
      slab(sb, 1);
      wgmma_wait<1>();  // the rope and slab 0
      fence_registers(s);
      add(sa);
      wgmma_fence();
      slab(sa, 2);
      wgmma_wait<1>();  // slab 1
      add(sb);
      wgmma_fence();
      slab(sb, 3);
      wgmma_wait<1>();  // slab 2
      add(sa);
      wgmma_wait<0>();  // slab 3
      add(sb);
    }
    JAX_MLA_TRACE_AT(i + 1, 2);

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
    JAX_MLA_TRACE_AT(i + 1, 3);
    // Between the maxima barrier (every warp's S has read the stage) and the P barrier (which orders
    // the zeros before P V's ldmatrix reads).
    if (by_tma && blk == num_blocks - 1 && u.range_end - key0 < N::BK) {
      zero_key_panel_rows(stage_base, u.range_end - key0, wtid);
    }
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
    // P as the K-major panel of P V's B (N::P_PANEL: 32 rows of 64 e4m3 keys).
    const uint32_t p_panel = base + N::P_OFF + (wg * 2 + (i & 1)) * N::P_PANEL;
    {
      // P times 2^8 in two e4m3 terms, x = hi + lo / 16 (split_e4m3x4's rule), row n = 16 term + row,
      // keys in the order of V^T's fragments below: within each 16 keys, key 8 h + 2 t + b sits at
      // position 4 t + 2 h + b. This thread's keys g and g + 8 of its warp's 16 are positions
      // 4 (g / 2) + (g & 1) and that + 2: a word of four positions is two keys of this lane and two
      // of lane ^ 4 (same rows). The even lane stores the hi words, the odd one the lo words.
      const bool odd = g & 1;
      uint32_t half16[4], send[2];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int e0 = (k & 1) + 4 * (k >> 1);  // key g (e0) and g + 8 (e0 + 2) of row R[k]
        const float2 x = make_float2(s[e0] * 256.f, s[e0 + 2] * 256.f);
        const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(x, __NV_SATFINITE, __NV_E4M3);
        const float2 r = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(hi, __NV_E4M3)));
        const __nv_fp8x2_storage_t lo =
            __nv_cvt_float2_to_fp8x2(make_float2((x.x - r.x) * 16.f, (x.y - r.y) * 16.f), __NV_SATFINITE, __NV_E4M3);
        half16[k] = odd ? (uint32_t)lo : (uint32_t)hi;  // the term this lane stores
        const uint32_t give = odd ? (uint32_t)hi : (uint32_t)lo;  // the term the other lane stores
        if (k & 1) {
          send[k >> 1] |= give << 16;
        } else {
          send[k >> 1] = give;
        }
      }
#pragma unroll
      for (int kp = 0; kp < 2; ++kp) {
        const uint32_t got = __shfl_xor_sync(0xffffffffu, send[kp], 4);
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          const int k = 2 * kp + kk;
          const uint32_t other = kk ? got >> 16 : got & 0xffffu;
          const uint32_t word = odd ? __byte_perm(other, half16[k], 0x5140) : __byte_perm(half16[k], other, 0x5140);
          const int n = 16 * odd + R[k];
          st_shared_u32(p_panel + n * 128 + ((warp ^ (n & 7)) << 4) + 4 * (g >> 1), word);
        }
      }
    }
    fence_proxy_async_shared();
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 8; ++e) o[j][e] *= alpha[acc_row(e)];
    named_barrier_sync(bar, 128);  // P of every warp is in the panel
    JAX_MLA_TRACE_AT(i + 1, 4);

    // ---- O^T += V^T P^T on e4m3 ----
    const uint32_t p_lo = sw128_desc_lo(p_panel);
    {
      // Two halves of four output tiles; per half a fresh accumulator (64 dims x two terms x 16 rows)
      // over the block's two k32 steps, added into O in float32 (the e4m3 wgmma's running sum keeps
      // ~14 bits). One ldmatrix.trans a tile and step gives keys 2t, 2t + 1 (+ 8, 16, 24) of dims 2g,
      // 2g + 1; two byte permutes make the 8-bit A registers (dim 2g: row g, 2g + 1: row g + 8).
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float acc[4][16];
        uint32_t a8[2][4][4];
#pragma unroll
        for (int ks = 0; ks < 2; ++ks)
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            uint32_t vb[4];
            ldmatrix_x4_trans(vb, fp8_slab_chunk(stage_base, 32 * ks + lane, 4 * (4 * hf + jj) + warp));
            vt_e4m3_fragment(a8[ks][jj], vb);
          }
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 2; ++ks)
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) wgmma_64x32_rs_e4m3(acc[jj], a8[ks][jj], sw128_desc_at(p_lo, ks * 32), ks);
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          fence_registers(acc[jj]);
#pragma unroll
          for (int e = 0; e < 8; ++e)
            o[4 * hf + jj][e] += acc[jj][e] * (1.f / 256.f) + acc[jj][8 + e] * (1.f / 4096.f);
        }
      }
    }
    JAX_MLA_TRACE_AT(i + 1, 5);
    // The stage is read (every wgmma of this thread has completed): the producer may refill it,
    // where it will (an arrival nobody waits for would leave a phase open).
    if constexpr (kProducer) {
      if (i + 2 < my_blocks) mbar_arrive(N::empty_bar(base, wg, i & 1));
    }
    // Nothing stays in flight across a back edge: with P V running into the next block, ptxas
    // serialised every wgmma of the kernel (C7514: the loop's register moves read O). The other
    // warpgroup's work covers these waits.
  }
  JAX_MLA_TRACE_AT(0, 4);
  cp_async_wait<0>();  // only empty groups can remain; leave nothing in flight
  // With an odd block count warpgroup 1 has one block fewer. It passes that block's barriers anyway
  // (three; two with the producer), so that both warpgroups reach the epilogue after the same number
  // of barriers of their own: only then does compute-sanitizer's racecheck see the epilogue's
  // barriers of both warpgroups order their accesses (it reported ~17,000 hazards there without this;
  // ffi/cuda/NOTES.md, "The e4m3 wgmma body becomes the default"). A few cycles, once a unit.
  for (int i = my_blocks; i < (num_blocks + 1) / 2; ++i) {
    if constexpr (!kProducer) named_barrier_sync(bar, 128);
    named_barrier_sync(bar, 128);
    named_barrier_sync(bar, 128);
  }

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
  // Warpgroup 0 combines and stores tiles 0-3, warpgroup 1 tiles 4-7, in one round: each hands the
  // other its four through the stages (every block has been read and every wgmma has completed). Two
  // rounds through the query panels, one barrier more, made the op 0.6-0.9 us slower on the fp8 timing
  // shapes (ffi/cuda/NOTES.md, "The epilogue in one round").
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
  {
    float* xbuf = reinterpret_cast<float*>(gbase + N::KV_OFF);  // float [warpgroup][32 dims][128 threads]
    const float* x_in = xbuf + (1 - wg) * 32 * 128;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj)
#pragma unroll
      for (int e = 0; e < 8; ++e) xbuf[(wg * 32 + jj * 8 + e) * 128 + wtid] = wg == 0 ? o[4 + jj][e] : o[jj][e];
    named_barrier_sync(kBothWarpgroups, 256);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = R[k];
      if (r >= rows) continue;
      const int e0 = (k & 1) + 4 * (k >> 1);  // dims 2g (e0) and 2g + 1 (e0 + 2) of row r
      store_tile_row<T, 4, 1, 32>(p, u, h0, hb, r, 256 * wg + 16 * warp + 2 * g, comb_l[k], comb_m[k], scales.out,
                                  wg == 0 && warp == 0 && g == 0, [&](int jj) {
                                    const float x = wg == 0 ? o[jj][e0] : o[4 + jj][e0];
                                    const float y = wg == 0 ? o[jj][e0 + 2] : o[4 + jj][e0 + 2];
                                    const float* other = x_in + jj * 8 * 128 + wtid;
                                    return make_float2(x * a_own[k] + other[e0 * 128] * a_other[k],
                                                       y * a_own[k] + other[(e0 + 2) * 128] * a_other[k]);
                                  });
    }
  }
  JAX_MLA_TRACE_AT(0, 5);
  JAX_MLA_TRACE_END();
}

}  // namespace cuda
}  // namespace jax_mla
