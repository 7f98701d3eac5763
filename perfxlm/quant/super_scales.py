"""Two-level scales, as GGUF's K-quants hold them: a small integer per group, times a float16 per super-block of 256.

A weight's `scales` (and `mins`) are then bytes, one row per output row:
- the row's G sub-scales, one byte per group (uint8: Q4_K / Q5_K's 6-bit scales and mins; int8: Q6_K's
  signed scales),
- then its S = K / 256 super-block factors, float16 stored as byte pairs (little-endian, as the file).
A group's value is sub x factor computed in float32 (the product gguf-py forms: exact, 6-8 bits by 11), so a
4-bit row streams 2 + 2 x 2 / 8 bytes of scale and min per 32 weights (0.63 bits per weight) where two
float32 per group streamed 2 bits. Stored mins hold the factors of the mins' negations (a K-quant subtracts
dmin x m): a group's min is -(sub x factor).
Rows are self-contained, so row cuts, gathers, stacks and concatenations of one form move bytes as for any
other scales; a column cut falls on super-blocks.
"""

from __future__ import annotations

import torch

SUPER_BLOCK = 256  # weights per float16 factor
BYTE_DTYPES = (torch.uint8, torch.int8)


def is_super(t: torch.Tensor | None) -> bool:
    """Whether scales (or mins) `t` are in this two-level form (bytes, not floats)."""
    return t is not None and t.dtype in BYTE_DTYPES


def row_bytes(in_features: int, group: int) -> int:
    """Bytes per row of two-level scales for K inputs in groups of `group`: G sub-scales, 2 S factor bytes."""
    return in_features // group + 2 * (in_features // SUPER_BLOCK)


def split(t: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., G + 2 S] bytes -> (sub-scales [..., G] in t's dtype, factors float16 [..., S])."""
    factors = t[..., groups:].contiguous().view(torch.uint8).view(torch.float16)
    return t[..., :groups], factors


def join(sub: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """(sub-scales [..., G] uint8 / int8, factors float16 [..., S]) -> [..., G + 2 S] in sub's dtype."""
    tail = factors.to(torch.float16).contiguous().view(torch.uint8).view(sub.dtype)
    return torch.cat([sub, tail], dim=-1).contiguous()


def expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Two-level scales [..., G + 2 S] -> float32 [..., G]: sub x factor (one rounding, as gguf-py)."""
    sub, factors = split(t, groups)
    per = groups // factors.shape[-1]
    return sub.float().mul_(factors.float().repeat_interleave(per, dim=-1))


def narrow(t: torch.Tensor, groups: int, group: int, start: int, length: int) -> torch.Tensor:
    """Columns [start, start + length) of two-level scales (both on super-block boundaries)."""
    sub, factors = split(t, groups)
    return join(sub[..., start // group : (start + length) // group],
                factors[..., start // SUPER_BLOCK : (start + length) // SUPER_BLOCK])  # fmt: skip
