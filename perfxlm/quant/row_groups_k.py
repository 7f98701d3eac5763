"""Row groups for GGUF K-quants: a Q4_K, Q5_K or Q6_K weight's codes and two-level scales stored with the blocks of
8 consecutive rows together, the layout the native `linear_q_rows8_k` GEMV reads (csrc/row_groups_k.h says
why; perfxlm/quant/row_groups.py is the same idea for Q8_0 / Q4_0).

From the `QuantizedWeight` form GGUF loading gives (`gguf_repack`): Q4_K (Q5_K) as 4-bit (5-bit) codes at
groups of 32 with two-level uint8 scales and mins, Q6_K as centred 6-bit codes at groups of 16 with two-level int8 scales
(`super_scales`). G = ceil(N / 8) groups of 8 rows, S = K / 256 super-blocks; the last group's rows past N
are zeros.
- codes uint8 [G, K / 32, 8 x B]: per block of 32, first the 8 rows' low nibbles as Q4_0's row groups hold
  them ([quad l][row][4 bytes], byte j of quad l: code 4l + j in its low nibble, code 16 + 4l + j in its
  high one: 128 bytes); Q5_K (B = 20) then one 32-byte word of fifth bits: byte 4 r + j holds row r's
  code 4l + j's at bit l and code 16 + 4l + j's at bit 4 + l; Q6_K (B = 24) then two 32-byte words of high bits, H0 for codes 0..15 and H1 for
  16..31: byte 4 r + j of H_h holds at bits 2l, 2l + 1 bits 4-5 of row r's code 16 h + 4l + j (the
  nibble byte's position, so one shift and one and put a quad's high bits under its nibbles);
- params uint8 [G, S, P] per super-block: Q4_K and Q5_K (P = 160) the sub-scales [8 blocks][8 rows], the sub-mins
  alike, then d and dmin, float16 [8 rows] each; Q6_K (P = 144) the int8 sub-scales [16 groups][8 rows],
  then d, float16 [8 rows].
All are the loaded form's bytes moved (4.625, 5.625 and 6.5625 bits per weight, as held now); `pack` and
`unpack` are each other's inverses. The product's plain-torch definition is
`perfxlm.quant.reference.block_reference_linear` (x rounded to int8 blocks of 32, times the plain weight).
A `QuantizedWeight` holds it as `CodeLayout.ROWS8_K` (perfxlm/quant/layouts.py; codes as above, `scales`
the params bytes, `mins` None), so this module imports the weight's type for annotations only. Many-row
products read it through the int8 GEMM (csrc/quant_gemm.cpp, layout 2), whose panels built from the groups
are the plain layout's bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from perfxlm.quant import super_scales
from perfxlm.quant.code_layout import pack_fives, pack_nibbles, pack_sixes, unpack_fives, unpack_nibbles, unpack_sixes

if TYPE_CHECKING:  # the weight imports this module (its layouts): no import at run time
    from perfxlm.quant.weight import QuantizedWeight

ROWS = 8
BLOCK = 32
SB = super_scales.SUPER_BLOCK
FORMATS = {"q4_k": 4, "q5_k": 5, "q6_k": 6}  # format -> the `bits` the native op takes
FORMAT_OF_BITS = {b: f for f, b in FORMATS.items()}
CODE_BYTES = {4: 16, 5: 20, 6: 24}  # per row and block of 32
PARAM_BYTES = {4: 160, 5: 160, 6: 144}  # per 8 rows and super-block


def takes(w: "QuantizedWeight") -> str | None:
    """Which row-group form `w` has: "q4_k" / "q5_k" (4- / 5-bit codes, groups of 32, two-level uint8
    scales and mins), "q6_k" (centred 6-bit codes, groups of 16, two-level int8 scales), or None."""
    if (w.codes.dim() != 2 or w.levels is not None or w.input_order is not None or w.act != "float"
            or not super_scales.is_super(w.scales) or w.in_features % SB):  # fmt: skip
        return None
    if w.bits in (4, 5) and w.group == 32 and w.scales.dtype == torch.uint8 and super_scales.is_super(w.mins):
        return f"q{w.bits}_k"
    if w.bits == 6 and w.group == 16 and w.scales.dtype == torch.int8 and w.mins is None:
        return "q6_k"
    return None


def _interleave(values: torch.Tensor, groups: int) -> torch.Tensor:
    """[G x 8, blocks, Q, 4] per row -> [G, blocks, Q, 8, 4]: a block's quads, each with the 8 rows' bytes."""
    _, blocks, quads, _ = values.shape
    return values.view(groups, ROWS, blocks, quads, 4).permute(0, 2, 3, 1, 4)


def _deinterleave(grouped: torch.Tensor) -> torch.Tensor:
    """`_interleave` undone: [G, blocks, Q, 8, 4] -> [G x 8, blocks, Q, 4]."""
    g, blocks, quads, _, _ = grouped.shape
    return grouped.permute(0, 3, 1, 2, 4).reshape(g * ROWS, blocks, quads, 4)


def _high_words(u: torch.Tensor, groups: int) -> torch.Tensor:
    """Codes u [G x 8, K] (0..63) -> the high-bit words [G, blocks, 2, 8, 4] (the module's H0 / H1)."""
    hi = (u >> 4).view(groups * ROWS, -1, 2, 4, 4)  # [row, block, h, l, j]: code 16 h + 4 l + j
    word = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)  # [row, block, h, j]
    return word.view(groups, ROWS, -1, 2, 4).permute(0, 2, 3, 1, 4)


def _from_high_words(words: torch.Tensor) -> torch.Tensor:
    """`_high_words` undone: [G, blocks, 2, 8, 4] -> bits 4-5 of each code [G x 8, K]."""
    g, blocks = words.shape[:2]
    w = words.permute(0, 3, 1, 2, 4)  # [G, row, block, h, j]
    hi = torch.stack([(w >> (2 * l)) & 3 for l in range(4)], dim=-2)  # [G, row, block, h, l, j]
    return hi.reshape(g * ROWS, blocks * BLOCK) << 4


def _fifth_words(u: torch.Tensor, groups: int) -> torch.Tensor:
    """Codes u [G x 8, K] (0..31) -> the fifth-bit words [G, blocks, 8, 4] (the module's Q5_K word)."""
    bit = ((u >> 4) & 1).view(groups * ROWS, -1, 2, 4, 4)  # [row, block, h, l, j]: code 16 h + 4 l + j
    word = torch.zeros_like(bit[:, :, 0, 0])
    for h in range(2):
        for l in range(4):
            word |= bit[:, :, h, l] << (4 * h + l)
    return word.view(groups, ROWS, -1, 4).permute(0, 2, 1, 3)


def _from_fifth_words(words: torch.Tensor) -> torch.Tensor:
    """`_fifth_words` undone: [G, blocks, 8, 4] -> bit 4 of each code [G x 8, K]."""
    g, blocks = words.shape[:2]
    w = words.permute(0, 2, 1, 3)  # [G, row, block, j]
    bits = torch.stack([torch.stack([(w >> (4 * h + l)) & 1 for l in range(4)], dim=-2) for h in range(2)], dim=-3)
    return bits.reshape(g * ROWS, blocks * BLOCK) << 4


def _param_block(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """Per-row values [G x 8, S, c_i, size_i] (bytes: size 1 for sub-bytes, 2 for a float16) -> [G, S, P]:
    each part as [value][row][its bytes]."""
    cols = [p.view(groups, ROWS, *p.shape[1:]).permute(0, 2, 3, 1, 4).reshape(groups, p.shape[1], -1) for p in parts]
    return torch.cat(cols, dim=-1).contiguous()


def _param_columns(params: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """`_param_block` undone: [G, S, P] -> per-row values [G x 8, S, c_i x size_i] for shapes (c_i, size_i)."""
    g, s, _ = params.shape
    out, at = [], 0
    for c, size in shapes:
        part = params[:, :, at : at + c * ROWS * size].reshape(g, s, c, ROWS, size)
        out.append(part.permute(0, 3, 1, 2, 4).reshape(g * ROWS, s, c * size))
        at += c * ROWS * size
    return out


def _split_two_level(t: torch.Tensor, groups_per_row: int, supers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-level bytes [R, G + 2 S] -> (sub bytes as uint8 [R, S, G / S, 1], factor bytes [R, S, 1, 2])."""
    r = t.shape[0]
    raw = t.contiguous().view(torch.uint8)
    return raw[:, :groups_per_row].reshape(r, supers, -1, 1), raw[:, groups_per_row:].reshape(r, supers, 1, 2)


def pack(w: "QuantizedWeight") -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_K / Q5_K / Q6_K weight as loaded (`takes`) -> (codes [G, K / 32, 8 B], params [G, S, P]) uint8."""
    fmt = takes(w)
    if fmt is None:
        raise ValueError("row_groups_k.pack: not a Q4_K, Q5_K or Q6_K weight in its loaded form")
    n, k = w.out_features, w.in_features
    groups, blocks, supers = -(-n // ROWS), k // BLOCK, k // SB
    pad = groups * ROWS - n

    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0, 0, pad))

    if fmt in ("q4_k", "q5_k"):
        if fmt == "q4_k":
            nib = rows(w.codes.view(torch.uint8)).view(groups * ROWS, blocks, 4, 4)
            codes = _interleave(nib, groups).reshape(groups, blocks, ROWS * 16)
        else:
            u = rows(unpack_fives(w.codes))
            nib = pack_nibbles(u & 15).view(groups * ROWS, blocks, 4, 4)
            low = _interleave(nib, groups).reshape(groups, blocks, ROWS * 16)
            codes = torch.cat([low, _fifth_words(u, groups).reshape(groups, blocks, ROWS * 4)], dim=-1)
        sc, d = _split_two_level(rows(w.scales), k // 32, supers)
        mn, dmin = _split_two_level(rows(w.mins), k // 32, supers)
        params = _param_block([sc, mn, d, dmin], groups)
    else:
        u = rows(unpack_sixes(w.codes))
        nib = pack_nibbles(u & 15).view(groups * ROWS, blocks, 4, 4)
        low = _interleave(nib, groups).reshape(groups, blocks, ROWS * 16)
        high = _high_words(u, groups).reshape(groups, blocks, ROWS * 8)
        codes = torch.cat([low, high], dim=-1)
        sc, d = _split_two_level(rows(w.scales), k // 16, supers)
        params = _param_block([sc, d], groups)
    return codes.contiguous(), params


def unpack(codes: torch.Tensor, params: torch.Tensor, fmt: str, n: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`pack` undone: the loaded form's (codes, scales, mins) of the first `n` rows (the weight's `bits`
    and `group` are the format's: 4 / 5 at 32, 6 at 16)."""
    groups, blocks, _ = codes.shape
    k = blocks * BLOCK
    nib = _deinterleave(codes[:, :, : ROWS * 16].reshape(groups, blocks, 4, ROWS, 4)).reshape(groups * ROWS, k // 2)[:n]
    if fmt in ("q4_k", "q5_k"):
        sc, mn, d, dmin = (c[:n].reshape(n, -1) for c in _param_columns(params, [(8, 1), (8, 1), (1, 2), (1, 2)]))
        scales = torch.cat([sc, d], dim=1).contiguous()
        mins = torch.cat([mn, dmin], dim=1).contiguous()
        if fmt == "q4_k":
            return nib.contiguous(), scales, mins
        fifth = _from_fifth_words(codes[:, :, ROWS * 16 :].reshape(groups, blocks, ROWS, 4))[:n]
        u = unpack_nibbles(nib.contiguous()) | fifth
        return pack_fives(u), scales, mins
    if fmt != "q6_k":
        raise ValueError(f"row_groups_k.unpack: unknown format {fmt!r}")
    high = _from_high_words(codes[:, :, ROWS * 16 :].reshape(groups, blocks, 2, ROWS, 4))[:n]
    u = unpack_nibbles(nib.contiguous()) | high
    sc, d = (c[:n].reshape(n, -1) for c in _param_columns(params, [(16, 1), (1, 2)]))
    scales = torch.cat([sc, d], dim=1).contiguous().view(torch.int8)
    return pack_sixes(u), scales, None
