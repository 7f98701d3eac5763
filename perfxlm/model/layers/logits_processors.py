"""Logit transforms applied before sampling, in vLLM's order and with vLLM's definitions:

0. structured outputs: each guided row's grammar bitmask (tokens the grammar forbids -inf), applied
   in place to those rows only, so unguided rows in the same batch pay nothing;
1. sparse edits: allowed_token_ids (everything else -inf), bad_words and min_tokens bans (-inf),
   logit_bias (added);
2. penalties: repetition (over prompt and output tokens: positive logits divided, negative
   multiplied), then frequency (minus penalty x count in the output) and presence (minus penalty
   if the token occurred in the output).
Each is a no-op unless some row asks for it, so plain requests pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SparseLogitEdits:
    """Flattened (row, token, value) triples; -inf bans, finite values add a bias."""

    rows: torch.Tensor  # [k] int64
    cols: torch.Tensor  # [k] int64
    values: torch.Tensor  # [k] float32


@dataclass(slots=True)
class Penalties:
    repetition: torch.Tensor  # [rows] float32 (1 = off)
    frequency: torch.Tensor  # [rows]
    presence: torch.Tensor  # [rows]
    prompt_ids: torch.Tensor  # [rows, max_prompt_len] int64, padded with vocab_size
    output_ids: torch.Tensor  # [rows, max_output_len] int64, padded with vocab_size


def apply_allowed(logits: torch.Tensor, allowed_rows: torch.Tensor, allowed_cols: torch.Tensor) -> torch.Tensor:
    """Rows listed in allowed_rows keep only the (row, col) pairs given."""
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[allowed_rows, allowed_cols] = True
    restricted = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    restricted[allowed_rows] = True
    return logits.masked_fill(restricted.unsqueeze(1) & ~keep, float("-inf"))


def apply_sparse_edits(logits: torch.Tensor, edits: SparseLogitEdits) -> torch.Tensor:
    return logits.index_put((edits.rows, edits.cols), edits.values, accumulate=True)


def _token_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    # Padding uses id == vocab: count into one spare column, then drop it.
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    vocab = logits.shape[1]
    output_counts = _token_counts(p.output_ids, vocab)
    seen = (_token_counts(p.prompt_ids, vocab) > 0) | (output_counts > 0)
    rep = p.repetition.unsqueeze(1).expand_as(logits)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - p.frequency.unsqueeze(1) * output_counts
    return logits - p.presence.unsqueeze(1) * (output_counts > 0).float()


def apply_grammar_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """In place: bitmask [logits rows, ceil(vocab / 32)] int32 (bit t of a row set = token t allowed),
    applied to the listed rows only (xgrammar's CPU kernel, ~20 us per 49k-token row)."""
    import xgrammar as xgr

    if not logits.is_contiguous():
        logits = logits.contiguous()
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
    return logits
