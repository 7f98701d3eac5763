// Quantized-weight products (csrc/quant_linear.cpp), shared with the fused decode layer.
#pragma once

#include <ATen/ATen.h>

#include <functional>

namespace perfxlm_quant {

// y = x W^T (+ b), x float32 [M, K], W stored as perfxlm.quant.QuantizedWeight's tensors:
// codes uint8 [N, K] (8-bit), [N, K / 2] (4-bit, GGUF Q4 nibble order per 32-block) or [N, 5 K / 8] (5-bit:
// those nibbles, then a plane of fifth bits), scales and mins
// float32 or float16 [N, K / group], w = scale * u + min (or scale * levels[u] + min with a 16-entry
// table); no mins (centred codes): w = scale * (u - 8) (4-bit), scale * (u - 128) (8-bit), scale * levels[u]. act_int8: activations quantized per row to symmetric int8 first (W8A8). Up to max_rows rows go
// to the GEMV kernels; more rows dequantize slabs of W for torch's GEMM (bf16 under bf16_gemm).
// int8_blocks: weight-only formats' GEMV quantizes x to int8 per block of 32 and runs int8 dot products
// (AVX512-VNNI, AVX2 and AVX-VNNI builds; llama.cpp's scheme), instead of widening the codes to float32.
// block_max_rows (>= 0): the GEMV limit, instead of max_rows, for 4-bit codes and for weights of more
// than 4M values (an LM head) under int8_blocks (on AVX2 their
// int8 block products beat dequantizing for a float32 GEMM up to a few hundred rows).
// gemm_rows: int8-block weights the int8 GEMM takes (quant_gemm.h) run it from this many rows (0: past
// the GEMV limits above; -1: never, the float32 GEMM on dequantized slabs does), the CPU plan's quant_gemm
// and quant_gemm_rows.
// layout: how codes and scales are arranged (perfxlm/quant/layouts.py's `native` numbers): 0 plain (above),
// 1 row groups of 8 (row_groups.h: codes [ceil(N / 8), K / 32, 8 B], float16 scales [ceil(N / 8), K / 32, 8],
// centred Q8_0 / Q4_0 codes), whose products always round x to int8 blocks (int8_blocks is not read) and
// which need out_features (N: the groups' padding rows are not outputs); 2 K-quant row groups of 8
// (row_groups_k.h: Q4_K / Q5_K / Q6_K codes [ceil(N / 8), K / 32, 8 B], the uint8 params in scales
// [ceil(N / 8), K / 256, P], no mins), whose GEMV runs every row count (no GEMM reads them yet); 3 affine
// row groups of 8 (row_groups_m.h: Q4_1's codes and scales as layout 1's 4-bit ones, the float16 mins shaped
// as the scales), chosen as layout 1's are.
at::Tensor linear_q(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& levels, const c10::optional<at::Tensor>& bias, bool act_int8,
                    int64_t max_rows, bool bf16_gemm, bool int8_blocks = false, int64_t block_max_rows = -1,
                    int64_t gemm_rows = -1, int64_t layout = 0, int64_t out_features = -1);

// The GEMV linear_q runs for these operands at few rows, prepared to be run over ranges of output columns
// from the threads of a parallel region the caller opens (the fused layer's projection with its LoRA
// adapters, lora_kernels.h's project_add): W is described and x's int8 blocks quantized once, here, on
// the calling thread; the function then writes y[:, n0:n1) of a row-major [M, N] y on whichever thread
// calls it, with no tensor made and no region of its own (the per-range tensor calls cost more than a
// batch-1 step's adapters). Each output sums as in linear_q's own call where n0 is a multiple of 64 (row
// groups: ranges of whole groups, n0 a multiple of 8, n1 too or N).
// Empty where linear_q would not run a GEMV (W8A8, many rows, the int8 GEMM): call linear_q then.
using RangeProduct = std::function<void(float* y, int64_t n0, int64_t n1)>;
RangeProduct linear_q_ranges(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& levels,
                             const c10::optional<at::Tensor>& bias, bool act_int8, int64_t max_rows,
                             bool int8_blocks, int64_t block_max_rows, int64_t gemm_rows, int64_t layout = 0,
                             int64_t out_features = -1);

}  // namespace perfxlm_quant
