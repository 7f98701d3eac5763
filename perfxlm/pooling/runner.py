"""One batch of whole token sequences -> final hidden states (and classifier logits): the model runner of
the pooling runner kind, with no KV cache and no sampler (pooling is `pooler.py`'s, per request). Every
attention layer is bound to the cacheless backend once, here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from perfxlm.model.forward_context import CachelessBatch, set_forward_context
from perfxlm.model.layers.attention import Attention
from perfxlm.model.layers.attention_backend import CachelessAttentionBackend
from perfxlm.model.models.base import EncoderModel


@dataclass(slots=True)
class PoolingSeq:
    token_ids: list[int]
    token_type_ids: list[int] | None = None  # a sentence pair's segments (BERT cross-encoders)


class PoolingRunner:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        # an encoder takes segment ids; a causal LM used as an embedder takes ids and positions only
        self.encoder = isinstance(model, EncoderModel)
        # which token a classification head reads: an encoder's first ([CLS]), a decoder's last
        self.classifier_reads_last = getattr(model, "classifier_token", "first") == "last"
        backend = CachelessAttentionBackend()
        for module in model.modules():
            if isinstance(module, Attention):
                module.backend = backend

    @torch.inference_mode()
    def forward(self, seqs: list[PoolingSeq]) -> tuple[torch.Tensor, list[int]]:
        """The final hidden states [total tokens, hidden] of consecutive sequences, and their lengths."""
        lens = [len(s.token_ids) for s in seqs]
        input_ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64)
        positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
        with set_forward_context(CachelessBatch.of(lens)):
            if not self.encoder:
                return self.model(input_ids, positions), lens
            types = None
            if any(s.token_type_ids is not None for s in seqs):
                types = torch.tensor(
                    [t for s in seqs for t in (s.token_type_ids or [0] * len(s.token_ids))], dtype=torch.int64
                )
            return self.model(input_ids, positions, types), lens

    @torch.inference_mode()
    def classify(self, hidden: torch.Tensor, lens: list[int], rows: list[int]) -> torch.Tensor:
        """Float32 logits [len(rows), num_labels] of sequences `rows`: the classifier reads their first
        token (BERT's, XLM-RoBERTa's, ModernBERT's heads) or, for a decoder's score head, their last,
        whatever embeddings pool."""
        ends = torch.cumsum(torch.tensor(lens), 0)
        picked = ends - 1 if self.classifier_reads_last else ends - torch.tensor(lens)
        return self.model.classify(hidden[picked[torch.tensor(rows)]])
