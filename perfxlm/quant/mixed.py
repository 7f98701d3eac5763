"""Mixed precision, as llama.cpp's Q4_K_M allocates bits: 5-bit codes where Q4_K_M spends more than 4.5
bits on a tensor, 4-bit codes elsewhere.

llama.cpp's Q4_K_M (src/llama-quant.cpp) stores most tensors as Q4_K (4.5 bits per weight), the attention
V projection and the FFN down projection at Q6_K (6.56) in about half the layers (`use_more_bits`: the
first and last eighth of the layers, and every third one between), and falls back to Q5_0 (5.5) for a
Q4_K tensor and to Q8_0 (8.5) for a Q6_K one whose rows are not whole 256-value super-blocks (on the
default model's architecture every projection but the FFN down one reads 576 inputs: most of its
"Q4_K_M" is Q5_0). The engine's forms with the same bits:
- 4-bit codes, a float16 scale and min per group of 32 searched for the least activation-weighted error
  (5 bits per weight) where Q4_K_M has Q4_K;
- 5-bit codes, one float16 scale per group of 32 (llama.cpp's Q5_0 form, 5.5 bits per weight), the scale
  searched the same way, everywhere Q4_K_M has more: its Q5_0 fallbacks and its widened V and down
  projections. The widened ones get 5 bits where Q4_K_M gives 6.56 or 8.5, which is what pays for the
  first form's 0.5 bit over Q4_K; earlier this engine gave them 8-bit codes (8.04 bits) and had no
  budget left for the rest.
V lives inside the fused QKV weight, which takes one code width for all its parts: QKV is 5-bit where
V would be widened (or where the rows do not fit K-quants), q and k with it.
An embedding table that is only looked up (untied from the LM head) follows the same rule (Q4_K_M's
token_embd is Q4_K, or Q5_0 where the rows do not fit); the LM head, or a table tied to it, stays 8-bit
as in every llama.cpp format (Q6_K or Q8_0).
"""

from __future__ import annotations

import re

WIDENED = ("down_proj", "fc2", "qkv_proj", "v_proj")  # Q4_K_M's widened tensors under the engine's names
K_QUANT_ROW = 256  # values per K-quant super-block: rows of other lengths fall back to Q5_0 / Q8_0
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's rule (src/llama-quant.cpp): the layers whose V and down projections Q4_K_M widens."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def code_bits(weights: dict[str, int], targets: tuple[str, ...] = WIDENED) -> dict[str, int]:
    """Quantized weights {name ("model.layers.3.mlp.down_proj.weight", ...): in_features} -> the code
    width of each (4 or 5) under Q4_K_M's allocation."""
    layers = {layer_of(n) for n in weights} - {None}
    num_layers = max(layers) + 1 if layers else 0  # type: ignore[type-var]
    out = {}
    for name, in_features in weights.items():
        layer = layer_of(name)
        parts = name.split(".")
        widened = layer is not None and any(t in parts for t in targets) and use_more_bits(layer, num_layers)
        out[name] = 5 if widened or in_features % K_QUANT_ROW else 4
    return out
