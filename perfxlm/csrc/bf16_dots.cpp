// linear_bf16_dots: y = bf16(x) W^T (+ b) for many rows of float32 x against plain bf16 rows W [N, K]
// (the `rows` layout, perfxlm/ops/cpu_plan.py): the rows a bfloat16 model sends past the row kernel
// (parallel decode, prefill). The activations are rounded to bfloat16 once per call (to nearest even,
// as torch's cast does), then pairs of products are summed into float32 lanes by vdpbf16ps, 32
// multiply-adds per zmm instruction, on AVX512-BF16 builds. It stands where torch's bf16 GEMM (oneDNN)
// stood on CPUs with AVX512-BF16 but no AMX, which reorders the weight on every call: that costs more
// than the products at 16-64 rows.
//
// Register tile: MT = 8 x rows by NT = 3 weight rows, one zmm of 16 partial sums per (x row, weight row),
// K walked 32 at a time; each sum is reduced at the end in one fixed tree (its 16 lanes, whatever the
// tile's shape). An output therefore does not depend on how many rows came with it nor where in a tile it
// fell: a request's logits are the same alone and in any batch that takes this kernel.
//
// Other builds run the same lanes, pair order and tree in plain C++ (correct, slow): the path can be
// forced on any CPU (PERFXLM_BF16_DOTS=1), so the tests check it everywhere.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "bf16_dots.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PERFXLM_BF16_DOTS_NATIVE 1
#endif

namespace perfxlm_bf16dots {
namespace {

// 8 x 3 rather than 6 x 4 (both 24 accumulators): 16 rows (parallel decode) are two passes over the
// weights instead of three (6 + 6 + 4), 64 rows eight instead of eleven. Per call, one thread's CPU time,
// alternating, loaded 2-vCPU Zen 4, the default model's shapes streamed from memory, with the spread
// prefetch below, against the 6 x 4 tile with its prefetches in the first pass: 16 rows 1.00-1.27x (two
// runs), 32 rows 1.05-1.30x, 64 rows 1.04-1.15x, 512 rows 0.96-1.09x.
constexpr int NT = 3;  // weight rows per tile
constexpr int MT = 8;  // x rows per tile: 24 accumulators, 3 weight and 1 x register of 32
constexpr int64_t TG = 4;  // tiles per group: 12 weight rows that MT x rows at a time pass over (in L1)

// Where a tile's weight rows lie and what it fetches ahead: row j at w + j * step, and on the k-steps
// `fetch`, `fetch` + `nfetch`, ... the line `ahead` values past each (fetch < 0: none).
struct Rows {
  const uint16_t* w;
  int64_t step, ahead;
  int fetch, nfetch;
};

inline uint16_t round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// x [M, K] float32 -> [M, Kp] bf16, the columns past K zero (Kp a multiple of 32: whole loads).
void round_rows(const float* x, int64_t M, int64_t K, int64_t Kp, uint16_t* out) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* src = x + m * K;
      uint16_t* dst = out + m * Kp;
      for (int64_t k = 0; k < K; ++k) dst[k] = round_bf16(src[k]);
      for (int64_t k = K; k < Kp; ++k) dst[k] = 0;
    }
  });
}

#ifdef PERFXLM_BF16_DOTS_NATIVE
// 4 accumulators' sums (the tile's 3 and a zero): lane j of the result is the sum of a_j's 16 lanes, in the tree
// ((l0+l2)+(l1+l3)) within each 128-bit quarter, then quarters (q0+q2)+(q1+q3).
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d d0 = _mm512_castps_pd(t0), d1 = _mm512_castps_pd(t1);
  const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

inline __m512 dot(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(a), reinterpret_cast<__m512bh&>(b));
}

// R x rows (bf16, stride Kp) by NW <= NT weight rows (bf16, stride K) -> y rows (stride N) at column n0.
template <int R, int NW>
inline void tile(const uint16_t* xb, int64_t Kp, const Rows& wr, int64_t K, float* y, int64_t N, int64_t n0,
                 const float* bias) {
  const uint16_t* w = wr.w;
  const int fetch = wr.fetch, nfetch = wr.nfetch;
  __m512 acc[R][NT];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t kfull = K & ~int64_t{31};
  int phase = 0;  // this step's share of the prefetches: pass `fetch` of `nfetch` takes every nfetch-th step
  for (int64_t k = 0; k < kfull; k += 32) {
    const bool ahead = phase == fetch;
    phase = phase + 1 == nfetch ? 0 : phase + 1;
    __m512i wv[NW];
#pragma GCC unroll 4
    for (int j = 0; j < NW; ++j) {
      // one line a step per read stream, `ahead` on (the walks below say which lines and when)
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(w + j * wr.step + wr.ahead + k), _MM_HINT_T0);
      wv[j] = _mm512_loadu_si512(w + j * wr.step + k);
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512i xv = _mm512_loadu_si512(xb + i * Kp + k);
#pragma GCC unroll 4
      for (int j = 0; j < NW; ++j) acc[i][j] = dot(acc[i][j], xv, wv[j]);
    }
  }
  if (kfull < K) {  // the weights' tail masked; x's padding is zero
    const __mmask32 m = static_cast<__mmask32>((uint64_t{1} << (K - kfull)) - 1);
    __m512i wv[NW];
#pragma GCC unroll 4
    for (int j = 0; j < NW; ++j) wv[j] = _mm512_maskz_loadu_epi16(m, w + j * wr.step + kfull);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512i xv = _mm512_loadu_si512(xb + i * Kp + kfull);
#pragma GCC unroll 4
      for (int j = 0; j < NW; ++j) acc[i][j] = dot(acc[i][j], xv, wv[j]);
    }
  }
  const __mmask8 out = static_cast<__mmask8>((1u << NW) - 1);
  const __m128 bv = bias ? _mm_maskz_loadu_ps(out, bias + n0) : _mm_setzero_ps();
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
    _mm_mask_storeu_ps(y + i * N + n0, out, _mm_add_ps(reduce4(acc[i][0], acc[i][1], acc[i][2], _mm512_setzero_ps()), bv));
}
#else
// The same arithmetic in plain C++: lane l of a 32-value step sums the pair (2l + 1, 2l) in that order
// (vdpbf16ps's), float32 multiply-adds (the products of bf16 values are exact), the same reduction tree.
inline float widen(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float reduce16(const float* a) {
  float q[4];
  for (int g = 0; g < 4; ++g) q[g] = (a[4 * g] + a[4 * g + 2]) + (a[4 * g + 1] + a[4 * g + 3]);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

template <int R, int NW>
inline void tile(const uint16_t* xb, int64_t Kp, const Rows& rows, int64_t K, float* y, int64_t N, int64_t n0,
                 const float* bias) {
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NW; ++j) {
      float acc[16] = {};
      const uint16_t* xr = xb + i * Kp;
      const uint16_t* wr = rows.w + j * rows.step;  // no prefetch here
      for (int64_t k = 0; k < K; k += 32)
        for (int l = 0; l < 16; ++l) {
          const int64_t k1 = k + 2 * l + 1, k0 = k + 2 * l;
          if (k1 < K) acc[l] = std::fma(widen(xr[k1]), widen(wr[k1]), acc[l]);
          if (k0 < K) acc[l] = std::fma(widen(xr[k0]), widen(wr[k0]), acc[l]);
        }
      y[i * N + n0 + j] = reduce16(acc) + (bias ? bias[n0 + j] : 0.f);
    }
}
#endif

template <int NW>
inline void tile_rows(int64_t r, const uint16_t* xb, int64_t Kp, const Rows& w, int64_t K, float* y, int64_t N,
                      int64_t n0, const float* bias) {
  switch (r) {
    case 8: tile<8, NW>(xb, Kp, w, K, y, N, n0, bias); break;
    case 7: tile<7, NW>(xb, Kp, w, K, y, N, n0, bias); break;
    case 6: tile<6, NW>(xb, Kp, w, K, y, N, n0, bias); break;
    case 5: tile<5, NW>(xb, Kp, w, K, y, N, n0, bias); break;
    case 4: tile<4, NW>(xb, Kp, w, K, y, N, n0, bias); break;
    case 3: tile<3, NW>(xb, Kp, w, K, y, N, n0, bias); break;
    case 2: tile<2, NW>(xb, Kp, w, K, y, N, n0, bias); break;
    default: tile<1, NW>(xb, Kp, w, K, y, N, n0, bias); break;
  }
}

// r <= MT x rows against nw <= NT weight rows: the tile for however many of each there are.
inline void one_tile(int64_t r, int64_t nw, const uint16_t* xb, int64_t Kp, const Rows& w, int64_t K, float* y,
                     int64_t N, int64_t n0, const float* bias) {
  switch (nw) {
    case 3: tile_rows<3>(r, xb, Kp, w, K, y, N, n0, bias); break;
    case 2: tile_rows<2>(r, xb, Kp, w, K, y, N, n0, bias); break;
    default: tile_rows<1>(r, xb, Kp, w, K, y, N, n0, bias); break;
  }
}

// Many rows (prefill chunks, 64 parallel sequences): a thread walks its tiles, NT adjacent weight rows
// each, once per block of x rows that stays in L2 (192 KB): past it (prefill chunks of 2048 rows) every
// tile would stream all of x from L3. Within a block, MT x rows at a time pass over a group of TG tiles
// (12 weight rows, in L1), so each row's outputs are written a whole 64-byte line at once: tile by tile
// down the block, rows 12 KB apart (3072 outputs) fell into one cache set, 1.35x slower than oneDNN at
// 2048 rows. A row's arithmetic is the same in any block.
void walk_blocks(const uint16_t* xbp, int64_t M, int64_t Kp, const uint16_t* wp, int64_t K, float* yp, int64_t N,
                 const float* bp, int64_t begin, int64_t end) {
  const int64_t block = std::max<int64_t>(MT, (int64_t{192} << 10) / (2 * Kp) / MT * MT);
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block);
    for (int64_t g = begin; g < end; g += TG) {
      const int64_t g1 = std::min(end, g + TG);
      const int passes = static_cast<int>((m1 - m0 + MT - 1) / MT);
      for (int64_t m = m0; m < m1; m += MT) {
        const int64_t r = std::min<int64_t>(MT, m1 - m);
        const int pass = static_cast<int>((m - m0) / MT);
        for (int64_t t = g; t < g1; ++t) {
          // the tile a group ahead (TG * NT * K weights on, contiguous), spread over the x rows' passes of
          // this group (pass p takes steps p, p + passes, ...): all in the first pass left memory idle
          // while the later passes ran from L1 (on a 6 x 4 tile, spreading gave 1.06-1.26x at 32 rows)
          const Rows w{wp + t * NT * K, K, TG * NT * K, pass, passes};
          one_tile(r, std::min<int64_t>(NT, N - t * NT), xbp + m * Kp, Kp, w, K, yp + m * N, N, t * NT, bp);
        }
      }
    }
  }
}

// Few rows (up to 2 MT: parallel decode, speculative verification), where the weights stream from memory
// once and the products barely keep up: a thread's rows are cut into NT parts, a tile taking row s of
// each, so the thread reads NT sequential streams far apart, which the hardware prefetchers follow at
// the DRAM rate; NT interleaved rows (adjacent tiles) they follow at about half of it (the batch-1 row
// kernel's finding, csrc/cpu_kernels.cpp). Each tile's x rows pass over it back to back (its rows in
// L1), the first pass fetching each stream's line kSplitAhead rows on. The outputs of kSplitTiles tiles
// gather in a buffer and go to y a part's run at a time. Per call, 2 threads, loaded Zen 4, weights
// streamed from memory, against the adjacent walk: 16 rows 1.1-1.4x, 8 rows 1.4-1.7x (the default
// model's projections and its 49152-row head); 32 and 64 rows 0.85-1.15x, so those keep the blocks.
constexpr int64_t kSplitTiles = 32;
constexpr int64_t kSplitAhead = 32;
void walk_split(const uint16_t* xbp, int64_t M, int64_t Kp, const uint16_t* wp, int64_t K, float* yp, int64_t N,
                const float* bp, int64_t begin, int64_t end) {
  const int64_t base = begin * NT, n = std::min(N, end * NT) - base, part = (n + NT - 1) / NT;
  constexpr int64_t row = kSplitTiles * NT;  // the buffer's row: a tile's NT outputs side by side
  alignas(64) float buf[2 * MT * row];
  for (int64_t s0 = 0; s0 < part; s0 += kSplitTiles) {
    const int64_t s1 = std::min(part, s0 + kSplitTiles);
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t nw = std::min<int64_t>(NT, (n - s + part - 1) / part);  // parts holding a row s
      for (int64_t m = 0; m < M; m += MT) {
        const Rows w{wp + (base + s) * K, part * K, kSplitAhead * K, m == 0 ? 0 : -1, 1};
        one_tile(std::min<int64_t>(MT, M - m), nw, xbp + m * Kp, Kp, w, K, buf + m * row, row, (s - s0) * NT,
                 nullptr);
      }
    }
    for (int64_t i = 0; i < M; ++i)  // a run of outputs per x row and part (rows of y in one cache set)
      for (int64_t j = 0; j < NT; ++j) {
        const int64_t c0 = base + j * part, s_end = std::min(s1, n - j * part);
        for (int64_t s = s0; s < s_end; ++s)
          yp[i * N + c0 + s] = buf[i * row + (s - s0) * NT + j] + (bp ? bp[c0 + s] : 0.f);
      }
  }
}

std::atomic<int> g_dots{-1};  // -1: not chosen yet

bool default_dots() {
  const char* env = std::getenv("PERFXLM_BF16_DOTS");
  const std::string v = env ? env : "";
  if (v == "0") return false;
  if (v == "1") return true;
#if defined(PERFXLM_BF16_DOTS_NATIVE) && !defined(__AMX_BF16__)
  return true;  // AVX512-BF16 without AMX (AMX's oneDNN GEMM outruns these dot products)
#else
  return false;
#endif
}

}  // namespace

bool dots_now() {
  int v = g_dots.load(std::memory_order_relaxed);
  if (v < 0) {
    v = default_dots() ? 1 : 0;
    g_dots.store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

// Returns the previous setting.
bool set_bf16_dots(bool on) {
  const bool previous = dots_now();
  g_dots.store(on ? 1 : 0, std::memory_order_relaxed);
  return previous;
}

bool bf16_dots_native() {
#ifdef PERFXLM_BF16_DOTS_NATIVE
  return true;
#else
  return false;
#endif
}

at::Tensor linear_bf16_dots(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_bf16_dots: x must be 2-D float32");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "linear_bf16_dots: weight must be contiguous bf16 [N, K]");
  TORCH_CHECK(weight.size(1) == x.size(1), "linear_bf16_dots: x has ", x.size(1), " features, weight expects ",
              weight.size(1));
  const int64_t N = weight.size(0), M = x.size(0), K = x.size(1);
  const at::Tensor xc = x.contiguous();
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear_bf16_dots: bias size ", bias->numel(), " != ", N);
    bc = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return bc.defined() ? bc.expand({M, N}).contiguous() : y.zero_();
  const int64_t Kp = (K + 31) & ~int64_t{31};
  at::Tensor xb = at::empty({M, Kp}, xc.options().dtype(at::kBFloat16));
  uint16_t* xbp = reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>());
  round_rows(xc.data_ptr<float>(), M, K, Kp, xbp);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + NT - 1) / NT;
  // a task's work ~ its tiles' weights times the rows: keep tasks above ~64K multiply-adds
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, M * K * NT));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    if (M <= 2 * MT) walk_split(xbp, M, Kp, wp, K, yp, N, bp, begin, end);
    else walk_blocks(xbp, M, Kp, wp, K, yp, N, bp, begin, end);
  });
  return y;
}

}  // namespace perfxlm_bf16dots

TORCH_LIBRARY_FRAGMENT(perfxlm, m) {
  m.def("linear_bf16_dots(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("set_bf16_dots(bool on) -> bool", &perfxlm_bf16dots::set_bf16_dots);  // no tensors: catch-all kernels
  m.def("bf16_dots() -> bool", &perfxlm_bf16dots::dots_now);
  m.def("bf16_dots_native() -> bool", &perfxlm_bf16dots::bf16_dots_native);
}

TORCH_LIBRARY_IMPL(perfxlm, CPU, m) { m.impl("linear_bf16_dots", &perfxlm_bf16dots::linear_bf16_dots); }
