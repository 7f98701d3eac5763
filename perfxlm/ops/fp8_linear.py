"""Products over FP8 e4m3 weight bytes with a float32 scale per group of columns (DeepSeek-V3's
block-quantized checkpoints, quant/formats/fp8_blocks.py) through the native kernel (csrc/fp8_linear.cpp):
the bytes decoded in registers and times their scale, the same float32 weight values as the plain-torch
definition (reference.weight_only_linear over the 256-level table), which dequantizes the whole matrix per
call; only the summation order differs. Where the kernel does not take a weight (no native build, mins,
W8A8, groups not a multiple of 16) the reference runs, as before."""

from __future__ import annotations

import torch

from perfxlm.quant.formats.compressed_tensors import fp8_e4m3_levels
from perfxlm.quant.reference import fake_quantize_blocks, reference_linear
from perfxlm.quant.weight import ActivationMode, QuantizedWeight


# Past this many rows the definition's one dequantized matrix and torch's GEMM beat the kernel's register
# tiles (measured on a loaded 2-core machine at DeepSeek-V3's q_a_proj shape, 7168 -> 1536: the kernel
# 3.9x faster at 48 rows, 2.3x at 96, 0.7x at 256; `benchmarks/fp8_linear.py` retakes it)
MAX_ROWS = 128


def takes(weight: QuantizedWeight) -> bool:
    """Whether the kernel runs this weight (a matrix, or each expert of a stack): e4m3 bytes (the shared
    table itself: a weight built by the FP8 formats holds that one object), centred (no mins), float
    activations, one float32 scale per row and group of a multiple of 16 columns; an input order (act-order)
    gathers the rows first. Decided once per layer at load (linear_methods/quantized.py)."""
    return (
        weight.levels is fp8_e4m3_levels() and weight.mins is None
        and weight.act == "float" and weight.group % 16 == 0 and weight.scales.dtype == torch.float32
    )  # fmt: skip


def fp8_linear(ops: object, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype, computed in float32 (as the reference)."""
    rows = weight.ordered_rows(x.reshape(-1, x.shape[-1]))
    if rows.shape[0] > MAX_ROWS:  # a long prefill chunk: one dequantized matrix for all its rows
        return reference_linear(x, weight, bias)
    if rows.dtype != torch.float32 or not rows.is_contiguous():
        rows = rows.float().contiguous()
    if weight.activations is ActivationMode.INT8:  # quant_activations="int8": the reference rounds them too
        rows = fake_quantize_blocks(rows)
    b = None if bias is None else bias.float().contiguous()
    scales = weight.scales.contiguous()
    y = ops.linear_fp8(rows, weight.codes, scales, weight.group, b)  # type: ignore[attr-defined]
    return y.to(x.dtype).view(*x.shape[:-1], weight.out_features)
