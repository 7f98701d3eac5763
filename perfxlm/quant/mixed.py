"""Mixed precision, as llama.cpp's Q4_K_M does it: the projections whose errors hurt most get 8-bit codes.

llama.cpp's Q4_K_M stores the attention V projection and the FFN down projection at 6 bits in about
half the layers (`use_more_bits`: the first and last eighth of the layers, and every third one between)
and the rest at 4. The engine has 4- and 8-bit codes, so the chosen projections take 8-bit codes, one
symmetric scale per output channel (8 bits plus a float32 scale and min per row: 8.04 bits per weight
on a 1536-wide down projection).

Only projections stored on their own are widened. V lives inside the fused QKV weight, and a fused
weight takes one form for all its parts (`QuantizedWeight.common_form`): an 8-bit V would make q and k
8-bit too, 5x V's own weights on a GQA model like the default one (V is 3 % of a layer's weights, QKV
16 %), which would take int4 past Q4_K_M's bits per weight. So the FFN down projections of those layers
(a quarter of a Llama layer's weights, half of them widened: +0.36 bits per weight over all
projections) are the 8-bit ones, an MoE layer's down projections of all its experts likewise. Measured
on the default model's architecture (README): with calibration, int4's mean KL divergence from the
float model 0.081 -> 0.073 for that cost, and its perplexity unchanged.
"""

from __future__ import annotations

import re

WIDENED = ("down_proj", "fc2")  # the FFN's output projection under the engine's module names
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's rule (src/llama-quant.cpp): the layers whose V and down projections Q4_K_M widens."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def widened(names: list[str], targets: tuple[str, ...] = WIDENED) -> set[str]:
    """Of the quantized weights `names` ("model.layers.3.mlp.down_proj.weight", ...), those stored 8-bit."""
    layers = {layer_of(n) for n in names} - {None}
    if not layers:
        return set()
    num_layers = max(layers) + 1  # type: ignore[type-var]
    out = set()
    for name in names:
        layer = layer_of(name)
        parts = name.split(".")
        if layer is not None and any(t in parts for t in targets) and use_more_bits(layer, num_layers):
            out.add(name)
    return out
