// The step's LoRA adapters on one projection of the fused decode layer, Punica's SGMV done on the CPU:
// rows are grouped by the adapter slot they use, and each group runs a shrink (h = x A^T * scale, its
// slot's columns only) then an expand (y += h B^T, each B row over the output columns it covers only),
// so a slot's A and B are read once per step whatever the number of its rows, other slots' columns are
// never touched, and the zero blocks of a fused projection's packed B^T (q's B beside k's columns) are
// skipped. A and B come in float32 (exact against peft in a float32 engine), bfloat16 (half the
// bytes, the adapters' form next to bf16 or quantized base weights) or int8 codes with a scale per
// packed row (a quarter, opt-in), widened in registers; sums are float32 always.
//
// Threads: the work is cut into shrink tasks (a block of one part's columns, for that slot's rows) and
// expand tasks (a block of one part's output columns), and each thread takes shrinks, then expands, from
// shared counters, an expand waiting only for its own part's shrinks: one parallel region per projection,
// no barrier, each thread reading about its share of A and B (a batch-1 step's too, where one part, o's
// or down's, used to be one thread's whole). Work too small to pay for a parallel region's fork and join
// stays on the calling thread. A quantized projection at few rows runs with its adapters instead
// (project_add): one region for the base product and the adapters, each thread its range of outputs.
//
// Decode with adapters is bound by reading A and B (at rank 16 on every projection of a 135M model,
// 1 MB of float32 per layer, 30 MB per step beside the 4-bit model's 98 MB), so bytes and the threads
// reading them are what this file is about. A layer's adapters arrive as one block laid out for that
// (perfxlm/lora/pack.py): built once per content of the slots, each slot's weights of the whole layer
// one contiguous region in the order they are read, B^T without the zero blocks beside a fused
// projection's parts, the segments already parsed; in a batched step `prefetch` asks for a projection's
// part of it before the base product runs, so the two overlap (not in a 1-row step: see prefetch_bytes).

#include "lora_kernels.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>
#include <type_traits>
#include <vector>

#include "simd16.h"

namespace perfxlm_lora {
namespace {

// Below this many multiply-adds a projection's products run on the calling thread. A 1-row step's
// products are a few tens of thousands (q|k|v at rank 16 on a 576-wide model: about 45 thousand, some
// 10 us on one thread), and a parallel region per projection cost more than it saved: replaying one
// batch-1 decode step of the 135M model's 30 fused layers on a loaded 2-core machine (best of 60), the
// adapters added 1.2 ms on one thread and 19 ms with two, whose regions waited on a descheduled worker.
// Batched steps (16 rows across 4 adapters: 0.3-1M per projection) and 1B-wide MLPs still split.
constexpr int64_t kParallelMacs = 1 << 18;
constexpr int kMaxTile = 8;
#ifdef PERFXLM_SIMD16
constexpr int kTile = simd16::kAvx512 ? 8 : 4;  // rows sharing one load of A or B
#else
constexpr int kTile = 4;
#endif

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
// int8 adapters: the block holds the signed codes (their per-row scales folded into `scale`), widened
// in one sign extension (the slots' codes + 128 took an extra add per 16 values)
inline float widen(int8_t v) { return static_cast<float>(v); }
#ifdef PERFXLM_SIMD16
inline simd16::V load_w(const float* p, int64_t n) { return simd16::load(p, n); }
inline simd16::V load_w(const uint16_t* p, int64_t n) { return simd16::load(p, n); }
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // simd16's AVX-512 V
inline simd16::V load_w(const int8_t* p, int64_t n) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(simd16::mask(n), p)))};
}
#else  // simd16's AVX2 V: two halves of 8
inline simd16::V load_w(const int8_t* p, int64_t n) {
  __m128i b;
  if (n >= 16) {
    b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    int8_t buf[16] = {};
    std::memcpy(buf, p, static_cast<size_t>(n > 0 ? n : 0));
    b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf));
  }
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
#endif
#endif

// One checkpoint module of one slot (q, k or v of a fused q|k|v) as the layer's block holds it
// (perfxlm/lora/pack.py): A [cols, K], B^T over its own output columns [n0, n1) only, in tiles of the
// outputs between multiples of 32 (the first and last may be narrower), each tile [cols, width]
// row-major at (tile start - n0) * cols, so an expand reads B front to back; the columns' scales.
struct Segment {
  const void* a;
  const void* b;
  const float* scale;
  int64_t cols, n0, n1;
};

// The rows of the step that use one slot, with that slot's parts in this projection.
struct Group {
  std::vector<int64_t> rows;
  std::vector<Segment> segments;
};

// h[i * ldh + j] = (x_i . A_{c0 + j}) * scale for MT rows and `cols` of the segment's columns. One or two
// rows (batch-1 decode) keep two partial sums per row, so consecutive FMAs do not wait on each other.
// Each column's sum is the same whichever columns a call takes.
template <int MT, typename W>
void shrink_tile(const float* const* xr, int64_t K, const W* a, const float* scale, int64_t cols, float* h,
                 int64_t ldh) {
  for (int64_t j = 0; j < cols; ++j) {
    const W* aj = a + j * K;
#ifdef PERFXLM_SIMD16
    constexpr int U = MT <= 2 ? 2 : 1;
    simd16::V acc[MT][U];
    for (int i = 0; i < MT; ++i)
      for (int u = 0; u < U; ++u) acc[i][u] = simd16::zero();
    int64_t k = 0;
    for (; k + 16 * U <= K; k += 16 * U)
      for (int u = 0; u < U; ++u) {
        const simd16::V av = load_w(aj + k + 16 * u, 16);
        for (int i = 0; i < MT; ++i) acc[i][u] = simd16::fmadd(simd16::load(xr[i] + k + 16 * u, 16), av, acc[i][u]);
      }
    for (; k < K; k += 16) {
      const simd16::V av = load_w(aj + k, K - k);
      for (int i = 0; i < MT; ++i) acc[i][0] = simd16::fmadd(simd16::load(xr[i] + k, K - k), av, acc[i][0]);
    }
    for (int i = 0; i < MT; ++i) {
      simd16::V sum = acc[i][0];
      for (int u = 1; u < U; ++u) sum = simd16::add(sum, acc[i][u]);
      h[i * ldh + j] = simd16::reduce_add(sum) * scale[j];
    }
#else
    float acc[MT] = {};
    for (int64_t k = 0; k < K; ++k) {
      const float av = widen(aj[k]);
      for (int i = 0; i < MT; ++i) acc[i] += xr[i][k] * av;
    }
    for (int i = 0; i < MT; ++i) h[i * ldh + j] = acc[i] * scale[j];
#endif
  }
}

// y_i[n0:n1] += sum over the segment's columns j of h_i[j] * B^T[j, n0:n1], for MT rows, B^T in the
// block's tiles (Segment), [n0, n1) a run of whole tiles; each y value is read and written once, each B
// value read once, in the order stored. A whole tile is 32 outputs, two blocks of 16: independent FMA
// chains for one or two rows. Each output's sum is y then j = 0, 1, ... whatever the tiling.
template <int MT, typename W>
void expand_tile(float* const* yr, const float* h, const W* tiles, int64_t seg_n0, int64_t cols, int64_t n0,
                 int64_t n1) {
  for (int64_t ts = n0; ts < n1;) {
    const int64_t te = std::min(n1, (ts / 32 + 1) * 32), w = te - ts;
    const W* bt = tiles + (ts - seg_n0) * cols;  // [cols, w]
#ifdef PERFXLM_SIMD16
    if (w == 32) {
      simd16::V acc[MT][2];
      for (int i = 0; i < MT; ++i)
        for (int u = 0; u < 2; ++u) acc[i][u] = simd16::load(yr[i] + ts + 16 * u, 16);
      for (int64_t j = 0; j < cols; ++j)
        for (int u = 0; u < 2; ++u) {
          const simd16::V b = load_w(bt + j * 32 + 16 * u, 16);
          for (int i = 0; i < MT; ++i) acc[i][u] = simd16::fmadd(simd16::set1(h[i * cols + j]), b, acc[i][u]);
        }
      for (int i = 0; i < MT; ++i)
        for (int u = 0; u < 2; ++u) simd16::store(yr[i] + ts + 16 * u, acc[i][u], 16);
    } else {
      for (int64_t n = 0; n < w; n += 16) {
        const int64_t valid = std::min<int64_t>(16, w - n);
        simd16::V acc[MT];
        for (int i = 0; i < MT; ++i) acc[i] = simd16::load(yr[i] + ts + n, valid);
        for (int64_t j = 0; j < cols; ++j) {
          const simd16::V b = load_w(bt + j * w + n, valid);
          for (int i = 0; i < MT; ++i) acc[i] = simd16::fmadd(simd16::set1(h[i * cols + j]), b, acc[i]);
        }
        for (int i = 0; i < MT; ++i) simd16::store(yr[i] + ts + n, acc[i], valid);
      }
    }
#else
    for (int64_t n = 0; n < w; ++n) {
      float acc[MT];
      for (int i = 0; i < MT; ++i) acc[i] = yr[i][ts + n];
      for (int64_t j = 0; j < cols; ++j) {
        const float b = widen(bt[j * w + n]);
        for (int i = 0; i < MT; ++i) acc[i] += h[i * cols + j] * b;
      }
      for (int i = 0; i < MT; ++i) yr[i][ts + n] = acc[i];
    }
#endif
    ts = te;
  }
}

template <typename F>
void with_tile(int64_t m, F&& f) {
  switch (m) {
    case 8: f(std::integral_constant<int, 8>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    default: f(std::integral_constant<int, 1>()); break;
  }
}

struct Operands {
  float* y;
  int64_t y_stride;
  const float* x;
  int64_t x_stride, K, N;
};

// One part (a slot's rows over one segment) of the step: its h = x A^T * scale, [rows, cols] row-major,
// and how many of its shrink tasks are done (its expands wait for all of them).
struct Part {
  const Group* group;
  const Segment* segment;
  float* h;
  int64_t shrinks;
};

// A shrink fills h's columns [j0, j1) for all of the part's rows; an expand adds h B^T to the output
// columns [n0, n1).
struct Task {
  int64_t part, from, to;
};

template <typename W>
void run_shrink(const Task& t, const Part& p, const Operands& o) {
  const Segment& s = *p.segment;
  const std::vector<int64_t>& rows = p.group->rows;
  const int64_t cols = s.cols, n = static_cast<int64_t>(rows.size());
  const W* a = static_cast<const W*>(s.a) + t.from * o.K;
  for (int64_t i0 = 0; i0 < n; i0 += kTile) {
    const int64_t m = std::min<int64_t>(kTile, n - i0);
    const float* xr[kMaxTile];
    for (int64_t i = 0; i < m; ++i) xr[i] = o.x + rows[i0 + i] * o.x_stride;
    with_tile(m, [&](auto mt) {
      shrink_tile<decltype(mt)::value>(xr, o.K, a, s.scale + t.from, t.to - t.from, p.h + i0 * cols + t.from, cols);
    });
  }
}

template <typename W>
void run_expand(const Task& t, const Part& p, const Operands& o) {
  const Segment& s = *p.segment;
  const std::vector<int64_t>& rows = p.group->rows;
  const int64_t cols = s.cols, n = static_cast<int64_t>(rows.size());
  const W* b = static_cast<const W*>(s.b);
  for (int64_t i0 = 0; i0 < n; i0 += kTile) {
    const int64_t m = std::min<int64_t>(kTile, n - i0);
    float* yr[kMaxTile];
    for (int64_t i = 0; i < m; ++i) yr[i] = o.y + rows[i0 + i] * o.y_stride;
    with_tile(m, [&](auto mt) {
      expand_tile<decltype(mt)::value>(yr, p.h + i0 * cols, b, s.n0, cols, t.from, t.to);
    });
  }
}

// Below this many multiply-adds a projection's products run on the calling thread; PERFXLM_LORA_PARALLEL_MACS
// sets another bound (0: every step splits across threads, batch-1 decode included), for measuring where
// a machine's parallel region costs less than the half of the adapter bytes it saves one thread.
int64_t parallel_macs() {
  static const int64_t bound = [] {
    const char* env = std::getenv("PERFXLM_LORA_PARALLEL_MACS");
    return env != nullptr && *env != '\0' ? std::max<int64_t>(0, std::atoll(env)) : kParallelMacs;
  }();
  return bound;
}

// The step's parts (a slot's rows over one segment) with room for their h, and how many columns and
// output columns they span, multiply-adds in all.
struct Parts {
  std::vector<Part> list;
  std::vector<float> h;
  int64_t cols = 0, width = 0, macs = 0;

  Parts(const Operands& o, const std::vector<Group>& groups) {
    int64_t h_size = 0;
    for (const Group& g : groups)
      for (const Segment& s : g.segments) {
        const int64_t rows = static_cast<int64_t>(g.rows.size()), c = s.cols;
        list.push_back({&g, &s, nullptr, 0});
        h_size += rows * c;
        macs += rows * c * (o.K + s.n1 - s.n0);
        cols += c;
        width += s.n1 - s.n0;
      }
    h.resize(static_cast<size_t>(h_size));
    int64_t offset = 0;
    for (Part& p : list) {
      p.h = h.data() + offset;
      offset += static_cast<int64_t>(p.group->rows.size()) * p.segment->cols;
    }
  }

  // shrink tasks of at most `block` columns of one part each (counted in each part's `shrinks`)
  std::vector<Task> shrinks(int64_t block) {
    std::vector<Task> tasks;
    for (int64_t i = 0; i < static_cast<int64_t>(list.size()); ++i) {
      const Segment& s = *list[i].segment;
      for (int64_t j0 = 0; j0 < s.cols; j0 += block) {
        tasks.push_back({i, j0, std::min(s.cols, j0 + block)});
        ++list[i].shrinks;
      }
    }
    return tasks;
  }
};

// The step's work as tasks: shrinks (a block of one part's columns) and expands (a block of one part's
// output columns, cut at multiples of 32 so B's tiles stay whole). Every thread takes shrinks
// until none is left, then expands; an expand waits only for its own part's shrinks, which threads finish
// without waiting on anything, so no thread waits on work that nobody runs (one thread alone, or a
// descheduled one, still completes). Each thread then reads about its share of A and of B, one parallel
// region per projection and no barrier; which thread runs which task changes no sum (a column's shrink
// and an output's expand are the same whatever the blocks).
template <typename W>
void apply(const Operands& o, const std::vector<Group>& groups) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  Parts ps(o, groups);
  std::vector<Part>& parts = ps.list;
  const bool parallel = threads >= 2 && ps.macs >= parallel_macs();
  // blocks: about 4 tasks per thread of each kind over the step, at least 4 columns / 32 outputs each
  const int64_t want = parallel ? 4 * threads : 1;  // serial: one shrink and one expand per part
  const int64_t col_block = std::max<int64_t>(parallel ? 4 : 1, (ps.cols + want - 1) / want);
  const int64_t out_block = std::max<int64_t>(32, ((ps.width + want - 1) / want + 31) / 32 * 32);
  const std::vector<Task> shrinks = ps.shrinks(col_block);
  std::vector<Task> expands;
  for (int64_t i = 0; i < static_cast<int64_t>(parts.size()); ++i) {  // cut at multiples of out_block: whole tiles
    const Segment& s = *parts[i].segment;
    for (int64_t n0 = s.n0; n0 < s.n1;) {
      const int64_t n1 = std::min(s.n1, (n0 / out_block + 1) * out_block);
      expands.push_back({i, n0, n1});
      n0 = n1;
    }
  }
  if (!parallel) {
    for (const Task& t : shrinks) run_shrink<W>(t, parts[t.part], o);
    for (const Task& t : expands) run_expand<W>(t, parts[t.part], o);
    return;
  }
  std::vector<std::atomic<int64_t>> done(parts.size());
  for (auto& d : done) d.store(0, std::memory_order_relaxed);
  std::atomic<int64_t> next_shrink{0}, next_expand{0};
  const int64_t n_shrinks = static_cast<int64_t>(shrinks.size()), n_expands = static_cast<int64_t>(expands.size());
  at::parallel_for(0, std::min(threads, std::max(n_shrinks, n_expands)), 1, [&](int64_t, int64_t) {
    for (int64_t j = next_shrink.fetch_add(1); j < n_shrinks; j = next_shrink.fetch_add(1)) {
      run_shrink<W>(shrinks[j], parts[shrinks[j].part], o);
      done[shrinks[j].part].fetch_add(1, std::memory_order_release);
    }
    for (int64_t j = next_expand.fetch_add(1); j < n_expands; j = next_expand.fetch_add(1)) {
      const Task& t = expands[j];
      for (int spins = 0; done[t.part].load(std::memory_order_acquire) < parts[t.part].shrinks; ++spins)
        if (spins > 64) std::this_thread::yield();  // its last shrink runs on a thread that was descheduled
      run_expand<W>(t, parts[t.part], o);
    }
  });
}

// The base product and the adapters in the base product's own parallel region (project_add): the output
// columns are cut into one range per thread (starting on multiples of 64, so the base kernels' row tiles
// are the same as in one whole call); each thread takes shrink tasks from a shared counter, then runs the
// base product of its range, then, once every shrink is done (by then, nearly always: the base range took
// far longer), adds h B^T over its range. No region of its own, no barrier; each output's sums are those
// of the base call then `apply` (same kernels, same order), so results do not change by a bit.
template <typename W>
void apply_with_base(const Operands& o, const std::vector<Group>& groups, const BaseRange& base) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  Parts ps(o, groups);
  std::vector<Part>& parts = ps.list;
  const int64_t n_ranges = std::max<int64_t>(1, std::min(threads, (o.N + 63) / 64));
  const auto bound = [&](int64_t r) { return r >= n_ranges ? o.N : std::min(o.N, (o.N * r / n_ranges + 63) / 64 * 64); };
  const std::vector<Task> shrinks = ps.shrinks(std::max<int64_t>(1, (ps.cols + 2 * n_ranges - 1) / (2 * n_ranges)));
  const int64_t n_shrinks = static_cast<int64_t>(shrinks.size());
  std::atomic<int64_t> next_shrink{0}, shrunk{0};
  at::parallel_for(0, n_ranges, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = next_shrink.fetch_add(1); j < n_shrinks; j = next_shrink.fetch_add(1)) {
      run_shrink<W>(shrinks[j], parts[shrinks[j].part], o);
      shrunk.fetch_add(1, std::memory_order_release);
    }
    for (int64_t r = begin; r < end; ++r) base(bound(r), bound(r + 1));
    for (int spins = 0; shrunk.load(std::memory_order_acquire) < n_shrinks; ++spins)
      if (spins > 64) std::this_thread::yield();  // a shrink runs on a thread that was descheduled
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n0 = bound(r), n1 = bound(r + 1);
      for (int64_t i = 0; i < static_cast<int64_t>(parts.size()); ++i) {
        const Segment& s = *parts[i].segment;
        const int64_t from = std::max(n0, s.n0), to = std::min(n1, s.n1);
        if (from < to) run_expand<W>(Task{i, from, to}, parts[i], o);
      }
    }
  });
}

// The layer's adapter block (perfxlm/lora/pack.py): int64 header (magic, weight type, projections P,
// segments S; per projection K, N, first and end segment; per segment slot, rank, n0, n1, A, B and scale
// byte offsets, 0), then the scales and the weights. Checked here once per projection call, a few
// dozen integer reads: the offsets of every segment the step uses are bounds-checked.
constexpr int64_t kMagic = 0x4C6F52410002;
constexpr int64_t kSegmentInts = 8;

struct Block {
  const uint8_t* base = nullptr;
  int64_t bytes = 0, wtype = 0, P = 0, S = 0;
  const int64_t* proj = nullptr;  // 4 per projection
  const int64_t* seg = nullptr;   // kSegmentInts per segment
};

int64_t element_size(int64_t wtype) { return wtype == 0 ? 4 : wtype == 1 ? 2 : 1; }

// lora = [row_slot int32 [T], block uint8]; false where the step has no adapter (an empty list or block)
bool read_block(at::TensorList lora, Block& b) {
  if (lora.empty()) return false;
  TORCH_CHECK(lora.size() == 2, "lora: expected [row_slot, the layer's adapter block] (perfxlm/lora/pack.py)");
  const at::Tensor& pack = lora[1];
  if (!pack.numel()) return false;
  TORCH_CHECK(pack.scalar_type() == at::kByte && pack.dim() == 1 && pack.is_contiguous() && pack.numel() >= 32,
              "lora: the adapter block must be a contiguous uint8 vector");
  b.base = pack.data_ptr<uint8_t>();
  b.bytes = pack.numel();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(b.base) % 8 == 0, "lora: the adapter block must start 8-byte aligned");
  const int64_t* h = reinterpret_cast<const int64_t*>(b.base);
  TORCH_CHECK(h[0] == kMagic, "lora: not an adapter block of this format (perfxlm/lora/pack.py)");
  b.wtype = h[1];
  b.P = h[2];
  b.S = h[3];
  TORCH_CHECK(b.wtype >= 0 && b.wtype <= 2 && b.P >= 0 && b.S >= 0 && 8 * (4 + 4 * b.P + kSegmentInts * b.S) <= b.bytes,
              "lora: bad adapter block header");
  b.proj = h + 4;
  b.seg = h + 4 + 4 * b.P;
  return true;
}

// The checked operands of one projection and its slots' row groups; empty `groups`: nothing to add (no
// adapter in the step, none on this projection, or no row using one that has it).
struct Step {
  at::Tensor xc;  // x with unit column stride, kept alive
  Operands o{};
  std::vector<Group> groups;
  int64_t wtype = 0;
};

Step prepare(const at::Tensor& y, const at::Tensor& x, at::TensorList lora, int64_t index) {
  Step st;
  Block b;
  if (!read_block(lora, b)) return st;
  TORCH_CHECK(index >= 0 && index < b.P, "lora: projection ", index, " is not in the adapter block (", b.P, ")");
  const int64_t K = b.proj[4 * index], N = b.proj[4 * index + 1], s0 = b.proj[4 * index + 2],
                s1 = b.proj[4 * index + 3];
  TORCH_CHECK(0 <= s0 && s0 <= s1 && s1 <= b.S, "lora: bad segment range of projection ", index);
  if (s0 == s1) return st;
  const at::Tensor& row_slot = lora[0];
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
              "lora: x and y must be 2-D float32");
  const int64_t T = x.size(0);
  TORCH_CHECK(x.size(1) == K && y.size(1) == N && y.size(0) == T, "lora: projection ", index, "'s adapters take [T, ",
              K, "] to [T, ", N, "], got x ", x.sizes(), " and y ", y.sizes());
  TORCH_CHECK(row_slot.scalar_type() == at::kInt && row_slot.numel() == T && row_slot.is_contiguous(),
              "lora: row_slot must be contiguous int32 [rows]");

  // the projection's segments, a slot's together (the block lists them by slot), grouped by slot
  const int64_t es = element_size(b.wtype);
  std::vector<Group>& groups = st.groups;
  std::vector<int64_t> group_of_slot;
  for (int64_t i = s0; i < s1; ++i) {
    const int64_t* e = b.seg + kSegmentInts * i;
    const int64_t slot = e[0], cols = e[1], n0 = e[2], n1 = e[3], a_off = e[4], b_off = e[5], sc_off = e[6];
    TORCH_CHECK(slot >= 0 && slot < 4096 && cols > 0 && 0 <= n0 && n0 < n1 && n1 <= N && a_off >= 0 && b_off >= 0 &&
                    sc_off >= 0 && a_off + cols * K * es <= b.bytes && b_off + cols * (n1 - n0) * es <= b.bytes &&
                    sc_off + 4 * cols <= b.bytes && sc_off % 4 == 0,
                "lora: bad segment ", i, " in the adapter block");
    if (slot >= static_cast<int64_t>(group_of_slot.size())) group_of_slot.resize(slot + 1, -1);
    if (group_of_slot[slot] < 0) {
      group_of_slot[slot] = static_cast<int64_t>(groups.size());
      groups.emplace_back();
    } else {
      TORCH_CHECK(b.seg[kSegmentInts * (i - 1)] == slot, "lora: a slot's segments must be contiguous");
    }
    groups[group_of_slot[slot]].segments.push_back(
        {b.base + a_off, b.base + b_off, reinterpret_cast<const float*>(b.base + sc_off), cols, n0, n1});
  }
  const int32_t* rs = row_slot.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int32_t slot = rs[t];
    if (slot >= 0 && slot < static_cast<int32_t>(group_of_slot.size()) && group_of_slot[slot] >= 0)
      groups[group_of_slot[slot]].rows.push_back(t);
  }
  groups.erase(std::remove_if(groups.begin(), groups.end(), [](const Group& g) { return g.rows.empty(); }),
               groups.end());
  if (groups.empty()) return st;
  st.xc = x.stride(1) == 1 ? x : x.contiguous();
  st.o = Operands{y.data_ptr<float>(), y.stride(0), st.xc.data_ptr<float>(), st.xc.stride(0), K, N};
  st.wtype = b.wtype;
  return st;
}

// fn(W{}) with W the element type A and B^T are stored in
template <typename F>
void with_weights(const Step& st, F&& f) {
  if (st.wtype == 0)
    f(float{});
  else if (st.wtype == 2)
    f(int8_t{});
  else
    f(uint16_t{});  // bfloat16 bits
}

// How many bytes of each used slot's region `prefetch` asks for in a step of `rows` rows:
// PERFXLM_LORA_PREFETCH=0 none, 1 all, a larger number that many from the region's start (the hardware
// prefetchers follow the rest), in every step. Unset: all of it in steps of two rows or more, none in a
// 1-row step. A 1-row step's base product is a GEMV bound by reading its weights, and a burst of
// prefetches issued just before it competes with those reads (and the lines may be evicted by its
// stream before the adapters use them): replaying one batch-1 step of the default model's 30 fused
// layers (one thread, process CPU time, int8 rank-16 adapters on every projection, a loaded 2-vCPU Zen
// 4, alternating processes), the adapters added 1.08 and 1.10 ms with the prefetch, 0.66 and 0.75 ms
// without, 0.80 and 0.83 ms with its first 4 KB. A batched step's base product does more arithmetic per
// byte, and there the prefetch measured faster (README: 0.9-1.8 ms per 16-row step without it).
constexpr int64_t kUnset = -1;
int64_t prefetch_setting() {
  static const int64_t v = [] {
    const char* env = std::getenv("PERFXLM_LORA_PREFETCH");
    if (env == nullptr || *env == '\0') return kUnset;
    const int64_t n = std::atoll(env);
    return n == 1 ? std::numeric_limits<int64_t>::max() : std::max<int64_t>(0, n);
  }();
  return v;
}
int64_t prefetch_bytes(int64_t rows) {
  const int64_t v = prefetch_setting();
  if (v != kUnset) return v;
  return rows >= 2 ? std::numeric_limits<int64_t>::max() : 0;
}

}  // namespace

void add(at::Tensor& y, const at::Tensor& x, at::TensorList lora, int64_t index) {
  Block b;
  if (!read_block(lora, b)) return;
  if (y.stride(1) != 1) {  // not met by the fused layer's outputs; kept correct anyway
    at::Tensor yc = y.contiguous();
    add(yc, x, lora, index);
    y.copy_(yc);
    return;
  }
  const Step st = prepare(y, x, lora, index);
  if (st.groups.empty()) return;
  with_weights(st, [&](auto w) { apply<decltype(w)>(st.o, st.groups); });
}

void prefetch(at::TensorList lora, int64_t index) {
  Block b;
  if (lora.size() != 2) return;  // none in the step (a malformed list: `add` says what is wrong with it)
  const at::Tensor& row_slot = lora[0];
  const int64_t limit = prefetch_bytes(row_slot.numel());
  if (limit == 0 || !read_block(lora, b) || index < 0 || index >= b.P) return;
  if (row_slot.scalar_type() != at::kInt || !row_slot.is_contiguous()) return;
  const int32_t* rs = row_slot.data_ptr<int32_t>();
  const int64_t T = row_slot.numel(), K = b.proj[4 * index], es = element_size(b.wtype);
  const int64_t s0 = b.proj[4 * index + 2], s1 = std::min(b.proj[4 * index + 3], b.S);
  if (s0 < 0) return;  // a bad block: `add` says what is wrong with it
  uint64_t used = 0;  // slots below 64 that a row uses (more slots than that: nothing is prefetched for them)
  for (int64_t t = 0; t < T; ++t)
    if (rs[t] >= 0 && rs[t] < 64) used |= uint64_t{1} << rs[t];
  // A then B of a slot's segments are one region (the block is laid out slot after slot, each slot's
  // projections in the fused layer's order): the lines from the first A to the last B, into L2
  for (int64_t i = s0; i < s1;) {
    const int64_t slot = b.seg[kSegmentInts * i];
    int64_t j = i, lo = b.bytes, hi = 0;
    for (; j < s1 && b.seg[kSegmentInts * j] == slot; ++j) {
      const int64_t* e = b.seg + kSegmentInts * j;
      lo = std::min({lo, e[4], e[5]});
      hi = std::max({hi, e[4] + e[1] * K * es, e[5] + e[1] * (e[3] - e[2]) * es});
    }
    if (slot >= 0 && slot < 64 && (used >> slot & 1))
      for (int64_t off = std::max<int64_t>(0, lo) / 64 * 64, end = std::min({hi, b.bytes, hi - lo > limit ? lo + limit : hi});
           off < end; off += 64)
        __builtin_prefetch(b.base + off, 0, 2);
    i = j;
  }
}

bool with_base() {
  static const bool on = [] {
    // opt-in: quiet batch-1 decode with an adapter measured 0.72-0.73x the base model with it against
    // 0.79x without (2 threads, default model, same runs); the 16-row figure did not separate from drift
    const char* env = std::getenv("PERFXLM_LORA_WITH_BASE");
    return env != nullptr && *env != '0';
  }();
  return on;
}

bool project_add(at::Tensor& y, const at::Tensor& x, at::TensorList lora, int64_t index, const BaseRange& base) {
  Block b;
  if (!read_block(lora, b)) return false;
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous(), "lora: project_add's y must be contiguous");
  const Step st = prepare(y, x, lora, index);
  if (st.groups.empty()) return false;
  with_weights(st, [&](auto w) { apply_with_base<decltype(w)>(st.o, st.groups, base); });
  return true;
}

namespace {

// The kernel alone, for tests against a plain-torch reference: y += ... in place.
void lora_add(at::Tensor y, const at::Tensor& x, at::TensorList lora, int64_t index) { add(y, x, lora, index); }

}  // namespace

}  // namespace perfxlm_lora

TORCH_LIBRARY_FRAGMENT(perfxlm, m) { m.def("lora_add(Tensor(a!) y, Tensor x, Tensor[] lora, int index) -> ()"); }

TORCH_LIBRARY_IMPL(perfxlm, CPU, m) { m.impl("lora_add", &perfxlm_lora::lora_add); }
