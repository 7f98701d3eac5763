// The ymm helpers both row-group GEMVs use (row_groups.h, row_groups_k.h): a 4-byte quad of one activation
// block broadcast to 8 lanes, and the 4-product int32 sums of unsigned codes with signed activations per
// lane: vpdpbusd where the CPU has it (AVX512-VL or AVX-VNNI), else vpmaddubsw + vpmaddwd (exact while
// the pair sums fit int16: the callers keep codes below 128 on that path).
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace perfxlm_row_dots {

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

inline __m256i quad(const int8_t* xq, int v) {
  int32_t w;
  std::memcpy(&w, xq + 4 * v, 4);
  return _mm256_set1_epi32(w);
}

}  // namespace perfxlm_row_dots
#endif
