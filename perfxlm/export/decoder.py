"""The engine's loaded Llama-shaped model written as one ONNX decoder graph, onnxruntime-genai's layout:

    input_ids [batch, seq], attention_mask [batch, past + seq], position_ids [batch, seq],
    past_key_values.N.key / .value [batch, kv_heads, past, head_dim]
    -> logits [batch, seq, vocab], present.N.key / .value [batch, kv_heads, past + seq, head_dim]

Weights are read from the loaded model, so every format the engine loads (a float checkpoint, a GGUF
file, a checkpoint quantized at load) exports as the engine holds it, quantized weights still packed
where the flavor has a packed matmul. Only families whose every layer is the Llama block (pre-norm
RMSNorm, rotary attention with optional biases, q/k head norms and sliding window, SiLU-gated MLP) export;
anything else is refused by name before a node is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

from perfxlm.export.flavors import FLAVORS, graph_ops
from perfxlm.export.graph import Graph
from perfxlm.export.graph_ops import AttentionSpec, HeadNorms, LinearWeight, Rope
from perfxlm.export.perfxlm_ops import HeldBf16
from perfxlm.quant.weight import QuantizedWeight

# architecture -> onnxruntime-genai's model type
EXPORTABLE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",  # the perfxlm flavor only (its MoE op)
    "Qwen2MoeForCausalLM": "qwen2_moe",  # the perfxlm flavor only (MoE, a shared expert under SigmoidGatedAdd)
}


def genai_model_type(model: torch.nn.Module, flavor: str = "ort") -> str:
    """onnxruntime-genai's type name of an exportable model; ValueError naming what is not."""
    from perfxlm.model.layers.norm import RMSNorm
    from perfxlm.model.models.llama import LlamaAttention, LlamaDecoderLayer

    arch = type(model).__name__
    if arch not in EXPORTABLE:
        supported = ", ".join(sorted(EXPORTABLE))
        raise ValueError(f"ONNX export does not support {arch} yet (supported: {supported}).")
    inner = model.model
    if inner.embed_tokens.scale is not None or model.lm_head.logit_soft_cap is not None:
        raise ValueError(f"ONNX export: this {arch} scales its embeddings or soft-caps its logits; "
                         "not supported.")
    for i, layer in enumerate(inner.layers):
        what = None
        if type(layer) is not LlamaDecoderLayer:
            what = f"a {type(layer).__name__} block"
        elif not isinstance(layer.self_attn, LlamaAttention):
            what = f"attention {type(layer.self_attn).__name__}"
        elif (type(layer.mlp).__name__ not in FLAVORS[flavor].mlps
              or _mlp_act(layer.mlp) not in FLAVORS[flavor].activations):
            what = f"an MLP {type(layer.mlp).__name__} ({_mlp_act(layer.mlp)})"
        elif layer.self_attn.attn.logit_soft_cap is not None:
            what = "soft-capped attention"
        elif {type(layer.input_layernorm), type(layer.post_attention_layernorm)} != {RMSNorm}:
            what = f"norm {type(layer.input_layernorm).__name__}"
        if what is not None:
            raise ValueError(f"ONNX export of {arch}: layer {i} has {what}, which the exporter cannot "
                             f"express (flavor {flavor}).")
    return EXPORTABLE[arch]


def _mlp_act(mlp: Any) -> str:
    """The gated activation's layer class name: a dense MLP's, or a mixture's experts'."""
    act = getattr(mlp, "act", None) or getattr(getattr(mlp, "experts", None), "act", None)
    return type(act).__name__


def _array(t: Any) -> Any:
    """A vector (norm, bias, rotary table) as float32 numpy; a QuantizedWeight as it is."""
    if isinstance(t, QuantizedWeight):
        return t
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
    if isinstance(weight, QuantizedWeight) and weight.act != "float":
        # W8A8 rounds activations at run time; a graph of weight-only products would not be that model
        raise ValueError(f"ONNX export: {name} is {weight.describe()}, whose int8 activations the exporter "
                         "cannot express; export the float checkpoint, or quantize with int4 / int8 "
                         "(weight-only).")
    method = getattr(getattr(module, "method", None), "name", None) if isinstance(weight, QuantizedWeight) else None
    return LinearWeight(weight, bias, name, method)


def _method_name(method: Any, weight: Any) -> str | None:
    """A quantized weight's linear-method name (its format), None for a float one."""
    return getattr(method, "name", None) if isinstance(weight, QuantizedWeight) else None


def build_decoder_graph(model: torch.nn.Module, flavor: str, stored: torch.dtype | None = None) -> Graph:
    """Matrices are written as `model` holds them (float32, bf16 or packed codes), bf16 ones widened where
    `stored` is float32 (the engine's weight dtype for a model the exporter holds in its checkpoint's bf16);
    flavors that take only float32 (ort, standard) are given a float32 model or that."""
    genai_model_type(model, flavor)  # refuses what cannot be expressed, before any node
    inner = model.model
    g = Graph("perfxlm_decoder")
    ops = graph_ops(flavor, g)
    ops.record_model(model)
    rope = Rope(inner.rotary_emb.cos_cache.float().numpy(), inner.rotary_emb.sin_cache.float().numpy())
    x = ops.embedding(_matrix(inner.embed_tokens.weight, stored))
    residual = None
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        cache = ops.layer_cache(i, attn.num_kv_heads, attn.head_dim)
        prefix = f"model.layers.{i}"
        norm = layer.input_layernorm
        if residual is None:
            residual = x
            h = ops.rms_norm(x, _array(norm.weight), norm.variance_epsilon, f"{prefix}.input_layernorm")
        else:
            h, residual = ops.add_rms_norm(x, residual, _array(norm.weight), norm.variance_epsilon,
                                           f"{prefix}.input_layernorm")
        qkv = ops.linear(h, _linear(attn.qkv_proj, f"{prefix}.self_attn.qkv_proj", stored))
        norms = None
        if attn.qk_norm:
            norms = HeadNorms(_array(attn.q_norm.weight), _array(attn.k_norm.weight), attn.q_norm.variance_epsilon)
        spec = AttentionSpec(attn.num_heads, attn.num_kv_heads, attn.head_dim, float(attn.attn.scale),
                             attn.attn.sliding_window)
        out = ops.self_attention(qkv, spec, norms, rope, cache, i, f"{prefix}.self_attn")
        x = ops.linear(out, _linear(attn.o_proj, f"{prefix}.self_attn.o_proj", stored))
        post = layer.post_attention_layernorm
        h, residual = ops.add_rms_norm(x, residual, _array(post.weight), post.variance_epsilon,
                                       f"{prefix}.post_attention_layernorm")
        mlp = layer.mlp
        if hasattr(mlp, "experts"):  # a mixture of experts (flavors whose `mlps` name it)
            e = mlp.experts
            x = ops.moe(h, _linear(mlp.gate, f"{prefix}.mlp.gate", stored), _matrix(e.gate_up_proj, stored),
                        _matrix(e.down_proj, stored), e.top_k, e.renormalize, e.act, f"{prefix}.mlp.experts",
                        (_method_name(e.gate_up_method, e.gate_up_proj), _method_name(e.down_method, e.down_proj)))
            shared = getattr(mlp, "shared_expert", None)
            if shared is not None:  # Qwen2-MoE
                x = ops.shared_expert(
                    h, x, _linear(shared.gate_up_proj, f"{prefix}.mlp.shared_expert.gate_up_proj", stored),
                    _linear(shared.down_proj, f"{prefix}.mlp.shared_expert.down_proj", stored),
                    shared.down_proj.in_features, shared.act,
                    _linear(mlp.shared_expert_gate, f"{prefix}.mlp.shared_expert_gate", stored),
                    f"{prefix}.mlp.shared_expert_add")
            continue
        gate_up = ops.linear(h, _linear(mlp.gate_up_proj, f"{prefix}.mlp.gate_up_proj", stored))
        act = ops.act_and_mul(gate_up, mlp.down_proj.in_features, mlp.act)
        x = ops.linear(act, _linear(mlp.down_proj, f"{prefix}.mlp.down_proj", stored))
    final = inner.norm
    h, _ = ops.add_rms_norm(x, residual, _array(final.weight), final.variance_epsilon, "model.norm")
    head = model.lm_head
    # (a tied head under bf16 panels holds its own packed copy of the table: tied all the same)
    tied = head.weight is inner.embed_tokens.weight or getattr(model, "tie_word_embeddings", False)
    ops.logits(h, None if tied else LinearWeight(_layer_matrix(head, stored), None, "lm_head",
                                                     _method_name(getattr(head, "method", None), head.weight)), model.config.vocab_size)
    return g
