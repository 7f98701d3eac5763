"""How quantized codes are laid out in memory: 4-bit codes as nibbles in Q4_0's order (lo nibbles the first
16 values of a block of 32, hi nibbles the next 16), 5- and 6-bit codes as those nibbles followed by one
bit plane per extra bit (element 8b + i at bit i of byte b), 8-bit codes one byte each. The native kernels
read these layouts; `QuantizedWeight` holds them."""

from __future__ import annotations

import torch

BLOCK4 = 32  # elements per nibble block of 4-, 5- and 6-bit codes (GGUF Q4_0's)


def unpack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [..., K // 2] -> one uint8 per element [..., K] (values 0..15)."""
    lead = codes.shape[:-1]
    blocks = codes.reshape(*lead, -1, BLOCK4 // 2)
    out = torch.empty(*blocks.shape[:-1], BLOCK4, dtype=torch.uint8)
    torch.bitwise_and(blocks, 0x0F, out=out[..., : BLOCK4 // 2])
    torch.bitwise_right_shift(blocks, 4, out=out[..., BLOCK4 // 2 :])
    return out.reshape(*lead, -1)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 values 0..15 (K a multiple of 32) -> 4-bit codes [..., K // 2] in Q4_0's layout."""
    lead = values.shape[:-1]
    v = values.reshape(*lead, -1, 2, BLOCK4 // 2)
    return (v[..., 0, :] | (v[..., 1, :] << 4)).reshape(*lead, -1).contiguous()


def _bit_plane(values: torch.Tensor, bit: int) -> torch.Tensor:
    """[..., K] uint8 -> [..., K // 8]: bit `bit` of each value, element 8b + i at bit i of byte b."""
    lead, k = values.shape[:-1], values.shape[-1]
    high = ((values >> bit) & 1).reshape(*lead, k // 8, 8)
    plane = high[..., 0].clone()
    for i in range(1, 8):  # uint8 shifts and ors: a fifth of the time of a weighted int32 sum (measured)
        plane.bitwise_or_(high[..., i] << i)
    return plane


def _plane_bits(plane: torch.Tensor) -> torch.Tensor:
    """A bit plane [..., K // 8] -> its bits, one uint8 (0 or 1) per element [..., K]."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return torch.bitwise_and(torch.bitwise_right_shift(plane.unsqueeze(-1), shifts), 1).reshape(*plane.shape[:-1], -1)


def pack_fives(values: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 values 0..31 (K a multiple of 32) -> 5-bit codes [..., 5 K // 8]: the low four bits
    in Q4_0's nibble layout, then the plane of fifth bits."""
    return torch.cat([pack_nibbles(values & 0x0F), _bit_plane(values, 4)], dim=-1).contiguous()


def pack_sixes(values: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 values 0..63 (K a multiple of 32) -> 6-bit codes [..., 3 K // 4]: the 5-bit layout of
    the low five bits, then the plane of sixth bits."""
    return torch.cat([pack_fives(values & 0x1F), _bit_plane(values, 5)], dim=-1).contiguous()


def unpack_fives(codes: torch.Tensor) -> torch.Tensor:
    """5-bit codes [..., 5 K // 8] -> one uint8 per element [..., K] (values 0..31)."""
    k = codes.shape[-1] * 8 // 5
    low = unpack_nibbles(codes[..., : k // 2].contiguous())
    return low | (_plane_bits(codes[..., k // 2 :]) << 4)


def unpack_sixes(codes: torch.Tensor) -> torch.Tensor:
    """6-bit codes [..., 3 K // 4] -> one uint8 per element [..., K] (values 0..63)."""
    k = codes.shape[-1] * 4 // 3
    low = unpack_fives(codes[..., : 5 * k // 8].contiguous())
    return low | (_plane_bits(codes[..., 5 * k // 8 :]) << 5)


def pack_codes(values: torch.Tensor, bits: int) -> torch.Tensor:
    """One uint8 code per weight [..., K] -> the stored layout for `bits`."""
    if bits == 4:
        return pack_nibbles(values)
    if bits == 5:
        return pack_fives(values)
    if bits == 6:
        return pack_sixes(values)
    return values.contiguous()
