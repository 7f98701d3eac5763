"""ModernBERT encoders (gte-modernbert, nomic-embed-text-v2-style, modernbert-embed) and cross-encoders
(`ModernBertForSequenceClassification` with CLS pooling: gte-reranker-modernbert).

Pre-norm blocks without biases: x + attn(norm(x)), then + GeGLU mlp(norm(.)) (layer 0 has no attention
norm: the embeddings' norm precedes it). Rotary positions with a theta per layer type; the layers
`layer_types` marks "sliding_attention" see keys within `sliding_window` positions on either side
(transformers' bidirectional window), the others the whole sequence.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.model.layers.activation import act_and_mul, get_activation
from perfxlm.model.layers.attention import Attention
from perfxlm.model.layers.embed_head import VocabEmbedding
from perfxlm.model.layers.linear import Linear
from perfxlm.model.layers.norm import LayerNorm
from perfxlm.model.layers.rotary import RotaryEmbedding, apply_rotary
from perfxlm.model.models.base import EncoderModel, num_labels_of


def _norm(config: Any) -> LayerNorm:
    return LayerNorm(config.hidden_size, config.norm_eps, bias=bool(config.norm_bias))


def _layer_types(config: Any) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:  # older configs: every n-th layer global
        every = int(getattr(config, "global_attn_every_n_layers", 3))
        types = ["full_attention" if i % every == 0 else "sliding_attention" for i in range(config.num_hidden_layers)]
    return list(types)


def _theta(config: Any, layer_type: str) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params and params[layer_type]:
        if params[layer_type].get("rope_type", "default") != "default":
            raise ValueError(f"ModernBERT rope_type {params[layer_type]['rope_type']!r} is not supported.")
        return float(params[layer_type]["rope_theta"])
    name = "local_rope_theta" if layer_type == "sliding_attention" else "global_rope_theta"
    return float(getattr(config, name))


class ModernBertAttention(nn.Module):
    def __init__(self, config: Any, layer_type: str) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads, self.head_dim = heads, hidden // heads
        bias = bool(config.attention_bias)
        self.Wqkv = Linear(hidden, 3 * hidden, bias=bias)
        self.Wo = Linear(hidden, hidden, bias=bias)
        # transformers' bidirectional window: |query - key| <= sliding_window; the backend's is < window
        window = int(config.sliding_window) + 1 if layer_type == "sliding_attention" else None
        self.attn = Attention(heads, heads, self.head_dim, self.head_dim**-0.5, sliding_window=window, causal=False)
        self.layer_type = layer_type

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        n, qk_size = x.shape[0], 2 * self.num_heads * self.head_dim
        qkv = self.Wqkv(x)
        # q and k heads are adjacent in the fused output: rotate them in one pass
        qk = apply_rotary(qkv[:, :qk_size].view(n, 2 * self.num_heads, self.head_dim), *rope)
        v = qkv[:, qk_size:].view(n, self.num_heads, self.head_dim)
        return self.Wo(self.attn(qk[:, : self.num_heads], qk[:, self.num_heads :], v))


class ModernBertMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.Wi = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bool(config.mlp_bias))
        self.act = act_and_mul(config.hidden_activation)  # act(first half) * second half
        self.Wo = Linear(config.intermediate_size, config.hidden_size, bias=bool(config.mlp_bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.Wo(self.act(self.Wi(x)))


class ModernBertLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, layer_type: str) -> None:
        super().__init__()
        self.attn_norm = _norm(config) if layer_idx > 0 else None
        self.attn = ModernBertAttention(config, layer_type)
        self.mlp_norm = _norm(config)
        self.mlp = ModernBertMLP(config)

    def forward(self, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
        h = x if self.attn_norm is None else self.attn_norm(x)
        x = x + self.attn(ropes[self.attn.layer_type], h)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.tok_embeddings = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.norm = _norm(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertModel(EncoderModel):
    renames = [(r"^model\.", "")]
    skip_substrings = ["position_ids", "rotary_emb"]
    default_pooling_type = "CLS"

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        types = _layer_types(config)
        head_dim = config.hidden_size // config.num_attention_heads
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = nn.ModuleList(ModernBertLayer(config, i, t) for i, t in enumerate(types))
        self.final_norm = _norm(config)
        self.rotary = {t: RotaryEmbedding(head_dim, config.max_position_embeddings, _theta(config, t), {})
                       for t in sorted(set(types))}

    def forward(self, input_ids, positions, token_type_ids=None):
        x = self.embeddings(input_ids)
        ropes = {t: r.cos_sin(positions, x.dtype) for t, r in self.rotary.items()}
        for layer in self.layers:
            x = layer(ropes, x)
        return self.final_norm(x)

    def max_positions(self) -> int:
        return int(self.config.max_position_embeddings)


class ModernBertPredictionHead(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, bias=bool(config.classifier_bias))
        self.act = get_activation(config.classifier_activation)
        self.norm = _norm(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertForSequenceClassification(EncoderModel):
    """A cross-encoder: the first token's state -> dense, activation, norm -> classifier."""

    skip_substrings = ["position_ids", "rotary_emb"]
    default_pooling_type = "CLS"

    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "classifier_pooling", "cls") != "cls":
            raise ValueError(f"ModernBERT classifier_pooling={config.classifier_pooling!r} is not supported; "
                             "only 'cls' is.")
        self.config = config
        self.model = ModernBertModel(config)
        self.head = ModernBertPredictionHead(config)
        self.num_labels = num_labels_of(config)
        self.classifier = Linear(config.hidden_size, self.num_labels, bias=True)

    def forward(self, input_ids, positions, token_type_ids=None):
        return self.model(input_ids, positions)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.head(pooled)).float()

    def max_positions(self) -> int:
        return self.model.max_positions()
