// Fused attention on CUDA: the fallback for GPUs where the Triton kernels cannot run.
//
// Same contract and math as attention_cpu.cpp (online softmax forward, FlashAttention-2
// backward, Philox dropout from philox.h, fully masked rows -> 0 with lse = +inf), written
// for clarity and zero register spills rather than peak speed: scalar FP32 FMAs on CUDA
// cores, no tensor cores. Only CUDA headers are included (see cuda_launchers.h).
//
// NaN follows fasttrans.reference: the scores are scale q.k plus a float mask, and then every
// hidden entry (causal, key_lengths, a bool mask's False) is replaced by -inf, so a NaN score
// at a hidden position stays hidden, while NaN + -inf from a float mask is NaN. A row with a
// NaN score has a NaN output and lse (the row maximum propagates NaN), and exp(s - NaN) makes
// its P, dS and so its gradients NaN in backward. Key tiles and query tiles that the kernels
// skip (above the causal diagonal, past key_lengths) are never read, so a NaN there cannot
// reach a gradient through 0 * NaN the way it does in the reference's dense matmuls.
//
// Work decomposition (a block is 4 warps; every output element has exactly one writer, so
// there are no atomics and the results are deterministic):
//   forward, dQ : a block owns 16 query rows of one (b, h), 4 rows per warp; key tiles of 32
//                 (one key per lane) are staged in shared memory as fp32.
//                 Lane j computes the scores of key j for the warp's 4 rows; each lane
//                 accumulates D/32 output columns, with the 32 probabilities broadcast by
//                 warp shuffles.
//   dK, dV      : a block owns 16 keys of one (b, kv head), 4 keys per warp, and loops over
//                 the query heads of its group and over query tiles of 32 (one row per lane).
// The per-lane accumulators are compile-time arrays of 4 x DPL floats (DPL = D/32 rounded up
// to a power of two), so they live in registers for every head dim up to 256.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "cuda_launchers.h"
#include "philox.h"

namespace fasttrans::cuda_kernels {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kPerWarp = 4;                   // query rows (forward, dQ) or keys (dK/dV) per warp
constexpr int kBlockRows = kWarps * kPerWarp;  // 16 per block
constexpr int kTile = 32;                      // keys (forward, dQ) or query rows (dK/dV) per tile: one per lane
constexpr unsigned kFullMask = 0xffffffffu;
// Resident blocks per SM the register allocation must allow. Shared memory (up to ~99 KiB
// per block at D = 256) limits residency to about two blocks anyway; without the hint ptxas
// picked 64 registers for some sm_90 instantiations and spilled.
constexpr int kMinBlocks = 2;
constexpr int kDefaultSmem = 48 * 1024;
// Grid cap of the row kernel (one warp per row): larger inputs loop, grid-stride.
constexpr int64_t kMaxRowBlocks = 65536;
// |lse| past which the row kernel recomputes a row's max and sum (see attention_row_kernel).
constexpr float kExactLse = 256.0f;

// Element i of a q/k/v/dout/out-typed array as fp32, and the store back. The dtype is a
// runtime switch (uniform across the grid) rather than a template parameter: it only touches
// loads and stores, and it keeps the kernel count (and nvcc time) three times smaller.
__device__ __forceinline__ float load_float(const void* p, int64_t i, DType t) {
  switch (t) {
    case DType::kFloat16: return __half2float(static_cast<const __half*>(p)[i]);
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void store_float(void* p, int64_t i, float v, DType t) {
  switch (t) {
    case DType::kFloat16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case DType::kBFloat16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

// max(a, b) that propagates NaN (fmaxf returns the other operand): a NaN score must make its
// row NaN, as in the reference, not leave it looking fully masked (output 0).
__device__ __forceinline__ float nan_max(float a, float b) { return (a >= b || a != a) ? a : b; }

// Maximum over the warp, NaN if any lane holds NaN; every lane gets it.
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = nan_max(x, __shfl_xor_sync(kFullMask, x, o));
  return x;
}

// Sum over the warp; every lane gets lane 0's result (bit-identical across lanes).
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFullMask, x, o);
  return __shfl_sync(kFullMask, x, 0);
}

__device__ __forceinline__ int64_t kv_length(const AttentionArgs& a, int64_t b) {
  if (a.key_lengths == nullptr) return a.Lk;
  const int64_t n = a.key_lengths[b];
  return n < 0 ? 0 : (n > a.Lk ? a.Lk : n);
}

__device__ __forceinline__ bool visible(const AttentionArgs& a, int64_t kv_len, int64_t i, int64_t j) {
  return i < a.Lq && j < kv_len && (!a.causal || j <= i + a.causal_offset);
}

__device__ __forceinline__ int64_t mask_offset(const AttentionArgs& a, int64_t b, int64_t h, int64_t i, int64_t j) {
  return b * a.m_sb + h * a.m_sh + i * a.m_si + j * a.m_sj;
}

// Query i may attend key j: visible (causal, key_lengths, in range) and, with a bool mask, True
// there (the reference's allowed_mask). The mask is read only for visible (in-range) entries.
__device__ __forceinline__ bool allowed(const AttentionArgs& a, int64_t kv_len, int64_t b, int64_t h, int64_t i,
                                        int64_t j) {
  if (!visible(a, kv_len, i, j)) return false;
  return a.mask_type != MaskType::kBool || static_cast<const bool*>(a.mask)[mask_offset(a, b, h, i, j)];
}

// The float mask's value added to score (b, h, i, j); 0 without one (a bool mask is not
// added: allowed() replaces the scores it hides by -inf).
__device__ __forceinline__ float mask_add(const AttentionArgs& a, int64_t b, int64_t h, int64_t i, int64_t j) {
  const int64_t off = mask_offset(a, b, h, i, j);
  switch (a.mask_type) {
    case MaskType::kFloat32:
      return static_cast<const float*>(a.mask)[off];
    case MaskType::kFloat16:
      return __half2float(static_cast<const __half*>(a.mask)[off]);
    case MaskType::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(a.mask)[off]);
    default:
      return 0.0f;
  }
}

// scale q.k, soft-capped where a.softcap > 0: softcap tanh(scale q.k / softcap), as the reference
// caps the scaled scores before the masks. With g, *g gets the derivative of the capped score by
// the scaled one, 1 - tanh^2 (1 uncapped), which the backward's dS carries.
__device__ __forceinline__ float scaled_score(const AttentionArgs& a, float qk, float* g) {
  const float s = qk * a.scale;
  if (a.softcap <= 0.0f) {  // uniform across the grid
    if (g != nullptr) *g = 1.0f;
    return s;
  }
  const float t = tanhf(s / a.softcap);
  if (g != nullptr) *g = 1.0f - t * t;
  return a.softcap * t;
}

// keep(b, h, i, j) / (1 - p), or 1 without dropout
__device__ __forceinline__ float dropout_factor(const AttentionArgs& a, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (!a.dropout) return 1.0f;
  return attention_dropout_keep(a.seed, a.dropout_threshold, b, h, i, j) ? a.dropout_scale : 0.0f;
}

// Rows [i0, i0 + n) of a strided (B, H, L, D) tensor into shared memory as fp32 (ld = ld_s),
// zero past row L - 1. Element (i, d) of the source is src[base + i * s_row + d].
__device__ __forceinline__ void stage_rows(float* dst, int ld_s, const void* src, DType t, int64_t base, int64_t s_row,
                                           int64_t i0, int n, int64_t L, int D) {
  for (int idx = threadIdx.x; idx < n * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    const int64_t i = i0 + r;
    dst[r * ld_s + d] = i < L ? load_float(src, base + i * s_row + d, t) : 0.0f;
  }
}

// Keys [0, kv_end) may be visible to some row of the query block [i0, i0 + rows).
__device__ __forceinline__ int64_t block_kv_end(const AttentionArgs& a, int64_t kv_len, int64_t i0, int64_t rows) {
  if (!a.causal) return kv_len;
  const int64_t last = i0 + rows + a.causal_offset;
  return last < 0 ? 0 : (last < kv_len ? last : kv_len);
}

// --------------------------------------------------------------------------------------
// Forward
// --------------------------------------------------------------------------------------
// acc[r][:] += sum_jj coef[r] (held by lane jj) * tile[jj][:] for this warp's kPerWarp rows:
// the (rows x keys) @ (keys x D) product of the forward (P V) and of dQ (dS K), with the
// coefficients broadcast from the lane that holds them, one key at a time.
template <int DPL>
__device__ __forceinline__ void accumulate_rows(float (&acc)[kPerWarp][DPL], const float (&coef)[kPerWarp],
                                                const float* tile, int ld, int lane, int D) {
  for (int jj = 0; jj < kTile; ++jj) {
    float cj[kPerWarp];
#pragma unroll
    for (int r = 0; r < kPerWarp; ++r) cj[r] = __shfl_sync(kFullMask, coef[r], jj);
#pragma unroll
    for (int t = 0; t < DPL; ++t) {
      const int c = lane + 32 * t;
      if (c < D) {
        const float x = tile[jj * ld + c];
#pragma unroll
        for (int r = 0; r < kPerWarp; ++r) acc[r][t] = fmaf(cj[r], x, acc[r][t]);
      }
    }
  }
}

template <int DPL>
__global__ void __launch_bounds__(kThreads, kMinBlocks) attention_fwd_kernel(const AttentionArgs a,
                                                                              void* __restrict__ out,
                                                                              float* __restrict__ lse) {
  extern __shared__ float smem[];
  const int D = static_cast<int>(a.D), ld = D + 1;
  float* q_s = smem;                    // [kBlockRows][D]
  float* k_s = q_s + kBlockRows * D;    // [kTile][D + 1]: lane j reads row j (padding: no bank conflicts)
  float* v_s = k_s + kTile * ld;        // [kTile][D + 1]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (a.H / a.Hkv);
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kBlockRows;
  const int64_t rows = a.Lq - i0 < kBlockRows ? a.Lq - i0 : kBlockRows;
  const int64_t kv_end = block_kv_end(a, kv_length(a, b), i0, rows);
  const int64_t q_base = b * a.q_sb + h * a.q_sh, k_base = b * a.k_sb + hk * a.k_sh, v_base = b * a.v_sb + hk * a.v_sh;
  stage_rows(q_s, D, a.q, a.dtype, q_base, a.q_si, i0, kBlockRows, a.Lq, D);

  float m[kPerWarp], l[kPerWarp], acc[kPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kPerWarp; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int t = 0; t < DPL; ++t) acc[r][t] = 0.0f;
  }

  for (int64_t j0 = 0; j0 < kv_end; j0 += kTile) {
    __syncthreads();  // the previous tile is consumed (and q_s is staged, on the first pass)
    stage_rows(k_s, ld, a.k, a.dtype, k_base, a.k_si, j0, kTile, kv_end, D);
    stage_rows(v_s, ld, a.v, a.dtype, v_base, a.v_si, j0, kTile, kv_end, D);
    __syncthreads();

    float s[kPerWarp];
#pragma unroll
    for (int r = 0; r < kPerWarp; ++r) s[r] = 0.0f;
    for (int d = 0; d < D; ++d) {
      const float kd = k_s[lane * ld + d];
#pragma unroll
      for (int r = 0; r < kPerWarp; ++r) s[r] = fmaf(q_s[(warp * kPerWarp + r) * D + d], kd, s[r]);
    }

    const int64_t j = j0 + lane;
    float p[kPerWarp];
#pragma unroll
    for (int r = 0; r < kPerWarp; ++r) {
      const int64_t i = i0 + warp * kPerWarp + r;
      const bool ok = allowed(a, kv_end, b, h, i, j);
      // (q.k) * scale, as the backward and the reference: a scaled q could overflow, or
      // underflow to 0 against an inf key
      const float score = ok ? scaled_score(a, s[r], nullptr) + mask_add(a, b, h, i, j) : -INFINITY;
      // NaN from the first NaN score on: alpha and p are then NaN, and so are l and the output
      const float m_new = nan_max(m[r], warp_max(score));
      float alpha = 1.0f;
      p[r] = 0.0f;
      if (m_new != -INFINITY) {  // uniform across the warp
        alpha = expf(m[r] - m_new);  // 0 while the row was empty
        p[r] = expf(score - m_new);
      }
      l[r] = l[r] * alpha + warp_sum(p[r]);  // l keeps the undropped sum
      m[r] = m_new;
      if (ok) p[r] *= dropout_factor(a, b, h, i, j);
#pragma unroll
      for (int t = 0; t < DPL; ++t) acc[r][t] *= alpha;
    }

    accumulate_rows<DPL>(acc, p, v_s, ld, lane, D);  // O += P V
  }

#pragma unroll
  for (int r = 0; r < kPerWarp; ++r) {
    const int64_t i = i0 + warp * kPerWarp + r;
    if (i >= a.Lq) continue;
    const int64_t row = (b * a.H + h) * a.Lq + i;
    // l == 0: no allowed key (output 0, lse +inf); l is NaN on rows with a NaN score, and so
    // are their output and lse, as in the reference
    const bool empty = l[r] == 0.0f;
    const float inv = empty ? 0.0f : 1.0f / l[r];  // p already carries the dropout scale
#pragma unroll
    for (int t = 0; t < DPL; ++t) {
      const int c = lane + 32 * t;
      if (c < D) store_float(out, row * D + c, acc[r][t] * inv, a.dtype);
    }
    if (lane == 0) lse[row] = empty ? INFINITY : m[r] + logf(l[r]);
  }
}

// --------------------------------------------------------------------------------------
// Backward
// --------------------------------------------------------------------------------------
// Per query row, one warp per row, rows grid-strided: delta = sum_d dout[row, d] out[row, d],
// and the (hi, r) the dQ and dK/dV kernels take P = exp(S - hi) r with. hi = lse and r = 1,
// except on rows with |lse| > kExactLse: lse = m + log(l) in one float32 loses log(l) once
// ulp(m) nears 1 (a finite mask of -1e9 on every key of a row loses it entirely, and P would
// be 1 instead of 1/l), so such a row gets hi = m and r = 1 / l, recomputed exactly as the
// forward computed them (the same fmaf chains, key tiles and warp reductions).
__global__ void __launch_bounds__(kThreads) attention_row_kernel(const AttentionArgs a, const void* __restrict__ dout,
                                                                  const void* __restrict__ out,
                                                                  const float* __restrict__ lse,
                                                                  float* __restrict__ stats) {
  const int64_t rows = a.B * a.H * a.Lq;
  float *delta = stats, *hi = stats + rows, *r = stats + 2 * rows;  // the (3, B, H, Lq) workspace
  const int D = static_cast<int>(a.D), lane = threadIdx.x % 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  // the loop condition, and so every branch on the row, is uniform across a warp: whole warps
  // run the shuffles together
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; row < rows; row += stride) {
    float s = 0.0f;
    for (int d = lane; d < D; d += 32)
      s = fmaf(load_float(dout, row * D + d, a.dtype), load_float(out, row * D + d, a.dtype), s);
    s = warp_sum(s);
    const float row_lse = lse[row];
    float m = row_lse, l = 1.0f;
    if (fabsf(row_lse) > kExactLse && fabsf(row_lse) < INFINITY) {
      const int64_t i = row % a.Lq, b = row / a.Lq / a.H, h = row / a.Lq % a.H, hk = h / (a.H / a.Hkv);
      const int64_t kv_end = block_kv_end(a, kv_length(a, b), i, 1);
      const int64_t q_base = b * a.q_sb + h * a.q_sh + i * a.q_si, k_base = b * a.k_sb + hk * a.k_sh;
      m = -INFINITY;
      l = 0.0f;
      for (int64_t j0 = 0; j0 < kv_end; j0 += kTile) {
        const int64_t j = j0 + lane;
        float dot = 0.0f;
        if (j < kv_end) {
          for (int d = 0; d < D; ++d)
            dot = fmaf(load_float(a.q, q_base + d, a.dtype), load_float(a.k, k_base + j * a.k_si + d, a.dtype), dot);
        }
        const float score =
            allowed(a, kv_end, b, h, i, j) ? scaled_score(a, dot, nullptr) + mask_add(a, b, h, i, j) : -INFINITY;
        const float m_new = nan_max(m, warp_max(score));
        float alpha = 1.0f, p = 0.0f;
        if (m_new != -INFINITY) {
          alpha = expf(m - m_new);
          p = expf(score - m_new);
        }
        l = l * alpha + warp_sum(p);
        m = m_new;
      }
    }
    if (lane == 0) {
      delta[row] = s;
      hi[row] = m;
      r[row] = 1.0f / l;
    }
  }
}

// dQ (and dmask): per query block, over all visible key tiles.
//   P = exp(scale q.k + mask - hi) r,  dS = P (keep/(1-p) dO.v - delta),  dQ = scale sum_j dS_j k_j
// (capped scores: cap(scale q.k) in P, and dS times the cap's derivative g in dQ and dK, not in dmask)
// dS is 0 where the key is hidden (the reference's masked_fill passes no gradient there).
template <int DPL>
__global__ void __launch_bounds__(kThreads, kMinBlocks) attention_bwd_dq_kernel(const AttentionArgs a,
                                                                                 const void* __restrict__ dout,
                                                                                 const float* __restrict__ stats,
                                                                                 void* __restrict__ dq,
                                                                                 float* __restrict__ dmask) {
  extern __shared__ float smem[];
  const int D = static_cast<int>(a.D), ld = D + 1;
  float* q_s = smem;                     // [kBlockRows][D]
  float* do_s = q_s + kBlockRows * D;    // [kBlockRows][D]
  float* k_s = do_s + kBlockRows * D;    // [kTile][D + 1]
  float* v_s = k_s + kTile * ld;         // [kTile][D + 1]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (a.H / a.Hkv);
  const int64_t bh = b * a.H + h;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kBlockRows;
  const int64_t rows = a.Lq - i0 < kBlockRows ? a.Lq - i0 : kBlockRows;
  const int64_t kv_end = block_kv_end(a, kv_length(a, b), i0, rows);
  const int64_t k_base = b * a.k_sb + hk * a.k_sh, v_base = b * a.v_sb + hk * a.v_sh;
  stage_rows(q_s, D, a.q, a.dtype, b * a.q_sb + h * a.q_sh, a.q_si, i0, kBlockRows, a.Lq, D);
  stage_rows(do_s, D, dout, a.dtype, bh * a.Lq * D, static_cast<int64_t>(D), i0, kBlockRows, a.Lq, D);

  const int64_t n = a.B * a.H * a.Lq;
  const float *delta = stats, *hi = stats + n, *rr = stats + 2 * n;  // see attention_row_kernel
  float row_hi[kPerWarp], row_r[kPerWarp], row_delta[kPerWarp], acc[kPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kPerWarp; ++r) {
    const int64_t i = i0 + warp * kPerWarp + r;
    row_hi[r] = i < a.Lq ? hi[bh * a.Lq + i] : INFINITY;
    row_r[r] = i < a.Lq ? rr[bh * a.Lq + i] : 0.0f;
    row_delta[r] = i < a.Lq ? delta[bh * a.Lq + i] : 0.0f;
#pragma unroll
    for (int t = 0; t < DPL; ++t) acc[r][t] = 0.0f;
  }

  for (int64_t j0 = 0; j0 < kv_end; j0 += kTile) {
    __syncthreads();
    stage_rows(k_s, ld, a.k, a.dtype, k_base, a.k_si, j0, kTile, kv_end, D);
    stage_rows(v_s, ld, a.v, a.dtype, v_base, a.v_si, j0, kTile, kv_end, D);
    __syncthreads();

    float s[kPerWarp], dp[kPerWarp];
#pragma unroll
    for (int r = 0; r < kPerWarp; ++r) s[r] = dp[r] = 0.0f;
    for (int d = 0; d < D; ++d) {
      const float kd = k_s[lane * ld + d], vd = v_s[lane * ld + d];
#pragma unroll
      for (int r = 0; r < kPerWarp; ++r) {
        s[r] = fmaf(q_s[(warp * kPerWarp + r) * D + d], kd, s[r]);
        dp[r] = fmaf(do_s[(warp * kPerWarp + r) * D + d], vd, dp[r]);
      }
    }

    const int64_t j = j0 + lane;
    float ds[kPerWarp];
#pragma unroll
    for (int r = 0; r < kPerWarp; ++r) {
      const int64_t i = i0 + warp * kPerWarp + r;
      float g;  // computed at hidden entries too: a NaN capped score there makes 0 * g NaN, as in the reference
      const float capped = scaled_score(a, s[r], &g);
      ds[r] = 0.0f;
      if (allowed(a, kv_end, b, h, i, j)) {
        // expf(x - NaN) is NaN: the rows NaN in the forward (lse NaN) get NaN gradients
        const float p = expf(capped + mask_add(a, b, h, i, j) - row_hi[r]) * row_r[r];
        ds[r] = p * (dp[r] * dropout_factor(a, b, h, i, j) - row_delta[r]);
        if (dmask != nullptr) dmask[(bh * a.Lq + i) * a.Lk + j] = ds[r];  // the mask is added after the cap
      }
      ds[r] *= g * a.scale;
    }

    accumulate_rows<DPL>(acc, ds, k_s, ld, lane, D);  // dQ += dS K
  }

#pragma unroll
  for (int r = 0; r < kPerWarp; ++r) {
    const int64_t i = i0 + warp * kPerWarp + r;
    if (i >= a.Lq) continue;
#pragma unroll
    for (int t = 0; t < DPL; ++t) {
      const int c = lane + 32 * t;
      if (c < D) store_float(dq, (bh * a.Lq + i) * D + c, acc[r][t], a.dtype);
    }
  }
}

// dK, dV: per block of 16 keys of one kv head, over its query heads and visible query tiles.
//   dV_j = sum_i P_ij keep/(1-p) dO_i,   dK_j = scale sum_i dS_ij q_i
// As in the reference, P is exp(-inf - hi) r where the key is hidden: 0, or NaN on a row NaN
// in the forward (lse NaN); dS is 0 there.
template <int DPL>
__global__ void __launch_bounds__(kThreads, kMinBlocks) attention_bwd_dkdv_kernel(const AttentionArgs a,
                                                                                   const void* __restrict__ dout,
                                                                                   const float* __restrict__ stats,
                                                                                   void* __restrict__ dk,
                                                                                   void* __restrict__ dv) {
  extern __shared__ float smem[];
  const int D = static_cast<int>(a.D), ld = D + 1;
  float* k_s = smem;                      // [kBlockRows][D]: this block's keys
  float* v_s = k_s + kBlockRows * D;      // [kBlockRows][D]
  float* q_s = v_s + kBlockRows * D;      // [kTile][D + 1]: lane i reads row i
  float* do_s = q_s + kTile * ld;         // [kTile][D + 1]
  float* hi_s = do_s + kTile * ld;        // [kTile]
  float* r_s = hi_s + kTile;              // [kTile]
  float* delta_s = r_s + kTile;           // [kTile]
  const int64_t n = a.B * a.H * a.Lq;
  const float *delta = stats, *hi = stats + n, *rr = stats + 2 * n;  // see attention_row_kernel
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.z, hk = blockIdx.y, group = a.H / a.Hkv;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kBlockRows;
  const int64_t kv_len = kv_length(a, b);
  stage_rows(k_s, D, a.k, a.dtype, b * a.k_sb + hk * a.k_sh, a.k_si, j0, kBlockRows, kv_len, D);
  stage_rows(v_s, D, a.v, a.dtype, b * a.v_sb + hk * a.v_sh, a.v_si, j0, kBlockRows, kv_len, D);

  float acc_k[kPerWarp][DPL], acc_v[kPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kPerWarp; ++r) {
#pragma unroll
    for (int t = 0; t < DPL; ++t) acc_k[r][t] = acc_v[r][t] = 0.0f;
  }

  // first query row that may see key j0 (tiles above the causal diagonal are skipped)
  int64_t i_begin = 0;
  if (a.causal) {
    i_begin = j0 - a.causal_offset;
    i_begin = i_begin < 0 ? 0 : (i_begin > a.Lq ? a.Lq : i_begin);
  }
  if (j0 >= kv_len) i_begin = a.Lq;  // keys past key_lengths: zero gradients, nothing to visit

  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const int64_t bh = b * a.H + h;
    for (int64_t i1 = i_begin; i1 < a.Lq; i1 += kTile) {
      __syncthreads();  // the previous tile is consumed (and the keys are staged, on the first pass)
      stage_rows(q_s, ld, a.q, a.dtype, b * a.q_sb + h * a.q_sh, a.q_si, i1, kTile, a.Lq, D);
      stage_rows(do_s, ld, dout, a.dtype, bh * a.Lq * D, static_cast<int64_t>(D), i1, kTile, a.Lq, D);
      if (threadIdx.x < kTile) {
        const int64_t i = i1 + threadIdx.x;
        hi_s[threadIdx.x] = i < a.Lq ? hi[bh * a.Lq + i] : INFINITY;
        r_s[threadIdx.x] = i < a.Lq ? rr[bh * a.Lq + i] : 0.0f;
        delta_s[threadIdx.x] = i < a.Lq ? delta[bh * a.Lq + i] : 0.0f;
      }
      __syncthreads();

      float s[kPerWarp], dp[kPerWarp];
#pragma unroll
      for (int r = 0; r < kPerWarp; ++r) s[r] = dp[r] = 0.0f;
      for (int d = 0; d < D; ++d) {
        const float qd = q_s[lane * ld + d], dod = do_s[lane * ld + d];
#pragma unroll
        for (int r = 0; r < kPerWarp; ++r) {
          s[r] = fmaf(qd, k_s[(warp * kPerWarp + r) * D + d], s[r]);
          dp[r] = fmaf(dod, v_s[(warp * kPerWarp + r) * D + d], dp[r]);
        }
      }

      const int64_t i = i1 + lane;
      float pd[kPerWarp], ds[kPerWarp];
#pragma unroll
      for (int r = 0; r < kPerWarp; ++r) {
        const int64_t j = j0 + warp * kPerWarp + r;
        const bool ok = allowed(a, kv_len, b, h, i, j);
        float g;  // at hidden entries too, as in the dQ kernel
        const float capped = scaled_score(a, s[r], &g);
        const float p = expf((ok ? capped + mask_add(a, b, h, i, j) : -INFINITY) - hi_s[lane]) * r_s[lane];
        pd[r] = p;
        ds[r] = 0.0f;
        if (ok) {
          const float f = dropout_factor(a, b, h, i, j);
          pd[r] = p * f;
          ds[r] = p * (dp[r] * f - delta_s[lane]);
        }
        ds[r] *= g * a.scale;
      }

      for (int ii = 0; ii < kTile; ++ii) {  // dV += Pd^T dO, dK += dS^T Q
        float pdi[kPerWarp], dsi[kPerWarp];
#pragma unroll
        for (int r = 0; r < kPerWarp; ++r) {
          pdi[r] = __shfl_sync(kFullMask, pd[r], ii);
          dsi[r] = __shfl_sync(kFullMask, ds[r], ii);
        }
#pragma unroll
        for (int t = 0; t < DPL; ++t) {
          const int c = lane + 32 * t;
          if (c < D) {
            const float doc = do_s[ii * ld + c], qc = q_s[ii * ld + c];
#pragma unroll
            for (int r = 0; r < kPerWarp; ++r) {
              acc_v[r][t] = fmaf(pdi[r], doc, acc_v[r][t]);
              acc_k[r][t] = fmaf(dsi[r], qc, acc_k[r][t]);
            }
          }
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kPerWarp; ++r) {
    const int64_t j = j0 + warp * kPerWarp + r;
    if (j >= a.Lk) continue;
    const int64_t row = (b * a.Hkv + hk) * a.Lk + j;
#pragma unroll
    for (int t = 0; t < DPL; ++t) {
      const int c = lane + 32 * t;
      if (c < D) {
        store_float(dk, row * D + c, acc_k[r][t], a.dtype);
        store_float(dv, row * D + c, acc_v[r][t], a.dtype);
      }
    }
  }
}

// keep[b, h, i, j], one element per thread (a debug entry point)
__global__ void attention_dropout_mask_kernel(int64_t H, int64_t Lq, int64_t Lk, int64_t rows, uint64_t seed,
                                              uint32_t threshold, bool* __restrict__ keep) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * Lk) return;
  const int64_t row = idx / Lk, j = idx % Lk;
  const int64_t b = row / (H * Lq), h = (row / Lq) % H, i = row % Lq;
  keep[idx] = attention_dropout_keep(seed, threshold, b, h, i, j);
}

// --------------------------------------------------------------------------------------
// Launchers
// --------------------------------------------------------------------------------------
const char* last_error() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

// Dynamic shared memory above the default 48 KiB needs an explicit opt-in per kernel.
template <typename Kernel>
const char* allow_smem(Kernel kernel, size_t bytes, int64_t D) {
  if (bytes <= static_cast<size_t>(kDefaultSmem)) return nullptr;
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e == cudaSuccess) return nullptr;
  static thread_local char message[256];
  snprintf(message, sizeof(message),
           "attention_cuda: head dim %lld needs %zu bytes of shared memory per block, more than this GPU allows (%s)",
           static_cast<long long>(D), bytes, cudaGetErrorString(e));
  return message;
}

const char* check_grid(const AttentionArgs& a, int64_t blocks_x) {
  if (blocks_x > 2147483647LL || a.H > 65535 || a.Hkv > 65535 || a.B > 65535) {
    return "attention_cuda: too many blocks for one launch";
  }
  if (a.D < 1 || a.D > 256) return "attention_cuda: head dim must be in [1, 256]";
  return nullptr;
}

size_t fwd_smem(int64_t D) { return sizeof(float) * (kBlockRows * D + 2 * kTile * (D + 1)); }
size_t dq_smem(int64_t D) { return sizeof(float) * (2 * kBlockRows * D + 2 * kTile * (D + 1)); }
size_t dkdv_smem(int64_t D) { return sizeof(float) * (2 * kBlockRows * D + 2 * kTile * (D + 1) + 3 * kTile); }

template <int DPL>
const char* fwd_launch(const AttentionArgs& a, void* out, float* lse, cudaStream_t stream) {
  const int64_t blocks = (a.Lq + kBlockRows - 1) / kBlockRows;
  if (const char* e = check_grid(a, blocks)) return e;
  const size_t smem = fwd_smem(a.D);
  if (const char* e = allow_smem(attention_fwd_kernel<DPL>, smem, a.D)) return e;
  attention_fwd_kernel<DPL><<<dim3(blocks, a.H, a.B), kThreads, smem, stream>>>(a, out, lse);
  return last_error();
}

template <int DPL>
const char* bwd_launch(const AttentionArgs& a, const void* dout, const void* out, const float* lse, float* stats,
                       void* dq, void* dk, void* dv, float* dmask, cudaStream_t stream) {
  const int64_t rows = a.B * a.H * a.Lq;
  const int64_t q_blocks = (a.Lq + kBlockRows - 1) / kBlockRows, k_blocks = (a.Lk + kBlockRows - 1) / kBlockRows;
  if (const char* e = check_grid(a, q_blocks > k_blocks ? q_blocks : k_blocks)) return e;
  if (rows > 0) {  // with no query rows only the dK/dV kernel runs: it writes their zeros
    const int64_t row_blocks = (rows + kWarps - 1) / kWarps;  // rows beyond the grid loop
    attention_row_kernel<<<static_cast<unsigned>(row_blocks < kMaxRowBlocks ? row_blocks : kMaxRowBlocks), kThreads, 0,
                           stream>>>(a, dout, out, lse, stats);
    if (const char* e = last_error()) return e;

    const size_t smem_q = dq_smem(a.D);
    if (const char* e = allow_smem(attention_bwd_dq_kernel<DPL>, smem_q, a.D)) return e;
    attention_bwd_dq_kernel<DPL><<<dim3(q_blocks, a.H, a.B), kThreads, smem_q, stream>>>(a, dout, stats, dq,
                                                                                          dmask);
    if (const char* e = last_error()) return e;
  }

  if (a.Lk == 0) return nullptr;
  const size_t smem_k = dkdv_smem(a.D);
  if (const char* e = allow_smem(attention_bwd_dkdv_kernel<DPL>, smem_k, a.D)) return e;
  attention_bwd_dkdv_kernel<DPL><<<dim3(k_blocks, a.Hkv, a.B), kThreads, smem_k, stream>>>(a, dout, stats, dk, dv);
  return last_error();
}

}  // namespace

const char* attention_fwd_cuda(const AttentionArgs& a, void* out, float* lse, cudaStream_t stream) {
  if (a.B == 0 || a.H == 0 || a.Lq == 0) return nullptr;
  // the per-lane accumulators hold DPL = D / 32 columns, rounded up to a power of two
  if (a.D <= 32) return fwd_launch<1>(a, out, lse, stream);
  if (a.D <= 64) return fwd_launch<2>(a, out, lse, stream);
  if (a.D <= 128) return fwd_launch<4>(a, out, lse, stream);
  if (a.D <= 256) return fwd_launch<8>(a, out, lse, stream);
  return "attention_cuda: head dim must be in [1, 256]";
}

const char* attention_bwd_cuda(const AttentionArgs& a, const void* dout, const void* out, const float* lse,
                               float* stats, void* dq, void* dk, void* dv, float* dmask, cudaStream_t stream) {
  if (a.B == 0 || a.D == 0) return nullptr;  // no output elements
  // H == 0 or Lq == 0 still launches the dK/dV kernel: dK and dV are 0, not uninitialised
  if (a.D <= 32) return bwd_launch<1>(a, dout, out, lse, stats, dq, dk, dv, dmask, stream);
  if (a.D <= 64) return bwd_launch<2>(a, dout, out, lse, stats, dq, dk, dv, dmask, stream);
  if (a.D <= 128) return bwd_launch<4>(a, dout, out, lse, stats, dq, dk, dv, dmask, stream);
  if (a.D <= 256) return bwd_launch<8>(a, dout, out, lse, stats, dq, dk, dv, dmask, stream);
  return "attention_cuda: head dim must be in [1, 256]";
}

const char* attention_dropout_mask_cuda(int64_t B, int64_t H, int64_t Lq, int64_t Lk, uint64_t seed,
                                        uint32_t threshold, bool* keep, cudaStream_t stream) {
  const int64_t rows = B * H * Lq, total = rows * Lk;
  if (total == 0) return nullptr;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  if (blocks > 2147483647LL) return "attention_dropout_mask_cuda: mask too large for one launch";
  attention_dropout_mask_kernel<<<blocks, threads, 0, stream>>>(H, Lq, Lk, rows, seed, threshold, keep);
  return last_error();
}

}  // namespace fasttrans::cuda_kernels
