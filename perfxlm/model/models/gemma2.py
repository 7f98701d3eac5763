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
from perfxlm.model.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from perfxlm.model.layers.norm import GemmaRMSNorm
from perfxlm.model.layers.rotary import RotaryEmbedding
from perfxlm.model.models.base import CausalLM
from perfxlm.model.models.llama import (
    LLAMA_STACKED_PARAMS, LlamaAttention, LlamaMLP, fused_llama_layer, head_dim_of,
)


def gemma_attention(
    config: Any, layer_idx: int, qk_norm: bool = False, soft_cap: bool = True, causal: bool = True
) -> LlamaAttention:
    """Gemma's attention: scale query_pre_attn_scalar^-1/2, local layers windowed, scores soft-capped
    where configured and `soft_cap`; Gemma 3 adds (1 + w) RMSNorms over each q and k head. Not `causal`:
    bidirectional, a local layer's window then reaching as far on either side (EmbeddingGemma)."""
    return LlamaAttention(
        config,
        qk_norm=qk_norm,
        head_norm=GemmaRMSNorm,
        scale=config.query_pre_attn_scalar**-0.5,
        sliding_window=layer_sliding_window(config, layer_idx),
        logit_soft_cap=getattr(config, "attn_logit_softcapping", None) if soft_cap else None,
        causal=causal,
    )


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config: Any, self_attn: LlamaAttention) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = self_attn
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
    """`rope_kinds`: per layer, the key of its rotary table in `rotary` (Gemma 2: one for all; Gemma 3:
    local and global layers rotate with different bases); each table is looked up once per step."""

    def __init__(
        self,
        config: Any,
        layers: list[nn.Module],
        rotary: dict[str, RotaryEmbedding] | None = None,
        rope_kinds: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, scale=config.hidden_size**0.5
        )
        self.rotary = rotary or {"all": RotaryEmbedding.from_config(config, head_dim_of(config))}
        self.rope_kinds = rope_kinds or ["all"] * len(layers)
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fused_decode = FusedDecode(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        tables = {kind: r.cos_sin(positions, x.dtype) for kind, r in self.rotary.items()}
        ropes = [tables[kind] for kind in self.rope_kinds]
        meta = get_forward_context()
        if self.fused_decode.applies(x, meta):  # all decodes: one native call per layer
            x, _ = self.fused_decode.run(x.contiguous(), ropes[0], meta, layer_ropes=ropes)
        else:
            for layer, rope in zip(self.layers, ropes):
                x = layer(rope, x)
        return self.norm(x)


class Gemma2ForCausalLM(CausalLM):
    stacked_params = LLAMA_STACKED_PARAMS
    supports_tensor_parallel = True

    def make_model(self, config: Any) -> Gemma2Model:
        """The decoder stack; Gemma 3 overrides it."""
        n = config.num_hidden_layers
        layers = [Gemma2DecoderLayer(config, gemma_attention(config, i)) for i in range(n)]
        return Gemma2Model(config, layers)

    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(
                f"{type(self).__name__} with use_bidirectional_attention (an encoder) is not supported."
            )
        self.config = config
        self.model = self.make_model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(
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
