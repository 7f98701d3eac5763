"""BERT encoders (bge, e5, all-MiniLM, gte) and BERT cross-encoders (`BertForSequenceClassification`).

Post-norm blocks: x = LN(x + attn(x)), x = LN(x + mlp(x)), with bidirectional attention; the pooling runner
runs them on whole sequences in one flattened batch (no KV cache). XLM-RoBERTa (`xlm_roberta.py`) is this
with other position ids and another classification head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.model.layers.activation import get_activation
from perfxlm.model.layers.attention import Attention
from perfxlm.model.layers.embed_head import VocabEmbedding
from perfxlm.model.layers.linear import Linear, MergedLinear
from perfxlm.model.layers.norm import LayerNorm
from perfxlm.model.models.base import EncoderModel, num_labels_of


class Table(nn.Module):
    """A small lookup table (positions, segments): float weights kept in the model dtype."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


class BertEmbeddings(nn.Module):
    """word + position + segment embeddings, then LayerNorm. `position_offset`: the row of position 0
    (XLM-RoBERTa's ids start after its padding index)."""

    def __init__(self, config: Any, position_offset: int = 0) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = VocabEmbedding(config.vocab_size, hidden)
        self.position_embeddings = Table(config.max_position_embeddings, hidden)
        self.token_type_embeddings = Table(max(1, getattr(config, "type_vocab_size", 1) or 1), hidden)
        self.LayerNorm = LayerNorm(hidden, config.layer_norm_eps)
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None):
        x = self.word_embeddings(input_ids)
        x = x + self.position_embeddings(positions + self.position_offset)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class AddNorm(nn.Module):
    """LN(residual + dense(x)): the output half of BERT's attention and MLP blocks (`*.output`)."""

    def __init__(self, in_features: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = Linear(in_features, hidden, bias=True)
        self.LayerNorm = LayerNorm(hidden, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense.forward_add(x, residual))


class BertAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        if hidden % heads:
            raise ValueError(f"hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads}).")
        self.num_heads, self.head_dim = heads, hidden // heads
        self.qkv_proj = MergedLinear(hidden, {"q": hidden, "k": hidden, "v": hidden}, bias=True)
        self.attn = Attention(heads, heads, self.head_dim, self.head_dim**-0.5, causal=False)
        self.output = AddNorm(hidden, hidden, config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        return self.output(self.attn(q, k, v), x)


class Intermediate(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size, bias=True)
        get_activation(config.hidden_act)  # an unsupported name fails as the model is built
        self.act = config.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the activation in the product's last pass where the weight's method has one (W8A8: GELU)
        return self.dense.forward_act(x, self.act)


class BertLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = Intermediate(config)
        self.output = AddNorm(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


def check_encoder_config(config: Any) -> None:
    kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise ValueError(f"position_embedding_type={kind!r} is not supported; only absolute positions are.")
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError("a BERT configured as a decoder (is_decoder / add_cross_attention) is not supported.")


BERT_STACKED_PARAMS = [
    (".attention.qkv_proj", ".attention.self.query", "q"),
    (".attention.qkv_proj", ".attention.self.key", "k"),
    (".attention.qkv_proj", ".attention.self.value", "v"),
]


class BertModel(EncoderModel):
    """The bare encoder, as sentence-transformers saves it (names without the `bert.` prefix; a checkpoint
    that has it loads too). Its pooler (dense + tanh over [CLS]) is not an embedding: skipped."""

    stacked_params = BERT_STACKED_PARAMS
    renames = [(r"^bert\.", "")]
    skip_substrings = ["pooler.", "position_ids", "cls.predictions", "cls.seq_relationship"]
    default_pooling_type = "CLS"
    position_offset = 0

    def __init__(self, config: Any) -> None:
        super().__init__()
        check_encoder_config(config)
        self.config = config
        self.embeddings = BertEmbeddings(config, self.position_offset)
        self.encoder = BertEncoder(config)

    def forward(self, input_ids, positions, token_type_ids=None):
        return self.encoder(self.embeddings(input_ids, positions, token_type_ids))

    def max_positions(self) -> int:
        return int(self.config.max_position_embeddings) - self.position_offset


class BertPooler(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, cls_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_states))


class BertForSequenceClassification(EncoderModel):
    """A cross-encoder (bge-reranker-base's BERT cousins, ms-marco MiniLM): [CLS] -> pooler -> classifier."""

    stacked_params = BERT_STACKED_PARAMS
    skip_substrings = ["position_ids"]
    default_pooling_type = "CLS"

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.bert.pooler = BertPooler(config)
        self.num_labels = num_labels_of(config)
        self.classifier = Linear(config.hidden_size, self.num_labels, bias=True)

    def forward(self, input_ids, positions, token_type_ids=None):
        return self.bert(input_ids, positions, token_type_ids)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.bert.pooler(pooled)).float()

    def max_positions(self) -> int:
        return self.bert.max_positions()
