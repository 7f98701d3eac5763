"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama whose checkpoints store qkv_proj and gate_up_proj already fused
(they load whole into the fused parameters), with LongRoPE scaling, partial rotary and a sliding window
on every layer where the config sets one."""

from __future__ import annotations

from typing import Any

from torch import nn

from perfxlm.model.layers.attention import layer_sliding_window
from perfxlm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class Phi3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        window = layer_sliding_window(config, layer_idx, every_layer=True)
        attn = LlamaAttention(config, qkv_bias=False, o_bias=False, sliding_window=window)
        return LlamaDecoderLayer(config, attn, LlamaMLP(config, bias=False))
