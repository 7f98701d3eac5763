// CPU kernels for the places where the profile showed PyTorch's own ops fall short:
//
// 1. linear_bf16_packed: y = x W^T (+ b) with x float32 and W stored as bfloat16 panels packed at
//    load, accumulated in float32. Decode is bound by reading the weights; on CPUs without native bf16
//    math torch's bf16 matmul is emulated (slower than float32), so this reads half the bytes of a
//    float32 GEMV and widens each weight in registers. widen_panels feeds MKL's float32 GEMM for
//    many rows (prefill).
// 2. fused_add_rms_norm, rms_norm, rotary_embedding: a decode step's per-layer elementwise work in one
//    call each (dispatch overhead, not arithmetic, is what they cost at small batch).
// 3. decode_layer: a whole decoder layer (Llama family, Gemma 2) for an all-decode step, composed from
//    the above and the KV cache kernels of attention_kernels.cpp.
// (moe_experts, a mixture of experts' routed experts in one call, is csrc/moe_kernels.cpp, built on
// `project` and `mlp_activation` here: fused_project.h.)
//
// The plain-torch references are perfxlm/ops/reference.py; tests compare the two on random inputs.
// Built at first use by torch.utils.cpp_extension (see perfxlm/ops/native.py) with -march=native:
// the AVX-512 paths compile where the CPU has it, the portable loops elsewhere.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_kernels.h"  // the fused layer's cache write and attention
#include "bf16_dots.h"  // many rows against bf16 rows: vdpbf16ps
#include "fused_project.h"  // what this file lends csrc/moe_kernels.cpp
#include "lora_kernels.h"  // the step's LoRA adapters after each projection
#include "quant_linear.h"  // quantized weights in the fused layer's projections
#include "read_streams.h"  // the order batch-1 GEMVs read their weights in
#include "simd16.h"  // the GEMV kernels' 16-lane vectors: AVX-512, or AVX2 + FMA


namespace {

inline float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}


// ---------------------------------------------------------------------------------------------
// linear_bf16_packed: the same product with W pre-packed once at load into panels of 16 output
// columns, [ceil(N/16), K, 16] bf16. One k step reads 16 consecutive weights of each panel and
// broadcasts one x value per row: no horizontal sums, every weight widened once per row tile.
// ---------------------------------------------------------------------------------------------

#ifdef PERFXLM_SIMD16
using simd16::V;
// Row tiles by register count. AVX-512 (32 zmm): 8 rows x 2 panels, 16 accumulators. AVX2 (16 ymm, a V
// two of them): 6 rows x 1 panel, 12 accumulators + the panel's 2 + a broadcast; the 4 x 2 tile it had
// needed 16 + 4 + 1 and spilled accumulators every k step.
constexpr int kPackedRows = simd16::kAvx512 ? 8 : 6;
constexpr int kPackedPanels = simd16::kAvx512 ? 2 : 1;

// Panel j of the tile is panels + j * panel_stride, its 16 outputs from column n0 + j * col_step.
template <int MT, int NP>
inline void packed_tile(const float* x, int64_t K, const uint16_t* panels, int64_t panel_stride, float* y,
                        int64_t N, int64_t n0, const float* bias, int64_t col_step = 16) {
  V acc[MT][NP];
  #pragma GCC unroll 16
  for (int i = 0; i < MT; ++i)
    #pragma GCC unroll 16
    for (int j = 0; j < NP; ++j) acc[i][j] = simd16::zero();
  for (int64_t k = 0; k < K; ++k) {
    V wv[NP];
    #pragma GCC unroll 16
    for (int j = 0; j < NP; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(panels + j * panel_stride + (k + 16) * 16), _MM_HINT_T0);
      wv[j] = simd16::load_panel(panels + j * panel_stride + k * 16);
    }
    #pragma GCC unroll 16
    for (int i = 0; i < MT; ++i) {
      const V xb = simd16::set1(x[i * K + k]);
      #pragma GCC unroll 16
      for (int j = 0; j < NP; ++j) acc[i][j] = simd16::fmadd(xb, wv[j], acc[i][j]);
    }
  }
  #pragma GCC unroll 16
  for (int j = 0; j < NP; ++j) {
    const int64_t n = n0 + col_step * j;
    const V bv = bias ? simd16::load(bias + n, N - n) : simd16::zero();
    #pragma GCC unroll 16
    for (int i = 0; i < MT; ++i) simd16::store(y + i * N + n, simd16::add(simd16::panel_order(acc[i][j]), bv), N - n);
  }
}

template <int NP>
inline void packed_rows(const float* x, int64_t M, int64_t K, const uint16_t* panels, int64_t panel_stride, float* y,
                        int64_t N, int64_t n0, const float* bias) {
  constexpr int MT = kPackedRows;
  int64_t m = 0;
  for (; m + MT <= M; m += MT) packed_tile<MT, NP>(x + m * K, K, panels, panel_stride, y + m * N, N, n0, bias);
  switch (M - m) {
    case 7: packed_tile<7, NP>(x + m * K, K, panels, panel_stride, y + m * N, N, n0, bias); break;
    case 6: packed_tile<6, NP>(x + m * K, K, panels, panel_stride, y + m * N, N, n0, bias); break;
    case 5: packed_tile<5, NP>(x + m * K, K, panels, panel_stride, y + m * N, N, n0, bias); break;
    case 4: packed_tile<4, NP>(x + m * K, K, panels, panel_stride, y + m * N, N, n0, bias); break;
    case 3: packed_tile<3, NP>(x + m * K, K, panels, panel_stride, y + m * N, N, n0, bias); break;
    case 2: packed_tile<2, NP>(x + m * K, K, panels, panel_stride, y + m * N, N, n0, bias); break;
    case 1: packed_tile<1, NP>(x + m * K, K, panels, panel_stride, y + m * N, N, n0, bias); break;
    default: break;
  }
}
#endif

at::Tensor linear_bf16_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                              const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_bf16_packed: x must be 2-D float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous(), "linear_bf16_packed: packed must be contiguous bf16 [N/16, K, 16]");
  TORCH_CHECK(packed.size(1) == x.size(1), "linear_bf16_packed: x has ", x.size(1), " features, weight expects ",
              packed.size(1));
  TORCH_CHECK(packed.size(0) * 16 >= N && packed.size(0) * 16 < N + 16, "linear_bf16_packed: N does not match panels");
  const at::Tensor xc = x.contiguous();
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear_bf16_packed: bias size ", bias->numel(), " != ", N);
    bc = bias->to(at::kFloat).contiguous();
  }
  const int64_t M = xc.size(0), K = xc.size(1), panels = packed.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t panel_stride = K * 16;
#ifdef PERFXLM_SIMD16
  if (M == 1 && perfxlm_streams::two_streams(false)) {
    // batch 1: a task's panels in two halves walked side by side, panel i of the first half with panel i
    // of the second (two sequential read streams far apart, read_streams.h); each column's sum as below
    at::parallel_for(0, panels, 2, [&](int64_t begin, int64_t end) {
      const int64_t half = (end - begin + 1) / 2;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t p = begin + i;
        if (p + half < end)
          packed_tile<1, 2>(xp, K, pp + p * panel_stride, half * panel_stride, yp, N, p * 16, bp, half * 16);
        else
          packed_tile<1, 1>(xp, K, pp + p * panel_stride, panel_stride, yp, N, p * 16, bp);
      }
    });
    return y;
  }
  // Many rows: each task's panels are walked once per block of x rows that stays in L2 (512 prefill rows
  // of 576 floats are 1.2 MB), tile by tile within it. Every column is one float32 FMA chain over k in
  // order, whatever the tile: a row gives the same bits alone (the batch-1 path above) and in any batch.
  const int64_t groups = (panels + 1) / 2;  // two panels (32 columns) per task
  const int64_t most = std::max<int64_t>(kPackedRows, (int64_t{512} << 10) / (4 * std::max<int64_t>(1, K)));  // half of Zen 4's L2
  const int64_t blocks = (M + most - 1) / most;  // equal blocks, whole tiles
  const int64_t block = ((M + blocks - 1) / blocks + kPackedRows - 1) / kPackedRows * kPackedRows;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t rows = std::min(block, M - m0);
      const float* xs = xp + m0 * K;
      float* ys = yp + m0 * N;
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p = 2 * g;
        const uint16_t* src = pp + p * panel_stride;
        if (p + 1 < panels && kPackedPanels == 2) {
          packed_rows<2>(xs, rows, K, src, panel_stride, ys, N, p * 16, bp);
        } else {
          packed_rows<1>(xs, rows, K, src, panel_stride, ys, N, p * 16, bp);
          if (p + 1 < panels) packed_rows<1>(xs, rows, K, src + panel_stride, panel_stride, ys, N, p * 16 + 16, bp);
        }
      }
    }
  });
#else
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t c = 0; c < 16 && p * 16 + c < N; ++c) {
          float acc = 0.f;
          for (int64_t k = 0; k < K; ++k) acc += xp[m * K + k] * bf16_to_float(pp[p * panel_stride + k * 16 + c]);
          yp[m * N + p * 16 + c] = acc + (bp ? bp[p * 16 + c] : 0.f);
        }
  });
#endif
  return y;
}

// ---------------------------------------------------------------------------------------------
// linear_bf16_rows: the same product with W kept as plain bf16 rows [N, K] (the layout torch's own
// bf16 GEMM reads, so CPUs with AMX / AVX512-BF16 run many-row products through oneDNN on the very
// same tensor). Few rows only: up to kPairMaxRows x rows dot two far-apart weight rows at a time (rows_pairs); more rows: each task
// streams NT weight rows and dots them with every x row,
// accumulating 16 lanes per pair and reducing once at the end (K / 16 FMAs per reduction). The NT
// rows of a tile stay in L1 while chunks of up to MT x rows pass over them.
// ---------------------------------------------------------------------------------------------

#ifdef PERFXLM_SIMD16
// x rows per chunk, by register count.
constexpr int kRowsChunk = simd16::kAvx512 ? 4 : 2;

template <int MT, int NT>
inline void rows_tile(const float* x, int64_t K, const uint16_t* w, float* y, int64_t N, int64_t n0,
                      const float* bias) {
  V acc[MT][NT];
  #pragma GCC unroll 16
  for (int i = 0; i < MT; ++i)
    #pragma GCC unroll 16
    for (int j = 0; j < NT; ++j) acc[i][j] = simd16::zero();
  for (int64_t k = 0; k < K; k += 16) {
    V wv[NT];
    #pragma GCC unroll 16
    for (int j = 0; j < NT; ++j) {
      // The NT rows are NT interleaved read streams, which the hardware prefetchers follow worse than
      // one: fetch the next tile's rows (the next NT * K weights, contiguous) a whole tile ahead.
      if ((k & 31) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (NT + j) * K + k), _MM_HINT_T0);
      wv[j] = simd16::load(w + j * K + k, K - k);
    }
    #pragma GCC unroll 16
    for (int i = 0; i < MT; ++i) {
      const V xv = simd16::load(x + i * K + k, K - k);
      #pragma GCC unroll 16
      for (int j = 0; j < NT; ++j) acc[i][j] = simd16::fmadd(xv, wv[j], acc[i][j]);
    }
  }
  #pragma GCC unroll 16
  for (int i = 0; i < MT; ++i)
    #pragma GCC unroll 16
    for (int j = 0; j < NT; ++j) y[i * N + n0 + j] = simd16::reduce_add(acc[i][j]) + (bias ? bias[n0 + j] : 0.f);
}

// Few x rows (batch 1, a verification step's rows): a task's weight rows split in two halves walked side by
// side, row a of the first half with row a of the second, each pair dotted with every x row while it is in
// L1. A thread then reads two sequential streams far apart, which the hardware prefetchers follow at the
// DRAM rate: NT interleaved rows (the tile above) read 10-14 GB/s from DRAM on Zen 4, one row after another
// 16-19, two far-apart rows 20-24 (2 threads, model-shaped matrices cycled past the L3); a software
// prefetch a tile or a few lines ahead did not close the gap. With the tile's pattern 2-4 rows cost
// 1.8-1.9x one row's time on a model's bf16 matrices; walked as pairs they stay near one row's.
// One accumulator per (x row, weight row), 16 lanes at a time, reduced once: the summation order of
// rows_tile, so a row alone gives the same bits as that row among others (one FMA chain per row is
// enough where the weights' reads bound the time).
template <int C>
inline void pair_rows(const float* x, int64_t K, const uint16_t* wa, const uint16_t* wb, bool two, float* y,
                      int64_t N, int64_t ra, int64_t rb, const float* bias) {
  V a[C], b[C];
  #pragma GCC unroll 8
  for (int i = 0; i < C; ++i) a[i] = b[i] = simd16::zero();
  for (int64_t k = 0; k < K; k += 16) {
    // From 3 x rows the FMAs take longer than the two streams' reads, and the prefetchers alone then fall
    // behind: fetching 1 KB ahead took 4 rows of a model's matrices 10.2 -> 8.7 ms (2 threads, Zen 4,
    // alternating; 2 KB ahead, or at every row count, did worse).
    if (C > 2 && (k & 31) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(wa + k + 512), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wb + k + 512), _MM_HINT_T0);
    }
    const V va = simd16::load(wa + k, K - k), vb = simd16::load(wb + k, K - k);
    #pragma GCC unroll 8
    for (int i = 0; i < C; ++i) {
      const V xv = simd16::load(x + i * K + k, K - k);
      a[i] = simd16::fmadd(xv, va, a[i]);
      b[i] = simd16::fmadd(xv, vb, b[i]);
    }
  }
  #pragma GCC unroll 8
  for (int i = 0; i < C; ++i) {
    y[i * N + ra] = simd16::reduce_add(a[i]) + (bias ? bias[ra] : 0.f);
    if (two) y[i * N + rb] = simd16::reduce_add(b[i]) + (bias ? bias[rb] : 0.f);
  }
}

// Up to this many x rows take the pair walk (beyond, rows_block's tiles reuse each weight load more).
constexpr int64_t kPairMaxRows = 8;

// x rows per pass over a pair, by register count: 2 accumulators per row, the pair and an x vector
// (AVX-512: 32 zmm, every row up to kPairMaxRows in one pass; AVX2: 16 ymm, two per 16 lanes).
constexpr int kPairChunk = simd16::kAvx512 ? 8 : 2;

// Weight rows [0, n) of this task (w, y and bias start at its first row; y's rows are N apart).
inline void rows_pairs(const float* x, int64_t M, int64_t K, const uint16_t* w, float* y, int64_t N, int64_t n,
                       const float* bias) {
  const int64_t half = (n + 1) / 2;
  for (int64_t r = 0; r < half; ++r) {
    const bool two = r + half < n;
    const uint16_t* wa = w + r * K;
    const uint16_t* wb = two ? w + (r + half) * K : wa;
    for (int64_t m = 0; m < M; m += kPairChunk) {
      const float* xm = x + m * K;
      float* ym = y + m * N;
      switch (std::min<int64_t>(M - m, kPairChunk)) {
        case 8: pair_rows<(kPairChunk >= 8 ? 8 : 1)>(xm, K, wa, wb, two, ym, N, r, r + half, bias); break;
        case 7: pair_rows<(kPairChunk >= 7 ? 7 : 1)>(xm, K, wa, wb, two, ym, N, r, r + half, bias); break;
        case 6: pair_rows<(kPairChunk >= 6 ? 6 : 1)>(xm, K, wa, wb, two, ym, N, r, r + half, bias); break;
        case 5: pair_rows<(kPairChunk >= 5 ? 5 : 1)>(xm, K, wa, wb, two, ym, N, r, r + half, bias); break;
        case 4: pair_rows<(kPairChunk >= 4 ? 4 : 1)>(xm, K, wa, wb, two, ym, N, r, r + half, bias); break;
        case 3: pair_rows<(kPairChunk >= 3 ? 3 : 1)>(xm, K, wa, wb, two, ym, N, r, r + half, bias); break;
        case 2: pair_rows<2>(xm, K, wa, wb, two, ym, N, r, r + half, bias); break;
        default: pair_rows<1>(xm, K, wa, wb, two, ym, N, r, r + half, bias); break;
      }
    }
  }
}

template <int NT>
inline void rows_block(const float* x, int64_t M, int64_t K, const uint16_t* w, float* y, int64_t N, int64_t n0,
                       const float* bias) {
  constexpr int MT = kRowsChunk;
  int64_t m = 0;
  for (; m + MT <= M; m += MT) rows_tile<MT, NT>(x + m * K, K, w, y + m * N, N, n0, bias);
  switch (M - m) {
    case 3: rows_tile<3, NT>(x + m * K, K, w, y + m * N, N, n0, bias); break;
    case 2: rows_tile<2, NT>(x + m * K, K, w, y + m * N, N, n0, bias); break;
    case 1: rows_tile<1, NT>(x + m * K, K, w, y + m * N, N, n0, bias); break;
    default: break;
  }
}
#endif

at::Tensor linear_bf16_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_bf16_rows: x must be 2-D float32");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "linear_bf16_rows: weight must be contiguous bf16 [N, K]");
  TORCH_CHECK(weight.size(1) == x.size(1), "linear_bf16_rows: x has ", x.size(1), " features, weight expects ",
              weight.size(1));
  const int64_t N = weight.size(0);
  const at::Tensor xc = x.contiguous();
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear_bf16_rows: bias size ", bias->numel(), " != ", N);
    bc = bias->to(at::kFloat).contiguous();
  }
  const int64_t M = xc.size(0), K = xc.size(1);
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
#ifdef PERFXLM_SIMD16
  if (M <= kPairMaxRows) {
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      rows_pairs(xp, M, K, wp + begin * K, yp + begin, N, end - begin, bp ? bp + begin : nullptr);
    });
    return y;
  }
  // Several x rows: 4 weight rows per tile, each loaded once for every x row of a chunk.
  const int64_t NT = 4;
  const int64_t tiles = N / NT;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NT;
      rows_block<4>(xp, M, K, wp + n0 * K, yp, N, n0, bp);
    }
  });
  for (int64_t n0 = tiles * NT; n0 < N; ++n0) rows_block<1>(xp, M, K, wp + n0 * K, yp, N, n0, bp);
#else
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc += xp[m * K + k] * bf16_to_float(wp[n * K + k]);
        yp[m * N + n] = acc + (bp ? bp[n] : 0.f);
      }
  });
#endif
  return y;
}

// widen_panels: panels [p0, p1) of a packed bf16 weight as float32 W^T, out [K, 16 * (p1 - p0)], for a
// float32 GEMM (many rows: MKL's GEMM beats the kernel above there). 64-byte rows in, 64-byte rows out.
void widen_panels(const at::Tensor& packed, int64_t p0, int64_t p1, at::Tensor& out) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous(), "widen_panels: packed must be contiguous bf16 [N/16, K, 16]");
  TORCH_CHECK(0 <= p0 && p0 < p1 && p1 <= packed.size(0), "widen_panels: bad panel range");
  const int64_t K = packed.size(1), n = 16 * (p1 - p0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() >= K * n,
              "widen_panels: out must be a contiguous float32 buffer of at least K * 16 * panels");
  const uint16_t* src = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()) + p0 * K * 16;
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, K, 64, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k)
      for (int64_t p = 0; p < p1 - p0; ++p) {
        const uint16_t* s = src + (p * K + k) * 16;
        float* d = dst + k * n + p * 16;
#ifdef PERFXLM_SIMD16
        simd16::store(d, simd16::load(s));
#else
        for (int c = 0; c < 16; ++c) d[c] = bf16_to_float(s[c]);
#endif
      }
  });
}


// ---------------------------------------------------------------------------------------------
// fused_add_rms_norm / rms_norm, rotary_embedding: the per-layer elementwise work of a decode step,
// one call each instead of eight to ten small torch ops. float32 activations only.
// ---------------------------------------------------------------------------------------------

inline void rms_norm_row(const float* in, const float* w, float eps, int64_t n, float* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += in[i] * in[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (in[i] * inv);
}

// residual += x; x = rms_norm(residual) * weight (both in place).
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && residual.scalar_type() == at::kFloat &&
                  weight.scalar_type() == at::kFloat, "fused_add_rms_norm: float32 tensors only");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes(),
              "fused_add_rms_norm: x and residual must be contiguous and the same shape");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.numel() == n, "fused_add_rms_norm: weight has ", weight.numel(), " elements, rows have ", n);
  const int64_t rows = x.numel() / n;
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const at::Tensor wc = weight.contiguous();  // kept alive: a temporary's pointer would dangle
  const float* wp = wc.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * n;
      float* rr = rp + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) rr[i] += xr[i];
      rms_norm_row(rr, wp, static_cast<float>(eps), n, xr);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 only");
  const at::Tensor xc = x.contiguous();
  const int64_t n = xc.size(-1);
  TORCH_CHECK(weight.numel() == n, "rms_norm: weight has ", weight.numel(), " elements, rows have ", n);
  at::Tensor out = at::empty_like(xc);
  const int64_t rows = xc.numel() / n;
  const float* xp = xc.data_ptr<float>();
  const at::Tensor wc = weight.contiguous();  // kept alive: a temporary's pointer would dangle
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * n, wp, static_cast<float>(eps), n, op + r * n);
  });
  return out;
}

// Rotate-half rotary on x [T, heads, head_dim] (any token/head strides, unit stride within a head),
// in place: cos/sin [T, rotary_dim] hold the angle of channel i and i + rotary_dim/2 twice. With
// rotary_dim < head_dim (partial rotary, Phi-3) the channels past rotary_dim pass through.
void rotary_embedding(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotary_embedding: float32 only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_embedding: x must be [tokens, heads, head_dim], unit stride in a head");
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2);
  const at::Tensor c = cos.reshape({T, -1}).contiguous();
  const at::Tensor s = sin.reshape({T, -1}).contiguous();
  const int64_t R = c.size(1), half = R / 2;
  TORCH_CHECK(s.size(1) == R && R <= D && R % 2 == 0, "rotary_embedding: tables must cover an even rotary_dim <= head_dim");
  float* xp = x.data_ptr<float>();
  const int64_t ts = x.stride(0), hs = x.stride(1);
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = cp + t * R;
      const float* st = sp + t * R;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + t * ts + h * hs;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * ct[i] - b * st[i];
          v[i + half] = b * ct[i + half] + a * st[i + half];
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// decode_layer: one decoder layer for a batch of single-token decodes, as one call. At small batch a
// decode step is dominated by per-op dispatch (about 25 torch ops per layer); this is the module path
// (model/models/llama.py, gemma2.py) composed in C++ from the kernels above, same math and order.
// Llama family (Llama, Mistral, Qwen2/3, Phi-3), pre-norm with a residual stream:
//   [residual +=] x; x = rmsnorm(residual); qkv = x Wqkv (+b); [q, k = rmsnorm per head]; rotary(q, k);
//   cache <- k, v; a = attention(q); x = a Wo (+b); residual += x; x = rmsnorm(residual);
//   x = act(g) * u Wdown
// Without MLP weights (w_gate_up empty: a mixture of experts, which the caller runs) the layer stops
// after the post-attention norm and returns (normed x, residual). `sinks`: gpt-oss's per-head logits.
// Gemma 2 ("sandwich": pre_ff_norm given; norm weights already 1 + w), no residual stream:
//   x += rmsnorm(attn block(rmsnorm(x)), post); x += rmsnorm(mlp(rmsnorm(x, pre_ff)), post_ff)
// ---------------------------------------------------------------------------------------------

// x's columns in `order` (int64 [K]): out[t, j] = x[t, order[j]], float32 [T, K] contiguous. An act-order
// weight's codes column j multiplies input channel order[j] (GPTQ's act-order): its product runs on these
// rows, as QuantizedWeight.ordered_rows gives them to the module path's linear_q.
at::Tensor take_columns(const at::Tensor& x, const at::Tensor& order) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "take_columns: x must be float32 [T, K]");
  const int64_t K = x.size(1);
  TORCH_CHECK(order.scalar_type() == at::kLong && order.dim() == 1 && order.numel() == K && order.is_contiguous(),
              "take_columns: an input order must be contiguous int64 [", K, "]");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({x.size(0), K}, x.options());
  const float* xp = xc.const_data_ptr<float>();
  const int64_t* idx = order.const_data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t rs = xc.stride(0);
  for (int64_t t = 0; t < x.size(0); ++t)
    for (int64_t j = 0; j < K; ++j) op[t * K + j] = xp[t * rs + idx[j]];
  return out;
}

// A quantized weight's parts past its own five: [input order] (see project) -> the rows its product takes.
at::Tensor ordered_inputs(const at::Tensor& x, at::TensorList parts) {
  return parts.size() >= 6 && parts[5].numel() ? take_columns(x, parts[5]) : x;
}

// A quantized weight's code layout from its parts (QuantizedWeight.native_parts): said explicitly by the
// eight-part form [.., order (empty: none), layout, out_features], 0 (plain) otherwise.
struct PartsLayout {
  int64_t layout = 0, out_features = -1;
};
PartsLayout parts_layout(at::TensorList parts) {
  if (parts.size() != 8) return {};
  // read in place: item() costs a dispatch, per projection and step
  return {*parts[6].const_data_ptr<int64_t>(), *parts[7].const_data_ptr<int64_t>()};
}

// y = x W^T + b as perfxlm/ops/linear.py dispatches it, so the fused layer and the module path agree:
// packed panels -> the panel kernel; bf16 rows under float32 x -> the row kernel up to max_rows rows,
// else the bf16 dot-product kernel or torch's bf16 GEMM (bf16_gemm: csrc/bf16_dots.cpp's setting says which) or a float32 GEMM on the widened weight; same dtypes -> torch.
// A quantized weight arrives as [codes, scales, mins (empty: centred codes), levels (empty: none),
// act_int8 (0-dim)], an act-order one with its input order sixth (int64 [K]: x's columns are taken in
// that order first, ordered_inputs), see perfxlm/model/fused_decode.py; a plain one as [w]. A weight in
// another code layout than the plain one has eight: its sixth the order (empty: none), then the layout
// (0-dim int64, perfxlm/quant/layouts.py's native number) and its out_features (0-dim int64).
at::Tensor project(const at::Tensor& x, at::TensorList parts, int64_t n_out, const c10::optional<at::Tensor>& bias,
                   int64_t max_rows, bool bf16_gemm, bool int8_blocks, int64_t quant_max_rows, int64_t quant_block_max_rows,
                   int64_t gemm_rows) {
  if (parts.size() > 8 && parts.size() % 8 == 0) {
    // a split weight (perfxlm/quant/split_rows.py): parts of their own formats, eight native parts each,
    // each part's product on its own, then their columns side by side (the module path runs the same calls)
    std::vector<at::Tensor> ys;
    int64_t at_row = 0;
    for (size_t i = 0; i < parts.size(); i += 8) {
      const int64_t n = *parts[i + 7].const_data_ptr<int64_t>();
      TORCH_CHECK(n > 0, "decode_layer: a split weight's part needs its out_features");
      const c10::optional<at::Tensor> b =
          bias.has_value() && bias->defined() ? c10::optional<at::Tensor>(bias->narrow(0, at_row, n)) : c10::nullopt;
      ys.push_back(project(x, parts.slice(i, 8), n, b, max_rows, bf16_gemm, int8_blocks, quant_max_rows,
                           quant_block_max_rows, gemm_rows));
      at_row += n;
    }
    TORCH_CHECK(n_out < 0 || at_row == n_out, "decode_layer: a split weight's parts have ", at_row, " rows, not ", n_out);
    return at::cat(ys, 1);
  }
  if (parts.size() == 8) {
    const PartsLayout pl = parts_layout(parts);
    const c10::optional<at::Tensor> levels = parts[3].numel() ? c10::optional<at::Tensor>(parts[3]) : c10::nullopt;
    const c10::optional<at::Tensor> mins = parts[2].numel() ? c10::optional<at::Tensor>(parts[2]) : c10::nullopt;
    return perfxlm_quant::linear_q(ordered_inputs(x, parts), parts[0], parts[1], mins, levels, bias,
                                   *parts[4].const_data_ptr<bool>(), quant_max_rows >= 0 ? quant_max_rows : max_rows,
                                   bf16_gemm, int8_blocks, quant_block_max_rows, gemm_rows, pl.layout, pl.out_features);
  }
  if (parts.size() == 6)
    return project(ordered_inputs(x, parts), parts.slice(0, 5), n_out, bias, max_rows, bf16_gemm, int8_blocks,
                   quant_max_rows, quant_block_max_rows, gemm_rows);
  if (parts.size() == 5) {
    const c10::optional<at::Tensor> levels = parts[3].numel() ? c10::optional<at::Tensor>(parts[3]) : c10::nullopt;
    const c10::optional<at::Tensor> mins = parts[2].numel() ? c10::optional<at::Tensor>(parts[2]) : c10::nullopt;
    return perfxlm_quant::linear_q(x, parts[0], parts[1], mins, levels, bias, *parts[4].const_data_ptr<bool>(),
                                   quant_max_rows >= 0 ? quant_max_rows : max_rows, bf16_gemm, int8_blocks,
                                   quant_block_max_rows, gemm_rows);
  }
  TORCH_CHECK(parts.size() == 1, "decode_layer: a weight is [w] or [codes, scales, mins, levels, act_int8[, order[, "
              "layout, out_features]]]");
  const at::Tensor& w = parts[0];
  if (w.dim() == 3) return linear_bf16_packed(x, w, n_out, bias);
  const bool has_bias = bias.has_value() && bias->defined();
  if (w.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kFloat) {
    if (x.size(0) <= max_rows && w.is_contiguous()) return linear_bf16_rows(x, w, bias);
    if (bf16_gemm && perfxlm_bf16dots::dots_now() && w.is_contiguous()) return perfxlm_bf16dots::linear_bf16_dots(x, w, bias);
    at::Tensor y = bf16_gemm ? at::linear(x.to(at::kBFloat16), w).to(at::kFloat) : at::linear(x, w.to(at::kFloat));
    if (has_bias) y.add_(bias->to(at::kFloat));
    return y;
  }
  return at::linear(x, w, has_bias ? *bias : at::Tensor());
}

// project() then the step's adapters on projection `index` of `lora` (which read x as it is: an act-order
// weight's gathered rows are its base product's alone). A quantized weight at few rows runs
// with the adapters in one parallel region (perfxlm_lora::project_add: each thread its range of outputs,
// base product then adapters), so a decode step's adapters add no fork and join per projection. Within
// both GEMV row limits, which kernel linear_q picks (a GEMV, or the int8 GEMM from gemm_rows) does not
// depend on how many outputs a call covers, and each of them sums an output the same whatever outputs
// beside it (GEMV row tiles, the GEMM's 32-column tasks; its row slices start at 128 rows), so the
// split changes no bit. Anything else: the product, then the adapters.
at::Tensor project_lora_in(const at::Tensor& x, at::TensorList weight, int64_t n_out, const c10::optional<at::Tensor>& bias,
                           int64_t max_rows, bool bf16_gemm, bool int8_blocks, int64_t quant_max_rows,
                           int64_t quant_block_max_rows, int64_t gemm_rows, at::TensorList lora, int64_t index,
                           bool one_region) {
  if (weight.size() > 8) {  // a split weight: its parts' products (project), then the adapters
    perfxlm_lora::prefetch(lora, index);
    at::Tensor y = project(x, weight, n_out, bias, max_rows, bf16_gemm, int8_blocks, quant_max_rows,
                           quant_block_max_rows, gemm_rows);
    perfxlm_lora::add(y, x, lora, index);
    return y;
  }
  const at::Tensor xw = ordered_inputs(x, weight);  // the base product's rows
  const at::TensorList parts = weight.size() >= 6 ? weight.slice(0, 5) : weight;
  const PartsLayout pl = parts_layout(weight);
  const int64_t M = x.size(0);
  // one thread: nothing to split
  const bool split = parts.size() == 5 && M < 128 && M <= (quant_max_rows >= 0 ? quant_max_rows : max_rows) &&
                     (quant_block_max_rows < 0 || M <= quant_block_max_rows) && at::get_num_threads() >= 2 &&
                     one_region;
  if (split && !lora.empty()) {
    // the GEMV linear_q would run, prepared once here (W described, x's int8 blocks quantized) and run by
    // each thread over its range of outputs straight into y: no tensor call on the region's threads
    const c10::optional<at::Tensor> levels = parts[3].numel() ? c10::optional<at::Tensor>(parts[3]) : c10::nullopt;
    const c10::optional<at::Tensor> mins = parts[2].numel() ? c10::optional<at::Tensor>(parts[2]) : c10::nullopt;
    const perfxlm_quant::RangeProduct ranges = perfxlm_quant::linear_q_ranges(
        xw, parts[0], parts[1], mins, levels, bias, *parts[4].const_data_ptr<bool>(),
        quant_max_rows >= 0 ? quant_max_rows : max_rows, int8_blocks, quant_block_max_rows, gemm_rows, pl.layout,
        pl.out_features);
    if (ranges) {
      at::Tensor y = at::empty({M, n_out}, x.options());
      float* yp = y.data_ptr<float>();
      if (perfxlm_lora::project_add(y, x, lora, index, [&](int64_t n0, int64_t n1) { ranges(yp, n0, n1); })) return y;
    }
  }
  perfxlm_lora::prefetch(lora, index);  // the adapters' bytes arrive while the base product runs
  // the weight's layout parts kept (its order already taken: an empty one in its place)
  std::vector<at::Tensor> held;
  if (weight.size() == 8) {
    held.assign(weight.begin(), weight.end());
    held[5] = at::empty({0}, held[5].options());
  }
  at::Tensor y = project(xw, weight.size() == 8 ? at::TensorList(held) : parts, n_out, bias, max_rows, bf16_gemm, int8_blocks, quant_max_rows, quant_block_max_rows,
                         gemm_rows);
  perfxlm_lora::add(y, x, lora, index);
  return y;
}

// The fused layer's projection: the one-region path where PERFXLM_LORA_WITH_BASE=1 (opt-in).
at::Tensor project_lora(const at::Tensor& x, at::TensorList parts, int64_t n_out, const c10::optional<at::Tensor>& bias,
                        int64_t max_rows, bool bf16_gemm, bool int8_blocks, int64_t quant_max_rows,
                        int64_t quant_block_max_rows, int64_t gemm_rows, at::TensorList lora, int64_t index) {
  return project_lora_in(x, parts, n_out, bias, max_rows, bf16_gemm, int8_blocks, quant_max_rows, quant_block_max_rows,
                         gemm_rows, lora, index, perfxlm_lora::with_base());
}

// The test op: always the one-region path where it applies, so its tests check it whatever the default.
at::Tensor project_lora_one_region(const at::Tensor& x, at::TensorList parts, int64_t n_out,
                                   const c10::optional<at::Tensor>& bias, int64_t max_rows, bool bf16_gemm,
                                   bool int8_blocks, int64_t quant_max_rows, int64_t quant_block_max_rows,
                                   int64_t gemm_rows, at::TensorList lora, int64_t index) {
  return project_lora_in(x, parts, n_out, bias, max_rows, bf16_gemm, int8_blocks, quant_max_rows, quant_block_max_rows,
                         gemm_rows, lora, index, true);
}

// RMSNorm over each head of rows [T, heads * D] (row stride `stride`) in place (Qwen3's q/k norms).
void head_rms_norm_(float* base, int64_t stride, int64_t T, int64_t heads, int64_t D, const at::Tensor& weight,
                    double eps) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == D, "head norm weight must be float32 [head_dim]");
  const at::Tensor wc = weight.contiguous();
  const float* wp = wc.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      float* row = base + t * stride + h * D;
      rms_norm_row(row, wp, static_cast<float>(eps), D, row);
    }
}

at::Tensor mlp_activation(const at::Tensor& gate_up, int64_t inter, int64_t activation) {
  // torch's own activations (their vectorised exp/tanh), so this path rounds as the module path does.
  const at::Tensor gate = gate_up.narrow(1, 0, inter), up = gate_up.narrow(1, inter, inter);
  at::Tensor act;
  switch (activation) {
    case 0: act = at::silu(gate); break;
    case 1: act = at::gelu(gate, "tanh"); break;
    case 2: act = at::gelu(gate); break;
    default: TORCH_CHECK(false, "decode_layer: unknown activation code ", activation);
  }
  return act.mul_(up);
}

// The layer's two halves, which tensor parallelism calls apart: each row-parallel projection's output (o,
// down) is a partial sum that the ranks all-reduce between the calls. decode_layer runs them back to back,
// so one process and one rank per half compute the same ops in the same order.
// decode_attention: [residual +=] x, input norm, q|k|v, head norms, rotary, cache writes, attention, o.
// -> {o (before any residual add), stream}: the residual (pre-norm) or the layer input (sandwich).
std::vector<at::Tensor> decode_attention(
    at::Tensor x, at::Tensor residual, bool first, bool sandwich, const at::Tensor& in_norm, double eps,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double head_eps,
    at::TensorList w_qkv, const c10::optional<at::Tensor>& b_qkv, at::TensorList w_o,
    const c10::optional<at::Tensor>& b_o, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor key_cache, at::Tensor value_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
    int64_t sliding_window, double soft_cap, int64_t max_rows, bool bf16_gemm, at::TensorList lora,
    const c10::optional<at::Tensor>& key_scale, const c10::optional<at::Tensor>& value_scale, bool int8_blocks,
    int64_t quant_max_rows, int64_t quant_block_max_rows, const c10::optional<at::Tensor>& sinks, int64_t gemm_rows,
    bool bf16_attention) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x must be contiguous float32 [T, hidden]");
  const int64_t T = x.size(0), hidden = x.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor h;
  if (sandwich) {
    h = rms_norm(x, in_norm, eps);
  } else if (first) {
    residual = x;
    h = rms_norm(x, in_norm, eps);
  } else {
    fused_add_rms_norm(x, residual, in_norm, eps);
    h = x;
  }
  at::Tensor qkv = project_lora(h, w_qkv, q_size + 2 * kv_size, b_qkv, max_rows, bf16_gemm, int8_blocks, quant_max_rows, quant_block_max_rows, gemm_rows, lora, 0);  // [T, q | k | v]
  const int64_t row = qkv.stride(0);
  float* qkv_p = qkv.data_ptr<float>();
  if (q_norm.has_value() && q_norm->defined()) {
    TORCH_CHECK(k_norm.has_value() && k_norm->defined(), "decode_layer: q_norm without k_norm");
    head_rms_norm_(qkv_p, row, T, num_heads, head_dim, *q_norm, head_eps);
    head_rms_norm_(qkv_p + q_size, row, T, num_kv_heads, head_dim, *k_norm, head_eps);
  }
  at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({T, num_heads + num_kv_heads, head_dim});
  rotary_embedding(qk, cos, sin);
  const at::Tensor slots_c = slot_mapping.contiguous();
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  perfxlm_attn::write_slots(qkv_p + q_size, row, T, kv_size, slots, key_cache, key_scale);
  perfxlm_attn::write_slots(qkv_p + q_size + kv_size, row, T, kv_size, slots, value_cache, value_scale);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
  at::Tensor attn = perfxlm_attn::paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale,
                                                         sliding_window, soft_cap, key_scale, value_scale, sinks,
                                                         bf16_attention);
  const at::Tensor attn_rows = attn.view({T, q_size});
  at::Tensor o = project_lora(attn_rows, w_o, hidden, b_o, max_rows, bf16_gemm, int8_blocks, quant_max_rows, quant_block_max_rows, gemm_rows, lora, 1);
  return {o, sandwich ? x : residual};
}

// decode_mlp: from the attention output o (whole: summed over ranks) and the stream, the post-attention
// norm (pre-norm: residual += o; sandwich: x += norm(o), then the pre-feedforward norm) and the MLP.
// -> {down's output (before the post-feedforward norm of a sandwich layer), stream}; without MLP weights
// (a mixture of experts, which the caller runs) {the normed input of the MLP, stream}.
std::vector<at::Tensor> decode_mlp(
    at::Tensor o, at::Tensor stream, bool sandwich, const at::Tensor& post_norm,
    const c10::optional<at::Tensor>& pre_ff_norm, double eps, at::TensorList w_gate_up,
    const c10::optional<at::Tensor>& b_gate_up, at::TensorList w_down, const c10::optional<at::Tensor>& b_down,
    int64_t intermediate, int64_t activation, int64_t max_rows, bool bf16_gemm, at::TensorList lora,
    bool int8_blocks, int64_t quant_max_rows, int64_t quant_block_max_rows, int64_t gemm_rows) {
  const int64_t hidden = o.size(1);
  at::Tensor h;
  if (sandwich) {
    stream = stream + rms_norm(o, post_norm, eps);
    h = rms_norm(stream, *pre_ff_norm, eps);
  } else {
    fused_add_rms_norm(o, stream, post_norm, eps);
    h = o;
  }
  if (w_gate_up.empty()) {  // the caller runs the layer's own MLP (a mixture of experts) on the normed h
    TORCH_CHECK(!sandwich, "decode_layer: a layer without its MLP must be pre-norm (no sandwich norms)");
    return {h, stream};
  }
  at::Tensor gate_up = project_lora(h, w_gate_up, 2 * intermediate, b_gate_up, max_rows, bf16_gemm, int8_blocks, quant_max_rows, quant_block_max_rows, gemm_rows, lora, 2);
  const at::Tensor act = mlp_activation(gate_up, intermediate, activation);
  at::Tensor out = project_lora(act, w_down, hidden, b_down, max_rows, bf16_gemm, int8_blocks, quant_max_rows, quant_block_max_rows, gemm_rows, lora, 3);
  return {out, stream};
}

}  // namespace

// The whole layer: decode_attention then decode_mlp (fused_project.h lends it to csrc/decode_stack.cpp).
namespace perfxlm_fused {

std::vector<at::Tensor> decode_layer(
    at::Tensor x, at::Tensor residual, bool first, const at::Tensor& in_norm, const at::Tensor& post_norm,
    const c10::optional<at::Tensor>& pre_ff_norm, const c10::optional<at::Tensor>& post_ff_norm, double eps,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double head_eps,
    at::TensorList w_qkv, const c10::optional<at::Tensor>& b_qkv, at::TensorList w_o,
    const c10::optional<at::Tensor>& b_o, at::TensorList w_gate_up, const c10::optional<at::Tensor>& b_gate_up,
    at::TensorList w_down, const c10::optional<at::Tensor>& b_down, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t intermediate, int64_t activation, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, double scale, int64_t sliding_window, double soft_cap, int64_t max_rows,
    bool bf16_gemm, at::TensorList lora, const c10::optional<at::Tensor>& key_scale, const c10::optional<at::Tensor>& value_scale,
    bool int8_blocks, int64_t quant_max_rows, int64_t quant_block_max_rows,
    const c10::optional<at::Tensor>& sinks, int64_t gemm_rows, bool bf16_attention) {
  const bool sandwich = pre_ff_norm.has_value() && pre_ff_norm->defined();
  const std::vector<at::Tensor> a = decode_attention(
      x, residual, first, sandwich, in_norm, eps, q_norm, k_norm, head_eps, w_qkv, b_qkv, w_o, b_o, num_heads,
      num_kv_heads, head_dim, cos, sin, key_cache, value_cache, slot_mapping, block_tables, seq_lens, scale,
      sliding_window, soft_cap, max_rows, bf16_gemm, lora, key_scale, value_scale, int8_blocks, quant_max_rows,
      quant_block_max_rows, sinks, gemm_rows, bf16_attention);
  std::vector<at::Tensor> m = decode_mlp(a[0], a[1], sandwich, post_norm, pre_ff_norm, eps, w_gate_up, b_gate_up,
                                         w_down, b_down, intermediate, activation, max_rows, bf16_gemm, lora,
                                         int8_blocks, quant_max_rows, quant_block_max_rows, gemm_rows);
  if (sandwich) {
    const at::Tensor out = m[1] + rms_norm(m[0], *post_ff_norm, eps);
    return {out, out};
  }
  return m;
}

// What csrc/moe_kernels.cpp composes its experts from: the fused layer's product and gated activation.
at::Tensor project(const at::Tensor& x, at::TensorList parts, int64_t n_out, const c10::optional<at::Tensor>& bias,
                   int64_t max_rows, bool bf16_gemm, bool int8_blocks, int64_t quant_max_rows,
                   int64_t quant_block_max_rows, int64_t gemm_rows) {
  return ::project(x, parts, n_out, bias, max_rows, bf16_gemm, int8_blocks, quant_max_rows, quant_block_max_rows,
                   gemm_rows);
}

at::Tensor mlp_activation(const at::Tensor& gate_up, int64_t inter, int64_t activation) {
  return ::mlp_activation(gate_up, inter, activation);
}

at::Tensor take_columns(const at::Tensor& x, const at::Tensor& order) { return ::take_columns(x, order); }

}  // namespace perfxlm_fused


TORCH_LIBRARY(perfxlm, m) {
  m.def("linear_bf16_packed(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
  m.def("linear_bf16_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("widen_panels(Tensor packed, int p0, int p1, Tensor(a!) out) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_embedding(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def(
      "decode_layer(Tensor(a!) x, Tensor(b!) residual, bool first, Tensor in_norm, Tensor post_norm, "
      "Tensor? pre_ff_norm, Tensor? post_ff_norm, float eps, Tensor? q_norm, Tensor? k_norm, float head_eps, "
      "Tensor[] w_qkv, Tensor? b_qkv, Tensor[] w_o, Tensor? b_o, Tensor[] w_gate_up, Tensor? b_gate_up, Tensor[] w_down, "
      "Tensor? b_down, int num_heads, int num_kv_heads, int head_dim, int intermediate, int activation, "
      "Tensor cos, Tensor sin, Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, float scale, int sliding_window, float soft_cap, int max_rows, "
      "bool bf16_gemm, Tensor[] lora, Tensor(e!)? key_scale=None, Tensor(f!)? value_scale=None, bool int8_blocks=False, int quant_max_rows=-1, int quant_block_max_rows=-1, Tensor? sinks=None, int gemm_rows=-1, bool bf16_attention=False) -> Tensor[]");
  m.def(
      "decode_attention(Tensor(a!) x, Tensor(b!) residual, bool first, bool sandwich, Tensor in_norm, float eps, "
      "Tensor? q_norm, Tensor? k_norm, float head_eps, Tensor[] w_qkv, Tensor? b_qkv, Tensor[] w_o, Tensor? b_o, "
      "int num_heads, int num_kv_heads, int head_dim, Tensor cos, Tensor sin, Tensor(c!) key_cache, "
      "Tensor(d!) value_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, float scale, "
      "int sliding_window, float soft_cap, int max_rows, bool bf16_gemm, Tensor[] lora, Tensor(e!)? key_scale, "
      "Tensor(f!)? value_scale, bool int8_blocks, int quant_max_rows, int quant_block_max_rows, Tensor? sinks, "
      "int gemm_rows=-1, bool bf16_attention=False) -> Tensor[]");
  m.def(
      "decode_mlp(Tensor(a!) o, Tensor(b!) stream, bool sandwich, Tensor post_norm, Tensor? pre_ff_norm, float eps, "
      "Tensor[] w_gate_up, Tensor? b_gate_up, Tensor[] w_down, Tensor? b_down, int intermediate, int activation, "
      "int max_rows, bool bf16_gemm, Tensor[] lora, bool int8_blocks, int quant_max_rows, "
      "int quant_block_max_rows, int gemm_rows=-1) -> Tensor[]");
  // a projection and its step's adapters as the fused layer runs them, for tests against linear_q + lora_add
  m.def(
      "lora_project(Tensor x, Tensor[] parts, int n_out, Tensor? bias, int max_rows, bool bf16_gemm, "
      "bool int8_blocks, int quant_max_rows, int quant_block_max_rows, int gemm_rows, Tensor[] lora, int index) -> Tensor");
}

TORCH_LIBRARY_IMPL(perfxlm, CPU, m) {
  m.impl("linear_bf16_packed", &linear_bf16_packed);
  m.impl("linear_bf16_rows", &linear_bf16_rows);
  m.impl("widen_panels", &widen_panels);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("decode_layer", &perfxlm_fused::decode_layer);
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_mlp", &decode_mlp);
  m.impl("lora_project", &project_lora_one_region);
}
