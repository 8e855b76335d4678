// Counter-based random numbers for dropout, shared by the CPU and CUDA kernels.
//
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011):
// a keyed bijection of a 128-bit counter. Dropout needs no generator state at all: the
// keep decision for score (b, h, i, j) is a pure function of (seed, b, h, i, j), so the
// backward pass regenerates exactly the mask of the forward pass, every device computes the
// same mask, and the order in which threads visit tiles does not matter.
//
// Attention:
//   key     = (seed mod 2^32, seed div 2^32)
//   counter = (8 (i div 16) + i mod 8, h, b, 4 (j div 16) + (j mod 8) div 2)
//   word    = philox(counter, key)[2 ((i div 8) mod 2) + (j div 8) mod 2]
//   draw    = 16-bit half (j mod 2) of word (0: bits 0..15, 1: bits 16..31)
//   keep    = draw >= threshold      threshold = min(round(p * 2^16), 2^16 - 1)
// One call decides rows (i, i + 8) x keys (j, j + 1, j + 8, j + 9) of a 16 x 16 block: the
// eight scores one GPU thread holds in the tensor-core accumulator layouts, so a Triton
// kernel draws its tile with one call per eight scores and no data movement.
//
// Elementwise dropout (fasttrans::dropout_fwd) numbers the elements of a contiguous tensor
// 0, 1, 2, ... and uses the counter (g mod 2^32, g div 2^32, 0, kFlatDomain) for elements
// 4g .. 4g+3, keeping word t when (word >> 8) >= round(p * 2^24): the constant last word
// keeps its counters apart from attention's.
//
// Draws are compared as integers, so the CPU and CUDA builds agree bit for bit (no float
// rounding is involved). P(keep) = 1 - threshold / 2^16 (attention), 1 - threshold / 2^24
// (elementwise).
//
// Plain C++ with no torch and no CUDA headers, so it compiles in both translation-unit kinds.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FT_HOST_DEVICE inline
#endif

namespace fasttrans {

struct Philox4 {
  uint32_t w[4];
};

// One Philox4x32-10 evaluation (the Random123 reference constants).
FT_HOST_DEVICE Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// round(p * 2^24) for a dropout probability p in [0, 1) (elementwise); computed once on the host.
inline uint32_t dropout_threshold(double p) {
  const double t = p * 16777216.0 + 0.5;
  return t >= 16777216.0 ? 16777216u : static_cast<uint32_t>(t);
}

// min(round(p * 2^16), 2^16 - 1) for attention's dropout probability p in [0, 1).
inline uint32_t attention_dropout_threshold(double p) {
  const double t = p * 65536.0 + 0.5;
  return t >= 65535.0 ? 65535u : static_cast<uint32_t>(t);
}

// The four Philox words of the counter (gi, h, b, gj): rows i with 8 (i div 16) + i mod 8 =
// gi, keys j with 4 (j div 16) + (j mod 8) div 2 = gj, in head h of batch b.
FT_HOST_DEVICE Philox4 attention_dropout_words(uint64_t seed, int64_t b, int64_t h, int64_t gi, int64_t gj) {
  return philox4x32_10(static_cast<uint32_t>(gi), static_cast<uint32_t>(h), static_cast<uint32_t>(b),
                       static_cast<uint32_t>(gj), static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// Last counter word of elementwise dropout ("DROP"); attention's is a key group.
constexpr uint32_t kFlatDomain = 0x44524F50u;

// The four Philox words for elements 4g .. 4g+3 of an elementwise dropout.
FT_HOST_DEVICE Philox4 flat_dropout_words(uint64_t seed, uint64_t g) {
  return philox4x32_10(static_cast<uint32_t>(g), static_cast<uint32_t>(g >> 32), 0u, kFlatDomain,
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

FT_HOST_DEVICE bool dropout_keep_word(uint32_t word, uint32_t threshold) {
  return (word >> 8) >= threshold;
}

// keep(b, h, i, j) of attention: the single-element form (the CPU kernels generate rows).
// The word is picked with selects, not r.w[t]: a dynamic index would put r in local memory
// (a stack frame) on the GPU.
FT_HOST_DEVICE bool attention_dropout_keep(uint64_t seed, uint32_t threshold, int64_t b, int64_t h, int64_t i,
                                           int64_t j) {
  const Philox4 r = attention_dropout_words(seed, b, h, 8 * (i >> 4) + (i & 7), 4 * (j >> 4) + ((j & 7) >> 1));
  const int t = static_cast<int>(2 * ((i >> 3) & 1) + ((j >> 3) & 1));
  const uint32_t word = t == 0 ? r.w[0] : t == 1 ? r.w[1] : t == 2 ? r.w[2] : r.w[3];
  return ((word >> (16 * (j & 1))) & 0xFFFFu) >= threshold;
}

}  // namespace fasttrans
