// The fused decode layer's product and gated activation (csrc/cpu_kernels.cpp), for the kernels built on
// them (csrc/moe_kernels.cpp): one dispatch rule for every weight form, so both round alike; and the
// layer itself, for the stack that runs every layer of a step in one call (csrc/decode_stack.cpp).
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

// One decoder layer of an all-decode step: torch.ops.perfxlm.decode_layer (its schema documents the operands).
std::vector<at::Tensor> decode_layer(
    at::Tensor x, at::Tensor residual, bool first, const at::Tensor& in_norm, const at::Tensor& post_norm,
    const c10::optional<at::Tensor>& pre_ff_norm, const c10::optional<at::Tensor>& post_ff_norm, double eps,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double head_eps,
    at::TensorList w_qkv, const c10::optional<at::Tensor>& b_qkv, at::TensorList w_o,
    const c10::optional<at::Tensor>& b_o, at::TensorList w_gate_up, const c10::optional<at::Tensor>& b_gate_up,
    at::TensorList w_down, const c10::optional<at::Tensor>& b_down, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t intermediate, int64_t activation, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, double scale, int64_t sliding_window, double soft_cap, int64_t max_rows,
    bool bf16_gemm, at::TensorList lora, const c10::optional<at::Tensor>& key_scale,
    const c10::optional<at::Tensor>& value_scale, bool int8_blocks, int64_t quant_max_rows,
    int64_t quant_block_max_rows, const c10::optional<at::Tensor>& sinks, int64_t gemm_rows, bool bf16_attention);

}  // namespace perfxlm_fused
