"""Qwen2 / Qwen2.5: Llama with biases on q/k/v (not on o), and sliding windows on the layers
`layer_types` marks (only when `use_sliding_window` is set)."""

from __future__ import annotations

from typing import Any

from torch import nn

from perfxlm.model.layers.attention import layer_sliding_window
from perfxlm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class Qwen2ForCausalLM(LlamaForCausalLM):
    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        attn = LlamaAttention(
            config, qkv_bias=True, o_bias=False, sliding_window=layer_sliding_window(config, layer_idx)
        )
        return LlamaDecoderLayer(config, attn, LlamaMLP(config))
