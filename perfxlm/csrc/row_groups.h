// Row groups: a quantized weight's codes stored with the blocks of 8 consecutive rows together, for the
// batch-1 int8-dot GEMV (perfxlm/quant/row_groups.py makes the layout and holds its plain-torch reference).
//
// Layout (centred codes: Q8_0's u = q + 128, Q4_0's nibbles; a float16 scale per 32):
//   codes  uint8 [G, K / 32, 8 x B]  (G = ceil(N / 8) groups, B = 32 bytes per row-block for 8-bit codes,
//          16 for 4-bit): per block, the rows' 4-byte quads as [quad][row][4 bytes]; a 4-bit quad's low
//          nibbles are codes 4q..4q + 3 of the block, its high nibbles codes 16 + 4q.. (GGUF's order);
//   scales float16 [G, K / 32, 8]; rows past N (the last group's padding) are zero.
// Why: in the plain layout one vpdpbusd's int32 lanes all belong to one row, so each 64 codes of a row
// pay a scale permute, a conversion and an FMA, and each row a horizontal sum and a mins pass. Here a
// ymm of codes holds one quad of 8 rows: the dots of a block land in 8 lanes, one per row, one
// conversion and one FMA with the 8 scales as loaded serve 8 rows, the centre comes off in the integer
// sum (the accumulator starts at -centre x the block's activation sum), and 8 results are one store.
// Measured (benchmarks/row_interleave.py, Zen 4, one thread): 1.4-2.6x per call streaming, 1.8-2.5x
// cache-resident, against the plain layout's batch-1 kernels on the default model's shapes.
//
// Each output row sums its blocks in one order on every path (even blocks into one float chain, odd
// ones into another, then the two added; each block's float(int sum) x (scale x activation scale) as one
// FMA), so a row's result does not depend on the ISA build or on the other rows of the batch.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <cmath>
#include <cstdint>
#include <vector>

#include "act_blocks.h"
#include "row_group_dots.h"
#include "row_groups_run.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PERFXLM_ROWS8_SIMD 1
#endif

namespace perfxlm_rows8 {

constexpr int kRows = 8;

// One activation row as int8 blocks: the values, each block's scale, and the integer start of each
// block's sum (-centre x the sum of its int8 values, 0 where the kernel takes the centre off itself).
struct Acts {
  std::vector<int8_t> q;
  std::vector<float> dx;
  std::vector<int32_t> start;
};

inline void quantize(const float* x, int64_t K, int32_t centre, Acts& a) {
  const int64_t blocks = K / 32;
  a.q.resize(K);
  a.dx.resize(blocks);
  a.start.resize(blocks);
  int8_t* q = a.q.data();
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t half[2];
    a.dx[b] = perfxlm_act::quantize_block_sums(x + 32 * b, q + 32 * b, half);
    a.start[b] = -centre * (half[0] + half[1]);
  }
}

// The integer sums of block b of one group's 8 rows (codes: the block's 8 x B bytes), lane r = row r.
#ifdef PERFXLM_ROWS8_SIMD
// vpmaddubsw + vpmaddwd (no VNNI): 4-bit codes' pair sums of a whole block fit int16 (8 x 2 x 15 x 127),
// so one vpmaddwd per block; 8-bit codes would saturate, so they enter as code - 128 = q (signed),
// multiplied as |q| x sign(x, q), which needs no centre correction (their start is 0).
constexpr bool kSignTrick = !perfxlm_row_dots::kVnni;
using perfxlm_row_dots::dot4;
using perfxlm_row_dots::quad;

// A block of one group's 8 rows, loaded once for every activation row of the step: 4-bit codes unpacked
// (c[l] codes 4l.. of the block, c[4 + l] codes 16 + 4l..), 8-bit ones as stored (the sign trick's flipped
// to signed, c[v] quad v). Unpacking is most of a 4-bit block's instructions besides the dot products,
// so a verification step's rows share it (group_rows) instead of each row redoing it.
struct Codes {
  __m256i c[8];
};

template <bool BITS4>
inline Codes load_codes(const uint8_t* codes) {
  Codes k;
  if constexpr (BITS4) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    #pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * l));
      k.c[l] = _mm256_and_si256(raw, nib);
      k.c[4 + l] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
    }
  } else {
    #pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) {
      k.c[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * v));
      if constexpr (kSignTrick) k.c[v] = _mm256_xor_si256(k.c[v], _mm256_set1_epi8(static_cast<char>(0x80)));
    }
  }
  return k;
}

// The integer sums of a loaded block with one activation row's int8 block xq, lane r = row r.
template <bool BITS4>
inline __m256i code_sums(const Codes& k, const int8_t* xq, int32_t start) {
  if constexpr (!kSignTrick) {
    __m256i s0 = _mm256_set1_epi32(start), s1 = _mm256_setzero_si256();
    if constexpr (BITS4) {
      #pragma GCC unroll 4
      for (int l = 0; l < 4; ++l) {
        s0 = dot4(s0, k.c[l], quad(xq, l));
        s1 = dot4(s1, k.c[4 + l], quad(xq, l + 4));
      }
    } else {
      #pragma GCC unroll 8
      for (int v = 0; v < 8; v += 2) {
        s0 = dot4(s0, k.c[v], quad(xq, v));
        s1 = dot4(s1, k.c[v + 1], quad(xq, v + 1));
      }
    }
    return _mm256_add_epi32(s0, s1);
  } else {
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (BITS4) {
      __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
      #pragma GCC unroll 4
      for (int l = 0; l < 4; ++l) {
        p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(k.c[l], quad(xq, l)));
        p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(k.c[4 + l], quad(xq, l + 4)));
      }
      return _mm256_add_epi32(_mm256_set1_epi32(start), _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones));
    } else {
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
      #pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) {
        const __m256i c = k.c[v];
        const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(quad(xq, v), c)), ones);
        if (v % 2 == 0) s0 = _mm256_add_epi32(s0, d);
        else s1 = _mm256_add_epi32(s1, d);
      }
      return _mm256_add_epi32(s0, s1);
    }
  }
}

template <bool BITS4>
inline __m256i block_sums(const uint8_t* codes, const int8_t* xq, int32_t start) {
  return code_sums<BITS4>(load_codes<BITS4>(codes), xq, start);
}

// One group's 8 outputs for each of R activation rows (out: R x 8), the block's codes loaded once for
// all R. Each row's sums run exactly as alone (its even blocks into one chain, odd ones into another), so
// a row's result does not depend on the tile it shares.
template <bool BITS4, int R>
inline void group_rows(const uint8_t* codes, const uint16_t* scales, const Acts* const* a, int64_t blocks, float* out) {
  constexpr int64_t bytes = kRows * (BITS4 ? 16 : 32);
  __m256 even[R], odd[R];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
  auto step = [&](int64_t b, __m256* acc) __attribute__((always_inline)) {
    const uint8_t* blk = codes + b * bytes;
    // the stream ahead: a block of 8 rows is a few cycles of dot products, too short a time for the
    // hardware prefetchers to ramp up at the start of a small weight
    _mm_prefetch(reinterpret_cast<const char*>(blk + 1024), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + 1024 + 64), _MM_HINT_T0);
    if constexpr (!BITS4) {
      _mm_prefetch(reinterpret_cast<const char*>(blk + 1024 + 128), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(blk + 1024 + 192), _MM_HINT_T0);
    }
    const Codes k = load_codes<BITS4>(blk);
    const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * kRows)));
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i isum = code_sums<BITS4>(k, a[r]->q.data() + 32 * b, a[r]->start[b]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(sc, _mm256_set1_ps(a[r]->dx[b])), acc[r]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    step(b, even);
    step(b + 1, odd);
  }
  if (b < blocks) step(b, even);
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * kRows, _mm256_add_ps(even[r], odd[r]));
}

// Batch 1, two groups at once (A and B far apart: the two halves of a thread's range), block b of A then
// block b of B: two read streams interleaved a block at a time. Each group's sums run exactly as in
// group_rows<BITS4, 1> (its even blocks into one chain, odd ones into another), so the bits are the same.
template <bool BITS4>
inline void group_pair(const uint8_t* codes_a, const uint16_t* scales_a, const uint8_t* codes_b,
                       const uint16_t* scales_b, const Acts& a, int64_t blocks, float* out_a, float* out_b) {
  constexpr int64_t bytes = kRows * (BITS4 ? 16 : 32);
  __m256 even_a = _mm256_setzero_ps(), odd_a = even_a, even_b = even_a, odd_b = even_a;
  auto step = [&](const uint8_t* codes, const uint16_t* scales, int64_t b, __m256& acc) __attribute__((always_inline)) {
    const uint8_t* blk = codes + b * bytes;
    const Codes k = load_codes<BITS4>(blk);
    const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * kRows)));
    const __m256i isum = code_sums<BITS4>(k, a.q.data() + 32 * b, a.start[b]);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(sc, _mm256_set1_ps(a.dx[b])), acc);
  };
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    step(codes_a, scales_a, b, even_a);
    step(codes_b, scales_b, b, even_b);
    step(codes_a, scales_a, b + 1, odd_a);
    step(codes_b, scales_b, b + 1, odd_b);
  }
  if (b < blocks) {
    step(codes_a, scales_a, b, even_a);
    step(codes_b, scales_b, b, even_b);
  }
  _mm256_storeu_ps(out_a, _mm256_add_ps(even_a, odd_a));
  _mm256_storeu_ps(out_b, _mm256_add_ps(even_b, odd_b));
}
#else
constexpr bool kSignTrick = false;

template <bool BITS4>
inline void group_row(const uint8_t* codes, const uint16_t* scales, const Acts& a, int64_t blocks, float* out) {
  constexpr int64_t bytes = kRows * (BITS4 ? 16 : 32);
  float acc[2][kRows] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = codes + b * bytes;
    const int8_t* xq = a.q.data() + 32 * b;
    for (int r = 0; r < kRows; ++r) {
      int32_t sum = a.start[b];
      for (int q = 0; q < (BITS4 ? 4 : 8); ++q)
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = blk[(q * kRows + r) * 4 + i];
          if constexpr (BITS4) {
            sum += (byte & 15) * xq[4 * q + i] + (byte >> 4) * xq[16 + 4 * q + i];
          } else {
            sum += byte * xq[4 * q + i];
          }
        }
      const float s = static_cast<float>(c10::Half(scales[b * kRows + r], c10::Half::from_bits())) * a.dx[b];
      acc[b & 1][r] = std::fma(static_cast<float>(sum), s, acc[b & 1][r]);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = acc[0][r] + acc[1][r];
}

template <bool BITS4, int R>
inline void group_rows(const uint8_t* codes, const uint16_t* scales, const Acts* const* a, int64_t blocks, float* out) {
  for (int r = 0; r < R; ++r) group_row<BITS4>(codes, scales, *a[r], blocks, out + r * kRows);
}

// Without SIMD: the two groups one after the other (the same bits as group_row on each).
template <bool BITS4>
inline void group_pair(const uint8_t* codes_a, const uint16_t* scales_a, const uint8_t* codes_b,
                       const uint16_t* scales_b, const Acts& a, int64_t blocks, float* out_a, float* out_b) {
  group_row<BITS4>(codes_a, scales_a, a, blocks, out_a);
  group_row<BITS4>(codes_b, scales_b, a, blocks, out_b);
}
#endif

// The checked operands of a product on row groups: the activation rows as int8 blocks, the weight's
// pointers. Made once per call on the calling thread; `groups_into` then runs any range of groups on
// any thread (linear below, and linear_q_ranges' column ranges for LoRA's one-region projection).
struct Product {
  std::vector<Acts> acts;
  const uint8_t* codes = nullptr;
  const uint16_t* scales = nullptr;
  int64_t M = 0, K = 0, blocks = 0, groups = 0, n_out = 0;
  bool bits4 = false;
};

inline Product prepare(const at::Tensor& xc, const at::Tensor& codes, const at::Tensor& scales, int64_t bits,
                       int64_t n_out) {
  TORCH_CHECK(xc.dim() == 2 && xc.scalar_type() == at::kFloat && xc.is_contiguous(),
              "linear_q_rows8: x must be contiguous 2-D float32");
  TORCH_CHECK(bits == 8 || bits == 4, "linear_q_rows8: 8- or 4-bit codes");
  Product p;
  p.bits4 = bits == 4;
  p.M = xc.size(0), p.K = xc.size(1), p.blocks = p.K / 32, p.groups = (n_out + kRows - 1) / kRows, p.n_out = n_out;
  TORCH_CHECK(p.K % 32 == 0, "linear_q_rows8: K must be a multiple of 32");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 3 && codes.size(0) == p.groups &&
                  codes.size(1) == p.blocks && codes.size(2) == kRows * (p.bits4 ? 16 : 32),
              "linear_q_rows8: codes must be uint8 [ceil(N / 8), K / 32, 8 x bytes per block]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == p.groups && scales.size(1) == p.blocks && scales.size(2) == kRows,
              "linear_q_rows8: scales must be float16 [ceil(N / 8), K / 32, 8]");
  p.acts.resize(static_cast<size_t>(p.M));
  const int32_t centre = p.bits4 ? 8 : (kSignTrick ? 0 : 128);
  const float* xp = xc.data_ptr<float>();
  for (int64_t m = 0; m < p.M; ++m) quantize(xp + m * p.K, p.K, centre, p.acts[m]);
  p.codes = codes.data_ptr<uint8_t>();
  p.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  return p;
}

// Groups [g0, g1) of the product into y (row stride ldy, output n at column n), bias added; each thread
// runs every activation row over a group before the next (the group's codes stay in L1). A row's outputs
// do not depend on which range computed them.
inline void groups_into(const Product& p, int64_t g0, int64_t g1, float* y, int64_t ldy, const float* bias) {
  const int64_t group_bytes = p.blocks * kRows * (p.bits4 ? 16 : 32);
  if (p.M == 1 && perfxlm_streams::two_streams(true) && g1 - g0 >= 2) {
    // batch 1, two streams: the range's halves a block at a time (group_pair)
    const Acts* row = &p.acts[0];
    auto codes = [&](int64_t g) { return p.codes + g * group_bytes; };
    auto scales = [&](int64_t g) { return p.scales + g * p.blocks * kRows; };
    perfxlm_row_groups::halves_in_pairs(g0, g1, p.n_out, y, bias,
      [&](int64_t ga, int64_t gb, float* out_a, float* out_b) {
        if (p.bits4) group_pair<true>(codes(ga), scales(ga), codes(gb), scales(gb), *row, p.blocks, out_a, out_b);
        else group_pair<false>(codes(ga), scales(ga), codes(gb), scales(gb), *row, p.blocks, out_a, out_b);
      },
      [&](int64_t g, float* out) {
        if (p.bits4) group_rows<true, 1>(codes(g), scales(g), &row, p.blocks, out);
        else group_rows<false, 1>(codes(g), scales(g), &row, p.blocks, out);
      });
    return;
  }
  perfxlm_row_groups::each_group(g0, g1, [&](int64_t g) {
    perfxlm_row_groups::row_tiles(p.M, [&](auto tile, int64_t m0) {
      constexpr int R = decltype(tile)::value;
      const Acts* rows[R];
      for (int r = 0; r < R; ++r) rows[r] = &p.acts[m0 + r];
      float out[R * kRows];
      if (p.bits4)
        group_rows<true, R>(p.codes + g * group_bytes, p.scales + g * p.blocks * kRows, rows, p.blocks, out);
      else
        group_rows<false, R>(p.codes + g * group_bytes, p.scales + g * p.blocks * kRows, rows, p.blocks, out);
      const int64_t n0 = g * kRows, n = std::min<int64_t>(kRows, p.n_out - n0);
      for (int r = 0; r < R; ++r)
        for (int64_t i = 0; i < n; ++i) y[(m0 + r) * ldy + n0 + i] = out[r * kRows + i] + (bias ? bias[n0 + i] : 0.f);
    });
  });
}

// y [M, N] = x [M, K] W^T (+ bias) for W in row groups (bits 8 or 4), over groups in parallel.
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t bits,
                         int64_t n_out, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_q_rows8: x must be 2-D float32");
  const at::Tensor xc = x.contiguous();
  return perfxlm_row_groups::run("linear_q_rows8", xc, prepare(xc, codes, scales, bits, n_out), n_out, bias, groups_into);
}

// Row groups -> the plain layout's codes [N, K (8-bit) or K / 2] and float16 scales [N, K / 32]
// (perfxlm/quant/row_groups.py's unpack): for the paths that read rows (many rows without the int8 GEMM).
inline std::pair<at::Tensor, at::Tensor> unpack(const at::Tensor& codes, const at::Tensor& scales, int64_t n_out) {
  const int64_t groups = codes.size(0), blocks = codes.size(1), per = codes.size(2) / kRows;
  const at::Tensor c = codes.view({groups, blocks, per / 4, kRows, 4}).permute({0, 3, 1, 2, 4})
                           .reshape({groups * kRows, blocks * per}).narrow(0, 0, n_out).contiguous();
  const at::Tensor s = scales.permute({0, 2, 1}).reshape({groups * kRows, blocks}).narrow(0, 0, n_out).contiguous();
  return {c, s};
}

// x with each block of 32 replaced by its int8 rounding times its scale (what the GEMV multiplies).
inline at::Tensor rounded_blocks(const at::Tensor& xc) {
  const int64_t M = xc.size(0), K = xc.size(1);
  at::Tensor out = at::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    int8_t q[32];
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < K / 32; ++b) {
        const float s = perfxlm_act::quantize_block_fast(xp + m * K + 32 * b, q);
        for (int j = 0; j < 32; ++j) op[m * K + 32 * b + j] = static_cast<float>(q[j]) * s;
      }
  });
  return out;
}

}  // namespace perfxlm_rows8
