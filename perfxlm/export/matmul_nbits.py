"""Quantized weights as ONNX Runtime's MatMulNBits reads them.

The engine's form is w = scale * u + min per group of `group` weights along K, 4-bit codes in GGUF
Q4_0's nibble order. MatMulNBits computes w = (u - zero_point) * scale per block of `block_size` (a power
of two, at least 16) with B [N, K / block, block * bits / 8], consecutive elements in a byte's low then
high nibble. So codes are re-packed (never re-quantized), a group becomes group / block blocks sharing
its scale, and the min becomes a zero point: an integer code where min = -scale * z exactly (Q4_0,
symmetric int4 / int8: packed uint8, exact), else -min / scale as a float zero point (asymmetric groups:
one extra rounding per weight, ~1e-7 relative).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perfxlm.quant.weight import QuantizedWeight

MIN_BLOCK, MAX_BLOCK = 16, 128


@dataclass
class PackedNBits:
    codes: np.ndarray  # uint8 [N, K / block, block * bits / 8]
    scales: np.ndarray  # float32 [N, K / block]
    zero_points: np.ndarray  # uint8 [N, ceil(K / block * bits / 8)] or float32 [N, K / block]
    block_size: int


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


def pack_matmul_nbits(w: QuantizedWeight) -> PackedNBits | None:
    """None where MatMulNBits cannot hold the weight unchanged (a lookup table such as NF4's, an
    expert stack, a group no power-of-two block divides, a zero scale with a nonzero min)."""
    if w.levels is not None or w.num_experts is not None or w.act != "float":
        return None
    block = block_size_for(w.group)
    if block is None:
        return None
    n, k, bits = w.out_features, w.in_features, w.bits
    repeat = w.group // block
    scales = w.scales.float().numpy().repeat(repeat, axis=1)  # [N, K / block]
    mins = w.mins.float().numpy().repeat(repeat, axis=1)
    if np.any((scales == 0) & (mins != 0)):
        return None
    u = w.unpacked_codes().numpy().reshape(n, k // block, block)
    codes = _pack_pairs(u) if bits == 4 else u.copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.where(scales == 0, 0.0, -mins / scales).astype(np.float32)
    integer = np.rint(zero)
    exact = (integer >= 0) & (integer < 2**bits) & (-scales * integer.astype(np.float32) == mins)
    if exact.all():
        z = integer.astype(np.uint8)
        if bits == 4:
            if z.shape[1] % 2:
                z = np.concatenate([z, np.zeros((n, 1), np.uint8)], axis=1)
            z = _pack_pairs(z)
        return PackedNBits(codes, scales.astype(np.float32), z, block)
    return PackedNBits(codes, scales.astype(np.float32), zero, block)
