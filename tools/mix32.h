// mix32: a 32-bit integer hash (two multiply-xorshift rounds) for drawing test data and random rows on the
// device without a generator; the standalone driver and the probes share it.
#pragma once

#include <cstdint>

__host__ __device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}
