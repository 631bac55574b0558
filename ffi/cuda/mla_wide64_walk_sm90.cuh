// The 64-key body's walk: one block per worker (SM) and head block, running the plan's units of its
// worker one after another (mla_launch.cuh). Launched where the plan holds many units a worker (its rows at
// least kWalkFromRows a worker): through JAX it ran 264 x 2048 h128 (four units a worker) 2.7% faster than
// waves and 300 x U[1, 4096] h128 even, and the benchmark's shapes of one or two units a worker 1.3-3.2% slower,
// which stay in waves (ffi/cuda/NOTES.md, "thirty-seventh" to "forty-fifth session"). A/B builds:
// -DJAX_MLA_WIDE64_WALK (CMake JAX_MLA_WIDE64_WALK=ON) walks every call of a multiple of 64 heads on a 16-bit
// cache, -DJAX_MLA_WIDE64_NO_WALK none.
//
// Why. In waves a unit's fixed costs are the block's: after its loop, the epilogue (~2,400 cycles, ~5,400
// for the warp that waits for the row copies' reads), then the next block's start on the SM, its plan row,
// device length and page ids (three dependent round trips), its query tile (~3,500 cycles to issue by
// cp.async) and its first key blocks: 13,000-17,000 cycles from one unit's last pair to the next unit's
// first S on an SM (NOTES.md, "twentieth session"). FlashMLA's blocks walk their share of the batch, and
// its next query tile loads while the last unit's rows are written. Here, at a unit boundary:
// - nothing is read from global memory: the next unit (plan row, device length, page ids of its first four
//   blocks) was found at the boundary before (or at the kernel's start) by a warp that had nothing else to
//   do (Wide64WalkNext), and kept in shared memory;
// - the rows are staged in key buffer 1; once every MMA of the unit is done (the epilogue's second
//   barrier), warpgroup 0's thread 0 issues the next unit's query tile (TMA, nine boxes) and its block 0
//   into buffer 0, and warpgroup 0 goes straight on into the next unit: its first S waits only for those
//   boxes to land;
// - warpgroup 1 copies the rows out (warps 0 and 1), finds the unit after next (warp 3), waits for the
//   copies' reads of buffer 1, issues block 1 there and follows; warpgroup 0 first waits for it at the next
//   unit's m_B hand-off (rows written by TMA tensor stores from swizzled panels instead, each warpgroup
//   issuing its half of block 1 over its own panels, were no faster: NOTES.md, "forty-first session");
// - the barriers are not initialised again: each unit starts in the phases the last one left
//   (Wide64Walk), and between two epilogues the warpgroups meet only at mbarrier phases, so neither waits
//   for the other at the boundary.
// (The thirty-seventh session's walk read the next unit's plan row and device length in the epilogue and
// issued its first blocks after a barrier of both warpgroups behind the row copies: its boundary cost what
// a wave's does, ~15,000 cycles; NOTES.md, "thirty-eighth session".)
//
// Scope. A 16-bit cache read by TMA (pages of 32+ keys) and a head count that is a multiple of 64: every
// unit is then a full tile of one token's 64 heads (q_tile 1), which the 64-key body takes, and whose
// query rows are consecutive rows of q_nope / q_pe seen as [tokens x heads] (one box a panel). A unit
// that starts off a box (a split at a multiple of 32 on pages of 64+ keys, as PlanTarget.chunk_align = 32
// makes, or another planner's; the default target splits at multiples of 64) reads its first block from the
// box below its start and masks the keys before it (Wide64Walk::key_lo), so that no unit needs another
// body.
//
// Workers: the launch makes sm_count / head_blocks of them (at most one per unit), and block (w, head block)
// runs, in row order, the units whose kWorkWorker column (plan_layout.h) modulo the workers is w. The
// planner names the worker it balanced each unit for: a packed plan's (its rows ordered by their start on
// their worker, for blocks launched one per unit), or a round of its longest-first units forwards, the next
// backwards. With PlanTarget.num_workers = the SM count and one unit a worker (the GPU's default target)
// the walk's workers are the planner's; any other plan, or any value in the column, runs correctly, only
// less balanced.
#pragma once

#include "mla_wide64_sm90.cuh"

namespace jax_mla {
namespace cuda {

// TMA descriptors of the queries seen as 2-D tensors of rows (q_nope [tokens * heads, 512], q_pe
// [tokens * heads, 64]), boxes of 64 rows x 128 bytes in the 128-byte swizzle of the body's query panels
// (WideSm90::chunk_offset). Made on the host for every launch (mla_launch.cuh).
struct QueryTensorMaps {
  CUtensorMap nope;
  CUtensorMap pe;
  int enabled;
};

// The query tile of unit u (64 rows: one token's heads h0 .. h0 + 63) into the query panels (eight boxes
// of 64 dims) and P1's panel (the rope box), completing on query_bar. One thread issues it.
__device__ __forceinline__ void wide64_walk_load_queries(const QueryTensorMaps& q, const Problem& p, const Unit& u,
                                                         int h0, uint32_t base) {
  using W = Wide64Sm90;
  const int row = u.q_start * p.num_heads + h0;  // < tokens * heads < 2^31 (query_tensor_maps checks)
  const uint32_t bar = W::query_bar(base);
  mbar_arrive_expect_tx(bar, (W::TILES - 1) * W::QPANEL + W::ROWS * 128);
#pragma unroll
  for (int t = 0; t < W::TILES - 1; ++t) tma_load_2d(base + W::Q_OFF + t * W::QPANEL, &q.nope, 64 * t, row, bar);
  tma_load_2d(base + W::P1_OFF, &q.pe, 0, row, bar);
}

// The next unit of a worker's walk and what its first blocks need: the first row at or after `from` whose
// worker (kWorkWorker modulo the workers) is this one and which is not padding, finished (finish_unit: its
// device length read), its blocks on the box at or below its first key (key_lo), and the page ids of its
// blocks 0-3 (0 past its blocks); index >= num_work when none is left. One warp finds it: it reads two
// columns of 128 rows a trip (eight loads a lane in flight) and takes the first row of its ballots; a row
// that start_unit refuses (another plan's) is passed over. Every read is the plan's or the device lengths'
// or the page table's, none of them written by the kernel, so a unit can be found at any time before it
// runs: warp 3 of warpgroup 1 finds the unit after next while warpgroup 1's row copies drain
// (Wide64WalkHooks), and keeps it in shared memory (store / load: 20 words at kWalkRecordOff) until every
// thread reads it at the next epilogue.
struct Wide64WalkNext {
  Unit unit;
  int index;
  int key_lo;
  Wide64Pages pages[4];
  static constexpr int kWords = 20;
  static constexpr int kSteps = 4;  // find's rows a trip, in 32s

  __device__ __forceinline__ void find(const Problem& p, const KeyTensorMaps& maps, int from, int worker,
                                       int workers) {
    const int lane = threadIdx.x & 31;
    for (int k = 0; k < 4; ++k) pages[k] = Wide64Pages{{0, 0}};
    key_lo = 0;
    index = from;
    while (index < p.num_work) {
      // kSteps x 32 rows a trip, every load issued before the first is used: one round trip a trip, so that
      // a worker's first unit (about row `worker` of the planner's plans) and the scan past its last one
      // through the padding each cost one, not one per 32 rows (the walk's cost at one unit a worker:
      // NOTES.md, "forty-first session").
      int worker_of[kSteps], q_len[kSteps];
#pragma unroll
      for (int k = 0; k < kSteps; ++k) {
        const int i = index + 32 * k + lane;
        worker_of[k] = 0, q_len[k] = 0;
        if (i < p.num_work) {
          const int32_t* row = p.work + (size_t)i * kWorkCols;
          worker_of[k] = __ldg(row + kWorkWorker);
          q_len[k] = __ldg(row + kWorkQLen);
        }
      }
      int first = -1;
#pragma unroll
      for (int k = kSteps - 1; k >= 0; --k) {
        const int w = worker_of[k] % workers;
        const unsigned found = __ballot_sync(0xffffffffu, q_len[k] > 0 && (w < 0 ? w + workers : w) == worker);
        if (found != 0) first = 32 * k + __ffs(found) - 1;
      }
      if (first < 0) {
        index += 32 * kSteps;
        continue;
      }
      index += first;
      if (start_unit(p, index, unit)) {
        finish_unit(p, unit);
        // The blocks start on the box at or below the first key (a box lies in one page); an empty unit keeps
        // its start, so that it reads no page id (its start may lie past the page table's row).
        key_lo = unit.kv_begin;
        if (unit.range_end > unit.kv_begin) unit.kv_begin &= ~(maps.box_rows - 1);
        const int blocks = num_blocks();
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (k < blocks) pages[k] = wide64_block_pages(p, maps, unit, k);
        }
        return;
      }
      ++index;
    }
  }
  __device__ __forceinline__ void store(uint32_t at) const {
    const int w[kWords] = {unit.request,     unit.q_start,     unit.q_len,       unit.q_end_offset, unit.partial_row,
                           unit.kv_len,      unit.kv_begin,    unit.kv_stop,     unit.range_end,    index,
                           key_lo,           pages[0].page[0], pages[0].page[1], pages[1].page[0],  pages[1].page[1],
                           pages[2].page[0], pages[2].page[1], pages[3].page[0], pages[3].page[1],  0};
#pragma unroll
    for (int i = 0; i < kWords; i += 4) st_shared_v4(at + 4 * i, make_uint4(w[i], w[i + 1], w[i + 2], w[i + 3]));
  }
  __device__ __forceinline__ void load(uint32_t at) {
    int w[kWords];
#pragma unroll
    for (int i = 0; i < kWords; i += 4) {
      const uint4 v = ld_shared_v4(at + 4 * i);
      w[i] = (int)v.x, w[i + 1] = (int)v.y, w[i + 2] = (int)v.z, w[i + 3] = (int)v.w;
    }
    unit = Unit{w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8]};
    index = w[9];
    key_lo = w[10];
#pragma unroll
    for (int k = 0; k < 4; ++k) pages[k] = Wide64Pages{{w[11 + 2 * k], w[12 + 2 * k]}};
  }
  __device__ __forceinline__ int num_blocks() const {
    return (unit.range_end - unit.kv_begin + Wide64Sm90::BK - 1) / Wide64Sm90::BK;
  }
};
// The walk's shared memory: the 64-key body's, then the record of the unit after next.
constexpr int kWalkRecordOff = (Wide64Sm90::BYTES + 15) & ~15;
constexpr int kWalkSmemBytes = kWalkRecordOff + 4 * Wide64WalkNext::kWords + 1024 - 16;  // room to align the base
static_assert(kWalkSmemBytes <= 227 * 1024, "one block per SM must fit");

// Block blk (0 or 1) of unit n whole (its nine tiles) into buffer blk, with its key mask. One thread issues it.
__device__ __forceinline__ void wide64_walk_load_block(const Problem& p, const KeyTensorMaps& maps,
                                                       const Wide64WalkNext& n, int blk, uint32_t base) {
  using W = Wide64Sm90;
  const Wide64Rows b = wide64_block_rows(p, maps, n.unit, blk, n.pages[blk]);
  st_shared_u32(W::mask_addr(base, blk), b.ok);
  wide64_load_tiles<0, W::TILES>(maps, base, blk, b);
}

// The body's hooks at a unit's end (wide64_warpgroup, kWalk). `next` holds the unit the body runs (its
// pages of blocks 2 and 3 are read in the prologue) until read_next, after the epilogue's first barrier,
// fills it with the next one from the record. After the second barrier (every MMA of the unit done, the
// rows staged in key buffer 1), warpgroup 0 issues the next unit's query tile and block 0 (buffer 0 is
// free) and goes straight on into it; warpgroup 1 copies the rows out, finds the unit after next (warp 3),
// waits for the copies' reads, issues block 1 into buffer 1 and follows.
struct Wide64WalkHooks {
  const Problem& p;
  const KeyTensorMaps& maps;
  const QueryTensorMaps& q;
  Wide64WalkNext& next;
  int worker, workers, h0;
  uint32_t base;
  __device__ __forceinline__ uint32_t record() const { return base + kWalkRecordOff; }
  __device__ __forceinline__ bool has_next() const { return next.index < p.num_work; }
  __device__ __forceinline__ void read_next() { next.load(record()); }
  // Warpgroup 0, thread 0.
  __device__ __forceinline__ void load_next_first() {
    if (threadIdx.x != 0 || !has_next()) return;
    wide64_walk_load_queries(q, p, next.unit, h0, base);
    if (next.num_blocks() > 0) wide64_walk_load_block(p, maps, next, 0, base);
  }
  // Warp 3 of warpgroup 1 (a warp-wide call): the unit after next, into the record (read at the next
  // unit's epilogue, after its first barrier, which this warp passes only after the store).
  __device__ __forceinline__ void find_after_next() {
    if (!has_next()) return;
    Wide64WalkNext after;
    after.find(p, maps, next.index + 1, worker, workers);
    if ((threadIdx.x & 31) == 0) after.store(record());
  }
  // Warpgroup 1, thread 0, once the row copies have read key buffer 1.
  __device__ __forceinline__ void load_next_second() {
    if (threadIdx.x != 128 || !has_next()) return;
    if (next.num_blocks() > 1) wide64_walk_load_block(p, maps, next, 1, base);
  }
};

template <typename T>
__global__ void __launch_bounds__(Wide64Sm90::kThreads, 1)
    mla_attention_wide64_walk_kernel(const Problem p, const __grid_constant__ KeyTensorMaps maps,
                                     const __grid_constant__ QueryTensorMaps qmaps) {
#ifdef JAX_MLA_HAS_WGMMA
  using W = Wide64Sm90;
  extern __shared__ __align__(16) char smem[];  // aligned to 1024 below
  allow_dependent_launch();  // the merge kernel may be scheduled as blocks retire
  JAX_MLA_BLOCK_TRACE_SCOPE(0);
  uint32_t base = smem_addr(smem);
  base += (1024 - (base & 1023)) & 1023;  // the 128-byte swizzle's atoms are 1024-byte aligned
  const int workers = gridDim.x / p.head_blocks, worker = blockIdx.x / p.head_blocks;
  const int h0 = (blockIdx.x - worker * p.head_blocks) * kRowsPerTile;
  const int hb = min(kRowsPerTile, p.num_heads - h0);
  if (threadIdx.x == 0) {
    for (int b = 0; b < 2; ++b)
      for (int t = 0; t < W::TILES; ++t) mbar_init(W::full_bar(base, b, t), 1);
    for (int h = 0; h < 4; ++h) mbar_init(W::handoff_bar(base, h), 128);
    mbar_init(W::query_bar(base), 1);
    mbar_init_fence();
  }
  named_barrier_sync(W::kBoth, W::kThreads);
  // The first unit, found by every warp (the same one), its query tile and its first two blocks; the unit
  // after it into the record.
  Wide64WalkNext next;
  next.find(p, maps, 0, worker, workers);
  if (next.index >= p.num_work) return;
  const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);  // warp-uniform, as wgmma needs
  Wide64WalkHooks hooks{p, maps, qmaps, next, worker, workers, h0, base};
  hooks.load_next_first();  // (the hooks' `next` is the first unit here)
  hooks.load_next_second();
  // A warp-uniform condition ptxas can see (from lane 0): the find's loop under a branch on threadIdx.x made
  // it serialise every wgmma of the kernel (C7520).
  if (__shfl_sync(0xffffffffu, (int)threadIdx.x >> 5, 0) == 7) hooks.find_after_next();
  Wide64Walk walk = {0, 0, 0, 0, 0};
#pragma unroll 1
  for (;;) {
    const Unit u = next.unit;
    walk.key_lo = next.key_lo;
    // The warpgroups part at a unit's end (warpgroup 0 goes on while warpgroup 1 copies rows) and meet
    // again at the next epilogue's barriers; every contact in between is an mbarrier's phase, which the walk
    // carries.
    if (wg == 0) {
      walk = wide64_warpgroup<T, kCacheAsQuery, 0, false, false, true>(p, maps, u, h0, hb, base, walk, &hooks);
    } else {
      walk = wide64_warpgroup<T, kCacheAsQuery, 1, false, false, true>(p, maps, u, h0, hb, base, walk, &hooks);
    }
    if (next.index >= p.num_work) break;
  }
#endif
}

}  // namespace cuda
}  // namespace jax_mla
