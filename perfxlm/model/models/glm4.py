"""GLM-4-0414 (Glm4ForCausalLM): GLM's attention (q/k/v biases, interleaved partial rotary, reordered at
load) in a block that also normalises each sublayer's output before its residual add:
x + norm(attn(norm(x))), then x + norm(mlp(norm(x))), with plain RMSNorms (Gemma 2's order, not its
1 + w scale)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.model.forward_context import get_forward_context
from perfxlm.model.fused_decode import FusedLayer
from perfxlm.model.layers.norm import RMSNorm
from perfxlm.model.models.glm import InterleavedRotaryLoading
from perfxlm.model.models.llama import (
    LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, fused_llama_layer,
)  # fmt: skip


class Glm4DecoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = LlamaAttention(config, qkv_bias=bool(config.attention_bias), o_bias=False)
        self.post_self_attn_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)  # before the MLP, despite its name
        self.mlp = LlamaMLP(config, bias=False)
        self.post_mlp_layernorm = RMSNorm(hidden, eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_self_attn_layernorm(self.self_attn(rope, self.input_layernorm(x)))
        return x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x)))

    def fused_decode_layer(self) -> FusedLayer | None:
        # the kernel's sandwich order: input, after attention, before the MLP, after the MLP
        norms = [self.input_layernorm, self.post_self_attn_layernorm, self.post_attention_layernorm,
                 self.post_mlp_layernorm]  # fmt: skip
        return fused_llama_layer(self, norms)


class Glm4Model(LlamaModel):
    """Layers whose output is the whole stream (no residual carried beside it), as Gemma 2's."""

    def __init__(self, config: Any) -> None:
        super().__init__(config, [Glm4DecoderLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb.cos_sin(positions, x.dtype)
        meta = get_forward_context()
        if self.fused_decode.applies(x, meta):  # all decodes: one native call per layer
            x, _ = self.fused_decode.run(x.contiguous(), rope, meta)
        else:
            for layer in self.layers:
                x = layer(rope, x)
        return self.norm(x)


class Glm4ForCausalLM(InterleavedRotaryLoading, LlamaForCausalLM):
    def make_model(self, config: Any) -> nn.Module:
        return Glm4Model(config)
