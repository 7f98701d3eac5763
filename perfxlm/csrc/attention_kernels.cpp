// The KV cache kernels: writing new tokens into their slots (quantizing for an int8 / fp8 cache) and
// decode attention reading the paged cache in place through the block table (no gather into a
// contiguous copy), float32 or bfloat16 cache, or a quantized one (int8 with float32 group scales beside
// the blocks, fp8 e4m3 / e5m2 with power-of-two scales in one byte, see kv_elements.h's ScaleOf)
// dequantized in registers; sliding window, logit soft-capping and attention sinks (gpt-oss: a logit per
// head in the softmax's denominator, over no value).
//
// The plain-torch references are perfxlm/ops/attention.py's torch paths and perfxlm/ops/reference.py.

#include "attention_kernels.h"
#include "kv_elements.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace perfxlm_attn {
namespace {

// ---------------------------------------------------------------------------------------------
// paged_decode_attention: one query token per sequence, flash-decoding over the paged cache.
//
// A task is one (sequence, KV head, token range), and it serves the G query heads of that KV head
// together: each K and V row is loaded and widened once per task, not once per query head. Widening
// is what a quantized cache pays for (fp8 to float32 takes more instructions than the FMAs that use
// it), so with GQA that is G times fewer conversions. Long contexts are cut into ranges so batch 1
// with few KV heads still feeds every thread and a range's rows stay in L2 between its K and V
// passes; each range keeps its softmax max, sum and unnormalised output, merged per head at the end.
// ---------------------------------------------------------------------------------------------

// Where one KV head's rows and scales sit: `cache` / `scales` arguments point at the head's first row.
struct Geometry {
  int64_t block_size, block_stride, token_stride;  // in elements
  int64_t s_block_stride, s_token_stride, groups;  // a quantized cache's scales (groups 0: none)
};

// How a quantized cache's scales enter: none (float, bf16), one per token (folded into the score and
// the softmax weight) or one per group of 16-lane chunks (folded into the widened chunk).
enum class Scales { None, Token, Group };

constexpr int64_t kMaxRange = 512;  // tokens per task at most: the range's K and V rows stay in L2
constexpr int64_t kMinRange = 128;  // ...and at least, so the merge stays negligible
#ifdef PERFXLM_AVX512
constexpr int64_t kFastLanes = 16;  // a scale group of the fast path is whole vectors
#else
constexpr int64_t kFastLanes = 8;
#endif

// e^(s - max) in place after the soft cap (cap > 0); returns max and the sum of the exponentials.
inline void softmax_partial(float* s, int64_t n, float cap, float& max_out, float& sum_out) {
  if (cap > 0)
    for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
  float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
#ifdef PERFXLM_AVX512
  __m512 mv = _mm512_set1_ps(mx);
  for (int64_t i = 0; i < n; i += 16) mv = _mm512_mask_max_ps(mv, tail_mask(n - i), mv, _mm512_maskz_loadu_ps(tail_mask(n - i), s + i));
  mx = _mm512_reduce_max_ps(mv);
  const __m512 m16 = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = tail_mask(n - i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + i), m16));
    _mm512_mask_storeu_ps(s + i, mask, e);
    acc = _mm512_mask_add_ps(acc, mask, acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(PERFXLM_AVX2)
  int64_t i = 0;
  __m256 mv = _mm256_set1_ps(mx);
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  for (; i < n; ++i) mx = std::max(mx, s[i]);
  const __m256 m8 = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m8));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  a4 = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));
  sum = _mm_cvtss_f32(_mm_add_ss(a4, _mm_movehdup_ps(a4)));
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
#else
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  for (int64_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
#endif
  max_out = mx;
  sum_out = sum;
}

// Walks tokens [t0, t1) of a sequence through its block table, one call per block:
// fn(t, stop, row of t, its scales or nullptr, the next block's id or -1 at the end of the range) covers
// tokens [t, stop), whose rows are token_stride apart (no per-token division).
template <typename T, typename Fn>
inline void walk(const T* cache, const ScaleT<T>* scales, const int64_t* table, int64_t t0, int64_t t1,
                 const Geometry& geo, Fn&& fn) {
  for (int64_t t = t0; t < t1;) {
    const int64_t blk = t / geo.block_size, slot = t % geo.block_size;
    const int64_t stop = std::min(t1, (blk + 1) * geo.block_size);
    const T* row = cache + table[blk] * geo.block_stride + slot * geo.token_stride;
    const ScaleT<T>* rs = scales ? scales + table[blk] * geo.s_block_stride + slot * geo.s_token_stride : nullptr;
    fn(t, stop, row, rs, stop < t1 ? table[blk + 1] : -1);
    t = stop;
  }
}

#if defined(PERFXLM_AVX512) || defined(PERFXLM_AVX2)
// fn(std::integral_constant<int, GH>{}, h) over the G query heads of a task in register tiles of at most
// TILE heads (GH: the tile's size, a template argument of the scores and values kernels).
template <int TILE, typename Fn>
inline void head_tiles(int64_t G, Fn&& fn) {
  static_assert(TILE >= 1 && TILE <= 4, "head tiles of 1 to 4");
  for (int64_t h = 0; h < G; h += TILE) {
    switch (std::min<int64_t>(TILE, G - h)) {
      case 1: fn(std::integral_constant<int, 1>{}, h); break;
      case 2: if constexpr (TILE >= 2) fn(std::integral_constant<int, 2>{}, h); break;
      case 3: if constexpr (TILE >= 3) fn(std::integral_constant<int, 3>{}, h); break;
      default: fn(std::integral_constant<int, TILE>{}, h); break;
    }
  }
}

// The next block's rows of this head, requested while the current block is computed: a head's rows are
// token_stride apart and its blocks scattered, a pattern the hardware prefetchers do not follow.
template <typename T>
inline void prefetch_block(const T* cache, int64_t next_block, const Geometry& geo, int64_t row_elems) {
  if (next_block < 0) return;
  const char* base = reinterpret_cast<const char*>(cache + next_block * geo.block_stride);
  const int64_t bytes = row_elems * static_cast<int64_t>(sizeof(T));
  for (int64_t r = 0; r < geo.block_size; ++r)
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(base + r * geo.token_stride * sizeof(T) + o, _MM_HINT_T0);
}

#endif

#ifdef PERFXLM_AVX512
// [sum(a), sum(b), sum(c), sum(d)]: four horizontal sums for the shuffles of about one and a half.
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 x = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));  // [a b c d] per 128-bit lane
  const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

// s[h * ns + (t - t0)] = q_h . k_t for the GH query heads at q (pre-scaled, [GH, 16 * DV]), tokens
// [t0, t1): each K chunk widened once for all GH heads, four tokens' sums reduced together.
template <typename T, int DV, int GH, Scales S>
void scores_fast(const float* q, const T* cache, const ScaleT<T>* scales, const int64_t* table, int64_t t0,
                 int64_t t1, const Geometry& geo, float* s, int64_t ns) {
  constexpr int D = 16 * DV;
  const int64_t ts = geo.token_stride, sts = geo.s_token_stride;
  const int64_t cpg = S == Scales::Group ? DV / geo.groups : DV;  // chunks per scale group
  walk(cache, scales, table, t0, t1, geo, [&](int64_t t, int64_t stop, const T* k, auto ks, int64_t next) {
    prefetch_block(cache, next, geo, D);
    for (; t + 4 <= stop; t += 4, k += 4 * ts) {
      __m512 acc[GH][4];
      for (int j = 0; j < 4; ++j) {
        for (int c = 0; c < DV; ++c) {
          __m512 kc = load16_fast(k + j * ts + 16 * c);
          if constexpr (S == Scales::Group) kc = _mm512_mul_ps(kc, _mm512_set1_ps(scale_value(ks[j * sts + c / cpg])));
          for (int h = 0; h < GH; ++h)
            acc[h][j] = c == 0 ? _mm512_mul_ps(_mm512_loadu_ps(q + h * D), kc)
                               : _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + 16 * c), kc, acc[h][j]);
        }
      }
      for (int h = 0; h < GH; ++h) {
        __m128 r = reduce4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
        if constexpr (S == Scales::Token)
          r = _mm_mul_ps(r, _mm_setr_ps(scale_value(ks[0]), scale_value(ks[sts]), scale_value(ks[2 * sts]),
                                        scale_value(ks[3 * sts])));
        _mm_storeu_ps(s + h * ns + (t - t0), r);
      }
      if constexpr (S != Scales::None) ks += 4 * sts;
    }
    for (; t < stop; ++t, k += ts) {
      __m512 acc[GH];
      for (int c = 0; c < DV; ++c) {
        __m512 kc = load16_fast(k + 16 * c);
        if constexpr (S == Scales::Group) kc = _mm512_mul_ps(kc, _mm512_set1_ps(scale_value(ks[c / cpg])));
        for (int h = 0; h < GH; ++h)
          acc[h] = c == 0 ? _mm512_mul_ps(_mm512_loadu_ps(q + h * D), kc)
                          : _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + 16 * c), kc, acc[h]);
      }
      for (int h = 0; h < GH; ++h)
        s[h * ns + (t - t0)] = _mm512_reduce_add_ps(acc[h]) * (S == Scales::Token ? scale_value(ks[0]) : 1.f);
      if constexpr (S != Scales::None) ks += sts;
    }
  });
}

// o[h] = sum_t p[h * np + (t - t0)] v_t for the GH heads, tokens [t0, t1): each V chunk widened once for
// all GH heads. Up to 4 chunks of 16 at a time (GH x 4 accumulators in registers); a wider head takes
// several passes over the range, whose rows are in L2 by then.
template <typename T, int DV, int GH, Scales S>
void values_fast(const float* p, int64_t np, const T* cache, const ScaleT<T>* scales, const int64_t* table,
                 int64_t t0, int64_t t1, const Geometry& geo, float* o) {
  constexpr int D = 16 * DV, SC = DV < 4 ? DV : 4;
  const int64_t ts = geo.token_stride, sts = geo.s_token_stride;
  const int64_t cpg = S == Scales::Group ? DV / geo.groups : DV;
  for (int c0 = 0; c0 < DV; c0 += SC) {
    __m512 acc[GH][SC];
    for (int h = 0; h < GH; ++h)
      for (int c = 0; c < SC; ++c) acc[h][c] = _mm512_setzero_ps();
    walk(cache, scales, table, t0, t1, geo, [&](int64_t t, int64_t stop, const T* v, auto vs, int64_t next) {
      if (c0 == 0) prefetch_block(cache, next, geo, D);
      for (; t < stop; ++t, v += ts) {
        __m512 pv[GH];
        const float tok = S == Scales::Token ? scale_value(vs[0]) : 1.f;
        for (int h = 0; h < GH; ++h) pv[h] = _mm512_set1_ps(p[h * np + (t - t0)] * tok);
        for (int c = 0; c < SC; ++c) {
          __m512 vc = load16_fast(v + 16 * (c0 + c));
          if constexpr (S == Scales::Group) vc = _mm512_mul_ps(vc, _mm512_set1_ps(scale_value(vs[(c0 + c) / cpg])));
          for (int h = 0; h < GH; ++h) acc[h][c] = _mm512_fmadd_ps(pv[h], vc, acc[h][c]);
        }
        if constexpr (S != Scales::None) vs += sts;
      }
    });
    for (int h = 0; h < GH; ++h)
      for (int c = 0; c < SC; ++c) _mm512_storeu_ps(o + h * D + 16 * (c0 + c), acc[h][c]);
  }
}

// One task's scores and values on the fast path: the G heads in register tiles of up to 4.
template <typename T, int DV, Scales S>
void range_fast(const float* q, int64_t G, const T* kc, const T* vc, const ScaleT<T>* ksc, const ScaleT<T>* vsc,
                const int64_t* table, int64_t t0, int64_t t1, const Geometry& geo, float cap, float* s, float* o,
                float* mx, float* sum) {
  constexpr int D = 16 * DV;
  const int64_t n = t1 - t0;
  head_tiles<4>(G, [&](auto gh, int64_t h) {
    scores_fast<T, DV, decltype(gh)::value, S>(q + h * D, kc, ksc, table, t0, t1, geo, s + h * n, n);
  });
  for (int64_t h = 0; h < G; ++h) softmax_partial(s + h * n, n, cap, mx[h], sum[h]);
  head_tiles<4>(G, [&](auto gh, int64_t h) {
    values_fast<T, DV, decltype(gh)::value, S>(s + h * n, n, vc, vsc, table, t0, t1, geo, o + h * D);
  });
}

#ifdef __AVX512BF16__
#define PERFXLM_DECODE_BF16 1
// A bf16 cache's products by vdpbf16ps where the caller asks for them (the CPU plan attends in bf16, as
// the prefill kernel does): pairs of bf16 products summed into float32 lanes, half the instructions of
// the float32 FMAs over widened rows and no widening. The queries (times the scale) and the softmax's
// weights are rounded to bf16 (to nearest even); maxima, exponentials, sums and outputs stay float32.
// A row's products do not depend on the other rows of its step, so verification rows keep their bits.

// s[h * ns + (t - t0)] = q_h . k_t for GH query heads, q: [GH, 32 * DC] bf16 (pre-scaled, rounded).
template <int DC, int GH>
void scores_bf16(const uint16_t* q, const uint16_t* cache, const int64_t* table, int64_t t0, int64_t t1,
                 const Geometry& geo, float* s, int64_t ns) {
  constexpr int D = 32 * DC;
  const int64_t ts = geo.token_stride;
  walk(cache, static_cast<const ScaleT<uint16_t>*>(nullptr), table, t0, t1, geo,
       [&](int64_t t, int64_t stop, const uint16_t* k, auto, int64_t next) {
    prefetch_block(cache, next, geo, D);
    for (; t + 4 <= stop; t += 4, k += 4 * ts) {
      __m512 acc[GH][4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        for (int h = 0; h < GH; ++h) acc[h][j] = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int c = 0; c < DC; ++c) {
          const __m512i kc = _mm512_loadu_si512(k + j * ts + 32 * c);
          for (int h = 0; h < GH; ++h) acc[h][j] = dot_pairs(acc[h][j], _mm512_loadu_si512(q + h * D + 32 * c), kc);
        }
      }
      for (int h = 0; h < GH; ++h) _mm_storeu_ps(s + h * ns + (t - t0), reduce4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]));
    }
    for (; t < stop; ++t, k += ts)
      for (int h = 0; h < GH; ++h) {
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < DC; ++c) acc = dot_pairs(acc, _mm512_loadu_si512(q + h * D + 32 * c), _mm512_loadu_si512(k + 32 * c));
        s[h * ns + (t - t0)] = _mm512_reduce_add_ps(acc);
      }
  });
}

// o[h] = sum_t p[h * np + (t - t0)] v_t for GH heads, p: bf16 weights. Two tokens per product: the
// weights of tokens t, t + 1 as one pair (one 32-bit broadcast from the weight row) against their rows
// interleaved word by word (vpunpcklwd / vpunpckhwd, within 128-bit lanes); a block's odd last token
// pairs with zero. The in-lane interleave leaves a 32-column chunk's columns in two accumulators in a
// fixed shuffled order (the low one columns 8L..8L + 3 at lanes 4L.., the high one 8L + 4..), undone
// once at the store: each column sums the same products in the same order as a full interleave would.
// Up to 2 chunks of 32 columns at a time; a wider head takes several passes over the range.
template <int DC, int GH>
void values_bf16(const uint16_t* p, int64_t np, const uint16_t* cache, const int64_t* table, int64_t t0, int64_t t1,
                 const Geometry& geo, float* o) {
  constexpr int D = 32 * DC, SC = DC < 2 ? DC : 2;
  const int64_t ts = geo.token_stride;
  // column j of a 32-column chunk from its (low, high) accumulators, j < 16 and j >= 16
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int c0 = 0; c0 < DC; c0 += SC) {
    __m512 lo[GH][SC], hi[GH][SC];
    for (int h = 0; h < GH; ++h)
      for (int c = 0; c < SC; ++c) lo[h][c] = hi[h][c] = _mm512_setzero_ps();
    auto step = [&](const __m512i* w, const uint16_t* v, bool pair) __attribute__((always_inline)) {
      for (int c = 0; c < SC; ++c) {
        const __m512i a = _mm512_loadu_si512(v + 32 * (c0 + c));
        const __m512i b = pair ? _mm512_loadu_si512(v + ts + 32 * (c0 + c)) : _mm512_setzero_si512();
        const __m512i vl = _mm512_unpacklo_epi16(a, b), vh = _mm512_unpackhi_epi16(a, b);
        for (int h = 0; h < GH; ++h) {
          lo[h][c] = dot_pairs(lo[h][c], w[h], vl);
          hi[h][c] = dot_pairs(hi[h][c], w[h], vh);
        }
      }
    };
    walk(cache, static_cast<const ScaleT<uint16_t>*>(nullptr), table, t0, t1, geo,
         [&](int64_t t, int64_t stop, const uint16_t* v, auto, int64_t next) {
      if (c0 == 0) prefetch_block(cache, next, geo, D);
      __m512i w[GH];
      for (; t + 2 <= stop; t += 2, v += 2 * ts) {
        for (int h = 0; h < GH; ++h) {
          int32_t both;  // the weights of t (low word) and t + 1
          std::memcpy(&both, p + h * np + (t - t0), 4);
          w[h] = _mm512_set1_epi32(both);
        }
        step(w, v, true);
      }
      if (t < stop) {
        for (int h = 0; h < GH; ++h) w[h] = _mm512_set1_epi32(p[h * np + (t - t0)]);
        step(w, v, false);
      }
    });
    for (int h = 0; h < GH; ++h)
      for (int c = 0; c < SC; ++c) {
        float* dst = o + h * D + 32 * (c0 + c);
        _mm512_storeu_ps(dst, _mm512_permutex2var_ps(lo[h][c], first, hi[h][c]));
        _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(lo[h][c], second, hi[h][c]));
      }
  }
}

// range_fast's task with bf16 products over a bf16 cache. q: float32 [G, 32 * DC] pre-scaled; qb, pb:
// room for the rounded queries [G, 32 * DC] and weights [G, t1 - t0].
template <int DC>
void range_bf16(const float* q, int64_t G, const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t t0,
                int64_t t1, const Geometry& geo, float cap, float* s, float* o, float* mx, float* sum, uint16_t* qb,
                uint16_t* pb) {
  constexpr int D = 32 * DC;
  const int64_t n = t1 - t0;
  auto round_bf16 = [](const float* x, int64_t count, uint16_t* out) {
    int64_t i = 0;
    for (; i + 16 <= count; i += 16) {
      const __m256bh r = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), reinterpret_cast<const __m256i&>(r));
    }
    if (i < count) {
      const __mmask16 m = tail_mask(count - i);
      const __m256bh r = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + i));
      _mm256_mask_storeu_epi16(out + i, m, reinterpret_cast<const __m256i&>(r));
    }
  };
  round_bf16(q, G * D, qb);
  head_tiles<4>(G, [&](auto gh, int64_t h) {
    scores_bf16<DC, decltype(gh)::value>(qb + h * D, kc, table, t0, t1, geo, s + h * n, n);
  });
  for (int64_t h = 0; h < G; ++h) {
    softmax_partial(s + h * n, n, cap, mx[h], sum[h]);
    round_bf16(s + h * n, n, pb + h * n);
  }
  head_tiles<4>(G, [&](auto gh, int64_t h) {
    values_bf16<DC, decltype(gh)::value>(pb + h * n, n, vc, table, t0, t1, geo, o + h * D);
  });
}
#endif
#elif defined(PERFXLM_AVX2)
// The same tasks on AVX2 (16 ymm registers): 8-lane chunks, up to 3 query heads per register tile
// (3 x 4 score accumulators, or 3 x 4 output chunks, plus the widened chunk fit in 16 registers).
constexpr int kHeadTile = 3;

// [sum(a), sum(b), sum(c), sum(d)]
inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}

inline float reduce_add8(__m256 a) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

template <typename T, int D, int GH, Scales S>
void scores_fast(const float* q, const T* cache, const ScaleT<T>* scales, const int64_t* table, int64_t t0,
                 int64_t t1, const Geometry& geo, float* s, int64_t ns) {
  constexpr int C = D / 8;
  const int64_t ts = geo.token_stride, sts = geo.s_token_stride;
  const int64_t cpg = S == Scales::Group ? C / geo.groups : C;  // chunks per scale group
  walk(cache, scales, table, t0, t1, geo, [&](int64_t t, int64_t stop, const T* k, auto ks, int64_t next) {
    prefetch_block(cache, next, geo, D);
    for (; t + 4 <= stop; t += 4, k += 4 * ts) {
      __m256 acc[GH][4];
      for (int c = 0; c < C; ++c) {
        for (int j = 0; j < 4; ++j) {
          __m256 kc = load8_fast(k + j * ts + 8 * c);
          if constexpr (S == Scales::Group) kc = _mm256_mul_ps(kc, _mm256_set1_ps(scale_value(ks[j * sts + c / cpg])));
          for (int h = 0; h < GH; ++h)
            acc[h][j] = c == 0 ? _mm256_mul_ps(_mm256_loadu_ps(q + h * D), kc)
                               : _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + 8 * c), kc, acc[h][j]);
        }
      }
      for (int h = 0; h < GH; ++h) {
        __m128 r = reduce4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
        if constexpr (S == Scales::Token)
          r = _mm_mul_ps(r, _mm_setr_ps(scale_value(ks[0]), scale_value(ks[sts]), scale_value(ks[2 * sts]),
                                        scale_value(ks[3 * sts])));
        _mm_storeu_ps(s + h * ns + (t - t0), r);
      }
      if constexpr (S != Scales::None) ks += 4 * sts;
    }
    for (; t < stop; ++t, k += ts) {
      __m256 acc[GH];
      for (int c = 0; c < C; ++c) {
        __m256 kc = load8_fast(k + 8 * c);
        if constexpr (S == Scales::Group) kc = _mm256_mul_ps(kc, _mm256_set1_ps(scale_value(ks[c / cpg])));
        for (int h = 0; h < GH; ++h)
          acc[h] = c == 0 ? _mm256_mul_ps(_mm256_loadu_ps(q + h * D), kc)
                          : _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + 8 * c), kc, acc[h]);
      }
      for (int h = 0; h < GH; ++h)
        s[h * ns + (t - t0)] = reduce_add8(acc[h]) * (S == Scales::Token ? scale_value(ks[0]) : 1.f);
      if constexpr (S != Scales::None) ks += sts;
    }
  });
}

template <typename T, int D, int GH, Scales S>
void values_fast(const float* p, int64_t np, const T* cache, const ScaleT<T>* scales, const int64_t* table,
                 int64_t t0, int64_t t1, const Geometry& geo, float* o) {
  constexpr int C = D / 8, SC = 4;  // D is a multiple of 32 here
  const int64_t ts = geo.token_stride, sts = geo.s_token_stride;
  const int64_t cpg = S == Scales::Group ? C / geo.groups : C;
  for (int c0 = 0; c0 < C; c0 += SC) {
    __m256 acc[GH][SC];
    for (int h = 0; h < GH; ++h)
      for (int c = 0; c < SC; ++c) acc[h][c] = _mm256_setzero_ps();
    walk(cache, scales, table, t0, t1, geo, [&](int64_t t, int64_t stop, const T* v, auto vs, int64_t next) {
      if (c0 == 0) prefetch_block(cache, next, geo, D);
      for (; t < stop; ++t, v += ts) {
        __m256 pv[GH];
        const float tok = S == Scales::Token ? scale_value(vs[0]) : 1.f;
        for (int h = 0; h < GH; ++h) pv[h] = _mm256_set1_ps(p[h * np + (t - t0)] * tok);
        for (int c = 0; c < SC; ++c) {
          __m256 vc = load8_fast(v + 8 * (c0 + c));
          if constexpr (S == Scales::Group) vc = _mm256_mul_ps(vc, _mm256_set1_ps(scale_value(vs[(c0 + c) / cpg])));
          for (int h = 0; h < GH; ++h) acc[h][c] = _mm256_fmadd_ps(pv[h], vc, acc[h][c]);
        }
        if constexpr (S != Scales::None) vs += sts;
      }
    });
    for (int h = 0; h < GH; ++h)
      for (int c = 0; c < SC; ++c) _mm256_storeu_ps(o + h * D + 8 * (c0 + c), acc[h][c]);
  }
}

template <typename T, int D, Scales S>
void range_fast(const float* q, int64_t G, const T* kc, const T* vc, const ScaleT<T>* ksc, const ScaleT<T>* vsc,
                const int64_t* table, int64_t t0, int64_t t1, const Geometry& geo, float cap, float* s, float* o,
                float* mx, float* sum) {
  const int64_t n = t1 - t0;
  head_tiles<kHeadTile>(G, [&](auto gh, int64_t h) {
    scores_fast<T, D, decltype(gh)::value, S>(q + h * D, kc, ksc, table, t0, t1, geo, s + h * n, n);
  });
  for (int64_t h = 0; h < G; ++h) softmax_partial(s + h * n, n, cap, mx[h], sum[h]);
  head_tiles<kHeadTile>(G, [&](auto gh, int64_t h) {
    values_fast<T, D, decltype(gh)::value, S>(s + h * n, n, vc, vsc, table, t0, t1, geo, o + h * D);
  });
}
#endif


// A row of any head size widened to float32 (a quantized row times its group scales) into `out`:
// widened once, then used by every query head of the group.
template <typename T>
inline void widen_row(const T* row, const ScaleT<T>* rs, int64_t D, int64_t GS, float* out) {
#ifdef PERFXLM_AVX512
  for (int64_t d = 0; d < D; d += 16) _mm512_mask_storeu_ps(out + d, tail_mask(D - d), load16(row + d, tail_mask(D - d)));
#else
  for (int64_t d = 0; d < D; ++d) out[d] = load_scalar(row + d);
#endif
  if (rs != nullptr)
    for (int64_t d = 0; d < D; ++d) out[d] *= scale_value(rs[d / GS]);
}

inline float dot_f(const float* a, const float* b, int64_t D) {
#ifdef PERFXLM_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16)
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail_mask(D - d), a + d), _mm512_maskz_loadu_ps(tail_mask(D - d), b + d), acc);
  return _mm512_reduce_add_ps(acc);
#else
  float acc = 0.f;
  for (int64_t d = 0; d < D; ++d) acc += a[d] * b[d];
  return acc;
#endif
}

// Any head size or scale group on any ISA: rows widened into a float buffer, then G dots / axpys.
template <typename T>
void range_generic(const float* q, int64_t G, int64_t D, const T* kc, const T* vc, const ScaleT<T>* ksc,
                   const ScaleT<T>* vsc, const int64_t* table, int64_t t0, int64_t t1, const Geometry& geo, float cap,
                   float* s, float* o, float* mx, float* sum, float* row) {
  const int64_t n = t1 - t0, GS = geo.groups > 0 ? D / geo.groups : D;
  walk(kc, ksc, table, t0, t1, geo, [&](int64_t t, int64_t stop, const T* k, auto ks, int64_t) {
    for (; t < stop; ++t, k += geo.token_stride, ks = ks ? ks + geo.s_token_stride : nullptr) {
      widen_row(k, ks, D, GS, row);
      for (int64_t h = 0; h < G; ++h) s[h * n + (t - t0)] = dot_f(q + h * D, row, D);
    }
  });
  for (int64_t h = 0; h < G; ++h) softmax_partial(s + h * n, n, cap, mx[h], sum[h]);
  std::fill(o, o + G * D, 0.f);
  walk(vc, vsc, table, t0, t1, geo, [&](int64_t t, int64_t stop, const T* v, auto vs, int64_t) {
    for (; t < stop; ++t, v += geo.token_stride, vs = vs ? vs + geo.s_token_stride : nullptr) {
      widen_row(v, vs, D, GS, row);
      for (int64_t h = 0; h < G; ++h) {
        const float w = s[h * n + (t - t0)];
        float* oh = o + h * D;
        for (int64_t d = 0; d < D; ++d) oh[d] += w * row[d];
      }
    }
  });
}

struct Task {
  int64_t b, h, t0, t1;
  int64_t part;  // its slot among the partial results, or -1: the range is the whole sequence
  int64_t range;  // which of its row's ranges
};

// Rows that read one block table (a speculative step's verification rows of one sequence, each the decode
// step it stands for) take their tasks in the order (KV head, range, row): the rows of a range run back
// to back on one thread, which reads those K and V rows from memory once and from its own cache for the
// other rows, instead of each thread streaming the whole sequence for its share of the rows. Only the
// order changes: every task computes what it did, so a row's bits are the same.
void order_by_range(std::vector<Task>& tasks, const int64_t* tables, int64_t B, int64_t max_blocks) {
  std::vector<int64_t> group(static_cast<size_t>(B));  // the first row of each run of rows with one table
  bool shared = false;
  for (int64_t b = 0; b < B; ++b) {
    const bool same = b > 0 && std::equal(tables + b * max_blocks, tables + (b + 1) * max_blocks, tables + (b - 1) * max_blocks);
    group[b] = same ? group[b - 1] : b;
    shared = shared || same;
  }
  if (!shared) return;
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& x, const Task& y) {
    return std::make_tuple(group[x.b], x.h, x.range, x.b) < std::make_tuple(group[y.b], y.h, y.range, y.b);
  });
}

// `k_scales` / `v_scales`: a quantized cache's [num_blocks, block_size, KVH, groups] scales, else
// nullptr (groups 0).
template <typename T>
void decode_attention_impl(const float* query, const T* key_cache, const T* value_cache, const int64_t* tables,
                           const int64_t* seq_lens, float* out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                           int64_t block_size, int64_t max_blocks, double scale, int64_t window, double soft_cap,
                           const ScaleT<T>* k_scales = nullptr, const ScaleT<T>* v_scales = nullptr,
                           int64_t groups = 0, const float* sinks = nullptr, bool bf16_products = false) {
  const int64_t G = H / KVH;
  const Geometry geo{block_size, block_size * KVH * D, KVH * D, block_size * KVH * groups, KVH * groups, groups};
  const float scale_f = static_cast<float>(scale), cap = static_cast<float>(soft_cap);
  auto first_of = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : 0; };

  // Range length: short enough that every thread gets several tasks at batch 1, within [kMinRange,
  // kMaxRange]. Taken from the sequence's own length, never the batch's: where the ranges fall decides
  // how the softmax sums round, and a row must round the same whatever else is in its step (a
  // speculative step's verification rows are the decode steps they stand for, bit for bit).
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  auto range_of = [&](int64_t n) { return std::clamp<int64_t>(n * KVH / (4 * threads) + 1, kMinRange, kMaxRange); };
  std::vector<Task> tasks;
  std::vector<int64_t> merge;  // (b * KVH + h) of the heads cut into several ranges, then their first part
  int64_t parts = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first = first_of(b), n = seq_lens[b] - first;
    if (n <= 0) {  // nothing to attend to: zeros, as before
      std::fill(out + b * H * D, out + (b + 1) * H * D, 0.f);
      continue;
    }
    const int64_t range = range_of(n), splits = (n + range - 1) / range;
    for (int64_t h = 0; h < KVH; ++h) {
      if (splits > 1) merge.insert(merge.end(), {b * KVH + h, parts, splits});
      for (int64_t i = 0; i < splits; ++i)
        tasks.push_back({b, h, first + i * n / splits, first + (i + 1) * n / splits, splits > 1 ? parts++ : -1, i});
    }
  }
  order_by_range(tasks, tables, B, max_blocks);
  // A partial result per head: unnormalised output [D], then the softmax max and sum.
  const int64_t part_stride = G * (D + 2);
  std::vector<float> partial(static_cast<size_t>(parts * part_stride));
#if defined(PERFXLM_AVX512) || defined(PERFXLM_AVX2)
  const int64_t GS = groups > 0 ? D / groups : D;
  const bool fast = (D == 64 || D == 128 || D == 256) && GS % kFastLanes == 0;
#endif
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buf;
    // scores, queries, outputs, maxima, sums, a widened row, then bf16 queries and weights (in floats)
    const size_t need = static_cast<size_t>(G * (kMaxRange + 2 * D + 2) + D + G * (D + kMaxRange) / 2 + 2);
    if (buf.size() < need) buf.resize(need);
    float* s = buf.data();  // scores, then weights [G, range]
    float* qs = s + G * kMaxRange;  // pre-scaled queries [G, D]
    float* o = qs + G * D;  // unnormalised outputs [G, D]
    float* mx = o + G * D;
    float* sum = mx + G;
    float* row = sum + G;
    uint16_t* bf16_rows = reinterpret_cast<uint16_t*>(row + D);  // bf16 queries [G, D], then weights
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[static_cast<size_t>(i)];
      const float* q = query + (task.b * H + task.h * G) * D;
      const int64_t* table = tables + task.b * max_blocks;
      const T* kc = key_cache + task.h * D;
      const T* vc = value_cache + task.h * D;
      const ScaleT<T>* ksc = k_scales ? k_scales + task.h * groups : nullptr;
      const ScaleT<T>* vsc = v_scales ? v_scales + task.h * groups : nullptr;
      bool done = false;
#if defined(PERFXLM_AVX512) || defined(PERFXLM_AVX2)
#ifdef PERFXLM_DECODE_BF16
      if constexpr (std::is_same<T, uint16_t>::value) {
        if (fast && bf16_products && groups == 0) {
          for (int64_t j = 0; j < G * D; ++j) qs[j] = q[j] * scale_f;
          uint16_t* qb = bf16_rows;
          auto run = [&](auto dc) {
            range_bf16<decltype(dc)::value>(qs, G, kc, vc, table, task.t0, task.t1, geo, cap, s, o, mx, sum, qb, qb + G * D);
          };
          switch (D) {  // 32-element chunks per row
            case 64: run(std::integral_constant<int, 2>{}); break;
            case 128: run(std::integral_constant<int, 4>{}); break;
            default: run(std::integral_constant<int, 8>{}); break;
          }
          done = true;
        }
      }
#endif
      if (fast && !done) {
        // load16_fast / load8_fast read values times kFastLoadScale<T> (a power of two): the query and the output
        // are scaled by its inverse, exactly.
        constexpr float f = kFastLoadScale<T>;
        for (int64_t j = 0; j < G * D; ++j) qs[j] = q[j] * scale_f / f;
        auto run = [&](auto dv, auto scales) {
          range_fast<T, decltype(dv)::value, decltype(scales)::value>(qs, G, kc, vc, ksc, vsc, table, task.t0, task.t1,
                                                                      geo, cap, s, o, mx, sum);
        };
        auto run_scaled = [&](auto dv) {
          if (groups == 0)
            run(dv, std::integral_constant<Scales, Scales::None>{});
          else if (groups == 1)
            run(dv, std::integral_constant<Scales, Scales::Token>{});
          else
            run(dv, std::integral_constant<Scales, Scales::Group>{});
        };
        switch (D) {  // AVX-512: 16-lane chunks per row; AVX2: the head size
          case 64: run_scaled(std::integral_constant<int, kFastLanes == 16 ? 4 : 64>{}); break;
          case 128: run_scaled(std::integral_constant<int, kFastLanes == 16 ? 8 : 128>{}); break;
          default: run_scaled(std::integral_constant<int, kFastLanes == 16 ? 16 : 256>{}); break;
        }
        if constexpr (f != 1.f)
          for (int64_t j = 0; j < G * D; ++j) o[j] /= f;
        done = true;
      }
#endif
      if (!done) {
        for (int64_t j = 0; j < G * D; ++j) qs[j] = q[j] * scale_f;
        range_generic(qs, G, D, kc, vc, ksc, vsc, table, task.t0, task.t1, geo, cap, s, o, mx, sum, row);
      }
      if (task.part < 0) {  // the whole sequence: normalise straight into the output
        float* dst = out + (task.b * H + task.h * G) * D;
        for (int64_t h = 0; h < G; ++h) {
          // A sink (gpt-oss) is one more term of the denominator, e^(sink - max), over no value. A sink so
          // far above the scores that the term overflows leaves o / inf = 0, the limit (the true value is
          // below float's range there).
          const float total = sinks != nullptr ? sum[h] + std::exp(sinks[task.h * G + h] - mx[h]) : sum[h];
          for (int64_t d = 0; d < D; ++d) dst[h * D + d] = o[h * D + d] / total;
        }
      } else {
        float* dst = partial.data() + task.part * part_stride;
        for (int64_t h = 0; h < G; ++h) {
          std::copy(o + h * D, o + (h + 1) * D, dst + h * (D + 2));
          dst[h * (D + 2) + D] = mx[h];
          dst[h * (D + 2) + D + 1] = sum[h];
        }
      }
    }
  });
  // Merge the ranges of each head: out = sum_i e^(m_i - M) o_i / sum_i e^(m_i - M) l_i.
  const int64_t heads_split = static_cast<int64_t>(merge.size() / 3);
  at::parallel_for(0, heads_split * G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* m = merge.data() + 3 * (i / G);
      const int64_t g = i % G, b = m[0] / KVH, h = m[0] % KVH, splits = m[2];
      const float* p0 = partial.data() + m[1] * part_stride + g * (D + 2);
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < splits; ++j) top = std::max(top, p0[j * part_stride + D]);
      float total = 0.f;
      if (sinks != nullptr) {  // the sink's term of the denominator (see the single-range case)
        const float sk = sinks[h * G + g];
        top = std::max(top, sk);
        total = std::exp(sk - top);
      }
      float* dst = out + (b * H + h * G + g) * D;
      std::fill(dst, dst + D, 0.f);
      for (int64_t j = 0; j < splits; ++j) {
        const float* pj = p0 + j * part_stride;
        const float w = std::exp(pj[D] - top);
        total += w * pj[D + 1];
        for (int64_t d = 0; d < D; ++d) dst[d] += w * pj[d];
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) dst[d] *= inv;
    }
  });
}

// A quantized cache's scales: [num_blocks, block_size, num_kv_heads, groups], groups dividing head_dim;
// float32 for int8, uint8 exponents for fp8 (ScaleOf).
int64_t check_scales(const at::Tensor& cache, const c10::optional<at::Tensor>& scales, const char* name) {
  const bool has = scales.has_value() && scales->defined();
  const auto dtype = cache.scalar_type();
  const bool fp8 = dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2;
  if (dtype != at::kChar && !fp8) {
    TORCH_CHECK(!has, name, " given for a cache that is not quantized");
    return 0;
  }
  TORCH_CHECK(has, "a quantized (", dtype, ") cache needs its ", name);
  const at::Tensor& s = *scales;
  const auto want = fp8 ? at::kByte : at::kFloat;
  TORCH_CHECK(s.scalar_type() == want && s.is_contiguous() && s.dim() == 4 && s.size(0) == cache.size(0) &&
                  s.size(1) == cache.size(1) && s.size(2) == cache.size(2) && s.size(3) >= 1 &&
                  cache.size(3) % s.size(3) == 0,
              name, " must be contiguous ", want, " [num_blocks, block_size, num_kv_heads, groups], groups dividing head_dim");
  return s.size(3);
}

// The formats' largest finite values, 0.875 * 2^(top + 1) (kv_quant.FP8_MAX / FP8_TOP).
constexpr float kE4m3Max = 448.f, kE5m2Max = 57344.f;
constexpr int kE4m3Top = 8, kE5m2Top = 15;

// The biased exponent byte of an fp8 group's power-of-two scale, as kv_quant.fp8_scale_exponents: the
// smallest e with amax / 2^e <= the format's maximum 0.875 * 2^(top + 1) (top 8: e4m3, 15: e5m2).
inline uint8_t fp8_scale_byte(float amax, int top) {
  if (!(amax > 0.f) || !std::isfinite(amax)) return 127;
  int k;
  const float m = std::frexp(amax, &k);  // amax = m 2^k, m in [0.5, 1)
  const int e = m <= 0.875f ? k - top - 1 : k - top;
  return static_cast<uint8_t>(std::clamp(e, -126, 126) + 127);
}

template <typename T>
const T* cache_ptr(const at::Tensor& t) { return reinterpret_cast<const T*>(t.const_data_ptr()); }

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t sliding_window, double soft_cap, const c10::optional<at::Tensor>& key_scale,
                                  const c10::optional<at::Tensor>& value_scale, const c10::optional<at::Tensor>& sinks,
                                  bool bf16_products) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat, "query must be float32 [B, H, D]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "caches must be [num_blocks, block_size, num_kv_heads, head_dim], both the same shape");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "key and value caches differ in dtype");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t KVH = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D, "head_dim of query (", D, ") and cache (", key_cache.size(3), ") differ");
  TORCH_CHECK(H % KVH == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.numel() == B, "one block table and length per sequence");
  const at::Tensor q = query.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  at::Tensor out = at::empty_like(q);
  const int64_t block_size = key_cache.size(1), max_blocks = tables.size(1), num_blocks = key_cache.size(0);
  {  // O(blocks) checks, so bad metadata fails like the torch path's indexing instead of reading out of bounds
    const int64_t* lp = lens.data_ptr<int64_t>();
    const int64_t* tp = tables.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(lp[b] >= 0 && lp[b] <= max_blocks * block_size, "seq_lens[", b, "] = ", lp[b],
                  " does not fit its block table (", max_blocks, " blocks of ", block_size, ")");
      for (int64_t j = 0; j < (lp[b] + block_size - 1) / block_size; ++j)
        TORCH_CHECK(tp[b * max_blocks + j] >= 0 && tp[b * max_blocks + j] < num_blocks, "block id ",
                    tp[b * max_blocks + j], " out of range for ", num_blocks, " cache blocks");
    }
  }
  at::Tensor sink_logits;
  if (sinks.has_value() && sinks->defined()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->numel() == H, "sinks must be float32 [num_heads] (",
                H, "), got ", sinks->scalar_type(), " ", sinks->sizes());
    sink_logits = sinks->contiguous();
  }
  const float* sink_p = sink_logits.defined() ? sink_logits.const_data_ptr<float>() : nullptr;
  const int64_t groups = check_scales(key_cache, key_scale, "key_scale");
  TORCH_CHECK(check_scales(value_cache, value_scale, "value_scale") == groups, "key and value scales differ in shape");
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const auto* ks = groups ? reinterpret_cast<const ScaleT<T>*>(key_scale->const_data_ptr()) : nullptr;
    const auto* vs = groups ? reinterpret_cast<const ScaleT<T>*>(value_scale->const_data_ptr()) : nullptr;
    decode_attention_impl<T>(q.data_ptr<float>(), cache_ptr<T>(key_cache), cache_ptr<T>(value_cache),
                             tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH, D,
                             block_size, max_blocks, scale, sliding_window, soft_cap, ks, vs, groups, sink_p,
                             bf16_products);
  };
  switch (key_cache.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(uint16_t{}); break;
    case at::kChar: run(int8_t{}); break;
    case at::kFloat8_e4m3fn: run(c10::Float8_e4m3fn{}); break;
    case at::kFloat8_e5m2: run(c10::Float8_e5m2{}); break;
    default: TORCH_CHECK(false, "cache dtype must be float32, bfloat16, int8, float8_e4m3fn or float8_e5m2");
  }
  return out;
}

namespace {
// Calls fn(values, group size, absmax, index of the group's scale, index of its first cache element) for
// every group of every row written to a quantized cache. The absmax is NaN where the group holds a NaN
// (as torch's amax), so both paths pick the same scale.
template <typename Fn>
void for_each_group(const float* src, int64_t src_stride, int64_t T, int64_t width, const int64_t* slots,
                    const at::Tensor& cache, const c10::optional<at::Tensor>& scales, Fn&& fn) {
  const int64_t groups = check_scales(cache, scales, "scales");
  const int64_t per_slot = width / cache.size(3) * groups, gs = cache.size(3) / groups;  // scales per slot
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < per_slot; ++g) {
      const float* x = src + t * src_stride + g * gs;
      float amax = 0.f;
      for (int64_t i = 0; i < gs; ++i) amax = std::isnan(x[i]) ? x[i] : std::max(amax, std::fabs(x[i]));
      fn(x, gs, amax, slots[t] * per_slot + g, slots[t] * width + g * gs);
    }
}
}  // namespace

// Rows of `src` ([T, width] with row stride `src_stride`) into cache slots (rows of `width` elements),
// quantized as perfxlm/ops/kv_quant.py's quantize(), per group of width / (heads * groups) values
// (`scales` gets [slot, heads * groups]): int8 with scale = absmax / 127, round half to even; fp8 times
// 2^-e (fp8_scale_byte), saturated to its range and rounded to nearest even.
void write_slots(const float* src, int64_t src_stride, int64_t T, int64_t width, const int64_t* slots,
                 at::Tensor& cache, const c10::optional<at::Tensor>& scales) {
  const int64_t num_slots = cache.numel() / width;
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " out of range for ", num_slots, " slots");
  if (cache.scalar_type() == at::kFloat) {
    float* dst = cache.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) std::memcpy(dst + slots[t] * width, src + t * src_stride, width * sizeof(float));
  } else if (cache.scalar_type() == at::kChar) {
    int8_t* dst = cache.data_ptr<int8_t>();
    for_each_group(src, src_stride, T, width, slots, cache, scales, [&](const float* x, int64_t gs, float amax,
                                                                      int64_t at, int64_t out_at) {
      const float sc = amax / 127.f, div = sc == 0.f ? 1.f : sc;
      scales->data_ptr<float>()[at] = sc;
      for (int64_t i = 0; i < gs; ++i)
        dst[out_at + i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[i] / div))));
    });
  } else if (cache.scalar_type() == at::kFloat8_e4m3fn || cache.scalar_type() == at::kFloat8_e5m2) {
    const bool e4m3 = cache.scalar_type() == at::kFloat8_e4m3fn;
    const float mx = e4m3 ? kE4m3Max : kE5m2Max;
    uint8_t* dst = reinterpret_cast<uint8_t*>(cache.data_ptr());
    for_each_group(src, src_stride, T, width, slots, cache, scales, [&](const float* x, int64_t gs, float amax,
                                                                      int64_t at, int64_t out_at) {
      const uint8_t byte = fp8_scale_byte(amax, e4m3 ? kE4m3Top : kE5m2Top);
      scales->data_ptr<uint8_t>()[at] = byte;
      const float inv = scale_value(static_cast<uint8_t>(254 - byte));  // 2^-e
      for (int64_t i = 0; i < gs; ++i) {
        float y = x[i] * inv;  // saturated; a NaN stays NaN, as torch's clamp
        y = y > mx ? mx : (y < -mx ? -mx : y);
        dst[out_at + i] = e4m3 ? c10::Float8_e4m3fn(y).x : c10::Float8_e5m2(y).x;
      }
    });
  } else {
    uint16_t* dst = reinterpret_cast<uint16_t*>(cache.data_ptr<at::BFloat16>());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < width; ++i) dst[slots[t] * width + i] = float_to_bf16(src[t * src_stride + i]);
  }
}

// The module path's cache write for a quantized cache: float32 K/V [T, num_kv_heads, head_dim] into their
// slots, quantized in one pass (the same code as the fused layer's write).
void write_kv_slots(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                    const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& key_scale,
                    const c10::optional<at::Tensor>& value_scale) {
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat && key.dim() == 3 &&
                  key.sizes() == value.sizes(),
              "key and value must be float32 [T, num_kv_heads, head_dim]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 4 &&
                  key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2),
              "caches must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == key.size(0), "one int64 slot per token");
  const at::Tensor k = key.contiguous(), v = value.contiguous(), slots = slot_mapping.contiguous();
  const int64_t T = k.size(0), width = k.size(1) * k.size(2);
  write_slots(k.data_ptr<float>(), width, T, width, slots.data_ptr<int64_t>(), key_cache, key_scale);
  write_slots(v.data_ptr<float>(), width, T, width, slots.data_ptr<int64_t>(), value_cache, value_scale);
}
}  // namespace perfxlm_attn

TORCH_LIBRARY_FRAGMENT(perfxlm, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int sliding_window, float soft_cap, Tensor? key_scale=None, "
      "Tensor? value_scale=None, Tensor? sinks=None, bool bf16_products=False) -> Tensor");
  m.def(
      "write_kv_slots(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
      "Tensor(c!)? key_scale=None, Tensor(d!)? value_scale=None) -> ()");
}

TORCH_LIBRARY_IMPL(perfxlm, CPU, m) {
  m.impl("paged_decode_attention", &perfxlm_attn::paged_decode_attention);
  m.impl("write_kv_slots", &perfxlm_attn::write_kv_slots);
}
