"""The attention layer: writes this step's K/V into the paged cache, then attends.

It reads the batch layout from the forward context; the runner binds `kv_cache` once; the kernels are its
attention backend's (`attention_backend.py`), chosen by the device of the first forward pass (the pooling
runner binds the cacheless backend itself, and no cache).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from perfxlm.model.forward_context import get_forward_context
from perfxlm.model.layers import attention_backend
from perfxlm.model.layers.attention_backend import AttentionBackend, AttentionOptions
from perfxlm.model.layers.rank_sharded import narrow
from perfxlm.ops.kv_quant import KVCache, KVCacheSpec


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
        causal: bool = True,  # False: bidirectional (an encoder; the pooling runner's cacheless backend)
        value_is_key: bool = False,  # callers pass v = k (MLA's latent): the cache stores it once
        sinks: bool = False,  # gpt-oss: a learned sink logit per head, `sinks` [num_heads]
        # under tensor parallelism: (the first of this rank's heads, the model's heads), the sinks it keeps
        heads_of: tuple[int, int] | None = None,
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
        self.value_is_key = value_is_key
        self.options = AttentionOptions(scale, sliding_window, logit_soft_cap, causal)
        # a Parameter of this module, put into the options at each forward (loading may replace it)
        self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False) if sinks else None
        self.heads_of = heads_of
        self.backend: AttentionBackend | None = None  # bound at the first forward pass, by its device
        # K and V blocks, each [num_blocks, block_size, num_kv_heads, head_dim], and their scales for an
        # int8 / fp8 cache (ops/kv_quant.py)
        self.kv_cache: KVCache | None = None

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        prefills_only: bool = False,  # the rows are the step's prefill rows alone (its decodes done apart)
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        backend = self.backend or self._bind_backend(q.device)
        assert self.kv_cache is not None or not backend.uses_cache, "KV cache not bound"
        options = self.options if self.sinks is None else dataclasses.replace(self.options, sinks=self.sinks)
        meta = get_forward_context()
        out = backend.forward(q, k, v, self.kv_cache, meta.prefill_part() if prefills_only else meta, options)
        return out.view(out.shape[0], -1)

    def latent_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, w_uk: torch.Tensor,
                      w_uv_t: torch.Tensor) -> torch.Tensor | None:
        """The step's decode rows of MLA in one kernel where the backend has one
        (`AttentionBackend.latent_decode`): [num_decode_tokens, num_heads, v_head_dim], or None (then
        `forward` for every row; for the prefill rows alone, `prefills_only`, where it returned them)."""
        backend = self.backend or self._bind_backend(q_nope.device)
        meta = get_forward_context()
        return backend.latent_decode(q_nope, q_pe, latent, self.kv_cache, meta, self.options, w_uk, w_uv_t)

    def rank_part(self, param_name: str, tensor: Any, shard: str | None, expert: int | None) -> Any:
        """The sinks of this rank's query heads (the checkpoint holds one per head of the model)."""
        if self.heads_of is None or param_name != "sinks":
            return tensor
        first, whole = self.heads_of
        return narrow(tensor, 0, first, self.num_heads, whole=whole)

    def cache_bytes_per_token(self, spec: KVCacheSpec) -> int:
        return spec.bytes_per_token(self.num_kv_heads, self.head_dim, self.value_is_key)

    def allocate_cache(self, spec: KVCacheSpec, num_blocks: int, block_size: int,
                       device: torch.device | None = None) -> KVCache:
        return spec.allocate(num_blocks, block_size, self.num_kv_heads, self.head_dim, self.value_is_key, device)

    def _bind_backend(self, device: torch.device) -> AttentionBackend:
        self.backend = attention_backend.for_device(device)
        return self.backend


def common_head_dim(model: nn.Module) -> int | None:
    """The head size of the model's attention layers when they all have the same one, else None."""
    dims = {m.head_dim for m in model.modules() if isinstance(m, Attention)}
    return dims.pop() if len(dims) == 1 else None
