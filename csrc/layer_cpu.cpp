// Inference forwards of whole fasttrans.nn modules on the CPU, each in one op: a Transformer
// encoder or decoder layer (transformer_layer_fwd), a decoder layer's step of incremental
// decoding over a key/value cache (decoder_layer_step_fwd, for fasttrans.models.decoding),
// and a MultiheadAttention (multihead_attention_fwd, below).
//
// fasttrans.nn's layers run the first in eval mode when nothing needs a gradient: the same
// computation as their module path (the same GEMM calls, this extension's attention and
// Add & Norm kernels, in the same order), without the dozens of Python-level op calls
// between them, which at a batch of one short sequence cost as much as the kernels.
//
//     post-norm (norm_first=false)          pre-norm (norm_first=true)
//     x = LN1(x + SA(x))                    x = x + SA(LN1(x))
//     x = LN2(x + CA(x, mem))   (decoder)   x = x + CA(LN2(x), mem)   (decoder)
//     x = LNn(x + FF(x))                    x = x + FF(LNn(x))
//
// with SA/CA = out_proj(attention(in_proj(.))) and FF = linear2(act(linear1(.))); each
// "LN(x + .)" is one add_layer_norm pass (norm_fwd with a residual), whose h is the
// pre-norm residual stream. Dropout is absent: inference.
#include <ATen/Dispatch.h>
#include <ATen/ops/add.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/softmax.h>

#include <cmath>
#include <limits>
#include <optional>

#include "checks.h"
#include "common.h"
#include "cpu_allocator.h"
#include "ops.h"

namespace fasttrans::cpu {
namespace {

struct AttentionArgs {
  at::Tensor in_weight, out_weight;  // (3E, E), (E, E)
  std::optional<at::Tensor> in_bias, out_bias;
  std::optional<at::Tensor> mask, key_lengths;
  bool is_causal;
};

std::optional<at::Tensor> optional_at(const c10::List<std::optional<at::Tensor>>& list, size_t i) {
  std::optional<at::Tensor> t = list.get(i);
  if (t.has_value() && !t->defined()) return std::nullopt;
  return t;
}

std::optional<at::Tensor> narrowed(const std::optional<at::Tensor>& t, int64_t start, int64_t length) {
  if (!t.has_value()) return std::nullopt;
  return t->narrow(0, start, length);
}

// (A, B, H, D) in the caller's layout ((L, N) when seq_first, else (N, L)) -> (N, H, L, D) view
at::Tensor split_heads(const at::Tensor& t, bool seq_first) {
  return seq_first ? t.permute({1, 2, 0, 3}) : t.transpose(1, 2);
}

// 1 / sqrt(head size): the scores' scale, as fasttrans.attention's default (scale=None)
double head_scale(int64_t D) {
  return 1.0 / std::sqrt(static_cast<double>(D));
}

// The queries of x (A, B, E): the first E rows of the packed in-projection, as (A, B, H, D)
at::Tensor query_projection(const at::Tensor& x, const AttentionArgs& a, int64_t H) {
  const int64_t E = x.size(2);
  return at::linear(x, a.in_weight.narrow(0, 0, E), narrowed(a.in_bias, 0, E)).view({x.size(0), x.size(1), H, E / H});
}

// out (N, H, L, D) -> rows of E features in x's layout (A, B, E), then the out-projection
at::Tensor output_projection(const at::Tensor& out, const at::Tensor& x, const AttentionArgs& a, bool seq_first) {
  const at::Tensor rows =
      (seq_first ? out.permute({2, 0, 1, 3}) : out.transpose(1, 2)).reshape({x.size(0), x.size(1), x.size(2)});
  return at::linear(rows, a.out_weight, a.out_bias);
}

// The softmax weights (N, H, L, S) of q (N, H, L, D) over k (N, H, S, D), materialised, in q's
// dtype (scores in fp32 for fp16/bf16): what MultiheadAttention returns for need_weights. A
// query with no allowed key has NaN weights, as torch's softmax of a row of -inf. The mask
// and key lengths are checked by the caller (attention_block).
at::Tensor attention_weights(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& mask,
                             const std::optional<at::Tensor>& key_lengths, bool is_causal, double scale) {
  const at::ScalarType acc =
      q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16 ? at::kFloat : q.scalar_type();
  at::Tensor s = at::matmul(q.to(acc), k.to(acc).transpose(-1, -2)).mul_(scale);
  const double neg_inf = -std::numeric_limits<double>::infinity();
  if (mask.has_value()) {
    if (mask->scalar_type() == at::kBool) {
      s.masked_fill_(mask->logical_not(), neg_inf);
    } else {
      s.add_(mask->to(acc));
    }
  }
  if (key_lengths.has_value()) {
    const at::Tensor positions = at::arange(s.size(3), key_lengths->options().dtype(at::kLong));
    s.masked_fill_(positions.view({1, 1, 1, -1}).ge(key_lengths->to(at::kLong).view({-1, 1, 1, 1})), neg_inf);
  }
  if (is_causal) {
    s.masked_fill_(at::ones({s.size(2), s.size(3)}, s.options().dtype(at::kBool)).triu_(1), neg_inf);
  }
  return at::softmax(s, -1).to(q.scalar_type());
}

// Few scores (a batch of one short sequence): the same weights and output from one loop nest.
// attention_weights and the matmul after it are some twenty ATen calls (head copies, two
// batched matmuls, the masks, the softmax), which there cost more than their arithmetic.
// Where the loops stop: the work at which the two measured even (benchmarks/README.md,
// "Attention weights of few scores").
constexpr int64_t kLoopWeightsWork = int64_t(1) << 17;  // N * H * L * S * D multiply-adds

bool loop_weights(const at::Tensor& q, const at::Tensor& k) {
  return q.size(0) * q.size(1) * q.size(2) * k.size(2) * q.size(3) <= kLoopWeightsWork;
}

// out (N, H, L, D) and weights in scalar_t from q (N, H, L, D), k, v (N, H, S, D) in T with
// unit inner strides; mask a view of an (N, H, L, S) broadcast (common.h). Each step rounds as
// attention_weights, the matmul and the mean over heads do: scores (q . k) * scale in T, the
// masks (-inf where masked, a float mask added), softmax in T (NaN for a row with no allowed
// key, or with a NaN), weights rounded to scalar_t, out = weights @ v accumulated in T.
// weights: (N, H, L, S), or with average their mean over the heads (N, L, S), summed in T.
template <typename scalar_t, typename T>
void attention_with_weights_loops(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const MaskView& mask, const at::Tensor& lengths, bool is_causal, T scale,
                                  bool average, at::Tensor& out, at::Tensor& weights) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  const T* qd = q.data_ptr<T>();
  const T* kd = k.data_ptr<T>();
  const T* vd = v.data_ptr<T>();
  const int64_t* len = lengths.defined() ? lengths.data_ptr<int64_t>() : nullptr;
  scalar_t* od = out.data_ptr<scalar_t>();  // contiguous (N, H, L, D)
  scalar_t* wd = weights.data_ptr<scalar_t>();  // contiguous (N, H, L, S) or (N, L, S)
  std::vector<T> srow(S), mrow(mask ? S : 0), orow(D), wsum(average ? L * S : 0);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t visible = len ? std::clamp<int64_t>(len[n], 0, S) : S;
    std::fill(wsum.begin(), wsum.end(), T(0));
    for (int64_t h = 0; h < H; ++h) {
      const T* kh = kd + n * k.stride(0) + h * k.stride(1);
      const T* vh = vd + n * v.stride(0) + h * v.stride(1);
      for (int64_t l = 0; l < L; ++l) {
        const T* qr = qd + n * q.stride(0) + h * q.stride(1) + l * q.stride(2);
        // srow = the weights, rounded to scalar_t; orow = weights @ v. exact: by std::exp,
        // which keeps the subnormal weights exp_u20 flushes to 0.
        auto weigh = [&](bool exact) {
          for (int64_t j = 0; j < S; ++j) srow[j] = dot(qr, kh + j * k.stride(2), D) * scale;
          if (mask) {
            load_mask_row(mask, n, h, l, 0, S, mrow.data());
            apply_mask_row(mask, mrow.data(), srow.data(), S, 1);
          }
          for (int64_t j = 0; j < S; ++j) {
            if (j >= visible || (is_causal && j > l)) srow[j] = neg_inf<T>();
          }
          const T m = row_max(srow.data(), S);
          // NaN when m is +-inf or NaN
          const T inv = T(1) / (exact ? exp_sub_sum_exact(srow.data(), S, m) : exp_sub_sum(srow.data(), S, m));
          std::fill(orow.begin(), orow.end(), T(0));
          for (int64_t j = 0; j < S; ++j) {
            const T w = srow[j] = static_cast<T>(static_cast<scalar_t>(srow[j] * inv));
            const T* vr = vh + j * v.stride(2);
            for (int64_t d = 0; d < D; ++d) orow[d] += w * vr[d];
          }
          return m;
        };
        const T m = weigh(false);
        if (flushed_weight_hit_inf(orow.data(), &m, 1, D)) weigh(true);
        scalar_t* wr = average ? nullptr : wd + ((n * H + h) * L + l) * S;
        for (int64_t j = 0; j < S; ++j) {
          if (wr) {
            wr[j] = static_cast<scalar_t>(srow[j]);
          } else {
            wsum[l * S + j] += srow[j];
          }
        }
        scalar_t* orr = od + ((n * H + h) * L + l) * D;
        for (int64_t d = 0; d < D; ++d) orr[d] = static_cast<scalar_t>(orow[d]);
      }
    }
    if (average) {
      scalar_t* wa = wd + n * L * S;
      for (int64_t i = 0; i < L * S; ++i) wa[i] = static_cast<scalar_t>(wsum[i] / static_cast<T>(H));
    }
  }
}

// attention_weights, out = weights @ v and, with average, weights.mean(1), by
// attention_with_weights_loops: (out, weights).
std::tuple<at::Tensor, at::Tensor> attention_with_weights(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, const std::optional<at::Tensor>& mask,
                                                          const std::optional<at::Tensor>& key_lengths,
                                                          bool is_causal, double scale, bool average) {
  const at::ScalarType dtype = q.scalar_type();
  const at::ScalarType acc = dtype == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  auto rows = [&](const at::Tensor& t) {  // in acc, unit inner stride
    at::Tensor r = t.to(acc);
    return r.stride(3) == 1 ? r : r.contiguous();
  };
  const at::Tensor qa = rows(q), ka = rows(k), va = rows(v);
  // expand() is a view: broadcast dims are read with stride 0
  const MaskView m = make_mask_view(mask.has_value() ? std::optional(mask->expand({N, H, L, S})) : std::nullopt);
  at::Tensor lengths;
  if (key_lengths.has_value()) {
    lengths = key_lengths->to(at::kLong).contiguous();
  }
  at::Tensor out = cpu::empty({N, H, L, D}, q.options());
  at::Tensor weights = average ? cpu::empty({N, L, S}, q.options()) : cpu::empty({N, H, L, S}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "multihead_attention_fwd_extension", [&] {
    using T = acc_t<scalar_t>;
    attention_with_weights_loops<scalar_t, T>(qa, ka, va, m, lengths, is_causal, static_cast<T>(scale), average,
                                              out, weights);
  });
  return {out, weights};
}

// x (A, B, E) attends itself (kv == nullptr) or kv (A', B, E): out_proj(attention(in_proj(.))).
// With weights != nullptr the attention is computed from the materialised softmax weights,
// which are stored there: (N, H, L, S), or with average_weights their mean over the heads
// (N, L, S); else by the fused kernel.
at::Tensor attention_block(const at::Tensor& x, const at::Tensor* kv, const AttentionArgs& a, int64_t H,
                           bool seq_first, at::Tensor* weights = nullptr, bool average_weights = false) {
  const int64_t E = x.size(2), D = E / H;
  at::Tensor q, k, v;
  if (kv == nullptr) {  // one (.., 3E) projection
    const at::Tensor qkv = at::linear(x, a.in_weight, a.in_bias).view({x.size(0), x.size(1), 3, H, D});
    q = qkv.select(2, 0);
    k = qkv.select(2, 1);
    v = qkv.select(2, 2);
  } else {  // queries from x; keys and values share one (.., 2E) projection of kv
    q = query_projection(x, a, H);
    const at::Tensor pkv = at::linear(*kv, a.in_weight.narrow(0, E, 2 * E), narrowed(a.in_bias, E, 2 * E))
                               .view({kv->size(0), kv->size(1), 2, H, D});
    k = pkv.select(2, 0);
    v = pkv.select(2, 1);
  }
  const double scale = head_scale(D);
  if (weights != nullptr) {  // the fused kernel checks its own; the weights paths share these
    const int64_t N = x.size(seq_first ? 1 : 0), L = x.size(seq_first ? 0 : 1);
    const int64_t S = kv == nullptr ? L : kv->size(seq_first ? 0 : 1);
    if (a.mask.has_value()) checks::mask_broadcasts(*a.mask, N, H, L, S);
    if (a.key_lengths.has_value()) checks::key_lengths_shape(*a.key_lengths, N);
  }
  at::Tensor out;
  if (weights != nullptr && loop_weights(split_heads(q, seq_first), split_heads(k, seq_first))) {
    std::tie(out, *weights) = attention_with_weights(split_heads(q, seq_first), split_heads(k, seq_first),
                                                     split_heads(v, seq_first), a.mask, a.key_lengths, a.is_causal,
                                                     scale, average_weights);
  } else if (weights != nullptr) {
    *weights = attention_weights(split_heads(q, seq_first), split_heads(k, seq_first), a.mask, a.key_lengths,
                                 a.is_causal, scale);
    out = at::matmul(*weights, split_heads(v, seq_first));
    if (average_weights) *weights = weights->mean(1);
  } else {
    out = std::get<0>(attention_fwd(split_heads(q, seq_first), split_heads(k, seq_first), split_heads(v, seq_first),
                                    a.mask, a.key_lengths, a.is_causal, /*causal_offset=*/0, /*dropout_p=*/0.0, scale,
                                    /*seed=*/0));
  }
  return output_projection(out, x, a, seq_first);
}

struct Norm {
  std::optional<at::Tensor> weight, bias;
  double eps;
};

// LN(x), or with a residual (y, h) = (LN(x + residual), x + residual) in one pass
std::tuple<at::Tensor, at::Tensor> norm(const at::Tensor& x, const at::Tensor* residual, const Norm& n) {
  const int64_t E = x.size(-1);
  std::optional<at::Tensor> r;
  if (residual != nullptr) r = residual->reshape({-1, E});
  auto [y, h, mean, rstd] = norm_fwd(x.reshape({-1, E}), r, n.weight, n.bias, n.eps, /*rms=*/false);
  return {y.view(x.sizes()), residual != nullptr ? h.view(x.sizes()) : h};
}

// linear2(act(linear1(t))), act 0 relu / 1 gelu / 2 gelu (tanh)
struct FeedForward {
  at::Tensor w1, w2;
  std::optional<at::Tensor> b1, b2;
  int64_t activation;

  at::Tensor operator()(const at::Tensor& t) const {
    at::Tensor hidden = at::linear(t, w1, b1);
    if (activation == 0) {
      hidden.relu_();
    } else {
      at::gelu_(hidden, activation == 1 ? "none" : "tanh");
    }
    return at::linear(hidden, w2, b2);
  }
};

void check_weight(const at::Tensor& w, const char* name, int64_t rows, int64_t cols, const at::Tensor& x) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) == rows && w.size(1) == cols, name, ": expected shape (", rows, ", ", cols,
              "), got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.device() == x.device(), name, ": expected ", x.scalar_type(),
              " on ", x.device(), " (from x), got ", w.scalar_type(), " on ", w.device());
}

void check_vector(const std::optional<at::Tensor>& b, const char* name, int64_t size, const at::Tensor& x) {
  if (!b.has_value()) return;
  TORCH_CHECK(b->dim() == 1 && b->size(0) == size, name, ": expected shape (", size, ",), got ", b->sizes());
  TORCH_CHECK(b->scalar_type() == x.scalar_type() && b->device() == x.device(), name, ": expected ",
              x.scalar_type(), " on ", x.device(), " (from x), got ", b->scalar_type(), " on ", b->device());
}

// x: the (L, N, E) or (N, L, E) input of a module with num_heads heads
void check_input(const at::Tensor& x, const char* name, int64_t num_heads) {
  TORCH_CHECK(x.dim() == 3, name, ": expected a 3-D (L, N, E) or (N, L, E) tensor, got shape ", x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), name, ": expected a floating-point dtype, got ", x.scalar_type());
  TORCH_CHECK(num_heads > 0 && x.size(2) % num_heads == 0,
              "num_heads: expected a positive divisor of the embedding size ", x.size(2), ", got ", num_heads);
}

// src: the sequence x attends (memory, or MultiheadAttention's key and value), in x's layout
void check_source(const at::Tensor& src, const char* name, const at::Tensor& x, const char* x_name, bool seq_first) {
  const int64_t n = seq_first ? 1 : 0;
  TORCH_CHECK(src.dim() == 3 && src.size(n) == x.size(n) && src.size(2) == x.size(2), name,
              ": expected the batch size and embedding size of ", x_name, " ", x.sizes(), ", got shape ", src.sizes());
  TORCH_CHECK(src.scalar_type() == x.scalar_type() && src.device() == x.device(), name, ": expected ",
              x.scalar_type(), " on ", x.device(), " (from ", x_name, "), got ", src.scalar_type(), " on ",
              src.device());
}

// The checks of a layer's parameters (see transformer_layer_fwd's schema): n_linear weights
// and biases (in_proj, out_proj of each attention, then linear1, linear2) and n_norm norms
// for x (.., .., E). Returns the norms.
std::vector<Norm> checked_layer(const at::Tensor& x, at::TensorList weights,
                                const c10::List<std::optional<at::Tensor>>& biases,
                                const c10::List<std::optional<at::Tensor>>& norm_weights,
                                const c10::List<std::optional<at::Tensor>>& norm_biases,
                                at::ArrayRef<double> norm_eps, size_t n_linear, size_t n_norm, int64_t activation) {
  TORCH_CHECK(weights.size() == n_linear && biases.size() == n_linear, "weights, biases: expected ", n_linear,
              " of each (", n_linear == 6 ? "a decoder layer" : "an encoder layer", "), got ", weights.size(), " and ",
              biases.size());
  TORCH_CHECK(norm_weights.size() == n_norm && norm_biases.size() == n_norm && norm_eps.size() == n_norm,
              "norm_weights, norm_biases, norm_eps: expected ", n_norm, " of each, got ", norm_weights.size(), ", ",
              norm_biases.size(), " and ", norm_eps.size());
  TORCH_CHECK(activation >= 0 && activation <= 2, "activation: expected 0 (relu), 1 (gelu) or 2 (gelu, tanh), got ",
              activation);
  const int64_t E = x.size(2);
  const int64_t F = weights[n_linear - 2].dim() == 2 ? weights[n_linear - 2].size(0) : -1;  // checked below
  static const char* const kWeightNames[] = {"weights[0] (self-attention in_proj)", "weights[1] (self-attention out_proj)",
                                             "weights[2] (cross-attention in_proj)", "weights[3] (cross-attention out_proj)"};
  static const char* const kBiasNames[] = {"biases[0] (self-attention in_proj)", "biases[1] (self-attention out_proj)",
                                           "biases[2] (cross-attention in_proj)", "biases[3] (cross-attention out_proj)"};
  for (size_t i = 0; i + 2 < n_linear; ++i) {
    const int64_t rows = i % 2 == 0 ? 3 * E : E;
    check_weight(weights[i], kWeightNames[i], rows, E, x);
    check_vector(optional_at(biases, i), kBiasNames[i], rows, x);
  }
  check_weight(weights[n_linear - 2], "linear1 weight", F, E, x);
  check_vector(optional_at(biases, n_linear - 2), "linear1 bias", F, x);
  check_weight(weights[n_linear - 1], "linear2 weight", E, F, x);
  check_vector(optional_at(biases, n_linear - 1), "linear2 bias", E, x);
  std::vector<Norm> norms;
  for (size_t i = 0; i < n_norm; ++i) {
    const Norm n{optional_at(norm_weights, i), optional_at(norm_biases, i), norm_eps[i]};
    check_vector(n.weight, "norm_weights", E, x);
    check_vector(n.bias, "norm_biases", E, x);
    TORCH_CHECK(n.eps >= 0 && std::isfinite(n.eps), "norm_eps: expected finite non-negative values, got ", n.eps);
    norms.push_back(n);
  }
  return norms;
}

// cache (B, H, capacity, D) of a decoder layer's keys or values, for x (B, n, E)
void check_cache(const at::Tensor& cache, const char* name, const at::Tensor& x, int64_t H, int64_t min_length) {
  const int64_t D = x.size(2) / H;
  TORCH_CHECK(cache.dim() == 4 && cache.size(0) == x.size(0) && cache.size(1) == H && cache.size(3) == D &&
                  cache.size(2) >= min_length,
              name, ": expected shape (", x.size(0), ", ", H, ", L, ", D, ") with L >= ", min_length,
              " (x's batch, the heads, positions, the head size), got ", cache.sizes());
  TORCH_CHECK(cache.scalar_type() == x.scalar_type() && cache.device() == x.device(), name, ": expected ",
              x.scalar_type(), " on ", x.device(), " (from x), got ", cache.scalar_type(), " on ", cache.device());
}

// Self-attention of x's n new positions (B, n, E) over a key/value cache: their keys and
// values are written to positions start .. start + n - 1 of self_k / self_v, and the new
// queries attend positions 0 .. start + n - 1 with the bottom-right causal mask (query i sees
// keys up to start + i).
at::Tensor cached_self_attention(const at::Tensor& x, at::Tensor& self_k, at::Tensor& self_v, int64_t start,
                                 const AttentionArgs& a, int64_t H) {
  const int64_t B = x.size(0), n = x.size(1), E = x.size(2), D = E / H;
  const at::Tensor qkv = at::linear(x, a.in_weight, a.in_bias).view({B, n, 3, H, D});
  self_k.narrow(2, start, n).copy_(qkv.select(2, 1).transpose(1, 2));
  self_v.narrow(2, start, n).copy_(qkv.select(2, 2).transpose(1, 2));
  const at::Tensor out = std::get<0>(attention_fwd(
      qkv.select(2, 0).transpose(1, 2), self_k.narrow(2, 0, start + n), self_v.narrow(2, 0, start + n), std::nullopt,
      std::nullopt, /*is_causal=*/true, /*causal_offset=*/start, /*dropout_p=*/0.0, head_scale(D), 0));
  return output_projection(out, x, a, /*seq_first=*/false);
}

// Cross-attention of x (B, n, E) over projected memory keys and values (B, H, S, D).
at::Tensor cached_cross_attention(const at::Tensor& x, const at::Tensor& cross_k, const at::Tensor& cross_v,
                                  const AttentionArgs& a, int64_t H) {
  const at::Tensor out =
      std::get<0>(attention_fwd(query_projection(x, a, H).transpose(1, 2), cross_k, cross_v, a.mask, a.key_lengths,
                                /*is_causal=*/false, 0, /*dropout_p=*/0.0, head_scale(x.size(2) / H), 0));
  return output_projection(out, x, a, /*seq_first=*/false);
}

}  // namespace

at::Tensor decoder_layer_step_fwd(const at::Tensor& x, at::Tensor& self_k, at::Tensor& self_v, int64_t start,
                                  const at::Tensor& cross_k, const at::Tensor& cross_v,
                                  const std::optional<at::Tensor>& cross_mask,
                                  const std::optional<at::Tensor>& cross_key_lengths, at::TensorList weights,
                                  const c10::List<std::optional<at::Tensor>>& biases,
                                  const c10::List<std::optional<at::Tensor>>& norm_weights,
                                  const c10::List<std::optional<at::Tensor>>& norm_biases,
                                  at::ArrayRef<double> norm_eps, int64_t num_heads, int64_t activation,
                                  bool norm_first) {
  TORCH_CHECK(x.dim() == 3, "x: expected a 3-D (N, n, E) tensor of new positions, got shape ", x.sizes());
  check_input(x, "x", num_heads);
  const std::vector<Norm> norms =
      checked_layer(x, weights, biases, norm_weights, norm_biases, norm_eps, 6, 3, activation);
  TORCH_CHECK(start >= 0, "start: expected a non-negative position, got ", start);
  check_cache(self_k, "self_k", x, num_heads, start + x.size(1));
  check_cache(self_v, "self_v", x, num_heads, start + x.size(1));
  check_cache(cross_k, "cross_k", x, num_heads, 0);
  check_cache(cross_v, "cross_v", x, num_heads, 0);
  TORCH_CHECK(cross_v.size(2) == cross_k.size(2), "cross_v: expected the ", cross_k.size(2),
              " positions of cross_k, got shape ", cross_v.sizes());
  const AttentionArgs self_attn{weights[0], weights[1], optional_at(biases, 0), optional_at(biases, 1),
                                std::nullopt, std::nullopt, true};
  const AttentionArgs cross_attn{weights[2], weights[3], optional_at(biases, 2), optional_at(biases, 3),
                                 cross_mask, cross_key_lengths, false};
  const FeedForward ff{weights[4], weights[5], optional_at(biases, 4), optional_at(biases, 5), activation};
  if (norm_first) {
    at::Tensor y, h;
    std::tie(y, h) = norm(cached_self_attention(std::get<0>(norm(x, nullptr, norms[0])), self_k, self_v, start,
                                                self_attn, num_heads),
                          &x, norms[1]);
    std::tie(y, h) = norm(cached_cross_attention(y, cross_k, cross_v, cross_attn, num_heads), &h, norms[2]);
    return at::add(h, ff(y));
  }
  at::Tensor h = std::get<0>(norm(cached_self_attention(x, self_k, self_v, start, self_attn, num_heads), &x, norms[0]));
  h = std::get<0>(norm(cached_cross_attention(h, cross_k, cross_v, cross_attn, num_heads), &h, norms[1]));
  return std::get<0>(norm(ff(h), &h, norms[2]));
}

at::Tensor transformer_layer_fwd(const at::Tensor& x, const std::optional<at::Tensor>& memory,
                                 at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                                 const c10::List<std::optional<at::Tensor>>& norm_weights,
                                 const c10::List<std::optional<at::Tensor>>& norm_biases,
                                 at::ArrayRef<double> norm_eps, const std::optional<at::Tensor>& self_mask,
                                 const std::optional<at::Tensor>& self_key_lengths, bool self_is_causal,
                                 const std::optional<at::Tensor>& cross_mask,
                                 const std::optional<at::Tensor>& cross_key_lengths, bool cross_is_causal,
                                 int64_t num_heads, int64_t activation, bool norm_first, bool seq_first) {
  const bool decoder = memory.has_value() && memory->defined();
  const size_t n_linear = decoder ? 6 : 4, n_norm = decoder ? 3 : 2;
  check_input(x, "x", num_heads);
  const std::vector<Norm> norms = checked_layer(x, weights, biases, norm_weights, norm_biases, norm_eps, n_linear,
                                                n_norm, activation);
  if (decoder) check_source(*memory, "memory", x, "x", seq_first);

  const AttentionArgs self_attn{weights[0], weights[1], optional_at(biases, 0), optional_at(biases, 1),
                                self_mask, self_key_lengths, self_is_causal};
  std::optional<AttentionArgs> cross_attn;
  if (decoder) {
    cross_attn = AttentionArgs{weights[2], weights[3], optional_at(biases, 2), optional_at(biases, 3),
                               cross_mask, cross_key_lengths, cross_is_causal};
  }
  const FeedForward ff{weights[n_linear - 2], weights[n_linear - 1], optional_at(biases, n_linear - 2),
                       optional_at(biases, n_linear - 1), activation};

  at::Tensor h = x;
  if (norm_first) {
    // a = LN1(h); then each sublayer's output joins the stream h, and the next norm reads it
    at::Tensor a = std::get<0>(norm(h, nullptr, norms[0]));
    std::tie(a, h) = norm(attention_block(a, nullptr, self_attn, num_heads, seq_first), &h, norms[1]);
    if (decoder) {
      std::tie(a, h) = norm(attention_block(a, &*memory, *cross_attn, num_heads, seq_first), &h, norms[2]);
    }
    return at::add(h, ff(a));
  }
  h = std::get<0>(norm(attention_block(h, nullptr, self_attn, num_heads, seq_first), &h, norms[0]));
  if (decoder) {
    h = std::get<0>(norm(attention_block(h, &*memory, *cross_attn, num_heads, seq_first), &h, norms[1]));
  }
  return std::get<0>(norm(ff(h), &h, norms[n_norm - 1]));
}

std::tuple<at::Tensor, at::Tensor> multihead_attention_fwd(
    const at::Tensor& query, const std::optional<at::Tensor>& kv, const at::Tensor& in_weight,
    const std::optional<at::Tensor>& in_bias, const at::Tensor& out_weight, const std::optional<at::Tensor>& out_bias,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_lengths, bool is_causal,
    int64_t num_heads, bool seq_first, bool need_weights, bool average_weights) {
  check_input(query, "query", num_heads);
  const int64_t E = query.size(2);
  check_weight(in_weight, "in_weight", 3 * E, E, query);
  check_vector(in_bias, "in_bias", 3 * E, query);
  check_weight(out_weight, "out_weight", E, E, query);
  check_vector(out_bias, "out_bias", E, query);
  const bool self = !(kv.has_value() && kv->defined());
  if (!self) check_source(*kv, "kv", query, "query", seq_first);
  const AttentionArgs args{in_weight, out_weight, in_bias, out_bias, attn_mask, key_lengths, is_causal};
  at::Tensor weights;
  at::Tensor out = attention_block(query, self ? nullptr : &*kv, args, num_heads, seq_first,
                                   need_weights ? &weights : nullptr, average_weights);
  if (!need_weights) return {out, cpu::empty({0}, query.options())};
  return {out, weights};
}

}  // namespace fasttrans::cpu
