// Output allocation for the CPU kernels: large blocks are kept for reuse when freed.
//
// glibc's malloc hands the top of its heap back to the system once enough of it is free
// and maps big blocks afresh, so an op whose large outputs are freed together (the two
// outputs of add_layer_norm, the three gradients of attention) can page-fault every byte
// of them again on the next call. The kernels' outputs of `kMinCachedBytes` or more come
// from a small cache of freed blocks instead: the next call of a similar size reuses the
// pages already mapped. Only fasttrans's own blocks are cached (nothing process-wide is
// changed); the cache holds at most FASTTRANS_CPU_CACHE_MB (default 256, 0 turns it off)
// of freed memory, oldest out first, and `cpu_cache_clear` returns it all.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <cstddef>
#include <vector>

namespace fasttrans::cpu {

// Blocks of this size or more are cached. Smaller ones stay with torch's allocator: faulting
// a few pages back in costs little next to the call, and every cached block is memory torch's
// allocations cannot reuse.
constexpr size_t kMinCachedBytes = size_t{1} << 20;

// at::empty / at::zeros for kernel outputs (CPU, contiguous)
at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options);
at::Tensor zeros(at::IntArrayRef sizes, const at::TensorOptions& options);

// A kernel's working memory for one call, n elements of T: from the cache when it is big
// enough to be cached (so a loop of calls does not fault it back in), from malloc otherwise.
template <typename T>
class ScratchBuffer {
 public:
  ScratchBuffer() = default;
  explicit ScratchBuffer(size_t n) {
    if (n * sizeof(T) >= kMinCachedBytes) {
      block_ = empty({static_cast<int64_t>(n * sizeof(T))}, at::TensorOptions().dtype(at::kByte));
      data_ = static_cast<T*>(block_.data_ptr());
    } else {
      small_.resize(n);
      data_ = small_.data();
    }
  }
  ScratchBuffer(const ScratchBuffer&) = delete;  // a copy's data_ would point at the original's buffer
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  ScratchBuffer(ScratchBuffer&&) = default;
  ScratchBuffer& operator=(ScratchBuffer&&) = default;
  T* data() { return data_; }

 private:
  at::Tensor block_;
  std::vector<T> small_;
  T* data_ = nullptr;
};

// [cached bytes, cached blocks, bytes in use, hits, misses, limit bytes]
std::vector<int64_t> cpu_cache_stats();
void cpu_cache_clear();

}  // namespace fasttrans::cpu
