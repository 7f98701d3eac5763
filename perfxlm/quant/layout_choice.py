"""Which code layout (perfxlm/quant/layouts.py) a loaded model's quantized weights take: the CPU plan's
`row_groups` names it, `choose_layouts` applies it once the weights are final."""

from __future__ import annotations

import torch

from perfxlm.quant.layouts import CodeLayout
from perfxlm.quant.weight import ActivationMode, QuantizedWeight


def choose_layouts(model: torch.nn.Module, layout: CodeLayout) -> int:
    """Put every quantized weight of `model` that `layout` takes into it, once the weights are final (after
    fusing rows, act-order, tensor-parallel cuts: all read the plain layout); returns how many. A weight
    shared by modules (a tied LM head is the embedding table) is packed once and stays shared. Only
    weights whose activations are rounded to int8 blocks (not ActivationMode.FLOAT): the layouts past
    PLAIN are int8-block products."""
    if layout is CodeLayout.PLAIN:
        return 0
    done: dict[int, QuantizedWeight] = {}
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if not isinstance(value, QuantizedWeight):
                continue
            if id(value) not in done:
                ok = value.layout is CodeLayout.PLAIN and value.activations is not ActivationMode.FLOAT
                done[id(value)] = value.in_layout(layout) if ok and layout.value.takes(value) else value
            setattr(module, name, done[id(value)])
    return sum(1 for k, w in done.items() if w.layout is layout)
