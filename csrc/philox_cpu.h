// Sixteen Philox counters at a time, for the CPU kernels (see philox.h for the mask itself).
//
//   keep_bits16(c0, c1, c2, c3, seed, threshold)
//       bit 4l + t = dropout_keep_word(philox4x32_10(c0 + l, c1, c2, c3, seed).w[t], threshold)
//       for lanes l = 0 .. 15 (c0 + l wraps mod 2^32, as the 32-bit counter word does)
//
// so one call decides 64 consecutive elements of a row. AVX-512 evaluates the 16 counters in
// the lanes of one register: a handful of vector instructions per element instead of the ~25
// scalar ones of a counter-at-a-time loop. Without AVX-512 the same bits come from the scalar
// philox4x32_10.
#pragma once

#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "philox.h"

namespace fasttrans::cpu {

inline uint64_t keep_bits16_scalar(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint64_t seed,
                                   uint32_t threshold) {
  uint64_t bits = 0;
  for (uint32_t l = 0; l < 16; ++l) {
    const Philox4 r = philox4x32_10(c0 + l, c1, c2, c3, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
    for (int t = 0; t < 4; ++t) bits |= static_cast<uint64_t>(dropout_keep_word(r.w[t], threshold)) << (4 * l + t);
  }
  return bits;
}

#if defined(CPU_CAPABILITY_AVX512)
// 32 x 32 -> 64-bit products of the 16 lanes of a with k: the high words (returned) and the
// low words (*lo). vpmuludq multiplies the even lanes; the odd lanes are shifted down first.
inline __m512i philox_mulhilo(__m512i a, __m512i k, __m512i* lo) {
  const __m512i even = _mm512_mul_epu32(a, k);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), k);
  *lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  return _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

inline uint64_t keep_bits16_avx512(uint32_t c0_base, uint32_t c1_all, uint32_t c2_all, uint32_t c3_all,
                                   uint64_t seed, uint32_t threshold) {
  __m512i c0 = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(c0_base)),
                                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  __m512i c1 = _mm512_set1_epi32(static_cast<int>(c1_all));
  __m512i c2 = _mm512_set1_epi32(static_cast<int>(c2_all));
  __m512i c3 = _mm512_set1_epi32(static_cast<int>(c3_all));
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int>(0xCD9E8D57u));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    __m512i lo0, lo1;
    const __m512i hi0 = philox_mulhilo(c0, m0, &lo0);
    const __m512i hi1 = philox_mulhilo(c2, m1, &lo1);
    c0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1), _mm512_set1_epi32(static_cast<int>(k0)));
    c1 = lo1;
    c2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3), _mm512_set1_epi32(static_cast<int>(k1)));
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  // word t of lane l decides element 4l + t: spread each 16-bit mask over every 4th bit
  const __m512i thr = _mm512_set1_epi32(static_cast<int>(threshold));
  const uint64_t w0 = _mm512_cmpge_epu32_mask(_mm512_srli_epi32(c0, 8), thr);
  const uint64_t w1 = _mm512_cmpge_epu32_mask(_mm512_srli_epi32(c1, 8), thr);
  const uint64_t w2 = _mm512_cmpge_epu32_mask(_mm512_srli_epi32(c2, 8), thr);
  const uint64_t w3 = _mm512_cmpge_epu32_mask(_mm512_srli_epi32(c3, 8), thr);
  constexpr uint64_t kEvery4th = 0x1111111111111111ull;
  return _pdep_u64(w0, kEvery4th) | _pdep_u64(w1, kEvery4th << 1) | _pdep_u64(w2, kEvery4th << 2) |
         _pdep_u64(w3, kEvery4th << 3);
}
#endif

inline uint64_t keep_bits16(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint64_t seed, uint32_t threshold) {
#if defined(CPU_CAPABILITY_AVX512)
  return keep_bits16_avx512(c0, c1, c2, c3, seed, threshold);
#else
  return keep_bits16_scalar(c0, c1, c2, c3, seed, threshold);
#endif
}

}  // namespace fasttrans::cpu
