// Row groups of affine 4-bit codes (GGUF Q4_1: value = d x u + m per 32-block, u in 0..15), the batch-1
// int8-dot GEMV on them (perfxlm/quant/row_groups.py makes the layout, linear_q's layout 3).
//
// Layout: codes and scales as row_groups.h's 4-bit ones (codes uint8 [G, K / 32, 8 x 16], scales float16
// [G, K / 32, 8]), and the mins float16 [G, K / 32, 8] as the scales are; rows past N are zeros.
// Per block of 32 activations x (int8 values q, scale sx) and row r:
//   d_r x sx x sum(u q) + m_r x (sx x sum(q))
// The first term is row_groups.h's 4-bit block sums with no centre (the codes are unsigned as stored); the
// second needs only the block's (sx x sum q), formed once per activation row (as the plain layout's block
// GEMV forms it, quantize_blocks' gsum), so per block of 8 rows the mins cost one conversion and one FMA
// with their 8 values as loaded. The two terms sum in their own accumulators (even blocks and odd ones
// apart, as row_groups.h's), added at the end: the plain kernel also sums the mins apart from the dots.
// A row's result does not depend on the ISA build's lane count or on the other rows of the batch.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "act_blocks.h"
#include "row_groups.h"
#include "row_groups_run.h"

namespace perfxlm_rows8m {

constexpr int kRows = 8;
constexpr int64_t kBlockBytes = kRows * 16;  // one block of a group: 8 rows x 16 bytes of nibbles

// One activation row as int8 blocks: the values, each block's scale, and each block's sx x sum(q) (what
// multiplies the mins).
struct Acts {
  std::vector<int8_t> q;
  std::vector<float> dx, xsum;
};

inline void quantize(const float* x, int64_t K, Acts& a) {
  const int64_t blocks = K / 32;
  a.q.resize(K);
  a.dx.resize(blocks);
  a.xsum.resize(blocks);
  int8_t* q = a.q.data();
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t half[2];
    const float dx = perfxlm_act::quantize_block_sums(x + 32 * b, q + 32 * b, half);
    a.dx[b] = dx;
    a.xsum[b] = dx * static_cast<float>(half[0] + half[1]);
  }
}

// One group's 8 outputs for each of R activation rows (out: R x 8): each block's codes unpacked, and its
// scales widened, once for all R (row_groups.h's group_rows); each row's sums in its own order. Up to 4
// rows the mins' term runs in the same pass; past 4 its accumulators (2 per row) would not fit in the 32
// registers beside the dots' (2 per row) and the block's 8 code vectors, so a second pass over the
// group's mins (in L1) sums it: each accumulator sees the same FMAs in the same order either way, so a
// row's bits do not depend on the tile.
#ifdef PERFXLM_ROWS8_SIMD
template <int R>
inline void group_rows(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, const Acts* const* a,
                       int64_t blocks, float* out) {
  constexpr bool kMinsApart = R > 4;
  __m256 acc[2][R], macc[2][R];  // [block parity][row]
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = macc[0][r] = macc[1][r] = _mm256_setzero_ps();
  auto mins_of = [&](int64_t b) __attribute__((always_inline)) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + b * kRows)));
  };
  auto step = [&](int64_t b, __m256* dots, __m256* mterm) __attribute__((always_inline)) {
    const uint8_t* blk = codes + b * kBlockBytes;
    // the stream ahead (row_groups.h says why)
    _mm_prefetch(reinterpret_cast<const char*>(blk + 1024), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + 1024 + 64), _MM_HINT_T0);
    const perfxlm_rows8::Codes k = perfxlm_rows8::load_codes<true>(blk);
    const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * kRows)));
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i isum = perfxlm_rows8::code_sums<true>(k, a[r]->q.data() + 32 * b, 0);
      dots[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(sc, _mm256_set1_ps(a[r]->dx[b])), dots[r]);
    }
    if constexpr (!kMinsApart) {
      const __m256 m = mins_of(b);
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) mterm[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a[r]->xsum[b]), mterm[r]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    step(b, acc[0], macc[0]);
    step(b + 1, acc[1], macc[1]);
  }
  if (b < blocks) step(b, acc[0], macc[0]);
  if constexpr (kMinsApart) {
    auto mstep = [&](int64_t b, __m256* mterm) __attribute__((always_inline)) {
      const __m256 m = mins_of(b);
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) mterm[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a[r]->xsum[b]), mterm[r]);
    };
    for (b = 0; b + 2 <= blocks; b += 2) {
      mstep(b, macc[0]);
      mstep(b + 1, macc[1]);
    }
    if (b < blocks) mstep(b, macc[0]);
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    _mm256_storeu_ps(out + r * kRows, _mm256_add_ps(_mm256_add_ps(acc[0][r], acc[1][r]), _mm256_add_ps(macc[0][r], macc[1][r])));
}

// Batch 1, two groups at once (A and B far apart: the two halves of a thread's range), block b of A then
// block b of B (row_groups.h's group_pair): each group's sums exactly group_rows<1>'s, so the same bits.
inline void group_pair(const uint8_t* codes_a, const uint16_t* scales_a, const uint16_t* mins_a, const uint8_t* codes_b,
                       const uint16_t* scales_b, const uint16_t* mins_b, const Acts& a, int64_t blocks, float* out_a,
                       float* out_b) {
  __m256 acc[2][2], macc[2][2];  // [group][block parity]
  for (int g = 0; g < 2; ++g) acc[g][0] = acc[g][1] = macc[g][0] = macc[g][1] = _mm256_setzero_ps();
  auto step = [&](const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, int64_t b, __m256& dots,
                  __m256& mterm) __attribute__((always_inline)) {
    const perfxlm_rows8::Codes k = perfxlm_rows8::load_codes<true>(codes + b * kBlockBytes);
    const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * kRows)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + b * kRows)));
    const __m256i isum = perfxlm_rows8::code_sums<true>(k, a.q.data() + 32 * b, 0);
    dots = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(sc, _mm256_set1_ps(a.dx[b])), dots);
    mterm = _mm256_fmadd_ps(m, _mm256_set1_ps(a.xsum[b]), mterm);
  };
  for (int64_t b = 0; b < blocks; ++b) {
    step(codes_a, scales_a, mins_a, b, acc[0][b & 1], macc[0][b & 1]);
    step(codes_b, scales_b, mins_b, b, acc[1][b & 1], macc[1][b & 1]);
  }
  _mm256_storeu_ps(out_a, _mm256_add_ps(_mm256_add_ps(acc[0][0], acc[0][1]), _mm256_add_ps(macc[0][0], macc[0][1])));
  _mm256_storeu_ps(out_b, _mm256_add_ps(_mm256_add_ps(acc[1][0], acc[1][1]), _mm256_add_ps(macc[1][0], macc[1][1])));
}
#else
inline void group_row(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, const Acts& a,
                      int64_t blocks, float* out) {
  float acc[2][kRows] = {}, macc[2][kRows] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = codes + b * kBlockBytes;
    const int8_t* xq = a.q.data() + 32 * b;
    for (int r = 0; r < kRows; ++r) {
      int32_t sum = 0;
      for (int q = 0; q < 4; ++q)
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = blk[(q * kRows + r) * 4 + i];
          sum += (byte & 15) * xq[4 * q + i] + (byte >> 4) * xq[16 + 4 * q + i];
        }
      const float s = static_cast<float>(c10::Half(scales[b * kRows + r], c10::Half::from_bits())) * a.dx[b];
      const float m = static_cast<float>(c10::Half(mins[b * kRows + r], c10::Half::from_bits()));
      acc[b & 1][r] = std::fma(static_cast<float>(sum), s, acc[b & 1][r]);
      macc[b & 1][r] = std::fma(m, a.xsum[b], macc[b & 1][r]);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = (acc[0][r] + acc[1][r]) + (macc[0][r] + macc[1][r]);
}

template <int R>
inline void group_rows(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, const Acts* const* a,
                       int64_t blocks, float* out) {
  for (int r = 0; r < R; ++r) group_row(codes, scales, mins, *a[r], blocks, out + r * kRows);
}

// Without SIMD: the two groups one after the other (group_row's bits on each).
inline void group_pair(const uint8_t* codes_a, const uint16_t* scales_a, const uint16_t* mins_a, const uint8_t* codes_b,
                       const uint16_t* scales_b, const uint16_t* mins_b, const Acts& a, int64_t blocks, float* out_a,
                       float* out_b) {
  group_row(codes_a, scales_a, mins_a, a, blocks, out_a);
  group_row(codes_b, scales_b, mins_b, a, blocks, out_b);
}
#endif

// Measured per call on Llama-3.2-1B's shapes cycled past the L3 (benchmarks/gemv_streams.py, one thread,
// per CPU-second, loaded): two block-interleaved streams 1.05-1.11x one stream (q|k|v, gate|up, down).
// Whether batch 1 reads a thread's groups as two block-interleaved streams (group_pair) unless
// PERFXLM_GEMV_STREAMS / set_gemv_streams says otherwise (read_streams.h).
constexpr bool kPairByDefault = true;

// The checked operands of a product (row_groups.h's Product, with the mins).
struct Product {
  std::vector<Acts> acts;
  const uint8_t* codes = nullptr;
  const uint16_t* scales = nullptr;
  const uint16_t* mins = nullptr;
  int64_t M = 0, K = 0, blocks = 0, groups = 0, n_out = 0;
};

inline Product prepare(const at::Tensor& xc, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                       int64_t n_out) {
  TORCH_CHECK(xc.dim() == 2 && xc.scalar_type() == at::kFloat && xc.is_contiguous(),
              "linear_q_rows8_m: x must be contiguous 2-D float32");
  Product p;
  p.M = xc.size(0), p.K = xc.size(1), p.blocks = p.K / 32, p.groups = (n_out + kRows - 1) / kRows, p.n_out = n_out;
  TORCH_CHECK(p.K % 32 == 0 && n_out > 0, "linear_q_rows8_m: K must be a multiple of 32, out_features positive");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 3 && codes.size(0) == p.groups &&
                  codes.size(1) == p.blocks && codes.size(2) == kBlockBytes,
              "linear_q_rows8_m: codes must be uint8 [ceil(N / 8), K / 32, 8 x 16]");
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == p.groups &&
                    t->size(1) == p.blocks && t->size(2) == kRows,
                "linear_q_rows8_m: scales and mins must be float16 [ceil(N / 8), K / 32, 8]");
  p.acts.resize(static_cast<size_t>(p.M));
  const float* xp = xc.data_ptr<float>();
  for (int64_t m = 0; m < p.M; ++m) quantize(xp + m * p.K, p.K, p.acts[m]);
  p.codes = codes.data_ptr<uint8_t>();
  p.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  p.mins = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  return p;
}

// Groups [g0, g1) into y (row stride ldy), bias added; each group's codes stay in L1 over the batch's rows.
inline void groups_into(const Product& p, int64_t g0, int64_t g1, float* y, int64_t ldy, const float* bias) {
  if (p.M == 1 && perfxlm_streams::two_streams(kPairByDefault) && g1 - g0 >= 2) {
    // batch 1, two streams: the range's halves a block at a time (group_pair)
    const Acts* row = &p.acts[0];
    auto codes = [&](int64_t g) { return p.codes + g * p.blocks * kBlockBytes; };
    auto params = [&](int64_t g) { return g * p.blocks * kRows; };
    perfxlm_row_groups::halves_in_pairs(g0, g1, p.n_out, y, bias,
      [&](int64_t ga, int64_t gb, float* out_a, float* out_b) {
        group_pair(codes(ga), p.scales + params(ga), p.mins + params(ga), codes(gb), p.scales + params(gb),
                   p.mins + params(gb), *row, p.blocks, out_a, out_b);
      },
      [&](int64_t g, float* out) { group_rows<1>(codes(g), p.scales + params(g), p.mins + params(g), &row, p.blocks, out); });
    return;
  }
  perfxlm_row_groups::each_group(g0, g1, [&](int64_t g) {
    perfxlm_row_groups::row_tiles(p.M, [&](auto tile, int64_t m0) {
      constexpr int R = decltype(tile)::value;
      const Acts* rows[R];
      for (int r = 0; r < R; ++r) rows[r] = &p.acts[m0 + r];
      float out[R * kRows];
      const int64_t params = g * p.blocks * kRows;
      group_rows<R>(p.codes + g * p.blocks * kBlockBytes, p.scales + params, p.mins + params, rows, p.blocks, out);
      const int64_t n0 = g * kRows, n = std::min<int64_t>(kRows, p.n_out - n0);
      for (int r = 0; r < R; ++r)
        for (int64_t i = 0; i < n; ++i) y[(m0 + r) * ldy + n0 + i] = out[r * kRows + i] + (bias ? bias[n0 + i] : 0.f);
    });
  });
}

// y [M, N] = x [M, K] W^T (+ bias) for W in affine row groups, over groups in parallel.
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                         int64_t n_out, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_q_rows8_m: x must be 2-D float32");
  const at::Tensor xc = x.contiguous();
  return perfxlm_row_groups::run("linear_q_rows8_m", xc, prepare(xc, codes, scales, mins, n_out), n_out, bias, groups_into);
}

// The mins (float16 [G, K / 32, 8]) in the plain layout [N, K / 32], as row_groups.h's unpack gives the scales.
inline at::Tensor unpack_mins(const at::Tensor& mins, int64_t n_out) {
  const int64_t groups = mins.size(0), blocks = mins.size(1);
  return mins.permute({0, 2, 1}).reshape({groups * kRows, blocks}).narrow(0, 0, n_out).contiguous();
}

}  // namespace perfxlm_rows8m
