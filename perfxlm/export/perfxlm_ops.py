"""The `perfxlm` flavor: a decoder as the graph of the engine's own fused ops, custom ops in the `perfxlm`
domain (version `PERFXLM_OPSET`), each the kernel the engine's module path calls, so the engine runs the
graph node by node (`perfxlm/model/graph/`) and another runtime needs only these few kernels.

The graph's interface is the engine's step, not onnxruntime-genai's: one flattened batch of tokens of
several sequences (prefill chunks and decodes together) over a paged KV cache.

    input_ids, positions, slot_mapping  int64 [num_tokens]   (slot: block * block_size + offset)
    block_tables                        int64 [num_seqs, max_blocks]
    seq_lens                            int64 [num_seqs]     (cached + new tokens)
    query_start_loc                     int64 [num_seqs + 1] (each sequence's first row; the last: num_tokens)
    logits_indices                      int64 [num_logits]   (rows whose logits are wanted)
    key_cache.N, value_cache.N          float [num_blocks, block_size, kv_heads, head_dim], written in place
    -> logits                           float [num_logits, vocab]

Ops (attributes in brackets):
    Embedding(ids, W, scales?, mins?, levels?)          [bits, group, act, activations]: rows of W
    RMSNorm(x, w)                                       [epsilon]
    AddRMSNorm(x, residual, w) -> (y, x + residual)     [epsilon]
    HeadRMSNorm(qkv, q_w, k_w): RMSNorm of each q and k head (Qwen3) [num_heads, num_kv_heads, head_dim, epsilon]
    Linear(x, W, bias?, scales?, mins?, levels?, input_order?)  [bits, group, act, activations, format]:
        x W^T + b; input_order (int64 [K]): the input channel of each codes column (GPTQ's act-order)
    Rotary(qkv, positions, cos, sin): rotate-half rotary of the first num_heads heads (q and k), tables
        [max_position, rotary_dim], the channels past rotary_dim passed through  [num_heads, head_dim]
    PagedAttention(qkv, key_cache, value_cache, block_tables, seq_lens, query_start_loc, slot_mapping):
        writes each token's k, v at its slot, then causal attention of each sequence's queries over its
        cached + new keys  [num_heads, num_kv_heads, head_dim, scale, sliding_window (0: none),
        logit_soft_cap (op-set version 2; absent: none)]
    SiluAndMul(x), GeluAndMul(x) [approximate]: [.., 2d] (gate | up) -> [.., d]
    MoE(x, router_logits, gate_up [E, 2I, H], down [E, H, I], gate_up's scales?, mins?, levels?, down's
        scales?, mins?, levels?): softmax top-k routing (weights renormalised if asked), each token through its
        experts' gated MLPs, summed by weight; expert stacks float or packed as a Linear's weight, per expert
        [top_k, renormalize, activation (SiluAndMul | GeluAndMul), approximate, gate_up_* / down_* the
        stacks' weight attributes]
    SigmoidGatedAdd(x, y, gate) -> x + sigmoid(gate) * y: a shared expert's output (y, an ordinary gated MLP
        of Linear nodes) added to the routed experts' (x) under its one-column gate's sigmoid (Qwen2-MoE)
    Scale(x) [factor]: x * factor (Gemma's embeddings by sqrt(hidden))
    SoftCap(x) [cap]: cap * tanh(x / cap) (Gemma's final logits)
    Gather (standard): the logits rows

A weight is stored as the engine holds it: bits 0 is a float matrix W [N, K] (float32, or bfloat16 with
`--dtype bfloat16`); bits 4 / 8 are its packed codes (4-bit in GGUF Q4_0's nibble order) with float16 or
float32 scales and mins per group of `group` inputs (w = scale * code + min; no mins: centred codes,
w = scale * code), an optional 16-level table,
and the activation rounding the engine applies (perfxlm/quant/weight.py's form, moved bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from onnx import TensorProto

from perfxlm.export.graph import Graph
from perfxlm.export.graph_moe import Experts, Routing
from perfxlm.export.graph_ops import AttentionSpec, GraphOps, HeadNorms, LinearWeight, Rope
from perfxlm.export.lora_record import LORA_KEY, lora_record
from perfxlm.export.manifest import PERFXLM_DOMAIN, SOFT_CAP_OPSET
from perfxlm.quant.weight import QuantizedWeight

WEIGHT_DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class StepInputs:
    input_ids: str
    positions: str
    slot_mapping: str
    block_tables: str
    seq_lens: str
    query_start_loc: str
    logits_indices: str


@dataclass
class HeldBf16:
    """A float matrix the engine holds in bf16: `matrix()` gives it [N, K] (a panel layout unpacked then,
    at save time, so unpacked copies never pile up beside the model)."""

    matrix: Callable[[], Any]  # -> torch.bfloat16 [N, K]

    def bits(self) -> np.ndarray:
        import torch

        return self.matrix().contiguous().view(torch.int16).numpy().view(np.uint16)


def _in_order(name: str, names: list[str]) -> None:
    """Only a Linear takes act-order codes (an embedding table or expert stack never comes so from GPTQ)."""
    if names[4]:
        raise ValueError(f"ONNX export (perfxlm flavor): {name} has act-order codes (input_order), which only a "
                         "Linear node takes.")


class PerfxlmOps(GraphOps):
    flavor = "perfxlm"
    activations = ("SiluAndMul", "GeluAndMul")
    # the engine's graph ops (model/graph/kernels.py) have kernels for these only: a family needing more
    # (soft-capped attention, sinks, LayerNorm, learned positions, latent attention, grouped routing) is
    # refused by name
    features = frozenset({"moe", "shared_expert", "embedding_scale", "post_norms", "rope_per_layer",
                          "logit_soft_cap", "attention_soft_cap"})
    why_not = "the engine's graph ops have no kernel for it yet"

    # the engine's own choice for the model on this CPU (export/engine_choices.py), so the folder runs as
    # the module path does
    default_dtype = "auto"

    @classmethod
    def check_weight_dtype(cls, dtype: str) -> str:
        """The engine's dtype option the model is loaded with; its float matrices are stored as it holds them."""
        if dtype not in WEIGHT_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one the perfxlm flavor writes "
                             f"(known: {', '.join(WEIGHT_DTYPES)}).")
        return dtype

    def _op(self, op_type: str, inputs: list[str], num_outputs: int = 1, **attrs: Any) -> Any:
        while inputs and not inputs[-1]:  # trailing optional inputs left out
            inputs = inputs[:-1]
        return self.g.op(op_type, inputs, num_outputs, domain=PERFXLM_DOMAIN, **attrs)

    # ---- the graph's interface: the engine's step ---------------------------------------------------
    @staticmethod
    def declare_inputs(g: Graph) -> StepInputs:
        i64 = TensorProto.INT64
        return StepInputs(
            g.add_input("input_ids", i64, ["num_tokens"]),
            g.add_input("positions", i64, ["num_tokens"]),
            g.add_input("slot_mapping", i64, ["num_tokens"]),
            g.add_input("block_tables", i64, ["num_seqs", "max_blocks"]),
            g.add_input("seq_lens", i64, ["num_seqs"]),
            g.add_input("query_start_loc", i64, ["num_seqs_plus_1"]),
            g.add_input("logits_indices", i64, ["num_logits"]),
        )

    def layer_cache(self, layer: int, kv_heads: int, head_dim: int) -> tuple[str, str]:
        return tuple(self.g.add_input(f"{kind}_cache.{layer}", TensorProto.FLOAT,
                                      ["num_blocks", "block_size", kv_heads, head_dim])
                     for kind in ("key", "value"))

    def record_model(self, model: Any) -> None:
        """The projections a LoRA adapter may target and the checkpoint-name tables that place an adapter's
        modules on them (export/lora_record.py): the engine binds adapters to the Linear nodes at run time."""
        self.g.metadata[LORA_KEY] = lora_record(model)

    # ---- weights --------------------------------------------------------------------------------------
    def _weight(self, name: str, w: Any, lw_format: str | None = None) -> tuple[list[str], dict[str, Any]]:
        """A weight's initializers [W or codes, scales, mins, levels, input_order] ("" where absent) and
        attributes."""
        g = self.g
        if isinstance(w, HeldBf16):  # bf16 bits as held, written when the graph is saved
            return [g.weight(f"{name}.weight", w.bits, TensorProto.BFLOAT16), "", "", "", ""], {"bits": 0}
        if not isinstance(w, QuantizedWeight):
            return [g.weight(f"{name}.weight", w), "", "", "", ""], {"bits": 0}
        if w.exponent_scales:  # MXFP4's E8M0 bytes: no numpy type; the same values as float32
            w = w.flat()
        names = [g.weight(f"{name}.codes", w.codes.numpy()), g.weight(f"{name}.scales", w.scales.numpy()),
                 "" if w.mins is None else g.weight(f"{name}.mins", w.mins.numpy()),
                 "" if w.levels is None else g.weight(f"{name}.levels", w.levels.numpy()),
                 "" if w.input_order is None else g.weight(f"{name}.input_order", w.input_order.numpy())]
        attrs = {"bits": w.bits, "group": w.group, "act": w.act, "activations": w.activations.value}
        if lw_format is not None:  # the engine's linear method for it (model/layers/linear_methods/)
            attrs["format"] = lw_format
        return names, attrs

    def embedding(self, table: Any) -> str:
        names, attrs = self._weight("model.embed_tokens", table)
        _in_order("model.embed_tokens", names)
        self._table = (names, attrs)  # a tied head shares these initializers
        return self._op("Embedding", [self.inputs.input_ids, *names], name="embed_tokens", **attrs)

    def rms_norm(self, x: str, weight: np.ndarray, eps: float, name: str) -> str:
        return self._op("RMSNorm", [x, self.g.weight(f"{name}.weight", weight)], epsilon=eps, name=name)

    def add_rms_norm(self, x: str, residual: str, weight: np.ndarray, eps: float,
                     name: str) -> tuple[str, str]:
        y, total = self._op("AddRMSNorm", [x, residual, self.g.weight(f"{name}.weight", weight)], 2,
                            epsilon=eps, name=name)
        return y, total

    def linear(self, x: str, lw: LinearWeight) -> str:
        return self._linear(x, *self._weight(lw.name, lw.weight, lw.method), lw.bias, lw.name)

    def _linear(self, x: str, names: list[str], attrs: dict[str, Any], bias: np.ndarray | None, name: str) -> str:
        b = "" if bias is None else self.g.weight(f"{name}.bias", bias)
        return self._op("Linear", [x, names[0], b, *names[1:]], name=name, **attrs)

    def act_and_mul(self, gate_up: str, inter: int, act: Any) -> str:
        if type(act).__name__ == "GeluAndMul":
            return self._op("GeluAndMul", [gate_up], approximate=act.approximate)
        return self._op("SiluAndMul", [gate_up])

    def moe(self, x: str, router: LinearWeight, experts: Experts, routing: Routing, name: str) -> str:
        """Softmax top-k routing over the router's logits, each expert a gated MLP (Mixtral); the stacks as
        the engine holds them (`experts.formats`: the quantized stacks' linear-method names)."""
        if routing.scoring != "softmax" or routing.num_groups or routing.scale != 1.0:
            raise ValueError(f"ONNX export (perfxlm flavor): {name} routes by {routing.scoring} scores in "
                             "groups or scaled, which the MoE op does not.")
        top_k, renormalize, act, formats = routing.top_k, routing.renormalize, experts.act, experts.formats
        logits = self.linear(x, router)
        gu, gu_attrs = self._weight(f"{name}.gate_up_proj", experts.gate_up, formats[0])
        dn, dn_attrs = self._weight(f"{name}.down_proj", experts.down, formats[1])
        _in_order(f"{name}.gate_up_proj", gu)
        _in_order(f"{name}.down_proj", dn)
        gu, dn = gu[:4], dn[:4]
        attrs = {f"gate_up_{k}": v for k, v in gu_attrs.items()}
        attrs.update({f"down_{k}": v for k, v in dn_attrs.items()})
        approximate = getattr(act, "approximate", "none")
        return self._op("MoE", [x, logits, gu[0], dn[0], *gu[1:], *dn[1:]], top_k=top_k,
                        renormalize=int(renormalize), activation=type(act).__name__, approximate=approximate,
                        name=name, **attrs)

    def shared_expert(self, x: str, routed: str, gate_up: LinearWeight, down: LinearWeight, inter: int, act: Any,
                      gate: LinearWeight, name: str) -> str:
        """routed + sigmoid(x gate^T) * mlp(x): the shared expert as Linear / activation nodes (any weight
        format a Linear takes), added under its gate as the module path adds it."""
        shared = self.linear(self.act_and_mul(self.linear(x, gate_up), inter, act), down)
        return self._op("SigmoidGatedAdd", [routed, shared, self.linear(x, gate)], name=name)

    # ---- attention ------------------------------------------------------------------------------------
    def self_attention(self, qkv: str, spec: AttentionSpec, qk_norms: HeadNorms | None, rope: Rope,
                       cache: tuple[str, str], layer: int, name: str) -> str:
        g, s = self.g, self.inputs
        h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        if qk_norms is not None:
            qkv = self._op("HeadRMSNorm", [qkv, g.weight(f"{name}.q_norm.weight", qk_norms.q_weight),
                                           g.weight(f"{name}.k_norm.weight", qk_norms.k_weight)],
                           num_heads=h, num_kv_heads=kvh, head_dim=d, epsilon=qk_norms.eps, name=f"{name}.qk_norm")
        cos, sin = self._once(("rope", rope.key), lambda: (g.weight(f"{rope.key}.cos", rope.cos),
                                                           g.weight(f"{rope.key}.sin", rope.sin)))
        qkv = self._op("Rotary", [qkv, s.positions, cos, sin], num_heads=h + kvh, head_dim=d,
                       name=f"{name}.rotary")
        capped = {}
        if spec.soft_cap is not None:  # Gemma 2 (op-set version 2: an engine running 1 refuses the graph)
            capped = {"logit_soft_cap": spec.soft_cap}
            g.versions[PERFXLM_DOMAIN] = max(g.versions.get(PERFXLM_DOMAIN, 1), SOFT_CAP_OPSET)
        return self._op("PagedAttention", [qkv, cache[0], cache[1], s.block_tables, s.seq_lens, s.query_start_loc,
                                           s.slot_mapping],
                        num_heads=h, num_kv_heads=kvh, head_dim=d, scale=spec.scale,
                        sliding_window=spec.sliding_window or 0, name=f"{name}.attn", **capped)

    def scaled(self, x: str, factor: float) -> str:
        return self._op("Scale", [x], factor=factor, name="embed_scale")

    def logits(self, h: str, head: LinearWeight | None, vocab: int, soft_cap: float | None = None) -> None:
        rows = self.g.op("Gather", [h, self.inputs.logits_indices], axis=0, name="logits_rows")
        if head is None:
            names, attrs = self._table
            logits = self._linear(rows, names, attrs, None, "lm_head")
        else:
            logits = self.linear(rows, head)
        if soft_cap is not None:  # Gemma 2 / 3
            self._op("SoftCap", [logits], cap=soft_cap, name="logit_soft_cap")
        self.g.nodes[-1].output[0] = "logits"  # the last node's own output, no Identity after it
        self.g.add_output("logits", TensorProto.FLOAT, ["num_logits", vocab])
