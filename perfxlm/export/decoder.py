"""The engine's loaded model written as one ONNX decoder graph, onnxruntime-genai's layout:

    input_ids [batch, seq], attention_mask [batch, past + seq], position_ids [batch, seq],
    past_key_values.N.key / .value [batch, kv_heads, past, head_dim]
    -> logits [batch, seq, vocab], present.N.key / .value [batch, kv_heads, past + seq, head_dim]

Weights are read from the loaded model, so every format the engine loads (a float checkpoint, a GGUF
file, a checkpoint quantized at load) exports as the engine holds it, quantized weights still packed
where the flavor has a packed matmul. Every decoder family the engine runs exports: one walk over its
modules (embeddings, each layer's norms, attention and MLP, final norm, head) written through the flavor's
`GraphOps`. What a family needs beyond the Llama block is named first (export/features.py), and a flavor
that cannot write it is refused by name before a node is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

from perfxlm.export.features import BLOCKS, FEATURES, needed, stack_of
from perfxlm.export.flavors import FLAVORS, graph_ops
from perfxlm.export.graph import Graph
from perfxlm.export.graph_mla import LatentWeights
from perfxlm.export.graph_moe import Experts, Routing
from perfxlm.export.graph_ops import AttentionSpec, GraphOps, HeadNorms, LinearWeight, Rope
from perfxlm.export.perfxlm_ops import HeldBf16
from perfxlm.quant.split_rows import SplitRows
from perfxlm.quant.weight import QuantizedWeight

# architecture -> onnxruntime-genai's model type
EXPORTABLE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "GlmForCausalLM": "glm",
    "Glm4ForCausalLM": "glm4",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "OPTForCausalLM": "opt",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

# decoder layer class -> its norms' attribute names: before attention, after it, before the MLP, after it
SUBLAYER_NORMS = {
    "LlamaDecoderLayer": ("input_layernorm", None, "post_attention_layernorm", None),
    "Gemma2DecoderLayer": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                           "post_feedforward_layernorm"),
    "Glm4DecoderLayer": ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm",
                         "post_mlp_layernorm"),
}


def genai_model_type(model: torch.nn.Module, flavor: str = "ort") -> str:
    """onnxruntime-genai's type name of an exportable model; ValueError naming what is not, or what the
    flavor cannot express."""
    arch = type(model).__name__
    if arch not in EXPORTABLE:
        supported = ", ".join(sorted(EXPORTABLE))
        raise ValueError(f"ONNX export does not support {arch} yet (supported: {supported}).")
    ops = FLAVORS[flavor]
    for feature, where in needed(model).items():
        if feature not in ops.features:
            can = ", ".join(name for name, cls in FLAVORS.items() if feature in cls.features)
            raise ValueError(f"ONNX export of {arch}: {where} has {FEATURES[feature]}, which the {flavor} flavor "
                             f"cannot express ({ops.why_not}); flavors that can: {can}.")
    for i, layer in enumerate(stack_of(model).layers):
        act = _mlp_act(layer.mlp) if hasattr(layer, "mlp") else None
        if act is not None and act not in ops.activations:
            raise ValueError(f"ONNX export of {arch}: layer {i} has an MLP {type(layer.mlp).__name__} ({act}), "
                             f"which the {flavor} flavor cannot express.")
    return EXPORTABLE[arch]


def _mlp_act(mlp: Any) -> str:
    """The gated activation's layer class name: a dense MLP's, or a mixture's experts'."""
    act = getattr(mlp, "act", None) or getattr(getattr(mlp, "experts", None), "act", None)
    return type(act).__name__


def _array(t: Any) -> Any:
    """A vector (norm, bias, rotary table) as float32 numpy; a QuantizedWeight as it is, in the plain code
    layout (row groups are the engine's run-time choice, not the file's)."""
    if isinstance(t, QuantizedWeight):
        return t.plain()
    if isinstance(t, SplitRows):  # a file holds one weight per projection: the parts joined (widened)
        return t.joined()
    return t.detach().float().contiguous().numpy()


@dataclass
class WidenedBf16:
    """A bf16 matrix (or expert stack) the exporter holds where the engine holds it in float32 (a bf16
    checkpoint's values, export/held_weights.py), written as float32 a block of rows at a time: widening
    is exact, and the float32 copy never exists whole."""

    tensor: torch.Tensor

    BLOCK_BYTES = 8 << 20  # a 128k x 2048 table in 64 blocks

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def stream(self) -> tuple[tuple[int, ...], np.dtype, Iterator[np.ndarray]]:
        t = self.tensor.detach()
        step = max(1, self.BLOCK_BYTES // max(1, t[0].numel() * 4))

        def blocks() -> Iterator[np.ndarray]:  # one buffer, refilled: each block is written before the next
            buffer = torch.empty((min(step, len(t)), *t.shape[1:]), dtype=torch.float32)
            for i in range(0, len(t), step):
                n = min(step, len(t) - i)
                yield buffer[:n].copy_(t[i : i + n]).numpy()

        return self.shape, np.dtype(np.float32), blocks()


def _matrix(t: Any, stored: torch.dtype | None = None, rows: Callable[[], torch.Tensor] | None = None) -> Any:
    """A matrix (or expert stack) as the engine holds it: a QuantizedWeight as it is, float32 as numpy, bf16
    kept bf16 (`rows`: how to get [N, K] back from a layer's panel layout), or widened to float32 as it
    is written where the engine stores float32 (`stored`: the float matrices' dtype; None: as held)."""
    if isinstance(t, QuantizedWeight) or t.dtype != torch.bfloat16:
        return _array(t)
    if stored == torch.float32:
        return WidenedBf16(rows() if rows is not None else t)
    return HeldBf16(rows or t.detach)


def _layer_matrix(module: Any, stored: torch.dtype | None = None) -> Any:
    """A Linear's or LM head's weight as its linear method holds it, [N, K] (bf16 panels unpacked)."""
    w = module.weight
    return _matrix(w, stored, lambda: module.method.weight_matrix(w, module.out_features))


def _linear(module: Any, name: str, stored: torch.dtype | None = None) -> LinearWeight:
    bias = None if module.bias is None else _array(module.bias)
    weight = _layer_matrix(module, stored)
    _check_weight_only(weight, name)
    method = getattr(getattr(module, "method", None), "name", None) if isinstance(weight, QuantizedWeight) else None
    return LinearWeight(weight, bias, name, method)


def _check_weight_only(weight: Any, name: str) -> None:
    if isinstance(weight, QuantizedWeight) and weight.act != "float":
        # W8A8 rounds activations at run time; a graph of weight-only products would not be that model
        raise ValueError(f"ONNX export: {name} is {weight.describe()}, whose int8 activations the exporter "
                         "cannot express; export the float checkpoint, or quantize with int4 / int8 "
                         "(weight-only).")


def _method_name(method: Any, weight: Any) -> str | None:
    """A quantized weight's linear-method name (its format), None for a float one."""
    return getattr(method, "name", None) if isinstance(weight, QuantizedWeight) else None


def build_decoder_graph(model: torch.nn.Module, flavor: str, stored: torch.dtype | None = None) -> Graph:
    """Matrices are written as `model` holds them (float32, bf16 or packed codes), bf16 ones widened where
    `stored` is float32 (the engine's weight dtype for a model the exporter holds in its checkpoint's bf16);
    flavors that take only float32 (ort, standard) are given a float32 model or that."""
    genai_model_type(model, flavor)  # refuses what cannot be expressed, before any node
    stack = stack_of(model)
    g = Graph("perfxlm_decoder")
    ops = graph_ops(flavor, g)
    ops.record_model(model)
    w = _Writer(ops, stored)
    ropes = _layer_ropes(stack)
    x = ops.embedding(_matrix(stack.embed_tokens.weight, stored))
    if getattr(stack.embed_tokens, "scale", None) is not None:  # Gemma: by sqrt(hidden), in float32
        x = ops.scaled(x, float(torch.tensor(stack.embed_tokens.scale, dtype=torch.float32)))
    if getattr(stack, "embed_positions", None) is not None:  # OPT
        if stack.project_in is not None:
            x = ops.linear(x, w.linear(stack.project_in, "model.decoder.project_in"))
        positions = stack.embed_positions
        x = ops.add(x, ops.learned_positions(_array(positions.weight), positions.offset))
    residual = None
    for i, layer in enumerate(stack.layers):
        if BLOCKS[type(layer).__name__] == "opt":
            x = w.opt_layer(x, layer, i)
            continue
        prefix = f"model.layers.{i}"
        pre_attn, post_attn, pre_mlp, post_mlp = SUBLAYER_NORMS[type(layer).__name__]
        h, residual = w.normed(x, residual, layer, pre_attn, prefix)
        x = w.attention(h, layer.self_attn, ropes[i], i, f"{prefix}.self_attn")
        if post_attn is not None:  # Gemma 2/3, GLM-4: the sublayer's output normed before the residual add
            x = w.norm(x, layer, post_attn, prefix)
        h, residual = w.normed(x, residual, layer, pre_mlp, prefix)
        x = w.mlp(h, layer.mlp, f"{prefix}.mlp")
        if post_mlp is not None:
            x = w.norm(x, layer, post_mlp, prefix)
    if getattr(stack, "embed_positions", None) is not None:  # OPT: no residual beside the stream
        if stack.final_layer_norm is not None:
            x = w.layer_norm(x, stack.final_layer_norm, "model.decoder.final_layer_norm")
        h = x if stack.project_out is None else ops.linear(x, w.linear(stack.project_out, "model.decoder.project_out"))
    else:
        h, _ = w.normed(x, residual, stack, "norm", "model")
    head = model.lm_head
    # (a tied head under bf16 panels holds its own packed copy of the table: tied all the same)
    tied = head.weight is stack.embed_tokens.weight or getattr(model, "tie_word_embeddings", False)
    ops.logits(h, None if tied else LinearWeight(_layer_matrix(head, stored), None, "lm_head",
                                                     _method_name(getattr(head, "method", None), head.weight)),
               model.config.vocab_size, getattr(head, "logit_soft_cap", None))
    return g


def _layer_ropes(stack: Any) -> list[Rope | None]:
    """Each layer's rotary table: the model's one, or its layer kind's (Gemma 3); None without rotary (OPT)."""
    def rope(module: Any, key: str = "rope") -> Rope:
        return Rope(module.cos_cache.float().numpy(), module.sin_cache.float().numpy(), key)

    if hasattr(stack, "rope_kinds"):  # Gemma 2 / 3: a table per layer kind
        tables = {kind: rope(r, "rope" if len(stack.rotary) == 1 else f"rope_{kind}")
                  for kind, r in stack.rotary.items()}
        return [tables[kind] for kind in stack.rope_kinds]
    if hasattr(stack, "rotary_emb"):
        table = rope(stack.rotary_emb)
        return [table] * len(stack.layers)
    return [None] * len(stack.layers)


class _Writer:
    """One layer's parts read from the engine's modules and written through the flavor's ops."""

    def __init__(self, ops: GraphOps, stored: torch.dtype | None) -> None:
        self.ops, self.stored = ops, stored

    def linear(self, module: Any, name: str) -> LinearWeight:
        return _linear(module, name, self.stored)

    # ---- norms ------------------------------------------------------------------------------------------
    def normed(self, x: str, residual: str | None, owner: Any, attr: str, prefix: str) -> tuple[str, str]:
        """(norm(x + residual), x + residual): the residual add fused into the norm; the first layer's
        input has no residual yet."""
        weight, eps = _rms_weight(getattr(owner, attr))
        name = f"{prefix}.{attr}"
        if residual is None:
            return self.ops.rms_norm(x, weight, eps, name), x
        return self.ops.add_rms_norm(x, residual, weight, eps, name)

    def norm(self, x: str, owner: Any, attr: str, prefix: str) -> str:
        weight, eps = _rms_weight(getattr(owner, attr))
        return self.ops.rms_norm(x, weight, eps, f"{prefix}.{attr}")

    def layer_norm(self, x: str, norm: Any, name: str) -> str:
        n = norm.normalized_shape[0]
        weight = np.ones(n, np.float32) if norm.weight is None else _array(norm.weight)
        bias = np.zeros(n, np.float32) if norm.bias is None else _array(norm.bias)
        return self.ops.layer_norm(x, weight, bias, norm.eps, name)

    # ---- attention --------------------------------------------------------------------------------------
    def attention(self, h: str, attn: Any, rope: Rope | None, i: int, name: str) -> str:
        ops = self.ops
        if type(attn).__name__ == "MLAttention":
            return ops.latent_attention(h, self.latent_weights(attn, name), rope,
                                        ops.layer_cache(i, 1, attn.latent_dim), i, name)
        cache = ops.layer_cache(i, attn.num_kv_heads, attn.head_dim)
        qkv = ops.linear(h, self.linear(attn.qkv_proj, f"{name}.qkv_proj"))
        norms = None
        if attn.qk_norm:  # Qwen3; Gemma 3's (1 + w)
            (q_w, eps), (k_w, _) = _rms_weight(attn.q_norm), _rms_weight(attn.k_norm)
            norms = HeadNorms(q_w, k_w, eps)
        core = attn.attn
        sinks = None if getattr(core, "sinks", None) is None else _array(core.sinks)
        spec = AttentionSpec(attn.num_heads, attn.num_kv_heads, attn.head_dim, float(core.scale),
                             core.sliding_window, core.logit_soft_cap, sinks)
        out = ops.self_attention(qkv, spec, norms, rope, cache, i, name)
        return ops.linear(out, self.linear(attn.o_proj, f"{name}.o_proj"))

    def latent_weights(self, attn: Any, name: str) -> LatentWeights:
        w_uk, w_uv_t = attn.absorbed(torch.float32)
        bottleneck = bool(attn.q_lora_rank)
        return LatentWeights(
            attn.num_heads, attn.nope_dim, attn.rope_dim, attn.v_dim, attn.kv_lora_rank, float(attn.attn.scale),
            None if bottleneck else self.linear(attn.q_proj, f"{name}.q_proj"),
            self.linear(attn.q_a_proj, f"{name}.q_a_proj") if bottleneck else None,
            _rms_weight(attn.q_a_layernorm) if bottleneck else None,
            self.linear(attn.q_b_proj, f"{name}.q_b_proj") if bottleneck else None,
            self.linear(attn.kv_a_proj_with_mqa, f"{name}.kv_a_proj_with_mqa"), _rms_weight(attn.kv_a_layernorm),
            _array(w_uk), _array(w_uv_t), self.linear(attn.o_proj, f"{name}.o_proj"),
        )  # fmt: skip

    # ---- MLPs -------------------------------------------------------------------------------------------
    def gated_mlp(self, h: str, mlp: Any, name: str) -> str:
        ops = self.ops
        gate_up = ops.linear(h, self.linear(mlp.gate_up_proj, f"{name}.gate_up_proj"))
        act = ops.act_and_mul(gate_up, mlp.down_proj.in_features, mlp.act)
        return ops.linear(act, self.linear(mlp.down_proj, f"{name}.down_proj"))

    def mlp(self, h: str, mlp: Any, name: str) -> str:
        kind = type(mlp).__name__
        if kind == "LlamaMLP":
            return self.gated_mlp(h, mlp, name)
        ops, e = self.ops, mlp.experts
        if kind == "GptOssMLP":  # softmax over the top-k logits of a biased router
            router = self.linear(mlp.router, f"{name}.router")
            routing = Routing(e.top_k, False, "topk_softmax")
        elif kind == "DeepseekMoE":  # grouped top-k of float32 scores, scaled
            gate = mlp.gate
            router = LinearWeight(_array(gate.weight), None, f"{name}.gate")
            bias = gate.e_score_correction_bias
            routing = Routing(gate.top_k, gate.renormalize, gate.scoring,
                              gate.num_groups if gate.grouped else None, gate.topk_group if gate.grouped else None,
                              None if bias is None else _array(bias), float(gate.routed_scaling_factor), 1e-20, True)
        else:  # Mixtral, Qwen2-MoE, Qwen3-MoE: softmax top-k
            router = self.linear(mlp.gate, f"{name}.gate")
            routing = Routing(e.top_k, e.renormalize)
        x = ops.moe(h, router, self.experts(e, f"{name}.experts"), routing, f"{name}.experts")
        shared = getattr(mlp, "shared_expert", None)
        if shared is not None:  # Qwen2-MoE: under a sigmoid gate
            x = ops.shared_expert(
                h, x, self.linear(shared.gate_up_proj, f"{name}.shared_expert.gate_up_proj"),
                self.linear(shared.down_proj, f"{name}.shared_expert.down_proj"), shared.down_proj.in_features,
                shared.act, self.linear(mlp.shared_expert_gate, f"{name}.shared_expert_gate"),
                f"{name}.shared_expert_add")
        shared = getattr(mlp, "shared_experts", None)
        if shared is not None:  # DeepSeek: always on, no gate
            x = ops.shared_expert(
                h, x, self.linear(shared.gate_up_proj, f"{name}.shared_experts.gate_up_proj"),
                self.linear(shared.down_proj, f"{name}.shared_experts.down_proj"), shared.down_proj.in_features,
                shared.act, None, f"{name}.shared_experts_add")
        return x

    def experts(self, e: Any, name: str) -> Experts:
        stored = self.stored

        def expert(which: str, index: int) -> LinearWeight:
            stack = e.gate_up_proj if which == "gate_up" else e.down_proj
            bias = e.gate_up_proj_bias if which == "gate_up" else e.down_proj_bias
            weight = _matrix(stack[index], stored)
            _check_weight_only(weight, f"{name}.{which}_proj")
            return LinearWeight(weight, None if bias is None else _array(bias[index]), f"{name}.{index}.{which}_proj")

        def bias(b: Any) -> Any:
            return None if b is None else _array(b)

        return Experts(e.num_experts, e.down_proj.shape[-2], e.intermediate_size, e.act, expert,
                       _matrix(e.gate_up_proj, stored), _matrix(e.down_proj, stored),
                       (_method_name(e.gate_up_method, e.gate_up_proj), _method_name(e.down_method, e.down_proj)),
                       bias(e.gate_up_proj_bias), bias(e.down_proj_bias))

    # ---- OPT --------------------------------------------------------------------------------------------
    def opt_layer(self, x: str, layer: Any, i: int) -> str:
        """LayerNorm before each sublayer (do_layer_norm_before) or after its residual add; ReLU MLP; no
        rotary (positions were added to the embeddings)."""
        ops, pre, prefix = self.ops, layer.do_layer_norm_before, f"model.decoder.layers.{i}"
        attn = layer.self_attn
        ln1, ln2 = f"{prefix}.self_attn_layer_norm", f"{prefix}.final_layer_norm"
        h = self.layer_norm(x, layer.self_attn_layer_norm, ln1) if pre else x
        cache = ops.layer_cache(i, attn.num_heads, attn.head_dim)
        qkv = ops.linear(h, self.linear(attn.qkv_proj, f"{prefix}.self_attn.qkv_proj"))
        spec = AttentionSpec(attn.num_heads, attn.num_heads, attn.head_dim, float(attn.scaling), None,
                             query_scaled=True)
        out = ops.self_attention(qkv, spec, None, None, cache, i, f"{prefix}.self_attn")
        x = ops.add(x, ops.linear(out, self.linear(attn.out_proj, f"{prefix}.self_attn.out_proj")))
        if not pre:
            x = self.layer_norm(x, layer.self_attn_layer_norm, ln1)
        h = self.layer_norm(x, layer.final_layer_norm, ln2) if pre else x
        h = ops.activation(ops.linear(h, self.linear(layer.fc1, f"{prefix}.fc1")), _activation_name(layer.act))
        x = ops.add(x, ops.linear(h, self.linear(layer.fc2, f"{prefix}.fc2")))
        return x if pre else self.layer_norm(x, layer.final_layer_norm, ln2)


def _rms_weight(norm: Any) -> tuple[np.ndarray, float]:
    """An RMSNorm's scale as the product uses it, and its epsilon: Gemma's (1 + w), taken in float32 as the
    engine takes it."""
    w = norm.weight.detach().float()
    if type(norm).__name__ == "GemmaRMSNorm":
        w = 1.0 + w
    return w.contiguous().numpy(), float(norm.variance_epsilon)


def _activation_name(act: Any) -> str:
    """The transformers name of an `Activation` module's function."""
    from perfxlm.model.layers.activation import _ACTIVATIONS

    for name, fn in _ACTIVATIONS.items():
        if fn is act.fn:
            return name
    raise ValueError(f"ONNX export: activation {act.fn!r} is not one the exporter knows.")
