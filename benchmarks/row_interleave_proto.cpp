// Batch-1 int8-dot GEMV for Q8_0 and Q4_0 weights in two code layouts, standalone (built and run by
// benchmarks/row_interleave.py, which documents the question and reads the output):
//
//   plain: perfxlm's layout (a row's codes contiguous, float16 scales [N, K / 32]), with the loops of
//     csrc/quant_linear.cpp's batch-1 kernels as they stand: vnni_block_tile<MT 1, NT 4> (AVX512-VNNI,
//     zmm) and block_tile_m1x4 / block_tile_m1x4_q8 (AVX2), each after quantize_blocks' activation pass.
//   rows R (4, 8, 16): the blocks of R consecutive rows stored together. Per block of 32 inputs: the R
//     rows' float16 scales, contiguous, then the R rows' codes as [quad q][row r][4 bytes] (a quad: 4
//     consecutive codes of the row; Q4_0's 16 bytes per row-block taken as 4 byte quads, GGUF's nibble
//     order: quad q's low nibbles are codes 4q..4q+3, its high nibbles codes 16 + 4q..). A W-bit vector
//     then holds QV = W / 32 / R quads of R rows: the int32 lanes of one vpdpbusd belong to different
//     rows, one conversion and one FMA with the R rows' scales (a plain load) serve the R rows per block,
//     the centre (128 or 8) comes off in the integer sum (the accumulator starts at -centre x the block's
//     activation sum), and the rows' results come out in lanes: no permutes of scales, no horizontal
//     sum per row, no mins pass.
//
// Modes: check (each kernel against a double reference), time (per-call thread CPU time, kernels
// alternated batch by batch, medians), count (a fixed number of calls of one kernel, for callgrind).
#include <immintrin.h>
#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#define NOINLINE __attribute__((noinline))

// ---------------------------------------------------------------------------------------------
// Shared: float16, activation blocks (act_blocks.h's rounding)
// ---------------------------------------------------------------------------------------------
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t f2h(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

// act_blocks.h's rounding, the widest form this build has, as the engine quantizes activations
#include "../perfxlm/csrc/act_blocks.h"
static inline float quantize_block(const float* src, int8_t* q) { return perfxlm_act::quantize_block_fast(src, q); }

// One weight in the plain layout: codes [N, K] (8-bit, u = q + 128) or [N, K / 2] (GGUF Q4 nibbles), scales
// float16 [N, K / 32]; w = scale x (u - centre).
struct Plain {
  const uint8_t* codes;
  const uint16_t* scales;
  int64_t N, K, row_bytes, groups;
  bool bits4;
};

// ---------------------------------------------------------------------------------------------
// (a) plain layout, AVX512-VNNI: quantize_blocks (one row) + vnni_block_tile<FloatScales<half>, MT 1, NT 4>
// ---------------------------------------------------------------------------------------------
struct PlainActs {
  std::vector<int8_t> q;
  std::vector<float> lanes, pair8, gsum;
  int64_t gstride;
};

static void plain_acts(const float* x, const Plain& w, PlainActs& a) {
  const int64_t K = w.K, chunks = K / 64;
  a.gstride = (w.groups + 7) / 8 * 8;
  a.q.resize(K);
  a.lanes.resize(chunks * 16);
  a.pair8.resize(chunks * 8);
  a.gsum.assign(a.gstride, 0.f);
  int64_t g = 0, g_end = 32;
  for (int64_t c = 0; c < chunks; ++c) {
    int8_t block[2][32];
    float scale[2];
    for (int half = 0; half < 2; ++half) {
      scale[half] = quantize_block(x + c * 64 + half * 32, block[half]);
      int32_t total[2] = {0, 0};
      for (int j = 0; j < 32; ++j) total[j / 16] += block[half][j];
      for (int h = 0; h < 2; ++h) {
        const int64_t at = c * 64 + half * 32 + h * 16;
        if (at >= g_end) {
          ++g;
          g_end += 32;
        }
        a.gsum[g] += scale[half] * static_cast<float>(total[h]);
      }
    }
    int8_t* dst = a.q.data() + c * 64;
    float* lanes = a.lanes.data() + c * 16;
    if (w.bits4) {
      std::memcpy(dst, block[0], 16);
      std::memcpy(dst + 16, block[1], 16);
      std::memcpy(dst + 32, block[0] + 16, 16);
      std::memcpy(dst + 48, block[1] + 16, 16);
      for (int l = 0; l < 16; ++l) lanes[l] = scale[(l / 4) % 2];
    } else {
      std::memcpy(dst, block[0], 32);
      std::memcpy(dst + 32, block[1], 32);
      for (int l = 0; l < 16; ++l) lanes[l] = scale[l / 8];
      float* pair = a.pair8.data() + c * 8;
      for (int l = 0; l < 8; ++l) pair[l] = scale[(l / 2) % 2];
    }
  }
}

#ifdef __AVX512VNNI__
template <bool BITS4>
static inline __m512i chunk_codes(const uint8_t* row, int64_t c) {
  if constexpr (BITS4) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
  } else {
    return _mm512_loadu_si512(row + c * 64);
  }
}

static inline __m512 load_half16(const uint16_t* p, int64_t n) {
  const __mmask16 mask = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

template <bool BITS4>
static inline void vnni_tile4(const PlainActs& a, const Plain& w, int64_t n0, float* y, float min_factor) {
  constexpr int NT = 4;
  const int64_t K = w.K, chunks = K / 64;
  const int8_t* xq = a.q.data();
  const float* lanes = a.lanes.data();
  const __m512i base_idx = BITS4 ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
                                 : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  constexpr int64_t per_load = 8;  // 16 scales = 8 chunks
  __m512 acc[NT];
  for (int j = 0; j < NT; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < chunks; c0 += per_load) {
    const int64_t c1 = std::min(chunks, c0 + per_load);
    __m512 S[NT];
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) S[j] = load_half16(w.scales + (n0 + j) * w.groups + c0 * 2, (c1 - c0) * 2);
    for (int64_t c = c0; c < c1; ++c) {
      const __m512i xv = _mm512_loadu_si512(xq + c * 64);
      const __m512 xs = _mm512_loadu_ps(lanes + c * 16);
      const __m512i idx = _mm512_add_epi32(base_idx, _mm512_set1_epi32(static_cast<int>(2 * (c - c0))));
#pragma GCC unroll 4
      for (int j = 0; j < NT; ++j) {
        const uint8_t* row = w.codes + (n0 + j) * w.row_bytes;
        if (!BITS4 || (c & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + NT * w.row_bytes + c * (BITS4 ? 32 : 64)), _MM_HINT_T0);
        const __m512i wv = chunk_codes<BITS4>(row, c);
        const __m512 ws = _mm512_permutexvar_ps(idx, S[j]);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, xs), acc[j]);
      }
    }
  }
  // tile_mins_store: the centre's term, 16 groups per step, then the reductions
  for (int64_t g = 0; g < w.groups; g += 16) {
    const int64_t left = w.groups - g;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) {
      const __m512 mv = _mm512_mul_ps(load_half16(w.scales + (n0 + j) * w.groups + g, left), _mm512_set1_ps(min_factor));
      acc[j] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(mask, a.gsum.data() + g), acc[j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NT; ++j) y[n0 + j] = _mm512_reduce_add_ps(acc[j]);
}

template <bool BITS4>
NOINLINE void plain_vnni(const float* x, const Plain& w, float* y) {
  thread_local PlainActs a;
  plain_acts(x, w, a);
  const float min_factor = BITS4 ? -8.f : -128.f;
  for (int64_t n = 0; n + 4 <= w.N; n += 4) vnni_tile4<BITS4>(a, w, n, y, min_factor);
}
#endif

// ---------------------------------------------------------------------------------------------
// (a) plain layout, AVX2: block_tile_m1x4 (4-bit, SPC 2, float16) / block_tile_m1x4_q8
// (vpmaddubsw + vpmaddwd; 8-bit codes through the sign trick, as without AVX-VNNI)
// ---------------------------------------------------------------------------------------------
static inline __m256i dot_pairs2(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}
static inline __m256i dot_u8(__m256i u, __m256i s) {
  const __m256i c = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(s, c)), _mm256_set1_epi16(1));
}
static inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
static inline void prefetch_range(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  int64_t o = 0;
  for (; o + 256 <= bytes; o += 256) {
    _mm_prefetch(c + o, _MM_HINT_T0);
    _mm_prefetch(c + o + 64, _MM_HINT_T0);
    _mm_prefetch(c + o + 128, _MM_HINT_T0);
    _mm_prefetch(c + o + 192, _MM_HINT_T0);
  }
  for (; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}
static inline void prefetch_rows(const Plain& w, int64_t n, int64_t count) {
  count = std::min(count, w.N - n);
  if (count <= 0) return;
  prefetch_range(w.codes + n * w.row_bytes, count * w.row_bytes);
  prefetch_range(w.scales + n * w.groups, count * w.groups * 2);
}
static inline __m256 half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// add_mins (4-bit centred: min = scale x -8; 8-bit shifted codes need nothing)
static inline __m256 add_mins4(__m256 acc, const Plain& w, int64_t row_base, const float* gsum) {
  const __m256 factor = _mm256_set1_ps(-8.f);
  int64_t g = 0;
  for (; g + 8 <= w.groups; g += 8) acc = _mm256_fmadd_ps(_mm256_mul_ps(half8(w.scales + row_base + g), factor), _mm256_loadu_ps(gsum + g), acc);
  if (g < w.groups) {
    const int64_t last = w.groups - 8;
    const __m256i done = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(g - last)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 mv = _mm256_mul_ps(half8(w.scales + row_base + last), factor);
    return _mm256_fmadd_ps(mv, _mm256_andnot_ps(_mm256_castsi256_ps(done), _mm256_loadu_ps(gsum + last)), acc);
  }
  return acc;
}

template <bool BITS4>
NOINLINE void plain_avx2(const float* x, const Plain& w, float* y) {
  thread_local PlainActs a;
  plain_acts(x, w, a);
  const int64_t K = w.K, chunks = K / 64;
  const int8_t* xq = a.q.data();
  for (int64_t n0 = 0; n0 + 4 <= w.N; n0 += 4) {
    const uint8_t* row[4];
    int64_t base[4];
    for (int j = 0; j < 4; ++j) {
      row[j] = w.codes + (n0 + j) * w.row_bytes;
      base[j] = (n0 + j) * w.groups;
    }
    prefetch_rows(w, n0 + 16, 4);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    if constexpr (BITS4) {
      const __m256i nib = _mm256_set1_epi8(0x0F);
      auto chunk = [&](int64_t c, const auto& scales) {
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * 64));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * 64 + 32));
        const __m256 xv = _mm256_loadu_ps(a.lanes.data() + c * 16);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[j] + c * 32));
          const __m256i lo = _mm256_and_si256(b, nib), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
          acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_pairs2(lo, x0, hi, x1)), _mm256_mul_ps(scales(j), xv), acc[j]);
        }
      };
      int64_t c = 0;
      for (; c + 4 <= chunks; c += 4) {
        __m256 s8[4];
        for (int j = 0; j < 4; ++j) s8[j] = half8(w.scales + base[j] + 2 * c);
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
          const __m256i idx = _mm256_setr_epi32(2 * q, 2 * q, 2 * q, 2 * q, 2 * q + 1, 2 * q + 1, 2 * q + 1, 2 * q + 1);
          chunk(c + q, [&](int j) { return _mm256_permutevar8x32_ps(s8[j], idx); });
        }
      }
      for (; c < chunks; ++c) {
        chunk(c, [&](int j) {
          int32_t v;
          std::memcpy(&v, w.scales + base[j] + 2 * c, 4);
          return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(v))), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
        });
      }
      for (int j = 0; j < 4; ++j) acc[j] = add_mins4(acc[j], w, base[j], a.gsum.data());
    } else {
      for (int64_t c = 0; c < chunks; ++c) {
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[j] + c * 64));
          const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[j] + c * 64 + 32));
          int32_t v;
          std::memcpy(&v, w.scales + base[j] + 2 * c, 4);
          const __m256 ws8 = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(v))), _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1));
          const __m256i d0 = dot_u8(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * 64)));
          const __m256i d1 = dot_u8(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * 64 + 32)));
          acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(d0, d1)), _mm256_mul_ps(ws8, _mm256_loadu_ps(a.pair8.data() + c * 8)), acc[j]);
        }
      }
    }
    _mm_storeu_ps(y + n0, hsum4x8(acc[0], acc[1], acc[2], acc[3]));
  }
}

// ---------------------------------------------------------------------------------------------
// (b) row-interleaved layout
// ---------------------------------------------------------------------------------------------
// Per group of R rows, per block b: R float16 scales, then the codes ([quad][row][4 bytes]); groups one
// after the other, so the whole weight is one stream.
struct Inter {
  const uint8_t* data;
  int64_t N, K, R, blocks, block_bytes, group_bytes;
  bool bits4;
};

static std::vector<uint8_t> interleave(const Plain& w, int R) {
  const int64_t blocks = w.K / 32, code_bytes = R * (w.bits4 ? 16 : 32), block_bytes = 2 * R + code_bytes;
  std::vector<uint8_t> out((w.N / R) * blocks * block_bytes);
  for (int64_t g = 0; g < w.N / R; ++g)
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* dst = out.data() + (g * blocks + b) * block_bytes;
      for (int r = 0; r < R; ++r) std::memcpy(dst + 2 * r, w.scales + (g * R + r) * w.groups + b, 2);
      const int quads = w.bits4 ? 4 : 8;
      for (int q = 0; q < quads; ++q)
        for (int r = 0; r < R; ++r)
          std::memcpy(dst + 2 * R + (q * R + r) * 4, w.codes + (g * R + r) * w.row_bytes + b * (w.bits4 ? 16 : 32) + 4 * q, 4);
    }
  return out;
}

// Activations for the interleaved kernels: int8 blocks in order, each block's scale and -centre x its sum
// (the integer accumulator's start), and for vectors holding QV > 1 quads per row the block's quads
// spread as the code vectors hold them (vector v: lanes j R .. j R + R - 1 take quad v QV + j).
struct InterActs {
  std::vector<int8_t> q;
  std::vector<float> dx;
  std::vector<int32_t> corr;
  std::vector<int8_t> spread;  // [block][8 / QV vectors][W / 8 bytes]
};

static void inter_acts(const float* x, int64_t K, int centre, int lanes, int R, InterActs& a) {
  const int64_t blocks = K / 32;
  a.q.resize(K);
  a.dx.resize(blocks);
  a.corr.resize(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    a.dx[b] = quantize_block(x + 32 * b, a.q.data() + 32 * b);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + 32 * b));
    // sum of 32 int8 as 4 x int64 via sad against 0 after the sign flip: sum(q + 128) - 4096
    const __m256i s = _mm256_sad_epu8(_mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))), _mm256_setzero_si256());
    const __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    const int32_t sum = static_cast<int32_t>(_mm_cvtsi128_si64(t) + _mm_extract_epi64(t, 1)) - 4096;
    a.corr[b] = -centre * sum;
  }
  const int QV = lanes / R;
  if (QV > 1) {
    const int vecs = 8 / QV, vbytes = lanes * 4;
    a.spread.resize(blocks * vecs * vbytes);
    const int32_t* q32 = reinterpret_cast<const int32_t*>(a.q.data());
    int32_t* s32 = reinterpret_cast<int32_t*>(a.spread.data());
    for (int64_t b = 0; b < blocks; ++b)
      for (int v = 0; v < vecs; ++v)
        for (int j = 0; j < QV; ++j)
          for (int r = 0; r < R; ++r) s32[(b * vecs + v) * lanes + j * R + r] = q32[b * 8 + v * QV + j];
  }
}

// Vector traits: 512 (zmm, VNNI), 256 (ymm, AVX512-VL VNNI), 2562 (ymm, AVX2 vpmaddubsw)
template <int W>
struct Vec;
#ifdef __AVX512VNNI__
template <>
struct Vec<512> {
  using I = __m512i;
  using F = __m512;
  static constexpr int lanes = 16;
  static I load(const void* p) { return _mm512_loadu_si512(p); }
  static I bcast32(const void* p) { return _mm512_set1_epi32(*static_cast<const int32_t*>(p)); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  template <int R>
  static I first(int32_t v) { return _mm512_maskz_set1_epi32(static_cast<__mmask16>((1u << R) - 1), v); }
  static I zero() { return _mm512_setzero_si512(); }
  static I nib(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static I nibhi(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
  static I dot(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fset1(float v) { return _mm512_set1_ps(v); }
  template <int R>
  static F scales(const uint16_t* p) {  // R float16 scales repeated over the lanes
    if constexpr (R == 16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    if constexpr (R == 8) return _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    if constexpr (R == 4) return _mm512_cvtph_ps(_mm256_set1_epi64x(*reinterpret_cast<const int64_t*>(p)));
  }
  template <int R>
  static void store(float* y, F acc) {  // sum the lanes of each row
    if constexpr (R == 16) _mm512_storeu_ps(y, acc);
    if constexpr (R == 8) _mm256_storeu_ps(y, _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1)));
    if constexpr (R == 4) {
      const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
      _mm_storeu_ps(y, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
  }
};
#endif
template <>
struct Vec<256> {
  using I = __m256i;
  using F = __m256;
  static constexpr int lanes = 8;
  static I load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static I bcast32(const void* p) { return _mm256_set1_epi32(*static_cast<const int32_t*>(p)); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  template <int R>  // v in the lanes of the first quad's rows (each row's lanes are summed at the end)
  static I first(int32_t v) {
    if constexpr (R == 8) return _mm256_set1_epi32(v);
    else return _mm256_blend_epi32(_mm256_setzero_si256(), _mm256_set1_epi32(v), (1 << R) - 1);
  }
#ifdef __AVX512VNNI__
  static I zero() { return _mm256_setzero_si256(); }
  static I nib(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static I nibhi(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
  static I dot(I acc, I u, I s) { return _mm256_dpbusd_epi32(acc, u, s); }
#endif
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fset1(float v) { return _mm256_set1_ps(v); }
  template <int R>
  static F scales(const uint16_t* p) {
    if constexpr (R == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if constexpr (R == 4) return _mm256_cvtph_ps(_mm_set1_epi64x(*reinterpret_cast<const int64_t*>(p)));
  }
  template <int R>
  static void store(float* y, F acc) {
    if constexpr (R == 8) _mm256_storeu_ps(y, acc);
    if constexpr (R == 4) _mm_storeu_ps(y, _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1)));
  }
};
// AVX2 without VNNI: the same shapes on ymm; the dots are vpmaddubsw + vpmaddwd (see inter_block_avx2)
template <>
struct Vec<2562> : Vec<256> {};

#ifndef PF_BYTES
#define PF_BYTES 1024  // -DPF_BYTES=... to try other distances (512-4096 measured alike, loaded)
#endif
constexpr int kPrefetchBytes = PF_BYTES;  // how far ahead of its reads the stream is requested

// One block of R rows (VNNI): code vectors dotted with their activations into two int32 chains, the
// first starting at the centre's correction.
#ifdef __AVX512VNNI__
template <int W, int R, bool BITS4>
static inline typename Vec<W>::I inter_block_vnni(const uint8_t* codes, const InterActs& a, int64_t b) {
  using V = Vec<W>;
  using I = typename V::I;
  constexpr int QV = V::lanes / R, vecs = 8 / QV;  // value vectors per block
  const int8_t* xq = a.q.data() + 32 * b;
  const int8_t* xs = QV > 1 ? a.spread.data() + b * vecs * V::lanes * 4 : nullptr;
  auto act = [&](int v) -> I {
    if constexpr (QV == 1) return V::bcast32(xq + 4 * v);
    else return V::load(xs + v * V::lanes * 4);
  };
  I s0 = V::template first<R>(a.corr[b]), s1 = V::zero();
  if constexpr (BITS4) {
    constexpr int loads = vecs / 2;  // each load: its low nibbles vector v, its high ones v + vecs / 2
#pragma GCC unroll 8
    for (int l = 0; l < loads; ++l) {
      const I raw = V::load(codes + l * V::lanes * 4);
      s0 = V::dot(s0, V::nib(raw), act(l));
      s1 = V::dot(s1, V::nibhi(raw), act(l + loads));
    }
  } else {
#pragma GCC unroll 8
    for (int v = 0; v < vecs; v += 2) {
      s0 = V::dot(s0, V::load(codes + v * V::lanes * 4), act(v));
      s1 = V::dot(s1, V::load(codes + (v + 1) * V::lanes * 4), act(v + 1));
    }
  }
  return V::add(s0, s1);
}
#endif

// One block of R rows (AVX2): vpmaddubsw pairs; 4-bit codes' int16 sums of a whole block fit (8 x 2 x
// 15 x 127), so one vpmaddwd per block; 8-bit codes go through the sign trick, a vpmaddwd per vector.
template <int R, bool BITS4>
static inline __m256i inter_block_avx2(const uint8_t* codes, const InterActs& a, int64_t b) {
  constexpr int QV = 8 / R, vecs = 8 / QV;
  const int8_t* xq = a.q.data() + 32 * b;
  const int8_t* xs = QV > 1 ? a.spread.data() + b * vecs * 32 : nullptr;
  auto act = [&](int v) -> __m256i {
    if constexpr (QV == 1) return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xq + 4 * v));
    else return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + v * 32));
  };
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS4) {
    constexpr int loads = vecs / 2;
    __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int l = 0; l < loads; ++l) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + l * 32));
      p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(_mm256_and_si256(raw, _mm256_set1_epi8(0x0F)), act(l)));
      p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F)), act(l + loads)));
    }
    return _mm256_add_epi32(Vec<256>::first<R>(a.corr[b]), _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones));
  } else {
    // codes - 128 are the signed values: no correction
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int v = 0; v < vecs; v += 2) {
      s0 = _mm256_add_epi32(s0, dot_u8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + v * 32)), act(v)));
      s1 = _mm256_add_epi32(s1, dot_u8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + (v + 1) * 32)), act(v + 1)));
    }
    return _mm256_add_epi32(s0, s1);
  }
}

template <int W, int R, bool BITS4>
NOINLINE void inter_gemv(const float* x, const Inter& w, float* y) {
  using V = Vec<W>;
  using F = typename V::F;
  thread_local InterActs a;
  inter_acts(x, w.K, (W == 2562 && !BITS4) ? 0 : (BITS4 ? 8 : 128), V::lanes, R, a);
  const int64_t blocks = w.blocks;
  for (int64_t g = 0; g < w.N / R; ++g) {
    const uint8_t* p = w.data + g * w.group_bytes;
    F acc0 = V::fzero(), acc1 = V::fzero();
    int64_t b = 0;
    // two float chains (even and odd blocks): a block of 8 rows is a few cycles of dot products, less
    // than an FMA's latency plus the conversion's
    auto block = [&](int64_t bb, F acc) -> F {
      const uint8_t* blk = p + bb * w.block_bytes;
      for (int64_t o = 0; o < w.block_bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + o), _MM_HINT_T0);
      typename V::I isum;
      if constexpr (W == 2562) isum = inter_block_avx2<R, BITS4>(blk + 2 * R, a, bb);
#ifdef __AVX512VNNI__
      else isum = inter_block_vnni<W, R, BITS4>(blk + 2 * R, a, bb);
#endif
      const F s = V::mul(V::template scales<R>(reinterpret_cast<const uint16_t*>(blk)), V::fset1(a.dx[bb]));
      return V::fma(V::cvt(isum), s, acc);
    };
    for (; b + 2 <= blocks; b += 2) {
      acc0 = block(b, acc0);
      acc1 = block(b + 1, acc1);
    }
    if (b < blocks) acc0 = block(b, acc0);
#ifdef __AVX512VNNI__
    if constexpr (W == 512) V::template store<R>(y + g * R, _mm512_add_ps(acc0, acc1));
    else
#endif
      V::template store<R>(y + g * R, _mm256_add_ps(acc0, acc1));
  }
}

// ---------------------------------------------------------------------------------------------
// Driver
// ---------------------------------------------------------------------------------------------
struct Weight {
  std::vector<uint8_t> codes;
  std::vector<uint16_t> scales;
  Plain plain;
  std::vector<uint8_t> inter[3];  // R = 4, 8, 16
  Inter iv[3];
};

static void make_weight(Weight& wt, int64_t N, int64_t K, bool bits4, std::mt19937& rng) {
  const int64_t row_bytes = bits4 ? K / 2 : K, groups = K / 32;
  wt.codes.resize(N * row_bytes);
  wt.scales.resize(N * groups);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> sc(0.001f, 0.02f);
  for (auto& c : wt.codes) c = static_cast<uint8_t>(byte(rng));
  for (auto& s : wt.scales) s = f2h(sc(rng));
  wt.plain = Plain{wt.codes.data(), wt.scales.data(), N, K, row_bytes, groups, bits4};
  const int Rs[3] = {4, 8, 16};
  for (int i = 0; i < 3; ++i) {
    wt.inter[i] = interleave(wt.plain, Rs[i]);
    const int64_t block_bytes = 2 * Rs[i] + Rs[i] * (bits4 ? 16 : 32);
    wt.iv[i] = Inter{wt.inter[i].data(), N, K, Rs[i], K / 32, block_bytes, block_bytes * (K / 32), bits4};
  }
}

// y = W x in double from the plain codes, x rounded to its int8 blocks as every kernel rounds it
static std::vector<double> reference(const float* x, const Plain& w) {
  std::vector<int8_t> q(w.K);
  std::vector<float> dx(w.K / 32);
  for (int64_t b = 0; b < w.K / 32; ++b) dx[b] = quantize_block(x + 32 * b, q.data() + 32 * b);
  std::vector<double> y(w.N);
  for (int64_t n = 0; n < w.N; ++n) {
    double total = 0;
    for (int64_t b = 0; b < w.K / 32; ++b) {
      int64_t dot = 0;
      for (int i = 0; i < 32; ++i) {
        int u;
        if (w.bits4) {
          const uint8_t byte = w.codes[n * w.row_bytes + b * 16 + (i % 16)];
          u = (i < 16 ? byte & 15 : byte >> 4) - 8;
        } else {
          u = w.codes[n * w.row_bytes + b * 32 + i] - 128;
        }
        dot += static_cast<int64_t>(u) * q[32 * b + i];
      }
      total += static_cast<double>(h2f(w.scales[n * w.groups + b])) * dx[b] * static_cast<double>(dot);
    }
    y[n] = total;
  }
  return y;
}

using Kernel = std::function<void(const float*, const Weight&, float*)>;
struct Named {
  std::string name;
  Kernel fn;
};

static std::vector<Named> kernels(bool bits4) {
  std::vector<Named> k;
  auto add = [&](const std::string& name, Kernel fn) { k.push_back({name, fn}); };
  if (bits4) {
#ifdef __AVX512VNNI__
    add("plain_vnni_zmm", [](const float* x, const Weight& w, float* y) { plain_vnni<true>(x, w.plain, y); });
#endif
    add("plain_avx2", [](const float* x, const Weight& w, float* y) { plain_avx2<true>(x, w.plain, y); });
#ifdef __AVX512VNNI__
    add("r4_vnni_ymm", [](const float* x, const Weight& w, float* y) { inter_gemv<256, 4, true>(x, w.iv[0], y); });
    add("r8_vnni_ymm", [](const float* x, const Weight& w, float* y) { inter_gemv<256, 8, true>(x, w.iv[1], y); });
    add("r4_vnni_zmm", [](const float* x, const Weight& w, float* y) { inter_gemv<512, 4, true>(x, w.iv[0], y); });
    add("r8_vnni_zmm", [](const float* x, const Weight& w, float* y) { inter_gemv<512, 8, true>(x, w.iv[1], y); });
    add("r16_vnni_zmm", [](const float* x, const Weight& w, float* y) { inter_gemv<512, 16, true>(x, w.iv[2], y); });
#endif
    add("r4_avx2", [](const float* x, const Weight& w, float* y) { inter_gemv<2562, 4, true>(x, w.iv[0], y); });
    add("r8_avx2", [](const float* x, const Weight& w, float* y) { inter_gemv<2562, 8, true>(x, w.iv[1], y); });
  } else {
#ifdef __AVX512VNNI__
    add("plain_vnni_zmm", [](const float* x, const Weight& w, float* y) { plain_vnni<false>(x, w.plain, y); });
#endif
    add("plain_avx2", [](const float* x, const Weight& w, float* y) { plain_avx2<false>(x, w.plain, y); });
#ifdef __AVX512VNNI__
    add("r4_vnni_ymm", [](const float* x, const Weight& w, float* y) { inter_gemv<256, 4, false>(x, w.iv[0], y); });
    add("r8_vnni_ymm", [](const float* x, const Weight& w, float* y) { inter_gemv<256, 8, false>(x, w.iv[1], y); });
    add("r4_vnni_zmm", [](const float* x, const Weight& w, float* y) { inter_gemv<512, 4, false>(x, w.iv[0], y); });
    add("r8_vnni_zmm", [](const float* x, const Weight& w, float* y) { inter_gemv<512, 8, false>(x, w.iv[1], y); });
    add("r16_vnni_zmm", [](const float* x, const Weight& w, float* y) { inter_gemv<512, 16, false>(x, w.iv[2], y); });
#endif
    add("r4_avx2", [](const float* x, const Weight& w, float* y) { inter_gemv<2562, 4, false>(x, w.iv[0], y); });
    add("r8_avx2", [](const float* x, const Weight& w, float* y) { inter_gemv<2562, 8, false>(x, w.iv[1], y); });
  }
  return k;
}

static double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s check|time|count q8|q4 N K [stream_mb rounds calls_per_batch kernel calls]\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  const bool bits4 = std::string(argv[2]) == "q4";
  const int64_t N = std::atoll(argv[3]), K = std::atoll(argv[4]);
  if (N % 16 != 0 || K % 64 != 0) {  // whole groups of 16 rows and chunks of 64 only (no tails here)
    std::fprintf(stderr, "N must be a multiple of 16 and K of 64\n");
    return 2;
  }
  const double stream_mb = argc > 5 ? std::atof(argv[5]) : 0;
  const int rounds = argc > 6 ? std::atoi(argv[6]) : 15;
  const int per_batch = argc > 7 ? std::atoi(argv[7]) : 20;
  std::mt19937 rng(1234 + N + K);
  const int64_t bytes = N * (bits4 ? K / 2 : K) + N * (K / 32) * 2;
  const int copies = stream_mb > 0 ? std::max<int>(2, static_cast<int>(stream_mb * 1e6 / bytes) + 1) : 1;
  std::vector<Weight> ws(copies);
  for (auto& w : ws) make_weight(w, N, K, bits4, rng);
  std::vector<float> x(K), y(N);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& v : x) v = nd(rng);
  const auto ks = kernels(bits4);

  if (mode == "check") {
    int bad = 0;
    for (int c = 0; c < std::min(copies, 2); ++c) {
      const auto ref = reference(x.data(), ws[c].plain);
      double scale = 0;
      for (double v : ref) scale = std::max(scale, std::fabs(v));
      for (const auto& k : ks) {
        std::fill(y.begin(), y.end(), NAN);
        k.fn(x.data(), ws[c], y.data());
        double err = 0;
        for (int64_t n = 0; n < N; ++n) err = std::max(err, std::fabs(y[n] - ref[n]));
        const bool ok = err <= 2e-6 * scale + 1e-7;
        bad += !ok;
        std::printf("check %s %s %ldx%ld max_err %.3g (of %.3g) %s\n", bits4 ? "q4" : "q8", k.name.c_str(), N, K, err, scale, ok ? "ok" : "FAIL");
      }
    }
    return bad ? 1 : 0;
  }
  if (mode == "count") {  // one kernel, a fixed number of calls (callgrind)
    const std::string want = argv[8];
    const int calls = std::atoi(argv[9]);
    for (const auto& k : ks)
      if (k.name == want)
        for (int i = 0; i < calls; ++i) k.fn(x.data(), ws[i % copies], y.data());
    return 0;
  }
  // time: per round, each kernel runs per_batch calls (cycling through the copies), kernels alternated;
  // the median over rounds of each kernel's per-call thread CPU time
  std::vector<std::vector<double>> t(ks.size());
  int next = 0;
  for (const auto& k : ks)  // warm-up
    for (int i = 0; i < per_batch; ++i) k.fn(x.data(), ws[(next++) % copies], y.data());
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < ks.size(); ++i) {
      const double t0 = thread_seconds();
      for (int c = 0; c < per_batch; ++c) ks[i].fn(x.data(), ws[(next++) % copies], y.data());
      t[i].push_back((thread_seconds() - t0) / per_batch);
    }
  for (size_t i = 0; i < ks.size(); ++i) {
    std::sort(t[i].begin(), t[i].end());
    const double med = t[i][t[i].size() / 2];
    std::printf("time %s %s %ldx%ld %s %.3f us %.2f GB/s\n", bits4 ? "q4" : "q8", ks[i].name.c_str(), N, K,
                stream_mb > 0 ? "stream" : "resident", med * 1e6, bytes / med / 1e9);
  }
  return 0;
}
