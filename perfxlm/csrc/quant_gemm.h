// The int8 GEMM over block-quantized codes (csrc/quant_gemm.cpp): linear_q hands it the many-row steps
// of int8-block weights when asked (the fused decode layer's large batches, as the module path does).
#pragma once

#include <ATen/ATen.h>

namespace perfxlm_qgemm {

// y = x W^T (+ b), x float32 [M, K] rounded to int8 per block of 32 (act_blocks.h), W as linear_q's
// float-scaled forms with groups of whole 32-blocks; errors for the layouts it does not take.
at::Tensor quant_block_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& levels,
                            const c10::optional<at::Tensor>& bias);

// The largest code the build's GEMM runs at its int8 rate (255, or 128 on AVX2 without AVX-VNNI, whose
// 8-bit path is no faster than the float32 GEMM), 0 where the build has none (no AVX2).
int64_t quant_block_gemm_max_code();

// Rows up to which 8-bit codes take the GEMM where the largest code above is below 255 (AVX2 without
// AVX-VNNI: the sign trick, faster than the block GEMV and than the float32 GEMM on dequantized slabs
// from 16 to a few hundred rows, slower than the float32 GEMM at prompt sizes); 0 elsewhere.
int64_t quant_block_gemm_rows8();

}  // namespace perfxlm_qgemm
