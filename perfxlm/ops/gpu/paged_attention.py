"""Paged attention in Triton over the engine's KV cache layout.

The same contract as `ops/attention.py` (the CPU paths), so an attention backend can swap one for the
other: K/V blocks `[num_blocks, block_size, num_kv_heads, head_dim]` read in place through a block table,
GQA served by one program per (sequence, KV head) for all of that head's query heads (each K/V row read
once, not G times), sliding window, soft-capping, and an int8 cache with one float scale per group of a
head's values (the scale is applied to the loaded tile, before the dot).

One kernel serves decode and prefill: a program owns BLOCK_M query rows of one sequence (a decode is a
sequence with one row) and walks its context BLOCK_N tokens at a time with an online softmax (flash
attention), so prefill over cached context never gathers the whole sequence.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _load_kv_tile(
    cache, scales, block_table_row, pos, valid, kv_head, d, d_mask,
    stride_block, stride_slot, stride_head, scale_stride_block, scale_stride_slot, scale_stride_head,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, QUANTIZED: tl.constexpr, HALF_DOT: tl.constexpr,
):  # fmt: skip
    """K or V rows at positions `pos` [BLOCK_N] of one KV head: [BLOCK_N, D], widened to float32 unless
    HALF_DOT (a 16-bit cache read as stored, for the tensor cores)."""
    block = tl.load(block_table_row + pos // BLOCK_SIZE, mask=valid, other=0)
    slot = pos % BLOCK_SIZE
    row = block.to(tl.int64) * stride_block + slot * stride_slot + kv_head * stride_head
    mask = valid[:, None] & d_mask[None, :]
    tile = tl.load(cache + row[:, None] + d[None, :], mask=mask, other=0.0)
    if not HALF_DOT:
        tile = tile.to(tl.float32)
    if QUANTIZED:
        srow = block.to(tl.int64) * scale_stride_block + slot * scale_stride_slot + kv_head * scale_stride_head
        scale = tl.load(scales + srow[:, None] + (d // GROUP)[None, :], mask=mask, other=0.0)
        tile = tile * scale
    return tile


@triton.jit
def _paged_attention_kernel(
    out, query, key_cache, value_cache, key_scale, value_scale,
    block_tables, query_start, query_pos0, seq_lens, tile_seq, tile_row0,
    sm_scale, soft_cap, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_block, stride_slot, stride_head,
    scale_stride_block, scale_stride_slot, scale_stride_head,
    head_dim, group_heads,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, QUANTIZED: tl.constexpr, SOFT_CAP: tl.constexpr, WINDOW: tl.constexpr,
    HALF_DOT: tl.constexpr,
):  # fmt: skip
    # Program (tile, kv_head): BLOCK_M rows = (query token, query head of this KV head) pairs, so a decode
    # row block holds the G heads of one token and a prefill block holds BLOCK_M // G tokens x G heads.
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq + tile)
    row0 = tl.load(tile_row0 + tile)  # first (token x head) row of this tile within its sequence
    q_start = tl.load(query_start + seq)
    num_q = tl.load(query_start + seq + 1) - q_start
    pos0 = tl.load(query_pos0 + seq)  # absolute position of the sequence's first query token
    seq_len = tl.load(seq_lens + seq)

    r = row0 + tl.arange(0, BLOCK_M)
    tok = r // group_heads
    head = kv_head * group_heads + r % group_heads
    row_valid = tok < num_q
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q_ptr = query + (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if HALF_DOT:  # a 16-bit query against a 16-bit cache: exact products, float32 sums, on the tensor cores
        q = q.to(key_cache.dtype.element_ty)
    else:
        q = q.to(tl.float32)
    q_pos = pos0 + tok  # [BLOCK_M]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_bt
    last = tl.minimum(pos0 + (row0 + BLOCK_M - 1) // group_heads, seq_len - 1)  # causal: no key past the tile
    first = 0
    if WINDOW:
        first = tl.maximum(pos0 + row0 // group_heads - window + 1, 0)
        first = (first // BLOCK_N) * BLOCK_N
    for n0 in range(first, last + 1, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos <= last
        k = _load_kv_tile(
            key_cache, key_scale, table, pos, valid, kv_head, d, d_mask, stride_block, stride_slot, stride_head,
            scale_stride_block, scale_stride_slot, scale_stride_head, BLOCK_SIZE, GROUP, QUANTIZED, HALF_DOT,
        )  # fmt: skip
        if HALF_DOT:
            s = tl.dot(q, tl.trans(k)) * sm_scale
        else:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        if SOFT_CAP:
            # c * tanh(s / c), tanh spelled with exp: 1 - 2 / (exp(2x) + 1) saturates cleanly at +-1
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
        keep = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW:
            keep = keep & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing kept yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(
            value_cache, value_scale, table, pos, valid, kv_head, d, d_mask, stride_block, stride_slot, stride_head,
            scale_stride_block, scale_stride_slot, scale_stride_head, BLOCK_SIZE, GROUP, QUANTIZED, HALF_DOT,
        )  # fmt: skip
        if HALF_DOT:  # the weights rounded to the cache's type, as flash attention does
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptr = out + (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr, acc.to(out.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


def _tiles(num_queries: list[int], group_heads: int, block_m: int) -> tuple[list[int], list[int]]:
    """(sequence, first row) of every BLOCK_M tile of (token x head) rows."""
    seqs: list[int] = []
    rows: list[int] = []
    for s, n in enumerate(num_queries):
        for r in range(0, n * group_heads, block_m):
            seqs.append(s)
            rows.append(r)
    return seqs, rows


@dataclass(frozen=True, slots=True)
class AttentionLaunch:
    """What one step's launch needs beyond the tensors of a layer, the same for every layer of the step
    (a backend builds it once per step: one host-to-device copy, not five per layer)."""

    block_m: int
    num_tokens: int
    num_tiles: int
    starts: torch.Tensor  # [num_seqs + 1] int32: each sequence's first query row
    pos0: torch.Tensor  # [num_seqs]: position of each sequence's first new token
    seq_lens: torch.Tensor  # [num_seqs]
    tile_seq: torch.Tensor  # [num_tiles]: the sequence of each BLOCK_M tile
    tile_row0: torch.Tensor  # [num_tiles]: its first (token x head) row


def decode_block_m(group_heads: int) -> int:
    """Rows of a tile when every sequence has one query token: tl.dot wants 16 or more; G heads need G."""
    return min(max(16, triton.next_power_of_2(group_heads)), 128)


def plan_launch(query_lens: list[int], seq_lens: list[int], group_heads: int, device: torch.device) -> AttentionLaunch:
    # rows of a tile: a decode of G heads needs G rows, a prefill more
    if max(query_lens) == 1:
        block_m = decode_block_m(group_heads)
    else:
        block_m = min(max(16, triton.next_power_of_2(4 * group_heads)), 128)
    tile_seq, tile_row0 = _tiles(query_lens, group_heads, block_m)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    pos0 = [s - n for s, n in zip(seq_lens, query_lens)]
    parts = (starts, pos0, list(seq_lens), tile_seq, tile_row0)
    packed = torch.tensor([x for part in parts for x in part], dtype=torch.int32).to(device, non_blocking=True)
    views, at = [], 0
    for part in parts:
        views.append(packed[at : at + len(part)])
        at += len(part)
    return AttentionLaunch(block_m, starts[-1], len(tile_seq), *views)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: every sequence's new tokens, back to back
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], this step's K/V written
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    query_lens: list[int],  # new tokens per sequence (1 for a decode)
    seq_lens: list[int],  # tokens each sequence attends to: its context + its new tokens
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    key_scale: torch.Tensor | None = None,  # int8 cache: [num_blocks, block_size, num_kv_heads, groups]
    value_scale: torch.Tensor | None = None,
    block_n: int | None = None,  # keys per step of a program's walk (default: 64 on the tensor cores, else 32)
    launch: AttentionLaunch | None = None,  # the step's plan_launch(query_lens, seq_lens, ...), else made here
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
    if key_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
        raise ValueError(f"paged_attention reads float, half, bfloat16 or int8 caches, got {key_cache.dtype}.")
    quantized = key_cache.dtype == torch.int8
    if quantized and key_scale is None:
        raise ValueError("an int8 KV cache needs its key_scale and value_scale tensors.")
    group_heads = num_heads // num_kv_heads
    if launch is None:
        launch = plan_launch(query_lens, seq_lens, group_heads, query.device)
    if launch.num_tokens != num_tokens:
        raise ValueError(f"query_lens sum to {launch.num_tokens} but the query has {num_tokens} tokens.")
    out = torch.empty_like(query)
    if not launch.num_tiles:
        return out
    groups = head_dim // key_scale.shape[-1] if quantized else head_dim
    # a float16 / bfloat16 cache under a query of the same type: both dots on the tensor cores (float32
    # models and int8 caches keep exact float32 dots)
    half_dot = key_cache.dtype in (torch.float16, torch.bfloat16) and query.dtype == key_cache.dtype
    if key_cache.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        half_dot = False  # the interpreter's numpy has no bfloat16: its bf16 dots come out as garbage
    if block_n is None:
        block_n = 64 if half_dot else 32
    dummy = key_cache  # an unused pointer argument where the cache carries no scales
    ks, vs = (key_scale, value_scale) if quantized else (dummy, dummy)
    sstrides = ks.stride()[:3] if quantized else (0, 0, 0)
    _paged_attention_kernel[(launch.num_tiles, num_kv_heads)](
        out, query, key_cache, value_cache, ks, vs,
        block_tables, launch.starts, launch.pos0, launch.seq_lens, launch.tile_seq, launch.tile_row0,
        float(scale), float(soft_cap or 0.0), int(sliding_window or 0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), *sstrides,
        head_dim, group_heads,
        BLOCK_SIZE=key_cache.shape[1], BLOCK_M=launch.block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), GROUP=groups, QUANTIZED=quantized,
        HALF_DOT=half_dot,
        SOFT_CAP=soft_cap is not None, WINDOW=sliding_window is not None,
    )  # fmt: skip
    return out
