// Vector helpers of the unit kernel: W floats as one value through GCC / Clang
// vector extensions, written once for any vector width W (4, 8 or 16); each
// multiversioned entry point of unit_kernel.cc instantiates them for its
// target's W. Everything here is always inlined, so it compiles to the
// instructions of the target that inlines it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#include "common.h"

#if !defined(__GNUC__) && !defined(__clang__)
#error "jax_mla's CPU handler needs GCC or Clang (vector extensions)"
#endif

// Vectors pass by value only between always-inline helpers of one target, so
// GCC's note that their calling convention differs across targets is moot.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace jax_mla {
namespace cpu {

// W floats as one value. GCC / Clang vector extensions lower it to the target's
// registers; each multiversioned entry point of unit_kernel.cc picks the W of its
// target.
template <int W>
struct VecOf {
  typedef float type __attribute__((vector_size(W * sizeof(float))));
  typedef int32_t mask __attribute__((vector_size(W * sizeof(int32_t))));
};
template <int W>
using Vec = typename VecOf<W>::type;
template <int W>
using Mask = typename VecOf<W>::mask;  // lanes of all ones (true) or zeros

template <int W>
JAX_MLA_INLINE Vec<W> Load(const float* p) {
  Vec<W> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int W>
JAX_MLA_INLINE void Store(float* p, const Vec<W>& v) {
  std::memcpy(p, &v, sizeof(v));
}

template <int W>
JAX_MLA_INLINE Vec<W> Splat(float x) {
  return Vec<W>{} + x;
}

// mask ? a : b, lane by lane.
template <int W>
JAX_MLA_INLINE Vec<W> Select(const Mask<W>& mask, const Vec<W>& a, const Vec<W>& b) {
  return (Vec<W>)((mask & (Mask<W>)a) | (~mask & (Mask<W>)b));
}

// Lane i of the result is lane kIndex[i] of x ++ y (0 <= kIndex < 2W).
// __builtin_shufflevector is Clang's and only GCC >= 12's; __builtin_shuffle
// is GCC's since 4.7.
template <int W, int... kIndex>
JAX_MLA_INLINE Vec<W> Shuffle(const Vec<W>& x, const Vec<W>& y) {
  static_assert(sizeof...(kIndex) == W, "one index per lane");
#if defined(__clang__)
  return __builtin_shufflevector(x, y, kIndex...);
#else
  return __builtin_shuffle(x, y, Mask<W>{kIndex...});
#endif
}

// Lane i of the result is lane (i + shift) % W of v.
template <int W, int kShift, size_t... I>
JAX_MLA_INLINE Vec<W> Rotate(const Vec<W>& v, std::index_sequence<I...>) {
  return Shuffle<W, static_cast<int>((I + kShift) % W)...>(v, v);
}

// Sum / max of the lanes, folded in halves (a fixed order, whatever the data).
template <int W, int kHalf = W / 2>
JAX_MLA_INLINE float SumLanes(const Vec<W>& v) {
  if constexpr (kHalf == 0) {
    return v[0];
  } else {
    return SumLanes<W, kHalf / 2>(v + Rotate<W, kHalf>(v, std::make_index_sequence<W>{}));
  }
}

template <int W, int kHalf = W / 2>
JAX_MLA_INLINE float MaxLanes(const Vec<W>& v) {
  if constexpr (kHalf == 0) {
    return v[0];
  } else {
    const Vec<W> r = Rotate<W, kHalf>(v, std::make_index_sequence<W>{});
    return MaxLanes<W, kHalf / 2>(Select<W>(v > r, v, r));
  }
}

// Lane i of x.y's fold at block size b: lanes are cut into blocks of b; even
// blocks come from x, odd ones from y, and each adds two neighbouring blocks of
// its source. One step halves the lanes each input vector occupies.
constexpr int FoldLane(int w, int b, int i, bool upper) {
  const int block = i / b, pos = i % b;
  return (block % 2 ? w : 0) + (block / 2) * 2 * b + pos + (upper ? b : 0);
}

template <int W, int B, size_t... I>
JAX_MLA_INLINE Vec<W> FoldPair(const Vec<W>& x, const Vec<W>& y, std::index_sequence<I...>) {
  return Shuffle<W, FoldLane(W, B, static_cast<int>(I), false)...>(x, y) +
         Shuffle<W, FoldLane(W, B, static_cast<int>(I), true)...>(x, y);
}

// Reverses the low log2(W) bits of i.
constexpr int BitReverse(int w, int i) {
  int r = 0;
  for (int b = 1; b < w; b <<= 1) r = (r << 1) | ((i & b) ? 1 : 0);
  return r;
}

// v[0..W) -> one vector whose lane i is the lane sum of v[i]: W sums for
// W - 1 adds (plus shuffles) instead of W separate folds. The pairwise folds
// leave the sums in bit-reversed order, so the inputs go in bit-reversed.
template <int W, int B = W / 2>
JAX_MLA_INLINE void FoldLevels(Vec<W>* v, int count) {
  if constexpr (B >= 1) {
    for (int k = 0; k < count / 2; ++k) {
      v[k] = FoldPair<W, B>(v[2 * k], v[2 * k + 1], std::make_index_sequence<W>{});
    }
    FoldLevels<W, B / 2>(v, count / 2);
  }
}

template <int W>
JAX_MLA_INLINE Vec<W> SumEach(const Vec<W>* acc) {
  Vec<W> v[W];
  for (int k = 0; k < W; ++k) v[k] = acc[BitReverse(W, k)];
  FoldLevels<W>(v, W);
  return v[0];
}

// exp(x) in float32, a few ulp: exp(x) = 2^n * exp(r), n = round(x / ln 2),
// |r| <= ln(2) / 2, exp(r) by its Taylor series to r^7 (truncation < 1e-8).
// x below -87 gives 0 (exp(-inf) = 0, and no subnormals), NaN stays NaN.
template <int W>
JAX_MLA_INLINE Vec<W> Exp(const Vec<W>& x) {
  const Vec<W> lo = Splat<W>(-87.0f), hi = Splat<W>(88.0f);
  Vec<W> xc = Select<W>(x > lo, x, lo);
  xc = Select<W>(xc < hi, xc, hi);
  // Adding 1.5 * 2^23 rounds x / ln 2 to an integer n held in the low mantissa bits.
  const Vec<W> magic = Splat<W>(12582912.0f);
  const Vec<W> t = xc * 1.44269504088896341f + magic;
  const Vec<W> n = t - magic;
  const Mask<W> n_int = (Mask<W>)t - (Mask<W>)magic;
  // ln 2 in two parts; n * 0.693359375 is exact.
  Vec<W> r = xc - n * 0.693359375f;
  r = r + n * 2.12194440054690583e-4f;
  Vec<W> p = Splat<W>(1.0f / 5040.0f);
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const Vec<W> two_n = (Vec<W>)((n_int + 127) << 23);
  const Vec<W> e = p * two_n;
  const Vec<W> zero = Vec<W>{};
  return Select<W>(x != x, x, Select<W>(x > lo, e, zero));
}

}  // namespace cpu
}  // namespace jax_mla
