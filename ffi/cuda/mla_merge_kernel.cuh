// Second launch of every call: combines split partials by LSE and writes zeros
// (LSE -inf) for the padding tokens that no work unit covers. A split's partial
// row is its normalised output in the output's type (16-bit for 16-bit queries:
// half the bytes of float32 partials for the split units to write and for this
// kernel to read) and its LSE in float32.
//
// Two kinds of merge task, by the row's split count:
//   * a row of many splits (> kMergeManySplits: one long request spread over the
//     GPU): (token, head, one of four parts of 128 columns). The block's 8 warps
//     share the splits (warp w reads splits w, w+8, ...), each lane four columns
//     of the part per split, eight splits in flight per warp, so 64 splits cost one
//     round trip; the warps meet once in shared memory, where thread c finishes
//     column c of the part.
//   * a row of a few splits (a batch cut into a few units per request): (token,
//     eight heads). Warp w merges head 8 t + w alone over all 512 columns (a lane
//     four times four columns per split, four splits in flight), with no shared
//     memory and no block barrier: one round trip, and a block finishes eight rows
//     at once.
// Tasks of all merge rows are numbered by a warp-wide prefix sum over
// the merge table (each warp does the same scan, so no barrier is needed to
// agree on it) and dealt round-robin over a grid of a few blocks per SM: the
// merge table is bucketed (mostly padding), and this keeps the launch the same
// size whatever it holds. The plan tables are read before the wait for the
// attention grid, so only the partials' round trip follows its end.
#pragma once

#include <type_traits>

#include "mla_common.cuh"

namespace jax_mla {
namespace cuda {

constexpr int kMergeManySplits = 16;  // rows with more splits share a block per column part

// Tasks of one token of a merge row: 4 column parts per head, or one per group of kWarps heads.
__device__ __forceinline__ int merge_tasks_per_token(int splits, int heads) {
  return splits > kMergeManySplits ? 4 * heads : (heads + kWarps - 1) / kWarps;
}

struct MergeScratch {
  float m[kWarps];
  float s[kWarps];
  float acc[kWarps][kDimCkv / 4];  // partial sums of the 128 columns of a part
  int red[kWarps];
  int red_live[kWarps];
};

// A warp's share of one merge: splits first, first + stride, ... of (token row base_row, head), the
// lane's columns col0 + 4 lane + 128 v (v < V), with the loads of U splits issued before any arithmetic
// waits on them. Returns the running max m of the splits' LSEs, the sum s of exp(lse_j - m) and the
// column sums acc of exp(lse_j - m) o_j; an empty split (LSE -inf) adds nothing, a NaN one sets nan.
template <int V>
struct MergeSums {
  float m = -INFINITY, s = 0.f;
  bool nan = false;  // a split's row is NaN (a NaN score): the merged row is NaN
  float4 acc[V];
};
// Four consecutive values of a partial row (T, the output's type) as loaded: one 8-byte load for a
// 16-bit T, 16 bytes for float, kept raw until the arithmetic (converting at the load made each
// split's load wait for the previous one's: the loads sit in branches). Plain loads: the partials are
// the attention grid's writes, read after the programmatic dependency's wait.
template <typename T>
using Partial4 = std::conditional_t<sizeof(T) == 4, float4, uint2>;
template <typename T>
__device__ __forceinline__ float4 partial4_floats(const Partial4<T>& v) {
  if constexpr (sizeof(T) == 4) {
    return v;
  } else {
    const float2 a = unpack2<T>(v.x), b = unpack2<T>(v.y);
    return make_float4(a.x, a.y, b.x, b.y);
  }
}

template <typename T, int V, int U>
__device__ __forceinline__ MergeSums<V> merge_splits(const Problem& p, int base_row, int q_len, int splits, int head,
                                                     int col0, int first, int stride) {
  const int lane = threadIdx.x & 31;
  MergeSums<V> r;
  float& m = r.m;
  float& s = r.s;
  bool& nan = r.nan;
  float4 (&acc)[V] = r.acc;
#pragma unroll
  for (int v = 0; v < V; ++v) acc[v] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int j0 = first; j0 < splits; j0 += stride * U) {
    float lj[U];
    Partial4<T> oj[U][V];
#pragma unroll
    for (int k = 0; k < U; ++k) {  // issue every load first
      const int j = j0 + stride * k;
      lj[k] = -INFINITY;
#pragma unroll
      for (int v = 0; v < V; ++v) oj[k][v] = {};
      if (j < splits) {
        const size_t row = ((size_t)base_row + (size_t)j * q_len) * p.num_heads + head;
        const T* src = static_cast<const T*>(p.partial_o) + row * kDimCkv + col0 + lane * 4;
        lj[k] = p.partial_lse[row];
#pragma unroll
        for (int v = 0; v < V; ++v) oj[k][v] = *reinterpret_cast<const Partial4<T>*>(src + 128 * v);
      }
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      if (lj[k] == -INFINITY) continue;  // an empty split adds nothing
      if (lj[k] != lj[k]) {
        nan = true;
        continue;
      }
      if (lj[k] > m) {
        const float c = m == -INFINITY ? 0.f : __expf(m - lj[k]);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          acc[v].x *= c; acc[v].y *= c; acc[v].z *= c; acc[v].w *= c;
        }
        s *= c;
        m = lj[k];
      }
      const float w = __expf(lj[k] - m);
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const float4 o = partial4_floats<T>(oj[k][v]);
        acc[v].x += w * o.x; acc[v].y += w * o.y;
        acc[v].z += w * o.z; acc[v].w += w * o.w;
      }
      s += w;
    }
  }
  return r;
}

// out[token, head, columns of part] = sum_j w_j o_j / sum_j w_j, w_j = exp(lse_j - max).
template <typename T>
__device__ __forceinline__ void merge_task(const Problem& p, MergeScratch& sh, int token, int base_row, int q_len,
                                           int splits, int head, int part) {
  constexpr int COLS = kDimCkv / 4;  // a part
  constexpr int V = COLS / 128;      // four columns a lane, V times per split
  constexpr int U = 8;               // splits in flight per warp
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int col_base = part * COLS;
  const MergeSums<V> r = merge_splits<T, V, U>(p, base_row, q_len, splits, head, col_base, warp, kWarps);
  if (lane == 0) {
    sh.m[warp] = r.nan ? NAN : r.m;
    sh.s[warp] = r.s;
  }
#pragma unroll
  for (int v = 0; v < V; ++v) *reinterpret_cast<float4*>(&sh.acc[warp][128 * v + lane * 4]) = r.acc[v];
  __syncthreads();
  float mx = -INFINITY;
  bool any_nan = false;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    mx = fmaxf(mx, sh.m[w]);  // fmaxf skips NaN: counted apart
    any_nan |= sh.m[w] != sh.m[w];
  }
  float tot = 0.f, a = 0.f;
  const int c = tid < COLS ? tid : 0;  // threads past the part's columns only help with the barrier
  if (mx != -INFINITY) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = sh.m[w];
      if (mw == -INFINITY) continue;
      const float wt = __expf(mw - mx);
      tot += wt * sh.s[w];
      a += wt * sh.acc[w][c];
    }
  }
  const size_t row = (size_t)token * p.num_heads + head;
  const float o = any_nan ? NAN : tot > 0.f ? a / tot : 0.f;
  if (tid < COLS) static_cast<T*>(p.out)[row * kDimCkv + col_base + tid] = from_float<T>(o);
  if (tid == 0 && part == 0) p.lse[row] = any_nan ? NAN : tot > 0.f ? mx + __logf(tot) : -INFINITY;
  __syncthreads();  // scratch reused by the next task
}

// One warp merges (token, head) over all 512 columns: lane l owns columns 4 l + 128 v.
template <typename T>
__device__ __forceinline__ void merge_head_warp(const Problem& p, int token, int base_row, int q_len, int splits,
                                                int head) {
  const int lane = threadIdx.x & 31;
  const MergeSums<4> r = merge_splits<T, 4, 4>(p, base_row, q_len, splits, head, 0, 0, 1);  // four splits in flight
  const size_t row = (size_t)token * p.num_heads + head;
  const float inv = r.s > 0.f ? 1.f / r.s : 0.f;
  T* out = static_cast<T*>(p.out) + row * kDimCkv + lane * 4;
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    const float4 o = r.nan ? make_float4(NAN, NAN, NAN, NAN)
                           : make_float4(r.acc[v].x * inv, r.acc[v].y * inv, r.acc[v].z * inv, r.acc[v].w * inv);
    if constexpr (sizeof(T) == 2) {
      *reinterpret_cast<uint2*>(out + 128 * v) = make_uint2(pack2<T>(o.x, o.y), pack2<T>(o.z, o.w));
    } else {
      *reinterpret_cast<float4*>(out + 128 * v) = o;
    }
  }
  if (lane == 0) p.lse[row] = r.nan ? NAN : r.s > 0.f ? r.m + __logf(r.s) : -INFINITY;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) mla_merge_kernel(const Problem p) {
  __shared__ MergeScratch sh;
  JAX_MLA_BLOCK_TRACE_SCOPE(1);
  const int tid = threadIdx.x, lane = tid & 31;
  const int grid = gridDim.x;
  // The plan tables are inputs of the op (complete before the attention kernel
  // started), so they are read while the attention grid still runs.
  auto merge_rows = [&](int m0) {
    MergeRow mr = {};
    if (m0 + lane < p.num_merge) mr = load_plan_row<kMergeCols>(p.merge, (size_t)(m0 + lane));
    return mr;
  };
  const MergeRow mr_first = merge_rows(0), mr_second = merge_rows(32);
  // Padding tokens are [end, T), end = one past the last token any unit covers. The merge rows to
  // scan are [0, live), live = one past the last row with tokens: the table is bucketed, and each
  // batch of 32 rows scanned after the wait is a dependent load (~1 us).
  int end = 0, live = 0;
  for (int m = tid; m < p.num_merge; m += kThreads) {
    if (load_plan_row<kMergeCols>(p.merge, (size_t)m)[kMergeQLen] > 0) live = m + 1;
  }
  for (int w = tid; w < p.num_work; w += kThreads) {
    static_assert(kWorkQStart < 4 && kWorkQLen < 4, "the tokens of a unit are in its first load");
    const auto a = load_plan_row<kWorkCols, 4>(p.work, (size_t)w);
    const int q_start = a[kWorkQStart], q_len = a[kWorkQLen];
    if (q_len > 0 && q_len <= p.q_tile && q_start >= 0 && (long long)q_start + q_len <= p.num_tokens) {
      end = max(end, q_start + q_len);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    end = max(end, __shfl_xor_sync(0xffffffffu, end, off));
    live = max(live, __shfl_xor_sync(0xffffffffu, live, off));
  }
  if (lane == 0) {
    sh.red[tid >> 5] = end;
    sh.red_live[tid >> 5] = live;
  }
  __syncthreads();
  end = live = 0;
#pragma unroll
  for (int k = 0; k < kWarps; ++k) {
    end = max(end, sh.red[k]);
    live = max(live, sh.red_live[k]);
  }

  // Only the merges read what the attention kernel writes. A plan without merge rows (an unsplit
  // batch: the table is bucketed by tile count, so its size cannot tell) does not wait for the
  // attention grid: the blocks zero the padding tokens, if any, and exit, and the kernel ends with the
  // attention grid instead of ~1 us after it (the wait's release, a scan, the exit). Stream order
  // still puts every later kernel after the attention grid: a dependent launch relaxes only when this
  // kernel may start (FlashMLA's combine kernel returns before its wait in the same way).
#ifdef JAX_MLA_MERGE_ALWAYS_WAITS  // (an A/B switch: the wait in every plan, as before)
  constexpr bool kAlwaysWait = true;
#else
  constexpr bool kAlwaysWait = false;
#endif
  // The wait: the attention kernel's partials and direct outputs are complete and visible.
  if (kAlwaysWait || live > 0) wait_for_primary_grid();

  // ---- merges: number the tasks 32 merge rows at a time (every warp alike) ----
  long long task_base = 0;
  for (int m0 = 0; m0 < live; m0 += 32) {
    const MergeRow mr = m0 == 0 ? mr_first : m0 == 32 ? mr_second : merge_rows(m0);
    const long long mine = merge_row_ok(p, mr) ? (long long)mr[kMergeQLen] *
                                                     merge_tasks_per_token(mr[kMergeNumSplits], p.num_heads)
                                               : 0;
    long long incl = mine;  // inclusive prefix over the lanes
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const long long v = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += v;
    }
    const long long total = __shfl_sync(0xffffffffu, incl, 31);
    // This block's tasks in [task_base, task_base + total): t == blockIdx.x (mod grid).
    const long long first = task_base + ((blockIdx.x - task_base) % grid + grid) % grid;
    for (long long t = first; t < task_base + total; t += grid) {
      const long long local = t - task_base;
      const unsigned owners = __ballot_sync(0xffffffffu, incl > local);
      const int src = __ffs(owners) - 1;  // first lane whose prefix passes local
      const long long start = __shfl_sync(0xffffffffu, incl - mine, src);
      const int q_start = __shfl_sync(0xffffffffu, mr[kMergeQStart], src);
      const int q_len = __shfl_sync(0xffffffffu, mr[kMergeQLen], src);
      const int base = __shfl_sync(0xffffffffu, mr[kMergePartialRow], src);
      const int splits = __shfl_sync(0xffffffffu, mr[kMergeNumSplits], src);
      const int per_token = merge_tasks_per_token(splits, p.num_heads);
      const int in_row = (int)(local - start);
      const int i = in_row / per_token;
      const int rem = in_row - i * per_token;
      if (splits > kMergeManySplits) {
        merge_task<T>(p, sh, q_start + i, base + i, q_len, splits, rem >> 2, rem & 3);
      } else {
        const int head = rem * kWarps + (tid >> 5);
        if (head < p.num_heads) merge_head_warp<T>(p, q_start + i, base + i, q_len, splits, head);
      }
    }
    task_base += total;
  }

  // ---- padding tokens: zeros, LSE -inf ----
  if (end >= p.num_tokens) return;

  constexpr int kPerVec = 16 / sizeof(T);
  const size_t first_vec = (size_t)end * p.num_heads * kDimCkv / kPerVec;
  const size_t total_vec = (size_t)p.num_tokens * p.num_heads * kDimCkv / kPerVec;
  const size_t stride = (size_t)grid * kThreads;
  for (size_t v = first_vec + (size_t)blockIdx.x * kThreads + tid; v < total_vec; v += stride) {
    reinterpret_cast<uint4*>(p.out)[v] = make_uint4(0u, 0u, 0u, 0u);
  }
  const size_t total_rows = (size_t)p.num_tokens * p.num_heads;
  for (size_t k = (size_t)end * p.num_heads + (size_t)blockIdx.x * kThreads + tid; k < total_rows; k += stride) {
    p.lse[k] = -INFINITY;
  }
}

}  // namespace cuda
}  // namespace jax_mla
