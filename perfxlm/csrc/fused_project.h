// The fused decode layer's product and gated activation (csrc/cpu_kernels.cpp), for the kernels built on
// them (csrc/moe_kernels.cpp): one dispatch rule for every weight form, so both round alike.
#pragma once

#include <ATen/ATen.h>

namespace perfxlm_fused {

// y = x W^T + b as perfxlm/ops/linear.py dispatches it; `parts`: [w] (float / bf16 rows / packed panels) or
// a quantized weight's [codes, scales, mins, levels, act_int8], and an act-order one's input order sixth
// (int64 [K]: x's columns taken in that order first, take_columns). gemm_rows: linear_q's (from that many rows
// int8-block weights the int8 GEMM takes run it; -1 never).
at::Tensor project(const at::Tensor& x, at::TensorList parts, int64_t n_out, const c10::optional<at::Tensor>& bias,
                   int64_t max_rows, bool bf16_gemm, bool int8_blocks, int64_t quant_max_rows,
                   int64_t quant_block_max_rows, int64_t gemm_rows = -1);

// x [T, K] float32 with its columns in `order` (int64 [K]): out[t, j] = x[t, order[j]], contiguous.
at::Tensor take_columns(const at::Tensor& x, const at::Tensor& order);

// act(gate) * up over [T, 2 * inter] (gate columns, then up): 0 SiLU, 1 GELU-tanh, 2 GELU, torch's own ops.
at::Tensor mlp_activation(const at::Tensor& gate_up, int64_t inter, int64_t activation);

}  // namespace perfxlm_fused
