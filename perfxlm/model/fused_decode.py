"""All-decode steps of Llama-family models as one native call per layer.

At small batch a decode step costs more in per-op dispatch (about 25 torch ops and a dozen module calls
per layer) than in arithmetic. `FusedDecode` checks once that every layer is plain Llama (RMSNorm,
fused QKV with optional bias, full rotary, attention without window or soft cap, SiLU-gated MLP without
bias, float32 activations) and then runs a step whose tokens are all decodes through
`torch.ops.perfxlm.llama_decode_layer`. Anything else (prefill chunks in the batch, other layer shapes,
no native kernels) takes the module path, which stays the reference the tests compare against.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.model.forward_context import AttentionMetadata
from perfxlm.model.layers.activation import SiluAndMul
from perfxlm.model.layers.norm import RMSNorm
from perfxlm.ops import native


def _layer_args(layer: nn.Module) -> tuple[Any, ...] | None:
    from perfxlm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    if type(layer) is not LlamaDecoderLayer:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP or attn.qk_norm:
        return None
    core = attn.attn
    if core.sliding_window is not None or core.logit_soft_cap is not None:
        return None
    if type(mlp.act) is not SiluAndMul or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(n) is not RMSNorm or n.weight.dtype != torch.float32 for n in norms):
        return None
    if norms[0].variance_epsilon != norms[1].variance_epsilon:
        return None
    return (
        layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.input_layernorm.variance_epsilon,
        attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight, attn.o_proj.bias,
        mlp.gate_up_proj.weight, mlp.down_proj.weight,
        core.num_heads, core.num_kv_heads, core.head_dim, mlp.down_proj.in_features,
    )  # fmt: skip


class FusedDecode:
    def __init__(self, layers: nn.ModuleList, rotary_dim: int) -> None:
        self.layers = layers
        self.args: list[tuple[Any, ...]] | None = None
        self.eligible = rotary_dim == getattr(layers[0].self_attn, "head_dim", -1) if len(layers) else False

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        if not self.eligible or x.dtype != torch.float32 or meta.prefills or meta.num_decode_tokens != x.shape[0]:
            return False
        if native.kernels() is None:
            return False
        if self.args is None:  # first all-decode step: collect (weights are final by now)
            args = [_layer_args(layer) for layer in self.layers]
            if any(a is None for a in args):
                self.eligible = False
                return False
            self.args = args  # type: ignore[assignment]
        return True

    def run(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ops = native.kernels()
        cos, sin = rope
        residual = x
        for i, (layer, args) in enumerate(zip(self.layers, self.args or [])):
            key_cache, value_cache = layer.self_attn.attn.kv_cache
            x, residual = ops.llama_decode_layer(
                x, residual, i == 0, *args, cos, sin, key_cache, value_cache, meta.slot_mapping,
                meta.decode_block_tables, meta.decode_seq_lens, layer.self_attn.attn.scale,
            )  # fmt: skip
        return x, residual
