"""Pooling types over one flattened batch of sequences, and the task heads applied per request."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, seq_lens: list[int], pooling_type: str) -> list[torch.Tensor]:
    """[num_tokens, hidden] rows of consecutive sequences -> one tensor per sequence: [hidden] (CLS, the
    first token; LAST, the last; MEAN over the tokens) or [len, hidden] (ALL)."""
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    ends = torch.cumsum(lens, 0)
    starts = ends - lens
    if pooling_type == "CLS":
        return list(hidden[starts].float().unbind(0))
    if pooling_type == "LAST":
        return list(hidden[ends - 1].float().unbind(0))
    if pooling_type == "MEAN":
        seq_of_row = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)
        sums = torch.zeros(len(seq_lens), hidden.shape[1], dtype=torch.float32)
        sums.index_add_(0, seq_of_row, hidden.float())
        return list((sums / lens[:, None].to(torch.float32)).unbind(0))
    if pooling_type == "ALL":
        return list(hidden.float().split(seq_lens, 0))
    raise ValueError(f"unknown pooling type {pooling_type!r}")


def embedding_head(pooled: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Matryoshka truncation first, then L2 normalization (vLLM's order: a truncated embedding is unit-length)."""
    if dimensions is not None:
        pooled = pooled[..., :dimensions]
    if normalize:
        pooled = F.normalize(pooled, p=2, dim=-1)
    return pooled


def classifier_activation(logits: torch.Tensor, use_activation: bool) -> torch.Tensor:
    """Probabilities from a classifier's logits: sigmoid for one label (a cross-encoder's relevance),
    softmax over several; raw logits when the request turned the activation off."""
    if not use_activation:
        return logits
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
