"""gpt-oss (GptOssForCausalLM), from float checkpoints: Llama-shaped attention with biases everywhere, a
learned sink logit per head (an `Attention` option the CPU kernels and the fused decode layer take),
sliding-window and full layers alternating by `layer_types`, YaRN; every layer a mixture of experts whose router has a bias
and softmaxes only the top-k logits, and whose experts have biases and gpt-oss's clamped SwiGLU over
interleaved gate/up columns. The expert stacks keep transformers' layout ([E, hidden, 2 * inter] and
[E, inter, hidden], x @ W) and are multiplied through transposed views."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.model.layers.activation import ClampedSwiGLU
from perfxlm.model.layers.attention import layer_sliding_window
from perfxlm.model.layers.linear import Linear
from perfxlm.model.layers.moe import grouped_experts
from perfxlm.model.models.llama import (
    LLAMA_STACKED_PARAMS, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM,
)  # fmt: skip


class GptOssExperts(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        e, hidden, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, hidden, 2 * inter), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * inter), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, inter, hidden), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(e, hidden), requires_grad=False)
        self.act = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return grouped_experts(
            x, weights, ids, self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2), self.act,
            self.gate_up_proj_bias, self.down_proj_bias,
        )  # fmt: skip


class GptOssMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k, experts = config.num_experts_per_tok, config.num_local_experts
        if not 0 < self.top_k <= experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be in [1, num_local_experts ({experts})].")
        self.router = Linear(config.hidden_size, config.num_local_experts, bias=True)
        self.router.quantize_weight = False  # routers stay float under quantization=
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        return self.experts(x, torch.softmax(top, dim=-1), ids)


class GptOssForCausalLM(LlamaForCausalLM):
    supports_tensor_parallel = False  # its attention and experts are not parallel layers yet
    # the sinks are the attention layer's own parameter
    renames = [(r"\.self_attn\.sinks$", ".self_attn.attn.sinks")]
    stacked_params = [e for e in LLAMA_STACKED_PARAMS if e[0] == ".qkv_proj"]

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        attn = LlamaAttention(
            config, qkv_bias=bool(config.attention_bias), o_bias=bool(config.attention_bias),
            sliding_window=layer_sliding_window(config, layer_idx), sinks=True,
        )  # fmt: skip
        return LlamaDecoderLayer(config, attn, GptOssMLP(config))
