// The int8 GEMM over block-quantized codes (csrc/quant_gemm.cpp): linear_q hands it the many-row steps
// of int8-block weights when asked (the fused decode layer's large batches, as the module path does).
#pragma once

#include <ATen/ATen.h>

namespace perfxlm_qgemm {

// y = x W^T (+ b), x float32 [M, K] rounded to int8 per block of 32 (act_blocks.h), W as linear_q's
// float-scaled forms with groups of whole 32-blocks; errors for the layouts it does not take. layout 1:
// row groups of 8 (linear_q's layout 1, quant_linear.h), 2: K-quant row groups (layout 2, scales the params
// bytes), 3 affine ones (Q4_1, mins given); out_features their N. A row group's product is the plain layout's,
// bit for bit.
at::Tensor quant_block_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& levels,
                            const c10::optional<at::Tensor>& bias, int64_t layout = 0, int64_t out_features = -1);

// The largest code the build's GEMM runs at its int8 rate: 255 (on AVX2 without AVX-VNNI 8-bit codes run
// as int16 pairs), 0 where the build has none (no AVX2).
int64_t quant_block_gemm_max_code();

}  // namespace perfxlm_qgemm
