// Shared pieces of the CPU kernels: accumulation types, the tile GEMM, vectorised row
// helpers, strided mask rows, dropout rows and a dynamically scheduled parallel loop.
//
// Compiled with the host's vector ISA: fasttrans/extension.py probes the compiler and
// defines CPU_CAPABILITY=AVX512 / AVX2 before any ATen vector header is seen, so
// at::vec::Vectorized<float> below is a real SIMD register, not the scalar fallback.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/bit_cast.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#include "philox.h"
#include "philox_cpu.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace fasttrans::cpu {

// fp64 inputs accumulate in fp64 (gradcheck); everything else in fp32.
template <typename scalar_t>
using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

template <typename T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

// --------------------------------------------------------------------------------------
// Tile GEMM: C (M x N, ldc) [+]= A (M x K, lda) * B (K x N, ldb), all row-major.
// --------------------------------------------------------------------------------------
// fp32 goes to oneDNN's brgemm micro-kernel through ATen (exported by libtorch_cpu; the
// kernel is JIT-generated once per shape and cached per thread). ATen's cpublas::gemm is
// not exported, and `a @ b` costs microseconds of dispatch per tile. brgemm has no
// transpose flags: callers arrange for B to be stored K-major (see attention_cpu.cpp).
inline void gemm_nn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                    float* C, int64_t ldc, bool add_C) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_C, A, B, C);
}

// fp64 exists for gradcheck only: a plain loop nest (the inner loop over N is contiguous
// in B and C and vectorises), no blocking.
inline void gemm_nn(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B, int64_t ldb,
                    double* C, int64_t ldc, bool add_C) {
  for (int64_t m = 0; m < M; ++m) {
    double* c = C + m * ldc;
    if (!add_C) std::fill(c, c + N, 0.0);
    for (int64_t k = 0; k < K; ++k) {
      const double a = A[m * lda + k];
      const double* b = B + k * ldb;
      for (int64_t n = 0; n < N; ++n) c[n] += a * b[n];
    }
  }
}

// --------------------------------------------------------------------------------------
// Vectorised row helpers (T = float or double)
// --------------------------------------------------------------------------------------
template <typename T>
using Vec = at::vec::Vectorized<T>;

#if defined(CPU_CAPABILITY_AVX512)
// exp(x) = 2^n exp(r), n = round(x / ln 2), r = x - n ln 2 in two parts (Cody-Waite), exp(r) by
// the degree-5 minimax polynomial exp_u20 uses, 2^n applied by vscalefps, in 11 instructions
// against exp_u20's 19. Like exp_u20 it gives 0, never a subnormal, below ln(FLT_MIN) (-inf
// included), which the attention kernels rely on; NaN stays NaN.
inline __m512 exp_avx512(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2, high bits exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(0.00828929059f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.0418978221f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.166676521f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.499991506f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.999999701f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  // x >= the least float whose exp is >= FLT_MIN, or NaN
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654022216797f), _CMP_NLT_UQ);
  return _mm512_maskz_scalef_ps(keep, p, n);
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// exp_avx512 for AVX2: the same reduction and polynomial, 2^n built in the exponent field,
// 0 below ln(FLT_MIN), NaN kept. Without vscalefps 2^128 has no float, so from
// 127.5 ln 2 = 88.376 on (results past 2.4e38) it gives inf; the kernels call it on x <= 0.
inline __m256 exp_avx2(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(0.00828929059f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.0418978221f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.166676521f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.499991506f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.999999701f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_min_ps(n, _mm256_set1_ps(127.0f))), _mm256_set1_epi32(127)), 23);
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654022216797f), _CMP_NLT_UQ);
  const __m256 big = _mm256_cmp_ps(x, _mm256_set1_ps(88.37626266479492f), _CMP_GE_OQ);
  return _mm256_blendv_ps(_mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(e))),
                          _mm256_set1_ps(std::numeric_limits<float>::infinity()), big);
}
#endif

template <typename T>
inline Vec<T> vexp(const Vec<T>& x) {
  if constexpr (std::is_same_v<T, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    return Vec<T>(exp_avx512(x));
#elif defined(CPU_CAPABILITY_AVX2)
    return Vec<T>(exp_avx2(x));
#else
    return x.exp_u20();  // ~20 ulp polynomial; exp(-inf) = 0 (attention probabilities)
#endif
  } else {
    return x.exp();
  }
}

// Sum of a vector's lanes in a fixed order (deterministic): ATen's shuffle tree for fp32
// (a scalar loop's 16 dependent adds would sit on every row's critical path).
template <typename T>
inline T lane_sum(const Vec<T>& v) {
  return at::vec::vec_reduce_all<T>(std::plus<Vec<T>>(), v);
}

// max(a, b) that propagates NaN (std::max(a, NaN) is a): a NaN score must reach the output as
// NaN, as in the reference, rather than leave its row looking fully masked (output 0).
template <typename T>
inline T nan_max(T a, T b) {
  return (a >= b || std::isnan(a)) ? a : b;
}

// Lanes past n of a partial load, as -inf: they leave a max unchanged.
template <typename T>
inline Vec<T> load_or_neg_inf(const T* x, int64_t n) {
  return Vec<T>::set(Vec<T>(neg_inf<T>()), Vec<T>::loadu(x, n), n);
}

// Max of a vector's lanes by a shuffle tree; at::vec::maximum propagates NaN, as nan_max does.
template <typename T>
inline T lane_max(const Vec<T>& v) {
  return at::vec::vec_reduce_all<T>([](const Vec<T>& a, const Vec<T>& b) { return at::vec::maximum(a, b); }, v);
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// row_max / scale_row_max for fp32 (and the forward's one-pass softmax rows, below): the
// plain max instruction, with NaNs tracked apart (one unordered compare per two vectors)
// instead of at::vec::maximum's compare-and-blend at every step. F32Simd: the few
// instructions that differ between AVX-512 (NaNs in a mask register) and AVX2 (in a vector).
#if defined(CPU_CAPABILITY_AVX512)
struct F32Simd {
  using V = __m512;
  using Nan = __mmask16;
  static constexpr int64_t W = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static Nan no_nan() { return 0; }
  static Nan add_nans(Nan acc, V a, V b) { return acc | _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q); }
  static bool any(Nan acc) { return acc != 0; }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static Nan add_above(Nan acc, V a, V limit) { return acc | _mm512_cmp_ps_mask(a, limit, _CMP_NLE_UQ); }  // or NaN
  static V exp(V x) { return exp_avx512(x); }
};
#else
struct F32Simd {
  using V = __m256;
  using Nan = __m256;
  static constexpr int64_t W = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static Nan no_nan() { return _mm256_setzero_ps(); }
  static Nan add_nans(Nan acc, V a, V b) { return _mm256_or_ps(acc, _mm256_cmp_ps(a, b, _CMP_UNORD_Q)); }
  static bool any(Nan acc) { return _mm256_movemask_ps(acc) != 0; }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static Nan add_above(Nan acc, V a, V limit) { return _mm256_or_ps(acc, _mm256_cmp_ps(a, limit, _CMP_NLE_UQ)); }
  static V exp(V x) { return exp_avx2(x); }  // called on x <= a finite limit
  static float reduce_max(V v) {  // no NaN left: plain max instructions
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
  }
};
#endif

template <bool kScale>
inline float row_max_simd(const float* x, float* dst, int64_t n, float a) {  // dst: x scaled
  using S = F32Simd;
  constexpr int64_t W = S::W;
  const S::V va = S::set1(a), lowest = S::set1(neg_inf<float>());
  S::V m0 = lowest, m1 = lowest;
  S::Nan nan = S::no_nan();
  int64_t k = 0;
  for (; k + 2 * W <= n; k += 2 * W) {
    S::V v0 = S::load(x + k), v1 = S::load(x + k + W);
    if constexpr (kScale) {
      v0 = S::mul(v0, va);
      v1 = S::mul(v1, va);
      S::store(dst + k, v0);
      S::store(dst + k + W, v1);
    }
    nan = S::add_nans(nan, v0, v1);
    m0 = S::max(m0, v0);
    m1 = S::max(m1, v1);
  }
  for (; k < n; k += W) {  // the rest, the last vector partial: ATen's partial load and store
    const int64_t c = std::min<int64_t>(W, n - k);
    Vec<float> v = Vec<float>::loadu(x + k, c);
    if constexpr (kScale) {
      v = v * Vec<float>(a);
      v.store(dst + k, c);
    }
    v = Vec<float>::set(Vec<float>(neg_inf<float>()), v, c);
    nan = S::add_nans(nan, v, v);
    m0 = S::max(m0, v);
  }
  if (S::any(nan)) return std::numeric_limits<float>::quiet_NaN();
  return S::reduce_max(S::max(m0, m1));
}
#endif

template <typename T>
inline T row_max(const T* x, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) return row_max_simd<false>(x, nullptr, n, 1.f);
#endif
  constexpr int64_t W = Vec<T>::size();
  // two accumulators: one would make the row's loads a chain of dependent max latencies
  Vec<T> m0(neg_inf<T>()), m1(neg_inf<T>());
  int64_t k = 0;
  for (; k + 2 * W <= n; k += 2 * W) {
    m0 = at::vec::maximum(m0, Vec<T>::loadu(x + k));
    m1 = at::vec::maximum(m1, Vec<T>::loadu(x + k + W));
  }
  for (; k + W <= n; k += W) m0 = at::vec::maximum(m0, Vec<T>::loadu(x + k));
  if (k < n) m1 = at::vec::maximum(m1, load_or_neg_inf(x + k, n - k));
  return lane_max(at::vec::maximum(m0, m1));
}

// x[k] *= a, returning the row's max afterwards (row_max of the scaled row) in the same pass.
template <typename T>
inline T scale_row_max(T* x, int64_t n, T a) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) return row_max_simd<true>(x, x, n, a);
#endif
  constexpr int64_t W = Vec<T>::size();
  const Vec<T> va(a);
  Vec<T> m0(neg_inf<T>()), m1(neg_inf<T>());
  int64_t k = 0;
  for (; k + 2 * W <= n; k += 2 * W) {
    const Vec<T> v0 = Vec<T>::loadu(x + k) * va, v1 = Vec<T>::loadu(x + k + W) * va;
    v0.store(x + k);
    v1.store(x + k + W);
    m0 = at::vec::maximum(m0, v0);
    m1 = at::vec::maximum(m1, v1);
  }
  for (; k + W <= n; k += W) {
    const Vec<T> v = Vec<T>::loadu(x + k) * va;
    v.store(x + k);
    m0 = at::vec::maximum(m0, v);
  }
  if (k < n) {
    const Vec<T> v = Vec<T>::loadu(x + k, n - k) * va;
    v.store(x + k, n - k);
    m1 = at::vec::maximum(m1, Vec<T>::set(Vec<T>(neg_inf<T>()), v, n - k));
  }
  return lane_max(at::vec::maximum(m0, m1));
}

// x[k] = exp(a x[k] - m), the argument rounded once (an FMA); returns the new x's lane-wise
// partial sums (lanes past n excluded), so that a caller accumulating over many rows' tiles
// reduces across lanes once, at the end.
template <typename T>
inline Vec<T> exp_affine_lanes(T* x, int64_t n, T a, T m) {
  constexpr int64_t W = Vec<T>::size();
  const Vec<T> va(a), vnm(-m);
  Vec<T> acc(T(0));
  int64_t k = 0;
  for (; k + W <= n; k += W) {
    Vec<T> e = vexp(at::vec::fmadd(Vec<T>::loadu(x + k), va, vnm));
    e.store(x + k);
    acc = acc + e;
  }
  if (k < n) {
    Vec<T> e = vexp(at::vec::fmadd(Vec<T>::loadu(x + k, n - k), va, vnm));
    e.store(x + k, n - k);
    // lanes past n were loaded as 0 and became exp(-m): keep them out of the sum
    acc = acc + Vec<T>::set(Vec<T>(T(0)), e, n - k);
  }
  return acc;
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// exp_affine_lanes over NV full vectors held in registers (F32Simd's): false, with x
// untouched, where any a x[k] - m is above `limit` or NaN.
template <int NV>
inline bool exp_affine_row_within(float* x, float a, float m, float limit, float* lane_sums) {
  using S = F32Simd;
  const S::V va = S::set1(a), vnm = S::set1(-m), vlimit = S::set1(limit);
  S::V t[NV];
  S::Nan over = S::no_nan();
  for (int v = 0; v < NV; ++v) {
    t[v] = S::fmadd(S::load(x + S::W * v), va, vnm);
    over = S::add_above(over, t[v], vlimit);
  }
  if (S::any(over)) return false;
  S::V acc = S::load(lane_sums);
  for (int v = 0; v < NV; ++v) {
    const S::V e = S::exp(t[v]);
    S::store(x + S::W * v, e);
    acc = S::add(acc, e);
  }
  S::store(lane_sums, acc);
  return true;
}
#endif

// The attention forward's one-pass softmax row, where the row's running max m is finite and
// no a x[k] - m passes `slack`: x[k] = exp(a x[k] - m) (as exp_affine_lanes), added to
// lane_sums (Vec<T>::size() lanes); returns false, with x untouched, for any other row and
// where the machine has no such path (fp32 rows of 64 or 128 under AVX-512 or AVX2), so that
// the caller takes the row max's pass.
template <typename T>
inline bool exp_row_in_one_pass(T* x, int64_t n, T a, T m, T slack, T* lane_sums) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    if (std::isfinite(m)) {
      if (n == 128) return exp_affine_row_within<128 / F32Simd::W>(x, a, m, slack, lane_sums);
      if (n == 64) return exp_affine_row_within<64 / F32Simd::W>(x, a, m, slack, lane_sums);
    }
  }
#endif
  return false;
}

// x[k] = exp(x[k] - m); returns the new x's lane-wise partial sums (see exp_affine_lanes).
template <typename T>
inline Vec<T> exp_sub_lanes(T* x, int64_t n, T m) {
  return exp_affine_lanes(x, n, T(1), m);  // fma(x, 1, -m) is x - m exactly
}

// x[k] = exp(x[k] - m); returns the sum of the new x.
template <typename T>
inline T exp_sub_sum(T* x, int64_t n, T m) {
  return lane_sum(exp_sub_lanes(x, n, m));
}

// The sum of exp_affine_lanes by std::exp: the results below FLT_MIN, which exp_u20 flushes
// to 0, stay subnormal (a weight of exp(-95) times an inf in v is inf, not 0 * inf = NaN).
// For double vexp is exact already.
template <typename T>
inline T exp_affine_sum_exact(T* x, int64_t n, T a, T m) {
  if constexpr (!std::is_same_v<T, float>) {
    return lane_sum(exp_affine_lanes(x, n, a, m));
  } else {
    T s = 0;
    for (int64_t k = 0; k < n; ++k) s += (x[k] = std::exp(std::fma(a, x[k], -m)));
    return s;
  }
}

// exp_sub_sum by std::exp (see exp_affine_sum_exact).
template <typename T>
inline T exp_sub_sum_exact(T* x, int64_t n, T m) {
  return exp_affine_sum_exact(x, n, T(1), m);
}

// Whether a row of o (rows of n) has a NaN or an inf where its running max m is finite: with
// exp_u20's flushed weights a NaN may be 0 * inf, and the row needs exp_sub_sum_exact. (A max
// of -inf leaves the row empty, one of +inf or NaN makes it NaN whatever the weights.) What
// exact weights give as well (inf - inf, a NaN or an inf in v) costs one more pass, no more.
template <typename T>
inline bool flushed_weight_hit_inf(const T* o, const T* m, int64_t rows, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) {
    return false;
  } else {
    constexpr int64_t W = Vec<T>::size();
    const Vec<T> zero(T(0));
    for (int64_t r = 0; r < rows; ++r) {
      if (!std::isfinite(m[r])) continue;
      const T* x = o + r * n;
      Vec<T> acc = zero;  // x * 0 is NaN where x is NaN or inf, 0 elsewhere
      int64_t k = 0;
      for (; k + W <= n; k += W) acc = at::vec::fmadd(Vec<T>::loadu(x + k), zero, acc);
      if (k < n) acc = at::vec::fmadd(Vec<T>::loadu(x + k, n - k), zero, acc);
      if (std::isnan(lane_sum(acc))) return true;
    }
    return false;
  }
}

// dst[k] = src[k] * a, vectorised (dst may be src)
template <typename T>
inline void scale_into(const T* src, T* dst, int64_t n, T a) {
  constexpr int64_t W = Vec<T>::size();
  const Vec<T> va(a);
  int64_t k = 0;
  for (; k + W <= n; k += W) (Vec<T>::loadu(src + k) * va).store(dst + k);
  if (k < n) (Vec<T>::loadu(src + k, n - k) * va).store(dst + k, n - k);
}

template <typename T>
inline void scale_row(T* x, int64_t n, T a) {
  scale_into(x, x, n, a);
}

template <typename T>
inline T dot(const T* x, const T* y, int64_t n) {
  constexpr int64_t W = Vec<T>::size();
  Vec<T> acc(T(0));
  int64_t k = 0;
  for (; k + W <= n; k += W) acc = at::vec::fmadd(Vec<T>::loadu(x + k), Vec<T>::loadu(y + k), acc);
  if (k < n) acc = at::vec::fmadd(Vec<T>::loadu(x + k, n - k), Vec<T>::loadu(y + k, n - k), acc);
  return lane_sum(acc);
}

// out[c] = dot(x, y + c * ld_y, n) for c < m: the scores of one query row against m key rows.
// fp32 with AVX-512 takes sixteen keys at a time: sixteen accumulators, then one
// reduce-transpose (the add of an unpack-32, an unpack-64 and two 128-bit lane-shuffle
// rounds, as in transpose16_f32 below) leaves the sixteen sums in one register: 30 shuffles
// and 15 adds for sixteen scores, where a horizontal sum takes a dependent chain of four
// shuffle-and-add steps for each score.
#if defined(CPU_CAPABILITY_AVX512)
inline void dots16_f32(const float* x, const float* y, int64_t ld_y, int m, int64_t n, float* out) {
  __m512 a[16];
#pragma GCC unroll 16
  for (int c = 0; c < 16; ++c) a[c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512 xv = _mm512_loadu_ps(x + k);
#pragma GCC unroll 16
    for (int c = 0; c < 16; ++c) {
      if (c < m) a[c] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(y + c * ld_y + k), a[c]);
    }
  }
  if (k < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - k)) - 1);
    const __m512 xv = _mm512_maskz_loadu_ps(tail, x + k);
#pragma GCC unroll 16
    for (int c = 0; c < 16; ++c) {
      if (c < m) a[c] = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(tail, y + c * ld_y + k), a[c]);
    }
  }
  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] for keys x = 2i, y = 2i + 1
  __m512 b[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  // per 128-bit lane: the lane's partial sums of keys 4i .. 4i + 3
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_castps_pd(b[2 * i]), hi = _mm512_castps_pd(b[2 * i + 1]);
    a[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  // lanes (L0 + L1, L2 + L3) of a pair, then once more: keys 0 .. 15 in order
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x88), _mm512_shuffle_f32x4(a[0], a[1], 0xdd));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], 0x88), _mm512_shuffle_f32x4(a[2], a[3], 0xdd));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xdd));
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << m) - 1), e);
}
#endif

template <typename T>
inline void dots(const T* x, const T* y, int64_t ld_y, int64_t m, int64_t n, T* out) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t c = 0; c < m; c += 16) {
      dots16_f32(x, y + c * ld_y, ld_y, static_cast<int>(std::min<int64_t>(16, m - c)), n, out + c);
    }
    return;
  }
#endif
  for (int64_t c = 0; c < m; ++c) out[c] = dot(x, y + c * ld_y, n);
}

// dst[k] = T(src[k]) * a   (src in any float dtype; a conversion and a scale in one pass)
template <typename src_t, typename T>
inline void load_scaled(const src_t* src, T* dst, int64_t n, T a) {
  if constexpr (std::is_same_v<src_t, T>) {
    scale_into(src, dst, n, a);
  } else {
    at::vec::convert(src, dst, n);
    if (a != T(1)) scale_row(dst, n, a);
  }
}

// dst[k] = out_t(src[k] * a)
template <typename T, typename out_t>
inline void store_scaled(const T* src, out_t* dst, int64_t n, T a) {
  if constexpr (std::is_same_v<out_t, T>) {
    scale_into(src, dst, n, a);
  } else {
    for (int64_t k = 0; k < n; ++k) dst[k] = static_cast<out_t>(src[k] * a);
  }
}

// --------------------------------------------------------------------------------------
// Transposing blocks of up to 16 x 16
// --------------------------------------------------------------------------------------
// dst[c * ld_dst + r] = src[r * ld_src + c] for r < M, c < N (M, N <= 16).
// fp32 with AVX-512: fully unrolled, the 16 rows held in registers (unpack 32-bit, unpack
// 64-bit, two rounds of 128-bit lane shuffles). ATen's at::vec::transpose_mxn takes M and N at
// run time and passes its rows through memory between the stages, which showed in profiles
// of the short-sequence attention backward. fp32 with AVX2 takes ATen's compile-time 16 x 16
// for full blocks; other types, ISAs and partial blocks use at::vec::transpose_mxn.
#if defined(CPU_CAPABILITY_AVX512)
inline void transpose16_f32(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int M, int N) {
  const __mmask16 cols = static_cast<__mmask16>((1u << N) - 1);
  const __mmask16 rows = static_cast<__mmask16>((1u << M) - 1);
  __m512 a[16], t[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    a[i] = i < M ? _mm512_maskz_loadu_ps(cols, src + i * ld_src) : _mm512_setzero_ps();
  }
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512d t0 = _mm512_castps_pd(t[4 * i]), t1 = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d t2 = _mm512_castps_pd(t[4 * i + 2]), t3 = _mm512_castps_pd(t[4 * i + 3]);
    a[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    a[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    a[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    a[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(a[8 * i + j], a[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_f32x4(a[8 * i + j], a[8 * i + j + 4], 0xdd);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if (i < N) {
      const __m512 out = i < 8 ? _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88)
                               : _mm512_shuffle_f32x4(t[i - 8], t[i], 0xdd);
      _mm512_mask_storeu_ps(dst + i * ld_dst, rows, out);
    }
  }
}
#endif

template <typename T>
inline void transpose_upto16(const T* src, int64_t ld_src, T* dst, int64_t ld_dst, int M, int N) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    transpose16_f32(src, ld_src, dst, ld_dst, M, N);
    return;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    if (M == 16 && N == 16) {  // ATen's in-register 8 x 8 transposes, for the full blocks
      at::vec::transpose_mxn<float, 16, 16>(src, ld_src, dst, ld_dst);
      return;
    }
  }
#endif
  at::vec::transpose_mxn<T>(src, ld_src, dst, ld_dst, M, N);
}

// --------------------------------------------------------------------------------------
// Dense attention masks, read through their strides (broadcast dims have stride 0)
// --------------------------------------------------------------------------------------
enum class MaskKind { kNone, kBool, kFloat, kDouble, kBFloat16, kHalf };

struct MaskView {
  MaskKind kind = MaskKind::kNone;
  const void* data = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_i = 0, stride_j = 0;  // in elements

  explicit operator bool() const { return kind != MaskKind::kNone; }
};

inline MaskView make_mask_view(const std::optional<at::Tensor>& mask) {
  MaskView m;
  if (!mask.has_value() || !mask->defined()) return m;
  const at::Tensor& t = *mask;
  TORCH_CHECK(t.dim() == 4, "attn_mask: expected a 4-D (B, H, Lq, Lk) view, got ", t.dim(), " dims");
  switch (t.scalar_type()) {
    case at::kBool: m.kind = MaskKind::kBool; break;
    case at::kFloat: m.kind = MaskKind::kFloat; break;
    case at::kDouble: m.kind = MaskKind::kDouble; break;
    case at::kBFloat16: m.kind = MaskKind::kBFloat16; break;
    case at::kHalf: m.kind = MaskKind::kHalf; break;
    default: TORCH_CHECK(false, "attn_mask: expected a bool or floating-point mask, got ", t.scalar_type());
  }
  m.data = t.data_ptr();
  m.stride_b = t.stride(0);
  m.stride_h = t.stride(1);
  m.stride_i = t.stride(2);
  m.stride_j = t.stride(3);
  return m;
}

template <typename mask_t, typename T>
inline void load_mask_values(const mask_t* p, int64_t sj, int64_t n, T* out) {
  if (sj == 1) {
    for (int64_t c = 0; c < n; ++c) out[c] = static_cast<T>(static_cast<float>(p[c]));
  } else {
    for (int64_t c = 0; c < n; ++c) out[c] = static_cast<T>(static_cast<float>(p[c * sj]));
  }
}

// out[c] = the additive mask for score (b, h, i, j0 + c): a float mask's value, or 0 / -inf
// for a bool mask (True = may attend).
template <typename T>
inline void load_mask_row(const MaskView& m, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n, T* out) {
  const int64_t off = b * m.stride_b + h * m.stride_h + i * m.stride_i + j0 * m.stride_j;
  const int64_t sj = m.stride_j;
  switch (m.kind) {
    case MaskKind::kBool: {
      // bytes (a bool tensor viewed from other bytes may hold values other than 0 and 1),
      // without a branch per key, which a random mask would mispredict
      using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
      static_assert(sizeof(Bits) == sizeof(T), "float or double");
      const Bits inf_bits = c10::bit_cast<Bits>(neg_inf<T>());
      const uint8_t* p = static_cast<const uint8_t*>(m.data) + off;
      for (int64_t c = 0; c < n; ++c) {
        const Bits bits = (Bits(0) - Bits(p[c * sj] == 0)) & inf_bits;
        std::memcpy(out + c, &bits, sizeof(T));
      }
      break;
    }
    case MaskKind::kFloat: {
      const float* p = static_cast<const float*>(m.data) + off;
      for (int64_t c = 0; c < n; ++c) out[c] = static_cast<T>(p[c * sj]);
      break;
    }
    case MaskKind::kDouble: {
      const double* p = static_cast<const double*>(m.data) + off;
      for (int64_t c = 0; c < n; ++c) out[c] = static_cast<T>(p[c * sj]);
      break;
    }
    case MaskKind::kBFloat16:
      load_mask_values(static_cast<const c10::BFloat16*>(m.data) + off, sj, n, out);
      break;
    case MaskKind::kHalf:
      load_mask_values(static_cast<const c10::Half*>(m.data) + off, sj, n, out);
      break;
    case MaskKind::kNone:
      std::fill(out, out + n, T(0));
      break;
  }
}

// Applies a row from load_mask_row to scores s[c * stride]: a float mask is added; a bool
// mask's hidden entries become -inf, replacing the score (as the reference's masked_fill: a
// NaN score at a hidden position stays hidden instead of turning its row NaN).
template <typename T>
inline void apply_mask_row(const MaskView& m, const T* mask_row, T* s, int64_t n, int64_t stride) {
  if (m.kind == MaskKind::kBool) {
    for (int64_t c = 0; c < n; ++c) {
      if (mask_row[c] != T(0)) s[c * stride] = mask_row[c];
    }
  } else {
    for (int64_t c = 0; c < n; ++c) s[c * stride] += mask_row[c];
  }
}

// --------------------------------------------------------------------------------------
// Dropout rows (see philox.h for the definition of the mask)
// --------------------------------------------------------------------------------------
struct Dropout {
  bool enabled = false;
  uint64_t seed = 0;
  uint32_t threshold = 0;
  double inv_keep = 1.0;  // 1 / (1 - p)
};

inline Dropout make_dropout(double p, int64_t seed) {
  Dropout d;
  d.enabled = p > 0.0;
  d.seed = static_cast<uint64_t>(seed);
  d.threshold = attention_dropout_threshold(p);
  d.inv_keep = d.enabled ? 1.0 / (1.0 - p) : 1.0;
  return d;
}

// out[c] = keep(b, h, i, j0 + c) ? 1 : 0. The row is generated 64 keys at a time from the
// 16-key block that holds j0; bits before j0 are shifted out.
template <typename T>
inline void dropout_keep_row(const Dropout& d, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n, T* out) {
  const int64_t end = j0 + n;
  for (int64_t j = j0; j < end;) {
    const int64_t c = j >> 4;
    const int64_t skip = j - 16 * c;  // 0..15 keys of the first block lie before j
    const int64_t count = std::min<int64_t>(64 - skip, end - j);
    const uint64_t bits = attention_keep_bits64(i, static_cast<uint32_t>(h), static_cast<uint32_t>(b), c, d.seed,
                                                d.threshold) >> skip;
    T* o = out + (j - j0);
    for (int64_t k = 0; k < count; ++k) o[k] = ((bits >> k) & 1u) ? T(1) : T(0);
    j += count;
  }
}

// --------------------------------------------------------------------------------------
// Parallel loop over independent work items with dynamic claiming
// --------------------------------------------------------------------------------------
// Each item writes only its own outputs, so results do not depend on which thread ran it
// or in which order: the loop is deterministic while balancing uneven items (causal
// triangles, ragged key lengths). `make_scratch()` builds one per-thread workspace.
template <typename MakeScratch, typename Body>
void parallel_items(int64_t n_items, const MakeScratch& make_scratch, const Body& body) {
  if (n_items <= 0) return;
  const int64_t n_threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, n_threads, 1, [&](int64_t, int64_t) {
    auto scratch = make_scratch();
    for (int64_t item = next.fetch_add(1); item < n_items; item = next.fetch_add(1)) body(item, scratch);
  });
}

}  // namespace fasttrans::cpu
