// Products over block-quantized FP8 weights (DeepSeek-V3's checkpoints, perfxlm/quant/formats/fp8_blocks.py;
// compressed-tensors' FP8 too): y = x W^T + b with W[n, k] = e4m3(codes[n, k]) x scales[n, k / G], the
// weight read as its e4m3 bytes (one byte per weight) instead of a float matrix dequantized per call.
//
// The native quantized products (quant_linear.cpp) take affine codes or a 16-level table; e4m3 bytes are a
// 256-level table, which no vector permute holds, and no int8 form is exact: e4m3 spans 2^-9..448 within
// one 128-column group, so one integer scale per group would round its small weights away. The bytes are
// instead decoded in registers by their bit fields (sign, 4 exponent, 3 mantissa bits: the exponent
// rebiased into float32's, the subnormals made exact by one subtraction), times the group's scale: the
// same float32 product, rounded once, as the plain-torch definition's `levels[u] * scale`, so the weights
// are DeepSeek's own values bit for bit and only the summation order differs from the reference.
//
// A task takes a panel of kRows output rows and walks K in slices of kSlice columns: the slice's weights
// are decoded once into an L1 buffer, then every activation row runs over it in register tiles of
// kRows weight rows x kCols activation rows, so decoding costs once per weight however many rows the call
// multiplies (one decode row or a prefill chunk). The decode is written with GCC vector types, which the
// compiler lowers to each tier's registers (zmm, ymm, or the scalar tier's xmm) with the same per-lane
// integer operations; the tile loop uses simd16.h's fused multiply-adds, plain loops on the scalar tier.
//
// The plain-torch reference is perfxlm/quant/reference.py's weight_only_linear (the 256-level table).

#include "simd16.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace perfxlm_fp8 {
namespace {

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x16 __attribute__((vector_size(64)));

constexpr int64_t kLanes = 16;
constexpr int64_t kSlice = 256;  // columns decoded at a time: kRows x 1 KB of floats, in L1

#ifdef PERFXLM_SIMD16
constexpr int kRows = simd16::kAvx512 ? 4 : 2;  // weight rows per register tile
constexpr int kCols = simd16::kAvx512 ? 4 : 2;  // activation rows per register tile
#else
constexpr int kRows = 4, kCols = 1;
#endif

// 16 e4m3fn bytes -> 16 floats times `scale`, exact: a normal byte (exponent e >= 1) is float32 bits
// sign | (e + 120) << 23 | m << 20; a subnormal (e == 0) is m x 2^-9 = 2^-6 (1 + m / 8) - 2^-6, the
// first term a normal float32 made the same way, the difference exact. NaN bytes (0x7f, 0xff) decode as
// 480 / -480; no weight holds them.
inline void decode16(const uint8_t* p, float scale, float* out) {
  u8x16 b;
  std::memcpy(&b, p, sizeof(b));
  const i32x16 u = __builtin_convertvector(b, i32x16);
  const i32x16 mag = (u & 0x7f) << 20;
  const i32x16 sign = (u & 0x80) << 24;
  const f32x16 normal = (f32x16)(mag + (120 << 23));
  const f32x16 sub = (f32x16)(mag + (121 << 23)) - 0x1p-6f;
  const i32x16 is_sub = mag < (1 << 23);  // all ones where the exponent bits are 0
  const i32x16 bits = (((i32x16)sub & is_sub) | ((i32x16)normal & ~is_sub)) | sign;
  const f32x16 v = (f32x16)bits * scale;
  std::memcpy(out, &v, sizeof(v));
}

// Columns [k0, k0 + len) of weight rows [n0, n0 + rows) decoded and scaled into buf [rows][kSlice].
inline void decode_slice(const uint8_t* codes, const float* scales, int64_t K, int64_t groups, int64_t G,
                         int64_t n0, int rows, int64_t k0, int64_t len, float* buf) {
  for (int i = 0; i < rows; ++i) {
    const uint8_t* row = codes + (n0 + i) * K;
    const float* rs = scales + (n0 + i) * groups;
    for (int64_t c = 0; c < len; c += kLanes) decode16(row + k0 + c, rs[(k0 + c) / G], buf + i * kSlice + c);
  }
}

#ifdef PERFXLM_SIMD16
// acc [cols][kRows][16] += buf [rows] . x rows [m0, m0 + cols) over `len` columns from k0.
template <int R, int C>
inline void tile(const float* buf, const float* x, int64_t K, int64_t m0, int64_t k0, int64_t len, float* acc) {
  namespace vec = simd16;
  vec::V a[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) a[i][j] = vec::load(acc + (j * kRows + i) * kLanes);
  for (int64_t c = 0; c < len; c += kLanes) {
    vec::V xv[C];
    for (int j = 0; j < C; ++j) xv[j] = vec::load(x + (m0 + j) * K + k0 + c);
    for (int i = 0; i < R; ++i) {
      const vec::V w = vec::load(buf + i * kSlice + c);
      for (int j = 0; j < C; ++j) a[i][j] = vec::fmadd(w, xv[j], a[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) vec::store(acc + (j * kRows + i) * kLanes, a[i][j]);
}

template <int R>
inline void tiles(const float* buf, const float* x, int64_t K, int64_t M, int64_t k0, int64_t len, float* acc) {
  int64_t m = 0;
  for (; m + kCols <= M; m += kCols) tile<R, kCols>(buf, x, K, m, k0, len, acc + m * kRows * kLanes);
  for (; m < M; ++m) tile<R, 1>(buf, x, K, m, k0, len, acc + m * kRows * kLanes);
}
#endif

// Output rows [n0, n0 + rows) of y for every activation row; acc is the task's [M][kRows][16] scratch.
void panel(const float* x, const uint8_t* codes, const float* scales, const float* bias, float* y, int64_t M,
           int64_t N, int64_t K, int64_t G, int64_t n0, int rows, float* buf, float* acc) {
  const int64_t groups = K / G;
  std::fill(acc, acc + M * kRows * kLanes, 0.f);
  for (int64_t k0 = 0; k0 < K; k0 += kSlice) {
    const int64_t len = std::min(kSlice, K - k0);
    decode_slice(codes, scales, K, groups, G, n0, rows, k0, len, buf);
#ifdef PERFXLM_SIMD16
    if (rows == kRows) {
      tiles<kRows>(buf, x, K, M, k0, len, acc);
    } else {
      for (int i = 0; i < rows; ++i) tiles<1>(buf + i * kSlice, x, K, M, k0, len, acc + i * kLanes);
    }
#else
    for (int64_t m = 0; m < M; ++m)
      for (int i = 0; i < rows; ++i) {
        float* a = acc + (m * kRows + i) * kLanes;
        const float* w = buf + i * kSlice;
        const float* xr = x + m * K + k0;
        for (int64_t c = 0; c < len; c += kLanes)
          for (int64_t l = 0; l < kLanes; ++l) a[l] += w[c + l] * xr[c + l];
      }
#endif
  }
  for (int64_t m = 0; m < M; ++m)
    for (int i = 0; i < rows; ++i) {
      const float* a = acc + (m * kRows + i) * kLanes;
      float s = 0.f;
      for (int64_t l = 0; l < kLanes; ++l) s += a[l];
      y[m * N + n0 + i] = bias != nullptr ? s + bias[n0 + i] : s;
    }
}

}  // namespace

// x [M, K] float32, codes [N, K] uint8 (e4m3fn bytes), scales [N, K / group] float32, bias [N] float32 or
// None -> [M, N] float32. group a multiple of 16 (every 16 columns share one scale).
at::Tensor linear_fp8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "linear_fp8: x must be a contiguous float32 [rows, in_features] matrix, got ", x.sizes(), " ",
              x.scalar_type());
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "linear_fp8: codes must be contiguous uint8 [out_features, in_features] (e4m3 bytes), got ",
              codes.sizes(), " ", codes.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.size(1) == K, "linear_fp8: codes have ", codes.size(1), " columns, x has ", K);
  TORCH_CHECK(group >= kLanes && group % kLanes == 0 && K % group == 0,
              "linear_fp8: group must be a multiple of 16 dividing in_features (", K, "), got ", group);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == K / group,
              "linear_fp8: scales must be contiguous float32 [", N, ", ", K / group, "], got ", scales.sizes(), " ",
              scales.scalar_type());
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "linear_fp8: bias must be contiguous float32 [", N, "]");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t panels = (N + kRows - 1) / kRows;
  // at least ~64 KB of weight bytes per task, so small products stay on the calling thread
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (kRows * K));
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    std::vector<float> buf(kRows * kSlice), acc(M * kRows * kLanes);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kRows;
      const int rows = static_cast<int>(std::min<int64_t>(kRows, N - n0));
      panel(xp, cp, sp, b, yp, M, N, K, group, n0, rows, buf.data(), acc.data());
    }
  });
  return y;
}

}  // namespace perfxlm_fp8

TORCH_LIBRARY_FRAGMENT(perfxlm, m) {
  m.def("linear_fp8(Tensor x, Tensor codes, Tensor scales, int group, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(perfxlm, CPU, m) { m.impl("linear_fp8", &perfxlm_fp8::linear_fp8); }
