// The extension backend's eager route for norms and attention as a Python module
// (fasttrans_ext): entry points called with Python's vectorcall convention that run the
// registered forward ops below their autograd key, or record a C++ autograd node whose
// backward runs without Python.
//
// fasttrans/backends/autograd.py (eager_route, selected_route) hands these to
// fasttrans.functional, which calls them only in eager mode with no torch.func transform,
// forward-AD level or dispatch mode active. A call through torch.ops costs the host a
// boxed dispatch into Python wrappers, and a Python autograd.Function a few more
// microseconds each way: longer than normalising a short row takes.
//
// The gradients are the formulas fasttrans/backends/autograd.py registers for the op: the
// same backward op on the same saved tensors, so both routes agree bit for bit. Under
// backward(create_graph=True) the node calls back into Python (set_second_order), where
// the reference implementation computes a differentiable gradient.
#include <ATen/Dispatch.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

namespace fasttrans::eager {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

using NormFwd = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, double, bool);
using NormBwd = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const OptTensor&, const at::Tensor&, const OptTensor&, const OptTensor&, const at::Tensor&,
    const at::Tensor&, bool);

// The registered ops, so that CPU and CUDA tensors reach their own kernels.
const c10::TypedOperatorHandle<NormFwd>& norm_fwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fasttrans::norm_fwd_extension", "").typed<NormFwd>();
  return op;
}

const c10::TypedOperatorHandle<NormBwd>& norm_bwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fasttrans::norm_bwd_extension", "").typed<NormBwd>();
  return op;
}

using AttentionFwd = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                       const OptTensor&, const OptTensor&, bool, c10::SymInt, double,
                                                       double, c10::SymInt, double);
using AttentionBwd = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const OptTensor&, const OptTensor&, bool, c10::SymInt, double, double, c10::SymInt, bool, double);

const c10::TypedOperatorHandle<AttentionFwd>& attention_fwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fasttrans::attention_fwd_extension", "")
                             .typed<AttentionFwd>();
  return op;
}

const c10::TypedOperatorHandle<AttentionBwd>& attention_bwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fasttrans::attention_bwd_extension", "")
                             .typed<AttentionBwd>();
  return op;
}

// The Python functions computing a norm's or attention's gradient with a graph of its own
// (see the header).
PyObject* second_order_norm = nullptr;
PyObject* second_order_attention = nullptr;

// Gradients arrive as views or expanded (stride 0): only a non-unit inner stride costs a copy.
at::Tensor last_dim_unit_stride(const at::Tensor& t) {
  return t.stride(-1) == 1 || t.size(-1) == 1 ? t : t.contiguous();
}

OptTensor optional(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

PyObject* wrap_or_none(const at::Tensor& t) {
  if (t.defined()) return THPVariable_Wrap(t);
  Py_RETURN_NONE;
}

[[noreturn]] void rethrow_python_error() {
  python_error error;
  error.persist();
  throw error;
}

pybind11::object tensor_or_none(const at::Tensor& t) {
  return pybind11::reinterpret_steal<pybind11::object>(wrap_or_none(t));
}

// fn(*args) with the GIL held (the second-order callbacks): its tuple of n tensors or Nones,
// the Nones as undefined tensors.
std::vector<at::Tensor> call_python_gradient(PyObject* fn, const pybind11::tuple& args, Py_ssize_t n,
                                             const char* what) {
  TORCH_CHECK(fn != nullptr, "fasttrans_ext: set_second_order was not called");
  PyObject* result = PyObject_Call(fn, args.ptr(), nullptr);
  if (result == nullptr) rethrow_python_error();
  std::vector<at::Tensor> grads(n);
  bool ok = PyTuple_Check(result) && PyTuple_GET_SIZE(result) == n;
  for (Py_ssize_t i = 0; ok && i < n; ++i) {
    PyObject* item = PyTuple_GET_ITEM(result, i);
    ok = item == Py_None || THPVariable_Check(item);
    if (ok && item != Py_None) grads[i] = THPVariable_Unpack(item);
  }
  Py_DECREF(result);
  TORCH_CHECK(ok, "fasttrans_ext: the second-order ", what, " gradient must be a tuple of ", n, " tensors or None");
  return grads;
}

}  // namespace

// Named outside the anonymous namespace: its type is the node's name (grad_fn.name()).
struct NormFunction : public torch::autograd::Function<NormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const OptTensor& residual,
                               const OptTensor& weight, const OptTensor& bias, double eps, bool rms, bool forced) {
    at::Tensor y, h, mean, rstd;
    {
      at::AutoDispatchBelowAutograd below;
      std::tie(y, h, mean, rstd) = norm_fwd_op().call(x, residual, weight, bias, eps, rms);
    }
    const bool has_residual = residual.has_value();
    // with a residual, x and the residual too: a second-order gradient recomputes h = x + residual
    // with a graph that does not lead back into this node, whose backward is then running
    variable_list to_save{has_residual ? h : x, weight.value_or(at::Tensor()), bias.value_or(at::Tensor())};
    if (has_residual) {
      to_save.push_back(x);
      to_save.push_back(*residual);
    }
    ctx->save_for_backward(to_save);
    ctx->saved_data["mean"] = mean;
    ctx->saved_data["rstd"] = rstd;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["forced"] = forced;
    ctx->saved_data["residual"] = has_residual;
    ctx->saved_data["needs_x"] = x.requires_grad() || (has_residual && residual->requires_grad());
    ctx->saved_data["needs_weight"] = weight.has_value() && weight->requires_grad();
    ctx->saved_data["needs_bias"] = bias.has_value() && bias->requires_grad();
    // when only y is used, h's gradient stays undefined instead of an all-zero (M, N) tensor
    ctx->set_materialize_grads(false);
    if (has_residual) return {y, h};
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& h = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& bias = saved[2];
    const bool has_residual = ctx->saved_data["residual"].toBool();
    const bool rms = ctx->saved_data["rms"].toBool();
    at::Tensor dy = grads[0];
    at::Tensor dh = has_residual ? grads[1] : at::Tensor();
    at::Tensor dx, dw, db;
    if (at::GradMode::is_enabled()) {  // backward(create_graph=True): it must be differentiable itself
      const at::Tensor x = has_residual ? saved[3] : h;
      const at::Tensor residual = has_residual ? saved[4] : at::Tensor();
      std::tie(dx, dw, db) = second_order(ctx, x, residual, weight, bias, dy, dh, rms);
    } else {
      if (!dy.defined()) dy = at::zeros_like(h);
      if (dh.defined()) dh = last_dim_unit_stride(dh);
      at::AutoDispatchBelowAutograd below;
      std::tie(dx, dw, db) = norm_bwd_op().call(last_dim_unit_stride(dy), optional(dh), h, optional(weight),
                                                optional(bias), ctx->saved_data["mean"].toTensor(),
                                                ctx->saved_data["rstd"].toTensor(), rms);
      if (!weight.defined()) dw = at::Tensor();
      if (!bias.defined()) db = at::Tensor();
    }
    return {dx, has_residual ? dx : at::Tensor(), dw, db, at::Tensor(), at::Tensor(), at::Tensor()};
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor> second_order(AutogradContext* ctx, const at::Tensor& x,
                                                                    const at::Tensor& residual,
                                                                    const at::Tensor& weight, const at::Tensor& bias,
                                                                    const at::Tensor& dy, const at::Tensor& dh,
                                                                    bool rms) {
    pybind11::gil_scoped_acquire gil;
    auto flag = [&](const char* key) { return pybind11::bool_(ctx->saved_data[key].toBool()); };
    const std::vector<at::Tensor> grads = call_python_gradient(
        second_order_norm,
        pybind11::make_tuple(flag("forced"), pybind11::bool_(rms), ctx->saved_data["eps"].toDouble(),
                             pybind11::make_tuple(flag("needs_x"), flag("needs_weight"), flag("needs_bias")),
                             tensor_or_none(x), tensor_or_none(residual), tensor_or_none(weight), tensor_or_none(bias),
                             tensor_or_none(dy), tensor_or_none(dh)),
        3, "norm");
    return {grads[0], grads[1], grads[2]};
  }
};

struct AttentionFunction : public torch::autograd::Function<AttentionFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const OptTensor& attn_mask, const OptTensor& key_lengths, bool is_causal,
                               int64_t causal_offset, double dropout_p, double scale, int64_t seed, double softcap,
                               bool forced) {
    at::Tensor out, lse;
    {
      at::AutoDispatchBelowAutograd below;
      std::tie(out, lse) =
          attention_fwd_op().call(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed,
                                  softcap);
    }
    const at::Tensor mask = attn_mask.value_or(at::Tensor());
    ctx->save_for_backward({q, k, v, out, lse, mask, key_lengths.value_or(at::Tensor())});
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["causal_offset"] = causal_offset;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["seed"] = seed;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["forced"] = forced;
    ctx->saved_data["needs"] = std::vector<bool>{q.requires_grad(), k.requires_grad(), v.requires_grad(),
                                                 mask.defined() && mask.requires_grad()};
    ctx->saved_data["mask_grad"] = mask.defined() && mask.scalar_type() != at::kBool && mask.requires_grad();
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const at::Tensor &mask = saved[5], &key_lengths = saved[6];
    const bool is_causal = ctx->saved_data["is_causal"].toBool();
    const int64_t causal_offset = ctx->saved_data["causal_offset"].toInt();
    const double dropout_p = ctx->saved_data["dropout_p"].toDouble();
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t seed = ctx->saved_data["seed"].toInt();
    const double softcap = ctx->saved_data["softcap"].toDouble();
    at::Tensor dq, dk, dv, dmask;
    if (at::GradMode::is_enabled()) {  // backward(create_graph=True): it must be differentiable itself
      pybind11::gil_scoped_acquire gil;
      const auto needs = ctx->saved_data["needs"].toBoolList();
      const std::vector<at::Tensor> grads_in = call_python_gradient(
          second_order_attention,
          pybind11::make_tuple(pybind11::bool_(ctx->saved_data["forced"].toBool()),
                               pybind11::make_tuple(pybind11::bool_(needs[0]), pybind11::bool_(needs[1]),
                                                    pybind11::bool_(needs[2]), pybind11::bool_(needs[3])),
                               tensor_or_none(q), tensor_or_none(k), tensor_or_none(v), tensor_or_none(mask),
                               tensor_or_none(key_lengths), pybind11::bool_(is_causal), causal_offset, dropout_p,
                               scale, seed, tensor_or_none(grads[0]), softcap),
          4, "attention");
      dq = grads_in[0], dk = grads_in[1], dv = grads_in[2], dmask = grads_in[3];
    } else {
      const bool mask_grad = ctx->saved_data["mask_grad"].toBool();
      at::AutoDispatchBelowAutograd below;
      std::tie(dq, dk, dv, dmask) =
          attention_bwd_op().call(last_dim_unit_stride(grads[0]), q, k, v, out, lse, optional(mask),
                                  optional(key_lengths), is_causal, causal_offset, dropout_p, scale, seed, mask_grad,
                                  softcap);
      dmask = mask_grad ? dmask.to(mask.scalar_type()) : at::Tensor();
    }
    return {dq, dk, dv, dmask, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

namespace {

// y and h (undefined without a residual) of a norm over x's (M, N) rows, through the autograd
// node when a gradient is being recorded for one of the tensors.
std::pair<at::Tensor, at::Tensor> run_norm(bool forced, const at::Tensor& x, const OptTensor& residual,
                                           const OptTensor& weight, const OptTensor& bias, double eps, bool rms) {
  const bool grad = at::GradMode::is_enabled() &&
                    (x.requires_grad() || (residual && residual->requires_grad()) ||
                     (weight && weight->requires_grad()) || (bias && bias->requires_grad()));
  if (!grad) {
    at::AutoDispatchBelowAutograd below;
    auto [y, h, mean, rstd] = norm_fwd_op().call(x, residual, weight, bias, eps, rms);
    return {y, residual ? h : at::Tensor()};
  }
  variable_list out = NormFunction::apply(x, residual, weight, bias, eps, rms, forced);
  return {out[0], residual ? out[1] : at::Tensor()};
}

OptTensor optional_arg(PyObject* obj) {
  return obj == Py_None ? std::nullopt : OptTensor(THPVariable_Unpack(obj));
}

// norm(forced, x, residual, weight, bias, eps, rms) -> (y, h or None, None, None): the
// registered forward op's outputs, the statistics only a backward reads as None. x: (M, N)
// rows; the rest as the op takes them. forced: the extension was asked for by name (a
// second-order gradient then raises instead of falling back to the reference).
PyObject* norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs == 7, "norm: expected 7 arguments, got ", nargs);
  for (int i : {1, 2, 3, 4}) {
    TORCH_CHECK_TYPE(THPVariable_Check(args[i]) || (i > 1 && args[i] == Py_None), "norm: argument ", i,
                     " must be a tensor");
  }
  const bool forced = PyObject_IsTrue(args[0]);
  const double eps = PyFloat_AsDouble(args[5]);
  if (eps == -1.0 && PyErr_Occurred()) return nullptr;
  const bool rms = PyObject_IsTrue(args[6]);
  const at::Tensor& x = THPVariable_Unpack(args[1]);
  const OptTensor residual = optional_arg(args[2]), weight = optional_arg(args[3]), bias = optional_arg(args[4]);
  std::pair<at::Tensor, at::Tensor> out;
  {
    pybind11::gil_scoped_release no_gil;
    out = run_norm(forced, x, residual, weight, bias, eps, rms);
  }
  return PyTuple_Pack(4, pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(out.first)).ptr(),
                      pybind11::reinterpret_steal<pybind11::object>(wrap_or_none(out.second)).ptr(), Py_None,
                      Py_None);
  END_HANDLE_TH_ERRORS
}

// out and lse (undefined where a gradient is being recorded) of attention on arguments valid by
// construction, through the autograd node when q, k, v or a float mask needs a gradient.
std::pair<at::Tensor, at::Tensor> run_attention(bool forced, const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const OptTensor& attn_mask,
                                                const OptTensor& key_lengths, bool is_causal, int64_t causal_offset,
                                                double dropout_p, double scale, int64_t seed, double softcap) {
  const bool grad = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                                                   (attn_mask && attn_mask->requires_grad()));
  if (grad) {
    return {AttentionFunction::apply(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale,
                                     seed, softcap, forced)[0],
            at::Tensor()};
  }
  at::AutoDispatchBelowAutograd below;
  auto [out, lse] =
      attention_fwd_op().call(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed,
                              softcap);
  return {out, lse};
}

PyObject* wrap_pair(std::pair<at::Tensor, at::Tensor> out) {
  return PyTuple_Pack(2, pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(out.first)).ptr(),
                      pybind11::reinterpret_steal<pybind11::object>(wrap_or_none(out.second)).ptr());
}

// attention(forced, q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p,
// scale, seed[, softcap]) -> (out, lse, or None where a gradient is being recorded): the
// registered forward op on arguments valid by construction (fasttrans.functional prepares them).
PyObject* attention(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs == 11 || nargs == 12, "attention: expected 11 or 12 arguments, got ", nargs);
  for (int i : {1, 2, 3, 4, 5}) {
    TORCH_CHECK_TYPE(THPVariable_Check(args[i]) || (i > 3 && args[i] == Py_None), "attention: argument ", i,
                     " must be a tensor");
  }
  const bool forced = PyObject_IsTrue(args[0]);
  const at::Tensor &q = THPVariable_Unpack(args[1]), &k = THPVariable_Unpack(args[2]), &v = THPVariable_Unpack(args[3]);
  const OptTensor attn_mask = optional_arg(args[4]), key_lengths = optional_arg(args[5]);
  const bool is_causal = PyObject_IsTrue(args[6]);
  const int64_t causal_offset = PyLong_AsLongLong(args[7]);
  const double dropout_p = PyFloat_AsDouble(args[8]);
  const double scale = PyFloat_AsDouble(args[9]);
  const int64_t seed = PyLong_AsLongLong(args[10]);
  const double softcap = nargs == 12 ? PyFloat_AsDouble(args[11]) : 0.0;
  if (PyErr_Occurred()) return nullptr;
  std::pair<at::Tensor, at::Tensor> out;
  {
    pybind11::gil_scoped_release no_gil;
    out = run_attention(forced, q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed,
                        softcap);
  }
  return wrap_pair(std::move(out));
  END_HANDLE_TH_ERRORS
}

// Whether t is a plain 4-D strided tensor with unit inner stride, of dtype and device.
bool plain_operand(PyObject* obj, at::ScalarType dtype, const at::Device& device) {
  if (!THPVariable_CheckExact(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  return t.layout() == at::kStrided && t.dim() == 4 && t.stride(3) == 1 && t.scalar_type() == dtype &&
         t.device() == device;
}

// The mask of the common case expanded to (B, H, Lq, Lk) (a view, never materialised), or
// nullopt when it is not the common case: a plain strided bool mask, or a float one in q's
// dtype or float32, on q's device, broadcastable to (B, H, Lq, Lk).
std::optional<OptTensor> common_mask(PyObject* obj, const at::Tensor& q, int64_t Lk) {
  if (obj == Py_None) return OptTensor();
  if (!THPVariable_CheckExact(obj)) return std::nullopt;
  const at::Tensor& m = THPVariable_Unpack(obj);
  const std::array<int64_t, 4> target{q.size(0), q.size(1), q.size(2), Lk};
  if (m.layout() != at::kStrided || m.dim() > 4 || m.device() != q.device() ||
      !(m.scalar_type() == at::kBool || m.scalar_type() == q.scalar_type() || m.scalar_type() == at::kFloat)) {
    return std::nullopt;
  }
  for (int64_t i = 1; i <= m.dim(); ++i) {
    const int64_t size = m.size(-i);
    if (size != 1 && size != target[4 - i]) return std::nullopt;
  }
  return OptTensor(m.expand(target));
}

// The key lengths of the common case as the contiguous int32 (B,) tensor the ops take, or
// nullopt when they are not the common case: a plain strided (B,) integer tensor on q's
// device whose values, when they are on the CPU, lie in [0, Lk] (on a GPU they are not read:
// that would synchronise the call; the kernels clamp them).
std::optional<OptTensor> common_key_lengths(PyObject* obj, const at::Tensor& q, int64_t Lk) {
  if (obj == Py_None) return OptTensor();
  if (!THPVariable_CheckExact(obj)) return std::nullopt;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (t.layout() != at::kStrided || t.dim() != 1 || t.size(0) != q.size(0) || t.device() != q.device() ||
      !at::isIntegralType(t.scalar_type(), /*includeBool=*/false)) {
    return std::nullopt;
  }
  if (t.device().is_cpu()) {
    bool in_range = true;
    AT_DISPATCH_INTEGRAL_TYPES(t.scalar_type(), "key_lengths", [&] {
      const scalar_t* p = t.const_data_ptr<scalar_t>();
      for (int64_t b = 0; b < t.size(0); ++b) {
        const int64_t value = static_cast<int64_t>(p[b * t.stride(0)]);
        in_range = in_range && value >= 0 && value <= Lk;
      }
    });
    if (!in_range) return std::nullopt;
  }
  if (t.scalar_type() == at::kInt && t.is_contiguous()) return OptTensor(t);
  return OptTensor(t.to(at::kInt).contiguous());
}

// attention_common(forced, q, k, v, attn_mask, key_lengths, is_causal, causal_offset, scale,
// max_head_dim) -> (out, lse or None), or None when the call is not the common case, which
// the caller's general route then takes (and reports, when it is invalid). The common case,
// without dropout: q (B, H, Lq, D) and k, v (B, Hkv, Lk, D) plain strided tensors of one
// dtype and device with unit inner stride, none of B, H, Lq, Lk, Hkv zero, Hkv dividing H,
// D at most max_head_dim; the mask and key lengths as common_mask and common_key_lengths
// take them; is_causal a bool, causal_offset an int, scale None or a finite float. The
// caller has checked q's type and dtype and that no transform is active.
PyObject* attention_common(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs == 10, "attention_common: expected 10 arguments, got ", nargs);
  if (!THPVariable_CheckExact(args[1]) || !PyBool_Check(args[6]) || !PyLong_CheckExact(args[7]) ||
      !(args[8] == Py_None || PyFloat_CheckExact(args[8]))) {
    Py_RETURN_NONE;
  }
  const at::Tensor& q = THPVariable_Unpack(args[1]);
  if (q.layout() != at::kStrided || q.dim() != 4 || q.stride(3) != 1 ||
      !plain_operand(args[2], q.scalar_type(), q.device()) || !plain_operand(args[3], q.scalar_type(), q.device())) {
    Py_RETURN_NONE;
  }
  const at::Tensor &k = THPVariable_Unpack(args[2]), &v = THPVariable_Unpack(args[3]);
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2);
  const int64_t max_head_dim = PyLong_AsLongLong(args[9]);
  if (max_head_dim == -1 && PyErr_Occurred()) return nullptr;
  if (B == 0 || H == 0 || Lq == 0 || D == 0 || D > max_head_dim || Hkv == 0 || Lk == 0 || H % Hkv != 0 ||
      k.size(0) != B || k.size(3) != D || v.sizes() != k.sizes()) {
    Py_RETURN_NONE;
  }
  const std::optional<OptTensor> attn_mask = common_mask(args[4], q, Lk);
  if (!attn_mask) Py_RETURN_NONE;
  const std::optional<OptTensor> key_lengths = common_key_lengths(args[5], q, Lk);
  if (!key_lengths) Py_RETURN_NONE;
  int overflow = 0;
  const long long offset = PyLong_AsLongLongAndOverflow(args[7], &overflow);
  // clamped to [-Lq, Lk]: the same masks (past Lk - 1 every query sees every key, at -Lq or below none sees any)
  const int64_t causal_offset =
      overflow > 0 ? Lk : overflow < 0 ? -Lq : std::max<int64_t>(-Lq, std::min<int64_t>(offset, Lk));
  double scale = 1.0 / std::sqrt(static_cast<double>(D));
  if (args[8] != Py_None) {
    scale = PyFloat_AS_DOUBLE(args[8]);
    if (!std::isfinite(scale)) Py_RETURN_NONE;
  }
  const bool forced = PyObject_IsTrue(args[0]);
  const bool is_causal = args[6] == Py_True;
  std::pair<at::Tensor, at::Tensor> out;
  {
    pybind11::gil_scoped_release no_gil;
    out = run_attention(forced, q, k, v, *attn_mask, *key_lengths, is_causal, causal_offset, 0.0, scale, 0, 0.0);
  }
  return wrap_pair(std::move(out));
  END_HANDLE_TH_ERRORS
}

// Whether p is None or a plain (N,) vector of x's dtype and device with unit stride.
bool plain_param(PyObject* p, int64_t n, const at::Tensor& x) {
  if (p == Py_None) return true;
  if (!THPVariable_CheckExact(p)) return false;
  const at::Tensor& t = THPVariable_Unpack(p);
  return t.layout() == at::kStrided && t.dim() == 1 && t.size(0) == n && t.stride(0) == 1 &&
         t.scalar_type() == x.scalar_type() && t.device() == x.device();
}

// norm_common(forced, x, residual, weight, bias, eps, rms, n) -> (y, h or None) in x's shape,
// or None when the call is not the common case, which the caller's general route then takes
// (and reports, when it is invalid). The common case: x a plain contiguous tensor whose last
// dim is n > 0 with at least one row; residual None or like x; weight and bias None or plain
// (n,) vectors of x's dtype and device. The caller has checked x's type and dtype and eps.
PyObject* norm_common(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs == 8, "norm_common: expected 8 arguments, got ", nargs);
  PyObject* const x_obj = args[1];
  PyObject* const r_obj = args[2];
  if (!THPVariable_CheckExact(x_obj) || !(r_obj == Py_None || THPVariable_CheckExact(r_obj))) Py_RETURN_NONE;
  const at::Tensor& x = THPVariable_Unpack(x_obj);
  const int64_t n = PyLong_AsLongLong(args[7]);
  if (n == -1 && PyErr_Occurred()) return nullptr;
  if (x.layout() != at::kStrided || x.dim() == 0 || x.size(-1) != n || n == 0 || x.numel() == 0 ||
      !x.is_contiguous() || !plain_param(args[3], n, x) || !plain_param(args[4], n, x)) {
    Py_RETURN_NONE;
  }
  OptTensor residual;
  if (r_obj != Py_None) {
    const at::Tensor& r = THPVariable_Unpack(r_obj);
    if (r.layout() != at::kStrided || r.scalar_type() != x.scalar_type() || r.sizes() != x.sizes() ||
        r.device() != x.device() || !r.is_contiguous()) {
      Py_RETURN_NONE;
    }
    residual = r;
  }
  const bool forced = PyObject_IsTrue(args[0]);
  const double eps = PyFloat_AsDouble(args[5]);
  if (eps == -1.0 && PyErr_Occurred()) return nullptr;
  const bool rms = PyObject_IsTrue(args[6]);
  const OptTensor weight = optional_arg(args[3]), bias = optional_arg(args[4]);
  std::pair<at::Tensor, at::Tensor> out;
  {
    pybind11::gil_scoped_release no_gil;
    const bool rows = x.dim() == 2;
    if (rows) {
      out = run_norm(forced, x, residual, weight, bias, eps, rms);
    } else {
      const OptTensor residual_rows = residual ? OptTensor(residual->view({-1, n})) : std::nullopt;
      out = run_norm(forced, x.view({-1, n}), residual_rows, weight, bias, eps, rms);
      out.first = out.first.view(x.sizes());
      if (out.second.defined()) out.second = out.second.view(x.sizes());
    }
  }
  return PyTuple_Pack(2, pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(out.first)).ptr(),
                      pybind11::reinterpret_steal<pybind11::object>(wrap_or_none(out.second)).ptr());
  END_HANDLE_TH_ERRORS
}

// set_second_order(norm, attention): the functions computing the gradients under
// create_graph=True (see the header).
//   norm(forced, rms, eps, (needs_x, needs_weight, needs_bias), x, residual, weight, bias, dy, dh)
//     -> (dx, dweight, dbias), dx including dh
//   attention(forced, (needs_q, needs_k, needs_v, needs_mask), q, k, v, attn_mask, key_lengths,
//             is_causal, causal_offset, dropout_p, scale, seed, dout) -> (dq, dk, dv, dmask)
PyObject* set_second_order(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyCallable_Check(args[0]) || !PyCallable_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "set_second_order: expected two callables (norm, attention)");
    return nullptr;
  }
  Py_INCREF(args[0]);
  Py_XSETREF(second_order_norm, args[0]);
  Py_INCREF(args[1]);
  Py_XSETREF(second_order_attention, args[1]);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(norm)), METH_FASTCALL,
     "norm(forced, x, residual, weight, bias, eps, rms) -> (y, h, None, None)"},
    {"norm_common", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(norm_common)), METH_FASTCALL,
     "norm_common(forced, x, residual, weight, bias, eps, rms, n) -> (y, h) or None"},
    {"attention", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(attention)), METH_FASTCALL,
     "attention(forced, q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed"
     "[, softcap]) -> (out, lse or None)"},
    {"attention_common", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(attention_common)),
     METH_FASTCALL,
     "attention_common(forced, q, k, v, attn_mask, key_lengths, is_causal, causal_offset, scale, max_head_dim) "
     "-> (out, lse) or None"},
    {"set_second_order", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(set_second_order)),
     METH_FASTCALL, "set_second_order(norm, attention): the create_graph=True gradients"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "fasttrans_ext",
                          "fasttrans's eager route for the extension's norms and attention", -1, methods};

}  // namespace
}  // namespace fasttrans::eager

PyMODINIT_FUNC PyInit_fasttrans_ext() { return PyModule_Create(&fasttrans::eager::module_def); }
