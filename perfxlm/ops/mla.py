"""Multi-head latent attention's decode step (DeepSeek-V2/V3) over the paged latent cache, as one op.

Each cached row is one token's [latent c | rope key k_pe] (model/layers/mla.py). With W_UK folded into the
query and W_UV applied after attention, head h of a single-token query attends as

    q_h = [q_nope_h W_UK[h], q_pe_h]     p_h = softmax(scale q_h . rows)     out_h = (p_h . latents) W_UV^T[h]

The native kernel (`csrc/mla_kernels.cpp`) runs all of it in one call per layer, reading each cached row
once for every head; `mla_decode_attention_torch` is the same from torch ops (the module path's own
composition: absorbed query, the paged decode attention with the latent as one KV head, W_UV), the
definition the kernel is tested against and the path where it is not built.
"""

from __future__ import annotations

import torch

from perfxlm.ops import native
from perfxlm.ops.attention import paged_decode_attention_torch


def mla_decode_attention(
    query: torch.Tensor,  # [B, H, nope + rope], one token per sequence, the rope part rotated
    cache: torch.Tensor,  # [num_blocks, block_size, 1, kv_lora_rank + rope]
    scales: torch.Tensor | None,  # a quantized cache's [num_blocks, block_size, 1, groups], else None
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    seq_lens: torch.Tensor,  # [B] int64, tokens to attend to (including the query's own)
    w_uk: torch.Tensor,  # [H, nope, kv_lora_rank], float32 or bf16
    w_uv_t: torch.Tensor,  # [H, kv_lora_rank, v_head_dim], the same dtype
    scale: float,
) -> torch.Tensor:  # [B, H, v_head_dim], query's dtype
    ops = native.kernels_for(query)
    if ops is not None:
        out = ops.mla_decode_attention(query.float(), cache, scales, block_tables, seq_lens, w_uk, w_uv_t, scale)
        return out.to(query.dtype)
    return mla_decode_attention_torch(query, cache, scales, block_tables, seq_lens, w_uk, w_uv_t, scale)


def mla_decode_attention_torch(
    query: torch.Tensor,
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv_t: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same from torch ops: any device."""
    nope, rank = w_uk.shape[1], w_uk.shape[2]
    q_latent = torch.bmm(query[..., :nope].transpose(0, 1), w_uk.to(query.dtype)).transpose(0, 1)
    q = torch.cat((q_latent, query[..., nope:]), dim=-1)
    out = paged_decode_attention_torch(
        q, cache, cache, block_tables, seq_lens, scale, key_scale=scales, value_scale=scales,
    )[..., :rank]  # fmt: skip
    return torch.bmm(out.transpose(0, 1), w_uv_t.to(query.dtype)).transpose(0, 1)
