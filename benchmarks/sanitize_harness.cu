// Standalone driver of the CUDA kernels for compute-sanitizer: no JAX, one
// cudaMalloc per operand (so memcheck knows every operand's exact bounds),
// outputs poisoned with NaN bytes before the launch. Cases come from
// benchmarks/sanitize_harness.py, which also checks the outputs against a
// NumPy reference.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 -lineinfo -Iffi/include -Iffi/cuda \
//        benchmarks/sanitize_harness.cu -o /tmp/mla_harness
//   /tmp/mla_harness case0.bin [case1.bin ...]   (writes caseN.bin.out)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mla_launch.cuh"

using namespace jax_mla::cuda;

#define CHECK(x)                                                                      \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                   \
    }                                                                                 \
  } while (0)

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

template <typename T>
static void run(Problem p, const std::vector<float>& qn, const std::vector<float>& qp, const std::vector<float>& ckv,
                const std::vector<float>& kpe, const char* out_path) {
  p.q_nope = upload_as<T>(qn);
  p.q_pe = upload_as<T>(qp);
  p.ckv = upload_as<T>(ckv);
  p.kpe = upload_as<T>(kpe);
  const size_t n_out = (size_t)p.num_tokens * p.num_heads * kDimCkv, n_lse = (size_t)p.num_tokens * p.num_heads;
  const size_t n_po = (size_t)p.num_partial_rows * p.num_heads * kDimCkv;
  const size_t n_pl = (size_t)p.num_partial_rows * p.num_heads;
  CHECK(cudaMalloc(&p.out, n_out * sizeof(T)));
  CHECK(cudaMalloc(&p.lse, n_lse * sizeof(float)));
  CHECK(cudaMalloc(&p.partial_o, n_po * sizeof(float)));
  CHECK(cudaMalloc(&p.partial_lse, n_pl * sizeof(float)));
  CHECK(cudaMemset(p.out, 0xff, n_out * sizeof(T)));  // NaN in every float type
  CHECK(cudaMemset(p.lse, 0xff, n_lse * sizeof(float)));
  CHECK(cudaMemset(p.partial_o, 0xff, n_po * sizeof(float)));
  CHECK(cudaMemset(p.partial_lse, 0xff, n_pl * sizeof(float)));
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  CHECK(launch<T>(p, stream, 2 * sm_count()));
  CHECK(cudaStreamSynchronize(stream));
  std::vector<T> out(n_out);
  std::vector<float> res(n_out + n_lse);
  CHECK(cudaMemcpy(out.data(), p.out, n_out * sizeof(T), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(res.data() + n_out, p.lse, n_lse * sizeof(float), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n_out; ++i) res[i] = to_float_host<T>(out[i]);
  FILE* f = std::fopen(out_path, "wb");
  std::fwrite(res.data(), sizeof(float), res.size(), f);
  std::fclose(f);
  for (const void* ptr : {p.q_nope, p.q_pe, p.ckv, p.kpe}) CHECK(cudaFree(const_cast<void*>(ptr)));
  for (void* ptr : {p.out, (void*)p.lse, (void*)p.partial_o, (void*)p.partial_lse}) CHECK(cudaFree(ptr));
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
  for (int a = 1; a < argc; ++a) {
    FILE* f = std::fopen(argv[a], "rb");
    if (!f) return 2;
    const auto h = take<int32_t>(f, 16);
    const float scale = take<float>(f, 1)[0];
    const int dtype = h[1], T = h[2], H = h[3], P = h[4], ps = h[5], R = h[6], maxp = h[7], nkv = h[8], W = h[9],
              M = h[10], Pp = h[11];
    const auto qn = take<float>(f, (size_t)T * H * kDimCkv), qp = take<float>(f, (size_t)T * H * kDimKpe);
    const auto ckv = take<float>(f, (size_t)P * ps * kDimCkv), kpe = take<float>(f, (size_t)P * ps * kDimKpe);
    const auto pt = take<int32_t>(f, (size_t)R * maxp), kvl = take<int32_t>(f, nkv);
    const auto work = take<int32_t>(f, (size_t)W * 8), merge = take<int32_t>(f, (size_t)M * 4);
    std::fclose(f);
    Problem p{};
    p.page_table = upload(pt);
    p.kv_lens = upload(kvl);
    p.work = upload(work);
    p.merge = upload(merge);
    p.num_tokens = T;
    p.num_heads = H;
    p.num_pages = P;
    p.page_size = ps;
    while ((1 << p.log2_page_size) < ps) ++p.log2_page_size;
    p.num_requests = R;
    p.max_pages = maxp;
    p.num_kv_lens = nkv;
    p.num_work = W;
    p.num_merge = M;
    p.num_partial_rows = Pp;
    p.head_blocks = (H + kRowsPerTile - 1) / kRowsPerTile;
    p.q_tile = std::max(1, kRowsPerTile / H);
    p.capacity = maxp * ps;
    p.scale_log2 = scale * kLog2e;
    const std::string out_path = std::string(argv[a]) + ".out";
    if (dtype == 0) run<__nv_bfloat16>(p, qn, qp, ckv, kpe, out_path.c_str());
    else if (dtype == 1) run<__half>(p, qn, qp, ckv, kpe, out_path.c_str());
    else run<float>(p, qn, qp, ckv, kpe, out_path.c_str());
    for (const int32_t* ptr : {p.page_table, p.kv_lens, p.work, p.merge}) CHECK(cudaFree(const_cast<int32_t*>(ptr)));
    std::printf("ran %s (dtype %d, T=%d H=%d ps=%d W=%d M=%d)\n", argv[a], dtype, T, H, ps, W, M);
  }
  return 0;
}
