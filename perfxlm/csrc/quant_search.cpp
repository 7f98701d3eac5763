// The group searches of perfxlm.quant.search in one pass per group: affine codes (0..top) whose scale and
// min make the weighted squared error least, llama.cpp's make_qkx2 / make_qkx3 search (search_affine),
// and codes into a table of levels with one searched scale (search_levels, below).
//
// The Python module holds the definition (and a plain-torch version of it, used where this is not
// built): candidates stretch the group's [min, max] by (top + rmin + i * rdelta) / top, i = 0..steps;
// each candidate's codes get the weighted least-squares scale and min (closed form, double sums) and
// its error from the same sums; the best, and one refit on its stored codes, are rounded to float16
// (when `half`), recoded against the stored values, and compared with the plain rule on the stored
// values, which wins ties. The torch version runs ~200 elementwise passes per weight; here a group
// stays in registers and L1, which is what makes quantizing at every load affordable (a 7B model's
// 6.5 G weights). Results match the torch version's choices up to float summation order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace perfxlm_search {
namespace {

struct Fit {
  double s, m, err;
};

// Weighted least squares x ~ s u + m from the sums; err = +inf where undetermined or s <= 0.
inline Fit fit(double sw, double swx, double swx2, double swu, double swu2, double swux) {
  const double det = sw * swu2 - swu * swu;
  if (!(det > 0)) return {0, 0, std::numeric_limits<double>::infinity()};
  const double s = (sw * swux - swx * swu) / det;
  const double m = (swu2 * swx - swu * swux) / det;
  if (!(s > 0)) return {0, 0, std::numeric_limits<double>::infinity()};
  const double err = s * s * swu2 + 2 * s * m * swu - 2 * s * swux + m * m * sw - 2 * m * swx + swx2;
  return {s, m, err};
}

inline float stored_value(float v, bool half) {
  return half ? static_cast<float>(c10::Half(v)) : v;
}

// Round half to even for 0 <= v < 2^22, as std::nearbyint does, in two adds that vectorize: adding
// 1.5 * 2^23 leaves no fraction bits, so the sum is rounded by the FPU (needs -ffp-contract=off and no
// fast-math, as the kernels are built).
inline float round_small(float v) {
  constexpr float kMagic = 12582912.0f;
  return (v + kMagic) - kMagic;
}

// Codes for a stored (s, m) as floats in `q`, and their weighted squared error. Clamped before rounding,
// which gives round-then-clamp's codes and keeps round_small's argument in range.
inline double recode(const float* x, const float* w, int64_t G, float s, float m, float top, float* q) {
  const float safe = s > 0 ? s : 1.0f;
  float err = 0;
#pragma omp simd reduction(+ : err)
  for (int64_t j = 0; j < G; ++j) {
    const float v = round_small(std::min(std::max((x[j] - m) / safe, 0.0f), top));
    q[j] = v;
    const float d = s * v + m - x[j];
    err += w[j] * d * d;
  }
  return err;
}

// Sums of one candidate's codes: sum w u, sum w u^2, sum w x u. Float accumulators over one group (at
// most a few hundred terms, as torch sums them) so that the loop vectorizes.
inline void candidate_sums(const float* normed, const float* w, const float* wx, int64_t G, float factor, float top,
                           double* swu, double* swu2, double* swux) {
  float a = 0, b = 0, c = 0;
#pragma omp simd reduction(+ : a, b, c)
  for (int64_t j = 0; j < G; ++j) {
    const float q = std::min(round_small(normed[j] * factor), top);  // normed >= 0
    const float wu = w[j] * q;
    a += wu;
    b += wu * q;
    c += wx[j] * q;
  }
  *swu = a;
  *swu2 = b;
  *swux = c;
}

// The error weights of perfxlm.quant.search.element_weights: sqrt(mean x^2) + |x| without statistics,
// imp * sqrt(2 mean x^2 + x^2) with them.
inline void element_weights(const float* x, const float* imp, int64_t G, float* w) {
  float sum2 = 0;
  for (int64_t j = 0; j < G; ++j) sum2 += x[j] * x[j];
  const float sigma2 = sum2 / static_cast<float>(G);
  if (imp == nullptr) {
    const float av = std::sqrt(sigma2);
    for (int64_t j = 0; j < G; ++j) w[j] = av + std::fabs(x[j]);
  } else {
    for (int64_t j = 0; j < G; ++j) w[j] = imp[j] * std::sqrt(2.0f * sigma2 + x[j] * x[j]);
  }
}

void search_group(const float* x, const float* imp, int64_t G, int top, int64_t steps, double rmin, double rdelta,
                  bool half, uint8_t* u_out, float* s_out, float* m_out, float* buf) {
  float* normed = buf;  // 5 scratch rows of G floats
  float* wx = buf + G;
  float* best_q = buf + 2 * G;
  float* q = buf + 3 * G;
  float* w = buf + 4 * G;
  element_weights(x, imp, G, w);
  float lo = x[0], hi = x[0];
  for (int64_t j = 0; j < G; ++j) {
    lo = std::min(lo, x[j]);
    hi = std::max(hi, x[j]);
  }
  const float span = hi - lo;
  const float span_safe = span > 0 ? span : 1.0f;
  float fw = 0, fwx = 0, fwx2 = 0;
  for (int64_t j = 0; j < G; ++j) {
    normed[j] = (x[j] - lo) / span_safe;
    wx[j] = w[j] * x[j];
    fw += w[j];
    fwx += wx[j];
    fwx2 += wx[j] * x[j];
  }
  const double sw = fw, swx = fwx, swx2 = fwx2;
  const float ftop = static_cast<float>(top);
  Fit best{0, 0, std::numeric_limits<double>::infinity()};
  for (int64_t i = 0; i <= steps; ++i) {
    const float factor = static_cast<float>(top + rmin + rdelta * static_cast<double>(i));
    double swu, swu2, swux;
    candidate_sums(normed, w, wx, G, factor, ftop, &swu, &swu2, &swux);
    const Fit f = fit(sw, swx, swx2, swu, swu2, swux);
    if (f.err < best.err) best = f;
  }
  // the plain rule first: the candidates after it must be strictly better
  float s = stored_value(span / top, half), m = stored_value(lo, half);
  double err = recode(x, w, G, s, m, ftop, best_q);
  auto consider = [&](double cs, double cm) {
    const float ss = stored_value(static_cast<float>(cs), half), sm = stored_value(static_cast<float>(cm), half);
    if (!(ss > 0) || !std::isfinite(ss) || !std::isfinite(sm)) return;
    const double e = recode(x, w, G, ss, sm, ftop, q);
    if (!(e < err)) return;
    err = e;
    s = ss;
    m = sm;
    std::copy(q, q + G, best_q);
  };
  if (std::isfinite(best.err)) {
    consider(best.s, best.m);
    // one alternating step: the least-squares fit to the searched fit's stored codes
    const float bs = stored_value(static_cast<float>(best.s), half);
    const float bm = stored_value(static_cast<float>(best.m), half);
    if (bs > 0 && std::isfinite(bs) && std::isfinite(bm)) {
      recode(x, w, G, bs, bm, ftop, q);
      float a = 0, b = 0, c = 0;
      for (int64_t j = 0; j < G; ++j) {
        a += w[j] * q[j];
        b += w[j] * q[j] * q[j];
        c += wx[j] * q[j];
      }
      const Fit f = fit(sw, swx, swx2, a, b, c);
      if (std::isfinite(f.err)) consider(f.s, f.m);
    }
  }
  for (int64_t j = 0; j < G; ++j) u_out[j] = static_cast<uint8_t>(best_q[j]);
  *s_out = s;
  *m_out = m;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> search_affine(const at::Tensor& groups,
                                                             const c10::optional<at::Tensor>& importance,
                                                             int64_t top, int64_t steps, double rmin,
                                                             double rdelta, bool half) {
  TORCH_CHECK(groups.dim() == 2 && groups.scalar_type() == at::kFloat && groups.is_contiguous(),
              "search_affine: groups must be contiguous float32 [R, G]");
  const int64_t R = groups.size(0), G = groups.size(1);
  const float* imp = nullptr;
  int64_t P = 1;  // group r takes importance row r % P (a row's groups, repeated for every output row)
  if (importance.has_value() && importance->defined()) {
    TORCH_CHECK(importance->dim() == 2 && importance->size(1) == G && importance->scalar_type() == at::kFloat &&
                    importance->is_contiguous() && importance->size(0) > 0 && R % importance->size(0) == 0,
                "search_affine: importance must be contiguous float32 [P, G] with P dividing R");
    imp = importance->data_ptr<float>();
    P = importance->size(0);
  }
  TORCH_CHECK(top >= 1 && top <= 255, "search_affine: top must be in 1..255");
  auto u = at::empty({R, G}, groups.options().dtype(at::kByte));
  auto s = at::empty({R}, groups.options());
  auto m = at::empty({R}, groups.options());
  const float* x = groups.data_ptr<float>();
  uint8_t* up = u.data_ptr<uint8_t>();
  float* sp = s.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  const int top_i = static_cast<int>(top);
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(G, 1)), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(5 * G);
    for (int64_t r = begin; r < end; ++r) {
      const float* ir = imp == nullptr ? nullptr : imp + (r % P) * G;
      search_group(x + r * G, ir, G, top_i, steps, rmin, rdelta, half, up + r * G, sp + r, mp + r, buf.data());
    }
  });
  return std::make_tuple(u, s, m);
}

// ---------------------------------------------------------------------------------------------
// search_levels: codes into a sorted table of levels (5-bit centred codes' 32 uniform levels, NF4's 16)
// and one scale per group, value = scale * levels[u], as perfxlm.quant.search.search_levels defines it:
// scales sign x factor x absmax for both signs and factors[] (float32 products, as torch multiplies a
// tensor by a Python float), each refit by least squares on its codes (double from float sums), the
// least error kept (strictly less: the first wins ties); then the plain rule (absmax) and the searched
// scale rounded to float16 and recoded against the stored value, the plain rule winning ties. The torch
// version runs ~170 elementwise passes per weight, with a bucketize for each code; here a group stays
// in registers and the nearest level of a uniform table is one rounding and two exact comparisons.
// ---------------------------------------------------------------------------------------------

// A sorted table and its midpoints (torch's (levels[1:] + levels[:-1]) / 2); `uniform` where each level
// and midpoint is lo + i * step (i integer, or half an integer) to the bit, so both come from arithmetic.
struct Table {
  const float* levels;
  int L;
  std::vector<float> mid;
  bool uniform;
  float lo, step;

  Table(const float* lv, int n) : levels(lv), L(n), mid(n - 1) {
    for (int i = 0; i + 1 < n; ++i) mid[i] = (lv[i] + lv[i + 1]) / 2.0f;
    lo = lv[0];
    step = (lv[n - 1] - lv[0]) / static_cast<float>(n - 1);
    uniform = step > 0;
    for (int i = 0; i < n && uniform; ++i) uniform = at(static_cast<float>(i)) == lv[i];
    for (int i = 0; i + 1 < n && uniform; ++i) uniform = at(static_cast<float>(i) + 0.5f) == mid[i];
  }

  float at(float i) const { return lo + i * step; }

  // torch.bucketize(clamp(v, -1, 1), mid): the number of midpoints below v (a tie goes to the lower level).
  int nearest_sorted(float v) const {
    v = std::min(std::max(v, -1.0f), 1.0f);
    return static_cast<int>(std::lower_bound(mid.begin(), mid.end(), v) - mid.begin());
  }
};

// The nearest level's index of each x[j] / d (clamped to [-1, 1]) as a float, into q. A uniform table:
// the rounded position (a multiply by 1 / step: it only has to land within one level) is off by at most
// one where v sits near a midpoint, and two comparisons with the exact midpoints (lo + (q -+ 0.5) step,
// the table's own floats) settle it, as bucketize would. Locals, not the table's fields, in the loop: a
// float store through q could alias them and stop the vectorizer.
inline void nearest_codes(const Table& t, const float* x, int64_t G, float d, float* q) {
  if (t.uniform) {
    const float top = static_cast<float>(t.L - 1), lo = t.lo, step = t.step, inv = 1.0f / t.step;
#pragma omp simd
    for (int64_t j = 0; j < G; ++j) {
      const float v = std::min(std::max(x[j] / d, -1.0f), 1.0f);
      float i = round_small(std::min(std::max((v - lo) * inv, 0.0f), top));
      const float below = lo + (i - 0.5f) * step, above = lo + (i + 0.5f) * step;
      i = (i > 0 && !(below < v)) ? i - 1 : ((i < top && above < v) ? i + 1 : i);
      q[j] = i;
    }
  } else {
    for (int64_t j = 0; j < G; ++j) q[j] = static_cast<float>(t.nearest_sorted(x[j] / d));
  }
}

// sum w lv^2 and sum w x lv over a group's codes (torch's (w * lv) * lv and wx * lv, float sums).
inline void level_sums(const Table& t, const float* w, const float* wx, const float* q, int64_t G, float* swl2,
                       float* swxl) {
  float a = 0, b = 0;
  if (t.uniform) {
    const float lo = t.lo, step = t.step;
#pragma omp simd reduction(+ : a, b)
    for (int64_t j = 0; j < G; ++j) {
      const float lv = lo + q[j] * step;
      a += (w[j] * lv) * lv;
      b += wx[j] * lv;
    }
  } else {
    for (int64_t j = 0; j < G; ++j) {
      const float lv = t.levels[static_cast<int>(q[j])];
      a += (w[j] * lv) * lv;
      b += wx[j] * lv;
    }
  }
  *swl2 = a;
  *swxl = b;
}

inline float level_of(const Table& t, float i) {
  return t.uniform ? t.at(i) : t.levels[static_cast<int>(i)];
}

void search_levels_group(const float* x, const float* imp, int64_t G, const Table& t, const float* factors,
                         int64_t nf, uint8_t* u_out, float* s_out, float* buf) {
  float* w = buf;  // 4 scratch rows of G floats
  float* wx = buf + G;
  float* q = buf + 2 * G;
  float* best_q = buf + 3 * G;
  element_weights(x, imp, G, w);
  float absmax = 0;
  for (int64_t j = 0; j < G; ++j) absmax = std::max(absmax, std::fabs(x[j]));
  const float safe = absmax > 0 ? absmax : 1.0f;
  float fx2 = 0;
  for (int64_t j = 0; j < G; ++j) {
    wx[j] = w[j] * x[j];
    fx2 += wx[j] * x[j];
  }
  const double swx2 = fx2;
  double best_s = safe, best_err = std::numeric_limits<double>::infinity();
  for (int sign = 0; sign < 2; ++sign) {
    for (int64_t f = 0; f < nf; ++f) {
      const float d = (sign ? -factors[f] : factors[f]) * safe;
      nearest_codes(t, x, G, d, q);
      float a, b;
      level_sums(t, w, wx, q, G, &a, &b);
      const double swl2 = a, swxl = b;
      if (!(swl2 > 0)) continue;
      const double err = swx2 - swxl * swxl / swl2;
      if (err < best_err) {
        best_err = err;
        best_s = swxl / swl2;
      }
    }
  }
  // stored values: codes against the float16 scale, error on them
  auto stored = [&](float s, float* codes) {
    s = static_cast<float>(c10::Half(s));
    nearest_codes(t, x, G, s != 0 ? s : 1.0f, codes);
    float err = 0;
#pragma omp simd reduction(+ : err)
    for (int64_t j = 0; j < G; ++j) {
      const float diff = s * level_of(t, codes[j]) - x[j];
      err += w[j] * (diff * diff);
    }
    return std::make_pair(s, err);
  };
  auto [s, err] = stored(absmax, best_q);  // the plain rule first: ties keep it
  const auto [cs, cerr] = stored(static_cast<float>(best_s), q);
  if (cerr < err && std::isfinite(cs) && cs != 0) {
    s = cs;
    std::copy(q, q + G, best_q);
  }
  for (int64_t j = 0; j < G; ++j) u_out[j] = static_cast<uint8_t>(best_q[j]);
  *s_out = s;
}

// The importance rows of a search ([P, G], P dividing R: group r reads row r % P), or none; checked.
inline std::pair<const float*, int64_t> importance_rows(const c10::optional<at::Tensor>& importance, int64_t R,
                                                        int64_t G, const char* op) {
  if (!importance.has_value() || !importance->defined()) return {nullptr, 1};
  TORCH_CHECK(importance->dim() == 2 && importance->size(1) == G && importance->scalar_type() == at::kFloat &&
                  importance->is_contiguous() && importance->size(0) > 0 && R % importance->size(0) == 0,
              op, ": importance must be contiguous float32 [P, G] with P dividing R");
  return {importance->data_ptr<float>(), importance->size(0)};
}

std::tuple<at::Tensor, at::Tensor> search_levels(const at::Tensor& groups, const at::Tensor& levels,
                                                 const c10::optional<at::Tensor>& importance,
                                                 const at::Tensor& factors) {
  TORCH_CHECK(groups.dim() == 2 && groups.scalar_type() == at::kFloat && groups.is_contiguous(),
              "search_levels: groups must be contiguous float32 [R, G]");
  TORCH_CHECK(levels.dim() == 1 && levels.scalar_type() == at::kFloat && levels.is_contiguous() &&
                  levels.numel() >= 2 && levels.numel() <= 256,
              "search_levels: levels must be contiguous float32 [2..256], sorted");
  TORCH_CHECK(factors.dim() == 1 && factors.scalar_type() == at::kFloat && factors.is_contiguous(),
              "search_levels: factors must be contiguous float32");
  const int64_t R = groups.size(0), G = groups.size(1);
  const std::pair<const float*, int64_t> rows = importance_rows(importance, R, G, "search_levels");
  const float* imp = rows.first;  // plain names: a lambda below captures them
  const int64_t P = rows.second;
  const Table table(levels.data_ptr<float>(), static_cast<int>(levels.numel()));
  for (int i = 0; i + 1 < table.L; ++i) TORCH_CHECK(table.levels[i] < table.levels[i + 1], "search_levels: levels must be sorted");
  auto u = at::empty({R, G}, groups.options().dtype(at::kByte));
  auto s = at::empty({R}, groups.options());
  const float* x = groups.data_ptr<float>();
  const float* fp = factors.data_ptr<float>();
  const int64_t nf = factors.numel();
  uint8_t* up = u.data_ptr<uint8_t>();
  float* sp = s.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(G, 1)), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(4 * G);
    for (int64_t r = begin; r < end; ++r) {
      const float* ir = imp == nullptr ? nullptr : imp + (r % P) * G;
      search_levels_group(x + r * G, ir, G, table, fp, nf, up + r * G, sp + r, buf.data());
    }
  });
  return std::make_tuple(u, s);
}

// ---------------------------------------------------------------------------------------------
// search_centred: centred integer codes (Q5_0's form, value = d * q, q in -half .. half - 1) and one
// scale per group, as perfxlm.quant.search.search_centred defines it: candidates anchor x multiplier
// (the caller's table, in its order: both signs, the group's extreme value and the extremes among its
// weights counting at least a fraction of its heaviest), each refit by least squares on its codes
// (double from float sums), the least error kept (strictly less); then the plain rule (extreme / -half)
// and the best candidate stored (float16 or float32) and recoded, alternating code / scale refits, the
// plain rule winning ties. torch runs ~60 elementwise passes per candidate over a chunk; here a group
// stays in cache and each candidate is one pass.
// ---------------------------------------------------------------------------------------------

inline int64_t first_absmax(const float* v, int64_t G) {
  int64_t idx = 0;
  float best = -1.0f;
  for (int64_t j = 0; j < G; ++j) {
    const float a = std::fabs(v[j]);
    if (a > best) best = a, idx = j;  // strictly greater: torch.argmax's first maximum
  }
  return idx;
}

// codes q = clamp(round-half-even(x / d), -half, half - 1), d = 0 read as 1; sums sum (w q) q, sum wx q
inline void centred_codes(const float* x, int64_t G, float d, float half, float* q) {
  const float safe = d != 0 ? d : 1.0f;
#pragma omp simd
  for (int64_t j = 0; j < G; ++j) q[j] = std::min(std::max(std::nearbyint(x[j] / safe), -half), half - 1.0f);
}

inline void centred_sums(const float* w, const float* wx, const float* q, int64_t G, float* swq2, float* swxq) {
  float a = 0, b = 0;
#pragma omp simd reduction(+ : a, b)
  for (int64_t j = 0; j < G; ++j) {
    a += (w[j] * q[j]) * q[j];
    b += wx[j] * q[j];
  }
  *swq2 = a;
  *swxq = b;
}

void search_centred_group(const float* x, const float* imp, int64_t G, float half, const int64_t* cand_anchor,
                          const float* cand_mult, int64_t nc, const float* fracs, int64_t nfrac,
                          int64_t refine, bool half_scale, float* q_out, float* d_out, float* buf) {
  float* w = buf;  // 5 scratch rows of G floats
  float* wx = buf + G;
  float* q = buf + 2 * G;
  float* cq = buf + 3 * G;
  float* kept = buf + 4 * G;
  element_weights(x, imp, G, w);
  float fx2 = 0, wmax = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < G; ++j) {
    wx[j] = w[j] * x[j];
    fx2 += wx[j] * x[j];
    wmax = std::max(wmax, w[j]);
  }
  const float extreme = x[first_absmax(x, G)];
  std::vector<float> anchors(1 + nfrac);
  anchors[0] = extreme;
  for (int64_t a = 0; a < nfrac; ++a) {
    const float bar = fracs[a] * wmax;
    for (int64_t j = 0; j < G; ++j) kept[j] = w[j] >= bar ? x[j] : 0.0f;
    anchors[1 + a] = kept[first_absmax(kept, G)];
  }
  const double swx2 = fx2;
  double best_d = static_cast<double>(extreme / -half), best_err = std::numeric_limits<double>::infinity();
  for (int64_t c = 0; c < nc; ++c) {
    centred_codes(x, G, anchors[cand_anchor[c]] * cand_mult[c], half, q);
    float a, b;
    centred_sums(w, wx, q, G, &a, &b);
    const double swq2 = a, swxq = b;
    if (!(swq2 > 0)) continue;
    const double err = swx2 - swxq * swxq / swq2;
    if (err < best_err) best_err = err, best_d = swxq / swq2;
  }
  auto store = [&](float d) { return half_scale ? static_cast<float>(c10::Half(d)) : d; };
  auto stored = [&](float d, float* codes) {  // the stored scale, its codes, their weighted error
    d = store(d);
    centred_codes(x, G, d, half, codes);
    float err = 0;
#pragma omp simd reduction(+ : err)
    for (int64_t j = 0; j < G; ++j) {
      const float diff = d * codes[j] - x[j];
      err += w[j] * (diff * diff);
    }
    return std::make_pair(d, err);
  };
  auto [d, err] = stored(extreme / -half, q_out);  // the plain rule first: ties keep it
  auto [cd, cerr] = stored(static_cast<float>(best_d), cq);
  for (int64_t step = 0; step <= refine; ++step) {
    if (cerr < err && std::isfinite(cd) && cd != 0) {
      d = cd, err = cerr;
      std::copy(cq, cq + G, q_out);
    }
    if (step == refine) break;
    float a, b;
    centred_sums(w, wx, cq, G, &a, &b);  // refit the scale to the candidate's codes
    const float next = a > 0 ? b / a : cd;
    std::tie(cd, cerr) = stored(next, cq);
  }
  *d_out = d;
}

std::tuple<at::Tensor, at::Tensor> search_centred(const at::Tensor& groups, const c10::optional<at::Tensor>& importance,
                                                  int64_t half_range, const at::Tensor& cand_anchor,
                                                  const at::Tensor& cand_mult, const at::Tensor& fracs,
                                                  int64_t refine, bool half_scale) {
  TORCH_CHECK(groups.dim() == 2 && groups.scalar_type() == at::kFloat && groups.is_contiguous(),
              "search_centred: groups must be contiguous float32 [R, G]");
  TORCH_CHECK(cand_anchor.dim() == 1 && cand_anchor.scalar_type() == at::kLong && cand_anchor.is_contiguous() &&
                  cand_mult.dim() == 1 && cand_mult.scalar_type() == at::kFloat && cand_mult.is_contiguous() &&
                  cand_mult.numel() == cand_anchor.numel(),
              "search_centred: candidates must be contiguous int64 anchors and float32 multipliers of one length");
  TORCH_CHECK(fracs.dim() == 1 && fracs.scalar_type() == at::kFloat && fracs.is_contiguous(),
              "search_centred: fractions must be contiguous float32");
  TORCH_CHECK(half_range >= 1 && half_range <= 128 && refine >= 0, "search_centred: bad half range or refine steps");
  const int64_t nfrac = fracs.numel(), nc = cand_anchor.numel();
  const int64_t* ca = cand_anchor.data_ptr<int64_t>();
  for (int64_t c = 0; c < nc; ++c) TORCH_CHECK(ca[c] >= 0 && ca[c] <= nfrac, "search_centred: anchor index out of range");
  const int64_t R = groups.size(0), G = groups.size(1);
  const std::pair<const float*, int64_t> rows = importance_rows(importance, R, G, "search_centred");
  const float* imp = rows.first;  // plain names: a lambda below captures them
  const int64_t P = rows.second;
  auto q = at::empty({R, G}, groups.options());
  auto d = at::empty({R}, groups.options());
  const float* x = groups.data_ptr<float>();
  const float* cm = cand_mult.data_ptr<float>();
  const float* fp = fracs.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* dp = d.data_ptr<float>();
  const float half = static_cast<float>(half_range);
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(G, 1)), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(5 * G);
    for (int64_t r = begin; r < end; ++r) {
      const float* ir = imp == nullptr ? nullptr : imp + (r % P) * G;
      search_centred_group(x + r * G, ir, G, half, ca, cm, nc, fp, nfrac, refine, half_scale, qp + r * G, dp + r,
                           buf.data());
    }
  });
  return std::make_tuple(q, d);
}

}  // namespace
}  // namespace perfxlm_search

TORCH_LIBRARY_FRAGMENT(perfxlm, m) {
  m.def("search_affine(Tensor groups, Tensor? importance, int top, int steps, float rmin, float rdelta, bool half) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("search_levels(Tensor groups, Tensor levels, Tensor? importance, Tensor factors) -> (Tensor, Tensor)");
  m.def("search_centred(Tensor groups, Tensor? importance, int half_range, Tensor cand_anchor, Tensor cand_mult, "
        "Tensor fracs, int refine, bool half_scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(perfxlm, CPU, m) {
  m.impl("search_affine", &perfxlm_search::search_affine);
  m.impl("search_levels", &perfxlm_search::search_levels);
  m.impl("search_centred", &perfxlm_search::search_centred);
}
