"""Plain-torch products with a `QuantizedWeight`: the fallback without native kernels and the reference
the kernels are tested against.

Weight-only (act="float"): y = x W^T + b with W = `w.dequantize()` (float32), dequantized a slab of
output rows at a time so a large matrix (an LM head) never exists whole in float32.

W8A8 (act="int8"), exactly:
1. per row m of x: a[m] = max|x[m, :]|, sx[m] = a[m] / 127 (float32), qx[m, k] = clamp(round(x / sx),
   -127, 127) with torch.round (half to even); a row of zeros has qx = 0 (sx = 0).
2. per group g of weights (group == K: one): the int8 weight qw = u - 128, c[n, g] = mins[n, g] +
   128 scales[n, g] (0 for symmetric weights, whose mins are -128 scales), integer sums
   acc[m, n, g] = sum_k qx[m, k] qw[n, k] and xs[m, g] = sum_k qx[m, k] over the group (exact, int32).
3. y[m, n] = sx[m] * (t[m, n, 0] + t[m, n, 1] + ...) in float32, groups added in order, with
   t = scales[n, g] * acc + c[n, g] * xs; then + bias.

W8A8 with activation blocks (act="int8_block"): each block of 32 values of a row is quantized as a row
is above (its own absmax / 127 scale, half to even, clamp to +-127); the product is the weight-only
product on those quantized values times their scales (`fake_quantize_blocks`), which the native
int8 dot-product kernel computes up to float summation order. A weight-only weight whose `activations`
is ActivationMode.INT8 (`quant_activations="int8"`) takes the same rounded activations; INT8_NATIVE
(int8 blocks only where the native kernel has them) is float32 here: there is no native kernel.

A weight with an `input_order` (GPTQ act-order) multiplies x's columns in that order, taken first, so
every rule above applies to the permuted row as the native kernel sees it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from perfxlm.quant import act_blocks
from perfxlm.quant.layouts import CodeLayout
from perfxlm.quant.weight import ACT_BLOCK, ActivationMode, QuantizedWeight

# output rows dequantized per slab: at most this many float32 weights (16 MB) at once
SLAB_ELEMENTS = 4 << 20


def weight_only_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x float32 [M, K] -> [M, N] float32."""
    n, k = w.out_features, w.in_features
    per_slab = max(1, SLAB_ELEMENTS // k)
    if per_slab >= n:
        return F.linear(x, w.dequantize(), bias)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    for n0 in range(0, n, per_slab):
        n1 = min(n, n0 + per_slab)
        y[:, n0:n1] = F.linear(x, w.narrow_rows(n0, n1 - n0).dequantize())
    if bias is not None:
        y += bias
    return y


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [M, K] -> (int8 [M, K], float32 scales [M]): symmetric per row, absmax / 127."""
    scale = x.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(x / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _super_amax(blocks: torch.Tensor) -> torch.Tensor:
    """[M, B, 32] -> [M, B, 1]: each block's super-block (8 blocks, 256 values; a row's last may be
    short) largest |x|."""
    m, b = blocks.shape[0], blocks.shape[1]
    per_block = blocks.abs().amax(dim=-1)
    padded = F.pad(per_block, (0, -b % 8)).view(m, -1, 8).amax(dim=-1)
    return padded.repeat_interleave(8, dim=1)[:, :b].unsqueeze(-1)


def fake_quantize_blocks(x: torch.Tensor, kquant: bool = False) -> torch.Tensor:
    """float32 [M, K] (K a multiple of 32) -> each block of 32 replaced by its symmetric int8 values
    times the block's scale (absmax / 127; an all-zero block stays zero), in the arithmetic that
    perfxlm.quant.act_blocks names: ggml's (values times 127 / absmax, the scale rounded to fp16) or
    float's (values divided by the float32 scale). kquant: for a K-quant weight, which under ggml's rule
    takes q8_K (one scale per 256 values: iscale 127 / absmax, values rounded times it, scale 1 / iscale
    in float32; ggml's sign convention negates both, which changes no product)."""
    blocks = x.reshape(x.shape[0], -1, ACT_BLOCK)
    if act_blocks.super_blocks(kquant):
        amax = _super_amax(blocks)
        live = amax > 0
        one = torch.ones_like(amax)
        iscale = torch.where(live, torch.full_like(amax, 127.0) / torch.where(live, amax, one), torch.zeros_like(amax))
        live = live & torch.isfinite(iscale)
        iscale = torch.where(live, iscale, torch.zeros_like(amax))
        scale = torch.where(live, one / torch.where(live, iscale, one), torch.zeros_like(amax))
        q = torch.round(blocks * iscale).clamp_(-127, 127)
        return q.mul_(scale).view(x.shape)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = amax / 127.0
    if act_blocks.mode() != "float":  # ggml's q8_0 / q8_1 blocks
        scale = scale.half().float()  # round to nearest even, as F16C
        live = scale > 0
        # a true division, as the kernels' 127.f / amax (torch's `127.0 / t` is 127 x reciprocal(t): an ulp off)
        factor = torch.where(live, torch.full_like(amax, 127.0) / torch.where(live, amax, torch.ones_like(amax)),
                             torch.zeros_like(amax))
        q = torch.round(blocks * factor).clamp_(-127, 127)
        return q.mul_(scale).view(x.shape)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(blocks / safe).clamp_(-127, 127)
    return q.mul_(scale).view(x.shape)


def _int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] x int8 [N, K] -> exact int32 [M, N]."""
    try:
        return torch._int_mm(a.contiguous(), b.t().contiguous())
    except (RuntimeError, AttributeError):  # shapes or builds _int_mm refuses: float64 is exact here
        return (a.double() @ b.double().t()).to(torch.int32)


def w8a8_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x float32 [M, K] -> [M, N] float32, by the W8A8 rule in the module docstring."""
    qx, sx = quantize_activations(x)
    qw = w.codes.view(torch.int8) ^ torch.tensor(-128, dtype=torch.int8)  # u - 128, as int8
    scales, mins = w.scales.float(), w.full_mins()
    offsets = mins + 128.0 * scales
    g = w.group
    total = None
    for i in range(w.in_features // g):
        cols = slice(i * g, (i + 1) * g)
        acc = _int_matmul(qx[:, cols], qw[:, cols]).float()
        xs = qx[:, cols].sum(dim=-1, dtype=torch.int32).float()
        t = acc.mul_(scales[:, i]).add_(xs.unsqueeze(1) * offsets[:, i])
        total = t if total is None else total.add_(t)
    assert total is not None
    y = total.mul_(sx.unsqueeze(1))
    if bias is not None:
        y += bias
    return y


def block_reference_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The int8-block GEMVs' product for `w` (either code layout; what csrc/row_groups.h computes): x [M, K]
    rounded to int8 blocks of 32, times the dequantized weight, in float64 then float32."""
    y = F.linear(fake_quantize_blocks(x.float(), w.kquant).double(), w.dequantize().double())
    if bias is not None:
        y = y + bias.double()
    return y.float()


def reference_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (any float dtype) -> [..., N] in x's dtype; computed in float32."""
    rows = w.ordered_rows(x.reshape(-1, x.shape[-1]).float())
    b = None if bias is None else bias.float()
    # W8A8 blocks, quant_activations="int8" on any format, or a layout whose products always round them
    if w.activations is ActivationMode.INT8 or w.layout is not CodeLayout.PLAIN:
        rows = fake_quantize_blocks(rows, w.kquant)
        w = w.plain()
    y = (w8a8_linear if w.act == "int8" else weight_only_linear)(rows, w, b)
    return y.to(x.dtype).view(*x.shape[:-1], w.out_features)
