"""Paged attention over a KV cache laid out as [num_blocks, block_size, num_kv_heads, head_dim].

Plain-torch versions built from SDPA; `ops/reference.py` holds the naive per-token reference
the tests compare against. Prefill over cached context reads the cache tile by tile
(`ops/prefill_tiles.py`); `prefill_attention_reference` keeps the gather-everything path beside it.

Options some models need: `sliding_window` W (a query at position p sees keys in (p - W, p], as
transformers' sliding-window masks) and `soft_cap` c (scores become c * tanh(scores / c) before the
mask, Gemma 2). Plain attention (neither set) takes the SDPA paths unchanged. Attention sinks (gpt-oss:
a per-head logit in each softmax's denominator, over no value) enter the native decode kernel's
normalisation, and prefill through the log-sum-exp the flash kernel returns: out x sigmoid(lse - sink)
(`prefill_tiles.apply_sinks`); the spelled-out softmax with the sink as one more column is the reference.
"""

from __future__ import annotations

import functools
import os
import torch
import torch.nn.functional as F

from perfxlm.ops import cpu_plan, native, prefill_kernel
from perfxlm.ops.kv_quant import as_bits, cache_is_quantized, gather_blocks, quantize
from perfxlm.ops.prefill_tiles import apply_sinks, attention_tile, fits_one_tile, gather_tile, tiled_prefill_attention


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    key_scale: torch.Tensor | None = None,  # quantized cache: [num_blocks, block_size, num_kv_heads, groups]
    value_scale: torch.Tensor | None = None,
) -> None:
    if cache_is_quantized(key_cache):
        ops = native.kernels()
        if ops is not None:  # quantized in one pass over the new tokens
            ops.write_kv_slots(key.float(), value.float(), key_cache, value_cache, slot_mapping, key_scale, value_scale)
            return
    write_kv_cache_torch(key, value, key_cache, value_cache, slot_mapping, key_scale, value_scale)


def write_kv_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """write_kv_cache in torch ops only: any device."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    for new, cache, scale in ((key, key_cache, key_scale), (value, value_cache, value_scale)):
        if new.dtype != cache.dtype:  # a bf16 cache under float32 compute, or a quantized cache
            new, new_scale = quantize(new, cache.dtype, scale.shape[-1] if scale is not None else 1)
            if scale is not None:
                scale.view(-1, num_kv_heads, scale.shape[-1]).index_copy_(0, slot_mapping, new_scale)
        as_bits(cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, as_bits(new))


def decode_mask(seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:  # [B, 1, 1, max_len] bool
    return (torch.arange(max_len)[None, :] < seq_lens[:, None]).view(seq_lens.shape[0], 1, 1, max_len)


def _softcap_attention(
    q: torch.Tensor,  # [B, num_kv_heads, group, T, D]
    k: torch.Tensor,  # [B, num_kv_heads, S, D]
    v: torch.Tensor,
    mask: torch.Tensor,  # bool, broadcastable to [B, num_kv_heads, group, T, S]
    scale: float,
    soft_cap: float | None,
    sinks: torch.Tensor | None = None,  # [num_heads] logits
) -> torch.Tensor:  # [B, num_kv_heads, group, T, D]
    # SDPA has no hook between the scores and the softmax: spelled out, as transformers' eager path.
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        # An attention sink (gpt-oss): one more logit per head in the softmax's denominator, attending to
        # nothing; its probability is dropped, so a head may attend to less than all of its keys.
        sink = sinks.to(scores.dtype).view(1, q.shape[1], q.shape[2], 1, 1).expand(*scores.shape[:-1], 1)
        combined = torch.cat((scores, sink), dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v.unsqueeze(2))


def paged_decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim], one query token per sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    seq_lens: torch.Tensor,  # [B] int64, tokens to attend to (including the query's own)
    scale: float,
    mask: torch.Tensor | None = None,  # decode_mask(...) of the same step, to build it once for all layers
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    key_scale: torch.Tensor | None = None,  # quantized cache: the scales beside the blocks
    value_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] sink logits (gpt-oss)
) -> torch.Tensor:  # [B, num_heads, head_dim]
    ops = native.kernels()
    if ops is not None:
        # Reads K/V in place through the block table (a quantized cache dequantized in registers): no
        # gathered copy, no mask.
        out = ops.paged_decode_attention(
            query.float(), key_cache, value_cache, block_tables, seq_lens, scale, sliding_window or 0,
            soft_cap or 0.0, key_scale, value_scale, None if sinks is None else sinks.float(),
            decode_bf16_products(key_cache.dtype),
        )  # fmt: skip
        return out.to(query.dtype)
    return paged_decode_attention_torch(
        query, key_cache, value_cache, block_tables, seq_lens, scale, mask, sliding_window, soft_cap, key_scale,
        value_scale, sinks,
    )  # fmt: skip


def paged_decode_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same from torch ops: gather the blocks into contiguous K/V (dequantized), then SDPA with a
    length mask (the softmax spelled out with a soft cap or attention sinks)."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    key = gather_blocks(key_cache, block_tables, query.dtype, key_scale)
    value = gather_blocks(value_cache, block_tables, query.dtype, value_scale)
    # The heads of one KV group become the "query length" axis: GQA without repeating K/V.
    q = query.view(batch, num_kv_heads, group, head_dim)
    if mask is None:
        mask = decode_mask(seq_lens, block_tables.shape[1] * key_cache.shape[1])
    if sliding_window is not None:
        # the query sits at position seq_len - 1: keys before seq_len - window fall out
        first = (seq_lens - sliding_window).view(batch, 1, 1, 1)
        mask = mask & (torch.arange(mask.shape[-1]) >= first)
    if soft_cap is not None or sinks is not None:
        out = _softcap_attention(q.unsqueeze(3), key, value, mask.unsqueeze(1), scale, soft_cap, sinks)
        return out.reshape(batch, num_heads, head_dim)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


DECODE_ATTENTION_MODES = ("auto", "bf16", "float32")


def decode_bf16_products(cache_dtype: torch.dtype) -> bool:
    """Whether the native decode kernel multiplies in bf16 (vdpbf16ps over a bf16 cache, queries and
    softmax weights rounded to bf16; AVX512-BF16 builds, else it keeps float32): where the CPU plan attends
    in bf16, as prefill does (_prefill_compute_dtype). PERFXLM_DECODE_ATTENTION=auto | bf16 | float32
    forces it either way. The fused decode layer asks here too, so a decode row has the same bits in
    either path (a speculative step's verification rows against plain decoding)."""
    if cache_dtype != torch.bfloat16:
        return False
    mode = os.environ.get("PERFXLM_DECODE_ATTENTION", "auto").strip().lower() or "auto"
    if mode not in DECODE_ATTENTION_MODES:
        raise ValueError(f"PERFXLM_DECODE_ATTENTION={mode!r}: expected one of {', '.join(DECODE_ATTENTION_MODES)}.")
    return mode == "bf16" or (mode == "auto" and cpu_plan.plan().gemm == "bf16")


def _prefill_compute_dtype(query_dtype: torch.dtype, cache_dtype: torch.dtype, bf16_model: bool) -> torch.dtype:
    """float32 activations of a bfloat16 model (over its bf16 or quantized KV cache): prefill attention
    runs in bf16 where the CPU plan uses the hardware's bf16 GEMM (AMX / AVX512-BF16 make SDPA's matmuls
    several times faster; a bf16 cache's keys are bf16 already, a quantized one's are dequantized
    straight to bf16), in float32 elsewhere and for float32 models."""
    bf16_model = bf16_model or cache_dtype == torch.bfloat16
    if query_dtype == torch.float32 and bf16_model and cpu_plan.plan().gemm == "bf16":
        return torch.bfloat16
    return query_dtype


def prefill_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim], the new tokens of one sequence
    key: torch.Tensor,  # [T, num_kv_heads, head_dim], their keys (also already in the cache)
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_blocks] int64
    num_context_tokens: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    key_scale: torch.Tensor | None = None,  # quantized cache: the scales beside the blocks
    value_scale: torch.Tensor | None = None,
    bf16_model: bool = False,  # a quantized cache of a bfloat16 model (see _prefill_compute_dtype)
    tiled: bool = True,  # False: prefill_attention_reference
    sinks: torch.Tensor | None = None,  # [num_heads] sink logits (gpt-oss)
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Causal attention of a sequence's new tokens: the native kernel where `prefill_kernel.applies`,
    else SDPA. With cached context before them, the cache is read tile by tile (`ops/prefill_tiles.py`):
    no copy of the whole context."""
    options_set = sliding_window is not None or soft_cap is not None or sinks is not None or key_scale is not None
    if tiled and prefill_kernel.applies(query, key_cache, num_context_tokens, options_set):
        ops = native.kernels()
        if ops is not None:
            context = num_context_tokens > 0
            # bf16 products (queries and softmax weights rounded) where the plan attends in bf16
            bf16_products = _prefill_compute_dtype(query.dtype, key_cache.dtype, bf16_model) == torch.bfloat16
            # new keys rounded as the cache holds them: the same rows as a later chunk reading them back
            return ops.prefill_attention_causal(
                query, key.to(key_cache.dtype), value.to(key_cache.dtype), key_cache if context else None,
                value_cache if context else None, block_table if context else None, num_context_tokens, scale,
                bf16_products,
            )  # fmt: skip
    compute = _prefill_compute_dtype(query.dtype, key_cache.dtype, bf16_model)
    if compute != query.dtype:  # bf16 attention on bf16 hardware, float32 result
        out = prefill_attention(
            query.to(compute), key.to(compute), value.to(compute), key_cache, value_cache, block_table,
            num_context_tokens, scale, sliding_window, soft_cap, key_scale, value_scale, bf16_model,
            tiled=tiled, sinks=sinks,
        )  # fmt: skip
        return out.to(query.dtype)
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
    if num_context_tokens > 0 and tiled and not fits_one_tile(num_context_tokens + query.shape[0], soft_cap):
        out = tiled_prefill_attention(
            q, key_cache, value_cache, block_table, num_context_tokens, scale, sliding_window, soft_cap,
            key_scale, value_scale, sinks=sinks,
        )  # fmt: skip
        return out[0].transpose(0, 1)
    if sinks is not None:
        if not tiled:  # the reference: the sink spelled out as one more softmax column
            return _prefill_attention_with_options(
                q, key, value, key_cache, value_cache, block_table, num_context_tokens, scale, sliding_window,
                soft_cap, key_scale, value_scale, sinks,
            )  # fmt: skip
        return _prefill_with_sinks(
            q, key, value, key_cache, value_cache, block_table, num_context_tokens, scale, sliding_window,
            soft_cap, key_scale, value_scale, sinks,
        )  # fmt: skip
    if sliding_window is not None or soft_cap is not None:
        return _prefill_attention_with_options(
            q, key, value, key_cache, value_cache, block_table, num_context_tokens, scale, sliding_window,
            soft_cap, key_scale, value_scale,
        )  # fmt: skip
    num_new = query.shape[0]
    if num_context_tokens == 0:
        k = key.transpose(0, 1).unsqueeze(0)
        v = value.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        total = num_context_tokens + num_new
        k = gather_blocks(key_cache, block_table[None], q.dtype, key_scale)[:, :, :total]
        v = gather_blocks(value_cache, block_table[None], q.dtype, value_scale)[:, :, :total]
        # New token i sits at absolute position num_context_tokens + i and sees keys up to it.
        rows = torch.arange(num_new)[:, None] + num_context_tokens
        mask = torch.arange(total)[None, :] <= rows
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


# The same over one gathered (dequantized) copy of the whole sequence and one masked SDPA: the plain-torch
# reference the tiled path is tested against.
prefill_attention_reference = functools.partial(prefill_attention, tiled=False)


def _prefill_with_sinks(
    q: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_context_tokens: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    key_scale: torch.Tensor | None,
    value_scale: torch.Tensor | None,
    sinks: torch.Tensor,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """A sequence that is one tile, with sinks: one flash call over its own K/V (a fresh prompt) or the
    gathered sequence, whose log-sum-exp gives each row's sink factor (`apply_sinks`)."""
    num_new = q.shape[2]
    if num_context_tokens == 0:
        k = key.transpose(0, 1).unsqueeze(0).contiguous()
        v = value.transpose(0, 1).unsqueeze(0).contiguous()
    else:
        total = num_context_tokens + num_new
        k = gather_tile(key_cache, block_table, 0, total, q.dtype, key_scale)
        v = gather_tile(value_cache, block_table, 0, total, q.dtype, value_scale)
    mask = None
    if num_context_tokens > 0 or sliding_window is not None:
        rows = torch.arange(num_new)[:, None] + num_context_tokens
        cols = torch.arange(k.shape[2])[None, :]
        mask = cols <= rows
        if sliding_window is not None:
            mask &= cols > rows - sliding_window
    out, lse = attention_tile(q.contiguous(), k, v, scale, soft_cap, mask=mask, causal=mask is None)
    return apply_sinks(out, lse, sinks)[0].transpose(0, 1)


def _prefill_attention_with_options(
    q: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_context_tokens: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    _, num_heads, num_new, head_dim = q.shape
    total = num_context_tokens + num_new
    if num_context_tokens == 0:
        k = key.transpose(0, 1).unsqueeze(0)
        v = value.transpose(0, 1).unsqueeze(0)
    else:
        k = gather_blocks(key_cache, block_table[None], q.dtype, key_scale)[:, :, :total]
        v = gather_blocks(value_cache, block_table[None], q.dtype, value_scale)[:, :, :total]
    rows = torch.arange(num_new)[:, None] + num_context_tokens
    cols = torch.arange(total)[None, :]
    mask = cols <= rows
    if sliding_window is not None:
        mask &= cols > rows - sliding_window
    if soft_cap is None and sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    num_kv_heads = k.shape[1]
    qg = q.view(1, num_kv_heads, num_heads // num_kv_heads, num_new, head_dim)
    out = _softcap_attention(qg, k, v, mask, scale, soft_cap, sinks)
    return out.view(num_heads, num_new, head_dim).transpose(0, 1)
