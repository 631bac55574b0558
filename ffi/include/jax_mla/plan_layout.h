// The plan contract: the layout of the host plan as the kernels read it, and the
// rules both sides share. Its Python twin is jax_mla/plan_layout.py (the same
// names; tests/test_plan_layout.py checks that the values agree). The planners
// (ffi/planner/, jax_mla/planner.py) write exactly these columns.
//
// The plan is two int32 tables with fixed (bucketed) row counts:
//
//   work  [W, kWorkCols]  one row per work unit: a tile of <= q_tile query tokens
//                         of one request against one kv range of that request.
//   merge [M, kMergeCols] one row per query tile whose kv was split: where its
//                         split partials live and how many there are.
//
// Rows with q_len == 0 are padding and must be skipped.
//
// Key visibility. A query token whose offset from the end of its request's
// query block is `e` (the last token has e = 1) sees keys [0, kv_len - e + 1),
// where kv_len is read from the device `kv_lens` at run time and clipped to the
// page table's capacity (max_pages * page_size). This is causal masking aligned
// to the end; decode (one token, e = 1) sees all kv_len keys.
//
// A unit covers keys [kv_start, kv_end) intersected with each token's visible
// range. kv_end == kKvEndOpen means "to the end of the visible range": the
// last split of every request is open so that a plan made for lengths L stays
// valid for any device lengths >= L (and it is simply emptier for shorter ones).
//
// A unit with partial_row < 0 writes its tokens' outputs and LSEs directly.
// Otherwise it writes float32 partial outputs / LSEs for its q_len tokens to
// workspace rows partial_row .. partial_row + q_len - 1, and the merge row of its
// tile combines them: split j of a tile with base b and q_len n stores local
// token i at row b + j * n + i.
//
// Workers. The planner balances the units over `workers` = PlanTarget.num_workers x units_per_worker /
// head blocks slots (on a GPU one per SM and head block) and names each unit's slot in kWorkWorker. Blocks
// launched one per unit ignore it (the hardware hands them to SMs in row order, which is why a packed plan's
// rows are ordered by their start on their worker); the 64-key body's walk (mla_wide64_walk_sm90.cuh) runs
// on each of its blocks the units whose worker, modulo the blocks' count, is that block's, in row order. So
// any value is safe; the planner's keep the walk's blocks as balanced as the plan.
//
// LSE convention everywhere (partials and the op's output): natural log of
// sum_k exp(sm_scale * q.k); -inf when no key is visible, and then the output
// row is zero.
#pragma once

#include <cstdint>

namespace jax_mla {

enum WorkCol : int {
  kWorkRequest = 0,    // request index into page_table / kv_lens
  kWorkQStart = 1,     // first query token (row of q_nope / q_pe / out)
  kWorkQLen = 2,       // tokens in this unit (<= plan q_tile); 0 = padding
  kWorkQEndOffset = 3, // e of the unit's first token; token i has e - i
  kWorkKvStart = 4,    // first key of the split
  kWorkKvEnd = 5,      // one past the last key, or kKvEndOpen
  kWorkPartialRow = 6, // -1: write out/lse directly; else workspace base row
  kWorkWorker = 7,     // the worker the planner placed the unit on, in [0, workers): see below
  kWorkCols = 8,
};

enum MergeCol : int {
  kMergeQStart = 0,     // first query token of the tile
  kMergeQLen = 1,       // tokens in the tile; 0 = padding
  kMergePartialRow = 2, // base workspace row b of split 0
  kMergeNumSplits = 3,  // number of splits (>= 2)
  kMergeCols = 4,
};

constexpr int32_t kKvEndOpen = 0x7fffffff;

// Query rows (tokens x heads) one work unit holds: a unit takes
// q_tile = max(1, kRowsPerTile / num_heads) tokens of one request, and with more
// heads than rows the CUDA kernel spreads one token's heads over
// ceil(num_heads / kRowsPerTile) blocks.
constexpr int kRowsPerTile = 64;

// The rule above, written once for every C++ / CUDA user (jax_mla/plan_layout.py mirrors it).
constexpr int64_t QTile(int64_t num_heads) { return num_heads >= kRowsPerTile ? 1 : kRowsPerTile / num_heads; }
constexpr int64_t HeadBlocks(int64_t num_heads) { return (num_heads + kRowsPerTile - 1) / kRowsPerTile; }

// The walk (mla_wide64_walk_sm90.cuh: a 16-bit cache at a multiple of kRowsPerTile heads, one block per worker
// and head block running its units): the CUDA launch takes it where the plan has at least kWalkFromRows rows a
// worker (SMs / head blocks), and there the planner deals the units to the least loaded worker.
constexpr int kWalkFromRows = 6;

// The walk's rule on the plan's shape, the one place the launch (mla_launch.cuh) and both planners
// (ffi/planner/plan_mla.cc, jax_mla/planner.py: walks_units) read it: a multiple of kRowsPerTile heads and
// at least kWalkFromRows plan rows for each of `workers` (SMs / head blocks). The launch also needs what a
// plan does not say: a 16-bit cache on pages of 32 keys or more. The planners deal by least load wherever
// this holds, also for an fp8 cache or small pages; there the kernel runs in waves, which ignore a unit's
// worker, so the deal costs nothing but its host time.
constexpr bool WalksUnits(int64_t num_heads, int64_t plan_rows, int64_t workers) {
  return num_heads % kRowsPerTile == 0 && plan_rows >= (int64_t)kWalkFromRows * workers;
}

// Page sizes: powers of two from 1 to kMaxPageSize.
constexpr int kMaxPageSize = 256;

}  // namespace jax_mla
