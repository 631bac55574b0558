// The unit kernel: one work unit of the plan (one query tile of one request
// against one kv range) with an online softmax in float32.
//
// The hot loops of a work unit are register-tiled small matrix products over
// GCC / Clang vector types (Vec<W>, simd.h), written once for any vector width W.
// On x86-64 Linux with GCC the unit kernel is compiled three times, for
// AVX-512 (W = 16), AVX2+FMA (W = 8) and baseline SSE2 (W = 4), and the loader
// picks the best one the CPU runs (function multiversioning); elsewhere the
// portable W = 4 build runs. The versions and the ifunc that picks among them
// stay inside this file: other files call the plain RunUnit at its end.
#include "unit_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"
#include "element_types.h"
#include "problem.h"
#include "simd.h"

#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__)
#define JAX_MLA_X86_MULTIVERSION 1
#else
#define JAX_MLA_X86_MULTIVERSION 0
#endif

namespace jax_mla {
namespace cpu {

// Converts keys [k0, k0 + n) of `request` into the scratch rows. Keys on an
// invalid page become zero rows marked not ok. Padding columns stay zero.
JAX_MLA_INLINE void LoadKeyBlock(const Problem& pb, int64_t request, int64_t k0, int64_t n,
                                 Scratch& sc) {
  const int64_t dc = pb.d_ckv, dr = pb.d_kpe;
  const int32_t* pages = pb.page_table + request * pb.max_pages;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t k = k0 + j;  // < capacity, so the page slot is in the table
    const int64_t page = pages[k / pb.page_size];
    float* ckv_row = sc.ckv_keys.data() + j * sc.dcp;
    float* kpe_row = sc.kpe_keys.data() + j * sc.drp;
    if (page < 0 || page >= pb.num_pages) {
      sc.key_ok[j] = 0;
      std::fill(ckv_row, ckv_row + dc, 0.0f);
      std::fill(kpe_row, kpe_row + dr, 0.0f);
    } else {
      sc.key_ok[j] = -1;
      const int64_t slot = page * pb.page_size + k % pb.page_size;
      ToFloat(pb.ckv_elem, pb.ckv + slot * dc * pb.ckv_bytes, dc, ckv_row, pb.ckv_scale);
      ToFloat(pb.kpe_elem, pb.kpe + slot * dr * pb.kpe_bytes, dr, kpe_row, pb.kpe_scale);
    }
  }
}

// Register tiles per vector width: scores are R rows x J keys of accumulators
// along the head dim (R * J a multiple of W, so they fold W at a time); the
// value product is R rows x C vectors of output columns. Sized to the target's
// registers: 32 zmm, 16 ymm, 16 xmm.
template <int W>
struct Tiles;
template <>
struct Tiles<16> {
  static constexpr int kScoreRows = 4, kScoreKeys = 4, kValueRows = 4, kValueCols = 4;
};
template <>
struct Tiles<8> {
  static constexpr int kScoreRows = 2, kScoreKeys = 4, kValueRows = 4, kValueCols = 2;
};
template <>
struct Tiles<4> {
  static constexpr int kScoreRows = 2, kScoreKeys = 2, kValueRows = 4, kValueCols = 2;
};

// acc[r][j] += lanes of q[r] * k[j] over `dims` (a multiple of W).
template <int W, int R, int J>
JAX_MLA_INLINE void DotTile(const float* q, int64_t q_stride, const float* k, int64_t k_stride,
                            int64_t dims, Vec<W> (&acc)[R * J]) {
  for (int64_t d = 0; d < dims; d += W) {
    Vec<W> kv[J];
    for (int j = 0; j < J; ++j) kv[j] = Load<W>(k + j * k_stride + d);
    for (int r = 0; r < R; ++r) {
      const Vec<W> qv = Load<W>(q + r * q_stride + d);
      for (int j = 0; j < J; ++j) acc[r * J + j] += qv * kv[j];
    }
  }
}

// Raw scores of query rows [r0, r0 + R) against block keys [j0, j0 + J):
// s[r, j] = q_nope[r] . ckv[j] + q_pe[r] . kpe[j].
template <int W, int R, int J>
JAX_MLA_INLINE void ScoreTile(Scratch& sc, int64_t r0, int64_t j0) {
  Vec<W> acc[R * J] = {};
  DotTile<W, R, J>(sc.q_nope.data() + r0 * sc.dcp, sc.dcp, sc.ckv_keys.data() + j0 * sc.dcp, sc.dcp,
                   sc.dcp, acc);
  DotTile<W, R, J>(sc.q_pe.data() + r0 * sc.drp, sc.drp, sc.kpe_keys.data() + j0 * sc.drp, sc.drp,
                   sc.drp, acc);
  float sums[R * J];
  if constexpr ((R * J) % W == 0) {
    for (int g = 0; g < R * J; g += W) Store<W>(sums + g, SumEach<W>(acc + g));
  } else {
    for (int a = 0; a < R * J; ++a) sums[a] = SumLanes<W>(acc[a]);
  }
  for (int r = 0; r < R; ++r) {
    std::memcpy(sc.probs.data() + (r0 + r) * kKeyBlock + j0, sums + r * J, J * sizeof(float));
  }
}

// acc[r0 + r, c0 + cols) = alpha[r] * acc + sum_{j < n} p[r, j] * ckv[j, c0 + cols)
// for R rows and C vectors of columns.
template <int W, int R, int C>
JAX_MLA_INLINE void ValueTile(Scratch& sc, int64_t r0, int64_t c0, int64_t n) {
  const int64_t dcp = sc.dcp;
  float* out = sc.acc.data() + r0 * dcp + c0;
  const float* p = sc.probs.data() + r0 * kKeyBlock;
  const float* v = sc.ckv_keys.data() + c0;
  Vec<W> a[R][C];
  for (int r = 0; r < R; ++r) {
    const float scale = sc.alpha[r0 + r];
    for (int c = 0; c < C; ++c) a[r][c] = Load<W>(out + r * dcp + c * W) * scale;
  }
  for (int64_t j = 0; j < n; ++j) {
    Vec<W> vv[C];
    for (int c = 0; c < C; ++c) vv[c] = Load<W>(v + j * dcp + c * W);
    for (int r = 0; r < R; ++r) {
      const float pr = p[r * kKeyBlock + j];
      for (int c = 0; c < C; ++c) a[r][c] += pr * vv[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) Store<W>(out + r * dcp + c * W, a[r][c]);
  }
}

// Online-softmax step of row r over the block's first `n` keys (the keys its
// token sees; key slots [n, nb) and bad pages are masked): turns the row's
// scores into probabilities relative to the new running max, and leaves the
// factor that rescales the row's accumulator in alpha[r].
template <int W>
JAX_MLA_INLINE void SoftmaxRow(const Problem& pb, Scratch& sc, int64_t r, int64_t n, int64_t nb) {
  float* s = sc.probs.data() + r * kKeyBlock;
  const int64_t slots = (nb + W - 1) / W * W;
  Mask<W> lane;
  for (int i = 0; i < W; ++i) lane[i] = i;
  const Vec<W> neg_inf = Splat<W>(kNegInf);
  Vec<W> vmax = neg_inf;
  Mask<W> nan = {};  // lanes where a score the row sees is NaN
  for (int64_t j = 0; j < slots; j += W) {
    Mask<W> ok;
    std::memcpy(&ok, sc.key_ok.data() + j, sizeof(ok));
    ok &= (lane + static_cast<int32_t>(j)) < (Mask<W>{} + static_cast<int32_t>(n));
    const Vec<W> x = Select<W>(ok, Load<W>(s + j) * pb.sm_scale, neg_inf);
    Store<W>(s + j, x);
    vmax = Select<W>(x > vmax, x, vmax);  // NaN never compares greater: caught below
    nan |= x != x;
  }
  float& row_max = sc.row_max[r];
  bool any_nan = false;
  for (int i = 0; i < W; ++i) any_nan |= nan[i] != 0;
  if (any_nan) {
    // A NaN score (NaN or inf in the query, or in a key the row sees) makes the row NaN, as the
    // reference's softmax does: NaN running max, sum and accumulator from here on.
    row_max = std::numeric_limits<float>::quiet_NaN();
    sc.row_sum[r] = row_max;
    sc.alpha[r] = row_max;
    std::fill(s, s + slots, 0.0f);
    return;
  }
  const float block_max = MaxLanes<W>(vmax);
  if (!(block_max > kNegInf)) {  // no key of the block counts for this row
    sc.alpha[r] = 1.0f;
    std::fill(s, s + slots, 0.0f);
    return;
  }
  float alpha = 1.0f;
  if (block_max > row_max) {
    alpha = std::exp(row_max - block_max);  // 0 on the row's first keys
    row_max = block_max;
  }
  Vec<W> vsum = Vec<W>{};
  for (int64_t j = 0; j < slots; j += W) {
    const Vec<W> e = Exp<W>(Load<W>(s + j) - row_max);  // masked: exp(-inf) = 0
    Store<W>(s + j, e);
    vsum += e;
  }
  sc.row_sum[r] = sc.row_sum[r] * alpha + SumLanes<W>(vsum);
  sc.alpha[r] = alpha;
}

// Keys of the current block that row r sees.
JAX_MLA_INLINE int64_t RowKeys(const Problem& pb, const Scratch& sc, int64_t r) {
  return sc.token_keys[r / pb.num_heads];
}

template <int W>
JAX_MLA_INLINE void RunUnitW(const Problem& pb, const Unit& u, Scratch& sc) {
  using T = Tiles<W>;
  constexpr int kSR = T::kScoreRows, kSJ = T::kScoreKeys, kVR = T::kValueRows, kVC = T::kValueCols;
  static_assert(kKeyBlock % kSJ == 0, "score tiles never run past the key slots");
  const int64_t h_n = pb.num_heads, dc = pb.d_ckv, dr = pb.d_kpe, dcp = sc.dcp;
  const int64_t rows = u.q_len * h_n;  // row = local token * H + head
  // The tile's query rows are contiguous in q_nope / q_pe; scratch rows are padded.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t src = u.q_start * h_n + r;
    ToFloat(pb.elem, pb.q_nope + src * dc * pb.elem_bytes, dc, sc.q_nope.data() + r * dcp);
    ToFloat(pb.elem, pb.q_pe + src * dr * pb.elem_bytes, dr, sc.q_pe.data() + r * sc.drp);
  }
  std::fill(sc.acc.data(), sc.acc.data() + rows * dcp, 0.0f);
  std::fill(sc.row_max.begin(), sc.row_max.begin() + rows, kNegInf);
  std::fill(sc.row_sum.begin(), sc.row_sum.begin() + rows, 0.0f);

  const int64_t key_stop = u.request < 0 ? u.kv_begin : u.KeyStop(u.q_len - 1);
  for (int64_t k0 = u.kv_begin; k0 < key_stop; k0 += kKeyBlock) {
    const int64_t nb = std::min(kKeyBlock, key_stop - k0);
    LoadKeyBlock(pb, u.request, k0, nb, sc);
    // Causal: earlier tokens see fewer keys, so within a run of rows the last
    // row sees the most.
    for (int64_t i = 0; i < u.q_len; ++i) {
      sc.token_keys[i] = std::clamp<int64_t>(u.KeyStop(i) - k0, 0, nb);
    }

    // Scores S[rows, keys] in register tiles. A tile's keys run to its last
    // row's count rounded up to whole tiles; the extra slots are masked below.
    int64_t r0 = 0;
    for (; r0 + kSR <= rows; r0 += kSR) {
      const int64_t n = RowKeys(pb, sc, r0 + kSR - 1);
      for (int64_t j0 = 0; j0 < n; j0 += kSJ) ScoreTile<W, kSR, kSJ>(sc, r0, j0);
    }
    for (; r0 < rows; ++r0) {
      const int64_t n = RowKeys(pb, sc, r0);
      for (int64_t j0 = 0; j0 < n; j0 += kSJ) ScoreTile<W, 1, kSJ>(sc, r0, j0);
    }

    for (int64_t r = 0; r < rows; ++r) SoftmaxRow<W>(pb, sc, r, RowKeys(pb, sc, r), nb);

    // acc = alpha * acc + P[rows, keys] . ckv[keys, :]. Columns outside: one
    // column strip of the block's values stays in L1 for all row tiles. Rows
    // that see no key of the block have alpha 1 and zero probabilities.
    int64_t c0 = 0;
    for (; c0 + kVC * W <= dcp; c0 += kVC * W) {
      int64_t v0 = 0;
      for (; v0 + kVR <= rows; v0 += kVR) {
        const int64_t n = RowKeys(pb, sc, v0 + kVR - 1);
        if (n > 0) ValueTile<W, kVR, kVC>(sc, v0, c0, n);
      }
      for (; v0 < rows; ++v0) {
        const int64_t n = RowKeys(pb, sc, v0);
        if (n > 0) ValueTile<W, 1, kVC>(sc, v0, c0, n);
      }
    }
    for (; c0 < dcp; c0 += W) {
      int64_t v0 = 0;
      for (; v0 + kVR <= rows; v0 += kVR) {
        const int64_t n = RowKeys(pb, sc, v0 + kVR - 1);
        if (n > 0) ValueTile<W, kVR, 1>(sc, v0, c0, n);
      }
      for (; v0 < rows; ++v0) {
        const int64_t n = RowKeys(pb, sc, v0);
        if (n > 0) ValueTile<W, 1, 1>(sc, v0, c0, n);
      }
    }
  }

  // Normalise and write: the final output, or a split's partial rows (the same type) for the merge.
  for (int64_t r = 0; r < rows; ++r) {
    const float sum = sc.row_sum[r];
    const bool any = !(sum == 0.0f);            // keys seen, or NaN (which stays NaN)
    const float inv = any ? 1.0f / sum : 0.0f;  // no key: zeros, never 0/0
    const float lse = any ? sc.row_max[r] + std::log(sum) : kNegInf;
    const float* acc = sc.acc.data() + r * dcp;
    const bool split = u.partial_row >= 0;
    const int64_t o = (split ? u.partial_row : u.q_start) * h_n + r;
    FromFloat(pb.elem, acc, inv, dc, (split ? pb.partial_o : pb.out) + o * dc * pb.elem_bytes);
    (split ? pb.partial_lse : pb.lse)[o] = lse;
  }
}

namespace {

// One entry point per target; the loader picks the best the CPU runs. Internal
// linkage: the multiversioned set and its resolver never leave this file.
#if JAX_MLA_X86_MULTIVERSION
__attribute__((target("arch=x86-64-v4"))) void RunUnitTargeted(const Problem& pb, const Unit& u,
                                                                Scratch& sc) {
  RunUnitW<16>(pb, u, sc);
}
__attribute__((target("arch=x86-64-v3"))) void RunUnitTargeted(const Problem& pb, const Unit& u,
                                                                Scratch& sc) {
  RunUnitW<8>(pb, u, sc);
}
__attribute__((target("default"))) void RunUnitTargeted(const Problem& pb, const Unit& u,
                                                         Scratch& sc) {
  RunUnitW<4>(pb, u, sc);
}
#else
void RunUnitTargeted(const Problem& pb, const Unit& u, Scratch& sc) { RunUnitW<4>(pb, u, sc); }
#endif

}  // namespace

void RunUnit(const Problem& pb, const Unit& u, Scratch& sc) { RunUnitTargeted(pb, u, sc); }

}  // namespace cpu
}  // namespace jax_mla
