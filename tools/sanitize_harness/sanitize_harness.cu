// Standalone driver of the CUDA kernels for compute-sanitizer: no JAX, one
// cudaMalloc per operand (so memcheck knows every operand's exact bounds),
// outputs poisoned with NaN bytes before the launch. Cases come from
// tools/sanitize_harness/cases.py (the `small` and `timing` shapes of
// jax_mla/arg_specs.py), which also checks the outputs against a NumPy reference.
//
//   built as the CMake target `sanitize_harness` with JAX_MLA_BUILD_TOOLS=ON
//   (scripts/gpu_check.sh: build/gpu/sanitize_harness)
//   sanitize_harness case0.bin [case1.bin ...]   (writes caseN.bin.out)
//   (fp8 caches: header word 13 the cache kind of mla_fp8.cuh, 14-15 the scales)
//   sanitize_harness --time timeN.bin ...         (device time per call of the op,
//        of its attention kernel alone, its merge kernel alone and of an empty
//        kernel: CUDA graphs of 20 calls on random device data, caches rotated;
//        then each kernel timed by events inside the attention / merge chain and
//        in a chain of its own kind, and the attention after an empty kernel, an L2
//        sweep and a code sweep)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define JAX_MLA_CHECK_EXIT 2
#include "../cuda_check.h"
#include "../mix32.h"
#include "mla_launch.cuh"

using namespace jax_mla::cuda;

template <typename T>
static T from_float_host(float x);
template <>
__nv_bfloat16 from_float_host<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__half from_float_host<__half>(float x) { return __float2half(x); }
template <>
float from_float_host<float>(float x) { return x; }

template <typename T>
static float to_float_host(T x);
template <>
float to_float_host<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
float to_float_host<__half>(__half x) { return __half2float(x); }
template <>
float to_float_host<float>(float x) { return x; }

template <typename T>
static T* upload(const std::vector<T>& v) {
  T* d = nullptr;
  CHECK(cudaMalloc(&d, std::max<size_t>(v.size(), 1) * sizeof(T)));
  if (!v.empty()) CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <typename T>
static void* upload_as(const std::vector<float>& v) {
  std::vector<T> c(v.size());
  for (size_t i = 0; i < v.size(); ++i) c[i] = from_float_host<T>(v[i]);
  return upload(c);
}

// fp8 cache values (the case file holds them as floats on the e4m3 grid: converted exactly).
static void* upload_fp8(const std::vector<float>& v) {
  std::vector<__nv_fp8_e4m3> c(v.size());
  for (size_t i = 0; i < v.size(); ++i) c[i] = __nv_fp8_e4m3(v[i]);
  return upload(c);
}

template <typename T, int kCache>
static void run(Problem p, const std::vector<float>& qn, const std::vector<float>& qp, const std::vector<float>& ckv,
                const std::vector<float>& kpe, float ckv_scale, float kpe_scale, const char* out_path) {
  using F = CacheFormat<kCache>;
  p.q_nope = upload_as<T>(qn);
  p.q_pe = upload_as<T>(qp);
  p.ckv = F::kFp8Ckv ? upload_fp8(ckv) : upload_as<T>(ckv);
  p.kpe = F::kFp8Kpe ? upload_fp8(kpe) : upload_as<T>(kpe);
  p.ckv_scale = upload(std::vector<float>{ckv_scale});  // own allocations: memcheck sees a 4-byte read
  p.kpe_scale = upload(std::vector<float>{kpe_scale});
  const size_t n_out = (size_t)p.num_tokens * p.num_heads * kDimCkv, n_lse = (size_t)p.num_tokens * p.num_heads;
  const size_t n_po = (size_t)p.num_partial_rows * p.num_heads * kDimCkv;
  const size_t n_pl = (size_t)p.num_partial_rows * p.num_heads;
  CHECK(cudaMalloc(&p.out, n_out * sizeof(T)));
  CHECK(cudaMalloc(&p.lse, n_lse * sizeof(float)));
  CHECK(cudaMalloc(&p.partial_o, n_po * sizeof(T)));  // the output's type, exactly: memcheck sees an overrun
  CHECK(cudaMalloc(&p.partial_lse, n_pl * sizeof(float)));
  CHECK(cudaMemset(p.out, 0xff, n_out * sizeof(T)));  // NaN in every float type
  CHECK(cudaMemset(p.lse, 0xff, n_lse * sizeof(float)));
  CHECK(cudaMemset(p.partial_o, 0xff, n_po * sizeof(T)));
  CHECK(cudaMemset(p.partial_lse, 0xff, n_pl * sizeof(float)));
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  CHECK((launch<T, kCache>(p, stream, 2 * sm_count())));
  CHECK(cudaStreamSynchronize(stream));
  std::vector<T> out(n_out);
  std::vector<float> res(n_out + n_lse);
  CHECK(cudaMemcpy(out.data(), p.out, n_out * sizeof(T), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(res.data() + n_out, p.lse, n_lse * sizeof(float), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n_out; ++i) res[i] = to_float_host<T>(out[i]);
  FILE* f = std::fopen(out_path, "wb");
  std::fwrite(res.data(), sizeof(float), res.size(), f);
  std::fclose(f);
  for (const void* ptr : {p.q_nope, p.q_pe, p.ckv, p.kpe, (const void*)p.ckv_scale, (const void*)p.kpe_scale})
    CHECK(cudaFree(const_cast<void*>(ptr)));
  for (void* ptr : {p.out, (void*)p.lse, (void*)p.partial_o, (void*)p.partial_lse}) CHECK(cudaFree(ptr));
  CHECK(cudaStreamDestroy(stream));
}

// ---- timing mode ----------------------------------------------------------------

template <typename T>
__global__ void fill_random(T* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const uint32_t h = mix32((uint32_t)i * 0x9e3779b9U ^ mix32(seed + (uint32_t)(i >> 32)));
    x[i] = from_float<T>((float)(h >> 8) * (4.0f / 16777216.0f) - 2.0f);
  }
}

// e4m3 bytes of magnitude <= 3.75 (exponent field <= 8), never NaN.
__global__ void fill_random_fp8(unsigned char* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const uint32_t h = mix32((uint32_t)i * 0x9e3779b9U ^ mix32(seed + (uint32_t)(i >> 32)));
    x[i] = (unsigned char)((h & 0x80u) | ((h >> 8) % 72u));
  }
}

__global__ void empty_kernel() {}
// Writes n float4 of zeros: with more bytes than L2 holds, evicts everything the kernels before read.
__global__ void sweep_kernel(float4* buf, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    buf[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}
constexpr size_t kSweepBytes = size_t{96} << 20;
// About 96 KB of code (6144 fma) and no memory traffic: evicts the other kernels' instructions from
// the SMs' instruction caches, as any large kernel between two attention calls does.
__global__ void code_sweep_kernel(float* sink, float a, float b) {
  float x = threadIdx.x;
#pragma unroll
  for (int i = 0; i < 6144; ++i) asm volatile("fma.rn.f32 %0, %0, %1, %2;" : "+f"(x) : "f"(a), "f"(b));
  if (x == 12345.f) sink[0] = x;  // never: keeps the chain live
}

template <typename T>
static T* device_random(size_t n, uint32_t seed) {
  T* d = nullptr;
  CHECK(cudaMalloc(&d, std::max<size_t>(n, 1) * sizeof(T)));
  fill_random<T><<<1024, 256>>>(d, n, seed);
  CHECK(cudaGetLastError());
  return d;
}

// Median device time per call of `calls` enqueued `n` times in one CUDA graph.
template <typename F>
static float graph_us(cudaStream_t stream, int n, F calls) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < n; ++i) calls(i);
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int r = 0; r < 12; ++r) {
    CHECK(cudaEventRecord(a, stream));
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(b, stream));
    CHECK(cudaEventSynchronize(b));
    float t = 0.f;
    CHECK(cudaEventElapsedTime(&t, a, b));
    if (r >= 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return ms[ms.size() / 2] * 1000.f / n;
}

// Event times (us) of every launch of step(0), ..., step(steps - 1), events around each: four
// rounds, the first a warm-up. Events add a little to each time, so compare these with each other,
// not with the graph times.
template <typename F>
static std::vector<float> event_intervals_us(cudaStream_t stream, int steps, F step) {
  std::vector<cudaEvent_t> ev(steps + 1);
  for (auto& e : ev) CHECK(cudaEventCreate(&e));
  std::vector<float> us;
  for (int r = 0; r < 4; ++r) {
    CHECK(cudaEventRecord(ev[0], stream));
    for (int j = 0; j < steps; ++j) {
      step(j);
      CHECK(cudaEventRecord(ev[j + 1], stream));
    }
    CHECK(cudaEventSynchronize(ev[steps]));
    for (int j = 0; r > 0 && j < steps; ++j) {
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, ev[j], ev[j + 1]));
      us.push_back(ms * 1000.f);
    }
  }
  for (auto& e : ev) CHECK(cudaEventDestroy(e));
  return us;
}

static float median_of(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median event time of each kernel kind k (0, 1) with the two kinds alternating (launch(i, 0),
// launch(i, 1), launch(i + 1, 0), ...; i cycles over `sets` input sets).
template <typename F>
static void chained_us(cudaStream_t stream, int n, int sets, F launch, float (&chained)[2]) {
  const std::vector<float> both = event_intervals_us(stream, 2 * n, [&](int j) { launch((j / 2) % sets, j & 1); });
  for (int k = 0; k < 2; ++k) {
    std::vector<float> mine;
    for (size_t j = k; j < both.size(); j += 2) mine.push_back(both[j]);  // steps alternate, 2 n per round
    chained[k] = median_of(mine);
  }
}

// Median event time of a kernel in a run of its own kind only.
template <typename F>
static float alone_us(cudaStream_t stream, int n, int sets, F launch) {
  return median_of(event_intervals_us(stream, n, [&](int j) { launch(j % sets); }));
}

template <typename T, int kCache>
static void time_case(Problem p, const char* name) {
  using F = CacheFormat<kCache>;
  auto launch_op = [](const Problem& q, cudaStream_t st, int grid) { return launch<T, kCache>(q, st, grid); };
  auto launch_attn = [](const Problem& q, cudaStream_t st) { return launch_attention<T, kCache>(q, st); };
  const size_t n_ckv = (size_t)p.num_pages * p.page_size * kDimCkv, n_kpe = (size_t)p.num_pages * p.page_size * kDimKpe;
  const size_t cache_bytes = n_ckv * F::kCkvBytes / kDimCkv + n_kpe * F::kKpeBytes / kDimKpe;
  const int sets = (int)std::min<size_t>(8, std::max<size_t>(1, (size_t)(256u << 20) / std::max<size_t>(cache_bytes, 1) + 1));
  std::vector<Problem> ps(sets, p);
  const size_t n_q = (size_t)p.num_tokens * p.num_heads;
  float* scales = nullptr;  // fp8 caches: ckv and kpe scales, 1/4 (values up to 3.75, fill_random_fp8)
  const float scale_values[2] = {0.25f, 0.25f};
  CHECK(cudaMalloc(&scales, 2 * sizeof(float)));
  CHECK(cudaMemcpy(scales, scale_values, sizeof(scale_values), cudaMemcpyHostToDevice));
  auto random_fp8 = [](size_t n, uint32_t seed) {
    unsigned char* d = nullptr;
    CHECK(cudaMalloc(&d, std::max<size_t>(n, 1)));
    fill_random_fp8<<<1024, 256>>>(d, n, seed);
    CHECK(cudaGetLastError());
    return (void*)d;
  };
  for (int s = 0; s < sets; ++s) {
    ps[s].ckv = F::kFp8Ckv ? random_fp8(n_ckv, 17 * s + 1) : (void*)device_random<T>(n_ckv, 17 * s + 1);
    ps[s].kpe = F::kFp8Kpe ? random_fp8(n_kpe, 17 * s + 2) : (void*)device_random<T>(n_kpe, 17 * s + 2);
    ps[s].ckv_scale = scales;
    ps[s].kpe_scale = scales + 1;
    ps[s].q_nope = device_random<T>(n_q * kDimCkv, 17 * s + 3);
    ps[s].q_pe = device_random<T>(n_q * kDimKpe, 17 * s + 4);
  }
  void *out, *lse, *po, *pl;
  CHECK(cudaMalloc(&out, n_q * kDimCkv * sizeof(T)));
  CHECK(cudaMalloc(&lse, n_q * sizeof(float)));
  CHECK(cudaMalloc(&po, std::max(1, p.num_partial_rows) * (size_t)p.num_heads * kDimCkv * sizeof(T)));
  CHECK(cudaMalloc(&pl, std::max(1, p.num_partial_rows) * (size_t)p.num_heads * sizeof(float)));
  for (auto& q : ps) {
    q.out = out;
    q.lse = static_cast<float*>(lse);
    q.partial_o = po;
    q.partial_lse = static_cast<float*>(pl);
  }
  CHECK(cudaDeviceSynchronize());
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int n = 20, merge_grid = merge_grid_for(sm_count());  // the library's grid
  for (int s = 0; s < sets; ++s) CHECK(launch_op(ps[s], stream, merge_grid));  // warm up, opt-ins outside capture
  CHECK(cudaStreamSynchronize(stream));
  const float full = graph_us(stream, n, [&](int i) { CHECK(launch_op(ps[i % sets], stream, merge_grid)); });
  const float attn = graph_us(stream, n, [&](int i) { CHECK(launch_attn(ps[i % sets], stream)); });
  const float merge = graph_us(stream, n, [&](int i) { CHECK(launch_merge<T>(ps[i % sets], stream, merge_grid)); });
  const float empty = graph_us(stream, n, [&](int) { empty_kernel<<<132, 256, 0, stream>>>(); });
  // The op with other merge grids, and with the merge as an ordinary launch (no PDL).
  float grid_us[3];
  const int grids[3] = {sm_count(), 2 * sm_count(), 4 * sm_count()};
  for (int g = 0; g < 3; ++g)
    grid_us[g] = graph_us(stream, n, [&](int i) { CHECK(launch_op(ps[i % sets], stream, grids[g])); });
  auto launch_merge_plain = [&](const Problem& q) {  // an ordinary launch: no PDL
    mla_merge_kernel<T><<<merge_grid, kThreads, 0, stream>>>(q);
    CHECK(cudaGetLastError());
  };
  const float no_pdl = graph_us(stream, n, [&](int i) {
    CHECK(launch_attn(ps[i % sets], stream));
    launch_merge_plain(ps[i % sets]);
  });
  // Each kernel's own time inside the chain attention, merge, attention, ... (no PDL; events around
  // every launch), against the same events around each kernel in a chain of its own kind: which of
  // the two costs more when they follow each other than when they run alone.
  float chained[2], after_empty[2], after_sweep[2], after_code[2];
  float4* sweep = nullptr;
  CHECK(cudaMalloc(&sweep, kSweepBytes));
  auto attention_then = [&](auto other) {
    return [&, other](int i, int k) {
      if (k == 0) {
        CHECK(launch_attn(ps[i], stream));
      } else {
        other(i);
      }
    };
  };
  chained_us(stream, n, sets, attention_then([&](int i) { launch_merge_plain(ps[i]); }), chained);
  const float alone[2] = {alone_us(stream, n, sets, [&](int i) { CHECK(launch_attn(ps[i], stream)); }),
                          alone_us(stream, n, sets, [&](int i) { launch_merge_plain(ps[i]); })};
  // The attention after three other kernels instead of the merge: an empty one (a kernel switch
  // and nothing else), one that writes 96 MB (L2 holds none of what the attention read before) and
  // one of 96 KB of code (the attention's instructions are no longer cached).
  chained_us(stream, n, sets, attention_then([&](int) { empty_kernel<<<132, 256, 0, stream>>>(); }), after_empty);
  chained_us(stream, n, sets,
             attention_then([&](int) { sweep_kernel<<<2 * 132, 256, 0, stream>>>(sweep, kSweepBytes / sizeof(float4)); }),
             after_sweep);
  chained_us(stream, n, sets, attention_then([&](int) {
               code_sweep_kernel<<<132, 128, 0, stream>>>(reinterpret_cast<float*>(sweep), 1.0001f, 0.5f);
             }),
             after_code);
  std::printf("time %s (cache %d, W=%d M=%d sets=%d): op %.1f us | attention alone %.1f | merge alone %.1f | empty kernel %.1f"
              " | op with merge grid %d/%d/%d: %.1f/%.1f/%.1f | op without PDL %.1f"
              " | events: attention %.1f chained / %.1f alone, merge %.1f chained / %.1f alone"
              " | attention after an empty kernel %.1f, after an L2 sweep %.1f, after a code sweep %.1f\n",
              name, kCache, p.num_work, p.num_merge, sets, full, attn, merge, empty, grids[0], grids[1], grids[2], grid_us[0],
              grid_us[1], grid_us[2], no_pdl, chained[0], alone[0], chained[1], alone[1], after_empty[0], after_sweep[0],
              after_code[0]);
  CHECK(cudaFree(sweep));
#ifdef JAX_MLA_TRACE
  // A body's timeline (mla_common.cuh, JAX_MLA_TRACE) of one more launch of the attention: after another
  // attention launch (NAME), then after an op's merge kernel (NAME@merge), where the code and the L2
  // lines the merge used are cold for the attention again. Row 0's event 11 is the body's id.
  static long long trace[kTraceSlots][kTraceRows + 1][kTraceEvents];
  auto print_trace = [&](const char* suffix) {
    CHECK(cudaStreamSynchronize(stream));
    CHECK(cudaMemcpyFromSymbol(trace, g_jax_mla_trace, sizeof(trace)));
    for (int slot = 0; slot < kTraceSlots; ++slot) {
      const long long t0 = trace[slot][0][0];
      std::printf("trace %s%s slot %d globaltimer %lld %lld body %lld\n", name, suffix, slot, trace[slot][0][6],
                  trace[slot][0][7], trace[slot][0][11]);
      for (int row = 0; row <= kTraceRows; ++row) {
        std::printf("trace %s%s slot %d row %d:", name, suffix, slot, row);
        for (int e = 0; e < kTraceEvents; ++e)
          if (row > 0 || e < 6 || (e > 7 && e < 11)) std::printf(" %lld", trace[slot][row][e] - t0);
        std::printf("\n");
      }
    }
    std::memset(trace, 0, sizeof(trace));
    CHECK(cudaMemcpyToSymbol(g_jax_mla_trace, trace, sizeof(trace)));
  };
  std::memset(trace, 0, sizeof(trace));
  CHECK(cudaMemcpyToSymbol(g_jax_mla_trace, trace, sizeof(trace)));
  CHECK(launch_attn(ps[0], stream));
  CHECK(launch_attn(ps[1 % sets], stream));
  print_trace("");
  CHECK(launch_op(ps[0], stream, merge_grid));
  CHECK(launch_attn(ps[1 % sets], stream));
  print_trace("@merge");
#endif
#ifdef JAX_MLA_BLOCK_TRACE
  // Where every block of one op call ran (mla_common.cuh, BlockTraceScope), after a warm-up call, and
  // the work table, for tools/block_trace_report.py. Times in ns from the first attention block's start.
  {
    CHECK(launch_op(ps[1 % sets], stream, merge_grid));
    static unsigned long long bt[2][kBlockTraceMax][3];
    std::memset(bt, 0, sizeof(bt));
    CHECK(cudaMemcpyToSymbolAsync(g_jax_mla_block_trace, bt, sizeof(bt), 0, cudaMemcpyHostToDevice, stream));
    CHECK(launch_op(ps[0], stream, merge_grid));
    CHECK(cudaStreamSynchronize(stream));
    CHECK(cudaMemcpyFromSymbol(bt, g_jax_mla_block_trace, sizeof(bt)));
    const int grids_of[2] = {std::min(p.num_work * p.head_blocks, kBlockTraceMax), std::min(merge_grid, kBlockTraceMax)};
    unsigned long long t0 = ~0ull;
    for (int b = 0; b < grids_of[0]; ++b)
      if (bt[0][b][1] != 0) t0 = std::min(t0, bt[0][b][0]);
    std::printf("blocktrace %s sms %d heads %d head_blocks %d work %d merge_grid %d\n", name, sm_count(), p.num_heads, p.head_blocks,
                p.num_work, merge_grid);
    for (int k = 0; k < 2; ++k)
      for (int b = 0; b < grids_of[k]; ++b)
        if (bt[k][b][1] != 0)
          std::printf("blocktrace %s kind %d block %d sm %llu start %lld end %lld\n", name, k, b, bt[k][b][2],
                      (long long)(bt[k][b][0] - t0), (long long)(bt[k][b][1] - t0));
    std::vector<int32_t> work((size_t)p.num_work * jax_mla::kWorkCols);
    CHECK(cudaMemcpy(work.data(), p.work, work.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
    std::vector<int32_t> kv_lens(p.num_kv_lens);
    CHECK(cudaMemcpy(kv_lens.data(), p.kv_lens, kv_lens.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
    std::printf("blockkv %s:", name);
    for (int32_t l : kv_lens) std::printf(" %d", l);
    std::printf("\n");
    for (int w = 0; w < p.num_work; ++w) {
      std::printf("blockwork %s unit %d:", name, w);
      for (int c = 0; c < jax_mla::kWorkCols; ++c) std::printf(" %d", work[(size_t)w * jax_mla::kWorkCols + c]);
      std::printf("\n");
    }
  }
#endif
  for (auto& q : ps)
    for (const void* ptr : {q.q_nope, q.q_pe, q.ckv, q.kpe}) CHECK(cudaFree(const_cast<void*>(ptr)));
  for (void* ptr : {out, lse, po, pl, (void*)scales}) CHECK(cudaFree(ptr));
  CHECK(cudaStreamDestroy(stream));
}

template <typename T>
static std::vector<T> take(FILE* f, size_t n) {
  std::vector<T> v(n);
  if (n && std::fread(v.data(), sizeof(T), n, f) != n) {
    std::fprintf(stderr, "short read\n");
    std::exit(2);
  }
  return v;
}

int main(int argc, char** argv) {
  // Line by line, so that a run cut off by a timeout (a hang in a variant under test) still shows the cases it
  // finished, and names the one it hung on.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const bool timing = argc > 1 && std::string(argv[1]) == "--time";
  for (int a = timing ? 2 : 1; a < argc; ++a) {
    FILE* f = std::fopen(argv[a], "rb");
    if (!f) return 2;
    const auto h = take<int32_t>(f, 16);
    const float scale = take<float>(f, 1)[0];
    const int dtype = h[1], T = h[2], H = h[3], P = h[4], ps = h[5], R = h[6], maxp = h[7], nkv = h[8], W = h[9],
              M = h[10], Pp = h[11];
    const bool data = h[12] == 0;  // timing cases carry no arrays: data is drawn on the device
    const auto qn = take<float>(f, data ? (size_t)T * H * kDimCkv : 0), qp = take<float>(f, data ? (size_t)T * H * kDimKpe : 0);
    const auto ckv = take<float>(f, data ? (size_t)P * ps * kDimCkv : 0), kpe = take<float>(f, data ? (size_t)P * ps * kDimKpe : 0);
    const auto pt = take<int32_t>(f, (size_t)R * maxp), kvl = take<int32_t>(f, nkv);
    const auto work = take<int32_t>(f, (size_t)W * 8), merge = take<int32_t>(f, (size_t)M * 4);
    std::fclose(f);
    Problem p{};
    p.page_table = upload(pt);
    p.kv_lens = upload(kvl);
    p.work = upload(work);
    p.merge = upload(merge);
    set_problem_sizes(p, T, H, P, ps, R, maxp, nkv, W, M, Pp, scale);
#ifdef JAX_MLA_E4M3_WIDE  // every case as with the op's fp8_products (lossy: check with JAX_MLA_CHECK_TOL)
    p.fp8_products = 1;
#endif
    // Word 13: the cache kind (mla_fp8.cuh); 14-15: the fp8 scales' float bits (cases with data).
    const int cache = h[13];
    if (timing) {
      if (dtype == 0 && cache == kCacheFp8Ckv) time_case<__nv_bfloat16, kCacheFp8Ckv>(p, argv[a]);
      else if (dtype == 0) time_case<__nv_bfloat16, kCacheAsQuery>(p, argv[a]);
      else time_case<__half, kCacheAsQuery>(p, argv[a]);
    } else {
      const std::string out_path = std::string(argv[a]) + ".out";
      float ckv_scale = 1.f, kpe_scale = 1.f;
      std::memcpy(&ckv_scale, &h[14], 4);
      std::memcpy(&kpe_scale, &h[15], 4);
      const char* o = out_path.c_str();
      if (dtype == 0 && cache == kCacheFp8Ckv) run<__nv_bfloat16, kCacheFp8Ckv>(p, qn, qp, ckv, kpe, ckv_scale, kpe_scale, o);
      else if (dtype == 0 && cache == kCacheFp8CkvKpe) run<__nv_bfloat16, kCacheFp8CkvKpe>(p, qn, qp, ckv, kpe, ckv_scale, kpe_scale, o);
      else if (dtype == 1 && cache == kCacheFp8Ckv) run<__half, kCacheFp8Ckv>(p, qn, qp, ckv, kpe, ckv_scale, kpe_scale, o);
      else if (dtype == 0) run<__nv_bfloat16, kCacheAsQuery>(p, qn, qp, ckv, kpe, 1.f, 1.f, o);
      else if (dtype == 1) run<__half, kCacheAsQuery>(p, qn, qp, ckv, kpe, 1.f, 1.f, o);
      else run<float, kCacheAsQuery>(p, qn, qp, ckv, kpe, 1.f, 1.f, o);
      std::printf("ran %s (dtype %d, cache %d, T=%d H=%d ps=%d W=%d M=%d)\n", argv[a], dtype, cache, T, H, ps, W, M);
    }
    for (const int32_t* ptr : {p.page_table, p.kv_lens, p.work, p.merge}) CHECK(cudaFree(const_cast<int32_t*>(ptr)));
  }
  return 0;
}
