"""How quantized codes are laid out in memory: 4-bit codes as nibbles in Q4_0's order (lo nibbles the first
16 values of a block of 32, hi nibbles the next 16), 5- and 6-bit codes as those nibbles followed by one
bit plane per extra bit, 8-bit codes one byte each. The native kernels read these layouts;
`QuantizedWeight` holds them.

A bit plane holds 4 bytes per block of 32 elements, read as one little-endian word; element e of the
block is at bit `PLANE_BIT[e]`: element 4j + b of the lo nibbles (e < 16) at bit 8b + 3 - j, element
16 + 4j + b (the hi nibbles) at bit 8b + 4 + j. Not GGUF Q5_0's order (bit e): in this one, the word
broadcast to 32-bit lanes and lane j shifted left by j + 1 (lo nibbles) or right by j (hi nibbles) puts
each of the lane's four elements' bits at bit 4 of its own byte, where the nibble wants it: a shift, an
and and an or per 32 codes on AVX2 (the natural order takes a byte shuffle, an and, a compare, an and
and an or), and one rotate on AVX-512 for both halves. GGUF's words are permuted once at load
(`plane_from_words`)."""

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


# element e of a block of 32 -> its bit in the block's plane word (the module's docstring), and back
PLANE_BIT = tuple(8 * (e % 4) + (3 - e // 4 if e < 16 else 4 + (e - 16) // 4) for e in range(BLOCK4))
_PLANE_BIT = torch.tensor(PLANE_BIT, dtype=torch.long)
_BIT_ELEMENT = torch.argsort(_PLANE_BIT)


def _in_plane_order(bits: torch.Tensor) -> torch.Tensor:
    """[..., K] one value per element -> the same values in plane order (position p of a block of 32
    holds its element at plane bit p)."""
    lead, k = bits.shape[:-1], bits.shape[-1]
    return bits.reshape(*lead, k // BLOCK4, BLOCK4)[..., _BIT_ELEMENT].reshape(*lead, k)


def _in_element_order(bits: torch.Tensor) -> torch.Tensor:
    """`_in_plane_order` undone."""
    lead, k = bits.shape[:-1], bits.shape[-1]
    return bits.reshape(*lead, k // BLOCK4, BLOCK4)[..., _PLANE_BIT].reshape(*lead, k)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 0 / 1 -> [..., K // 8]: position 8b + i at bit i of byte b."""
    lead, k = bits.shape[:-1], bits.shape[-1]
    high = bits.reshape(*lead, k // 8, 8)
    plane = high[..., 0].clone()
    for i in range(1, 8):  # uint8 shifts and ors: a fifth of the time of a weighted int32 sum (measured)
        plane.bitwise_or_(high[..., i] << i)
    return plane


def _unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """`_pack_bits` undone: [..., K // 8] -> [..., K] uint8 0 / 1."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return torch.bitwise_and(torch.bitwise_right_shift(packed.unsqueeze(-1), shifts), 1).reshape(*packed.shape[:-1], -1)


def _bit_plane(values: torch.Tensor, bit: int) -> torch.Tensor:
    """[..., K] uint8 -> [..., K // 8]: the plane of bit `bit` of each value."""
    return _pack_bits(_in_plane_order((values >> bit) & 1))


def _plane_bits(plane: torch.Tensor) -> torch.Tensor:
    """A bit plane [..., K // 8] -> its bits, one uint8 (0 or 1) per element [..., K], in element order."""
    return _in_element_order(_unpack_bits(plane))


def plane_from_words(words: torch.Tensor) -> torch.Tensor:
    """[..., K // 8] uint8 holding a little-endian word per block of 32 with element e at bit e (GGUF Q5_0 /
    Q5_1's qh) -> the same bits as a plane in this module's order."""
    return _pack_bits(_in_plane_order(_unpack_bits(words)))


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
