// Stages every attention body shares, written once: the query tile load, the
// page-id ring, the per-row key gather and the epilogue of a tile row. A body passes its shared-memory layout
// as a chunk-address function; the stage does the indexing, bounds and zero-fill.
// (The fp8 side of a key row is gather_key_row in mla_fp8.cuh; the wgmma body's
// TMA path for whole blocks is its own, in mla_wide_sm90.cuh.)
#pragma once

#include "mla_common.cuh"
#include "mla_fp8.cuh"

namespace jax_mla {
namespace cuda {

// Query tile: rows r < max_rows, r = (token u.q_start + r / hb, head h0 + r % hb),
// 72 16-byte chunks a row (64 of q_nope, 8 of q_pe) by cp.async; rows at or past
// `rows` are zero-filled. Threads tid = 0 .. nthreads - 1 share the work, a warp a row at a
// time: coalesced reads and one division by hb a row (a division per chunk took the wide body's
// warps ~9,000 cycles to issue a 64-row tile in a full wave, this ~3,500; NOTES.md, "third session").
// chunk(r, c): shared address of chunk c of row r in the body's layout.
template <typename T, int max_rows, int nthreads, typename ChunkAddr>
__device__ __forceinline__ void load_query_tile(const Problem& p, const Unit& u, int h0, int hb, int rows, int tid,
                                                ChunkAddr chunk) {
  const T* q_nope = static_cast<const T*>(p.q_nope);
  const T* q_pe = static_cast<const T*>(p.q_pe);
  static_assert(nthreads % 32 == 0 && kChunksPerKey <= 96, "a row per warp, three chunks per lane");
  const int warp = tid >> 5, lane = tid & 31;
  for (int r = warp; r < max_rows; r += nthreads / 32) {
    const bool live = r < rows;
    const size_t tok_head = live ? (size_t)(u.q_start + r / hb) * p.num_heads + h0 + r % hb : 0;
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const int c = lane + 32 * k;
      if (c >= kChunksPerKey) break;
      const void* src = c < 64 ? (const void*)(q_nope + tok_head * kDimCkv + c * 8)
                               : (const void*)(q_pe + tok_head * kDimKpe + (c - 64) * 8);
      cp_async16(chunk(r, c), src, live ? 16 : 0);
    }
  }
}

// Page-id ring: thread tid < BK fetches the page id of key kv_begin + blk * BK + tid
// (4-byte cp.async) into slot blk % RING, some blocks before the keys that need it,
// so the key gather never waits on a page-table read. Blocks past num_blocks and
// keys at or past key_bound are zero-filled and never used (the gather checks the
// key index first).
template <int BK, int RING>
__device__ __forceinline__ void fetch_page_ids(const Problem& p, const int* pt_row, int* page_ring, int kv_begin,
                                               int blk, int num_blocks, int key_bound, int tid) {
  if (tid < BK) {
    const int key = kv_begin + blk * BK + tid;
    const bool ok = blk < num_blocks && key < key_bound;
    const int* src = ok ? pt_row + (key >> p.log2_page_size) : p.page_table;
    cp_async4(smem_addr(page_ring + (blk % RING) * BK + tid), src, ok ? 4 : 0);
  }
}

// Key gather of block blk into ring stage `stage`: thread tid takes keys
// kl = pass * KPP + tid / 8 (PASSES passes of KPP keys: 32 for 256 threads, 16 for a warpgroup)
// and chunks tid % 8 + 8 i of each (gather_key_row). Keys past u.range_end or on a page id outside the cache
// are zero-filled (never read out of bounds) and flagged 0 in key_ok[stage * BK + kl].
// chunk(kl, c): shared address of chunk c of key kl's row in this stage.
template <int kCache, int BK, int RING, int PASSES, int KPP = 32, bool kL2Hint = true, typename KeyOk,
          typename ChunkAddr>
__device__ __forceinline__ void gather_key_block(const Problem& p, const Unit& u, const int* page_ring, KeyOk* key_ok,
                                                 int kv_begin, int blk, int stage, int tid, ChunkAddr chunk) {
  using F = CacheFormat<kCache>;
  const char* ckv = static_cast<const char*>(p.ckv);
  const char* kpe = static_cast<const char*>(p.kpe);
  const int sub = tid & 7;
  const int* pages = page_ring + (blk % RING) * BK;
#pragma unroll
  for (int pass = 0; pass < PASSES; ++pass) {
    const int kl = pass * KPP + (tid >> 3);
    const int key = kv_begin + blk * BK + kl;
    const int page = pages[kl];
    const bool ok = key < u.range_end && page_in_cache(p, page);
    const size_t slot = ok ? cache_row<size_t>(page, key, p.page_size) : 0;
    gather_key_row<kCache, kL2Hint>([&](int c) { return chunk(kl, c); }, ckv + slot * F::kCkvBytes,
                                    kpe + slot * F::kKpeBytes, sub, ok ? 16 : 0);
    if (sub == 0) key_ok[stage * BK + kl] = ok;
  }
}

// Epilogue of tile row r: O / l (l = 0: no key, zeros; a NaN l stays NaN) times out_scale (an fp8
// cache's scale, mla_fp8.cuh), stored in the query type, to out or, for a split unit, to its
// partial rows for the merge; and, where write_lse, the row's LSE (natural log; -inf with no key).
// m_log2 is the row's running max in base 2. The thread holds NPAIRS column pairs, pair(j) gives
// them: in groups of GROUP adjacent pairs, group i at col0 + 2 STRIDE i (the m16n8 layout: GROUP 1,
// pair j at col0 + 8 j; the narrow body's fp8 P V holds four adjacent columns, GROUP 2; STRIDE is in
// pairs, 4 GROUP unless given: the transposed fp8 body's pairs are 64 columns apart).
template <typename T, int NPAIRS, int GROUP = 1, int STRIDE = 4 * GROUP, typename Pair>
__device__ __forceinline__ void store_tile_row(const Problem& p, const Unit& u, int h0, int hb, int r, int col0,
                                               float l, float m_log2, float out_scale, bool write_lse, Pair pair) {
  const float inv = l != 0.f ? out_scale / l : 0.f;
  const float lse = l != 0.f ? (m_log2 + __log2f(l)) * kLn2 : -INFINITY;
  const int i = r / hb, h = h0 + r % hb;
  const UnitDest d = unit_dest(p, u, i, h);
  uint32_t* dst = reinterpret_cast<uint32_t*>(static_cast<T*>(d.out) + d.row * kDimCkv + col0);
#pragma unroll
  for (int j = 0; j < NPAIRS; ++j) {
    const float2 v = pair(j);
    dst[(j / GROUP) * STRIDE + j % GROUP] = pack2<T>(v.x * inv, v.y * inv);
  }
  if (write_lse) d.lse[d.row] = lse;
}

}  // namespace cuda
}  // namespace jax_mla
