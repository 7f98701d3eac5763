"""GLM-4-0414 GGUF files (`glm4`) as llama.cpp's converter writes them, back in Hugging Face terms.

What differs from the llama layout: four norms per layer (each sublayer's output normed before its
residual add), the gate|up projection stored fused as `ffn_up` (the checkpoint's own `gate_up_proj`),
q/k/v biases, and rotary over part of each head: `rope.dimension_count` is the rotary width
(head_dim x partial_rotary_factor), not the head size. The converter leaves q/k rows as the checkpoint
has them (llama.cpp rotates GLM's interleaved pairs), so the model's own load-time reorder applies.
"""

from __future__ import annotations

from typing import Any

TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{n}.attn_q": "model.layers.{n}.self_attn.q_proj",
    "blk.{n}.attn_k": "model.layers.{n}.self_attn.k_proj",
    "blk.{n}.attn_v": "model.layers.{n}.self_attn.v_proj",
    "blk.{n}.attn_output": "model.layers.{n}.self_attn.o_proj",
    "blk.{n}.ffn_up": "model.layers.{n}.mlp.gate_up_proj",
    "blk.{n}.ffn_down": "model.layers.{n}.mlp.down_proj",
    "blk.{n}.attn_norm": "model.layers.{n}.input_layernorm",
    "blk.{n}.post_attention_norm": "model.layers.{n}.post_self_attn_layernorm",
    "blk.{n}.ffn_norm": "model.layers.{n}.post_attention_layernorm",
    "blk.{n}.post_ffw_norm": "model.layers.{n}.post_mlp_layernorm",
}

CONFIG_DEFAULTS: dict[str, Any] = {"hidden_act": "silu"}


def apply(meta: dict[str, Any], kwargs: dict[str, Any], head_dim: int) -> None:
    """The rotary width as Glm4Config's partial_rotary_factor (the converter writes head_dim x factor)."""
    rope_dim = meta.get("glm4.rope.dimension_count")
    rope_dim = int(rope_dim) if rope_dim is not None else head_dim // 2  # Glm4Config's default factor 0.5
    if not 0 < rope_dim <= head_dim or rope_dim % 2:
        raise ValueError(
            f"GGUF glm4.rope.dimension_count={rope_dim} must be an even width within the head size {head_dim}."
        )
    kwargs["partial_rotary_factor"] = rope_dim / head_dim
