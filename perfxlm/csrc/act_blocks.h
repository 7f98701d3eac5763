// Activations rounded to int8 per block of 32 (llama.cpp's Q8 activations): the one rounding the block
// GEMV (quant_linear.cpp) and the int8 GEMM (quant_gemm.cpp) share, so a token's bytes are the same
// whichever of the two multiplies them: scale max |x| / 127, each value divided by it and rounded half to
// even, clamped to [-127, 127]; an all-zero block stays zero (scale 0).
//
// quantize_block is the scalar definition; quantize_block_fast the widest form this build has (zmm, ymm,
// or the scalar loop), the same division and rounding per value, so the same bytes.
//
// Two arithmetics (set_act_blocks; perfxlm.quant.act_blocks names them, the torch references follow):
//   kFloat: the above, the scale kept in float32.
//   kGgml:  what a GGUF file's q8_0 / q8_1 activation blocks hold (ggml's x86 quantize_row_q8_0/q8_1):
//           each value times 127 / max |x| (one float division per block, then multiplies), rounded half
//           to even, and the scale max |x| / 127 rounded to fp16, as the block stores it; a block whose
//           fp16 scale is 0 stays zero (its products would be). llama.cpp multiplies these fp16 scales,
//           so the same file gives the same products; it costs one conversion per 32 values.
//           K-quant weights (two-level scales: GGUF Q4_K / Q5_K / Q6_K, int4's super-block form) take
//           ggml's q8_K instead, the activations llama.cpp gives them: one float32 scale per 256 values
//           (BlockScales below), each block of 32 of the 256 rounded with it.
//   kFine:  kGgml's blocks of 32 for every weight, K-quants too (the rule before q8_K: finer, so
//           slightly closer to float, and not what llama.cpp computes).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || (defined(__AVX512F__) && defined(__AVX512BW__)) || defined(__F16C__)
#include <immintrin.h>
#endif
#if !defined(__F16C__)
#include <c10/util/Half.h>
#endif

namespace perfxlm_act {

enum Arith : int { kFloat = 0, kGgml = 1, kFine = 2 };

// The arithmetic every block below uses: one setting for the process (a row alone and in a batch, the
// GEMV and the GEMM round alike). An inline function's static: one object across the translation units.
inline std::atomic<int>& arith() {
  static std::atomic<int> mode{kGgml};
  return mode;
}

// float -> fp16 -> float, round to nearest even (ggml's GGML_FP32_TO_FP16 on x86).
inline float fp16_round(float v) {
#if defined(__F16C__)
  return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  return static_cast<float>(c10::Half(v));
#endif
}

// The block's scale, and what each value is multiplied by (mul, ggml: 127 / max) or divided by (the
// float scale) before rounding; scale 0: the block is written as zeros.
struct BlockScale {
  float scale, factor;
  bool mul;
};

inline BlockScale block_scale(float amax) {
  const float scale = amax / 127.f;
  if (arith().load(std::memory_order_relaxed) != kFloat) {
    const float s16 = fp16_round(scale);
    return {s16, s16 > 0.f ? 127.f / amax : 0.f, true};
  }
  return {scale, scale, false};
}

// ggml's q8_K scale for 256 values whose largest |x| is amax (quantize_row_q8_K): iscale = -127 / max,
// each value nearest_int(iscale x) (round half to even), d = 1 / iscale, kept in float32; all zero: d 0.
// Here the sign is the other way: iscale = 127 / |max| and d = 1 / iscale, both exactly the negations of
// ggml's (IEEE division and rounding to nearest even are symmetric in sign), so every value is exactly
// the negation of ggml's and every product d x q is ggml's bit for bit; a positive scale keeps the
// kernels' "scale 0 means a zero block" test. ggml caps q at +127 only: |iscale x| <= 127 (1 + 2^-24)
// rounds to at most 127 here, so neither cap ever binds.
inline BlockScale super_scale(float amax) {
  const float iscale = amax > 0.f ? 127.f / amax : 0.f;
  const float d = iscale > 0.f && std::isfinite(iscale) ? 1.f / iscale : 0.f;
  return {d, d > 0.f ? iscale : 0.f, true};
}

inline float amax_scalar(const float* src) {
  float amax = 0.f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(src[j]));
  return amax;
}

// One block of 32 with a given scale (its own, or its super-block's).
inline float quantize_with(const float* src, int8_t* q, const BlockScale s) {
  for (int j = 0; j < 32; ++j) {
    const float v = s.scale > 0.f ? std::nearbyint(s.mul ? src[j] * s.factor : src[j] / s.factor) : 0.f;
    q[j] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
  }
  return s.scale;
}

inline float quantize_block(const float* src, int8_t* q) { return quantize_with(src, q, block_scale(amax_scalar(src))); }

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline float block_amax(const float* src) {
  const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
}

inline float quantize_with_fast(const float* src, int8_t* q, const BlockScale s) {
  const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
  if (!(s.scale > 0.f)) {
    std::memset(q, 0, 32);
    return 0.f;
  }
  const __m512 d = _mm512_set1_ps(s.factor), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 ta = s.mul ? _mm512_mul_ps(a, d) : _mm512_div_ps(a, d);
  const __m512 tb = s.mul ? _mm512_mul_ps(b, d) : _mm512_div_ps(b, d);
  const __m512 ra = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(ta, kRound)));
  const __m512 rb = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(tb, kRound)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(ra)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(rb)));
  return s.scale;
}

// quantize_block_fast, and the int8 sums of the block's two halves (values 0-15, 16-31), which the
// row-group GEMVs need per block: taken from the rounded vectors (integers below 2^11: exact in float).
inline float quantize_with_sums(const float* src, int8_t* q, int32_t half[2], const BlockScale s) {
  const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
  if (!(s.scale > 0.f)) {
    std::memset(q, 0, 32);
    half[0] = half[1] = 0;
    return 0.f;
  }
  const __m512 d = _mm512_set1_ps(s.factor), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 ta = s.mul ? _mm512_mul_ps(a, d) : _mm512_div_ps(a, d);
  const __m512 tb = s.mul ? _mm512_mul_ps(b, d) : _mm512_div_ps(b, d);
  const __m512 ra = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(ta, kRound)));
  const __m512 rb = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(tb, kRound)));
  const __m512i ia = _mm512_cvtps_epi32(ra), ib = _mm512_cvtps_epi32(rb);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(ia));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(ib));
  half[0] = _mm512_reduce_add_epi32(ia);
  half[1] = _mm512_reduce_add_epi32(ib);
  return s.scale;
}
#elif defined(__AVX2__)
inline float block_amax(const float* src) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + 8 * i)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float quantize_with_fast(const float* src, int8_t* q, const BlockScale s) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(src + 8 * i);
  if (!(s.scale > 0.f)) {
    std::memset(q, 0, 32);
    return 0.f;
  }
  const __m256 d = _mm256_set1_ps(s.factor), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  __m256i r[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 x = s.mul ? _mm256_mul_ps(v[i], d) : _mm256_div_ps(v[i], d);
    const __m256 t = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, t)));
  }
  // packs work per 128-bit lane: [0..3 8..11 | 4..7 12..15] per pair, then [a b c d] bytes interleaved
  // by lane; one dword permute puts the 32 values back in order
  const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return s.scale;
}

// quantize_with_fast, and the int8 sums of the block's two halves (values 0-15, 16-31).
inline float quantize_with_sums(const float* src, int8_t* q, int32_t half[2], const BlockScale s) {
  const float scale = quantize_with_fast(src, q, s);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  // |q| <= 127: vpmaddubsw of ones (unsigned) with q (signed) sums pairs, vpmaddwd of ones the pairs
  const __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
  const __m128i h0 = _mm256_castsi256_si128(pairs), h1 = _mm256_extracti128_si256(pairs, 1);
  auto sum4 = [](__m128i x) {
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1)));
  };
  half[0] = sum4(h0);
  half[1] = sum4(h1);
  return scale;
}
#else
inline float block_amax(const float* src) { return amax_scalar(src); }
inline float quantize_with_fast(const float* src, int8_t* q, const BlockScale s) { return quantize_with(src, q, s); }
inline float quantize_with_sums(const float* src, int8_t* q, int32_t half[2], const BlockScale s) {
  const float scale = quantize_with(src, q, s);
  half[0] = half[1] = 0;
  for (int i = 0; i < 32; ++i) half[i / 16] += q[i];
  return scale;
}
#endif

// One block of 32 with its own scale (q8_0 / q8_1 or the float rule), in the widest form this build has.
inline float quantize_block_fast(const float* src, int8_t* q) {
  return quantize_with_fast(src, q, block_scale(block_amax(src)));
}

// quantize_block_fast, and the int8 sums of the block's two halves (values 0-15, 16-31), which the
// row-group GEMVs need per block.
inline float quantize_block_sums(const float* src, int8_t* q, int32_t half[2]) {
  return quantize_with_sums(src, q, half, block_scale(block_amax(src)));
}

// Whether activations for a K-quant weight round as q8_K (one scale per 256) in the arithmetic in force.
inline bool super_blocks() { return arith().load(std::memory_order_relaxed) == kGgml; }

// The scales of one activation row's blocks of 32, in order: each block's own, or, for a K-quant weight
// under kGgml, its 256-value super-block's q8_K scale (computed once, at the super-block's first block;
// a row's last super-block may be short). Blocks are asked for in increasing order within a super-block.
class BlockScales {
 public:
  BlockScales(const float* row, int64_t K, bool kquant) : row_(row), blocks_(K / 32), super_(kquant && super_blocks()) {}
  BlockScale at(int64_t b) {
    if (!super_) return block_scale(block_amax(row_ + 32 * b));
    if (b / 8 != cached_) {
      cached_ = b / 8;
      float amax = 0.f;
      for (int64_t j = 8 * cached_; j < std::min<int64_t>(8 * cached_ + 8, blocks_); ++j)
        amax = std::max(amax, block_amax(row_ + 32 * j));
      scale_ = super_scale(amax);
    }
    return scale_;
  }
  float quantize(int64_t b, int8_t* q) { return quantize_with_fast(row_ + 32 * b, q, at(b)); }
  float quantize_sums(int64_t b, int8_t* q, int32_t half[2]) { return quantize_with_sums(row_ + 32 * b, q, half, at(b)); }

 private:
  const float* row_;
  int64_t blocks_;
  bool super_;
  int64_t cached_ = -1;
  BlockScale scale_{0.f, 0.f, true};
};

}  // namespace perfxlm_act
