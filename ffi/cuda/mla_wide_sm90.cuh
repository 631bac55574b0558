// The producer / two-consumer wide body of the sm_90a kernel (mla_sm90_kernel.cuh, "v5b"): units of
// more than 16 query rows (rows = tokens x heads of one request: 32-128 heads, or 16 heads x 2-4 tokens
// of MTP / speculative verify) on an fp8 ckv below 64 heads or on pages under 32 keys take this
// warp-specialised body built on wgmma (a 16-bit cache's take mla_wide64_sm90.cuh at every page size);
// units of at most 16 rows take the narrow body (mla_narrow_kernel.cuh) on the
// first two warpgroups. With an fp8 ckv the wide body's producer converts the keys
// to fp16 in the ring (wide_producer_fp8) and the consumers multiply the latent part
// in fp16; an fp8 kpe takes the portable wide body.
//
// The wide body: one block = one work unit x 64 rows (padding rows are zero),
// three warpgroups.
//
//   * Producer (warpgroup 0, few registers): queries into nine 128-byte-swizzled
//     panels of 64 dims, then the unit's keys, 32 per block, into a four-stage
//     ring. A block of 32 valid keys inside one page (page size >= 32: every
//     block but a unit's partial last one) is one TMA box per 64-dim panel
//     (cp.async.bulk.tensor, tensor maps made on the host per launch), its bytes
//     counted on the stage's barrier; other blocks (page sizes < 32, partial
//     blocks, bad page ids) are gathered through the page table with 16-byte
//     cp.async. A stage is three groups with their own "full" and "empty"
//     mbarriers: the rope panel (dims 512-575, and a validity mask of the
//     block's keys), the left half of the latent (dims 0-255) and the right
//     half (256-511). Each group is refilled as soon as its last reader is
//     done with it; with four stages the next pair of blocks streams in while
//     the current pair is multiplied (two stages would leave loads and MMAs in
//     series; ffi/cuda/NOTES.md, v4a / v4b).
//   * Two consumers (warpgroups 1 and 2, most registers) split the output by
//     columns: consumer c keeps O[:, 256c : 256c + 256] in registers (128
//     floats per thread). They take the key blocks in pairs: consumer 0
//     computes S = Q K^T of the even block (A), consumer 1 of the odd one (B),
//     both with wgmma m64n32k16 (queries and keys from shared memory), so the
//     two S products and the softmax of the other consumer overlap. Then each
//     needs both blocks' probabilities for its own columns:
//
//       consumer 0: softmax A (max m_A) ................ signal A (m_A, P_A)
//                   O_L = a_A O_L + P_A V_A[:, left]       (P_A from registers)
//                   S_A of the next pair goes in behind it
//                   wait B; O_L = a_B O_L + P_B V_B[:, left] (P_B via shared memory)
//                   softmax of the next A while that PV runs
//       consumer 1: wait A; softmax B from m_A (max m_B); signal B (m_B, P_B)
//                   O_R = a_A a_B O_R + P_B V_B[:, right] + (a_B P_A) V_A[:, right]
//                   S_B of the next pair goes in behind it
//
//     The signals are mbarriers (one phase per pair, every thread of the
//     sending consumer arrives), which also order the reuse of the P and
//     statistics buffers one pair later. With a 16-bit cache, consumer 0's
//     signal goes out before it rescales O, which only it needs.
//     PV is wgmma m64n256k16 with P from registers and V read straight from the
//     key stage (the latent rows, MN-major). The running max is shared through
//     shared memory, so both halves of every row stay on one scale; the row sums
//     are kept per consumer and added in the epilogue. With a 16-bit cache, the
//     max a row's P is taken against moves only when a block's scores pass it
//     by more than kLazyMaxLog2 (P then stays at most 2^kLazyMaxLog2): past a
//     row's first blocks its factors are exactly 1, and a warp whose rows all
//     have factor 1 skips the rescale of its 128 accumulators.
//
// ffi/cuda/NOTES.md has what each version of this body measured.
//
// Split units write float32 partials for the merge kernel, as every body does.
#pragma once

#include "mla_common.cuh"
#include "mla_hopper.cuh"
#include "mla_attention_kernel.cuh"
#include "mla_narrow_kernel.cuh"
#include "mla_stages.cuh"

namespace jax_mla {
namespace cuda {

struct WideSm90 {
  static constexpr int kThreads = 384;  // producer + two consumer warpgroups
  static constexpr int ROWS = 64;
  static constexpr int BK = 32;                  // keys per block
  static constexpr int STAGES = 4;               // two pairs of blocks
  static constexpr int QPANEL = ROWS * 128;      // 64 query rows x 64 dims, 128-byte swizzle
  static constexpr int KPANEL = BK * 128;        // 32 keys x 64 dims
  static constexpr int STAGE = 9 * KPANEL;       // a key block: 8 latent panels + the rope panel
  static constexpr int ROPE_PANEL = 8;
  static constexpr int SACC = ROWS * BK / 128;   // S accumulators per thread
  static constexpr int PBYTES = ROWS * BK * 2;   // P of one block (64-byte rows, swizzled)
  // Shared memory (from a 1024-byte-aligned base): the nine query panels, the key
  // ring, P_A and P_B, the statistics. All of S = Q K^T reads the queries from shared
  // memory, which leaves the consumers' registers to O, S and the P fragments of the
  // MMAs in flight (the pipelined loop keeps one S and one PV in flight at once).
  static constexpr int Q_OFF = 0;
  static constexpr int KV_OFF = 9 * QPANEL;
  static constexpr int PA_OFF = KV_OFF + STAGES * STAGE;
  static constexpr int PB_OFF = PA_OFF + PBYTES;
  static constexpr int STATS_OFF = PB_OFF + PBYTES;  // float [6][64]: m_A, a_A, m_B, a_B, l(c=0), l(c=1)
  // Per stage: a u32 whose four bytes are the producer warps' ballots of valid
  // keys (all ones: no key is masked), then one byte per key.
  static constexpr int MASK_OFF = STATS_OFF + 6 * ROWS * 4;
  static constexpr int KEY_OK_OFF = MASK_OFF + STAGES * 4;
  static constexpr int BAR_OFF = KEY_OK_OFF + STAGES * BK;
  // full / empty x stage x group, queries, A / B ready; fp8 cache: raw latent landed x stage x half
  static constexpr int NUM_BARS = 2 * STAGES * 3 + 3 + 2 * STAGES;
  static constexpr int BYTES = BAR_OFF + NUM_BARS * 8;
  static constexpr int SMEM_BYTES = BYTES + 1024 - 16;  // room to align the base

  enum Group : int { kRope = 0, kLeft = 1, kRight = 2 };
  enum Stat : int { kMaxA = 0, kAlphaA = 1, kMaxB = 2, kAlphaB = 3, kSum0 = 4, kSum1 = 5 };
  enum NamedBarrier : int { kConsumers = 1 };
  static constexpr int kConsumerThreads = 256;
  static constexpr int kConverterThreads = 64;  // fp8 cache: producer warps 2-3 (wide_producer_fp8)

  static __device__ __forceinline__ uint32_t full_bar(uint32_t base, int stage, int group) {
    return base + BAR_OFF + (stage * 3 + group) * 8;
  }
  static __device__ __forceinline__ uint32_t empty_bar(uint32_t base, int stage, int group) {
    return base + BAR_OFF + (3 * STAGES + stage * 3 + group) * 8;
  }
  static __device__ __forceinline__ uint32_t query_bar(uint32_t base) { return base + BAR_OFF + 6 * STAGES * 8; }
  // Consumer 0 -> 1: m_A, a_A and P_A are in shared memory; consumer 1 -> 0: m_B,
  // a_B and P_B are, and P_A has been read. One phase per pair, all 128 threads arrive.
  static __device__ __forceinline__ uint32_t a_ready_bar(uint32_t base) { return query_bar(base) + 8; }
  static __device__ __forceinline__ uint32_t b_ready_bar(uint32_t base) { return query_bar(base) + 16; }
  // fp8 cache: the raw e4m3 bytes of a latent half (group kLeft / kRight) have landed in its stage.
  static __device__ __forceinline__ uint32_t raw_bar(uint32_t base, int stage, int group) {
    return query_bar(base) + 24 + (stage * 2 + group - kLeft) * 8;
  }
  static __device__ __forceinline__ uint32_t stage_addr(uint32_t base, int stage) {
    return base + KV_OFF + stage * STAGE;
  }
  // Byte offset of 16-byte chunk c (of 72: 64 latent + 8 rope) of row r in nine panels of `panel` bytes.
  static __device__ __forceinline__ uint32_t chunk_offset(int r, int c, int panel) {
    return (c >> 3) * panel + r * 128 + (((c & 7) ^ (r & 7)) << 4);
  }
  // Expected arrivals. full: every producer thread's cp.async arrival (+ one
  // plain arrival per producer warp for the rope group, which publishes the key
  // mask). empty: one arrival per warp of each consumer warpgroup that reads the
  // group (stage 0 = block A: consumer 0 computes S on all of it and PV on the
  // left half, consumer 1 PV on the right half; odd stages (block B) mirrored);
  // the rope group one per thread, as every thread of the softmax reads its key flags.
  static __device__ __forceinline__ int empty_count(int stage, int group) {
    if (group == kRope) return 128;  // every thread of the consumer whose softmax read the key flags
    const bool shared = (stage & 1) == 0 ? group == kRight : group == kLeft;
    return shared ? 8 : 4;
  }
  static_assert(SMEM_BYTES <= 227 * 1024, "one block per SM must fit");
  static_assert(STAGE % 1024 == 0 && KPANEL % 1024 == 0 && QPANEL % 1024 == 0, "swizzle atoms stay aligned");
};

// ---- producer -------------------------------------------------------------------

// The producer's key loaders: WARPS warps (tid 0 .. 32 WARPS - 1) walk the unit's key blocks
// into the ring. Warp w takes keys w, w + WARPS, ... of every block; lane j < KEYS = 32 / WARPS
// holds the page id of key w + WARPS j (the other lanes mirror them), fetched one block ahead.
// For each block and group, in the order the consumers free them (block A's readers free the
// left half first, block B's the right half), the loaders wait for the group's empty barrier,
// then load the rope group here (key mask and flags, kpe) and a latent half by
// load_half(group, stage, stage address, tma, tma_row, ok_bits, slot_of), where slot_of(j) is the
// cache row of key w + WARPS j (0 when invalid: zero-filled, never read).
// A block of 32 valid keys inside one page is one TMA box per panel, issued by thread 0 (bytes
// counted on the barriers); the rest (page sizes below 32, a unit's partial last block, bad page
// ids) is gathered row by row with cp.async. `tma` is uniform over the loaders: the keys' page is
// one page, so every warp sees the same validity.
// kLaneRow: each lane computes its own key's row once, in 32 bits, and slot_of broadcasts it (an
// fp8 cache that fits in memory has < 2^31 rows; fewer live registers); otherwise slot_of derives
// the row from the broadcast page id.
template <typename T, int WARPS, bool kLaneRow, typename LoadHalf>
__device__ __forceinline__ void wide_load_keys(const Problem& p, const KeyTensorMaps& maps, const Unit& u,
                                               uint32_t base, int tid, LoadHalf load_half) {
  using W = WideSm90;
  constexpr int KEYS = W::BK / WARPS;  // keys a warp takes of every block
  constexpr uint32_t kAllKeys = (1u << KEYS) - 1;
  const int warp = tid >> 5, lane = tid & 31;
  const T* kpe = static_cast<const T*>(p.kpe);
  const int kv_begin = u.kv_begin;
  const int num_blocks = (u.range_end - kv_begin + W::BK - 1) / W::BK;
  const int* pt_row = page_table_row(p, u);
  const int key_in_block = warp + WARPS * (lane & (KEYS - 1));
  auto page_of = [&](int blk) {
    const int key = kv_begin + blk * W::BK + key_in_block;
    return blk < num_blocks && key < u.range_end ? __ldg(pt_row + (key >> p.log2_page_size)) : -1;
  };
  int page_next = page_of(0);
#pragma unroll 1
  for (int blk = 0; blk < num_blocks; ++blk) {
    const int stage = blk & (W::STAGES - 1), use = blk / W::STAGES;
    const bool block_a = (blk & 1) == 0;
    const int page = page_next;
    page_next = page_of(blk + 1);
    const int key_base = kv_begin + blk * W::BK;
    const bool ok = key_base + key_in_block < u.range_end && page_in_cache(p, page);
    const uint32_t ok_bits = __ballot_sync(0xffffffffu, ok) & kAllKeys;  // bit j: key w + WARPS j
    const uint32_t st = W::stage_addr(base, stage);
    const int in_page = key_base & (p.page_size - 1);
    const bool tma = maps.enabled && in_page + W::BK <= p.page_size && key_base + W::BK <= u.range_end &&
                     ok_bits == kAllKeys;
    const int tma_row = __shfl_sync(0xffffffffu, page, 0) * p.page_size + in_page;
    uint32_t row = 0u;
    if constexpr (kLaneRow) {
      row = ok ? cache_row<uint32_t>(page, key_base + key_in_block, p.page_size) : 0u;
    }
    auto slot_of = [&](int j) -> size_t {
      if constexpr (kLaneRow) {
        return __shfl_sync(0xffffffffu, row, j);
      } else {
        const int pg = __shfl_sync(0xffffffffu, page, j);
        const int key = key_base + warp + WARPS * j;
        return ((ok_bits >> j) & 1) ? cache_row<size_t>(pg, key, p.page_size) : 0;
      }
    };
#pragma unroll
    for (int gi = 0; gi < 3; ++gi) {
      const int group = gi == 0 ? W::kRope : ((gi == 1) == block_a ? W::kLeft : W::kRight);
      mbar_wait(W::empty_bar(base, stage, group), (use & 1) ^ 1);
      if (group != W::kRope) {
        load_half(group, stage, st, tma, tma_row, ok_bits, slot_of);
        continue;
      }
      // The mask word of the stage: one ballot of KEYS bits per warp.
      if (lane == 0) {
        if constexpr (KEYS == 8) {
          st_shared_u8(base + W::MASK_OFF + stage * 4 + warp, ok_bits);
        } else {
          st_shared_u16(base + W::MASK_OFF + stage * 4 + 2 * warp, ok_bits);
        }
      }
      if (lane < KEYS) st_shared_u8(base + W::KEY_OK_OFF + stage * W::BK + key_in_block, ok);
      __syncwarp();  // lane 0's arrival below publishes the whole warp's flags
      if (tma) {
        if (tid == 0) {
          mbar_arrive_expect_tx(W::full_bar(base, stage, W::kRope), W::KPANEL);
          tma_load_2d(st + W::ROPE_PANEL * W::KPANEL, &maps.kpe, 0, tma_row, W::full_bar(base, stage, W::kRope));
        } else {
          mbar_arrive(W::full_bar(base, stage, W::kRope));
        }
        if (lane == 0) mbar_arrive(W::full_bar(base, stage, W::kRope));  // publishes the mask
        continue;
      }
#pragma unroll
      for (int i = 0; i < KEYS / 4; ++i) {
        const int j = 4 * i + (lane >> 3), c = lane & 7, kl = warp + WARPS * j;
        const size_t slot = slot_of(j);
        cp_async16(st + W::ROPE_PANEL * W::KPANEL + kl * 128 + ((c ^ (kl & 7)) << 4), kpe + slot * kDimKpe + c * 8,
                   ((ok_bits >> j) & 1) ? 16 : 0);
      }
      mbar_arrive_on_cp_async(W::full_bar(base, stage, W::kRope));
      if (lane == 0) mbar_arrive(W::full_bar(base, stage, W::kRope));  // publishes the mask
    }
  }
  cp_async_wait_all();  // leave nothing in flight behind an exited thread
}

template <typename T>
__device__ __forceinline__ void wide_producer(const Problem& p, const KeyTensorMaps& maps, const Unit& u, int h0,
                                              int hb, uint32_t base) {
  using W = WideSm90;
  const int tid = threadIdx.x;  // 0..127
  const int warp = tid >> 5, lane = tid & 31;
  const int rows = u.q_len * hb;
  const T* ckv = static_cast<const T*>(p.ckv);

  // Queries: rows r = (token r / hb, head h0 + r % hb); padding rows zero.
  load_query_tile<T, W::ROWS, 128>(p, u, h0, hb, rows, tid,
                                   [&](int r, int c) { return base + W::Q_OFF + W::chunk_offset(r, c, W::QPANEL); });
  mbar_arrive_on_cp_async(W::query_bar(base));

  // Keys, by all four warps; a latent half is four panels of 64 dims: dims 0-255 (left) or 256-511 (right).
  wide_load_keys<T, 4, false>(
      p, maps, u, base, tid,
      [&](int group, int stage, uint32_t st, bool tma, int tma_row, uint32_t ok_bits, auto slot_of) {
        if (tma) {
          const int panel0 = group == W::kLeft ? 0 : 4;
          if (tid == 0) {
            mbar_arrive_expect_tx(W::full_bar(base, stage, group), 4 * W::KPANEL);
#pragma unroll
            for (int i = 0; i < 4; ++i)
              tma_load_2d(st + (panel0 + i) * W::KPANEL, &maps.ckv, (panel0 + i) * 64, tma_row,
                          W::full_bar(base, stage, group));
          } else {
            mbar_arrive(W::full_bar(base, stage, group));
          }
          return;
        }
        const int c = (group == W::kLeft ? 0 : 32) + lane;  // one key's 512 bytes per warp instruction
#pragma unroll 4
        for (int j = 0; j < 8; ++j) {
          const int kl = warp + 4 * j;
          const size_t slot = slot_of(j);
          cp_async16(st + (c >> 3) * W::KPANEL + kl * 128 + (((c & 7) ^ (kl & 7)) << 4), ckv + slot * kDimCkv + c * 8,
                     ((ok_bits >> j) & 1) ? 16 : 0);
        }
        mbar_arrive_on_cp_async(W::full_bar(base, stage, group));
      });
}

// ---- producer, fp8 cache (e4m3 ckv, kpe in T) -------------------------------------
//
// The MMAs read keys from shared memory in a 16-bit type, so the producer turns each fp8
// latent half into fp16 (LatentMmaType) in its stage before it hands it over. A single
// in-order producer cannot both keep loads in flight and convert: the consumers free a
// stage only once the blocks up to three ahead of it are full, so a producer that waited
// for a block's bytes before it asked for the next stage would put every load's latency
// in series. The producer warpgroup is therefore two teams:
//
//   * loaders (warps 0-1, wide_load_keys): the key mask, the rope panel (kpe, already T,
//     into its final place) and the raw e4m3 bytes of each latent half into the half's
//     last two panels: raw dims 0-127 of key k in row k of panel 2, dims 128-255 in row k
//     of panel 3, 16-byte chunk i at i ^ (k & 7), which is TMA's 128-byte swizzle: a whole
//     block on one page is one TMA box per panel, other blocks are gathered by cp.async.
//     A "raw" mbarrier per stage and half counts their landing. The loaders run ahead as
//     far as the empty barriers let them.
//   * converters (warps 2-3): the queries (cp.async, as they are: the consumers rescale
//     them into fp16, wide_prepare_queries_fp8), then warp 2 + c the c-th latent half of
//     every block: wait for its raw bytes, write it in place as fp16 in the four panels
//     the MMAs read (exact: one cvt a pair, LatentMmaType), fence for the async proxy,
//     arrive on the half's full barrier. A lane converts one key's row, in an order that
//     reads every raw byte before it is overwritten, so no barrier is needed.
template <typename T>
__device__ __forceinline__ void wide_producer_fp8(const Problem& p, const KeyTensorMaps& maps, const Unit& u, int h0,
                                                  int hb, uint32_t base) {
  using W = WideSm90;
  const int tid = threadIdx.x;  // 0..127
  const int warp = tid >> 5, lane = tid & 31;
  if (warp < 2) {
    const char* ckv = static_cast<const char*>(p.ckv);  // 512 bytes a key
    wide_load_keys<T, 2, true>(
        p, maps, u, base, tid,
        [&](int group, int stage, uint32_t st, bool tma, int tma_row, uint32_t ok_bits, auto slot_of) {
          const int half = group == W::kLeft ? 0 : 1;  // raw bytes 256 half + 128 q into panel 4 half + 2 + q
          if (tma) {
            if (tid == 0) {
              mbar_arrive_expect_tx(W::raw_bar(base, stage, group), 2 * W::KPANEL);
#pragma unroll
              for (int q = 0; q < 2; ++q)
                tma_load_2d(st + (4 * half + 2 + q) * W::KPANEL, &maps.ckv, 256 * half + 128 * q, tma_row,
                            W::raw_bar(base, stage, group));
            } else {
              mbar_arrive(W::raw_bar(base, stage, group));
            }
            return;
          }
#pragma unroll 4
          for (int i = 0; i < 8; ++i) {  // 16 keys x 16 raw chunks a warp
            const int j = 2 * i + (lane >> 4), c = lane & 15, kl = warp + 2 * j;
            const uint32_t raw = st + (4 * half + 2 + (c >> 3)) * W::KPANEL;
            cp_async16(raw + kl * 128 + (((c & 7) ^ (kl & 7)) << 4), ckv + slot_of(j) * kDimCkv + half * 256 + c * 16,
                       ((ok_bits >> j) & 1) ? 16 : 0);
          }
          mbar_arrive_on_cp_async(W::raw_bar(base, stage, group));
        });
    return;
  }

  // ---- converters: the queries as they are (the consumers rescale them, wide_prepare_queries_fp8), then keys ----
  using MT = LatentMmaType<T, kCacheFp8Ckv>;
  const int ct = tid - 64, cw = ct >> 5;
  const int num_blocks = (u.range_end - u.kv_begin + W::BK - 1) / W::BK;
  load_query_tile<T, W::ROWS, W::kConverterThreads>(
      p, u, h0, hb, u.q_len * hb, ct, [&](int r, int c) { return base + W::Q_OFF + W::chunk_offset(r, c, W::QPANEL); });
  mbar_arrive_on_cp_async(W::query_bar(base));
  // Converter warp cw takes latent half cw of every block in the order the consumers read them
  // (block A: left first, block B: right first), so a block's halves are converted side by side.
  // Lane l owns key l's row from raw bytes to fp16, which orders every overwrite after its reads
  // without a barrier: panels 0-1 (not raw) from raw panel 2; then panel 2 (raw panel 2's row,
  // read) from raw chunks 0-3 of panel 3; then panel 3 in place: raw chunks 4-5 into output
  // chunks 0-3 (where raw chunks 0-3 were), then 6-7 into 4-7 (where 4-7 were).
  const int kl = lane, sw = lane & 7;
#pragma unroll 1
  for (int blk = 0; blk < num_blocks; ++blk) {
    const int stage = blk & (W::STAGES - 1), use = blk / W::STAGES;
    const bool block_a = (blk & 1) == 0;
    const int group = (cw == 0) == block_a ? W::kLeft : W::kRight;
    const uint32_t row = W::stage_addr(base, stage) + (group == W::kLeft ? 0 : 4) * W::KPANEL + kl * 128;
    const uint32_t raw2 = row + 2 * W::KPANEL, raw3 = row + 3 * W::KPANEL;  // key kl's raw rows
    // Raw chunk i of a raw row (16 e4m3) -> output chunks oc, oc + 1 of the half (8 values each).
    auto put = [&](uint4 v, int oc) {
      st_shared_v4(row + (oc >> 3) * W::KPANEL + (((oc & 7) ^ sw) << 4), fp8x8_to<MT>(make_uint2(v.x, v.y)));
      st_shared_v4(row + ((oc + 1) >> 3) * W::KPANEL + ((((oc + 1) & 7) ^ sw) << 4),
                   fp8x8_to<MT>(make_uint2(v.z, v.w)));
    };
    mbar_wait(W::raw_bar(base, stage, group), use & 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) put(ld_shared_v4(raw2 + ((i ^ sw) << 4)), 2 * i);
#pragma unroll
    for (int i = 0; i < 4; ++i) put(ld_shared_v4(raw3 + ((i ^ sw) << 4)), 16 + 2 * i);
#pragma unroll
    for (int i = 4; i < 8; i += 2) {
      const uint4 v0 = ld_shared_v4(raw3 + ((i ^ sw) << 4)), v1 = ld_shared_v4(raw3 + (((i + 1) ^ sw) << 4));
      put(v0, 16 + 2 * i);
      put(v1, 18 + 2 * i);
    }
    fence_proxy_async_shared();  // the fp16 rows reach the consumers' wgmma reads
    mbar_arrive(W::full_bar(base, stage, group));
  }
}

// ---- consumer stages -------------------------------------------------------------

// S = Q K^T for the block in `stage`: rope panel first, then the two latent halves
// in the order the producer refills them (block A: left first; block B: right
// first). Async: the caller commits the group.
template <typename T, typename MT, bool BLOCK_A>
__device__ __forceinline__ void wide_scores(float (&s)[WideSm90::SACC], uint32_t base, int stage, int parity) {
  using W = WideSm90;
  base = opaque(base);
  const uint32_t st = W::stage_addr(base, stage);
  const uint32_t q_lo = sw128_desc_lo(base + W::Q_OFF), k_lo = sw128_desc_lo(st);
  mbar_wait(W::full_bar(base, stage, W::kRope), parity);
  fence_proxy_async_shared();
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_64x32_ss<T>(s, sw128_desc_at(q_lo, W::ROPE_PANEL * W::QPANEL + kk * 32),
                      sw128_desc_at(k_lo, W::ROPE_PANEL * W::KPANEL + kk * 32), kk > 0);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int group = (half == 0) == BLOCK_A ? W::kLeft : W::kRight;
    mbar_wait(W::full_bar(base, stage, group), parity);
    fence_proxy_async_shared();
    const int p0 = group == W::kLeft ? 0 : 4;
#pragma unroll
    for (int pn = p0; pn < p0 + 4; ++pn)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_64x32_ss<MT>(s, sw128_desc_at(q_lo, pn * W::QPANEL + kk * 32),
                           sw128_desc_at(k_lo, pn * W::KPANEL + kk * 32), 1);
  }
}

// Scales scores to base 2 (scale_log2: the thread's two rows') and masks keys that are invalid
// or past the row's limit.
// The block's validity ballot decides whether any key needs the per-key flags.
__device__ __forceinline__ void wide_mask(float (&s)[WideSm90::SACC], const float (&scale_log2)[2], uint32_t base,
                                          int stage, int key0, const int (&limit)[2], int t4) {
  using W = WideSm90;
  const uint32_t ballot = *reinterpret_cast<const uint32_t*>(__cvta_shared_to_generic(base + W::MASK_OFF + stage * 4));
  const bool clean = ballot == 0xffffffffu && key0 + W::BK <= min(limit[0], limit[1]);
  if (clean) {
#pragma unroll
    for (int i = 0; i < W::SACC; ++i) s[i] *= scale_log2[(i >> 1) & 1];
    return;
  }
  const unsigned char* key_ok = reinterpret_cast<const unsigned char*>(
      __cvta_shared_to_generic(opaque(base) + W::KEY_OK_OFF + stage * W::BK + 2 * t4));
#pragma unroll
  for (int j = 0; j < W::SACC / 4; ++j) {
    const unsigned short ok2 = *reinterpret_cast<const unsigned short*>(key_ok + 8 * j);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int kl = 8 * j + 2 * t4 + (e & 1);
      const bool vis = ((ok2 >> (8 * (e & 1))) & 1) && key0 + kl < limit[e >> 1];
      s[4 * j + e] = vis ? s[4 * j + e] * scale_log2[e >> 1] : -INFINITY;
    }
  }
}

// Row maxima of the thread's two rows (a row's keys sit in four lanes). NS: the thread's scores
// of one block (keys / 2 for 64 rows; both wgmma bodies).
template <int NS>
__device__ __forceinline__ void wide_row_max(const float (&s)[NS], float (&mx)[2]) {
  mx[0] = mx[1] = -INFINITY;
#pragma unroll
  for (int i = 0; i < NS; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 1));
    mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 2));
  }
}

// P = 2^(S - m) in place, with the thread's partial row sums; m = -inf (nothing
// visible yet) counts as 0 so that masked scores give 0, never NaN.
template <int NS>
__device__ __forceinline__ void wide_exp(float (&s)[NS], const float (&m)[2], float (&sum)[2]) {
  const float mu[2] = {m[0] == -INFINITY ? 0.f : m[0], m[1] == -INFINITY ? 0.f : m[1]};
  sum[0] = sum[1] = 0.f;
#pragma unroll
  for (int i = 0; i < NS; ++i) {
    s[i] = fast_exp2(s[i] - mu[(i >> 1) & 1]);
    sum[(i >> 1) & 1] += s[i];
  }
}
__device__ __forceinline__ float wide_alpha(float m_old, float m_new) {
  return fast_exp2(m_old - (m_new == -INFINITY ? 0.f : m_new));
}

// A row's reference max moves only when a block's scores exceed it by more than this (base 2):
// P = 2^(S - m) then stays at most 2^8, far inside the range of P's 16-bit type and of the float
// sums, while the rows' factors are exactly 1 on most blocks, so their rescales are skipped.
constexpr float kLazyMaxLog2 = 8.f;

// A row's new reference max from its old one and a block's max (kLazyMax: kept unless the block's exceeds it
// by more than kLazyMaxLog2), and alpha, the factor for what was accumulated against the old one.
template <bool kLazyMax>
__device__ __forceinline__ void wide_max_update(const float& m_prev, const float& mx, float& m_new, float& alpha) {
  if constexpr (kLazyMax) {
    // A NaN max fails the test and leaves m_prev (fmaxf), as in the plain update; its P is NaN.
    const bool keep = m_prev != -INFINITY && mx <= m_prev + kLazyMaxLog2;
    m_new = keep ? m_prev : fmaxf(m_prev, mx);
    alpha = m_new == m_prev ? 1.f : wide_alpha(m_prev, m_new);
  } else {
    m_new = fmaxf(m_prev, mx);
    alpha = wide_alpha(m_prev, m_new);
  }
}

// A block's softmax step, in place: mask and scale the scores (mask(s): the body's own key
// flags and row limits), the rows' new reference max m_new (m_prev, unless the block's max
// exceeds it by more than kLazyMaxLog2, or nothing was visible before), alpha = the factor for
// what was accumulated against m_prev (exactly 1 when the max stays), P = 2^(S - m_new) and the
// thread's partial row sums of P.
template <bool kLazyMax, int NS, typename Mask>
__device__ __forceinline__ void softmax_block(float (&s)[NS], Mask mask, const float (&m_prev)[2], float (&m_new)[2],
                                              float (&alpha)[2], float (&sum)[2]) {
  mask(s);
  float mx[2];
  wide_row_max(s, mx);
#pragma unroll
  for (int e = 0; e < 2; ++e) wide_max_update<kLazyMax>(m_prev[e], mx[e], m_new[e], alpha[e]);
  wide_exp(s, m_new, sum);
}

// softmax_block with the scale folded into the exponent (an experiment of the 64-key body,
// -DJAX_MLA_WIDE64_LEAN_SOFTMAX; NOTES.md, "fifty-second session"): mask(s) leaves the scores raw (-inf
// where masked), the row max is taken over them in four partial maxima a row and then scaled (scale > 0),
// P = 2^(fma(S, scale, -m)) and the row sums go in four partial sums a row: no multiply per score and
// dependency chains of 4 instead of 16 in the softmax, which lies on the pair's critical path.
template <bool kLazyMax, int NS, typename Mask>
__device__ __forceinline__ void softmax_block_scaled(float (&s)[NS], Mask mask, const float (&scale)[2],
                                                     const float (&m_prev)[2], float (&m_new)[2], float (&alpha)[2],
                                                     float (&sum)[2]) {
  static_assert(NS % 16 == 0, "four partial reductions a row");
  mask(s);
  float part[2][4];
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int k = 0; k < 4; ++k) part[e][k] = -INFINITY;
#pragma unroll
  for (int i = 0; i < NS; ++i) part[(i >> 1) & 1][(i >> 2) & 3] = fmaxf(part[(i >> 1) & 1][(i >> 2) & 3], s[i]);
  float mx[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    mx[e] = fmaxf(fmaxf(part[e][0], part[e][1]), fmaxf(part[e][2], part[e][3]));
    mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 1));
    mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 2));
    wide_max_update<kLazyMax>(m_prev[e], mx[e] * scale[e], m_new[e], alpha[e]);
  }
  const float neg_mu[2] = {m_new[0] == -INFINITY ? 0.f : -m_new[0], m_new[1] == -INFINITY ? 0.f : -m_new[1]};
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int k = 0; k < 4; ++k) part[e][k] = 0.f;
#pragma unroll
  for (int i = 0; i < NS; ++i) {
    const int e = (i >> 1) & 1;
    s[i] = fast_exp2(fmaf(s[i], scale[e], neg_mu[e]));
    part[e][(i >> 2) & 3] += s[i];
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) sum[e] = (part[e][0] + part[e][1]) + (part[e][2] + part[e][3]);
}

// v5b's softmax step: its key flags come from the producer's mask (wide_mask).
template <bool kLazyMax>
__device__ __forceinline__ void wide_softmax(float (&s)[WideSm90::SACC], const float (&scale_log2)[2], uint32_t base,
                                             int stage, int key0, const int (&limit)[2], int t4,
                                             const float (&m_prev)[2], float (&m_new)[2], float (&alpha)[2],
                                             float (&sum)[2]) {
  softmax_block<kLazyMax>(
      s, [&](float (&x)[WideSm90::SACC]) { wide_mask(x, scale_log2, base, stage, key0, limit, t4); }, m_prev, m_new,
      alpha, sum);
}

constexpr int kWideKSteps = WideSm90::BK / 16;  // k16 steps of P V per block

// The 64 x 16 KS probabilities as the A fragments of KS k16 steps.
template <typename T, int KS>
__device__ __forceinline__ void wide_pack_p(const float (&s)[8 * KS], uint32_t (&pa)[KS][4]) {
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    pa[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
    pa[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
    pa[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
    pa[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
  }
}
// P fragments to / from a 64 x 32 tile of 64-byte rows, chunk c of row r at
// c ^ ((r >> 1) & 3): the eight rows of every store or ldmatrix phase fall in
// distinct banks.
__device__ __forceinline__ uint32_t wide_p_offset(int r, int c) { return r * 64 + ((c ^ ((r >> 1) & 3)) << 4); }
__device__ __forceinline__ void wide_store_p(uint32_t buf, const uint32_t (&pa)[kWideKSteps][4], int warp,
                                             int lane) {
  buf = opaque(buf);
  const int g = lane >> 2, t4 = lane & 3;
  const int r0 = 16 * warp + g, r1 = r0 + 8;
#pragma unroll
  for (int kk = 0; kk < kWideKSteps; ++kk) {
    st_shared_u32(buf + wide_p_offset(r0, 2 * kk) + 4 * t4, pa[kk][0]);
    st_shared_u32(buf + wide_p_offset(r1, 2 * kk) + 4 * t4, pa[kk][1]);
    st_shared_u32(buf + wide_p_offset(r0, 2 * kk + 1) + 4 * t4, pa[kk][2]);
    st_shared_u32(buf + wide_p_offset(r1, 2 * kk + 1) + 4 * t4, pa[kk][3]);
  }
}
__device__ __forceinline__ void wide_load_p(uint32_t buf, uint32_t (&pa)[kWideKSteps][4], int warp, int lane) {
  buf = opaque(buf);
  const int row = 16 * warp + (lane & 7) + ((lane >> 3) & 1) * 8, ch = lane >> 4;
#pragma unroll
  for (int kk = 0; kk < kWideKSteps; ++kk) ldmatrix_x4(pa[kk], buf + wide_p_offset(row, 2 * kk + ch));
}

template <typename T>
__device__ __forceinline__ uint32_t scale_pair(uint32_t v, float a) {
  const float2 f = unpack2<T>(v);
  return pack2<T>(f.x * a, f.y * a);
}

// O[:, 256 HALF : +256] += P V for the keys of `stage` (async, not committed).
template <typename T, int HALF>
__device__ __forceinline__ void wide_pv(float (&o)[128], const uint32_t (&pa)[kWideKSteps][4], uint32_t stage_addr) {
  using W = WideSm90;
  const uint32_t v_lo = sw128_mn_desc_lo(opaque(stage_addr), W::KPANEL);
#pragma unroll
  for (int kk = 0; kk < kWideKSteps; ++kk)
    wgmma_64x256_rs_mn<T>(o, pa[kk], sw128_desc_at(v_lo, HALF * 4 * W::KPANEL + kk * 2048), 1);
}

// O (128 floats a thread: 32 groups of the m16n8 layout) times a row's factor; with kSkip,
// skipped by a warp whose 16 rows all have factor 1 (the lazy max makes that the common case).
template <bool kSkip>
__device__ __forceinline__ void wide_rescale(float (&o)[128], const float (&a)[2]) {
  if constexpr (kSkip) {
    if (__all_sync(0xffffffffu, a[0] == 1.f && a[1] == 1.f)) return;
  }
  rescale_rows(*reinterpret_cast<float(*)[32][4]>(&o), a[0], a[1]);
}

// ---- consumers -------------------------------------------------------------------

// fp8 cache: the queries, as staged (T), turned in place into the types the MMAs read. Row r's
// latent part times 2^k_r into fp16, its rope part times rope_factor 2^k_r, rounded once to T; k_r
// brings the row's largest magnitude (latent, and rope times the factor) just under 2^15, so fp16
// keeps every value a bf16 query holds down to 2^-24 of that maximum at full precision (smaller ones
// cannot move a score). scale_log2[e] is divided by 2^k_r for the thread's rows. `chunk(r, c)` is
// the shared address of chunk c (0-71: 64 latent, 8 rope) of staged row r, wherever the body keeps
// it. Both warpgroups of a two-warpgroup body (v5b's consumers, the 64-key body's two) hold the same
// rows (16 warp + g, + 8) and each reads all of them, so both find the same k_r; each then rewrites
// half of the chunks, after `sync_both` (a barrier over both warpgroups) orders every read before
// the first write. The caller fences and synchronises both warpgroups before any wgmma or ldmatrix
// reads the rows.
template <typename T, int HALF, typename ChunkAddr, typename SyncBoth>
__device__ __forceinline__ void wide_prepare_queries_fp8(ChunkAddr chunk, SyncBoth sync_both, int warp, int lane,
                                                         float rope_factor, float (&scale_log2)[2]) {
  const int g = lane >> 2, t4 = lane & 3;
  float factor[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 16 * warp + g + 8 * e;
    float amax_latent = 0.f, amax_rope = 0.f;
#pragma unroll 2
    for (int c = t4; c < kChunksPerKey; c += 4) {
      const float m = chunk_amax<T>(ld_shared_v4(chunk(r, c)));
      if (c < 64) {
        amax_latent = fmaxf(amax_latent, m);
      } else {
        amax_rope = fmaxf(amax_rope, m);
      }
    }
    float amax = fmaxf(amax_latent, amax_rope * fabsf(rope_factor));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const int k = fp8_query_exponent(amax);
    factor[e] = exp2_int(k);
    scale_log2[e] *= exp2_int(-k);
  }
  sync_both();  // every read of the staged rows is done
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 16 * warp + g + 8 * e;
#pragma unroll 3
    for (int j = 0; j < 9; ++j) {  // latent chunks 32 HALF + t4 + 4j, then rope chunk 64 + 4 HALF + t4
      const bool rope = j == 8;
      const int c = rope ? 64 + 4 * HALF + t4 : 32 * HALF + t4 + 4 * j;
      const float f = rope ? factor[e] * rope_factor : factor[e];
      st_shared_v4(chunk(r, c), scale_query_chunk<T>(ld_shared_v4(chunk(r, c)), f, rope));
    }
  }
}

// The two rows a thread holds in a warpgroup's 64-row accumulators (warp w: rows 16 w + g and
// 16 w + g + 8) and the keys each row may see.
__device__ __forceinline__ void accumulator_rows(const Unit& u, int warp, int g, int rows, int hb, int (&r)[2],
                                                 int (&limit)[2]) {
  r[0] = 16 * warp + g;
  r[1] = r[0] + 8;
#pragma unroll
  for (int e = 0; e < 2; ++e) limit[e] = row_key_limit(u, r[e], rows, hb);
}

// A tile row's LSE (natural log) from its base-2 max and row sum, into lse or a split's partial_lse.
__device__ __forceinline__ void store_row_lse(const Problem& p, const Unit& u, int h0, int hb, int row, float m,
                                              float l) {
  const UnitDest d = unit_dest(p, u, row / hb, h0 + row % hb);
  d.lse[d.row] = l != 0.f ? (m + __log2f(l)) * kLn2 : -INFINITY;
}
// Bytes between two staged rows of T: 16 bytes of padding put the fragments' 4-byte stores of a warp
// (rows g, columns 2 t4) in distinct banks.
template <typename T>
constexpr int kStagedRowPitch = kDimCkv * (int)sizeof(T) + 16;

// The staged rows of T (kStagedRowPitch<T> bytes apart from `stage`) to out, or to a split's partial
// rows: one bulk copy a row by thread ctid < rows, which waits for the copy's reads (the block's shared
// memory must outlive them). The caller fences and synchronises the staging threads first.
template <typename T>
__device__ __forceinline__ void copy_staged_rows(const Problem& p, const Unit& u, int h0, int hb, int rows,
                                                 uint32_t stage, int ctid) {
  if (ctid < rows) {
    const UnitDest d = unit_dest(p, u, ctid / hb, h0 + ctid % hb);
    T* dst = static_cast<T*>(d.out) + d.row * kDimCkv;
    bulk_copy_s2g(dst, stage + ctid * kStagedRowPitch<T>, kDimCkv * sizeof(T));
    bulk_commit_and_wait_read();
  }
}

// A warpgroup's row sums (a row's keys sit in four lanes) into shared memory at sum_ptr(HALF, row).
template <int HALF, typename SumPtr>
__device__ __forceinline__ void publish_row_sums(const float (&l_run)[2], const int (&r)[2], int t4, SumPtr sum_ptr) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float l = l_run[e];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (t4 == 0) *sum_ptr(HALF, r[e]) = l;
  }
}

// The end of a two-warpgroup body (this one and mla_wide64_sm90.cuh's), in two stages.
// stage_two_halves: each warpgroup's row sums (a row's keys sit in four lanes) meet in shared memory
// (sum_ptr(half, row)) at a named barrier across both warpgroups (`threads` of them); then each
// warpgroup writes its 256 columns of every row, normalised, as T (a split unit's partial rows too)
// into `stage`: the body's key buffers, free once both warpgroups' last MMAs are done (before the
// barrier), rows padded by 16 bytes so that the fragments' stores fall in distinct banks; warpgroup 0
// writes the LSEs. store_two_halves then fences, meets at the barrier again and copies the rows out,
// one bulk copy per row (ctid = 0 .. threads - 1 among the threads). Per thread 4-byte global stores
// of the fragments took ~8,000 cycles a 64-row tile (NOTES.md, "third session"). The 64-key body's
// walk (mla_wide64_walk_sm90.cuh) does its own work between the two stages.
template <typename T, int HALF, typename SumPtr>
__device__ __forceinline__ void stage_two_halves(const Problem& p, const Unit& u, int h0, int hb, int rows,
                                                 const int (&r)[2], int t4, const float (&l_run)[2],
                                                 const float (&m_run)[2], const float (&o)[128], float out_scale,
                                                 SumPtr sum_ptr, int barrier, int threads, uint32_t stage) {
  publish_row_sums<HALF>(l_run, r, t4, sum_ptr);
  named_barrier_sync(barrier, threads);
  constexpr int pitch = kStagedRowPitch<T>;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float l = *sum_ptr(0, r[e]) + *sum_ptr(1, r[e]);
    const float inv = l != 0.f ? out_scale / l : 0.f;
    const uint32_t row = stage + r[e] * pitch;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = HALF * 256 + 8 * j + 2 * t4;
      st_shared_u32(row + col * (int)sizeof(T), pack2<T>(o[4 * j + 2 * e] * inv, o[4 * j + 2 * e + 1] * inv));
    }
    if (HALF == 0 && t4 == 0 && r[e] < rows) store_row_lse(p, u, h0, hb, r[e], m_run[e], l);
  }
}
template <typename T, int HALF, typename SumPtr>
__device__ __forceinline__ void store_two_halves(const Problem& p, const Unit& u, int h0, int hb, int rows,
                                                 const int (&r)[2], int t4, const float (&l_run)[2],
                                                 const float (&m_run)[2], const float (&o)[128], float out_scale,
                                                 SumPtr sum_ptr, int barrier, int threads, uint32_t stage, int ctid) {
  stage_two_halves<T, HALF>(p, u, h0, hb, rows, r, t4, l_run, m_run, o, out_scale, sum_ptr, barrier, threads, stage);
  fence_proxy_async_shared();  // the rows reach the bulk copies' reads
  named_barrier_sync(barrier, threads);
  copy_staged_rows<T>(p, u, h0, hb, rows, stage, ctid);
}
// Shared memory the staged rows of store_two_halves take (16-bit T: the wgmma bodies' query types).
constexpr int kStagedRowsBytes = kRowsPerTile * kStagedRowPitch<__half>;

// The latent part of S and all of P V multiply in MT (T, or fp16 with an fp8 cache: mla_fp8.cuh).
template <typename T, int HALF, int kCache>
__device__ __forceinline__ void wide_consumer(const Problem& p, const Unit& u, int h0, int hb, uint32_t base) {
  using W = WideSm90;
  using MT = LatentMmaType<T, kCache>;
  // The lazy max, the skipped rescales and the early A signal (see the top of this file) are
  // for 16-bit caches only: with an fp8 ckv they made this kernel's narrow body (the same
  // __global__, mla_attention_sm90_kernel<T, kCacheFp8Ckv>) 8-10% slower through the code ptxas
  // made of it (ffi/cuda/NOTES.md, "Lazy max"), more than they gave the fp8 wide body. With the
  // narrow body's fp8 in registers they still cost it 1-2% and gave the fp8 wide body 4% ("fp8 in
  // registers"): left off.
  constexpr bool kLazy = !CacheFormat<kCache>::kFp8Ckv;
  const int tid = threadIdx.x - 128 * (1 + HALF);
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int rows = u.q_len * hb;
  int r[2], limit[2];
  accumulator_rows(u, warp, g, rows, hb, r, limit);
  // Broadcast from lane 0: the compiler then knows the loop and `has_b` are
  // warp-uniform, which wgmma (issued inside them) needs to stay asynchronous.
  const int num_blocks = __shfl_sync(0xffffffffu, (u.range_end - u.kv_begin + W::BK - 1) / W::BK, 0);
  const uint32_t stats_addr = base + W::STATS_OFF;
  auto stat_ptr = [&](int which, int row) -> float* {
    return reinterpret_cast<float*>(__cvta_shared_to_generic(stats_addr + (which * W::ROWS + row) * 4));
  };

  mbar_wait(W::query_bar(base), 0);
  // The softmax scale in base 2 of each of the thread's rows (times an fp8 cache's s_c, and over
  // the power of two its queries were scaled by), and the output's factor.
  const CacheScales scales = cache_scales<kCache>(p);
  float scale_log2[2] = {p.scale_log2 * scales.score, p.scale_log2 * scales.score};
  if constexpr (CacheFormat<kCache>::kFp8Ckv) {
    wide_prepare_queries_fp8<T, HALF>(
        [&](int r, int c) { return base + W::Q_OFF + W::chunk_offset(r, c, W::QPANEL); },
        [] { named_barrier_sync(WideSm90::kConsumers, WideSm90::kConsumerThreads); }, warp, lane, scales.rope_query,
        scale_log2);
  }
  fence_proxy_async_shared();  // the query panels reach wgmma's reads
  if constexpr (CacheFormat<kCache>::kFp8Ckv) named_barrier_sync(W::kConsumers, W::kConsumerThreads);

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};

  // Software-pipelined over pairs: each consumer issues its next S right behind its PV of the
  // pair, so the tensor pipe has the next scores queued while the hand-offs run, and consumer 0's
  // softmax of the next block A overlaps its last PV. The loop is rotated so that no MMA is in
  // flight across its back edge, and every MMA group is issued on every trip (past the end they
  // recompute a finished block and are dropped): with one path through each wgmma pipeline
  // stage ptxas keeps the MMAs asynchronous (a branch around one makes it copy accumulators
  // inside the stage and serialise every wgmma of the kernel, C7515).
  uint32_t pa[kWideKSteps][4], pb[kWideKSteps][4];
  float s[W::SACC];
  float a_max[2], a_alpha[2], a_sum[2];  // consumer 0: block A's softmax, made one step ahead
  // Consumer 0's softmax of block A (scores in s) against the running max.
  auto softmax_a = [&](int stage_a, int key0) {
    fence_registers(s);
    wide_softmax<kLazy>(s, scale_log2, base, stage_a, key0, limit, t4, m_run, a_max, a_alpha, a_sum);
    // S and the mask are read: the rope panel and the right half go back. Every thread read
    // the key flags, so every thread's arrival publishes its reads (rope group).
    mbar_arrive(W::empty_bar(base, stage_a, W::kRope));
    if (lane == 0) mbar_arrive(W::empty_bar(base, stage_a, W::kRight));
  };
  if (num_blocks > 0) {
    if constexpr (HALF == 0) {
      wide_scores<T, MT, true>(s, base, 0, 0);
      wgmma_commit();
      wgmma_wait<0>();
      softmax_a(0, u.kv_begin);
    } else if (num_blocks > 1) {
      wide_scores<T, MT, false>(s, base, 1, 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(s);
    }
  }
#pragma unroll 1
  for (int pair = 0; 2 * pair < num_blocks; ++pair) {
    // Pair k uses stages 2 (k % 2) and 2 (k % 2) + 1, for the (k / 2)-th time.
    const int stage_a = 2 * (pair & 1), stage_b = stage_a + 1;
    const bool has_b = 2 * pair + 1 < num_blocks;
    const int parity = (pair >> 1) & 1, next_parity = ((pair + 1) >> 1) & 1;
    const int key0 = u.kv_begin + 2 * pair * W::BK;
    const uint32_t st_a = W::stage_addr(base, stage_a), st_b = W::stage_addr(base, stage_b);
    if constexpr (HALF == 0) {
      const bool has_next = 2 * pair + 2 < num_blocks;
      // ---- block A (softmax done a step ahead): signal, rescale, PV; the next S_A behind it ----
      // Block A's share of the row sums and of O's rescale (only consumer 0 needs them).
      auto account_a = [&]() {
#pragma unroll
        for (int e = 0; e < 2; ++e) l_run[e] = l_run[e] * a_alpha[e] + a_sum[e];
        wide_rescale<kLazy>(o, a_alpha);
      };
      if constexpr (!kLazy) account_a();
      wide_pack_p<MT>(s, pa);
      if (t4 == 0) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          *stat_ptr(W::kMaxA, r[e]) = a_max[e];
          *stat_ptr(W::kAlphaA, r[e]) = a_alpha[e];
        }
      }
      wide_store_p(base + W::PA_OFF, pa, warp, lane);
      mbar_arrive(W::a_ready_bar(base));
      // Consumer 1 needs only P_A and the statistics: with a 16-bit cache the rescale of O waits
      // until they are out.
      if constexpr (kLazy) account_a();
      wgmma_fence();
      wide_pv<MT, 0>(o, pa, st_a);
      wgmma_commit();
      // Issued on every trip (see above): past the last pair it recomputes this pair's block A,
      // whose phase has completed (no wait), and is dropped.
      wide_scores<T, MT, true>(s, base, has_next ? stage_a ^ 2 : stage_a, has_next ? next_parity : parity);
      wgmma_commit();
      // ---- block B's probabilities from consumer 1 ----
      mbar_wait(W::b_ready_bar(base), pair & 1);
      fence_proxy_async_shared();  // block B's left half landed for consumer 1; our wgmma reads it next
      float a_b[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        a_b[e] = *stat_ptr(W::kAlphaB, r[e]);
        m_run[e] = *stat_ptr(W::kMaxB, r[e]);
      }
      if (has_b) {
        wide_load_p(base + W::PB_OFF, pb, warp, lane);
      } else {
#pragma unroll
        for (int kk = 0; kk < kWideKSteps; ++kk) pb[kk][0] = pb[kk][1] = pb[kk][2] = pb[kk][3] = 0u;
      }
      wgmma_wait<1>();  // PV_A is done (the next S_A may still run)
      fence_registers(o);
      fence_fragments(pa);
      if (lane == 0) mbar_arrive(W::empty_bar(base, stage_a, W::kLeft));
      wide_rescale<kLazy>(o, a_b);
#pragma unroll
      for (int e = 0; e < 2; ++e) l_run[e] *= a_b[e];
      // Issued on every trip (see above): without a block B, P = 0 times block A's rows, which
      // adds 0 to O (or NaN where PV_A already made one: a non-finite row).
      wgmma_fence();
      wide_pv<MT, 0>(o, pb, has_b ? st_b : st_a);
      wgmma_commit();
      // ---- the next block A's softmax while PV_B runs ----
      wgmma_wait<1>();
      if (has_next) softmax_a(stage_a ^ 2, key0 + 2 * W::BK);
      wgmma_wait<0>();
      fence_registers(o);
      fence_fragments(pb);
      if (has_b && lane == 0) mbar_arrive(W::empty_bar(base, stage_b, W::kLeft));
    } else {
      // ---- block B (scores done a step ahead): softmax from m_A ----
      mbar_wait(W::a_ready_bar(base), pair & 1);
      fence_proxy_async_shared();  // block A's right half landed for consumer 0; our wgmma reads it next
      float m_a[2], a_a[2], m_b[2], a_b[2] = {1.f, 1.f};
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        m_a[e] = *stat_ptr(W::kMaxA, r[e]);
        a_a[e] = *stat_ptr(W::kAlphaA, r[e]);
        m_b[e] = m_a[e];
      }
      if (has_b) {
        float sum[2];
        wide_softmax<kLazy>(s, scale_log2, base, stage_b, key0 + W::BK, limit, t4, m_a, m_b, a_b, sum);
        // S_B and its mask are read: rope panel (every thread: each read flags) and left half go back
        mbar_arrive(W::empty_bar(base, stage_b, W::kRope));
        if (lane == 0) mbar_arrive(W::empty_bar(base, stage_b, W::kLeft));
#pragma unroll
        for (int e = 0; e < 2; ++e) l_run[e] = l_run[e] * a_a[e] * a_b[e] + sum[e];
        wide_pack_p<MT>(s, pb);
        wide_store_p(base + W::PB_OFF, pb, warp, lane);
      } else {
#pragma unroll
        for (int e = 0; e < 2; ++e) l_run[e] *= a_a[e];
      }
      if (t4 == 0) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          *stat_ptr(W::kMaxB, r[e]) = m_b[e];
          *stat_ptr(W::kAlphaB, r[e]) = a_b[e];
        }
      }
      wide_load_p(base + W::PA_OFF, pa, warp, lane);
      mbar_arrive(W::b_ready_bar(base));
      // P_A was made against m_A; this half of O now lives at m_B.
#pragma unroll
      for (int kk = 0; kk < kWideKSteps; ++kk) {
        pa[kk][0] = scale_pair<MT>(pa[kk][0], a_b[0]);
        pa[kk][1] = scale_pair<MT>(pa[kk][1], a_b[1]);
        pa[kk][2] = scale_pair<MT>(pa[kk][2], a_b[0]);
        pa[kk][3] = scale_pair<MT>(pa[kk][3], a_b[1]);
      }
      const float a_ab[2] = {a_a[0] * a_b[0], a_a[1] * a_b[1]};
      wide_rescale<kLazy>(o, a_ab);
      wgmma_fence();
      if (has_b) wide_pv<MT, 1>(o, pb, st_b);
      wide_pv<MT, 1>(o, pa, st_a);
      wgmma_commit();
      // The next pair's S_B goes in behind it; issued on every trip (see above): without a next
      // block B it recomputes this pair's block A, whose phase has completed, and is dropped.
      const bool next_b = 2 * pair + 3 < num_blocks;
      wide_scores<T, MT, false>(s, base, next_b ? stage_b ^ 2 : stage_a, next_b ? next_parity : parity);
      wgmma_commit();
      wgmma_wait<1>();
      fence_registers(o);
      fence_fragments(pa);
      if (has_b) fence_fragments(pb);
      if (lane == 0) {
        mbar_arrive(W::empty_bar(base, stage_a, W::kRight));
        if (has_b) mbar_arrive(W::empty_bar(base, stage_b, W::kRight));
      }
      wgmma_wait<0>();
      fence_registers(s);
#pragma unroll
      for (int e = 0; e < 2; ++e) m_run[e] = m_b[e];
    }
  }

  static_assert(kStagedRowsBytes <= W::STAGES * W::STAGE, "the staged rows fit in the key ring");
  store_two_halves<T, HALF>(p, u, h0, hb, rows, r, t4, l_run, m_run, o, scales.out,
                            [&](int half, int row) { return stat_ptr(W::kSum0 + half, row); }, W::kConsumers,
                            W::kConsumerThreads, base + W::KV_OFF, (int)threadIdx.x - 128);
}

}  // namespace cuda
}  // namespace jax_mla
