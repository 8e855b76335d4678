// The torch side of the CUDA kernels: argument checks, output allocation, the current
// stream, and TORCH_LIBRARY_IMPL(fasttrans, CUDA). Compiled only when torch has CUDA (the
// kernels themselves are in the torch-free attention_cuda.cu / layernorm_cuda.cu /
// dropout_cuda.cu).
//
// Only the light c10/cuda headers are used (no ATen/cuda/CUDAContext.h, which pulls in
// cuBLAS and cuSPARSE headers that some CUDA installations lack).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "checks.h"
#include "cuda_launchers.h"
#include "ops.h"
#include "philox.h"

namespace fasttrans::cuda {
namespace {

namespace kern = fasttrans::cuda_kernels;

void check_launch(const char* error, const char* op) {
  TORCH_CHECK(error == nullptr, op, " (CUDA): ", error);
}

kern::DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return kern::DType::kFloat32;
    case at::kHalf: return kern::DType::kFloat16;
    case at::kBFloat16: return kern::DType::kBFloat16;
    default:
      TORCH_CHECK(false, name, ": the CUDA kernels support float32, float16 and bfloat16, got ", t.scalar_type(),
                  " (float64 runs on the CPU extension and the reference backend)");
  }
}

void check_cuda(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.device() == like.device(), name, ": expected a tensor on ", like.device(), ", got ", t.device());
}

// Inner (head dim / column) stride 1, as the kernels assume; anything else is copied.
at::Tensor unit_inner(const at::Tensor& t) {
  return t.stride(-1) == 1 || t.size(-1) == 1 ? t : t.contiguous();
}

struct AttentionInputs {
  at::Tensor q, k, v, mask, lengths;
  kern::AttentionArgs args{};
};

AttentionInputs attention_inputs(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                 const std::optional<at::Tensor>& attn_mask,
                                 const std::optional<at::Tensor>& key_lengths, bool is_causal, int64_t causal_offset,
                                 double dropout_p, double scale, int64_t seed, double softcap) {
  TORCH_CHECK(q_in.dim() == 4 && k_in.dim() == 4 && v_in.sizes() == k_in.sizes(),
              "q, k, v: expected (B, H, Lq, D) and equal (B, Hkv, Lk, D) shapes, got ", q_in.sizes(), ", ",
              k_in.sizes(), " and ", v_in.sizes());
  TORCH_CHECK(k_in.size(0) == q_in.size(0) && k_in.size(3) == q_in.size(3) && k_in.size(1) > 0 &&
                  q_in.size(1) % k_in.size(1) == 0,
              "k: expected batch ", q_in.size(0), ", head dim ", q_in.size(3), " and a head count dividing ",
              q_in.size(1), ", got shape ", k_in.sizes());
  TORCH_CHECK(k_in.scalar_type() == q_in.scalar_type() && v_in.scalar_type() == q_in.scalar_type(),
              "k, v: expected the dtype of q (", q_in.scalar_type(), ")");
  check_cuda(k_in, q_in, "k");
  check_cuda(v_in, q_in, "v");
  AttentionInputs in;
  in.q = unit_inner(q_in);
  in.k = unit_inner(k_in);
  in.v = unit_inner(v_in);
  const int64_t B = q_in.size(0), H = q_in.size(1), Lq = q_in.size(2), D = q_in.size(3);
  const int64_t Hkv = k_in.size(1), Lk = k_in.size(2);

  kern::AttentionArgs& a = in.args;
  a.B = B;
  a.H = H;
  a.Hkv = Hkv;
  a.Lq = Lq;
  a.Lk = Lk;
  a.D = D;
  a.dtype = dtype_of(q_in, "q");
  a.q = in.q.data_ptr();
  a.q_sb = in.q.stride(0);
  a.q_sh = in.q.stride(1);
  a.q_si = in.q.stride(2);
  a.k = in.k.data_ptr();
  a.k_sb = in.k.stride(0);
  a.k_sh = in.k.stride(1);
  a.k_si = in.k.stride(2);
  a.v = in.v.data_ptr();
  a.v_sb = in.v.stride(0);
  a.v_sh = in.v.stride(1);
  a.v_si = in.v.stride(2);

  a.mask = nullptr;
  a.mask_type = kern::MaskType::kNone;
  if (attn_mask.has_value() && attn_mask->defined()) {
    check_cuda(*attn_mask, q_in, "attn_mask");
    checks::mask_broadcasts(*attn_mask, B, H, Lq, Lk);
    at::Tensor m = *attn_mask;
    switch (m.scalar_type()) {
      case at::kBool: a.mask_type = kern::MaskType::kBool; break;
      case at::kFloat: a.mask_type = kern::MaskType::kFloat32; break;
      case at::kHalf: a.mask_type = kern::MaskType::kFloat16; break;
      case at::kBFloat16: a.mask_type = kern::MaskType::kBFloat16; break;
      default:
        TORCH_CHECK(m.is_floating_point(), "attn_mask: expected a bool or floating-point mask, got ", m.scalar_type());
        m = m.to(at::kFloat);
        a.mask_type = kern::MaskType::kFloat32;
    }
    in.mask = m.expand({B, H, Lq, Lk});  // a view: broadcast dims keep stride 0
    a.mask = in.mask.data_ptr();
    a.m_sb = in.mask.stride(0);
    a.m_sh = in.mask.stride(1);
    a.m_si = in.mask.stride(2);
    a.m_sj = in.mask.stride(3);
  }
  a.key_lengths = nullptr;
  if (key_lengths.has_value() && key_lengths->defined()) {
    checks::key_lengths_shape(*key_lengths, B);
    in.lengths = key_lengths->to(q_in.device(), at::kInt).contiguous();
    a.key_lengths = in.lengths.data_ptr<int32_t>();
  }
  a.causal = is_causal;
  // beyond these bounds the offset changes nothing, and the kernels' index arithmetic stays small
  a.causal_offset = std::clamp<int64_t>(causal_offset, -(Lq + 1), Lk + 1);
  a.scale = static_cast<float>(scale);
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_p: expected a probability in [0, 1), got ", dropout_p);
  a.dropout = dropout_p > 0.0;
  a.seed = static_cast<uint64_t>(seed);
  a.dropout_threshold = attention_dropout_threshold(dropout_p);
  a.dropout_scale = a.dropout ? static_cast<float>(1.0 / (1.0 - dropout_p)) : 1.0f;
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), "softcap: expected a finite value > 0 (0: none), got ",
              softcap);
  a.softcap = static_cast<float>(softcap);
  return in;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const std::optional<at::Tensor>& attn_mask,
                                                 const std::optional<at::Tensor>& key_lengths, bool is_causal,
                                                 int64_t causal_offset, double dropout_p, double scale, int64_t seed,
                                                 double softcap) {
  const c10::cuda::CUDAGuard guard(q.device());
  const AttentionInputs in =
      attention_inputs(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed, softcap);
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  check_launch(kern::attention_fwd_cuda(in.args, out.data_ptr(), lse.data_ptr<float>(),
                                        c10::cuda::getCurrentCUDAStream().stream()),
               "attention_fwd_extension");
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_lengths,
    bool is_causal, int64_t causal_offset, double dropout_p, double scale, int64_t seed, bool mask_grad,
    double softcap) {
  const c10::cuda::CUDAGuard guard(q.device());
  const AttentionInputs in =
      attention_inputs(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed, softcap);
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "dout, out: expected the shape of q ", q.sizes(),
              ", got ", dout.sizes(), " and ", out.sizes());
  // the kernels read lse[(b * H + h) * Lq + i]
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && lse.size(2) == q.size(2),
              "lse: expected shape (B, H, Lq) = ", q.sizes().slice(0, 3), ", got ", lse.sizes());
  TORCH_CHECK(!mask_grad || (in.mask.defined() && in.mask.scalar_type() != at::kBool),
              "mask_grad: the gradient of attn_mask needs a floating-point attn_mask");
  checks::floating(dout, "dout");
  checks::floating(out, "out");
  checks::floating(lse, "lse");
  check_cuda(dout, q, "dout");
  check_cuda(out, q, "out");
  check_cuda(lse, q, "lse");
  const at::Tensor dout_c = dout.to(q.scalar_type()).contiguous();
  const at::Tensor out_c = out.to(q.scalar_type()).contiguous();
  const at::Tensor lse_c = lse.to(at::kFloat).contiguous();
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2);
  at::Tensor stats = at::empty({3, B, H, Lq}, q.options().dtype(at::kFloat));
  // every element is written by the kernels, dK and dV also when there are no query rows
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  at::Tensor dmask = mask_grad ? at::zeros({B, H, Lq, Lk}, q.options().dtype(at::kFloat))
                               : at::empty({0}, q.options().dtype(at::kFloat));
  check_launch(kern::attention_bwd_cuda(in.args, dout_c.data_ptr(), out_c.data_ptr(), lse_c.data_ptr<float>(),
                                        stats.data_ptr<float>(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                                        mask_grad ? dmask.data_ptr<float>() : nullptr,
                                        c10::cuda::getCurrentCUDAStream().stream()),
               "attention_bwd_extension");
  return {dq, dk, dv, dmask};
}

at::Tensor attention_dropout_mask(const at::Tensor& q, const at::Tensor& k, double dropout_p, int64_t seed) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "q, k: expected 4-D tensors, got shapes ", q.sizes(), " and ", k.sizes());
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_p: expected a probability in [0, 1), got ", dropout_p);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor keep = at::empty({q.size(0), q.size(1), q.size(2), k.size(2)}, q.options().dtype(at::kBool));
  check_launch(kern::attention_dropout_mask_cuda(q.size(0), q.size(1), q.size(2), k.size(2),
                                                 static_cast<uint64_t>(seed), attention_dropout_threshold(dropout_p),
                                                 keep.data_ptr<bool>(), c10::cuda::getCurrentCUDAStream().stream()),
               "attention_dropout_mask_extension");
  return keep;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_fwd(const at::Tensor& x_in,
                                                                    const std::optional<at::Tensor>& residual,
                                                                    const std::optional<at::Tensor>& weight,
                                                                    const std::optional<at::Tensor>& bias, double eps,
                                                                    bool rms) {
  TORCH_CHECK(x_in.dim() == 2, "x: expected a 2-D (M, N) tensor, got shape ", x_in.sizes());
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = unit_inner(x_in);
  const int64_t M = x.size(0), N = x.size(1);
  kern::NormArgs a{};
  a.M = M;
  a.N = N;
  a.dtype = dtype_of(x, "x");
  a.x = x.data_ptr();
  a.ldx = x.stride(0);
  at::Tensor r;
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual: expected the shape and dtype of x");
    check_cuda(*residual, x, "residual");
    r = unit_inner(*residual);
    a.residual = r.data_ptr();
    a.ldr = r.stride(0);
  }
  checks::param_numel(weight, "weight", N);
  if (!rms) checks::param_numel(bias, "bias", N);  // RMSNorm ignores bias, as on the CPU
  // parameters as fp32 vectors: one tiny conversion instead of a kernel per parameter dtype
  at::Tensor w, b;
  if (weight.has_value() && weight->defined()) {
    check_cuda(*weight, x, "weight");
    w = weight->reshape({N}).to(at::kFloat).contiguous();
    a.weight = w.data_ptr<float>();
  }
  if (!rms && bias.has_value() && bias->defined()) {
    check_cuda(*bias, x, "bias");
    b = bias->reshape({N}).to(at::kFloat).contiguous();
    a.bias = b.data_ptr<float>();
  }
  a.eps = static_cast<float>(eps);
  a.rms = rms;
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor h = r.defined() ? at::empty({M, N}, x.options()) : at::empty({0}, x.options());
  at::Tensor mean = at::empty({rms ? 0 : M}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({M}, x.options().dtype(at::kFloat));
  check_launch(kern::norm_fwd_cuda(a, y.data_ptr(), r.defined() ? h.data_ptr() : nullptr,
                                   rms ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(),
                                   c10::cuda::getCurrentCUDAStream().stream()),
               "norm_fwd_extension");
  return {y, h, mean, rstd};
}

namespace {

// A (M, N) gradient of h: h's shape and dtype (as the CPU kernel requires), h's device.
void check_rows(const at::Tensor& t, const at::Tensor& h, const char* name) {
  TORCH_CHECK(t.sizes() == h.sizes(), name, ": expected the shape of h ", h.sizes(), ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == h.scalar_type(), name, ": expected the dtype of h (", h.scalar_type(), "), got ",
              t.scalar_type());
  check_cuda(t, h, name);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_bwd(const at::Tensor& dy, const std::optional<at::Tensor>& dh,
                                                        const at::Tensor& h_in, const std::optional<at::Tensor>& weight,
                                                        const std::optional<at::Tensor>& bias, const at::Tensor& mean,
                                                        const at::Tensor& rstd, bool rms) {
  TORCH_CHECK(h_in.dim() == 2, "h: expected a 2-D (M, N) tensor, got shape ", h_in.sizes());
  const c10::cuda::CUDAGuard guard(h_in.device());
  const at::Tensor h = unit_inner(h_in);
  const int64_t M = h.size(0), N = h.size(1);
  const kern::DType dtype = dtype_of(h, "h");
  check_rows(dy, h, "dy");
  const at::Tensor dy_c = dy.contiguous();
  at::Tensor dh_c;
  if (dh.has_value() && dh->defined() && dh->numel() > 0) {
    check_rows(*dh, h, "dh");
    dh_c = dh->contiguous();
  }
  // RMSNorm has no mean: it arrives as an empty (0,) tensor and is ignored
  at::Tensor mean_c;
  if (!rms) {
    TORCH_CHECK(mean.numel() == M, "mean: expected ", M, " elements, got shape ", mean.sizes());
    check_cuda(mean, h, "mean");
    mean_c = mean.to(at::kFloat).contiguous();
  }
  TORCH_CHECK(rstd.numel() == M, "rstd: expected ", M, " elements, got shape ", rstd.sizes());
  check_cuda(rstd, h, "rstd");
  const at::Tensor rstd_c = rstd.to(at::kFloat).contiguous();
  checks::param_numel(weight, "weight", N);
  checks::param_numel(bias, "bias", N);
  at::Tensor w;
  if (weight.has_value() && weight->defined()) {
    check_cuda(*weight, h, "weight");
    w = weight->reshape({N}).to(at::kFloat).contiguous();
  }
  const bool want_db = bias.has_value() && bias->defined();

  const int64_t chunks = kern::norm_bwd_chunks(M);
  const auto f32 = h.options().dtype(at::kFloat);
  at::Tensor dx = at::empty({M, N}, h.options());
  at::Tensor dw_part = w.defined() ? at::empty({chunks, N}, f32) : at::Tensor();
  at::Tensor db_part = want_db ? at::empty({chunks, N}, f32) : at::Tensor();
  at::Tensor dw32 = w.defined() ? at::zeros({N}, f32) : at::Tensor();
  at::Tensor db32 = want_db ? at::zeros({N}, f32) : at::Tensor();
  check_launch(kern::norm_bwd_cuda(M, N, dtype, dy_c.data_ptr(), dh_c.defined() ? dh_c.data_ptr() : nullptr,
                                   h.data_ptr(), h.stride(0), w.defined() ? w.data_ptr<float>() : nullptr,
                                   rms ? nullptr : mean_c.data_ptr<float>(), rstd_c.data_ptr<float>(), rms,
                                   dx.data_ptr(), w.defined() ? dw_part.data_ptr<float>() : nullptr,
                                   want_db ? db_part.data_ptr<float>() : nullptr,
                                   w.defined() ? dw32.data_ptr<float>() : nullptr,
                                   want_db ? db32.data_ptr<float>() : nullptr, c10::cuda::getCurrentCUDAStream().stream()),
               "norm_bwd_extension");
  at::Tensor dw = w.defined() ? dw32.to(weight->scalar_type()).view(weight->sizes()) : at::empty({0}, h.options());
  at::Tensor db = want_db ? db32.to(bias->scalar_type()).view(bias->sizes()) : at::empty({0}, h.options());
  return {dx, dw, db};
}

// Elementwise dropout: fasttrans.functional passes 0 < p < 1 (it handles p == 0 and p == 1).
// Any int64 seed is accepted, as on the CPU: the Philox key is its 64 bits (uint64).
std::tuple<at::Tensor, at::Tensor> dropout_fwd(const at::Tensor& x_in, double p, int64_t seed) {
  TORCH_CHECK(p > 0.0 && p < 1.0, "p: expected a dropout probability in (0, 1), got ", p);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const kern::DType dtype = dtype_of(x_in, "x");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor keep = at::empty(x.sizes(), x.options().dtype(at::kBool));
  // scale: 1 / (1 - p) in double, rounded once to fp32 (the contract's rounding)
  check_launch(kern::dropout_fwd_cuda(x.numel(), dtype, x.data_ptr(), y.data_ptr(), keep.data_ptr<bool>(),
                                      static_cast<uint64_t>(seed), dropout_threshold(p),
                                      static_cast<float>(1.0 / (1.0 - p)), c10::cuda::getCurrentCUDAStream().stream()),
               "dropout_fwd_extension");
  return {y, keep};
}

at::Tensor dropout_bwd(const at::Tensor& dy, const at::Tensor& keep, double p) {
  TORCH_CHECK(p > 0.0 && p < 1.0, "p: expected a dropout probability in (0, 1), got ", p);
  TORCH_CHECK(keep.sizes() == dy.sizes(), "keep: expected the shape of dy ", dy.sizes(), ", got ", keep.sizes());
  TORCH_CHECK(keep.scalar_type() == at::kBool, "keep: expected a bool mask, got ", keep.scalar_type());
  check_cuda(keep, dy, "keep");
  const c10::cuda::CUDAGuard guard(dy.device());
  const kern::DType dtype = dtype_of(dy, "dy");
  // gradients often arrive expanded (stride 0): the kernel reads contiguous memory
  const at::Tensor dy_c = dy.contiguous();
  const at::Tensor keep_c = keep.contiguous();
  at::Tensor dx = at::empty(dy_c.sizes(), dy_c.options());
  check_launch(kern::dropout_bwd_cuda(dy_c.numel(), dtype, dy_c.data_ptr(), keep_c.data_ptr<bool>(), dx.data_ptr(),
                                      static_cast<float>(1.0 / (1.0 - p)), c10::cuda::getCurrentCUDAStream().stream()),
               "dropout_bwd_extension");
  return dx;
}

}  // namespace fasttrans::cuda

TORCH_LIBRARY_IMPL(fasttrans, CUDA, m) {
  m.impl("attention_fwd_extension", &fasttrans::cuda::attention_fwd);
  m.impl("attention_bwd_extension", &fasttrans::cuda::attention_bwd);
  m.impl("attention_dropout_mask_extension", &fasttrans::cuda::attention_dropout_mask);
  m.impl("norm_fwd_extension", &fasttrans::cuda::norm_fwd);
  m.impl("norm_bwd_extension", &fasttrans::cuda::norm_bwd);
  m.impl("dropout_fwd_extension", &fasttrans::cuda::dropout_fwd);
  m.impl("dropout_bwd_extension", &fasttrans::cuda::dropout_bwd);
}
