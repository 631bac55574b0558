// The sm_90a kernel of the paged MLA op: one block per work unit and head block.
// Units of at most 16 query rows take the narrow body (mla_narrow_kernel.cuh); wider units take a
// wgmma body. Instances per cache: kWide64 (256 threads; a 16-bit cache at any head count and page
// size, an fp8 ckv with 64 heads or more on pages of 32+ keys, mla_launch.cuh) holds the
// two-warpgroup body of 64-key blocks (mla_wide64_sm90.cuh), its blocks by TMA or, with kGather (a
// 16-bit cache on pages of fewer than 32 keys), by cp.async, or with kPageBoxes too (pages of 8 or 16
// keys) as TMA boxes of one page, issued by the consumers or, with kProducer (384 threads), by a third
// warpgroup; the other (384 threads: an fp8 ckv below
// 64 heads or on pages under 32 keys, an fp8 kpe) the producer / two-consumer body
// (mla_wide_sm90.cuh). Each instance holds only its own wide body, so that ptxas makes of one what it
// would alone. An fp8 kpe takes the portable wide body (mla_attention_kernel.cuh).
#pragma once

#include "mla_narrow_fp8_sm90.cuh"
#include "mla_wide64_sm90.cuh"
#include "mla_wide_sm90.cuh"

namespace jax_mla {
namespace cuda {

// ---- the kernel ----------------------------------------------------------------------

// Room for the wgmma bodies and for the two bodies it hands units to (narrow; portable wide, fp8 caches).
constexpr int kSm90SmemBytes =
    cmax(cmax(cmax(WideSm90::SMEM_BYTES, Wide64Sm90::SMEM_BYTES), NarrowFp8Sm90::SMEM_BYTES), kAttentionSmemBytes);
static_assert(kSm90SmemBytes <= 227 * 1024, "one block per SM must fit");

// grid.x = W * head_blocks (head blocks of one unit are neighbours: the second
// finds the keys in L2). 384 threads: the register cap of 168 at entry is what
// lets the warpgroups move registers between them (setmaxnreg). The kWide64 instance has
// no producer warpgroup: 256 threads, 255 registers each from the start; but where its blocks are
// gathered (kGather: pages under 32 keys) a third warpgroup may gather them (kProducer: 384 threads).
template <bool kWide64, bool kProducer = false>
constexpr int sm90_kernel_threads() {
  return !kWide64 ? WideSm90::kThreads : kProducer ? Wide64Sm90::kProducerThreads : Wide64Sm90::kThreads;
}
template <typename T, int kCache = kCacheAsQuery, bool kWide64 = false, bool kE4m3 = false, bool kGather = false,
          bool kPageBoxes = false, bool kProducer = false>
__global__ void __launch_bounds__(sm90_kernel_threads<kWide64, kProducer>(), 1) mla_attention_sm90_kernel(const Problem p, const __grid_constant__ KeyTensorMaps maps) {
  extern __shared__ __align__(16) char smem[];  // aligned to 1024 below
  allow_dependent_launch();  // the merge kernel may be scheduled as blocks retire
  JAX_MLA_BLOCK_TRACE_SCOPE(0);
  const int unit_index = blockIdx.x / p.head_blocks;
  const int head_block = blockIdx.x - unit_index * p.head_blocks;
  Unit u;
  if (!start_unit(p, unit_index, u)) return;  // padding unit (or unusable row)
  const int h0 = head_block * kRowsPerTile;
  const int hb = min(kRowsPerTile, p.num_heads - h0);
  const int rows = u.q_len * hb;
  if (rows > kRowsPerTile) return;  // cannot happen with q_len <= q_tile; keeps tiles in bounds
  // The wgmma bodies read keys as T: from a cache of T, or from an fp8 ckv turned into fp16 in
  // shared memory (by v5b's producer, or in its buffer by the 64-key body; kpe in T). An fp8 kpe
  // takes the portable wide body.
  constexpr bool kWgmmaCache = kCache != kCacheFp8CkvKpe;
  static_assert(!kWide64 || kCache != kCacheFp8CkvKpe, "the 64-key body reads a 16-bit kpe");
  static_assert(!kE4m3 || (kWide64 && kCache == kCacheFp8Ckv), "e4m3 products: the 64-key body, an fp8 ckv");
  static_assert(!kGather || (kWide64 && !kE4m3 && kCache == kCacheAsQuery), "gathered blocks: a 16-bit cache");
  static_assert(!kPageBoxes || kGather, "boxes of a page: the gathering instance's");
  // (A producer for blocks read by TMA: above 16 heads, unless built with -DJAX_MLA_WIDE64_NO_TMA_PRODUCER.)
  static_assert(!kProducer || (kWide64 && !kE4m3 && kCache == kCacheAsQuery), "a producer warpgroup: a 16-bit cache");
  // A unit start off a box boundary (32 or 64 keys) cannot take the 64-key body's TMA boxes; this
  // library's planner splits at multiples of 64, so only another plan would send one here: the
  // portable body. Gathered blocks start anywhere.
  const bool portable = !kWgmmaCache || (kWide64 && !kGather && !wide64_takes(maps, u));
  // An fp8 ckv's narrow units on sm_90a take the transposed e4m3 wgmma body (mla_narrow_fp8_sm90.cuh;
  // -DJAX_MLA_NARROW_FP8_MMA_SYNC keeps the mma.sync body for them instead, an A/B of the two). In the
  // 384-thread instance its third warpgroup stays, as the body's producer
  // (-DJAX_MLA_NARROW_FP8_NO_PRODUCER: it leaves, and the two gather for themselves; an A/B switch).
#if defined(JAX_MLA_HAS_WGMMA) && !defined(JAX_MLA_NARROW_FP8_MMA_SYNC)
  constexpr bool kNarrowFp8Wgmma = kCache == kCacheFp8Ckv;
#else
  constexpr bool kNarrowFp8Wgmma = false;
#endif
#ifdef JAX_MLA_NARROW_FP8_NO_PRODUCER
  constexpr bool kNarrowFp8Producer = false;
#else
  constexpr bool kNarrowFp8Producer = kNarrowFp8Wgmma && !kWide64;
#endif
  // The narrow body (and the portable wide body) are two warpgroups; in the 384-thread instance the
  // third hands them its registers (the bodies want more than the 168 a thread gets at entry) and
  // leaves, unless it is the fp8 narrow body's producer.
  if (rows <= 16 || portable) {
    if constexpr (!kWide64 || kProducer) {
      if (!(kNarrowFp8Producer && rows <= 16)) {
        if (__shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0) == 2) {
          release_registers<24>();
          return;
        }
        claim_registers<232>();
      }
    }
    if (rows <= 16) {
      if constexpr (kNarrowFp8Wgmma) {
        attend_unit_narrow_fp8_sm90<T, kNarrowFp8Producer>(p, maps, u, h0, hb, smem);
        return;
      }
      attend_unit_narrow<T, NarrowShapeFor<kCache>, kCache>(p, u, h0, hb, smem);
    } else if constexpr (!kWgmmaCache || kWide64) {
      finish_unit(p, u);
      // Plain copies in the TMA producer's instance: with the L2 hint ptxas 13.0 gave seven of this body's
      // copies there a descriptor in uniform registers it never set (desc[UR1], as in "Keys evict-first";
      // tools/sass_size.py flags it). Its units are the rare ones off a box boundary (another plan's).
      attend_unit_wide_portable<T, kCache, !kProducer>(p, u, h0, hb, smem);
    }
    return;
  }
#ifdef JAX_MLA_HAS_WGMMA
  uint32_t base = smem_addr(smem);
  base += (1024 - (base & 1023)) & 1023;  // the 128-byte swizzle's atoms are 1024-byte aligned
  if constexpr (kWide64) {
    // The two-warpgroup body of 64-key blocks.
    finish_unit(p, u);
    attend_unit_wide64<T, kCache, kE4m3, kGather, kPageBoxes, kProducer>(p, maps, u, h0, hb, base);
  } else if constexpr (kWgmmaCache) {
    using W = WideSm90;
    constexpr bool kFp8 = kCache == kCacheFp8Ckv;
    // Arrivals on the barriers the producer completes: every producer thread (cp.async or plain),
    // plus one per producer warp on the rope group (the key mask). With an fp8 cache
    // (wide_producer_fp8) only the 64 loader threads do that (on the rope group and on each half's
    // raw barrier), and the 32 threads of the converting warp arrive on each half's full barrier.
    constexpr int kLoaders = kFp8 ? 64 : 128, kLoaderWarps = kLoaders / 32;
    finish_unit(p, u);
    if (threadIdx.x == 0) {
      for (int s = 0; s < W::STAGES; ++s)
        for (int g = 0; g < 3; ++g) {
          mbar_init(W::full_bar(base, s, g), g == W::kRope ? kLoaders + kLoaderWarps : (kFp8 ? 32 : 128));
          mbar_init(W::empty_bar(base, s, g), W::empty_count(s, g));
          if (kFp8 && g != W::kRope) mbar_init(W::raw_bar(base, s, g), kLoaders);
        }
      mbar_init(W::query_bar(base), kFp8 ? W::kConverterThreads : 128);
      mbar_init(W::a_ready_bar(base), 128);
      mbar_init(W::b_ready_bar(base), 128);
      mbar_init_fence();
    }
    __syncthreads();
    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);  // warp-uniform, as wgmma needs
    if (wg == 0) {
      release_registers<40>();
      if constexpr (kFp8) {
        wide_producer_fp8<T>(p, maps, u, h0, hb, base);
      } else {
        wide_producer<T>(p, maps, u, h0, hb, base);
      }
    } else {
      claim_registers<232>();
      if (wg == 1) {
        wide_consumer<T, 0, kCache>(p, u, h0, hb, base);
      } else {
        wide_consumer<T, 1, kCache>(p, u, h0, hb, base);
      }
    }
  }
#endif
}

}  // namespace cuda
}  // namespace jax_mla
