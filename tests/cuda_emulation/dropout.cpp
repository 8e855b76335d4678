// The CUDA elementwise dropout kernels (csrc/dropout_cuda.cu), forward and backward, vector
// and scalar paths, on the host emulation of shim.h: the keep mask must be the CPU
// extension's (philox_cpu.h, the elementwise counter layout) bit for bit, every element
// written once, y = x * keep / (1 - p) and dx = dy * keep / (1 - p) exactly as the kernels
// round them. Exits non-zero on any mismatch.
#include "shim.h"
#include "dropout_cuda.h"
#include "philox_cpu.h"
#include <random>
#include <type_traits>
using namespace fasttrans;

template <typename T>
T round_to(float v) { return cuda_kernels::from_float<T>(v); }

template <typename T, bool kVector>
int check(int64_t numel, unsigned blocks, double p, uint64_t seed) {
  std::mt19937 rng(static_cast<unsigned>(numel + blocks));
  std::normal_distribution<float> nd;
  std::vector<T> x(numel + 4), dy(numel + 4), y(numel + 4), dx(numel + 4);
  for (auto& v : x) v = round_to<T>(nd(rng));
  for (auto& v : dy) v = round_to<T>(nd(rng));
  const T sentinel = round_to<T>(12345.0f);  // past numel: must stay untouched
  std::fill(y.begin(), y.end(), sentinel);
  std::fill(dx.begin(), dx.end(), sentinel);
  std::vector<uint8_t> keep(numel + 4, 7);
  const uint32_t thr = dropout_threshold(p);
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  launch(dim3(blocks), cuda_kernels::kThreads, 0, [&] {
    cuda_kernels::dropout_fwd_kernel<T, kVector>(x.data(), y.data(), reinterpret_cast<bool*>(keep.data()), numel, seed,
                                                 thr, scale);
  });
  launch(dim3(blocks), cuda_kernels::kThreads, 0, [&] {
    cuda_kernels::dropout_bwd_kernel<T, kVector>(dy.data(), reinterpret_cast<const bool*>(keep.data()), dx.data(),
                                                 numel, scale);
  });
  int bad = 0, kept = 0;
  for (int64_t i = 0; i < numel; ++i) {
    const uint64_t g = static_cast<uint64_t>(i) / 4;
    const uint64_t bits = cpu::keep_bits16_scalar(static_cast<uint32_t>(g), static_cast<uint32_t>(g >> 32), 0u,
                                                  kFlatDomain, seed, thr);
    const bool k = (bits >> (i % 4)) & 1;
    kept += k;
    const float f = k ? scale : 0.0f;
    const T want_y = round_to<T>(cuda_kernels::to_float(x[i]) * f), want_dx = round_to<T>(cuda_kernels::to_float(dy[i]) * f);
    bad += keep[i] != static_cast<uint8_t>(k);
    bad += std::memcmp(&y[i], &want_y, sizeof(T)) != 0 || std::memcmp(&dx[i], &want_dx, sizeof(T)) != 0;
  }
  for (int64_t i = numel; i < numel + 4; ++i) {
    bad += keep[i] != 7 || std::memcmp(&y[i], &sentinel, sizeof(T)) != 0 || std::memcmp(&dx[i], &sentinel, sizeof(T)) != 0;
  }
  printf("%s %s numel %ld blocks %u vector %d p %.2f: kept %d, %d mismatches\n", bad ? "BAD" : "ok ",
         sizeof(T) == 4 ? "fp32" : std::is_same_v<T, __half> ? "fp16" : "bf16", static_cast<long>(numel), blocks, kVector, p, kept, bad);
  return bad != 0;
}

int main() {
  int bad = 0;
  const uint64_t seed = 0x0123456789abcdefULL;
  for (int64_t numel : {1, 3, 4, 7, 1001, 4099}) {
    bad += check<float, true>(numel, 1, 0.3, seed);   // one block: the grid-stride loop runs
    bad += check<float, false>(numel, 2, 0.1, seed + 1);
    bad += check<__nv_bfloat16, true>(numel, 3, 0.5, seed + 2);
    bad += check<__half, true>(numel, 2, 0.2, seed + 3);
  }
  printf("%d bad\n", bad);
  return bad != 0;
}
