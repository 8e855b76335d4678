// The CUDA norm kernels and launchers (csrc/layernorm_cuda.cu): LayerNorm, add + LayerNorm and
// RMSNorm, forward, backward and the dW/dB reduction, in fp32, bf16 and fp16, on the host emulation
// of shim.h, against a double-precision reference computed from the same rounded inputs.
// Exits non-zero if any configuration is wrong.
#include "shim.h"
#include "layernorm_cuda.h"
#include <random>
#include <string>
using namespace fasttrans::cuda_kernels;

template <typename T> constexpr DType kDType = DType::kFloat32;
template <> constexpr DType kDType<__nv_bfloat16> = DType::kBFloat16;
template <> constexpr DType kDType<__half> = DType::kFloat16;
template <typename T> const char* kName = "fp32";
template <> const char* kName<__nv_bfloat16> = "bf16";
template <> const char* kName<__half> = "fp16";
// Largest error |got - want| / (1 + |want|) allowed: for bf16 (8 bits) and fp16 (11 bits)
// the outputs' own rounding dominates (measured up to 3e-3 and 4e-4), hence about 3x that.
template <typename T> constexpr double kTol = 1e-4;
template <> constexpr double kTol<__nv_bfloat16> = 8e-3;
template <> constexpr double kTol<__half> = 1e-3;

struct Case {
  int M, N;
  bool res, rms, hasw, hasb;
  int grid;  // blocks of the forward: M runs norm_fwd_cuda; fewer runs the kernel on that grid,
            // so its loop over the rows beyond the grid (M > 2^31 on a GPU) runs too
  unsigned seed;
  float spread = 1.0f;  // rows are 3 + spread * N(0, 1)
  double tol = 0;       // 0: kTol<T>
};

template <typename T>
int check(const Case& c) {
  const int M = c.M, N = c.N, ldx = N + 5;  // x and the residual have a row stride > N
  std::mt19937 rng(c.seed);
  std::normal_distribution<float> nd;
  auto rows = [&](size_t n, float offset, float scale) {
    std::vector<T> v(n);
    for (auto& t : v) t = from_float<T>(offset + scale * nd(rng));
    return v;
  };
  const std::vector<T> x = rows((size_t)M * ldx, 3.0f, c.spread), r = rows((size_t)M * ldx, 0.0f, 1.0f);
  const std::vector<T> dy = rows((size_t)M * N, 0.0f, 1.0f), dh = rows((size_t)M * N, 0.0f, 1.0f);
  std::vector<float> w(N), b(N);
  for (auto& t : w) t = nd(rng);
  for (auto& t : b) t = nd(rng);

  NormArgs a{};
  a.M = M; a.N = N; a.dtype = kDType<T>; a.x = x.data(); a.ldx = ldx;
  a.residual = c.res ? r.data() : nullptr; a.ldr = ldx;
  a.weight = c.hasw ? w.data() : nullptr; a.bias = (c.hasb && !c.rms) ? b.data() : nullptr;
  a.eps = 1e-5f; a.rms = c.rms;
  const T nan_t = from_float<T>(NAN);
  std::vector<T> y((size_t)M * N, nan_t), h((size_t)M * N, nan_t), dx((size_t)M * N, nan_t);
  std::vector<float> mean(M, NAN), rstd(M, NAN);
  const char* err = nullptr;
  if (c.grid >= M) {
    err = norm_fwd_cuda(a, y.data(), c.res ? h.data() : nullptr, c.rms ? nullptr : mean.data(), rstd.data(), nullptr);
  } else {
    launch(dim3(c.grid), kThreads, 0, [&] {
      norm_fwd_kernel<T>(a, y.data(), c.res ? h.data() : nullptr, c.rms ? nullptr : mean.data(), rstd.data());
    });
  }
  const int64_t chunks = norm_bwd_chunks(M);
  std::vector<float> dwp(chunks * N, NAN), dbp(chunks * N, NAN), dw(N, NAN), db(N, NAN);
  if (!err) {
    err = norm_bwd_cuda(M, N, kDType<T>, dy.data(), c.res ? dh.data() : nullptr, c.res ? h.data() : x.data(),
                        c.res ? N : ldx, c.hasw ? w.data() : nullptr, c.rms ? nullptr : mean.data(), rstd.data(), c.rms,
                        dx.data(), c.hasw ? dwp.data() : nullptr, c.hasb ? dbp.data() : nullptr,
                        c.hasw ? dw.data() : nullptr, c.hasb ? db.data() : nullptr, nullptr);
  }
  if (err) {
    printf("launcher error: %s\n", err);
    return 1;
  }

  // reference, in double from the rounded inputs (h = x + r rounded to T, as torch's add)
  double worst = 0;
  std::string what = "-";
  auto upd = [&](double got, double want, const char* name) {
    const double e = std::fabs(got - want) / (1 + std::fabs(want));
    if (!(e <= worst)) { worst = e; what = name; }  // NaN counts as worst
  };
  std::vector<double> rdw(N, 0), rdb(N, 0);
  for (int i = 0; i < M; ++i) {
    std::vector<double> hv(N), xh(N), g(N);
    double mu = 0, var = 0, mg = 0, mgx = 0;
    for (int k = 0; k < N; ++k) {
      const size_t at = (size_t)i * ldx + k;
      hv[k] = c.res ? to_float(from_float<T>(to_float(x[at]) + to_float(r[at]))) : to_float(x[at]);
      mu += hv[k];
    }
    mu = c.rms ? 0.0 : mu / N;
    for (int k = 0; k < N; ++k) var += (hv[k] - mu) * (hv[k] - mu);
    const double rs = 1 / std::sqrt(var / N + 1e-5);
    for (int k = 0; k < N; ++k) {
      const size_t at = (size_t)i * N + k;
      xh[k] = (hv[k] - mu) * rs;
      upd(to_float(y[at]), xh[k] * (c.hasw ? w[k] : 1) + ((c.hasb && !c.rms) ? b[k] : 0), "y");
      if (c.res) upd(to_float(h[at]), hv[k], "h");
      const double dyk = to_float(dy[at]);
      g[k] = dyk * (c.hasw ? w[k] : 1);
      mg += g[k];
      mgx += g[k] * xh[k];
      rdw[k] += dyk * xh[k];
      rdb[k] += dyk;
    }
    mg = c.rms ? 0.0 : mg / N;
    mgx /= N;
    if (!c.rms) upd(mean[i], mu, "mean");
    upd(rstd[i] / rs, 1.0, "rstd");
    for (int k = 0; k < N; ++k) {
      const size_t at = (size_t)i * N + k;
      upd(to_float(dx[at]), rs * (g[k] - mg - xh[k] * mgx) + (c.res ? to_float(dh[at]) : 0.0), "dx");
    }
  }
  for (int k = 0; k < N; ++k) {
    if (c.hasw) upd(dw[k], rdw[k], "dw");
    if (c.hasb) upd(db[k], rdb[k], "db");
  }
  const bool bad = !(worst <= (c.tol > 0 ? c.tol : kTol<T>));
  printf("%s %s M%d N%d res%d rms%d w%d b%d grid%d spread %g: worst %.2g (%s)\n", bad ? "BAD" : "ok ", kName<T>, M, N,
         c.res, c.rms, c.hasw, c.hasb, c.grid, c.spread, worst, what.c_str());
  return bad;
}

int main() {
  const Case cases[] = {
      {7, 1, false, false, true, true, 7, 1},      {7, 300, true, false, true, true, 3, 2},
      {40, 700, false, true, true, false, 40, 3},  {33, 257, true, false, false, true, 5, 4},
      {17, 64, false, false, true, true, 17, 5},   {3, 1000, true, true, false, false, 1, 6},
  };
  int bad = 0;
  for (const Case& c : cases) bad += check<float>(c) + check<__nv_bfloat16>(c) + check<__half>(c);
  // rows whose spread is small against their mean (var about 0.005 to 0.1 eps), where dx
  // nearly cancels: without the backward's re-centred xhat, dx and dw were off by up to 7e-4
  bad += check<float>({64, 2, false, false, true, true, 8, 7, 3e-4f, 2e-5});
  bad += check<float>({64, 3, true, false, true, true, 8, 8, 1e-3f, 2e-5});
  bad += check<float>({64, 33, false, false, true, true, 8, 9, 1e-3f, 2e-5});
  // rows near the top of fp32's range: squared deviations from the first element sum past
  // 3.4e38 while N * var (about 1e38 here) does not, so the variance must stay finite
  bad += check<float>({16, 12, false, false, true, true, 16, 10, 2.9e18f});
  bad += check<float>({16, 12, true, false, true, true, 16, 11, 2.9e18f});
  printf("%d bad\n", bad);
  return bad != 0;
}
