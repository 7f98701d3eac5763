"""Prefill attention over a paged KV cache, read tile by tile.

A chunk of new tokens with earlier context in the cache (a reused prefix, a chunked prompt) attends to
the whole sequence. Gathering the sequence into one contiguous K/V would copy (and, for an int8 / fp8
cache, dequantize) the whole context per layer and step; here the context is read in tiles of whole
blocks, each gathered and dequantized into a tile-sized buffer, and the tiles' partial results are
merged by their log-sum-exp as flash attention does:

    out = sum_i exp(lse_i - lse) * out_i,   lse = log(sum_i exp(lse_i))

so the extra memory is a tile and the chunk's float32 accumulator, whatever the context length.

Every tile, the new tokens' own included, is read from the cache (dequantized), as the gathered path
does: a later chunk then sees exactly the values decode will read, and both paths agree to rounding.
Context tiles lie wholly before every new token, so they need no causal mask; the new tokens' tile is
causal (the flash kernel's top-left `is_causal`: no mask tensor). A sliding window W
(a token at p sees (p - W, p]) skips the context before the first token's window, runs each context
tile only for the rows that see some of it (a leading run of rows, so no row is fully masked: the CPU
flash kernel reports log-sum-exp 0 for such a row, which the merge would count), and masks a tile only
where some of its columns fall out of a row's window. Soft-capped scores (Gemma 2) have no hook in
SDPA: those tiles are spelled out (scores, cap, mask, softmax statistics) on the same tiles. Attention
sinks (gpt-oss) scale the merged rows by their share against the sink, from the merged log-sum-exp.
"""

from __future__ import annotations

import torch

from perfxlm.ops.kv_quant import gather_blocks

# Context tokens per tile (rounded down to whole blocks, at least one). Measured with 512 new tokens
# after 3584 (docs/DESIGN.md): on 1B shapes (32 heads, 8 KV heads, head_dim 64) 2048 is ~5 % faster
# than 1024 (each tile's merge is a pass over the chunk's accumulator) for 4 MiB more. Soft-capped
# tiles materialize their scores [heads, new tokens, tile] in float32: 512 was fastest on Gemma 2 2B
# shapes (8 heads of 256; 2048: 1.7x slower, its scores out of cache).
TILE_TOKENS = 2048
SOFTCAP_TILE_TOKENS = 512

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def fits_one_tile(total_tokens: int, soft_cap: float | None) -> bool:
    """Whether a sequence of this many tokens (context + new) is one tile. Then the caller's single
    masked SDPA over the gathered sequence is used: a copy no larger than a tile, and rounded once, as a
    prompt computed in one piece is (merging tiles rounds each tile's bf16 output, then the sum: enough
    for a greedy token of a short chunked prompt to differ from the unchunked one)."""
    return total_tokens <= (TILE_TOKENS if soft_cap is None else SOFTCAP_TILE_TOKENS)


def gather_tile(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_blocks_of_sequence] int64
    start: int,
    end: int,
    dtype: torch.dtype,
    scale: torch.Tensor | None = None,  # quantized cache: [num_blocks, block_size, num_kv_heads, groups]
) -> torch.Tensor:  # [1, num_kv_heads, end - start, head_dim], in `dtype`
    """Tokens start .. end - 1 of a sequence: only the blocks holding them are copied and dequantized."""
    block_size = cache.shape[1]
    first = start // block_size
    blocks = gather_blocks(cache, block_table[None, first : -(-end // block_size)], dtype, scale)
    offset = first * block_size
    # heads second: the flash kernel runs ~6 % faster on contiguous K/V than on this strided view, for a
    # copy of one tile
    return blocks[:, :, start - offset : end - offset].contiguous()


def _softcap_tile(
    q: torch.Tensor,  # [1, H, n, D]
    k: torch.Tensor,  # [1, KVH, S, D]
    v: torch.Tensor,
    scale: float,
    soft_cap: float,
    mask: torch.Tensor | None,  # bool [n, S], True where visible; every row sees at least one column
) -> tuple[torch.Tensor, torch.Tensor]:  # out [1, H, n, D] (q's dtype), lse [1, H, n] float32
    _, num_heads, n, head_dim = q.shape
    num_kv_heads = k.shape[1]
    # the heads of a KV group share its K/V: a group axis instead of repeating K/V per head
    qg = q.reshape(num_kv_heads, num_heads // num_kv_heads, n, head_dim)
    scores = torch.matmul(qg, k[0].unsqueeze(1).transpose(-1, -2)) * scale
    scores = (torch.tanh(scores / soft_cap) * soft_cap).float()
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    probs = torch.exp(scores - peak)
    total = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs.to(q.dtype), v[0].unsqueeze(1)).float() / total
    lse = (peak + torch.log(total)).squeeze(-1)
    return out.view(1, num_heads, n, head_dim).to(q.dtype), lse.view(1, num_heads, n)


def attention_tile(
    q: torch.Tensor,  # [1, H, n, D]
    k: torch.Tensor,  # [1, KVH, S, D]
    v: torch.Tensor,
    scale: float,
    soft_cap: float | None,
    mask: torch.Tensor | None = None,  # bool [n, S], True where visible
    causal: bool = False,  # row i sees columns <= i (n == S)
) -> tuple[torch.Tensor, torch.Tensor]:
    if soft_cap is not None:
        if causal:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril_()
        return _softcap_tile(q, k, v, scale, soft_cap, mask)
    # The CPU flash kernel serves GQA itself (K/V heads shared by their group) and returns the
    # log-sum-exp the merge needs; it takes an additive mask in the query's dtype only.
    additive = None
    if mask is not None:
        additive = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
    return _flash(q, k, v, 0.0, causal, attn_mask=additive, scale=scale)


def apply_sinks(
    out: torch.Tensor,  # [1, H, T, D], each row normalised over its keys
    lse: torch.Tensor,  # [1, H, T] float32, the rows' log-sum-exp of scores
    sinks: torch.Tensor,  # [H] sink logits
) -> torch.Tensor:  # [1, H, T, D] in out's dtype
    """Attention sinks (gpt-oss) after the fact: the sink is one more logit in each row's softmax over no
    value, so the row's weights shrink by e^lse / (e^lse + e^sink) = sigmoid(lse - sink)."""
    keep = torch.sigmoid(lse - sinks.float().view(1, -1, 1)).unsqueeze(-1)
    return (out.float() * keep).to(out.dtype)


class _Merge:
    """Running flash-attention merge of tile results into a float32 accumulator [1, H, T, D]."""

    def __init__(self, out: torch.Tensor, lse: torch.Tensor):
        self.acc = out.float()  # the first tile covers every row (the new tokens' own tile)
        self.lse = lse.clone()

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        n = out.shape[2]  # a tile may cover a leading run of rows only (sliding window)
        acc, old = self.acc[:, :, :n], self.lse[:, :, :n]
        new = torch.logaddexp(old, lse)
        acc.mul_(torch.exp(old - new).unsqueeze(-1))
        acc.addcmul_(out, torch.exp(lse - new).unsqueeze(-1))  # widened to float32 on the fly, no copy
        old.copy_(new)


def tiled_prefill_attention(
    q: torch.Tensor,  # [1, H, T, D], the new tokens of one sequence, in the compute dtype
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_blocks] int64
    num_context_tokens: int,  # > 0; the new tokens' K/V are in the cache after them
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    tile_tokens: int | None = None,  # default: TILE_TOKENS (SOFTCAP_TILE_TOKENS with a soft cap)
    sinks: torch.Tensor | None = None,  # [H] sink logits (gpt-oss), applied to the merged result
) -> torch.Tensor:  # [1, H, T, D] in q's dtype
    q = q.contiguous()  # [T, H, D] transposed by the caller: one copy, faster tiles (see gather_tile)
    num_new = q.shape[2]
    ctx, total = num_context_tokens, num_context_tokens + num_new
    block_size = key_cache.shape[1]
    tile_tokens = tile_tokens or (TILE_TOKENS if soft_cap is None else SOFTCAP_TILE_TOKENS)
    tile = max(block_size, tile_tokens // block_size * block_size)

    def kv(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (gather_tile(key_cache, block_table, start, end, q.dtype, key_scale),
                gather_tile(value_cache, block_table, start, end, q.dtype, value_scale))  # fmt: skip

    # The new tokens' own tile: causal, and windowed only where the window is shorter than the chunk.
    k, v = kv(ctx, total)
    if sliding_window is not None and sliding_window < num_new:
        pos = torch.arange(num_new)
        diff = pos[:, None] - pos[None, :]
        merge = _Merge(*attention_tile(q, k, v, scale, soft_cap, mask=(diff >= 0) & (diff < sliding_window)))
    else:
        merge = _Merge(*attention_tile(q, k, v, scale, soft_cap, causal=True))
    del k, v
    # Context tiles. Without a window every new token sees all of them; with one, the first new token
    # (at ctx) sees nothing before ctx - W + 1.
    lo = 0 if sliding_window is None else max(0, ctx - sliding_window + 1)
    for start in range(lo // block_size * block_size, ctx, tile):
        a, b = max(start, lo), min(start + tile, ctx)
        if a >= b:  # a window of 1: the context is out of every row's sight (and an empty K crashes SDPA)
            continue
        mask = None
        rows = num_new
        if sliding_window is not None:
            # row r (position ctx + r) sees column c iff c > ctx + r - W: rows up to b - 2 + W - ctx see
            # the tile's last column, the rest see none of it
            rows = min(num_new, b - 1 + sliding_window - ctx)  # >= 1, as a >= lo
            if ctx + rows - 1 - sliding_window >= a:  # some row loses some of the tile's columns
                pos = torch.arange(ctx, ctx + rows)
                mask = torch.arange(a, b)[None, :] > (pos - sliding_window)[:, None]
        k, v = kv(a, b)
        merge.add(*attention_tile(q[:, :, :rows], k, v, scale, soft_cap, mask=mask))
    if sinks is not None:
        return apply_sinks(merge.acc, merge.lse, sinks).to(q.dtype)
    return merge.acc.to(q.dtype)
