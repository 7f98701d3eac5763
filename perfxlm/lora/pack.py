"""One decoder layer's adapters as the fused decode layer's LoRA kernel reads them: a single byte block.

The kernel (csrc/lora_kernels.cpp) used to take, per layer and step, 16 tensors (A, B^T, scale and column
table of each projection) and to rebuild each projection's segments from its column table at every
call. The block holds the same values, laid out once per content of the adapter slots (built at a layer's
first step after a repack, see slots.KernelOperands):

- a header of int64: magic, weight type, number of projections P, number of segments S; per projection
  (K, N, first segment, end segment); per segment (slot, rank, n0, n1, A offset, B offset, scale offset,
  0): a segment is one checkpoint module of one slot (q, k or v of a fused q|k|v), whose B rows add to
  the output columns [n0, n1) only;
- the segments' scales (float32, int8's row scales folded in);
- the weights, slot after slot, and within a slot projection after projection in the order the fused
  layer runs them (q|k|v, o, gate|up, down), each projection's A rows then its B^T rows over their own
  output columns only (no zero blocks beside a fused projection's parts).

So a batch-1 step with one adapter reads one contiguous region per layer, front to back, which the
hardware prefetchers follow, and the kernel can prefetch a projection's part while the base product runs.
Offsets are bytes from the block's start; every region starts on a 64-byte boundary.
"""

from __future__ import annotations

from typing import Sequence

import torch

MAGIC = 0x4C6F52410001  # "LoRA", format 1: the kernel refuses any other block
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2}  # uint8: int8 codes + 128
_ALIGN = 64
_SEGMENT_INTS = 8

# one projection's kernel operands: A [R, K], B^T [R, N] (both float32, bfloat16 or uint8), scale float32
# [R], cols int32 [R, 3] (each packed column's slot and the output columns [n0, n1) its B row covers);
# None where no adapter in the slots targets the projection
Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

EMPTY = torch.empty(0, dtype=torch.uint8)


def _segments(cols: torch.Tensor) -> list[tuple[int, int, int, int, int]]:
    """(slot, c0, c1, n0, n1) runs of consecutive columns of one slot covering the same outputs."""
    runs: list[list[int]] = []
    for c, (slot, n0, n1) in enumerate(cols.tolist()):
        if runs and runs[-1][0] == slot and runs[-1][2] == c and runs[-1][3:] == [n0, n1]:
            runs[-1][2] = c + 1
        elif n1 > n0:
            runs.append([slot, c, c + 1, n0, n1])
    return [tuple(r) for r in runs]  # type: ignore[misc]


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def pack_layer(projections: Sequence[Operands | None]) -> torch.Tensor:
    """The layer's block (uint8), or an empty tensor where no projection has an adapter."""
    present = [p for p in projections if p is not None and p[0].numel()]
    if not present:
        return EMPTY
    wtype = present[0][0].dtype
    if wtype not in WEIGHT_TYPES or any(p[0].dtype != wtype or p[1].dtype != wtype for p in present):
        raise ValueError(f"LoRA block: A and B^T must all be one of {list(WEIGHT_TYPES)}")
    # per projection its segments, and every slot that has one
    segs = [[] if p is None or not p[0].numel() else _segments(p[3]) for p in projections]
    slots = sorted({s[0] for per in segs for s in per})
    n_segments = sum(len(per) for per in segs)
    header_ints = 4 + 4 * len(projections) + _SEGMENT_INTS * n_segments
    scale_at = _aligned(8 * header_ints)
    n_scales = sum(s[2] - s[1] for per in segs for s in per)
    offset = _aligned(scale_at + 4 * n_scales)
    # weights slot-major: offsets first, then the bytes in the same order
    a_off: dict[tuple[int, int], int] = {}
    b_off: dict[tuple[int, int], int] = {}
    chunks: list[tuple[int, torch.Tensor]] = []
    for slot in slots:
        for p, per in enumerate(segs):
            mine = [(i, s) for i, s in enumerate(per) if s[0] == slot]
            if not mine:
                continue
            a, bt = projections[p][0], projections[p][1]  # type: ignore[index]
            offset = _aligned(offset)
            for i, (_, c0, c1, _, _) in mine:
                block = a[c0:c1].contiguous()
                a_off[p, i] = offset
                chunks.append((offset, block))
                offset += block.numel() * block.element_size()
            for i, (_, c0, c1, n0, n1) in mine:
                block = bt[c0:c1, n0:n1].contiguous()
                b_off[p, i] = offset
                chunks.append((offset, block))
                offset += block.numel() * block.element_size()
    out = torch.zeros(_aligned(offset), dtype=torch.uint8)
    header = torch.zeros(header_ints, dtype=torch.int64)
    header[:4] = torch.tensor([MAGIC, WEIGHT_TYPES[wtype], len(projections), n_segments])
    scales = torch.empty(n_scales, dtype=torch.float32)
    rows, first, scale_pos = [], 0, 0
    for p, per in enumerate(segs):
        op = projections[p]
        K = 0 if op is None or not op[0].numel() else op[0].shape[1]
        N = 0 if op is None or not op[0].numel() else op[1].shape[1]
        header[4 + 4 * p : 8 + 4 * p] = torch.tensor([K, N, first, first + len(per)])
        first += len(per)
        for i, (slot, c0, c1, n0, n1) in enumerate(per):
            scales[scale_pos : scale_pos + c1 - c0] = op[2][c0:c1]  # type: ignore[index]
            rows.append([slot, c1 - c0, n0, n1, a_off[p, i], b_off[p, i], scale_at + 4 * scale_pos, 0])
            scale_pos += c1 - c0
    if rows:
        header[4 + 4 * len(projections) :] = torch.tensor(rows, dtype=torch.int64).flatten()
    out[: 8 * header_ints] = header.view(torch.uint8)
    out[scale_at : scale_at + 4 * n_scales] = scales.view(torch.uint8)
    for at, block in chunks:
        flat = block.reshape(-1).view(torch.uint8)
        out[at : at + flat.numel()] = flat
    return out
