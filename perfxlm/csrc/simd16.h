// 16 float32 lanes, loaded from float32 or bfloat16 memory: one zmm register with AVX-512, two ymm
// registers with AVX2 + FMA. The GEMV/GEMM kernels are written once against this, so a CPU without
// AVX-512 (plain AVX2: older Xeons, Zen 2/3, client cores) runs the same register tiling at half the
// width instead of scalar loops. `n` arguments are the lanes still valid at a tail (>= 16: all).
#pragma once

#include <cstdint>
#include <cstring>

#include "code_planes.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PERFXLM_SIMD16 1

namespace simd16 {
constexpr bool kAvx512 = true;
struct V {
  __m512 v;
};
inline __mmask16 mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}
inline V zero() { return {_mm512_setzero_ps()}; }
inline V set1(float a) { return {_mm512_set1_ps(a)}; }
inline V load(const float* p, int64_t n = 16) { return {_mm512_maskz_loadu_ps(mask(n), p)}; }
inline V load(const uint16_t* p, int64_t n = 16) {
  const __m256i half = _mm256_maskz_loadu_epi16(mask(n), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16))};
}
// A panel row of 16 bf16 weights (csrc/cpu_kernels.cpp's packed layout) in the lane order `panel_order`
// undoes: here the natural order.
inline V load_panel(const uint16_t* p) { return load(p); }
inline V panel_order(V a) { return a; }
inline V fmadd(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V add(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
inline void store(float* p, V a, int64_t n = 16) { _mm512_mask_storeu_ps(p, mask(n), a.v); }
inline float reduce_add(V a) { return _mm512_reduce_add_ps(a.v); }
// 16 lanes rounded to bfloat16 (to nearest even, as torch's conversion; the values are finite).
inline void store_bf16(uint16_t* p, V a, int64_t n = 16) {
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_mask_storeu_epi16(p, mask(n), _mm512_cvtepi32_epi16(r));
}

// 16 int32 lanes holding small unsigned weight codes (quantized weights, csrc/quant_linear.cpp).
struct I {
  __m512i v;
};
inline I load_u8(const uint8_t* p, int64_t n = 16) { return {_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask(n), p))}; }
// 16 bytes of 4-bit codes: low nibbles are elements 0..15, high nibbles 16..31 (GGUF's Q4 block order).
inline void load_nibbles(const uint8_t* p, I& lo, I& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  lo = {_mm512_cvtepu8_epi32(_mm_and_si128(b, m))};
  hi = {_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m))};
}
inline V to_float(I a) { return {_mm512_cvtepi32_ps(a.v)}; }
// 5-bit codes: 16 added to the lanes whose bit is set in a block's plane word (code_planes.h), the lanes
// being the block's elements 16 half..16 half + 15; 6-bit codes' sixth bits: 32.
inline I add_plane_bits(I a, uint32_t word, int half, int value = 16) {
  const __m512i own = _mm512_load_si512(perfxlm_planes::kLaneBits.v + 16 * half);
  const __mmask16 set = _mm512_test_epi32_mask(_mm512_set1_epi32(static_cast<int>(word)), own);
  return {_mm512_mask_add_epi32(a.v, set, a.v, _mm512_set1_epi32(value))};
}
// table[code] per lane, codes 0..15 (NF4's levels).
struct Table16 {
  __m512 t;
  explicit Table16(const float* p) : t(_mm512_loadu_ps(p)) {}
};
inline V lookup(const Table16& table, I a) { return {_mm512_permutexvar_ps(a.v, table.t)}; }
}  // namespace simd16

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PERFXLM_SIMD16 1

namespace simd16 {
constexpr bool kAvx512 = false;
struct V {
  __m256 lo, hi;
};
inline V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// Tails go through a zeroed 16-lane buffer: rare (only when K or N is not a multiple of 16).
template <typename T>
inline V load_tail(const T* p, int64_t n);
inline V load(const float* p, int64_t n = 16) {
  if (n >= 16) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  return load_tail(p, n);
}
inline V load(const uint16_t* p, int64_t n = 16) {
  if (n >= 16) return {widen8(p), widen8(p + 8)};
  return load_tail(p, n);
}
template <typename T>
inline V load_tail(const T* p, int64_t n) {
  T buf[16] = {};
  std::memcpy(buf, p, static_cast<size_t>(n > 0 ? n : 0) * sizeof(T));
  return load(buf, 16);
}
// A panel row of 16 bf16 weights in one 32-byte load, widened as [even columns, odd columns]: a shift and
// an and instead of two loads, two zero-extensions and two shifts. Lanes are independent columns, so
// the kernel accumulates in that order and `panel_order` restores column order once per tile.
inline V load_panel(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
inline V panel_order(V a) {
  const __m256 lo = _mm256_unpacklo_ps(a.lo, a.hi), hi = _mm256_unpackhi_ps(a.lo, a.hi);  // [0-3 | 8-11], [4-7 | 12-15]
  return {_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)};
}
inline V fmadd(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V add(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline void store(float* p, V a, int64_t n = 16) {
  if (n >= 16) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
    return;
  }
  float buf[16];
  _mm256_storeu_ps(buf, a.lo);
  _mm256_storeu_ps(buf + 8, a.hi);
  std::memcpy(p, buf, static_cast<size_t>(n > 0 ? n : 0) * sizeof(float));
}
inline __m256i round_bf16(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
}
inline void store_bf16(uint16_t* p, V a, int64_t n = 16) {
  // packus interleaves 128-bit lanes: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> permute back to order
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(round_bf16(a.lo), round_bf16(a.hi)), 0xD8);
  if (n >= 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
    return;
  }
  uint16_t buf[16];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf), packed);
  std::memcpy(p, buf, static_cast<size_t>(n > 0 ? n : 0) * sizeof(uint16_t));
}
inline float reduce_add(V a) {
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

struct I {
  __m256i lo, hi;
};
inline I load_u8(const uint8_t* p, int64_t n = 16) {
  __m128i b;
  if (n >= 16) {
    b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    uint8_t buf[16] = {};
    std::memcpy(buf, p, static_cast<size_t>(n > 0 ? n : 0));
    b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf));
  }
  return {_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))};
}
inline void load_nibbles(const uint8_t* p, I& lo, I& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  const __m128i l = _mm_and_si128(b, m), h = _mm_and_si128(_mm_srli_epi16(b, 4), m);
  lo = {_mm256_cvtepu8_epi32(l), _mm256_cvtepu8_epi32(_mm_srli_si128(l, 8))};
  hi = {_mm256_cvtepu8_epi32(h), _mm256_cvtepu8_epi32(_mm_srli_si128(h, 8))};
}
inline V to_float(I a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
// 5-bit codes: 16 added to the lanes whose bit is set in a block's plane word (code_planes.h), the lanes
// being the block's elements 16 half..16 half + 15: each lane tests its own bit of the broadcast word.
// 6-bit codes' sixth bits: 32.
inline I add_plane_bits(I a, uint32_t word, int half, int value = 16) {
  const uint32_t* own = perfxlm_planes::kLaneBits.v + 16 * half;
  const __m256i own0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(own));
  const __m256i own1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(own + 8));
  const __m256i sixteen = _mm256_set1_epi32(value);
  const __m256i b = _mm256_set1_epi32(static_cast<int>(word));
  const __m256i m0 = _mm256_cmpeq_epi32(_mm256_and_si256(b, own0), own0);
  const __m256i m1 = _mm256_cmpeq_epi32(_mm256_and_si256(b, own1), own1);
  return {_mm256_add_epi32(a.lo, _mm256_and_si256(m0, sixteen)), _mm256_add_epi32(a.hi, _mm256_and_si256(m1, sixteen))};
}
struct Table16 {
  __m256 t0, t1;
  explicit Table16(const float* p) : t0(_mm256_loadu_ps(p)), t1(_mm256_loadu_ps(p + 8)) {}
};
inline __m256 lookup8(const Table16& table, __m256i idx) {
  const __m256 a = _mm256_permutevar8x32_ps(table.t0, idx), b = _mm256_permutevar8x32_ps(table.t1, idx);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7))));
}
inline V lookup(const Table16& table, I a) { return {lookup8(table, a.lo), lookup8(table, a.hi)}; }
}  // namespace simd16
#endif
