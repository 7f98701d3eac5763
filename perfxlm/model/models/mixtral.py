"""Mixtral: Mistral attention with a top-k (renormalised) mixture of SiLU experts in place of the MLP."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.model.layers.attention import layer_sliding_window
from perfxlm.model.layers.linear import Linear
from perfxlm.model.layers.moe import FusedMoE
from perfxlm.model.models.llama import (
    LLAMA_STACKED_PARAMS,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate = Linear(config.hidden_size, config.num_local_experts)
        self.gate.quantize_weight = False  # routers stay float under quantization=
        self.experts = FusedMoE(
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=True,
            activation=config.hidden_act,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.forward_with_router(x, self.gate)


class MixtralForCausalLM(LlamaForCausalLM):
    renames = [(r"\.block_sparse_moe\.", ".mlp.")]
    # w1 = gate, w3 = up, w2 = down in Mixtral's checkpoints
    stacked_params = [
        (".experts.gate_up_proj", ".experts.{expert}.w1.weight", "gate"),
        (".experts.gate_up_proj", ".experts.{expert}.w3.weight", "up"),
        (".experts.down_proj", ".experts.{expert}.w2.weight", "down"),
    ] + LLAMA_STACKED_PARAMS

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        window = layer_sliding_window(config, layer_idx, every_layer=True)
        return LlamaDecoderLayer(
            config, LlamaAttention(config, sliding_window=window), MixtralSparseMoeBlock(config)
        )
