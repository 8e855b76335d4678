// Argument checks shared by the CPU and CUDA entry points. The registered ops are public
// (torch.ops.fasttrans.*) and skip fasttrans.functional's Python checks, so each error
// names the argument at fault, as those checks do.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <array>
#include <optional>

namespace fasttrans::checks {

// attn_mask must broadcast to (B, H, Lq, Lk) under torch's rules (trailing dims aligned).
inline void mask_broadcasts(const at::Tensor& mask, int64_t B, int64_t H, int64_t Lq, int64_t Lk) {
  const std::array<int64_t, 4> want{B, H, Lq, Lk};
  bool ok = mask.dim() <= 4;
  for (int64_t i = 1; ok && i <= mask.dim(); ++i) {
    const int64_t got = mask.size(-i);
    ok = got == 1 || got == want[4 - i];
  }
  TORCH_CHECK(ok, "attn_mask: expected a shape that broadcasts to (B, H, Lq, Lk) = (", B, ", ", H, ", ", Lq, ", ",
              Lk, "), got ", mask.sizes());
}

// key_lengths: one length per batch entry.
inline void key_lengths_shape(const at::Tensor& key_lengths, int64_t B) {
  TORCH_CHECK(key_lengths.dim() == 1 && key_lengths.size(0) == B, "key_lengths: expected shape (", B, ",), got ",
              key_lengths.sizes());
}

inline void floating(const at::Tensor& t, const char* name) {
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), name, ": expected a floating-point dtype, got ", t.scalar_type());
}

// weight / bias of a norm over rows of N: N elements when given.
inline void param_numel(const std::optional<at::Tensor>& p, const char* name, int64_t N) {
  if (!p.has_value() || !p->defined()) return;
  TORCH_CHECK(p->numel() == N, name, ": expected ", N, " elements (the normalized size), got shape ", p->sizes());
}

}  // namespace fasttrans::checks
