// The problem as the CPU handler received it (operands, shapes, plan tables)
// and one work unit of the plan decoded and bounds-checked against it. Field
// names follow the CUDA side's Problem and Unit (ffi/cuda/mla_common.cuh);
// elem, elem_bytes, d_ckv, d_kpe and sm_scale are the CPU's own (the CUDA
// kernels are built for fixed dims and keep the scale in base 2).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "element_types.h"
#include "jax_mla/plan_layout.h"

namespace jax_mla {
namespace cpu {

struct Problem {
  Elem elem;             // queries and output
  int64_t elem_bytes;
  Elem ckv_elem, kpe_elem;  // the caches: elem, or kF8E4M3 with a scale
  int64_t ckv_bytes, kpe_bytes;
  float ckv_scale, kpe_scale;  // value = stored x scale (fp8); 1 otherwise
  int64_t num_tokens, num_heads, d_ckv, d_kpe;
  int64_t num_pages, page_size;
  int64_t num_requests;  // min(page_table rows, kv_lens entries)
  int64_t max_pages;     // page_table width
  int64_t num_work, num_merge, num_partial_rows;
  float sm_scale;

  const char* q_nope;  // [T, H, Dc]
  const char* q_pe;    // [T, H, Dr]
  const char* ckv;     // [P, ps, Dc]
  const char* kpe;     // [P, ps, Dr]
  const int32_t* page_table;  // [R, max_pages]
  const int32_t* kv_lens;     // [>= R]
  const int32_t* work;        // [W, kWorkCols]
  const int32_t* merge;       // [M, kMergeCols]

  char* out;          // [T, H, Dc], elem
  float* lse;         // [T, H]
  char* partial_o;    // [Pp, H, Dc], elem (a split's normalised rows, rounded as its output would be)
  float* partial_lse; // [Pp, H]

  int64_t Capacity() const { return max_pages * page_size; }
};

// A work unit decoded and bounds-checked.
struct Unit {
  int64_t request;       // -1 when outside the page table / kv_lens
  int64_t q_start, q_len;
  int64_t q_end_offset;  // e of the first token; token i has e - i
  int64_t kv_begin;      // first key of the split
  int64_t kv_stop;       // one past the split's last key (huge when open)
  int64_t partial_row;   // < 0: direct output
  int64_t kv_len;        // device length, clipped to capacity (0 for bad requests)

  // One past the last key that local token i may read. A sane plan has
  // e - i >= 1; the clamp to kv_len keeps a bad one inside the page table.
  // This is CUDA's min(kv_stop, visible_keys(u, i)) except that it is not
  // clamped at 0 (it may be negative): every caller clamps the count it derives.
  int64_t KeyStop(int64_t i) const {
    const int64_t visible = kv_len - (q_end_offset - i) + 1;
    return std::min({kv_stop, visible, kv_len});
  }
};

// Returns false for padding and for rows that would write out of bounds.
inline bool DecodeUnit(const Problem& pb, int64_t w, Unit* u) {
  const int32_t* row = pb.work + w * kWorkCols;
  u->q_len = row[kWorkQLen];
  if (u->q_len <= 0) return false;
  u->q_start = row[kWorkQStart];
  if (u->q_start < 0 || u->q_start + u->q_len > pb.num_tokens) return false;
  u->partial_row = row[kWorkPartialRow];
  if (u->partial_row >= 0 && u->partial_row + u->q_len > pb.num_partial_rows) return false;
  u->request = row[kWorkRequest];
  u->q_end_offset = row[kWorkQEndOffset];
  u->kv_begin = std::max<int64_t>(row[kWorkKvStart], 0);
  u->kv_stop = row[kWorkKvEnd] == kKvEndOpen ? std::numeric_limits<int64_t>::max() / 4
                                             : int64_t{row[kWorkKvEnd]};
  if (u->request < 0 || u->request >= pb.num_requests) {
    u->request = -1;
    u->kv_len = 0;  // unknown request: sees nothing, writes zeros
  } else {
    u->kv_len = std::clamp<int64_t>(pb.kv_lens[u->request], 0, pb.Capacity());
  }
  return true;
}

// Keys the unit reads in all: the last token sees the most.
inline int64_t UnitKeys(const Unit& u) {
  return std::max<int64_t>(u.KeyStop(u.q_len - 1) - u.kv_begin, 0);
}

}  // namespace cpu
}  // namespace jax_mla
