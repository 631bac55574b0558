// One work unit of the plan on CPU: the per-thread scratch it runs in and its
// entry point. The kernel itself (unit_kernel.cc) is compiled once per vector
// target; callers see only the plain RunUnit below, so no other translation
// unit depends on how that target is chosen.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "problem.h"

namespace jax_mla {
namespace cpu {

// Keys processed together: converted to float once, then reused by every query
// row of the unit (64 keys x 576 dims x 4 B = 144 KiB, at home in L2).
constexpr int64_t kKeyBlock = 64;

// Rows, columns and key slots of the scratch are padded to this many floats
// (the widest W) with zeros, so the vector loops have no tails: a zero column
// adds nothing to a dot product, and padding keys are masked.
constexpr int64_t kPad = 16;
static_assert(kKeyBlock % kPad == 0, "key slots are a whole number of vectors");

inline int64_t Padded(int64_t n) { return (n + kPad - 1) / kPad * kPad; }

// A float array whose data starts on a cache line.
class AlignedFloats {
 public:
  explicit AlignedFloats(int64_t n) : buf_(static_cast<size_t>(n + 16), 0.0f) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(buf_.data());
    data_ = buf_.data() + ((64 - a % 64) % 64) / sizeof(float);
  }
  float* data() { return data_; }
  const float* data() const { return data_; }

 private:
  std::vector<float> buf_;
  float* data_;
};

// Per-thread buffers, sized once per call for the largest unit. Row r of a
// unit is local token r / H, head r % H.
struct Scratch {
  int64_t dcp, drp;            // padded d_ckv, d_kpe: row strides
  AlignedFloats ckv_keys;      // [kKeyBlock, dcp]  the block's keys, also its values
  AlignedFloats kpe_keys;      // [kKeyBlock, drp]
  std::vector<int32_t> key_ok; // [kKeyBlock] -1: page id valid, 0: not (a lane mask)
  AlignedFloats q_nope;        // [rows, dcp]
  AlignedFloats q_pe;          // [rows, drp]
  AlignedFloats acc;           // [rows, dcp]  unnormalised output
  AlignedFloats probs;         // [rows, kKeyBlock] scores, then probabilities
  std::vector<float> row_max;  // [rows] running max of the scaled scores
  std::vector<float> row_sum;  // [rows] running sum of exp(score - row_max)
  std::vector<float> alpha;    // [rows] this block's rescale of acc
  std::vector<int64_t> token_keys;  // [q_len] keys of the block each token sees

  Scratch(const Problem& pb, int64_t max_rows, int64_t max_q_len)
      : dcp(Padded(pb.d_ckv)),
        drp(Padded(pb.d_kpe)),
        ckv_keys(kKeyBlock * dcp),
        kpe_keys(kKeyBlock * drp),
        key_ok(kKeyBlock, 0),
        q_nope(max_rows * dcp),
        q_pe(max_rows * drp),
        acc(max_rows * dcp),
        probs(max_rows * kKeyBlock),
        row_max(max_rows),
        row_sum(max_rows),
        alpha(max_rows),
        token_keys(max_q_len) {}
};

// Runs work unit `u` with the fastest kernel version this CPU runs: writes its
// rows of out / lse, or its partial rows of partial_o / partial_lse.
void RunUnit(const Problem& pb, const Unit& u, Scratch& sc);

}  // namespace cpu
}  // namespace jax_mla
