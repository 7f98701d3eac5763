"""gpt-oss GGUF files (`gpt-oss`) as llama.cpp's converter writes them, back in Hugging Face terms.

What differs from the llama layout:
- every layer a mixture of experts with biases: the router `ffn_gate_inp` (weight and bias) and the
  expert stacks `ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps` [E, rows, cols] with a bias stack each,
  the converter's split of the checkpoint's interleaved gate|up columns. They are put back together here
  (`regroup`): gate and up rows interleaved into one `gate_up_proj` stack, as the model multiplies it.
  MXFP4 stacks stay packed (`quant/mxfp4.py`); float ones are handed over in transformers' x @ W layout,
  as a checkpoint holds them (the model transposes float stacks as they load);
- the post-attention norm is `post_attention_norm` (llama's `ffn_norm` name is not used);
- `attn_sinks`: one sink logit per head;
- sliding-window and full layers alternate (llama.cpp's swa pattern 2: even layers slide, as
  transformers' default `layer_types`), the window from `attention.sliding_window`;
- YaRN rope scaling, which gpt-oss applies without truncating the correction range (transformers'
  `truncate: False`); llama.cpp's graph fixes the clamped SwiGLU's alpha (1.702) and limit (7.0), which the
  file does not carry.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import torch

from perfxlm.quant import joining
from perfxlm.quant.weight import QuantizedWeight

TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{n}.attn_norm": "model.layers.{n}.input_layernorm",
    "blk.{n}.post_attention_norm": "model.layers.{n}.post_attention_layernorm",
    "blk.{n}.attn_q": "model.layers.{n}.self_attn.q_proj",
    "blk.{n}.attn_k": "model.layers.{n}.self_attn.k_proj",
    "blk.{n}.attn_v": "model.layers.{n}.self_attn.v_proj",
    "blk.{n}.attn_output": "model.layers.{n}.self_attn.o_proj",
    "blk.{n}.attn_sinks": "model.layers.{n}.self_attn.sinks",
    "blk.{n}.ffn_gate_inp": "model.layers.{n}.mlp.router",
    "blk.{n}.ffn_gate_exps": "model.layers.{n}.mlp.experts.gate_proj",
    "blk.{n}.ffn_up_exps": "model.layers.{n}.mlp.experts.up_proj",
    "blk.{n}.ffn_down_exps": "model.layers.{n}.mlp.experts.down_proj",
}

KEYS: dict[str, str] = {
    "expert_count": "num_local_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "intermediate_size",
    "attention.sliding_window": "sliding_window",
}

# read by `apply` (the rope keys) or by the table above
EXTRA_KEYS = frozenset({
    "expert_feed_forward_length", "attention.sliding_window", "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
})  # fmt: skip

CONFIG_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.0,
    "attention_bias": True,
}  # fmt: skip

ROPE_SCALING_TYPES = ("none", "yarn")


def apply(meta: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """The alternating layer kinds and gpt-oss's YaRN (untruncated) into the config's fields."""
    layers = int(kwargs["num_hidden_layers"])
    kwargs["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if "sliding_window" not in kwargs:
        raise ValueError("GGUF gpt-oss file lacks gpt-oss.attention.sliding_window.")
    kind = meta.get("gpt-oss.rope.scaling.type")
    if kind != "yarn":
        return
    theta = kwargs["rope_theta"]
    params = {
        "rope_type": "yarn", "rope_theta": theta,
        "factor": float(meta["gpt-oss.rope.scaling.factor"]),
        "original_max_position_embeddings": int(meta["gpt-oss.rope.scaling.original_context_length"]),
        "beta_fast": float(meta.get("gpt-oss.rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(meta.get("gpt-oss.rope.scaling.yarn_beta_slow", 1.0)),
        "truncate": False,
    }  # fmt: skip
    kwargs["rope_parameters"] = params
    # not also as rope_scaling: transformers would standardize that spelling before the config has
    # max_position_embeddings (the rotary layer reads rope_parameters)
    kwargs.pop("rope_scaling", None)


_EXPERTS = re.compile(
    r"^(?P<layer>.+\.mlp\.experts)\.(?P<part>gate_proj|up_proj|down_proj)\.(?P<kind>weight|bias)$"
)
_SINKS = re.compile(r"\.self_attn\.sinks\.weight$")


def _interleave_rows(gate: Any, up: Any) -> Any:
    """[E, I, ...] gate and up -> [E, 2I, ...] with gate row i at 2i and up row i at 2i + 1."""
    if isinstance(gate, QuantizedWeight) != isinstance(up, QuantizedWeight):  # one packed, one float
        gate, up = (t.dense() if isinstance(t, QuantizedWeight) else t for t in (gate, up))
    if isinstance(gate, QuantizedWeight):
        inter = gate.out_features
        both = joining.cat_rows([gate, up])  # [gate; up]
        order = torch.stack((torch.arange(inter), torch.arange(inter) + inter), dim=1).reshape(-1)
        return both.index_rows(order)
    return torch.stack((gate, up), dim=2).reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])


def _checkpoint_layout(stack: Any) -> Any:
    """A float [E, out, in] stack as transformers stores it ([E, in, out]); packed stacks stay as they are."""
    return stack if isinstance(stack, QuantizedWeight) else stack.transpose(-1, -2)


def regroup(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Per-part expert tensors -> the checkpoint's fused `gate_up_proj` (interleaved) and `down_proj`
    stacks with their `_bias` stacks; the sinks under their checkpoint name."""
    waiting: dict[tuple[str, str], dict[str, Any]] = {}
    for name, tensor in weights:
        if _SINKS.search(name):
            yield name.removesuffix(".weight"), tensor
            continue
        m = _EXPERTS.match(name)
        if m is None:
            yield name, tensor
            continue
        layer, part, kind = m["layer"], m["part"], m["kind"]
        if part == "down_proj":
            yield (f"{layer}.down_proj", _checkpoint_layout(tensor)) if kind == "weight" else (
                f"{layer}.down_proj_bias", tensor)
            continue
        parts = waiting.setdefault((layer, kind), {})
        parts[part] = tensor
        if len(parts) < 2:
            continue
        del waiting[(layer, kind)]
        fused = _interleave_rows(parts["gate_proj"], parts["up_proj"])
        yield (f"{layer}.gate_up_proj", _checkpoint_layout(fused)) if kind == "weight" else (
            f"{layer}.gate_up_proj_bias", fused)
    if waiting:
        missing = sorted(f"{layer} ({kind})" for layer, kind in waiting)
        raise ValueError(f"GGUF gpt-oss file has a gate or up expert stack without the other: {missing[:3]}")
