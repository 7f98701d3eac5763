"""Quantized weights as ONNX Runtime's MatMulNBits reads them.

The engine's form is w = scale * u + min per group of `group` weights along K, 4-bit codes in GGUF
Q4_0's nibble order. MatMulNBits computes w = (u - zero_point) * scale per block of `block_size` (a power
of two, at least 16) with B [N, K / block, block * bits / 8], consecutive elements in a byte's low then
high nibble. So codes are re-packed (never re-quantized), a group becomes group / block blocks sharing
its scale, and the min becomes a zero point: an integer code where min = -scale * z exactly (Q4_0,
symmetric int4 / int8: packed uint8, exact). Other mins (Q4_1, asymmetric int4) are not a code: ONNX
Runtime takes float zero points only on a path that dequantizes the whole weight at every call (~10x
slower than its packed kernel, measured), so those weights get the middle code as zero point and the rest,
min + scale * middle per block, as `offsets`: w = scale * (u - middle) + offset, the offset term of a
product being (sum of the block's activations) x offset, one small float matmul of K / block inputs.

A level table is no affine form, but one of small integers is one after a widening: MXFP4's (gpt-oss's
experts: E2M1 values doubled, -12..12, times a power of two per 32 weights) becomes 8-bit codes
level + 128 with zero point 128 and the E8M0 scale as a float32 block scale, the same values exactly
(ONNX Runtime has no FP4 op; its MatMulBnb4's FP4 table is bitsandbytes', not E2M1: 0.0052 where E2M1
has 0.5 / 6). 8 bits and a float32 scale per 32 weights: 2.1x the MXFP4 bytes, a quarter of float32.
A table of other values (NF4's, FP8 bytes') is written as float by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from perfxlm.quant.weight import QuantizedWeight

MIN_BLOCK, MAX_BLOCK = 16, 128


@dataclass
class PackedNBits:
    codes: np.ndarray  # uint8 [N, K / block, block * bits / 8]
    scales: np.ndarray  # float32 [N, K / block]
    zero_points: np.ndarray  # uint8 [N, ceil(K / block * bits / 8)]
    block_size: int
    bits: int  # 4 or 8 (5-bit codes are stored as 8-bit ones)
    offsets: np.ndarray | None = None  # float32 [N, K / block], added per block (mins that are no code)


def block_size_for(group: int) -> int | None:
    """The largest power of two in [16, 128] dividing the group, or None."""
    block = MAX_BLOCK
    while block >= MIN_BLOCK:
        if group % block == 0:
            return block
        block //= 2
    return None


def _pack_pairs(values: np.ndarray) -> np.ndarray:
    """[..., 2m] values < 16 -> [..., m] bytes, element 2j in the low nibble, 2j + 1 in the high."""
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def integer_levels_as_codes(w: QuantizedWeight) -> QuantizedWeight | None:
    """A weight on a table of integer levels within int8 (MXFP4's) as centred 8-bit codes level + 128 with
    one float32 scale per group: the same values, an affine form; None for any other table."""
    levels = w.levels
    if not bool(torch.isfinite(levels).all()) or not bool((levels == levels.round()).all()):
        return None
    if float(levels.min()) < -128 or float(levels.max()) > 127:
        return None
    codes = (levels.index_select(0, w.unpacked_codes().reshape(-1).int()) + 128).to(torch.uint8)
    return QuantizedWeight(codes.view(*w.codes.shape[:-1], w.in_features), w.float_scales().contiguous(), None,
                           None, 8, w.group, w.act, w.out_features, w.in_features, input_order=w.input_order)


def pack_matmul_nbits(w: QuantizedWeight) -> PackedNBits | None:
    """None where MatMulNBits cannot hold the weight unchanged (a table of levels other than small
    integers, such as NF4's; an expert stack; a group no power-of-two block divides). The codes stay in
    their columns' order: an act-order weight's product takes x[..., input_order] (the caller gathers)."""
    if w.num_experts is not None or w.act != "float":
        return None
    if w.levels is not None:
        w = integer_levels_as_codes(w)
        if w is None:
            return None
    w = w.flat()  # GGUF K-quants' two-level scales: one float32 scale (and min) per group, as MatMulNBits holds
    block = block_size_for(w.group)
    if block is None:
        return None
    if w.bits in (5, 6):  # (Q5_0 / Q6_K's forms, mixed precision's int4) MatMulNBits packs 4 or 8 bits: the same values as 8
        w = w.widened(8)
    n, k, bits = w.out_features, w.in_features, w.bits
    repeat = w.group // block
    scales = w.scales.float().numpy().repeat(repeat, axis=1)  # [N, K / block]
    mins = w.full_mins().numpy().repeat(repeat, axis=1)
    u = w.unpacked_codes().numpy().reshape(n, k // block, block)
    codes = _pack_pairs(u) if bits == 4 else u.copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        integer = np.rint(np.where(scales == 0, 0.0, -mins / scales))
    exact = (integer >= 0) & (integer < 2**bits) & (-scales * integer.astype(np.float32) == mins)
    offsets = None
    if not exact.all():
        middle = 2 ** (bits - 1)
        integer = np.full(scales.shape, middle)
        offsets = (mins + scales * np.float32(middle)).astype(np.float32)
    z = integer.astype(np.uint8)
    if bits == 4:
        if z.shape[1] % 2:
            z = np.concatenate([z, np.zeros((n, 1), np.uint8)], axis=1)
        z = _pack_pairs(z)
    return PackedNBits(codes, scales.astype(np.float32), z, block, bits, offsets)
