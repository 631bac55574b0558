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
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "jax_mla/plan_layout.h"
#include "xla/ffi/api/ffi.h"

namespace jax_mla {
namespace {

namespace ffi = xla::ffi;

// The hot loops of a work unit use GCC / Clang vector types (Lanes below), so
// they vectorize for whatever the target has. On x86-64 Linux with GCC the unit
// kernel is also compiled for AVX2+FMA and AVX-512 and picked at load time;
// elsewhere the portable build runs.
#if !defined(__GNUC__) && !defined(__clang__)
#error "jax_mla's CPU handler needs GCC or Clang (vector extensions)"
#endif
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__)
#define JAX_MLA_MULTIVERSION \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define JAX_MLA_MULTIVERSION
#endif
// Inlined into each clone of the unit kernel, so they vectorize for its target.
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
  if (exp == 0x1f) {  // inf / NaN
    return BitsFloat(sign | 0x7f800000u | (mant << 13));
  }
  if (exp == 0) {  // zero / subnormal: mant * 2^-24, exact in float32
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  // Normal: re-bias the exponent from 15 to 127.
  return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
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

// ---- one work unit -----------------------------------------------------------

// Heads of one token handled together: each key row loaded serves all of them.
constexpr int kHeadGroup = 4;
// Floats per vector value (head dims run along the lanes).
constexpr int64_t kLanes = 16;

// Per-thread buffers, sized once per call for the largest unit.
struct Scratch {
  std::vector<float> keys;     // [kKeyBlock, Dc]  ckv rows: the values
  std::vector<float> kpe_rows; // [kKeyBlock, Dr]
  std::vector<uint8_t> key_ok; // [kKeyBlock] page id was valid
  std::vector<float> probs;    // [kHeadGroup, kKeyBlock] scores, then probabilities
  std::vector<float> q_nope;   // [rows, Dc]
  std::vector<float> q_pe;     // [rows, Dr]
  std::vector<float> acc;      // [rows, Dc]
  std::vector<float> row_max;  // [rows]
  std::vector<float> row_sum;  // [rows]

  Scratch(const Problem& pb, int64_t max_rows)
      : keys(kKeyBlock * pb.d_ckv),
        kpe_rows(kKeyBlock * pb.d_kpe),
        key_ok(kKeyBlock),
        probs(kHeadGroup * kKeyBlock),
        q_nope(max_rows * pb.d_ckv),
        q_pe(max_rows * pb.d_kpe),
        acc(max_rows * pb.d_ckv),
        row_max(max_rows),
        row_sum(max_rows) {}
};

// Converts keys [k0, k0 + n) of `request` into the scratch layouts. Keys on an
// invalid page become zero rows marked not ok.
JAX_MLA_INLINE void LoadKeyBlock(const Problem& pb, int64_t request, int64_t k0, int64_t n,
                                 Scratch& sc) {
  const int64_t dc = pb.d_ckv, dr = pb.d_kpe;
  const int32_t* pages = pb.page_table + request * pb.max_pages;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t k = k0 + j;  // < capacity, so the page slot is in the table
    const int64_t page = pages[k / pb.page_size];
    float* ckv_row = sc.keys.data() + j * dc;
    float* kpe_row = sc.kpe_rows.data() + j * dr;
    if (page < 0 || page >= pb.num_pages) {
      sc.key_ok[j] = 0;
      std::fill(ckv_row, ckv_row + dc, 0.0f);
      std::fill(kpe_row, kpe_row + dr, 0.0f);
    } else {
      sc.key_ok[j] = 1;
      const int64_t slot = page * pb.page_size + k % pb.page_size;
      ToFloat(pb.elem, pb.ckv + slot * dc * pb.elem_bytes, dc, ckv_row);
      ToFloat(pb.elem, pb.kpe + slot * dr * pb.elem_bytes, dr, kpe_row);
    }
  }
}

// kLanes floats as one value: GCC / Clang vector extensions lower it to
// whatever the target has (4 SSE, 2 AVX or 1 AVX-512 register).
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

JAX_MLA_INLINE void LoadLanes(Lanes& v, const float* p) { std::memcpy(&v, p, sizeof(Lanes)); }
JAX_MLA_INLINE void StoreLanes(float* p, const Lanes& v) { std::memcpy(p, &v, sizeof(Lanes)); }

// Sum of the lanes, as a tree: halves added as vectors, then four scalars.
typedef float Lanes8 __attribute__((vector_size(8 * sizeof(float))));
typedef float Lanes4 __attribute__((vector_size(4 * sizeof(float))));
static_assert(kLanes == 16, "SumLanes folds 16 lanes");

JAX_MLA_INLINE float SumLanes(const Lanes& v) {
  Lanes8 lo8, hi8;
  std::memcpy(&lo8, &v, sizeof(Lanes8));
  std::memcpy(&hi8, reinterpret_cast<const char*>(&v) + sizeof(Lanes8), sizeof(Lanes8));
  const Lanes8 s8 = lo8 + hi8;
  Lanes4 lo4, hi4;
  std::memcpy(&lo4, &s8, sizeof(Lanes4));
  std::memcpy(&hi4, reinterpret_cast<const char*>(&s8) + sizeof(Lanes4), sizeof(Lanes4));
  const Lanes4 s4 = lo4 + hi4;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// s[g, j] (+)= q[g] . k[j] for G query rows (stride q_stride) and key rows
// j < n of k [n, dims]. Lanes run over dims and fold once per product; each
// key row is loaded once for the G rows.
template <int G>
JAX_MLA_INLINE void GroupScores(const float* q, int64_t q_stride, const float* k, int64_t dims,
                                int64_t n, bool accumulate, float* s) {
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = k + j * dims;
    Lanes a[G];
    for (int g = 0; g < G; ++g) a[g] = Lanes{};
    int64_t d = 0;
    for (; d + kLanes <= dims; d += kLanes) {
      Lanes kv;
      LoadLanes(kv, kj + d);
      for (int g = 0; g < G; ++g) {
        Lanes qv;
        LoadLanes(qv, q + g * q_stride + d);
        a[g] += qv * kv;
      }
    }
    for (int g = 0; g < G; ++g) {
      float t = SumLanes(a[g]);
      for (int64_t e = d; e < dims; ++e) t += q[g * q_stride + e] * kj[e];
      s[g * kKeyBlock + j] = accumulate ? s[g * kKeyBlock + j] + t : t;
    }
  }
}

// acc[g, :] += sum_{j < n} p[g, j] * v[j, :] for G rows (stride dc).
template <int G>
JAX_MLA_INLINE void GroupValues(const float* p, const float* v, int64_t n, int64_t dc, float* acc) {
  int64_t c0 = 0;
  for (; c0 + kLanes <= dc; c0 += kLanes) {
    Lanes a[G];
    for (int g = 0; g < G; ++g) LoadLanes(a[g], acc + g * dc + c0);
    for (int64_t j = 0; j < n; ++j) {
      Lanes vr;
      LoadLanes(vr, v + j * dc + c0);
      for (int g = 0; g < G; ++g) a[g] += p[g * kKeyBlock + j] * vr;
    }
    for (int g = 0; g < G; ++g) StoreLanes(acc + g * dc + c0, a[g]);
  }
  for (; c0 < dc; ++c0) {  // head dims that are not a multiple of kLanes
    for (int g = 0; g < G; ++g) {
      float a = acc[g * dc + c0];
      for (int64_t j = 0; j < n; ++j) a += p[g * kKeyBlock + j] * v[j * dc + c0];
      acc[g * dc + c0] = a;
    }
  }
}

// Online-softmax update of G consecutive query rows (heads of one token, first
// row r) with the first n keys of the loaded block.
template <int G>
JAX_MLA_INLINE void UpdateRows(const Problem& pb, int64_t r, int64_t n, Scratch& sc) {
  const int64_t dc = pb.d_ckv, dr = pb.d_kpe;
  float* s = sc.probs.data();
  GroupScores<G>(sc.q_nope.data() + r * dc, dc, sc.keys.data(), dc, n, false, s);
  GroupScores<G>(sc.q_pe.data() + r * dr, dr, sc.kpe_rows.data(), dr, n, true, s);
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * kKeyBlock;
    float block_max = kNegInf;
    for (int64_t j = 0; j < n; ++j) {
      sg[j] = sc.key_ok[j] ? sg[j] * pb.sm_scale : kNegInf;
      block_max = std::max(block_max, sg[j]);
    }
    float& row_max = sc.row_max[r + g];
    float& row_sum = sc.row_sum[r + g];
    if (block_max == kNegInf) {  // every key of the block sits on a bad page
      std::fill(sg, sg + n, 0.0f);
      continue;
    }
    if (block_max > row_max) {
      // exp(-inf) = 0 clears the (zero) accumulator on the first block.
      const float alpha = std::exp(row_max - block_max);
      row_sum *= alpha;
      float* acc = sc.acc.data() + (r + g) * dc;
      for (int64_t c = 0; c < dc; ++c) acc[c] *= alpha;
      row_max = block_max;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      sg[j] = std::exp(sg[j] - row_max);  // bad-page keys: exp(-inf) = 0
      sum += sg[j];
    }
    row_sum += sum;
  }
  // Keys on bad pages are zero rows with probability 0: they add nothing.
  GroupValues<G>(s, sc.keys.data(), n, dc, sc.acc.data() + r * dc);
}

JAX_MLA_MULTIVERSION
void RunUnit(const Problem& pb, const Unit& u, Scratch& sc) {
  const int64_t h_n = pb.num_heads, dc = pb.d_ckv, dr = pb.d_kpe;
  const int64_t rows = u.q_len * h_n;  // row = local token * H + head
  // The tile's query rows are contiguous in q_nope / q_pe.
  ToFloat(pb.elem, pb.q_nope + u.q_start * h_n * dc * pb.elem_bytes, rows * dc, sc.q_nope.data());
  ToFloat(pb.elem, pb.q_pe + u.q_start * h_n * dr * pb.elem_bytes, rows * dr, sc.q_pe.data());
  std::fill(sc.acc.begin(), sc.acc.begin() + rows * dc, 0.0f);
  std::fill(sc.row_max.begin(), sc.row_max.begin() + rows, kNegInf);
  std::fill(sc.row_sum.begin(), sc.row_sum.begin() + rows, 0.0f);

  const int64_t key_end = u.request < 0 ? u.kv_start : u.KeyEnd(u.q_len - 1);
  for (int64_t k0 = u.kv_start; k0 < key_end; k0 += kKeyBlock) {
    const int64_t block = std::min(kKeyBlock, key_end - k0);
    LoadKeyBlock(pb, u.request, k0, block, sc);
    for (int64_t i = 0; i < u.q_len; ++i) {
      const int64_t n = std::clamp<int64_t>(u.KeyEnd(i) - k0, 0, block);
      if (n == 0) continue;  // earlier tokens see fewer keys (causal)
      int64_t h = 0;
      for (; h + kHeadGroup <= h_n; h += kHeadGroup) UpdateRows<kHeadGroup>(pb, i * h_n + h, n, sc);
      switch (h_n - h) {
        case 3: UpdateRows<3>(pb, i * h_n + h, n, sc); break;
        case 2: UpdateRows<2>(pb, i * h_n + h, n, sc); break;
        case 1: UpdateRows<1>(pb, i * h_n + h, n, sc); break;
        default: break;
      }
    }
  }

  // Normalise and write: the final output, or a float32 partial for the merge.
  for (int64_t r = 0; r < rows; ++r) {
    const float sum = sc.row_sum[r];
    const bool any = sum > 0.0f;
    const float inv = any ? 1.0f / sum : 0.0f;  // no key: zeros, never 0/0
    const float lse = any ? sc.row_max[r] + std::log(sum) : kNegInf;
    const float* acc = sc.acc.data() + r * dc;
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
      for (int64_t j = 0; j < splits; ++j) {
        mx = std::max(mx, pb.partial_lse[(base + j * q_len + i) * h_n + h]);
      }
      const int64_t o = (q_start + i) * h_n + h;
      char* out = pb.out + o * dc * pb.elem_bytes;
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

int ThreadsFor(int64_t tasks, int64_t macs) {
  const int64_t by_work = std::max<int64_t>(1, macs / kMinMacsPerThread);
  return static_cast<int>(std::max<int64_t>(1, std::min({int64_t{MaxThreads()}, tasks, by_work})));
}

// Runs body(task, thread) for task in [0, tasks) on up to `threads` threads,
// the caller included. Tasks are handed out one at a time in order: the planner
// sorts units longest first, so the stragglers are short. If a thread cannot be
// started the others simply take its share.
template <typename Body>
void ParallelFor(int64_t tasks, int threads, const Body& body) {
  std::atomic<int64_t> next{0};
  auto worker = [&](int tid) {
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) body(t, tid);
  };
  std::vector<std::thread> pool;
  for (int tid = 1; tid < threads; ++tid) {
    try {
      pool.emplace_back(worker, tid);
    } catch (const std::exception&) {
      break;
    }
  }
  worker(0);
  for (std::thread& t : pool) t.join();
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

ffi::Error PagedAttentionImpl(ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe, ffi::AnyBuffer ckv,
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

  const int unit_threads = ThreadsFor(static_cast<int64_t>(units.size()), macs);
  std::vector<Scratch> scratch;
  scratch.reserve(unit_threads);
  for (int t = 0; t < unit_threads; ++t) scratch.emplace_back(pb, max_q_len * pb.num_heads);
  ParallelFor(static_cast<int64_t>(units.size()), unit_threads,
              [&](int64_t i, int tid) { RunUnit(pb, units[i], scratch[tid]); });

  // Merges read what the units wrote: only after the join above.
  int64_t merge_macs = 0;
  for (int64_t m = 0; m < pb.num_merge; ++m) {
    const int32_t* row = pb.merge + m * kMergeCols;
    merge_macs += std::max(row[kMergeQLen], 0) * int64_t{std::max(row[kMergeNumSplits], 0)} *
                  pb.num_heads * pb.d_ckv;
  }
  const int merge_threads = ThreadsFor(pb.num_merge, merge_macs);
  std::vector<std::vector<float>> merge_acc(merge_threads, std::vector<float>(pb.d_ckv));
  ParallelFor(pb.num_merge, merge_threads,
              [&](int64_t m, int tid) { RunMerge(pb, m, merge_acc[tid]); });
  return ffi::Error::Success();
}

// No C++ exception may cross into XLA.
ffi::Error PagedAttentionCpu(ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe, ffi::AnyBuffer ckv,
                             ffi::AnyBuffer kpe, ffi::Buffer<ffi::S32> page_table,
                             ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> work,
                             ffi::Buffer<ffi::S32> merge, float sm_scale,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                             ffi::Result<ffi::Buffer<ffi::F32>> partial_o,
                             ffi::Result<ffi::Buffer<ffi::F32>> partial_lse) {
  try {
    return PagedAttentionImpl(q_nope, q_pe, ckv, kpe, page_table, kv_lens, work, merge, sm_scale, out,
                              lse, partial_o, partial_lse);
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jax_mla paged attention (cpu): ") + e.what());
  }
}

}  // namespace
}  // namespace jax_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaPagedAttentionCpu, jax_mla::PagedAttentionCpu,
                              xla::ffi::Ffi::Bind()
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
