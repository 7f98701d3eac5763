"""Plain reference implementations: slow, obvious, and what the optimized ops are tested against."""

from __future__ import annotations

import torch


def attention_reference(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [S, num_kv_heads, head_dim], all keys the sequence has (context + new)
    value: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Causal attention where query i is the last T tokens of the S-token sequence."""
    num_new, num_heads, _ = query.shape
    total, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for i in range(num_new):
        visible = total - num_new + i + 1
        for h in range(num_heads):
            k = key[:visible, h // group].float()
            v = value[:visible, h // group].float()
            weights = torch.softmax((k @ query[i, h].float()) * scale, dim=0)
            out[i, h] = (weights @ v).to(query.dtype)
    return out


def gather_sequence_kv(
    cache: torch.Tensor, block_table: list[int], num_tokens: int
) -> torch.Tensor:  # [num_tokens, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    rows = [cache[block_table[p // block_size], p % block_size] for p in range(num_tokens)]
    return torch.stack(rows)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
