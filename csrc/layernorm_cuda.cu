// LayerNorm, add + LayerNorm and RMSNorm on CUDA: the fallback for GPUs where the Triton
// kernels cannot run. Same contract as layernorm_cpu.cpp; the statistics are taken in
// the shifted two-pass form below (the CPU forward takes them in one pass about a checked
// shift, see layernorm_cpu.cpp):
//
//   forward   one block per row: h = x + residual (rounded to the input dtype), the mean as
//             h[0] + d (shifted sum, exact deviations near the mean), the centred variance in
//             a second pass over the row, then y = (h - mean) * rstd * w + b.
//   backward  one block per chunk of rows: dx per row, and the chunk's partial dw / db
//             rows in an fp32 workspace (each column owned by one thread: no atomics); a
//             second kernel sums the partials over chunks in order. Deterministic.
//
// Only CUDA headers are included (see cuda_launchers.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_convert.cuh"
#include "cuda_launchers.h"

namespace fasttrans::cuda_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;
// Resident blocks per SM the register allocation must allow (without the hint ptxas chose a
// register budget for the half/bf16 backward on sm_80 that spilled).
constexpr int kMinBlocks = 2;

// Sum over the block, in a fixed order; every thread gets the same value.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  __syncthreads();  // red may still be read by the previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += red[w];
  return total;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocks) norm_fwd_kernel(const NormArgs a, T* __restrict__ y, T* __restrict__ h,
                                                             float* __restrict__ mean, float* __restrict__ rstd) {
  __shared__ float red[kWarps];
  const int64_t N = a.N;
  const float inv_n = 1.0f / static_cast<float>(N);
  for (int64_t row = blockIdx.x; row < a.M; row += gridDim.x) {
    const T* x = static_cast<const T*>(a.x) + row * a.ldx;
    const T* r = a.residual ? static_cast<const T*>(a.residual) + row * a.ldr : nullptr;
    T* hrow = h ? h + row * N : nullptr;
    // h is re-read from where it lives: the h output (written by this same thread) or x
    const T* hsrc = hrow ? hrow : x;

    float shift = 0.0f;
    if (!a.rms) shift = r ? to_float(from_float<T>(to_float(x[0]) + to_float(r[0]))) : to_float(x[0]);
    float s = 0.0f;
    for (int64_t k = threadIdx.x; k < N; k += kThreads) {
      float hv;
      if (r) {
        const T rounded = from_float<T>(to_float(x[k]) + to_float(r[k]));  // what torch's add gives
        hrow[k] = rounded;
        hv = to_float(rounded);
      } else {
        hv = to_float(x[k]);
      }
      s += hv - shift;
    }
    const float d = a.rms ? 0.0f : block_sum(s, red) * inv_n;

    float q = 0.0f;
    for (int64_t k = threadIdx.x; k < N; k += kThreads) {
      const float e = (to_float(hsrc[k]) - shift) - d;
      q = fmaf(e, e, q);
    }
    const float rs = 1.0f / sqrtf(block_sum(q, red) * inv_n + a.eps);

    for (int64_t k = threadIdx.x; k < N; k += kThreads) {
      float v = ((to_float(hsrc[k]) - shift) - d) * rs;
      if (a.weight) v *= a.weight[k];
      if (a.bias) v += a.bias[k];
      y[row * N + k] = from_float<T>(v);
    }
    if (threadIdx.x == 0) {
      if (mean) mean[row] = shift + d;
      rstd[row] = rs;
    }
  }
}

constexpr int64_t kMinRowsPerChunk = 16;
constexpr int64_t kMaxChunks = 1024;

template <typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocks) norm_bwd_rows_kernel(int64_t M, int64_t N, int64_t rows_per_chunk,
                                                                  const T* __restrict__ dy, const T* __restrict__ dh,
                                                                  const T* __restrict__ h, int64_t ldh,
                                                                  const float* __restrict__ w,
                                                                  const float* __restrict__ mean,
                                                                  const float* __restrict__ rstd, bool rms,
                                                                  T* __restrict__ dx, float* __restrict__ dw_part,
                                                                  float* __restrict__ db_part) {
  __shared__ float red[kWarps];
  const int64_t chunk = blockIdx.x;
  const int64_t row_end = (chunk + 1) * rows_per_chunk < M ? (chunk + 1) * rows_per_chunk : M;
  float* dwp = dw_part ? dw_part + chunk * N : nullptr;
  float* dbp = db_part ? db_part + chunk * N : nullptr;
  for (int64_t k = threadIdx.x; k < N; k += kThreads) {  // column k belongs to this thread throughout
    if (dwp) dwp[k] = 0.0f;
    if (dbp) dbp[k] = 0.0f;
  }
  const float inv_n = 1.0f / static_cast<float>(N);
  for (int64_t row = chunk * rows_per_chunk; row < row_end; ++row) {
    const float mu = rms ? 0.0f : mean[row];
    const float rs = rstd[row];
    const T* hr = h + row * ldh;
    const T* dyr = dy + row * N;
    // mean(xhat) is 0 in exact arithmetic; the stored mean's rounding shifts every xhat by
    // it, and it is subtracted (see norm_bwd in fasttrans/backends/__init__.py for the error removed)
    float sg = 0.0f, sgx = 0.0f, sx = 0.0f;
    for (int64_t k = threadIdx.x; k < N; k += kThreads) {
      const float xh = (to_float(hr[k]) - mu) * rs;
      // g rounded on its own (no FMA contraction into the sums below): with one column
      // g - mean(g) must be exactly 0, as in the CPU kernels (-ffp-contract=off)
      const float g = w ? __fmul_rn(to_float(dyr[k]), w[k]) : to_float(dyr[k]);
      sg += g;
      sx += xh;
      sgx = fmaf(g, xh, sgx);
    }
    const float mean_x = rms ? 0.0f : block_sum(sx, red) * inv_n;
    const float mean_g = rms ? 0.0f : block_sum(sg, red) * inv_n;
    const float mean_gx = block_sum(sgx, red) * inv_n - mean_x * mean_g;  // mean(g * (xhat - mean_x))
    for (int64_t k = threadIdx.x; k < N; k += kThreads) {
      const float xh = fmaf(to_float(hr[k]) - mu, rs, -mean_x);
      const float dyk = to_float(dyr[k]);
      const float g = w ? __fmul_rn(dyk, w[k]) : dyk;
      float v = rs * (g - mean_g - xh * mean_gx);
      if (dh) v += to_float(dh[row * N + k]);
      dx[row * N + k] = from_float<T>(v);
      if (dwp) dwp[k] = fmaf(dyk, xh, dwp[k]);
      if (dbp) dbp[k] += dyk;
    }
  }
}

// out[k] = sum over chunks c, in order, of part[c, k]
__global__ void norm_reduce_partials_kernel(const float* __restrict__ part, int64_t chunks, int64_t N,
                                            float* __restrict__ out) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= N) return;
  float s = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) s += part[c * N + k];
  out[k] = s;
}

const char* last_error() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

int grid_rows(int64_t M) {
  return static_cast<int>(M < 2147483647LL ? M : 2147483647LL);  // rows beyond the grid loop
}

int64_t rows_per_chunk(int64_t M) {
  const int64_t r = (M + kMaxChunks - 1) / kMaxChunks;
  return r > kMinRowsPerChunk ? r : kMinRowsPerChunk;
}

template <typename T>
const char* fwd_typed(const NormArgs& a, void* y, void* h, float* mean, float* rstd, cudaStream_t stream) {
  norm_fwd_kernel<T><<<grid_rows(a.M), kThreads, 0, stream>>>(a, static_cast<T*>(y), static_cast<T*>(h), mean, rstd);
  return last_error();
}

template <typename T>
const char* bwd_typed(int64_t M, int64_t N, const void* dy, const void* dh, const void* h, int64_t ldh,
                      const float* w, const float* mean, const float* rstd, bool rms, void* dx, float* dw_part,
                      float* db_part, float* dw, float* db, cudaStream_t stream) {
  const int64_t chunks = norm_bwd_chunks(M);
  norm_bwd_rows_kernel<T><<<static_cast<int>(chunks), kThreads, 0, stream>>>(
      M, N, rows_per_chunk(M), static_cast<const T*>(dy), static_cast<const T*>(dh), static_cast<const T*>(h), ldh,
      w, rms ? nullptr : mean, rstd, rms, static_cast<T*>(dx), dw ? dw_part : nullptr, db ? db_part : nullptr);
  if (const char* e = last_error()) return e;
  const int threads = 256;
  const int blocks = static_cast<int>((N + threads - 1) / threads);
  if (dw) norm_reduce_partials_kernel<<<blocks, threads, 0, stream>>>(dw_part, chunks, N, dw);
  if (db) norm_reduce_partials_kernel<<<blocks, threads, 0, stream>>>(db_part, chunks, N, db);
  return last_error();
}

}  // namespace

int64_t norm_bwd_chunks(int64_t M) {
  return M == 0 ? 0 : (M + rows_per_chunk(M) - 1) / rows_per_chunk(M);
}

const char* norm_fwd_cuda(const NormArgs& a, void* y, void* h, float* mean, float* rstd, cudaStream_t stream) {
  if (a.M == 0 || a.N == 0) return nullptr;
  switch (a.dtype) {
    case DType::kFloat32: return fwd_typed<float>(a, y, h, mean, rstd, stream);
    case DType::kFloat16: return fwd_typed<__half>(a, y, h, mean, rstd, stream);
    case DType::kBFloat16: return fwd_typed<__nv_bfloat16>(a, y, h, mean, rstd, stream);
  }
  return "norm_fwd_cuda: unsupported dtype";
}

const char* norm_bwd_cuda(int64_t M, int64_t N, DType dtype, const void* dy, const void* dh, const void* h,
                          int64_t ldh, const float* weight, const float* mean, const float* rstd, bool rms, void* dx,
                          float* dw_part, float* db_part, float* dw, float* db, cudaStream_t stream) {
  if (M == 0 || N == 0) return nullptr;
  switch (dtype) {
    case DType::kFloat32:
      return bwd_typed<float>(M, N, dy, dh, h, ldh, weight, mean, rstd, rms, dx, dw_part, db_part, dw, db, stream);
    case DType::kFloat16:
      return bwd_typed<__half>(M, N, dy, dh, h, ldh, weight, mean, rstd, rms, dx, dw_part, db_part, dw, db, stream);
    case DType::kBFloat16:
      return bwd_typed<__nv_bfloat16>(M, N, dy, dh, h, ldh, weight, mean, rstd, rms, dx, dw_part, db_part, dw, db,
                                      stream);
  }
  return "norm_bwd_cuda: unsupported dtype";
}

}  // namespace fasttrans::cuda_kernels
