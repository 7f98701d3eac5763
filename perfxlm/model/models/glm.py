"""GLM-4 (GlmForCausalLM: glm-4-9b-chat-hf): a Llama block with q/k/v biases (none on o_proj), a fused
gate|up checkpoint tensor, and rotary over the first half of each head (`partial_rotary_factor`) in GPT-J's
interleaved pairs. The q and k rows are reordered at load (`interleaved_to_halves`) so the engine's
rotate-half kernels, the fused decode layer's included, apply that same rotation."""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch
from torch import nn

from perfxlm.model.layers.rotary import interleaved_to_halves
from perfxlm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

_QK_ROWS = re.compile(r"\.(q_proj|k_proj)\.(weight|bias)$")


class InterleavedRotaryLoading:
    """Mixed into a Llama-shaped CausalLM whose checkpoint's q/k heads rotate interleaved pairs: reorders
    those rows as they are read, before any sink quantizes them."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], sink: Any = None) -> None:
        rope = self.model.rotary_emb  # type: ignore[attr-defined]

        def reordered() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if _QK_ROWS.search(name):
                    tensor = interleaved_to_halves(tensor, rope.head_dim, rope.rotary_dim)
                yield name, tensor

        super().load_weights(reordered(), sink)  # type: ignore[misc]


class GlmForCausalLM(InterleavedRotaryLoading, LlamaForCausalLM):
    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        attn = LlamaAttention(config, qkv_bias=bool(config.attention_bias), o_bias=False)
        return LlamaDecoderLayer(config, attn, LlamaMLP(config, bias=False))
