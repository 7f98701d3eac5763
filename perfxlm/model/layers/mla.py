"""Multi-head latent attention (DeepSeek-V2/V3), with the compressed latent as the KV cache.

Each token's keys and values are one latent c = norm(W_DKV x) of `kv_lora_rank` values plus one shared
rotary key k_pe of `qk_rope_head_dim`; head h's key is [W_UK[h] c, k_pe] and its value W_UV[h] c. Rather
than expanding them (num_heads x (qk_head_dim + v_head_dim) values per token), W_UK is folded into the
query and W_UV applied after attention ("weight absorption"):

    score_h = (q_nope_h W_UK[h]) . c + q_pe_h . k_pe        out_h = W_UV[h] (sum_t p_t c_t)

so attention is multi-query attention with one KV head of kv_lora_rank + qk_rope_head_dim channels, which
the paged cache and every attention kernel already serve (a decode reads each cached latent once for all
heads). The value is the same latent row as the key (the rope channels of the output are dropped), so the
layer's cache holds one tensor as both K and V (`value_is_key`): kv_lora_rank + qk_rope_head_dim values
per token and layer, the latent's size. DeepSeek-V2-Lite's expanded K/V would be 16 heads x (192 + 128)
= 5120 values per token and layer, against 576 here (8.9x fewer bytes at any cache dtype).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.distributed.parallel_state import tp_group
from perfxlm.model.layers.attention import Attention
from perfxlm.model.layers.linear import Linear
from perfxlm.model.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from perfxlm.model.layers.norm import RMSNorm
from perfxlm.model.layers.rotary import _rope_type, apply_rotary, rope_parameters, yarn_mscale


def mla_scale(config: Any) -> float:
    """qk_head_dim^-1/2, times YaRN's mscale(factor, mscale_all_dim)^2 where the rope is scaled."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    _, scaling = rope_parameters(config)
    mscale_all_dim = scaling.get("mscale_all_dim", 0)
    if _rope_type(scaling) != "default" and mscale_all_dim:
        scale *= yarn_mscale(scaling["factor"], mscale_all_dim) ** 2
    return scale


def heads_of_rank(num_heads: int) -> tuple[int, int]:
    """(first head, heads) of this rank's contiguous share of the query heads (all of them with one rank)."""
    tp = tp_group()
    if tp.world_size > num_heads:
        raise ValueError(f"tensor_parallel_size={tp.world_size} exceeds the model's {num_heads} attention "
                         "heads: each rank needs at least one head.")
    return tp.part(num_heads)


class MLAttention(nn.Module):
    """Under tensor parallelism (as vLLM's MLA) the heads are split: q (or q_b) and kv_b are column-parallel
    by whole heads, o_proj row-parallel over the same heads; the down projections (q_a, kv_a) and their
    norms are replicated, so every rank computes and caches the whole latent (one KV head, which cannot be
    split) and attends with its own heads."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        heads = config.num_attention_heads
        first, self.num_heads = heads_of_rank(heads)
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        q_head, kv_b_head = self.nope_dim + self.rope_dim, self.nope_dim + self.v_dim

        def by_heads(width: int) -> tuple[int, int]:  # this rank's rows (or columns) of a per-head weight
            return first * width, self.num_heads * width

        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank:  # the query through its own low-rank bottleneck (V2 full size, V3)
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)  # transformers' default epsilon, not the config's
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * q_head, output_part=by_heads(q_head))
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * q_head, output_part=by_heads(q_head))
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * kv_b_head, output_part=by_heads(kv_b_head))
        self.kv_b_proj.quantize_weight = False  # absorbed into per-head float matrices at the first step
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=bias, input_part=by_heads(self.v_dim))
        self.latent_dim = self.kv_lora_rank + self.rope_dim
        self.attn = Attention(self.num_heads, 1, self.latent_dim, mla_scale(config), value_is_key=True)
        self._absorbed: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._decode_dtype: torch.dtype | None = None

    def absorbed(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, kv_lora], W_UV^T [H, kv_lora, v]) from kv_b_proj, once per dtype (the weights
        are final by the first forward pass)."""
        if dtype not in self._absorbed:
            w = self.kv_b_proj.weight_matrix().to(dtype)
            w = w.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
            w_uk = w[:, : self.nope_dim].contiguous()
            w_uv_t = w[:, self.nope_dim :].transpose(1, 2).contiguous()
            self._absorbed[dtype] = (w_uk, w_uv_t)
        return self._absorbed[dtype]

    def decode_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The absorbed matrices the latent decode kernel reads: bf16 where kv_b_proj's weight is (the same
        values in half the bytes a step reads), else float32."""
        if self._decode_dtype is None:
            bf16 = self.kv_b_proj.weight_matrix().dtype == torch.bfloat16
            self._decode_dtype = torch.bfloat16 if bf16 else torch.float32
        return self.absorbed(self._decode_dtype)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        kv = self.kv_a_proj_with_mqa(x)
        return self.o_proj(attend_latent(self.attn, self.kv_a_layernorm, *self.absorbed(x.dtype), self.nope_dim,
                                         rope, q, kv, self.decode_weights()))


def attend_latent(attn: Attention, kv_norm: RMSNorm, w_uk: torch.Tensor, w_uv_t: torch.Tensor, nope_dim: int,
                  rope: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, kv: torch.Tensor,
                  decode: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Latent attention between the projections: q [n, H * (nope + rope)] and kv_a's output [n, kv_lora +
    rope] in, the heads' values [n, H * v] out (o_proj's input); the latent row written to `attn`'s cache.
    MLAttention's core, and the engine's graph op for it (model/graph/kernels.py), so both round alike.
    `decode`: the absorbed matrices the latent decode kernel reads (MLAttention.decode_weights); the
    step's decode rows then run as one kernel from the query to W_UV (attention_backend.latent_decode)
    and only its prefill rows, if any, take the composition below: each row is computed as it would be
    in a step of its own kind."""
    n, heads, rank = q.shape[0], attn.num_heads, w_uk.shape[-1]
    q = q.view(n, heads, -1)
    latent = kv_norm(kv[:, :rank].contiguous())
    q_pe = apply_rotary(q[..., nope_dim:].contiguous(), *rope)
    k_pe = apply_rotary(kv[:, rank:].contiguous().view(n, 1, -1), *rope)
    key = torch.cat((latent.view(n, 1, rank), k_pe), dim=-1)  # [n, 1, latent_dim]
    decoded = None if decode is None else attn.latent_decode(q[..., :nope_dim], q_pe, key, *decode)
    done = 0 if decoded is None else decoded.shape[0]  # the leading decode rows the kernel answered
    if decoded is not None and done == n:
        return decoded.reshape(n, heads * w_uv_t.shape[-1])
    q, q_pe, key = q[done:], q_pe[done:], key[done:]
    q_latent = torch.bmm(q[..., :nope_dim].transpose(0, 1), w_uk).transpose(0, 1)  # [rows, H, kv_lora]
    query = torch.cat((q_latent, q_pe), dim=-1)
    out = attn(query, key, key, prefills_only=done > 0).view(n - done, heads, attn.head_dim)[..., :rank]
    out = torch.bmm(out.transpose(0, 1), w_uv_t).transpose(0, 1)  # [rows, H, v]
    if decoded is not None:
        out = torch.cat((decoded.to(out.dtype), out))
    return out.reshape(n, heads * w_uv_t.shape[-1])
