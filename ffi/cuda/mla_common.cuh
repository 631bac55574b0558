// Pieces shared by the CUDA kernels of the paged MLA op: the problem
// description every kernel receives, the decoding of one plan row into the
// key range it covers (plan_layout.h), and thin wrappers over the PTX we use.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

#include "jax_mla/plan_layout.h"

namespace jax_mla {
namespace cuda {

constexpr int kDimCkv = 512;                // d_ckv the kernels are built for
constexpr int kDimKpe = 64;                 // d_kpe
constexpr int kDimKey = kDimCkv + kDimKpe;  // a key is [ckv | kpe]
constexpr int kThreads = 256;               // every kernel: 8 warps
constexpr int kWarps = kThreads / 32;
// Shared-memory rows of keys and queries: 576 elements + 16 bytes of padding,
// so that the eight 16-byte rows one ldmatrix phase reads fall in distinct banks.
constexpr int kRowStride = kDimKey + 8;       // elements
constexpr int kRowBytes = kRowStride * 2;     // 1168
constexpr int kChunksPerKey = kDimKey / 8;    // 72 16-byte chunks: 64 ckv + 8 kpe
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Everything a launch needs, passed by value as one kernel parameter.
struct Problem {
  const void* q_nope;      // [T, H, 512]
  const void* q_pe;        // [T, H, 64]
  const void* ckv;         // [P, ps, 512], the query dtype or fp8 (mla_fp8.cuh)
  const void* kpe;         // [P, ps, 64], likewise
  const int32_t* page_table;  // [R, max_pages]
  const int32_t* kv_lens;     // [num_kv_lens]
  const int32_t* work;        // [W, kWorkCols]
  const int32_t* merge;       // [M, kMergeCols]
  const float* ckv_scale;     // [1]: an fp8 ckv's value = fp8 x scale (read only for fp8 caches)
  const float* kpe_scale;     // [1]
  void* out;                  // [T, H, 512] in the query dtype
  float* lse;                 // [T, H]
  void* partial_o;            // [Pp, H, 512] in the query dtype (a split's rows, normalised, as its output would be)
  float* partial_lse;         // [Pp, H]
  int num_tokens;             // T
  int num_heads;              // H
  int num_pages;              // P
  int page_size;              // ps, a power of two
  int log2_page_size;
  int num_requests;           // R (page_table rows)
  int max_pages;              // page_table columns
  int num_kv_lens;
  int num_work;               // W
  int num_merge;              // M
  int num_partial_rows;       // Pp
  int head_blocks;            // ceil(H / 64): blocks sharing one work unit
  int q_tile;                 // max(1, 64 / H), as the planner computes it
  int capacity;               // min(max_pages * ps, INT_MAX): keys a request can hold
  float scale_log2;           // sm_scale * log2(e): scores live in base 2
  int fp8_products;           // 1: an fp8 ckv's 64-key units multiply on e4m3, lossy (mla_wide64_e4m3_sm90.cuh)
};

// Whether a page id from the page table names a page of the cache. Its keys are read only then;
// otherwise they are masked (a skipped or bad page id never reaches an address).
__device__ __forceinline__ bool page_in_cache(const Problem& p, int page) { return page >= 0 && page < p.num_pages; }

// The cache row (page x page_size + offset in the page) of `key` on `page`, in R: size_t for an address,
// int for a TMA coordinate, uint32_t where a row travels through a shuffle. The page size is a power of two.
template <typename R>
__device__ __forceinline__ R cache_row(int page, int key, int page_size) {
  return (R)page * page_size + (key & (page_size - 1));
}

// The sizes and derived constants of a Problem, from the operands' shapes: one
// definition for the FFI handler and the standalone driver. Counts past int32
// are clamped (the handler refuses the ones it cannot index); an empty cache or
// page table leaves nothing to read, so every unit sees no keys.
inline void set_problem_sizes(Problem& p, int64_t num_tokens, int64_t num_heads, int64_t num_pages,
                              int64_t page_size, int64_t num_requests, int64_t max_pages, int64_t num_kv_lens,
                              int64_t num_work, int64_t num_merge, int64_t num_partial_rows, float sm_scale) {
  auto clamp32 = [](int64_t v) { return (int)(v < INT_MAX ? v : INT_MAX); };
  p.num_tokens = clamp32(num_tokens);
  p.num_heads = clamp32(num_heads);
  p.num_pages = clamp32(num_pages);
  p.page_size = clamp32(page_size);
  p.log2_page_size = 0;
  while ((int64_t{1} << p.log2_page_size) < page_size) ++p.log2_page_size;
  p.num_requests = clamp32(num_requests);
  p.max_pages = clamp32(max_pages);
  p.num_kv_lens = clamp32(num_kv_lens);
  p.num_work = clamp32(num_work);
  p.num_merge = clamp32(num_merge);
  p.num_partial_rows = clamp32(num_partial_rows);
  p.head_blocks = (int)HeadBlocks(num_heads);
  p.q_tile = (int)QTile(num_heads);
  p.capacity = clamp32(max_pages * page_size);
  p.scale_log2 = sm_scale * kLog2e;
  if (num_pages == 0 || num_requests == 0 || max_pages == 0) {
    p.num_requests = 0;
    p.capacity = 0;
  }
}

// One work unit, decoded and clipped against the device lengths.
struct Unit {
  int request;
  int q_start;
  int q_len;
  int q_end_offset;   // e of the first token; token i has e - i
  int partial_row;    // < 0: write out/lse directly
  int kv_len;         // device length clipped to [0, capacity]; 0 for a bad request
  int kv_begin;       // first key of the split
  int kv_stop;        // one past the split's last key (may be kKvEndOpen)
  int range_end;      // one past the last key any token of the unit sees
};

// Where the unit's row of local token i and head h goes: row `row` of out (T) and lse, or, for a split
// unit, of its partial rows (in the output's type, as out) and their LSEs for the merge. One
// definition for every epilogue.
struct UnitDest {
  void* out;   // T rows of kDimCkv
  float* lse;
  size_t row;
};
__device__ __forceinline__ UnitDest unit_dest(const Problem& p, const Unit& u, int i, int h) {
  const bool split = u.partial_row >= 0;
  return {split ? p.partial_o : p.out, split ? p.partial_lse : p.lse,
          (size_t)((split ? u.partial_row : u.q_start) + i) * p.num_heads + h};
}

// Keys [0, visible) that local token i of the unit sees: causal, aligned to the
// end of the request's query block, never beyond the device length.
__device__ __forceinline__ int visible_keys(const Unit& u, int i) {
  const long long v = (long long)u.kv_len - (long long)(u.q_end_offset - i) + 1;
  return (int)min((long long)u.kv_len, max(0LL, v));
}

// One past the last key row r of a tile sees (rows r = (token r / hb, head r % hb), `rows` of
// them live): the token's causal limit within the split; INT_MIN for a padding row, which
// then masks every key.
__device__ __forceinline__ int row_key_limit(const Unit& u, int r, int rows, int hb) {
  return r < rows ? min(u.kv_stop, visible_keys(u, r / hb)) : INT_MIN;
}

// O = alpha O on an accumulator tile in the m16n8 layout that mma.sync and wgmma share: each
// group of four holds two columns of row g (scaled by a_lo) and the same two of row g + 8 (a_hi).
template <int N>
__device__ __forceinline__ void rescale_rows(float (&o)[N][4], float a_lo, float a_hi) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    o[j][0] *= a_lo;
    o[j][1] *= a_lo;
    o[j][2] *= a_hi;
    o[j][3] *= a_hi;
  }
}

// A plan row by its named columns (plan_layout.h), read as 16-byte loads.
template <int kCols>
struct PlanRow {
  static_assert(kCols % 4 == 0, "a plan row is whole 16-byte loads");
  int col[kCols];
  __device__ __forceinline__ int operator[](int c) const { return col[c]; }
};
using WorkRow = PlanRow<kWorkCols>;
using MergeRow = PlanRow<kMergeCols>;

// Row `index` of a table of kCols columns, its first kRead columns (whole 16-byte loads).
template <int kCols, int kRead = kCols>
__device__ __forceinline__ PlanRow<kRead> load_plan_row(const int32_t* table, size_t index) {
  static_assert(kRead <= kCols, "a row's own columns");
  PlanRow<kRead> r;
  const int4* src = reinterpret_cast<const int4*>(table + index * kCols);
#pragma unroll
  for (int k = 0; k < kRead / 4; ++k) {
    const int4 v = __ldg(src + k);
    r.col[4 * k] = v.x;
    r.col[4 * k + 1] = v.y;
    r.col[4 * k + 2] = v.z;
    r.col[4 * k + 3] = v.w;
  }
  return r;
}

// Reads work row `index`; false for padding rows and for rows that would make
// the kernel touch memory outside its operands (a plan for other shapes). The
// device length is only requested here (kv_len holds the raw value until
// finish_unit), so a kernel can issue its first page-table and query loads
// before the length arrives.
__device__ __forceinline__ bool start_unit(const Problem& p, int index, Unit& u) {
  const WorkRow w = load_plan_row<kWorkCols>(p.work, (size_t)index);
  u.request = w[kWorkRequest];
  u.q_start = w[kWorkQStart];
  u.q_len = w[kWorkQLen];
  u.q_end_offset = w[kWorkQEndOffset];
  u.partial_row = w[kWorkPartialRow];
  if (u.q_len <= 0 || u.q_len > p.q_tile) return false;
  if (u.q_start < 0 || (long long)u.q_start + u.q_len > p.num_tokens) return false;
  if (u.partial_row >= 0 && (long long)u.partial_row + u.q_len > p.num_partial_rows) return false;
  const bool has_len = u.request >= 0 && u.request < p.num_requests && u.request < p.num_kv_lens;
  u.kv_len = has_len ? __ldg(p.kv_lens + u.request) : 0;
  u.kv_begin = max(w[kWorkKvStart], 0);
  u.kv_stop = max(w[kWorkKvEnd], u.kv_begin);
  u.range_end = u.kv_begin;
  return true;
}

// Clips the device length (to [0, capacity]) and derives the unit's key range.
__device__ __forceinline__ void finish_unit(const Problem& p, Unit& u) {
  u.kv_len = min(max(u.kv_len, 0), p.capacity);
  u.range_end = max(min(u.kv_stop, visible_keys(u, u.q_len - 1)), u.kv_begin);
}

// Keys whose page ids can be read before the device length is known: the
// split's range clipped to the page table's capacity.
__device__ __forceinline__ int page_bound(const Problem& p, const Unit& u) { return min(u.kv_stop, p.capacity); }
// The keys whose page ids a body may fetch before the device length arrives (finish_unit): those
// bounds, none for a bad request. Keys past the length are never gathered.
__device__ __forceinline__ int early_key_bound(const Problem& p, const Unit& u) {
  return u.request >= 0 && u.request < p.num_requests ? page_bound(p, u) : u.kv_begin;
}
// The unit's row of the page table (row 0 for a bad request, whose keys are all masked).
__device__ __forceinline__ const int* page_table_row(const Problem& p, const Unit& u) {
  return p.page_table + (size_t)max(u.request, 0) * p.max_pages;
}

__device__ __forceinline__ bool decode_unit(const Problem& p, int index, Unit& u) {
  if (!start_unit(p, index, u)) return false;
  finish_unit(p, u);
  return true;
}

// A merge row is usable when every partial row it names lies in the workspace.
__device__ __forceinline__ bool merge_row_ok(const Problem& p, const MergeRow& m) {
  const int q_start = m[kMergeQStart], q_len = m[kMergeQLen], base = m[kMergePartialRow];
  const int splits = m[kMergeNumSplits];
  if (q_len <= 0 || q_len > p.q_tile || splits < 1 || base < 0 || q_start < 0) return false;
  if ((long long)q_start + q_len > p.num_tokens) return false;
  return (long long)base + (long long)splits * q_len <= p.num_partial_rows;
}

// ---- PTX wrappers ------------------------------------------------------------

// The GPU's nanosecond clock (the diagnosis timelines: JAX_MLA_BLOCK_TRACE and JAX_MLA_TRACE below).
__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  return t;
}

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte global->shared copy that bypasses L1; src_bytes = 0 writes zeros and
// reads nothing (used for keys outside the range and for skipped pages).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
// An L2 policy of evict-first for data streamed once (keys): created per use (one instruction,
// which ptxas hoists), so that callers need not carry it.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
// cp_async16 with an L2 cache policy (l2_evict_first_policy).
__device__ __forceinline__ void cp_async16_hint(uint32_t dst, const void* src, int src_bytes, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes), "l"(policy)
               : "memory");
}
// 4-byte copy through L1 (page ids: neighbours share lines); src_bytes = 0 writes zero.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Shared-memory loads and stores by 32-bit address (volatile and ordered among themselves).
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_u8(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u8 [%0], %1;\n" ::"r"(addr), "h"((unsigned short)v) : "memory");
}
__device__ __forceinline__ void st_shared_u16(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"((unsigned short)v) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void st_shared_v2(uint32_t addr, uint2 v) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(addr), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ uint2 ld_shared_v2(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D = A(16x16, row) * B(16x8, col) + D with float accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Programmatic dependent launch (sm_90+; no-ops elsewhere): the primary grid
// lets its dependent start early, the dependent waits for the primary's memory.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_primary_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// 2^x; exact 0 for -inf, which is how masked scores vanish.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two floats packed as one 32-bit pair of T (the mma operand format).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// The two floats of a 32-bit pair of T (pack2's inverse, exact).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }

// Block timeline for diagnosis (standalone driver builds with -DJAX_MLA_BLOCK_TRACE only; nothing
// otherwise): per kernel kind (0 attention, 1 merge) and block, the SM it ran on and globaltimer at its
// start (thread 0) and at its last warp's exit, so a driver can compare where blocks ran with where the
// planner meant them to run (tools/block_trace_report.py).
#ifdef JAX_MLA_BLOCK_TRACE
constexpr int kBlockTraceMax = 8192;
__device__ unsigned long long g_jax_mla_block_trace[2][kBlockTraceMax][3];  // start, end, SM id
struct BlockTraceScope {
  int kind;
  __device__ explicit BlockTraceScope(int k) : kind(k) {
    if (threadIdx.x == 0 && blockIdx.x < kBlockTraceMax) {
      unsigned sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      g_jax_mla_block_trace[kind][blockIdx.x][0] = globaltimer_ns();
      g_jax_mla_block_trace[kind][blockIdx.x][2] = sm;
    }
  }
  __device__ ~BlockTraceScope() {
    if ((threadIdx.x & 31) == 0 && blockIdx.x < kBlockTraceMax) {
      atomicMax(&g_jax_mla_block_trace[kind][blockIdx.x][1], globaltimer_ns());
    }
  }
};
#define JAX_MLA_BLOCK_TRACE_SCOPE(kind) const BlockTraceScope block_trace_scope(kind)
#else
#define JAX_MLA_BLOCK_TRACE_SCOPE(kind) static_cast<void>(0)
#endif

// A timeline of one body for diagnosis (standalone driver builds with -DJAX_MLA_TRACE only; nothing
// otherwise; tools/trace_report.py reads what the driver prints): clock64 stamps of lane 0 of warps 0
// and 3 of each warpgroup (slots 2 wg + (warp == 3)) in blocks 0 and JAX_MLA_TRACE_BLOCK (slots + 4).
// Row 0: the prologue and the epilogue, with globaltimer at the start and the end (events 6 and 7)
// and the body's id (event 11: kTraceWide64, kTraceNarrowFp8, kTraceWide64PaFirst: the 64-key body's default
// P_A-first schedule, whose warpgroup 1 marks other points; kTraceWide64: -DJAX_MLA_WIDE64_NO_PA_FIRST); row 1 + n:
// the body's n-th trip.
// A body declares `trace_slot` (jax_mla_trace_slot) and marks its points with JAX_MLA_TRACE_AT.
// A walk's body (walk_unit: the units its block ran before this one) is traced in block 0 only, its first
// unit in slots 0-3 and its second in slots 4-7: each unit of a walk would otherwise write the same slots,
// and the boundary between them (the first unit's end, the second's start by globaltimer) would not show.
#ifdef JAX_MLA_TRACE
constexpr int kTraceRows = 40, kTraceEvents = 12, kTraceSlots = 8;
constexpr int kTraceWide64 = 1, kTraceNarrowFp8 = 2, kTraceWide64PaFirst = 3;
__device__ long long g_jax_mla_trace[kTraceSlots][kTraceRows + 1][kTraceEvents];
__device__ __forceinline__ long long trace_clock() {
  long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
  return t;
}
#ifndef JAX_MLA_TRACE_BLOCK
#define JAX_MLA_TRACE_BLOCK 200
#endif
// This thread's slot, or -1; a traced thread also stamps the start (event 0, globaltimer) and the body.
__device__ __forceinline__ int jax_mla_trace_slot(int wg, int warp, int lane, int body, int walk_unit = -1) {
  const bool traced = lane == 0 && (warp == 0 || warp == 3) &&
                      (walk_unit < 0 ? blockIdx.x == 0 || blockIdx.x == JAX_MLA_TRACE_BLOCK
                                     : blockIdx.x == 0 && walk_unit < 2);
  const int group = walk_unit < 0 ? (blockIdx.x == 0 ? 0 : 4) : 4 * walk_unit;
  const int slot = traced ? group + 2 * wg + (warp == 3) : -1;
  if (slot >= 0) {
    g_jax_mla_trace[slot][0][6] = (long long)globaltimer_ns();
    g_jax_mla_trace[slot][0][11] = body;
    g_jax_mla_trace[slot][0][0] = trace_clock();
  }
  return slot;
}
#define JAX_MLA_TRACE_AT(row, ev) \
  do { if (trace_slot >= 0 && (row) <= kTraceRows) g_jax_mla_trace[trace_slot][row][ev] = trace_clock(); } while (0)
#define JAX_MLA_TRACE_END() \
  do { if (trace_slot >= 0) g_jax_mla_trace[trace_slot][0][7] = (long long)globaltimer_ns(); } while (0)
#else
#define JAX_MLA_TRACE_AT(row, ev) do { } while (0)
#define JAX_MLA_TRACE_END() do { } while (0)
#endif

}  // namespace cuda
}  // namespace jax_mla
