// Many rows of float32 x against plain bf16 rows W (csrc/bf16_dots.cpp): x rounded to bf16, pairs of
// products summed in float32 (vdpbf16ps on AVX512-BF16 builds, the same arithmetic in C++ elsewhere).
#pragma once

#include <ATen/ATen.h>

namespace perfxlm_bf16dots {

// y = bf16(x) W^T (+ b): x [M, K] float32, W [N, K] contiguous bf16 -> [M, N] float32.
at::Tensor linear_bf16_dots(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// Whether rows past the row kernel that would take torch's bf16 GEMM take linear_bf16_dots instead: one
// process-wide setting (the CPU plan's bf16_dots, perfxlm/ops/cpu_plan.py), until set the same rule from
// PERFXLM_BF16_DOTS. set_bf16_dots returns the previous one.
bool dots_now();
bool set_bf16_dots(bool on);
// Whether the build runs vdpbf16ps (else the C++ emulation).
bool bf16_dots_native();

}  // namespace perfxlm_bf16dots
