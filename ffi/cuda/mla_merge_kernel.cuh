// Second launch of every call: combines split partials by LSE and writes zeros
// (LSE -inf) for the padding tokens that no work unit covers.
//
// A merge task is (merge row, token, head, 64-column chunk); 256 threads take
// it as 16 split lanes x 16 float4 columns, so one split's 64 columns are read
// by 16 consecutive threads and 16 splits are in flight at once. Tasks of all
// merge rows are dealt round-robin over a grid of about two blocks per SM:
// the merge table is bucketed (mostly padding), and this keeps the launch the
// same size whatever it holds.
#pragma once

#include "mla_common.cuh"

namespace jax_mla {
namespace cuda {

constexpr int kMergeChunks = kDimCkv / 64;  // column chunks per (token, head)

template <typename T>
__device__ __forceinline__ void store4(T* dst, float4 v);
template <>
__device__ __forceinline__ void store4<float>(float* dst, float4 v) {
  *reinterpret_cast<float4*>(dst) = v;
}
template <>
__device__ __forceinline__ void store4<__nv_bfloat16>(__nv_bfloat16* dst, float4 v) {
  uint2 w = make_uint2(pack2<__nv_bfloat16>(v.x, v.y), pack2<__nv_bfloat16>(v.z, v.w));
  *reinterpret_cast<uint2*>(dst) = w;
}
template <>
__device__ __forceinline__ void store4<__half>(__half* dst, float4 v) {
  uint2 w = make_uint2(pack2<__half>(v.x, v.y), pack2<__half>(v.z, v.w));
  *reinterpret_cast<uint2*>(dst) = w;
}

struct MergeScratch {
  int4 rows[kThreads];
  float m[kThreads];
  float s[kThreads];
  float4 acc[kThreads];
  int red[kWarps];
};

// out[token, head, chunk] = sum_j w_j o_j / sum_j w_j with w_j = exp(lse_j - max).
template <typename T>
__device__ __forceinline__ void merge_task(const Problem& p, MergeScratch& sh, int token, int base_row, int q_len,
                                           int splits, int head, int chunk) {
  const int tid = threadIdx.x;
  const int lane_j = tid >> 4, c4 = tid & 15;
  const int col = chunk * 64 + c4 * 4;
  float m = -INFINITY, s = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int j0 = lane_j; j0 < splits; j0 += 64) {
    float lj[4];
    float4 oj[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // issue all loads first
      const int j = j0 + 16 * k;
      lj[k] = -INFINITY;
      oj[k] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (j < splits) {
        const size_t row = ((size_t)base_row + (size_t)j * q_len) * p.num_heads + head;
        lj[k] = p.partial_lse[row];
        oj[k] = *reinterpret_cast<const float4*>(p.partial_o + row * kDimCkv + col);
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (lj[k] == -INFINITY) continue;  // an empty split adds nothing
      if (lj[k] > m) {
        const float r = m == -INFINITY ? 0.f : __expf(m - lj[k]);
        acc.x *= r; acc.y *= r; acc.z *= r; acc.w *= r;
        s *= r;
        m = lj[k];
      }
      const float w = __expf(lj[k] - m);
      acc.x += w * oj[k].x; acc.y += w * oj[k].y; acc.z += w * oj[k].z; acc.w += w * oj[k].w;
      s += w;
    }
  }
  sh.m[tid] = m;
  sh.s[tid] = s;
  sh.acc[tid] = acc;
  __syncthreads();
  if (tid < 16) {
    float mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < 16; ++k) mx = fmaxf(mx, sh.m[k * 16 + tid]);
    float tot = 0.f;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    if (mx != -INFINITY) {
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        const float mk = sh.m[k * 16 + tid];
        if (mk == -INFINITY) continue;
        const float w = __expf(mk - mx);
        const float4 ak = sh.acc[k * 16 + tid];
        tot += w * sh.s[k * 16 + tid];
        a.x += w * ak.x; a.y += w * ak.y; a.z += w * ak.z; a.w += w * ak.w;
      }
    }
    const float inv = tot > 0.f ? 1.f / tot : 0.f;
    a.x *= inv; a.y *= inv; a.z *= inv; a.w *= inv;
    const size_t row = (size_t)token * p.num_heads + head;
    store4<T>(static_cast<T*>(p.out) + row * kDimCkv + col, a);
    if (tid == 0 && chunk == 0) p.lse[row] = tot > 0.f ? mx + __logf(tot) : -INFINITY;
  }
  __syncthreads();  // scratch reused by the next task
}

template <typename T>
__global__ void __launch_bounds__(kThreads) mla_merge_kernel(const Problem p) {
  __shared__ MergeScratch sh;
  const int tid = threadIdx.x;
  const long long grid = gridDim.x;
  const int tasks_per_token = p.num_heads * kMergeChunks;

  // ---- merges: deal the tasks of all usable merge rows round-robin ----
  long long task_base = 0;
  for (int m0 = 0; m0 < p.num_merge; m0 += kThreads) {
    __syncthreads();
    sh.rows[tid] = m0 + tid < p.num_merge
                       ? __ldg(reinterpret_cast<const int4*>(p.merge) + m0 + tid)
                       : make_int4(0, 0, 0, 0);
    __syncthreads();
    const int n = min(kThreads, p.num_merge - m0);
    for (int k = 0; k < n; ++k) {
      const int4 mr = sh.rows[k];
      if (!merge_row_ok(p, mr)) continue;
      const long long tasks = (long long)mr.y * tasks_per_token;
      const long long first = task_base + ((blockIdx.x - task_base) % grid + grid) % grid;
      for (long long t = first; t < task_base + tasks; t += grid) {
        const int local = (int)(t - task_base);
        const int i = local / tasks_per_token;
        const int rem = local - i * tasks_per_token;
        const int head = rem / kMergeChunks;
        const int chunk = rem - head * kMergeChunks;
        merge_task<T>(p, sh, mr.x + i, mr.z + i, mr.y, mr.w, head, chunk);
      }
      task_base += tasks;
    }
  }

  // ---- padding tokens: [end, T) where end is the last token any unit covers ----
  int end = 0;
  for (int w = tid; w < p.num_work; w += kThreads) {
    const int4 a = __ldg(reinterpret_cast<const int4*>(p.work + (size_t)w * kWorkCols));
    const int q_start = a.y, q_len = a.z;
    if (q_len > 0 && q_len <= p.q_tile && q_start >= 0 && (long long)q_start + q_len <= p.num_tokens) {
      end = max(end, q_start + q_len);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) end = max(end, __shfl_xor_sync(0xffffffffu, end, off));
  if ((tid & 31) == 0) sh.red[tid >> 5] = end;
  __syncthreads();
  end = 0;
#pragma unroll
  for (int k = 0; k < kWarps; ++k) end = max(end, sh.red[k]);
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
