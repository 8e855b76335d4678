// Host-side helpers of fasttrans.nn's mask translation (fasttrans/nn/_masks.py), for CPU
// masks: the questions it asks of a torch.nn mask's values, each answered in one pass.
//
// The same answers from PyTorch ops take four to six op calls, paid by every attention layer
// of a model for the same mask.
// They are exact (comparisons and counts), so they agree with the PyTorch formulation in
// _masks.py bit for bit, which the tests check.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <limits>

#include "ops.h"

namespace fasttrans::cpu {

at::Tensor padding_key_lengths(const at::Tensor& key_padding_mask) {
  const at::Tensor& m = key_padding_mask;
  TORCH_CHECK(m.device().is_cpu(), "key_padding_mask: expected a CPU tensor, got one on ", m.device());
  TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 2,
              "key_padding_mask: expected a 2-D (N, S) bool tensor, got ", m.scalar_type(), " of shape ", m.sizes());
  const int64_t N = m.size(0), S = m.size(1), s0 = m.stride(0), s1 = m.stride(1);
  const bool* p = m.const_data_ptr<bool>();
  at::Tensor lengths = at::empty({N}, m.options().dtype(at::kInt));
  int32_t* out = lengths.mutable_data_ptr<int32_t>();
  for (int64_t n = 0; n < N; ++n) {
    const bool* row = p + n * s0;
    int64_t j = 0;
    while (j < S && !row[j * s1]) ++j;  // the keys before the first padding one
    out[n] = static_cast<int32_t>(j);
    for (; j < S; ++j) {
      if (!row[j * s1]) return at::empty({0}, m.options().dtype(at::kInt));  // a key after padding
    }
  }
  return lengths;
}

namespace {

// Whether every (L, S) matrix of m (batched over its leading dims) is `above` strictly
// above the diagonal and `below` on and below it.
template <typename T>
bool all_causal(const at::Tensor& m, T above, T below) {
  const int64_t L = m.size(-2), S = m.size(-1);
  const int64_t batch = m.numel() / std::max<int64_t>(L * S, 1);
  const at::Tensor flat = m.dim() == 2 ? m.unsqueeze(0) : m.reshape({batch, L, S});  // a view when strides allow
  const int64_t sb = flat.stride(0), sl = flat.stride(1), ss = flat.stride(2);  // a copy has strides of its own
  const T* p = flat.const_data_ptr<T>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < L; ++i) {
      const T* row = p + b * sb + i * sl;
      for (int64_t j = 0; j < S; ++j) {
        if (row[j * ss] != (j > i ? above : below)) return false;
      }
    }
  }
  return true;
}

}  // namespace

bool is_causal_mask(const at::Tensor& mask) {
  TORCH_CHECK(mask.device().is_cpu(), "mask: expected a CPU tensor, got one on ", mask.device());
  TORCH_CHECK(mask.dim() >= 2, "mask: expected at least 2 dims (..., L, S), got shape ", mask.sizes());
  if (mask.numel() == 0) return true;  // as torch.equal of two empty tensors
  if (mask.scalar_type() == at::kBool) return all_causal<bool>(mask, true, false);
  TORCH_CHECK(at::isFloatingType(mask.scalar_type()), "mask: expected a bool or floating-point tensor, got ",
              mask.scalar_type());
  bool causal = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, mask.scalar_type(), "is_causal_mask", [&] {
    causal = all_causal<scalar_t>(mask, static_cast<scalar_t>(-std::numeric_limits<float>::infinity()),
                                  static_cast<scalar_t>(0));
  });
  return causal;
}

}  // namespace fasttrans::cpu
