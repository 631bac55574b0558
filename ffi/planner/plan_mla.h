// The host planner in C++: the same plan as jax_mla/planner.py's NumPy code
// (`plan_mla_numpy`), bit for bit (tests/test_planner.py compares them), made in
// a few microseconds. It runs before every decode step, where NumPy's per-call
// overhead (~1 us per array operation, ~40 of them) is the whole cost.
// Exposed to Python by ffi/bindings/cpu_module.cc; the table layout is
// ffi/include/jax_mla/plan_layout.h.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "jax_mla/plan_layout.h"

namespace jax_mla {

struct PlanRequest {
  const int64_t* qo_lens = nullptr;  // [num_requests], >= 0 (checked here)
  const int64_t* kv_lens = nullptr;  // [num_requests]
  int64_t num_requests = 0;
  int64_t num_heads = 1;
  int64_t page_size = 1;
  int64_t num_tokens = -1;             // -1: sum(qo_lens)
  int64_t max_pages_per_request = -1;  // -1: unchecked
  // PlanTarget
  int64_t num_workers = 1;
  double units_per_worker = 1.0;
  int64_t min_chunk = 256;
  int64_t chunk_align = 64;
  int64_t unit_overhead = 128;
  int64_t min_work_units = 16;
  int64_t min_partial_rows = 16;
};

struct Plan {
  std::vector<int32_t> work;    // [num_work, kWorkCols]
  std::vector<int32_t> merge;   // [num_merge, kMergeCols]
  std::vector<int32_t> tokens;  // [num_tokens, 2]
  int64_t num_work = 0, num_merge = 0, num_tokens = 0, q_tile = 1, num_partial_rows = 0;
};

// A bad length or count: the message names the value, as the Python planner's does.
struct PlanError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

Plan plan_mla(const PlanRequest& req);

}  // namespace jax_mla
