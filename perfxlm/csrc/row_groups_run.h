// The op body the row-group GEMVs share (row_groups.h for Q8_0 / Q4_0, row_groups_k.h for the K-quants):
// y [M, N] from a prepared product, groups of 8 weight rows shared out over threads, each range of groups
// written by the kernel's `groups_into` with the bias added.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "read_streams.h"

namespace perfxlm_row_groups {

// The order a thread walks its range of groups in (read_streams.h): one after another, or the range's two
// halves side by side. Each group's sums are the same either way.
template <class Fn>
inline void each_group(int64_t g0, int64_t g1, Fn&& fn) {
  perfxlm_streams::each_in_order(g0, g1, false, fn);  // a group at a time: no gain measured
}

// Activation rows per pass over a group's blocks: each block's codes are loaded (and 4-bit ones unpacked)
// once per tile of rows, then every row of the tile takes its dot products from the registers. With 32
// vector registers (AVX-512VL) 8 rows' accumulators fit beside a block's 8 code vectors (Q8_0 / Q4_0: 2 per
// row; Q4_1 sums its mins in a pass of their own past 4 rows, row_groups_m.h), so a verification step of up
// to 8 rows unpacks each block once; AVX2 has 16 registers, room for 2 rows.
#if defined(__AVX512VL__)
constexpr int kRowTile = 8;
#else
constexpr int kRowTile = 2;
#endif

// The largest tile row_tiles uses, process-wide: kRowTile unless set_row_tile or PERFXLM_ROW_TILE (1..8)
// caps it (measurements compare tile sizes in one process; a row's bits are the same in any tile).
inline std::atomic<int> g_row_tile{-1};  // -1: not read yet; 0: kRowTile

inline int row_tile_cap() {
  int v = g_row_tile.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("PERFXLM_ROW_TILE");
    v = env ? std::max(0, std::min(8, std::atoi(env))) : 0;
    g_row_tile.store(v, std::memory_order_relaxed);
  }
  return v == 0 ? kRowTile : std::min(v, kRowTile);
}

// fn(std::integral_constant<int, R>{}, m0) over rows [0, M) in as few tiles of at most row_tile_cap() rows
// as there can be, their sizes as even as possible (with a cap of 4: 5 rows as 2 + 3, 6 as 3 + 3): a tile
// of one row pays a block's whole loading and unpacking for one row's dots.
template <class Fn>
inline void row_tiles(int64_t M, Fn&& fn) {
  const int64_t cap = row_tile_cap();
  const int64_t tiles = (M + cap - 1) / cap;
  int64_t m = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t size = t + 1 == tiles ? M - m : (M - m) / (tiles - t);
    switch (size) {
      case 1: fn(std::integral_constant<int, 1>{}, m); break;
      case 2: fn(std::integral_constant<int, 2>{}, m); break;
      case 3: if constexpr (kRowTile >= 3) fn(std::integral_constant<int, 3>{}, m); break;
      case 4: if constexpr (kRowTile >= 4) fn(std::integral_constant<int, 4>{}, m); break;
      case 5: if constexpr (kRowTile >= 5) fn(std::integral_constant<int, 5>{}, m); break;
      case 6: if constexpr (kRowTile >= 6) fn(std::integral_constant<int, 6>{}, m); break;
      case 7: if constexpr (kRowTile >= 7) fn(std::integral_constant<int, 7>{}, m); break;
      case 8: if constexpr (kRowTile >= 8) fn(std::integral_constant<int, 8>{}, m); break;
      default: break;
    }
    m += size;
  }
}

// Batch 1 in two read streams (read_streams.h): groups [g0, g1) walked as the range's two halves side by
// side, pair(ga, gb, out_a, out_b) on a group of each half (block b of one, then block b of the other),
// one(g, out) on the group left over when the range is odd; each group's 8 outputs stored at its columns
// of the one output row, bias added. The kernels behind pair and one sum each group in its one-row order.
template <class Pair, class One>
inline void halves_in_pairs(int64_t g0, int64_t g1, int64_t n_out, float* y, const float* bias, Pair&& pair,
                            One&& one) {
  constexpr int64_t kRows = 8;
  auto store = [&](int64_t g, const float* out) {
    const int64_t n0 = g * kRows, n = std::min<int64_t>(kRows, n_out - n0);
    for (int64_t i = 0; i < n; ++i) y[n0 + i] = out[i] + (bias ? bias[n0 + i] : 0.f);
  };
  const int64_t half = (g1 - g0 + 1) / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t ga = g0 + i, gb = g0 + half + i;
    float out_a[kRows], out_b[kRows];
    if (gb < g1) {
      pair(ga, gb, out_a, out_b);
      store(gb, out_b);
    } else {
      one(ga, out_a);
    }
    store(ga, out_a);
  }
}

template <class Product, class Into>
inline at::Tensor run(const char* op, const at::Tensor& xc, const Product& p, int64_t n_out,
                      const c10::optional<at::Tensor>& bias, Into into) {
  at::Tensor y = at::empty({p.M, n_out}, xc.options());
  at::Tensor bc;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n_out, op, ": bias size ", bias->numel(), " != ", n_out);
    bc = bias->to(at::kFloat).contiguous();
    bp = bc.data_ptr<float>();
  }
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, p.groups, 8, [&](int64_t g0, int64_t g1) { into(p, g0, g1, yp, n_out, bp); });
  return y;
}

}  // namespace perfxlm_row_groups
