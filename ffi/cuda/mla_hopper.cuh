// Hopper (sm_90a) building blocks of the wide body (mla_wide_sm90.cuh): mbarriers,
// named barriers, register reallocation between warpgroups, and the warpgroup
// MMAs the bodies issue. Everything here compiles to nothing outside
// sm_90a (JAX_MLA_HAS_WGMMA), where the body is never launched.
#pragma once

#include <cuda.h>  // CUtensorMap (a type only: the encoder is reached through the runtime)

#include <type_traits>

#include "mla_common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAX_MLA_HAS_WGMMA 1
#endif

namespace jax_mla {
namespace cuda {

// Shared-memory matrix descriptors are 64 bits: start address (>> 4) and leading byte offset in the
// low word, stride byte offset and swizzle mode in the high word. Every descriptor here has the same
// high word (8-row groups 1024 B apart, 128-byte swizzle), so the kernels keep only a low word per set
// of panels and make each wgmma's descriptor as that word plus byte offset / 16: one 32-bit add
// (shared addresses stay below 2^18, so the start field never carries into the next one).
constexpr uint32_t kSw128DescHi = (uint32_t)((((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62)) >> 32);

// Low word of the descriptor of a K-major operand (Q and K in S = Q K^T) stored in the 128-byte
// swizzle: rows of 64 elements (128 B), 16-byte chunk j of row r at j ^ (r & 7), groups of 8 rows
// 1024 B apart, every group 1024-byte aligned. Advancing along K inside the 128-byte row is adding
// the byte offset to the start address. The leading offset is unused when swizzled (set to 1).
__device__ __forceinline__ uint32_t sw128_desc_lo(uint32_t smem_byte_addr) {
  return ((smem_byte_addr & 0x3FFFF) >> 4) | (1u << 16);
}

// The descriptor at byte_offset past the one whose low word is lo.
__device__ __forceinline__ uint64_t sw128_desc_at(uint32_t lo, uint32_t byte_offset) {
  return ((uint64_t)kSw128DescHi << 32) | (uint64_t)(lo + (byte_offset >> 4));
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef JAX_MLA_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
// Bytes (a multiple of 16, both ends 16-byte aligned) from shared to global memory by the bulk
// copy engine, in this thread's bulk group; bulk_commit_and_wait_read() closes the group and waits
// until every copy in it has read its shared-memory source.
__device__ __forceinline__ void bulk_copy_s2g(void* dst, uint32_t src, uint32_t bytes) {
#ifdef JAX_MLA_HAS_WGMMA
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit_and_wait_read() {
#ifdef JAX_MLA_HAS_WGMMA
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#ifdef JAX_MLA_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Keeps the compiler from moving accumulator reads above the wait.
template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// cp.async / st.shared writes become visible to the async proxy (wgmma operand reads).
__device__ __forceinline__ void fence_proxy_async_shared() {
#ifdef JAX_MLA_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}


// An opaque copy of a value: descriptors computed from it are not hoisted out of
// the key loop (dozens of loop-invariant 64-bit descriptors would stay live in
// registers the accumulators need).
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}

// ---- mbarriers (shared::cta, 64-bit) ------------------------------------------

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
#ifdef JAX_MLA_HAS_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}
// Makes the initialised barriers visible before any thread uses them (then a __syncthreads).
__device__ __forceinline__ void mbar_init_fence() {
#ifdef JAX_MLA_HAS_WGMMA
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// One arrival (release: this thread's earlier shared-memory writes are visible to a waiter).
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#ifdef JAX_MLA_HAS_WGMMA
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#endif
}
// One arrival that fires when every cp.async this thread issued so far has landed;
// counted in the barrier's expected count (noinc).
__device__ __forceinline__ void mbar_arrive_on_cp_async(uint32_t bar) {
#ifdef JAX_MLA_HAS_WGMMA
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
#endif
}
// One arrival that also announces `bytes` more to come from bulk (TMA) copies
// completing on this barrier: the phase ends when every arrival is in and the bytes have landed.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#ifdef JAX_MLA_HAS_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

// ---- TMA (cp.async.bulk.tensor) -------------------------------------------------

// TMA descriptors of the two caches seen as 2-D tensors of rows (ckv [P * ps, 512],
// kpe [P * ps, 64]) with a box of box_rows rows x 128 bytes (64 dims; an fp8 ckv: 128 raw
// bytes) in the 128-byte swizzle the stage panels use (the wide bodies', and the fp8 narrow
// body's producer). Made on the host for every launch (mla_launch.cuh); `enabled` is 0 where
// they could not be made, or the page size is below a box.
struct KeyTensorMaps {
  CUtensorMap ckv;
  CUtensorMap kpe;
  int enabled;
  int box_rows;  // keys per box: WideSm90::BK, 64 for the 64-key body on pages of 64 keys or more, or a
                 // page of 8-16 keys for its gathering instance
};

// The tensor row a box of keys starts at: `key`'s row of `page` where the box may be read, else `box`
// rows before the tensor (a bad page id, or a box wholly past the range), which TMA fills with zeros.
__device__ __forceinline__ int tma_box_row(bool ok, int page, int key, int page_size, int box) {
  return ok ? cache_row<int>(page, key, page_size) : -box;
}

// Panels of 64 keys x 128 bytes (a TMA box row each, any 128-byte swizzle: a row's chunks stay in
// the row), four of them consecutive: a block's latent keys in the e4m3 stages and the 64-key body.
constexpr int kKeyPanelBytes = 64 * 128;

// Rows [from, to) of PANELS consecutive key panels (four by default) set to zero by one warpgroup
// (tid 0-127). A box the range ends in comes whole from its page, so a unit's last block holds keys
// past the range whose bytes (NaN among them, in a pool) must not reach P V: 0 times a NaN is NaN
// (rows [from, 64)); a walk's unit that starts off a box holds keys before its start (rows [0, to),
// all eight latent panels: mla_wide64_sm90.cuh).
template <int PANELS = 4>
__device__ __forceinline__ void zero_key_panel_rows(uint32_t panels, int from, int tid, int to = 64) {
  static_assert(PANELS == 2 || PANELS == 4 || PANELS == 8, "a half, a warpgroup's or a whole block's latent panels");
  constexpr int kShift = PANELS == 8 ? 6 : PANELS == 4 ? 5 : 4;  // 16-byte chunks a row: 8 PANELS = 2^kShift
#pragma unroll 1
  for (int idx = tid; idx < (to - from) << kShift; idx += 128) {
    const int r = from + (idx >> kShift), c = idx & ((1 << kShift) - 1);  // chunk c of row r: panel c / 8
    st_shared_v4(panels + (c >> 3) * kKeyPanelBytes + r * 128 + ((c & 7) << 4), make_uint4(0, 0, 0, 0));
  }
}

// A box of a 2-D tensor map (made on the host, mla_launch.cuh) at element
// coordinates (column c0, row c1) into shared memory at dst; completion is
// counted in bytes on the mbarrier. The map must live in parameter, constant or
// global memory: the kernel takes it as a __grid_constant__ parameter.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, int c0, int c1, uint32_t bar) {
#ifdef JAX_MLA_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
#endif
}

// tma_load_2d with an L2 cache policy (l2_evict_first_policy: for data read once, or twice close
// together), made by the caller once for many boxes or per box (ptxas hoists it).
__device__ __forceinline__ void tma_load_2d_hint(uint32_t dst, const void* map, int c0, int c1, uint32_t bar,
                                                 uint64_t policy) {
#ifdef JAX_MLA_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "l"(policy)
      : "memory");
#endif
}

// Waits until the phase of the given parity has completed (acquire). A fresh
// barrier is in phase 0, so waiting for parity 1 returns at once: that is how a
// producer passes its first wait on an "empty" barrier.
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
#ifdef JAX_MLA_HAS_WGMMA
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
  __syncwarp();  // lanes leave the loop separately; .aligned instructions (wgmma, bar.sync) follow
#endif
}

// Four 8 x 8 matrices of 16-bit pairs stored transposed: lane (g, t)'s r[i] holds row g, columns
// 2t, 2t+1 of matrix i, which land in rows 2t, 2t+1 (column g) of memory; lanes 8i .. 8i+7 give the
// addresses of matrix i's eight memory rows.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
#ifdef JAX_MLA_HAS_WGMMA
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
#endif
}

// ---- named barriers between warpgroups -----------------------------------------

// Not .aligned: the two consumer warpgroups reach it through different code (one
// template instance each), which the .aligned form (bar.sync) does not allow.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- register reallocation between warpgroups (needs a register cap at entry) ----

template <int N>
__device__ __forceinline__ void release_registers() {
#ifdef JAX_MLA_HAS_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void claim_registers() {
#ifdef JAX_MLA_HAS_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef JAX_MLA_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Keeps A fragments that an in-flight wgmma reads alive (and unmoved) until the wait.
template <int N>
__device__ __forceinline__ void fence_fragments(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}

// ---- shared-memory matrix descriptors (128-byte swizzle) ----------------------
//
// Tiles here are "panels": 64 dimensions (128 bytes) wide, one row per key or
// query, 16-byte chunk c of row r at c ^ (r & 7), 1024-byte aligned.
//  * K-major (the MMA's K runs along the row): sw128_desc_lo above; Q and K in S = Q K^T.
//  * MN-major: V in O += P V, where K (the keys) runs down the rows and N (the
//    dimensions) along them. Groups of 8 keys are 1024 bytes apart (stride byte
//    offset) and the next 64 dimensions live one panel further on (leading byte
//    offset = the panel's size).
__device__ __forceinline__ uint32_t sw128_mn_desc_lo(uint32_t smem_byte_addr, uint32_t panel_bytes) {
  return ((smem_byte_addr & 0x3FFFF) >> 4) | (((panel_bytes >> 4) & 0x3FFF) << 16);
}

// ---- the warpgroup MMAs --------------------------------------------------
// Accumulator layout (all of them): warp w of the warpgroup holds rows 16w + g and
// 16w + g + 8 (g = lane / 4); d[4n + e] is column 8n + 2 (lane % 4) + (e & 1) of
// row 16w + g + 8 (e >> 1). Register A fragments have the mma.sync m16n8k16 A
// layout per warp: a[0] (g, 2t..2t+1), a[1] (g+8, 2t..), a[2] (g, 8+2t..), a[3] (g+8, 8+2t..).
// `accumulate` = 0 ignores d's old contents.

// One wgmma with a predicate from `accumulate`: the D registers' text (DREGS) and operands
// (DOUTS, a JAX_MLA_D* name), then A and B as the instruction takes them (AB: "desc_a, desc_b" or "{a regs}, desc_b"),
// the predicate's operand (PRED) and the immediates after it (IMM: scale A, scale B, and the
// transpose flags of the shared-memory operands). The operands after DOUTS are the inputs.
// clang-format off
#define JAX_MLA_WGMMA(TY, SHAPE, DREGS, DOUTS, AB, PRED, IMM, ...)                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n"                                    \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " {" DREGS "}, " AB ", p, " IMM ";\n}\n" \
             : DOUTS() : __VA_ARGS__)
// The accumulators of a 64 x N tile, N / 2 floats a thread (function-like, so that the list
// passes through JAX_MLA_WGMMA_T's arguments as one name).
#define JAX_MLA_F8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                      "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define JAX_MLA_D16() JAX_MLA_F8(0), JAX_MLA_F8(8)
#define JAX_MLA_D32() JAX_MLA_D16(), JAX_MLA_F8(16), JAX_MLA_F8(24)
#define JAX_MLA_D128() JAX_MLA_D32(), JAX_MLA_F8(32), JAX_MLA_F8(40), JAX_MLA_F8(48), JAX_MLA_F8(56), JAX_MLA_F8(64), JAX_MLA_F8(72), JAX_MLA_F8(80), JAX_MLA_F8(88), JAX_MLA_F8(96), JAX_MLA_F8(104), JAX_MLA_F8(112), JAX_MLA_F8(120)
#define JAX_MLA_R16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define JAX_MLA_R32 JAX_MLA_R16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define JAX_MLA_R128 JAX_MLA_R32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
// The bf16 or fp16 form of one of them, by T.
#define JAX_MLA_WGMMA_T(...)                                \
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {         \
    JAX_MLA_WGMMA("bf16", __VA_ARGS__);                     \
  } else {                                                  \
    JAX_MLA_WGMMA("f16", __VA_ARGS__);                      \
  }
// clang-format on

// S += Q K^T over one k16 step (v5b): D 64 x 32, A (64 x 16) and B (32 keys x 16) K-major in shared memory.
template <typename T>
__device__ __forceinline__ void wgmma_64x32_ss(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#ifdef JAX_MLA_HAS_WGMMA
  JAX_MLA_WGMMA_T("m64n32k16", JAX_MLA_R16, JAX_MLA_D16, "%16, %17", "%18", "1, 1, 0, 0", "l"(desc_a), "l"(desc_b),
                  "r"(accumulate))
#endif
}
// O += P V over one k16 step of keys: D 64 x 256, A = P from registers, B = V MN-major.
template <typename T>
__device__ __forceinline__ void wgmma_64x256_rs_mn(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b,
                                                   int accumulate) {
#ifdef JAX_MLA_HAS_WGMMA
  JAX_MLA_WGMMA_T("m64n256k16", JAX_MLA_R128, JAX_MLA_D128, "{%128, %129, %130, %131}, %132", "%133", "1, 1, 1",
                  "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))
#endif
}
// S += Q K^T over one k16 step of the 64-key body: D 64 x 64, A (64 x 16) and B (64 keys x 16)
// K-major in shared memory.
template <typename T>
__device__ __forceinline__ void wgmma_64x64_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#ifdef JAX_MLA_HAS_WGMMA
  JAX_MLA_WGMMA_T("m64n64k16", JAX_MLA_R32, JAX_MLA_D32, "%32, %33", "%34", "1, 1, 0, 0", "l"(desc_a), "l"(desc_b),
                  "r"(accumulate))
#endif
}
// The same with A from registers (the queries' rope part, held by each warpgroup).
template <typename T>
__device__ __forceinline__ void wgmma_64x64_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                               int accumulate) {
#ifdef JAX_MLA_HAS_WGMMA
  JAX_MLA_WGMMA_T("m64n64k16", JAX_MLA_R32, JAX_MLA_D32, "{%32, %33, %34, %35}, %36", "%37", "1, 1, 0",
                  "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))
#endif
}
// O += P V over one k16 step of keys with P from shared memory (K-major, the other warpgroup's
// probabilities) and V MN-major: D 64 x 256.
template <typename T>
__device__ __forceinline__ void wgmma_64x256_ss_mn(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#ifdef JAX_MLA_HAS_WGMMA
  JAX_MLA_WGMMA_T("m64n256k16", JAX_MLA_R128, JAX_MLA_D128, "%128, %129", "%130", "1, 1, 0, 1", "l"(desc_a),
                  "l"(desc_b), "r"(accumulate))
#endif
}
// O^T += V^T P^T over one k32 step of keys on e4m3 (mla_narrow_fp8_sm90.cuh):
// D 64 output dims x 32 (two e4m3 terms of the 16 query rows' P), A = V^T from registers (raw key
// bytes, permuted; the 8-bit A layout per warp: a[0] (g, 4t..4t+3), a[1] (g+8, 4t..), a[2] (g,
// 16+4t..), a[3] (g+8, 16+4t..)), B = P (32 x 32) K-major e4m3 in shared memory.
__device__ __forceinline__ void wgmma_64x32_rs_e4m3(float (&d)[16], const uint32_t (&a)[4], uint64_t desc_b,
                                                    int accumulate) {
#ifdef JAX_MLA_HAS_WGMMA
  JAX_MLA_WGMMA("e4m3", "m64n32k32", JAX_MLA_R16, JAX_MLA_D16, "{%16, %17, %18, %19}, %20", "%21", "1, 1",
                "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
#endif
}
// S^T += K Q^T over one k32 step of an e4m3 ckv (mla_narrow_fp8_sm90.cuh): D 64 keys x N (the e4m3
// terms of the 16 query rows, N / 16 of them), A (64 keys x 32 dims) and B (N x 32) K-major e4m3 in
// shared memory, raw as they landed.
#define JAX_MLA_D24() JAX_MLA_D16(), JAX_MLA_F8(16)
#define JAX_MLA_R24 JAX_MLA_R16 ", %16, %17, %18, %19, %20, %21, %22, %23"
template <int N>
__device__ __forceinline__ void wgmma_64xN_ss_e4m3(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                                   int accumulate) {
  static_assert(N == 32 || N == 48, "two or three terms of 16 rows");
#ifdef JAX_MLA_HAS_WGMMA
  if constexpr (N == 32) {
    JAX_MLA_WGMMA("e4m3", "m64n32k32", JAX_MLA_R16, JAX_MLA_D16, "%16, %17", "%18", "1, 1", "l"(desc_a),
                  "l"(desc_b), "r"(accumulate));
  } else {
    JAX_MLA_WGMMA("e4m3", "m64n48k32", JAX_MLA_R24, JAX_MLA_D24, "%24, %25", "%26", "1, 1", "l"(desc_a),
                  "l"(desc_b), "r"(accumulate));
  }
#endif
}
#undef JAX_MLA_R24
#undef JAX_MLA_D24
// The lossy e4m3 wide body (mla_wide64_e4m3_sm90.cuh): S += Q K^T over one k32 step, D 64 rows
// x 64 keys, A (e4m3 queries) and B (raw e4m3 keys) K-major in shared memory; and O^T += V^T P^T over one
// k32 step, D 64 dims x 64 rows, A = V^T from registers (the 8-bit A layout above), B = P (64 rows x 32 keys)
// K-major e4m3 in shared memory.
__device__ __forceinline__ void wgmma_64x64_ss_e4m3(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#ifdef JAX_MLA_HAS_WGMMA
  JAX_MLA_WGMMA("e4m3", "m64n64k32", JAX_MLA_R32, JAX_MLA_D32, "%32, %33", "%34", "1, 1", "l"(desc_a), "l"(desc_b),
                "r"(accumulate));
#endif
}
__device__ __forceinline__ void wgmma_64x64_rs_e4m3(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                    int accumulate) {
#ifdef JAX_MLA_HAS_WGMMA
  JAX_MLA_WGMMA("e4m3", "m64n64k32", JAX_MLA_R32, JAX_MLA_D32, "{%32, %33, %34, %35}, %36", "%37", "1, 1",
                "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
#endif
}
#define JAX_MLA_D8() JAX_MLA_F8(0)
// The rope part of the same: D 64 keys x 16 rows, A (kpe, 64 keys x 16) and B (q_pe, 16 x 16) K-major
// in shared memory.
template <typename T>
__device__ __forceinline__ void wgmma_64x16_ss(float (&d)[8], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#ifdef JAX_MLA_HAS_WGMMA
  JAX_MLA_WGMMA_T("m64n16k16", "%0, %1, %2, %3, %4, %5, %6, %7", JAX_MLA_D8, "%8, %9", "%10", "1, 1, 0, 0",
                  "l"(desc_a), "l"(desc_b), "r"(accumulate))
#endif
}
#undef JAX_MLA_D8
#undef JAX_MLA_WGMMA_T
#undef JAX_MLA_R128
#undef JAX_MLA_R32
#undef JAX_MLA_R16
#undef JAX_MLA_D128
#undef JAX_MLA_D32
#undef JAX_MLA_D16
#undef JAX_MLA_F8
#undef JAX_MLA_WGMMA


}  // namespace cuda
}  // namespace jax_mla
