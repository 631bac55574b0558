// The merge step of the plan (merge.h): split tiles combined by their LSEs.
#include "merge.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"
#include "element_types.h"
#include "jax_mla/plan_layout.h"
#include "problem.h"

namespace jax_mla {
namespace cpu {

void RunMerge(const Problem& pb, int64_t m, std::vector<float>& scratch) {
  const int32_t* row = pb.merge + m * kMergeCols;
  const int64_t q_start = row[kMergeQStart], q_len = row[kMergeQLen];
  const int64_t base = row[kMergePartialRow], splits = row[kMergeNumSplits];
  if (q_len <= 0 || splits <= 0) return;
  if (q_start < 0 || q_start + q_len > pb.num_tokens) return;
  if (base < 0 || base + splits * q_len > pb.num_partial_rows) return;
  const int64_t h_n = pb.num_heads, dc = pb.d_ckv;
  float* acc = scratch.data();  // the merged row's sums
  float* src = acc + dc;        // a split's row, as float
  for (int64_t i = 0; i < q_len; ++i) {
    for (int64_t h = 0; h < h_n; ++h) {
      // Split j of local token i lives at partial row base + j * q_len + i.
      float mx = kNegInf;
      bool nan = false;
      for (int64_t j = 0; j < splits; ++j) {
        const float l = pb.partial_lse[(base + j * q_len + i) * h_n + h];
        mx = std::max(mx, l);
        nan |= l != l;
      }
      const int64_t o = (q_start + i) * h_n + h;
      char* out = pb.out + o * dc * pb.elem_bytes;
      if (nan) {  // a split's row is NaN: so is the merged row
        std::fill(acc, acc + dc, std::numeric_limits<float>::quiet_NaN());
        FromFloat(pb.elem, acc, 1.0f, dc, out);
        pb.lse[o] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      std::fill(acc, acc + dc, 0.0f);
      if (mx == kNegInf) {  // no split saw a key: zeros, never 0/0
        FromFloat(pb.elem, acc, 1.0f, dc, out);
        pb.lse[o] = kNegInf;
        continue;
      }
      float total = 0.0f;
      for (int64_t j = 0; j < splits; ++j) {
        const int64_t p = (base + j * q_len + i) * h_n + h;
        const float w = std::exp(pb.partial_lse[p] - mx);
        if (w == 0.0f) continue;  // an empty split: its output row is not needed
        total += w;
        ToFloat(pb.elem, pb.partial_o + p * dc * pb.elem_bytes, dc, src);
        for (int64_t c = 0; c < dc; ++c) acc[c] += w * src[c];
      }
      FromFloat(pb.elem, acc, 1.0f / total, dc, out);
      pb.lse[o] = mx + std::log(total);
    }
  }
}

}  // namespace cpu
}  // namespace jax_mla
