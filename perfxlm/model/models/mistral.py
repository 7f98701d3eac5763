"""Mistral: Llama with a sliding window on every layer when `sliding_window` is set (v0.1; null from v0.2)."""

from __future__ import annotations

from typing import Any

from torch import nn

from perfxlm.model.layers.attention import layer_sliding_window
from perfxlm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class MistralForCausalLM(LlamaForCausalLM):
    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        window = layer_sliding_window(config, layer_idx, every_layer=True)
        return LlamaDecoderLayer(config, LlamaAttention(config, sliding_window=window), LlamaMLP(config))
