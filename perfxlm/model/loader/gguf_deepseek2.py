"""DeepSeek-V2 / V3 GGUF files (llama.cpp's `deepseek2`, one architecture for both) back in Hugging Face
terms.

What differs from the llama layout:
- multi-head latent attention: `attn_q` (V2-Lite) or `attn_q_a` / `attn_q_a_norm` / `attn_q_b`,
  `attn_kv_a_mqa`, `attn_kv_a_norm`, and the latent's up-projection either whole (`attn_kv_b`, older
  converters) or split for llama.cpp's weight absorption: `attn_k_b` [H, kv_lora, nope] (each head's
  W_UK transposed) and `attn_v_b` [H, v, kv_lora], put back together into `kv_b_proj` here (`regroup`;
  a quantized pair is dequantized: the model keeps kv_b float, it is absorbed at the first step);
- the first `leading_dense_block_count` layers dense (`ffn_gate` / `ffn_up` / `ffn_down`), the others a
  router `ffn_gate_inp`, expert stacks `ffn_*_exps`, shared experts `ffn_*_shexp` and, for V3, the
  routing correction bias `exp_probs_b`;
- metadata: the converter writes `head_count_kv` 1 and `key_length` / `value_length` as the MQA view of
  the latent (kv_lora + rope, kv_lora); the heads' own sizes are `key_length_mla` / `value_length_mla`
  (older files: `key_length` / `value_length` are them), the rope width `rope.dimension_count`.
  `expert_gating_func` picks the family: softmax (or absent, as llama.cpp reads V2 files) is V2, sigmoid
  V3; groups (`expert_group_count` > 1) make V2's routing group-limited;
- rope: interleaved pairs in the file as in the checkpoint (the model reorders them at load); YaRN with
  DeepSeek's mscale, which the converter stores as `rope.scaling.yarn_log_multiplier` = 0.1 x mscale_all_dim
  (mscale taken equal to it, as in every DeepSeek checkpoint).
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import torch

from perfxlm.quant.weight import QuantizedWeight

TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{n}.attn_norm": "model.layers.{n}.input_layernorm",
    "blk.{n}.ffn_norm": "model.layers.{n}.post_attention_layernorm",
    "blk.{n}.attn_q": "model.layers.{n}.self_attn.q_proj",
    "blk.{n}.attn_q_a": "model.layers.{n}.self_attn.q_a_proj",
    "blk.{n}.attn_q_a_norm": "model.layers.{n}.self_attn.q_a_layernorm",
    "blk.{n}.attn_q_b": "model.layers.{n}.self_attn.q_b_proj",
    "blk.{n}.attn_kv_a_mqa": "model.layers.{n}.self_attn.kv_a_proj_with_mqa",
    "blk.{n}.attn_kv_a_norm": "model.layers.{n}.self_attn.kv_a_layernorm",
    "blk.{n}.attn_kv_b": "model.layers.{n}.self_attn.kv_b_proj",
    "blk.{n}.attn_k_b": "model.layers.{n}.self_attn.k_b_proj",
    "blk.{n}.attn_v_b": "model.layers.{n}.self_attn.v_b_proj",
    "blk.{n}.attn_output": "model.layers.{n}.self_attn.o_proj",
    "blk.{n}.ffn_gate": "model.layers.{n}.mlp.gate_proj",
    "blk.{n}.ffn_up": "model.layers.{n}.mlp.up_proj",
    "blk.{n}.ffn_down": "model.layers.{n}.mlp.down_proj",
    "blk.{n}.ffn_gate_inp": "model.layers.{n}.mlp.gate",
    "blk.{n}.exp_probs_b": "model.layers.{n}.mlp.gate.e_score_correction",
    "blk.{n}.ffn_gate_exps": "model.layers.{n}.mlp.experts.gate_proj",
    "blk.{n}.ffn_up_exps": "model.layers.{n}.mlp.experts.up_proj",
    "blk.{n}.ffn_down_exps": "model.layers.{n}.mlp.experts.down_proj",
    "blk.{n}.ffn_gate_shexp": "model.layers.{n}.mlp.shared_experts.gate_proj",
    "blk.{n}.ffn_up_shexp": "model.layers.{n}.mlp.shared_experts.up_proj",
    "blk.{n}.ffn_down_shexp": "model.layers.{n}.mlp.shared_experts.down_proj",
}

KEYS: dict[str, str] = {
    "attention.q_lora_rank": "q_lora_rank",
    "attention.kv_lora_rank": "kv_lora_rank",
    "rope.dimension_count": "qk_rope_head_dim",
    "expert_count": "n_routed_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_count": "n_shared_experts",
    "expert_weights_scale": "routed_scaling_factor",
    "leading_dense_block_count": "first_k_dense_replace",
}

# read by `apply` or by the table above
EXTRA_KEYS = frozenset({
    *KEYS, "attention.key_length_mla", "attention.value_length_mla", "expert_weights_norm", "expert_gating_func",
    "expert_group_count", "expert_group_used_count", "rope.scaling.yarn_log_multiplier",
    "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
})  # fmt: skip

CONFIG_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "attention_bias": False, "n_shared_experts": 0, "first_k_dense_replace": 0,
    "routed_scaling_factor": 1.0, "q_lora_rank": None, "rope_interleave": True, "aux_loss_alpha": 0.0,
}  # fmt: skip

ROPE_SCALING_TYPES = ("none", "yarn")
GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE values


def variant(meta: dict[str, Any]) -> tuple[str, str]:
    """(model_type, architecture): V2's softmax routing or V3's sigmoid, by `expert_gating_func`."""
    func = meta.get("deepseek2.expert_gating_func", 1)
    if func not in GATING:
        raise ValueError(
            f"GGUF metadata deepseek2.expert_gating_func={func!r} is not supported; supported: "
            f"{', '.join(f'{k} ({v})' for k, v in GATING.items())}."
        )
    return ("deepseek_v3", "DeepseekV3ForCausalLM") if GATING[func] == "sigmoid" else (
        "deepseek_v2", "DeepseekV2ForCausalLM")  # fmt: skip


def apply(meta: dict[str, Any], kwargs: dict[str, Any]) -> int:
    """The latent attention's sizes and the routing into the config's fields; returns the rope head
    size (transformers' `head_dim` for these families)."""

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"deepseek2.{key}", default)
        return value[0] if isinstance(value, list) and value else value

    rope = kwargs.get("qk_rope_head_dim")
    if rope is None or "kv_lora_rank" not in kwargs:
        raise ValueError("GGUF deepseek2 file lacks deepseek2.rope.dimension_count or attention.kv_lora_rank.")
    mla = get("attention.key_length_mla") is not None
    qk_head = get("attention.key_length_mla") if mla else get("attention.key_length")
    v_head = get("attention.value_length_mla") if mla else get("attention.value_length")
    if qk_head is None or v_head is None:
        raise ValueError("GGUF deepseek2 file lacks the heads' key and value sizes (attention.key_length_mla).")
    kwargs["qk_nope_head_dim"], kwargs["v_head_dim"] = int(qk_head) - int(rope), int(v_head)
    kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # the file's 1 is MLA's MQA view
    kwargs["q_lora_rank"] = int(kwargs["q_lora_rank"]) if kwargs.get("q_lora_rank") else None
    kwargs["moe_intermediate_size"] = kwargs.get("moe_intermediate_size") or kwargs.get("intermediate_size")
    if "n_routed_experts" not in kwargs:  # dense only: every layer the leading dense kind
        kwargs["n_routed_experts"] = None
        kwargs["first_k_dense_replace"] = int(kwargs["num_hidden_layers"])
    groups, used = int(get("expert_group_count", 1) or 1), int(get("expert_group_used_count", 1) or 1)
    kwargs["n_group"], kwargs["topk_group"] = groups, used
    norm = bool(get("expert_weights_norm", False))
    kwargs["norm_topk_prob"] = norm
    if GATING[get("expert_gating_func", 1)] == "sigmoid":
        kwargs["topk_method"] = "noaux_tc"
    else:
        if norm:  # DeepSeek-V2 never renormalises its softmax weights (transformers' V2 has no such option)
            raise ValueError("GGUF metadata deepseek2.expert_weights_norm=true with softmax gating is not "
                             "supported; supported: false (DeepSeek-V2's routing).")  # fmt: skip
        kwargs["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    return int(rope)


def apply_rope(meta: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """DeepSeek's YaRN: factor, original context, betas and mscale = mscale_all_dim."""
    if meta.get("deepseek2.rope.scaling.type") != "yarn":
        return
    params = {
        "rope_type": "yarn", "rope_theta": kwargs["rope_theta"],
        "factor": float(meta["deepseek2.rope.scaling.factor"]),
        "original_max_position_embeddings": int(meta["deepseek2.rope.scaling.original_context_length"]),
        "beta_fast": float(meta.get("deepseek2.rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(meta.get("deepseek2.rope.scaling.yarn_beta_slow", 1.0)),
    }  # fmt: skip
    log_mul = meta.get("deepseek2.rope.scaling.yarn_log_multiplier")
    if log_mul is not None:
        params["mscale"] = params["mscale_all_dim"] = float(log_mul) / 0.1
    kwargs["rope_parameters"] = params
    kwargs.pop("rope_scaling", None)  # one spelling: the rotary layer reads rope_parameters


_SPLIT_KV_B = re.compile(r"^(?P<attn>.+\.self_attn)\.(?P<part>k_b_proj|v_b_proj)\.weight$")
_BIAS = re.compile(r"\.mlp\.gate\.e_score_correction\.bias$")


def _dense(t: Any) -> torch.Tensor:
    return t.dense() if isinstance(t, QuantizedWeight) else t.float()


def regroup(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """`attn_k_b` [H, kv_lora, nope] and `attn_v_b` [H, v, kv_lora] -> `kv_b_proj` [H (nope + v), kv_lora]
    (per head: W_UK's rows, then W_UV's); the correction bias under its checkpoint name."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        if _BIAS.search(name):
            yield name.replace(".e_score_correction.bias", ".e_score_correction_bias"), tensor
            continue
        m = _SPLIT_KV_B.match(name)
        if m is None:
            yield name, tensor
            continue
        parts = waiting.setdefault(m["attn"], {})
        parts[m["part"]] = _dense(tensor)
        if len(parts) < 2:
            continue
        del waiting[m["attn"]]
        k_b, v_b = parts["k_b_proj"], parts["v_b_proj"]
        if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
            raise ValueError(f"GGUF deepseek2 attn_k_b {list(k_b.shape)} and attn_v_b {list(v_b.shape)} of "
                             f"{m['attn']} do not fit [heads, kv_lora, nope] / [heads, v, kv_lora].")  # fmt: skip
        kv_b = torch.cat((k_b.transpose(1, 2), v_b), dim=1)
        yield f"{m['attn']}.kv_b_proj.weight", kv_b.reshape(-1, kv_b.shape[-1]).contiguous()
    if waiting:
        raise ValueError(f"GGUF deepseek2 file has attn_k_b or attn_v_b without the other: {sorted(waiting)[:3]}")
