"""Gemma 2 GGUF files as llama.cpp's converter writes them, back in Hugging Face terms.

What differs from the llama layout: four norms per layer, norm weights stored as (1 + w) (the converter
adds one; Gemma's RMSNorm adds it again at run time, so it is subtracted on load), no `output` tensor
(the head is tied), soft-caps and the sliding window as metadata, local/global layers alternating from
the first. The attention scale is not stored: llama.cpp derives it from the model size (hidden / heads
for the 27B model, 46 layers; head_dim otherwise), and so does this loader unless the file carries
`gemma2.attention.scale`.
"""

from __future__ import annotations

from typing import Any

TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "blk.{n}.attn_q": "model.layers.{n}.self_attn.q_proj",
    "blk.{n}.attn_k": "model.layers.{n}.self_attn.k_proj",
    "blk.{n}.attn_v": "model.layers.{n}.self_attn.v_proj",
    "blk.{n}.attn_output": "model.layers.{n}.self_attn.o_proj",
    "blk.{n}.ffn_gate": "model.layers.{n}.mlp.gate_proj",
    "blk.{n}.ffn_up": "model.layers.{n}.mlp.up_proj",
    "blk.{n}.ffn_down": "model.layers.{n}.mlp.down_proj",
    "blk.{n}.attn_norm": "model.layers.{n}.input_layernorm",
    "blk.{n}.post_attention_norm": "model.layers.{n}.post_attention_layernorm",
    "blk.{n}.ffn_norm": "model.layers.{n}.pre_feedforward_layernorm",
    "blk.{n}.post_ffw_norm": "model.layers.{n}.post_feedforward_layernorm",
}

# metadata keys beyond the llama-like decoder's that this translation reads
EXTRA_KEYS = frozenset({"attn_logit_softcapping", "final_logit_softcapping", "attention.sliding_window"})

CONFIG_DEFAULTS: dict[str, Any] = {
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
}  # fmt: skip

_LLAMA_CPP_27B_LAYERS = 46


def apply(meta: dict[str, Any], kwargs: dict[str, Any], head_dim: int) -> None:
    """Fill the Gemma 2 fields of `kwargs` from the file's metadata."""
    n_layers = int(kwargs["num_hidden_layers"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = meta.get(f"gemma2.{key}")
        kwargs[key] = float(value) if value else None
    window = meta.get("gemma2.attention.sliding_window")
    kwargs["sliding_window"] = int(window) if window else None
    # as Gemma2Config and llama.cpp: sliding-window attention on even layers, global on odd ones
    kwargs["layer_types"] = [
        "sliding_attention" if window and i % 2 == 0 else "full_attention" for i in range(n_layers)
    ]
    kwargs["query_pre_attn_scalar"] = query_pre_attn_scalar(meta.get("gemma2.attention.scale"), kwargs, head_dim,
                                                            n_layers == _LLAMA_CPP_27B_LAYERS)


def query_pre_attn_scalar(scale: Any, kwargs: dict[str, Any], head_dim: int, is_27b: bool) -> float:
    """The attention scale's inverse square: the file's, else llama.cpp's rule (hidden / heads for the
    27B model, whose layer count gives it away; head_dim otherwise)."""
    if scale is not None:
        return float(scale) ** -2
    if is_27b:
        return int(kwargs["hidden_size"]) // int(kwargs["num_attention_heads"])
    return head_dim
