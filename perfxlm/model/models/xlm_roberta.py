"""XLM-RoBERTa encoders (bge-m3, multilingual-e5) and cross-encoders (bge-reranker-base / -large, -v2-m3).

BERT's blocks (`bert.py`); positions are counted from the padding index + 1, as RoBERTa numbers them (a
sequence's first token sits at row padding_idx + 1 of the table), and the classification head is
dense -> tanh -> out_proj over the first token. transformers gives a literal padding token inside a
text the padding position; here every token of a sequence gets its index (the tokenizer never makes
one from ordinary text).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.model.layers.linear import Linear
from perfxlm.model.models.base import EncoderModel
from perfxlm.model.models.base import num_labels_of
from perfxlm.model.models.bert import BERT_STACKED_PARAMS, BertModel


def _position_offset(config: Any) -> int:
    return int(getattr(config, "pad_token_id", 1) or 0) + 1


class XLMRobertaModel(BertModel):
    renames = [(r"^roberta\.", "")]

    def __init__(self, config: Any) -> None:
        self.position_offset = _position_offset(config)
        super().__init__(config)


class XLMRobertaClassificationHead(nn.Module):
    def __init__(self, config: Any, num_labels: int) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, bias=True)
        self.out_proj = Linear(config.hidden_size, num_labels, bias=True)

    def forward(self, first_token: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first_token)))


class XLMRobertaForSequenceClassification(EncoderModel):
    stacked_params = BERT_STACKED_PARAMS
    skip_substrings = ["position_ids", "roberta.pooler."]
    default_pooling_type = "CLS"

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.roberta = XLMRobertaModel(config)
        self.num_labels = num_labels_of(config)
        self.classifier = XLMRobertaClassificationHead(config, self.num_labels)

    def forward(self, input_ids, positions, token_type_ids=None):
        return self.roberta(input_ids, positions, token_type_ids)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(pooled).float()

    def max_positions(self) -> int:
        return self.roberta.max_positions()
