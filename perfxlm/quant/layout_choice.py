"""Which code layout (perfxlm/quant/layouts.py) a loaded model's quantized weights take: the CPU plan's
`row_groups` and `row_groups_k` name them (`layouts.all_for_plan`, and `few_rows_for_plan` for weights that
take few rows), `choose_layouts` applies them once the weights are final.

Few rows: a module whose class sets `few_rows = True` (the LM head: only each sequence's last rows reach
it in a step). K-quant row groups go there under `row_groups_k` "head", to every K-quant matrix under
"all"; the rule is the plan's, not a branch in the products."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from perfxlm.quant.layouts import CodeLayout, members
from perfxlm.quant.split_rows import SplitRows
from perfxlm.quant.weight import ActivationMode, QuantizedWeight


def choose_layouts(model: torch.nn.Module, layout: CodeLayout | Sequence[CodeLayout],
                   few_rows: CodeLayout = CodeLayout.PLAIN) -> int:
    """Put every quantized weight of `model` into the first of `layout` (one or several) that takes it, once the weights are final (after
    fusing rows, act-order, tensor-parallel cuts: all read the plain layout); returns how many. A weight
    shared by modules (a tied LM head is the embedding table) is packed once and stays shared. Only
    weights whose activations are rounded to int8 blocks (not ActivationMode.FLOAT): the layouts past
    PLAIN are int8-block products."""
    layouts = [layout] if isinstance(layout, CodeLayout) else list(layout)
    if all(x is CodeLayout.PLAIN for x in layouts) and few_rows is CodeLayout.PLAIN:
        return 0
    # a weight shared with a few-row module (a tied head's table) is the head's: its layout serves lookups too
    heads = {id(v) for m in model.modules() if getattr(m, "few_rows", False) for v in vars(m).values()
             if isinstance(v, QuantizedWeight)}  # fmt: skip
    done: dict[int, QuantizedWeight] = {}
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, SplitRows):  # each part its own layout (its own format)
                done[id(value)] = value.map(lambda p: chosen_layout(p, layouts))
            elif isinstance(value, QuantizedWeight):
                if id(value) not in done:
                    done[id(value)] = chosen_layout(value, [few_rows, *layouts] if id(value) in heads else layouts)
            else:
                continue
            setattr(module, name, done[id(value)])
    return sum(1 for w in done.values() for p in getattr(w, "parts", (w,)) if p.layout is not CodeLayout.PLAIN)


def chosen_layout(w: QuantizedWeight, layouts: list[CodeLayout]) -> QuantizedWeight:
    """`w` in the first of `layouts` that takes it (past PLAIN: int8-block products only), else as it is."""
    if w.layout is not CodeLayout.PLAIN or w.activations is ActivationMode.FLOAT:
        return w
    for member in (m for layout in layouts for m in members(layout)):
        if member is not CodeLayout.PLAIN and member.value.takes(w):
            return w.in_layout(member)
    return w
