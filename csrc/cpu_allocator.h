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

#include <vector>

namespace fasttrans::cpu {

// at::empty / at::zeros for kernel outputs (CPU, contiguous)
at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options);
at::Tensor zeros(at::IntArrayRef sizes, const at::TensorOptions& options);

// [cached bytes, cached blocks, bytes in use, hits, misses, limit bytes]
std::vector<int64_t> cpu_cache_stats();
void cpu_cache_clear();

}  // namespace fasttrans::cpu
