"""Token sampling from float32 logits of the rows that sample.

1. Greedy rows take the argmax of the raw logits.
2. Random rows: logits / temperature -> min_p -> top_k -> top_p (vLLM's order), then one draw
   per row with the exponential-race trick (argmax(p / q), q ~ Exp(1)), which needs no
   cumulative sum; a row with a seed draws its q from its own generator, so its tokens do not
   depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [num_rows] float32; 0 for greedy rows
    all_greedy: bool
    top_p: torch.Tensor | None  # [num_rows] or None when no row filters
    top_k: torch.Tensor | None  # [num_rows] int64, vocab size where off
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]  # row -> generator, for rows with a seed


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    if k is None and p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if k is not None:
        # The k-th largest value sits at index vocab - k of the ascending sort.
        kth = sorted_logits.gather(1, (vocab - k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:  # [num_rows] int64
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        is_greedy = meta.temperature == 0
        temp = torch.where(is_greedy, torch.ones_like(meta.temperature), meta.temperature)
        logits = logits / temp.unsqueeze(1)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_()
        for row, gen in meta.generators.items():
            q[row].exponential_(generator=gen)
        random = (probs / q).argmax(dim=-1)
        return torch.where(is_greedy, greedy, random)
