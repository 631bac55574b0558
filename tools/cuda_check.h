// CHECK(call): a CUDA runtime call in the tools' host code; on an error, prints where and what, and exits with
// JAX_MLA_CHECK_EXIT (1 unless the includer defines it: the driver exits 2 on such errors, as on bad input, to
// keep them apart from failed checks).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#ifndef JAX_MLA_CHECK_EXIT
#define JAX_MLA_CHECK_EXIT 1
#endif

#define CHECK(x)                                                                                \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(JAX_MLA_CHECK_EXIT);                                                            \
    }                                                                                           \
  } while (0)
