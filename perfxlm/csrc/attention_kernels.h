// The KV cache kernels (csrc/attention_kernels.cpp) that the fused decode layer calls.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace perfxlm_attn {

// One query token per sequence (query float32 [B, H, D]) over the paged cache, read in place through
// the block table; `key_scale` / `value_scale` are a quantized cache's group scales, else none; `sinks`
// float32 [H], one more logit per query head in its softmax's denominator (gpt-oss), else none.
// `bf16_products`: over a bf16 cache on AVX512-BF16 builds, the products by vdpbf16ps with the queries
// and softmax weights rounded to bf16 (where the CPU plan attends in bf16); ignored elsewhere.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t sliding_window, double soft_cap,
                                  const c10::optional<at::Tensor>& key_scale = c10::nullopt,
                                  const c10::optional<at::Tensor>& value_scale = c10::nullopt,
                                  const c10::optional<at::Tensor>& sinks = c10::nullopt, bool bf16_products = false);

// Rows of `src` ([T, width], row stride `src_stride`) into cache slots, quantized as
// perfxlm/ops/kv_quant.py's quantize() for an int8 or fp8 cache.
void write_slots(const float* src, int64_t src_stride, int64_t T, int64_t width, const int64_t* slots,
                 at::Tensor& cache, const c10::optional<at::Tensor>& scales = c10::nullopt);

void write_kv_slots(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                    const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& key_scale,
                    const c10::optional<at::Tensor>& value_scale);

}  // namespace perfxlm_attn
