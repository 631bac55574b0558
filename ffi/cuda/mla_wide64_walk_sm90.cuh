// The 64-key body's walk: one block per worker (SM) and head block, running the plan's units of its
// worker one after another (an A/B build:
// -DJAX_MLA_WIDE64_WALK, mla_launch.cuh; off by default until it is measured: ffi/cuda/NOTES.md,
// "thirty-seventh session").
//
// Why. In waves a unit's fixed costs are the block's: after its loop, the epilogue (~2,400 cycles, ~5,400
// for the warp that waits for the row copies' reads), then the next block's start on the SM, its plan row,
// device length and page ids (three dependent round trips), its query tile (~3,500 cycles to issue by
// cp.async) and its first key blocks: 13,000-17,000 cycles from one unit's last pair to the next unit's
// first S on an SM (NOTES.md, "twentieth session"). FlashMLA's blocks walk their share of the batch, and
// its next query tile loads while the last unit's rows are written. Here, at a unit boundary:
// - the next unit's plan row and device length are read while the rows are staged (hooks.find_next);
// - its query tile goes in by TMA (nine boxes from one thread) as soon as the last S has read the query
//   panels and P_B has left P1, beside the row copies (hooks.queries_free);
// - the barriers are not initialised again: each unit starts in the phases the last one left
//   (Wide64Walk), so nothing waits for a re-initialisation.
// What stays serial: the row copies' reads of key buffer 0 (the staged rows) before the next unit's
// first blocks go in, then their page ids and boxes.
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

// The next unit of a worker's walk: the first row at or after `from` whose worker (kWorkWorker modulo the
// workers) is this one and which is not padding, started (start_unit: its plan row, and its device length
// requested); index >= num_work when none is left. A warp reads two columns of 32 rows a step and takes the
// first row of its ballot (every warp of the block reads the same rows and finds the same one); a row that
// start_unit refuses (another plan's) is passed over.
struct Wide64WalkNext {
  Unit unit;
  int index;
  __device__ __forceinline__ void find(const Problem& p, int from, int worker, int workers) {
    const int lane = threadIdx.x & 31;
    index = from;
    while (index < p.num_work) {
      const int i = index + lane;
      bool mine = false;
      if (i < p.num_work) {
        const int32_t* row = p.work + (size_t)i * kWorkCols;
        const int w = __ldg(row + kWorkWorker) % workers;
        mine = __ldg(row + kWorkQLen) > 0 && (w < 0 ? w + workers : w) == worker;
      }
      const unsigned found = __ballot_sync(0xffffffffu, mine);
      if (found == 0) {
        index += 32;
        continue;
      }
      index += __ffs(found) - 1;
      if (start_unit(p, index, unit)) return;
      ++index;
    }
  }
};

// The body's epilogue hooks (wide64_warpgroup, kWalk): every thread finds the next unit; thread 0 issues its
// query tile once the panels are free.
struct Wide64WalkHooks {
  const Problem& p;
  const QueryTensorMaps& q;
  Wide64WalkNext& next;
  int from, worker, workers, h0;
  uint32_t base;
  __device__ __forceinline__ void find_next() { next.find(p, from, worker, workers); }
  __device__ __forceinline__ void queries_free() {
    if (threadIdx.x == 0 && next.index < p.num_work) wide64_walk_load_queries(q, p, next.unit, h0, base);
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
  Wide64WalkNext next;
  next.find(p, 0, worker, workers);
  if (next.index >= p.num_work) return;
  if (threadIdx.x == 0) wide64_walk_load_queries(qmaps, p, next.unit, h0, base);
  const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);  // warp-uniform, as wgmma needs
  Wide64Walk walk = {0, 0, 0, 0, 0};
#pragma unroll 1
  for (;;) {
    Unit u = next.unit;
    const int index = next.index;
    finish_unit(p, u);
    // The blocks start on the box at or below the first key (a box lies in one page); an empty unit keeps
    // its start, so that it reads no page id (its start may lie past the page table's row).
    walk.key_lo = u.kv_begin;
    if (u.range_end > u.kv_begin) u.kv_begin &= ~(maps.box_rows - 1);
    Wide64WalkHooks hooks{p, qmaps, next, index + 1, worker, workers, h0, base};
    if (wg == 0) {
      walk = wide64_warpgroup<T, kCacheAsQuery, 0, false, false, true>(p, maps, u, h0, hb, base, walk, &hooks);
    } else {
      walk = wide64_warpgroup<T, kCacheAsQuery, 1, false, false, true>(p, maps, u, h0, hb, base, walk, &hooks);
    }
    if (next.index >= p.num_work) break;
    // The row copies have read key buffer 0 (their threads waited), and every barrier phase of the unit
    // has completed: the next unit's first blocks may go in.
    named_barrier_sync(W::kBoth, W::kThreads);
  }
#endif
}

}  // namespace cuda
}  // namespace jax_mla
