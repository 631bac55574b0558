// Element types of the op's operands and their conversions to and from
// float32, which the CPU handler computes in. Kept apart from the kernel and
// needing only the standard library (and the inlining macro), so that a new
// element type's conversions go here; handler.cc maps XLA dtypes onto Elem.
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

namespace jax_mla {
namespace cpu {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// bfloat16 is the top half of a float32.
JAX_MLA_INLINE float Bf16ToFloat(uint16_t h) { return BitsFloat(uint32_t{h} << 16); }

JAX_MLA_INLINE uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a (quiet) NaN
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  // Round to nearest, ties to even, on the 16 dropped bits.
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

JAX_MLA_INLINE float F16ToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  // Every case is computed and one is chosen: no branches, so the conversion
  // loops vectorize (this runs once per cache element read).
  // Normal: re-bias the exponent from 15 to 127.
  const uint32_t normal = sign | ((exp + 112u) << 23) | (mant << 13);
  const uint32_t inf_nan = sign | 0x7f800000u | (mant << 13);
  // Zero / subnormal: mant * 2^-24, exact in float32 (and a normal float).
  const uint32_t small = sign | FloatBits(static_cast<float>(static_cast<int32_t>(mant)) * 5.9604644775390625e-8f);
  const uint32_t is_inf_nan = 0u - uint32_t{exp == 0x1f};  // all ones or zero
  const uint32_t is_small = 0u - uint32_t{exp == 0};
  return BitsFloat((inf_nan & is_inf_nan) | (small & is_small) | (normal & ~(is_inf_nan | is_small)));
}

JAX_MLA_INLINE uint16_t FloatToF16(float f) {
  uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u >= 0x7f800000u) {  // inf / NaN
    return sign | (u > 0x7f800000u ? 0x7e00u : 0x7c00u);
  }
  if (u >= 0x477ff000u) {  // >= 65520 rounds to infinity
    return sign | 0x7c00u;
  }
  if (u >= 0x38800000u) {  // normal half: re-bias 127 -> 15 and round to even
    u += 0xc8000fffu + ((u >> 13) & 1u);
    return sign | static_cast<uint16_t>(u >> 13);
  }
  // Subnormal half (or zero). Adding 0.5 makes the float32 ulp 2^-24, the half
  // subnormal step, so the hardware's round-to-even does the rounding for us;
  // the low mantissa bits are then the half's mantissa.
  const float r = BitsFloat(u) + 0.5f;
  return sign | static_cast<uint16_t>(FloatBits(r) - 0x3f000000u);
}

enum class Elem { kF32, kBF16, kF16, kF8E4M3 };

inline int64_t ElemBytes(Elem e) { return e == Elem::kF32 ? 4 : e == Elem::kF8E4M3 ? 1 : 2; }

// float8_e4m3fn (the FP8 cache): sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities,
// S.1111.111 is NaN; exponent 0 holds the subnormals m x 2^-9. All 256 values, decoded once:
// a table lookup is exact and cheaper than the bit arithmetic per element.
struct F8E4M3Table {
  float value[256];
  F8E4M3Table() {
    for (int b = 0; b < 256; ++b) {
      const int exp = (b >> 3) & 0xf, mant = b & 7;
      float v = exp == 0 ? static_cast<float>(mant) * (1.0f / 512.0f)
                         : BitsFloat(static_cast<uint32_t>(exp + 120) << 23 | static_cast<uint32_t>(mant) << 20);
      if (exp == 15 && mant == 7) v = BitsFloat(0x7fc00000u);
      value[b] = (b & 0x80) ? -v : v;
    }
  }
};

inline const float* F8E4M3Values() {
  static const F8E4M3Table table;
  return table.value;
}

// n elements of type `e` at src -> float. Only cache tensors are fp8, dequantized here (value =
// fp8 x scale); `scale` applies to fp8 only.
JAX_MLA_INLINE void ToFloat(Elem e, const void* src, int64_t n, float* dst, float scale = 1.0f) {
  switch (e) {
    case Elem::kF8E4M3: {
      const uint8_t* s = static_cast<const uint8_t*>(src);
      const float* values = F8E4M3Values();
      for (int64_t i = 0; i < n; ++i) dst[i] = values[s[i]] * scale;
      return;
    }
    case Elem::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case Elem::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(s[i]);
      return;
    }
    case Elem::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = F16ToFloat(s[i]);
      return;
    }
  }
}

// n floats -> elements of type `e` at dst, scaled by `scale`. (Outputs are never fp8.)
JAX_MLA_INLINE void FromFloat(Elem e, const float* src, float scale, int64_t n, void* dst) {
  switch (e) {
    case Elem::kF8E4M3:
      return;
    case Elem::kF32: {
      float* d = static_cast<float*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = src[i] * scale;
      return;
    }
    case Elem::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = FloatToBf16(src[i] * scale);
      return;
    }
    case Elem::kF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = FloatToF16(src[i] * scale);
      return;
    }
  }
}

}  // namespace cpu
}  // namespace jax_mla
