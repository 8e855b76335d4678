// Elementwise dropout on CUDA: the fallback for GPUs where the Triton kernels cannot run.
// Same contract and the same mask as dropout_cpu.cpp, bit for bit (csrc/philox.h):
//
//   element i of the contiguous tensor uses word i % 4 of flat_dropout_words(seed, i / 4)
//   keep[i] = dropout_keep_word(word, threshold)        threshold = dropout_threshold(p)
//   y[i]    = x[i] * (keep[i] ? scale : 0)              fp32, rounded once to x's dtype
//
// Multiplying by 0 rather than selecting 0 is x * keep * scale exactly: a dropped -x gives
// -0 and a dropped inf or NaN gives NaN, as in torch's dropout.
//
//   forward   one thread per group of four elements (one Philox call per group), in a
//             grid-stride loop; whole groups use one vector load/store per tensor when the
//             pointers allow it, the tail group (and unaligned views) go element by element.
//   backward  dx[i] = dy[i] * (keep[i] ? scale : 0), the same group structure, no random
//             numbers.
//
// Element counts and indices are int64 throughout. Only CUDA headers are included (see
// cuda_launchers.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_convert.cuh"
#include "cuda_launchers.h"
#include "philox.h"

namespace fasttrans::cuda_kernels {
namespace {

constexpr int kThreads = 256;
// Grid cap: enough resident blocks for any current GPU; larger tensors loop (grid-stride).
constexpr int64_t kMaxBlocks = 65536;

// Four consecutive elements, loaded or stored with one instruction (16 bytes for fp32,
// 8 for fp16/bf16, 4 for the bool mask).
template <typename T>
struct alignas(4 * sizeof(T)) Vec4 {
  T v[4];
};

// (keep ? scale : 0) for word j of a group; j is a compile-time constant after unrolling,
// so the words stay in registers (a dynamic index would put them in a stack frame).
__device__ __forceinline__ uint32_t word_of(const Philox4& r, int j) {
  return j == 0 ? r.w[0] : j == 1 ? r.w[1] : j == 2 ? r.w[2] : r.w[3];
}

template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads) dropout_fwd_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                               bool* __restrict__ keep, int64_t numel, uint64_t seed,
                                                               uint32_t threshold, float scale) {
  const int64_t groups = (numel + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; g < groups; g += stride) {
    const Philox4 r = flat_dropout_words(seed, static_cast<uint64_t>(g));
    const int64_t i0 = 4 * g;
    if (kVector && i0 + 4 <= numel) {
      const Vec4<T> xv = reinterpret_cast<const Vec4<T>*>(x)[g];
      Vec4<T> yv;
      Vec4<bool> kv;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool k = dropout_keep_word(word_of(r, j), threshold);
        kv.v[j] = k;
        yv.v[j] = from_float<T>(to_float(xv.v[j]) * (k ? scale : 0.0f));
      }
      reinterpret_cast<Vec4<T>*>(y)[g] = yv;
      reinterpret_cast<Vec4<bool>*>(keep)[g] = kv;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t i = i0 + j;
        if (i < numel) {
          const bool k = dropout_keep_word(word_of(r, j), threshold);
          keep[i] = k;
          y[i] = from_float<T>(to_float(x[i]) * (k ? scale : 0.0f));
        }
      }
    }
  }
}

template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads) dropout_bwd_kernel(const T* __restrict__ dy, const bool* __restrict__ keep,
                                                               T* __restrict__ dx, int64_t numel, float scale) {
  const int64_t groups = (numel + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; g < groups; g += stride) {
    const int64_t i0 = 4 * g;
    if (kVector && i0 + 4 <= numel) {
      const Vec4<T> dyv = reinterpret_cast<const Vec4<T>*>(dy)[g];
      const Vec4<bool> kv = reinterpret_cast<const Vec4<bool>*>(keep)[g];
      Vec4<T> dxv;
#pragma unroll
      for (int j = 0; j < 4; ++j) dxv.v[j] = from_float<T>(to_float(dyv.v[j]) * (kv.v[j] ? scale : 0.0f));
      reinterpret_cast<Vec4<T>*>(dx)[g] = dxv;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t i = i0 + j;
        if (i < numel) dx[i] = from_float<T>(to_float(dy[i]) * (keep[i] ? scale : 0.0f));
      }
    }
  }
}

const char* last_error() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

int grid_for(int64_t numel) {
  const int64_t blocks = ((numel + 3) / 4 + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Whether every pointer allows the group-wide vector accesses (torch allocations do; a view
// with an element offset may not).
template <typename T>
bool vector_aligned(const void* a, const void* b, const void* mask) {
  return reinterpret_cast<uintptr_t>(a) % sizeof(Vec4<T>) == 0 && reinterpret_cast<uintptr_t>(b) % sizeof(Vec4<T>) == 0 &&
         reinterpret_cast<uintptr_t>(mask) % sizeof(Vec4<bool>) == 0;
}

template <typename T>
const char* fwd_typed(int64_t numel, const void* x, void* y, bool* keep, uint64_t seed, uint32_t threshold,
                      float scale, cudaStream_t stream) {
  const T* xt = static_cast<const T*>(x);
  T* yt = static_cast<T*>(y);
  if (vector_aligned<T>(x, y, keep)) {
    dropout_fwd_kernel<T, true><<<grid_for(numel), kThreads, 0, stream>>>(xt, yt, keep, numel, seed, threshold, scale);
  } else {
    dropout_fwd_kernel<T, false><<<grid_for(numel), kThreads, 0, stream>>>(xt, yt, keep, numel, seed, threshold, scale);
  }
  return last_error();
}

template <typename T>
const char* bwd_typed(int64_t numel, const void* dy, const bool* keep, void* dx, float scale, cudaStream_t stream) {
  const T* dyt = static_cast<const T*>(dy);
  T* dxt = static_cast<T*>(dx);
  if (vector_aligned<T>(dy, dx, keep)) {
    dropout_bwd_kernel<T, true><<<grid_for(numel), kThreads, 0, stream>>>(dyt, keep, dxt, numel, scale);
  } else {
    dropout_bwd_kernel<T, false><<<grid_for(numel), kThreads, 0, stream>>>(dyt, keep, dxt, numel, scale);
  }
  return last_error();
}

}  // namespace

const char* dropout_fwd_cuda(int64_t numel, DType dtype, const void* x, void* y, bool* keep, uint64_t seed,
                             uint32_t threshold, float scale, cudaStream_t stream) {
  if (numel == 0) return nullptr;
  if (numel < 0) return "dropout_fwd_cuda: negative element count";
  switch (dtype) {
    case DType::kFloat32: return fwd_typed<float>(numel, x, y, keep, seed, threshold, scale, stream);
    case DType::kFloat16: return fwd_typed<__half>(numel, x, y, keep, seed, threshold, scale, stream);
    case DType::kBFloat16: return fwd_typed<__nv_bfloat16>(numel, x, y, keep, seed, threshold, scale, stream);
  }
  return "dropout_fwd_cuda: unsupported dtype";
}

const char* dropout_bwd_cuda(int64_t numel, DType dtype, const void* dy, const bool* keep, void* dx, float scale,
                             cudaStream_t stream) {
  if (numel == 0) return nullptr;
  if (numel < 0) return "dropout_bwd_cuda: negative element count";
  switch (dtype) {
    case DType::kFloat32: return bwd_typed<float>(numel, dy, keep, dx, scale, stream);
    case DType::kFloat16: return bwd_typed<__half>(numel, dy, keep, dx, scale, stream);
    case DType::kBFloat16: return bwd_typed<__nv_bfloat16>(numel, dy, keep, dx, scale, stream);
  }
  return "dropout_bwd_cuda: unsupported dtype";
}

}  // namespace fasttrans::cuda_kernels
