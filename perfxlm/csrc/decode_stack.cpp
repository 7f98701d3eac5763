// DecodeStack: every decoder layer of an all-decode step in one native call.
//
// The fused decode layer (csrc/cpu_kernels.cpp's decode_layer) takes ~45 operands, most of them the same
// every step: norms, weights (a quantized one is a list of parts), the KV cache tensors, head counts.
// Called once per layer from Python, each step parsed them all again and looped over the layers in the
// interpreter while the other thread waited: on the default model (30 layers, Q4_1, 2 threads) one call
// per step took decode from 150-178 to 194-216 tok/s (alternating runs). A DecodeStack holds each layer's fixed operands once (add_layer, at the
// model's first all-decode step) and `run` passes only what changes per step, calling the same
// decode_layer for each layer in turn: the same kernels in the same order, so the same bits.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "fused_project.h"

namespace {

using OptTensor = c10::optional<at::Tensor>;

struct DecodeStack : torch::CustomClassHolder {
  struct Layer {
    at::Tensor in_norm, post_norm;
    OptTensor pre_ff_norm, post_ff_norm;
    double eps;
    OptTensor q_norm, k_norm;
    double head_eps;
    std::vector<at::Tensor> w_qkv;
    OptTensor b_qkv;
    std::vector<at::Tensor> w_o;
    OptTensor b_o;
    std::vector<at::Tensor> w_gate_up;
    OptTensor b_gate_up;
    std::vector<at::Tensor> w_down;
    OptTensor b_down;
    int64_t num_heads, num_kv_heads, head_dim, intermediate, activation;
    at::Tensor key_cache, value_cache;
    double scale;
    int64_t sliding_window;
    double soft_cap;
    OptTensor key_scale, value_scale, sinks;
    int64_t rope;  // which of the step's rope tables this layer rotates by
  };
  std::vector<Layer> layers;
  int64_t rope_tables = 0;  // how many rope tables each step must pass (the layers' largest index + 1)

  // decode_layer's fixed operands for the next layer, in its schema's order, and the index of its rope
  // table among those each step passes (Gemma's local and global layers rotate by different bases).
  void add_layer(at::Tensor in_norm, at::Tensor post_norm, OptTensor pre_ff_norm, OptTensor post_ff_norm, double eps,
                 OptTensor q_norm, OptTensor k_norm, double head_eps, std::vector<at::Tensor> w_qkv, OptTensor b_qkv,
                 std::vector<at::Tensor> w_o, OptTensor b_o, std::vector<at::Tensor> w_gate_up, OptTensor b_gate_up,
                 std::vector<at::Tensor> w_down, OptTensor b_down, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim, int64_t intermediate, int64_t activation, at::Tensor key_cache,
                 at::Tensor value_cache, double scale, int64_t sliding_window, double soft_cap, OptTensor key_scale,
                 OptTensor value_scale, OptTensor sinks, int64_t rope) {
    TORCH_CHECK(!w_gate_up.empty() && !w_down.empty(),
                "DecodeStack.add_layer: a layer without its MLP weights (a mixture of experts) runs per layer");
    layers.push_back(Layer{std::move(in_norm), std::move(post_norm), std::move(pre_ff_norm), std::move(post_ff_norm),
                           eps, std::move(q_norm), std::move(k_norm), head_eps, std::move(w_qkv), std::move(b_qkv),
                           std::move(w_o), std::move(b_o), std::move(w_gate_up), std::move(b_gate_up),
                           std::move(w_down), std::move(b_down), num_heads, num_kv_heads, head_dim, intermediate,
                           activation, std::move(key_cache), std::move(value_cache), scale, sliding_window, soft_cap,
                           std::move(key_scale), std::move(value_scale), std::move(sinks), rope});
    TORCH_CHECK(rope >= 0, "DecodeStack.add_layer: rope table index ", rope, " is negative");
    rope_tables = std::max(rope_tables, rope + 1);
  }

  // The step through every layer: -> {hidden, residual} as the last decode_layer returns them.
  std::vector<at::Tensor> run(at::Tensor x, at::Tensor residual, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                              at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens, int64_t max_rows,
                              bool bf16_gemm, bool int8_blocks, int64_t quant_max_rows, int64_t quant_block_max_rows,
                              int64_t gemm_rows, bool bf16_attention) {
    TORCH_CHECK(!layers.empty(), "DecodeStack.run: no layers were added");
    TORCH_CHECK(cos.size() == sin.size() && static_cast<int64_t>(cos.size()) >= rope_tables, "DecodeStack.run: ",
                cos.size(), " cos and ", sin.size(), " sin tables for layers that rotate by ", rope_tables);
    const std::vector<at::Tensor> no_lora;
    std::vector<at::Tensor> out{x, residual};
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& l = layers[i];
      out = perfxlm_fused::decode_layer(
          out[0], out[1], i == 0, l.in_norm, l.post_norm, l.pre_ff_norm, l.post_ff_norm, l.eps, l.q_norm, l.k_norm,
          l.head_eps, l.w_qkv, l.b_qkv, l.w_o, l.b_o, l.w_gate_up, l.b_gate_up, l.w_down, l.b_down, l.num_heads,
          l.num_kv_heads, l.head_dim, l.intermediate, l.activation, cos[l.rope], sin[l.rope], l.key_cache, l.value_cache,
          slot_mapping, block_tables, seq_lens, l.scale, l.sliding_window, l.soft_cap, max_rows, bf16_gemm, no_lora,
          l.key_scale, l.value_scale, int8_blocks, quant_max_rows, quant_block_max_rows, l.sinks, gemm_rows,
          bf16_attention);
    }
    return out;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(perfxlm, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("run", &DecodeStack::run);
}
