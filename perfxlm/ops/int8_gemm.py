"""W8A8 with one activation scale per token, many rows: an integer GEMM (torch's `_int_mm`, oneDNN's int8
kernels: `vpdpbusd` with AVX512-VNNI / AVX-VNNI, `vpmaddubsw` + `vpmaddwd` on AVX2) instead of dequantizing
the weight to float slabs for a float32 GEMM.

An encoder embedding a batch multiplies thousands of rows per weight, so its products are bound by
arithmetic, not by reading weights: int8 dot products do 4x the multiply-adds of float32 FMAs per
instruction (2x on AVX2). The weight-only and block-activation formats cannot use a plain integer GEMM
(one activation scale per 32 values means one GEMM per block); a weight with one scale per output channel
and activations with one scale per row can: y[m, n] = sx[m] * sw[n] * sum_k qx[m, k] qw[n, k].

The integer sums are exact, and the scaling is done in the order `perfxlm.quant.reference.w8a8_linear`
does it (acc x sw, then x sx, then + bias), so this path gives the definition's bits, whatever the number
of rows. Few rows (decode, a short query) stay on the native GEMV, which is faster there.
"""

from __future__ import annotations

import torch

from perfxlm.ops import native
from perfxlm.quant.weight import QuantizedWeight


def gemm_weight(weight: object) -> torch.Tensor | None:
    """The int8 matrix qw [N, K] (code - 128) of a W8A8 weight the integer GEMM takes: 8-bit symmetric codes,
    one scale per output channel, per-token activations (`act="int8"`), no level table; None for any other
    weight, or where this torch build has no integer GEMM. Kept beside the codes (one more byte per weight):
    the native GEMV reads the unsigned codes. Its columns are the codes' (an act-order weight's caller
    passes `weight.ordered_rows(x)`: each row's scale is its absmax, the same in any column order)."""
    if not isinstance(weight, QuantizedWeight) or weight.codes.dim() != 2:
        return None
    if weight.act != "int8" or weight.bits != 8 or weight.levels is not None:
        return None
    if weight.group != weight.in_features:
        return None
    offsets = weight.full_mins().float() + 128.0 * weight.scales.float()
    if bool(offsets.any()):  # an asymmetric weight: its zero points would need the activations' row sums
        return None
    if not _has_int_mm():
        return None
    return (weight.codes.view(torch.int8) ^ torch.tensor(-128, dtype=torch.int8)).contiguous()


def int8_gemm_linear(
    x: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: rows quantized per token (the W8A8 rule), an exact int32 GEMM,
    then acc x scales[n] x sx[m] + bias (+ residual [..., N]), in float32. `scales`: float32 [N].

    The passes around the GEMM run natively where the kernels are built (perfxlm/csrc/int8_rows.cpp: one
    pass each, the same bits); `int8_gemm_reference` is their torch definition and the fallback."""
    ops = native.kernels_for(x)
    if ops is None:
        return int8_gemm_reference(x, qw, scales, bias, residual)
    rows = _float_rows(x)
    qx, sx = ops.int8_quantize_rows(rows)
    acc = torch._int_mm(qx, qw.t())
    res = None
    if residual is not None:
        res = residual.reshape(-1, qw.shape[0])
        res = res if res.dtype == torch.float32 and res.is_contiguous() else res.float().contiguous()
    ops.int8_gemm_epilogue(acc, scales, sx, _float_bias(bias), res)
    return acc.view(torch.float32).to(x.dtype).view(*x.shape[:-1], qw.shape[0])


def int8_gemm_gelu(x: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """GELU(int8_gemm_linear(x, ...)) (the erf form, an encoder's up projection), the activation computed in
    the epilogue's pass over the GEMM's sums (int8_rows.cpp) instead of one more pass over the whole output.
    Not F.gelu's bits: within 1e-7 + 1.2e-7 |x| of the exact GELU (erf by Abramowitz-Stegun 7.1.26), where
    F.gelu's own approximation is as far or further; the torch fallback is F.gelu."""
    ops = native.kernels_for(x)
    if ops is None:
        return torch.nn.functional.gelu(int8_gemm_reference(x, qw, scales, bias))
    qx, sx = ops.int8_quantize_rows(_float_rows(x))
    acc = torch._int_mm(qx, qw.t())
    ops.int8_gemm_epilogue_gelu(acc, scales, sx, _float_bias(bias))
    return acc.view(torch.float32).to(x.dtype).view(*x.shape[:-1], qw.shape[0])


def int8_gemm_reference(
    x: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`int8_gemm_linear` in torch ops: the definition the native passes equal bit for bit."""
    qx, sx = quantize_rows(_float_rows(x))
    y = torch._int_mm(qx, qw.t()).float()
    y.mul_(scales).mul_(sx.unsqueeze(1))
    if bias is not None:
        y.add_(_float_bias(bias))
    if residual is not None:
        y.add_(residual.reshape(y.shape).float())
    return y.to(x.dtype).view(*x.shape[:-1], qw.shape[0])


def _float_rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.dtype == torch.float32 and rows.is_contiguous() else rows.float().contiguous()


def _float_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    if bias is None:
        return None
    return bias if bias.dtype == torch.float32 and bias.is_contiguous() else bias.float().contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.quantize_activations`' values in fewer passes over x (at these sizes each elementwise
    pass costs a fifth of the GEMM): max |x| as max(max x, -min x), two reductions that write nothing
    (3x faster than |x| then its max; the max norm and aminmax measured slower still), and no clamp:
    |x| / (max |x| / 127) cannot round past 127."""
    scale = torch.maximum(x.amax(dim=-1), x.amin(dim=-1).neg_()) / 127.0
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.div(x, safe.unsqueeze(-1)).round_().to(torch.int8), scale


_INT_MM: list[bool] = []


def _has_int_mm() -> bool:
    """Whether torch's integer GEMM runs here (odd sizes included), checked once against the exact product."""
    if not _INT_MM:
        try:
            a = torch.randint(-127, 128, (17, 37), dtype=torch.int8)
            b = torch.randint(-127, 128, (5, 37), dtype=torch.int8)
            ok = torch.equal(torch._int_mm(a, b.t()), (a.long() @ b.long().t()).int())
        except (RuntimeError, AttributeError):
            ok = False
        _INT_MM.append(ok)
    return _INT_MM[0]
