// Multi-head latent attention's decode step (DeepSeek-V2/V3, perfxlm/model/layers/mla.py) as one call per
// layer: the query's no-rope part absorbed through W_UK, scores against each cached [latent | rope key]
// row, softmax, the weighted sum of the latents, then W_UV:
//
//   q_h = scale [q_nope_h W_UK[h], q_pe_h]     s_ht = q_h . row_t     out_h = (sum_t p_ht latent_t) W_UV^T[h]
//
// Every query head reads the same cached row (one KV head of kv_lora_rank + qk_rope_head_dim channels), so
// a row is loaded and widened (a bf16 / int8 / fp8 cache) once per step for all heads, into a float buffer
// of a chunk of tokens that the score and value passes then read from L2. That makes the step bound by
// arithmetic (2 x heads FMAs per cached value), not by reading the cache: the passes are register tiles of
// several heads x several tokens (scores) or heads x 16-lane chunks (values). A chunk of tokens at a time
// with an online softmax (running max, sum and output per head, rescaled when the max grows) reads each row
// once instead of twice. Long contexts are cut into token ranges (flash-decoding) so batch 1 feeds every
// thread; the cut follows the sequence's own length, never the batch, so a row is the same bits alone or
// batched. The paged attention kernel (attention_kernels.cpp) served MLA before through its generic path
// (head sizes other than 64 / 128 / 256), with the absorption and W_UV as separate torch ops around it.
//
// The plain-torch reference is perfxlm/ops/mla.py's mla_decode_attention_torch.

#include "kv_elements.h"
#include "simd16.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace perfxlm_mla {
namespace {

using perfxlm_attn::load_scalar;
using perfxlm_attn::scale_value;
using perfxlm_attn::ScaleT;

#ifdef PERFXLM_SIMD16
namespace vec = simd16;
// Register tiles: AVX-512 has 32 vector registers, AVX2 16 (and a 16-lane vector is two of them there).
constexpr int kHeadTile = simd16::kAvx512 ? 4 : 2;  // query heads per tile
constexpr int kTokenTile = simd16::kAvx512 ? 4 : 2;  // cached rows per score tile
constexpr int kValueChunks = simd16::kAvx512 ? 4 : 2;  // 16-lane output chunks per value tile
#else
// The scalar tier: the same loops over 16 plain floats.
namespace vec {
struct V {
  float v[16];
};
inline V zero() { return V{}; }
inline V set1(float a) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = a;
  return r;
}
template <typename T>
inline V load(const T* p, int64_t n = 16) {
  V r{};
  for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) r.v[i] = load_scalar(p + i);
  return r;
}
inline V fmadd(V a, V b, V c) {
  for (int i = 0; i < 16; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline void store(float* p, V a, int64_t n = 16) {
  for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) p[i] = a.v[i];
}
inline float reduce_add(V a) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += a.v[i];
  return s;
}
}  // namespace vec
constexpr int kHeadTile = 1, kTokenTile = 1, kValueChunks = 1;
#endif

constexpr int64_t kChunk = 64;  // tokens widened at a time: 64 rows of 576 floats, 147 KB, stay in L2
constexpr int64_t kMaxRange = 512;  // tokens per task at most (as the paged attention kernel)
constexpr int64_t kMinRange = 128;  // ...and at least, so merging the ranges stays negligible

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Row `t` of a sequence (cache [num_blocks, block_size, 1, D]) widened to float32 into dst[0, Dp), times its
// group scales for a quantized cache, zeros past D.
template <typename T>
inline void widen_row(const T* cache, const ScaleT<T>* scales, const int64_t* table, int64_t t, int64_t block_size,
                      int64_t D, int64_t groups, int64_t Dp, float* dst) {
  const int64_t slot = table[t / block_size] * block_size + t % block_size;
  const T* row = cache + slot * D;
#ifdef PERFXLM_AVX512
  using perfxlm_attn::tail_mask;
  for (int64_t d = 0; d < D; d += 16)
    _mm512_mask_storeu_ps(dst + d, tail_mask(D - d), perfxlm_attn::load16(row + d, tail_mask(D - d)));
  int64_t d = D;
#elif defined(PERFXLM_AVX2)
  const __m256 undo = _mm256_set1_ps(1.f / perfxlm_attn::kFastLoadScale<T>);  // e4m3's skipped x256
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(perfxlm_attn::load8_fast(row + d), undo));
  for (; d < D; ++d) dst[d] = load_scalar(row + d);
#else
  int64_t d = 0;
  for (; d < D; ++d) dst[d] = load_scalar(row + d);
#endif
  for (; d < Dp; ++d) dst[d] = 0.f;
  if (scales != nullptr) {
    const ScaleT<T>* rs = scales + slot * groups;
    const int64_t gs = D / groups;
    for (int64_t g = 0; g < groups; ++g) {
      const float s = scale_value(rs[g]);
      for (int64_t i = g * gs; i < (g + 1) * gs; ++i) dst[i] *= s;
    }
  }
}

// s[j] = e^(s[j] - m) for j < n; returns their sum.
inline float exp_sum(float* s, int64_t n, float m) {
#ifdef PERFXLM_AVX512
  using perfxlm_attn::tail_mask;
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    const __m512 e = perfxlm_attn::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mv));
    _mm512_mask_storeu_ps(s + i, k, e);
    acc = _mm512_mask_add_ps(acc, k, acc, e);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float sum = 0.f;
  int64_t i = 0;
#ifdef PERFXLM_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = perfxlm_attn::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  for (float l : lanes) sum += l;
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
#endif
}

// s[h * ns + j] = q_h . row_j for kHeadTile heads (q, rows Dp apart) and kTokenTile rows.
inline void score_tile(const float* q, const float* rows, int64_t Dp, float* s, int64_t ns) {
  vec::V acc[kHeadTile][kTokenTile];
  for (int h = 0; h < kHeadTile; ++h)
    for (int j = 0; j < kTokenTile; ++j) acc[h][j] = vec::zero();
  for (int64_t d = 0; d < Dp; d += 16) {
    vec::V r[kTokenTile];
    for (int j = 0; j < kTokenTile; ++j) r[j] = vec::load(rows + j * Dp + d);
    for (int h = 0; h < kHeadTile; ++h) {
      const vec::V qh = vec::load(q + h * Dp + d);
      for (int j = 0; j < kTokenTile; ++j) acc[h][j] = vec::fmadd(qh, r[j], acc[h][j]);
    }
  }
  for (int h = 0; h < kHeadTile; ++h)
    for (int j = 0; j < kTokenTile; ++j) s[h * ns + j] = vec::reduce_add(acc[h][j]);
}

// o_h[c0, c0 + 16 kValueChunks) += sum_j p[h * np + j] row_j[...] for kHeadTile heads (o rows Lp apart).
inline void value_tile(const float* p, int64_t np, const float* rows, int64_t Dp, int64_t n, int64_t c0, float* o,
                       int64_t Lp) {
  vec::V acc[kHeadTile][kValueChunks];
  for (int h = 0; h < kHeadTile; ++h)
    for (int c = 0; c < kValueChunks; ++c) acc[h][c] = vec::load(o + h * Lp + c0 + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    vec::V pv[kHeadTile];
    for (int h = 0; h < kHeadTile; ++h) pv[h] = vec::set1(p[h * np + j]);
    for (int c = 0; c < kValueChunks; ++c) {
      const vec::V r = vec::load(rows + j * Dp + c0 + 16 * c);
      for (int h = 0; h < kHeadTile; ++h) acc[h][c] = vec::fmadd(pv[h], r, acc[h][c]);
    }
  }
  for (int h = 0; h < kHeadTile; ++h)
    for (int c = 0; c < kValueChunks; ++c) vec::store(o + h * Lp + c0 + 16 * c, acc[h][c]);
}

// y[0, n) += a x[0, n): a row of an absorbed matrix (float32 or bf16 bits) into a float32 accumulator.
template <typename W>
inline void axpy(float* y, float a, const W* x, int64_t n) {
  const vec::V av = vec::set1(a);
  for (int64_t i = 0; i < n; i += 16) vec::store(y + i, vec::fmadd(av, vec::load(x + i, n - i), vec::load(y + i, n - i)), n - i);
}

struct Task {
  int64_t b, t0, t1;
  int64_t part;  // its slot among the partial results, or -1: the range is the whole sequence
};

struct Shape {
  int64_t B, H, Hp, N, R, L, V, D, Dp, Lp, block_size, max_blocks, groups;
};

template <typename T, typename W>
void mla_decode_impl(const float* query, const T* cache, const ScaleT<T>* scales, const int64_t* tables,
                     const int64_t* seq_lens, const W* w_uk, const W* w_uv_t, float scale, const Shape& sh,
                     float* out) {
  const int64_t B = sh.B, H = sh.H, Hp = sh.Hp, N = sh.N, R = sh.R, L = sh.L, V = sh.V, D = sh.D, Dp = sh.Dp,
                Lp = sh.Lp;
  // 1. The absorbed, pre-scaled queries [B, Hp, Dp]: scale [q_nope W_UK[h], q_pe], zeros past D and for
  // the padding heads (their scores are never used).
  std::vector<float> qa(static_cast<size_t>(B * Hp * Dp), 0.f);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, h = i % H;
      const float* q = query + i * (N + R);
      float* dst = qa.data() + (b * Hp + h) * Dp;
      for (int64_t n = 0; n < N; ++n) axpy(dst, q[n], w_uk + (h * N + n) * L, L);
      for (int64_t l = 0; l < L; ++l) dst[l] *= scale;
      for (int64_t r = 0; r < R; ++r) dst[L + r] = q[N + r] * scale;
    }
  });

  // 2. Attention over the latent rows: tasks of (sequence, token range).
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  auto range_of = [&](int64_t n) { return std::clamp<int64_t>(n / (4 * threads) + 1, kMinRange, kMaxRange); };
  std::vector<Task> tasks;
  std::vector<int64_t> first_part(static_cast<size_t>(B), -1), splits_of(static_cast<size_t>(B), 0);
  int64_t parts = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = seq_lens[b];
    if (n <= 0) continue;  // nothing to attend to: zeros
    const int64_t splits = (n + range_of(n) - 1) / range_of(n);
    splits_of[b] = splits;
    if (splits > 1) first_part[b] = parts;
    for (int64_t i = 0; i < splits; ++i) tasks.push_back({b, i * n / splits, (i + 1) * n / splits, splits > 1 ? parts++ : -1});
  }
  // the attention output per head in the latent space [B, H, Lp] (normalised), and the ranges' partial
  // results: unnormalised output [Lp], then the running max and sum, per head
  std::vector<float> latent(static_cast<size_t>(B * H * Lp), 0.f);
  const int64_t part_stride = H * (Lp + 2);
  std::vector<float> partial(static_cast<size_t>(parts * part_stride));
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buf;
    const size_t need = static_cast<size_t>(kChunk * Dp + Hp * kChunk + Hp * Lp + 2 * H);
    if (buf.size() < need) buf.resize(need);
    float* rows = buf.data();  // the chunk's widened rows [kChunk, Dp]
    float* s = rows + kChunk * Dp;  // scores, then weights [Hp, kChunk]
    float* o = s + Hp * kChunk;  // running unnormalised outputs [Hp, Lp]
    float* mx = o + Hp * Lp;
    float* sum = mx + H;
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[static_cast<size_t>(i)];
      const float* q = qa.data() + task.b * Hp * Dp;
      const int64_t* table = tables + task.b * sh.max_blocks;
      std::fill(o, o + Hp * Lp, 0.f);
      std::fill(mx, mx + H, -std::numeric_limits<float>::infinity());
      std::fill(sum, sum + H, 0.f);
      for (int64_t t0 = task.t0; t0 < task.t1; t0 += kChunk) {
        const int64_t n = std::min(kChunk, task.t1 - t0), np = round_up(n, kTokenTile);
        for (int64_t j = 0; j < n; ++j) widen_row(cache, scales, table, t0 + j, sh.block_size, D, sh.groups, Dp, rows + j * Dp);
        std::fill(rows + n * Dp, rows + np * Dp, 0.f);  // a tile's padding rows
        for (int64_t h = 0; h < Hp; h += kHeadTile)
          for (int64_t j = 0; j < np; j += kTokenTile) score_tile(q + h * Dp, rows + j * Dp, Dp, s + h * kChunk + j, kChunk);
        for (int64_t h = 0; h < Hp; ++h) {
          float* sh_ = s + h * kChunk;
          if (h >= H) {  // a padding head: no weight
            std::fill(sh_, sh_ + np, 0.f);
            continue;
          }
          float m = mx[h];
          for (int64_t j = 0; j < n; ++j) m = std::max(m, sh_[j]);
          const float alpha = std::exp(mx[h] - m);  // 0 at the first chunk (max -inf)
          if (alpha != 1.f) {
            for (int64_t l = 0; l < Lp; ++l) o[h * Lp + l] *= alpha;
          }
          sum[h] = sum[h] * alpha + exp_sum(sh_, n, m);
          mx[h] = m;
          std::fill(sh_ + n, sh_ + np, 0.f);
        }
        for (int64_t h = 0; h < Hp; h += kHeadTile)
          for (int64_t c0 = 0; c0 < Lp; c0 += 16 * kValueChunks)
            value_tile(s + h * kChunk, kChunk, rows, Dp, n, c0, o + h * Lp, Lp);
      }
      if (task.part < 0) {
        float* dst = latent.data() + task.b * H * Lp;
        for (int64_t h = 0; h < H; ++h) {
          const float inv = 1.f / sum[h];
          for (int64_t l = 0; l < L; ++l) dst[h * Lp + l] = o[h * Lp + l] * inv;
        }
      } else {
        float* dst = partial.data() + task.part * part_stride;
        for (int64_t h = 0; h < H; ++h) {
          std::copy(o + h * Lp, o + h * Lp + L, dst + h * (Lp + 2));
          dst[h * (Lp + 2) + Lp] = mx[h];
          dst[h * (Lp + 2) + Lp + 1] = sum[h];
        }
      }
    }
  });

  // 3. Per head: merge the ranges (out = sum_i e^(m_i - M) o_i / sum_i e^(m_i - M) l_i), then W_UV.
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, h = i % H;
      float* lat = latent.data() + i * Lp;
      if (first_part[b] >= 0) {
        const float* p0 = partial.data() + first_part[b] * part_stride + h * (Lp + 2);
        float top = -std::numeric_limits<float>::infinity(), total = 0.f;
        for (int64_t j = 0; j < splits_of[b]; ++j) top = std::max(top, p0[j * part_stride + Lp]);
        for (int64_t j = 0; j < splits_of[b]; ++j) {
          const float* pj = p0 + j * part_stride;
          const float w = std::exp(pj[Lp] - top);
          total += w * pj[Lp + 1];
          for (int64_t l = 0; l < L; ++l) lat[l] += w * pj[l];
        }
        const float inv = 1.f / total;
        for (int64_t l = 0; l < L; ++l) lat[l] *= inv;
      }
      float* dst = out + i * V;
      std::fill(dst, dst + V, 0.f);
      for (int64_t l = 0; l < L; ++l) axpy(dst, lat[l], w_uv_t + (h * L + l) * V, V);
    }
  });
}

template <typename T>
const T* ptr(const at::Tensor& t) { return reinterpret_cast<const T*>(t.const_data_ptr()); }

}  // namespace

// query float32 [B, H, N + R] (the rope part rotated), cache [num_blocks, block_size, 1, L + R] (float32,
// bf16, int8 or fp8, with `scales` [num_blocks, block_size, 1, groups] for a quantized one), w_uk
// [H, N, L] and w_uv_t [H, L, V] (float32 or bf16, one dtype) -> float32 [B, H, V].
at::Tensor mla_decode_attention(const at::Tensor& query, const at::Tensor& cache, const c10::optional<at::Tensor>& scales,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& w_uk,
                                const at::Tensor& w_uv_t, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat, "query must be float32 [B, H, nope + rope]");
  TORCH_CHECK(cache.dim() == 4 && cache.size(2) == 1 && cache.is_contiguous(),
              "the latent cache must be contiguous [num_blocks, block_size, 1, kv_lora_rank + rope]");
  TORCH_CHECK(w_uk.dim() == 3 && w_uv_t.dim() == 3 && w_uk.is_contiguous() && w_uv_t.is_contiguous() &&
                  w_uk.scalar_type() == w_uv_t.scalar_type() &&
                  (w_uk.scalar_type() == at::kFloat || w_uk.scalar_type() == at::kBFloat16),
              "w_uk [H, nope, rank] and w_uv_t [H, rank, v] must be contiguous, both float32 or both bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong && block_tables.dim() == 2,
              "block_tables and seq_lens must be int64");
  Shape sh{};
  sh.B = query.size(0), sh.H = query.size(1), sh.N = w_uk.size(1), sh.L = w_uk.size(2), sh.V = w_uv_t.size(2);
  sh.R = query.size(2) - sh.N, sh.D = cache.size(3);
  TORCH_CHECK(w_uk.size(0) == sh.H && w_uv_t.size(0) == sh.H && w_uv_t.size(1) == sh.L,
              "w_uk [H, nope, rank] and w_uv_t [H, rank, v] must match the query's ", sh.H, " heads and each other");
  TORCH_CHECK(sh.R >= 0 && sh.D == sh.L + sh.R, "cache rows (", sh.D, ") must be kv_lora_rank (", sh.L,
              ") + the query's rope part (", sh.R, ")");
  TORCH_CHECK(block_tables.size(0) == sh.B && seq_lens.numel() == sh.B, "one block table and length per sequence");
  sh.Hp = round_up(sh.H, kHeadTile);
  sh.Lp = round_up(sh.L, 16 * kValueChunks);
  sh.Dp = std::max(round_up(sh.D, 16), sh.Lp);
  sh.block_size = cache.size(1), sh.max_blocks = block_tables.size(1);
  const at::Tensor q = query.contiguous(), tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  {  // O(blocks) checks: bad metadata fails here instead of reading out of bounds
    const int64_t* lp = lens.data_ptr<int64_t>();
    const int64_t* tp = tables.data_ptr<int64_t>();
    for (int64_t b = 0; b < sh.B; ++b) {
      TORCH_CHECK(lp[b] >= 0 && lp[b] <= sh.max_blocks * sh.block_size, "seq_lens[", b, "] = ", lp[b],
                  " does not fit its block table (", sh.max_blocks, " blocks of ", sh.block_size, ")");
      for (int64_t j = 0; j < (lp[b] + sh.block_size - 1) / sh.block_size; ++j)
        TORCH_CHECK(tp[b * sh.max_blocks + j] >= 0 && tp[b * sh.max_blocks + j] < cache.size(0), "block id ",
                    tp[b * sh.max_blocks + j], " out of range for ", cache.size(0), " cache blocks");
    }
  }
  const auto dtype = cache.scalar_type();
  const bool fp8 = dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2;
  const bool has_scales = scales.has_value() && scales->defined();
  if (dtype == at::kChar || fp8) {
    TORCH_CHECK(has_scales, "a quantized (", dtype, ") latent cache needs its scales");
    const at::Tensor& s = *scales;
    TORCH_CHECK(s.scalar_type() == (fp8 ? at::kByte : at::kFloat) && s.is_contiguous() && s.dim() == 4 &&
                    s.size(0) == cache.size(0) && s.size(1) == cache.size(1) && s.size(2) == 1 && s.size(3) >= 1 &&
                    sh.D % s.size(3) == 0,
                "scales must be contiguous [num_blocks, block_size, 1, groups], groups dividing the row");
    sh.groups = s.size(3);
  } else {
    TORCH_CHECK(!has_scales, "scales given for a latent cache that is not quantized");
  }
  at::Tensor out = at::empty({sh.B, sh.H, sh.V}, query.options());
  auto run = [&](auto cache_tag, auto weight_tag) {
    using T = decltype(cache_tag);
    using W = decltype(weight_tag);
    const auto* sc = sh.groups ? reinterpret_cast<const ScaleT<T>*>(scales->const_data_ptr()) : nullptr;
    mla_decode_impl<T, W>(q.data_ptr<float>(), ptr<T>(cache), sc, tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                          ptr<W>(w_uk), ptr<W>(w_uv_t), static_cast<float>(scale), sh, out.data_ptr<float>());
  };
  auto by_weight = [&](auto cache_tag) {
    if (w_uk.scalar_type() == at::kFloat)
      run(cache_tag, float{});
    else
      run(cache_tag, uint16_t{});
  };
  switch (dtype) {
    case at::kFloat: by_weight(float{}); break;
    case at::kBFloat16: by_weight(uint16_t{}); break;
    case at::kChar: by_weight(int8_t{}); break;
    case at::kFloat8_e4m3fn: by_weight(c10::Float8_e4m3fn{}); break;
    case at::kFloat8_e5m2: by_weight(c10::Float8_e5m2{}); break;
    default: TORCH_CHECK(false, "latent cache dtype must be float32, bfloat16, int8, float8_e4m3fn or float8_e5m2");
  }
  return out;
}

}  // namespace perfxlm_mla

TORCH_LIBRARY_FRAGMENT(perfxlm, m) {
  m.def(
      "mla_decode_attention(Tensor query, Tensor cache, Tensor? scales, Tensor block_tables, Tensor seq_lens, "
      "Tensor w_uk, Tensor w_uv_t, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(perfxlm, CPU, m) { m.impl("mla_decode_attention", &perfxlm_mla::mla_decode_attention); }
