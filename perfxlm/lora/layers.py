"""`LoRALinear`: a base projection with the step's adapters added to its output.

`wrap_model` puts one around every projection an adapter may target, after the weights are loaded.
The base projection is untouched (float, bf16 or quantized: its own kernel runs first); the adapters'
products come from the step's `LoRABatch` (perfxlm/lora/slots.py), which the runner sets on the forward
context only when a row of the step has an adapter, so a step without one costs a context lookup per
projection. The wrapper shows the base's `weight`, `bias` and sizes, so whoever describes the model's
weights (the fused decode layer) sees the base projection; the fused layer adds the same adapter
products itself after each of its projections (LoRABatch.operands), in the same order as `forward`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.lora.targets import LoRATargets
from perfxlm.model.forward_context import get_forward_context
from perfxlm.model.layers.linear import Linear


class LoRALinear(nn.Module):
    def __init__(self, base: Linear, name: str) -> None:
        super().__init__()
        self.base = base
        self.name = name  # the target's module name, as adapters are keyed
        self.packed: Any = None  # slots.PackedLoRA: the adapters in the runner's slots, set by LoRASlots

    # the base projection's description, for code that reads the weights (fused decode, quantization)
    @property
    def weight(self) -> Any:
        return self.base.weight

    @property
    def bias(self) -> Any:
        return self.base.bias

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def reduces_output(self) -> bool:
        return self.base.reduces_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = get_forward_context().lora
        if batch is None:  # no row of this step has an adapter
            return out
        return batch.add(self, x, out)


def wrap_model(model: nn.Module) -> tuple[LoRATargets, list[LoRALinear]]:
    """Wrap every projection an adapter may target; (the targets, the wrappers in module order)."""
    targets = LoRATargets.of(model)
    wrappers = []
    modules = dict(model.named_modules())
    for name in targets.modules:
        parent_name, local = name.rsplit(".", 1)
        wrapper = LoRALinear(modules[name], name)
        setattr(modules[parent_name], local, wrapper)
        wrappers.append(wrapper)
    return targets, wrappers
