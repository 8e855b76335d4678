// Sixteen Philox counters at a time, for the CPU kernels (see philox.h for the masks).
//
//   keep_bits16(c0, c1, c2, c3, seed, threshold)          elementwise dropout
//       bit 4l + t = dropout_keep_word(philox4x32_10(c0 + l, c1, c2, c3, seed).w[t], threshold)
//       for lanes l = 0 .. 15 (c0 + l wraps mod 2^32, as the 32-bit counter word does)
//   attention_keep_bits64(i, h, b, c, seed, threshold)   attention dropout
//       bit k = attention_dropout_keep(seed, threshold, b, h, i, 16 c + k), k = 0 .. 63
//
// so one call decides 64 consecutive elements of a row. AVX-512 evaluates the 16 counters in
// the lanes of one register, AVX2 in two: a handful of vector instructions per element instead
// of the ~25 scalar ones of a counter-at-a-time loop. Other targets take the scalar
// philox4x32_10. An attention row uses two of each counter's four words (the other two are
// row i + 8's or i - 8's), so it costs what elementwise dropout does per element.
#pragma once

#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
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

// Lane l = 4 c' + t of the counters (gi, h, b, 4 c + l) decides keys 16 (c + c') + 2 t + 8 rj + pj
// of row i by half pj of word 2 ri + rj (ri = (i div 8) mod 2).
inline uint64_t attention_keep_bits64_scalar(int64_t i, uint32_t h, uint32_t b, int64_t c, uint64_t seed,
                                             uint32_t threshold) {
  const uint32_t gi = static_cast<uint32_t>(8 * (i >> 4) + (i & 7)), ri = static_cast<uint32_t>((i >> 3) & 1);
  uint64_t bits = 0;
  for (uint32_t l = 0; l < 16; ++l) {
    const Philox4 r = philox4x32_10(gi, h, b, static_cast<uint32_t>(4 * c) + l, static_cast<uint32_t>(seed),
                                    static_cast<uint32_t>(seed >> 32));
    const uint32_t at = 16 * (l >> 2) + 2 * (l & 3);
    for (uint32_t rj = 0; rj < 2; ++rj) {
      const uint32_t w = r.w[2 * ri + rj];
      bits |= static_cast<uint64_t>((w & 0xFFFFu) >= threshold) << (at + 8 * rj);
      bits |= static_cast<uint64_t>((w >> 16) >= threshold) << (at + 8 * rj + 1);
    }
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

// Philox4x32-10 of the 16 counters in the lanes of c[0..3], in place.
inline void philox16_avx512(__m512i* c, uint64_t seed) {
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int>(0xCD9E8D57u));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    __m512i lo0, lo1;
    const __m512i hi0 = philox_mulhilo(c[0], m0, &lo0);
    const __m512i hi1 = philox_mulhilo(c[2], m1, &lo1);
    c[0] = _mm512_xor_si512(_mm512_xor_si512(hi1, c[1]), _mm512_set1_epi32(static_cast<int>(k0)));
    c[1] = lo1;
    c[2] = _mm512_xor_si512(_mm512_xor_si512(hi0, c[3]), _mm512_set1_epi32(static_cast<int>(k1)));
    c[3] = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

inline __m512i lanes_from(uint32_t base) {
  return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(base)),
                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

inline uint64_t keep_bits16_avx512(uint32_t c0_base, uint32_t c1_all, uint32_t c2_all, uint32_t c3_all,
                                   uint64_t seed, uint32_t threshold) {
  __m512i c[4] = {lanes_from(c0_base), _mm512_set1_epi32(static_cast<int>(c1_all)),
                  _mm512_set1_epi32(static_cast<int>(c2_all)), _mm512_set1_epi32(static_cast<int>(c3_all))};
  philox16_avx512(c, seed);
  // word t of lane l decides element 4l + t: spread each 16-bit mask over every 4th bit
  const __m512i thr = _mm512_set1_epi32(static_cast<int>(threshold));
  uint64_t bits = 0;
  constexpr uint64_t kEvery4th = 0x1111111111111111ull;
  for (int t = 0; t < 4; ++t) bits |= _pdep_u64(_mm512_cmpge_epu32_mask(_mm512_srli_epi32(c[t], 8), thr), kEvery4th << t);
  return bits;
}

inline uint64_t attention_keep_bits64_avx512(int64_t i, uint32_t h, uint32_t b, int64_t c, uint64_t seed,
                                             uint32_t threshold) {
  const uint32_t gi = static_cast<uint32_t>(8 * (i >> 4) + (i & 7)), ri = static_cast<uint32_t>((i >> 3) & 1);
  __m512i w[4] = {_mm512_set1_epi32(static_cast<int>(gi)), _mm512_set1_epi32(static_cast<int>(h)),
                  _mm512_set1_epi32(static_cast<int>(b)), lanes_from(static_cast<uint32_t>(4 * c))};
  philox16_avx512(w, seed);
  // lane l = 4 c' + t: keys 16 c' + 2 t (+ 8 rj + pj), the set bits of kPairs (+ 8 rj + pj)
  const __m512i thr = _mm512_set1_epi32(static_cast<int>(threshold));
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  constexpr uint64_t kPairs = 0x0055005500550055ull;
  uint64_t bits = 0;
  for (uint32_t rj = 0; rj < 2; ++rj) {
    const __m512i word = w[2 * ri + rj];
    bits |= _pdep_u64(_mm512_cmpge_epu32_mask(_mm512_and_si512(word, low16), thr), kPairs << (8 * rj));
    bits |= _pdep_u64(_mm512_cmpge_epu32_mask(_mm512_srli_epi32(word, 16), thr), kPairs << (8 * rj + 1));
  }
  return bits;
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// Bit l of m (l < 16) moved to bit 4 l: _pdep_u64(m, 0x1111111111111111) without BMI2's pdep,
// which some AVX2 CPUs (AMD Zen 1 and 2) run in microcode.
inline uint64_t spread_every_4th(uint64_t x) {
  x = (x | (x << 24)) & 0x000000FF000000FFull;
  x = (x | (x << 12)) & 0x000F000F000F000Full;
  x = (x | (x << 6)) & 0x0303030303030303ull;
  return (x | (x << 3)) & 0x1111111111111111ull;
}

// Bit l = 4 c + t of m moved to bit 16 c + 2 t: _pdep_u64(m, 0x0055005500550055).
inline uint64_t spread_pairs(uint64_t x) {
  x = (x | (x << 24)) & 0x000000FF000000FFull;
  x = (x | (x << 12)) & 0x000F000F000F000Full;
  x = (x | (x << 2)) & 0x0033003300330033ull;
  return (x | (x << 1)) & 0x0055005500550055ull;
}

// philox_mulhilo for the 8 lanes of an AVX2 register.
inline __m256i philox_mulhilo(__m256i a, __m256i k, __m256i* lo) {
  const __m256i even = _mm256_mul_epu32(a, k);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), k);
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  return _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// Philox4x32-10 of 16 counters, lanes 0-7 in c[w][0] and 8-15 in c[w][1], in place; the two
// halves interleave so that each hides the other's multiply latency.
inline void philox16_avx2(__m256i (&c)[4][2], uint64_t seed) {
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const __m256i key0 = _mm256_set1_epi32(static_cast<int>(k0)), key1 = _mm256_set1_epi32(static_cast<int>(k1));
    for (int g = 0; g < 2; ++g) {
      __m256i lo0, lo1;
      const __m256i hi0 = philox_mulhilo(c[0][g], m0, &lo0);
      const __m256i hi1 = philox_mulhilo(c[2][g], m1, &lo1);
      c[0][g] = _mm256_xor_si256(_mm256_xor_si256(hi1, c[1][g]), key0);
      c[1][g] = lo1;
      c[2][g] = _mm256_xor_si256(_mm256_xor_si256(hi0, c[3][g]), key1);
      c[3][g] = lo0;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

// Bit l of the result: lane l of x >= threshold, for x and threshold below 2^31 (signed
// compares suffice: AVX2 has no unsigned one).
inline uint64_t lanes_at_least(__m256i x0, __m256i x1, uint32_t threshold) {
  const __m256i below = _mm256_set1_epi32(static_cast<int>(threshold) - 1);
  const auto mask = [&](__m256i x) {
    return static_cast<uint64_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(x, below))));
  };
  return mask(x0) | (mask(x1) << 8);
}

inline void lanes_from(uint32_t base, __m256i (&c)[2]) {
  const __m256i b = _mm256_set1_epi32(static_cast<int>(base));
  c[0] = _mm256_add_epi32(b, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  c[1] = _mm256_add_epi32(b, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15));
}

inline uint64_t keep_bits16_avx2(uint32_t c0_base, uint32_t c1_all, uint32_t c2_all, uint32_t c3_all,
                                 uint64_t seed, uint32_t threshold) {
  __m256i c[4][2];
  lanes_from(c0_base, c[0]);
  for (int g = 0; g < 2; ++g) {
    c[1][g] = _mm256_set1_epi32(static_cast<int>(c1_all));
    c[2][g] = _mm256_set1_epi32(static_cast<int>(c2_all));
    c[3][g] = _mm256_set1_epi32(static_cast<int>(c3_all));
  }
  philox16_avx2(c, seed);
  uint64_t bits = 0;  // word t of lane l decides element 4 l + t
  for (int t = 0; t < 4; ++t) {
    bits |= spread_every_4th(lanes_at_least(_mm256_srli_epi32(c[t][0], 8), _mm256_srli_epi32(c[t][1], 8),
                                            threshold)) << t;
  }
  return bits;
}

inline uint64_t attention_keep_bits64_avx2(int64_t i, uint32_t h, uint32_t b, int64_t c, uint64_t seed,
                                           uint32_t threshold) {
  const uint32_t gi = static_cast<uint32_t>(8 * (i >> 4) + (i & 7)), ri = static_cast<uint32_t>((i >> 3) & 1);
  __m256i w[4][2];
  for (int g = 0; g < 2; ++g) {
    w[0][g] = _mm256_set1_epi32(static_cast<int>(gi));
    w[1][g] = _mm256_set1_epi32(static_cast<int>(h));
    w[2][g] = _mm256_set1_epi32(static_cast<int>(b));
  }
  lanes_from(static_cast<uint32_t>(4 * c), w[3]);
  philox16_avx2(w, seed);
  // lane l = 4 c' + t: keys 16 c' + 2 t (+ 8 rj + pj), as in the AVX-512 version
  const __m256i low16 = _mm256_set1_epi32(0xFFFF);
  uint64_t bits = 0;
  for (uint32_t rj = 0; rj < 2; ++rj) {
    const __m256i* word = w[2 * ri + rj];
    bits |= spread_pairs(lanes_at_least(_mm256_and_si256(word[0], low16), _mm256_and_si256(word[1], low16),
                                        threshold)) << (8 * rj);
    bits |= spread_pairs(lanes_at_least(_mm256_srli_epi32(word[0], 16), _mm256_srli_epi32(word[1], 16),
                                        threshold)) << (8 * rj + 1);
  }
  return bits;
}
#endif

inline uint64_t keep_bits16(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint64_t seed, uint32_t threshold) {
#if defined(CPU_CAPABILITY_AVX512)
  return keep_bits16_avx512(c0, c1, c2, c3, seed, threshold);
#elif defined(CPU_CAPABILITY_AVX2)
  return keep_bits16_avx2(c0, c1, c2, c3, seed, threshold);
#else
  return keep_bits16_scalar(c0, c1, c2, c3, seed, threshold);
#endif
}

inline uint64_t attention_keep_bits64(int64_t i, uint32_t h, uint32_t b, int64_t c, uint64_t seed, uint32_t threshold) {
#if defined(CPU_CAPABILITY_AVX512)
  return attention_keep_bits64_avx512(i, h, b, c, seed, threshold);
#elif defined(CPU_CAPABILITY_AVX2)
  return attention_keep_bits64_avx2(i, h, b, c, seed, threshold);
#else
  return attention_keep_bits64_scalar(i, h, b, c, seed, threshold);
#endif
}

}  // namespace fasttrans::cpu
