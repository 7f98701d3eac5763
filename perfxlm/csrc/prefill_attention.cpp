// prefill_attention_causal: causal attention of one sequence's new tokens over its own keys and, with
// cached context before them (prefix caching, chunked prefill), the paged cache's earlier blocks; GQA
// without repeating K/V; float32 or bfloat16 keys and values, float32 queries and output.
//
// Why: torch's SDPA ran a bf16 model's 512-token prefill at about a quarter of the linears' rate (~30 %
// of the prefill's time for ~7 % of its FLOPs). Here a task is one (KV head, block of 64 query
// positions); its rows are the G query heads of that KV head at each position (K/V read once for all
// G), walked R rows at a time against blocks of 64 keys in registers: scores, online softmax, then the
// rows' outputs += P V. Keys are first packed per KV head, transposed (a row of queries meets 16 keys
// per vector), with V beside them: float32 FMAs over widened keys (run), or over bf16 keys on AVX512-BF16
// builds vdpbf16ps on pairs (run_bf16: 2.31x torch's bf16 SDPA at 512 tokens against 1.57x for the
// float32 form, one thread's CPU time per call, loaded 2-vCPU Zen 4).
//
// Numerics: a query's output depends only on its own keys. Key blocks start at absolute positions 0, 64,
// 128, ... whatever the query block, a query's last block is the one holding its own position (query
// blocks are cut at multiples of 32, so no row of a task meets a block it sees nothing of), masked
// scores enter neither the max nor the sum, and every sum runs in one fixed order. So a row comes out
// the same alone, in a longer prompt, or after the same context read back from the cache (its keys
// rounded as the cache rounds them: the caller passes new keys in the cache's dtype).
//
// The plain-torch reference is perfxlm/ops/attention.py's SDPA path (prefill_attention_reference).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kv_elements.h"
#include "simd16.h"

namespace perfxlm_prefill_attn {
namespace {

constexpr int64_t BK = 64;  // keys per block (and query positions per task): 4 vectors of 16 scores

#if defined(PERFXLM_SIMD16) && defined(PERFXLM_AVX512) && defined(__AVX512BF16__)
#define PERFXLM_PREFILL_BF16 1  // bf16 keys and values take vdpbf16ps (run_bf16)
#endif

#if defined(PERFXLM_SIMD16) && defined(PERFXLM_AVX512)
constexpr int R = 4;  // rows per micro-tile: 4 x 4 score (or output) vectors of 32 zmm
#else
constexpr int R = 2;  // AVX2 (a vector is two ymm) and scalar builds: 2 x 4 vectors, 16 ymm
#endif

#ifdef PERFXLM_SIMD16
using simd16::V;
inline V vmax(V a, V b);
inline V vexp(V a);
inline float reduce_max(V a);
#if defined(PERFXLM_AVX512)
inline V vmax(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V vexp(V a) { return {perfxlm_attn::exp16(a.v)}; }
inline float reduce_max(V a) { return _mm512_reduce_max_ps(a.v); }
#else
inline V vmax(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V vexp(V a) { return {perfxlm_attn::exp8(a.lo), perfxlm_attn::exp8(a.hi)}; }
inline float reduce_max(V a) {
  float t[16];
  simd16::store(t, a);
  float m = t[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, t[i]);
  return m;
}
#endif
#endif

// Scores of R rows against one key block: s[r][j] = q_r . k_j (the scale is in q), j < 64.
// qs: R rows of D floats; kt: the block's keys transposed, D rows of `ld` floats.
inline void scores(const float* qs, int64_t D, const float* kt, int64_t ld, float* s) {
#ifdef PERFXLM_SIMD16
  V acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = simd16::zero();
  for (int64_t d = 0; d < D; ++d) {
    const float* row = kt + d * ld;
    const V k0 = simd16::load(row), k1 = simd16::load(row + 16), k2 = simd16::load(row + 32),
            k3 = simd16::load(row + 48);
    for (int r = 0; r < R; ++r) {
      const V q = simd16::set1(qs[r * D + d]);
      acc[r][0] = simd16::fmadd(q, k0, acc[r][0]);
      acc[r][1] = simd16::fmadd(q, k1, acc[r][1]);
      acc[r][2] = simd16::fmadd(q, k2, acc[r][2]);
      acc[r][3] = simd16::fmadd(q, k3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) simd16::store(s + r * BK + 16 * c, acc[r][c]);
#else
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < BK; ++j) {
      float a = 0.f;
      for (int64_t d = 0; d < D; ++d) a = std::fma(qs[r * D + d], kt[d * ld + j], a);
      s[r * BK + j] = a;
    }
#endif
}

// out[r][c0 .. c0 + 16 NV) += sum_j p[r][j] v[j][...] over the block's 64 keys, in key order.
template <int NV>
inline void accumulate(const float* p, const float* v, int64_t ldv, float* out, int64_t ldo) {
#ifdef PERFXLM_SIMD16
  V acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = simd16::load(out + r * ldo + 16 * c);
  for (int64_t j = 0; j < BK; ++j) {
    V vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = simd16::load(v + j * ldv + 16 * c);
    for (int r = 0; r < R; ++r) {
      const V w = simd16::set1(p[r * BK + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = simd16::fmadd(w, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) simd16::store(out + r * ldo + 16 * c, acc[r][c]);
#else
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < 16 * NV; ++c) {
      float a = out[r * ldo + c];
      for (int64_t j = 0; j < BK; ++j) a = std::fma(p[r * BK + j], v[j * ldv + c], a);
      out[r * ldo + c] = a;
    }
#endif
}

// The output's Dp columns (a multiple of 16) in register tiles: 64 columns at a time, then one tile of the
// 16-48 left; `tile(std::integral_constant<int, NV>, c)` accumulates NV x 16 columns from column c.
template <typename Tile>
inline void column_tiles(int64_t Dp, Tile&& tile) {
  int64_t c = 0;
  for (; c + 64 <= Dp; c += 64) tile(std::integral_constant<int, 4>{}, c);
  switch ((Dp - c) / 16) {
    case 3: tile(std::integral_constant<int, 3>{}, c); break;
    case 2: tile(std::integral_constant<int, 2>{}, c); break;
    case 1: tile(std::integral_constant<int, 1>{}, c); break;
    default: break;
  }
}

inline void accumulate_all(const float* p, const float* v, int64_t Dp, float* out) {
  column_tiles(Dp, [&](auto nv, int64_t c) { accumulate<decltype(nv)::value>(p, v + c, Dp, out + c, Dp); });
}

// Softmax statistics of one row's block: max over the visible keys (j < n), p = e^(s - max) with the
// hidden ones 0, and their sum, each in one fixed order. Returns the block's sum; `m` is updated and
// `factor` is what the row's earlier output and sum are scaled by.
inline float softmax_block(float* s, int64_t n, float& m, float& factor) {
  for (int64_t j = n; j < BK; ++j) s[j] = -std::numeric_limits<float>::infinity();
#ifdef PERFXLM_SIMD16
  const V a = vmax(vmax(simd16::load(s), simd16::load(s + 16)), vmax(simd16::load(s + 32), simd16::load(s + 48)));
  const float block_max = reduce_max(a);
#else
  float block_max = s[0];
  for (int64_t j = 1; j < BK; ++j) block_max = std::max(block_max, s[j]);
#endif
  const float m_new = std::max(m, block_max);
  factor = std::exp(m - m_new);  // e^-inf = 0 for the first block
  m = m_new;
#ifdef PERFXLM_SIMD16
  const V neg = simd16::set1(-m_new);
  V sum = simd16::zero();
  for (int c = 0; c < 4; ++c) {
    simd16::store(s + 16 * c, vexp(simd16::add(simd16::load(s + 16 * c), neg)));
  }
  for (int64_t j = n; j < BK; ++j) s[j] = 0.f;  // e^-inf is not 0 in every exp's polynomial: set it
  for (int c = 0; c < 4; ++c) sum = simd16::add(sum, simd16::load(s + 16 * c));
  return simd16::reduce_add(sum);
#else
  float sum = 0.f;
  for (int64_t j = 0; j < BK; ++j) {
    s[j] = j < n ? std::exp(s[j] - m_new) : 0.f;
    sum += s[j];
  }
  return sum;
#endif
}

template <typename T>
inline float widen(T x) {
  return perfxlm_attn::load_scalar(&x);
}

// Where key / value row `pos` of KV head g sits: the cache for positions before the context's end, the
// new tokens' tensor after.
template <typename C, typename N>
struct KVSource {
  const C* cache;  // [num_blocks, block_size, Hkv, D] (nullptr without context)
  const int64_t* table;
  int64_t block_size, cache_block_stride, cache_token_stride;  // elements
  const N* fresh;  // [T, Hkv, D]
  int64_t fresh_stride;  // between tokens
  int64_t context;
  float at(int64_t pos, int64_t g, int64_t D, int64_t d) const {
    if (pos < context) {
      const C* row = cache + table[pos / block_size] * cache_block_stride + (pos % block_size) * cache_token_stride + g * D;
      return widen(row[d]);
    }
    return widen(fresh[(pos - context) * fresh_stride + g * D + d]);
  }
};

// Query blocks of QB positions cut at multiples of QB (absolute), so a block never straddles a key block
// boundary: all its rows end in the same key block and each sees at least one key there.
constexpr int64_t QB = 32;

// Runs fn(g, p0, p1) for every (KV head, query block), spread over the threads by cost (rows x key
// blocks: a late block sees more keys), the dearest first to the least loaded thread: at::parallel_for's
// contiguous ranges left one thread twice the other's work at 128 tokens.
template <typename F>
void for_each_task(int64_t context, int64_t total, int64_t Hkv, const F& fn) {
  struct Task {
    int64_t g, p0, p1, cost;
  };
  std::vector<Task> tasks;
  for (int64_t p = context; p < total; p = (p / QB + 1) * QB) {
    const int64_t p1 = std::min((p / QB + 1) * QB, total);
    for (int64_t g = 0; g < Hkv; ++g) tasks.push_back({g, p, p1, (p1 - p) * ((p1 - 1) / BK + 1)});
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  std::vector<std::vector<Task>> lists(threads);
  std::vector<int64_t> load(threads, 0);
  for (const Task& t : tasks) {
    const int64_t i = std::min_element(load.begin(), load.end()) - load.begin();
    lists[i].push_back(t);
    load[i] += t.cost;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (const Task& t : lists[i]) fn(t.g, t.p0, t.p1);
  });
}

// One row's softmax over a block's scores s (64 floats) into p; its running max, sum and output rescaled.
inline void row_softmax(const float* s, float* p, int64_t visible, float& m, float& l, float* orow, int64_t Dp) {
  float factor;
  std::memcpy(p, s, sizeof(float) * BK);
  const float block_sum = softmax_block(p, visible, m, factor);
  l = l * factor + block_sum;
  if (factor != 1.f)
    for (int64_t d = 0; d < Dp; ++d) orow[d] *= factor;
}

// A call's sizes: head_dim D (padded to Dp, whole 16-float vectors), G query heads per KV head, the
// cached context before the T new tokens, and the key columns packed to Tp, a whole number of blocks.
struct Sizes {
  int64_t D, G, context, total, Tp, Dp;
  Sizes(const at::Tensor& query, int64_t context_, int64_t Hkv)
      : D(query.size(2)), G(query.size(1) / Hkv), context(context_), total(context_ + query.size(0)),
        Tp((total + BK - 1) / BK * BK), Dp((D + 15) / 16 * 16) {}
};

// A call's queries (scaled as read) and its float32 output [T, H, D]; rows of a task are position-major,
// head-minor (row r of a task starting at sequence index i0 is position i0 + r / G, head g G + r % G).
struct QueryOut {
  at::Tensor out;
  const float* q;
  int64_t qs0, qs1, H, D, G;
  float sc;
  QueryOut(const at::Tensor& query, int64_t Hkv, double scale)
      : out(at::empty({query.size(0), query.size(1), query.size(2)}, query.options().dtype(at::kFloat))),
        q(query.data_ptr<float>()), qs0(query.stride(0)), qs1(query.stride(1)), H(query.size(1)),
        D(query.size(2)), G(query.size(1) / Hkv), sc(static_cast<float>(scale)) {}
  // Row r's query, times the scale, into dst[0 .. D).
  void read(int64_t i0, int64_t g, int64_t r, float* dst) const {
    const float* src = q + (i0 + r / G) * qs0 + (g * G + r % G) * qs1;
    for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * sc;
  }
};

// One task's running rows: unnormalised outputs [rows_p][Dp], running max and sum per row.
struct TaskRows {
  std::vector<float> obuf, mrow, lrow;
  int64_t Dp;
  TaskRows(int64_t rows_p, int64_t Dp_)
      : obuf(static_cast<size_t>(rows_p * Dp_), 0.f),
        mrow(static_cast<size_t>(rows_p), -std::numeric_limits<float>::infinity()),
        lrow(static_cast<size_t>(rows_p), 0.f), Dp(Dp_) {}
  // The first `rows` rows, divided by their sums, into the output.
  void write(const QueryOut& io, int64_t i0, int64_t g, int64_t rows) {
    float* o = io.out.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = o + ((i0 + r / io.G) * io.H + g * io.G + r % io.G) * io.D;
      const float inv = 1.f / lrow[r];
      for (int64_t d = 0; d < io.D; ++d) dst[d] = obuf[r * Dp + d] * inv;
    }
  }
};

template <typename C, typename N>
at::Tensor run(const at::Tensor& query, const KVSource<C, N>& keys, const KVSource<C, N>& values, int64_t Hkv,
               double scale) {
  const Sizes z(query, keys.context, Hkv);
  const int64_t D = z.D, G = z.G, context = z.context, total = z.total, Tp = z.Tp, Dp = z.Dp;
  // Packed per KV head: keys transposed [D][Tp], values [Tp][Dp], float32, padding zero.
  std::vector<float> kt(static_cast<size_t>(Hkv * D * Tp), 0.f), vp(static_cast<size_t>(Hkv * Tp * Dp), 0.f);
  const int64_t chunks = Tp / BK;
  at::parallel_for(0, Hkv * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t / chunks, p0 = (t % chunks) * BK, p1 = std::min(p0 + BK, total);
      float* ktg = kt.data() + g * D * Tp;
      float* vpg = vp.data() + g * Tp * Dp;
      for (int64_t pos = p0; pos < p1; ++pos)
        for (int64_t d = 0; d < D; ++d) {
          ktg[d * Tp + pos] = keys.at(pos, g, D, d);
          vpg[pos * Dp + d] = values.at(pos, g, D, d);
        }
    }
  });

  const QueryOut io(query, Hkv, scale);
  for_each_task(context, total, Hkv, [&](int64_t g, int64_t p0, int64_t p1) {
    const int64_t rows = (p1 - p0) * G, rows_p = (rows + R - 1) / R * R;
    std::vector<float> qbuf(static_cast<size_t>(rows_p * D), 0.f);
    TaskRows acc(rows_p, Dp);
    auto& obuf = acc.obuf;
    auto& mrow = acc.mrow;
    auto& lrow = acc.lrow;
    float s[R * BK], p[R * BK];
    // row = position-major, head-minor: rows of one position share its mask
    for (int64_t r = 0; r < rows; ++r) io.read(p0 - context, g, r, qbuf.data() + r * D);
    const float* ktg = kt.data() + g * D * Tp;
    const float* vpg = vp.data() + g * Tp * Dp;
    const int64_t last_block = (p1 - 1) / BK;
    // key blocks outer: one block's K and V (2 x 16 KiB at head_dim 64) stay in L1 across the rows
    for (int64_t kb = 0; kb <= last_block; ++kb) {
      for (int64_t r0 = 0; r0 < rows_p; r0 += R) {
        scores(qbuf.data() + r0 * D, D, ktg + kb * BK, Tp, s);
        for (int r = 0; r < R; ++r) {
          const int64_t pos = p0 + std::min(r0 + r, rows - 1) / G;  // a padding row: the last row's mask
          row_softmax(s + r * BK, p + r * BK, std::min<int64_t>(BK, pos - kb * BK + 1), mrow[r0 + r], lrow[r0 + r],
                      obuf.data() + (r0 + r) * Dp, Dp);
        }
        accumulate_all(p, vpg + kb * BK * Dp, Dp, obuf.data() + r0 * Dp);
      }
    }
    acc.write(io, p0 - context, g, rows);
  });
  return io.out;
}

#ifdef PERFXLM_PREFILL_BF16
// bf16 keys and values on AVX512-BF16 where the caller asks for bf16 products (the CPU plan's bf16
// attention; a float32 plan keeps float32 queries exact): the products by vdpbf16ps, pairs of bf16 products summed into
// float32 lanes, half the instructions of float32 FMAs. The queries (times the scale) and the softmax's
// weights are rounded to bf16 (to nearest even), as torch's bf16 SDPA rounds them; maxima, exponentials
// and sums stay float32. Each lane's pairs are summed in one fixed order, so the invariance above holds.
inline uint32_t pair_bits(uint16_t lo, uint16_t hi) { return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16); }

using perfxlm_attn::dot_pairs;

// s[r][j] = q_r . k_j over D2 pairs; kp: the block's keys as [D2][64] pairs (dims 2t, 2t + 1 of a key).
inline void scores_bf16(const uint32_t* qp, int64_t D2, const uint32_t* kp, float* s) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < D2; ++t) {
    const uint32_t* row = kp + t * BK;
    __m512i k[4];
    for (int c = 0; c < 4; ++c) k[c] = _mm512_loadu_si512(row + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512i q = _mm512_set1_epi32(static_cast<int>(qp[r * D2 + t]));
      for (int c = 0; c < 4; ++c) acc[r][c] = dot_pairs(acc[r][c], q, k[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * BK + 16 * c, acc[r][c]);
}

// out[r][c0 ..] += P V; pp: R rows of 32 weight pairs (keys 2t, 2t + 1); vp: the block's values as
// [32][Dp] pairs (one column of keys 2t and 2t + 1).
template <int NV>
inline void accumulate_bf16(const uint32_t* pp, const uint32_t* v, int64_t ldv, float* out, int64_t ldo) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_loadu_ps(out + r * ldo + 16 * c);
  for (int64_t t = 0; t < BK / 2; ++t) {
    __m512i vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = _mm512_loadu_si512(v + t * ldv + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512i w = _mm512_set1_epi32(static_cast<int>(pp[r * (BK / 2) + t]));
      for (int c = 0; c < NV; ++c) acc[r][c] = dot_pairs(acc[r][c], w, vv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + r * ldo + 16 * c, acc[r][c]);
}

inline void accumulate_all_bf16(const uint32_t* pp, const uint32_t* v, int64_t Dp, float* out) {
  column_tiles(Dp, [&](auto nv, int64_t c) { accumulate_bf16<decltype(nv)::value>(pp, v + c, Dp, out + c, Dp); });
}

// 32 floats to 32 bf16 (nearest even) as 16 pairs.
inline void round_pairs(const float* x, uint32_t* out) {
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
  _mm512_storeu_si512(out, reinterpret_cast<const __m512i&>(b));
}

template <typename C, typename N>
at::Tensor run_bf16(const at::Tensor& query, const KVSource<C, N>& keys, const KVSource<C, N>& values, int64_t Hkv,
                    double scale) {
  const Sizes z(query, keys.context, Hkv);
  const int64_t D = z.D, G = z.G, context = z.context, total = z.total, Tp = z.Tp, Dp = z.Dp;
  const int64_t D2 = (D + 1) / 2;
  const int64_t blocks = Tp / BK;
  // Per KV head and key block: keys [D2][64] pairs, values [32][Dp] pairs; padding zero.
  const int64_t kblock = D2 * BK, vblock = (BK / 2) * Dp;
  std::vector<uint32_t> kp(static_cast<size_t>(Hkv * blocks * kblock), 0u), vp(static_cast<size_t>(Hkv * blocks * vblock), 0u);
  at::parallel_for(0, Hkv * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> kr(static_cast<size_t>(D2 * 2)), vr(static_cast<size_t>(Dp * 2));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t / blocks, b = t % blocks, p0 = b * BK, p1 = std::min(p0 + BK, total);
      uint32_t* kb = kp.data() + (g * blocks + b) * kblock;
      uint16_t* vb = reinterpret_cast<uint16_t*>(vp.data() + (g * blocks + b) * vblock);
      for (int64_t pos = p0; pos < p1; ++pos) {
        const int64_t j = pos - p0;
        for (int64_t d = 0; d < D; ++d) {
          // exact: the sources are bf16, widened and narrowed back
          const float kf = keys.at(pos, g, D, d), vf = values.at(pos, g, D, d);
          uint32_t kbits, vbits;
          std::memcpy(&kbits, &kf, 4);
          std::memcpy(&vbits, &vf, 4);
          reinterpret_cast<uint16_t*>(kb + (d / 2) * BK + j)[d % 2] = static_cast<uint16_t>(kbits >> 16);
          vb[((j / 2) * Dp + d) * 2 + j % 2] = static_cast<uint16_t>(vbits >> 16);
        }
      }
    }
  });

  const QueryOut io(query, Hkv, scale);
  for_each_task(context, total, Hkv, [&](int64_t g, int64_t p0, int64_t p1) {
    const int64_t rows = (p1 - p0) * G, rows_p = (rows + R - 1) / R * R;
    std::vector<uint32_t> qbuf(static_cast<size_t>(rows_p * D2), 0u);
    TaskRows acc(rows_p, Dp);
    auto& obuf = acc.obuf;
    auto& mrow = acc.mrow;
    auto& lrow = acc.lrow;
    float s[R * BK], p[R * BK];
    uint32_t pp[R * BK / 2];
    std::vector<float> qrow(static_cast<size_t>(2 * ((D2 + 15) / 16) * 16), 0.f);
    for (int64_t r = 0; r < rows; ++r) {
      io.read(p0 - context, g, r, qrow.data());
      for (int64_t t = 0; t < D2; t += 16) {
        uint32_t chunk[16];
        round_pairs(qrow.data() + 2 * t, chunk);
        std::memcpy(qbuf.data() + r * D2 + t, chunk, sizeof(uint32_t) * std::min<int64_t>(16, D2 - t));
      }
    }
    const uint32_t* kpg = kp.data() + g * blocks * kblock;
    const uint32_t* vpg = vp.data() + g * blocks * vblock;
    const int64_t last_block = (p1 - 1) / BK;
    for (int64_t kb = 0; kb <= last_block; ++kb) {
      for (int64_t r0 = 0; r0 < rows_p; r0 += R) {
        scores_bf16(qbuf.data() + r0 * D2, D2, kpg + kb * kblock, s);
        for (int r = 0; r < R; ++r) {
          const int64_t pos = p0 + std::min(r0 + r, rows - 1) / G;
          row_softmax(s + r * BK, p + r * BK, std::min<int64_t>(BK, pos - kb * BK + 1), mrow[r0 + r], lrow[r0 + r],
                      obuf.data() + (r0 + r) * Dp, Dp);
          round_pairs(p + r * BK, pp + r * (BK / 2));
          round_pairs(p + r * BK + 32, pp + r * (BK / 2) + 16);
        }
        accumulate_all_bf16(pp, vpg + kb * vblock, Dp, obuf.data() + r0 * Dp);
      }
    }
    acc.write(io, p0 - context, g, rows);
  });
  return io.out;
}
#endif

template <typename C, typename N>
KVSource<C, N> source(const c10::optional<at::Tensor>& cache, const c10::optional<at::Tensor>& table,
                      const at::Tensor& fresh, int64_t context) {
  KVSource<C, N> s{};
  if (context > 0) {
    s.cache = reinterpret_cast<const C*>(cache->data_ptr());
    s.table = table->data_ptr<int64_t>();
    s.block_size = cache->size(1);
    s.cache_block_stride = cache->stride(0);
    s.cache_token_stride = cache->stride(1);
  }
  s.fresh = reinterpret_cast<const N*>(fresh.data_ptr());
  s.fresh_stride = fresh.stride(0);
  s.context = context;
  return s;
}

template <typename C>
at::Tensor with_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& kc,
                      const c10::optional<at::Tensor>& vc, const c10::optional<at::Tensor>& table, int64_t context,
                      double scale, bool bf16_products) {
  if (k.scalar_type() == at::kBFloat16) {
#ifdef PERFXLM_PREFILL_BF16
    if (bf16_products && (std::is_same<C, uint16_t>::value || context == 0))
      return run_bf16(q, source<C, uint16_t>(kc, table, k, context), source<C, uint16_t>(vc, table, v, context), k.size(1),
                      scale);
#endif
    return run(q, source<C, uint16_t>(kc, table, k, context), source<C, uint16_t>(vc, table, v, context), k.size(1), scale);
  }
  return run(q, source<C, float>(kc, table, k, context), source<C, float>(vc, table, v, context), k.size(1), scale);
}

at::Tensor prefill_attention_causal(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                    const c10::optional<at::Tensor>& key_cache,
                                    const c10::optional<at::Tensor>& value_cache,
                                    const c10::optional<at::Tensor>& block_table, int64_t num_context, double scale,
                                    bool bf16_products) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3, "query, key, value: [T, heads, head_dim]");
  TORCH_CHECK(query.scalar_type() == at::kFloat, "query: float32");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() &&
                  (key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16),
              "key, value: float32 or bfloat16, the same");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1, "head_dim contiguous");
  TORCH_CHECK(key.stride(1) == key.size(2) && value.stride(1) == value.size(2), "key, value: heads packed");
  TORCH_CHECK(query.size(1) % key.size(1) == 0, "query heads: a multiple of the KV heads");
  TORCH_CHECK(query.size(0) == key.size(0) && query.size(2) == key.size(2), "query, key: the same tokens and head_dim");
  if (num_context == 0 || !key_cache.has_value())
    return with_cache<float>(query, key, value, c10::nullopt, c10::nullopt, c10::nullopt, 0, scale, bf16_products);
  TORCH_CHECK(value_cache.has_value() && block_table.has_value(), "context: caches and block table");
  TORCH_CHECK(key_cache->scalar_type() == value_cache->scalar_type(), "caches: one dtype");
  TORCH_CHECK(key_cache->stride(3) == 1 && key_cache->stride(2) == key_cache->size(3) &&
                  key_cache->strides() == value_cache->strides(),
              "caches: [blocks, block_size, kv_heads, head_dim], rows packed, the same layout");
  TORCH_CHECK(block_table->scalar_type() == at::kLong && block_table->is_contiguous(), "block table: int64");
  if (key_cache->scalar_type() == at::kBFloat16)
    return with_cache<uint16_t>(query, key, value, key_cache, value_cache, block_table, num_context, scale, bf16_products);
  TORCH_CHECK(key_cache->scalar_type() == at::kFloat, "cache: float32 or bfloat16");
  return with_cache<float>(query, key, value, key_cache, value_cache, block_table, num_context, scale, bf16_products);
}

}  // namespace
}  // namespace perfxlm_prefill_attn

TORCH_LIBRARY_FRAGMENT(perfxlm, m) {
  m.def(
      "prefill_attention_causal(Tensor query, Tensor key, Tensor value, Tensor? key_cache, Tensor? value_cache, "
      "Tensor? block_table, int num_context, float scale, bool bf16_products) -> Tensor");
}

TORCH_LIBRARY_IMPL(perfxlm, CPU, m) {
  m.impl("prefill_attention_causal", &perfxlm_prefill_attn::prefill_attention_causal);
}
