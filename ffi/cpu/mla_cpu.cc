// CPU handler of jax_mla's paged MLA attention (absorbed form).
//
// It follows the host plan exactly as the CUDA kernel does (plan_layout.h):
// every work unit computes one query tile of one request against one kv range
// with an online softmax in float32, writing either the final output or a
// float32 partial; then every merge row combines the partials of a split tile
// by their LSEs. Running the plan this way on CPU means the planner's split and
// merge logic is exercised in CI, not only on the GPU.
//
// Robustness: the handler never reads out of bounds, whatever the device
// values. Page ids outside [0, P) contribute nothing, kv lengths are clipped to
// the page table's capacity, unknown requests see no keys, and plan rows that
// point outside the output or workspace are skipped.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "jax_mla/plan_layout.h"
#include "xla/ffi/api/ffi.h"

namespace jax_mla {
namespace {

namespace ffi = xla::ffi;

// The hot loops of a work unit are register-tiled small matrix products over
// GCC / Clang vector types (Vec<W> below), written once for any vector width W.
// On x86-64 Linux with GCC the unit kernel is compiled three times, for
// AVX-512 (W = 16), AVX2+FMA (W = 8) and baseline SSE2 (W = 4), and the loader
// picks the best one the CPU runs (function multiversioning); elsewhere the
// portable W = 4 build runs.
#if !defined(__GNUC__) && !defined(__clang__)
#error "jax_mla's CPU handler needs GCC or Clang (vector extensions)"
#endif
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__)
#define JAX_MLA_X86_MULTIVERSION 1
#else
#define JAX_MLA_X86_MULTIVERSION 0
#endif
// Inlined into each version of the unit kernel, so they vectorize for its target.
#define JAX_MLA_INLINE inline __attribute__((always_inline))

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Keys processed together: converted to float once, then reused by every query
// row of the unit (64 keys x 576 dims x 4 B = 144 KiB, at home in L2).
constexpr int64_t kKeyBlock = 64;

// Below this many multiply-adds per thread, starting a thread costs more than
// it saves.
constexpr int64_t kMinMacsPerThread = int64_t{1} << 19;
constexpr int kMaxThreads = 64;

// ---- element conversions (no dependency beyond the standard library) --------

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

enum class Elem { kF32, kBF16, kF16 };

inline int64_t ElemBytes(Elem e) { return e == Elem::kF32 ? 4 : 2; }

// n elements of type `e` at src -> float.
JAX_MLA_INLINE void ToFloat(Elem e, const void* src, int64_t n, float* dst) {
  switch (e) {
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

// n floats -> elements of type `e` at dst, scaled by `scale`.
JAX_MLA_INLINE void FromFloat(Elem e, const float* src, float scale, int64_t n, void* dst) {
  switch (e) {
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

// ---- the problem as the handler received it ---------------------------------

struct Problem {
  Elem elem;
  int64_t elem_bytes;
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
  float* partial_o;   // [Pp, H, Dc]
  float* partial_lse; // [Pp, H]

  int64_t Capacity() const { return max_pages * page_size; }
};

// A work unit decoded and bounds-checked.
struct Unit {
  int64_t request;      // -1 when outside the page table / kv_lens
  int64_t q_start, q_len;
  int64_t end_offset;   // e of the first token
  int64_t kv_start, kv_end;
  int64_t partial_row;  // < 0: direct output
  int64_t kv_len;       // device length, clipped to capacity (0 for bad requests)

  // One past the last key that local token i may read. A sane plan has
  // e - i >= 1; the clamp to kv_len keeps a bad one inside the page table.
  int64_t KeyEnd(int64_t i) const {
    const int64_t visible = kv_len - (end_offset - i) + 1;
    return std::min({kv_end, visible, kv_len});
  }
};

// Returns false for padding and for rows that would write out of bounds.
bool DecodeUnit(const Problem& pb, int64_t w, Unit* u) {
  const int32_t* row = pb.work + w * kWorkCols;
  u->q_len = row[kWorkQLen];
  if (u->q_len <= 0) return false;
  u->q_start = row[kWorkQStart];
  if (u->q_start < 0 || u->q_start + u->q_len > pb.num_tokens) return false;
  u->partial_row = row[kWorkPartialRow];
  if (u->partial_row >= 0 && u->partial_row + u->q_len > pb.num_partial_rows) return false;
  u->request = row[kWorkRequest];
  u->end_offset = row[kWorkQEndOffset];
  u->kv_start = std::max<int64_t>(row[kWorkKvStart], 0);
  u->kv_end = row[kWorkKvEnd] == kKvEndOpen ? std::numeric_limits<int64_t>::max() / 4
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
int64_t UnitKeys(const Unit& u) {
  return std::max<int64_t>(u.KeyEnd(u.q_len - 1) - u.kv_start, 0);
}

// ---- vectors -------------------------------------------------------------------

// Vectors pass by value only between always-inline helpers of one target, so
// GCC's note that their calling convention differs across targets is moot.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

// W floats as one value. GCC / Clang vector extensions lower it to the target's
// registers; each multiversioned entry point below picks the W of its target.
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

// ---- one work unit -----------------------------------------------------------

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
      ToFloat(pb.elem, pb.ckv + slot * dc * pb.elem_bytes, dc, ckv_row);
      ToFloat(pb.elem, pb.kpe + slot * dr * pb.elem_bytes, dr, kpe_row);
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

  const int64_t key_end = u.request < 0 ? u.kv_start : u.KeyEnd(u.q_len - 1);
  for (int64_t k0 = u.kv_start; k0 < key_end; k0 += kKeyBlock) {
    const int64_t nb = std::min(kKeyBlock, key_end - k0);
    LoadKeyBlock(pb, u.request, k0, nb, sc);
    // Causal: earlier tokens see fewer keys, so within a run of rows the last
    // row sees the most.
    for (int64_t i = 0; i < u.q_len; ++i) {
      sc.token_keys[i] = std::clamp<int64_t>(u.KeyEnd(i) - k0, 0, nb);
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

  // Normalise and write: the final output, or a float32 partial for the merge.
  for (int64_t r = 0; r < rows; ++r) {
    const float sum = sc.row_sum[r];
    const bool any = !(sum == 0.0f);            // keys seen, or NaN (which stays NaN)
    const float inv = any ? 1.0f / sum : 0.0f;  // no key: zeros, never 0/0
    const float lse = any ? sc.row_max[r] + std::log(sum) : kNegInf;
    const float* acc = sc.acc.data() + r * dcp;
    if (u.partial_row < 0) {
      const int64_t o = u.q_start * h_n + r;
      FromFloat(pb.elem, acc, inv, dc, pb.out + o * dc * pb.elem_bytes);
      pb.lse[o] = lse;
    } else {
      const int64_t o = u.partial_row * h_n + r;
      float* dst = pb.partial_o + o * dc;
      for (int64_t c = 0; c < dc; ++c) dst[c] = acc[c] * inv;
      pb.partial_lse[o] = lse;
    }
  }
}

// One entry point per target; the loader picks the best the CPU runs.
#if JAX_MLA_X86_MULTIVERSION
__attribute__((target("arch=x86-64-v4"))) void RunUnit(const Problem& pb, const Unit& u,
                                                        Scratch& sc) {
  RunUnitW<16>(pb, u, sc);
}
__attribute__((target("arch=x86-64-v3"))) void RunUnit(const Problem& pb, const Unit& u,
                                                        Scratch& sc) {
  RunUnitW<8>(pb, u, sc);
}
__attribute__((target("default"))) void RunUnit(const Problem& pb, const Unit& u, Scratch& sc) {
  RunUnitW<4>(pb, u, sc);
}
#else
void RunUnit(const Problem& pb, const Unit& u, Scratch& sc) { RunUnitW<4>(pb, u, sc); }
#endif

// ---- merging split tiles -----------------------------------------------------

void RunMerge(const Problem& pb, int64_t m, std::vector<float>& acc) {
  const int32_t* row = pb.merge + m * kMergeCols;
  const int64_t q_start = row[kMergeQStart], q_len = row[kMergeQLen];
  const int64_t base = row[kMergePartialRow], splits = row[kMergeNumSplits];
  if (q_len <= 0 || splits <= 0) return;
  if (q_start < 0 || q_start + q_len > pb.num_tokens) return;
  if (base < 0 || base + splits * q_len > pb.num_partial_rows) return;
  const int64_t h_n = pb.num_heads, dc = pb.d_ckv;
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
        std::fill(acc.begin(), acc.end(), std::numeric_limits<float>::quiet_NaN());
        FromFloat(pb.elem, acc.data(), 1.0f, dc, out);
        pb.lse[o] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      if (mx == kNegInf) {  // no split saw a key: zeros, never 0/0
        FromFloat(pb.elem, acc.data(), 1.0f, dc, out);
        pb.lse[o] = kNegInf;
        continue;
      }
      float total = 0.0f;
      for (int64_t j = 0; j < splits; ++j) {
        const int64_t p = (base + j * q_len + i) * h_n + h;
        const float w = std::exp(pb.partial_lse[p] - mx);
        if (w == 0.0f) continue;  // an empty split: its output row is not needed
        total += w;
        const float* src = pb.partial_o + p * dc;
        for (int64_t c = 0; c < dc; ++c) acc[c] += w * src[c];
      }
      FromFloat(pb.elem, acc.data(), 1.0f / total, dc, out);
      pb.lse[o] = mx + std::log(total);
    }
  }
}

// ---- threading ----------------------------------------------------------------

int MaxThreads() {
  if (const char* env = std::getenv("JAX_MLA_CPU_THREADS")) {
    const int n = std::atoi(env);
    if (n >= 1) return std::min(n, kMaxThreads);
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return std::clamp<int>(hw == 0 ? 1 : static_cast<int>(hw), 1, kMaxThreads);
}

int ThreadsFor(int64_t tasks, int64_t macs, int available) {
  const int64_t by_work = std::max<int64_t>(1, macs / kMinMacsPerThread);
  return static_cast<int>(
      std::max<int64_t>(1, std::min({int64_t{MaxThreads()}, int64_t{available}, tasks, by_work})));
}

// Threads to use: XLA's intra-op pool when the runtime gives us one (no thread
// creation per call, and XLA's own threading settings apply), else our own.
int AvailableThreads(ffi::ThreadPool& pool) {
  const int64_t n = pool.num_threads();
  return n > 0 ? static_cast<int>(std::min<int64_t>(n, kMaxThreads)) : MaxThreads();
}

// State shared with helper tasks. A helper that starts after the caller has
// finished (the pool was busy) finds `closed` set and leaves without touching
// the caller's stack; the caller waits only for helpers that got in before.
struct ForState {
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int running = 0;
  int next_tid = 1;
  bool closed = false;
};

// Runs body(task, thread) for task in [0, tasks) on up to `threads` threads,
// the caller included. Tasks are handed out one at a time in order: the planner
// sorts units longest first, so the stragglers are short. Helpers that never get
// to run (busy pool, thread start failure) simply leave their share to others, so
// this cannot deadlock even when the caller is itself a pool thread.
template <typename Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t tasks, int threads, const Body& body) {
  auto st = std::make_shared<ForState>();
  auto drain = [&body, tasks](ForState& s, int tid) {
    for (int64_t t = s.next.fetch_add(1); t < tasks; t = s.next.fetch_add(1)) body(t, tid);
  };
  auto helper = [st, &drain, threads]() {
    int tid;
    {
      std::lock_guard<std::mutex> lock(st->mu);
      if (st->closed || st->next_tid >= threads) return;
      tid = st->next_tid++;
      ++st->running;
    }
    drain(*st, tid);
    std::lock_guard<std::mutex> lock(st->mu);
    if (--st->running == 0) st->cv.notify_all();
  };
  std::vector<std::thread> own;
  const bool use_pool = pool.num_threads() > 0;
  for (int i = 1; i < threads; ++i) {
    if (use_pool) {
      auto task = helper;  // Schedule takes ownership of a copy
      pool.Schedule(std::move(task));
    } else {
      try {
        own.emplace_back(helper);
      } catch (const std::exception&) {
        break;
      }
    }
  }
  drain(*st, 0);
  {
    std::unique_lock<std::mutex> lock(st->mu);
    st->closed = true;
    st->cv.wait(lock, [&] { return st->running == 0; });
  }
  for (std::thread& t : own) t.join();
}

// ---- the handler -----------------------------------------------------------------

std::string ShapeStr(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

ffi::Error CheckRank(const char* name, ffi::AnyBuffer::Dimensions d, size_t rank) {
  if (d.size() != rank) {
    return ffi::Error::InvalidArgument(std::string(name) + " must have rank " + std::to_string(rank) +
                                       ", got shape " + ShapeStr(d));
  }
  return ffi::Error::Success();
}

ffi::Error Mismatch(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_mla paged attention (cpu): " + what);
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool& pool, ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe, ffi::AnyBuffer ckv,
                              ffi::AnyBuffer kpe, ffi::Buffer<ffi::S32> page_table,
                              ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> work,
                              ffi::Buffer<ffi::S32> merge, float sm_scale,
                              ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                              ffi::Result<ffi::Buffer<ffi::F32>> partial_o,
                              ffi::Result<ffi::Buffer<ffi::F32>> partial_lse) {
  const struct {
    const char* name;
    ffi::AnyBuffer::Dimensions dims;
    size_t rank;
  } ranks[] = {
      {"q_nope", q_nope.dimensions(), 3},     {"q_pe", q_pe.dimensions(), 3},
      {"ckv", ckv.dimensions(), 3},           {"kpe", kpe.dimensions(), 3},
      {"page_table", page_table.dimensions(), 2}, {"kv_lens", kv_lens.dimensions(), 1},
      {"work", work.dimensions(), 2},         {"merge", merge.dimensions(), 2},
      {"out", out->dimensions(), 3},          {"lse", lse->dimensions(), 2},
      {"partial_o", partial_o->dimensions(), 3}, {"partial_lse", partial_lse->dimensions(), 2},
  };
  for (const auto& r : ranks) {
    if (ffi::Error e = CheckRank(r.name, r.dims, r.rank); !e.success()) return e;
  }

  Problem pb;
  switch (q_nope.element_type()) {
    case ffi::F32: pb.elem = Elem::kF32; break;
    case ffi::BF16: pb.elem = Elem::kBF16; break;
    case ffi::F16: pb.elem = Elem::kF16; break;
    default: return Mismatch("q_nope must be float32, bfloat16 or float16");
  }
  for (ffi::DataType t : {q_pe.element_type(), ckv.element_type(), kpe.element_type(), out->element_type()}) {
    if (t != q_nope.element_type()) return Mismatch("q_pe, ckv, kpe and out must have q_nope's dtype");
  }
  pb.elem_bytes = ElemBytes(pb.elem);

  const auto qn = q_nope.dimensions(), qp = q_pe.dimensions();
  const auto kc = ckv.dimensions(), kr = kpe.dimensions();
  pb.num_tokens = qn[0];
  pb.num_heads = qn[1];
  pb.d_ckv = qn[2];
  pb.d_kpe = qp[2];
  pb.num_pages = kc[0];
  pb.page_size = kc[1];
  if (qp[0] != qn[0] || qp[1] != qn[1]) {
    return Mismatch("q_pe " + ShapeStr(qp) + " disagrees with q_nope " + ShapeStr(qn));
  }
  if (kc[2] != pb.d_ckv || kr[0] != kc[0] || kr[1] != kc[1] || kr[2] != pb.d_kpe) {
    return Mismatch("caches ckv " + ShapeStr(kc) + " / kpe " + ShapeStr(kr) +
                    " disagree with q_nope " + ShapeStr(qn) + " / q_pe " + ShapeStr(qp));
  }
  if (pb.page_size < 1) return Mismatch("page_size must be >= 1");
  if (work.dimensions()[1] != kWorkCols || merge.dimensions()[1] != kMergeCols) {
    return Mismatch("plan tables must be [W, 8] and [M, 4], got work " + ShapeStr(work.dimensions()) +
                    " and merge " + ShapeStr(merge.dimensions()));
  }
  const auto od = out->dimensions(), ld = lse->dimensions();
  const auto pod = partial_o->dimensions(), pld = partial_lse->dimensions();
  if (od[0] != qn[0] || od[1] != qn[1] || od[2] != qn[2] || ld[0] != qn[0] || ld[1] != qn[1]) {
    return Mismatch("out " + ShapeStr(od) + " / lse " + ShapeStr(ld) + " do not match q_nope " + ShapeStr(qn));
  }
  if (pod[1] != qn[1] || pod[2] != qn[2] || pld[0] != pod[0] || pld[1] != qn[1]) {
    return Mismatch("workspace partial_o " + ShapeStr(pod) + " / partial_lse " + ShapeStr(pld) +
                    " do not match q_nope " + ShapeStr(qn));
  }
  pb.max_pages = page_table.dimensions()[1];
  pb.num_requests = std::min<int64_t>(page_table.dimensions()[0], kv_lens.dimensions()[0]);
  pb.num_work = work.dimensions()[0];
  pb.num_merge = merge.dimensions()[0];
  pb.num_partial_rows = pod[0];
  pb.sm_scale = sm_scale;
  pb.q_nope = static_cast<const char*>(q_nope.untyped_data());
  pb.q_pe = static_cast<const char*>(q_pe.untyped_data());
  pb.ckv = static_cast<const char*>(ckv.untyped_data());
  pb.kpe = static_cast<const char*>(kpe.untyped_data());
  pb.page_table = page_table.typed_data();
  pb.kv_lens = kv_lens.typed_data();
  pb.work = work.typed_data();
  pb.merge = merge.typed_data();
  pb.out = static_cast<char*>(out->untyped_data());
  pb.lse = lse->typed_data();
  pb.partial_o = partial_o->typed_data();
  pb.partial_lse = partial_lse->typed_data();

  // Tokens no unit covers (padding) come out as zeros with LSE -inf; workspace
  // LSEs start at -inf so a split that a bad plan row skipped weighs nothing.
  const int64_t rows_total = pb.num_tokens * pb.num_heads;
  if (rows_total > 0) {
    std::memset(pb.out, 0, static_cast<size_t>(rows_total * pb.d_ckv * pb.elem_bytes));
    std::fill(pb.lse, pb.lse + rows_total, kNegInf);
  }
  std::fill(pb.partial_lse, pb.partial_lse + pb.num_partial_rows * pb.num_heads, kNegInf);

  // Live units, their size, and the work they amount to.
  std::vector<Unit> units;
  units.reserve(static_cast<size_t>(pb.num_work));
  int64_t max_q_len = 0, macs = 0;
  for (int64_t w = 0; w < pb.num_work; ++w) {
    Unit u;
    if (!DecodeUnit(pb, w, &u)) continue;
    units.push_back(u);
    max_q_len = std::max(max_q_len, u.q_len);
    macs += u.q_len * pb.num_heads * (UnitKeys(u) * (2 * pb.d_ckv + pb.d_kpe) + pb.d_ckv);
  }

  const int available = AvailableThreads(pool);
  const int unit_threads = ThreadsFor(static_cast<int64_t>(units.size()), macs, available);
  std::vector<Scratch> scratch;
  scratch.reserve(unit_threads);
  for (int t = 0; t < unit_threads; ++t) scratch.emplace_back(pb, max_q_len * pb.num_heads, max_q_len);
  ParallelFor(pool, static_cast<int64_t>(units.size()), unit_threads,
              [&](int64_t i, int tid) { RunUnit(pb, units[i], scratch[tid]); });

  // Merges read what the units wrote: only after the join above.
  int64_t merge_macs = 0;
  for (int64_t m = 0; m < pb.num_merge; ++m) {
    const int32_t* row = pb.merge + m * kMergeCols;
    merge_macs += std::max(row[kMergeQLen], 0) * int64_t{std::max(row[kMergeNumSplits], 0)} *
                  pb.num_heads * pb.d_ckv;
  }
  const int merge_threads = ThreadsFor(pb.num_merge, merge_macs, available);
  std::vector<std::vector<float>> merge_acc(merge_threads, std::vector<float>(pb.d_ckv));
  ParallelFor(pool, pb.num_merge, merge_threads,
              [&](int64_t m, int tid) { RunMerge(pb, m, merge_acc[tid]); });
  return ffi::Error::Success();
}

// No C++ exception may cross into XLA.
ffi::Error PagedAttentionCpu(ffi::ThreadPool pool, ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe, ffi::AnyBuffer ckv,
                             ffi::AnyBuffer kpe, ffi::Buffer<ffi::S32> page_table,
                             ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> work,
                             ffi::Buffer<ffi::S32> merge, float sm_scale,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                             ffi::Result<ffi::Buffer<ffi::F32>> partial_o,
                             ffi::Result<ffi::Buffer<ffi::F32>> partial_lse) {
  try {
    return PagedAttentionImpl(pool, q_nope, q_pe, ckv, kpe, page_table, kv_lens, work, merge, sm_scale, out,
                              lse, partial_o, partial_lse);
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jax_mla paged attention (cpu): ") + e.what());
  }
}

}  // namespace
}  // namespace jax_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaPagedAttentionCpu, jax_mla::PagedAttentionCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()                     // XLA's intra-op pool
                                  .Arg<xla::ffi::AnyBuffer>()                      // q_nope
                                  .Arg<xla::ffi::AnyBuffer>()                      // q_pe
                                  .Arg<xla::ffi::AnyBuffer>()                      // ckv
                                  .Arg<xla::ffi::AnyBuffer>()                      // kpe
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()          // page_table
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()          // kv_lens
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()          // work
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()          // merge
                                  .Attr<float>("sm_scale")
                                  .Ret<xla::ffi::AnyBuffer>()                      // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()          // lse
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()          // partial_o
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());        // partial_lse
