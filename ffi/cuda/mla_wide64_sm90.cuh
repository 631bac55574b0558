// The wide body of 64-key blocks: two warpgroups, no producer (ffi/cuda/NOTES.md, "v8", "v8f", "fp8
// on the 64-key body", "the 64-key body on small pages"), launched for a 16-bit cache at every head
// count and page size (blocks by TMA on pages of 32+ keys, else gathered, kGather: as TMA boxes of one
// page on pages of 8-16 keys, by cp.async on smaller ones, issued above 16 heads by a third, producer
// warpgroup, kProducer) and for
// an fp8 ckv with a 16-bit kpe at 64 heads or more on pages of 32+ keys (mla_launch.cuh).
// mla_wide_sm90.cuh's body (v5b) keeps the rest: an fp8 ckv below 64 heads or on smaller pages; an fp8
// kpe, and a unit start off a box boundary in a TMA launch, take the portable body.
//
// One block = one work unit x 64 rows (padding rows zero). Shared memory holds the latent
// queries (eight 128-byte-swizzled panels of 64 dims), two key buffers of one 64-key block each
// (nine 8 KB tiles: eight latent panels and the rope panel, each with its own "full" mbarrier),
// P of each warpgroup's block, and the rows' maxima. The queries' rope panel lives in registers
// (the A operand of the rope k-steps), which is what leaves room for the second P buffer.
//
// Blocks go in pairs: block A (even) in buffer 0, block B (odd) in buffer 1. Warpgroup w computes
// S of its block (A: w = 0, B: w = 1) and its softmax, and keeps O[:, 256 w : 256 w + 256]:
//
//   WG0: softmax A against the running max (m_A) ........ m_A to shared; signal m_A
//        O_L += P_A V_A[:, left]       (P_A from registers)
//        refill buffer 0's tiles 0-3 with block A + 2 (the last reader is done)
//        wait m_B; P_A in m_B's frame to shared; signal P_A
//        wait P_B; O_L = O_L 2^(m_A - m_B) + P_B V_B[:, left]   (P_B from shared memory)
//        S of block A + 2 (tiles 0-3 first: refilled first); refill buffer 1's tiles 0-3
//   WG1: wait m_A; softmax B against m_A (m_B); signal m_B; P_B to shared; signal P_B
//        O_R = O_R 2^(m_prev - m_B) + P_B V_B[:, right]    (P_B from registers)
//        wait P_A; O_R += P_A V_A[:, right]   (issued behind the first: no wait between them)
//        refill buffer 1's tiles 4-8 with block B + 2, then buffer 0's with block A + 2
//        S of block B + 2 (tiles 4-8 first)
//
// That is FlashMLA's hand-off order: WG0 hands P_A over already in the frame of m_B, so WG1's two
// PVs run back to back, and block B + 2's tiles 4-8 go in while the second still runs.
// Every refill is issued by the warpgroup that reads the tiles last, right after its wgmma wait:
// no producer wake-up sits between a free tile and its next load (NOTES.md, v7). A refill is one
// TMA box per tile on pages of 64 keys or more, else one of 32 keys per tile half; a box on a bad
// page id reads rows outside the tensor, which TMA fills with zeros, and its keys are masked. A
// unit's partial last block is read whole (its page holds the rows) and its V rows past the range
// are zeroed before the PVs (their P is 0, but 0 times a NaN is NaN). The lazy max and the skipped
// rescales are v5b's.
//
// Split units write float32 partials for the merge kernel, as every body does.
#pragma once

#include "mla_wide_sm90.cuh"

namespace jax_mla {
namespace cuda {

struct Wide64Sm90 {
  static constexpr int kThreads = 256;  // two warpgroups
  // Gathered blocks (kGather: cp.async on pages under 8 keys, boxes of one page on pages of 8-16) from a
  // third warpgroup (kProducer: the consumers 232 registers a thread, the producer 40; mla_launch.cuh).
  static constexpr int kProducerThreads = 384;
  // The P_A V_A-under-softmax-B schedule (NOTES.md, "fifty-third" to "fifty-fifth session"), read by the
  // consumers (16-bit caches only) and by the TMA producer, which frees halves in its order.
  // -DJAX_MLA_WIDE64_NO_PA_FIRST: the schedule before it, P_A V_A after softmax B (an A/B switch).
#ifdef JAX_MLA_WIDE64_NO_PA_FIRST
  static constexpr bool kPaFirstSchedule = false;
#else
  static constexpr bool kPaFirstSchedule = true;
#endif
  static constexpr int ROWS = 64;
  static constexpr int BK = 64;                 // keys per block
  static constexpr int TILE = BK * 128;         // 64 keys x 64 dims, 128-byte swizzle
  static constexpr int QPANEL = ROWS * 128;     // 64 query rows x 64 dims
  static constexpr int TILES = 9;               // eight latent panels + the rope panel
  static constexpr int ROPE_TILE = 8;
  static constexpr int BUF = TILES * TILE;
  static constexpr int BOX = WideSm90::BK;      // keys per TMA box (the tensor maps' box: 32 rows)
  // The fewest keys a box of one page may hold in the gathering instance: it then lands at a multiple
  // of 1024 bytes of its tile, where the 128-byte swizzle is the whole block's.
  static constexpr int MIN_PAGE_BOX = 1024 / 128;
  static constexpr int SACC = ROWS * BK / 128;  // S accumulators per thread
  static constexpr int KSTEPS = BK / 16;        // k16 steps of P V per block
  static constexpr int Q_OFF = 0;
  static constexpr int K_OFF = 8 * QPANEL;
  static constexpr int P0_OFF = K_OFF + 2 * BUF;
  static constexpr int P1_OFF = P0_OFF + ROWS * 128;  // also the queries' rope panel until both warpgroups hold it
  static constexpr int STATS_OFF = P1_OFF + ROWS * 128;  // float [4][64]: m_A, m_B, l (WG0), l (WG1)
  // u32 per buffer and use parity: bit k = box k's keys are usable. Two per buffer, so that the
  // mask of a buffer's next block is written while its readers may still read the current one.
  static constexpr int MASK_OFF = STATS_OFF + 4 * ROWS * 4;
  static constexpr int BAR_OFF = MASK_OFF + 4 * 4;
  // full x buffer x tile; m_A, m_B, P_A, P_B ready; an fp8 cache's "half free" x buffer; the gathering
  // producer's "half empty" x buffer x half
  static constexpr int NUM_BARS = 2 * TILES + 4 + 2 + 4;
  // Gathered blocks (kGather): u64 per buffer and use parity, bit k = key k is usable (a page id per
  // key on pages of one key, so the boxes' two bits do not serve).
  static constexpr int KEYMASK_OFF = BAR_OFF + NUM_BARS * 8;
  static constexpr int BYTES = KEYMASK_OFF + 4 * 8;
  static constexpr int SMEM_BYTES = BYTES + 1024 - 16;  // room to align the base

  enum Stat : int { kMaxA = 0, kMaxB = 1, kSum0 = 2, kSum1 = 3 };
  enum NamedBarrier : int { kBoth = 1, kWarpgroup0 = 2 };  // kWarpgroup0 + w: warpgroup w alone

  static __device__ __forceinline__ uint32_t full_bar(uint32_t base, int buf, int tile) {
    return base + BAR_OFF + (buf * TILES + tile) * 8;
  }
  // The hand-offs between the warpgroups, one phase per pair: WG0 -> WG1, m_A is in shared memory;
  // WG1 -> WG0, m_B is; WG0 -> WG1, P_A (in m_A's frame; in m_B's with -DJAX_MLA_WIDE64_NO_PA_FIRST) is in P0;
  // WG1 -> WG0, P_B is in P1 (with PA_FIRST: P_B is in P1 by m_B's hand-off, and this one goes unused).
  enum Handoff : int { kAReady = 0, kBReady = 1, kP0Ready = 2, kP1Ready = 3 };
  static __device__ __forceinline__ uint32_t handoff_bar(uint32_t base, int h) {
    return base + BAR_OFF + (2 * TILES + h) * 8;
  }
  // fp8 cache: the other warpgroup is done reading the half of buffer `buf` that the raw bytes do
  // not occupy (wide64_convert_block), one phase per pair; 128 arrivals.
  static __device__ __forceinline__ uint32_t free_bar(uint32_t base, int buf) {
    return base + BAR_OFF + (2 * TILES + 4 + buf) * 8;
  }
  // Gathered blocks with a producer warpgroup (kProducer): half `half` of buffer `buf` (tiles 0-3, or
  // 4-8 with the rope tile) has been read by the warpgroup that reads it last, one phase per use; 128 arrivals.
  static __device__ __forceinline__ uint32_t empty_bar(uint32_t base, int buf, int half) {
    return base + BAR_OFF + (2 * TILES + 4 + 2 + 2 * buf + half) * 8;
  }
  // The walk's query tile (mla_wide64_walk_sm90.cuh; 16-bit caches only): its TMA boxes complete on the
  // slot of an fp8 cache's free_bar(0), which a 16-bit cache does not use.
  static __device__ __forceinline__ uint32_t query_bar(uint32_t base) { return free_bar(base, 0); }
  // fp8 cache: the first tile of a buffer's raw e4m3 block (raw panel p, dims 128 p .. 128 p + 127,
  // in tile RAW0 + p): the half its next block's S warpgroup frees first. Buffer 0 (blocks A):
  // tiles 0-3 (WG0's P V from registers reads them, first of the four); buffer 1 (blocks B): tiles 4-7
  // (WG1's, likewise).
  static __device__ __forceinline__ constexpr int raw_tile0(int buf) { return buf == 0 ? 0 : 4; }
  static __device__ __forceinline__ uint32_t buf_addr(uint32_t base, int buf) { return base + K_OFF + buf * BUF; }
  // Stat `which` (Stat) of tile row `row`.
  static __device__ __forceinline__ float* stat(uint32_t base, int which, int row) {
    return reinterpret_cast<float*>(__cvta_shared_to_generic(base + STATS_OFF + (which * ROWS + row) * 4));
  }
  // Block n lives in buffer n % 2 for the (n / 2)-th time: its mask slot (buffer, use parity).
  static __device__ __forceinline__ constexpr int mask_slot(int blk) { return (blk & 1) * 2 + ((blk >> 1) & 1); }
  static __device__ __forceinline__ uint32_t mask_addr(uint32_t base, int blk) {
    return base + MASK_OFF + mask_slot(blk) * 4;
  }
  static __device__ __forceinline__ uint32_t keymask_addr(uint32_t base, int blk) {
    return base + KEYMASK_OFF + mask_slot(blk) * 8;
  }
  static_assert(SMEM_BYTES <= 227 * 1024, "one block per SM must fit");
  static_assert(TILE % 1024 == 0 && QPANEL % 1024 == 0 && K_OFF % 1024 == 0 && P0_OFF % 1024 == 0,
                "swizzle atoms stay aligned");
  static_assert(BAR_OFF % 8 == 0 && KEYMASK_OFF % 8 == 0, "mbarriers and key masks are 8-byte aligned");
};

// Hand-off h, an mbarrier: all 128 threads of the sender signal, all 128 of the receiver wait
// (parity: the pair's). Named barriers instead (the sender arriving without waiting) were no
// faster, and racecheck does not see the ordering they give (NOTES.md, "v8f").
__device__ __forceinline__ void handoff_signal(int h, uint32_t base) { mbar_arrive(Wide64Sm90::handoff_bar(base, h)); }
__device__ __forceinline__ void handoff_wait(int h, uint32_t base, int parity) {
  mbar_wait(Wide64Sm90::handoff_bar(base, h), parity);
}

// The cache rows of a block's TMA boxes and which of them hold usable keys. On pages of 64 keys
// or more the maps' box is the whole block (maps.box_rows == 64: one box, row[0]); otherwise two
// boxes of 32 keys, and a second box wholly past the unit's range reads the first box's rows again
// (its keys are past every row limit, its V rows are zeroed). A box on a page id outside the cache
// reads rows before the tensor, which TMA fills with zeros, and its bits mask its keys. Needs a
// box-aligned block start (wide64_takes): each box lies in one page. The first box always starts in
// range.
struct Wide64Rows {
  int row[2];
  uint32_t ok;  // bit k: keys 32k .. 32k + 31 are usable
};
// The page ids of a block's boxes (the second box's only where it has its own), raw.
struct Wide64Pages {
  int page[2];
};
__device__ __forceinline__ Wide64Pages wide64_block_pages(const Problem& p, const KeyTensorMaps& maps, const Unit& u,
                                                          int blk) {
  using W = Wide64Sm90;
  const int* pt_row = page_table_row(p, u);
  const int key0 = u.kv_begin + blk * W::BK, key1 = key0 + W::BOX;
  Wide64Pages g;
  g.page[0] = __ldg(pt_row + (key0 >> p.log2_page_size));
  // Not g.page[0] where there is no second box (wide64_block_rows does not read it then): a copy
  // of the loaded value made the thread wait for the load right here.
  g.page[1] = maps.box_rows != W::BK && key1 < u.range_end ? __ldg(pt_row + (key1 >> p.log2_page_size)) : 0;
  return g;
}
__device__ __forceinline__ Wide64Rows wide64_block_rows(const Problem& p, const KeyTensorMaps& maps, const Unit& u,
                                                        int blk, const Wide64Pages& g) {
  using W = Wide64Sm90;
  const bool one_box = maps.box_rows == W::BK;
  Wide64Rows b;
  b.ok = 0;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int key = u.kv_begin + blk * W::BK + k * W::BOX;
    if (k == 1 && (one_box || key >= u.range_end)) {  // box 0's rows again
      b.row[1] = b.row[0];
      if (one_box) b.ok |= b.ok << 1;
      break;
    }
    const int page = g.page[k];
    const bool ok = page_in_cache(p, page);
    b.row[k] = tma_box_row(ok, page, key, p.page_size, maps.box_rows);
    b.ok |= (uint32_t)ok << k;
  }
  return b;
}

// Tile t of buffer `buf` from columns [col, col + 128 bytes) of `map` at the block's rows: one box
// (or two of 32 keys), completion counted in bytes on the tile's barrier. The first box is loaded L2
// evict-first: the keys are read by this block and by its neighbour (the unit's other head block) at
// about the same time, then never again; 0.3% (64 x 8192 x 128 heads) to 4.5% (1 x 32768) faster than
// the default policy (NOTES.md, "third session"; the second box of pages of 32 keys was not measured
// so). One thread issues it.
__device__ __forceinline__ void wide64_load_tile(const KeyTensorMaps& maps, uint32_t base, int buf, int t,
                                                 const void* map, int col, const Wide64Rows& b) {
  using W = Wide64Sm90;
  const uint32_t dst = W::buf_addr(base, buf) + t * W::TILE, bar = W::full_bar(base, buf, t);
  mbar_arrive_expect_tx(bar, W::TILE);
  tma_load_2d_hint(dst, map, col, b.row[0], bar, l2_evict_first_policy());
  if (maps.box_rows != W::BK) tma_load_2d(dst + W::TILE / 2, map, col, b.row[1], bar);
}

// Where tile t of a 16-bit cache's block comes from: latent tile t is ckv's dims 64 t .. 64 t + 63, the
// rope tile kpe's 64 dims (for the whole-block boxes and the boxes of one page alike).
struct Wide64TileSource {
  const void* map;
  int col;
};
__device__ __forceinline__ Wide64TileSource wide64_tile_source(const KeyTensorMaps& maps, int t) {
  return t == Wide64Sm90::ROPE_TILE ? Wide64TileSource{&maps.kpe, 0} : Wide64TileSource{&maps.ckv, 64 * t};
}

// Tiles [T0, T1) of a block into buffer `buf`, each in its final place (16-bit latent panels of 64
// dims, the rope tile).
template <int T0, int T1>
__device__ __forceinline__ void wide64_load_tiles(const KeyTensorMaps& maps, uint32_t base, int buf,
                                                  const Wide64Rows& b) {
#pragma unroll
  for (int t = T0; t < T1; ++t) {
    const Wide64TileSource src = wide64_tile_source(maps, t);
    wide64_load_tile(maps, base, buf, t, src.map, src.col, b);
  }
}

// fp8 cache: a block's raw e4m3 latent (four panels of 64 keys x 128 bytes, the fp8 map's boxes,
// 128-byte swizzle) into tiles raw_tile0(buf) .. + 3 of buffer `buf` (the rope tile goes by
// wide64_load_tiles<8, 9>).
__device__ __forceinline__ void wide64_load_raw(const KeyTensorMaps& maps, uint32_t base, int buf,
                                                const Wide64Rows& b) {
  using W = Wide64Sm90;
#pragma unroll
  for (int q = 0; q < 4; ++q) wide64_load_tile(maps, base, buf, W::raw_tile0(buf) + q, &maps.ckv, 128 * q, b);
}

// ---- gathered blocks (kGather: a 16-bit cache on pages of fewer than 32 keys) ----
// No TMA box fits in such a page, so each block comes by cp.async, 16 bytes a copy, into the same
// tiles the boxes fill, issued by a producer warpgroup (kProducer: wide64_gather_producer, at more than 16
// heads) or by the warpgroup that would have issued the boxes (every thread instead of one; the refill
// points and the order are the TMA path's). Warp w of the warpgroup takes
// keys 16 w .. 16 w + 15 of the block, lane j < 16 holding key 16 w + j's page id. Half 0 (tiles 0-3:
// dims 0-255) and half 1 (tiles 4-7: dims 256-511) are each 512 consecutive bytes of a key's row; a
// warp instruction copies a 128-byte line of four keys (lane l: chunk l % 8 of key l / 8 of the four),
// so a lane shuffles in four rows a half, not sixteen. (Two lanes a key, each of a tile's 128 bytes in
// 32-byte pieces from four instructions, ran 1.03-1.58x slower than the v5b producer body; a key's
// half row an instruction, lane l its chunk l, ran ~5% slower than these lines at 128 heads on pages of
// one key: NOTES.md, "twenty-sixth session".) Each thread arrives on a half's tile barriers once its
// copies land (noinc: 128 arrivals a tile). Keys past the range or on a page id outside the cache are
// zero-filled and masked key by key (keymask_addr, written by the warpgroup that gathers half 0 and
// published on tile 0's barrier by lane 0 of each warp: 4 more arrivals). The S warpgroup fences for
// the async proxy after each wait (wide64_scores).
// Cache rows are int: a cache of 2^31 rows would be 2 TiB of latent.
//
// Pages of 8 or 16 keys (the kPageBoxes instance: maps made with a box of one page, mla_launch.cuh) and a
// unit start on a page boundary take boxes instead: lane j < 16 of warp w with j a multiple of the box
// issues the box of keys 16 w + j .. of each tile of the half, its bytes expected on the tile's barrier by
// its own arrival; the other threads arrive plainly (128 arrivals a tile either way). A box lands at a
// multiple of 1024 bytes in its tile, so its 128-byte swizzle is the whole block's. The cp.async gathers
// (a key's half row an instruction, then) cost each consumer warp ~600-750 cycles a half (~1,200 with the
// rope tile) of a pair's ~7,800 at 128 heads on pages of one key, against 60-120 for the warps that do not
// issue the TMA path's boxes; the boxes took 8-10% off 64 and 128 heads on pages of 16 (NOTES.md,
// "twenty-fifth session"). A box on a bad page id or wholly past the range reads rows before the tensor
// (zeros); one whose page holds keys past the range reads them, masked, and the partial block's V rows
// are zeroed before the PVs, as on the TMA path.

// Whether unit u's blocks can come as TMA boxes: maps made and a start on a box boundary (every box in
// one page; the planner splits at multiples of 64). In the TMA instance (pages of 32+ keys) a unit
// that cannot takes the portable body; in the kPageBoxes one (pages of 8 or 16 keys: boxes of a page)
// its blocks come by cp.async.
__device__ __forceinline__ bool wide64_takes(const KeyTensorMaps& maps, const Unit& u) {
  return maps.enabled && (u.kv_begin & (maps.box_rows - 1)) == 0;
}

// The page id lane tid % 16 of warp tid / 32 holds for block blk (key 16 warp + lane % 16); -1 past
// the range.
__device__ __forceinline__ Wide64Pages wide64_key_page(const Problem& p, const Unit& u, int blk, int tid) {
  const int key = u.kv_begin + blk * Wide64Sm90::BK + 16 * (tid >> 5) + (tid & 15);
  Wide64Pages g;
  g.page[0] = key < u.range_end ? __ldg(page_table_row(p, u) + (key >> p.log2_page_size)) : -1;
  g.page[1] = 0;
  return g;
}

// Half HALF of block blk into buffer `buf` by the warpgroup's 128 threads (g: wide64_key_page); half 1
// with the rope tile, half 0 with the block's key mask.
template <int HALF, bool kPageBoxes>
__device__ __forceinline__ void wide64_gather_half(const Problem& p, const KeyTensorMaps& maps, const Unit& u,
                                                   uint32_t base, int buf, int blk, const Wide64Pages& g, int tid) {
  using W = Wide64Sm90;
  const int warp = tid >> 5, lane = tid & 31;
  const int key = u.kv_begin + blk * W::BK + 16 * warp + (lane & 15);
  const int row = key < u.range_end && page_in_cache(p, g.page[0]) ? cache_row<int>(g.page[0], key, p.page_size)
                                                                    : -1;  // -1: zero-filled, masked
  const uint64_t pol = l2_evict_first_policy();  // as the TMA boxes
  const uint32_t kbuf = W::buf_addr(base, buf);
  if constexpr (HALF == 0) {
    const uint32_t bits = __ballot_sync(0xffffffffu, row >= 0) & 0xffffu;  // lanes 0-15: the warp's keys
    if (lane == 0) st_shared_u16(W::keymask_addr(base, blk) + 2 * warp, bits);
  }
  if (kPageBoxes && wide64_takes(maps, u)) {
    const int box = maps.box_rows;
    const bool issues = lane < 16 && (lane & (box - 1)) == 0;
    const int box_row = row >= 0 ? row : -box;  // its first key's row (a page's first), else zeros
    const uint32_t dst = kbuf + (16 * warp + lane) * 128;
#pragma unroll
    for (int tt = 4 * HALF; tt < (HALF ? W::TILES : 4); ++tt) {
      const uint32_t bar = W::full_bar(base, buf, tt);
      if (issues) {
        const Wide64TileSource src = wide64_tile_source(maps, tt);
        mbar_arrive_expect_tx(bar, box * 128);
        tma_load_2d_hint(dst + tt * W::TILE, src.map, src.col, box_row, bar, pol);
      } else {
        mbar_arrive(bar);
      }
    }
  } else {
    // Four keys an instruction, a whole 128-byte line of each: lane l copies chunk l % 8 of key 4 i + l / 8 of
    // the warp's sixteen, of each of the half's tiles (and of the rope tile), so that a lane needs the rows
    // of four keys (four shuffles a half) and each copy's addresses are its key's plus constants.
    const int c = lane & 7, ks = lane >> 3;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = 4 * i + ks, kl = 16 * warp + j, rj = __shfl_sync(0xffffffffu, row, j);
      const uint32_t dst = kbuf + kl * 128 + ((c ^ (kl & 7)) << 4);
      const size_t r = (size_t)max(rj, 0);
      const char* src = static_cast<const char*>(p.ckv) + r * (2 * kDimCkv) + HALF * 512 + c * 16;
      const int bytes = rj >= 0 ? 16 : 0;
#pragma unroll
      for (int q = 0; q < 4; ++q) cp_async16_hint(dst + (4 * HALF + q) * W::TILE, src + q * 128, bytes, pol);
      if constexpr (HALF == 1) {
        cp_async16_hint(dst + W::ROPE_TILE * W::TILE, static_cast<const char*>(p.kpe) + r * (2 * kDimKpe) + c * 16,
                        bytes, pol);
      }
    }
#pragma unroll
    for (int tt = 4 * HALF; tt < (HALF ? W::TILES : 4); ++tt) mbar_arrive_on_cp_async(W::full_bar(base, buf, tt));
  }
  if constexpr (HALF == 0) {
    if (lane == 0) mbar_arrive(W::full_bar(base, buf, 0));  // publishes the warp's mask bits
  }
}

// fp8 cache: a block's raw latent turned into the eight 16-bit tiles the MMAs read (MT: fp16, exact),
// in place, by one warpgroup (tid 0-127): tile t holds dims 64 t .. 64 t + 63 as a 16-bit cache's
// TMA would have put them. Raw panel q becomes tiles 2q and 2q + 1. Two lanes own key r = 16 warp +
// lane / 2, lane h = lane & 1 its raw chunks 4h .. 4h + 3 of every panel (tile 2q + h); a key's bytes
// stay in its 128-byte row of every tile (the swizzle permutes chunks within a row), so only the
// lane pair touches them, and a __syncwarp between each panel's reads and writes orders the pair.
// Panels go in an order that reads every raw row before it is overwritten: buffer 0 (raw in tiles
// 0-3) q = 2, 3 (into tiles 4-7, which the other warpgroup frees: `free_bar`), then 1, 0; buffer 1
// (raw in tiles 4-7) q = 0, 1 (into tiles 0-3, freed likewise), then 2, 3. Lane h = 1 takes its
// chunks rotated by two, so that the pair's loads and stores fall in distinct banks. The caller
// fences for the async proxy and synchronises the warpgroup before a wgmma reads the tiles.
template <typename MT>
__device__ __forceinline__ void wide64_convert_block(uint32_t base, int buf, int raw_parity, bool wait_free,
                                                     int free_parity, int tid) {
  using W = Wide64Sm90;
  const int warp = tid >> 5, lane = tid & 31;
  const int r = 16 * warp + (lane >> 1), h = lane & 1, sw = r & 7;
  const uint32_t kbuf = W::buf_addr(opaque(base), buf) + r * 128;
  const int raw0 = W::raw_tile0(buf);
#pragma unroll
  for (int q = 0; q < 4; ++q) mbar_wait(W::full_bar(base, buf, raw0 + q), raw_parity);
  if (wait_free) mbar_wait(W::free_bar(base, buf), free_parity);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int q = buf == 0 ? (i < 2 ? i + 2 : 3 - i) : i;
    uint4 v[4];  // v[j]: raw chunk 4h + c_j, c_j = (j + 2h) & 3
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = 4 * h + ((j + 2 * h) & 3);
      v[j] = ld_shared_v4(kbuf + (raw0 + q) * W::TILE + ((c ^ sw) << 4));
    }
    __syncwarp();
    const uint32_t out = kbuf + (2 * q + h) * W::TILE;
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // raw chunk 4h + c_j: output chunks 2 c_j, 2 c_j + 1 of tile 2q + h
      const int oc = 2 * ((j + 2 * h) & 3);
      st_shared_v4(out + ((oc ^ sw) << 4), fp8x8_to<MT>(make_uint2(v[j].x, v[j].y)));
      st_shared_v4(out + (((oc + 1) ^ sw) << 4), fp8x8_to<MT>(make_uint2(v[j].z, v[j].w)));
    }
  }
}

// S = Q K^T for the block in `kbuf`, each tile as its barrier completes: steps [I0, I1) of the
// tile order, tiles 0-3 first when kLeftFirst (WG0: refilled first), else 4-8 first (WG1).
// Without `wait`, kbuf is the query panels and the product is thrown away: the loop issues every
// wgmma on every trip (see wide_consumer), and the queries are never written. kGather: the tiles were
// written by cp.async (generic proxy), so each wait is followed by a proxy fence. Async: the caller
// commits.
template <typename T, typename MT, bool kFp8, bool kLeftFirst, int I0 = 0, int I1 = Wide64Sm90::TILES,
          bool kGather = false>
__device__ __forceinline__ void wide64_scores(float (&s)[Wide64Sm90::SACC], const uint32_t (&q_rope)[4][4],
                                              uint32_t base, uint32_t kbuf, int buf, int parity, bool wait) {
  using W = Wide64Sm90;
  base = opaque(base);
  kbuf = opaque(kbuf);
  const uint32_t q_lo = sw128_desc_lo(base + W::Q_OFF), k_lo = sw128_desc_lo(kbuf);
#pragma unroll
  for (int i = I0; i < I1; ++i) {
    const int t = kLeftFirst ? i : (i < 5 ? i + 4 : i - 5);
#ifdef JAX_MLA_WIDE64_S_WAIT_GROUP
    // Experiment (NOTES.md, "fifty-second session"): every tile of a group (a call's range; WG1's tiles
    // 4-8, then 0-3) waited for before the group's first wgmma, so that a warpgroup passes one
    // compiler-inserted warpgroup arrive a group instead of one a tile.
    if (wait && (i == I0 || (!kLeftFirst && i == 5))) {
      const int group_end = !kLeftFirst && i < 5 ? (I1 < 5 ? I1 : 5) : I1;
#pragma unroll
      for (int j = i; j < group_end; ++j) {
        const int tj = kLeftFirst ? j : (j < 5 ? j + 4 : j - 5);
        if (!kFp8 || tj == W::ROPE_TILE) mbar_wait(W::full_bar(base, buf, tj), parity);
      }
      if constexpr (kGather) fence_proxy_async_shared();
    }
#else
    // (an fp8 cache's latent tiles were waited for and converted before: wide64_convert_block)
    if (wait && (!kFp8 || t == W::ROPE_TILE)) {
      mbar_wait(W::full_bar(base, buf, t), parity);
      if constexpr (kGather) fence_proxy_async_shared();
    }
#endif
    if (i == 0) wgmma_fence();
    if (t == W::ROPE_TILE) {
      const uint32_t tile = wait ? W::ROPE_TILE * W::TILE : 0;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_64x64_rs<T>(s, q_rope[kk], sw128_desc_at(k_lo, tile + kk * 32), i + kk > 0);
    } else {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_64x64_ss<MT>(s, sw128_desc_at(q_lo, t * W::QPANEL + kk * 32), sw128_desc_at(k_lo, t * W::TILE + kk * 32),
                           i + kk > 0);
    }
  }
}

// P fragments to a 64 x 64 panel in the 128-byte swizzle (chunk c of row r at c ^ (r & 7)): the
// K-major A operand of the other warpgroup's wgmma.
__device__ __forceinline__ void wide64_store_p(uint32_t buf, const uint32_t (&pa)[Wide64Sm90::KSTEPS][4], int warp,
                                               int lane) {
  buf = opaque(buf);
  const int g = lane >> 2, t4 = lane & 3;
  const uint32_t r0 = buf + (16 * warp + g) * 128 + 4 * t4, r1 = r0 + 8 * 128;
#pragma unroll
  for (int kk = 0; kk < Wide64Sm90::KSTEPS; ++kk) {
    st_shared_u32(r0 + (((2 * kk) ^ g) << 4), pa[kk][0]);
    st_shared_u32(r1 + (((2 * kk) ^ g) << 4), pa[kk][1]);
    st_shared_u32(r0 + (((2 * kk + 1) ^ g) << 4), pa[kk][2]);
    st_shared_u32(r1 + (((2 * kk + 1) ^ g) << 4), pa[kk][3]);
  }
}
// The A fragments of KS k16 steps from such a panel, by ldmatrix (the queries' rope panel).
template <int KS>
__device__ __forceinline__ void wide64_load_fragments(uint32_t panel, uint32_t (&a)[KS][4], int warp, int lane) {
  panel = opaque(panel);
  const int row = 16 * warp + (lane & 7) + ((lane >> 3) & 1) * 8, ch = lane >> 4;
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) ldmatrix_x4(a[kk], panel + row * 128 + (((2 * kk + ch) ^ (row & 7)) << 4));
}

// O[:, 256 HALF : +256] += P V for the block in kbuf (async, not committed); P from registers or
// from a panel in shared memory.
template <typename T, int HALF>
__device__ __forceinline__ void wide64_pv(float (&o)[128], const uint32_t (&pa)[Wide64Sm90::KSTEPS][4],
                                          uint32_t kbuf) {
  using W = Wide64Sm90;
  const uint32_t v_lo = sw128_mn_desc_lo(opaque(kbuf), W::TILE);
#pragma unroll
  for (int kk = 0; kk < W::KSTEPS; ++kk)
    wgmma_64x256_rs_mn<T>(o, pa[kk], sw128_desc_at(v_lo, HALF * 4 * W::TILE + kk * 2048), 1);
}
template <typename T, int HALF>
__device__ __forceinline__ void wide64_pv_shared_p(float (&o)[128], uint32_t p_panel, uint32_t kbuf) {
  using W = Wide64Sm90;
  const uint32_t v_lo = sw128_mn_desc_lo(opaque(kbuf), W::TILE), p_lo = sw128_desc_lo(p_panel);
#pragma unroll
  for (int kk = 0; kk < W::KSTEPS; ++kk)
    wgmma_64x256_ss_mn<T>(o, sw128_desc_at(p_lo, kk * 32), sw128_desc_at(v_lo, HALF * 4 * W::TILE + kk * 2048), 1);
}

// V rows [from, 64) of the four latent tiles a warpgroup multiplies (HALF) set to zero, then
// fenced for wgmma and synchronised within the warpgroup: a partial last block's rows past the
// range came whole from their page.
template <int HALF>
__device__ __forceinline__ void wide64_zero_rows(uint32_t kbuf, int from, int tid) {
  using W = Wide64Sm90;
  static_assert(W::TILE == kKeyPanelBytes, "the tiles are key panels");
  zero_key_panel_rows(kbuf + 4 * HALF * W::TILE, from, tid);
  fence_proxy_async_shared();
  named_barrier_sync(W::kWarpgroup0 + HALF, 128);
}

// Masks and scales the scores of block blk (key0: its first key) in S's accumulator layout: keys of a
// box on a bad page (the block's mask word; kKeys, gathered blocks: a key's bit of the key mask) or
// past a row's limit get -inf, the rest times the row's base-2 softmax scale. kLow: keys below key_lo
// too (the walk's unit that starts off a box: its first block starts on the box below).
// kScale = false (softmax_block_scaled, -DJAX_MLA_WIDE64_LEAN_SOFTMAX): the scores stay unscaled.
template <bool kKeys = false, bool kLow = false, bool kScale = true>
__device__ __forceinline__ void wide64_mask_scores(float (&x)[Wide64Sm90::SACC], uint32_t base, int blk, int key0,
                                                   const int (&limit)[2], const float (&scale_log2)[2], int t4,
                                                   int key_lo = 0) {
  using W = Wide64Sm90;
  using Mask = std::conditional_t<kKeys, uint64_t, uint32_t>;
  const uint32_t at = kKeys ? W::keymask_addr(opaque(base), blk) : W::mask_addr(opaque(base), blk);
  const Mask ok = *reinterpret_cast<const Mask*>(__cvta_shared_to_generic(at));
  if (ok == (kKeys ? ~Mask(0) : Mask(3)) && key0 + W::BK <= min(limit[0], limit[1]) && (!kLow || key0 >= key_lo)) {
    if constexpr (kScale) {
#pragma unroll
      for (int i = 0; i < W::SACC; ++i) x[i] *= scale_log2[(i >> 1) & 1];
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < W::SACC / 4; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int kl = 8 * j + 2 * t4 + (e & 1);
      const bool key_ok = (ok >> (kKeys ? kl : j >> 2)) & 1;  // boxes: keys 8j .. 8j + 7 lie in box j / 4
      const bool in_range = key0 + kl < limit[e >> 1] && (!kLow || key0 + kl >= key_lo);
      x[4 * j + e] = key_ok && in_range ? (kScale ? x[4 * j + e] * scale_log2[e >> 1] : x[4 * j + e]) : -INFINITY;
    }
  }
}

// A unit's place in a walk (kWalk: mla_wide64_walk_sm90.cuh, a block that runs unit after unit): the
// phases its barriers are in when it starts (they are not initialised again between units), the parity
// of its query tile's barrier, and its first key. A block of one unit passes none of it.
struct Wide64Walk {
  int phase_a;   // buffer 0's tile barriers and the four hand-offs: each turns once a pair
  int phase_b;   // buffer 1's tile barriers: one turn fewer than buffer 0 in a unit of an odd block count
  int q_parity;  // the query barrier (query_bar): one turn a unit
  int key_lo;    // the unit's first key: its blocks start on the box at or below it, keys below it masked
  int unit;      // the units the block ran before this one (the trace's slots: mla_common.cuh)
  // The phases a unit of num_blocks blocks leaves (the body returns them, so that the count is computed in
  // one place: a walk that advanced its phases by another count would wait on a phase that never comes).
  __device__ __forceinline__ Wide64Walk after(int num_blocks) const {
    return {phase_a ^ (((num_blocks + 1) >> 1) & 1), phase_b ^ ((num_blocks >> 1) & 1), q_parity ^ 1, key_lo, unit + 1};
  }
};

// One warpgroup of the body (HALF = 0: WG0, block A and O's left half; 1: WG1, block B, right half).
// An fp8 ckv (kCache == kCacheFp8Ckv): the raw block comes by TMA into one half of its buffer
// (raw_tile0) and the warpgroup that computes its S turns it into fp16 tiles in place right before
// (wide64_convert_block), once the other warpgroup has freed the other half (free_bar): WG0 issues
// block A + 2's raw bytes where it refilled tiles 0-3, WG1 block B + 2's where it refilled tiles 4-8,
// each with its rope tile (WG1 issues A + 2's). The latent MMAs run in fp16 (LatentMmaType), the
// queries brought into fp16's range per row as in v5b (wide_prepare_queries_fp8).
// kGather: a 16-bit cache on pages of fewer than 32 keys; the blocks come by cp.async
// (wide64_gather_half), issued where the TMA path issues its boxes, by the whole warpgroup.
// kWalk: one unit of a walk (mla_wide64_walk_sm90.cuh; a 16-bit cache, blocks by TMA): the query tile and
// blocks 0 and 1 were issued by TMA before (query_bar, the tiles' barriers), the barriers' phases and the
// first key come in `walk`, and the epilogue stages the rows in key buffer 1, then calls the hooks (the next
// unit's record, its first loads, the row copies' end); it returns the phases the unit leaves its barriers
// in (a block of one unit ignores them).
template <typename T, int kCache, int HALF, bool kGather = false, bool kPageBoxes = false, bool kWalk = false,
          typename WalkHooks = void, bool kProducer = false>
__device__ __forceinline__ Wide64Walk wide64_warpgroup(const Problem& p, const KeyTensorMaps& maps, const Unit& u, int h0,
                                                 int hb, uint32_t base_in, Wide64Walk walk = {},
                                                 WalkHooks* hooks = nullptr) {
  using W = Wide64Sm90;
  static_assert(!kWalk || (kCache == kCacheAsQuery && !kGather), "the walk: a 16-bit cache read by TMA");
  using MT = LatentMmaType<T, kCache>;
  constexpr bool kFp8 = kCache == kCacheFp8Ckv;
  // An fp8 ckv: base broadcast from lane 0, so that ptxas knows it is warp-uniform. Without it ptxas kept
  // base in a vector register in the fp8 instance (whose conversions hold more values), built every
  // wgmma descriptor there and moved it to the uniform datapath per wgmma: 197 and 184 R2URs in the two
  // warpgroups' loops (the 16-bit instance's: 20 and 16), loops of 1,685 and 1,736 instructions against
  // 1,484 and 1,640 with the broadcast (NOTES.md, "twenty-eighth session"). In the 16-bit instance the
  // broadcast made WG1's loop worse (16 -> 105 R2URs), so it is not used there.
  const uint32_t base = kFp8 ? __shfl_sync(0xffffffffu, base_in, 0) : base_in;
  static_assert(!kGather || kCache == kCacheAsQuery, "gathered blocks: a 16-bit cache");
  static_assert(!kProducer || kCache == kCacheAsQuery, "the producer warpgroup: a 16-bit cache");
  static_assert(!kProducer || !kWalk, "the walk's consumers issue its boxes");
  // Whether this warpgroup issues refills: not where the producer warpgroup gathers or issues the boxes
  // (kProducer); the consumers then arrive on a half's empty barrier where they would have issued it (`release`).
  constexpr bool kIssues = !kProducer;
#ifdef JAX_MLA_WIDE64_REFILL_A_LATE
  // Experiment (NOTES.md, "fifty-second session"): WG0 issues block A + 2's tiles 0-3 after the P_A hand-off,
  // not between P_A V_A and the m_B wait, where thread 0's ~470 cycles of issue delayed P_A, which WG1's
  // P_A V_A waits for (a compute-bound pair's critical path).
  constexpr bool kLateRefillA = kIssues && !kGather && !kFp8;
#else
  constexpr bool kLateRefillA = false;
#endif
  // The default schedule (W::kPaFirstSchedule; -DJAX_MLA_WIDE64_NO_PA_FIRST: off): P_A goes to WG1 in m_A's frame
  // right after m_A, and WG1 issues P_A V_A before its softmax of block B, so that the tensor pipe holds both
  // halves of P_A V_A (not one) while softmax B, the pair's critical path, runs. WG1 then moves O_R to m_A's frame
  // before P_A V_A and to m_B's after it; WG0 no longer rescales P_A. P_B comes with m_B (the P1 hand-off goes
  // unused).
  constexpr bool kPaFirst = W::kPaFirstSchedule && !kFp8;
  [[maybe_unused]] auto release = [&](int buf, int half) { mbar_arrive(W::empty_bar(base, buf, half)); };
  const int tid = threadIdx.x - 128 * HALF;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
#ifdef JAX_MLA_TRACE  // (mla_common.cuh) row 0: the prologue and the epilogue; row 1 + n: pair n
  const int trace_slot = jax_mla_trace_slot(HALF, warp, lane, kPaFirst ? kTraceWide64PaFirst : kTraceWide64,
                                            kWalk ? walk.unit : -1);
#endif
  const int rows = u.q_len * hb;
  int r[2], limit[2];
  accumulator_rows(u, warp, g, rows, hb, r, limit);
  // Broadcast from lane 0: the compiler then knows the loop is warp-uniform, which wgmma needs.
  const int num_blocks = __shfl_sync(0xffffffffu, (u.range_end - u.kv_begin + W::BK - 1) / W::BK, 0);
  const int last_rows = u.range_end - u.kv_begin - (num_blocks - 1) * W::BK;  // keys of the last block
  // The walk: keys of the first block below the unit's first key (a unit that starts off a box).
  const int low_rows = kWalk ? __shfl_sync(0xffffffffu, walk.key_lo - u.kv_begin, 0) : 0;
  auto stat_ptr = [&](int which, int row) { return W::stat(base, which, row); };
  const uint32_t kb0 = W::buf_addr(base, 0), kb1 = W::buf_addr(base, 1), q_panels = base + W::Q_OFF;

  JAX_MLA_TRACE_AT(0, 8);
  // The first two blocks: WG0 loads their tiles 0-3 (and writes their key masks), WG1 tiles 4-8.
  // The page ids are read first and the tiles issued after this thread's query copies, so that no
  // query copy waits for the page table.
  // WG0 also reads the ids of the first pair's refills (blocks 2 and 3): see the loop's top.
  // Gathered blocks: every thread, the id of its own key (wide64_key_page).
  auto block_pages = [&](int blk) {
    if constexpr (kGather) {
      return wide64_key_page(p, u, blk, tid);
    } else {
      return wide64_block_pages(p, maps, u, blk);
    }
  };
  Wide64Pages first[2] = {}, ahead_a = {}, ahead_b = {};
  if constexpr (kWalk) {
    // The walk's blocks 0 and 1 were issued at the last unit's end (or the kernel's start), their page ids
    // and those of blocks 2 and 3 read during the last unit (mla_wide64_walk_sm90.cuh).
    if (HALF == 0 && tid == 0) {
      ahead_a = hooks->next.pages[2];
      ahead_b = hooks->next.pages[3];
    }
  } else if (kIssues && (kGather || tid == 0)) {
    if (num_blocks > 0) first[0] = block_pages(0);
    if (num_blocks > 1) first[1] = block_pages(1);
    if (HALF == 0 && num_blocks > 2) ahead_a = block_pages(2);
    if (HALF == 0 && num_blocks > 3) ahead_b = block_pages(3);
  }
  JAX_MLA_TRACE_AT(0, 9);
  // Queries: rows r = (token r / hb, head h0 + r % hb), padding rows zero; the latent part into
  // the query panels, the rope part into P1's panel, from where each warpgroup takes it into registers.
  // (The walk's tile is in flight already: TMA boxes in the same places.)
  if constexpr (!kWalk) {
    load_query_tile<T, W::ROWS, W::kThreads>(p, u, h0, hb, rows, threadIdx.x, [&](int rr, int c) {
      return c < 64 ? base + W::Q_OFF + WideSm90::chunk_offset(rr, c, W::QPANEL)
                    : base + W::P1_OFF + WideSm90::chunk_offset(rr, c - 64, 0);
    });
  }
  if constexpr (kGather) {
    // The queries are one cp.async group (waited for below); the gathers arrive on the tiles'
    // barriers and stay out of every group.
    cp_async_commit();
#pragma unroll
    for (int blk = 0; blk < 2; ++blk) {
      if (!kIssues || blk >= num_blocks) break;
      wide64_gather_half<HALF, kPageBoxes>(p, maps, u, base, blk, blk, first[blk], tid);  // warpgroup w gathers half w
    }
  } else if (tid == 0 && kFp8) {  // block HALF whole: mask, raw latent, rope
    if (HALF < num_blocks) {
      const Wide64Rows b = wide64_block_rows(p, maps, u, HALF, first[HALF]);
      st_shared_u32(W::mask_addr(base, HALF), b.ok);
      wide64_load_raw(maps, base, HALF, b);
      wide64_load_tiles<8, 9>(maps, base, HALF, b);
    }
  } else if (!kWalk && kIssues && tid == 0) {
#pragma unroll
    for (int blk = 0; blk < 2; ++blk) {
      if (blk >= num_blocks) break;
      const Wide64Rows b = wide64_block_rows(p, maps, u, blk, first[blk]);
      if constexpr (HALF == 0) {
        st_shared_u32(W::mask_addr(base, blk), b.ok);
        wide64_load_tiles<0, 4>(maps, base, blk, b);
      } else {
        wide64_load_tiles<4, 9>(maps, base, blk, b);
      }
    }
  }
  JAX_MLA_TRACE_AT(0, 1);
  // An fp8 cache's scales, read while the queries land: read after the barrier below, their round trip
  // came after the queries' (each thread waits for the load where it is read, here).
  const CacheScales scales = cache_scales<kCache>(p);
  if constexpr (kWalk) {
    // The boxes' bytes are counted on the barrier, whose wait makes them visible to this thread's
    // ldmatrix and (async proxy to async proxy) to its wgmma. The block masks thread 0 wrote are
    // published by its arrivals on the tiles' barriers, which every S waits for.
    mbar_wait(W::query_bar(base), walk.q_parity);
  } else {
    if constexpr (kGather) {
      cp_async_wait<0>();  // the queries' group only
    } else {
      cp_async_wait_all();
    }
    fence_proxy_async_shared();  // the query panels reach wgmma's reads
    named_barrier_sync(W::kBoth, W::kThreads);
  }
  JAX_MLA_TRACE_AT(0, 2);
  // The softmax scale in base 2 of the thread's rows (times an fp8 cache's s_c, and over the power
  // of two its queries were scaled by: then per row).
  float scale_log2[2] = {p.scale_log2 * scales.score, p.scale_log2 * scales.score};
  if constexpr (kFp8) {
    wide_prepare_queries_fp8<T, HALF>(
        [&](int rr, int c) {
          return c < 64 ? base + W::Q_OFF + WideSm90::chunk_offset(rr, c, W::QPANEL)
                        : base + W::P1_OFF + WideSm90::chunk_offset(rr, c - 64, 0);
        },
        [] { named_barrier_sync(Wide64Sm90::kBoth, Wide64Sm90::kThreads); }, warp, lane, scales.rope_query,
        scale_log2);
    fence_proxy_async_shared();  // the rewritten query panels reach wgmma's reads
    named_barrier_sync(W::kBoth, W::kThreads);
  }
  uint32_t q_rope[4][4];
  wide64_load_fragments(base + W::P1_OFF, q_rope, warp, lane);  // WG1 overwrites P1 only after the m_A hand-off

  // Masks and scales the scores of block blk (key0: its first key).
  auto mask = [&](int blk, int key0) {
    return [&, blk, key0](float (&x)[W::SACC]) {
#ifdef JAX_MLA_WIDE64_LEAN_SOFTMAX
      wide64_mask_scores<kGather, kWalk, false>(x, base, blk, key0, limit, scale_log2, t4, walk.key_lo);
#else
      wide64_mask_scores<kGather, kWalk>(x, base, blk, key0, limit, scale_log2, t4, walk.key_lo);
#endif
    };
  };

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};
  float s[W::SACC];
  uint32_t pa[W::KSTEPS][4], pb[W::KSTEPS][4];

  // fp8: this warpgroup's first block into fp16 (its buffer is not read yet: no wait for a free half).
  auto convert = [&](int buf, int raw_parity, bool wait_free, int free_parity) {
    wide64_convert_block<MT>(base, buf, raw_parity, wait_free, free_parity, tid);
    fence_proxy_async_shared();  // the fp16 tiles reach wgmma's reads
    named_barrier_sync(W::kWarpgroup0 + HALF, 128);
  };
  if constexpr (HALF == 0) {
    if (num_blocks > 0) {
      if constexpr (kFp8) convert(0, 0, false, 0);
      wide64_scores<T, MT, kFp8, true, 0, W::TILES, kGather>(s, q_rope, base, kb0, 0, kWalk ? walk.phase_a : 0, true);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(s);
      if constexpr (kWalk) {
        // Block 0 is read as K: the V rows of the keys below the unit's start go, in all eight latent tiles,
        // before either warpgroup's P V (their P is 0, but their bytes, another split's keys, may hold a NaN);
        // fenced for the async proxy, which the hand-offs before warpgroup 1's reads then order.
        static_assert(W::TILE == kKeyPanelBytes, "the tiles are key panels");
        if (low_rows > 0) {
          zero_key_panel_rows<8>(kb0, 0, tid, low_rows);
          fence_proxy_async_shared();
          named_barrier_sync(W::kWarpgroup0, 128);
        }
      }
    }
  } else {
    // The walk: warpgroup 0's barrier after zeroing the low rows, matched (racecheck: see the epilogue).
    if (kWalk && low_rows > 0) named_barrier_sync(W::kWarpgroup0 + 1, 128);
    if (num_blocks > 1) {
      if constexpr (kFp8) convert(1, 0, false, 0);
      wide64_scores<T, MT, kFp8, false, 0, W::TILES, kGather>(s, q_rope, base, kb1, 1, kWalk ? walk.phase_b : 0,
                                                              true);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(s);
    }
  }
  JAX_MLA_TRACE_AT(0, 3);

  // Like v5b's consumers, the loop issues every wgmma on every trip (past the end on the query
  // panels, dropped): a branch around one makes ptxas serialise every wgmma of the kernel (C7515).
#pragma unroll 1
  for (int pair = 0; 2 * pair < num_blocks; ++pair) {
    const int blk_a = 2 * pair, blk_b = blk_a + 1;
    const bool has_b = blk_b < num_blocks, next_a = blk_a + 2 < num_blocks, next_b = blk_b + 2 < num_blocks;
    // The pair's hand-offs and buffer 0's fill (the walk: in the phases its unit started in).
    const int parity = (pair & 1) ^ (kWalk ? walk.phase_a : 0);
    const int key0 = u.kv_begin + blk_a * W::BK;
    const bool a_partial = blk_a == num_blocks - 1 && last_rows < W::BK;
    const bool b_partial = blk_b == num_blocks - 1 && last_rows < W::BK;
    JAX_MLA_TRACE_AT(pair + 1, 0);
    // The page ids of this pair's refills. WG0's were read during the last pair, while it waited
    // for tiles: read here, the address arithmetic and loads kept its warp 0 ~120 cycles behind the
    // other warps at the m_A hand-off, which every later step waits for (NOTES.md, "fourth
    // session"). WG1 waits for m_A here anyway. Their rows are made where the refills need them
    // (made here, the thread waited ~300 cycles for the page table: NOTES.md, "third session").
    Wide64Pages pages_a = ahead_a, pages_b = ahead_b;
    if (kIssues && HALF == 1 && (kGather || tid == 0)) {
      if (next_a) pages_a = block_pages(blk_a + 2);
      if (next_b) pages_b = block_pages(blk_b + 2);
    }
    if constexpr (HALF == 0) {
      // ---- block A: softmax, m_A out, PV from registers ----
      // This warpgroup's S of block A, issued at the end of the last trip, is waited for here, where its
      // scores are first read (WG1: after the m_A hand-off). So the last trip's S, computed on the query
      // panels and thrown away, runs beside the epilogue, not before it; the block waits for it before it
      // exits. Its reads are the query panels only (the rope step's too), which the epilogue does not
      // write: it stages rows in the key buffers. Every refill of the tiles an S reads is issued after
      // that S's wait, by the same warpgroup or behind a hand-off the wait precedes (m_A, P_B). NOTES.md,
      // "thirty-first session" and "thirty-third session": 1-6% faster at 64-128 heads.
      wgmma_wait<0>();
      fence_registers(s);
      float m_a[2], alpha_a[2], sum_a[2];
#ifdef JAX_MLA_WIDE64_LEAN_SOFTMAX
      softmax_block_scaled<true>(s, mask(blk_a, key0), scale_log2, m_run, m_a, alpha_a, sum_a);
#else
      softmax_block<true>(s, mask(blk_a, key0), m_run, m_a, alpha_a, sum_a);
#endif
      if (t4 == 0) {
#pragma unroll
        for (int e = 0; e < 2; ++e) *stat_ptr(W::kMaxA, r[e]) = m_a[e];
      }
      if constexpr (kPaFirst) {  // P_A in m_A's frame goes right after m_A
        handoff_signal(W::kAReady, base);
        JAX_MLA_TRACE_AT(pair + 1, 1);
        wide_pack_p<MT>(s, pa);
        wide64_store_p(base + W::P0_OFF, pa, warp, lane);
        fence_proxy_async_shared();  // P_A reaches WG1's wgmma reads
        handoff_signal(W::kP0Ready, base);
      } else {
        handoff_signal(W::kAReady, base);
        JAX_MLA_TRACE_AT(pair + 1, 1);
        wide_pack_p<MT>(s, pa);
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) l_run[e] = l_run[e] * alpha_a[e] + sum_a[e];
      wide_rescale<true>(o, alpha_a);
      if (a_partial) wide64_zero_rows<0>(kb0, last_rows, tid);
      JAX_MLA_TRACE_AT(pair + 1, 2);
      wgmma_fence();
      wide64_pv<MT, 0>(o, pa, kb0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(o);
      fence_fragments(pa);
      JAX_MLA_TRACE_AT(pair + 1, 3);
      if constexpr (kProducer) {  // block A's tiles 0-3 are read: block A + 2's may go in
        if (next_a) release(0, 0);
      } else if constexpr (kGather) {  // block A's tiles 0-3 are read: block A + 2's go in
        if (next_a) wide64_gather_half<0, kPageBoxes>(p, maps, u, base, 0, blk_a + 2, pages_a, tid);
      } else if (tid == 0 && next_a && !kLateRefillA) {  // block A's tiles 0-3 are read: A + 2's go in (fp8: raw)
        const Wide64Rows b = wide64_block_rows(p, maps, u, blk_a + 2, pages_a);
        st_shared_u32(W::mask_addr(base, blk_a + 2), b.ok);
        if constexpr (kFp8) {
          wide64_load_raw(maps, base, 0, b);
        } else {
          wide64_load_tiles<0, 4>(maps, base, 0, b);
        }
      }
      JAX_MLA_TRACE_AT(pair + 1, 4);
      // ---- m_B from WG1: P_A in its frame for WG1's PV, O_L to it ----
      handoff_wait(W::kBReady, base, parity);
      JAX_MLA_TRACE_AT(pair + 1, 5);
      float alpha_b[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float m_b = *stat_ptr(W::kMaxB, r[e]);
        alpha_b[e] = m_b == m_a[e] ? 1.f : wide_alpha(m_a[e], m_b);
        m_run[e] = m_b;
      }
      if constexpr (!kPaFirst) {
        if (alpha_b[0] != 1.f || alpha_b[1] != 1.f) {
#pragma unroll
          for (int i = 0; i < W::SACC; ++i) s[i] *= alpha_b[(i >> 1) & 1];
          wide_pack_p<MT>(s, pa);
        }
        wide64_store_p(base + W::P0_OFF, pa, warp, lane);
        fence_proxy_async_shared();  // P_A reaches WG1's wgmma reads
        handoff_signal(W::kP0Ready, base);
      }
      JAX_MLA_TRACE_AT(pair + 1, 6);
      if constexpr (kLateRefillA) {  // (the experiment's place for block A + 2's tiles 0-3: after the P_A hand-off)
        if (tid == 0 && next_a) {
          const Wide64Rows b = wide64_block_rows(p, maps, u, blk_a + 2, pages_a);
          st_shared_u32(W::mask_addr(base, blk_a + 2), b.ok);
          wide64_load_tiles<0, 4>(maps, base, 0, b);
        }
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) l_run[e] *= alpha_b[e];
      wide_rescale<true>(o, alpha_b);
      if (b_partial) wide64_zero_rows<0>(kb1, last_rows, tid);
      if constexpr (!kPaFirst) handoff_wait(W::kP1Ready, base, parity);  // (kPaFirst: P_B came with m_B)
      JAX_MLA_TRACE_AT(pair + 1, 7);
      // Without a block B, WG1 stored P_B = 0 and this adds 0 times block A's half (already multiplied,
      // its rows past the range zeroed). Not the query panels: a NaN or inf query element times 0 made
      // its column NaN in every row of the tile (tests/test_attention.py's NaN test on pages of 16).
      wgmma_fence();
      wide64_pv_shared_p<MT, 0>(o, base + W::P1_OFF, has_b ? kb1 : kb0);
      wgmma_commit();
      if (kIssues && (kGather || tid == 0)) {  // the next pair's refill ids, while the S below waits for its tiles
        if (blk_a + 4 < num_blocks) ahead_a = block_pages(blk_a + 4);
        if (blk_b + 4 < num_blocks) ahead_b = block_pages(blk_b + 4);
      }
      if constexpr (kFp8) {
        // Block A + 2 into fp16 while P_B V_B runs (its tiles 4-7 once WG1's P_A V_A is done), then
        // buffer 1's tiles 0-3 go back to WG1 for block B + 2, then S of A + 2.
        if (next_a) wide64_convert_block<MT>(base, 0, parity ^ 1, true, parity, tid);
        wgmma_wait<0>();
        fence_registers(o);
        // Only where WG1 will wait for it: a phase nobody waits for is a "missing wait" to synccheck.
        if (next_b) mbar_arrive(W::free_bar(base, 1));
        if (next_a) {
          fence_proxy_async_shared();  // the fp16 tiles reach wgmma's reads
          named_barrier_sync(W::kWarpgroup0, 128);
        }
        JAX_MLA_TRACE_AT(pair + 1, 9);
        wide64_scores<T, MT, kFp8, true>(s, q_rope, base, next_a ? kb0 : q_panels, 0, parity ^ 1, next_a);
        wgmma_commit();
        JAX_MLA_TRACE_AT(pair + 1, 10);
      } else {
        // The next S in two parts: tiles 0-3 (refilled above) go in before the refill of block B's
        // tiles 0-3, tiles 4-8 (WG1 refills them last) after it, so that refill never waits for them.
        wide64_scores<T, MT, kFp8, true, 0, 4, kGather>(s, q_rope, base, next_a ? kb0 : q_panels, 0, parity ^ 1,
                                                        next_a);
        wgmma_commit();
        JAX_MLA_TRACE_AT(pair + 1, 8);
        wgmma_wait<1>();
        fence_registers(o);
        JAX_MLA_TRACE_AT(pair + 1, 9);
        // Block B's tiles 0-3 are read (WG1's S before its signal, our PV now).
        if constexpr (kProducer) {
          if (next_b) release(1, 0);
        } else if constexpr (kGather) {
          if (next_b) wide64_gather_half<0, kPageBoxes>(p, maps, u, base, 1, blk_b + 2, pages_b, tid);
        } else if (tid == 0 && next_b) {
          const Wide64Rows b = wide64_block_rows(p, maps, u, blk_b + 2, pages_b);
          st_shared_u32(W::mask_addr(base, blk_b + 2), b.ok);
          wide64_load_tiles<0, 4>(maps, base, 1, b);
        }
        wide64_scores<T, MT, kFp8, true, 4, 9, kGather>(s, q_rope, base, next_a ? kb0 : q_panels, 0, parity ^ 1,
                                                        next_a);
        wgmma_commit();
        JAX_MLA_TRACE_AT(pair + 1, 10);
      }
      JAX_MLA_TRACE_AT(pair + 1, 11);
    } else if constexpr (kPaFirst) {
      // ---- m_A and P_A from WG0: O_R to m_A's frame, P_A V_A issued, then softmax B against m_A ----
      handoff_wait(W::kAReady, base, parity);
      JAX_MLA_TRACE_AT(pair + 1, 1);
      // This warpgroup's S of block B (see WG0's), waited for before P_A V_A goes in: a wait that left P_A
      // V_A in flight over the softmax (wgmma_wait<1>) made ptxas serialise the kernel's wgmmas (C7514).
      wgmma_wait<0>();
      fence_registers(s);
      float m_a[2], m_b[2], alpha_a[2], alpha_ab[2], sum_b[2] = {0.f, 0.f};
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        m_b[e] = m_a[e] = *stat_ptr(W::kMaxA, r[e]);
        alpha_a[e] = m_a[e] == m_run[e] ? 1.f : wide_alpha(m_run[e], m_a[e]);  // as WG0's (wide_max_update)
      }
      wide_rescale<true>(o, alpha_a);
      // A partial block A is the unit's last (no block B): its rows past the range are zeroed before the
      // P Vs that read it (see WG0's).
      if (a_partial) wide64_zero_rows<1>(kb0, last_rows, tid);
      handoff_wait(W::kP0Ready, base, parity);
      wgmma_fence();
      wide64_pv_shared_p<MT, 1>(o, base + W::P0_OFF, kb0);
      wgmma_commit();
      JAX_MLA_TRACE_AT(pair + 1, 2);
      if (has_b) {
#ifdef JAX_MLA_WIDE64_LEAN_SOFTMAX
        softmax_block_scaled<true>(s, mask(blk_b, key0 + W::BK), scale_log2, m_a, m_b, alpha_ab, sum_b);
#else
        softmax_block<true>(s, mask(blk_b, key0 + W::BK), m_a, m_b, alpha_ab, sum_b);
#endif
        wide_pack_p<MT>(s, pb);
      } else {
        alpha_ab[0] = alpha_ab[1] = 1.f;
#pragma unroll
        for (int kk = 0; kk < W::KSTEPS; ++kk) pb[kk][0] = pb[kk][1] = pb[kk][2] = pb[kk][3] = 0u;
      }
      if (t4 == 0) {
#pragma unroll
        for (int e = 0; e < 2; ++e) *stat_ptr(W::kMaxB, r[e]) = m_b[e];
      }
      wide64_store_p(base + W::P1_OFF, pb, warp, lane);
      fence_proxy_async_shared();  // P_B reaches WG0's wgmma reads
      handoff_signal(W::kBReady, base);
      JAX_MLA_TRACE_AT(pair + 1, 3);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float alpha_r = m_b[e] == m_run[e] ? 1.f : wide_alpha(m_run[e], m_b[e]);
        l_run[e] = l_run[e] * alpha_r + sum_b[e];
        m_run[e] = m_b[e];
      }
      wgmma_wait<0>();  // P_A V_A: block A's tiles 4-8 are read
      fence_registers(o);
      JAX_MLA_TRACE_AT(pair + 1, 4);
      // ---- O_R to m_B's frame, P_B V_B; block A + 2's tiles 4-8 issued while it runs ----
      // (Issued before P_B V_B, one thread's ~560 cycles of TMA issue delayed the warpgroup's P_B V_B and
      // with it block B + 2's refill: the first version of this experiment, NOTES.md.)
      wide_rescale<true>(o, alpha_ab);
      if (b_partial) wide64_zero_rows<1>(kb1, last_rows, tid);
      wgmma_fence();
      wide64_pv<MT, 1>(o, pb, has_b ? kb1 : kb0);
      wgmma_commit();
      JAX_MLA_TRACE_AT(pair + 1, 5);
      if constexpr (kProducer) {
        if (next_a) release(0, 1);
      } else if constexpr (kGather) {
        if (next_a) wide64_gather_half<1, kPageBoxes>(p, maps, u, base, 0, blk_a + 2, pages_a, tid);
      } else if (tid == 0 && next_a) {
        wide64_load_tiles<4, 9>(maps, base, 0, wide64_block_rows(p, maps, u, blk_a + 2, pages_a));
      }
      JAX_MLA_TRACE_AT(pair + 1, 6);
      wgmma_wait<0>();
      fence_registers(o);
      fence_fragments(pb);
      JAX_MLA_TRACE_AT(pair + 1, 7);
      if constexpr (kProducer) {  // block B's tiles 4-8 are read
        if (next_b) release(1, 1);
      } else if constexpr (kGather) {
        if (next_b) wide64_gather_half<1, kPageBoxes>(p, maps, u, base, 1, blk_b + 2, pages_b, tid);
      } else if (tid == 0 && next_b) {
        wide64_load_tiles<4, 9>(maps, base, 1, wide64_block_rows(p, maps, u, blk_b + 2, pages_b));
      }
      JAX_MLA_TRACE_AT(pair + 1, 8);
      JAX_MLA_TRACE_AT(pair + 1, 9);
      wide64_scores<T, MT, kFp8, false, 0, W::TILES, kGather>(
          s, q_rope, base, next_b ? kb1 : q_panels, 1, parity ^ 1 ^ (kWalk ? walk.phase_a ^ walk.phase_b : 0), next_b);
      wgmma_commit();
      JAX_MLA_TRACE_AT(pair + 1, 10);
      JAX_MLA_TRACE_AT(pair + 1, 11);
    } else {
      // ---- block B: softmax against m_A, m_B out ----
      handoff_wait(W::kAReady, base, parity);
      JAX_MLA_TRACE_AT(pair + 1, 1);
      wgmma_wait<0>();  // this warpgroup's S of block B (see WG0's)
      fence_registers(s);
      float m_a[2], m_b[2], alpha_ab[2], sum_b[2] = {0.f, 0.f};
#pragma unroll
      for (int e = 0; e < 2; ++e) m_b[e] = m_a[e] = *stat_ptr(W::kMaxA, r[e]);
      if (has_b) {
#ifdef JAX_MLA_WIDE64_LEAN_SOFTMAX
        softmax_block_scaled<true>(s, mask(blk_b, key0 + W::BK), scale_log2, m_a, m_b, alpha_ab, sum_b);
#else
        softmax_block<true>(s, mask(blk_b, key0 + W::BK), m_a, m_b, alpha_ab, sum_b);
#endif
        wide_pack_p<MT>(s, pb);
      } else {
#pragma unroll
        for (int kk = 0; kk < W::KSTEPS; ++kk) pb[kk][0] = pb[kk][1] = pb[kk][2] = pb[kk][3] = 0u;
      }
      if (t4 == 0) {
#pragma unroll
        for (int e = 0; e < 2; ++e) *stat_ptr(W::kMaxB, r[e]) = m_b[e];
      }
      handoff_signal(W::kBReady, base);
      JAX_MLA_TRACE_AT(pair + 1, 2);
      // ---- O_R to m_B, then P_B V_B and P_A V_A back to back ----
      float alpha_r[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        alpha_r[e] = m_b[e] == m_run[e] ? 1.f : wide_alpha(m_run[e], m_b[e]);
        l_run[e] = l_run[e] * alpha_r[e] + sum_b[e];
        m_run[e] = m_b[e];
      }
      wide64_store_p(base + W::P1_OFF, pb, warp, lane);
      fence_proxy_async_shared();  // P_B reaches WG0's wgmma reads
      handoff_signal(W::kP1Ready, base);
      JAX_MLA_TRACE_AT(pair + 1, 3);
      wide_rescale<true>(o, alpha_r);
      if (b_partial) wide64_zero_rows<1>(kb1, last_rows, tid);
      // A partial block A is the unit's last (no block B): its rows past the range are zeroed before
      // P_B V_B, which then adds 0 times block A's half (see WG0's).
      if (a_partial) wide64_zero_rows<1>(kb0, last_rows, tid);
      wgmma_fence();
      wide64_pv<MT, 1>(o, pb, has_b ? kb1 : kb0);
      wgmma_commit();
      JAX_MLA_TRACE_AT(pair + 1, 4);
      handoff_wait(W::kP0Ready, base, parity);
      JAX_MLA_TRACE_AT(pair + 1, 5);
      wide64_pv_shared_p<MT, 1>(o, base + W::P0_OFF, kb0);
      wgmma_commit();
      wgmma_wait<1>();
      fence_fragments(pb);
      JAX_MLA_TRACE_AT(pair + 1, 6);
      if constexpr (kProducer) {  // block B's tiles 4-8 are read
        if (next_b) release(1, 1);
      } else if constexpr (kGather) {  // block B's tiles 4-8 are read
        if (next_b) wide64_gather_half<1, kPageBoxes>(p, maps, u, base, 1, blk_b + 2, pages_b, tid);
      } else if (tid == 0 && next_b) {  // block B's tiles 4-8 are read (fp8: block B + 2 whole goes in)
        const Wide64Rows b = wide64_block_rows(p, maps, u, blk_b + 2, pages_b);
        if constexpr (kFp8) {
          st_shared_u32(W::mask_addr(base, blk_b + 2), b.ok);
          wide64_load_raw(maps, base, 1, b);
        }
        wide64_load_tiles<kFp8 ? 8 : 4, 9>(maps, base, 1, b);
      }
      JAX_MLA_TRACE_AT(pair + 1, 7);
      wgmma_wait<0>();
      fence_registers(o);
      if constexpr (kFp8) {  // buffer 0's tiles 4-7 go to WG0 for block A + 2
        if (next_a) mbar_arrive(W::free_bar(base, 0));
      }
      JAX_MLA_TRACE_AT(pair + 1, 8);
      if constexpr (kProducer) {  // block A's tiles 4-8 are read
        if (next_a) release(0, 1);
      } else if constexpr (kGather) {  // block A's tiles 4-8 are read
        if (next_a) wide64_gather_half<1, kPageBoxes>(p, maps, u, base, 0, blk_a + 2, pages_a, tid);
      } else if (tid == 0 && next_a) {  // block A's tiles 4-8 are read (fp8: its rope tile; the raw latent is in)
        wide64_load_tiles<kFp8 ? 8 : 4, 9>(maps, base, 0, wide64_block_rows(p, maps, u, blk_a + 2, pages_a));
      }
      JAX_MLA_TRACE_AT(pair + 1, 9);
      if constexpr (kFp8) {
        if (next_b) convert(1, parity ^ 1, true, parity);
      }
      // (Buffer 1's barriers are a turn behind buffer 0's after a walk's unit of an odd block count.)
      wide64_scores<T, MT, kFp8, false, 0, W::TILES, kGather>(
          s, q_rope, base, next_b ? kb1 : q_panels, 1, parity ^ 1 ^ (kWalk ? walk.phase_a ^ walk.phase_b : 0), next_b);
      wgmma_commit();
      JAX_MLA_TRACE_AT(pair + 1, 10);
      JAX_MLA_TRACE_AT(pair + 1, 11);
    }
  }

  // fp8: with an odd block count WG1 converted one block fewer than WG0, so it passes one named
  // barrier of its own fewer. Without this one more, racecheck reports the epilogue's row sums (read
  // after a barrier of both warpgroups) as hazards: it stops counting that barrier as ordering them
  // once the warpgroups' barrier counts differ (as in the narrow fp8 body: NOTES.md, "twelfth session").
  if constexpr (kFp8 && HALF == 1) {
    if (num_blocks & 1) named_barrier_sync(W::kWarpgroup0 + 1, 128);
  }
  JAX_MLA_TRACE_AT(0, 4);
  auto sum_ptr = [&](int half, int row) { return stat_ptr(W::kSum0 + half, row); };
  if constexpr (kWalk) {
    // The rows go to key buffer 1, so that buffer 0 takes the next unit's block 0 while they are copied out.
    stage_two_halves<T, HALF>(p, u, h0, hb, rows, r, t4, l_run, m_run, o, scales.out, sum_ptr, W::kBoth,
                              W::kThreads, kb1);
    hooks->read_next();  // the next unit (its record was stored before this unit's first barrier above)
    wgmma_wait<0>();  // the last trip's thrown-away S: the query panels are read
    fence_proxy_async_shared();  // the rows reach the bulk copies' reads
    named_barrier_sync(W::kBoth, W::kThreads);
    if constexpr (HALF == 0) {
      // Every MMA of the unit is done: the query panels, P1 (P_B of the last pair, read) and buffer 0 take
      // the next unit's query tile and block 0, and this warpgroup goes on into it.
      hooks->load_next_first();
      // As many barriers of its own as warpgroup 1 passes (its one after the copies): racecheck stops counting
      // a barrier of both as ordering the row sums once the warpgroups' counts of their own barriers differ
      // (its hazards on this walk without it; NOTES.md, "twelfth session"). Its threads wait for thread 0's
      // loads here instead of at the query tile's barrier.
      named_barrier_sync(W::kWarpgroup0, 128);
    } else {
      copy_staged_rows<T>(p, u, h0, hb, rows, kb1, tid);  // rows <= 64: warps 0 and 1
      if (__shfl_sync(0xffffffffu, warp, 0) == 3) hooks->find_after_next();  // (uniform: see the walk kernel)
      named_barrier_sync(W::kWarpgroup0 + 1, 128);  // the copies have read buffer 1
      hooks->load_next_second();
    }
  } else {
    store_two_halves<T, HALF>(p, u, h0, hb, rows, r, t4, l_run, m_run, o, scales.out, sum_ptr, W::kBoth, W::kThreads,
                              base + W::K_OFF, threadIdx.x);
    wgmma_wait<0>();  // the last trip's thrown-away S (its query-panel reads) before the exit
  }
  static_assert(kStagedRowsBytes <= W::BUF, "the staged rows fit in a key buffer");
  JAX_MLA_TRACE_AT(0, 5);
  JAX_MLA_TRACE_END();
  return walk.after(num_blocks);
}

// The lossy e4m3 x e4m3 body for an fp8 ckv (mla_wide64_e4m3_sm90.cuh, included below).
template <typename T, int HALF>
__device__ __forceinline__ void wide64_warpgroup_e4m3(const Problem& p, const KeyTensorMaps& maps, const Unit& u, int h0,
                                                      int hb, uint32_t base);

// The producer warpgroup of gathered blocks (kProducer; threads 256-383): every block of the unit, each
// half (wide64_gather_half) once the warpgroup that read it last in the block two before has released it
// (empty_bar). The halves go in the order the consumers free them and first need them: blocks 0 and 1 whole,
// then a pair's A + 2 half 0 (WG0 frees it after P_A V_A), B + 2 half 1 (WG1, after P_B V_B), A + 2 half 1 (WG1,
// after P_A V_A), B + 2 half 0 (WG0, after P_B V_B). Each half's copies arrive on its tiles' barriers as the
// consumers' gathers did (128 arrivals a tile, 132 on tile 0 with the key mask). The page ids of a pair are read
// a pair ahead, while the producer waits.
template <bool kPageBoxes>
__device__ __forceinline__ void wide64_gather_producer(const Problem& p, const KeyTensorMaps& maps, const Unit& u,
                                                       uint32_t base) {
  using W = Wide64Sm90;
  const int tid = threadIdx.x - W::kThreads;
  const int num_blocks = __shfl_sync(0xffffffffu, (u.range_end - u.kv_begin + W::BK - 1) / W::BK, 0);
  auto pages = [&](int blk) { return blk < num_blocks ? wide64_key_page(p, u, blk, tid) : Wide64Pages{}; };
  Wide64Pages ga = pages(0), gb = pages(1);
  Wide64Pages na = pages(2), nb = pages(3);
  if (num_blocks > 0) {
    wide64_gather_half<0, kPageBoxes>(p, maps, u, base, 0, 0, ga, tid);
    wide64_gather_half<1, kPageBoxes>(p, maps, u, base, 0, 0, ga, tid);
  }
  if (num_blocks > 1) {
    wide64_gather_half<0, kPageBoxes>(p, maps, u, base, 1, 1, gb, tid);
    wide64_gather_half<1, kPageBoxes>(p, maps, u, base, 1, 1, gb, tid);
  }
#pragma unroll 1
  for (int a = 2; a < num_blocks; a += 2) {
    const int b = a + 1;
    const bool has_b = b < num_blocks;
    // Blocks a and b replace blocks a - 2 and b - 2: the (a / 2 - 1)-th release of each half.
    const int parity = ((a >> 1) - 1) & 1;
    ga = na;
    gb = nb;
    na = pages(a + 2);
    nb = pages(b + 2);
    mbar_wait(W::empty_bar(base, 0, 0), parity);
    wide64_gather_half<0, kPageBoxes>(p, maps, u, base, 0, a, ga, tid);
    if (has_b) {
      mbar_wait(W::empty_bar(base, 1, 1), parity);
      wide64_gather_half<1, kPageBoxes>(p, maps, u, base, 1, b, gb, tid);
    }
    mbar_wait(W::empty_bar(base, 0, 1), parity);
    wide64_gather_half<1, kPageBoxes>(p, maps, u, base, 0, a, ga, tid);
    if (has_b) {
      mbar_wait(W::empty_bar(base, 1, 0), parity);
      wide64_gather_half<0, kPageBoxes>(p, maps, u, base, 1, b, gb, tid);
    }
  }
  cp_async_wait_all();  // leave nothing in flight behind an exited thread
}

// The producer warpgroup of a block read by TMA (above 16 heads; -DJAX_MLA_WIDE64_NO_TMA_PRODUCER: none, an A/B
// switch; NOTES.md, "fifty-third" to "fifty-fifth session"): lane 0 of its warp 0 issues every box of the unit,
// blocks 0 and 1 whole, then each half once the warpgroup that read it last has released it (as
// wide64_gather_producer), so that no consumer warp spends the ~470-600 cycles a half's boxes take to issue between
// two of its warpgroup's wgmmas. A block's key mask goes with its first half; its page ids are read a pair ahead.
// Warps 1-3 leave at once; warp 0's lanes all wait (mbar_wait ends in a __syncwarp).
__device__ __forceinline__ void wide64_tma_producer(const Problem& p, const KeyTensorMaps& maps, const Unit& u,
                                                    uint32_t base) {
  using W = Wide64Sm90;
  if (__shfl_sync(0xffffffffu, (int)threadIdx.x >> 5, 0) != W::kThreads / 32) return;
  const bool issuer = threadIdx.x == W::kThreads;
  const int num_blocks = __shfl_sync(0xffffffffu, (u.range_end - u.kv_begin + W::BK - 1) / W::BK, 0);
  auto pages = [&](int blk) {
    return issuer && blk < num_blocks ? wide64_block_pages(p, maps, u, blk) : Wide64Pages{};
  };
  // Half `half` of block blk into buffer blk % 2 (tiles 0-3 with the key mask, or 4-8).
  auto issue = [&](int blk, int half, const Wide64Rows& b, bool mask) {
    if (!issuer) return;
    if (mask) st_shared_u32(W::mask_addr(base, blk), b.ok);
    if (half == 0) {
      wide64_load_tiles<0, 4>(maps, base, blk & 1, b);
    } else {
      wide64_load_tiles<4, 9>(maps, base, blk & 1, b);
    }
  };
  Wide64Pages na = pages(2), nb = pages(3);
  for (int blk = 0; blk < 2 && blk < num_blocks; ++blk) {
    const Wide64Rows b = wide64_block_rows(p, maps, u, blk, pages(blk));
    issue(blk, 0, b, true);
    issue(blk, 1, b, false);
  }
#pragma unroll 1
  for (int a = 2; a < num_blocks; a += 2) {
    const int b = a + 1;
    const bool has_b = b < num_blocks;
    const int parity = ((a >> 1) - 1) & 1;  // the (a / 2 - 1)-th release of each half
    const Wide64Rows ra = wide64_block_rows(p, maps, u, a, na);
    const Wide64Rows rb = has_b ? wide64_block_rows(p, maps, u, b, nb) : Wide64Rows{};
    na = pages(a + 2);
    nb = pages(b + 2);
    // Half `half` of block blk once its last reader has released it.
    auto refill = [&](int blk, int half, const Wide64Rows& rows, bool mask) {
      mbar_wait(W::empty_bar(base, blk & 1, half), parity);
      issue(blk, half, rows, mask);
    };
    // In the order the halves are freed: A's left (WG0 after P_A V_A), A's right (WG1 after P_A V_A, which
    // it multiplies first in the P_A-first schedule), B's right (WG1 after P_B V_B), B's left (WG0 after
    // P_B V_B). With -DJAX_MLA_WIDE64_NO_PA_FIRST WG1 multiplies P_B V_B first: B's right before A's right.
    refill(a, 0, ra, true);
    if (W::kPaFirstSchedule) refill(a, 1, ra, false);
    if (has_b) refill(b, 1, rb, true);
    if (!W::kPaFirstSchedule) refill(a, 1, ra, false);
    if (has_b) refill(b, 0, rb, false);
  }
}

// The body: barriers, then the two warpgroups (threads 0-255; the caller has sent the rest away, but for
// the producer warpgroup of kProducer: threads 256-383).
// kE4m3: an fp8 ckv's units multiply on e4m3 (Problem::fp8_products; its own kernel instance).
template <typename T, int kCache, bool kE4m3 = false, bool kGather = false, bool kPageBoxes = false,
          bool kProducer = false>
__device__ __forceinline__ void attend_unit_wide64(const Problem& p, const KeyTensorMaps& maps, const Unit& u, int h0,
                                                   int hb, uint32_t base) {
  using W = Wide64Sm90;
  static_assert(!kProducer || (kCache == kCacheAsQuery && !kE4m3), "the producer warpgroup: a 16-bit cache");
  if (threadIdx.x == 0) {
    // A tile's fill: one arrival with its bytes (TMA), or each gathering thread's when its copies land
    // (kGather; tile 0 also one from each warp that wrote mask bits).
    for (int b = 0; b < 2; ++b)
      for (int t = 0; t < W::TILES; ++t) mbar_init(W::full_bar(base, b, t), kGather ? (t == 0 ? 132 : 128) : 1);
    for (int h = 0; h < 4; ++h) mbar_init(W::handoff_bar(base, h), 128);
    if constexpr (kCache == kCacheFp8Ckv) {
      for (int b = 0; b < 2; ++b) mbar_init(W::free_bar(base, b), 128);
    }
    if constexpr (kProducer) {
      for (int b = 0; b < 2; ++b)
        for (int h = 0; h < 2; ++h) mbar_init(W::empty_bar(base, b, h), 128);
    }
    mbar_init_fence();
  }
  if constexpr (kProducer) {
    __syncthreads();  // all three warpgroups
    if (__shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0) == 2) {
      release_registers<40>();
      if constexpr (kGather) {
        wide64_gather_producer<kPageBoxes>(p, maps, u, base);
      } else {
        wide64_tma_producer(p, maps, u, base);
      }
      return;
    }
    claim_registers<232>();
  } else {
    named_barrier_sync(W::kBoth, W::kThreads);
  }
  if constexpr (kE4m3) {
    static_assert(kCache == kCacheFp8Ckv, "the e4m3 body reads an fp8 ckv");
    if (__shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0) == 0) {
      wide64_warpgroup_e4m3<T, 0>(p, maps, u, h0, hb, base);
    } else {
      wide64_warpgroup_e4m3<T, 1>(p, maps, u, h0, hb, base);
    }
    return;
  }
  if (__shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0) == 0) {
    wide64_warpgroup<T, kCache, 0, kGather, kPageBoxes, false, void, kProducer>(p, maps, u, h0, hb, base);
  } else {
    wide64_warpgroup<T, kCache, 1, kGather, kPageBoxes, false, void, kProducer>(p, maps, u, h0, hb, base);
  }
}

}  // namespace cuda
}  // namespace jax_mla

#include "mla_wide64_e4m3_sm90.cuh"
