// LayerNorm, add + LayerNorm and RMSNorm on the CPU, forward and backward.
//
// Forward, per row of N (rows in parallel; fp32 statistics, fp64 for fp64 inputs):
//     h     = x + residual           (rounded to x's dtype, exactly what torch's add gives)
//     shift = mean of the row's first vector                 a point near the mean
//     d     = sum(h - shift) / N,   mean = shift + d          one pass over the row for both
//     var   = (sum((h - shift)^2) - sum(h - shift) * d) / N   sums (see row_stats); never
//     rstd  = 1 / sqrt(var + eps)                             E[h^2] - E[h]^2 about zero
//     y     = ((h - shift) * rstd - d * rstd) * w + b
// RMSNorm: shift = d = 0 and rstd = 1 / sqrt(sum(h^2) / N + eps). add_layer_norm takes the
// sums in the pass that forms h, so each row is read twice in all: once for h and its
// sums, once to normalise it.
//
// Backward, with xhat = (h - mean) * rstd and g = dy * w:
//     dh = rstd * (g - mean(g) - xhat * mean(g * xhat))      [+ the gradient flowing into h]
//     (RMSNorm drops the mean(g) term)
//     dw = sum_rows dy * xhat,   db = sum_rows dy
// dw/db are reduced deterministically: rows are cut into fixed chunks (independent of the
// thread count), each chunk writes its own fp32 partial row, and the partials are summed in
// chunk order. No atomics, and the same bits on any number of threads.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>

#include <cstring>
#include <initializer_list>
#include <limits>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "checks.h"
#include "common.h"
#include "cpu_allocator.h"
#include "ops.h"

namespace fasttrans::cpu {
namespace {

// Rows per backward chunk (each chunk writes one partial row of dw and of db, summed in
// chunk order afterwards, so the result depends on M and N only, never on the threads):
//  - at least 8 chunks where that leaves 8 rows or more to each, so that a few long rows
//    (64 x 65536) still keep every core busy;
//  - about 32K elements per chunk at least, so small inputs stay one chunk, run inline;
//  - up to 64 rows per chunk, more only to stay within ~256 chunks (the partial buffers
//    stay small next to the input).
int64_t rows_per_chunk(int64_t M, int64_t N) {
  const int64_t want = std::max<int64_t>({8, (M + 7) / 8, (32768 + N - 1) / std::max<int64_t>(N, 1)});
  return std::min(want, std::max<int64_t>(64, (M + 255) / 256));
}

// Row-parallel grain: about 32K elements per task.
int64_t row_grain(int64_t N) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(N, 1));
}

// --------------------------------------------------------------------------------------
// Writing rows out
// --------------------------------------------------------------------------------------
// Outputs much larger than the caches are written with non-temporal (streaming) stores:
// an ordinary store first reads the destination line into the cache (read-for-ownership),
// so a write-only output costs twice its size in memory traffic. The norms are memory-bound
// (a few flops per element), so for big tensors this is the largest single cost. Small
// outputs keep ordinary stores: they stay in cache for whoever reads them next.
constexpr int64_t kStreamBytes = int64_t(4) << 20;

bool use_streaming_stores(int64_t output_bytes) {
  return output_bytes >= kStreamBytes;
}

template <typename T>
void write_row(const T* src, T* dst, int64_t n, bool stream) {
  const char* s = reinterpret_cast<const char*>(src);
  char* d = reinterpret_cast<char*>(dst);
  size_t bytes = static_cast<size_t>(n) * sizeof(T);
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (stream) {
#if defined(CPU_CAPABILITY_AVX512)
    constexpr size_t kLine = 64;
#else
    constexpr size_t kLine = 32;
#endif
    // ordinary stores up to the first aligned address, streaming stores for whole vectors
    const size_t head = std::min(bytes, (kLine - reinterpret_cast<uintptr_t>(d) % kLine) % kLine);
    std::memcpy(d, s, head);
    s += head;
    d += head;
    bytes -= head;
    for (; bytes >= kLine; bytes -= kLine, s += kLine, d += kLine) {
#if defined(CPU_CAPABILITY_AVX512)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d), _mm512_loadu_si512(s));
#else
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
#endif
    }
  }
#endif
  std::memcpy(d, s, bytes);
}

// Streaming stores are weakly ordered: fence them before the task reports completion.
inline void stream_fence() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

// Rows can be streamed straight from the compute loop (no row buffer) when the output is
// fp32/fp64 and every row starts on a vector boundary.
template <typename scalar_t>
bool can_stream_direct(bool stream, int64_t N, std::initializer_list<const void*> rows0) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  using T = acc_t<scalar_t>;
  constexpr int64_t kBytes = Vec<T>::size() * sizeof(T);
  if (!stream || !std::is_same_v<scalar_t, T> || (N * static_cast<int64_t>(sizeof(T))) % kBytes != 0) return false;
  for (const void* p : rows0) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % kBytes != 0) return false;
  }
  return true;
#else
  return false;
#endif
}

// A non-temporal store of one full vector to an aligned address (see can_stream_direct).
template <typename T>
inline void stream_vec(T* dst, const Vec<T>& v) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    _mm512_stream_ps(dst, v);
  } else {
    _mm512_stream_pd(dst, v);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    _mm256_stream_ps(dst, v);
  } else {
    _mm256_stream_pd(dst, v);
  }
#else
  v.store(dst);
#endif
}

// Shifted sums of one row in a single pass: s1 = sum(h - shift), s2 = sum((h - shift)^2).
// With kCentre false (RMSNorm) only s2 = sum(h^2) is formed.
template <typename T>
struct Moments {
  T s1, s2;
};

template <bool kCentre, typename T>
inline void accumulate(const Vec<T>& v, const Vec<T>& vs, Vec<T>& a1, Vec<T>& a2, int64_t count = Vec<T>::size()) {
  if constexpr (kCentre) {
    const Vec<T> e = count == Vec<T>::size() ? v - vs : Vec<T>::set(Vec<T>(T(0)), v - vs, count);
    a1 = a1 + e;
    a2 = at::vec::fmadd(e, e, a2);
  } else {
    a2 = at::vec::fmadd(v, v, a2);
  }
}

// Long rows are summed in two levels: the lane accumulators take kSumChunk elements (a few
// hundred terms a lane) and are then added into per-lane chunk totals and restarted, so
// a lane's rounding error grows with kSumChunk / lanes + N / kSumChunk terms instead of N /
// lanes (rows of 2^22 had 50x torch's error with one level).
constexpr int64_t kSumChunk = 8192;

// Adds the accumulators a[0..n) into total and zeroes them.
template <typename T, size_t n>
inline void flush(Vec<T>& total, Vec<T> (&a)[n]) {
  Vec<T> s = a[0];
  a[0] = Vec<T>(T(0));
  for (size_t i = 1; i < n; ++i) {
    s = s + a[i];
    a[i] = Vec<T>(T(0));
  }
  total = total + s;
}

template <bool kCentre, typename T>
Moments<T> row_moments(const T* x, int64_t n, T shift) {
  constexpr int64_t W = Vec<T>::size();
  const Vec<T> vs(shift);
  Vec<T> p[4] = {Vec<T>(T(0)), Vec<T>(T(0)), Vec<T>(T(0)), Vec<T>(T(0))};
  Vec<T> q[4] = {Vec<T>(T(0)), Vec<T>(T(0)), Vec<T>(T(0)), Vec<T>(T(0))};
  Vec<T> tp(T(0)), tq(T(0));
  int64_t k = 0;
  while (k + 4 * W <= n) {
    const int64_t stop = std::min(n, k + kSumChunk);
    for (; k + 4 * W <= stop; k += 4 * W) {
      accumulate<kCentre>(Vec<T>::loadu(x + k), vs, p[0], q[0]);
      accumulate<kCentre>(Vec<T>::loadu(x + k + W), vs, p[1], q[1]);
      accumulate<kCentre>(Vec<T>::loadu(x + k + 2 * W), vs, p[2], q[2]);
      accumulate<kCentre>(Vec<T>::loadu(x + k + 3 * W), vs, p[3], q[3]);
    }
    flush(tp, p);
    flush(tq, q);
  }
  for (; k + W <= n; k += W) accumulate<kCentre>(Vec<T>::loadu(x + k), vs, p[1], q[1]);
  // the tail goes into the lane sums too (added one by one to the total, each term would be
  // rounded to the total's ulp); the lanes past n are zeroed (h - shift = -shift there)
  if (k < n) accumulate<kCentre>(Vec<T>::loadu(x + k, n - k), vs, p[2], q[2], n - k);
  flush(tp, p);
  flush(tq, q);
  return {kCentre ? lane_sum(tp) : T(0), lane_sum(tq)};
}

// add_layer_norm's first pass: h = x + r into hbuf (and streamed to hout when given), with
// the moments of h about shift taken on the way.
template <bool kCentre, typename T>
Moments<T> add_row_moments(const T* x, const T* r, T* hbuf, T* hout, int64_t n, T shift) {
  constexpr int64_t W = Vec<T>::size();
  const Vec<T> vs(shift);
  Vec<T> p[2] = {Vec<T>(T(0)), Vec<T>(T(0))}, q[2] = {Vec<T>(T(0)), Vec<T>(T(0))};
  Vec<T> tp(T(0)), tq(T(0));
  int64_t k = 0;
  while (k + 2 * W <= n) {  // two levels, as row_moments
    const int64_t stop = std::min(n, k + kSumChunk);
    for (; k + 2 * W <= stop; k += 2 * W) {
      const Vec<T> v0 = Vec<T>::loadu(x + k) + Vec<T>::loadu(r + k);
      const Vec<T> v1 = Vec<T>::loadu(x + k + W) + Vec<T>::loadu(r + k + W);
      v0.store(hbuf + k);
      v1.store(hbuf + k + W);
      if (hout) {
        stream_vec(hout + k, v0);
        stream_vec(hout + k + W, v1);
      }
      accumulate<kCentre>(v0, vs, p[0], q[0]);
      accumulate<kCentre>(v1, vs, p[1], q[1]);
    }
    flush(tp, p);
    flush(tq, q);
  }
  for (; k + W <= n; k += W) {
    const Vec<T> v = Vec<T>::loadu(x + k) + Vec<T>::loadu(r + k);
    v.store(hbuf + k);
    if (hout) stream_vec(hout + k, v);
    accumulate<kCentre>(v, vs, p[0], q[0]);
  }
  if (k < n) {  // never when streaming (rows are a multiple of W)
    const Vec<T> v = Vec<T>::loadu(x + k, n - k) + Vec<T>::loadu(r + k, n - k);
    v.store(hbuf + k, n - k);
    accumulate<kCentre>(v, vs, p[1], q[1], n - k);
  }
  flush(tp, p);
  flush(tq, q);
  return {kCentre ? lane_sum(tp) : T(0), lane_sum(tq)};
}

// The point the moments are taken about: the mean of the row's first vector, computed as
// h[0] + mean(h[0:W] - h[0]) (differences of nearby values are exact). Any value near the
// mean keeps h - shift exact; one near the mean within a fraction of a standard deviation
// also keeps the one-pass variance below from cancelling (see row_stats).
template <typename T>
inline T first_vec_mean(const Vec<T>& v0) {
  alignas(64) T lanes[Vec<T>::size()];
  v0.store(lanes);
  return lanes[0] + lane_sum(v0 - Vec<T>(lanes[0])) / static_cast<T>(Vec<T>::size());
}

template <typename T>
inline T row_shift(const T* h, int64_t n) {
  return n >= Vec<T>::size() ? first_vec_mean(Vec<T>::loadu(h)) : h[0];
}

// The statistics of one row from its moments about shift: mean = shift + d with d = s1 / N,
// and the variance from the same single pass,
//     var = (s2 - s1 * d) / N.
// s2 / N = var + d^2, so the subtraction loses about log2(1 + d^2 / var) bits of s2; with the
// shift at the mean of W samples of the row, d^2 / var is about 1 / W (a chi-square with one
// degree of freedom over W) and the loss is a few hundredths of a bit. Past kMaxShift2 (d^2 >
// var: one bit; ~1e-4 of Gaussian rows at W = 16) the moments are taken again about the
// rounded mean shift + d, which lies within a rounding of the true mean: rows whose first
// elements are outliers, or far out in a heavy tail, or whose mean the first vector misses.
// The same happens when the sums overflow although the variance would not (|h - shift| near
// sqrt of the dtype's largest value: s2 = inf and s1 * d = inf give NaN): about the mean the
// squares are as small as they can be, so the moments stay finite wherever a two-pass
// variance does, and a variance that truly overflows gives rstd = 0, as torch's does.
constexpr int kMaxShift2 = 1;

template <typename T>
struct RowStats {
  T shift, d, var;
};

template <typename T, typename Recompute>
RowStats<T> row_stats(Moments<T> m, T shift, int64_t n, Recompute&& moments_about) {
  const T nn = static_cast<T>(n);
  T d = m.s1 / nn;
  T var = (m.s2 - m.s1 * d) / nn;
  // twice at most: the second estimate of the mean is already within rounding of the mean
  for (int it = 0; it < 2 && (d * d > T(kMaxShift2) * var || !std::isfinite(var)); ++it) {
    shift = shift + d;
    m = moments_about(shift);
    d = m.s1 / nn;
    var = (m.s2 - m.s1 * d) / nn;
  }
  // Still not finite about the mean, with every element finite (s1 finite): the squares
  // themselves overflow (s2 = inf; s1 * d may too, for inf - inf = NaN). The two-pass
  // variance is inf there as well, and rstd = 0.
  if (!std::isfinite(var) && m.s2 == std::numeric_limits<T>::infinity() && std::isfinite(m.s1)) {
    var = m.s2;
  }
  return {shift, d, std::max(var, T(0))};
}

// y = xhat * w + b with xhat = (h - shift) * rstd - d * rstd: one subtract and one FMA per
// xhat (h - shift is exact near the mean and d * rstd is a small per-row constant), one FMA
// for the affine part. RMSNorm (kCentre false): xhat = h * rstd.
template <bool kCentre, typename T>
inline void normalize_row(const T* hr, const T* w, const T* b, T* out, bool stream, int64_t n, T shift, T d, T rs) {
  constexpr int64_t W = Vec<T>::size();
  const Vec<T> vshift(shift), vrs(rs), vc(d == T(0) ? T(0) : -(d * rs));  // 0, not 0 * inf, for rstd = inf
  auto xhat = [&](const Vec<T>& h) {
    if constexpr (kCentre) {
      return at::vec::fmadd(h - vshift, vrs, vc);
    } else {
      return h * vrs;
    }
  };
  auto emit = [&](int64_t k, const Vec<T>& v) {
    if (stream) {
      stream_vec(out + k, v);
    } else {
      v.store(out + k);
    }
  };
  int64_t k = 0;
  if (w && b) {
    for (; k + W <= n; k += W) emit(k, at::vec::fmadd(xhat(Vec<T>::loadu(hr + k)), Vec<T>::loadu(w + k), Vec<T>::loadu(b + k)));
  } else if (w) {
    for (; k + W <= n; k += W) emit(k, xhat(Vec<T>::loadu(hr + k)) * Vec<T>::loadu(w + k));
  } else if (b) {
    for (; k + W <= n; k += W) emit(k, xhat(Vec<T>::loadu(hr + k)) + Vec<T>::loadu(b + k));
  } else {
    for (; k + W <= n; k += W) emit(k, xhat(Vec<T>::loadu(hr + k)));
  }
  for (; k < n; ++k) {  // never reached when streaming (n is a multiple of W)
    T v = kCentre ? std::fma(hr[k] - shift, rs, d == T(0) ? T(0) : -(d * rs)) : hr[k] * rs;
    if (w) v *= w[k];
    if (b) v += b[k];
    out[k] = v;
  }
}

// A scratch row: per thread and kept between calls for rows of up to kKeptRow elements (no
// allocation per task or per call), owned by the task for longer rows (so that one huge
// call does not pin its buffers to every thread for good).
constexpr int64_t kKeptRow = int64_t(1) << 16;

template <typename T>
class ScratchRow {
 public:
  ScratchRow(int slot, int64_t n) {
    static thread_local std::vector<T> kept[3];  // per element type
    std::vector<T>& v = n <= kKeptRow ? kept[slot] : own_;
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    data_ = v.data();
  }
  T* data() const { return data_; }

 private:
  std::vector<T> own_;
  T* data_;
};

template <bool kCentre, typename scalar_t>
void norm_fwd_rows(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w, const at::Tensor& bias,
                   double eps, at::Tensor& y, at::Tensor& h, at::Tensor& mean, at::Tensor& rstd) {
  using T = acc_t<scalar_t>;
  constexpr bool kSame = std::is_same_v<scalar_t, T>;
  constexpr int64_t W = Vec<T>::size();
  const int64_t M = x.size(0), N = x.size(1);
  const scalar_t* x_data = x.data_ptr<scalar_t>();
  const int64_t ldx = x.stride(0);
  const scalar_t* r_data = residual.defined() ? residual.data_ptr<scalar_t>() : nullptr;
  const int64_t ldr = residual.defined() ? residual.stride(0) : 0;
  scalar_t* h_data = residual.defined() ? h.data_ptr<scalar_t>() : nullptr;
  const T* w_data = w.defined() ? w.data_ptr<T>() : nullptr;
  const T* b_data = bias.defined() ? bias.data_ptr<T>() : nullptr;
  scalar_t* y_data = y.data_ptr<scalar_t>();
  T* mean_data = kCentre ? mean.data_ptr<T>() : nullptr;
  T* rstd_data = rstd.data_ptr<T>();
  const bool stream = use_streaming_stores(M * N * static_cast<int64_t>(sizeof(scalar_t)));
  const bool direct = can_stream_direct<scalar_t>(stream, N, {y_data, h_data});
  const T teps = static_cast<T>(eps);

  at::parallel_for(0, M, row_grain(N), [&](int64_t begin, int64_t end) {
    // per-thread row buffers (L1-resident): h and y are finished here, then written out once
    const ScratchRow<T> hrow(0, N), yrow(1, N);
    const ScratchRow<scalar_t> outrow(2, kSame ? 0 : N);
    T* hbuf = hrow.data();
    T* ybuf = yrow.data();
    scalar_t* out_buf = outrow.data();
    for (int64_t i = begin; i < end; ++i) {
      // the row of h in the accumulation dtype (cached for the passes below) and its moments
      const T* hr;
      T shift0 = T(0);
      Moments<T> m;
      if (r_data) {
        const scalar_t* xi = x_data + i * ldx;
        const scalar_t* ri = r_data + i * ldr;
        if constexpr (kSame) {
          if (kCentre) {
            shift0 = N >= W ? first_vec_mean(Vec<T>::loadu(xi) + Vec<T>::loadu(ri)) : T(xi[0] + ri[0]);
          }
          m = add_row_moments<kCentre>(xi, ri, hbuf, direct ? h_data + i * N : nullptr, N, shift0);
          if (!direct) write_row(hbuf, h_data + i * N, N, stream);
        } else {
          for (int64_t k = 0; k < N; ++k) {
            out_buf[k] = static_cast<scalar_t>(static_cast<T>(xi[k]) + static_cast<T>(ri[k]));  // as torch's add
            hbuf[k] = static_cast<T>(out_buf[k]);
          }
          write_row(out_buf, h_data + i * N, N, stream);
          if (kCentre) shift0 = row_shift(hbuf, N);
          m = row_moments<kCentre>(hbuf, N, shift0);
        }
        hr = hbuf;
      } else {
        if constexpr (kSame) {
          hr = x_data + i * ldx;
        } else {
          at::vec::convert(x_data + i * ldx, hbuf, N);
          hr = hbuf;
        }
        if (kCentre) shift0 = row_shift(hr, N);
        m = row_moments<kCentre>(hr, N, shift0);
      }

      T shift = T(0), d = T(0), var;
      if constexpr (kCentre) {
        const RowStats<T> s = row_stats(m, shift0, N, [&](T sh) { return row_moments<true>(hr, N, sh); });
        shift = s.shift;
        d = s.d;
        var = s.var;
        mean_data[i] = shift + d;
      } else {
        var = m.s2 / static_cast<T>(N);
      }
      const T rs = T(1) / std::sqrt(var + teps);
      rstd_data[i] = rs;
      if (kCentre && !std::isfinite(rs)) {  // eps = 0 and a variance of 0: y = (h - mean) * inf, as torch
        shift = shift + d;
        d = T(0);
      }

      if constexpr (kSame) {
        if (direct) {
          normalize_row<kCentre>(hr, w_data, b_data, y_data + i * N, true, N, shift, d, rs);
        } else {
          normalize_row<kCentre>(hr, w_data, b_data, ybuf, false, N, shift, d, rs);
          write_row(ybuf, y_data + i * N, N, stream);
        }
      } else {
        normalize_row<kCentre>(hr, w_data, b_data, ybuf, false, N, shift, d, rs);
        at::vec::convert(ybuf, out_buf, N);
        write_row(out_buf, y_data + i * N, N, stream);
      }
    }
    if (stream) stream_fence();
  });
}

template <typename scalar_t>
void norm_fwd_kernel(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w, const at::Tensor& bias,
                     double eps, bool rms, at::Tensor& y, at::Tensor& h, at::Tensor& mean, at::Tensor& rstd) {
  if (rms) {
    norm_fwd_rows<false, scalar_t>(x, residual, w, bias, eps, y, h, mean, rstd);
  } else {
    norm_fwd_rows<true, scalar_t>(x, residual, w, bias, eps, y, h, mean, rstd);
  }
}

// Rows are processed in groups of kRowGroup: pass 1 computes each row's two means, pass 2
// walks the group column-block by column-block, so the partial dw / db rows are loaded and
// stored once per group instead of once per row (they would otherwise dominate the L1 traffic).
constexpr int64_t kRowGroup = 4;

template <typename scalar_t>
void norm_bwd_kernel(const at::Tensor& dy, const at::Tensor& dh, const at::Tensor& h, const at::Tensor& w,
                     const at::Tensor& mean, const at::Tensor& rstd, bool rms, bool want_dw, bool want_db,
                     int64_t R, at::Tensor& dx, at::Tensor& dw_part, at::Tensor& db_part) {
  using T = acc_t<scalar_t>;
  constexpr int64_t W = Vec<T>::size();
  constexpr bool kSame = std::is_same_v<scalar_t, T>;
  const int64_t M = h.size(0), N = h.size(1);
  const scalar_t* dy_data = dy.data_ptr<scalar_t>();
  const int64_t lddy = dy.stride(0);
  const scalar_t* dh_data = dh.defined() ? dh.data_ptr<scalar_t>() : nullptr;
  const int64_t lddh = dh.defined() ? dh.stride(0) : 0;
  const scalar_t* h_data = h.data_ptr<scalar_t>();
  const int64_t ldh = h.stride(0);
  const T* w_data = w.defined() ? w.data_ptr<T>() : nullptr;
  const T* mean_data = rms ? nullptr : mean.data_ptr<T>();
  const T* rstd_data = rstd.data_ptr<T>();
  scalar_t* dx_data = dx.data_ptr<scalar_t>();
  const int64_t n_chunks = (M + R - 1) / R;  // R rows per chunk: the partials' rows (norm_bwd)
  T* dw_data = want_dw ? dw_part.data_ptr<T>() : nullptr;  // (n_chunks, N)
  T* db_data = want_db ? db_part.data_ptr<T>() : nullptr;
  const T inv_n = T(1) / static_cast<T>(N);
  const bool stream = use_streaming_stores(M * N * static_cast<int64_t>(sizeof(scalar_t)));
  const bool direct = can_stream_direct<scalar_t>(stream, N, {dx_data});

  at::parallel_for(0, n_chunks, 1, [&](int64_t c_begin, int64_t c_end) {
    // rows in the accumulation dtype: converted copies for fp16/bf16, else unused
    const int64_t conv = kSame ? 0 : kRowGroup * N;
    std::vector<T> hbuf(conv), dybuf(conv), dhbuf(dh_data ? conv : 0), dxbuf(kRowGroup * N);
    std::vector<scalar_t> out_buf(kSame ? 0 : N);
    for (int64_t chunk = c_begin; chunk < c_end; ++chunk) {
      T* dwp = dw_data ? dw_data + chunk * N : nullptr;
      T* dbp = db_data ? db_data + chunk * N : nullptr;
      if (dwp) std::fill(dwp, dwp + N, T(0));
      if (dbp) std::fill(dbp, dbp + N, T(0));
      const int64_t chunk_end = std::min(M, (chunk + 1) * R);
      for (int64_t i0 = chunk * R; i0 < chunk_end; i0 += kRowGroup) {
        const int64_t G = std::min(kRowGroup, chunk_end - i0);
        const T* hr[kRowGroup];
        const T* dyr[kRowGroup];
        const T* dhr[kRowGroup];
        T mu[kRowGroup], rs[kRowGroup], mean_g[kRowGroup], mean_gx[kRowGroup];

        // pass 1, per row: mean(g) and mean(g * xhat) with g = dy * w, xhat = (h - mean) * rstd.
        // LayerNorm also takes mean(xhat), 0 in exact arithmetic: the stored mean's rounding
        // error shifts every xhat by it, and dx is taken with xhat - mean(xhat) (see norm_bwd
        // in fasttrans/backends/__init__.py for the error this removes). dw keeps the shifted xhat, as
        // torch's does: there the shift is a relative error of δ·rstd with no cancellation
        // to magnify it, and leaving it out of pass 2 keeps that pass's loads as they were.
        for (int64_t r = 0; r < G; ++r) {
          const int64_t i = i0 + r;
          if constexpr (kSame) {
            hr[r] = h_data + i * ldh;
            dyr[r] = dy_data + i * lddy;
            dhr[r] = dh_data ? dh_data + i * lddh : nullptr;
          } else {
            at::vec::convert(h_data + i * ldh, hbuf.data() + r * N, N);
            at::vec::convert(dy_data + i * lddy, dybuf.data() + r * N, N);
            hr[r] = hbuf.data() + r * N;
            dyr[r] = dybuf.data() + r * N;
            dhr[r] = nullptr;
            if (dh_data) {
              at::vec::convert(dh_data + i * lddh, dhbuf.data() + r * N, N);
              dhr[r] = dhbuf.data() + r * N;
            }
          }
          mu[r] = rms ? T(0) : mean_data[i];
          rs[r] = rstd_data[i];
          // sums of g, of d = h - mean and of g * d; rstd scales the last two once at the end
          const Vec<T> vmu(mu[r]);
          Vec<T> sg[2] = {Vec<T>(T(0)), Vec<T>(T(0))}, sd[2] = {Vec<T>(T(0)), Vec<T>(T(0))};
          Vec<T> sgd[2] = {Vec<T>(T(0)), Vec<T>(T(0))};
          Vec<T> tg(T(0)), td(T(0)), tgd(T(0));
          int64_t k = 0;
          while (k + 2 * W <= N) {  // two levels, as row_moments
            const int64_t stop = std::min(N, k + kSumChunk);
            for (; k + 2 * W <= stop; k += 2 * W) {
              Vec<T> g0 = Vec<T>::loadu(dyr[r] + k), g1 = Vec<T>::loadu(dyr[r] + k + W);
              if (w_data) {
                g0 = g0 * Vec<T>::loadu(w_data + k);
                g1 = g1 * Vec<T>::loadu(w_data + k + W);
              }
              const Vec<T> d0 = Vec<T>::loadu(hr[r] + k) - vmu;
              const Vec<T> d1 = Vec<T>::loadu(hr[r] + k + W) - vmu;
              sg[0] = sg[0] + g0;
              sg[1] = sg[1] + g1;
              sd[0] = sd[0] + d0;
              sd[1] = sd[1] + d1;
              sgd[0] = at::vec::fmadd(g0, d0, sgd[0]);
              sgd[1] = at::vec::fmadd(g1, d1, sgd[1]);
            }
            flush(tg, sg);
            flush(td, sd);
            flush(tgd, sgd);
          }
          T sum_g = lane_sum(tg), sum_gd = lane_sum(tgd), sum_d = lane_sum(td);
          for (; k < N; ++k) {
            const T g = w_data ? dyr[r][k] * w_data[k] : dyr[r][k];
            const T d = hr[r][k] - mu[r];
            sum_g += g;
            sum_d += d;
            sum_gd += g * d;
          }
          // with the re-centred xhat - mean(xhat), and xhat as computed in pass 2:
          //   mean(g * (xhat - mean(xhat))) = mean(g * xhat) - mean(xhat) * mean(g)
          //   dx = rstd * (g - mean(g) - (xhat - mean(xhat)) * mean_gx)
          //      = rstd * (g - (mean(g) - mean(xhat) * mean_gx) - xhat * mean_gx)
          // so the correction folds into the per-row constant mean_g.
          const T mean_x = rms ? T(0) : sum_d * rs[r] * inv_n;
          const T mg = rms ? T(0) : sum_g * inv_n;
          mean_gx[r] = sum_gd * rs[r] * inv_n - mean_x * mg;
          mean_g[r] = mg - mean_x * mean_gx[r];
        }

        // pass 2, column block by column block over the group (rows are still in cache):
        //   dx = rstd * (g - mean_g - xhat * mean_gx) [+ dh];  dw += dy * xhat;  db += dy
        int64_t k = 0;
        for (; k + W <= N; k += W) {
          const Vec<T> wv = w_data ? Vec<T>::loadu(w_data + k) : Vec<T>(T(1));
          Vec<T> dwv = dwp ? Vec<T>::loadu(dwp + k) : Vec<T>(T(0));
          Vec<T> dbv = dbp ? Vec<T>::loadu(dbp + k) : Vec<T>(T(0));
          for (int64_t r = 0; r < G; ++r) {
            const Vec<T> dyv = Vec<T>::loadu(dyr[r] + k);
            const Vec<T> xv = (Vec<T>::loadu(hr[r] + k) - Vec<T>(mu[r])) * Vec<T>(rs[r]);
            Vec<T> v = Vec<T>(rs[r]) * (dyv * wv - Vec<T>(mean_g[r]) - xv * Vec<T>(mean_gx[r]));
            if (dhr[r]) v = v + Vec<T>::loadu(dhr[r] + k);
            if (direct) {
              stream_vec(reinterpret_cast<T*>(dx_data + (i0 + r) * N) + k, v);
            } else {
              v.store(dxbuf.data() + r * N + k);
            }
            dwv = at::vec::fmadd(dyv, xv, dwv);
            dbv = dbv + dyv;
          }
          if (dwp) dwv.store(dwp + k);
          if (dbp) dbv.store(dbp + k);
        }
        for (; k < N; ++k) {  // never reached when direct (N is a multiple of W)
          for (int64_t r = 0; r < G; ++r) {
            const T dyk = dyr[r][k];
            const T xh = (hr[r][k] - mu[r]) * rs[r];
            const T g = w_data ? dyk * w_data[k] : dyk;
            T v = rs[r] * (g - mean_g[r] - xh * mean_gx[r]);
            if (dhr[r]) v += dhr[r][k];
            dxbuf[r * N + k] = v;
            if (dwp) dwp[k] += dyk * xh;
            if (dbp) dbp[k] += dyk;
          }
        }
        if (!direct) {
          for (int64_t r = 0; r < G; ++r) {
            if constexpr (kSame) {
              write_row(dxbuf.data() + r * N, dx_data + (i0 + r) * N, N, stream);
            } else {
              at::vec::convert(dxbuf.data() + r * N, out_buf.data(), N);
              write_row(out_buf.data(), dx_data + (i0 + r) * N, N, stream);
            }
          }
        }
      }
    }
    if (stream) stream_fence();
  });
}

// out[k] = sum over chunks c (in order) of part[c, k]
template <typename T>
at::Tensor reduce_partials(const at::Tensor& part, at::ScalarType out_dtype) {
  const int64_t n_chunks = part.size(0), N = part.size(1);
  at::Tensor sum = cpu::empty({N}, part.options());
  const T* p = part.data_ptr<T>();
  T* s = sum.data_ptr<T>();
  at::parallel_for(0, N, 1024, [&](int64_t begin, int64_t end) {
    std::fill(s + begin, s + end, T(0));
    for (int64_t c = 0; c < n_chunks; ++c) {
      for (int64_t k = begin; k < end; ++k) s[k] += p[c * N + k];
    }
  });
  return sum.to(out_dtype);
}

void check_rows(const char* name, const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK(t.sizes() == x.sizes(), name, ": expected the shape of x ", x.sizes(), ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), name, ": expected the dtype of x (", x.scalar_type(), "), got ",
              t.scalar_type());
}

// Rows with unit inner stride (any row stride); anything else gets a contiguous copy.
at::Tensor unit_inner(const at::Tensor& t) {
  return t.stride(1) == 1 || t.size(1) == 1 ? t : t.contiguous();
}

// weight / bias as contiguous (N,) vectors in the accumulation dtype, or undefined.
at::Tensor param_as(const std::optional<at::Tensor>& p, const char* name, int64_t N, at::ScalarType acc) {
  if (!p.has_value() || !p->defined()) return at::Tensor();
  checks::param_numel(p, name, N);
  // the usual case, already a contiguous (N,) vector in acc, without the three no-op calls
  // (about a microsecond: a norm over one short row costs a few)
  if (p->dim() == 1 && p->scalar_type() == acc && p->is_contiguous()) return *p;
  return p->reshape({N}).to(acc).contiguous();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_fwd(const at::Tensor& x_in,
                                                                    const std::optional<at::Tensor>& residual_in,
                                                                    const std::optional<at::Tensor>& weight,
                                                                    const std::optional<at::Tensor>& bias, double eps,
                                                                    bool rms) {
  TORCH_CHECK(x_in.dim() == 2, "x: expected a 2-D (M, N) tensor, got shape ", x_in.sizes());
  TORCH_CHECK(at::isFloatingType(x_in.scalar_type()), "x: expected a floating-point dtype, got ", x_in.scalar_type());
  const at::Tensor x = unit_inner(x_in);
  const int64_t M = x.size(0), N = x.size(1);
  const at::ScalarType acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor residual;
  if (residual_in.has_value() && residual_in->defined()) {
    check_rows("residual", *residual_in, x);
    residual = unit_inner(*residual_in);
  }
  const at::Tensor w = param_as(weight, "weight", N, acc);
  const at::Tensor b = rms ? at::Tensor() : param_as(bias, "bias", N, acc);

  at::Tensor y = cpu::empty({M, N}, x.options());
  at::Tensor h = residual.defined() ? cpu::empty({M, N}, x.options()) : cpu::empty({0}, x.options());
  at::Tensor mean = cpu::empty({rms ? 0 : M}, x.options().dtype(acc));
  at::Tensor rstd = cpu::empty({M}, x.options().dtype(acc));
  if (M == 0 || N == 0) return {y, h, mean, rstd};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "norm_fwd_extension", [&] {
    norm_fwd_kernel<scalar_t>(x, residual, w, b, eps, rms, y, h, mean, rstd);
  });
  return {y, h, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_bwd(const at::Tensor& dy_in, const std::optional<at::Tensor>& dh_in,
                                                        const at::Tensor& h_in, const std::optional<at::Tensor>& weight,
                                                        const std::optional<at::Tensor>& bias, const at::Tensor& mean,
                                                        const at::Tensor& rstd, bool rms) {
  TORCH_CHECK(h_in.dim() == 2, "h: expected a 2-D (M, N) tensor, got shape ", h_in.sizes());
  checks::floating(h_in, "h");
  const at::Tensor h = unit_inner(h_in);
  const int64_t M = h.size(0), N = h.size(1);
  const at::ScalarType acc = h.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  check_rows("dy", dy_in, h);
  const at::Tensor dy = unit_inner(dy_in);
  at::Tensor dh;
  if (dh_in.has_value() && dh_in->defined() && dh_in->numel() > 0) {
    check_rows("dh", *dh_in, h);
    dh = unit_inner(*dh_in);
  }
  // RMSNorm has no mean: it arrives as an empty (0,) tensor (or anything, ignored)
  at::Tensor mean_c;
  if (!rms) {
    TORCH_CHECK(mean.numel() == M, "mean: expected ", M, " elements (one per row), got shape ", mean.sizes());
    mean_c = mean.to(acc).contiguous();
  }
  TORCH_CHECK(rstd.numel() == M, "rstd: expected ", M, " elements (one per row), got shape ", rstd.sizes());
  const at::Tensor rstd_c = rstd.to(acc).contiguous();
  const at::Tensor w = param_as(weight, "weight", N, acc);
  const bool want_dw = w.defined();
  checks::param_numel(bias, "bias", N);
  const bool want_db = bias.has_value() && bias->defined();

  at::Tensor dx = cpu::empty({M, N}, h.options());
  const int64_t R = rows_per_chunk(M, N);
  const int64_t n_chunks = (M + R - 1) / R;
  at::Tensor dw_part = cpu::empty({want_dw ? n_chunks : 0, N}, h.options().dtype(acc));
  at::Tensor db_part = cpu::empty({want_db ? n_chunks : 0, N}, h.options().dtype(acc));
  if (M > 0 && N > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "norm_bwd_extension", [&] {
      norm_bwd_kernel<scalar_t>(dy, dh, h, w, mean_c, rstd_c, rms, want_dw, want_db, R, dx, dw_part, db_part);
    });
  } else {
    dw_part.zero_();
    db_part.zero_();
  }
  at::Tensor dw = cpu::empty({0}, h.options());
  at::Tensor db = cpu::empty({0}, h.options());
  AT_DISPATCH_FLOATING_TYPES(acc, "norm_bwd_extension_reduce", [&] {
    if (want_dw) dw = reduce_partials<scalar_t>(dw_part, weight->scalar_type()).view(weight->sizes());
    if (want_db) db = reduce_partials<scalar_t>(db_part, bias->scalar_type()).view(bias->sizes());
  });
  return {dx, dw, db};
}

}  // namespace fasttrans::cpu
