"""`LinearMethod`: how one layer stores its weight and computes x W^T + b, chosen once at load.

A layer that multiplies by a weight (Linear and its fused kinds, the LM head, MoE expert stacks) holds
one method object. The model is built with the float method (`create_weights`: an empty [N, K]
Parameter the checkpoint streams into, or that the quantized-weight sink replaces); once every weight
is in, `registry.bind` picks each layer's method from the one registry by what the layer holds (a
`QuantizedWeight` of the model's format, else the float layout the plan names) and calls its
`process_after_loading(layer, plan)`, which puts the weight in the layout its kernel takes and decides
everything that depends only on the weight (which kernel, whether activations are rounded in torch
first, whether many rows may run the CPU's bf16 GEMM). `apply(layer, x, bias)` then runs that kernel:
nothing is derived from the weight's type, rank or dtype per call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from perfxlm.model.layers.activation import get_activation


@dataclass(frozen=True)
class LinearPlan:
    """What a model's layers get their methods by, fixed for one load.

    `weight_dtype` / `compute_dtype`: how float weights are stored and what activations are (bf16
    weights under float32 compute take the `layout` the CPU plan names: "rows" or "panels");
    `quantized_format`: the registry name of the model's quantized weights ("gguf", "int8", "int4",
    "nf4", "w8a8", "awq", "gptq", "compressed-tensors", "mxfp4", "fp8"), or None where none stay quantized."""

    weight_dtype: torch.dtype
    compute_dtype: torch.dtype
    layout: str = "rows"
    quantized_format: str | None = None

    @property
    def float_method(self) -> str:
        """The registry name for a weight that stays float under this plan."""
        if self.weight_dtype == self.compute_dtype:
            return "float"
        if self.weight_dtype == torch.bfloat16 and self.compute_dtype == torch.float32:
            return "bf16_panels" if self.layout == "panels" else "bf16_rows"
        return "float"  # another storage dtype: widened per call (correct and slow)


class LinearMethod(ABC):
    """One weight format's storage and product; one instance per layer (it holds that layer's choices)."""

    name: ClassVar[str]
    quantized: ClassVar[bool] = False

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        """The layer's float placeholders: every format loads through them (a quantized format's sink
        replaces `weight` as its checkpoint tensors arrive), so building a model reads no format."""
        layer.in_features = in_features
        layer.out_features = out_features
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def process_after_loading(self, layer: nn.Module, plan: LinearPlan) -> None:
        """Put `layer.weight` in this method's layout and decide what depends only on it. Default: as
        loaded."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype (LM heads widen their logits themselves)."""
        return self.multiply(x, layer.weight, bias, layer.out_features)

    def apply_add(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
    ) -> torch.Tensor:
        """x W^T + b + residual (a post-norm block's sum before its LayerNorm). Default: the product, then
        the sum; a method whose product ends in a pass over its output adds the residual there."""
        return self.apply(layer, x, bias) + residual

    def apply_act(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
        """act(x W^T + b), `act` a transformers `hidden_act` name (an encoder's up projection). Default: the
        product, then the activation's pass; a method whose product ends in a pass over its output applies
        the activation there."""
        return get_activation(act)(self.apply(layer, x, bias))

    @abstractmethod
    def multiply(
        self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        """x W^T + b for a weight in this method's layout (the layer's, or one expert's of a stack)."""

    def weight_matrix(self, weight: Any, out_features: int) -> torch.Tensor:
        """W as a plain [N, K] tensor, for code that uses W otherwise than in x W^T (MLA)."""
        return weight


@runtime_checkable
class OwnsLinearMethod(Protocol):
    """A layer with a linear method (Linear, LMHead, FusedMoE): it picks its method(s) for what it holds
    once its weights are in (`registry.method_for`) and lets them process the weights."""

    def bind_linear_method(self, plan: LinearPlan) -> None: ...
