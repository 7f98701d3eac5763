// The bit planes of 5- and 6-bit codes (perfxlm/quant/code_layout.py): after a row's nibbles, 4 bytes per
// block of 32 elements per plane, read as one little-endian word, element e at bit plane_bit(e). The order
// is chosen for the unpack: the word broadcast to 32-bit lanes, a lane covering the 4 elements of one
// nibble register's 4 bytes, and lane j (j = 0..3 within a block) shifted left by j + 1 (lo nibbles,
// elements 4j..4j + 3) or right by j (hi nibbles, elements 16 + 4j..16 + 4j + 3) leaves each element's bit
// at bit 4 of its own byte. So on AVX2 a plane costs a shift, an and and an or per 32 codes (the natural
// order, llama.cpp's bytes_from_bits_32, takes a byte shuffle, an and, a compare, an and and an or), and on
// AVX-512 one rotate serves both halves.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace perfxlm_planes {

// Element e (0..31) of a block -> its bit in the block's plane word.
constexpr int plane_bit(int e) { return 8 * (e % 4) + (e < 16 ? 3 - e / 4 : 4 + (e - 16) / 4); }

// 1 << plane_bit(e) per element: a lane's own bit, for kernels holding one code per 32-bit lane.
struct alignas(64) LaneBits {
  uint32_t v[32];
};
constexpr LaneBits lane_bits() {
  LaneBits t{};
  for (int e = 0; e < 32; ++e) t.v[e] = 1u << plane_bit(e);
  return t;
}
inline constexpr LaneBits kLaneBits = lane_bits();

// The bit of element k (any k of a row) in the plane starting at `plane`: the scalar definition.
inline int plane_bit_at(const uint8_t* plane, int64_t k) {
  const int p = plane_bit(static_cast<int>(k % 32));
  return (plane[(k / 32) * 4 + p / 8] >> (p % 8)) & 1;
}

#if defined(__AVX2__)
// A chunk's two plane words (blocks A and B, 8 bytes at p) as the 32-bit lanes [A A A A B B B B]: the
// lanes of a nibble register [A x 16 bytes, B x 16 bytes] (the int8 block products' halves).
inline __m256i chunk_words(const uint8_t* p) {
  return _mm256_permutevar8x32_epi32(_mm256_castsi128_si256(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
                                     _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// From chunk_words: 16 (bit 4) in each byte of the lo half [A 0-15, B 0-15] whose element's bit is set,
// else 0; and of the hi half [A 16-31, B 16-31].
inline __m256i lo_fifths(__m256i words) {
  return _mm256_and_si256(_mm256_sllv_epi32(words, _mm256_setr_epi32(1, 2, 3, 4, 1, 2, 3, 4)), _mm256_set1_epi8(0x10));
}
inline __m256i hi_fifths(__m256i words) {
  return _mm256_and_si256(_mm256_srlv_epi32(words, _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3)), _mm256_set1_epi8(0x10));
}
// The same at bit 5 (32: sixth bits). The lo half shifts one further; the hi half would shift right by
// j - 1, which lane 0 cannot, so its bit 4 is doubled.
inline __m256i lo_sixths(__m256i words) {
  return _mm256_and_si256(_mm256_sllv_epi32(words, _mm256_setr_epi32(2, 3, 4, 5, 2, 3, 4, 5)), _mm256_set1_epi8(0x20));
}
inline __m256i hi_sixths(__m256i words) {
  const __m256i b = hi_fifths(words);
  return _mm256_add_epi8(b, b);
}

// One block's 32 elements in order (bytes 0..31) from its plane word: 16 where the element's bit is set.
inline __m256i block_fifths(uint32_t word) {
  const __m256i w = _mm256_set1_epi32(static_cast<int>(word));
  const __m256i shifted = _mm256_blend_epi32(_mm256_sllv_epi32(w, _mm256_setr_epi32(1, 2, 3, 4, 0, 0, 0, 0)),
                                             _mm256_srlv_epi32(w, _mm256_setr_epi32(0, 0, 0, 0, 0, 1, 2, 3)), 0xF0);
  return _mm256_and_si256(shifted, _mm256_set1_epi8(0x10));
}
#endif

#if defined(__AVX512F__)
// A chunk's two plane words as the 32-bit lanes of a zmm of codes [lo half | hi half] (4-bit codes
// unpacked as the AVX-512 block products hold them): [A x4, B x4, A x4, B x4].
inline __m512i chunk_words512(const uint8_t* p) {
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1),
                                  _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// u | each byte's plane bit at bit 4 (fifths) or 5 (sixths), from chunk_words512: one rotate per 64
// codes (left by j + 1 in the lo half, right by j in the hi half; one further left for bit 5) and one
// ternary logic op (u | (rotated & bit)).
inline __m512i or_fifths512(__m512i u, __m512i words) {
  const __m512i r = _mm512_rolv_epi32(words, _mm512_setr_epi32(1, 2, 3, 4, 1, 2, 3, 4, 0, 31, 30, 29, 0, 31, 30, 29));
  return _mm512_ternarylogic_epi32(u, r, _mm512_set1_epi8(0x10), 0xF8);  // a | (b & c)
}
inline __m512i or_sixths512(__m512i u, __m512i words) {
  const __m512i r = _mm512_rolv_epi32(words, _mm512_setr_epi32(2, 3, 4, 5, 2, 3, 4, 5, 1, 0, 31, 30, 1, 0, 31, 30));
  return _mm512_ternarylogic_epi32(u, r, _mm512_set1_epi8(0x20), 0xF8);
}
#endif

}  // namespace perfxlm_planes
