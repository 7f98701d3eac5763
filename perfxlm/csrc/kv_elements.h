// KV cache elements widened to float32: float32, bfloat16 (as uint16_t bits), int8, fp8 e4m3 / e5m2.
// Shared by the attention kernels (csrc/attention_kernels.cpp) and the prefill tile reader.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PERFXLM_AVX512 1  // the attention kernels' zmm paths
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PERFXLM_AVX2 1  // the attention kernels' ymm paths (x86-64-v3: Zen 2/3, Haswell and later)
#endif

namespace perfxlm_attn {

inline float load_scalar(const float* p) { return *p; }
inline float load_scalar(const uint16_t* p) { return static_cast<float>(c10::BFloat16(*p, c10::BFloat16::from_bits())); }
inline float load_scalar(const int8_t* p) { return static_cast<float>(*p); }
inline float load_scalar(const c10::Float8_e4m3fn* p) { return static_cast<float>(*p); }
inline float load_scalar(const c10::Float8_e5m2* p) { return static_cast<float>(*p); }

// A quantized cache's group scales: float32 for int8; for fp8 one byte, the biased exponent of a power
// of two (2^(byte - 127), bytes 1..253), read as a float by placing it in the exponent field.
template <typename T>
struct ScaleOf {
  using type = float;
};
template <>
struct ScaleOf<c10::Float8_e4m3fn> {
  using type = uint8_t;
};
template <>
struct ScaleOf<c10::Float8_e5m2> {
  using type = uint8_t;
};
template <typename T>
using ScaleT = typename ScaleOf<T>::type;
inline float scale_value(float s) { return s; }
inline float scale_value(uint8_t biased_exponent) {
  const uint32_t u = static_cast<uint32_t>(biased_exponent) << 23;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch's conversion
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Full-width loads for the hot loops (load16_fast / load8_fast) return the values times
// kFastLoadScale<T>: e4m3 skips an exact x256 that the caller folds into the query and the output.
template <typename T>
constexpr float kFastLoadScale = 1.f;
template <>
constexpr float kFastLoadScale<c10::Float8_e4m3fn> = 1.f / 256.f;

// Cephes' expf, shared by exp16 / exp8: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is
// exact), e^r = 1 + r + r^2 p(r) with p of degree 5.
constexpr float kExpLog2e = 1.44269504088896341f, kExpLn2Hi = 0.693359375f, kExpLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#ifdef PERFXLM_AVX512
// e4m3 bytes as fp16 bit patterns: sign-extended to 16 bits, shifted left by 7, the sign lands in bit 15
// (and a copy in bit 14, cleared), exponent and mantissa in bits 13..7: an fp16 of the value times 2^-8,
// subnormals included.
inline __m256i e4m3_as_fp16(__m128i bytes) {
  const __m256i x = _mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7);
  return _mm256_and_si256(x, _mm256_set1_epi16(static_cast<short>(0xBFFF)));
}
// 16 lanes from float32 or bfloat16 memory; `mask` selects the lanes of a tail.
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const uint16_t* p, __mmask16 mask) {
  __m256i half = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 load16(const int8_t* p, __mmask16 mask) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
}
// fp8 widened through fp16 (vcvtph2ps): e5m2 is the high byte of an fp16; e4m3's exponent and mantissa
// bits placed in an fp16 give the value times 2^-8 (subnormals included), so one exact multiply restores it.
inline __m512 load16(const c10::Float8_e5m2* p, __mmask16 mask) {
  const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(mask, p)), 8);
  return _mm512_cvtph_ps(h);
}
inline __m512 load16(const c10::Float8_e4m3fn* p, __mmask16 mask) {
  return _mm512_mul_ps(_mm512_cvtph_ps(e4m3_as_fp16(_mm_maskz_loadu_epi8(mask, p))), _mm512_set1_ps(256.f));
}
template <typename T>
inline __m512 load16_fast(const T* p) { return load16(p, static_cast<__mmask16>(0xFFFF)); }
inline __m512 load16_fast(const c10::Float8_e4m3fn* p) {
  return _mm512_cvtph_ps(e4m3_as_fp16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}
// 16 lanes rounded to bfloat16 (to nearest even, as torch's conversion; the values are finite).
inline void store16_bf16(uint16_t* p, __m512 a, __mmask16 mask) {
  const __m512i u = _mm512_castps_si512(a);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(r));
}
// e^x (Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial, 2^n by scalef,
// which underflows to 0 for very negative x): within 2 ulp of std::exp, 16 lanes at a time.
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kExpLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Lo), _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Hi), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

#ifdef __AVX512BF16__
// acc + the products of 16 pairs of bf16 (a's pair i times b's, summed into lane i) by vdpbf16ps: the
// bf16 products of the decode and prefill attention kernels.
inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(a), reinterpret_cast<__m512bh&>(b));
}
#endif
#endif

#ifdef PERFXLM_AVX2
// 8 lanes of a full row chunk, times kFastLoadScale<T> (the ymm counterpart of load16_fast).
inline __m256 load8_fast(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_fast(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8_fast(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8_fast(const c10::Float8_e5m2* p) {
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8));
}
inline __m256 load8_fast(const c10::Float8_e4m3fn* p) {  // e4m3_as_fp16 on 8 bytes
  const __m128i x = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 7);
  return _mm256_cvtph_ps(_mm_and_si128(x, _mm_set1_epi16(static_cast<short>(0xBFFF))));
}
// e^x, 8 lanes: exp16's polynomial; 2^n built in the exponent field, with x clamped below at the
// smallest normal's logarithm (e^x under 1.2e-38 comes out as 1.2e-38, not 0: nothing a softmax sees).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kExpLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Lo), _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Hi), x));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

}  // namespace perfxlm_attn
