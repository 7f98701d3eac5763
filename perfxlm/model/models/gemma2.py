"""Gemma 2: embeddings scaled by sqrt(hidden), Gemma RMSNorm (1 + w) before and after both attention and
MLP, GELU-tanh gated MLP, attention scale query_pre_attn_scalar^-1/2, attention and final logit
soft-capping, and local (sliding window) / global attention alternating by `layer_types`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.model.forward_context import get_forward_context
from perfxlm.model.fused_decode import FusedDecode, FusedLayer
from perfxlm.model.layers.attention import layer_sliding_window
from perfxlm.model.layers.embed_head import LMHead, VocabEmbedding
from perfxlm.model.layers.norm import GemmaRMSNorm
from perfxlm.model.layers.rotary import RotaryEmbedding
from perfxlm.model.models.base import CausalLM
from perfxlm.model.models.llama import (
    LLAMA_STACKED_PARAMS, LlamaAttention, LlamaMLP, fused_llama_layer, head_dim_of,
)


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = LlamaAttention(
            config,
            scale=config.query_pre_attn_scalar**-0.5,
            sliding_window=layer_sliding_window(config, layer_idx),
            logit_soft_cap=getattr(config, "attn_logit_softcapping", None),
        )
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = LlamaMLP(config, bias=False, activation=config.hidden_activation)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(x)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def fused_decode_layer(self) -> FusedLayer | None:
        norms = [self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                 self.post_feedforward_layernorm]  # fmt: skip
        return fused_llama_layer(self, norms)


class Gemma2Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, scale=config.hidden_size**0.5
        )
        self.rotary_emb = RotaryEmbedding.from_config(config, head_dim_of(config))
        self.layers = nn.ModuleList(Gemma2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fused_decode = FusedDecode(self.layers)

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


class Gemma2ForCausalLM(CausalLM):
    stacked_params = LLAMA_STACKED_PARAMS

    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 2 with use_bidirectional_attention (an encoder) is not supported.")
        self.config = config
        self.model = Gemma2Model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = LMHead(
            config.vocab_size,
            config.hidden_size,
            tied_to=tied,
            logit_soft_cap=getattr(config, "final_logit_softcapping", None),
        )

    def tied_param_names(self) -> set[str]:
        return {"lm_head.weight"} if self.tie_word_embeddings else set()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
