"""y = x W^T + b: the kernels each layer's linear method calls (model/layers/linear_methods/, chosen once
at load), and `linear`, which dispatches on how W is stored for weights no layer owns (see `cpu_plan`
for which form a CPU gets).

- W in x's dtype ([N, K]): torch's own linear (MKL / oneDNN).
- W bf16 rows [N, K] under float32 x (CPUs with AVX512-BF16 / AMX, and MoE expert stacks everywhere): up
  to `native_max_rows` rows (decode) go to the native row kernel, which widens the weights in registers;
  more rows round x to bf16 and run bf16 dot products on the same tensor (`gemm="bf16"`: the native
  vdpbf16ps kernel where the plan's `bf16_dots` says, else torch's bf16 GEMM, AMX / AVX512-BF16 through
  oneDNN), or widen W in slabs for MKL's float32 GEMM (`gemm="float32"`).
- W packed bf16 panels [ceil(N/16), K, 16] under float32 x (`pack_bf16`, AVX2 and AVX-512 without bf16
  arithmetic): few rows go to the native panel kernel; many rows (`panel_gemm`) too, or they widen a
  slab of panels into a reused float32 buffer that stays in cache and run MKL's float32 GEMM on it.
- Without native kernels: W widened per call, correct and slow.
- W a `perfxlm.quant.QuantizedWeight` (GGUF blocks kept quantized, `quantization=`): the native
  `linear_q` kernel (codes widened in registers, or int8 dot products on activations rounded to int8
  blocks where `W.activations` says so, and W8A8), else `perfxlm.quant.reference` (dequantize, then
  F.linear; W8A8's integer product).

The reference for all of them is `F.linear(x, W.float(), b)`.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.nn.functional as F

from perfxlm.ops import cpu_plan, fp8_linear, native
from perfxlm.quant.reference import fake_quantize_blocks, reference_linear
from perfxlm.quant.layouts import CodeLayout
from perfxlm.quant.weight import ActivationMode, QuantizedWeight

PANEL = 16
# Output columns widened per slab when rows are few: 1024 x 576 float32 = 2.3 MB, about L2.
SLAB_COLUMNS = 1024
# With many rows the widening is cheap next to the GEMM: widen up to 8M float32 (32 MB) at once.
BIG_SLAB_ELEMENTS = 8 << 20

_scratch = threading.local()


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), K, 16] bf16 panels (the last one zero-padded)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=torch.bfloat16)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def unpack_bf16(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """Inverse of pack_bf16: [N, K] bf16."""
    panels, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(panels * PANEL, k)[:out_features]


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out_features: int | None = None
) -> torch.Tensor:
    """Any weight, its form read off its type, rank and dtype on each call: for weights no layer owns
    (expert stacks of families without a FusedMoE, tests). A layer runs its `LinearMethod` instead,
    chosen once at load (model/layers/linear_methods/)."""
    if type(weight) is QuantizedWeight:
        return quantized_linear(x, weight, bias)
    if weight.dim() == 3:  # packed bf16 panels
        assert out_features is not None, "a packed weight needs its out_features"
        return packed_linear(x, weight, bias, out_features)
    return float_linear(x, weight, bias)


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A plain [N, K] float weight: torch's product where dtypes agree, the bf16 row kernel for bf16
    weights under float32 activations (never widened whole), else the weight cast to x's dtype."""
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    if weight.dtype == torch.bfloat16 and x.dtype == torch.float32:
        rows = x.reshape(-1, x.shape[-1])
        return bf16_rows_linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x [..., K] float32 times packed bf16 panels: the native panel kernel for few rows, and for many where
    the plan's `panel_gemm` says so, else widened slabs."""
    rows = x.reshape(-1, x.shape[-1])
    ops = native.kernels()
    plan = cpu_plan.plan()
    if ops is not None and (rows.shape[0] <= plan.native_max_rows or plan.panel_gemm == "kernel"):
        y = ops.linear_bf16_packed(rows, weight, out_features, bias)
    else:
        y = _slab_linear(rows, weight, out_features, bias)
    return y.view(*x.shape[:-1], out_features)


def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, bf16_gemm: bool = False
) -> torch.Tensor:
    """x [..., K] (float32, or bf16 activations computed in float32) -> [..., N] in x's dtype: the native
    `linear_q` kernel where built, else the plain-torch reference (perfxlm.quant.reference). Many rows run
    the CPU's bf16 GEMM for a bfloat16 model (`bf16_gemm`); the activations are rounded to int8
    blocks as the weight's `activations` (decided at load from `quant_activations`) says, else the
    products are exact to float summation order. The fused decode layer does the same."""
    ops = native.kernels()
    if ops is not None and not weight.kernel_levels and fp8_linear.takes(weight):  # e4m3 bytes
        return fp8_linear.fp8_linear(ops, x, weight, bias)
    if ops is None or not hasattr(ops, "linear_q") or not weight.kernel_levels:
        return reference_linear(x, weight, bias)
    mode = weight.activations
    int8_blocks = mode is not ActivationMode.FLOAT  # INT8_NATIVE: the kernel rounds where it can
    round_in_torch = mode is ActivationMode.INT8 and not native_int8_blocks(weight)
    # the kernel would multiply them as given: round them here, the same way
    return run_linear_q(ops, x, weight, bias, bf16_gemm, int8_blocks and not round_in_torch, round_in_torch)


def run_linear_q(
    ops: object, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, bf16_gemm: bool,
    int8_blocks: bool, round_in_torch: bool,
) -> torch.Tensor:
    """The native `linear_q` call, with the choices made: whether many rows may run the bf16 GEMM,
    whether the kernel rounds activations to int8 blocks, or they are rounded here first."""
    rows = weight.ordered_rows(x.reshape(-1, x.shape[-1]))  # act-order: the codes' columns' inputs
    if rows.dtype != torch.float32 or not rows.is_contiguous():
        rows = rows.float().contiguous()
    b = bias if bias is None or bias.dtype == torch.float32 else bias.float()
    plan = cpu_plan.plan()
    if weight.layout is not CodeLayout.PLAIN:  # the kernel picks GEMV or int8 GEMM (always int8 blocks)
        y = ops.linear_q(  # type: ignore[attr-defined]
            rows, weight.codes, weight.scales, weight.mins, None, b, False, plan.quant_max_rows,
            plan.gemm == "bf16" and bf16_gemm, True, plan.quant_block_max_rows,
            plan.quant_gemm_rows if plan.quant_gemm == "int8" else -1, weight.layout.value.native,
            weight.out_features,
        )  # fmt: skip
        return y.to(x.dtype).view(*x.shape[:-1], weight.out_features)
    if int8_blocks and plan.quant_gemm == "int8" and rows.shape[0] >= gemm_rows(weight, plan) and gemm_takes(weight):
        # the GEMM reads float scales and K-quants' two-level bytes as they are (forming the values flat()
        # would); exponent bytes (MXFP4's) are widened for the call
        w = weight if weight.two_level else weight.flat()
        y = ops.quant_block_gemm(rows, w.codes, w.scales, w.mins, w.levels, b)  # type: ignore[attr-defined]
        return y.to(x.dtype).view(*x.shape[:-1], weight.out_features)
    if round_in_torch:
        rows = fake_quantize_blocks(rows, weight.kquant)
    y = ops.linear_q(  # type: ignore[attr-defined]
        rows, weight.codes, weight.scales, weight.mins, weight.levels, b, weight.act == "int8",
        plan.quant_max_rows, plan.gemm == "bf16" and bf16_gemm, int8_blocks, plan.quant_block_max_rows,
    )  # fmt: skip
    return y.to(x.dtype).view(*x.shape[:-1], weight.out_features)


def gemv_rows(weight: QuantizedWeight, plan: cpu_plan.CpuPlan) -> int:
    """Rows up to which `linear_q` runs this int8-block weight's GEMV (csrc quant_linear.cpp's rule: 4-, 5-
    and 6-bit codes and weights of more than 4M values keep it up to quant_block_max_rows where set)."""
    block_wins = weight.bits in (4, 5, 6) or weight.out_features * weight.in_features > (4 << 20)
    return plan.quant_block_max_rows if block_wins and plan.quant_block_max_rows >= 0 else plan.quant_max_rows


def gemm_rows(weight: QuantizedWeight, plan: cpu_plan.CpuPlan) -> int:
    """Rows from which an int8-block weight the int8 GEMM takes runs it under an int8 plan (csrc
    quant_linear.cpp's rule, which the fused decode layer follows): the plan's quant_gemm_rows, or past the
    GEMV's limit."""
    return plan.quant_gemm_rows if plan.quant_gemm_rows > 0 else gemv_rows(weight, plan) + 1


def gemm_takes(weight: QuantizedWeight) -> bool:
    """Whether the int8 GEMM (csrc quant_gemm.cpp) takes an int8-block weight: groups of whole 32-blocks
    (not 8-bit groups of 16), or centred 6-bit codes in groups of 16 (Q6_K's, closed per half block), a
    level table only of integers (MXFP4's), codes within what the build's dot instruction runs at its int8
    rate (every SIMD build: 255; AVX2 without AVX-VNNI widens 8-bit codes to int16 for it); not W8A8 per
    token (one activation scale per row: its own integer GEMM). GGUF K-quants' two-level byte scales it
    reads as stored."""
    halves = weight.group == 16 and weight.bits == 6 and weight.mins is None
    if weight.act == "int8" or (weight.group % 32 != 0 and not halves):
        return False
    if weight.levels is None:
        top = (1 << weight.bits) - 1
    elif integer_levels(weight):
        top = int(weight.levels.max() - weight.levels.min())
    else:
        return False
    return top <= gemm_max_code()


@functools.cache
def gemm_max_code() -> int:
    """The largest unsigned code the native build's int8 GEMM runs at its int8 rate (0: no GEMM); fixed for the
    process."""
    ops = native.kernels()
    return int(ops.quant_block_gemm_max_code()) if ops is not None and hasattr(ops, "quant_block_gemm_max_code") else 0


def native_int8_blocks(weight: QuantizedWeight) -> bool:
    """Whether the native kernel quantizes activations to int8 blocks for this weight when asked (a VNNI
    build, and a layout its block GEMV takes: no level table, or a centred table of integers spanning at
    most 64 (MXFP4's, looked up as int8), K a multiple of 64, groups of 32 / multiples of 64, or of 16 with
    6- or 8-bit codes);
    elsewhere it multiplies the activations as given. Row groups: always (their GEMV's scheme on every build)."""
    if weight.layout is not CodeLayout.PLAIN:
        return True
    g = weight.group
    layout_ok = (weight.levels is None or integer_levels(weight)) and weight.in_features % 64 == 0 and (
        g % 64 == 0 or g == 32 or (g == 16 and weight.bits in (6, 8))
    )
    return layout_ok and _int8_dots()


def integer_levels(weight: QuantizedWeight) -> bool:
    """A level table the int8 block products take (csrc `integer_table`): centred 4-bit codes into
    integers spanning at most 64 (MXFP4's E2M1 values doubled)."""
    lv = weight.levels
    if lv is None or weight.bits != 4 or weight.mins is not None:
        return False
    return bool(torch.equal(lv, lv.round()) and float(lv.max() - lv.min()) <= 64.0)


@functools.cache
def _int8_dots() -> bool:  # a property of the native build, fixed for the process
    return cpu_plan.has_int8_dots()


def bf16_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[M, K] float32 x [N, K] bf16 -> [M, N] float32, by the plan in force."""
    plan = cpu_plan.plan()
    ops = native.kernels()
    if ops is not None and x.shape[0] <= plan.native_max_rows and weight.is_contiguous():
        return ops.linear_bf16_rows(x, weight, bias)
    if plan.gemm == "bf16":
        if plan.bf16_dots and ops is not None and hasattr(ops, "linear_bf16_dots") and weight.is_contiguous():
            return ops.linear_bf16_dots(x, weight, bias)
        y = F.linear(x.to(torch.bfloat16), weight).float()
    else:
        y = _widened_rows_mm(x, weight)
    if bias is not None:
        y += bias.float()
    return y


def _scratch_buffer(name: str, numel: int) -> torch.Tensor:
    """This thread's reused float32 buffer `name`, at least `numel` long.

    Allocated outside inference mode: an inference tensor cannot be written in place once the
    caller leaves inference mode, and the same thread serves both (tests, eager callers)."""
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=torch.float32)
        setattr(_scratch, name, buf)
    return buf


def _widened_rows_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T in float32 with W widened a slab of rows at a time into a reused buffer."""
    n, k = weight.shape
    per_slab = max(1, min(n, max(SLAB_COLUMNS, BIG_SLAB_ELEMENTS // k) if x.shape[0] >= 128 else SLAB_COLUMNS))
    buf = _scratch_buffer("rows_buf", per_slab * k)
    if per_slab >= n:  # one slab: one GEMM straight into the result
        wide = buf[: n * k].view(n, k)
        wide.copy_(weight)
        return torch.mm(x, wide.t())
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    for n0 in range(0, n, per_slab):
        n1 = min(n, n0 + per_slab)
        wide = buf[: (n1 - n0) * k].view(n1 - n0, k)
        wide.copy_(weight[n0:n1])
        y[:, n0:n1] = torch.mm(x, wide.t())
    return y


def _slab_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    panels, k, _ = packed.shape
    rows = x.shape[0]
    columns = SLAB_COLUMNS if rows < 128 else max(SLAB_COLUMNS, BIG_SLAB_ELEMENTS // k)
    per_slab = max(1, min(columns // PANEL, panels))
    buf = _scratch_buffer("buf", per_slab * PANEL * k)
    ops = native.kernels()

    def widened(p0: int, p1: int) -> torch.Tensor:  # W^T for panels [p0, p1): [K, 16 (p1 - p0)] float32
        wt = buf[: k * (p1 - p0) * PANEL]
        if ops is not None:
            ops.widen_panels(packed, p0, p1, wt)
        else:
            wt.view(k, p1 - p0, PANEL).copy_(packed[p0:p1].permute(1, 0, 2))
        return wt.view(k, (p1 - p0) * PANEL)

    if per_slab >= panels:  # one slab: one GEMM straight into the result
        y = torch.mm(x, widened(0, panels))
    else:
        y = torch.empty(rows, panels * PANEL, dtype=torch.float32)
        for p0 in range(0, panels, per_slab):
            p1 = min(panels, p0 + per_slab)
            y[:, p0 * PANEL : p1 * PANEL] = torch.mm(x, widened(p0, p1))
    if y.shape[1] != out_features:
        y = y[:, :out_features].contiguous()
    if bias is not None:
        y += bias.float()
    return y
