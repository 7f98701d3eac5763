"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (RMSNorm on every q and k head, a
sliding window on every layer where `use_sliding_window` sets one) with Qwen2-MoE's sparse block minus
the shared expert: softmax top-k routing, renormalised with `norm_topk_prob`; the layers in
`mlp_only_layers`, or off the `decoder_sparse_step` beat, keep a dense MLP."""

from __future__ import annotations

from typing import Any

from torch import nn

from perfxlm.model.layers.attention import layer_sliding_window
from perfxlm.model.models.llama import LLAMA_STACKED_PARAMS, LlamaAttention, LlamaDecoderLayer, LlamaMLP
from perfxlm.model.models.qwen2_moe import (
    MOE_STACKED_PARAMS, Qwen2MoeForCausalLM, Qwen2MoeSparseMoeBlock, is_sparse_layer,
)  # fmt: skip


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    stacked_params = MOE_STACKED_PARAMS + LLAMA_STACKED_PARAMS

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        window = layer_sliding_window(config, layer_idx, every_layer=True)
        attn = LlamaAttention(config, qk_norm=True, sliding_window=window)
        sparse = is_sparse_layer(config, layer_idx)
        mlp = Qwen2MoeSparseMoeBlock(config) if sparse else LlamaMLP(config, bias=False)
        return LlamaDecoderLayer(config, attn, mlp)
