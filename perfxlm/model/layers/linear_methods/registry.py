"""The one registry of linear methods, and the one place a layer's method is chosen (at load)."""

from __future__ import annotations

from typing import Any

from torch import nn

from perfxlm.model.layers.linear_methods.base import LinearMethod, LinearPlan, OwnsLinearMethod
from perfxlm.model.layers.linear_methods.quantized import QUANTIZED_METHODS
from perfxlm.model.layers.linear_methods.unquantized import (
    Bf16PanelsLinear, Bf16RowsLinear, UnquantizedLinear,
)  # fmt: skip
from perfxlm.model.layers.linear_methods.split_rows import SplitRowsLinear
from perfxlm.quant.split_rows import SplitRows, is_quantized

LINEAR_METHODS: dict[str, type[LinearMethod]] = {
    cls.name: cls for cls in (UnquantizedLinear, Bf16RowsLinear, Bf16PanelsLinear, *QUANTIZED_METHODS)
}


def method_for(weight: Any, plan: LinearPlan, panels: bool = True) -> LinearMethod:
    """A new method for a layer holding `weight`: the model's quantized format for a QuantizedWeight,
    else the float layout the plan names (`panels` False: a weight read by rows whatever the plan, as
    expert stacks are)."""
    if is_quantized(weight):
        name = plan.quantized_format
        if name is None:
            raise ValueError("a quantized weight in a model loaded without a quantized format")
    else:
        name = plan.float_method
        if name == "bf16_panels" and not panels:
            name = "bf16_rows"
    if name not in LINEAR_METHODS:
        raise ValueError(f"no linear method {name!r}; registered: {', '.join(LINEAR_METHODS)}")
    if isinstance(weight, SplitRows):  # parts of their own formats: the format's method per part
        return SplitRowsLinear(LINEAR_METHODS[name], len(weight.parts))
    return LINEAR_METHODS[name]()


def bind(model: nn.Module, plan: LinearPlan) -> None:
    """Give every layer that owns a linear method the method for what it holds now that its weights are
    in, and let the method put them in its layout. Called once, at load."""
    for module in list(model.modules()):
        if isinstance(module, OwnsLinearMethod):
            module.bind_linear_method(plan)
