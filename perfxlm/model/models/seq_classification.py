"""A Llama-shaped decoder with transformers' sequence-classification head (`*ForSequenceClassification`:
Qwen3-Reranker converted to a score head, reward and classifier fine-tunes): the decoder's layers as its
causal LM builds them, no LM head, and `score` (hidden -> num_labels, no bias) over the last token's
state. Only the pooling runner serves it (classify, and score when it has one label).

A causal LM's own checkpoint loads here too when its config (hf_overrides) names the LM head rows the
score is made of (`classifier_from_tokens.py`: Qwen3-Reranker's yes/no form)."""

from __future__ import annotations

from typing import Any, ClassVar, Iterable

import torch

from perfxlm.model.layers.linear import Linear
from perfxlm.model.models import classifier_from_tokens
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
        # set where the score head is made of LM head rows (a causal LM's checkpoint)
        self.from_tokens: classifier_from_tokens.ClassifierFromTokens | None = getattr(
            config, classifier_from_tokens.CONFIG_KEY, None
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], sink: Any = None) -> None:
        if self.from_tokens is not None:
            weights = self.from_tokens.score_stream(weights, self.tie_word_embeddings)
        super().load_weights(weights, sink)

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
