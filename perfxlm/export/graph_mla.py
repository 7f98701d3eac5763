"""Multi-head latent attention (DeepSeek-V2/V3) in standard ONNX ops, over a latent cache.

The graph keeps the engine's cache (model/layers/mla.py): per token and layer one latent row, the normed
kv_lora_rank values and the rotated shared key, as one KV head of kv_lora_rank + qk_rope_head_dim channels;
the per-head keys and values are never expanded. kv_b_proj's halves are folded in as the engine folds them
("weight absorption"): W_UK into each head's query before attention, W_UV onto its output after it. So
attention is multi-query attention over the latent, whose value is the key row itself: the past and
present `value` of a layer repeat its `key` (onnxruntime-genai's layout has one head size for both)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from perfxlm.export.graph_values import AttentionSpec


@dataclass
class LatentWeights:
    num_heads: int
    nope_dim: int  # per head: query / key channels without rotary
    rope_dim: int  # per head: rotary channels (the key's shared by all heads)
    v_dim: int
    kv_lora_rank: int
    scale: float
    q: Any  # LinearWeight of q_proj, or None where the query has its bottleneck:
    q_a: Any  # q_a_proj, RMSNorm (weight, eps), q_b_proj
    q_a_norm: tuple[np.ndarray, float] | None
    q_b: Any
    kv_a: Any  # kv_a_proj_with_mqa: [latent | rope] rows
    kv_a_norm: tuple[np.ndarray, float]
    w_uk: np.ndarray  # [H, nope, kv_lora]
    w_uv_t: np.ndarray  # [H, kv_lora, v]
    o: Any

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim


class LatentAttentionOps:
    """Mixed into GraphOps: `latent_attention` from its linear, norm, rotary and attention ops."""

    g: Any

    def latent_attention(self, h: str, w: LatentWeights, rope: Any, cache: tuple[str, str], layer: int,
                         name: str) -> str:
        """The layer's normed input in, o_proj's output out; the latent cache written as layer `layer`'s
        present key (and value)."""
        g = self.g
        heads, nope, r, rank = w.num_heads, w.nope_dim, w.rope_dim, w.kv_lora_rank
        if w.q is not None:
            q = self.linear(h, w.q)  # type: ignore[attr-defined]
        else:
            qa = self.linear(h, w.q_a)  # type: ignore[attr-defined]
            q = self.linear(self.rms_norm(qa, *w.q_a_norm, f"{name}.q_a_layernorm"), w.q_b)  # type: ignore[attr-defined]
        q_nope, q_pe = g.op("Split", [g.op("Reshape", [q, g.const([0, 0, heads, nope + r])]), g.const([nope, r])],
                            num_outputs=2, axis=-1)
        q_pe = self.rotary(g.op("Reshape", [q_pe, g.const([0, 0, heads * r])]), heads, r, rope)  # type: ignore[attr-defined]
        latent, k_pe = g.op("Split", [self.linear(h, w.kv_a), g.const([rank, r])], num_outputs=2, axis=-1)  # type: ignore[attr-defined]
        latent = self.rms_norm(latent, *w.kv_a_norm, f"{name}.kv_a_layernorm")  # type: ignore[attr-defined]
        k_pe = self.rotary(k_pe, 1, r, rope)  # type: ignore[attr-defined]
        # each head's query in latent space: q_nope W_UK[h] ([b, H, s, nope] x [H, nope, rank])
        w_uk = g.weight(f"{name}.w_uk", w.w_uk)
        q_latent = g.op("MatMul", [g.op("Transpose", [q_nope], perm=[0, 2, 1, 3]), w_uk])
        query = g.op("Concat", [g.op("Transpose", [q_latent], perm=[0, 2, 1, 3]),
                                g.op("Reshape", [q_pe, g.const([0, 0, heads, r])])], axis=-1)
        query = g.op("Reshape", [query, g.const([0, 0, heads * w.latent_dim])])
        key = g.op("Concat", [latent, k_pe], axis=-1)  # [b, s, rank + rope]: the cached row
        spec = AttentionSpec(heads, 1, w.latent_dim, w.scale, None)
        out, present_k, present_v = self.attention(query, key, key, cache[0], cache[1], spec, None,  # type: ignore[attr-defined]
                                                   f"{name}.attn")
        g.rename(present_k, f"present.{layer}.key")
        g.rename(present_v, f"present.{layer}.value")
        # the latent part of each head's output, through W_UV[h]: [b, H, s, rank] x [H, rank, v]
        out = g.op("Slice", [g.op("Reshape", [out, g.const([0, 0, heads, w.latent_dim])]), g.const([0]),
                             g.const([rank]), g.const([-1])])
        out = g.op("MatMul", [g.op("Transpose", [out], perm=[0, 2, 1, 3]), g.weight(f"{name}.w_uv_t", w.w_uv_t)])
        out = g.op("Reshape", [g.op("Transpose", [out], perm=[0, 2, 1, 3]), g.const([0, 0, heads * w.v_dim])])
        return self.linear(out, w.o)  # type: ignore[attr-defined]
