// The step's LoRA adapters on one projection (csrc/lora_kernels.cpp), called by the fused decode layer.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>

namespace perfxlm_lora {

// y += each row's own adapter's (x A^T * scale) B^T, for projection `index` (0 qkv, 1 o, 2 gate_up,
// 3 down) of the step's `lora` (perfxlm/lora/slots.py's LoRABatch.fused_operands): [row_slot int32 [T],
// the layer's adapter block (uint8, laid out by perfxlm/lora/pack.py: a header with every segment's slot,
// rank, output columns and offsets, then the scales, then A and B^T, float32, bfloat16 or int8 codes +
// 128, slot after slot)]. An empty list or block: no adapter in the step; a projection without segments:
// none on it.
void add(at::Tensor& y, const at::Tensor& x, at::TensorList lora, int64_t index);

// Prefetches into L2 the block's bytes that `add` will read for projection `index` (the slots of the
// step's rows), so the fetches overlap the base product the fused layer runs first. By default in steps
// of two rows or more only (a 1-row step's GEMV measured slower beside the burst); PERFXLM_LORA_PREFETCH
// =0 never, =1 in every step, =N the first N bytes of each region in every step.
void prefetch(at::TensorList lora, int64_t index);

// Writes the base product's output columns [n0, n1) of every row into y; called on a parallel region's
// threads (each range once, ranges disjoint, starting on multiples of 64).
using BaseRange = std::function<void(int64_t n0, int64_t n1)>;

// y = base + the adapters of projection `index`, in one parallel region: each thread runs the base
// product over its range of output columns and adds the adapters' products there, so a decode step's
// adapters cost no fork and join of their own and their expand is split as the base product is.
// Returns false, having done nothing, where no row of the step has an adapter on this projection.
bool project_add(at::Tensor& y, const at::Tensor& x, at::TensorList lora, int64_t index, const BaseRange& base);

// Whether the fused layer runs its quantized projections through project_add (PERFXLM_LORA_WITH_BASE=1;
// default: no, the product then `add`, which measured faster at batch 1).
bool with_base();

}  // namespace perfxlm_lora
