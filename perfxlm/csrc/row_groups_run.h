// The op body the row-group GEMVs share (row_groups.h for Q8_0 / Q4_0, row_groups_k.h for the K-quants):
// y [M, N] from a prepared product, groups of 8 weight rows shared out over threads, each range of groups
// written by the kernel's `groups_into` with the bias added.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>

namespace perfxlm_row_groups {

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
