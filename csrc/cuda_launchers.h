// Launchers of the CUDA kernels (attention_cuda.cu, layernorm_cuda.cu, dropout_cuda.cu): raw pointers,
// sizes, strides and a stream. No torch and no CUDA headers here, so the .cu files compile
// with plain nvcc on any machine and cuda_binding.cpp (the torch side) can include this too.
//
// Every launcher returns nullptr on success, else a static error string (CUDA's message or
// an argument problem); the caller turns it into an exception.
#pragma once

#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace fasttrans::cuda_kernels {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
enum class MaskType : int { kNone = 0, kBool = 1, kFloat32 = 2, kFloat16 = 3, kBFloat16 = 4 };

// Everything the attention kernels read. Strides are in elements; the innermost (head dim)
// stride of q, k, v is 1. The mask is (B, H, Lq, Lk) through its strides (0 on broadcast dims).
struct AttentionArgs {
  int64_t B, H, Hkv, Lq, Lk, D;
  DType dtype;
  const void* q;
  int64_t q_sb, q_sh, q_si;
  const void* k;
  int64_t k_sb, k_sh, k_si;
  const void* v;
  int64_t v_sb, v_sh, v_si;
  const void* mask;
  MaskType mask_type;
  int64_t m_sb, m_sh, m_si, m_sj;
  const int32_t* key_lengths;  // (B,) or null
  bool causal;
  int64_t causal_offset;
  float scale;
  bool dropout;
  uint64_t seed;
  uint32_t dropout_threshold;  // see philox.h
  float dropout_scale;         // 1 / (1 - p)
  float softcap;               // > 0: scaled scores s become softcap * tanh(s / softcap) before the masks; 0: none
};

// out (B, H, Lq, D) contiguous in args.dtype; lse (B, H, Lq) fp32.
const char* attention_fwd_cuda(const AttentionArgs& args, void* out, float* lse, cudaStream_t stream);

// dout, out (B, H, Lq, D) contiguous in args.dtype; lse (B, H, Lq) fp32; stats a (3, B, H, Lq)
// fp32 workspace (each row's delta and softmax statistics); dq (B, H, Lq, D), dk, dv (B, Hkv,
// Lk, D) contiguous in args.dtype, every element written (dk, dv are zeros when H or Lq is
// 0); dmask (B, H, Lq, Lk) fp32, zero-filled by the caller, or null.
const char* attention_bwd_cuda(const AttentionArgs& args, const void* dout, const void* out, const float* lse,
                               float* stats, void* dq, void* dk, void* dv, float* dmask, cudaStream_t stream);

// keep (B, H, Lq, Lk) bool, contiguous.
const char* attention_dropout_mask_cuda(int64_t B, int64_t H, int64_t Lq, int64_t Lk, uint64_t seed,
                                        uint32_t threshold, bool* keep, cudaStream_t stream);

struct NormArgs {
  int64_t M, N;
  DType dtype;
  const void* x;         // (M, N), row stride ldx, unit column stride
  int64_t ldx;
  const void* residual;  // (M, N) or null
  int64_t ldr;
  const float* weight;   // (N,) fp32 or null
  const float* bias;     // (N,) fp32 or null
  float eps;
  bool rms;
};

// y, h (M, N) contiguous in args.dtype (h only with a residual, else null); mean (M,) fp32
// (null for RMSNorm); rstd (M,) fp32.
const char* norm_fwd_cuda(const NormArgs& args, void* y, void* h, float* mean, float* rstd, cudaStream_t stream);

// Rows per chunk of the deterministic dweight/dbias reduction, and the number of chunks.
int64_t norm_bwd_chunks(int64_t M);

// dy (M, N) contiguous; dh (M, N) contiguous or null; h (M, N) with row stride ldh;
// dx (M, N) contiguous; dw_part, db_part (norm_bwd_chunks(M), N) fp32 workspaces or null;
// dw, db (N,) fp32 outputs or null.
const char* norm_bwd_cuda(int64_t M, int64_t N, DType dtype, const void* dy, const void* dh, const void* h,
                          int64_t ldh, const float* weight, const float* mean, const float* rstd, bool rms, void* dx,
                          float* dw_part, float* db_part, float* dw, float* db, cudaStream_t stream);

// Elementwise dropout over numel contiguous elements (the mask of csrc/philox.h's
// flat_dropout_words, equal to the CPU kernel's bit for bit). x, y in dtype; keep bool;
// threshold = dropout_threshold(p); scale = fp32(1 / (1 - p)). y = x * (keep ? scale : 0) in fp32.
const char* dropout_fwd_cuda(int64_t numel, DType dtype, const void* x, void* y, bool* keep, uint64_t seed,
                             uint32_t threshold, float scale, cudaStream_t stream);

// dx = dy * (keep ? scale : 0) in fp32, rounded to dtype; dy, dx in dtype, keep bool, all contiguous.
const char* dropout_bwd_cuda(int64_t numel, DType dtype, const void* dy, const bool* keep, void* dx, float scale,
                             cudaStream_t stream);

}  // namespace fasttrans::cuda_kernels
