"""NF4 as QLoRA defines it (bitsandbytes' `quantize_4bit(quant_type="nf4", compress_statistics=True)`).

- Each block of 64 consecutive weights is scaled by its absmax (float32); each weight's code is the
  nearest of the 16 NormalFloat levels to clamp(w * (1 / absmax), -1, 1) (ties to the lower level).
- Double quantization: the absmax values of one tensor, minus their mean (one float32 offset per tensor),
  are quantized again in blocks of 256 with bitsandbytes' 8-bit dynamic code (`dynamic_map`): a float32
  absmax per block of 256 and one byte per 64 weights, 4 + 8/64 + 32/(64 * 256) = 4.127 bits per weight.
- Dequantized: levels[u] * (code[q] * absmax2 + offset), all in float32.

The codes are chosen against the exact absmax, then the scale is replaced by its double-quantized
value, as bitsandbytes does. `QuantizedWeight` has no second-level form, so the stored scales are the
double-dequantized values themselves, in float32 so that every dequantized weight equals QLoRA's bit
for bit (the kernel reads float16 or float32 scales, plus a min of 0 per group): 4 + 64/64 = 5 bits per
weight stored, against QLoRA's nominal 4.127. `double_quant=False` keeps the plain absmax in float16
instead (4.5 bits stored, closer to the float weights: no second rounding of the scales).
"""

from __future__ import annotations

import functools

import torch

NF4_BLOCK = 64  # QLoRA's block size for the absmax of the weights
ABSMAX_BLOCK = 256  # bitsandbytes' block size for the double quantization of the absmax values

# bitsandbytes' NF4 code book (bitsandbytes/functional.py, get_4bit_type("nf4"))
NF4_LEVELS = torch.tensor(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0],
    dtype=torch.float32,
)  # fmt: skip


@functools.cache
def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic code (`create_dynamic_map(signed=True, max_exponent_bits=7,
    total_bits=8)`), float32 [256], sorted: a sign, a decimal exponent 10^-6 .. 10^0 written in unary and
    the rest of the byte a linear fraction, so small values keep relative precision."""
    exponent_bits, non_sign_bits = 7, 7
    data: list[float] = []
    for i in range(exponent_bits):
        items = 2 ** (i + non_sign_bits - exponent_bits) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += (10 ** (-(exponent_bits - 1) + i) * means).tolist()
        data += (-(10 ** (-(exponent_bits - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def nearest_level(scaled: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of `levels` (sorted) for each value; ties to the lower index, as
    bitsandbytes' argmin |x - code| picks the first."""
    idx = torch.searchsorted(levels, scaled.contiguous()).clamp_(1, len(levels) - 1)
    below, above = levels[idx - 1], levels[idx]
    take_above = (above - scaled).abs() < (scaled - below).abs()
    return torch.where(take_above, idx, idx - 1)


def double_quantize_absmax(absmax: torch.Tensor) -> torch.Tensor:
    """float32 absmax values of one tensor (flat, in block order) -> their double-quantized values,
    code[q] * absmax2 + offset, as QLoRA dequantizes them."""
    flat = absmax.reshape(-1).float()
    offset = flat.mean()
    centered = flat - offset
    n = centered.numel()
    blocks = -(-n // ABSMAX_BLOCK)
    padded = torch.zeros(blocks * ABSMAX_BLOCK, dtype=torch.float32)
    padded[:n] = centered
    padded = padded.view(blocks, ABSMAX_BLOCK)
    scale2 = padded.abs().amax(dim=-1, keepdim=True)  # the padding's zeros never raise an absmax
    scaled = torch.clamp(padded * (1 / scale2), -1, 1)
    code = dynamic_map()
    q = nearest_level(scaled, code)
    # a block of equal absmax values has scale2 = 0: 0 * inf is nan, bitsandbytes' argmin then picks
    # code[0], and code[0] * 0 = 0 all the same
    q = torch.where(torch.isnan(scaled), torch.zeros_like(q), q)
    values = (code[q] * scale2).reshape(-1)[:n]
    return (values + offset).reshape(absmax.shape)


def nf4_codes(g: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """Groups float32 [..., G] and their absmax [...] -> NF4 codes (int64) as bitsandbytes picks them."""
    scaled = torch.clamp(g * (1 / absmax).unsqueeze(-1), -1, 1)
    codes = nearest_level(scaled, NF4_LEVELS)
    # An all-zero block: 0 * (1 / 0) is nan, which bitsandbytes' search maps to code 0 (level -1.0); with
    # the double-quantized absmax (not 0) such a block dequantizes to -scale there, and here alike.
    return torch.where(torch.isnan(scaled), torch.zeros_like(codes), codes)
