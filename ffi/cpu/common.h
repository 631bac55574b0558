// What every file of the CPU handler shares: the inlining macro the unit
// kernel's helpers rely on, and -inf as a float constant.
#pragma once

#include <limits>

// Inlined into each version of the unit kernel, so they vectorize for its target.
#define JAX_MLA_INLINE inline __attribute__((always_inline))

namespace jax_mla {
namespace cpu {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

}  // namespace cpu
}  // namespace jax_mla
