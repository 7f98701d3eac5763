// Many-row products of quantized weights as an int8 GEMM (prefill, large batches): y = x W^T (+ b) with W
// in perfxlm.quant.QuantizedWeight's form (codes, scales, mins, levels; see quant_linear.h) and x rounded to
// int8 per block of 32 inputs (the block GEMV's rounding, act_blocks.h, shared with quant_linear.cpp: the same bytes).
//
// Why a GEMM and not the block GEMV at many rows: the GEMV dots one row of x with one row of W along K
// (64 products per vpdpbusd, then a convert, a multiply and an FMA per 64 to apply the two block scales,
// and a horizontal sum per output), about 16 products per instruction: the float32 GEMM's rate. Here a
// register holds 16 output columns x 4 inputs of W, so one vpdpbusd with the 4 activation bytes of one row
// broadcast does 64 products for 16 outputs at once, and the per-block scaling (convert, multiply, FMA) is
// paid once per 32 inputs x 16 outputs: 8 dot instructions + 3 per 512 products, 2.5-3x the float32 FMA rate.
//
// W is repacked per call, not at load: a thread takes 32 output columns (two 16-column panels), widens
// their codes to bytes in [K / 4][32][4] order (vpdpbusd's lanes) with their block scales beside them, in a
// buffer that stays in its cache, and runs every row tile over it. Repacking costs about one pass over W's
// codes per call (a few % of a 128+-row product) and no memory beyond the thread's buffer; decode keeps the
// GEMV and its layout.
//
// Per block b of 32 inputs, for output n and row m (c: the codes' centre, u: unsigned codes):
//   y[m, n] += sw[n, b] * sx[m, b] * (sum u * q - c * sum q) + min[n, b] * sx[m, b] * sum q
// the first term exact in int32 (the accumulator starts at -c * sum q), the min term only for formats with
// mins (Q4_1, Q5_1, asymmetric int4 / int8). A row's result does not depend on the other rows (its sums
// are the same integers and its float steps the same), but it is not bit-identical to the block GEMV's
// (which adds 64-input chunks in another order): equal to float32 rounding.
//
// 6-bit codes (GGUF Q6_K's values, 0..63 about a centre of 32) unpack like 5-bit ones plus a second bit
// plane and multiply as bytes. Q6_K's scale per 16 inputs (an int8 sub-scale times a float16 factor per
// 256, formed in float32 as the panels are packed: exact) would break the one-scale-per-block step, so those
// weights close their int32 sums per half block, each half starting at -32 x its own activation sum and
// scaled by its own group scale (Weight::unit): the same integers per 16 as the 1-row kernels, two float
// closes per 32 inputs instead of one. Before this they took the float32 GEMM over dequantized slabs.
//
// AVX2 builds run the same scheme on ymm (8 columns per register, 4-row tiles: 16 registers hold the int32
// sums, the float32 ones stay in L1), with vpdpbusd on ymm where the CPU has AVX-VNNI, else vpmaddubsw +
// vpmaddwd (llama.cpp's AVX2 dot), whose int16 pair sums limit unsigned codes to 128 (a level table must
// span at most 128 there): 8-bit codes are repacked wide instead, as int16 (u - 128) pairs multiplied by
// vpmaddwd alone in 6-row tiles (see WideDots), which beats the block GEMV from 16 rows and MKL's float32
// GEMM on dequantized slabs at every row count measured (16-2048). The scalar build has no GEMM
// (quant_block_gemm_max_code() is 0).
//
// The plain-torch reference is perfxlm.quant.reference on fake-quantized activations.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "act_blocks.h"
#include "code_planes.h"
#include "quant_gemm.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PERFXLM_QGEMM_ZMM 1  // 16 columns per register, vpdpbusd
#elif defined(__AVX2__) && defined(__FMA__)
#define PERFXLM_QGEMM_YMM 1  // 8 columns per register, vpdpbusd on ymm (AVX-VNNI) or vpmaddubsw + vpmaddwd
#endif
#if defined(PERFXLM_QGEMM_ZMM) || defined(PERFXLM_QGEMM_YMM)
#include <immintrin.h>
#define PERFXLM_QGEMM 1
#endif

namespace perfxlm_qgemm {
namespace {

#ifdef PERFXLM_QGEMM
#ifdef PERFXLM_QGEMM_ZMM
constexpr int kLanes = 16;      // output columns per register (int32 lanes of a zmm)
constexpr int kRowTile = 6;     // rows per register tile: 12 int32 + 12 float32 accumulators of 32
constexpr int kMaxCode = 255;   // vpdpbusd takes any unsigned byte
constexpr int kMaxTableCode = 255;
#else
constexpr int kLanes = 8;       // a ymm's int32 lanes
constexpr int kRowTile = 4;     // 8 int32 accumulators of 16 ymm; the float32 ones live in L1
#ifndef __AVXVNNI__
// vpmaddubsw saturates its int16 pair sums: codes up to 128 (x 127 x 2 = 32512) cannot reach it, 8-bit
// codes can. Those are repacked wide, as int16 u - 128 (the 128 x sum q taken off comes back in the
// accumulator's start), and multiplied by vpmaddwd (WideDots): 2 instructions per 16 products, one of
// them a multiply, where llama.cpp's vpsignb trick on bytes (|c| x sign(x, c), the path this replaced)
// spends 4 per 32 with three multiply-port ones and lost to MKL's float32 GEMM at prompt sizes. One
// thread's CPU time per call, the default model's projections, Q8_0-shaped codes, min of 3 calls on a
// loaded shared Xeon forced to the avx2 tier: 1.3-1.9x the sign trick at 16 rows, 1.15-1.4x at 64, 1.3-1.4x
// at 512; against the float32 path 1.5-2.4x at 64 rows, 1.3-1.4x at 512, 1.13-1.24x at 2048.
#define PERFXLM_QGEMM_WIDE8 1
constexpr int kMaxCode = 255;
constexpr int kMaxTableCode = 128;  // a level table's codes stay unsigned bytes: vpmaddubsw's limit
#else
constexpr int kMaxCode = 255;
constexpr int kMaxTableCode = 255;
#endif
#endif
constexpr int kPanels = 2;      // panels per task: 32 (zmm) or 16 (ymm) columns
constexpr int kCols = kLanes * kPanels;

// The weight as raw pointers, and how its codes decode.
struct Weight {
  const uint8_t* codes;
  int64_t N, K, row_bytes, group, groups;
  int bits;                 // 4, 5, 6 or 8
  const void* scales;
  const void* mins;         // null: centred codes
  bool half;
  int centre;               // integer subtracted from each unsigned byte code (8, 16, 32, 128; a table's offset)
  bool lut;
  uint8_t ulut[16];         // a level table as unsigned bytes: levels[u] + centre
  int shift;                // 128 where the panels hold 8-bit codes signed (u - 128), else 0
  // Inputs per weight scale in the tiles: 32 (one scale per activation block), or 16 for 6-bit codes in
  // groups of 16 (GGUF Q6_K's sub-blocks): each half of a 32-block closes its own int32 sums into float,
  // scaled by its own group scale (a Q6_K sub-scale times its float16 factor: exact in float32, 8 by 11
  // bits), so a 32-block costs two closes instead of one and nothing else changes.
  int unit;
  // Two-level scales and mins (GGUF K-quants, perfxlm/quant/super_scales.py) read as stored: per row
  // `kstride` bytes, a byte per group (int8 where ksigned) then a float16 factor per `kper` groups; a
  // group's scale is byte x factor in float32 (exact, the value QuantizedWeight.flat() forms), its min the
  // negation of that. kstride 0: float32 / float16 tables. Multiplying them out per call in Python cost a
  // pass over a float32 table 2 bits per weight wide, next to a 16-row product's few passes over the codes.
  int64_t kstride = 0, kper = 0;
  bool ksigned = false;
  // Row groups (row_groups.h: codes [ceil(N / 8), K / 32, 8 B], float16 scales [.., 8]): a block's 8
  // rows are already [quad][row][4 bytes], the panels' own order for 8 columns, so they are copied, not
  // transposed (repack_group).
  bool rows8 = false;
  // K-quant row groups (row_groups_k.h: codes [ceil(N / 8), K / 32, 8 B], params [.., K / 256, P] bytes):
  // a block's nibbles are [quad][row][4 bytes] like Q4_0's groups, its upper bits in words beside them, and
  // a super-block's sub-scales (and sub-mins) [sub-block][row] with the 8 rows' float16 factors after
  // them, so the panels are built from them directly (repack_group_k) with the plain layout's values.
  bool rows8_k = false;
  int64_t param_bytes = 0;  // P: bytes per group and super-block
};

inline float half_float(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);  // one instruction, not c10's bit steps
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// Group g of row n of a table (scales, or mins: `mins` negates two-level values, stored as negations).
inline float param(const Weight& w, const void* p, int64_t n, int64_t g, bool mins) {
  if (w.kstride) {
    const uint8_t* row = static_cast<const uint8_t*>(p) + n * w.kstride;
    const float sub = w.ksigned ? static_cast<float>(static_cast<int8_t>(row[g])) : static_cast<float>(row[g]);
    uint16_t factor;
    std::memcpy(&factor, row + w.groups + 2 * (g / w.kper), 2);
    const float v = sub * half_float(factor);
    return mins ? -v : v;
  }
  const int64_t i = n * w.groups + g;
  if (w.half) return half_float(static_cast<const uint16_t*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

// `value` in byte j where element j's bit is set in a block's plane word (5- and 6-bit codes' upper bits,
// code_planes.h's order), else 0.
inline __m256i plane_bits(const uint8_t* plane, __m256i value) {
  uint32_t word;
  std::memcpy(&word, plane, 4);
  const __m256i sixteen = _mm256_set1_epi8(16);
  return _mm256_and_si256(_mm256_cmpeq_epi8(perfxlm_planes::block_fifths(word), sixteen), value);
}

// A task's panels: codes [K / 4][kCols][4] bytes, and per unit of inputs (Weight::unit) [K / unit][kCols]
// scales and mins (0 past N). On AVX2 without AVX-VNNI 8-bit codes are held wide: int16 (u - 128) in
// [K / 2][kCols][2] (see WideDots).
struct Panels {
  std::vector<uint8_t> codes;
  std::vector<float> scales, mins;
  bool wide = false;  // codes stored as int16 pairs u - 128 (Weight::shift), not bytes
};

// The 32 unsigned codes of block b of row n as one register of bytes (the same decoding as
// quant_linear.cpp's code_at): 8-bit codes as they are (or signed, Weight::shift); 4-bit ones from their
// nibbles (through a level table where there is one); 5- and 6-bit ones the nibbles plus 16 where the
// fifth plane's bit is set and 32 where the sixth's is (the planes follow the nibbles, K / 8 bytes each).
inline __m256i block_register(const Weight& w, int64_t n, int64_t b) {
  const uint8_t* row = w.codes + n * w.row_bytes;
  if (w.bits == 8) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 32));
    return w.shift ? _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80))) : u;
  }
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m256i u = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(packed, mask)),
                                      _mm_and_si128(_mm_srli_epi16(packed, 4), mask), 1);
  if (w.lut) u = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.ulut))), u);
  if (w.bits >= 5) u = _mm256_add_epi8(u, plane_bits(row + w.K / 2 + b * 4, _mm256_set1_epi8(16)));
  if (w.bits == 6) u = _mm256_add_epi8(u, plane_bits(row + w.K / 2 + w.K / 8 + b * 4, _mm256_set1_epi8(32)));
  return u;
}

// r[i]: row i's 8 groups of 4 bytes -> r[q]: group q of the 8 rows (an 8 x 8 transpose of 32-bit lanes).
inline void transpose8x8(__m256i (&r)[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int h = 0; h < 8; h += 4) {
    u[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
    u[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
    u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
    u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    r[q] = _mm256_permute2x128_si256(u[q], u[q + 4], 0x20);
    r[q + 4] = _mm256_permute2x128_si256(u[q], u[q + 4], 0x31);
  }
}

// Groups [g0, g0 + 8) of row n of a table as float32 (two-level: the 8 share one factor, kper % 8 == 0).
inline __m256 params8(const Weight& w, const void* table, int64_t n, int64_t g0, bool mins) {
  if (w.kstride) {
    const uint8_t* row = static_cast<const uint8_t*>(table) + n * w.kstride;
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + g0));
    const __m256i sub = w.ksigned ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    uint16_t factor;
    std::memcpy(&factor, row + w.groups + 2 * (g0 / w.kper), 2);
    const float f = half_float(factor);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(sub), _mm256_set1_ps(mins ? -f : f));
  }
  const int64_t i = n * w.groups + g0;
  if (w.half) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(table) + i)));
  return _mm256_loadu_ps(static_cast<const float*>(table) + i);
}

// Columns [c0, c0 + live) of one table (scales or mins) into dst [units][kCols] (Weight::unit). Where
// each group is one unit (a scale per 32: Q8_0, Q4_0; per 16: Q6_K) and all 8 columns are live, 8 columns
// x 8 groups at a time through the codes' 8 x 8 transpose: one strided scalar store per column and unit
// cost as much as the codes' transpose at 16 rows. Else group by group, each spread over its units (no
// division per unit).
void spread(const Weight& w, const void* table, bool mins, int64_t n0, int c0, int live, float* dst) {
  const int64_t per = w.group / w.unit;  // units per group
  int64_t g0 = 0;
  if (per == 1 && live == 8 && (!w.kstride || w.kper % 8 == 0)) {
    for (; g0 + 8 <= w.groups; g0 += 8) {
      __m256i r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_castps_si256(params8(w, table, n0 + c0 + i, g0, mins));
      transpose8x8(r);
      for (int q = 0; q < 8; ++q) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (g0 + q) * kCols + c0), r[q]);
    }
  }
  for (int i = 0; i < live; ++i) {
    const int64_t row = n0 + c0 + i;
    for (int64_t g = g0, b = g0 * per; g < w.groups; ++g) {
      const float v = param(w, table, row, g, mins);
      for (int64_t e = b + per; b < e; ++b) dst[b * kCols + c0 + i] = v;
    }
  }
}

// The task's panels, 8 columns at a time: each block's 8 x 32 codes loaded as 8 registers and transposed
// into [q][8 columns][4] (one pass of loads, shuffles and stores; the column-by-column copy it replaces
// cost as much as the products at 16 rows, where parallel decode runs). Wide panels (8-bit codes on AVX2
// without AVX-VNNI) widen each column's block to 2 x 16 int16 first and transpose both halves into
// [pair][8 columns][2 int16]. Meanwhile the next task's codes (the thread's next columns: parallel_for
// hands each thread a run of tasks) are prefetched into L2, spread over the loop: its transposes touch 8
// rows a few dozen bytes at a time, too little of each for the hardware prefetchers to follow.
// Block b of the row group holding columns [n, n + 8) as the panels' 8 quads q[0..7] ([row][4 bytes] each),
// unsigned codes (signed where Weight::shift): 8-bit quads as stored; a 4-bit quad's low nibbles are codes
// 4q.. of its rows and its high nibbles codes 16 + 4q.., quads q and q + 4 of the block.
inline void group_quads(const Weight& w, int64_t n, int64_t b, __m256i (&q)[8]) {
  const int64_t per = w.bits == 8 ? 32 : 16;
  const uint8_t* blk = w.codes + ((n / 8) * (w.K / 32) + b) * 8 * per;
  if (w.bits == 8) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int i = 0; i < 8; ++i) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * i));
      q[i] = w.shift ? _mm256_xor_si256(u, flip) : u;
    }
    return;
  }
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * i));
    q[i] = _mm256_and_si256(raw, mask);
    q[i + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
  }
}

// The float16 scales (or mins) of block b of the group holding columns [n, n + 8), as float32.
inline __m256 group_scales(const Weight& w, int64_t n, int64_t b, const void* table) {
  const uint16_t* s = static_cast<const uint16_t*>(table) + ((n / 8) * (w.K / 32) + b) * 8;
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
}

// Block b of the K-quant row group holding columns [n, n + 8) as the panels' 8 quads q[0..7] of unsigned
// codes: each nibble quad's low nibbles codes 4q.. of its rows, its high ones 16 + 4q.. (quad q + 4);
// Q5_K's word holds code 4q + j's fifth bit at bit q of byte 4 r + j (16 + 4q + j's at bit 4 + q), Q6_K's
// two words (codes 0-15, 16-31) bits 4-5 of code 16 h + 4q + j at bits 2q, 2q + 1: the same u each
// plain block_register forms, so the panels' bytes are the plain layout's.
inline void group_quads_k(const Weight& w, int64_t n, int64_t b, __m256i (&q)[8]) {
  const int64_t per = w.bits == 4 ? 16 : w.bits == 5 ? 20 : 24;
  const uint8_t* blk = w.codes + ((n / 8) * (w.K / 32) + b) * 8 * per;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * i));
    q[i] = _mm256_and_si256(raw, mask);
    q[i + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
  }
  if (w.bits == 5) {
    const __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128));
    const __m256i one = _mm256_set1_epi8(1);
    for (int i = 0; i < 8; ++i)  // bit i of each byte, moved to bit 4 (16-bit shifts: the masks keep bytes apart)
      q[i] = _mm256_or_si256(q[i], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(word, i), one), 4));
  } else if (w.bits == 6) {
    const __m256i three = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      for (int i = 0; i < 4; ++i)
        q[4 * h + i] = _mm256_or_si256(
            q[4 * h + i], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(word, 2 * i), three), 4));
    }
  }
}

// The scales (and mins, negated) of the K-quant row group holding columns [c, c + 8), for the panels'
// columns c - n0..: sub-byte x float16 factor in float32 per unit (Weight::unit), as params8 forms them
// from the plain rows (exact: 8 by 11 bits). Q4_K / Q5_K params per super-block: sub-scales [8][8 rows],
// sub-mins alike, d and dmin float16 [8 rows]; Q6_K: int8 sub-scales [16][8 rows], d [8 rows].
void group_params_k(const Weight& w, int64_t c, int64_t col, Panels& p) {
  const int64_t supers = w.K / 256, units = 256 / w.unit;  // units per super-block: 8 (32s) or 16 (16s)
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* par = static_cast<const uint8_t*>(w.scales) + ((c / 8) * supers + s) * w.param_bytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(par + units * 8 * (w.mins ? 2 : 1))));
    for (int64_t i = 0; i < units; ++i) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(par + 8 * i));
      const __m256i sub = w.bits == 6 ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
      _mm256_storeu_ps(p.scales.data() + (s * units + i) * kCols + col, _mm256_mul_ps(_mm256_cvtepi32_ps(sub), d));
    }
    if (!w.mins) continue;
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(par + 144)));
    const __m256 neg = _mm256_xor_ps(dmin, _mm256_set1_ps(-0.f));  // -dmin, as params8 negates it
    for (int64_t i = 0; i < 8; ++i) {
      const __m256i sub = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(par + 64 + 8 * i)));
      _mm256_storeu_ps(p.mins.data() + (s * 8 + i) * kCols + col, _mm256_mul_ps(_mm256_cvtepi32_ps(sub), neg));
    }
  }
}

void repack(const Weight& w, int64_t n0, Panels& p, bool wide) {
  const int64_t blocks = w.K / 32;
  p.codes.resize(static_cast<size_t>(w.K * kCols * (wide ? 2 : 1)));
  const bool full = w.N - n0 >= kCols;  // every column live: every scale below is written
  const size_t table = static_cast<size_t>(w.K / w.unit * kCols);
  if (full) p.scales.resize(table);
  else p.scales.assign(table, 0.f);
  if (w.mins) {  // read only by the tiles for weights with mins
    if (full) p.mins.resize(table);
    else p.mins.assign(table, 0.f);
  }
  p.wide = wide;
  const uint8_t* next = w.codes + std::min(w.N, n0 + kCols) * w.row_bytes;
  const uint8_t* const next_end = w.codes + std::min(w.N, n0 + 2 * kCols) * w.row_bytes;
  const int64_t ahead = ((next_end - next) / 64 / (2 * blocks) + 1) * 64;  // bytes per block step
  for (int c0 = 0; c0 < kCols; c0 += 8) {
    const int live = static_cast<int>(std::clamp<int64_t>(w.N - n0 - c0, 0, 8));  // columns past N stay 0
    for (int64_t b = 0; b < blocks; ++b) {
      for (const uint8_t* e = std::min(next + ahead, next_end); next < e; next += 64) _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T1);
      __m256i r[8];
      if (w.rows8_k && live > 0) {  // K groups: bytes, never wide (no 8-bit codes); params after the blocks
        group_quads_k(w, n0 + c0, b, r);
        uint8_t* dst = p.codes.data() + (b * 8 * kCols + c0) * 4;
        for (int q = 0; q < 8; ++q) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + q * kCols * 4), r[q]);
        continue;
      }
      if (w.rows8 && live > 0) {  // the group's rows past N are zeros with scale 0
        group_quads(w, n0 + c0, b, r);
        _mm256_storeu_ps(p.scales.data() + b * kCols + c0, group_scales(w, n0 + c0, b, w.scales));
        if (w.mins) _mm256_storeu_ps(p.mins.data() + b * kCols + c0, group_scales(w, n0 + c0, b, w.mins));
        if (!wide) {
          uint8_t* dst = p.codes.data() + (b * 8 * kCols + c0) * 4;
          for (int q = 0; q < 8; ++q) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + q * kCols * 4), r[q]);
          continue;
        }
        transpose8x8(r);  // wide panels widen each row's block: the rows back first
      } else {
        for (int i = 0; i < 8; ++i) r[i] = i < live ? block_register(w, n0 + c0 + i, b) : _mm256_setzero_si256();
      }
      if (!wide) {
        transpose8x8(r);
        uint8_t* dst = p.codes.data() + (b * 8 * kCols + c0) * 4;
        for (int q = 0; q < 8; ++q) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + q * kCols * 4), r[q]);
        continue;
      }
      __m256i hi[8];  // inputs 16-31 of each column as int16: pairs 8-15
      for (int i = 0; i < 8; ++i) {
        hi[i] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(r[i], 1));
        r[i] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(r[i]));  // inputs 0-15: pairs 0-7
      }
      transpose8x8(r);
      transpose8x8(hi);
      uint8_t* dst = p.codes.data() + (b * 16 * kCols + c0) * 4;
      for (int q = 0; q < 8; ++q) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + q * kCols * 4), r[q]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (q + 8) * kCols * 4), hi[q]);
      }
    }
    if (w.rows8) continue;  // scales (and affine groups' mins) written per block above
    if (w.rows8_k) {  // the group's rows past N have zero params: scale and min 0, as the plain columns' past N
      if (live > 0) group_params_k(w, n0 + c0, c0, p);
      continue;
    }
    spread(w, w.scales, false, n0, c0, live, p.scales.data());
    if (w.mins) spread(w, w.mins, true, n0, c0, live, p.mins.data());
  }
}

// x rounded to int8 per block of 32: the bytes, each block's scale, where its int32 sums start (-centre x
// the sum of its bytes: sum (u - c) q = sum u q - c sum q, c the panels' centre; one broadcast load per
// row and block in the tiles; per half block where the weight's scales are per 16, Weight::unit), and
// scale x the sum of its bytes (the mins').
struct Acts {
  std::vector<int8_t> q;
  std::vector<int16_t> q16;  // the same bytes as int16, for wide panels (one broadcast per pair of inputs)
  std::vector<float> scale, scaled_sum;
  std::vector<int32_t> start;
};

// act_blocks.h's rounding: the block GEMV's bytes.
using perfxlm_act::quantize_block_fast;

// kquant: K-quant weights' activations, q8_K under ggml's rule (act_blocks.h's BlockScales).
void quantize(const float* x, int64_t M, int64_t K, int centre, bool wide, int unit, bool kquant, Acts& a) {
  const int64_t blocks = K / 32, halves = 32 / unit;  // int32 sums per block: one, or one per 16 inputs
  a.q.resize(static_cast<size_t>(M * K));
  if (wide) a.q16.resize(static_cast<size_t>(M * K));
  a.scale.resize(static_cast<size_t>(M * blocks));
  a.scaled_sum.resize(static_cast<size_t>(M * blocks));
  a.start.resize(static_cast<size_t>(M * blocks * halves));
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      perfxlm_act::BlockScales scales(x + m * K, K, kquant);
      for (int64_t b = 0; b < blocks; ++b) {
        int8_t* q = a.q.data() + m * K + b * 32;
        int32_t half[2];  // the sums of the block's values 0-15 and 16-31, from its rounded vectors
        const float scale = scales.quantize_sums(b, q, half);
        const int32_t total = half[0] + half[1];
        if (halves == 2) {
          a.start[(m * blocks + b) * 2] = -centre * half[0];
          a.start[(m * blocks + b) * 2 + 1] = -centre * half[1];
        } else {
          a.start[m * blocks + b] = -centre * total;
        }
        a.scale[m * blocks + b] = scale;
        a.scaled_sum[m * blocks + b] = scale * static_cast<float>(total);
        if (wide) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
          int16_t* q16 = a.q16.data() + m * K + b * 32;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + 16), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)));
        }
      }
    }
  });
}

#ifdef PERFXLM_QGEMM_ZMM
// The one code form of the zmm tile: vpdpbusd takes any byte code alike.
struct ByteDots {
  static constexpr int kRows = kRowTile;
};

// Rows [m0, m0 + MT) x the task's 32 columns, all of K: int32 sums per block (per half block for U = 2:
// scales per 16 inputs), scaled into float32.
template <int MT, bool MINS, class D, int U>
inline void tile(const Acts& a, int64_t m0, int64_t K, const Panels& p, int64_t n0, int64_t N, float* y,
                 const float* bias) {
  static_assert(U == 1 || !MINS, "mins take one scale per 32-block");
  const int64_t blocks = K / 32, units = blocks * U;
  constexpr int kPer = 8 / U;  // steps of 4 inputs per unit
  __m512 acc[MT][kPanels];
  #pragma GCC unroll 8
  for (int i = 0; i < MT; ++i)
    #pragma GCC unroll 2
    for (int j = 0; j < kPanels; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = p.codes.data() + b * 8 * kCols * 4;
    const int8_t* xb = a.q.data() + m0 * K + b * 32;
    #pragma GCC unroll 2
    for (int h = 0; h < U; ++h) {
      const int64_t e = b * U + h;  // the unit: its sums' start and its weight scales
      __m512i dot[MT][kPanels];
      #pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) {
        const __m512i start = _mm512_set1_epi32(a.start[(m0 + i) * units + e]);
        #pragma GCC unroll 2
        for (int j = 0; j < kPanels; ++j) dot[i][j] = start;
      }
      #pragma GCC unroll 8
      for (int s = 0; s < kPer; ++s) {
        const int q = h * kPer + s;
        __m512i wv[kPanels];
        #pragma GCC unroll 2
        for (int j = 0; j < kPanels; ++j) wv[j] = _mm512_loadu_si512(wb + (q * kCols + j * kLanes) * 4);
        #pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
          int32_t x4;
          std::memcpy(&x4, xb + i * K + 4 * q, 4);
          const __m512i xv = _mm512_set1_epi32(x4);
          #pragma GCC unroll 2
          for (int j = 0; j < kPanels; ++j) dot[i][j] = _mm512_dpbusd_epi32(dot[i][j], wv[j], xv);
        }
      }
      #pragma GCC unroll 2
      for (int j = 0; j < kPanels; ++j) {
        const __m512 sw = _mm512_loadu_ps(p.scales.data() + e * kCols + j * kLanes);
        __m512 mw;
        if constexpr (MINS) mw = _mm512_loadu_ps(p.mins.data() + e * kCols + j * kLanes);
        #pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
          const float sx = a.scale[(m0 + i) * blocks + b];
          const __m512 s = _mm512_mul_ps(sw, _mm512_set1_ps(sx));
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][j]), s, acc[i][j]);
          if constexpr (MINS) acc[i][j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.scaled_sum[(m0 + i) * blocks + b]), acc[i][j]);
        }
      }
    }
  }
  #pragma GCC unroll 2
  for (int j = 0; j < kPanels; ++j) {
    const int64_t n = n0 + j * kLanes;
    if (n >= N) break;
    const __mmask16 mask = N - n >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (N - n)) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    #pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) _mm512_mask_storeu_ps(y + (m0 + i) * N + n, mask, _mm512_add_ps(acc[i][j], bv));
  }
}

#else
// How one step (4 inputs of 8 columns, against one row's 4 bytes broadcast) enters a block's sums: the
// AVX2 tile below is one loop nest for every code form, and these say what differs. `codes` is what a
// step multiplies, made once per loaded register and shared by the tile's rows; `start` opens a block's
// sums from the accumulator's -centre x sum q, `step` adds a step (or `step2` two steps, where kGroup is
// 2), `close` gives the block's int32 sums.
#ifndef __AVXVNNI__
// A row's running sum, kept in its register: integer adds reassociate freely, and unrolled, GCC formed a
// block's products first and summed them as a tree, spilling most to the stack (WideDots 1.5x slower; the
// 4-bit step's 4-row tile held ~40 stack moves per block, forced-AVX2 1B Q4_K_M prefill 135 vs 182 tok/s).
// An empty asm that claims to change the value pins each step's add to the chain.
inline __m256i chained(__m256i r) {
  asm("" : "+x"(r));
  return r;
}
#endif

#ifdef __AVXVNNI__
// Any byte code: vpdpbusd on ymm, one instruction per step.
struct ByteDots {
  using Sum = __m256i;
  static constexpr int kRows = kRowTile, kSteps = 8;
  static constexpr bool kWide = false;
  static __m256i codes(__m256i w) { return w; }
  static Sum start(__m256i from) { return from; }
  static constexpr int kGroup = 1;
  static Sum step(Sum s, __m256i w, __m256i, __m256i x) { return _mm256_dpbusd_avx_epi32(s, w, x); }
  static __m256i close(Sum s, __m256i) { return s; }
};
#else
// Codes up to 128 (a level table's): vpmaddubsw + vpmaddwd per step, whose int16 pair sums
// (2 x 128 x 127) cannot saturate.
struct ByteDots {
  using Sum = __m256i;
  static constexpr int kRows = kRowTile, kSteps = 8;
  static constexpr bool kWide = false;
  static __m256i codes(__m256i w) { return w; }
  static Sum start(__m256i from) { return from; }
  static constexpr int kGroup = 1;
  static Sum step(Sum s, __m256i w, __m256i, __m256i x) {
    return chained(_mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))));
  }
  static __m256i close(Sum s, __m256i) { return s; }
};

// Codes <= 63 (6-bit, Q6_K's): two steps' int16 pair sums add as int16 (2 x 2 x 63 x 127 = 32004) before
// one vpmaddwd widens them: 5 instructions per two steps, 3 of them multiplies, where ByteDots spends 6
// and 4 (the multiply ports bound these loops).
struct PairDots {
  using Sum = __m256i;
  static constexpr int kRows = kRowTile, kSteps = 8;
  static constexpr bool kWide = false;
  static constexpr int kGroup = 2;
  static __m256i codes(__m256i w) { return w; }
  static Sum start(__m256i from) { return from; }
  static Sum step2(Sum s, __m256i w0, __m256i w1, __m256i x0, __m256i x1) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1));
    return chained(_mm256_add_epi32(s, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))));
  }
  static __m256i close(Sum s, __m256i) { return s; }
};

// Codes <= 15: a block's 8 int16 pair sums stay within int16 (8 x 2 x 15 x 127 = 30480), so they add as
// int16 and widen once per block: 2 instructions per step instead of 3.
struct NibbleDots {
  using Sum = __m256i;  // int16 pair sums
  static constexpr int kRows = kRowTile, kSteps = 8;
  static constexpr bool kWide = false;
  static __m256i codes(__m256i w) { return w; }
  static constexpr int kGroup = 1;
  static Sum start(__m256i) { return _mm256_setzero_si256(); }
  static Sum step(Sum s, __m256i w, __m256i, __m256i x) {
    return chained(_mm256_add_epi16(s, _mm256_maddubs_epi16(w, x)));
  }
  static __m256i close(Sum s, __m256i from) {
    return _mm256_add_epi32(from, _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
  }
};

// 8-bit codes held wide: int16 c = u - 128 in [K / 2][8 columns][2], against the activations' int16 copy
// with a pair of inputs broadcast per row. vpmaddwd multiplies the pair for 8 columns and adds the two
// products into int32 lanes (exact: 2 x 128 x 127), vpaddd accumulates: 2 instructions per 16 products,
// one of them on the multiply ports. llama.cpp's vpsignb trick on bytes (|c| x sign(x, c)) takes 4 per 32,
// three of them there (vpsignb, vpmaddubsw, vpmaddwd): those ports, not the instruction count, bound it.
// With one register per step's weights the tile is 6 rows deep (12 int32 sums of 16 registers).
struct WideDots {
  using Sum = __m256i;
  static constexpr int kRows = 6, kSteps = 16;  // 16 steps of 2 inputs per block
  static constexpr bool kWide = true;
  static constexpr int kGroup = 1;
  static __m256i codes(__m256i w) { return w; }
  static Sum start(__m256i from) { return from; }
  static Sum step(Sum s, __m256i w, __m256i, __m256i x) {
    return chained(_mm256_add_epi32(s, _mm256_madd_epi16(w, x)));
  }
  static __m256i close(Sum s, __m256i) { return s; }
};
#endif

// Rows [m0, m0 + MT) x the task's 16 columns, all of K: int32 sums per block (per half block for U = 2:
// scales per 16 inputs) in registers (the form D says how), the float32 sums in an L1 buffer (16 ymm hold
// only the int32 ones).
template <int MT, bool MINS, class D, int U>
inline void tile(const Acts& a, int64_t m0, int64_t K, const Panels& p, int64_t n0, int64_t N, float* y,
                 const float* bias) {
  static_assert(U == 1 || !MINS, "mins take one scale per 32-block");
  const int64_t blocks = K / 32, units = blocks * U;
  constexpr int kPer = D::kSteps / U;  // steps per unit
  alignas(32) float acc[MT][kCols] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    // a step: 4 bytes of each row (4 inputs, or 2 as int16) against 8 columns' 4 bytes per panel register
    constexpr int64_t width = D::kWide ? 2 : 1;
    const uint8_t* wb = p.codes.data() + b * D::kSteps * kCols * 4;
    const uint8_t* xb = (D::kWide ? reinterpret_cast<const uint8_t*>(a.q16.data())
                                  : reinterpret_cast<const uint8_t*>(a.q.data())) + (m0 * K + b * 32) * width;
    #pragma GCC unroll 2
    for (int h = 0; h < U; ++h) {
      const int64_t e = b * U + h;  // the unit: its sums' start and its weight scales
      const auto from = [&](int i) { return _mm256_set1_epi32(a.start[(m0 + i) * units + e]); };
      typename D::Sum sum[MT][kPanels];
      #pragma GCC unroll 8
      for (int i = 0; i < MT; ++i)
        #pragma GCC unroll 2
        for (int j = 0; j < kPanels; ++j) sum[i][j] = D::start(from(i));
      constexpr int G = D::kGroup;  // steps taken at once
      #pragma GCC unroll 16
      for (int s = 0; s < kPer; s += G) {
        const int q = h * kPer + s;
        __m256i wv[G][kPanels], wk[G][kPanels];
        #pragma GCC unroll 2
        for (int g = 0; g < G; ++g)
          #pragma GCC unroll 2
          for (int j = 0; j < kPanels; ++j) {
            wv[g][j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + ((q + g) * kCols + j * kLanes) * 4));
            wk[g][j] = D::codes(wv[g][j]);
          }
        #pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
          __m256i xv[G];
          #pragma GCC unroll 2
          for (int g = 0; g < G; ++g) {
            int32_t x4;
            std::memcpy(&x4, xb + i * K * width + 4 * (q + g), 4);
            xv[g] = _mm256_set1_epi32(x4);
          }
          #pragma GCC unroll 2
          for (int j = 0; j < kPanels; ++j) {
            if constexpr (G == 1) sum[i][j] = D::step(sum[i][j], wv[0][j], wk[0][j], xv[0]);
            else sum[i][j] = D::step2(sum[i][j], wv[0][j], wv[1][j], xv[0], xv[1]);
          }
        }
      }
      #pragma GCC unroll 2
      for (int j = 0; j < kPanels; ++j) {
        const __m256 sw = _mm256_loadu_ps(p.scales.data() + e * kCols + j * kLanes);
        __m256 mw;
        if constexpr (MINS) mw = _mm256_loadu_ps(p.mins.data() + e * kCols + j * kLanes);
        #pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
          const __m256 s = _mm256_mul_ps(sw, _mm256_set1_ps(a.scale[(m0 + i) * blocks + b]));
          const __m256i dot = D::close(sum[i][j], from(i));
          __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, _mm256_load_ps(acc[i] + j * kLanes));
          if constexpr (MINS) t = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.scaled_sum[(m0 + i) * blocks + b]), t);
          _mm256_store_ps(acc[i] + j * kLanes, t);
        }
      }
    }
  }
  const int64_t cols = std::min<int64_t>(kCols, N - n0);
  for (int i = 0; i < MT; ++i)
    for (int64_t c = 0; c < cols; ++c) y[(m0 + i) * N + n0 + c] = acc[i][c] + (bias ? bias[n0 + c] : 0.f);
}

#endif

template <bool MINS, class D, int U = 1>
void run_task(const Acts& a, int64_t m_begin, int64_t m_end, const Weight& w, const Panels& p, int64_t n0, float* y,
              const float* bias) {
  constexpr int R = D::kRows;
  int64_t m = m_begin;
  for (; m + R <= m_end; m += R) tile<R, MINS, D, U>(a, m, w.K, p, n0, w.N, y, bias);
  switch (m_end - m) {  // the last rows: a shorter tile
    case 5: tile<5, MINS, D, U>(a, m, w.K, p, n0, w.N, y, bias); break;
    case 4: tile<4, MINS, D, U>(a, m, w.K, p, n0, w.N, y, bias); break;
    case 3: tile<3, MINS, D, U>(a, m, w.K, p, n0, w.N, y, bias); break;
    case 2: tile<2, MINS, D, U>(a, m, w.K, p, n0, w.N, y, bias); break;
    case 1: tile<1, MINS, D, U>(a, m, w.K, p, n0, w.N, y, bias); break;
    default: break;
  }
}

// A task's rows in the code form its weight takes (on AVX2 without AVX-VNNI: signed 8-bit, nibbles, 6-bit
// codes two steps at a time, or codes up to 128; with vpdpbusd: one form for every code). 6-bit codes in
// groups of 16 close per half block (centred only: describe refuses mins there).
template <bool MINS>
void run_rows(const Acts& a, int64_t m_begin, int64_t m_end, const Weight& w, const Panels& p, int64_t n0, float* y,
              const float* bias) {
#if defined(PERFXLM_QGEMM_YMM) && !defined(__AVXVNNI__)
  using SixDots = PairDots;  // 6-bit codes: two steps per widening
#else
  using SixDots = ByteDots;
#endif
  if constexpr (!MINS) {
    if (w.unit == 16) return run_task<false, SixDots, 2>(a, m_begin, m_end, w, p, n0, y, bias);
  }
  if (w.bits == 6) return run_task<MINS, SixDots>(a, m_begin, m_end, w, p, n0, y, bias);
#if defined(PERFXLM_QGEMM_YMM) && !defined(__AVXVNNI__)
  if (p.wide) return run_task<MINS, WideDots>(a, m_begin, m_end, w, p, n0, y, bias);
  if (w.bits == 4 && !w.lut) return run_task<MINS, NibbleDots>(a, m_begin, m_end, w, p, n0, y, bias);
#endif
  run_task<MINS, ByteDots>(a, m_begin, m_end, w, p, n0, y, bias);
}

// Row groups of Q8_0 / Q4_0 codes (see Weight::rows8), or with `affine` Q4_1's (layout 3: float16 mins
// shaped as the scales, uncentred codes): N from the caller (the last group's padding rows are not
// outputs); row_bytes as the plain rows', so a group's bytes are at codes + n0 x row_bytes.
Weight describe_rows8(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                      const c10::optional<at::Tensor>& levels, int64_t K, int64_t N, bool affine) {
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK(has_mins == affine && !(levels.has_value() && levels->defined()),
              "quant_block_gemm: row groups hold centred codes (layout 1: no mins) or 4-bit ones with float16 mins "
              "(layout 3), no table");
  TORCH_CHECK(K % 32 == 0 && K > 0 && N > 0, "quant_block_gemm: row groups need K a positive multiple of 32, N > 0");
  const int64_t groups = (N + 7) / 8, blocks = K / 32;
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(0) == groups &&
                  codes.size(1) == blocks && (codes.size(2) == 8 * 32 || codes.size(2) == 8 * 16),
              "quant_block_gemm: row-group codes must be contiguous uint8 [ceil(N / 8), K / 32, 8 x 32 or 8 x 16]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == groups && scales.size(1) == blocks && scales.size(2) == 8,
              "quant_block_gemm: row-group scales must be contiguous float16 [ceil(N / 8), K / 32, 8]");
  const int bits = codes.size(2) == 8 * 32 ? 8 : 4;
  TORCH_CHECK(!affine || (bits == 4 && mins->sizes() == scales.sizes() && mins->scalar_type() == at::kHalf &&
                          mins->is_contiguous()),
              "quant_block_gemm: affine row groups take 4-bit codes and contiguous float16 mins shaped as the scales");
  Weight w{codes.data_ptr<uint8_t>(), N, K, bits == 8 ? K : K / 2, 32, blocks, bits, scales.data_ptr(),
           affine ? mins->data_ptr() : nullptr, true, affine ? 0 : (bits == 8 ? 128 : 8), false, {}, 0, 32};
  w.rows8 = true;
#ifdef PERFXLM_QGEMM_WIDE8
  if (bits == 8) w.shift = 128;
#endif
  return w;
}

// K-quant row groups (see Weight::rows8_k): codes [ceil(N / 8), K / 32, 8 B] (B = 16, 20, 24 for Q4_K,
// Q5_K, Q6_K), params uint8 [ceil(N / 8), K / 256, P]; the plain form's centre, unit and mins (Q4_K / Q5_K
// carry mins: `mins` points at the params only to select the tiles that add them).
Weight describe_rows8_k(const at::Tensor& codes, const at::Tensor& params, const c10::optional<at::Tensor>& mins,
                        const c10::optional<at::Tensor>& levels, int64_t K, int64_t N) {
  TORCH_CHECK(!(mins.has_value() && mins->defined()) && !(levels.has_value() && levels->defined()),
              "quant_block_gemm: K-quant row groups hold their params in scales (no mins, no table)");
  TORCH_CHECK(K % 256 == 0 && K > 0 && N > 0, "quant_block_gemm: K-quant row groups need K a positive multiple of 256, N > 0");
  const int64_t groups = (N + 7) / 8, blocks = K / 32;
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(0) == groups &&
                  codes.size(1) == blocks && codes.size(2) % 8 == 0,
              "quant_block_gemm: K-quant row-group codes must be contiguous uint8 [ceil(N / 8), K / 32, 8 B]");
  const int64_t per = codes.size(2) / 8;
  const int bits = per == 16 ? 4 : per == 20 ? 5 : per == 24 ? 6 : 0;
  TORCH_CHECK(bits, "quant_block_gemm: K-quant row groups hold 16, 20 or 24 bytes per row and block, got ", per);
  const int64_t pb = bits == 6 ? 144 : 160;
  TORCH_CHECK(params.scalar_type() == at::kByte && params.is_contiguous() && params.dim() == 3 &&
                  params.size(0) == groups && params.size(1) == K / 256 && params.size(2) == pb,
              "quant_block_gemm: K-quant row-group params must be contiguous uint8 [ceil(N / 8), K / 256, ", pb, "]");
  Weight w{codes.data_ptr<uint8_t>(), N, K, blocks * per, bits == 6 ? 16 : 32, K / (bits == 6 ? 16 : 32), bits,
           params.data_ptr(), bits == 6 ? nullptr : params.data_ptr(), false, bits == 6 ? 32 : 0, false, {}, 0,
           bits == 6 ? 16 : 32};
  w.rows8_k = true;
  w.param_bytes = pb;
  return w;
}

Weight describe(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                const c10::optional<at::Tensor>& levels, int64_t K) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "quant_block_gemm: codes must be contiguous uint8 [N, K], [N, 3 K / 4], [N, 5 K / 8] or [N, K / 2]");
  TORCH_CHECK(K % 32 == 0 && K > 0, "quant_block_gemm: K must be a positive multiple of 32, got ", K);
  const int64_t N = codes.size(0), rb = codes.size(1);
  const int bits = rb == K ? 8 : rb * 2 == K ? 4 : rb * 8 == K * 5 ? 5 : rb * 4 == K * 3 ? 6 : 0;
  TORCH_CHECK(bits, "quant_block_gemm: codes hold ", rb, " bytes per row for ", K,
              " inputs (want K, 3 K / 4, 5 K / 8 or K / 2)");
  const bool centred = !mins.has_value() || !mins->defined();
  // two-level bytes: a byte per group, then a float16 factor (2 bytes) per 256 inputs
  const bool two_level = scales.scalar_type() == at::kByte || scales.scalar_type() == at::kChar;
  const int64_t supers = K / 256;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.is_contiguous() &&
                  (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf ||
                   (two_level && K % 256 == 0 && scales.size(1) > 2 * supers)),
              "quant_block_gemm: scales must be contiguous float32 or float16 [N, K / group], or two-level bytes "
              "[N, K / group + 2 K / 256] on rows of whole 256s");
  TORCH_CHECK(centred || (mins->sizes() == scales.sizes() && mins->is_contiguous() &&
                          mins->scalar_type() == scales.scalar_type()),
              "quant_block_gemm: mins must be contiguous, shaped and typed as the scales");
  const int64_t groups = two_level ? scales.size(1) - 2 * supers : scales.size(1);
  TORCH_CHECK(!two_level || groups % supers == 0, "quant_block_gemm: two-level scales of ", groups,
              " groups do not divide into ", supers, " super-blocks");
  // groups of 16: Q6_K's sub-blocks, whose halves of a 32-block close apart (Weight::unit); centred only,
  // as Q6_K's codes are (a min per 16 would need the activations' sums per 16 scaled too)
  const bool halves = groups >= 1 && K % groups == 0 && K / groups == 16 && bits == 6 && centred;
  TORCH_CHECK(groups >= 1 && K % groups == 0 && ((K / groups) % 32 == 0 || halves),
              "quant_block_gemm: groups must be whole multiples of 32 inputs (or 16 for centred 6-bit codes), got ",
              groups, " for K = ", K);
  Weight w{codes.data_ptr<uint8_t>(), N, K, rb, K / groups, groups, bits, scales.data_ptr(),
           centred ? nullptr : mins->data_ptr(), scales.scalar_type() == at::kHalf, 0, false, {}, 0,
           halves ? 16 : 32};
  if (two_level) {
    w.kstride = scales.size(1);
    w.kper = groups / supers;
    w.ksigned = scales.scalar_type() == at::kChar;
  }
  if (levels.has_value() && levels->defined()) {
    TORCH_CHECK(bits == 4 && levels->scalar_type() == at::kFloat && levels->numel() == 16 && levels->is_contiguous(),
                "quant_block_gemm: a level table must be float32 [16] over 4-bit codes");
    const float* lv = levels->data_ptr<float>();
    float lo = lv[0], hi = lv[0];
    for (int i = 0; i < 16; ++i) {
      TORCH_CHECK(lv[i] == std::nearbyint(lv[i]), "quant_block_gemm: a level table must hold integers");
      lo = std::min(lo, lv[i]);
      hi = std::max(hi, lv[i]);
    }
    TORCH_CHECK(hi - lo <= static_cast<float>(kMaxTableCode), "quant_block_gemm: a level table must span at most ",
                kMaxTableCode, " on this build");
    for (int i = 0; i < 16; ++i) w.ulut[i] = static_cast<uint8_t>(lv[i] - lo);
    w.lut = true;
    w.centre = static_cast<int>(-lo);  // levels[u] = ulut[u] - centre
  } else if (centred) {
    w.centre = bits == 8 ? 128 : bits == 6 ? 32 : bits == 5 ? 16 : 8;
  }
#ifdef PERFXLM_QGEMM_WIDE8
  if (bits == 8) w.shift = 128;  // wide panels hold u - 128
#endif
  return w;
}

}  // namespace

at::Tensor quant_block_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& levels,
                            const c10::optional<at::Tensor>& bias, int64_t layout, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "quant_block_gemm: x must be 2-D float32");
  TORCH_CHECK(layout >= 0 && layout <= 3, "quant_block_gemm: layout ", layout,
              " (0 plain, 1 row groups of 8, 2 K-quant row groups of 8, 3 affine row groups of 8)");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  const Weight w = layout == 1 || layout == 3 ? describe_rows8(codes, scales, mins, levels, K, out_features, layout == 3)
                   : layout == 2              ? describe_rows8_k(codes, scales, mins, levels, K, out_features)
                                              : describe(codes, scales, mins, levels, K);
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == w.N, "quant_block_gemm: bias size ", bias->numel(), " != ", w.N);
    bc = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({M, w.N}, xc.options());
  if (M == 0 || w.N == 0) return y;
  // reused call after call (a prefill makes seven of these per layer); named by reference, as a
  // thread_local named inside the parallel region would be each worker's own, empty, one
  thread_local Acts caller_acts;
  Acts& acts = caller_acts;
  // the accumulators start at -centre x sum q, the centre less the panels' shift (signed 8-bit panels: 0
  // for Q8_0's centred codes)
  const bool wide = w.shift != 0;  // 8-bit codes on AVX2 without AVX-VNNI: int16 panels (WideDots)
  quantize(xc.data_ptr<float>(), M, K, w.centre - w.shift, wide, w.unit, w.kstride > 0 || w.rows8_k, acts);
  // Tasks: 32 columns each, and for few column groups, slices of rows too (each slice repacks its
  // columns again: about 1/100 of a 512-row product per repack)
  const int64_t col_tasks = (w.N + kCols - 1) / kCols;
  const int64_t threads = at::get_num_threads();
  int64_t row_slices = 1;
  while (col_tasks * row_slices < 4 * threads && M / (row_slices * 2) >= 64) row_slices *= 2;
  const int64_t slice = ((M + row_slices - 1) / row_slices + kRowTile - 1) / kRowTile * kRowTile;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, col_tasks * row_slices, 1, [&](int64_t t0, int64_t t1) {
    thread_local Panels panels;
    int64_t packed = -1;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t col = t / row_slices, m_begin = (t % row_slices) * slice, m_end = std::min(M, m_begin + slice);
      if (col != packed) {
        repack(w, col * kCols, panels, wide);
        packed = col;
      }
      if (m_begin >= m_end) continue;
      if (w.mins) run_rows<true>(acts, m_begin, m_end, w, panels, col * kCols, yp, bp);
      else run_rows<false>(acts, m_begin, m_end, w, panels, col * kCols, yp, bp);
    }
  });
  return y;
}

#else  // no AVX2: no GEMM; the engine keeps its float32 path (quant_block_gemm_max_code() is 0)

}  // namespace

at::Tensor quant_block_gemm(const at::Tensor& x, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                            const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, int64_t, int64_t) {
  TORCH_CHECK(false, "quant_block_gemm: this build of the kernels has no int8 GEMM (it needs AVX2)");
  return x;
}

#endif  // PERFXLM_QGEMM

// The largest code this build's GEMM runs at its int8 rate, what the layers consult: 255 on every SIMD build
// (vpdpbusd; AVX2 without AVX-VNNI through wide int16 panels, where a level table's span is at most 128),
// 0 where there is no GEMM.
int64_t quant_block_gemm_max_code() {
#ifdef PERFXLM_QGEMM
  return kMaxCode;
#else
  return 0;
#endif
}

}  // namespace perfxlm_qgemm

TORCH_LIBRARY_FRAGMENT(perfxlm, m) {
  m.def("quant_block_gemm(Tensor x, Tensor codes, Tensor scales, Tensor? mins, Tensor? levels, Tensor? bias, "
        "int layout=0, int out_features=-1) -> Tensor");
  m.def("quant_block_gemm_max_code() -> int", &perfxlm_qgemm::quant_block_gemm_max_code);
}

TORCH_LIBRARY_IMPL(perfxlm, CPU, m) { m.impl("quant_block_gemm", &perfxlm_qgemm::quant_block_gemm); }
