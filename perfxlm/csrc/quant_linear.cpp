// Quantized-weight products: y = x W^T (+ b) with W in perfxlm.quant.QuantizedWeight's one affine form
// (uint8 codes, 8-bit, 6-bit, 5-bit or 4-bit, a scale and a min per group of inputs: w = scale * u + min, or
// scale * levels[u] + min for NF4). Centred codes (Q4_0, Q5_0, Q8_0, symmetric int4 / int8) store no mins:
// w = scale * (u - 8) for 4-bit codes, (u - 16) for 5-bit, (u - 128) for 8-bit, scale * levels[u] with a table,
// so a decode step streams 4.5 bits per 4-bit weight instead of 5 (llama.cpp's Q4_0 rate). Every GGUF block type the engine runs, and its own int8 / int4 /
// NF4 / W8A8 quantizations, are repacked into this form at load, so one set of kernels serves them all.
//
// Decode (few rows) is bound by reading the weights: the GEMV kernels stream 4.5-9 bits per weight
// instead of 16, widen each code in registers (one FMA applies scale and min), and dot it with float32
// activations, so weight-only formats keep the activations' precision. W8A8 rows are quantized per row
// to int8 first; with AVX512-VNNI the dot products are int8 x uint8 -> int32 (vpdpbusd), elsewhere the
// same integers run through the float kernel. Many rows (prefill) dequantize a slab of W at a time into
// a buffer that stays in cache and hand it to torch's GEMM (oneDNN's bf16 GEMM under a bf16-GEMM plan:
// AMX / AVX512-BF16), which beats any GEMV there.
//
// The plain-torch reference is perfxlm.quant (dequantize, then F.linear); tests compare the two on
// random inputs with odd sizes, per format, on each ISA build.

#include "quant_linear.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "act_blocks.h"
#include "code_planes.h"
#include "quant_gemm.h"
#include "row_groups.h"
#include "row_groups_k.h"
#include "row_groups_m.h"
#include "simd16.h"

#if defined(PERFXLM_SIMD16) && defined(__AVX512F__) && defined(__AVX512VNNI__)
#define PERFXLM_VNNI 1
#define PERFXLM_INT8_DOTS 1
#elif defined(PERFXLM_SIMD16) && defined(__AVX2__) && defined(__FMA__)
#define PERFXLM_DOTS_AVX2 1
#define PERFXLM_INT8_DOTS 1
#endif

namespace perfxlm_quant {
namespace {

constexpr int64_t kSlabValues = int64_t{4} << 20;  // values of W dequantized at once for torch's GEMM

// One quantized weight, as raw pointers.
struct QW {
  const uint8_t* codes;
  int64_t N, K, row_bytes, group, groups;
  bool bits4;  // nibble codes: 4-bit, or the low four bits of 5-bit ones
  // 5-bit codes: each row's nibbles (K / 2 bytes) are followed by a plane of fifth bits (K / 8 bytes, a
  // word per block of 32 in code_planes.h's order), u = nibble + 16 x fifth bit: the 4-bit paths plus
  // the plane's unpack
  bool bits5;
  const void* scales;
  // A group's min is param(mins) * min_factor: the stored mins times 1, or for centred codes the scales
  // times -centre (exact: a power of two), so every kernel reads one formula and centred weights stream
  // no mins from memory (the scale it re-reads is in the same cache line it just loaded).
  const void* mins;
  bool half;
  const float* levels;  // 16 floats or null
  bool centred;
  float min_factor;
  // A centred table of small integers (MXFP4's E2M1 values doubled): the int8 block products look each
  // code up as levels[u] + offset (0..64, unsigned for vpdpbusd / vpmaddubsw: 4 x 64 x 127 stays within
  // vpmaddubsw's int16 pair sums), and take offset x scale back with the mins (block_min_factor = -offset).
  bool int_lut = false;
  alignas(16) uint8_t ulut[16] = {};
  float block_min_factor = 1.f;  // min_factor for the int8 block products
  // 6-bit codes (GGUF Q6_K's values): the 5-bit layout (bits5 is set too) followed by a second plane of
  // sixth bits (K / 8 bytes, in the fifth plane's order), u = nibble + 16 x fifth + 32 x sixth (0..63):
  // every 5-bit path plus one more plane's unpack. Groups of 16 (Q6_K's) are each one nibble half of a
  // 32-block, so the 4-bit paths' halves take one scale each.
  bool bits6 = false;
  // Two-level scales (GGUF K-quants, perfxlm/quant/super_scales.py): `kbytes` bytes per row, a byte per
  // group (int8 where ksigned) then a float16 factor per 256 inputs (`kper` groups); stored mins alike,
  // each min being -(byte x factor). Null for float scales. The int8 block products form the values from
  // these bytes in their loops (kq_product) and the scalar reference per weight (weight_at); the float
  // kernels get a view whose float32 scales and mins were multiplied out for the rows they run
  // (expanded_rows, via over_rows).
  const uint8_t* kscales = nullptr;
  const uint8_t* kmins = nullptr;
  int64_t kbytes = 0;
  int64_t kper = 0;
  bool ksigned = false;
  // E8M0 exponent bytes (MXFP4's scales as the format stores them, torch's float8_e8m0fnu): kscales holds
  // one byte b per group, the scale 2^(b - 127), multiplied out per run as two-level bytes are.
  bool kexp = false;
};

constexpr int64_t kSuperBlock = 256;  // inputs per float16 factor of two-level scales

// Whether `lv` (16 floats) is a table the int8 block products take, and its unsigned form and offset.
inline bool integer_table(const float* lv, uint8_t* ulut, float* offset) {
  float lo = lv[0], hi = lv[0];
  for (int i = 0; i < 16; ++i) {
    if (!(lv[i] == std::nearbyint(lv[i]))) return false;  // NaN fails too
    lo = std::min(lo, lv[i]);
    hi = std::max(hi, lv[i]);
  }
  if (hi - lo > 64.f) return false;
  for (int i = 0; i < 16; ++i) ulut[i] = static_cast<uint8_t>(lv[i] - lo);
  *offset = -lo;
  return true;
}

inline float half_to_float(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

template <bool HALF>
inline float param_at(const void* p, int64_t i) {
  if constexpr (HALF)
    return half_to_float(static_cast<const uint16_t*>(p)[i]);
  else
    return static_cast<const float*>(p)[i];
}

inline float param(const QW& w, const void* p, int64_t i) {
  return w.half ? param_at<true>(p, i) : param_at<false>(p, i);
}

// One row of two-level bytes: group g's sub-value at sub[g], super-block s's float16 factor at fac + 2 s.
struct KBytes {
  const uint8_t* sub;
  const uint8_t* fac;
};

inline KBytes k_row(const uint8_t* bytes, const QW& w, int64_t n) {
  const uint8_t* r = bytes + n * w.kbytes;
  return {r, r + w.groups};
}

// Row n's scale bytes and the bytes its mins come from (centred codes: the scale bytes again, the min
// being the scale x min_factor).
inline KBytes kscale_bytes(const QW& w, int64_t n) { return k_row(w.kscales, w, n); }
inline KBytes kmin_bytes(const QW& w, int64_t n) { return k_row(w.kmins ? w.kmins : w.kscales, w, n); }

inline uint16_t k_half(const uint8_t* fac, int64_t s) {
  uint16_t h;
  std::memcpy(&h, fac + 2 * s, sizeof(h));
  return h;
}

// Group g's value (per groups to a factor): float(sub) x factor, one rounding (the product gguf-py
// forms); a min is its negation.
inline float k_value(KBytes r, int64_t g, int64_t per, bool is_signed) {
  const float sub = is_signed ? static_cast<float>(static_cast<int8_t>(r.sub[g])) : static_cast<float>(r.sub[g]);
  return sub * half_to_float(k_half(r.fac, g / per));
}

// An E8M0 byte -> float32 2^(b - 127), the bits built directly (b = 0: the subnormal 2^-127), as torch's
// float8_e8m0fnu reads it (b = 255, E8M0's NaN, never stored: quant/mxfp4.py keeps ggml's reading).
inline float exponent_value(uint8_t b) {
  const uint32_t bits = b ? static_cast<uint32_t>(b) << 23 : 0x00400000u;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Row n's group g scale and min (min_factor applied) in any form: float, two-level bytes, E8M0 bytes.
inline float scale_of(const QW& w, int64_t n, int64_t g) {
  if (w.kexp) return exponent_value(w.kscales[n * w.kbytes + g]);
  if (w.kscales) return k_value(k_row(w.kscales, w, n), g, w.kper, w.ksigned);
  return param(w, w.scales, n * w.groups + g);
}

inline float min_of(const QW& w, int64_t n, int64_t g) {
  if (w.kscales)
    return (w.kmins ? -k_value(k_row(w.kmins, w, n), g, w.kper, false) : scale_of(w, n, g)) * w.min_factor;
  return param(w, w.mins, n * w.groups + g) * w.min_factor;
}

// The code of weight (n, k): the scalar definition every vector path must agree with.
inline int code_at(const QW& w, int64_t n, int64_t k) {
  const uint8_t* row = w.codes + n * w.row_bytes;
  if (!w.bits4) return row[k];
  const int64_t block = k / 32, j = k % 32;
  const uint8_t b = row[block * 16 + (j & 15)];
  const int low = j < 16 ? (b & 0x0F) : (b >> 4);
  if (!w.bits5) return low;
  const int fifth = perfxlm_planes::plane_bit_at(row + w.K / 2, k);
  return low + 16 * fifth + (w.bits6 ? 32 * perfxlm_planes::plane_bit_at(row + w.K / 2 + w.K / 8, k) : 0);
}

inline float weight_at(const QW& w, int64_t n, int64_t k) {
  const int u = code_at(w, n, k);
  const int64_t g = k / w.group;
  const float v = w.levels ? w.levels[u] : static_cast<float>(u);
  return std::fma(v, scale_of(w, n, g), min_of(w, n, g));
}

QW describe_two_level(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                      const c10::optional<at::Tensor>& levels, int64_t K);

QW describe(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins_arg,
            const c10::optional<at::Tensor>& levels, int64_t K) {
  const bool centred = !mins_arg.has_value() || !mins_arg->defined();
  const at::Tensor& mins = centred ? scales : *mins_arg;
  if (scales.scalar_type() == at::kByte || scales.scalar_type() == at::kChar)
    return describe_two_level(codes, scales, centred ? c10::optional<at::Tensor>() : mins_arg, levels, K);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "linear_q: codes must be contiguous uint8 [N, K] or [N, K / 2]");
  const int64_t N = codes.size(0);
  const bool bits6 = codes.size(1) * 4 == K * 3 && K % 32 == 0;
  const bool bits5 = bits6 || (codes.size(1) * 8 == K * 5 && K % 32 == 0);
  const bool bits4 = bits5 || (codes.size(1) * 2 == K && codes.size(1) != K);
  TORCH_CHECK(bits4 || codes.size(1) == K, "linear_q: codes hold ", codes.size(1), " bytes per row for ", K,
              " inputs (want K, 3 K / 4, 5 K / 8 or K / 2)");
  TORCH_CHECK(!bits4 || K % 32 == 0, "linear_q: 4-bit codes need K % 32 == 0, got K = ", K);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.is_contiguous() && mins.sizes() == scales.sizes() &&
                  mins.is_contiguous() && mins.scalar_type() == scales.scalar_type(),
              "linear_q: scales and mins must be contiguous, same dtype, [N, K / group]");
  const bool exponents = scales.scalar_type() == at::kFloat8_e8m0fnu;
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf || exponents,
              "linear_q: scales must be float32, float16 or float8_e8m0fnu exponents");
  TORCH_CHECK(!exponents || (centred && levels.has_value() && levels->defined()),
              "linear_q: exponent scales take centred codes into a level table (MXFP4)");
  const int64_t groups = scales.size(1);
  TORCH_CHECK(groups >= 1 && K % groups == 0, "linear_q: ", groups, " groups do not divide K = ", K);
  const int64_t group = K / groups;
  const int64_t min_group = bits4 && !bits6 ? 32 : 16;  // a 6-bit group may be one nibble half of a 32-block
  TORCH_CHECK(groups == 1 || group % min_group == 0, "linear_q: group ", group, " must be a multiple of ",
              min_group, " (or the whole row)");
  const float* lv = nullptr;
  if (levels.has_value() && levels->defined()) {
    TORCH_CHECK(levels->scalar_type() == at::kFloat && levels->numel() == 16 && levels->is_contiguous(),
                "linear_q: levels must be contiguous float32 [16]");
    TORCH_CHECK(bits4 && !bits5, "linear_q: a level table needs 4-bit codes");
    lv = levels->data_ptr<float>();
  }
  // centred: w = scale * (u - centre), or scale * levels[u] with a table
  const float centre = lv ? 0.f : (bits6 ? 32.f : (bits5 ? 16.f : (bits4 ? 8.f : 128.f)));
  QW w{codes.data_ptr<uint8_t>(), N, K, codes.size(1), group, groups, bits4, bits5,
       scales.data_ptr(), mins.data_ptr(), scales.scalar_type() == at::kHalf, lv,
       centred, centred ? -centre : 1.f};
  w.bits6 = bits6;
  w.block_min_factor = w.min_factor;
  float offset = 0.f;
  if (lv && centred && integer_table(lv, w.ulut, &offset)) {
    w.int_lut = true;
    w.block_min_factor = -offset;  // w = scale * (lut[u] - offset): the min is -offset x the scale
  }
  if (exponents) {  // read as bytes, expanded per run (expanded_rows)
    w.kscales = static_cast<const uint8_t*>(scales.data_ptr());
    w.kbytes = groups;
    w.kexp = true;
    w.scales = w.mins = nullptr;
    w.half = false;
  }
  return w;
}

// Two-level scales: codes as for float scales; scales (and mins) bytes [N, groups + 2 K / 256].
QW describe_two_level(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                      const c10::optional<at::Tensor>& levels, int64_t K) {
  TORCH_CHECK(!(levels.has_value() && levels->defined()), "linear_q: two-level scales take no level table");
  TORCH_CHECK(K % kSuperBlock == 0, "linear_q: two-level scales need K % ", kSuperBlock, " == 0, got K = ", K);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "linear_q: codes must be contiguous uint8");
  const int64_t N = codes.size(0), supers = K / kSuperBlock;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.is_contiguous() && scales.size(1) > 2 * supers,
              "linear_q: two-level scales must be contiguous [N, groups + 2 K / 256]");
  const int64_t groups = scales.size(1) - 2 * supers;
  TORCH_CHECK(K % groups == 0 && groups % supers == 0 && (K / groups) % 16 == 0, "linear_q: two-level scales of ",
              scales.size(1), " bytes per row do not fit K = ", K);
  const bool centred = !mins.has_value();
  TORCH_CHECK(centred || (mins->scalar_type() == at::kByte && mins->sizes() == scales.sizes() && mins->is_contiguous()),
              "linear_q: two-level mins must be contiguous uint8 shaped as the scales");
  const bool bits6 = codes.size(1) * 4 == K * 3;
  const bool bits5 = bits6 || codes.size(1) * 8 == K * 5, bits4 = bits5 || codes.size(1) * 2 == K;
  TORCH_CHECK(bits4 || codes.size(1) == K, "linear_q: codes hold ", codes.size(1), " bytes per row for ", K, " inputs");
  TORCH_CHECK(!bits4 || (K / groups) % (bits6 ? 16 : 32) == 0, "linear_q: ", bits6 ? 6 : 4,
              "-bit codes need groups of a multiple of ", bits6 ? 16 : 32);
  const float centre = bits6 ? 32.f : (bits5 ? 16.f : (bits4 ? 8.f : 128.f));
  QW w{codes.data_ptr<uint8_t>(), N, K, codes.size(1), K / groups, groups, bits4, bits5, nullptr, nullptr, false,
       nullptr, centred, centred ? -centre : 1.f};
  w.bits6 = bits6;
  w.block_min_factor = w.min_factor;
  w.kscales = static_cast<const uint8_t*>(scales.data_ptr());
  w.kmins = centred ? nullptr : static_cast<const uint8_t*>(mins->data_ptr());
  w.kbytes = scales.size(1);
  w.kper = groups / supers;
  w.ksigned = scales.scalar_type() == at::kChar;
  return w;
}

// One row of two-level bytes multiplied out: out[g] = sub[g] x factor[g / per] x sign, in float32 (the
// product gguf-py forms; sign -1 gives a min, -(sub x factor), exactly). Branch-free over each
// super-block's `per` groups so the compiler vectorizes the conversions: this runs once per row per call,
// 2 values per 32 weights, and must stay small beside the products.
template <bool SIGNED>
inline void expand_row(const uint8_t* row, int64_t groups, int64_t per, float sign, float* out) {
  const int64_t supers = groups / per;
  for (int64_t s = 0; s < supers; ++s) {
    uint16_t h;
    std::memcpy(&h, row + groups + 2 * s, 2);
    const float factor = half_to_float(h) * sign;
    const uint8_t* __restrict src = row + s * per;
    float* __restrict dst = out + s * per;
    int64_t g = 0;
#ifdef __AVX2__
    const __m256 f8 = _mm256_set1_ps(factor);
    for (; g + 8 <= per; g += 8) {  // 8 bytes widened, converted (exact) and multiplied: the scalar values
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + g));
      const __m256i i = SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
      _mm256_storeu_ps(dst + g, _mm256_mul_ps(_mm256_cvtepi32_ps(i), f8));
    }
#endif
    for (; g < per; ++g)
      dst[g] = (SIGNED ? static_cast<float>(static_cast<int8_t>(src[g])) : static_cast<float>(src[g])) * factor;
  }
}

// A row of E8M0 bytes -> float32 scales (exponent_value each).
void expand_exponents(const uint8_t* __restrict row, int64_t groups, float* __restrict out) {
  for (int64_t g = 0; g < groups; ++g) out[g] = exponent_value(row[g]);
}

// Rows [n0, n1) of a two-level weight's scales (and mins) multiplied out to float32, [rows][groups] each.
void expand_two_level(const QW& w, int64_t n0, int64_t n1, float* sc, float* mn) {
  if (w.kexp) {
    for (int64_t n = n0; n < n1; ++n) expand_exponents(w.kscales + n * w.kbytes, w.groups, sc + (n - n0) * w.groups);
    return;
  }
  const int64_t per = w.groups / (w.K / kSuperBlock);
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t o = (n - n0) * w.groups;
    if (w.ksigned)
      expand_row<true>(w.kscales + n * w.kbytes, w.groups, per, 1.f, sc + o);
    else
      expand_row<false>(w.kscales + n * w.kbytes, w.groups, per, 1.f, sc + o);
    if (w.kmins) expand_row<false>(w.kmins + n * w.kbytes, w.groups, per, -1.f, mn + o);
  }
}

// A view of w for rows [n0, n1) whose scales and mins are float32 (two-level ones multiplied out into
// this thread's buffers, a few KB that stay in L1 while the kernel reads them): every kernel reads the
// one float layout, and a decode step streams the bytes, not the floats.
QW expanded_rows(const QW& w, int64_t n0, int64_t n1) {
  if (!w.kscales) return w;
  thread_local std::vector<float> sc_buf, mn_buf;
  const size_t count = static_cast<size_t>((n1 - n0) * w.groups);
  sc_buf.resize(count);
  mn_buf.resize(w.kmins ? count : 0);
  expand_two_level(w, n0, n1, sc_buf.data(), mn_buf.data());
  QW v = w;
  v.kscales = v.kmins = nullptr;
  v.half = false;
  // the kernels address row n's groups at n * groups: the buffers start at row n0
  const auto from_n0 = [&](const float* p) {
    return reinterpret_cast<const float*>(reinterpret_cast<uintptr_t>(p) - static_cast<uintptr_t>(n0 * w.groups) * sizeof(float));
  };
  v.scales = from_n0(sc_buf.data());
  v.mins = w.kmins ? from_n0(mn_buf.data()) : v.scales;
  return v;
}

// fn(view, r0, r1) over rows [n0, n1), in runs of at most 32 rows for two-level weights (each run's scales
// expanded first), starting on multiples of `tile` where n0 is one.
template <class Fn>
inline void in_runs(const QW& w, int64_t n0, int64_t n1, int64_t tile, const Fn& fn) {
  if (!w.kscales) return fn(w, n0, n1);
  const int64_t run = std::max<int64_t>(tile, 32 / tile * tile);
  for (int64_t r = n0; r < n1; r += run) {
    const int64_t r1 = std::min(n1, r + run);
    fn(expanded_rows(w, r, r1), r, r1);
  }
}

// fn(view, r0, r1) over all rows, in parallel, in ranges that start on multiples of `tile` (the last one
// ends at N): the tile kernels run whole tiles, the rows past the last whole tile one by one.
template <class Fn>
inline void over_rows(const QW& w, int64_t tile, int64_t grain_tiles, const Fn& fn) {
  const int64_t tiles = (w.N + tile - 1) / tile;
  at::parallel_for(0, tiles, grain_tiles, [&](int64_t begin, int64_t end) {
    in_runs(w, begin * tile, std::min(w.N, end * tile), tile, fn);
  });
}

#ifdef PERFXLM_SIMD16
using simd16::I;
using simd16::V;

constexpr int kTileOne = simd16::kAvx512 ? 8 : 4;  // weight rows per tile at batch 1
constexpr int kChunk = simd16::kAvx512 ? 4 : 2;    // x rows per pass over a tile
alignas(64) constexpr float kNoLevels[16] = {};

// NT weight rows against MT x rows, 16 (8-bit) or 32 (4-bit) inputs per step: each code widened once,
// scaled and offset with one FMA, then one FMA per x row.
template <bool BITS4, bool LUT, bool HALF, int MT, int NT, int PLANES = 0>
inline void q_tile(const float* x, const QW& w, int64_t n0, float* y, const float* bias) {
  const int64_t K = w.K, N = w.N;
  const simd16::Table16 table(LUT ? w.levels : kNoLevels);
  V acc[MT][NT];
  #pragma GCC unroll 16
  for (int i = 0; i < MT; ++i)
    #pragma GCC unroll 16
    for (int j = 0; j < NT; ++j) acc[i][j] = simd16::zero();
  constexpr int64_t step = BITS4 ? 32 : 16;
  for (int64_t k = 0; k < K; k += step) {
    const int64_t g = k / w.group;
    V x0[MT], x1[MT];
    #pragma GCC unroll 16
    for (int i = 0; i < MT; ++i) {
      x0[i] = simd16::load(x + i * K + k, K - k);
      if constexpr (BITS4) x1[i] = simd16::load(x + i * K + k + 16);
    }
    #pragma GCC unroll 16
    for (int j = 0; j < NT; ++j) {
      const int64_t n = n0 + j;
      const uint8_t* row = w.codes + n * w.row_bytes;
      // NT interleaved streams: fetch the next tile's rows a tile ahead (as the bf16 row kernel does).
      if ((k & (BITS4 ? 127 : 63)) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + NT * w.row_bytes + (BITS4 ? k / 2 : k)), _MM_HINT_T0);
      const V s = simd16::set1(param_at<HALF>(w.scales, n * w.groups + g));
      const V m = simd16::set1(param_at<HALF>(w.mins, n * w.groups + g) * w.min_factor);
      if constexpr (BITS4) {
        I lo, hi;
        simd16::load_nibbles(row + k / 2, lo, hi);
        V s1 = s, m1 = m;  // the hi half's scale and min: the next group's at groups of 16 (6-bit codes)
        if constexpr (PLANES > 0) {
          uint32_t fifth;
          std::memcpy(&fifth, row + K / 2 + k / 8, 4);
          lo = simd16::add_plane_bits(lo, fifth, 0);
          hi = simd16::add_plane_bits(hi, fifth, 1);
          if (w.bits6) {
            uint32_t sixth;
            std::memcpy(&sixth, row + K / 2 + K / 8 + k / 8, 4);
            lo = simd16::add_plane_bits(lo, sixth, 0, 32);
            hi = simd16::add_plane_bits(hi, sixth, 1, 32);
            if (w.group == 16) {
              s1 = simd16::set1(param_at<HALF>(w.scales, n * w.groups + g + 1));
              m1 = simd16::set1(param_at<HALF>(w.mins, n * w.groups + g + 1) * w.min_factor);
            }
          }
        }
        const V w0 = simd16::fmadd(LUT ? simd16::lookup(table, lo) : simd16::to_float(lo), s, m);
        const V w1 = simd16::fmadd(LUT ? simd16::lookup(table, hi) : simd16::to_float(hi), s1, m1);
        #pragma GCC unroll 16
        for (int i = 0; i < MT; ++i) acc[i][j] = simd16::fmadd(x1[i], w1, simd16::fmadd(x0[i], w0, acc[i][j]));
      } else {
        // Past K the code lanes are 0 (w = min) but x's lanes are 0 too.
        const V w0 = simd16::fmadd(simd16::to_float(simd16::load_u8(row + k, K - k)), s, m);
        #pragma GCC unroll 16
        for (int i = 0; i < MT; ++i) acc[i][j] = simd16::fmadd(x0[i], w0, acc[i][j]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int i = 0; i < MT; ++i)
    #pragma GCC unroll 16
    for (int j = 0; j < NT; ++j) y[i * N + n0 + j] = simd16::reduce_add(acc[i][j]) + (bias ? bias[n0 + j] : 0.f);
}

template <bool BITS4, bool LUT, bool HALF, int NT, int PLANES = 0>
inline void q_block(const float* x, int64_t M, const QW& w, int64_t n0, float* y, const float* bias) {
  constexpr int MT = kChunk;
  const int64_t K = w.K, N = w.N;
  int64_t m = 0;
  for (; m + MT <= M; m += MT) q_tile<BITS4, LUT, HALF, MT, NT, PLANES>(x + m * K, w, n0, y + m * N, bias);
  switch (M - m) {
    case 3: q_tile<BITS4, LUT, HALF, 3, NT, PLANES>(x + m * K, w, n0, y + m * N, bias); break;
    case 2: q_tile<BITS4, LUT, HALF, 2, NT, PLANES>(x + m * K, w, n0, y + m * N, bias); break;
    case 1: q_tile<BITS4, LUT, HALF, 1, NT, PLANES>(x + m * K, w, n0, y + m * N, bias); break;
    default: break;
  }
}

template <bool BITS4, bool LUT, bool HALF, int PLANES = 0>
void q_gemv_typed(const float* x, int64_t M, const QW& w, float* y, const float* bias) {
  const int64_t NT = M == 1 ? kTileOne : 4;
  over_rows(w, NT, 16, [&](const QW& v, int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + NT <= n1; n += NT) {
      if (NT == 8)
        q_block<BITS4, LUT, HALF, 8, PLANES>(x, M, v, n, y, bias);
      else
        q_block<BITS4, LUT, HALF, 4, PLANES>(x, M, v, n, y, bias);
    }
    for (; n < n1; ++n) q_block<BITS4, LUT, HALF, 1, PLANES>(x, M, v, n, y, bias);
  });
}

void q_gemv(const float* x, int64_t M, const QW& w, float* y, const float* bias) {
  if (w.bits5) {
    // one plane as far as the template knows: q_tile reads the sixth where bits6 says (this float path
    // is not the decode one where int8 blocks run)
    w.half ? q_gemv_typed<true, false, true, 1>(x, M, w, y, bias) : q_gemv_typed<true, false, false, 1>(x, M, w, y, bias);
  } else if (w.bits4 && w.levels) {
    w.half ? q_gemv_typed<true, true, true>(x, M, w, y, bias) : q_gemv_typed<true, true, false>(x, M, w, y, bias);
  } else if (w.bits4) {
    w.half ? q_gemv_typed<true, false, true>(x, M, w, y, bias) : q_gemv_typed<true, false, false>(x, M, w, y, bias);
  } else {
    w.half ? q_gemv_typed<false, false, true>(x, M, w, y, bias) : q_gemv_typed<false, false, false>(x, M, w, y, bias);
  }
}

inline void store_out(float* p, V a, int64_t n = 16) { simd16::store(p, a, n); }
inline void store_out(uint16_t* p, V a, int64_t n = 16) { simd16::store_bf16(p, a, n); }

// Rows [n0, n1) of W as float32 or bf16 (uint16_t), out [n1 - n0, K].
template <typename T>
void dequant_rows(const QW& whole, int64_t n0, int64_t n1, T* out) {
  at::parallel_for(n0, n1, 8, [&](int64_t begin, int64_t end) {
   in_runs(whole, begin, end, 1, [&](const QW& w, int64_t r0, int64_t r1) {
    const simd16::Table16 table(w.levels ? w.levels : kNoLevels);
    for (int64_t n = r0; n < r1; ++n) {
      const uint8_t* row = w.codes + n * w.row_bytes;
      T* o = out + (n - n0) * w.K;
      const int64_t step = w.bits4 ? 32 : 16;
      // the group's scale and min read when k enters it (g = k / group, counted up: a 64-bit division per
      // 16 codes cost more than widening them, and slabs are dequantized afresh for every call)
      int64_t g = n * w.groups - 1, g_end = 0;
      V s = simd16::set1(0.f), m = s, s1 = s, m1 = s;  // s1, m1: the hi half's (the next group's at 16)
      for (int64_t k = 0; k < w.K; k += step) {
        if (k >= g_end) {
          do {
            ++g;
            g_end += w.group;
          } while (k >= g_end);
          s = simd16::set1(param(w, w.scales, g));
          m = simd16::set1(param(w, w.mins, g) * w.min_factor);
          s1 = s;
          m1 = m;
          if (w.bits4 && w.group == 16) {  // 6-bit codes: a 32-step spans two groups
            s1 = simd16::set1(param(w, w.scales, g + 1));
            m1 = simd16::set1(param(w, w.mins, g + 1) * w.min_factor);
          }
        }
        if (w.bits4) {
          I lo, hi;
          simd16::load_nibbles(row + k / 2, lo, hi);
          if (w.bits5) {
            uint32_t fifth;
            std::memcpy(&fifth, row + w.K / 2 + k / 8, 4);
            lo = simd16::add_plane_bits(lo, fifth, 0);
            hi = simd16::add_plane_bits(hi, fifth, 1);
          }
          if (w.bits6) {
            uint32_t sixth;
            std::memcpy(&sixth, row + w.K / 2 + w.K / 8 + k / 8, 4);
            lo = simd16::add_plane_bits(lo, sixth, 0, 32);
            hi = simd16::add_plane_bits(hi, sixth, 1, 32);
          }
          store_out(o + k, simd16::fmadd(w.levels ? simd16::lookup(table, lo) : simd16::to_float(lo), s, m));
          store_out(o + k + 16, simd16::fmadd(w.levels ? simd16::lookup(table, hi) : simd16::to_float(hi), s1, m1));
        } else {
          store_out(o + k, simd16::fmadd(simd16::to_float(simd16::load_u8(row + k, w.K - k)), s, m), w.K - k);
        }
      }
    }
   });
  });
}
#else
// weight_at forms two-level scales from their bytes: the weight as given, no expanded runs.
void q_gemv(const float* x, int64_t M, const QW& w, float* y, const float* bias) {
  at::parallel_for(0, w.N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t k = 0; k < w.K; ++k) acc += x[m * w.K + k] * weight_at(w, n, k);
        y[m * w.N + n] = acc + (bias ? bias[n] : 0.f);
      }
  });
}

inline void store_out(float* p, float v) { *p = v; }
inline void store_out(uint16_t* p, float v) {  // round to nearest even, as torch
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  *p = static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

template <typename T>
void dequant_rows(const QW& w, int64_t n0, int64_t n1, T* out) {
  at::parallel_for(n0, n1, 8, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < w.K; ++k) store_out(out + (n - n0) * w.K + k, weight_at(w, n, k));
  });
}
#endif

#ifdef PERFXLM_VNNI
// W8A8 at few rows: uint8 codes x int8 activations -> int32 with vpdpbusd, 64 inputs per instruction;
// one group per row (per-channel scales): y = sx * (scale * sum(u q) + min * sum(q)).
template <int MT, int NT>
inline void vnni_tile(const int8_t* xq, const float* sx, const int32_t* xsum, const QW& w, int64_t n0, float* y,
                      const float* bias) {
  const int64_t K = w.K, N = w.N;
  __m512i acc[MT][NT];
  #pragma GCC unroll 16
  for (int i = 0; i < MT; ++i)
    #pragma GCC unroll 16
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 mask = K - k >= 64 ? ~0ULL : ((1ULL << (K - k)) - 1);
    __m512i xv[MT];
    #pragma GCC unroll 16
    for (int i = 0; i < MT; ++i) xv[i] = _mm512_maskz_loadu_epi8(mask, xq + i * K + k);
    #pragma GCC unroll 16
    for (int j = 0; j < NT; ++j) {
      const uint8_t* row = w.codes + (n0 + j) * w.row_bytes;
      _mm_prefetch(reinterpret_cast<const char*>(row + NT * w.row_bytes + k), _MM_HINT_T0);
      const __m512i wv = _mm512_maskz_loadu_epi8(mask, row + k);
      #pragma GCC unroll 16
      for (int i = 0; i < MT; ++i) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], wv, xv[i]);
    }
  }
  #pragma GCC unroll 16
  for (int j = 0; j < NT; ++j) {
    const int64_t n = n0 + j;
    const float s = param(w, w.scales, n), m = param(w, w.mins, n) * w.min_factor;
    #pragma GCC unroll 16
    for (int i = 0; i < MT; ++i) {
      const float dot = static_cast<float>(_mm512_reduce_add_epi32(acc[i][j]));
      y[i * N + n] = sx[i] * (s * dot + m * static_cast<float>(xsum[i])) + (bias ? bias[n] : 0.f);
    }
  }
}

template <int NT>
inline void vnni_block(const int8_t* xq, const float* sx, const int32_t* xsum, int64_t M, const QW& w, int64_t n0,
                       float* y, const float* bias) {
  const int64_t K = w.K, N = w.N;
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) vnni_tile<4, NT>(xq + m * K, sx + m, xsum + m, w, n0, y + m * N, bias);
  switch (M - m) {
    case 3: vnni_tile<3, NT>(xq + m * K, sx + m, xsum + m, w, n0, y + m * N, bias); break;
    case 2: vnni_tile<2, NT>(xq + m * K, sx + m, xsum + m, w, n0, y + m * N, bias); break;
    case 1: vnni_tile<1, NT>(xq + m * K, sx + m, xsum + m, w, n0, y + m * N, bias); break;
    default: break;
  }
}

void vnni_gemv(const int8_t* xq, const float* sx, const int32_t* xsum, int64_t M, const QW& w, float* y,
               const float* bias) {
  const int64_t tiles = w.N / 8;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) vnni_block<8>(xq, sx, xsum, M, w, t * 8, y, bias);
  });
  for (int64_t n = tiles * 8; n < w.N; ++n) vnni_block<1>(xq, sx, xsum, M, w, n, y, bias);
}
#endif

#ifdef PERFXLM_INT8_DOTS
// ---------------------------------------------------------------------------------------------
// Integer codes (no level table) against activations quantized to int8 per block of 32 (llama.cpp's
// Q8 activations, quantized once per row per call): the dot products run as uint8 x int8 -> int32
// (vpdpbusd, 64 per instruction), 2-3x fewer instructions per weight than widening codes to float32,
// which is what bounds the float kernel above. Per 64 inputs (a "chunk", two activation blocks):
//   acc += float(dot) * (weight scale lanes * activation scale lanes)
// and the mins once per row: y += sum over groups of min * (activation scale * sum of its int8 values).
// 4-bit codes unpack as [lo nibbles of A, of B, hi nibbles of A, of B] (A, B: the chunk's two 32-blocks),
// so the activations are stored in that order too; 8-bit codes and activations keep their order.
// ---------------------------------------------------------------------------------------------

// One block of 32 activations to symmetric int8: act_blocks.h's rounding, shared with the int8 GEMM.
using perfxlm_act::quantize_block_fast;

// The activations of one call, quantized, in the calling thread's scratch buffers (reused call after
// call: a decode step makes 120 of these, and three tensor allocations each cost as much as the
// quantization); the kernels read the raw pointers, valid until this thread's next call.
struct BlockActs {
  const int8_t* q;       // int8 [M, K], in the codes' chunk order
  const float* lanes;    // float32 [M, K / 64, 16]: each int32 lane's activation scale
  // float32 [M, K / 64, 8], 8-bit codes only: a chunk's two block scales as [A A B B A A B B], the lanes of
  // the chunk's pairwise-summed int32 dots (chunk_dot8), so a weight row's scales multiply them as loaded
  const float* pair8;
  const float* gsum;     // float32 [M, gstride]: per weight group, sum of scale * int8 values (0-padded)
  int64_t gstride;       // the weight's groups rounded up to 8, so 8-lane loads need no tail
  // int32 [M, K / 64, 24]: the int32 starts of the 256-bit tiles' dot products, per chunk the lanes of its
  // lo half (8), of its hi half (8) and of both halves' lanes added (8): -(centre x the lane's activation
  // bytes' sum) for centred codes without a table where the build has vpdpbusd on ymm (fold_centre),
  // else zero. vpdpbusd accumulates onto its start, so sum((u - centre) q) comes out of the dot product
  // itself, exact, and the per-row mins pass (the groups' min x activation sums) has nothing left to add.
  const int32_t* starts;
  bool folded;           // the starts hold the centre (the tiles skip the mins)
};

// Whether quantize_blocks folds centred codes' centre into the dot products' starts (set_int8_centre_fold;
// only builds with vpdpbusd on ymm: a start costs vpmaddubsw's path an add per dot, and its 8-bit codes are
// shifted to signed ones instead).
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr bool kCanFold = true;
#else
constexpr bool kCanFold = false;
#endif
std::atomic<bool> g_fold_centre{true};

// 5-bit codes: a chunk's fifth bits are the plane's 8 bytes at K / 2 + 8 c (blocks A and B's words),
// unpacked onto the 4-bit paths' nibble bytes (A 0-15, B 0-15, A 16-31, B 16-31) by code_planes.h's
// shifts. The codes stay within 0..31: vpmaddubsw's pair sums of two halves (4 x 31 x 127) fit int16 as
// 4-bit ones do, and the min (-16 x scale) goes with the mins.

// K-quant weights (two-level bytes, not MXFP4's exponents) take q8_K activations under ggml's rule
// (act_blocks.h: one scale per 256 values, as llama.cpp multiplies them).
inline bool is_kquant(const QW& w) { return w.kscales != nullptr && !w.kexp; }

BlockActs quantize_blocks(const at::Tensor& x, const QW& w) {
  const int64_t M = x.size(0), K = w.K, chunks = K / 64, gstride = (w.groups + 7) / 8 * 8;
  thread_local std::vector<int8_t> q_buf;
  thread_local std::vector<float> lanes_buf, pair8_buf, gsum_buf;
  q_buf.resize(static_cast<size_t>(M * K));
  lanes_buf.resize(static_cast<size_t>(M * chunks * 16));
  if (!w.bits4) pair8_buf.resize(static_cast<size_t>(M * chunks * 8));
  gsum_buf.assign(static_cast<size_t>(M * gstride), 0.f);
  thread_local std::vector<int32_t> starts_buf;
  starts_buf.resize(static_cast<size_t>(M * chunks * 24));
  const bool fold = kCanFold && w.centred && !w.levels && g_fold_centre.load(std::memory_order_relaxed);
  const bool kquant = is_kquant(w);
  const int centre = static_cast<int>(-w.min_factor);  // 8, 16, 32 or 128 where fold
  int32_t* sp = starts_buf.data();
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q_buf.data();
  float* lp = lanes_buf.data();
  float* pp = pair8_buf.data();
  float* gp = gsum_buf.data();
  const BlockActs a{qp, lp, pp, gp, gstride, sp, fold};
  // Rows in parallel only past ~32K values (a prefill's thousands of blocks): a parallel decode step's
  // 16-32 rows take a few microseconds here, less than waking the other threads for them costs, and one
  // parallel region fewer per product (4 per layer) is one fork/join fewer to wait on.
  at::parallel_for(0, M, std::max<int64_t>(8, 32768 / std::max<int64_t>(K, 1)), [&](int64_t m_begin, int64_t m_end) {
    for (int64_t m = m_begin; m < m_end; ++m) {
      float* gsum = gp + m * gstride;
      perfxlm_act::BlockScales scales(xp + m * K, K, kquant);
      // a chunk (two blocks, A and B) at a time: its lane scales written as whole vectors, and the group
      // of each 16 inputs counted up (group a multiple of 16), not divided out twice per block
      int64_t g = 0, g_end = w.group;
      for (int64_t c = 0; c < chunks; ++c) {
        int8_t block[2][32];
        float scale[2];
        for (int half = 0; half < 2; ++half) {
          scale[half] = scales.quantize(2 * c + half, block[half]);
          int32_t total[2] = {0, 0};  // per 16 inputs: a block spans two groups when group == 16
          for (int j = 0; j < 32; ++j) total[j / 16] += block[half][j];
          for (int h = 0; h < 2; ++h) {
            const int64_t at = c * 64 + half * 32 + h * 16;
            if (at >= g_end) {
              ++g;
              g_end += w.group;
            }
            gsum[g] += scale[half] * static_cast<float>(total[h]);
          }
        }
        int8_t* dst = qp + m * K + c * 64;
        float* lanes = lp + (m * chunks + c) * 16;
        if (w.bits4) {  // element j of block A goes to byte j (j < 16) or 32 + j - 16; of block B, 16 + ...
          std::memcpy(dst, block[0], 16);
          std::memcpy(dst + 16, block[1], 16);
          std::memcpy(dst + 32, block[0] + 16, 16);
          std::memcpy(dst + 48, block[1] + 16, 16);
          for (int l = 0; l < 16; ++l) lanes[l] = scale[(l / 4) % 2];  // [A x4, B x4] per half
        } else {
          std::memcpy(dst, block[0], 32);
          std::memcpy(dst + 32, block[1], 32);
          for (int l = 0; l < 16; ++l) lanes[l] = scale[l / 8];
          float* pair = pp + (m * chunks + c) * 8;  // [A A B B A A B B]
          for (int l = 0; l < 8; ++l) pair[l] = scale[(l / 2) % 2];
        }
        int32_t* start = sp + (m * chunks + c) * 24;
        for (int l = 0; l < 16; ++l)
          start[l] = fold ? -centre * (dst[4 * l] + dst[4 * l + 1] + dst[4 * l + 2] + dst[4 * l + 3]) : 0;
        for (int l = 0; l < 8; ++l) start[16 + l] = start[l] + start[8 + l];
      }
    }
  });
  return a;
}

// ---------------------------------------------------------------------------------------------
// Two-level scales in the int8 block products (GGUF K-quants, int4's super-block form): a group's scale
// and min are formed where the kernel uses them, each byte widened to float32 times its super-block's
// float16 factor, read from the row's packed bytes (llama.cpp's q4_K_q8_K dot forms d x sc per 32 in its
// loop as well). Before, every run of 32 rows had its bytes multiplied out into a float buffer first
// (expanded_rows): at batch 1 that pass cost a third as much as the products it fed. Here a row's 8 scales
// of a super-block are one widening load, a conversion and a multiply by the factor, shared by its four
// chunks; the mins go in once per row as before, 8 groups per step. The values are the expansion's (one
// rounding: float(byte) x factor, the product gguf-py forms) and each row's sums run in the float-scale
// kernels' order, so a two-level weight gives the bits of the same weight with its scales multiplied
// out, and a row alone the bits of that row in a batch.
// Layouts taken (kq_takes): 4-bit codes at groups of 32 (Q4_K, int4) or 64-256 (int4), 5-bit codes at
// groups of 32 (Q5_K), centred 6-bit codes at groups of 16 with signed sub-scales (Q6_K; 8-bit alike). Other two-level layouts
// keep the expansion (in_runs), as the float-activation kernel and the slab dequantization do.
// ---------------------------------------------------------------------------------------------
inline bool kq_takes(const QW& w, int spc) {
  if (!w.kscales || w.levels) return false;
  if (w.bits6) return spc == 4 && w.ksigned && w.centred;
  if (w.bits4) return !w.ksigned && (spc == 2 || (spc == 1 && !w.bits5));
  return spc == 4 && w.ksigned && w.centred;
}

// The int8 block GEMV's vector width, 512 or 256, in AVX512-VNNI builds (the others have only the 256-bit
// tiles): the CPU plan's dot_width (perfxlm/ops/cpu_plan.py, PERFXLM_DOT_WIDTH, with the measurements
// behind its default) sets it here (set_int8_dot_width); until it does, the same rule from the
// environment. One process-wide setting read by block_into, which every consumer of the block GEMV
// reaches (linear_q, the fused layer's projections, the experts, linear_q_ranges).
std::atomic<int> g_dot_width{0};  // 0: not chosen yet

int default_dot_width() {
#ifdef PERFXLM_VNNI
  const char* env = std::getenv("PERFXLM_DOT_WIDTH");
  const std::string v = env ? env : "";
  return v == "256" ? 256 : 512;
#else
  return 256;
#endif
}

inline int dot_width_now() {
  int v = g_dot_width.load(std::memory_order_relaxed);
  if (v == 0) {
    v = default_dot_width();
    g_dot_width.store(v, std::memory_order_relaxed);
  }
  return v;
}

#ifdef PERFXLM_VNNI
// The 512-bit tiles (zmm: 32 registers, 64 bytes per instruction) and their dispatch.
namespace zmm {
template <bool BITS4, int PLANES>
inline __m512i chunk_codes(const uint8_t* row, int64_t c, const QW& w, __m512i lut) {
  if constexpr (BITS4) {
    // 32 bytes -> [bytes | bytes >> 4] & 0x0F: lo nibbles of A, of B, then hi nibbles of A, of B
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
    const __m512i u = _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
    if constexpr (PLANES > 0) {
      const __m512i v = perfxlm_planes::or_fifths512(u, perfxlm_planes::chunk_words512(row + w.K / 2 + c * 8));
      // 6-bit codes: the sixth plane follows the fifth, K / 8 bytes on, in its order
      if constexpr (PLANES == 2)
        return perfxlm_planes::or_sixths512(v, perfxlm_planes::chunk_words512(row + w.K / 2 + w.K / 8 + c * 8));
      return v;
    }
    return w.int_lut ? _mm512_shuffle_epi8(lut, u) : u;
  } else {
    return _mm512_loadu_si512(row + c * 64);
  }
}

// Which of a chunk's SPC scales each int32 lane takes (lane l covers code bytes 4l..4l+3). 4-bit codes
// unpack as [A 0-15, B 0-15, A 16-31, B 16-31]: at groups of 16 (6-bit codes) those quarters are groups
// 0, 2, 1, 3 of the chunk.
template <bool BITS4, int SPC>
inline __m512i chunk_scale_lanes() {
  if constexpr (SPC == 4 && BITS4) return _mm512_set_epi32(3, 3, 3, 3, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0, 0);
  if constexpr (SPC == 4) return _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  if constexpr (BITS4) return _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
}

// Up to 16 consecutive scales or mins of a row as float32 (the lanes past n are 0).
template <bool HALF>
inline __m512 load_params16(const void* p, int64_t i, int64_t n) {
  const __mmask16 mask = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  if constexpr (HALF)
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + i));
  else
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + i);
}

// Up to 16 values of a two-level row from group g (a multiple of 16), the lanes past n zero: the bytes
// widened, times the factors of their super-blocks spread over the lanes (pidx: lane l -> l / per), times
// sign: expand_row's values, as load_params16 would read them from its buffer.
template <bool SIGNED>
inline __m512 kvalues16(KBytes r, int64_t g, int64_t n, int64_t per, int64_t supers, __m512i pidx, float sign) {
  const __mmask16 mask = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  const __m128i b = _mm_maskz_loadu_epi8(mask, r.sub + g);
  const __m512 v = _mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
  const int64_t f0 = g / per, nf = std::min<int64_t>((std::min<int64_t>(n, 16) + per - 1) / per, supers - f0);
  const __mmask16 fmask = static_cast<__mmask16>((1u << nf) - 1);
  const __m512 f = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(fmask, r.fac + 2 * f0));
  return _mm512_mul_ps(v, _mm512_mul_ps(_mm512_permutexvar_ps(pidx, f), _mm512_set1_ps(sign)));
}

// Where vnni_block_tile reads the scales and mins of its weight rows n0 + j: float ones here (float32 or
// float16 per group, as held or multiplied out by expanded_rows), two-level bytes in KByteScales. Each
// gives up to 16 consecutive scales from group g (lanes past n zero), one scale, and up to 16 mins as the
// tile adds them: acc + min x (the activations' group sums).
template <bool HALF>
struct FloatScales {
  const QW& w;
  int64_t n0;
  FloatScales(const QW& w_, int64_t n0_, int) : w(w_), n0(n0_) {}
  __m512 scales16(int j, int64_t g, int64_t n) const { return load_params16<HALF>(w.scales, (n0 + j) * w.groups + g, n); }
  float scale(int j, int64_t g) const { return param_at<HALF>(w.scales, (n0 + j) * w.groups + g); }
  __m512 mins16(int j, int64_t g, int64_t n) const {
    return _mm512_mul_ps(load_params16<HALF>(w.mins, (n0 + j) * w.groups + g, n), _mm512_set1_ps(w.block_min_factor));
  }
};

// Two-level bytes (GGUF K-quants, int4's super-block form): each value formed from its bytes where the
// float source loads it (kvalues16: expand_row's values). A stored min is -(byte x factor), formed as the
// bytes times -factor: the negation is exact, so the tile's FMA rounds as it does with the expanded min.
template <bool SIGNED>
struct KByteScales {
  const QW& w;
  int64_t n0, per, supers;
  __m512i pidx;
  KByteScales(const QW& w_, int64_t n0_, int nt)
      : w(w_), n0(n0_), per(w_.kper), supers(w_.K / kSuperBlock),
        pidx(_mm512_srlv_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                               _mm512_set1_epi32(__builtin_ctzll(static_cast<unsigned long long>(w_.kper))))) {
    for (int j = 0; j < nt; ++j)  // the next tile's scale bytes (its codes are fetched in the tile's loop)
      if (n0 + nt + j < w.N) {
        _mm_prefetch(reinterpret_cast<const char*>(w.kscales + (n0 + nt + j) * w.kbytes), _MM_HINT_T0);
        if (w.kmins) _mm_prefetch(reinterpret_cast<const char*>(w.kmins + (n0 + nt + j) * w.kbytes), _MM_HINT_T0);
      }
  }
  __m512 scales16(int j, int64_t g, int64_t n) const {
    return kvalues16<SIGNED>(kscale_bytes(w, n0 + j), g, n, per, supers, pidx, 1.f);
  }
  float scale(int j, int64_t g) const { return k_value(kscale_bytes(w, n0 + j), g, per, SIGNED); }
  __m512 mins16(int j, int64_t g, int64_t n) const {
    return w.kmins ? kvalues16<false>(kmin_bytes(w, n0 + j), g, n, per, supers, pidx, -1.f)
                   : kvalues16<SIGNED>(kscale_bytes(w, n0 + j), g, n, per, supers, pidx, w.block_min_factor);
  }
};

// NT weight rows against MT activation rows, the scales and mins read through Src (FloatScales or
// KByteScales): per 64-input chunk one vpdpbusd per weight and activation row, the weight scales (16 per
// load) spread over the chunk's int32 lanes; the mins 16 groups per step at the end.
// The end of a tile: acc + the mins' sum over groups of min x (activation scale x sum of the group's int8
// values), 16 groups per step, then each accumulator reduced into y with the bias.
template <class Src, int MT, int NT>
inline void tile_mins_store(const Src& src, const BlockActs& a, int64_t m0, const QW& w, int64_t n0,
                            __m512 (&acc)[MT][NT], float* y, const float* bias) {
  const int64_t groups = w.groups;
  const float* gsum = a.gsum + m0 * a.gstride;
  for (int64_t g = 0; g < groups; g += 16) {
    const int64_t left = groups - g;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    #pragma GCC unroll 16
    for (int j = 0; j < NT; ++j) {
      const __m512 mv = src.mins16(j, g, left);
      #pragma GCC unroll 16
      for (int i = 0; i < MT; ++i)
        acc[i][j] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(mask, gsum + i * a.gstride + g), acc[i][j]);
    }
  }
  #pragma GCC unroll 16
  for (int j = 0; j < NT; ++j)
    #pragma GCC unroll 16
    for (int i = 0; i < MT; ++i)
      y[(m0 + i) * w.N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]) + (bias ? bias[n0 + j] : 0.f);
}

template <class Src, bool BITS4, int SPC, int MT, int NT, int PLANES>
inline void vnni_block_tile(const BlockActs& a, int64_t m0, const QW& w, int64_t n0, float* y, const float* bias) {
  const int64_t K = w.K, chunks = K / 64;
  const int8_t* xq = a.q + m0 * K;
  const float* lanes = a.lanes + m0 * chunks * 16;
  const Src src(w, n0, NT);
  // which of the 16 loaded scales each int32 lane of a chunk takes (lane l covers code bytes 4l..4l+3)
  const __m512i base_idx = chunk_scale_lanes<BITS4, SPC>();
  constexpr int64_t per_load = SPC > 1 ? 16 / SPC : 1;  // chunks whose scales one 16-lane load holds
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(w.ulut)));
  __m512 acc[MT][NT];
  #pragma GCC unroll 16
  for (int i = 0; i < MT; ++i)
    #pragma GCC unroll 16
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < chunks; c0 += per_load) {
    const int64_t c1 = std::min(chunks, c0 + per_load);
    __m512 S[NT];
    if constexpr (SPC > 1) {
      #pragma GCC unroll 16
      for (int j = 0; j < NT; ++j) S[j] = src.scales16(j, c0 * SPC, (c1 - c0) * SPC);
    }
    for (int64_t c = c0; c < c1; ++c) {
      __m512i xv[MT];
      __m512 xs[MT];
      #pragma GCC unroll 16
      for (int i = 0; i < MT; ++i) {
        xv[i] = _mm512_loadu_si512(xq + i * K + c * 64);
        xs[i] = _mm512_loadu_ps(lanes + (i * chunks + c) * 16);
      }
      const __m512i idx = _mm512_add_epi32(base_idx, _mm512_set1_epi32(static_cast<int>(SPC * (c - c0))));
      #pragma GCC unroll 16
      for (int j = 0; j < NT; ++j) {
        const int64_t n = n0 + j;
        const uint8_t* row = w.codes + n * w.row_bytes;
        // Every 64-byte line of the next tile's rows: a chunk of 8-bit codes is a whole line (one prefetch
        // per two chunks left every other line to the hardware prefetchers, which Zen 4 does not pair as
        // Intel's adjacent-line prefetcher does: its Q8_0 batch-1 decode ran 15-20 % slower for it).
        if (!BITS4 || (c & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + NT * w.row_bytes + c * (BITS4 ? 32 : 64)), _MM_HINT_T0);
        const __m512i wv = chunk_codes<BITS4, PLANES>(row, c, w, lut);
        __m512 ws;
        if constexpr (SPC > 1)
          ws = _mm512_permutexvar_ps(idx, S[j]);
        else
          ws = _mm512_set1_ps(src.scale(j, (c * 64) / w.group));
        #pragma GCC unroll 16
        for (int i = 0; i < MT; ++i) {
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv[i]);
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, xs[i]), acc[i][j]);
        }
      }
    }
  }
  tile_mins_store<Src, MT, NT>(src, a, m0, w, n0, acc, y, bias);
}

// block_tile for 5-8 activation rows on zmm: two weight rows at a time, their codes unpacked and their
// scales spread once per chunk and held while each activation row's codes and scales are loaded and
// multiplied into both: MT x 2 accumulators and 4 registers for the two rows' codes and scales. (block_tile
// holds every activation row's codes and scales instead, 2 MT registers: at 8 x 2 the compiler spilled
// accumulators to the stack.) Each row's operations are block_tile's, in its order: the same bits.
template <bool BITS4, bool HALF, int SPC, int MT, int PLANES>
inline void block_tile_wide(const BlockActs& a, int64_t m0, const QW& w, int64_t n0, float* y, const float* bias) {
  constexpr int NT = 2;
  const int64_t K = w.K, chunks = K / 64;
  const int8_t* xq = a.q + m0 * K;
  const float* lanes = a.lanes + m0 * chunks * 16;
  const FloatScales<HALF> src(w, n0, NT);
  const __m512i base_idx = chunk_scale_lanes<BITS4, SPC>();
  constexpr int64_t per_load = SPC > 1 ? 16 / SPC : 1;
  const int64_t per_group = w.group / 64;  // chunks per group (SPC 1): no division per chunk at the usual 1
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(w.ulut)));
  __m512 acc[MT][NT];
  #pragma GCC unroll 16
  for (int i = 0; i < MT; ++i)
    #pragma GCC unroll 16
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < chunks; c0 += per_load) {
    const int64_t c1 = std::min(chunks, c0 + per_load);
    __m512 S[NT];
    if constexpr (SPC > 1) {
      #pragma GCC unroll 16
      for (int j = 0; j < NT; ++j) S[j] = src.scales16(j, c0 * SPC, (c1 - c0) * SPC);
    }
    for (int64_t c = c0; c < c1; ++c) {
      const __m512i idx = _mm512_add_epi32(base_idx, _mm512_set1_epi32(static_cast<int>(SPC * (c - c0))));
      __m512i wv[NT];
      __m512 ws[NT];
      #pragma GCC unroll 16
      for (int j = 0; j < NT; ++j) {
        const int64_t n = n0 + j;
        const uint8_t* row = w.codes + n * w.row_bytes;
        if (!BITS4 || (c & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + NT * w.row_bytes + c * (BITS4 ? 32 : 64)), _MM_HINT_T0);
        wv[j] = chunk_codes<BITS4, PLANES>(row, c, w, lut);
        if constexpr (SPC > 1)
          ws[j] = _mm512_permutexvar_ps(idx, S[j]);
        else
          ws[j] = _mm512_set1_ps(src.scale(j, per_group == 1 ? c : c / per_group));
      }
      #pragma GCC unroll 16
      for (int i = 0; i < MT; ++i) {
        const __m512i xv = _mm512_loadu_si512(xq + i * K + c * 64);
        const __m512 xs = _mm512_loadu_ps(lanes + (i * chunks + c) * 16);
        #pragma GCC unroll 16
        for (int j = 0; j < NT; ++j) {
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[j], xv);
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws[j], xs), acc[i][j]);
        }
      }
    }
  }
  tile_mins_store<FloatScales<HALF>, MT, NT>(src, a, m0, w, n0, acc, y, bias);
}

template <bool BITS4, bool HALF, int SPC, int MT, int NT, int PLANES>
inline void block_tile(const BlockActs& a, int64_t m0, const QW& w, int64_t n0, float* y, const float* bias) {
  vnni_block_tile<FloatScales<HALF>, BITS4, SPC, MT, NT, PLANES>(a, m0, w, n0, y, bias);
}

// block_tile (AVX512-VNNI) on two-level rows: the one tile, reading the bytes.
template <bool BITS4, bool SIGNED, int SPC, int MT, int NT, int PLANES>
inline void kq_tile(const BlockActs& a, int64_t m0, const QW& w, int64_t n0, float* y, const float* bias) {
  vnni_block_tile<KByteScales<SIGNED>, BITS4, SPC, MT, NT, PLANES>(a, m0, w, n0, y, bias);
}

template <bool BITS4, bool SIGNED, int SPC, int NT, int PLANES>
inline void kq_rows(const BlockActs& a, int64_t M, const QW& w, int64_t n0, float* y, const float* bias) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) kq_tile<BITS4, SIGNED, SPC, 4, NT, PLANES>(a, m, w, n0, y, bias);
  switch (M - m) {
    case 3: kq_tile<BITS4, SIGNED, SPC, 3, NT, PLANES>(a, m, w, n0, y, bias); break;
    case 2: kq_tile<BITS4, SIGNED, SPC, 2, NT, PLANES>(a, m, w, n0, y, bias); break;
    case 1: kq_tile<BITS4, SIGNED, SPC, 1, NT, PLANES>(a, m, w, n0, y, bias); break;
    default: break;
  }
}

#define PERFXLM_ZMM_TILES 1
#include "block_dispatch.h"
#undef PERFXLM_ZMM_TILES
}  // namespace zmm
#endif  // PERFXLM_VNNI

// The 256-bit tiles (dots256.h) and their dispatch: every int8-dot build has them.
namespace ymm {
#include "dots256.h"
#include "dots256_kbytes.h"
#define PERFXLM_ZMM_TILES 0
#include "block_dispatch.h"
#undef PERFXLM_ZMM_TILES
}  // namespace ymm

// x with each block of 32 replaced by its int8 quantization times its scale: what the block GEMV
// multiplies, rounded exactly as quantize_blocks rounds (kquant: is_kquant's weight).
at::Tensor fake_quantize_blocks(const at::Tensor& x, bool kquant) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      perfxlm_act::BlockScales scales(xp + m * K, K, kquant);
      for (int64_t b = 0; b < K / 32; ++b) {
        int8_t block[32];
        const float scale = scales.quantize(b, block);
        for (int j = 0; j < 32; ++j) op[m * K + b * 32 + j] = static_cast<float>(block[j]) * scale;
      }
    }
  });
  return out;
}

// Scales per 64-input chunk, or 0 where the block path does not apply (then the float kernel runs).
int block_spc(const QW& w) {
  if ((w.levels && !w.int_lut) || w.K % 64 != 0) return 0;
  if (w.group % 64 == 0) return 1;
  if (w.group == 32) return 2;
  if (w.group == 16 && (!w.bits4 || w.bits6)) return 4;
  return 0;
}


// Whether the int8 GEMM (quant_gemm.cpp) takes a weight the block GEMV takes: perfxlm/ops/linear.py's
// gemm_takes, less the two-level scales it multiplies out in Python.
bool gemm_takes(const QW& w) {
  const int top = w.bits4 ? (w.bits6 ? 63 : (w.bits5 ? 31 : 15)) : 255;
  const bool rate = top <= perfxlm_qgemm::quant_block_gemm_max_code();
  // 6-bit codes in groups of 16 (centred: Q6_K's) close per half block there
  const bool groups_ok = w.group % 32 == 0 || (w.group == 16 && w.bits6 && w.centred);
  return groups_ok && (!w.kscales || w.kexp) && (!w.levels || w.int_lut) && rate;
}

// The block products of M quantized rows `a` with every row of w into y [M, w.N]: on zmm tiles, or on ymm
// ones where the process's dot width (int8_dot_width) is 256.
void block_into(const BlockActs& a, int64_t M, const QW& w, float* yp, const float* bias, int spc) {
#ifdef PERFXLM_VNNI
  if (dot_width_now() == 512) return zmm::products(a, M, w, yp, bias, spc);
#endif
  ymm::products(a, M, w, yp, bias, spc);
}

at::Tensor block_product(const at::Tensor& x, const QW& w, const float* bias, int spc) {
  const int64_t M = x.size(0);
  const BlockActs a = quantize_blocks(x, w);
  at::Tensor y = at::empty({M, w.N}, x.options());
  block_into(a, M, w, y.data_ptr<float>(), bias, spc);
  return y;
}
#endif

// w's rows [n0, n1) as a weight of their own: the kernels address rows from the view's first one.
QW rows_of(const QW& w, int64_t n0, int64_t n1) {
  QW v = w;
  v.N = n1 - n0;
  v.codes += n0 * w.row_bytes;
  const int64_t param_bytes = w.half ? 2 : 4;
  if (w.scales) v.scales = static_cast<const uint8_t*>(w.scales) + n0 * w.groups * param_bytes;
  if (w.mins) v.mins = static_cast<const uint8_t*>(w.mins) + n0 * w.groups * param_bytes;
  if (w.kscales) v.kscales += n0 * w.kbytes;
  if (w.kmins) v.kmins += n0 * w.kbytes;
  return v;
}

// product(view, out, bias) for the output columns [n0, n1) of y [M, w.N]: one row writes in place, more
// rows go through this thread's scratch, copied into their rows after.
template <class Fn>
void into_columns(const QW& w, int64_t M, int64_t n0, int64_t n1, float* y, const float* bias, const Fn& product) {
  const QW v = rows_of(w, n0, n1);
  const float* b = bias ? bias + n0 : nullptr;
  if (M == 1) return product(v, y + n0, b);
  thread_local std::vector<float> buf;
  const int64_t n = n1 - n0;
  buf.resize(static_cast<size_t>(M * n));
  product(v, buf.data(), b);
  for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * w.N + n0, buf.data() + m * n, static_cast<size_t>(n) * sizeof(float));
}

// Weight-only product on float32 rows (also W8A8's fallback, on rows holding integers).
at::Tensor float_product(const at::Tensor& x, const QW& w, const float* bias, int64_t max_rows, bool bf16_gemm) {
  const int64_t M = x.size(0), K = w.K, N = w.N;
  if (M <= max_rows) {
    at::Tensor y = at::empty({M, N}, x.options());
    q_gemv(x.data_ptr<float>(), M, w, y.data_ptr<float>(), bias);
    return y;
  }
  // Slabs of W rows handed to torch's GEMM: the whole weight up to 4M values, else 4M-value slabs.
  // bf16: dequantized straight to bf16 (half the bytes written and read again by the GEMM).
  const int64_t per_slab = std::min<int64_t>(N, std::max<int64_t>(64, kSlabValues / K));
  at::Tensor buf = at::empty({per_slab, K}, x.options().dtype(bf16_gemm ? at::kBFloat16 : at::kFloat));
  const at::Tensor xg = bf16_gemm ? x.to(at::kBFloat16) : x;
  at::Tensor y = per_slab >= N ? at::Tensor() : at::empty({M, N}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += per_slab) {
    const int64_t n1 = std::min(N, n0 + per_slab);
    at::Tensor slab = buf.narrow(0, 0, n1 - n0);
    if (bf16_gemm)
      dequant_rows(w, n0, n1, reinterpret_cast<uint16_t*>(slab.data_ptr<at::BFloat16>()));
    else
      dequant_rows(w, n0, n1, slab.data_ptr<float>());
    at::Tensor part = at::mm(xg, slab.t());
    if (bf16_gemm) part = part.to(at::kFloat);
    if (!y.defined())
      y = part;
    else
      y.narrow(1, n0, n1 - n0).copy_(part);
  }
  if (bias) y.add_(at::from_blob(const_cast<float*>(bias), {N}, x.options()));
  return y;
}

}  // namespace

// The bias as float32 (kept alive in `keep`), or nullptr where there is none.
inline const float* float_bias(const c10::optional<at::Tensor>& bias, int64_t N, at::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->numel() == N, "linear_q: bias size ", bias->numel(), " != ", N);
  keep = bias->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

namespace {

// The GEMV's row limit for a weight of N x K values (linear_q's rule): 4-bit codes and weights too large
// for one dequantized slab keep it up to block_max_rows where the plan sets it.
int64_t gemv_limit(bool bits4, int64_t N, int64_t K, int64_t max_rows, int64_t block_max_rows) {
  const bool block_wins = bits4 || N * K > kSlabValues;
  return block_wins && block_max_rows >= 0 ? block_max_rows : max_rows;
}

void check_rows8(const at::Tensor& codes, const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& levels,
                 bool act_int8, int64_t out_features) {
  TORCH_CHECK(!act_int8 && !(mins.has_value() && mins->defined()) && !(levels.has_value() && levels->defined()),
              "linear_q: row groups hold centred codes (no mins, no table, float activations)");
  TORCH_CHECK(out_features > 0 && codes.dim() == 3 && (out_features + 7) / 8 == codes.size(0),
              "linear_q: row groups need out_features (", out_features, ") filling ", codes.size(0), " groups of 8");
}

// linear_q on row groups (row_groups.h): always int8 activation blocks (the layout exists for that
// GEMV, on every build). Few rows: its GEMV; from the int8 GEMM's first row: the GEMM, which reads the
// groups as its panels; many rows without it: the plain layout unpacked for this call, on the rows
// rounded as the GEMV rounds them (a token's result does not depend on its step's row count).
at::Tensor rows8_product(const at::Tensor& xc, const at::Tensor& codes, const at::Tensor& scales,
                         const c10::optional<at::Tensor>& bias, int64_t max_rows, bool bf16_gemm, int64_t block_max_rows,
                         int64_t gemm_rows, int64_t N) {
  const int64_t M = xc.size(0), K = xc.size(1);
  const bool bits4 = codes.size(2) == 8 * 16;
  const int64_t gemv_rows = gemv_limit(bits4, N, K, max_rows, block_max_rows);
  const bool gemm = perfxlm_qgemm::quant_block_gemm_max_code() >= (bits4 ? 15 : 255);
  if (gemm && gemm_rows >= 0 && M >= (gemm_rows > 0 ? gemm_rows : gemv_rows + 1))
    return perfxlm_qgemm::quant_block_gemm(xc, codes, scales, c10::nullopt, c10::nullopt, bias, 1, N);
  if (M <= gemv_rows) return perfxlm_rows8::linear(xc, codes, scales, bits4 ? 4 : 8, N, bias);
  const auto plain = perfxlm_rows8::unpack(codes, scales, N);
  return linear_q(perfxlm_rows8::rounded_blocks(xc), plain.first, plain.second, c10::nullopt, c10::nullopt, bias,
                  false, max_rows, bf16_gemm, false, block_max_rows, -1);
}

void check_rows8_m(const at::Tensor& codes, const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& levels,
                   bool act_int8, int64_t out_features) {
  TORCH_CHECK(!act_int8 && mins.has_value() && mins->defined() && !(levels.has_value() && levels->defined()),
              "linear_q: affine row groups hold their mins (no table, float activations)");
  TORCH_CHECK(out_features > 0 && codes.dim() == 3 && (out_features + 7) / 8 == codes.size(0),
              "linear_q: row groups need out_features (", out_features, ") filling ", codes.size(0), " groups of 8");
}

// rows8_product for affine 4-bit row groups (row_groups_m.h, layout 3): the same three ways, the GEMM told
// the layout, the fallback unpacking the mins too.
at::Tensor rows8_m_product(const at::Tensor& xc, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                           const c10::optional<at::Tensor>& bias, int64_t max_rows, bool bf16_gemm, int64_t block_max_rows,
                           int64_t gemm_rows, int64_t N) {
  const int64_t M = xc.size(0), K = xc.size(1);
  const int64_t gemv_rows = gemv_limit(true, N, K, max_rows, block_max_rows);
  const bool gemm = perfxlm_qgemm::quant_block_gemm_max_code() >= 15;
  if (gemm && gemm_rows >= 0 && M >= (gemm_rows > 0 ? gemm_rows : gemv_rows + 1))
    return perfxlm_qgemm::quant_block_gemm(xc, codes, scales, mins, c10::nullopt, bias, 3, N);
  if (M <= gemv_rows) return perfxlm_rows8m::linear(xc, codes, scales, mins, N, bias);
  const auto plain = perfxlm_rows8::unpack(codes, scales, N);
  return linear_q(perfxlm_rows8::rounded_blocks(xc), plain.first, plain.second, perfxlm_rows8m::unpack_mins(mins, N),
                  c10::nullopt, bias, false, max_rows, bf16_gemm, false, block_max_rows, -1);
}

void check_rows8_k(const at::Tensor& codes, const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& levels,
                   bool act_int8, int64_t out_features) {
  TORCH_CHECK(!act_int8 && !(mins.has_value() && mins->defined()) && !(levels.has_value() && levels->defined()),
              "linear_q: K-quant row groups hold their params in scales (no mins, no table, float activations)");
  TORCH_CHECK(out_features > 0 && codes.dim() == 3 && (out_features + 7) / 8 == codes.size(0),
              "linear_q: row groups need out_features (", out_features, ") filling ", codes.size(0), " groups of 8");
}

// Whether linear_q runs K-quant row groups (4-, 5- or 6-bit codes: the GEMV's block row limit) on the int8
// GEMM: from gemm_rows rows (0: past the GEMV's limit) where the plan asks for it (gemm_rows >= 0) and the
// build has one.
bool rows8_k_gemm(int64_t M, int64_t K, int64_t N, int64_t max_rows, int64_t block_max_rows, int64_t gemm_rows) {
  if (gemm_rows < 0 || perfxlm_qgemm::quant_block_gemm_max_code() < 63) return false;
  return M >= (gemm_rows > 0 ? gemm_rows : gemv_limit(true, N, K, max_rows, block_max_rows) + 1);
}

}  // namespace

at::Tensor linear_q(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& levels, const c10::optional<at::Tensor>& bias, bool act_int8,
                    int64_t max_rows, bool bf16_gemm, bool int8_blocks, int64_t block_max_rows, int64_t gemm_rows,
                    int64_t layout, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_q: x must be 2-D float32");
  TORCH_CHECK(layout >= 0 && layout <= 3, "linear_q: layout ", layout,
              " (0 plain, 1 row groups of 8, 2 K-quant row groups of 8, 3 affine row groups of 8)");
  const at::Tensor xc = x.contiguous();
  if (layout == 1) {
    check_rows8(codes, mins, levels, act_int8, out_features);
    return rows8_product(xc, codes, scales, bias, max_rows, bf16_gemm, block_max_rows, gemm_rows, out_features);
  }
  // K-quant row groups: their GEMV, and from the int8 GEMM's first row (the plain K-quants' rule in
  // perfxlm/ops/linear.py) the GEMM, which builds its panels from the groups with the plain layout's bits;
  // without a GEMM (the scalar build, a float32 plan) the GEMV at every row count
  if (layout == 2) {
    check_rows8_k(codes, mins, levels, act_int8, out_features);
    if (rows8_k_gemm(xc.size(0), xc.size(1), out_features, max_rows, block_max_rows, gemm_rows))
      return perfxlm_qgemm::quant_block_gemm(xc, codes, scales, c10::nullopt, c10::nullopt, bias, 2, out_features);
    return perfxlm_rows8k::linear(xc, codes, scales, perfxlm_rows8k::bits_of(codes), out_features, bias);
  }
  if (layout == 3) {
    check_rows8_m(codes, mins, levels, act_int8, out_features);
    return rows8_m_product(xc, codes, scales, *mins, bias, max_rows, bf16_gemm, block_max_rows, gemm_rows, out_features);
  }
  const int64_t M = xc.size(0), K = xc.size(1);
  const QW w = describe(codes, scales, mins, levels, K);
  at::Tensor bc;
  const float* bp = float_bias(bias, w.N, bc);
  if (!act_int8) {
#ifdef PERFXLM_INT8_DOTS
    const int spc = int8_blocks ? block_spc(w) : 0;
    // 4-bit codes, and weights too large for one dequantized slab (an LM head: the GEMM path's slabs
    // leave the cache), keep the block products up to block_max_rows where the plan sets it
    const bool block_wins = w.bits4 || w.N * w.K > kSlabValues;
    const int64_t gemv_rows = block_wins && block_max_rows >= 0 ? block_max_rows : max_rows;
    // The int8 GEMM from gemm_rows rows where the plan says so and it takes the layout (groups of whole
    // 32-blocks, float scales: K-quants' two-level bytes stay on the GEMV and the float path here)
    // (the GEMM reads float scales: exponent bytes widened for the call, as the module path's flat() does)
    if (spc && gemm_rows >= 0 && M >= (gemm_rows > 0 ? gemm_rows : gemv_rows + 1) && gemm_takes(w))
      return perfxlm_qgemm::quant_block_gemm(xc, codes, w.kexp ? scales.to(at::kFloat) : scales, mins, levels, bias);
    if (spc && M <= gemv_rows) return block_product(xc, w, bp, spc);
    // Many rows: the same int8 activation blocks (dequantized) go to the GEMM, so a token's result does
    // not depend on how many rows its step had (prefix-cache hits, chunking, batch size).
    if (spc) return float_product(fake_quantize_blocks(xc, is_kquant(w)), w, bp, max_rows, bf16_gemm);
#endif
    return float_product(xc, w, bp, max_rows, bf16_gemm);
  }

  TORCH_CHECK(!w.kscales, "linear_q: two-level scales take float activations, not W8A8");
  // W8A8: each row to symmetric int8, scale = max |x| / 127 (an all-zero row stays zero).
  at::Tensor sx = xc.abs().amax(1).div_(127.f);
  at::Tensor xq = at::where(sx.unsqueeze(1) > 0, xc.div(sx.unsqueeze(1)), at::zeros_like(xc)).round_().clamp_(-127, 127);
#ifdef PERFXLM_VNNI
  if (M <= max_rows && !w.bits4 && w.groups == 1) {
    const at::Tensor q8 = xq.to(at::kChar).contiguous();
    const at::Tensor xsum = q8.sum(1, false, at::kInt).contiguous();
    at::Tensor y = at::empty({M, w.N}, xc.options());
    vnni_gemv(q8.data_ptr<int8_t>(), sx.data_ptr<float>(), xsum.data_ptr<int32_t>(), M, w, y.data_ptr<float>(), bp);
    return y;
  }
#endif
  at::Tensor y = float_product(xq, w, nullptr, max_rows, bf16_gemm).mul_(sx.unsqueeze(1));
  if (bp) y.add_(bc);
  return y;
}

RangeProduct linear_q_ranges(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& levels,
                             const c10::optional<at::Tensor>& bias, bool act_int8, int64_t max_rows,
                             bool int8_blocks, int64_t block_max_rows, int64_t gemm_rows, int64_t layout,
                             int64_t out_features) {
  if (act_int8 || x.dim() != 2 || x.scalar_type() != at::kFloat) return {};
  at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  if (layout == 1) {  // rows8_product's GEMV, over whole groups of 8 outputs
    check_rows8(codes, mins, levels, act_int8, out_features);
    const int64_t N = out_features;
    const bool bits4 = codes.size(2) == 8 * 16;
    const int64_t gemv_rows = gemv_limit(bits4, N, K, max_rows, block_max_rows);
    const bool gemm = perfxlm_qgemm::quant_block_gemm_max_code() >= (bits4 ? 15 : 255);
    if ((gemm && gemm_rows >= 0 && M >= (gemm_rows > 0 ? gemm_rows : gemv_rows + 1)) || M > gemv_rows) return {};
    at::Tensor bc;
    const float* bp = float_bias(bias, N, bc);
    auto p = std::make_shared<perfxlm_rows8::Product>(perfxlm_rows8::prepare(xc, codes, scales, bits4 ? 4 : 8, N));
    return [p, bp, bc, codes, scales, N](float* y, int64_t n0, int64_t n1) {
      TORCH_CHECK(n0 % 8 == 0 && (n1 % 8 == 0 || n1 == N), "linear_q_ranges: row groups run whole groups of 8 outputs");
      perfxlm_rows8::groups_into(*p, n0 / 8, (n1 + 7) / 8, y, N, bp);
    };
  }
  if (layout == 3) {  // rows8_m_product's GEMV, over whole groups of 8 outputs
    check_rows8_m(codes, mins, levels, act_int8, out_features);
    const int64_t N = out_features;
    const int64_t gemv_rows = gemv_limit(true, N, K, max_rows, block_max_rows);
    const bool gemm = perfxlm_qgemm::quant_block_gemm_max_code() >= 15;
    if ((gemm && gemm_rows >= 0 && M >= (gemm_rows > 0 ? gemm_rows : gemv_rows + 1)) || M > gemv_rows) return {};
    at::Tensor bc;
    const float* bp = float_bias(bias, N, bc);
    const at::Tensor mn = *mins;
    auto p = std::make_shared<perfxlm_rows8m::Product>(perfxlm_rows8m::prepare(xc, codes, scales, mn, N));
    return [p, bp, bc, codes, scales, mn, N](float* y, int64_t n0, int64_t n1) {
      TORCH_CHECK(n0 % 8 == 0 && (n1 % 8 == 0 || n1 == N), "linear_q_ranges: row groups run whole groups of 8 outputs");
      perfxlm_rows8m::groups_into(*p, n0 / 8, (n1 + 7) / 8, y, N, bp);
    };
  }
  if (layout == 2) {  // linear_q's: the K-quant GEMV where it runs it, whole groups of 8 outputs
    check_rows8_k(codes, mins, levels, act_int8, out_features);
    const int64_t N = out_features;
    if (rows8_k_gemm(M, K, N, max_rows, block_max_rows, gemm_rows)) return {};
    at::Tensor bc;
    const float* bp = float_bias(bias, N, bc);
    auto p = std::make_shared<perfxlm_rows8k::Product>(
        perfxlm_rows8k::prepare(xc, codes, scales, perfxlm_rows8k::bits_of(codes), N));
    return [p, bp, bc, codes, scales, N](float* y, int64_t n0, int64_t n1) {
      TORCH_CHECK(n0 % 8 == 0 && (n1 % 8 == 0 || n1 == N), "linear_q_ranges: row groups run whole groups of 8 outputs");
      perfxlm_rows8k::groups_into(*p, n0 / 8, (n1 + 7) / 8, y, N, bp);
    };
  }
  const QW w = describe(codes, scales, mins, levels, K);
  at::Tensor bc;
  const float* bp = float_bias(bias, w.N, bc);
  (void)int8_blocks, (void)block_max_rows, (void)gemm_rows;  // the scalar build has no block products
#ifdef PERFXLM_INT8_DOTS
  const int spc = int8_blocks ? block_spc(w) : 0;
  if (spc) {  // linear_q's choice, as there
    const bool block_wins = w.bits4 || w.N * w.K > kSlabValues;
    const int64_t gemv_rows = block_wins && block_max_rows >= 0 ? block_max_rows : max_rows;
    if ((gemm_rows >= 0 && M >= (gemm_rows > 0 ? gemm_rows : gemv_rows + 1) && gemm_takes(w)) || M > gemv_rows) return {};
    const BlockActs a = quantize_blocks(xc, w);  // this thread's scratch: unchanged until its next call
    return [w, a, M, bp, spc, bc](float* y, int64_t n0, int64_t n1) {
      into_columns(w, M, n0, n1, y, bp, [&](const QW& v, float* out, const float* b) { block_into(a, M, v, out, b, spc); });
    };
  }
#endif
  if (M > max_rows) return {};
  const float* xp = xc.data_ptr<float>();
  return [w, xp, xc, M, bp, bc](float* y, int64_t n0, int64_t n1) {
    into_columns(w, M, n0, n1, y, bp, [&](const QW& v, float* out, const float* b) { q_gemv(xp, M, v, out, b); });
  };
}

namespace {

at::Tensor dequantize_q(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                        const c10::optional<at::Tensor>& levels, int64_t in_features) {
  const QW w = describe(codes, scales, mins, levels, in_features);
  at::Tensor out = at::empty({w.N, w.K}, scales.options().dtype(at::kFloat));
  if (w.N > 0) dequant_rows(w, 0, w.N, out.data_ptr<float>());
  return out;
}

}  // namespace

// The int8 block GEMV's vector width in force (256 or 512; 0 where the build has no block GEMV).
int64_t int8_dot_width() {
#ifdef PERFXLM_INT8_DOTS
  return dot_width_now();
#else
  return 0;
#endif
}

// Set it (256 or 512; 512 only takes where the build has zmm tiles); returns the width now in force.
int64_t set_int8_dot_width(int64_t width) {
  TORCH_CHECK(width == 256 || width == 512, "set_int8_dot_width: expected 256 or 512, got ", width);
#ifdef PERFXLM_VNNI
  g_dot_width.store(static_cast<int>(width), std::memory_order_relaxed);
#endif
  return int8_dot_width();
}

// The order batch-1 GEMVs read their weights in (read_streams.h: 1 one stream per thread, 2 two far-apart
// halves side by side, 0 each kernel's measured default); returns the setting now in force.
int64_t set_gemv_streams(int64_t streams) {
  TORCH_CHECK(streams >= 0 && streams <= 2, "set_gemv_streams: expected 0, 1 or 2, got ", streams);
  perfxlm_streams::g_streams.store(static_cast<int>(streams), std::memory_order_relaxed);
  return perfxlm_streams::streams_now();
}

int64_t gemv_streams() { return perfxlm_streams::streams_now(); }

// The largest tile of rows the row-group GEMVs run a block's codes for (row_groups_run.h: 0 the build's
// kRowTile, 1..8 a cap); returns the tile now in force. A row's bits are the same in any tile.
int64_t set_row_tile(int64_t rows) {
  TORCH_CHECK(rows >= 0 && rows <= 8, "set_row_tile: expected 0..8, got ", rows);
  perfxlm_row_groups::g_row_tile.store(static_cast<int>(rows), std::memory_order_relaxed);
  return perfxlm_row_groups::row_tile_cap();
}

// Whether the 256-bit tiles fold centred codes' centre into their dot products (BlockActs::starts; on by
// default where the build can); returns the previous setting. For tests and measurements of both forms.
bool set_int8_centre_fold(bool on) {
#ifdef PERFXLM_INT8_DOTS
  return g_fold_centre.exchange(on);
#else
  (void)on;
  return false;
#endif
}

// The arithmetic of every int8 activation block (act_blocks.h: 0 float scales, 1 ggml's fp16 scales and
// q8_K for K-quants, 2 ggml's fp16 scales for all); returns the previous one. perfxlm.quant.act_blocks
// sets it at load and keeps the references in step.
int64_t set_act_blocks(int64_t mode) {
  TORCH_CHECK(mode >= perfxlm_act::kFloat && mode <= perfxlm_act::kFine, "set_act_blocks: mode 0, 1 or 2, got ", mode);
  return perfxlm_act::arith().exchange(static_cast<int>(mode));
}

// Whether this build has the int8 block-dot GEMV (AVX512-VNNI, AVX2, AVX-VNNI); without it int8_blocks
// is ignored.
bool int8_block_dots() {
#ifdef PERFXLM_INT8_DOTS
  return true;
#else
  return false;
#endif
}

// The instruction-set tier this build was compiled for (perfxlm/ops/isa.py's names).
std::string compiled_isa() {
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
  return "amx";
#elif defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return "avx512_bf16";
#elif defined(__AVX512VNNI__)
  return "avx512_vnni";
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  return "avx512";
#elif defined(__AVXVNNI__) && defined(__AVX2__)
  return "avx_vnni";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace perfxlm_quant

TORCH_LIBRARY_FRAGMENT(perfxlm, m) {
  m.def(
      "linear_q(Tensor x, Tensor codes, Tensor scales, Tensor? mins, Tensor? levels, Tensor? bias, bool act_int8, "
      "int max_rows, bool bf16_gemm, bool int8_blocks=False, int block_max_rows=-1, int gemm_rows=-1, int layout=0, "
      "int out_features=-1) -> Tensor");
  m.def("int8_block_dots() -> bool", &perfxlm_quant::int8_block_dots);  // no tensors: a catch-all kernel
  m.def("int8_dot_width() -> int", &perfxlm_quant::int8_dot_width);
  m.def("set_int8_dot_width(int width) -> int", &perfxlm_quant::set_int8_dot_width);
  m.def("set_int8_centre_fold(bool on) -> bool", &perfxlm_quant::set_int8_centre_fold);
  m.def("set_act_blocks(int mode) -> int", &perfxlm_quant::set_act_blocks);
  m.def("set_gemv_streams(int streams) -> int", &perfxlm_quant::set_gemv_streams);
  m.def("set_row_tile(int rows) -> int", &perfxlm_quant::set_row_tile);
  m.def("gemv_streams() -> int", &perfxlm_quant::gemv_streams);
  m.def("compiled_isa() -> str", &perfxlm_quant::compiled_isa);
  m.def("dequantize_q(Tensor codes, Tensor scales, Tensor? mins, Tensor? levels, int in_features) -> Tensor");
  // Q8_0 / Q4_0 codes in row groups (row_groups.h, perfxlm/quant/row_groups.py)
  m.def("linear_q_rows8(Tensor x, Tensor codes, Tensor scales, int bits, int out_features, Tensor? bias) -> Tensor");
  // Q4_K / Q6_K in row groups (row_groups_k.h, perfxlm/quant/row_groups_k.py)
  m.def("linear_q_rows8_k(Tensor x, Tensor codes, Tensor params, int bits, int out_features, Tensor? bias) -> Tensor");
  // Q4_1 in row groups (row_groups_m.h, perfxlm/quant/row_groups.py)
  m.def("linear_q_rows8_m(Tensor x, Tensor codes, Tensor scales, Tensor mins, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(perfxlm, CPU, m) {
  m.impl("linear_q", &perfxlm_quant::linear_q);
  m.impl("dequantize_q", &perfxlm_quant::dequantize_q);
  m.impl("linear_q_rows8", &perfxlm_rows8::linear);
  m.impl("linear_q_rows8_k", &perfxlm_rows8k::linear);
  m.impl("linear_q_rows8_m", &perfxlm_rows8m::linear);
}
