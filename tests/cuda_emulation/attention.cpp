// The CUDA attention kernels and launchers (csrc/attention_cuda.cu), forward and backward, on the host
// emulation of shim.h, against a double-precision reference computed step by step as
// fasttrans.reference.attention and its autograd do: every mask kind and combination,
// broadcast and transposed masks, GQA, odd head dims up to 256, empty rows, no keys, no
// query rows, dropout (the shared Philox mask), NaN rows and NaN keys at hidden positions.
// Prints one line per configuration; exits non-zero if any is wrong.
#include "shim.h"
#include "attention_cuda.h"
#include <random>
#include <limits>
using namespace fasttrans::cuda_kernels;
using fasttrans::attention_dropout_keep;


// nan: 0 none; 1 NaN in q row (0, H-1, Lq/2) (and (B-1, 0, 0)); 2 NaN in float-mask elements
// (one visible, one hidden by causality / key_lengths if any), and a float-mask row of -inf
// with a NaN key the row sees; 3 NaN keys at hidden positions only (bool-masked column 5,
// past key_lengths, above the causal diagonal); 4 (no NaN) rows of huge scores, float mask only.
// cap > 0: scaled scores soft-capped, cap tanh(s / cap), before the masks.
struct Cfg { int B, H, Hkv, Lq, Lk, D; int mask; /*0 none 1 bool 2 float*/ int mbcast; bool kl; bool causal; long off; double p; int nan = 0; DType dtype = DType::kFloat32; float cap = 0.0f; };

// q, k, v, dout and the outputs in the kernels' dtype. The harness keeps every value as a
// float: inputs are rounded to the dtype in place (so the double reference sees exactly
// what the kernels read), 16-bit copies go to the kernels, and outputs come back as floats.
float round_to(float x, DType t) {
  if (t == DType::kBFloat16) return __bfloat162float(__float2bfloat16_rn(x));
  if (t == DType::kFloat16) return __half2float(__float2half_rn(x));
  return x;
}
struct Stored {
  std::vector<float>& f;
  DType t;
  std::vector<uint16_t> bits;
  Stored(std::vector<float>& values, DType dtype, bool input) : f(values), t(dtype) {
    if (t == DType::kFloat32) return;
    bits.resize(f.size());
    for (size_t i = 0; i < f.size(); ++i) {
      if (input) f[i] = round_to(f[i], t);
      if (t == DType::kBFloat16) bits[i] = __float2bfloat16_rn(f[i]).x; else bits[i] = __float2half_rn(f[i]).x;
    }
  }
  void* data() { return t == DType::kFloat32 ? static_cast<void*>(f.data()) : static_cast<void*>(bits.data()); }
  void to_floats() {  // outputs: the kernels' values, as floats
    for (size_t i = 0; i < bits.size(); ++i) f[i] = t == DType::kBFloat16 ? __bfloat162float(__nv_bfloat16{bits[i]}) : __half2float(__half{bits[i]});
  }
};

// The forward and backward launchers of csrc/cuda_launchers.h, as the extension's binding
// calls them (grids, shared-memory sizes and opt-ins are theirs).
void run_launchers(const AttentionArgs& a, void* out, float* lse, const void* dout, float* stats, void* dq, void* dk,
                   void* dv, float* dmask) {
  const char* e = attention_fwd_cuda(a, out, lse, nullptr);
  if (!e) e = attention_bwd_cuda(a, dout, out, lse, stats, dq, dk, dv, dmask, nullptr);
  if (e) {
    printf("launcher error: %s\n", e);
    std::exit(1);
  }
}

static double nan_max_d(double a, double b) { return (a >= b || std::isnan(a)) ? a : b; }

int check(const Cfg& c, uint64_t seed_) {
  std::mt19937 rng(seed_);
  std::normal_distribution<float> nd;
  const int B = c.B, H = c.H, Hkv = c.Hkv, Lq = c.Lq, Lk = c.Lk, D = c.D, G = H / Hkv;
  // q stored (B, Lq, H, D+3): stride(-1)=1, others non-standard; k,v stored (B, Hkv, Lk, D) padded row D+1
  const int64_t q_sd = D + 3; std::vector<float> q(std::max<size_t>((size_t)B * Lq * H * q_sd, 1));
  for (auto& x : q) x = nd(rng);
  const int64_t q_sb = (int64_t)Lq * H * q_sd, q_sh = q_sd, q_si = (int64_t)H * q_sd;
  const int64_t k_si = D + 1; std::vector<float> k(std::max<size_t>((size_t)B * Hkv * Lk * k_si, 1)), v(k.size());
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  const int64_t k_sh = Lk * k_si, k_sb = Hkv * k_sh;
  // mask
  std::vector<float> fm; std::vector<uint8_t> bm; int64_t m_sb = 0, m_sh = 0, m_si = 0, m_sj = 0;
  // mbcast: 0 full (B,H,Lq,Lk); 1 (Lq,Lk); 2 (B,1,1,Lk); 3 full but transposed (j stride Lq)
  int64_t mn = c.mbcast == 1 ? (int64_t)Lq * Lk : c.mbcast == 2 ? (int64_t)B * Lk : (int64_t)B * H * Lq * Lk;
  if (c.mbcast == 0) { m_sj = 1; m_si = Lk; m_sh = (int64_t)Lq * Lk; m_sb = (int64_t)H * Lq * Lk; }
  if (c.mbcast == 1) { m_sj = 1; m_si = Lk; }
  if (c.mbcast == 2) { m_sj = 1; m_sb = Lk; }
  if (c.mbcast == 3) { m_si = 1; m_sj = Lq; m_sh = (int64_t)Lq * Lk; m_sb = (int64_t)H * Lq * Lk; }
  auto moff = [&](int64_t b, int64_t h, int64_t i, int64_t j) { return b * m_sb + h * m_sh + i * m_si + j * m_sj; };
  std::uniform_real_distribution<float> ud;
  if (c.mask == 1) { bm.resize(std::max<int64_t>(mn, 1)); for (auto& x : bm) x = ud(rng) < 0.7f; }
  if (c.mask == 2) { fm.resize(std::max<int64_t>(mn, 1)); for (auto& x : fm) { float u = ud(rng); x = u < 0.2f ? -INFINITY : nd(rng); } }
  std::vector<int32_t> kl(std::max(B, 1));
  for (auto& x : kl) x = std::uniform_int_distribution<int>(0, Lk)(rng);
  if (B > 1 && c.kl) kl[0] = Lk;
  auto kvlen = [&](int b) { return c.kl ? kl[b] : Lk; };
  const float scale = 1.0f / std::sqrt((float)D) * 1.3f;
  const uint64_t seed = 0x123456789abcULL + seed_;
  const double p = c.p;
  AttentionArgs a{};
  a.B = B; a.H = H; a.Hkv = Hkv; a.Lq = Lq; a.Lk = Lk; a.D = D; a.dtype = DType::kFloat32;
  a.dtype = c.dtype;
  a.q_sb = q_sb; a.q_sh = q_sh; a.q_si = q_si;
  a.k_sb = k_sb; a.k_sh = k_sh; a.k_si = k_si;
  a.v_sb = k_sb; a.v_sh = k_sh; a.v_si = k_si;
  a.mask = c.mask == 1 ? (const void*)bm.data() : c.mask == 2 ? (const void*)fm.data() : nullptr;
  a.mask_type = c.mask == 1 ? MaskType::kBool : c.mask == 2 ? MaskType::kFloat32 : MaskType::kNone;
  a.m_sb = m_sb; a.m_sh = m_sh; a.m_si = m_si; a.m_sj = m_sj;
  a.key_lengths = c.kl ? kl.data() : nullptr;
  a.causal = c.causal; a.causal_offset = std::clamp<int64_t>(c.off, -(Lq + 1), Lk + 1);
  a.scale = scale; a.dropout = p > 0; a.seed = seed; a.dropout_threshold = fasttrans::attention_dropout_threshold(p);
  a.dropout_scale = p > 0 ? (float)(1.0 / (1.0 - p)) : 1.0f;
  a.softcap = c.cap;
  auto allowed_ref = [&](int b, int h, int i, int j) {
    bool ok = (!c.kl || j < kl[b]) && (!c.causal || j <= i + c.off);
    if (c.mask == 1 && !bm[moff(b, h, i, j)]) ok = false;
    return ok;
  };

  // ---- NaN injection
  auto K = [&](int b, int hk, int j, int d) -> float& { return k[b * k_sb + hk * k_sh + j * k_si + d]; };
  if (c.nan == 1) {
    q[0 * q_sb + (H - 1) * q_sh + (Lq / 2) * q_si + 0] = NAN;
    q[(B - 1) * q_sb + 0 * q_sh + 0 * q_si + D - 1] = NAN;
  }
  if (c.nan == 2) {
    // (a) one visible element; (b) one hidden by causality or key_lengths (stays hidden)
    for (int t = 0; t < 40; ++t) {
      int b = rng() % B, h = rng() % H, i = rng() % Lq, j = rng() % Lk;
      if (allowed_ref(b, h, i, j)) { fm[moff(b, h, i, j)] = NAN; break; }
    }
    for (int t = 0; t < 400; ++t) {
      int b = rng() % B, h = rng() % H, i = rng() % Lq, j = rng() % Lk;
      if (!allowed_ref(b, h, i, j)) { fm[moff(b, h, i, j)] = NAN; break; }
    }
    // (c) row (B-1, *, Lq-1) all -inf in the float mask, and a NaN key it sees: NaN + -inf = NaN
    for (int h = 0; h < H; ++h) for (int j = 0; j < Lk; ++j) fm[moff(B - 1, h, Lq - 1, j)] = -INFINITY;
    for (int j = 0; j < Lk; ++j) if (allowed_ref(B - 1, 0, Lq - 1, j)) { K(B - 1, 0, j, D / 2) = NAN; break; }
  }
  if (c.nan == 3) {
    if (c.mask == 1 && Lk > 5) {  // column 5 hidden from every row: NaN keys there
      for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) for (int i = 0; i < Lq; ++i) bm[moff(b, h, i, 5)] = 0;
      for (int b = 0; b < B; ++b) for (int hk = 0; hk < Hkv; ++hk) for (int d = 0; d < D; ++d) K(b, hk, 5, d) = NAN;
    }
    if (c.kl) for (int b = 0; b < B; ++b) for (int hk = 0; hk < Hkv; ++hk) for (int j = kl[b]; j < Lk; ++j) K(b, hk, j, 0) = NAN;
    if (c.causal) for (int j = std::max<long>(0, Lq + c.off); j < Lk; ++j) for (int b = 0; b < B; ++b) for (int hk = 0; hk < Hkv; ++hk) K(b, hk, j, D - 1) = NAN;
  }

  if (c.nan == 4) {
    // rows of huge scores: every key through the same finite mask value, -1e9 (rows 3n) or
    // -1e4 (rows 3n + 2), with q = 0 so that float32 holds each score exactly; P is uniform
    for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) for (int i = 0; i < Lq; ++i) {
      if (i % 3 == 1) continue;
      for (int j = 0; j < Lk; ++j) fm[moff(b, h, i, j)] = i % 3 == 0 ? -1e9f : -1e4f;
      for (int d = 0; d < D; ++d) q[b * q_sb + h * q_sh + i * q_si + d] = 0.0f;
    }
  }

  std::vector<float> dout(std::max<size_t>((size_t)B * H * Lq * D, 1)); for (auto& x : dout) x = nd(rng);
  Stored q_s(q, c.dtype, true), k_s(k, c.dtype, true), v_s(v, c.dtype, true), dout_s(dout, c.dtype, true);
  a.q = q_s.data(); a.k = k_s.data(); a.v = v_s.data();
  std::vector<float> out(dout.size(), NAN), lse(std::max<size_t>((size_t)B * H * Lq, 1), NAN), stats(3 * lse.size(), NAN), dq(dout.size(), NAN);
  std::vector<float> dk(std::max<size_t>((size_t)B * Hkv * Lk * D, 1), NAN), dv(dk.size(), NAN);
  std::vector<float> dmask(std::max<size_t>((size_t)B * H * Lq * Lk, 1), 0.0f);
  bool want_dmask = c.mask == 2;
  Stored out_s(out, c.dtype, false), dq_s(dq, c.dtype, false), dk_s(dk, c.dtype, false), dv_s(dv, c.dtype, false);
  float* dm = want_dmask ? dmask.data() : nullptr;
  run_launchers(a, out_s.data(), lse.data(), dout_s.data(), stats.data(), dq_s.data(), dk_s.data(), dv_s.data(), dm);
  for (Stored* o : {&out_s, &dq_s, &dk_s, &dv_s}) if (c.dtype != DType::kFloat32) o->to_floats();

  // ---- reference in double: fasttrans.reference.attention_with_lse and its autograd, step by step
  // (s = scale q.k, capped to cap tanh(s / cap) with a cap, + float mask; masked_fill(~allowed, -inf); softmax
  // with empty rows 0; P * keep / (1-p) @ v; the gradient of the scaled scores is dS (1 - tanh^2)).
  // visited = true restricts every sum to the (i, j) pairs the kernels visit: keys j < the query block's
  // kv_end for out/dQ; query rows from the key block's i_begin, and no rows for key blocks past key_lengths,
  // for dK/dV. Outside them the exact contributions are 0, but the reference's dense matmuls can make
  // 0 * NaN there.
  const size_t nrow = (size_t)B * H * Lq;
  struct Ref { std::vector<double> out, lse, dq, dk, dv, dm; };
  auto reference = [&](bool visited) {
    Ref R;
    R.out.assign((size_t)nrow * D, 0); R.lse.assign(nrow, 0); R.dq.assign(nrow * D, 0);
    R.dk.assign((size_t)B * Hkv * Lk * D, 0); R.dv.assign(R.dk.size(), 0); R.dm.assign(nrow * Lk, 0);
    for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) {
      int hk = h / G;
      for (int i = 0; i < Lq; ++i) {
        std::vector<double> s2(Lk, -INFINITY), P(Lk, 0), Pd(Lk, 0), dS(Lk, 0), f(Lk, 1), g(Lk, 1);
        std::vector<char> al(Lk);
        double mx = -INFINITY;
        for (int j = 0; j < Lk; ++j) {
          double acc = 0;
          for (int d = 0; d < D; ++d) acc += (double)q[b * q_sb + h * q_sh + i * q_si + d] * K(b, hk, j, d);
          double s1 = acc * scale;
          if (c.cap > 0) {
            const double th = std::tanh(s1 / c.cap);
            s1 = c.cap * th;
            // the cap's derivative multiplies dS = 0 at hidden entries too (NaN where the score is NaN), but
            // keys past key_lengths are never read: the kernels take them as zeros there
            double acc0 = 0;
            for (int d = 0; d < D; ++d) acc0 += (double)q[b * q_sb + h * q_sh + i * q_si + d] * 0.0;
            const double tg = c.kl && j >= kl[b] ? std::tanh(acc0 * scale / c.cap) : th;
            g[j] = 1.0 - tg * tg;
          }
          s1 += c.mask == 2 ? (double)fm[moff(b, h, i, j)] : 0.0;
          al[j] = allowed_ref(b, h, i, j);
          s2[j] = al[j] ? s1 : -INFINITY;
          mx = nan_max_d(mx, s2[j]);
        }
        const bool empty = mx == -INFINITY;
        double l = 0;
        for (int j = 0; j < Lk; ++j) { P[j] = std::exp(s2[j] - (empty ? 0.0 : mx)); l += P[j]; }
        for (int j = 0; j < Lk; ++j) {
          P[j] = empty ? 0.0 : P[j] / l;
          f[j] = p > 0 ? (attention_dropout_keep(seed, a.dropout_threshold, b, h, i, j) ? 1.0 / (1.0 - p) : 0.0) : 1.0;
          Pd[j] = P[j] * f[j];
        }
        const size_t row = ((size_t)b * H + h) * Lq + i;
        R.lse[row] = empty ? INFINITY : mx + std::log(l);  // NaN rows: NaN
        const int64_t i0 = i / kBlockRows * kBlockRows, rows = std::min<int64_t>(kBlockRows, Lq - i0);
        int64_t kvq = kvlen(b);
        if (c.causal) kvq = std::clamp<int64_t>(i0 + rows + a.causal_offset, 0, kvq);
        const int64_t jend = visited ? kvq : Lk;
        for (int d = 0; d < D; ++d) { double o = 0; for (int j = 0; j < jend; ++j) o += Pd[j] * v[b * k_sb + hk * k_sh + j * k_si + d]; R.out[row * D + d] = o; }
        // delta from the output as stored (rounded to the dtype), as the kernels and torch take it
        double dl = 0; for (int d = 0; d < D; ++d) dl += (double)dout[row * D + d] * round_to((float)R.out[row * D + d], c.dtype);
        for (int j = 0; j < Lk; ++j) {
          double dp = 0; for (int d = 0; d < D; ++d) dp += (double)dout[row * D + d] * v[b * k_sb + hk * k_sh + j * k_si + d];
          const double ds2 = empty ? 0.0 : P[j] * (dp * f[j] - dl);
          dS[j] = al[j] ? ds2 : 0.0;  // masked_fill passes no gradient to hidden entries
          R.dm[row * Lk + j] = dS[j];
        }
        for (int j = 0; j < jend; ++j)
          for (int d = 0; d < D; ++d) R.dq[row * D + d] += scale * dS[j] * g[j] * K(b, hk, j, d);
        for (int j = 0; j < Lk; ++j) {
          if (visited) {
            const int64_t j0 = j / kBlockRows * kBlockRows;
            int64_t ib = c.causal ? std::clamp<int64_t>(j0 - a.causal_offset, 0, Lq) : 0;
            if (j0 >= kvlen(b)) ib = Lq;
            if (i < ib) continue;
          }
          for (int d = 0; d < D; ++d) {
            size_t kr = (((size_t)b * Hkv + hk) * Lk + j) * D + d;
            R.dk[kr] += scale * dS[j] * g[j] * q[b * q_sb + h * q_sh + i * q_si + d];
            R.dv[kr] += Pd[j] * dout[row * D + d];
          }
        }
      }
    }
    return R;
  };
  const Ref R = reference(true), Rd = reference(false);

  // NaN patterns must be equal; elsewhere rel. error < 2e-4 (inf must match exactly)
  char info[2048] = "";
  auto cmp = [&](const char* name, const float* x, const std::vector<double>& r, const std::vector<double>& rd, size_t n) {
    double worst = 0; size_t wi = 0, nan_bad = 0, nan_first = 0, nans = 0, dense_diff = 0;
    for (size_t t = 0; t < n; ++t) {
      const bool xn = std::isnan(x[t]), rn = std::isnan(r[t]);
      nans += xn;
      dense_diff += xn != (bool)std::isnan(rd[t]);
      if (xn != rn) { if (!nan_bad++) nan_first = t; continue; }
      if (xn) continue;
      double e;
      if (std::isinf(r[t]) && x[t] == r[t]) e = 0; else if (std::isinf(x[t])) e = INFINITY; else e = std::fabs(x[t] - r[t]) / (1 + std::fabs(r[t]));
      if (!(e <= worst)) { worst = e; wi = t; }
    }
    if (c.nan) snprintf(info + strlen(info), sizeof(info) - strlen(info), "    %-5s NaN %5zu/%-6zu (NaN pattern differs from the dense reference at %zu)\n", name, nans, n, dense_diff);
    int bad = 0;
    if (nan_bad) { printf("  FAIL %s NaN pattern differs at %zu elements, first %zu (got %g want %g)\n", name, nan_bad, nan_first, x[nan_first], r[nan_first]); bad = 1; }
    // fp32: kernel arithmetic only; bf16/fp16: about 3x the outputs' own rounding, which
    // reaches 2.7e-3 (bf16) and 3.8e-4 (fp16) in this metric
    const double tol = c.dtype == DType::kBFloat16 ? 8e-3 : c.dtype == DType::kFloat16 ? 1e-3 : 2e-4;
    if (worst > tol) { printf("  FAIL %s worst %.3g at %zu (got %g want %g)\n", name, worst, wi, x[wi], r[wi]); bad = 1; }
    return bad;
  };
  int bad = 0;
  bad += cmp("out", out.data(), R.out, Rd.out, nrow * D);
  bad += cmp("lse", lse.data(), R.lse, Rd.lse, nrow);
  bad += cmp("dq", dq.data(), R.dq, Rd.dq, nrow * D);
  bad += cmp("dk", dk.data(), R.dk, Rd.dk, R.dk.size());
  bad += cmp("dv", dv.data(), R.dv, Rd.dv, R.dv.size());
  if (want_dmask) bad += cmp("dmask", dmask.data(), R.dm, Rd.dm, nrow * Lk);
  const char* dt = c.dtype == DType::kBFloat16 ? "bf16" : c.dtype == DType::kFloat16 ? "fp16" : "fp32";
  printf("%s %s B%d H%d Hkv%d Lq%d Lk%d D%d mask%d bc%d kl%d causal%d off%ld p%.2f nan%d cap%g\n", bad ? "BAD " : "ok  ", dt, B, H, Hkv, Lq, Lk, D, c.mask, c.mbcast, c.kl, c.causal, c.off, p, c.nan, c.cap);
  if (c.kl) { printf("    key_lengths"); for (int b = 0; b < B; ++b) printf(" %d", kl[b]); printf("\n"); }
  printf("%s", info);
  return bad;
}

// One query, one key, D = 2, scale 2e38: the score (q.k) * scale = 1 * 2e38 is finite and
// the output is v. A q scaled before the dot product overflows ((2e38 q).k = inf - 2e38).
int check_huge_scale() {
  std::vector<float> q = {1.0f, 1.0f}, k = {2.0f, -1.0f}, v = {3.0f, 4.0f}, dout = {1.0f, 1.0f};
  std::vector<float> out(2, NAN), lse(1, NAN), stats(3, NAN), dq(2, NAN), dk(2, NAN), dv(2, NAN);
  AttentionArgs a{};
  a.B = a.H = a.Hkv = a.Lq = a.Lk = 1; a.D = 2; a.dtype = DType::kFloat32;
  a.q = q.data(); a.k = k.data(); a.v = v.data();
  a.q_sb = a.q_sh = a.q_si = 2; a.k_sb = a.k_sh = a.k_si = 2; a.v_sb = a.v_sh = a.v_si = 2;
  a.mask_type = MaskType::kNone; a.scale = 2e38f; a.dropout_scale = 1.0f;
  run_launchers(a, out.data(), lse.data(), dout.data(), stats.data(), dq.data(), dk.data(), dv.data(), nullptr);
  // one key: P = 1, so out = v, dv = dout and dS = P (dP - delta) = 0, hence dq = dk = 0
  const bool ok = out[0] == 3.0f && out[1] == 4.0f && dv[0] == 1.0f && dv[1] == 1.0f && dq[0] == 0.0f &&
                  dq[1] == 0.0f && dk[0] == 0.0f && dk[1] == 0.0f;
  if (!ok) printf("scale 2e38: out (%g, %g) dq (%g, %g) dk (%g, %g) dv (%g, %g)\n", out[0], out[1], dq[0], dq[1], dk[0], dk[1], dv[0], dv[1]);
  return ok ? 0 : 1;
}

// One query, keys of scores 0 and -95, v = (1, inf): the second weight is exp(-95) = 5.5e-42,
// subnormal, and 5.5e-42 * inf = inf, as in the reference; a weight flushed to 0 would give
// 0 * inf = NaN (the CPU extension's exp_u20 does, and recomputes such blocks).
int check_subnormal_weight_with_inf_value() {
  std::vector<float> q = {1.0f}, k = {0.0f, -95.0f}, v = {1.0f, INFINITY}, dout = {1.0f};
  std::vector<float> out(1, NAN), lse(1, NAN), stats(3, NAN), dq(1, NAN), dk(2, NAN), dv(2, NAN);
  AttentionArgs a{};
  a.B = a.H = a.Hkv = a.Lq = a.D = 1; a.Lk = 2; a.dtype = DType::kFloat32;
  a.q = q.data(); a.k = k.data(); a.v = v.data();
  a.q_sb = a.q_sh = 1; a.q_si = 1; a.k_sb = a.k_sh = 2; a.k_si = 1; a.v_sb = a.v_sh = 2; a.v_si = 1;
  a.mask_type = MaskType::kNone; a.scale = 1.0f; a.dropout_scale = 1.0f;
  run_launchers(a, out.data(), lse.data(), dout.data(), stats.data(), dq.data(), dk.data(), dv.data(), nullptr);
  const bool ok = out[0] == INFINITY;
  if (!ok) printf("subnormal weight with an inf value: out %g (want inf)\n", out[0]);
  return ok ? 0 : 1;
}

int main(int argc, char** argv) {
  std::vector<Cfg> cfgs = {
    {1, 1, 1, 1, 1, 1, 0, 0, false, false, 0, 0.0},
    {2, 4, 2, 17, 33, 5, 0, 0, false, false, 0, 0.0},
    {2, 4, 2, 17, 33, 33, 1, 1, true, true, 16, 0.0},
    {1, 3, 1, 40, 19, 64, 2, 0, false, true, -3, 0.0},
    {2, 2, 2, 33, 70, 100, 2, 2, true, true, 37, 0.25},
    {1, 2, 1, 20, 20, 256, 1, 3, false, true, 0, 0.5},
    {1, 2, 2, 5, 0, 8, 0, 0, false, false, 0, 0.0},
    {2, 2, 1, 18, 45, 31, 2, 3, true, false, 0, 0.1},
    {1, 1, 1, 50, 10, 16, 0, 0, false, true, -30, 0.0},
    {1, 1, 1, 35, 50, 12, 0, 0, false, true, 1000, 0.3},
    {1, 8, 2, 1, 77, 64, 2, 2, true, true, 76, 0.2},
    {2, 4, 1, 70, 70, 48, 1, 0, true, true, 0, 0.1},
    {1, 2, 1, 3, 129, 129, 2, 1, false, false, 0, 0.0},
    // no query rows (D1): dK, dV must be zeros
    {2, 0, 1, 4, 21, 8, 0, 0, false, false, 0, 0.0},
    {2, 2, 1, 0, 21, 40, 2, 0, true, true, 3, 0.0},
    // NaN in q rows
    {2, 4, 2, 17, 33, 8, 0, 0, false, false, 0, 0.0, 1},
    {2, 4, 2, 37, 45, 33, 1, 0, true, true, 8, 0.2, 1},
    {2, 2, 1, 20, 40, 16, 2, 0, true, true, 5, 0.0, 1},
    // NaN in float-mask elements, and NaN + -inf
    {2, 2, 1, 19, 40, 16, 2, 0, true, true, 20, 0.0, 2},
    {2, 4, 2, 33, 70, 64, 2, 0, false, false, 0, 0.3, 2},
    {1, 2, 2, 17, 50, 8, 2, 1, true, true, 34, 0.0, 2},
    // NaN keys at hidden positions only (bool mask, key_lengths, causal): rows stay finite
    {2, 4, 2, 20, 40, 16, 1, 0, true, true, 20, 0.0, 3},
    {2, 2, 1, 40, 70, 48, 1, 2, true, true, 10, 0.2, 3},
    {2, 2, 2, 19, 40, 8, 1, 0, false, false, 0, 0.0, 3},
    {2, 2, 1, 20, 33, 40, 0, 0, true, false, 0, 0.0, 3},
    {1, 2, 1, 20, 60, 16, 2, 0, false, true, 7, 0.0, 3},
    // bf16 and fp16 storage (fp32 float masks, as the contract allows)
    {2, 4, 2, 17, 33, 33, 1, 1, true, true, 16, 0.0, 0, DType::kBFloat16},
    {2, 2, 1, 33, 70, 100, 2, 2, true, true, 37, 0.25, 0, DType::kBFloat16},
    {1, 8, 2, 1, 77, 64, 2, 2, true, true, 76, 0.2, 0, DType::kFloat16},
    {2, 4, 1, 40, 45, 48, 1, 0, true, false, 0, 0.1, 0, DType::kFloat16},
    // rows of huge scores (a finite mask of -1e9 or -1e4 on every key): exact statistics
    {2, 4, 2, 37, 45, 16, 2, 0, true, true, 8, 0.0, 4},
    {1, 2, 1, 40, 70, 64, 2, 0, false, false, 0, 0.2, 4},
    {2, 2, 1, 20, 33, 32, 2, 0, true, false, 0, 0.0, 4, DType::kFloat16},
    // soft-capped scores: caps below and near the scores' size (scale 1.3/sqrt(D): about 1.3), every mask kind,
    // GQA, dropout, key_lengths, causal, NaN rows and NaN keys at hidden positions, 16-bit storage
    {2, 4, 2, 17, 33, 33, 0, 0, false, false, 0, 0.0, 0, DType::kFloat32, 0.5f},
    {2, 4, 2, 37, 45, 64, 1, 1, true, true, 8, 0.2, 0, DType::kFloat32, 1.0f},
    {2, 2, 1, 33, 70, 100, 2, 2, true, true, 37, 0.25, 0, DType::kFloat32, 2.0f},
    {1, 2, 1, 20, 20, 256, 2, 3, false, true, 0, 0.0, 0, DType::kFloat32, 0.3f},
    {2, 2, 1, 20, 40, 16, 2, 0, true, true, 5, 0.0, 1, DType::kFloat32, 1.0f},
    {2, 4, 2, 20, 40, 16, 1, 0, true, true, 20, 0.0, 3, DType::kFloat32, 1.0f},
    {2, 4, 2, 37, 45, 16, 2, 0, true, true, 8, 0.0, 4, DType::kFloat32, 1.0f},
    {2, 2, 1, 33, 70, 48, 2, 2, true, true, 37, 0.25, 0, DType::kBFloat16, 0.5f},
    {1, 8, 2, 1, 77, 64, 1, 0, true, true, 76, 0.2, 0, DType::kFloat16, 1.0f},
  };
  int bad = 0;
  int first = argc > 1 ? atoi(argv[1]) : 0, last = argc > 2 ? atoi(argv[2]) : (int)cfgs.size();
  for (int t = first; t < last; ++t) bad += check(cfgs[t], 1000 + t) ? 1 : 0;
  if (first == 0) bad += check_huge_scale() + check_subnormal_weight_with_inf_value();
  printf("%d bad configs\n", bad);
  return bad != 0;
}
