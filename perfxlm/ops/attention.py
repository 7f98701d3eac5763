"""Paged attention over a KV cache laid out as [num_blocks, block_size, num_kv_heads, head_dim].

Plain-torch versions built from SDPA; `ops/reference.py` holds the naive per-token reference
the tests compare against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    # [B, max_blocks] -> [B, num_kv_heads, max_blocks * block_size, head_dim]
    batch = block_tables.shape[0]
    # index_select on a 2-D view: several times faster than advanced indexing on the 4-D cache.
    gathered = cache.view(cache.shape[0], -1).index_select(0, block_tables.reshape(-1))
    return gathered.view(batch, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)


def decode_mask(seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:  # [B, 1, 1, max_len] bool
    return (torch.arange(max_len)[None, :] < seq_lens[:, None]).view(seq_lens.shape[0], 1, 1, max_len)


def paged_decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim], one query token per sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    seq_lens: torch.Tensor,  # [B] int64, tokens to attend to (including the query's own)
    scale: float,
    mask: torch.Tensor | None = None,  # decode_mask(...) of the same step, to build it once for all layers
) -> torch.Tensor:  # [B, num_heads, head_dim]
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    key = _gather(key_cache, block_tables)
    value = _gather(value_cache, block_tables)
    # The heads of one KV group become the "query length" axis: GQA without repeating K/V.
    q = query.view(batch, num_kv_heads, group, head_dim)
    if mask is None:
        mask = decode_mask(seq_lens, block_tables.shape[1] * key_cache.shape[1])
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def prefill_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim], the new tokens of one sequence
    key: torch.Tensor,  # [T, num_kv_heads, head_dim], their keys (also already in the cache)
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_blocks] int64
    num_context_tokens: int,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    num_new = query.shape[0]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
    if num_context_tokens == 0:
        k = key.transpose(0, 1).unsqueeze(0)
        v = value.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        total = num_context_tokens + num_new
        k = _gather(key_cache, block_table[None])[:, :, :total]
        v = _gather(value_cache, block_table[None])[:, :, :total]
        # New token i sits at absolute position num_context_tokens + i and sees keys up to it.
        rows = torch.arange(num_new)[:, None] + num_context_tokens
        mask = torch.arange(total)[None, :] <= rows
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
