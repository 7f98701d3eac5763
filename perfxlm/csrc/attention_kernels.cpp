// The KV cache kernels: writing new tokens into their slots (quantizing for an int8 / fp8 cache) and
// decode attention reading the paged cache in place through the block table (no gather into a
// contiguous copy), float32 or bfloat16 cache, or a quantized one (int8 with float32 group scales
// beside the blocks, fp8 e4m3 / e5m2) dequantized in registers; sliding window and logit soft-capping.
//
// The plain-torch references are perfxlm/ops/attention.py's torch paths and perfxlm/ops/reference.py.

#include "attention_kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PERFXLM_AVX512 1  // the attention kernels' zmm paths
#endif

namespace perfxlm_attn {
namespace {

inline float load_scalar(const float* p) { return *p; }
inline float load_scalar(const uint16_t* p) { return static_cast<float>(c10::BFloat16(*p, c10::BFloat16::from_bits())); }
inline float load_scalar(const int8_t* p) { return static_cast<float>(*p); }
inline float load_scalar(const c10::Float8_e4m3fn* p) { return static_cast<float>(*p); }
inline float load_scalar(const c10::Float8_e5m2* p) { return static_cast<float>(*p); }

#ifdef PERFXLM_AVX512
// 16 lanes from float32 or bfloat16 memory; `mask` selects the lanes of a tail.
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const uint16_t* p, __mmask16 mask) {
  __m256i half = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 load16(const int8_t* p, __mmask16 mask) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
}
// fp8 widened through fp16 (vcvtph2ps): e5m2 is the high byte of an fp16; e4m3's exponent and mantissa
// bits placed in an fp16 give the value times 2^-8 (subnormals included), so one exact multiply restores it.
inline __m512 load16(const c10::Float8_e5m2* p, __mmask16 mask) {
  const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(mask, p)), 8);
  return _mm512_cvtph_ps(h);
}
inline __m512 load16(const c10::Float8_e4m3fn* p, __mmask16 mask) {
  const __m256i x = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(mask, p));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8);
  const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7F)), 7);
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, mag)), _mm512_set1_ps(256.f));
}
inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}
#endif

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch's conversion
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
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
//
// An int8 cache has `groups` float32 scales per token and KV head (`scales` points at this head's in
// slot 0; s_block_stride / s_token_stride step them like the values): with one group the scale
// multiplies the score (K) or the softmax weight (V) once per token; with several, each 16-lane chunk
// takes its group's scale. fp8 and float caches pass no scales.
template <typename T, int DV>
void head_scores(const float* q, const T* cache, const float* scales, const int64_t* table, int64_t first, int64_t len,
                 int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t s_block_stride,
                 int64_t s_token_stride, int64_t groups, float scale, float* s) {
  __m512 qv[DV];
  for (int c = 0; c < DV; ++c) qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * c), _mm512_set1_ps(scale));
  const int64_t cpg = groups > 0 ? DV / groups : DV;  // 16-lane chunks per scale group
  for (int64_t t = first; t < len;) {
    const int64_t blk = t / block_size;
    const int64_t stop = std::min(len, (blk + 1) * block_size);
    const T* k = cache + table[blk] * block_stride + (t % block_size) * token_stride;
    if (scales == nullptr) {
      for (; t < stop; ++t, k += token_stride) {
        __m512 acc = _mm512_mul_ps(qv[0], load16(k, 0xFFFF));
        for (int c = 1; c < DV; ++c) acc = _mm512_fmadd_ps(qv[c], load16(k + 16 * c, 0xFFFF), acc);
        s[t - first] = _mm512_reduce_add_ps(acc);
      }
      continue;
    }
    const float* ks = scales + table[blk] * s_block_stride + (t % block_size) * s_token_stride;
    for (; t < stop; ++t, k += token_stride, ks += s_token_stride) {
      if (groups == 1) {
        __m512 acc = _mm512_mul_ps(qv[0], load16(k, 0xFFFF));
        for (int c = 1; c < DV; ++c) acc = _mm512_fmadd_ps(qv[c], load16(k + 16 * c, 0xFFFF), acc);
        s[t - first] = _mm512_reduce_add_ps(acc) * ks[0];
      } else {
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < DV; ++c)
          acc = _mm512_fmadd_ps(_mm512_mul_ps(qv[c], _mm512_set1_ps(ks[c / cpg])), load16(k + 16 * c, 0xFFFF), acc);
        s[t - first] = _mm512_reduce_add_ps(acc);
      }
    }
  }
}

template <typename T, int DV>
void head_values(const float* p, const T* cache, const float* scales, const int64_t* table, int64_t first, int64_t len,
                 int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t s_block_stride,
                 int64_t s_token_stride, int64_t groups, float* o) {
  __m512 acc[DV];
  for (int c = 0; c < DV; ++c) acc[c] = _mm512_setzero_ps();
  const int64_t cpg = groups > 0 ? DV / groups : DV;
  for (int64_t t = first; t < len;) {
    const int64_t blk = t / block_size;
    const int64_t stop = std::min(len, (blk + 1) * block_size);
    const T* v = cache + table[blk] * block_stride + (t % block_size) * token_stride;
    if (scales == nullptr) {
      for (; t < stop; ++t, v += token_stride) {
        const __m512 pv = _mm512_set1_ps(p[t - first]);
        for (int c = 0; c < DV; ++c) acc[c] = _mm512_fmadd_ps(pv, load16(v + 16 * c, 0xFFFF), acc[c]);
      }
      continue;
    }
    const float* vs = scales + table[blk] * s_block_stride + (t % block_size) * s_token_stride;
    for (; t < stop; ++t, v += token_stride, vs += s_token_stride) {
      const float pt = p[t - first];
      if (groups == 1) {
        const __m512 pv = _mm512_set1_ps(pt * vs[0]);
        for (int c = 0; c < DV; ++c) acc[c] = _mm512_fmadd_ps(pv, load16(v + 16 * c, 0xFFFF), acc[c]);
      } else {
        for (int c = 0; c < DV; ++c)
          acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(pt * vs[c / cpg]), load16(v + 16 * c, 0xFFFF), acc[c]);
      }
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

// `k_scales` / `v_scales`: an int8 cache's [num_blocks, block_size, KVH, groups] float32 scales, else
// nullptr (groups 0).
template <typename T>
void decode_attention_impl(const float* query, const T* key_cache, const T* value_cache, const int64_t* tables,
                           const int64_t* seq_lens, float* out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                           int64_t block_size, int64_t max_blocks, double scale, int64_t window, double soft_cap,
                           const float* k_scales = nullptr, const float* v_scales = nullptr, int64_t groups = 0) {
  const int64_t G = H / KVH;
  const int64_t token_stride = KVH * D;  // between slots of one block
  const int64_t block_stride = block_size * token_stride;
  const int64_t s_token_stride = KVH * groups, s_block_stride = block_size * s_token_stride;
  const int64_t GS = groups > 0 ? D / groups : D;  // values per scale
  const float scale_f = static_cast<float>(scale);
  const float cap = static_cast<float>(soft_cap);
#ifdef PERFXLM_AVX512
  if ((D == 64 || D == 128 || D == 256) && GS % 16 == 0) {
    // One task per query head (not per KV head): at batch 1 that is 9 tasks instead of 3 for two
    // threads. Consecutive heads share their KV head and land on the same thread, so K/V stay in L2.
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> scores;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / H, head = item % H, h = head / G;
        const int64_t len = seq_lens[b];
        const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        const int64_t n = len - first;
        const int64_t* table = tables + b * max_blocks;
        const float* q = query + (b * H + head) * D;
        float* o = out + (b * H + head) * D;
        if (n <= 0) {
          std::fill(o, o + D, 0.f);
          continue;
        }
        if (scores.size() < static_cast<size_t>(n)) scores.resize(static_cast<size_t>(n));
        float* s = scores.data();
        const T* kc = key_cache + h * D;
        const T* vc = value_cache + h * D;
        const float* ksc = k_scales ? k_scales + h * groups : nullptr;
        const float* vsc = v_scales ? v_scales + h * groups : nullptr;
#define PERFXLM_HEAD(DV)                                                                                   \
  head_scores<T, DV>(q, kc, ksc, table, first, len, block_size, block_stride, token_stride, s_block_stride, \
                     s_token_stride, groups, scale_f, s);                                                  \
  softmax_inplace(s, n, cap);                                                                             \
  head_values<T, DV>(s, vc, vsc, table, first, len, block_size, block_stride, token_stride, s_block_stride, \
                     s_token_stride, groups, o);
        switch (D) {
          case 64: PERFXLM_HEAD(4) break;
          case 128: PERFXLM_HEAD(8) break;
          default: PERFXLM_HEAD(16) break;
        }
#undef PERFXLM_HEAD
      }
    });
    return;
  }
#endif
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
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
      // Any head_dim: pass 1 scores[g][token], walking the block table (no per-token division).
      for (int64_t t = first; t < len;) {
        const int64_t blk = t / block_size, slot0 = t % block_size;
        const int64_t stop = std::min(len, (blk + 1) * block_size);
        const T* k = key_cache + table[blk] * block_stride + slot0 * token_stride + h * D;
        if (k_scales == nullptr) {
          for (; t < stop; ++t, k += token_stride) {
            for (int64_t g = 0; g < G; ++g) sc[g * n + (t - first)] = dot(q + g * D, k, D) * scale_f;
          }
          continue;
        }
        const float* ks = k_scales + table[blk] * s_block_stride + slot0 * s_token_stride + h * groups;
        for (; t < stop; ++t, k += token_stride, ks += s_token_stride) {
          for (int64_t g = 0; g < G; ++g) {
            float acc = 0.f;
            for (int64_t j = 0; j < groups; ++j) acc += dot(q + g * D + j * GS, k + j * GS, GS) * ks[j];
            sc[g * n + (t - first)] = acc * scale_f;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) softmax_inplace(sc + g * n, n, cap);
      // Pass 2: out[g] = sum_t p[g][t] v_t.
      for (int64_t t = first; t < len;) {
        const int64_t blk = t / block_size, slot0 = t % block_size;
        const int64_t stop = std::min(len, (blk + 1) * block_size);
        const T* v = value_cache + table[blk] * block_stride + slot0 * token_stride + h * D;
        if (v_scales == nullptr) {
          for (; t < stop; ++t, v += token_stride) {
            for (int64_t g = 0; g < G; ++g) axpy(sc[g * n + (t - first)], v, o + g * D, D);
          }
          continue;
        }
        const float* vs = v_scales + table[blk] * s_block_stride + slot0 * s_token_stride + h * groups;
        for (; t < stop; ++t, v += token_stride, vs += s_token_stride) {
          for (int64_t g = 0; g < G; ++g)
            for (int64_t j = 0; j < groups; ++j)
              axpy(sc[g * n + (t - first)] * vs[j], v + j * GS, o + g * D + j * GS, GS);
        }
      }
    }
  });
}

// An int8 cache's scales: float32 [num_blocks, block_size, num_kv_heads, groups], groups dividing head_dim.
int64_t check_scales(const at::Tensor& cache, const c10::optional<at::Tensor>& scales, const char* name) {
  const bool has = scales.has_value() && scales->defined();
  if (cache.scalar_type() != at::kChar) {
    TORCH_CHECK(!has, name, " given for a cache that is not int8");
    return 0;
  }
  TORCH_CHECK(has, "an int8 cache needs its ", name);
  const at::Tensor& s = *scales;
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 4 && s.size(0) == cache.size(0) &&
                  s.size(1) == cache.size(1) && s.size(2) == cache.size(2) && s.size(3) >= 1 &&
                  cache.size(3) % s.size(3) == 0,
              name, " must be contiguous float32 [num_blocks, block_size, num_kv_heads, groups], groups dividing head_dim");
  return s.size(3);
}

template <typename T>
const T* cache_ptr(const at::Tensor& t) { return reinterpret_cast<const T*>(t.const_data_ptr()); }

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t sliding_window, double soft_cap, const c10::optional<at::Tensor>& key_scale,
                                  const c10::optional<at::Tensor>& value_scale) {
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
  const int64_t block_size = key_cache.size(1), max_blocks = tables.size(1), num_blocks = key_cache.size(0);
  {  // O(blocks) checks, so bad metadata fails like the torch path's indexing instead of reading out of bounds
    const int64_t* lp = lens.data_ptr<int64_t>();
    const int64_t* tp = tables.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(lp[b] >= 0 && lp[b] <= max_blocks * block_size, "seq_lens[", b, "] = ", lp[b],
                  " does not fit its block table (", max_blocks, " blocks of ", block_size, ")");
      for (int64_t j = 0; j < (lp[b] + block_size - 1) / block_size; ++j)
        TORCH_CHECK(tp[b * max_blocks + j] >= 0 && tp[b * max_blocks + j] < num_blocks, "block id ",
                    tp[b * max_blocks + j], " out of range for ", num_blocks, " cache blocks");
    }
  }
  const int64_t groups = check_scales(key_cache, key_scale, "key_scale");
  TORCH_CHECK(check_scales(value_cache, value_scale, "value_scale") == groups, "key and value scales differ in shape");
  const float* ks = groups ? key_scale->data_ptr<float>() : nullptr;
  const float* vs = groups ? value_scale->data_ptr<float>() : nullptr;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    decode_attention_impl<T>(q.data_ptr<float>(), cache_ptr<T>(key_cache), cache_ptr<T>(value_cache),
                             tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH, D,
                             block_size, max_blocks, scale, sliding_window, soft_cap, ks, vs, groups);
  };
  switch (key_cache.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(uint16_t{}); break;
    case at::kChar: run(int8_t{}); break;
    case at::kFloat8_e4m3fn: run(c10::Float8_e4m3fn{}); break;
    case at::kFloat8_e5m2: run(c10::Float8_e5m2{}); break;
    default: TORCH_CHECK(false, "cache dtype must be float32, bfloat16, int8, float8_e4m3fn or float8_e5m2");
  }
  return out;
}

// Rows of `src` ([T, width] with row stride `src_stride`) into cache slots (rows of `width` elements),
// quantized as perfxlm/ops/kv_quant.py's quantize(): int8 per group of width / (heads * groups) values
// (scale = absmax / 127, round half to even; `scales` gets [slot, heads * groups]), fp8 saturated to its
// range and rounded to nearest even.
void write_slots(const float* src, int64_t src_stride, int64_t T, int64_t width, const int64_t* slots,
                 at::Tensor& cache, const c10::optional<at::Tensor>& scales) {
  const int64_t num_slots = cache.numel() / width;
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " out of range for ", num_slots, " slots");
  if (cache.scalar_type() == at::kFloat) {
    float* dst = cache.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) std::memcpy(dst + slots[t] * width, src + t * src_stride, width * sizeof(float));
  } else if (cache.scalar_type() == at::kChar) {
    const int64_t groups = check_scales(cache, scales, "scales");
    const int64_t per_slot = width / cache.size(3) * groups, gs = cache.size(3) / groups;  // scales per slot
    int8_t* dst = cache.data_ptr<int8_t>();
    float* sdst = scales->data_ptr<float>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g = 0; g < per_slot; ++g) {
        const float* x = src + t * src_stride + g * gs;
        float amax = 0.f;
        for (int64_t i = 0; i < gs; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float sc = amax / 127.f, div = sc == 0.f ? 1.f : sc;
        sdst[slots[t] * per_slot + g] = sc;
        int8_t* out = dst + slots[t] * width + g * gs;
        for (int64_t i = 0; i < gs; ++i)
          out[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[i] / div))));
      }
  } else if (cache.scalar_type() == at::kFloat8_e4m3fn || cache.scalar_type() == at::kFloat8_e5m2) {
    const bool e4m3 = cache.scalar_type() == at::kFloat8_e4m3fn;
    const float mx = e4m3 ? 448.f : 57344.f;
    uint8_t* dst = reinterpret_cast<uint8_t*>(cache.data_ptr());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < width; ++i) {
        const float x = std::min(mx, std::max(-mx, src[t * src_stride + i]));
        dst[slots[t] * width + i] = e4m3 ? c10::Float8_e4m3fn(x).x : c10::Float8_e5m2(x).x;
      }
  } else {
    uint16_t* dst = reinterpret_cast<uint16_t*>(cache.data_ptr<at::BFloat16>());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < width; ++i) dst[slots[t] * width + i] = float_to_bf16(src[t * src_stride + i]);
  }
}

// The module path's cache write for a quantized cache: float32 K/V [T, num_kv_heads, head_dim] into their
// slots, quantized in one pass (the same code as the fused layer's write).
void write_kv_slots(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                    const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& key_scale,
                    const c10::optional<at::Tensor>& value_scale) {
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat && key.dim() == 3 &&
                  key.sizes() == value.sizes(),
              "key and value must be float32 [T, num_kv_heads, head_dim]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 4 &&
                  key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2),
              "caches must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == key.size(0), "one int64 slot per token");
  const at::Tensor k = key.contiguous(), v = value.contiguous(), slots = slot_mapping.contiguous();
  const int64_t T = k.size(0), width = k.size(1) * k.size(2);
  write_slots(k.data_ptr<float>(), width, T, width, slots.data_ptr<int64_t>(), key_cache, key_scale);
  write_slots(v.data_ptr<float>(), width, T, width, slots.data_ptr<int64_t>(), value_cache, value_scale);
}
}  // namespace perfxlm_attn

TORCH_LIBRARY_FRAGMENT(perfxlm, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int sliding_window, float soft_cap, Tensor? key_scale=None, "
      "Tensor? value_scale=None) -> Tensor");
  m.def(
      "write_kv_slots(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
      "Tensor(c!)? key_scale=None, Tensor(d!)? value_scale=None) -> ()");
}

TORCH_LIBRARY_IMPL(perfxlm, CPU, m) {
  m.impl("paged_decode_attention", &perfxlm_attn::paged_decode_attention);
  m.impl("write_kv_slots", &perfxlm_attn::write_kv_slots);
}
