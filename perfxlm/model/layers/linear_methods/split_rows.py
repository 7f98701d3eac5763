"""The linear method of a split weight (`perfxlm.quant.split_rows.SplitRows`: a fused projection whose
parts keep their own formats, as Q4_K q|k beside a Q6_K v): one method of the model's quantized format
per part, each deciding for its part as it would for a weight of its own, and a product that runs each
part's product into its columns of the output. The fused decode layer runs the same per-part calls
(csrc `project` on the split weight's native parts), so both give the same bits."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.model.layers.linear_methods.base import LinearMethod, LinearPlan
from perfxlm.model.layers.linear_methods.quantized import QuantizedLinearMethod


class SplitRowsLinear(LinearMethod):
    quantized = True

    def __init__(self, part_method: type[LinearMethod], parts: int) -> None:
        if not issubclass(part_method, QuantizedLinearMethod):
            raise ValueError(f"a split weight's parts run by a quantized format's method, not {part_method.name!r}")
        self.name = part_method.name  # the format's name: what export and stats read
        self.methods = [part_method() for _ in range(parts)]

    def process_after_loading(self, layer: nn.Module, plan: LinearPlan) -> None:
        weight = layer.weight
        if len(weight.parts) != len(self.methods):
            raise ValueError(f"{type(layer).__name__}: a split weight of {len(weight.parts)} parts, its method has "
                             f"{len(self.methods)}")
        for i, (method, part) in enumerate(zip(self.methods, weight.parts)):
            method.decide(part, plan, f"{type(layer).__name__} part {i}")

    @property
    def fusable(self) -> bool:
        return all(m.fusable for m in self.methods)

    @property
    def bf16_gemm(self) -> bool:
        return all(m.bf16_gemm for m in self.methods)

    def multiply(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        ys = [m.multiply(x, p, b, p.out_features) for m, p, b in zip(self.methods, weight.parts, weight.biases(bias))]
        return torch.cat(ys, -1)

    def weight_matrix(self, weight: Any, out_features: int) -> torch.Tensor:
        return weight.dequantize()
