"""Gemma 3 (text) GGUF files as llama.cpp's converter writes them, back in Hugging Face terms.

Gemma 2's layout (four (1 + w) norms per layer, the tied head) plus (1 + w) q/k head norms. What the file
does not say, llama.cpp fixes and so does this loader: five local layers to one global (its swa pattern
of 6, Gemma3TextConfig's default), local layers rotating with base 10000 unscaled, the global ones with
`gemma3.rope.freq_base` and the file's rope scaling, and the attention scale from the size as for
Gemma 2 (hidden / heads for the 27B model, 62 layers; head_dim otherwise) unless `gemma3.attention.scale`
is stored.
"""

from __future__ import annotations

from typing import Any

from perfxlm.model.loader import gguf_gemma2

TENSORS: dict[str, str] = {
    **gguf_gemma2.TENSORS,
    "blk.{n}.attn_q_norm": "model.layers.{n}.self_attn.q_norm",
    "blk.{n}.attn_k_norm": "model.layers.{n}.self_attn.k_norm",
}

EXTRA_KEYS = frozenset({"attention.sliding_window"})

CONFIG_DEFAULTS = gguf_gemma2.CONFIG_DEFAULTS

_SLIDING_WINDOW_PATTERN = 6
_LOCAL_ROPE_THETA = 10000.0
_LLAMA_CPP_27B_LAYERS = 62


def apply(meta: dict[str, Any], kwargs: dict[str, Any], head_dim: int) -> None:
    """Fill the Gemma 3 fields of `kwargs` from the file's metadata; `kwargs["rope_parameters"]` (the
    global layers') becomes the per-layer-type dict Gemma3TextConfig holds."""
    n_layers = int(kwargs["num_hidden_layers"])
    window = meta.get("gemma3.attention.sliding_window")
    kwargs["sliding_window"] = int(window) if window else None
    kwargs["layer_types"] = [
        "sliding_attention" if window and (i + 1) % _SLIDING_WINDOW_PATTERN else "full_attention"
        for i in range(n_layers)
    ]
    kwargs["attn_logit_softcapping"] = kwargs["final_logit_softcapping"] = None
    kwargs["query_pre_attn_scalar"] = gguf_gemma2.query_pre_attn_scalar(
        meta.get("gemma3.attention.scale"), kwargs, head_dim, n_layers == _LLAMA_CPP_27B_LAYERS)
    kwargs["rope_parameters"] = {
        "full_attention": kwargs["rope_parameters"],
        "sliding_attention": {"rope_type": "default", "rope_theta": _LOCAL_ROPE_THETA},
    }
    kwargs.pop("rope_scaling", None)  # the global layers' only: it lives in rope_parameters now
