// The merge step of the plan: combines the float32 partials of a query tile
// that the planner split over several kv ranges, weighting them by their LSEs.
// Runs after every work unit has finished.
#pragma once

#include <cstdint>
#include <vector>

#include "problem.h"

namespace jax_mla {
namespace cpu {

// Merges plan row `m` into out / lse; `scratch` is 2 d_ckv floats of per-thread
// scratch (the sums, a split's row). Rows that point outside the output or
// workspace are skipped.
void RunMerge(const Problem& pb, int64_t m, std::vector<float>& scratch);

}  // namespace cpu
}  // namespace jax_mla
