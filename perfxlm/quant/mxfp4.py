"""MXFP4 (OCP microscaling FP4) -> `QuantizedWeight`, by moving bits: gpt-oss's expert weights, as a GGUF
file (GGML type MXFP4) or the Hugging Face checkpoint (`*_blocks` / `*_scales`) stores them.

A block of 32 weights shares one E8M0 exponent byte e (the power of two 2^(e - 127)); each weight is a
4-bit E2M1 float (sign, two exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
negatives). In the one affine form that is a 16-level table on 4-bit codes, group 32, centred (no
mins): the levels are the E2M1 values doubled (small integers, as ggml keeps them, so that a kernel may
take them as int8) and the scale is 2^(e - 128), so every dequantized weight is ggml's product
d x kvalue bit for bit. The scale stays one byte per block, as the format stores it: torch's
float8_e8m0fnu byte e - 1, whose value is 2^(e - 1 - 127) = 2^(e - 128) exactly (`.float()` reads it;
the native kernels multiply it out per run of rows, csrc quant_linear.cpp), so a weight streams 4.25
bits, not 5 (`scale_bytes`: exponent 0, 2^-128, below that byte's range, where its block is not all
zeros keeps the tensor's scales float32, subnormal for e < 2, which float16 could not hold).

Byte layouts (both hold 16 bytes of codes per block of 32):
- GGUF: 17-byte blocks [e, qs[16]], byte j holding element j in its low nibble and element j + 16 in its
  high nibble: Q4_0's order, which `QuantizedWeight` keeps, so the codes are copied as they are;
- the checkpoint: `blocks` [..., K / 32, 16] with byte j holding elements 2j (low) and 2j + 1 (high), and
  `scales` [..., K / 32] the exponent bytes: the nibbles are reordered once at load.
"""

from __future__ import annotations

import math

import torch

from perfxlm.quant.weight import QuantizedWeight, pack_nibbles

MXFP4_BLOCK = 32  # weights per shared exponent
GGUF_BLOCK_BYTES = 17  # one exponent byte, 16 bytes of codes

# E2M1 codes 0..15 -> twice their value (ggml's kvalues_mxfp4); code 8 is -0, kept +0 as ggml does
E2M1_DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def e8m0_half(exponents: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents e -> float32 2^(e - 128), exactly (the bits built directly: a subnormal for
    e < 2, as ggml's ggml_e8m0_to_fp32_half; e = 255, E8M0's NaN, reads as 2^127 there too)."""
    e = exponents.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def scale_bytes(exponents: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents e [..., K / 32] of blocks of Q4_0-ordered `codes` [..., K / 2] -> the scales
    2^(e - 128) as float8_e8m0fnu bytes e - 1 (the values `e8m0_half` gives). Exponent 0 (2^-128, which
    no byte holds; ggml writes it for an all-zero block) takes byte 0 where its block is all zeros (codes
    of +-0: zero at any scale); any other block of exponent 0 keeps the tensor's scales float32."""
    low = exponents == 0
    if bool(low.any()):
        blocks = codes.reshape(*codes.shape[:-1], -1, MXFP4_BLOCK // 2)
        zero = ((blocks & 0x77) == 0).all(-1)  # every nibble 0 or 8 (E2M1's +0 and -0)
        if bool((low & ~zero).any()):
            return e8m0_half(exponents).contiguous()
    return torch.where(low, 0, exponents.int() - 1).to(torch.uint8).contiguous().view(torch.float8_e8m0fnu)


def _weight(codes: torch.Tensor, exponents: torch.Tensor, out_features: int, in_features: int
            ) -> QuantizedWeight:
    return QuantizedWeight(
        codes.contiguous(), scale_bytes(exponents, codes), None, E2M1_DOUBLED.clone(), 4, MXFP4_BLOCK,
        "float", out_features, in_features,
    )  # fmt: skip


def _check_shape(shape: tuple[int, ...], what: str) -> tuple[int, int]:
    if len(shape) not in (2, 3):
        raise ValueError(f"{what}: MXFP4 weights are matrices or expert stacks; got shape {shape}.")
    n, k = shape[-2:]
    if k % MXFP4_BLOCK:
        raise ValueError(f"{what}: row length {k} is not a multiple of MXFP4's block of {MXFP4_BLOCK}.")
    return n, k


def from_gguf(data: torch.Tensor, shape: tuple[int, ...]) -> QuantizedWeight:
    """A GGUF MXFP4 tensor's bytes (flat uint8; torch shape [N, K] or [E, N, K]) as a QuantizedWeight
    holding the same values."""
    shape = tuple(int(s) for s in shape)
    n, k = _check_shape(shape, "GGUF MXFP4 tensor")
    lead = shape[:-2]
    blocks_per_row = k // MXFP4_BLOCK
    if data.numel() != math.prod(shape) // MXFP4_BLOCK * GGUF_BLOCK_BYTES:
        raise ValueError(f"MXFP4 tensor of shape {shape}: wrong number of bytes ({data.numel()}).")
    b = data.reshape(*lead, n, blocks_per_row, GGUF_BLOCK_BYTES)
    codes = b[..., 1:].reshape(*lead, n, k // 2)
    return _weight(codes, b[..., 0], n, k)


def from_checkpoint(blocks: torch.Tensor, scales: torch.Tensor, where: str) -> QuantizedWeight:
    """A checkpoint's `blocks` uint8 [..., N, K / 32, 16] and `scales` uint8 [..., N, K / 32] as a
    QuantizedWeight [..., N, K]; ValueError naming `where` if they do not fit together."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"{where}: MXFP4 blocks and scales must be uint8 (got {blocks.dtype}, {scales.dtype})."
        )
    fits = tuple(scales.shape) == tuple(blocks.shape[:-1])
    if blocks.dim() not in (3, 4) or blocks.shape[-1] != MXFP4_BLOCK // 2 or not fits:
        raise ValueError(
            f"{where}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit: "
            "expected "
            f"blocks [..., N, K / {MXFP4_BLOCK}, {MXFP4_BLOCK // 2}] and scales [..., N, K / {MXFP4_BLOCK}]."
        )
    *lead, n, nb, _ = blocks.shape
    k = nb * MXFP4_BLOCK
    # byte j: elements 2j (low nibble), 2j + 1 (high) -> one code per element, then Q4_0's order
    values = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*lead, n, k)
    return _weight(pack_nibbles(values), scales, n, k)


def dequantize_gguf_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [n_blocks, 17] -> float32 [n_blocks, 32], equal to `gguf.quants.dequantize` bit for bit."""
    qs = blocks[:, 1:]
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=1)
    values = E2M1_DOUBLED.index_select(0, codes.reshape(-1).int()).view(codes.shape)
    return values.mul_(e8m0_half(blocks[:, :1]))


def quantize_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., N, K] -> (checkpoint-layout blocks, scales): the exponent floor(log2(absmax)) - 2 + 127
    per block and the nearest E2M1 level (ggml's rule, `gguf.quants.MXFP4`), for tests and dummy files."""
    *lead, n, k = w.shape
    blocks = w.float().reshape(*lead, n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, torch.zeros_like(amax)).clamp(0, 254)
    e = e.to(torch.uint8)
    d = e8m0_half(e).unsqueeze(-1)
    codes = ((d.unsqueeze(-1) * E2M1_DOUBLED) - blocks.unsqueeze(-1)).abs().argmin(-1).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), e
