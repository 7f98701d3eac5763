"""Qwen3: Llama with RMSNorm on every q and k head before rotary; biases per `attention_bias`."""

from __future__ import annotations

from typing import Any

from torch import nn

from perfxlm.model.layers.attention import layer_sliding_window
from perfxlm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        attn = LlamaAttention(config, qk_norm=True, sliding_window=layer_sliding_window(config, layer_idx))
        return LlamaDecoderLayer(config, attn, LlamaMLP(config))
