"""Attention of whole sequences over themselves, several in one flattened batch, without a KV cache.

The pooling runner's step: linears run on the unpadded tokens; attention runs once per run of
consecutive sequences of one length, on a [sequences, heads, length, head_dim] view of their rows (no
gather and no key mask: a run has no padding), and writes its rows of the output in place. The runner
sorts a batch longest first, so a batch of texts cut to the window is one run, and short texts make
runs of a few sequences. Per-run calls instead of one padded call save the gather of q, k and v and the
read-back of the real rows, which cost more than the attention product itself on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _window_mask(length: int, causal: bool, sliding_window: int) -> torch.Tensor:
    """[length, length] bool: causal, a query at p sees keys in (p - window, p]; bidirectional, the keys
    within window - 1 of p on either side."""
    query_pos = torch.arange(length)[:, None]
    key_pos = torch.arange(length)[None, :]
    if causal:
        return (key_pos <= query_pos) & (key_pos > query_pos - sliding_window)
    return (key_pos - query_pos).abs() < sliding_window


def varlen_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,
    runs: tuple[tuple[int, int, int], ...],  # (first row, sequences, length) of consecutive equal lengths
    scale: float,
    causal: bool,
    # causal: a query at position p sees keys in (p - window, p]; bidirectional: keys within window - 1 of p
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    out = torch.empty(q.shape, dtype=q.dtype)
    for start, count, length in runs:
        rows = slice(start, start + count * length)
        qs, ks, vs = (t[rows].unflatten(0, (count, length)).transpose(1, 2) for t in (q, k, v))
        mask = None if sliding_window is None or sliding_window >= length else _window_mask(length, causal, sliding_window)
        result = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=causal and mask is None, scale=scale, enable_gqa=True,
        )  # fmt: skip
        out[rows].unflatten(0, (count, length)).copy_(result.transpose(1, 2))
    return out
