"""Gemma 3 (text): Gemma 2's block (sandwich (1 + w) RMSNorms, GELU-tanh MLP, embeddings scaled by
sqrt(hidden), attention scale query_pre_attn_scalar^-1/2) with (1 + w) RMSNorms over each q and k head,
local (sliding window) and global layers in `layer_types` (5:1 in the released models), and a rotary base
per layer type: local layers rotate with `rope_local_base_freq` (10k), global ones with `rope_theta` and
its scaling. The final logits are soft-capped where the config says; `attn_logit_softcapping`, though
Gemma3TextConfig keeps the field, is not applied by transformers' Gemma 3 (nor set by the released
models), so it is not applied here either."""

from __future__ import annotations

from typing import Any

from perfxlm.model.layers.rotary import RotaryEmbedding
from perfxlm.model.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model, gemma_attention
from perfxlm.model.models.llama import head_dim_of


def gemma3_stack(config: Any, causal: bool = True) -> Gemma2Model:
    """Gemma 3's embeddings, layers and final norm; bidirectional where not `causal` (EmbeddingGemma's
    encoder, `gemma3_encoder.py`)."""
    kinds = list(config.layer_types)
    if len(kinds) != config.num_hidden_layers:
        raise ValueError(
            f"layer_types has {len(kinds)} entries for {config.num_hidden_layers} layers."
        )
    rotary = {kind: RotaryEmbedding.from_config(config, head_dim_of(config), kind) for kind in set(kinds)}
    layers = [
        Gemma2DecoderLayer(config, gemma_attention(config, i, qk_norm=True, soft_cap=False, causal=causal))
        for i in range(config.num_hidden_layers)
    ]
    return Gemma2Model(config, layers, rotary, kinds)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    def make_model(self, config: Any) -> Gemma2Model:
        return gemma3_stack(config)
