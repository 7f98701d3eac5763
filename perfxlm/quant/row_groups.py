"""Row groups: a Q8_0 / Q4_0 weight's codes stored with the blocks of 8 consecutive rows together, the
layout the native `linear_q_rows8` GEMV reads (csrc/row_groups.h says why: one vpdpbusd's lanes are 8
rows, so per block one conversion and one FMA serve 8 rows and nothing is reduced per row).

For a `QuantizedWeight` of centred 8- or 4-bit codes with a float16 scale per 32 (`takes`):
- codes uint8 [G, K / 32, 8 B], G = ceil(N / 8), B = 32 (8-bit) or 16 (4-bit) bytes per row and block:
  per block the 8 rows' 4-byte quads as [quad][row][4 bytes] (a 4-bit quad's bytes are the plain
  layout's, GGUF's nibble order: low nibbles codes 4q.., high nibbles codes 16 + 4q..);
- scales float16 [G, K / 32, 8]; the last group's rows past N are zeros;
- an expert stack [E, N, K]: the same per expert, with the leading E (codes [E, G, K / 32, 8 B], scales
  [E, G, K / 32, 8]), so one expert's slice, or a run of its groups, is a matrix in row groups
  (csrc/moe_kernels.cpp runs the GEMV on runs of an expert's rows that start at multiples of 8).
`pack` and `unpack` move bytes only (each is the other's inverse); the product's plain-torch definition
is `perfxlm.quant.reference.block_reference_linear` (the plain layout's, on activations rounded to int8
blocks).

Affine 4-bit codes (GGUF Q4_1: value = scale x u + min, u in 0..15; `takes_affine`) take the same codes and
scales, and their float16 mins [G, K / 32, 8] as the scales are (`pack_params`): `CodeLayout.ROWS8_M`, the
`linear_q` layout 3 (csrc/row_groups_m.h).

A `QuantizedWeight` holds it as `CodeLayout.ROWS8` (perfxlm/quant/layouts.py; `w.in_row_groups()`,
`w.plain()`), chosen at load by the CPU plan's `row_groups` (`layout_choice.choose_layouts`).
Its products always round the activations to int8 blocks of 32 (the kernel's scheme on every build), so
only weights whose activations are rounded (not `ActivationMode.FLOAT`) take it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the weight imports this module (its layouts): no import at run time
    from perfxlm.quant.weight import QuantizedWeight

ROWS = 8
BLOCK = 32


def takes(w: "QuantizedWeight") -> bool:
    """Whether `w` has a row-group form: one 2-D matrix, or a stack of expert matrices [E, N, K] (each
    expert its own groups), of centred 8- or 4-bit codes (Q8_0, Q4_0, symmetric int8 / int4 at group 32),
    float16 scales, no table, columns in order."""
    return (w.codes.dim() in (2, 3) and w.bits in (8, 4) and w.group == BLOCK and w.mins is None
            and w.levels is None and w.scales.dtype == torch.float16 and w.input_order is None
            and w.act == "float" and w.in_features % BLOCK == 0)  # fmt: skip


def takes_affine(w: "QuantizedWeight") -> bool:
    """Whether `w` has the affine row-group form: one 2-D matrix of 4-bit codes with a float16 scale and min
    per 32 (GGUF Q4_1, asymmetric int4 at group 32), no table, columns in order."""
    return (w.codes.dim() == 2 and w.bits == 4 and w.group == BLOCK and w.mins is not None and w.levels is None
            and w.scales.dtype == torch.float16 and w.mins.dtype == torch.float16 and w.input_order is None
            and w.act == "float" and w.in_features % BLOCK == 0)  # fmt: skip


def pack_params(params: torch.Tensor) -> torch.Tensor:
    """Plain per-block params [..., N, K / 32] (scales or mins) -> [..., G, K / 32, 8], the padding rows zero
    (a stack's leading expert dimension kept)."""
    *lead, n, blocks = params.shape
    groups = -(-n // ROWS)
    p = torch.nn.functional.pad(params.reshape(-1, n, blocks), (0, 0, 0, groups * ROWS - n))
    return p.view(-1, groups, ROWS, blocks).permute(0, 1, 3, 2).reshape(*lead, groups, blocks, ROWS).contiguous()


def unpack_params(params8: torch.Tensor, n: int) -> torch.Tensor:
    """pack_params' inverse: the first `n` rows' params [..., n, K / 32]."""
    *lead, groups, blocks, _ = params8.shape
    p = params8.reshape(-1, groups, blocks, ROWS).permute(0, 1, 3, 2).reshape(-1, groups * ROWS, blocks)
    return p[:, :n].reshape(*lead, n, blocks).contiguous()


def _block_bytes(bits: int) -> int:
    return BLOCK if bits == 8 else BLOCK // 2


def pack(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain codes [..., N, K] (8-bit) or [..., N, K / 2] (4-bit) and float16 scales [..., N, K / 32] -> row
    groups [..., G, K / 32, 8 B] and [..., G, K / 32, 8] (a stack's leading expert dimension kept)."""
    lead, n, blocks = codes.shape[:-2], codes.shape[-2], scales.shape[-1]
    b = _block_bytes(bits)
    groups = -(-n // ROWS)
    pad = groups * ROWS - n
    c = torch.nn.functional.pad(codes.reshape(-1, n, blocks * b), (0, 0, 0, pad))
    # [lead, G, row, block, quad, 4] -> [lead, G, block, quad, row, 4]
    c = c.view(-1, groups, ROWS, blocks, b // 4, 4).permute(0, 1, 3, 4, 2, 5).reshape(*lead, groups, blocks, ROWS * b)
    return c.contiguous(), pack_params(scales)


def unpack(codes8: torch.Tensor, scales8: torch.Tensor, bits: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row groups -> the plain codes and scales of the first `n` rows (pack's inverse, stacks alike)."""
    lead, (groups, blocks, _) = codes8.shape[:-3], codes8.shape[-3:]
    b = _block_bytes(bits)
    c = codes8.reshape(-1, groups, blocks, b // 4, ROWS, 4).permute(0, 1, 4, 2, 3, 5).reshape(-1, groups * ROWS, blocks * b)
    return c[:, :n].reshape(*lead, n, blocks * b).contiguous(), unpack_params(scales8, n)
