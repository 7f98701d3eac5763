"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention; sparse layers route each token to its
top-k experts (softmax, renormalised only with `norm_topk_prob`) and add a shared expert scaled by a
sigmoid gate."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.distributed.parallel_state import tp_group
from perfxlm.model.layers.attention import layer_sliding_window
from perfxlm.model.layers.linear import Linear
from perfxlm.model.layers.moe import FusedMoE
from perfxlm.model.models.llama import (
    LLAMA_STACKED_PARAMS,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)

# per-expert checkpoint tensors -> one slice of the stacked expert parameters
MOE_STACKED_PARAMS = [
    (".experts.gate_up_proj", ".experts.{expert}.gate_proj.weight", "gate"),
    (".experts.gate_up_proj", ".experts.{expert}.up_proj.weight", "up"),
    (".experts.down_proj", ".experts.{expert}.down_proj.weight", "down"),
]


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Whether a layer routes to experts: not in `mlp_only_layers`, and on the `decoder_sparse_step` beat."""
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate = Linear(config.hidden_size, config.num_experts)
        self.gate.quantize_weight = False  # routers stay float under quantization=
        self.experts = FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob),
            activation=config.hidden_act,
            reduce_results=False,
        )
        shared = getattr(config, "shared_expert_intermediate_size", 0)
        # under tensor parallelism the experts' and the shared expert's partial sums are added first, then
        # reduced once (the shared expert's gate is replicated: it scales each rank's partial sum alike)
        self.tp = tp_group()
        self.shared_expert = (
            LlamaMLP(config, intermediate_size=shared, bias=False, reduce_results=False) if shared else None
        )
        self.shared_expert_gate = Linear(config.hidden_size, 1) if shared else None
        if self.shared_expert_gate is not None:
            self.shared_expert_gate.quantize_weight = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts.forward_with_router(x, self.gate)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out) if self.tp.parallel else out


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    stacked_params = MOE_STACKED_PARAMS + LLAMA_STACKED_PARAMS

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        attn = LlamaAttention(
            config,
            qkv_bias=bool(getattr(config, "qkv_bias", True)),
            o_bias=False,
            sliding_window=layer_sliding_window(config, layer_idx),
        )
        sparse = is_sparse_layer(config, layer_idx)
        mlp = Qwen2MoeSparseMoeBlock(config) if sparse else LlamaMLP(config, bias=False)
        return LlamaDecoderLayer(config, attn, mlp)
