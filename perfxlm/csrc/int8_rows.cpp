// The passes around W8A8's integer GEMM (perfxlm/ops/int8_gemm.py), one pass each instead of torch's
// four to six: quantizing activation rows to int8 with one scale per row, and the epilogue that turns the
// GEMM's int32 sums into float rows (x column scale, x row scale, + bias, + a residual).
//
// An encoder's batch multiplies thousands of rows per weight; with the GEMM itself on int8 dot products,
// the elementwise torch passes around it (max, min, divide, round, cast; int32 -> float, two scalings, a
// bias add) cost as much as the GEMM. Each torch pass reads and writes the whole [rows, N] tensor; here a
// row is read once and written once while it sits in L1.
//
// Bits: the same float32 operations in the same order as the torch definition (`quantize_rows`,
// `int8_gemm_linear`), each rounded once (built with -ffp-contract=off: no fused multiply-add), and
// rounding to the nearest even as torch.round: the results are equal to the bit. Written once over
// 16-lane vector types, which the compiler lowers to whatever tier the build targets.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace perfxlm_int8_rows {
namespace {

constexpr int64_t kLanes = 16;
// Rows per parallel task: at least this many values, so a small batch stays on the calling thread.
constexpr int64_t kGrainValues = 1 << 15;

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kGrainValues / std::max<int64_t>(1, width)); }

// 16 lanes as GCC / Clang vector types: the compiler lowers each elementwise operation to the build's
// widest registers (one zmm, two ymm, four xmm on the scalar tier), the same per-lane operation whatever
// the width, so every tier rounds alike. Loads and stores go through memcpy (any alignment, no aliasing).
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

// (an out-parameter, not a returned vector: that would change the calling convention between tiers)
template <typename V, typename T>
inline void load16(V& v, const T* p) { std::memcpy(&v, p, sizeof(v)); }

// max |x| over a row as max(max x, -min x): the definition's two reductions (no |x| written).
// `a > b ? a : b` is what the CPU's max instruction computes, so it needs no fast-math.
float row_absmax(const float* x, int64_t k) {
  const float first = k > 0 ? x[0] : 0.0f;
  f32x16 hi = first - f32x16{}, lo = hi;  // every lane = first
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    f32x16 v;
    load16(v, x + i);
    hi = v > hi ? v : hi;
    lo = v < lo ? v : lo;
  }
  float h = first, l = first;
  for (int64_t j = 0; j < kLanes; ++j) {
    h = hi[j] > h ? hi[j] : h;
    l = lo[j] < l ? lo[j] : l;
  }
  for (; i < k; ++i) {
    h = x[i] > h ? x[i] : h;
    l = x[i] < l ? x[i] : l;
  }
  const float neg = -l;
  return h > neg ? h : neg;
}

// codes of one row: round_half_even(x / safe) (nearbyint under the default rounding mode: ties to even).
// A function of its own with value bounds and restrict pointers, so the loop vectorizes.
void quantize_row(const float* __restrict x, int8_t* __restrict q, int64_t k, float safe) {
  for (int64_t i = 0; i < k; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] / safe));
}

// One row of the epilogue, over the int32 sums it overwrites: 16 results made in registers from 16 sums,
// then stored over them.
template <bool kBias, bool kResidual>
void epilogue_row(int32_t* acc, const float* cs, float sx, const float* bias, const float* res, int64_t n) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    i32x16 sums;
    f32x16 col, add;
    load16(sums, acc + j);
    load16(col, cs + j);
    f32x16 y = __builtin_convertvector(sums, f32x16) * col;
    y = y * sx;
    if (kBias) {
      load16(add, bias + j);
      y = y + add;
    }
    if (kResidual) {
      load16(add, res + j);
      y = y + add;
    }
    std::memcpy(acc + j, &y, sizeof(y));
  }
  for (; j < n; ++j) {
    float y = static_cast<float>(acc[j]) * cs[j] * sx;
    if (kBias) y = y + bias[j];
    if (kResidual) y = y + res[j];
    std::memcpy(acc + j, &y, sizeof(y));
  }
}

// exp(x) for x <= 0 on 16 lanes (GELU's erf takes exp(-z^2)): 2^n x exp(r), n = round(x / ln 2), r = x - n ln 2
// in two parts (Cody-Waite), exp(r) by Cephes' degree-6 polynomial on |r| <= ln 2 / 2 (relative error
// about 1 ulp); x below -87.3 (exp under float's smallest normal) gives 0.
inline f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 lowest = f32x16{} - 87.3f;
  x = x < lowest ? lowest : x;
  f32x16 n = x * 1.44269504088896341f;
  // n to a nearest integer: n - 1/2 <= 0 truncates toward zero, up, to ceil(n - 1/2)
  n = __builtin_convertvector(__builtin_convertvector(n - 0.5f, i32x16), f32x16);
  f32x16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  f32x16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// GELU(x) = x / 2 (1 + erf(x / sqrt 2)), erf by Abramowitz and Stegun 7.1.26 (1 - (a1 t + ... + a5 t^5)
// exp(-z^2), t = 1 / (1 + p z); absolute error under 1.5e-7): within 1e-7 + 1.2e-7 |x| of the exact GELU
// (torch's F.gelu is not bit-equal to it either, and measured further from exact).
inline f32x16 gelu16(f32x16 x) {
  const f32x16 z0 = x * 0.70710678118654752f;
  const f32x16 z = z0 < 0.0f ? -z0 : z0;
  const f32x16 t = 1.0f / (z * 0.3275911f + 1.0f);
  f32x16 r = t * 1.061405429f + -1.453152027f;
  r = r * t + 1.421413741f;
  r = r * t + -0.284496736f;
  r = r * t + 0.254829592f;
  f32x16 erf_abs = 1.0f - r * t * exp_nonpositive(-(z * z));
  f32x16 erf = z0 < 0.0f ? -erf_abs : erf_abs;
  return x * 0.5f * (1.0f + erf);
}

// The epilogue with GELU after the bias (an encoder's up projection): its activation computed while the
// row is in registers, instead of torch's pass over the whole [rows, N] output.
void epilogue_gelu_row(int32_t* acc, const float* cs, float sx, const float* bias, int64_t n) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    i32x16 sums;
    f32x16 col, add{};
    load16(sums, acc + j);
    load16(col, cs + j);
    f32x16 y = __builtin_convertvector(sums, f32x16) * col;
    y = y * sx;
    if (bias != nullptr) {
      load16(add, bias + j);
      y = y + add;
    }
    y = gelu16(y);
    std::memcpy(acc + j, &y, sizeof(y));
  }
  if (j < n) {  // the tail through one padded vector
    float tail[kLanes] = {};
    for (int64_t i = j; i < n; ++i) {
      float y = static_cast<float>(acc[i]) * cs[i] * sx;
      tail[i - j] = bias != nullptr ? y + bias[i] : y;
    }
    f32x16 y;
    load16(y, tail);
    y = gelu16(y);
    std::memcpy(acc + j, &y, sizeof(float) * (n - j));
  }
}

void check_rows(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.scalar_type() == dtype, "int8 rows: ", name,
              " must be a contiguous 2-D ", c10::toString(dtype), " tensor, got ", t.sizes(), " ",
              t.scalar_type());
}

void check_vector(const c10::optional<at::Tensor>& t, int64_t n, const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->dim() == 1 && t->numel() == n && t->is_contiguous() && t->scalar_type() == at::kFloat,
              "int8 rows: ", name, " must be a contiguous float32 vector of ", n, " values, got ", t->sizes());
}

}  // namespace

// x float32 [M, K] -> (codes int8 [M, K], scales float32 [M]): scale = max|x| / 127 (1 where a row is
// all zeros), code = round_half_even(x / scale). |x| / (max|x| / 127) cannot round past 127: no clamp.
std::tuple<at::Tensor, at::Tensor> int8_quantize_rows(const at::Tensor& x) {
  check_rows(x, at::kFloat, "x");
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor codes = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({m}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = codes.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  at::parallel_for(0, m, grain_rows(k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * k;
      const float scale = row_absmax(row, k) / 127.0f;
      sp[r] = scale;
      const float safe = scale == 0.0f ? 1.0f : scale;
      quantize_row(row, qp + r * k, k, safe);
    }
  });
  return {codes, scales};
}

// The GEMM's sums acc int32 [M, N] -> float32 in place (the caller views the same memory as float32):
// ((acc x col_scales[n]) x row_scales[m]) + bias[n] + residual[m, n], each product and sum rounded once,
// in the definition's order. bias and residual are optional. In place because a fresh [M, N] output of
// a few MB is mapped anew by the allocator on every call, and its page faults cost as much as the pass.
void int8_gemm_epilogue(const at::Tensor& acc, const at::Tensor& col_scales, const at::Tensor& row_scales,
                              const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  check_rows(acc, at::kInt, "acc");
  const int64_t m = acc.size(0), n = acc.size(1);
  check_vector(col_scales, n, "col_scales");
  check_vector(row_scales, m, "row_scales");
  check_vector(bias, n, "bias");
  if (residual.has_value()) {
    check_rows(*residual, at::kFloat, "residual");
    TORCH_CHECK(residual->size(0) == m && residual->size(1) == n, "int8 rows: residual must be [", m, ", ", n,
                "], got ", residual->sizes());
  }
  // int32 and float32 have one size: each value is read then overwritten by its float result.
  int32_t* ap = acc.data_ptr<int32_t>();
  const float* cs = col_scales.data_ptr<float>();
  const float* rs = row_scales.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float* res = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  at::parallel_for(0, m, grain_rows(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int32_t* a = ap + r * n;
      const float* rr = res == nullptr ? nullptr : res + r * n;
      if (bp != nullptr && rr != nullptr) {
        epilogue_row<true, true>(a, cs, rs[r], bp, rr, n);
      } else if (bp != nullptr) {
        epilogue_row<true, false>(a, cs, rs[r], bp, rr, n);
      } else if (rr != nullptr) {
        epilogue_row<false, true>(a, cs, rs[r], bp, rr, n);
      } else {
        epilogue_row<false, false>(a, cs, rs[r], bp, rr, n);
      }
    }
  });
}

// int8_gemm_epilogue without a residual, then GELU (erf form) on each result, in the same pass. Not
// F.gelu's bits: both approximate erf, each its own way (see gelu16).
void int8_gemm_epilogue_gelu(const at::Tensor& acc, const at::Tensor& col_scales, const at::Tensor& row_scales,
                             const c10::optional<at::Tensor>& bias) {
  check_rows(acc, at::kInt, "acc");
  const int64_t m = acc.size(0), n = acc.size(1);
  check_vector(col_scales, n, "col_scales");
  check_vector(row_scales, m, "row_scales");
  check_vector(bias, n, "bias");
  int32_t* ap = acc.data_ptr<int32_t>();
  const float* cs = col_scales.data_ptr<float>();
  const float* rs = row_scales.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, m, grain_rows(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) epilogue_gelu_row(ap + r * n, cs, rs[r], bp, n);
  });
}

}  // namespace perfxlm_int8_rows

TORCH_LIBRARY_FRAGMENT(perfxlm, m) {
  m.def("int8_quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("int8_gemm_epilogue(Tensor(a!) acc, Tensor col_scales, Tensor row_scales, Tensor? bias, "
        "Tensor? residual) -> ()");
  m.def("int8_gemm_epilogue_gelu(Tensor(a!) acc, Tensor col_scales, Tensor row_scales, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(perfxlm, CPU, m) {
  m.impl("int8_quantize_rows", &perfxlm_int8_rows::int8_quantize_rows);
  m.impl("int8_gemm_epilogue", &perfxlm_int8_rows::int8_gemm_epilogue);
  m.impl("int8_gemm_epilogue_gelu", &perfxlm_int8_rows::int8_gemm_epilogue_gelu);
}
