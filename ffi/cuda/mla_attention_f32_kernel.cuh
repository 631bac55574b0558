// float32 path of the op: plain FMA, one warp per query row, keys streamed one
// at a time with an online softmax. It exists so that float32 inputs give
// float32-accurate answers on the GPU too (tensor cores would round them);
// it follows the same plan and writes the same partials as the bf16/fp16
// kernel, so the same merge kernel finishes it. Not tuned for speed.
#pragma once

#include "mla_common.cuh"

namespace jax_mla {
namespace cuda {

__global__ void __launch_bounds__(kThreads) mla_attention_f32_kernel(const Problem p) {
  const int unit_index = blockIdx.x / p.head_blocks;
  const int head_block = blockIdx.x - unit_index * p.head_blocks;
  Unit u;
  if (!decode_unit(p, unit_index, u)) return;
  const int h0 = head_block * kRowsPerTile;
  const int hb = min(kRowsPerTile, p.num_heads - h0);
  const int rows = u.q_len * hb;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* q_nope = static_cast<const float*>(p.q_nope);
  const float* q_pe = static_cast<const float*>(p.q_pe);
  const float* ckv = static_cast<const float*>(p.ckv);
  const float* kpe = static_cast<const float*>(p.kpe);
  const int* pt_row = page_table_row(p, u);

  for (int r = warp; r < rows; r += kWarps) {
    const int i = r / hb, h = h0 + r % hb;
    const size_t tok_head = (size_t)(u.q_start + i) * p.num_heads + h;
    // lane owns ckv columns [16 lane, 16 lane + 16) and kpe columns [2 lane, 2 lane + 2)
    float qn[16], qr[2], o[16];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float4 v = *reinterpret_cast<const float4*>(q_nope + tok_head * kDimCkv + lane * 16 + 4 * k);
      qn[4 * k] = v.x; qn[4 * k + 1] = v.y; qn[4 * k + 2] = v.z; qn[4 * k + 3] = v.w;
    }
    {
      const float2 v = *reinterpret_cast<const float2*>(q_pe + tok_head * kDimKpe + lane * 2);
      qr[0] = v.x; qr[1] = v.y;
    }
#pragma unroll
    for (int k = 0; k < 16; ++k) o[k] = 0.f;
    float m = -INFINITY, l = 0.f;
    const int limit = row_key_limit(u, r, rows, hb);
    for (int key = u.kv_begin; key < limit; ++key) {
      const int page = __ldg(pt_row + (key >> p.log2_page_size));
      if (!page_in_cache(p, page)) continue;  // skipped page: its keys are masked
      const size_t slot = cache_row<size_t>(page, key, p.page_size);
      float v[16];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float4 x = *reinterpret_cast<const float4*>(ckv + slot * kDimCkv + lane * 16 + 4 * k);
        v[4 * k] = x.x; v[4 * k + 1] = x.y; v[4 * k + 2] = x.z; v[4 * k + 3] = x.w;
      }
      const float2 kr = *reinterpret_cast<const float2*>(kpe + slot * kDimKpe + lane * 2);
      float dot = qr[0] * kr.x + qr[1] * kr.y;
#pragma unroll
      for (int k = 0; k < 16; ++k) dot = fmaf(qn[k], v[k], dot);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
      const float s = dot * p.scale_log2;
      const float m_new = fmaxf(m, s);
      const float alpha = exp2f(m - m_new);  // 0 on the first key (m = -inf)
      const float w = exp2f(s - m_new);
      l = l * alpha + w;
#pragma unroll
      for (int k = 0; k < 16; ++k) o[k] = fmaf(w, v[k], o[k] * alpha);
      m = m_new;
    }
    const float inv = l != 0.f ? 1.f / l : 0.f;  // l = 0: no key, zeros; NaN l (a NaN score) stays NaN
    const float lse = l != 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
    const UnitDest d = unit_dest(p, u, i, h);
    float* dst = static_cast<float*>(d.out) + d.row * kDimCkv;
    if (lane == 0) d.lse[d.row] = lse;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      *reinterpret_cast<float4*>(dst + lane * 16 + 4 * k) =
          make_float4(o[4 * k] * inv, o[4 * k + 1] * inv, o[4 * k + 2] * inv, o[4 * k + 3] * inv);
    }
  }
}

}  // namespace cuda
}  // namespace jax_mla
