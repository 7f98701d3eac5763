"""Float weights: in the activations' dtype, bf16 rows, or bf16 panels (ops/cpu_plan.py says which layout a
CPU gets for bf16 weights under float32 activations). The kernels are `perfxlm.ops.linear`'s."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.model.layers.linear_methods.base import LinearMethod, LinearPlan
from perfxlm.ops.linear import bf16_rows_linear, float_linear, pack_bf16, packed_linear, unpack_bf16


class UnquantizedLinear(LinearMethod):
    """W in the activations' dtype: torch's own linear (MKL / oneDNN). A weight stored in another dtype
    (a model run in a dtype it was not loaded for) is widened per call: correct and slow."""

    name = "float"

    def multiply(
        self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        return float_linear(x, weight, bias)


class Bf16RowsLinear(LinearMethod):
    """bf16 rows [N, K] under float32 activations: the native row kernel up to the plan's row limit,
    then torch's bf16 GEMM or MKL's float32 GEMM over widened slabs (`ops.linear.bf16_rows_linear`). A
    tied LM head keeps sharing the embedding's Parameter (cast in place)."""

    name = "bf16_rows"

    def process_after_loading(self, layer: nn.Module, plan: LinearPlan) -> None:
        if layer.weight.dtype != torch.bfloat16:  # .data: a tied head keeps sharing the table's Parameter
            layer.weight.data = layer.weight.data.to(torch.bfloat16)

    def multiply(
        self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return bf16_rows_linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


class Bf16PanelsLinear(LinearMethod):
    """bf16 packed panels [ceil(N/16), K, 16] under float32 activations (AVX-512 without bf16
    arithmetic): the native panel kernel for few rows, widened slabs under MKL for many. A tied LM head
    gets its own packed copy (the embedding needs rows)."""

    name = "bf16_panels"

    def process_after_loading(self, layer: nn.Module, plan: LinearPlan) -> None:
        if layer.weight.dim() != 3:
            layer.weight = nn.Parameter(pack_bf16(layer.weight.data.to(torch.bfloat16)), requires_grad=False)

    def multiply(
        self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        return packed_linear(x, weight, bias, out_features)

    def weight_matrix(self, weight: Any, out_features: int) -> torch.Tensor:
        return unpack_bf16(weight, out_features)

