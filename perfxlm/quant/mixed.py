"""Mixed precision, as llama.cpp's Q4_K_M allocates bits, at no more bits per weight than it.

llama.cpp's Q4_K_M (src/llama-quant.cpp) stores most tensors as Q4_K (4.5 bits per weight), the attention
V projection and the FFN down projection at Q6_K (6.56) in about half the layers (`use_more_bits`: the
first and last eighth of the layers, and every third one between), and falls back to Q5_0 (5.5) for a
Q4_K tensor and to Q8_0 (8.5) for a Q6_K one whose rows are not whole 256-value super-blocks (on the
default model's architecture every projection but the FFN down one reads 576 inputs: most of its
"Q4_K_M" is Q5_0, its widened V Q8_0). The engine's forms:
- 4-bit codes, a scale and min per group of 32 searched for the least activation-weighted error where
  Q4_K_M has Q4_K (which needs rows of whole 256s there too): held as Q4_K holds them, bytes x float16
  per 256 (`perfxlm.quant.two_level`, 4.625 bits per weight), or float16 (5 bits) with `super_blocks`
  off;
- 5-bit codes, one float16 scale per group of 32 (llama.cpp's Q5_0 form, 5.5 bits per weight), the scale
  searched the same way (`perfxlm.quant.search.search_centred`), where Q4_K_M falls back to Q5_0 and for
  its widened down projections (Q6_K there);
- 8-bit codes, one float16 scale per 32 (Q8_0's form, 8.5 bits), for the widened V where Q4_K_M too falls
  back to Q8_0. V lives inside the fused QKV, which takes one code width for all its parts, so q and k
  are 8-bit with it. Measured on the default model turned off its 4-bit grid (README): V is the most
  sensitive weight by far (V in float in those 14 of 30 layers takes a fifth off the KL divergence, the
  down projections in float 7 %), which is why Q4_K_M widens it.
An embedding table that is only looked up (untied from the LM head) takes 4-bit codes (Q4_K_M's
token_embd is Q4_K; where its rows do not fit, Q5_0): its error costs little (measured: 5-bit to 4-bit
adds 4 % to the KL divergence, widening V takes 21 % off) and its 0.5 bit per weight pays for the 8-bit
QKV. The LM head, or a table tied to it, stays 8-bit as in every llama.cpp format (Q6_K or Q8_0).
"""

from __future__ import annotations

import re

DOWN = ("down_proj", "fc2")  # the FFN down projection under the engine's names
VALUE = ("qkv_proj", "v_proj")  # the attention V projection, alone or inside the fused QKV
WIDENED = DOWN + VALUE  # Q4_K_M's widened tensors
K_QUANT_ROW = 256  # values per K-quant super-block: rows of other lengths fall back to Q5_0 / Q8_0
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's rule (src/llama-quant.cpp): the layers whose V and down projections Q4_K_M widens."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def code_bits(
    weights: dict[str, int], targets: tuple[str, ...] = WIDENED, tables: frozenset[str] | set[str] = frozenset()
) -> dict[str, int]:
    """Quantized weights {name ("model.layers.3.mlp.down_proj.weight", ...): in_features} -> the code
    width of each (4, 5 or 8) under Q4_K_M's allocation. `tables`: the names among them of embedding
    tables that are only looked up (Q4_K_M's token_embd: 4 bits)."""
    layers = {layer_of(n) for n in weights} - {None}
    num_layers = max(layers) + 1 if layers else 0  # type: ignore[type-var]
    out = {}
    for name, in_features in weights.items():
        if name in tables:
            out[name] = 4
            continue
        layer = layer_of(name)
        parts = name.split(".")
        widened = layer is not None and any(t in parts for t in targets) and use_more_bits(layer, num_layers)
        if widened and any(t in parts for t in VALUE) and in_features % K_QUANT_ROW:
            out[name] = 8  # Q4_K_M's Q6_K V falls back to Q8_0 here
        else:
            out[name] = 5 if widened or in_features % K_QUANT_ROW else 4
    return out
