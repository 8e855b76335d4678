// The extension's op entry points (tensor-level), one namespace per device.
//
// Schemas (registration.cpp) and semantics: the backend interface in fasttrans/backends/__init__.py.
// Absent optional outputs are returned as empty tensors of shape (0,).
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

namespace fasttrans {

#define FASTTRANS_DECLARE_OPS                                                                                     \
  std::tuple<at::Tensor, at::Tensor> attention_fwd(                                                               \
      const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& attn_mask, \
      const std::optional<at::Tensor>& key_lengths, bool is_causal, int64_t causal_offset, double dropout_p,     \
      double scale, int64_t seed, double softcap = 0.0);                                                          \
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_bwd(                                       \
      const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,                     \
      const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,                  \
      const std::optional<at::Tensor>& key_lengths, bool is_causal, int64_t causal_offset, double dropout_p,     \
      double scale, int64_t seed, bool mask_grad, double softcap = 0.0);                                          \
  at::Tensor attention_dropout_mask(const at::Tensor& q, const at::Tensor& k, double dropout_p, int64_t seed);    \
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_fwd(                                            \
      const at::Tensor& x, const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& weight,   \
      const std::optional<at::Tensor>& bias, double eps, bool rms);                                               \
  std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_bwd(                                                        \
      const at::Tensor& dy, const std::optional<at::Tensor>& dh, const at::Tensor& h,                            \
      const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& mean,    \
      const at::Tensor& rstd, bool rms);                                                                     \
  std::tuple<at::Tensor, at::Tensor> dropout_fwd(const at::Tensor& x, double p, int64_t seed);                   \
  at::Tensor dropout_bwd(const at::Tensor& dy, const at::Tensor& keep, double p);

namespace cpu {
FASTTRANS_DECLARE_OPS
// mask translation helpers (masks_cpu.cpp): CPU only
at::Tensor padding_key_lengths(const at::Tensor& key_padding_mask);
bool is_causal_mask(const at::Tensor& mask);
// one encoder or decoder layer's inference forward (layer_cpu.cpp): CPU only
at::Tensor transformer_layer_fwd(const at::Tensor& x, const std::optional<at::Tensor>& memory,
                                 at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                                 const c10::List<std::optional<at::Tensor>>& norm_weights,
                                 const c10::List<std::optional<at::Tensor>>& norm_biases,
                                 at::ArrayRef<double> norm_eps, const std::optional<at::Tensor>& self_mask,
                                 const std::optional<at::Tensor>& self_key_lengths, bool self_is_causal,
                                 const std::optional<at::Tensor>& cross_mask,
                                 const std::optional<at::Tensor>& cross_key_lengths, bool cross_is_causal,
                                 int64_t num_heads, int64_t activation, bool norm_first, bool seq_first);
// one decoder layer's step of incremental decoding, writing its key/value cache (layer_cpu.cpp): CPU only
at::Tensor decoder_layer_step_fwd(const at::Tensor& x, at::Tensor& self_k, at::Tensor& self_v, int64_t start,
                                  const at::Tensor& cross_k, const at::Tensor& cross_v,
                                  const std::optional<at::Tensor>& cross_mask,
                                  const std::optional<at::Tensor>& cross_key_lengths, at::TensorList weights,
                                  const c10::List<std::optional<at::Tensor>>& biases,
                                  const c10::List<std::optional<at::Tensor>>& norm_weights,
                                  const c10::List<std::optional<at::Tensor>>& norm_biases,
                                  at::ArrayRef<double> norm_eps, int64_t num_heads, int64_t activation,
                                  bool norm_first);
// one MultiheadAttention inference forward, packed projection (layer_cpu.cpp): CPU only
std::tuple<at::Tensor, at::Tensor> multihead_attention_fwd(
    const at::Tensor& query, const std::optional<at::Tensor>& kv, const at::Tensor& in_weight,
    const std::optional<at::Tensor>& in_bias, const at::Tensor& out_weight, const std::optional<at::Tensor>& out_bias,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_lengths, bool is_causal,
    int64_t num_heads, bool seq_first, bool need_weights, bool average_weights);
// the attention kernels' tiles for a head dim and an accumulation element size, and the L2
// bytes they were chosen for: [fwd rows, fwd keys, bwd rows, bwd keys, l2 bytes]. l2_bytes < 0:
// what the kernels use (l2 bytes 0 when FASTTRANS_CPU_ATTENTION_TILES sets them); else the
// rule at that L2 size.
std::vector<int64_t> cpu_attention_tiles(int64_t head_dim, int64_t element_size, int64_t l2_bytes);
}  // namespace cpu

namespace cuda {
FASTTRANS_DECLARE_OPS
}  // namespace cuda

#undef FASTTRANS_DECLARE_OPS

}  // namespace fasttrans
