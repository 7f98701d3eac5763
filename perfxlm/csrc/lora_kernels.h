// The step's LoRA adapters on one projection (csrc/lora_kernels.cpp), called by the fused decode layer.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace perfxlm_lora {

// y += each row's own adapter's (x A^T * scale) B^T, for projection `index` (0 qkv, 1 o, 2 gate_up,
// 3 down) of the step's operand list `lora` (perfxlm/lora/slots.py's LoRABatch.fused_operands):
// [row_slot int32 [T], then per projection A [R, in], B^T [R, out] (float32 or bfloat16, both alike),
// scale float32 [R], cols int32 [R, 3] (each packed column's slot and the output columns [n0, n1) its
// B row covers)]. An empty list: no adapter in the step; an empty A: none on that projection.
void add(at::Tensor& y, const at::Tensor& x, at::TensorList lora, int64_t index);

}  // namespace perfxlm_lora
