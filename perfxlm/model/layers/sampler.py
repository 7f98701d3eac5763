"""Token sampling from float32 logits of the rows that sample.

1. Greedy rows take the argmax of the raw logits.
2. Random rows: logits / temperature -> min_p -> top_k -> top_p (vLLM's order), then one
   uniform draw per row through the cumulative distribution (one random number per row: the
   exponential race needs one per vocabulary entry, 150 ms for 64 rows on this CPU).
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


# Top-p looks at this many best tokens first; only rows whose mass there stays below p need a full sort.
_TOP_P_CANDIDATES = 1024


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) what top-k and then top-p drop. Sorting the whole vocabulary is slow on CPU,
    so both work on a top-k slice and fall back to a full sort only where the slice is not enough."""
    if k is None and p is None:
        return logits
    vocab = logits.shape[-1]
    if k is not None:
        k = k.clamp(1, vocab)
        top = logits.topk(int(k.max()), dim=-1).values  # [rows, max_k], descending
        kth = top.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p is not None:
        n = min(vocab, _TOP_P_CANDIDATES)
        probs = logits.softmax(dim=-1)
        cand = probs.topk(n, dim=-1).values  # descending
        mass_before = cand.cumsum(dim=-1) - cand
        complete = (mass_before[:, -1] + cand[:, -1] >= p) | (n == vocab)
        if not bool(complete.all()):
            cand = probs.sort(dim=-1, descending=True).values
            mass_before = cand.cumsum(dim=-1) - cand
        # Keep a token while the mass ranked above it is still below p (the best token always stays).
        num_keep = (mass_before < p.unsqueeze(1)).sum(dim=-1).clamp(min=1)
        threshold = cand.gather(1, (num_keep - 1).unsqueeze(1))
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:  # [num_rows] int64
        if meta.all_greedy:
            return logits.argmax(dim=-1)
        is_greedy = meta.temperature == 0
        any_greedy = bool(is_greedy.any())
        greedy = logits.argmax(dim=-1) if any_greedy else None
        temp = torch.where(is_greedy, torch.ones_like(meta.temperature), meta.temperature)
        logits = logits / temp.unsqueeze(1)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        sampled = sample_from_probs(logits.softmax(dim=-1), meta.generators)
        return torch.where(is_greedy, greedy, sampled) if any_greedy else sampled


def sample_from_probs(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One uniform draw per row through the cumulative distribution: a row with a seed draws from its
    own generator, so its tokens do not depend on what else is in the batch."""
    u = torch.rand(probs.shape[0], 1)
    for row, gen in generators.items():
        u[row] = torch.rand(1, generator=gen)
    cdf = probs.cumsum(dim=-1)
    # Scale by the row total so rounding in the cumulative sum never leaves u past the end.
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return idx.squeeze(1).clamp_(max=probs.shape[-1] - 1)
