// Row groups for GGUF K-quants (Q4_K, Q5_K, Q6_K): the batch-1 int8-dot GEMV over codes and two-level scales
// stored with the blocks of 8 consecutive rows together (perfxlm/quant/row_groups_k.py makes the layout
// and holds its plain-torch reference; row_groups.h is the same for Q8_0 / Q4_0).
//
// Layout (G = ceil(N / 8) groups of 8 rows, S = K / 256 super-blocks; rows past N are zero):
//   codes  uint8 [G, K / 32, 8 x B]: per block of 32, the 8 rows' nibbles as [quad l][row][4 bytes] (byte j
//          of quad l: code 4l + j low, 16 + 4l + j high: 128 bytes); Q5_K (B = 20) then a 32-byte word of
//          fifth bits (byte 4 r + j: row r's code 4l + j's at bit l, 16 + 4l + j's at bit 4 + l); Q6_K
//          (B = 24) then the words H0, H1 of 32 bytes: byte 4 r + j of H_h holds bits 4-5 of row r's code
//          16 h + 4l + j at bits 2l, 2l + 1;
//   params uint8 [G, S, P]: Q4_K and Q5_K (160) sub-scales [block][row], sub-mins [block][row], d [row],
//          dmin [row] (float16); Q6_K (144) int8 sub-scales [group of 16][row], d [row] (float16).
// Why: as for Q4_0 (row_groups.h), one ymm of codes holds one quad of 8 rows, so vpdpbusd's int32 lanes
// are the 8 rows, and everything after the dot products is per 8 rows at once, with no horizontal sums:
// - the sub-scales apply in int32 (Q4_K / Q5_K: the block's sum x its byte scale; Q6_K: each half-block's sum x
//   its int8 scale, the two added), exact, where the plain kernels convert and FMA per group and row;
// - one conversion and FMA per block of 32 (where the activation scale changes) into a super-block sum,
//   and one FMA by d per super-block;
// - Q4_K / Q5_K's mins: the 8 rows' min bytes x (activation scale x the block's int8 sum), one FMA per block,
//   times dmin per super-block;
// - Q6_K's centre (32) comes off in the integer sums: each half-block's dot starts at -32 x its
//   activations' sum (vpdpbusd builds); the vpmaddubsw build multiplies the int16 pair sums by the
//   sub-scales in vpmaddwd (no vpmulld) and takes 32 x (the scales . the half sums) off after.
// Each output row sums in one order on every path (per super-block: its blocks' float(int sum) x
// activation scale FMAs in order, then x d; Q4_K's mins alike, subtracted after), so a row's result does
// not depend on the other rows of the batch, and the scalar build rounds as the SIMD ones do.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "act_blocks.h"
#include "row_group_dots.h"
#include "row_groups_run.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PERFXLM_ROWS8K_SIMD 1
#endif

namespace perfxlm_rows8k {

constexpr int kRows = 8;
constexpr int64_t kSuper = 256;
constexpr int64_t kQ4Params = 160, kQ6Params = 144;  // bytes per 8 rows and super-block (Q5_K: Q4_K's)
constexpr int64_t kQ4Block = kRows * 16, kQ5Block = kRows * 20, kQ6Block = kRows * 24;  // code bytes per 8 rows, block of 32

// One activation row as int8 blocks (act_blocks.h's rounding for K-quants, the plain kernels' bytes) and what the
// kernels add per block: its scale; Q4_K: scale x the block's int8 sum (the mins' factor); Q6_K: the
// int8 sums of its two halves, as -32 x sum (vpdpbusd starts) and packed as two int16 (vpmaddwd).
struct Acts {
  std::vector<int8_t> q;
  std::vector<float> dx, xsf;
  std::vector<int32_t> start, pair;
};

inline void quantize(const float* x, int64_t K, Acts& a) {
  const int64_t blocks = K / 32;
  a.q.resize(K);
  a.dx.resize(blocks);
  a.xsf.resize(blocks);
  a.start.resize(2 * blocks);
  a.pair.resize(blocks);
  int8_t* q = a.q.data();
  perfxlm_act::BlockScales scales(x, K, true);  // K-quants: q8_K under ggml's rule
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t half[2];
    a.dx[b] = scales.quantize_sums(b, q + 32 * b, half);
    a.xsf[b] = a.dx[b] * static_cast<float>(half[0] + half[1]);
    a.start[2 * b] = -32 * half[0];
    a.start[2 * b + 1] = -32 * half[1];
    a.pair[b] = static_cast<int32_t>((static_cast<uint32_t>(half[0]) & 0xFFFFu) | (static_cast<uint32_t>(half[1]) << 16));
  }
}

inline float half_at(const uint8_t* p, int r) {
  uint16_t h;
  std::memcpy(&h, p + 2 * r, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

#ifdef PERFXLM_ROWS8K_SIMD
using perfxlm_row_dots::dot4;
using perfxlm_row_dots::kVnni;
using perfxlm_row_dots::quad;

// 8 bytes (one per row) widened to int32 lanes.
inline __m256i rows_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i rows_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256 rows_f16(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// int32 lanes of int16 range -> each lane's value in both of its int16 halves (a vpmaddwd multiplier).
inline __m256i dup16(__m256i v) { return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16)); }

// Q5_K: bit 4 of quad l's codes (lo: codes 4l + j, hi: 16 + 4l + j) from the block's fifth-bit word.
template <int L>
inline __m256i fifth_lo(__m256i h) { return _mm256_and_si256(_mm256_slli_epi16(h, 4 - L), _mm256_set1_epi8(0x10)); }
template <int L>
inline __m256i fifth_hi(__m256i h) { return _mm256_and_si256(_mm256_srli_epi16(h, L), _mm256_set1_epi8(0x10)); }

// Q4_K / Q5_K: quad l's codes of 8 rows, codes 4l + j (lo) and 16 + 4l + j (hi).
template <bool FIVE, int L>
inline void q45_codes(const uint8_t* blk, __m256i h, __m256i& lo, __m256i& hi) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * L));
  lo = _mm256_and_si256(raw, nib);
  hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
  if constexpr (FIVE) {
    lo = _mm256_or_si256(lo, fifth_lo<L>(h));
    hi = _mm256_or_si256(hi, fifth_hi<L>(h));
  }
}

// Q4_K / Q5_K: block b's int sums x sub-scales of 8 rows (codes: its 128 / 160 bytes), for MR activation
// rows (their blocks at xq[i]) on one unpacking of the codes.
template <bool FIVE, int MR>
inline void q45_block(const uint8_t* blk, const int8_t* const* xq, const uint8_t* sc, __m256i* isum) {
  const __m256i h = FIVE ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128)) : _mm256_setzero_si256();
  __m256i lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3;
  q45_codes<FIVE, 0>(blk, h, lo0, hi0);
  q45_codes<FIVE, 1>(blk, h, lo1, hi1);
  q45_codes<FIVE, 2>(blk, h, lo2, hi2);
  q45_codes<FIVE, 3>(blk, h, lo3, hi3);
  if constexpr (kVnni) {
    const __m256i scale = rows_u8(sc);
    #pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
      s0 = dot4(s0, lo0, quad(xq[i], 0));
      s1 = dot4(s1, hi0, quad(xq[i], 4));
      s0 = dot4(s0, lo1, quad(xq[i], 1));
      s1 = dot4(s1, hi1, quad(xq[i], 5));
      s0 = dot4(s0, lo2, quad(xq[i], 2));
      s1 = dot4(s1, hi2, quad(xq[i], 6));
      s0 = dot4(s0, lo3, quad(xq[i], 3));
      s1 = dot4(s1, hi3, quad(xq[i], 7));
      isum[i] = _mm256_mullo_epi32(_mm256_add_epi32(s0, s1), scale);
    }
  } else {
    // vpmaddubsw pair sums in int16: 8 of codes <= 15 fit (8 x 2 x 15 x 127), 4 of codes <= 31; then
    // vpmaddwd by the scale bytes
    const __m256i d = dup16(rows_u8(sc));
    #pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const int8_t* x = xq[i];
      const __m256i p0 = _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo0, quad(x, 0)), _mm256_maddubs_epi16(lo1, quad(x, 1))),
                                          _mm256_add_epi16(_mm256_maddubs_epi16(lo2, quad(x, 2)), _mm256_maddubs_epi16(lo3, quad(x, 3))));
      const __m256i p1 = _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(hi0, quad(x, 4)), _mm256_maddubs_epi16(hi1, quad(x, 5))),
                                          _mm256_add_epi16(_mm256_maddubs_epi16(hi2, quad(x, 6)), _mm256_maddubs_epi16(hi3, quad(x, 7))));
      if constexpr (FIVE) isum[i] = _mm256_add_epi32(_mm256_madd_epi16(p0, d), _mm256_madd_epi16(p1, d));
      else isum[i] = _mm256_madd_epi16(_mm256_add_epi16(p0, p1), d);
    }
  }
}

// Q6_K: bits 4-5 of quad l's codes from its high word h, at bits 4-5 of each byte.
template <int L>
inline __m256i high_bits(__m256i h) {
  const __m256i m = _mm256_set1_epi8(0x30);
  if constexpr (L == 0) return _mm256_and_si256(_mm256_slli_epi16(h, 4), m);
  if constexpr (L == 1) return _mm256_and_si256(_mm256_slli_epi16(h, 2), m);
  if constexpr (L == 2) return _mm256_and_si256(h, m);
  return _mm256_and_si256(_mm256_srli_epi16(h, 2), m);
}

template <int L>
inline void q6k_codes(const uint8_t* blk, __m256i h0, __m256i h1, __m256i& lo, __m256i& hi) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * L));
  lo = _mm256_or_si256(_mm256_and_si256(raw, nib), high_bits<L>(h0));
  hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nib), high_bits<L>(h1));
}

// Q6_K: block b's sum over its two halves of (int sum - 32 x activation sum) x sub-scale, 8 rows
// (codes: its 192 bytes; sc: the sub-scales of its first half, the second's 8 bytes on), for MR
// activation rows (a[i], block blk) on one unpacking of the codes.
template <int MR>
inline void q6k_block(const uint8_t* blk, const Acts* const* a, int64_t bi, const uint8_t* sc, __m256i* isum) {
  const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128));
  const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 160));
  __m256i lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3;
  q6k_codes<0>(blk, h0, h1, lo0, hi0);
  q6k_codes<1>(blk, h0, h1, lo1, hi1);
  q6k_codes<2>(blk, h0, h1, lo2, hi2);
  q6k_codes<3>(blk, h0, h1, lo3, hi3);
  const __m256i sc0 = rows_i8(sc), sc1 = rows_i8(sc + 8);
  if constexpr (kVnni) {
    #pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const int8_t* xq = a[i]->q.data() + 32 * bi;
      __m256i s0 = _mm256_set1_epi32(a[i]->start[2 * bi]), s1 = _mm256_set1_epi32(a[i]->start[2 * bi + 1]);
      s0 = dot4(s0, lo0, quad(xq, 0));
      s1 = dot4(s1, hi0, quad(xq, 4));
      s0 = dot4(s0, lo1, quad(xq, 1));
      s1 = dot4(s1, hi1, quad(xq, 5));
      s0 = dot4(s0, lo2, quad(xq, 2));
      s1 = dot4(s1, hi2, quad(xq, 6));
      s0 = dot4(s0, lo3, quad(xq, 3));
      s1 = dot4(s1, hi3, quad(xq, 7));
      isum[i] = _mm256_add_epi32(_mm256_mullo_epi32(s0, sc0), _mm256_mullo_epi32(s1, sc1));
    }
  } else {
    // two vpmaddubsw pair sums of codes <= 63 fit int16 (2 x 2 x 63 x 127); vpmaddwd by the scales
    const __m256i d0 = dup16(sc0), d1 = dup16(sc1);
    // the centre: 32 x (sc0 x sum of the first half + sc1 x sum of the second), one vpmaddwd
    const __m256i sp = _mm256_or_si256(_mm256_and_si256(sc0, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(sc1, 16));
    #pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const int8_t* xq = a[i]->q.data() + 32 * bi;
      const __m256i a0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, quad(xq, 0)), _mm256_maddubs_epi16(lo1, quad(xq, 1)));
      const __m256i a1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo2, quad(xq, 2)), _mm256_maddubs_epi16(lo3, quad(xq, 3)));
      const __m256i b0 = _mm256_add_epi16(_mm256_maddubs_epi16(hi0, quad(xq, 4)), _mm256_maddubs_epi16(hi1, quad(xq, 5)));
      const __m256i b1 = _mm256_add_epi16(_mm256_maddubs_epi16(hi2, quad(xq, 6)), _mm256_maddubs_epi16(hi3, quad(xq, 7)));
      const __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(a0, d0), _mm256_madd_epi16(a1, d0)),
                                         _mm256_add_epi32(_mm256_madd_epi16(b0, d1), _mm256_madd_epi16(b1, d1)));
      isum[i] = _mm256_sub_epi32(s, _mm256_slli_epi32(_mm256_madd_epi16(sp, _mm256_set1_epi32(a[i]->pair[bi])), 5));
    }
  }
}

// One group's 8 outputs for MR activation rows a[i] (out: MR x 8).
template <bool FIVE, int MR>
inline void q45_group_rows(const uint8_t* codes, const uint8_t* params, const Acts* const* a, int64_t supers, float* out) {
  constexpr int64_t block_bytes = FIVE ? kQ5Block : kQ4Block;
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* ps = params + s * kQ4Params;
    __m256 as[MR], am[MR];
    for (int i = 0; i < MR; ++i) as[i] = am[i] = _mm256_setzero_ps();
    for (int b = 0; b < 8; ++b) {
      const int64_t blk = s * 8 + b;
      const uint8_t* cb = codes + blk * block_bytes;
      // the stream ahead (row_groups.h: too short a time per block for the prefetchers to ramp up)
      _mm_prefetch(reinterpret_cast<const char*>(cb + 8 * block_bytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(cb + 8 * block_bytes + 64), _MM_HINT_T0);
      if constexpr (FIVE) _mm_prefetch(reinterpret_cast<const char*>(cb + 8 * block_bytes + 128), _MM_HINT_T0);
      const int8_t* xq[MR];
      for (int i = 0; i < MR; ++i) xq[i] = a[i]->q.data() + 32 * blk;
      __m256i isum[MR];
      q45_block<FIVE, MR>(cb, xq, ps + 8 * b, isum);
      const __m256 mins = _mm256_cvtepi32_ps(rows_u8(ps + 64 + 8 * b));
      for (int i = 0; i < MR; ++i) {
        as[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(a[i]->dx[blk]), as[i]);
        am[i] = _mm256_fmadd_ps(mins, _mm256_set1_ps(a[i]->xsf[blk]), am[i]);
      }
    }
    const __m256 d = rows_f16(ps + 128), dmin = rows_f16(ps + 144);
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_fnmadd_ps(am[i], dmin, _mm256_fmadd_ps(as[i], d, acc[i]));
  }
  for (int i = 0; i < MR; ++i) _mm256_storeu_ps(out + 8 * i, acc[i]);
}

template <int MR>
inline void q6k_group_rows(const uint8_t* codes, const uint8_t* params, const Acts* const* a, int64_t supers, float* out) {
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* ps = params + s * kQ6Params;
    __m256 as[MR];
    for (int i = 0; i < MR; ++i) as[i] = _mm256_setzero_ps();
    for (int b = 0; b < 8; ++b) {
      const int64_t blk = s * 8 + b;
      const uint8_t* cb = codes + blk * kQ6Block;
      _mm_prefetch(reinterpret_cast<const char*>(cb + 1536), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(cb + 1536 + 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(cb + 1536 + 128), _MM_HINT_T0);
      __m256i isum[MR];
      q6k_block<MR>(cb, a, blk, ps + 16 * b, isum);
      for (int i = 0; i < MR; ++i)
        as[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(a[i]->dx[blk]), as[i]);
    }
    const __m256 d = rows_f16(ps + 128);
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(as[i], d, acc[i]);
  }
  for (int i = 0; i < MR; ++i) _mm256_storeu_ps(out + 8 * i, acc[i]);
}

// Batch 1, two groups at once (A and B far apart: the two halves of a thread's range), block b of A then
// block b of B: two read streams interleaved a block at a time, as row_groups.h's group_pair. Each group's
// sums are exactly those of q45_group_rows / q6k_group_rows at one row (its own accumulators, the same
// operations in the same order), so the bits are the same. No software prefetch: two streams are what
// the hardware prefetchers keep in flight (read_streams.h).
template <bool FIVE>
inline void q45_group_pair(const uint8_t* codes_a, const uint8_t* params_a, const uint8_t* codes_b,
                           const uint8_t* params_b, const Acts& a, int64_t supers, float* out_a, float* out_b) {
  constexpr int64_t block_bytes = FIVE ? kQ5Block : kQ4Block;
  const int8_t* const xq0 = a.q.data();
  __m256 acc_a = _mm256_setzero_ps(), acc_b = acc_a;
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* pa = params_a + s * kQ4Params;
    const uint8_t* pb = params_b + s * kQ4Params;
    __m256 as_a = _mm256_setzero_ps(), am_a = as_a, as_b = as_a, am_b = as_a;
    auto step = [&](const uint8_t* codes, const uint8_t* ps, int b, __m256& as, __m256& am) __attribute__((always_inline)) {
      const int64_t blk = s * 8 + b;
      const int8_t* xq = xq0 + 32 * blk;
      __m256i isum;
      q45_block<FIVE, 1>(codes + blk * block_bytes, &xq, ps + 8 * b, &isum);
      const __m256 mins = _mm256_cvtepi32_ps(rows_u8(ps + 64 + 8 * b));
      as = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(a.dx[blk]), as);
      am = _mm256_fmadd_ps(mins, _mm256_set1_ps(a.xsf[blk]), am);
    };
    #pragma GCC unroll 2
    for (int b = 0; b < 8; ++b) {
      step(codes_a, pa, b, as_a, am_a);
      step(codes_b, pb, b, as_b, am_b);
    }
    acc_a = _mm256_fnmadd_ps(am_a, rows_f16(pa + 144), _mm256_fmadd_ps(as_a, rows_f16(pa + 128), acc_a));
    acc_b = _mm256_fnmadd_ps(am_b, rows_f16(pb + 144), _mm256_fmadd_ps(as_b, rows_f16(pb + 128), acc_b));
  }
  _mm256_storeu_ps(out_a, acc_a);
  _mm256_storeu_ps(out_b, acc_b);
}

inline void q6k_group_pair(const uint8_t* codes_a, const uint8_t* params_a, const uint8_t* codes_b,
                           const uint8_t* params_b, const Acts& a, int64_t supers, float* out_a, float* out_b) {
  const Acts* const rows[1] = {&a};
  __m256 acc_a = _mm256_setzero_ps(), acc_b = acc_a;
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* pa = params_a + s * kQ6Params;
    const uint8_t* pb = params_b + s * kQ6Params;
    __m256 as_a = _mm256_setzero_ps(), as_b = as_a;
    auto step = [&](const uint8_t* codes, const uint8_t* ps, int b, __m256& as) __attribute__((always_inline)) {
      const int64_t blk = s * 8 + b;
      __m256i isum;
      q6k_block<1>(codes + blk * kQ6Block, rows, blk, ps + 16 * b, &isum);
      as = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(a.dx[blk]), as);
    };
    #pragma GCC unroll 2
    for (int b = 0; b < 8; ++b) {
      step(codes_a, pa, b, as_a);
      step(codes_b, pb, b, as_b);
    }
    acc_a = _mm256_fmadd_ps(as_a, rows_f16(pa + 128), acc_a);
    acc_b = _mm256_fmadd_ps(as_b, rows_f16(pb + 128), acc_b);
  }
  _mm256_storeu_ps(out_a, acc_a);
  _mm256_storeu_ps(out_b, acc_b);
}
#else
// The scalar definition: the same integer sums and the same float operations in the same order.
template <bool FIVE>
inline void q45_group_row(const uint8_t* codes, const uint8_t* params, const Acts& a, int64_t supers, float* out) {
  constexpr int64_t block_bytes = FIVE ? kQ5Block : kQ4Block;
  for (int r = 0; r < kRows; ++r) {
    float acc = 0.f;
    for (int64_t s = 0; s < supers; ++s) {
      const uint8_t* ps = params + s * kQ4Params;
      float as = 0.f, am = 0.f;
      for (int b = 0; b < 8; ++b) {
        const int64_t blk = s * 8 + b;
        const uint8_t* cb = codes + blk * block_bytes;
        const int8_t* xq = a.q.data() + 32 * blk;
        int32_t dot = 0;
        for (int l = 0; l < 4; ++l)
          for (int j = 0; j < 4; ++j) {
            const uint8_t byte = cb[(l * kRows + r) * 4 + j];
            const int fifth = FIVE ? cb[128 + 4 * r + j] : 0;
            dot += ((byte & 15) | (((fifth >> l) & 1) << 4)) * xq[4 * l + j] +
                   ((byte >> 4) | (((fifth >> (4 + l)) & 1) << 4)) * xq[16 + 4 * l + j];
          }
        as = std::fma(static_cast<float>(dot * ps[8 * b + r]), a.dx[blk], as);
        am = std::fma(static_cast<float>(ps[64 + 8 * b + r]), a.xsf[blk], am);
      }
      acc = std::fma(as, half_at(ps + 128, r), acc);
      acc = std::fma(-am, half_at(ps + 144, r), acc);
    }
    out[r] = acc;
  }
}

inline void q6k_group_row(const uint8_t* codes, const uint8_t* params, const Acts& a, int64_t supers, float* out) {
  for (int r = 0; r < kRows; ++r) {
    float acc = 0.f;
    for (int64_t s = 0; s < supers; ++s) {
      const uint8_t* ps = params + s * kQ6Params;
      float as = 0.f;
      for (int b = 0; b < 8; ++b) {
        const int64_t blk = s * 8 + b;
        const uint8_t* cb = codes + blk * kQ6Block;
        const int8_t* xq = a.q.data() + 32 * blk;
        int32_t sum[2] = {a.start[2 * blk], a.start[2 * blk + 1]};
        for (int h = 0; h < 2; ++h)
          for (int l = 0; l < 4; ++l)
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = cb[(l * kRows + r) * 4 + j];
              const int high = (cb[128 + 32 * h + 4 * r + j] >> (2 * l)) & 3;
              const int u = (h ? byte >> 4 : byte & 15) | (high << 4);
              sum[h] += u * xq[16 * h + 4 * l + j];
            }
        const int32_t isum = sum[0] * static_cast<int8_t>(ps[16 * b + r]) + sum[1] * static_cast<int8_t>(ps[16 * b + 8 + r]);
        as = std::fma(static_cast<float>(isum), a.dx[blk], as);
      }
      acc = std::fma(as, half_at(ps + 128, r), acc);
    }
    out[r] = acc;
  }
}

template <bool FIVE, int MR>
inline void q45_group_rows(const uint8_t* codes, const uint8_t* params, const Acts* const* a, int64_t supers, float* out) {
  for (int i = 0; i < MR; ++i) q45_group_row<FIVE>(codes, params, *a[i], supers, out + 8 * i);
}
template <int MR>
inline void q6k_group_rows(const uint8_t* codes, const uint8_t* params, const Acts* const* a, int64_t supers, float* out) {
  for (int i = 0; i < MR; ++i) q6k_group_row(codes, params, *a[i], supers, out + 8 * i);
}

// Without SIMD: the two groups one after the other (the same bits as the one-group kernels on each).
template <bool FIVE>
inline void q45_group_pair(const uint8_t* codes_a, const uint8_t* params_a, const uint8_t* codes_b,
                           const uint8_t* params_b, const Acts& a, int64_t supers, float* out_a, float* out_b) {
  q45_group_row<FIVE>(codes_a, params_a, a, supers, out_a);
  q45_group_row<FIVE>(codes_b, params_b, a, supers, out_b);
}
inline void q6k_group_pair(const uint8_t* codes_a, const uint8_t* params_a, const uint8_t* codes_b,
                           const uint8_t* params_b, const Acts& a, int64_t supers, float* out_a, float* out_b) {
  q6k_group_row(codes_a, params_a, a, supers, out_a);
  q6k_group_row(codes_b, params_b, a, supers, out_b);
}
#endif

// One call's activations, rounded, and the weight it multiplies (row_groups.h's Product, for K-quants):
// prepare once, then groups_into over any ranges of groups.
struct Product {
  std::vector<Acts> acts;
  const uint8_t* codes = nullptr;
  const uint8_t* params = nullptr;
  int64_t M = 0, K = 0, supers = 0, groups = 0, n_out = 0, bits = 0, group_codes = 0, group_params = 0;
};

// Measured per call in a 1B-shaped model's decode order (every matrix once, one thread, thread CPU time,
// loaded): two block-interleaved streams 1.14-1.22x one stream on the Q4_K / Q6_K matrices and the Q6_K
// head. Whether batch 1 reads a thread's groups as two block-interleaved streams (the pair kernels) unless
// PERFXLM_GEMV_STREAMS / set_gemv_streams says otherwise (read_streams.h).
constexpr bool kPairByDefault = true;

inline int64_t block_bytes_of(int64_t bits) { return bits == 4 ? kQ4Block : bits == 5 ? kQ5Block : kQ6Block; }
// The format of row-group codes from their shape (a dispatcher that gets no bits): 4, 5 or 6.
inline int64_t bits_of(const at::Tensor& codes) { return codes.dim() == 3 ? codes.size(2) / (kRows * 4) : 0; }

inline Product prepare(const at::Tensor& xc, const at::Tensor& codes, const at::Tensor& params, int64_t bits,
                       int64_t n_out) {
  TORCH_CHECK(xc.dim() == 2 && xc.scalar_type() == at::kFloat && xc.is_contiguous(),
              "linear_q_rows8_k: x must be contiguous 2-D float32");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6, "linear_q_rows8_k: bits 4 (Q4_K), 5 (Q5_K) or 6 (Q6_K)");
  Product p;
  p.bits = bits;
  p.M = xc.size(0), p.K = xc.size(1), p.supers = p.K / kSuper, p.n_out = n_out;
  p.groups = (n_out + kRows - 1) / kRows;
  const int64_t blocks = p.K / 32, block_bytes = block_bytes_of(bits), param_bytes = bits == 6 ? kQ6Params : kQ4Params;
  TORCH_CHECK(p.K % kSuper == 0, "linear_q_rows8_k: K must be a multiple of 256");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 3 && codes.size(0) == p.groups &&
                  codes.size(1) == blocks && codes.size(2) == block_bytes,
              "linear_q_rows8_k: codes must be uint8 [ceil(N / 8), K / 32, ", block_bytes, "] (row groups)");
  TORCH_CHECK(params.scalar_type() == at::kByte && params.is_contiguous() && params.dim() == 3 &&
                  params.size(0) == p.groups && params.size(1) == p.supers && params.size(2) == param_bytes,
              "linear_q_rows8_k: params must be uint8 [ceil(N / 8), K / 256, ", param_bytes, "] (row groups)");
  p.acts.resize(static_cast<size_t>(p.M));
  const float* xp = xc.data_ptr<float>();
  for (int64_t m = 0; m < p.M; ++m) quantize(xp + m * p.K, p.K, p.acts[m]);
  p.codes = codes.data_ptr<uint8_t>();
  p.params = params.data_ptr<uint8_t>();
  p.group_codes = blocks * block_bytes;
  p.group_params = p.supers * param_bytes;
  return p;
}

// Groups [g0, g1) of the product into y (row stride ldy, output n at column n), bias added; every
// activation row runs over a group before the next group (its codes stay in L1). A row's outputs do not
// depend on which range computed them.
inline void groups_into(const Product& p, int64_t g0, int64_t g1, float* y, int64_t ldy, const float* bias) {
  if (p.M == 1 && perfxlm_streams::two_streams(kPairByDefault) && g1 - g0 >= 2) {
    // batch 1, two streams: the range's halves a block at a time (q45_group_pair / q6k_group_pair)
    const Acts* row = &p.acts[0];
    auto codes = [&](int64_t g) { return p.codes + g * p.group_codes; };
    auto params = [&](int64_t g) { return p.params + g * p.group_params; };
    perfxlm_row_groups::halves_in_pairs(g0, g1, p.n_out, y, bias,
      [&](int64_t ga, int64_t gb, float* out_a, float* out_b) {
        if (p.bits == 4) q45_group_pair<false>(codes(ga), params(ga), codes(gb), params(gb), *row, p.supers, out_a, out_b);
        else if (p.bits == 5) q45_group_pair<true>(codes(ga), params(ga), codes(gb), params(gb), *row, p.supers, out_a, out_b);
        else q6k_group_pair(codes(ga), params(ga), codes(gb), params(gb), *row, p.supers, out_a, out_b);
      },
      [&](int64_t g, float* out) {
        if (p.bits == 4) q45_group_rows<false, 1>(codes(g), params(g), &row, p.supers, out);
        else if (p.bits == 5) q45_group_rows<true, 1>(codes(g), params(g), &row, p.supers, out);
        else q6k_group_rows<1>(codes(g), params(g), &row, p.supers, out);
      });
    return;
  }
  perfxlm_row_groups::each_group(g0, g1, [&](int64_t g) {
    const uint8_t* c = p.codes + g * p.group_codes;
    const uint8_t* w = p.params + g * p.group_params;
    const int64_t n0 = g * kRows, rows = std::min<int64_t>(kRows, p.n_out - n0);
    // two activation rows per pass where there are two: the codes are unpacked once for both (the
    // sums of each row are the one-row pass's, in its order)
    for (int64_t m = 0; m < p.M; m += 2) {
      const Acts* a[2] = {&p.acts[m], m + 1 < p.M ? &p.acts[m + 1] : nullptr};
      const int mr = a[1] ? 2 : 1;
      float out[2 * kRows];
      if (p.bits == 4) {
        if (mr == 2) q45_group_rows<false, 2>(c, w, a, p.supers, out);
        else q45_group_rows<false, 1>(c, w, a, p.supers, out);
      } else if (p.bits == 5) {
        if (mr == 2) q45_group_rows<true, 2>(c, w, a, p.supers, out);
        else q45_group_rows<true, 1>(c, w, a, p.supers, out);
      } else {
        if (mr == 2) q6k_group_rows<2>(c, w, a, p.supers, out);
        else q6k_group_rows<1>(c, w, a, p.supers, out);
      }
      for (int i = 0; i < mr; ++i)
        for (int64_t r = 0; r < rows; ++r) y[(m + i) * ldy + n0 + r] = out[i * kRows + r] + (bias ? bias[n0 + r] : 0.f);
    }
  });
}

// y [M, N] = x [M, K] W^T (+ bias) for W a Q4_K (bits 4), Q5_K (5) or Q6_K (6) weight in row groups, over
// groups in parallel.
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& params, int64_t bits,
                         int64_t n_out, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_q_rows8_k: x must be 2-D float32");
  const at::Tensor xc = x.contiguous();
  return perfxlm_row_groups::run("linear_q_rows8_k", xc, prepare(xc, codes, params, bits, n_out), n_out, bias, groups_into);
}

}  // namespace perfxlm_rows8k
