// The extension's torch.library schemas and their CPU kernels.
//
// fasttrans/backends/registration.py adds the fake (meta) implementations and autograd in Python, so
// only the schemas and the device kernels live here. The CUDA kernels are registered by
// cuda_binding.cpp, which is compiled only when torch has CUDA.
#include <torch/library.h>

#include "cpu_allocator.h"
#include "ops.h"

TORCH_LIBRARY(fasttrans, m) {
  m.def(
      "attention_fwd_extension(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? key_lengths, "
      "bool is_causal, SymInt causal_offset, float dropout_p, float scale, SymInt seed, float softcap=0.0) "
      "-> (Tensor, Tensor)");
  m.def(
      "attention_bwd_extension(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? attn_mask, Tensor? key_lengths, bool is_causal, SymInt causal_offset, float dropout_p, "
      "float scale, SymInt seed, bool mask_grad, float softcap=0.0) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("attention_dropout_mask_extension(Tensor q, Tensor k, float dropout_p, SymInt seed) -> Tensor");
  m.def(
      "norm_fwd_extension(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, bool rms) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "norm_bwd_extension(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor? bias, Tensor mean, "
      "Tensor rstd, bool rms) -> (Tensor, Tensor, Tensor)");
  m.def("dropout_fwd_extension(Tensor x, float p, SymInt seed) -> (Tensor, Tensor)");
  m.def("dropout_bwd_extension(Tensor dy, Tensor keep, float p) -> Tensor");
  // fasttrans.nn's mask translation helpers (masks_cpu.cpp), for CPU masks
  m.def("padding_key_lengths(Tensor key_padding_mask) -> Tensor");
  m.def("is_causal_mask(Tensor mask) -> bool");
  // the CPU kernels' block cache (cpu_allocator.h): no tensor arguments, so one kernel for
  // every dispatch key
  m.def("cpu_cache_stats() -> int[]", &fasttrans::cpu::cpu_cache_stats);
  m.def("cpu_cache_clear() -> ()", &fasttrans::cpu::cpu_cache_clear);
  m.def("cpu_attention_tiles(int head_dim, int element_size, int l2_bytes=-1) -> int[]",
        &fasttrans::cpu::cpu_attention_tiles);
  // fasttrans.nn's inference path for a whole encoder or decoder layer (layer_cpu.cpp)
  m.def(
      "transformer_layer_fwd_extension(Tensor x, Tensor? memory, Tensor[] weights, Tensor?[] biases, "
      "Tensor?[] norm_weights, Tensor?[] norm_biases, float[] norm_eps, Tensor? self_mask, "
      "Tensor? self_key_lengths, bool self_is_causal, Tensor? cross_mask, Tensor? cross_key_lengths, "
      "bool cross_is_causal, int num_heads, int activation, bool norm_first, bool seq_first) -> Tensor");
  // and one decoder layer's step of incremental decoding with a key/value cache: the new
  // positions' keys and values are written into self_k / self_v at start ..
  m.def(
      "decoder_layer_step_fwd_extension(Tensor x, Tensor(a!) self_k, Tensor(b!) self_v, int start, "
      "Tensor cross_k, Tensor cross_v, Tensor? cross_mask, Tensor? cross_key_lengths, Tensor[] weights, "
      "Tensor?[] biases, Tensor?[] norm_weights, Tensor?[] norm_biases, float[] norm_eps, int num_heads, "
      "int activation, bool norm_first) -> Tensor");
  // and for a MultiheadAttention with a packed projection (kv: None for self-attention)
  m.def(
      "multihead_attention_fwd_extension(Tensor query, Tensor? kv, Tensor in_weight, Tensor? in_bias, "
      "Tensor out_weight, Tensor? out_bias, Tensor? attn_mask, Tensor? key_lengths, bool is_causal, "
      "int num_heads, bool seq_first, bool need_weights, bool average_weights) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fasttrans, CPU, m) {
  m.impl("attention_fwd_extension", &fasttrans::cpu::attention_fwd);
  m.impl("attention_bwd_extension", &fasttrans::cpu::attention_bwd);
  m.impl("attention_dropout_mask_extension", &fasttrans::cpu::attention_dropout_mask);
  m.impl("norm_fwd_extension", &fasttrans::cpu::norm_fwd);
  m.impl("norm_bwd_extension", &fasttrans::cpu::norm_bwd);
  m.impl("dropout_fwd_extension", &fasttrans::cpu::dropout_fwd);
  m.impl("dropout_bwd_extension", &fasttrans::cpu::dropout_bwd);
  m.impl("padding_key_lengths", &fasttrans::cpu::padding_key_lengths);
  m.impl("is_causal_mask", &fasttrans::cpu::is_causal_mask);
  m.impl("transformer_layer_fwd_extension", &fasttrans::cpu::transformer_layer_fwd);
  m.impl("decoder_layer_step_fwd_extension", &fasttrans::cpu::decoder_layer_step_fwd);
  m.impl("multihead_attention_fwd_extension", &fasttrans::cpu::multihead_attention_fwd);
}
