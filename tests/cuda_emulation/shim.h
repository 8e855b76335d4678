// Host emulation of the parts of CUDA the kernels in csrc/*.cu use, for
// tests/test_cuda_emulation.py: every CUDA thread of a block is an std::thread.
//
// - Blocks run one after another on one pool of `threads` std::threads (created once per
//   launch); __syncthreads is a barrier over the block, the warp shuffles exchange values
//   through a per-warp buffer between two barriers over the warp.
// - A thread that returns early drops out of its block's and its warp's barriers, as an
//   exited CUDA thread no longer takes part in __syncthreads.
// - Dynamic shared memory is one buffer per launch, filled with NaN before every block, so
//   a read of it that no thread of the block has written shows up as NaN.
// - Only what the kernels use is here: fp16 (through the compiler's _Float16) and bf16
//   conversions rounding to nearest even, fmaf, __fmul_rn and the math of <cmath>. Memory ordering
//   and atomics are not modelled (the kernels use none).
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 gridDim, blockDim;
struct WarpCtx {
  std::barrier<>* bar;
  float* buf;
};
inline thread_local std::barrier<>* t_block_bar;
inline thread_local WarpCtx t_warp;
inline thread_local float* t_smem;  // the launch's dynamic shared memory

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
// Static __shared__ arrays: one per kernel instantiation, shared by every thread (blocks run
// one at a time). `extern __shared__` (dynamic) declarations are rewritten by the test to
// point at the launch's buffer, t_smem.
#define __shared__ static

inline void __syncthreads() { t_block_bar->arrive_and_wait(); }
// a product rounded on its own, never contracted into an FMA (the volatile store forces it)
inline float __fmul_rn(float a, float b) {
  volatile float p = a * b;
  return p;
}
inline float __shfl_sync(unsigned, float v, int src) {
  const int lane = threadIdx.x % 32;
  t_warp.buf[lane] = v;
  t_warp.bar->arrive_and_wait();
  const float r = t_warp.buf[src & 31];
  t_warp.bar->arrive_and_wait();
  return r;
}
inline float __shfl_xor_sync(unsigned, float v, int o) {
  const int lane = threadIdx.x % 32;
  t_warp.buf[lane] = v;
  t_warp.bar->arrive_and_wait();
  const float r = t_warp.buf[(lane ^ o) & 31];
  t_warp.bar->arrive_and_wait();
  return r;
}

struct __half {
  uint16_t x;
};
struct __nv_bfloat16 {
  uint16_t x;
};
inline float __half2float(__half h) {
  _Float16 v;
  std::memcpy(&v, &h.x, 2);
  return static_cast<float>(v);
}
inline __half __float2half_rn(float f) {
  const _Float16 v = static_cast<_Float16>(f);
  __half h;
  std::memcpy(&h.x, &v, 2);
  return h;
}
inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = uint32_t(b.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return __nv_bfloat16{uint16_t(u >> 16)};
}
typedef struct CUstream_st* cudaStream_t;

// The runtime calls of the launchers. Launches run synchronously and cannot fail here;
// opting a kernel into more than 48 KiB of dynamic shared memory fails above the smallest
// limit of the supported GPUs (sm_80: 163 KiB), as cudaFuncSetAttribute would there.
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "invalid argument"; }
template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel, cudaFuncAttribute, int bytes) {
  return bytes <= 163 * 1024 ? cudaSuccess : cudaErrorInvalidValue;
}

// Runs fn (the kernel body bound to its arguments) for every block of grid, with `threads`
// threads per block and smem_bytes of shared memory.
template <typename F>
void launch(dim3 grid, unsigned threads, size_t smem_bytes, F fn) {
  gridDim = grid;
  blockDim = dim3(threads);
  const unsigned n_warps = (threads + 31) / 32;
  const unsigned n_blocks = grid.x * grid.y * grid.z;
  std::vector<float> smem(smem_bytes / 4 + 1);
  std::vector<std::vector<float>> warp_buf(n_warps, std::vector<float>(32));
  std::unique_ptr<std::barrier<>> block_bar;
  std::vector<std::unique_ptr<std::barrier<>>> warp_bar(n_warps);
  std::barrier<> gate(threads);  // between blocks: the next block's barriers are ready
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      threadIdx = dim3(t);
      for (unsigned b = 0; b < n_blocks; ++b) {
        if (t == 0) {  // fresh barriers (a previous block's early exits lowered their counts)
          std::fill(smem.begin(), smem.end(), std::nanf(""));
          block_bar = std::make_unique<std::barrier<>>(threads);
          for (unsigned w = 0; w < n_warps; ++w) warp_bar[w] = std::make_unique<std::barrier<>>(32);
        }
        gate.arrive_and_wait();
        blockIdx = dim3(b % grid.x, (b / grid.x) % grid.y, b / (grid.x * grid.y));
        t_block_bar = block_bar.get();
        t_warp = WarpCtx{warp_bar[t / 32].get(), warp_buf[t / 32].data()};
        t_smem = smem.data();
        fn();
        block_bar->arrive_and_drop();
        warp_bar[t / 32]->arrive_and_drop();
        gate.arrive_and_wait();  // every thread is done with this block's barriers
      }
    });
  }
  for (auto& th : pool) th.join();
}
