// The sm_90a kernel of the paged MLA op: units of more than 16 query rows
// (rows = tokens x heads of one request: 32-128 heads, or 16 heads x 2-4 tokens
// of MTP / speculative verify) take a warp-specialised body built on wgmma;
// units of at most 16 rows take the narrow body (mla_narrow_kernel.cuh) on the
// first two warpgroups.
//
// The wide body: one block = one work unit x 64 rows (padding rows are zero),
// three warpgroups.
//
//   * Producer (warpgroup 0, few registers): queries into nine 128-byte-swizzled
//     panels of 64 dims, then the unit's keys, 64 per block, into two stages
//     (A: even blocks, B: odd blocks; 72 KB each, all the room the queries leave).
//     A stage is nine panels with a "full" mbarrier each (S starts on the first
//     panel that lands while the others stream in) and two halves with an "empty"
//     mbarrier each: the left half (dims 0-255) and the right half (256-511); the
//     rope panel (dims 512-575, and the block's key-validity flags) travels with
//     the right half of stage A and the left half of stage B, for the reason below.
//     Each half is refilled as soon as its one reader releases it, so the next
//     pair's halves stream in while the current pair is still multiplied. Past the
//     first pair, a whole block on one valid page (pages of >= 64 keys) is refilled by
//     the releasing consumer itself (its thread 0 issues the TMA right after the
//     release: no hop through the producer, whose turn would come a pair of halves
//     later); the producer still waits for and arrives on every release, so the two
//     sides stay within one phase of each other. Whole blocks of valid
//     keys on pages of at least 16 keys come by TMA (cp.async.bulk.tensor, one box
//     of min(page size, 64) keys x 64 dims per panel and page, tensor maps made on
//     the host per launch, bytes counted on the barriers); the rest (page sizes
//     below 16, a unit's partial last block, bad page ids) is gathered through the
//     page table with 16-byte cp.async, unseen rows as zeros.
//   * Two consumers (warpgroups 1 and 2, most registers) split the output by
//     columns: consumer c keeps O[:, 256c : 256c + 256] in registers (128 floats
//     per thread). They take the blocks in pairs: consumer 0 computes S = Q K^T of
//     block A, consumer 1 of block B (wgmma m64n64k16, queries and keys from shared
//     memory: at 64 keys the MMA's time matches its operand reads, at 32 keys it
//     waited on shared memory, ffi/cuda/NOTES.md v5). Each then needs both blocks'
//     probabilities for its own columns, and each block's P goes to the other
//     consumer through the block's own rope panel, dead once its S is done (two
//     separate P buffers would not fit beside two 72 KB stages):
//
//       consumer 0: softmax A (max m_A); P_A -> rope panel A; signal A (m_A)
//                   O_L = a_A O_L + P_A V_A[:, left]              (P_A from registers)
//                   wait B; O_L = a_B O_L + P_B V_B[:, left]      (P_B from rope panel B)
//                   S of the next block A, the left half (released first) while that PV runs,
//                   then the right half and the rope panel
//       consumer 1: wait A; softmax B from m_A (max m_B); P_B -> rope panel B; signal B (m_B)
//                   O_R = a_A a_B O_R + (a_B P_A) V_A[:, right] + P_B V_B[:, right]
//                   S of the next block B, right half first
//
//     So every half of a stage has exactly one releasing reader: the left halves
//     consumer 0 (S_A and PV_A on A's; PV_B, which reads P_B from B's rope panel,
//     on B's), the right halves consumer 1. The signals are mbarriers (one phase
//     per pair, every thread of the sending consumer arrives), which also order
//     the reuse of the statistics one pair later. PV is wgmma m64n256k16 with P
//     from registers and V read straight from the stage (the latent rows,
//     MN-major). The running max is shared through shared memory, so both halves
//     of every row stay on one scale; the row sums are kept per consumer and added
//     in the epilogue.
//
// ffi/cuda/NOTES.md has what each version of this body measured.
//
// Split units write float32 partials for the merge kernel, as every body does.
#pragma once

#include <cuda.h>  // CUtensorMap (a type only: the encoder is reached through the runtime)

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
  static constexpr int BK = 64;                  // keys per block
  static constexpr int STAGES = 2;               // block A (even) and block B (odd) of a pair
  static constexpr int MIN_TMA_PAGE = 16;        // smallest page size loaded by TMA (boxes of min(ps, BK) keys)
  static constexpr int QPANEL = ROWS * 128;      // 64 query rows x 64 dims, 128-byte swizzle
  static constexpr int KPANEL = BK * 128;        // 64 keys x 64 dims
  static constexpr int STAGE = 9 * KPANEL;       // a key block: 8 latent panels + the rope panel
  static constexpr int ROPE_PANEL = 8;
  static constexpr int SACC = ROWS * BK / 128;   // S accumulators per thread
  // Shared memory (from a 1024-byte-aligned base): the nine query panels, the two
  // stages, the statistics. All of S = Q K^T reads the queries from shared memory,
  // which leaves the consumers' registers to O, S and the P fragments.
  static constexpr int Q_OFF = 0;
  static constexpr int KV_OFF = 9 * QPANEL;
  static constexpr int STATS_OFF = KV_OFF + STAGES * STAGE;  // float [6][64]: m_A, a_A, m_B, a_B, l(c=0), l(c=1)
  // Per stage: one byte per key (1: valid; 16-byte aligned, a TMA block writes them as
  // vectors), and four bytes, producer warp w's 0xff when all its keys of the block are
  // valid (all 0xff: no key is masked).
  static constexpr int KEY_OK_OFF = STATS_OFF + 6 * ROWS * 4;
  static constexpr int MASK_OFF = KEY_OK_OFF + STAGES * BK;
  static constexpr int BAR_OFF = MASK_OFF + STAGES * 4;
  // "full": one per panel of a stage (S starts on the first panel that lands while the rest
  // streams in); "empty": one per half of a stage; queries; A / B ready.
  static constexpr int NUM_BARS = STAGES * 9 + STAGES * 2 + 3;
  static constexpr int BYTES = BAR_OFF + NUM_BARS * 8;
  static constexpr int SMEM_BYTES = BYTES + 1024 - 16;  // room to align the base

  enum Half : int { kLeft = 0, kRight = 1 };  // released by consumer 0 / consumer 1
  enum Stat : int { kMaxA = 0, kAlphaA = 1, kMaxB = 2, kAlphaB = 3, kSum0 = 4, kSum1 = 5 };
  enum NamedBarrier : int { kConsumers = 1 };
  static constexpr int kConsumerThreads = 256;

  // The half that carries the rope panel (and, after S, the block's P for the other
  // consumer): the one the consumer that did not compute the block's S releases.
  static __device__ __forceinline__ int rope_half(int stage) { return stage == 0 ? kRight : kLeft; }
  static __device__ __forceinline__ uint32_t full_bar(uint32_t base, int stage, int panel) {
    return base + BAR_OFF + (stage * 9 + panel) * 8;
  }
  static __device__ __forceinline__ uint32_t empty_bar(uint32_t base, int stage, int half) {
    return base + BAR_OFF + (9 * STAGES + stage * 2 + half) * 8;
  }
  static __device__ __forceinline__ uint32_t query_bar(uint32_t base) { return base + BAR_OFF + 11 * STAGES * 8; }
  // Consumer 0 -> 1: m_A, a_A and P_A are in shared memory; consumer 1 -> 0: m_B,
  // a_B and P_B are. One phase per pair, all 128 threads arrive.
  static __device__ __forceinline__ uint32_t a_ready_bar(uint32_t base) { return query_bar(base) + 8; }
  static __device__ __forceinline__ uint32_t b_ready_bar(uint32_t base) { return query_bar(base) + 16; }
  static __device__ __forceinline__ uint32_t stage_addr(uint32_t base, int stage) {
    return base + KV_OFF + stage * STAGE;
  }
  // Byte offset of 16-byte chunk c (of 72: 64 latent + 8 rope) of row r in nine panels of `panel` bytes.
  static __device__ __forceinline__ uint32_t chunk_offset(int r, int c, int panel) {
    return (c >> 3) * panel + r * 128 + (((c & 7) ^ (r & 7)) << 4);
  }
  // Expected arrivals. full: one per producer thread, each after its own writes (its
  // cp.async gather has landed; the rope panel's also publish the key flags); with TMA
  // thread 0 makes all of them, beside the panel's bytes. Each writer arriving itself is
  // what lets racecheck see every write published. empty: the releasing consumer's,
  // one per warp, or one per thread on the half with the rope panel (its P was read by
  // every thread's ldmatrix; a lane-0 arrival would not publish the other lanes' reads),
  // and the producer's one (see wide_producer's load_half).
  static constexpr int kFullCount = 128;
  static __device__ __forceinline__ int empty_count(int stage, int half) {
    return (half == rope_half(stage) ? 128 : 4) + 1;
  }
  static_assert(SMEM_BYTES <= 227 * 1024, "one block per SM must fit");
  static_assert(STAGE % 1024 == 0 && KPANEL % 1024 == 0 && QPANEL % 1024 == 0, "swizzle atoms stay aligned");
  static_assert(KEY_OK_OFF % 16 == 0 && MASK_OFF % 4 == 0 && BAR_OFF % 8 == 0, "vector stores and mbarriers stay aligned");
  static_assert(SACC == 32 && BK == 64, "the P layout in a rope panel is one 128-byte row per query row");
};

// TMA descriptors of the two caches seen as 2-D tensors of rows (ckv [P * ps, 512],
// kpe [P * ps, 64]) with a box of min(ps, 64) rows x 64 dims in the 128-byte swizzle
// the stage panels use. Made on the host for every launch (mla_launch.cuh);
// `enabled` is 0 where they could not be made, or the page size is below
// WideSm90::MIN_TMA_PAGE.
struct KeyTensorMaps {
  CUtensorMap ckv;
  CUtensorMap kpe;
  int enabled;
};

// ---- key loads ------------------------------------------------------------------

// One thread: the TMA boxes of one half of a block of 64 valid keys (box b of `box` keys
// from cache row rows[b]) and, when the half carries it, the rope panel and the block's
// key flags (all valid); each panel's bytes and all its arrivals go on its "full" barrier.
__device__ __forceinline__ void wide_tma_half(const KeyTensorMaps& maps, uint32_t base, int stage, int half,
                                              const int (&rows)[4], int box) {
  using W = WideSm90;
  const uint32_t st = W::stage_addr(base, stage);
  const bool rope = half == W::rope_half(stage);
  const int panel0 = half == W::kLeft ? 0 : 4;  // dims 0-255 (left) or 256-511 (right)
  if (rope) {  // the flags say every key is valid before the rope panel's arrival publishes them
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(base + W::MASK_OFF + stage * 4), "r"(0xffffffffu) : "memory");
#pragma unroll
    for (int i = 0; i < W::BK / 16; ++i)
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(base + W::KEY_OK_OFF + stage * W::BK + 16 * i),
                   "r"(0x01010101u)
                   : "memory");
  }
#pragma unroll
  for (int i = 0; i < 5; ++i) {
    if (i == 4 && !rope) break;
    const int panel = i < 4 ? panel0 + i : W::ROPE_PANEL;
    const uint32_t full = W::full_bar(base, stage, panel);
    mbar_arrive_expect_tx(full, W::KPANEL);
    mbar_arrive_count(full, W::kFullCount - 1);
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      if (b * box >= W::BK) break;
      const uint32_t dst = st + panel * W::KPANEL + b * box * 128;
      if (i < 4) {
        tma_load_2d(dst, &maps.ckv, panel * 64, rows[b], full);
      } else {
        tma_load_2d(dst, &maps.kpe, 0, rows[b], full);
      }
    }
  }
}

// Whether the consumer that releases a half of block blk - 2 refills it with block blk
// itself, right after its last read (no hop through the producer warpgroup): blocks past
// the first pair whose 64 keys are valid and lie in one page (page size >= 64). `page` is
// the page of the block's first key. The producer skips these halves.
__device__ __forceinline__ bool wide_consumer_refills(const Problem& p, const KeyTensorMaps& maps, const Unit& u,
                                                      int blk, int page) {
  const int key_base = u.kv_begin + blk * WideSm90::BK;
  const int num_blocks = (u.range_end - u.kv_begin + WideSm90::BK - 1) / WideSm90::BK;
  return blk >= 2 && blk < num_blocks && maps.enabled && p.page_size >= WideSm90::BK &&
         (key_base & (WideSm90::BK - 1)) == 0 && key_base + WideSm90::BK <= u.range_end && page >= 0 &&
         page < p.num_pages;
}

// ---- producer -------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ void wide_producer(const Problem& p, const KeyTensorMaps& maps, const Unit& u, int h0,
                                              int hb, uint32_t base) {
  using W = WideSm90;
  const int tid = threadIdx.x;  // 0..127
  const int warp = tid >> 5, lane = tid & 31;
  const int rows = u.q_len * hb;
  const T* ckv = static_cast<const T*>(p.ckv);
  const T* kpe = static_cast<const T*>(p.kpe);

  // Queries: rows r = (token r / hb, head h0 + r % hb); padding rows zero.
  load_query_tile<T, W::ROWS, 128>(p, u, h0, hb, rows, tid,
                                   [&](int r, int c) { return base + W::Q_OFF + W::chunk_offset(r, c, W::QPANEL); });
  mbar_arrive_on_cp_async(W::query_bar(base));

  // Keys: warp w gathers the keys w, w + 4, ..., w + 60 of every block; lane l holds
  // the page id of key w + 4 (l & 15) (lanes 16-31 mirror 0-15), fetched a pair ahead.
  const int kv_begin = u.kv_begin;
  const int num_blocks = (u.range_end - kv_begin + W::BK - 1) / W::BK;
  const int* pt_row = p.page_table + (size_t)max(u.request, 0) * p.max_pages;
  const int key_in_block = warp + 4 * (lane & 15);
  auto page_of = [&](int blk) {
    const int key = kv_begin + blk * W::BK + key_in_block;
    return blk < num_blocks && key < u.range_end ? __ldg(pt_row + (key >> p.log2_page_size)) : -1;
  };
  // TMA boxes: min(page size, 64) keys, so a block is one to four boxes per panel.
  const int box = min(p.page_size, W::BK);
  // First cache row of box b of a block whose warp-0 lanes hold `page` (key b * box is
  // warp 0's key of lane b * box / 4); -1 for a page outside the cache.
  auto box_row = [&](int page, int key_base, int b) {
    const int pg = __shfl_sync(0xffffffffu, page, (b * box / 4) & 15);
    return pg >= 0 && pg < p.num_pages ? pg * p.page_size + ((key_base + b * box) & (p.page_size - 1)) : -1;
  };
  // One half of block `blk` into its stage (A: even blocks, B: odd ones), once its reader
  // has released it.
  auto load_half = [&](int blk, int page, int half) {
    const int stage = blk & 1, use = blk >> 1;  // a stage's k-th use is pair k
    const int key_base = kv_begin + blk * W::BK;
    const bool ok = key_base + key_in_block < u.range_end && page >= 0 && page < p.num_pages;
    const uint32_t ok_bits = __ballot_sync(0xffffffffu, ok) & 0xffffu;  // bit j: key w + 4j
    const uint32_t st = W::stage_addr(base, stage);
    const bool rope = half == W::rope_half(stage);
    // A block of 64 valid keys on pages of >= 16 keys, starting on a box boundary, is TMA
    // boxes issued by thread 0; the rest is gathered row by row. Uniform over the
    // warpgroup: every warp has keys on every page of the block (a box holds >= 4 of
    // each warp's keys), so all warps see all their keys valid or none does.
    const bool tma = maps.enabled && (key_base & (box - 1)) == 0 && key_base + W::BK <= u.range_end &&
                     ok_bits == 0xffffu;
    // Every use of a half waits for the previous one's release and then arrives itself (one
    // arrival of the five a use's release takes), loaded here or not: a phase cannot complete
    // without the producer, so neither side is ever two phases from the other, where a parity
    // wait would pass on the wrong phase (the producer skipping ahead to a unit's partial last
    // block would overwrite a stage in use).
    mbar_wait(W::empty_bar(base, stage, half), (use & 1) ^ 1);
    if (tid == 0) mbar_arrive(W::empty_bar(base, stage, half));
    // The consumers refill this half themselves (wide_consumer_refills: a TMA block past
    // the first pair on pages of >= 64 keys, where a box is the block and its one page is
    // valid). The same test, from what is at hand: the producer's registers are few.
    if (tma && blk >= 2 && p.page_size >= W::BK) return;
    // Four latent panels of 64 dims: dims 0-255 (left) or 256-511 (right).
    const int panel0 = half == W::kLeft ? 0 : 4;
    if (tma) {
      int rows[4];
#pragma unroll
      for (int b = 0; b < 4; ++b) rows[b] = box_row(page, key_base, b);
      if (tid == 0) wide_tma_half(maps, base, stage, half, rows, box);
      return;
    }
    if (rope) {
      if (lane == 0) {
        asm volatile("st.shared.u8 [%0], %1;\n" ::"r"(base + W::MASK_OFF + stage * 4 + warp),
                     "h"((unsigned short)(ok_bits == 0xffffu ? 0xff : 0))
                     : "memory");
      }
      if (lane < 16) {
        asm volatile("st.shared.u8 [%0], %1;\n" ::"r"(base + W::KEY_OK_OFF + stage * W::BK + key_in_block),
                     "h"((unsigned short)ok)
                     : "memory");
      }
    }
    // Row (slot) of the key that lane `j` of this warp describes; 0 when invalid (not read).
    auto slot_of = [&](int j) -> size_t {
      const int pg = __shfl_sync(0xffffffffu, page, j);
      const int key = key_base + warp + 4 * j;
      return ((ok_bits >> j) & 1) ? (size_t)pg * p.page_size + (key & (p.page_size - 1)) : 0;
    };
    const int c = panel0 * 8 + lane;  // one key's 512 bytes per warp instruction
#pragma unroll 4
    for (int j = 0; j < 16; ++j) {
      const int kl = warp + 4 * j;
      const size_t slot = slot_of(j);
      cp_async16(st + (c >> 3) * W::KPANEL + kl * 128 + (((c & 7) ^ (kl & 7)) << 4), ckv + slot * kDimCkv + c * 8,
                 ((ok_bits >> j) & 1) ? 16 : 0);
    }
    if (rope) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = 4 * i + (lane >> 3), cr = lane & 7, kl = warp + 4 * j;
        const size_t slot = slot_of(j);
        cp_async16(st + W::ROPE_PANEL * W::KPANEL + kl * 128 + ((cr ^ (kl & 7)) << 4), kpe + slot * kDimKpe + cr * 8,
                   ((ok_bits >> j) & 1) ? 16 : 0);
      }
    }
    // The thread's gather lands and becomes visible to wgmma's (async proxy) reads; its
    // arrivals publish it with its flags. These blocks are the rare ones: page sizes
    // below 16, a unit's partial last block, bad page ids.
    cp_async_wait_all();
    fence_proxy_async_shared();
#pragma unroll
    for (int i = 0; i < 4; ++i) mbar_arrive(W::full_bar(base, stage, panel0 + i));
    if (rope) mbar_arrive(W::full_bar(base, stage, W::ROPE_PANEL));
  };
  // Pair by pair, the halves in the order their readers release them: A's left (consumer
  // 0 after PV_A), A's right (consumer 1's first PV), B's right (its second), B's left
  // (consumer 0 after PV_B). (Measured: an L2 prefetch of the next pair cost 7%, and
  // consumer 1 doing PV_B first, for its own next S, cost 2%; ffi/cuda/NOTES.md, v6.)
  int page_a = page_of(0), page_b = page_of(1);
#pragma unroll 1
  for (int blk = 0; blk < num_blocks; blk += 2) {
    const int next_a = page_of(blk + 2), next_b = page_of(blk + 3);
    const bool has_b = blk + 1 < num_blocks;
    load_half(blk, page_a, W::kLeft);
    load_half(blk, page_a, W::kRight);
    if (has_b) load_half(blk + 1, page_b, W::kRight);
    if (has_b) load_half(blk + 1, page_b, W::kLeft);
    page_a = next_a;
    page_b = next_b;
  }
  cp_async_wait_all();  // leave nothing in flight behind an exited thread
}

// ---- consumer stages -------------------------------------------------------------

// One part of S = Q K^T for the block in `stage`: PART 0 is the half its producer
// fills first (block A: left, block B: right), PART 1 the other half with the rope
// panel. Async: the caller commits the group.
template <typename T, bool BLOCK_A, int PART>
__device__ __forceinline__ void wide_scores(float (&s)[WideSm90::SACC], uint32_t base, int stage, int parity) {
  using W = WideSm90;
  base = opaque(base);
  const uint32_t st = W::stage_addr(base, stage);
  const int half = (PART == 0) == BLOCK_A ? W::kLeft : W::kRight;
  if constexpr (PART == 1) {
    mbar_wait(W::full_bar(base, stage, W::ROPE_PANEL), parity);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_64x64_ss<T>(s, sw128_desc(base + W::Q_OFF + W::ROPE_PANEL * W::QPANEL + kk * 32),
                        sw128_desc(st + W::ROPE_PANEL * W::KPANEL + kk * 32), 1);
  }
  const int p0 = half == W::kLeft ? 0 : 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    mbar_wait(W::full_bar(base, stage, p0 + i), parity);
    wgmma_fence();  // after a wait loop ptxas wants the fence (C7519), so say it where it goes
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_64x64_ss<T>(s, sw128_desc(base + W::Q_OFF + (p0 + i) * W::QPANEL + kk * 32),
                        sw128_desc(st + (p0 + i) * W::KPANEL + kk * 32), PART == 1 || i > 0 || kk > 0);
  }
}

// Scales scores to base 2 and masks keys that are invalid or past the row's limit.
// The block's validity flags decide whether any key needs the per-key bytes.
__device__ __forceinline__ void wide_mask(float (&s)[WideSm90::SACC], float scale_log2, uint32_t base, int stage,
                                          int key0, const int (&limit)[2], int t4) {
  using W = WideSm90;
  const uint32_t ballot = *reinterpret_cast<const uint32_t*>(__cvta_shared_to_generic(base + W::MASK_OFF + stage * 4));
  const bool clean = ballot == 0xffffffffu && key0 + W::BK <= min(limit[0], limit[1]);
  if (clean) {
#pragma unroll
    for (int i = 0; i < W::SACC; ++i) s[i] *= scale_log2;
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
      s[4 * j + e] = vis ? s[4 * j + e] * scale_log2 : -INFINITY;
    }
  }
}

// Row maxima of the thread's two rows (a row's keys sit in four lanes).
__device__ __forceinline__ void wide_row_max(const float (&s)[WideSm90::SACC], float (&mx)[2]) {
  mx[0] = mx[1] = -INFINITY;
#pragma unroll
  for (int i = 0; i < WideSm90::SACC; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 1));
    mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 2));
  }
}

// P = 2^(S - m) in place, with the thread's partial row sums; m = -inf (nothing
// visible yet) counts as 0 so that masked scores give 0, never NaN.
__device__ __forceinline__ void wide_exp(float (&s)[WideSm90::SACC], const float (&m)[2], float (&sum)[2]) {
  const float mu[2] = {m[0] == -INFINITY ? 0.f : m[0], m[1] == -INFINITY ? 0.f : m[1]};
  sum[0] = sum[1] = 0.f;
#pragma unroll
  for (int i = 0; i < WideSm90::SACC; ++i) {
    s[i] = fast_exp2(s[i] - mu[(i >> 1) & 1]);
    sum[(i >> 1) & 1] += s[i];
  }
}
__device__ __forceinline__ float wide_alpha(float m_old, float m_new) {
  return fast_exp2(m_old - (m_new == -INFINITY ? 0.f : m_new));
}

// A block's softmax step, in place: mask and scale the scores, the rows' new max m_new
// (against the running max m_prev), alpha = the factor for what was accumulated against
// m_prev, P = 2^(S - m_new) and the thread's partial row sums of P.
__device__ __forceinline__ void wide_softmax(float (&s)[WideSm90::SACC], float scale_log2, uint32_t base, int stage,
                                             int key0, const int (&limit)[2], int t4, const float (&m_prev)[2],
                                             float (&m_new)[2], float (&alpha)[2], float (&sum)[2]) {
  wide_mask(s, scale_log2, base, stage, key0, limit, t4);
  float mx[2];
  wide_row_max(s, mx);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    m_new[e] = fmaxf(m_prev[e], mx[e]);
    alpha[e] = wide_alpha(m_prev[e], m_new[e]);
  }
  wide_exp(s, m_new, sum);
}

constexpr int kWideKSteps = WideSm90::BK / 16;  // k16 steps of P V per block

// The 64 x 64 probabilities as the A fragments of four k16 steps.
template <typename T>
__device__ __forceinline__ void wide_pack_p(const float (&s)[WideSm90::SACC], uint32_t (&pa)[kWideKSteps][4]) {
#pragma unroll
  for (int kk = 0; kk < kWideKSteps; ++kk) {
    pa[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
    pa[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
    pa[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
    pa[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
  }
}
// P fragments to / from a block's rope panel: 64 rows of 128 bytes (64 keys), chunk c
// of row r at c ^ (r & 7), as every panel: the eight rows of a store or ldmatrix phase
// fall in distinct banks.
__device__ __forceinline__ uint32_t wide_p_offset(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }
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
__device__ __forceinline__ uint32_t wide_p_panel(uint32_t base, int stage) {
  return WideSm90::stage_addr(base, stage) + WideSm90::ROPE_PANEL * WideSm90::KPANEL;
}

template <typename T>
__device__ __forceinline__ uint32_t scale_pair(uint32_t v, float a);
template <>
__device__ __forceinline__ uint32_t scale_pair<__nv_bfloat16>(uint32_t v, float a) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  return pack2<__nv_bfloat16>(f.x * a, f.y * a);
}
template <>
__device__ __forceinline__ uint32_t scale_pair<__half>(uint32_t v, float a) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&v));
  return pack2<__half>(f.x * a, f.y * a);
}

// O[:, 256 HALF : +256] += P V for the keys of `stage` (async, not committed).
template <typename T, int HALF>
__device__ __forceinline__ void wide_pv(float (&o)[128], const uint32_t (&pa)[kWideKSteps][4], uint32_t stage_addr) {
  using W = WideSm90;
  stage_addr = opaque(stage_addr);
#pragma unroll
  for (int kk = 0; kk < kWideKSteps; ++kk)
    wgmma_64x256_rs_mn<T>(o, pa[kk], sw128_mn_desc(stage_addr + HALF * 4 * W::KPANEL + kk * 2048, W::KPANEL), 1);
}

__device__ __forceinline__ void wide_rescale(float (&o)[128], const float (&a)[2]) {
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    o[4 * j + 0] *= a[0];
    o[4 * j + 1] *= a[0];
    o[4 * j + 2] *= a[1];
    o[4 * j + 3] *= a[1];
  }
}
template <int N>
__device__ __forceinline__ void zero_fragments(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) a[i][0] = a[i][1] = a[i][2] = a[i][3] = 0u;
}

// ---- consumers -------------------------------------------------------------------

template <typename T, int HALF>
__device__ __forceinline__ void wide_consumer(const Problem& p, const KeyTensorMaps& maps, const Unit& u, int h0,
                                              int hb, uint32_t base) {
  using W = WideSm90;
  const int tid = threadIdx.x - 128 * (1 + HALF);
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int rows = u.q_len * hb;
  const int r[2] = {16 * warp + g, 16 * warp + g + 8};
  int limit[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) limit[e] = r[e] < rows ? min(u.kv_stop, visible_keys(u, r[e] / hb)) : INT_MIN;
  // Broadcast from lane 0: the compiler then knows the loop and `has_b` are
  // warp-uniform, which wgmma (issued inside them) needs to stay asynchronous.
  const int num_blocks = __shfl_sync(0xffffffffu, (u.range_end - u.kv_begin + W::BK - 1) / W::BK, 0);
  const uint32_t stats_addr = base + W::STATS_OFF;
  auto stat_ptr = [&](int which, int row) -> float* {
    return reinterpret_cast<float*>(__cvta_shared_to_generic(stats_addr + (which * W::ROWS + row) * 4));
  };

  mbar_wait(W::query_bar(base), 0);
  fence_proxy_async_shared();  // the query panels reach wgmma's reads

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};

  // Each consumer computes its block's S at the end of a trip, for the next one. The
  // loop is rotated so that no MMA is in flight across its back edge, and every MMA
  // group is issued on every trip (past the end they recompute a block whose phase has
  // completed and are dropped; without a block B, P = 0 times block A's rows): with one
  // path through each wgmma pipeline stage ptxas keeps the MMAs asynchronous (a branch
  // around one makes it copy accumulators inside the stage and serialise every wgmma of
  // the kernel, C7515).
  uint32_t pa[kWideKSteps][4], pb[kWideKSteps][4];
  float s[W::SACC];
  float a_max[2], a_alpha[2], a_sum[2];  // consumer 0: block A's softmax, made one trip ahead
  // After this consumer released a half of block blk - 2 (its lane 0s arrived on the
  // "empty" barrier of use `use`): when the consumer refills it (wide_consumer_refills,
  // uniform over the warpgroup), every warp waits for the other warps' release (and the
  // producer's arrival, long made) and thread 0 issues block blk's TMA boxes. The page id is read here, not held through the pair
  // (registers): the producer read it a pair earlier, so it comes from L1.
  auto refill = [&](int blk, int half, int use) {
    const int key = u.kv_begin + blk * W::BK;
    if (blk >= num_blocks || p.page_size < W::BK) return;
    const int page = __ldg(p.page_table + (size_t)max(u.request, 0) * p.max_pages + (key >> p.log2_page_size));
    if (!wide_consumer_refills(p, maps, u, blk, page)) return;
    const int stage = blk & 1;
    mbar_wait(W::empty_bar(base, stage, half), use & 1);
    if (tid == 0) {
      const int rows[4] = {page * p.page_size + ((u.kv_begin + blk * W::BK) & (p.page_size - 1)), 0, 0, 0};
      wide_tma_half(maps, base, stage, half, rows, W::BK);
    }
    __syncwarp();
  };
  auto softmax_a = [&](int key0) {
    fence_registers(s);
    wide_softmax(s, p.scale_log2, base, 0, key0, limit, t4, m_run, a_max, a_alpha, a_sum);
  };
  if (num_blocks > 0) {
    if constexpr (HALF == 0) {
      wide_scores<T, true, 0>(s, base, 0, 0);
      wide_scores<T, true, 1>(s, base, 0, 0);
      wgmma_commit();
      wgmma_wait<0>();
      softmax_a(u.kv_begin);
    } else if (num_blocks > 1) {
      wide_scores<T, false, 0>(s, base, 1, 0);
      wide_scores<T, false, 1>(s, base, 1, 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(s);
    }
  }
#pragma unroll 1
  for (int pair = 0; 2 * pair < num_blocks; ++pair) {
    // Pair k is stage 0's and stage 1's k-th use.
    const bool has_b = 2 * pair + 1 < num_blocks;
    const int parity = pair & 1, next_parity = parity ^ 1;
    const int key0 = u.kv_begin + 2 * pair * W::BK;
    const uint32_t st_a = W::stage_addr(base, 0), st_b = W::stage_addr(base, 1);
    if constexpr (HALF == 0) {
      const bool has_next = 2 * pair + 2 < num_blocks;
      // ---- block A (softmax done a trip ahead): P_A to its rope panel, signal, PV ----
#pragma unroll
      for (int e = 0; e < 2; ++e) l_run[e] = l_run[e] * a_alpha[e] + a_sum[e];
      wide_rescale(o, a_alpha);
      wide_pack_p<T>(s, pa);
      if (t4 == 0) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          *stat_ptr(W::kMaxA, r[e]) = a_max[e];
          *stat_ptr(W::kAlphaA, r[e]) = a_alpha[e];
        }
      }
      wide_store_p(wide_p_panel(base, 0), pa, warp, lane);
      fence_proxy_async_shared();  // the rope panel is TMA's to refill after consumer 1 reads P_A
      mbar_arrive(W::a_ready_bar(base));
      wgmma_fence();
      wide_pv<T, 0>(o, pa, st_a);
      wgmma_commit();
      // PV_A ends (while consumer 1 does its softmax) before the wait for block B, so that
      // block A's left half goes back, and the next block A starts to stream in, at once.
      wgmma_wait<0>();
      fence_registers(o);
      fence_fragments(pa);
      if (lane == 0) mbar_arrive(W::empty_bar(base, 0, W::kLeft));
      refill(2 * pair + 2, W::kLeft, pair);
      // ---- block B's probabilities from consumer 1 ----
      mbar_wait(W::b_ready_bar(base), parity);
      float a_b[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        a_b[e] = *stat_ptr(W::kAlphaB, r[e]);
        m_run[e] = *stat_ptr(W::kMaxB, r[e]);
      }
      if (has_b) {
        wide_load_p(wide_p_panel(base, 1), pb, warp, lane);
      } else {
        zero_fragments(pb);
      }
      wide_rescale(o, a_b);
#pragma unroll
      for (int e = 0; e < 2; ++e) l_run[e] *= a_b[e];
      wgmma_fence();
      wide_pv<T, 0>(o, pb, has_b ? st_b : st_a);
      wgmma_commit();
      // ---- the next block A's S while PV_B runs: its left half first (released above) ----
      // Past the last block it recomputes this block A, whose phase has completed.
      const int s_parity = has_next ? next_parity : parity;
      wide_scores<T, true, 0>(s, base, 0, s_parity);
      wgmma_commit();
      wgmma_wait<1>();  // PV_B is done: block B's left half (and P_B in its rope panel) goes back
      fence_registers(o);
      fence_fragments(pb);
      if (has_b) mbar_arrive(W::empty_bar(base, 1, W::kLeft));  // the rope half: P_B was read here
      refill(2 * pair + 3, W::kLeft, pair);
      wide_scores<T, true, 1>(s, base, 0, s_parity);
      wgmma_commit();
      wgmma_wait<0>();
      if (has_next) softmax_a(key0 + 2 * W::BK);
    } else {
      // ---- block B (scores done a trip ahead): softmax from m_A ----
      mbar_wait(W::a_ready_bar(base), parity);
      float m_a[2], a_a[2], m_b[2], a_b[2] = {1.f, 1.f};
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        m_a[e] = *stat_ptr(W::kMaxA, r[e]);
        a_a[e] = *stat_ptr(W::kAlphaA, r[e]);
        m_b[e] = m_a[e];
      }
      if (has_b) {
        float sum[2];
        wide_softmax(s, p.scale_log2, base, 1, key0 + W::BK, limit, t4, m_a, m_b, a_b, sum);
#pragma unroll
        for (int e = 0; e < 2; ++e) l_run[e] = l_run[e] * a_a[e] * a_b[e] + sum[e];
        wide_pack_p<T>(s, pb);
        wide_store_p(wide_p_panel(base, 1), pb, warp, lane);
        fence_proxy_async_shared();  // the rope panel is TMA's to refill after consumer 0 reads P_B
      } else {
#pragma unroll
        for (int e = 0; e < 2; ++e) l_run[e] *= a_a[e];
        zero_fragments(pb);
      }
      if (t4 == 0) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          *stat_ptr(W::kMaxB, r[e]) = m_b[e];
          *stat_ptr(W::kAlphaB, r[e]) = a_b[e];
        }
      }
      wide_load_p(wide_p_panel(base, 0), pa, warp, lane);
      mbar_arrive(W::b_ready_bar(base));
      // P_A was made against m_A; this half of O now lives at m_B.
#pragma unroll
      for (int kk = 0; kk < kWideKSteps; ++kk) {
        pa[kk][0] = scale_pair<T>(pa[kk][0], a_b[0]);
        pa[kk][1] = scale_pair<T>(pa[kk][1], a_b[1]);
        pa[kk][2] = scale_pair<T>(pa[kk][2], a_b[0]);
        pa[kk][3] = scale_pair<T>(pa[kk][3], a_b[1]);
      }
      const float a_ab[2] = {a_a[0] * a_b[0], a_a[1] * a_b[1]};
      wide_rescale(o, a_ab);
      // PV_B first: block B's right half is what this consumer's next S starts on, so it
      // goes back (and streams in again) while PV_A runs.
      // PV_A first: block A's right half (with P_A) is what consumer 0's next S waits for.
      wgmma_fence();
      wide_pv<T, 1>(o, pa, st_a);
      wgmma_commit();
      wide_pv<T, 1>(o, pb, has_b ? st_b : st_a);
      wgmma_commit();
      wgmma_wait<1>();
      fence_fragments(pa);
      mbar_arrive(W::empty_bar(base, 0, W::kRight));  // the rope half: P_A was read here
      refill(2 * pair + 2, W::kRight, pair);
      wgmma_wait<0>();
      fence_registers(o);
      fence_fragments(pb);
      if (has_b && lane == 0) mbar_arrive(W::empty_bar(base, 1, W::kRight));
      refill(2 * pair + 3, W::kRight, pair);
      // The next block B's S, right half first. Past the last block B it recomputes this
      // pair's block B (not refilled again), or without one block A (nothing is refilled).
      const bool next_b = 2 * pair + 3 < num_blocks;
      const int s_stage = next_b || has_b ? 1 : 0;
      const int s_parity = next_b ? next_parity : parity;
      wide_scores<T, false, 0>(s, base, s_stage, s_parity);
      wide_scores<T, false, 1>(s, base, s_stage, s_parity);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(s);
#pragma unroll
      for (int e = 0; e < 2; ++e) m_run[e] = m_b[e];
    }
  }

  // ---- epilogue: both halves' row sums, normalise, store ----
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float l = l_run[e];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (t4 == 0) *stat_ptr(W::kSum0 + HALF, r[e]) = l;
  }
  named_barrier_sync(W::kConsumers, W::kConsumerThreads);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (r[e] >= rows) continue;
    const float l = *stat_ptr(W::kSum0, r[e]) + *stat_ptr(W::kSum1, r[e]);
    store_tile_row<T, 32>(p, u, h0, hb, r[e], HALF * 256 + 2 * t4, l, m_run[e], 1.f, HALF == 0 && t4 == 0,
                          [&](int j) { return make_float2(o[4 * j + 2 * e], o[4 * j + 2 * e + 1]); });
  }
}


// ---- the kernel ----------------------------------------------------------------------

// Room for the wgmma body and for the two bodies it hands units to (narrow; portable wide, fp8 caches).
constexpr int kSm90SmemBytes = cmax(WideSm90::SMEM_BYTES, kAttentionSmemBytes);
static_assert(kSm90SmemBytes <= 227 * 1024, "one block per SM must fit");

// grid.x = W * head_blocks (head blocks of one unit are neighbours: the second
// finds the keys in L2); 384 threads. The register cap of 168 at entry is what
// lets the warpgroups move registers between them (setmaxnreg).
template <typename T, int kCache = kCacheAsQuery>
__global__ void __launch_bounds__(WideSm90::kThreads, 1) mla_attention_sm90_kernel(const Problem p, const __grid_constant__ KeyTensorMaps maps) {
  extern __shared__ __align__(16) char smem[];  // aligned to 1024 below
  allow_dependent_launch();  // the merge kernel may be scheduled as blocks retire
  const int unit_index = blockIdx.x / p.head_blocks;
  const int head_block = blockIdx.x - unit_index * p.head_blocks;
  Unit u;
  if (!start_unit(p, unit_index, u)) return;  // padding unit (or unusable row)
  const int h0 = head_block * kRowsPerTile;
  const int hb = min(kRowsPerTile, p.num_heads - h0);
  const int rows = u.q_len * hb;
  if (rows > kRowsPerTile) return;  // cannot happen with q_len <= q_tile; keeps tiles in bounds
  // The narrow body (and, for an fp8 cache, the portable wide body: the wgmma body reads keys as
  // the queries' type only) are two warpgroups; the third hands them its registers (the bodies want
  // more than the 168 a thread gets at entry) and leaves.
  if (rows <= 16 || kCache != kCacheAsQuery) {
    if (__shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0) == 2) {
      release_registers<24>();
      return;
    }
    claim_registers<232>();
    if (rows <= 16) {
      attend_unit_narrow<T, NarrowShape64x3, kCache>(p, u, h0, hb, smem);
    } else {
      finish_unit(p, u);
      attend_unit_wide_portable<T, kCache>(p, u, h0, hb, smem);
    }
    return;
  }
#ifdef JAX_MLA_HAS_WGMMA
  if constexpr (kCache == kCacheAsQuery) {
    using W = WideSm90;
    uint32_t base = smem_addr(smem);
    base += (1024 - (base & 1023)) & 1023;
    finish_unit(p, u);
    if (threadIdx.x == 0) {
      for (int s = 0; s < W::STAGES; ++s)
      {
        for (int i = 0; i < 9; ++i) mbar_init(W::full_bar(base, s, i), W::kFullCount);
        for (int h = 0; h < 2; ++h) mbar_init(W::empty_bar(base, s, h), W::empty_count(s, h));
      }
      mbar_init(W::query_bar(base), 128);
      mbar_init(W::a_ready_bar(base), 128);
      mbar_init(W::b_ready_bar(base), 128);
      mbar_init_fence();
    }
    __syncthreads();
    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);  // warp-uniform, as wgmma needs
    if (wg == 0) {
      release_registers<40>();
      wide_producer<T>(p, maps, u, h0, hb, base);
    } else {
      claim_registers<232>();
      if (wg == 1) {
        wide_consumer<T, 0>(p, maps, u, h0, hb, base);
      } else {
        wide_consumer<T, 1>(p, maps, u, h0, hb, base);
      }
    }
  }
#endif
}

}  // namespace cuda
}  // namespace jax_mla
