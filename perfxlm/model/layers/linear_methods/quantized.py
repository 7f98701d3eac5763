"""Quantized weights: one class per format, all over the one storage form (`perfxlm.quant.QuantizedWeight`)
and the one native kernel (`linear_q`), or its plain-torch definition (`perfxlm.quant.reference`).

`process_after_loading` checks the layer holds what its format produces and decides, once, how its
product runs: the native kernel, FP8 bytes' own kernel (a 256-level table, ops/fp8_linear.py) or the
reference (FP8 bytes it does not take), whether activations are rounded to int8 blocks by the kernel
or in torch first (a layout or build the block GEMV lacks), whether many rows may run the CPU's bf16 GEMM
(a bfloat16 model). An act-order weight's input order (GPTQ) goes with the weight: every product takes
`weight.ordered_rows(x)` (csrc `project` the native side's). The fused decode layer reads the same
decisions (`fusable`, `bf16_gemm`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.model.layers.linear_methods.base import LinearMethod, LinearPlan
from perfxlm.ops import cpu_plan, fp8_linear, native
from perfxlm.ops.int8_gemm import gemm_weight, int8_gemm_gelu, int8_gemm_linear
from perfxlm.ops.linear import native_int8_blocks, run_linear_q
from perfxlm.quant.reference import reference_linear
from perfxlm.quant.weight import ActivationMode, QuantizedWeight


# Below this many rows the integer GEMM's setup (quantizing rows, int32 -> float) outweighs its faster
# multiply-adds, and decode steps keep the one kernel the fused layer also runs (a last-bit difference
# between two kernels would otherwise move an int8 activation step between fused and module decode)
INT_GEMM_MIN_ROWS = 32


class QuantizedLinearMethod(LinearMethod):
    quantized = True
    # what the format's weights may hold: code widths, level tables, an input order, int8 activations
    bits: tuple[int, ...] = (4, 8)
    levels: bool = False
    input_order: bool = False
    acts: tuple[str, ...] = ("float",)

    def __init__(self) -> None:
        self.native = True  # the native kernel takes the codes (else the plain-torch reference)
        self.fp8 = False  # FP8 e4m3 bytes the native FP8 kernel takes (ops/fp8_linear.py)
        self.bf16_gemm = False
        self.int8_blocks = False
        self.round_in_torch = False
        # W8A8 per token: the int8 matrix and float32 scales torch's integer GEMM takes past the GEMV's rows
        self.int_gemm: tuple[torch.Tensor, torch.Tensor] | None = None

    def check(self, weight: Any, where: str) -> None:
        """ValueError where `weight` is not what this format produces (a loader bug, named)."""
        problem = None
        if not isinstance(weight, QuantizedWeight):
            problem = f"holds {type(weight).__name__}, not quantized codes"
        elif weight.bits not in self.bits:
            problem = f"has {weight.bits}-bit codes; the format has {self.bits}"
        elif weight.levels is not None and not self.levels:
            problem = "has a level table; the format has affine codes only"
        elif weight.input_order is not None and not self.input_order:
            problem = "has an input order (act-order); the format has none"
        elif weight.act not in self.acts:
            problem = f"takes {weight.act!r} activations; the format takes {self.acts}"
        if problem is not None:
            raise ValueError(f"{where}: a {self.name} weight {problem}.")

    def process_after_loading(self, layer: nn.Module, plan: LinearPlan) -> None:
        self.decide(layer.weight, plan, type(layer).__name__)
        qw = gemm_weight(layer.weight)
        if qw is not None:
            self.int_gemm = (qw, layer.weight.scales.float().reshape(-1).contiguous())

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # many rows of a per-token W8A8 weight (an encoder's batch, a prefill): the integer GEMM, whose
        # exact sums give the plain-torch definition's bits (the GEMV below it: to float rounding)
        if self._takes_int_gemm(x):
            return int8_gemm_linear(layer.weight.ordered_rows(x), *self.int_gemm, bias)
        return super().apply(layer, x, bias)

    def apply_add(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
    ) -> torch.Tensor:
        # the sum in the epilogue's pass: the same bits as after it in float32 (a bf16 sum would round
        # the product to bf16 first)
        if self._takes_int_gemm(x) and x.dtype == torch.float32 and residual.dtype == torch.float32:
            return int8_gemm_linear(layer.weight.ordered_rows(x), *self.int_gemm, bias, residual)
        return super().apply_add(layer, x, bias, residual)

    def apply_act(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
        # GELU in the epilogue's pass: the whole [rows, N] output is not read and written once more
        if act == "gelu" and self._takes_int_gemm(x) and x.dtype == torch.float32:
            return int8_gemm_gelu(layer.weight.ordered_rows(x), *self.int_gemm, bias)
        return super().apply_act(layer, x, bias, act)

    def _takes_int_gemm(self, x: torch.Tensor) -> bool:
        rows = x.numel() // x.shape[-1]
        return self.int_gemm is not None and rows > max(cpu_plan.plan().quant_max_rows, INT_GEMM_MIN_ROWS)

    def decide(self, weight: QuantizedWeight, plan: LinearPlan, where: str) -> None:
        self.check(weight, where)
        self.native = weight.kernel_levels
        self.fp8 = not self.native and fp8_linear.takes(weight)
        # bf16 storage under float32 activations (a bfloat16 model): many rows may run the bf16 GEMM
        self.bf16_gemm = plan.weight_dtype == torch.bfloat16 and plan.compute_dtype != torch.bfloat16
        mode = weight.activations  # taken at install, checked there against the weight's input size
        self.round_in_torch = mode is ActivationMode.INT8 and not native_int8_blocks(weight)
        self.int8_blocks = mode is not ActivationMode.FLOAT and not self.round_in_torch

    @property
    def fusable(self) -> bool:
        """Whether the fused decode layer's kernel takes this weight as the module path runs it (not an
        FP8 byte table; act-order inputs it gathers as `run_linear_q` does, from the weight's
        native_parts)."""
        return self.native

    def multiply(
        self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        ops = native.kernels()  # None where a caller turned them off: the definition runs
        if ops is not None and self.fp8:
            return fp8_linear.fp8_linear(ops, x, weight, bias)
        if ops is None or not self.native:
            return reference_linear(x, weight, bias)
        return run_linear_q(ops, x, weight, bias, self.bf16_gemm, self.int8_blocks, self.round_in_torch)

    def weight_matrix(self, weight: Any, out_features: int) -> torch.Tensor:
        return weight.dequantize()


class GGUFLinear(QuantizedLinearMethod):
    """A GGUF file's blocks kept as they are (Q4_0, Q4_K, Q6_K, Q8_0, ...: affine codes, any group)."""

    name = "gguf"
    bits = (4, 5, 6, 8)  # 5-bit: Q5_0 / Q5_1 / Q5_K; 6-bit: Q6_K
    levels = True  # MXFP4 (gpt-oss's experts): 4-bit codes into the E2M1 table


class Int8Linear(QuantizedLinearMethod):
    """int8 at load: 8-bit codes, float activations unless quant_activations rounds them."""

    name = "int8"
    bits = (8,)


class Int4Linear(QuantizedLinearMethod):
    """int4 at load: 4-bit codes (5-bit where mixed precision widened a weight; 6- or 8-bit tables)."""

    name = "int4"
    bits = (4, 5, 6, 8)


class NF4Linear(QuantizedLinearMethod):
    """QLoRA's NF4: 4-bit codes into 16 NormalFloat levels (the table scaled per group)."""

    name = "nf4"
    bits = (4, 5, 6, 8)  # 5-bit affine codes where mixed precision widened a weight
    levels = True  # 6- or 8-bit affine codes too: the embedding table and LM head


class W8A8Linear(QuantizedLinearMethod):
    """W8A8: 8-bit codes and int8 activations, per token or in blocks, as the weight's `act` says."""

    name = "w8a8"
    bits = (8,)
    acts = ("int8", "int8_block", "float")  # float: the embedding table and LM head


class AWQLinear(QuantizedLinearMethod):
    """AWQ checkpoints: codes repacked into Q4_0's nibble order (or 8-bit codes), zero points as mins."""

    name = "awq"
    bits = (4, 6, 8)  # 6 / 8: the embedding table and LM head quantized at load (quant/loading.packed_head)


class GPTQLinear(QuantizedLinearMethod):
    """GPTQ checkpoints: 4- or 8-bit codes; with act-order every product (module path, fused decode
    layer, experts, int8 GEMMs) gathers x's columns into the codes' order first."""

    name = "gptq"
    bits = (4, 6, 8)  # 6: the embedding table and LM head quantized at load (quant/loading.packed_head)
    input_order = True



class CompressedTensorsLinear(QuantizedLinearMethod):
    """compressed-tensors checkpoints: int4 / int8 packs (W8A8 with int8 activations), and FP8 e4m3
    bytes as a 256-level table, which only the plain-torch product takes."""

    name = "compressed-tensors"
    bits = (4, 6, 8)  # 6: the embedding table and LM head quantized at load (quant/loading.packed_head)
    levels = True
    input_order = True  # actorder "group"
    acts = ("float", "int8", "int8_block")


class MXFP4Linear(QuantizedLinearMethod):
    """MXFP4 checkpoints (gpt-oss's experts): 4-bit E2M1 codes into a 16-level table, scaled by a power of
    two per 32 weights (`quant/mxfp4.py`)."""

    name = "mxfp4"
    bits = (4, 6, 8)  # 6 / 8: the embedding table and LM head, where quantization's lm_head asks
    levels = True


class FP8BlockLinear(QuantizedLinearMethod):
    """Block-quantized FP8 checkpoints (DeepSeek-V3's): e4m3 bytes as a 256-level table, each row scaled
    per group of its block's columns (`quant/formats/fp8_blocks.py`); the plain-torch product takes them."""

    name = "fp8"
    bits = (6, 8)  # 6: the embedding table and LM head, where quantization's lm_head asks
    levels = True


QUANTIZED_METHODS: tuple[type[QuantizedLinearMethod], ...] = (
    GGUFLinear, Int8Linear, Int4Linear, NF4Linear, W8A8Linear, AWQLinear, GPTQLinear, CompressedTensorsLinear,
    MXFP4Linear, FP8BlockLinear,
)
