// Elementwise dropout on the CPU, forward and backward.
//
//     keep[i] = dropout_keep_word(flat_dropout_words(seed, i / 4).w[i % 4], threshold)   (philox.h)
//     y[i]    = x[i] * (keep[i] ? scale : 0)       scale = 1 / (1 - p), product in fp32 (fp64)
//     dx[i]   = dy[i] * (keep[i] ? scale : 0)      from the saved keep bytes: no second RNG pass
// (a product, not a select: a dropped inf or NaN gives NaN, as torch's dropout does)
//
// The elements of the contiguous tensor are processed in blocks of 64: one block is 16
// Philox counters (four words each), evaluated at once by keep_bits16 (philox_cpu.h). The
// block's keep decisions become one 64-bit mask that drives masked multiplies and the
// keep-byte store. The mask depends only on
// (seed, element index): the same bits on any thread count, and the same bits as the CUDA
// kernel (dropout_cuda.cu), which evaluates the same counters.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "checks.h"
#include "common.h"
#include "cpu_allocator.h"
#include "ops.h"
#include "philox_cpu.h"

namespace fasttrans::cpu {
namespace {

constexpr int64_t kBlock = 64;           // elements per block: 16 counters x 4 words
constexpr int64_t kGrainBlocks = 1024;   // blocks per parallel task (64K elements)

// Bit e of the result is keep(64 * blk + e), for one block of 64 elements: counters
// 16 blk .. 16 blk + 15, whose 64-bit index is split over the first two counter words.
inline uint64_t keep_bits(uint64_t seed, uint32_t threshold, uint64_t blk) {
  const uint64_t g0 = blk * 16;
  // keep_bits16 steps the first word only: a block that straddles a multiple of 2^32
  // counters (the high word changes inside it) takes its counters one at a time
  if ((g0 >> 32) == ((g0 + 15) >> 32)) {
    return keep_bits16(static_cast<uint32_t>(g0), static_cast<uint32_t>(g0 >> 32), 0u, kFlatDomain, seed, threshold);
  }
  uint64_t bits = 0;
  for (int l = 0; l < 16; ++l) {
    const Philox4 r = flat_dropout_words(seed, g0 + l);
    for (int t = 0; t < 4; ++t) bits |= static_cast<uint64_t>(dropout_keep_word(r.w[t], threshold)) << (4 * l + t);
  }
  return bits;
}

#if defined(CPU_CAPABILITY_AVX2)
// keep[e] = bit e of bits, for e < 64: byte e of a register takes byte e / 8 of the mask, then
// tests its own bit of it.
inline void store_keep_bytes(uint64_t bits, bool* keep) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  for (int half = 0; half < 2; ++half) {
    // shuffle_epi8 stays within 128-bit lanes: each holds all four bytes of the broadcast word
    const __m256i word = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(bits >> (32 * half))));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(word, spread), bit), bit);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(keep + 32 * half), _mm256_and_si256(set, _mm256_set1_epi8(1)));
  }
}
#endif

// out[e] = keep bit e ? in[e] * scale : 0 for the n <= 64 elements of one block, and the keep
// bytes when keep_out is given.
template <typename scalar_t>
inline void apply_block(const scalar_t* in, scalar_t* out, bool* keep_out, uint64_t bits, int64_t n,
                        acc_t<scalar_t> scale) {
#if defined(CPU_CAPABILITY_AVX512)
  if (n == kBlock) {
    if (keep_out != nullptr) _mm512_storeu_si512(keep_out, _mm512_maskz_set1_epi8(bits, 1));
    if constexpr (std::is_same_v<scalar_t, float>) {
      const __m512 s = _mm512_set1_ps(scale);
      for (int q = 0; q < 4; ++q) {
        // x * (scale or 0), not a masked select: a dropped inf or NaN gives NaN, as in torch
        const __m512 f = _mm512_maskz_mov_ps(static_cast<__mmask16>(bits >> (16 * q)), s);
        _mm512_storeu_ps(out + 16 * q, _mm512_mul_ps(_mm512_loadu_ps(in + 16 * q), f));
      }
      return;
    }
    keep_out = nullptr;  // written above
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if (n == kBlock) {
    // lane e of a group of 8 tests bit e of the group's byte of the mask
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    if (keep_out != nullptr) store_keep_bytes(bits, keep_out);
    if constexpr (std::is_same_v<scalar_t, float>) {
      const __m256 s = _mm256_set1_ps(scale);
      for (int q = 0; q < 8; ++q) {
        const __m256i byte = _mm256_set1_epi32(static_cast<int>((bits >> (8 * q)) & 0xFF));
        const __m256i kept = _mm256_cmpeq_epi32(_mm256_and_si256(byte, lane_bit), lane_bit);
        // x * (scale or 0), not a masked select: a dropped inf or NaN gives NaN, as in torch
        const __m256 f = _mm256_and_ps(_mm256_castsi256_ps(kept), s);
        _mm256_storeu_ps(out + 8 * q, _mm256_mul_ps(_mm256_loadu_ps(in + 8 * q), f));
      }
      return;
    }
    keep_out = nullptr;  // written above
  }
#endif
  using T = acc_t<scalar_t>;
  for (int64_t e = 0; e < n; ++e) {
    const bool kept = (bits >> e) & 1u;
    if (keep_out != nullptr) keep_out[e] = kept;
    out[e] = static_cast<scalar_t>(static_cast<T>(in[e]) * (kept ? scale : T(0)));
  }
}

// The bits of a block from its keep bytes (backward).
inline uint64_t bits_from_bytes(const bool* keep, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  if (n == kBlock) return _mm512_test_epi8_mask(_mm512_loadu_si512(keep), _mm512_set1_epi8(1));
#elif defined(CPU_CAPABILITY_AVX2)
  if (n == kBlock) {
    // bit 0 of each byte shifted into its sign bit, which movemask collects
    const auto half = [&](int h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keep + 32 * h));
      return static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(v, 7))));
    };
    return half(0) | (half(1) << 32);
  }
#endif
  uint64_t bits = 0;
  for (int64_t e = 0; e < n; ++e) bits |= static_cast<uint64_t>(keep[e]) << e;
  return bits;
}

void check_probability(double p) {
  TORCH_CHECK(p > 0.0 && p < 1.0, "p: expected a dropout probability in (0, 1), got ", p);
}

// out = in * (keep ? scale : 0), block by block in parallel, with bits_of(blk, e0, n) giving
// the keep bits of a block; keep_out (forward) receives them as bytes.
template <typename BitsOf>
void scale_blocks(const at::Tensor& in, at::Tensor& out, bool* keep_out, double p, const BitsOf& bits_of) {
  const int64_t numel = in.numel();
  const int64_t n_blocks = (numel + kBlock - 1) / kBlock;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.scalar_type(), "dropout_extension", [&] {
    const auto scale = static_cast<acc_t<scalar_t>>(1.0 / (1.0 - p));
    const scalar_t* src = in.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, n_blocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t e0 = blk * kBlock, n = std::min(kBlock, numel - e0);
        apply_block<scalar_t>(src + e0, dst + e0, keep_out ? keep_out + e0 : nullptr, bits_of(blk, e0, n), n, scale);
      }
    });
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> dropout_fwd(const at::Tensor& x_in, double p, int64_t seed) {
  check_probability(p);
  TORCH_CHECK(at::isFloatingType(x_in.scalar_type()), "x: expected a floating-point dtype, got ",
              x_in.scalar_type());
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = cpu::empty(x.sizes(), x.options());
  at::Tensor keep = cpu::empty(x.sizes(), x.options().dtype(at::kBool));
  const uint32_t threshold = dropout_threshold(p);
  const uint64_t useed = static_cast<uint64_t>(seed);
  scale_blocks(x, y, keep.data_ptr<bool>(), p, [&](int64_t blk, int64_t, int64_t) {
    return keep_bits(useed, threshold, static_cast<uint64_t>(blk));
  });
  return {y, keep};
}

at::Tensor dropout_bwd(const at::Tensor& dy_in, const at::Tensor& keep_in, double p) {
  check_probability(p);
  checks::floating(dy_in, "dy");
  TORCH_CHECK(keep_in.scalar_type() == at::kBool, "keep: expected a bool tensor, got ", keep_in.scalar_type());
  TORCH_CHECK(keep_in.sizes() == dy_in.sizes(), "keep: expected the shape of dy ", dy_in.sizes(), ", got ",
              keep_in.sizes());
  const at::Tensor dy = dy_in.contiguous();
  const at::Tensor keep = keep_in.contiguous();
  at::Tensor dx = cpu::empty(dy.sizes(), dy.options());
  const bool* kp = keep.data_ptr<bool>();
  scale_blocks(dy, dx, nullptr, p, [&](int64_t, int64_t e0, int64_t n) { return bits_from_bytes(kp + e0, n); });
  return dx;
}

}  // namespace fasttrans::cpu
