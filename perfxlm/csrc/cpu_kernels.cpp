// CPU kernels for the two places where the profile shows PyTorch's own ops fall short:
//
// 1. linear_bf16w: y = x W^T (+ b) with x float32 and W stored as bfloat16, accumulated in float32.
//    Decode is bound by reading the weights; on CPUs without native bf16 math torch's bf16 matmul is
//    emulated (slower than float32), so this reads half the bytes of a float32 GEMV and widens each
//    weight in registers. Meant for small M (decode); large M goes through a float32 GEMM in Python.
// 2. paged_decode_attention: one query token per sequence over the paged KV cache, all query heads
//    of a KV group together, reading K/V in place through the block table (no gather into a
//    contiguous copy), float32 or bfloat16 cache, sliding window and logit soft-capping.
//
// The plain-torch references are perfxlm/ops/reference.py; tests compare the two on random inputs.
// Built at first use by torch.utils.cpp_extension (see perfxlm/ops/native.py) with -march=native:
// the AVX-512 paths compile where the CPU has it, the portable loops elsewhere.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PERFXLM_AVX512 1
#endif

namespace {

inline float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float load_scalar(const float* p) { return *p; }
inline float load_scalar(const uint16_t* p) { return bf16_to_float(*p); }

#ifdef PERFXLM_AVX512
// 16 lanes from float32 or bfloat16 memory; `mask` selects the lanes of a tail.
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const uint16_t* p, __mmask16 mask) {
  __m256i half = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}
#endif

// ---------------------------------------------------------------------------------------------
// linear_bf16w
// ---------------------------------------------------------------------------------------------

// An MT x NT tile of outputs: MT rows of x against NT rows of W, each a K-long dot product.
template <int MT, int NT>
inline void dot_tile(const float* x, const uint16_t* w, int64_t K, int64_t N, float* y, const float* bias) {
#ifdef PERFXLM_AVX512
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NT];
    for (int j = 0; j < NT; ++j) {
      // The slab after this one streams in while this one computes (decode is bound by this read).
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + NT) * K + k), _MM_HINT_T0);
      wv[j] = load16(w + j * K + k, 0xFFFF);
    }
    for (int i = 0; i < MT; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * K + k);
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {
    const __mmask16 mask = tail_mask(K - k);
    __m512 wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = load16(w + j * K + k, mask);
    for (int i = 0; i < MT; ++i) {
      const __m512 xv = load16(x + i * K + k, mask);
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) y[i * N + j] = _mm512_reduce_add_ps(acc[i][j]) + (bias ? bias[j] : 0.f);
#else
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) {
      float acc = 0.f;
      const float* xr = x + i * K;
      const uint16_t* wr = w + j * K;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < K; ++k) acc += xr[k] * bf16_to_float(wr[k]);
      y[i * N + j] = acc + (bias ? bias[j] : 0.f);
    }
#endif
}

template <int NT>
inline void rows_against_block(const float* x, int64_t M, const uint16_t* w, int64_t K, int64_t N, float* y,
                               const float* bias) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dot_tile<4, NT>(x + m * K, w, K, N, y + m * N, bias);
  switch (M - m) {
    case 3: dot_tile<3, NT>(x + m * K, w, K, N, y + m * N, bias); break;
    case 2: dot_tile<2, NT>(x + m * K, w, K, N, y + m * N, bias); break;
    case 1: dot_tile<1, NT>(x + m * K, w, K, N, y + m * N, bias); break;
    default: break;
  }
}

at::Tensor linear_bf16w(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_bf16w: x must be a 2-D float32 tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "linear_bf16w: w must be a 2-D bfloat16 tensor");
  TORCH_CHECK(x.size(1) == w.size(1), "linear_bf16w: x has ", x.size(1), " features, w expects ", w.size(1));
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = w.contiguous();
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == w.size(0), "linear_bf16w: bias size ", bias->numel(), " != ", w.size(0));
    bc = bias->to(at::kFloat).contiguous();
  }
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  constexpr int64_t NT = 4;
  const int64_t blocks = (N + NT - 1) / NT;
  // Each task reads a slab of W once and applies it to every row of x (x stays in cache).
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * NT;
      const int64_t nt = std::min<int64_t>(NT, N - n);
      const float* bn = bp ? bp + n : nullptr;
      switch (nt) {
        case 4: rows_against_block<4>(xp, M, wp + n * K, K, N, yp + n, bn); break;
        case 3: rows_against_block<3>(xp, M, wp + n * K, K, N, yp + n, bn); break;
        case 2: rows_against_block<2>(xp, M, wp + n * K, K, N, yp + n, bn); break;
        default: rows_against_block<1>(xp, M, wp + n * K, K, N, yp + n, bn); break;
      }
    }
  });
  return y;
}

// ---------------------------------------------------------------------------------------------
// paged_decode_attention
// ---------------------------------------------------------------------------------------------

template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
#ifdef PERFXLM_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 mask = tail_mask(D - d);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, q + d), load16(k + d, mask), acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float acc = 0.f;
  for (int64_t d = 0; d < D; ++d) acc += q[d] * load_scalar(k + d);
  return acc;
#endif
}

template <typename T>
inline void axpy(float a, const T* v, float* out, int64_t D) {
#ifdef PERFXLM_AVX512
  const __m512 av = _mm512_set1_ps(a);
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 mask = tail_mask(D - d);
    const __m512 o = _mm512_maskz_loadu_ps(mask, out + d);
    _mm512_mask_storeu_ps(out + d, mask, _mm512_fmadd_ps(av, load16(v + d, mask), o));
  }
#else
  for (int64_t d = 0; d < D; ++d) out[d] += a * load_scalar(v + d);
#endif
}

#ifdef PERFXLM_AVX512
// One query head against tokens [first, len) of one sequence, head_dim = 16 * DV: the query and the
// output accumulator live in registers; K/V rows of the sequence stay in L2 across the G heads.
template <typename T, int DV>
void head_scores(const float* q, const T* cache, const int64_t* table, int64_t first, int64_t len,
                 int64_t block_size, int64_t block_stride, int64_t token_stride, float scale, float* s) {
  __m512 qv[DV];
  for (int c = 0; c < DV; ++c) qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * c), _mm512_set1_ps(scale));
  for (int64_t t = first; t < len;) {
    const int64_t blk = t / block_size;
    const int64_t stop = std::min(len, (blk + 1) * block_size);
    const T* k = cache + table[blk] * block_stride + (t % block_size) * token_stride;
    for (; t < stop; ++t, k += token_stride) {
      __m512 acc = _mm512_mul_ps(qv[0], load16(k, 0xFFFF));
      for (int c = 1; c < DV; ++c) acc = _mm512_fmadd_ps(qv[c], load16(k + 16 * c, 0xFFFF), acc);
      s[t - first] = _mm512_reduce_add_ps(acc);
    }
  }
}

template <typename T, int DV>
void head_values(const float* p, const T* cache, const int64_t* table, int64_t first, int64_t len,
                 int64_t block_size, int64_t block_stride, int64_t token_stride, float* o) {
  __m512 acc[DV];
  for (int c = 0; c < DV; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t t = first; t < len;) {
    const int64_t blk = t / block_size;
    const int64_t stop = std::min(len, (blk + 1) * block_size);
    const T* v = cache + table[blk] * block_stride + (t % block_size) * token_stride;
    for (; t < stop; ++t, v += token_stride) {
      const __m512 pv = _mm512_set1_ps(p[t - first]);
      for (int c = 0; c < DV; ++c) acc[c] = _mm512_fmadd_ps(pv, load16(v + 16 * c, 0xFFFF), acc[c]);
    }
  }
  for (int c = 0; c < DV; ++c) _mm512_storeu_ps(o + 16 * c, acc[c]);
}
#endif

inline void softmax_inplace(float* s, int64_t n, float cap) {
  if (cap > 0)
    for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}

template <typename T>
void decode_attention_impl(const float* query, const T* key_cache, const T* value_cache, const int64_t* tables,
                           const int64_t* seq_lens, float* out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                           int64_t block_size, int64_t max_blocks, double scale, int64_t window, double soft_cap) {
  const int64_t G = H / KVH;
  const int64_t token_stride = KVH * D;  // between slots of one block
  const int64_t block_stride = block_size * token_stride;
  const float scale_f = static_cast<float>(scale);
  const float cap = static_cast<float>(soft_cap);
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t len = seq_lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int64_t* table = tables + b * max_blocks;
      const float* q = query + (b * H + h * G) * D;  // the G query heads of this KV head
      float* o = out + (b * H + h * G) * D;
      std::fill(o, o + G * D, 0.f);
      if (n <= 0) continue;
      scores.resize(static_cast<size_t>(G * n));
      float* sc = scores.data();
#ifdef PERFXLM_AVX512
      if (D == 64 || D == 128 || D == 256) {
        const T* kc = key_cache + h * D;
        const T* vc = value_cache + h * D;
        for (int64_t g = 0; g < G; ++g) {
          float* s = sc + g * n;
          switch (D) {
            case 64: head_scores<T, 4>(q + g * D, kc, table, first, len, block_size, block_stride, token_stride, scale_f, s); break;
            case 128: head_scores<T, 8>(q + g * D, kc, table, first, len, block_size, block_stride, token_stride, scale_f, s); break;
            default: head_scores<T, 16>(q + g * D, kc, table, first, len, block_size, block_stride, token_stride, scale_f, s); break;
          }
          softmax_inplace(s, n, cap);
          switch (D) {
            case 64: head_values<T, 4>(s, vc, table, first, len, block_size, block_stride, token_stride, o + g * D); break;
            case 128: head_values<T, 8>(s, vc, table, first, len, block_size, block_stride, token_stride, o + g * D); break;
            default: head_values<T, 16>(s, vc, table, first, len, block_size, block_stride, token_stride, o + g * D); break;
          }
        }
        continue;
      }
#endif
      // Any head_dim: pass 1 scores[g][token], walking the block table (no per-token division).
      for (int64_t t = first; t < len;) {
        const int64_t blk = t / block_size, slot0 = t % block_size;
        const int64_t stop = std::min(len, (blk + 1) * block_size);
        const T* k = key_cache + table[blk] * block_stride + slot0 * token_stride + h * D;
        for (; t < stop; ++t, k += token_stride) {
          for (int64_t g = 0; g < G; ++g) sc[g * n + (t - first)] = dot(q + g * D, k, D) * scale_f;
        }
      }
      for (int64_t g = 0; g < G; ++g) softmax_inplace(sc + g * n, n, cap);
      // Pass 2: out[g] = sum_t p[g][t] v_t.
      for (int64_t t = first; t < len;) {
        const int64_t blk = t / block_size, slot0 = t % block_size;
        const int64_t stop = std::min(len, (blk + 1) * block_size);
        const T* v = value_cache + table[blk] * block_stride + slot0 * token_stride + h * D;
        for (; t < stop; ++t, v += token_stride) {
          for (int64_t g = 0; g < G; ++g) axpy(sc[g * n + (t - first)], v, o + g * D, D);
        }
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t sliding_window, double soft_cap) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat, "query must be float32 [B, H, D]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "caches must be [num_blocks, block_size, num_kv_heads, head_dim], both the same shape");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "key and value caches differ in dtype");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t KVH = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D, "head_dim of query (", D, ") and cache (", key_cache.size(3), ") differ");
  TORCH_CHECK(H % KVH == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.numel() == B, "one block table and length per sequence");
  const at::Tensor q = query.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  at::Tensor out = at::empty_like(q);
  const int64_t block_size = key_cache.size(1), max_blocks = tables.size(1);
  if (key_cache.scalar_type() == at::kFloat) {
    decode_attention_impl<float>(q.data_ptr<float>(), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
                                 tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H,
                                 KVH, D, block_size, max_blocks, scale, sliding_window, soft_cap);
  } else {
    TORCH_CHECK(key_cache.scalar_type() == at::kBFloat16, "cache dtype must be float32 or bfloat16");
    decode_attention_impl<uint16_t>(
        q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(key_cache.data_ptr<at::BFloat16>()),
        reinterpret_cast<const uint16_t*>(value_cache.data_ptr<at::BFloat16>()), tables.data_ptr<int64_t>(),
        lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH, D, block_size, max_blocks, scale,
        sliding_window, soft_cap);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(perfxlm, m) {
  m.def("linear_bf16w(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int sliding_window, float soft_cap) -> Tensor");
}

TORCH_LIBRARY_IMPL(perfxlm, CPU, m) {
  m.impl("linear_bf16w", &linear_bf16w);
  m.impl("paged_decode_attention", &paged_decode_attention);
}
