"""Attention of whole sequences over themselves, several in one flattened batch, without a KV cache.

The pooling runner's step: linears run on the unpadded tokens; here they are gathered into
[num_seqs, max_len] (the runner sorts a batch by length, so little is padding), one SDPA call attends
with a key mask (and the causal / sliding-window mask of a decoder), and the real rows are read back in
the flattened order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def varlen_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,
    index: torch.Tensor,  # [B, L] int64: row of each sequence's token in the flattened batch
    valid: torch.Tensor,  # [B, L] bool: a real token
    scale: float,
    causal: bool,
    # causal: a query at position p sees keys in (p - window, p]; bidirectional: keys within window - 1 of p
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    num_seqs, width = index.shape
    if num_seqs == 1 and sliding_window is None:  # one sequence: no gather, no mask
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=causal,
            scale=scale, enable_gqa=True,
        )  # fmt: skip
        return out[0].transpose(0, 1)
    rows = index.reshape(-1)
    # index_select: half the time of advanced indexing on these strided views of the fused QKV output
    qp, kp, vp = (t.index_select(0, rows).view(num_seqs, width, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
    mask = valid[:, None, None, :]  # keys only: a padding query row still sees real keys (no NaN)
    if causal or sliding_window is not None:
        query_pos = torch.arange(width)[:, None]
        key_pos = torch.arange(width)[None, :]
        shape = key_pos <= query_pos if causal else torch.ones(width, width, dtype=torch.bool)
        if sliding_window is not None:
            near = (key_pos > query_pos - sliding_window) if causal else (key_pos - query_pos).abs() < sliding_window
            shape = shape & near
        mask = mask & shape
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)[valid]
