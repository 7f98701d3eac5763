"""The attention layer: writes this step's K/V into the paged cache, then attends.

It reads the batch layout from the forward context; the runner binds `kv_cache` once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.model.forward_context import get_forward_context
from perfxlm.ops.attention import paged_decode_attention, prefill_attention, write_kv_cache
from perfxlm.ops.kv_quant import KVCache


def layer_sliding_window(config: Any, layer_idx: int, every_layer: bool = False) -> int | None:
    """The sliding window of one layer, as transformers decides it.

    `every_layer`: the family applies `config.sliding_window` to all layers when set (Mistral, Mixtral,
    Phi-3). Otherwise only layers that `config.layer_types` marks "sliding_attention" get it (Qwen2,
    Qwen2-MoE, Gemma 2).
    """
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if every_layer:
        return int(window)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return None
    return int(window) if layer_types[layer_idx] == "sliding_attention" else None


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,  # a query at position p sees keys in (p - window, p]
        logit_soft_cap: float | None = None,  # scores -> cap * tanh(scores / cap) before the softmax
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}.")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_soft_cap = logit_soft_cap
        # K and V blocks, each [num_blocks, block_size, num_kv_heads, head_dim], and their scales for an
        # int8 / fp8 cache (ops/kv_quant.py)
        self.kv_cache: KVCache | None = None

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        assert self.kv_cache is not None, "KV cache not bound"
        meta = get_forward_context()
        cache = self.kv_cache
        key_cache, value_cache = cache.key, cache.value
        write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping, cache.key_scale, cache.value_scale)
        out = torch.empty(q.shape, dtype=q.dtype)
        options = {}
        if cache.key_scale is not None:
            options["key_scale"], options["value_scale"] = cache.key_scale, cache.value_scale
        if self.sliding_window is not None:
            options["sliding_window"] = self.sliding_window
        if self.logit_soft_cap is not None:
            options["soft_cap"] = self.logit_soft_cap
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = paged_decode_attention(
                q[:nd], key_cache, value_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale,
                meta.decode_mask, **options,
            )  # fmt: skip
        for seq in meta.prefills:
            s, e = seq.start, seq.end
            out[s:e] = prefill_attention(
                q[s:e], k[s:e], v[s:e], key_cache, value_cache, seq.block_table, seq.num_context_tokens,
                self.scale, bf16_model=cache.bf16_model, **options,
            )  # fmt: skip
        return out.view(out.shape[0], -1)
