"""A Llama-shaped decoder with transformers' sequence-classification head (`*ForSequenceClassification`:
Qwen3-Reranker converted to a score head, reward and classifier fine-tunes): the decoder's layers as its
causal LM builds them, no LM head, and `score` (hidden -> num_labels, no bias) over the last token's
state. Only the pooling runner serves it (classify, and score when it has one label)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from perfxlm.model.layers.linear import Linear
from perfxlm.model.models.base import CheckpointModel, num_labels_of
from perfxlm.model.models.llama import LLAMA_STACKED_PARAMS, LlamaForCausalLM, LlamaModel
from perfxlm.model.models.qwen2 import Qwen2ForCausalLM
from perfxlm.model.models.qwen3 import Qwen3ForCausalLM


class DecoderForSequenceClassification(CheckpointModel):
    stacked_params = LLAMA_STACKED_PARAMS
    # the causal LM whose `make_layer` builds the layers (attention options, MLP)
    decoder: ClassVar[type] = LlamaForCausalLM
    default_pooling_type: ClassVar[str] = "LAST"
    classifier_token: ClassVar[str] = "last"  # transformers pools the last (non-padding) token

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        layers = [self.decoder.make_layer(self, config, i) for i in range(config.num_hidden_layers)]
        self.model = LlamaModel(config, layers)
        self.num_labels = num_labels_of(config)
        self.score = Linear(config.hidden_size, self.num_labels, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.score(pooled).float()


class LlamaForSequenceClassification(DecoderForSequenceClassification):
    decoder = LlamaForCausalLM


class Qwen2ForSequenceClassification(DecoderForSequenceClassification):
    decoder = Qwen2ForCausalLM


class Qwen3ForSequenceClassification(DecoderForSequenceClassification):
    decoder = Qwen3ForCausalLM
