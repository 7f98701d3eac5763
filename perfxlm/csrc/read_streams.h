// The order batch-1 GEMVs read their weights in, process-wide: 1, each thread's share as one sequential
// stream; 2, its two halves side by side (item i of the first half, then item i of the second), two
// sequential streams far apart. Zen 4's hardware prefetchers keep two such streams in flight together
// where one stream alone leaves DRAM bandwidth unused (benchmarks/gemv_streams.py measures both on model
// shapes cycled past the L3). Only the order of whole items (row groups, bf16 panels) changes: each
// output's sum is the same either way, so outputs are bit-identical. Set by set_gemv_streams (tests,
// measurements); until then PERFXLM_GEMV_STREAMS (1 or 2), else 0: each kernel's measured choice
// (two_streams' argument). Measured per call, one thread, loaded (per CPU-second, weights cycled past the
// L3): Q8_0 row groups at one row 1.25-1.37x with two block-interleaved streams, Q4_0 1.10-1.13x; the
// Q4_1 / K-quant groups 1.14-1.22x once interleaved a block at a time too (their group-at-a-time order
// gave 0.86-1.10x), so all row groups read two streams at batch 1 by default; the bf16 panels' pairs
// (0.88-1.23x) no clear gain, so those stay one stream unless forced.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace perfxlm_streams {

inline std::atomic<int> g_streams{-1};  // -1: not chosen yet; 0 each kernel's default, 1, 2

inline int default_streams() {
  const char* env = std::getenv("PERFXLM_GEMV_STREAMS");
  if (env && std::strcmp(env, "1") == 0) return 1;
  if (env && std::strcmp(env, "2") == 0) return 2;
  return 0;
}

inline int streams_now() {
  int v = g_streams.load(std::memory_order_relaxed);
  if (v < 0) {
    v = default_streams();
    g_streams.store(v, std::memory_order_relaxed);
  }
  return v;
}

// Whether a kernel reads two streams: forced either way, else its measured default.
inline bool two_streams(bool by_default) {
  const int v = streams_now();
  return v == 2 || (v == 0 && by_default);
}

// fn(i) for every i of [i0, i1), in the order two_streams(by_default) names.
template <class Fn>
inline void each_in_order(int64_t i0, int64_t i1, bool by_default, Fn&& fn) {
  if (two_streams(by_default) && i1 - i0 >= 2) {
    const int64_t half = (i1 - i0 + 1) / 2;
    for (int64_t i = 0; i < half; ++i) {
      fn(i0 + i);
      if (i0 + half + i < i1) fn(i0 + half + i);
    }
    return;
  }
  for (int64_t i = i0; i < i1; ++i) fn(i);
}

}  // namespace perfxlm_streams
