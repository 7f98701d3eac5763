"""What a family is made of beyond the Llama block, by name: the exporter reads the loaded model's modules
into these names before a node is written (`needed`), and each flavor says which it can write
(`GraphOps.features`), so a flavor that cannot express a family is refused by name, with the reason,
rather than writing a graph that is not the model."""

from __future__ import annotations

from typing import Any

# name -> what it is, as an error message says it
FEATURES = {
    "embedding_scale": "embeddings scaled by a constant",
    "learned_positions": "learned absolute position embeddings",
    "layer_norm": "LayerNorm",
    "post_norms": "a norm after each sublayer as well as before it",
    "plain_mlp": "an ungated MLP (fc1, activation, fc2)",
    "rope_per_layer": "a rotary table per layer kind",
    "attention_soft_cap": "soft-capped attention scores",
    "attention_sinks": "attention sinks",
    "latent_attention": "multi-head latent attention",
    "logit_soft_cap": "soft-capped logits",
    "moe": "a mixture of experts",
    "shared_expert": "a shared expert under a sigmoid gate",
    "shared_experts": "always-on shared experts",
    "topk_softmax_routing": "a router that softmaxes its top-k logits",
    "grouped_routing": "grouped top-k expert routing",
    "expert_biases": "biased experts",
}
ALL_FEATURES = frozenset(FEATURES)


def needed(model: Any) -> dict[str, str]:
    """feature -> where the model first needs it (a module path), for every feature the model uses; a
    layer, attention or MLP module the exporter does not know raises ValueError naming it."""
    from perfxlm.model.layers.moe_router import GroupedTopKRouter
    from perfxlm.model.layers.norm import LayerNorm

    found: dict[str, str] = {}

    def need(feature: str, where: str) -> None:
        found.setdefault(feature, where)

    arch = type(model).__name__
    stack = stack_of(model)
    if getattr(stack.embed_tokens, "scale", None) is not None:
        need("embedding_scale", "model.embed_tokens")
    if getattr(stack, "embed_positions", None) is not None:
        need("learned_positions", "model.decoder.embed_positions")
    if getattr(model.lm_head, "logit_soft_cap", None) is not None:
        need("logit_soft_cap", "lm_head")
    if len(set(getattr(stack, "rope_kinds", None) or ["all"])) > 1:
        need("rope_per_layer", "model.rotary")
    for i, layer in enumerate(stack.layers):
        at = f"layer {i}"
        kind = type(layer).__name__
        if kind not in BLOCKS:
            raise ValueError(f"ONNX export of {arch}: {at} is a {kind} block, which the exporter does not know.")
        if BLOCKS[kind] == "post_norms":
            need("post_norms", at)
        if kind == "OPTDecoderLayer":
            need("layer_norm", at)
            need("plain_mlp", at)
            continue
        attn = layer.self_attn
        attn_kind = type(attn).__name__
        if attn_kind == "MLAttention":
            need("latent_attention", at)
        elif attn_kind != "LlamaAttention":
            raise ValueError(f"ONNX export of {arch}: {at} has attention {attn_kind}, which the exporter does "
                             "not know.")
        else:
            if attn.attn.logit_soft_cap is not None:
                need("attention_soft_cap", at)
            if getattr(attn.attn, "sinks", None) is not None:
                need("attention_sinks", at)
        mlp = layer.mlp
        mlp_kind = type(mlp).__name__
        if mlp_kind not in MLPS:
            raise ValueError(f"ONNX export of {arch}: {at} has an MLP {mlp_kind}, which the exporter does not "
                             "know.")
        if mlp_kind == "LlamaMLP":
            continue
        need("moe", at)
        if mlp.experts.gate_up_proj_bias is not None:
            need("expert_biases", at)
        if mlp_kind == "GptOssMLP":
            need("topk_softmax_routing", at)
        if getattr(mlp, "shared_expert", None) is not None:
            need("shared_expert", at)
        if getattr(mlp, "shared_experts", None) is not None:
            need("shared_experts", at)
        gate = getattr(mlp, "gate", None)
        if isinstance(gate, GroupedTopKRouter):
            need("grouped_routing", at)
    for name, module in model.named_modules():
        if isinstance(module, LayerNorm):
            need("layer_norm", name)
    return found


def stack_of(model: Any) -> Any:
    """The module holding the embeddings, layers and final norm (OPT's is `model.decoder`)."""
    inner = model.model
    return getattr(inner, "decoder", inner)


# decoder layer class -> how its sublayers are normed: "pre" (a norm before each, the residual add fused into
# the next), "post_norms" (Gemma 2/3, GLM-4: a norm after each too), "opt" (LayerNorm before or after)
BLOCKS = {"LlamaDecoderLayer": "pre", "Gemma2DecoderLayer": "post_norms", "Glm4DecoderLayer": "post_norms",
          "OPTDecoderLayer": "opt"}
MLPS = {"LlamaMLP", "MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "GptOssMLP", "DeepseekMoE"}
