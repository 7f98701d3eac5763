// The step's LoRA adapters on one projection of the fused decode layer, Punica's SGMV done on the CPU:
// rows are grouped by the adapter slot they use, and each group runs a shrink (h = x A^T * scale, its
// slot's columns only) then an expand (y += h B^T, each B row over the output columns it covers only),
// so a slot's A and B are read once per step whatever the number of its rows, other slots' columns are
// never touched, and the zero blocks of a fused projection's packed B^T (q's B beside k's columns) are
// skipped. Both passes split across threads as the base GEMV kernels do: the shrink over packed
// columns, the expand over blocks of 16 output columns; work too small to pay for a parallel region's
// fork and join stays on the calling thread. A and B come in float32 (exact against peft in a float32
// engine) or bfloat16 (half the bytes, the adapters' form next to bf16 or quantized base weights),
// widened in registers; sums are float32 either way.
//
// Decode with adapters is bound by reading A and B (at rank 16 on every projection of a 135M model,
// 1 MB of float32 per layer, 30 MB per step beside the 4-bit model's 98 MB), so bytes and the threads
// reading them are what this file is about.

#include "lora_kernels.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd16.h"

namespace perfxlm_lora {
namespace {

// Below this many multiply-adds a pass runs on the calling thread (a 1-row step's qkv shrink at rank 16
// is about 28 thousand).
constexpr int64_t kParallelMacs = 1 << 15;
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

// Consecutive packed columns of one slot whose B rows cover the same output columns: one checkpoint
// module (q, k or v of a fused q|k|v).
struct Segment {
  int64_t c0, c1, n0, n1;
};

// The rows of the step that use one slot, with that slot's columns in this projection.
struct Group {
  int64_t c0 = 0, c1 = 0;
  std::vector<int64_t> rows;
  std::vector<Segment> segments;
  int64_t h_offset = 0;  // where its h [rows, c1 - c0] starts in the step's buffer
};

// h[i][c] = (x_i . A_c) * scale_c for MT rows and one column c.
template <int MT, typename W>
void shrink_tile(const float* const* xr, int64_t K, const W* a, float scale, float* const* h) {
#ifdef PERFXLM_SIMD16
  simd16::V acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = simd16::zero();
  for (int64_t k = 0; k < K; k += 16) {
    const simd16::V av = simd16::load(a + k, K - k);
    for (int i = 0; i < MT; ++i) acc[i] = simd16::fmadd(simd16::load(xr[i] + k, K - k), av, acc[i]);
  }
  for (int i = 0; i < MT; ++i) *h[i] = simd16::reduce_add(acc[i]) * scale;
#else
  float acc[MT] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float av = widen(a[k]);
    for (int i = 0; i < MT; ++i) acc[i] += xr[i][k] * av;
  }
  for (int i = 0; i < MT; ++i) *h[i] = acc[i] * scale;
#endif
}

// y_i[n0:n1] += sum over the segment's columns c of h_i[c] * B^T[c, n0:n1], for MT rows; each y value is
// read and written once, each B value read once.
template <int MT, typename W>
void expand_tile(float* const* yr, const float* const* hr, const W* bt, int64_t N, int64_t cols, int64_t n0,
                 int64_t n1) {
#ifdef PERFXLM_SIMD16
  for (int64_t n = n0; n < n1; n += 16) {
    const int64_t valid = n1 - n;
    simd16::V acc[MT];
    for (int i = 0; i < MT; ++i) acc[i] = simd16::load(yr[i] + n, valid);
    for (int64_t c = 0; c < cols; ++c) {
      const simd16::V b = simd16::load(bt + c * N + n, valid);
      for (int i = 0; i < MT; ++i) acc[i] = simd16::fmadd(simd16::set1(hr[i][c]), b, acc[i]);
    }
    for (int i = 0; i < MT; ++i) simd16::store(yr[i] + n, acc[i], valid);
  }
#else
  for (int64_t n = n0; n < n1; ++n) {
    float acc[MT];
    for (int i = 0; i < MT; ++i) acc[i] = yr[i][n];
    for (int64_t c = 0; c < cols; ++c) {
      const float b = widen(bt[c * N + n]);
      for (int i = 0; i < MT; ++i) acc[i] += hr[i][c] * b;
    }
    for (int i = 0; i < MT; ++i) yr[i][n] = acc[i];
  }
#endif
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

int64_t grain(int64_t tasks, int64_t macs) {
  if (macs < kParallelMacs || tasks <= 1) return std::max<int64_t>(tasks, 1);
  const int64_t per_task = std::max<int64_t>(1, macs / tasks);
  return std::max<int64_t>(1, kParallelMacs / 2 / per_task);
}

template <typename W>
void apply(float* y, int64_t y_stride, const float* x, int64_t x_stride, int64_t K, const W* a, const W* bt,
           int64_t N, const float* scale, std::vector<Group>& groups) {
  // shrink: one task per (group, column), flattened
  std::vector<std::pair<int32_t, int64_t>> tasks;
  int64_t h_size = 0, shrink_macs = 0, expand_macs = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    Group& gr = groups[g];
    gr.h_offset = h_size;
    const int64_t rows = static_cast<int64_t>(gr.rows.size());
    h_size += rows * (gr.c1 - gr.c0);
    for (int64_t c = gr.c0; c < gr.c1; ++c) tasks.emplace_back(static_cast<int32_t>(g), c);
    shrink_macs += rows * (gr.c1 - gr.c0) * K;
    for (const Segment& s : gr.segments) expand_macs += rows * (s.c1 - s.c0) * (s.n1 - s.n0);
  }
  std::vector<float> h(static_cast<size_t>(h_size));
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, n_tasks, grain(n_tasks, shrink_macs), [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const Group& gr = groups[tasks[j].first];
      const int64_t c = tasks[j].second, span = gr.c1 - gr.c0, rows = static_cast<int64_t>(gr.rows.size());
      for (int64_t i0 = 0; i0 < rows; i0 += kTile) {
        const int64_t m = std::min<int64_t>(kTile, rows - i0);
        const float* xr[8];
        float* hp[8];
        for (int64_t i = 0; i < m; ++i) {
          xr[i] = x + gr.rows[i0 + i] * x_stride;
          hp[i] = h.data() + gr.h_offset + (i0 + i) * span + (c - gr.c0);
        }
        with_tile(m, [&](auto mt) { shrink_tile<decltype(mt)::value>(xr, K, a + c * K, scale[c], hp); });
      }
    }
  });
  // expand: blocks of 16 output columns
  const int64_t blocks = (N + 15) / 16;
  at::parallel_for(0, blocks, grain(blocks, expand_macs), [&](int64_t begin, int64_t end) {
    const int64_t lo = begin * 16, hi = std::min(N, end * 16);
    for (const Group& gr : groups) {
      const int64_t span = gr.c1 - gr.c0, rows = static_cast<int64_t>(gr.rows.size());
      for (const Segment& s : gr.segments) {
        const int64_t n0 = std::max(s.n0, lo), n1 = std::min(s.n1, hi);
        if (n0 >= n1) continue;
        for (int64_t i0 = 0; i0 < rows; i0 += kTile) {
          const int64_t m = std::min<int64_t>(kTile, rows - i0);
          float* yr[8];
          const float* hr[8];
          for (int64_t i = 0; i < m; ++i) {
            yr[i] = y + gr.rows[i0 + i] * y_stride;
            hr[i] = h.data() + gr.h_offset + (i0 + i) * span + (s.c0 - gr.c0);
          }
          with_tile(m, [&](auto mt) {
            expand_tile<decltype(mt)::value>(yr, hr, bt + s.c0 * N, N, s.c1 - s.c0, n0, n1);
          });
        }
      }
    }
  });
}

}  // namespace

void add(at::Tensor& y, const at::Tensor& x, at::TensorList lora, int64_t index) {
  if (lora.empty()) return;
  TORCH_CHECK(static_cast<int64_t>(lora.size()) >= 1 + 4 * (index + 1),
              "lora: expected row_slot then (A, B^T, scale, cols) per projection");
  const at::Tensor& a = lora[1 + 4 * index];
  if (!a.numel()) return;
  const at::Tensor& row_slot = lora[0];
  const at::Tensor& bt = lora[2 + 4 * index];
  const at::Tensor& scale = lora[3 + 4 * index];
  const at::Tensor& cols = lora[4 + 4 * index];
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
              "lora: x and y must be 2-D float32");
  const int64_t T = x.size(0), K = x.size(1), R = a.size(0), N = y.size(1);
  TORCH_CHECK(a.dim() == 2 && bt.dim() == 2 && a.size(1) == K && bt.size(0) == R && bt.size(1) == N && y.size(0) == T,
              "lora: A must be [R, ", K, "] and B^T [R, ", N, "]");
  TORCH_CHECK(a.scalar_type() == bt.scalar_type() && (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
              "lora: A and B^T must both be float32 or both bfloat16");
  TORCH_CHECK(a.is_contiguous() && bt.is_contiguous(), "lora: A and B^T must be contiguous");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == R && scale.is_contiguous(),
              "lora: scale must be contiguous float32 [R]");
  TORCH_CHECK(cols.scalar_type() == at::kInt && cols.dim() == 2 && cols.size(0) == R && cols.size(1) == 3 &&
                  cols.is_contiguous(), "lora: cols must be contiguous int32 [R, 3]");
  TORCH_CHECK(row_slot.scalar_type() == at::kInt && row_slot.numel() == T && row_slot.is_contiguous(),
              "lora: row_slot must be contiguous int32 [rows]");
  if (y.stride(1) != 1) {  // not met by the fused layer's outputs; kept correct anyway
    at::Tensor yc = y.contiguous();
    add(yc, x, lora, index);
    y.copy_(yc);
    return;
  }
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();

  // each slot's columns (contiguous: the slots are packed one after another), split where the output
  // columns a B row covers change
  const int32_t* info = cols.data_ptr<int32_t>();
  std::vector<Group> groups;
  std::vector<int64_t> group_of_slot;
  for (int64_t c = 0; c < R; ++c) {
    const int32_t slot = info[3 * c], n0 = info[3 * c + 1], n1 = info[3 * c + 2];
    TORCH_CHECK(slot >= 0 && n0 >= 0 && n0 <= n1 && n1 <= N, "lora: bad cols entry at column ", c);
    if (slot >= static_cast<int32_t>(group_of_slot.size())) group_of_slot.resize(slot + 1, -1);
    if (group_of_slot[slot] < 0) {
      group_of_slot[slot] = static_cast<int64_t>(groups.size());
      groups.emplace_back();
      groups.back().c0 = c;
    } else {
      TORCH_CHECK(info[3 * (c - 1)] == slot, "lora: a slot's columns must be contiguous");
    }
    Group& gr = groups[group_of_slot[slot]];
    gr.c1 = c + 1;
    if (!gr.segments.empty() && gr.segments.back().n0 == n0 && gr.segments.back().n1 == n1) {
      gr.segments.back().c1 = c + 1;
    } else {
      gr.segments.push_back({c, c + 1, n0, n1});
    }
  }
  const int32_t* rs = row_slot.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int32_t slot = rs[t];
    if (slot >= 0 && slot < static_cast<int32_t>(group_of_slot.size()) && group_of_slot[slot] >= 0)
      groups[group_of_slot[slot]].rows.push_back(t);
  }
  groups.erase(std::remove_if(groups.begin(), groups.end(), [](const Group& g) { return g.rows.empty(); }),
               groups.end());
  if (groups.empty()) return;
  float* yp = y.data_ptr<float>();
  const float* xp = xc.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  if (a.scalar_type() == at::kFloat) {
    apply(yp, y.stride(0), xp, xc.stride(0), K, a.data_ptr<float>(), bt.data_ptr<float>(), N, sp, groups);
  } else {
    apply(yp, y.stride(0), xp, xc.stride(0), K, reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>()),
          reinterpret_cast<const uint16_t*>(bt.data_ptr<at::BFloat16>()), N, sp, groups);
  }
}

namespace {

// The kernel alone, for tests against a plain-torch reference: y += ... in place.
void lora_add(at::Tensor y, const at::Tensor& x, at::TensorList lora, int64_t index) { add(y, x, lora, index); }

}  // namespace

}  // namespace perfxlm_lora

TORCH_LIBRARY_FRAGMENT(perfxlm, m) { m.def("lora_add(Tensor(a!) y, Tensor x, Tensor[] lora, int index) -> ()"); }

TORCH_LIBRARY_IMPL(perfxlm, CPU, m) { m.impl("lora_add", &perfxlm_lora::lora_add); }
