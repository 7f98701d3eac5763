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
Op-set version 3 (written only where a graph needs one of them; `manifest.FAMILIES_OPSET`):
    PagedAttention's optional input 7, sinks float [num_heads] (a learned logit per head in each softmax's
        sum: gpt-oss), and attribute query_scale (the queries multiplied by it before attention, at scale 1:
        OPT)
    Add(x, y): x + y (OPT's residual adds, DeepSeek's shared experts added to the routed ones)
    PositionEmbedding(positions, table) [offset]: rows offset + position of a learned position table (OPT)
    LayerNorm(x, weight?, bias?) [epsilon]
    Activation(x) [function]: an elementwise activation by its transformers name (OPT's relu)
    TopKSoftmax(logits) -> (weights, ids) [top_k]: softmax of each row's top-k logits (gpt-oss's router)
    GroupedTopK(x, weight, correction_bias?) -> (weights, ids) [top_k, scoring (softmax | sigmoid),
        num_groups (0: top k of all experts), topk_group, renormalize, routed_scaling_factor]: DeepSeek's
        router over float32 logits of its float32 weight [E, H]
    Experts(x, weights [T, k], ids [T, k], gate_up, down, gate_up's scales?, mins?, levels?, down's scales?,
        mins?, levels?, gate_up_bias? [E, 2I], down_bias? [E, H]): each token through its routed experts,
        summed by weight; MoE's attributes less the routing ones, and the activation ClampedSwiGLU [alpha,
        limit] (gate and up columns interleaved: gpt-oss)
    LatentAttention(q, kv, key_cache, value_cache, block_tables, seq_lens, query_start_loc, slot_mapping,
        positions, cos, sin, kv_norm, w_uk [H, nope, rank], w_uv_t [H, rank, v]): DeepSeek's multi-head
        latent attention over the latent cache (value_cache is key_cache: the latent row is both), q the
        query projection's output [n, H * (nope + rope)], kv kv_a_proj_with_mqa's [n, rank + rope]; out
        [n, H * v] before o_proj  [num_heads, nope_dim, rope_dim, v_dim, kv_lora_rank, scale, epsilon]
Op-set version 4 (`manifest.PLANES_OPSET`): any op holding 5- or 6-bit codes (bits 5 / 6), whose bit
    planes follow perfxlm/quant/code_layout.py's order (version 3's followed GGUF Q5_0's)

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

from perfxlm.export.features import ALL_FEATURES
from perfxlm.export.graph import Graph
from perfxlm.export.graph_mla import LatentWeights
from perfxlm.export.graph_moe import Experts, Routing
from perfxlm.export.graph_ops import AttentionSpec, GraphOps, HeadNorms, LinearWeight, Rope
from perfxlm.export.lora_record import LORA_KEY, lora_record
from perfxlm.export.manifest import FAMILIES_OPSET, PERFXLM_DOMAIN, PLANES_OPSET, SOFT_CAP_OPSET
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
    activations = ("SiluAndMul", "GeluAndMul", "ClampedSwiGLU")
    # every family the engine runs (model/graph/kernels.py has a kernel for each piece); a feature named
    # later is refused by name until it has one
    features = ALL_FEATURES
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

    def _op(self, op_type: str, inputs: list[str], num_outputs: int = 1, since: int = 1, **attrs: Any) -> Any:
        """A node of the perfxlm domain; `since`: the op-set version that holds it (the graph is written at
        the lowest version holding all its nodes)."""
        while inputs and not inputs[-1]:  # trailing optional inputs left out
            inputs = inputs[:-1]
        if since > 1:
            self.g.versions[PERFXLM_DOMAIN] = max(self.g.versions.get(PERFXLM_DOMAIN, 1), since)
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
        if w.bits in (5, 6):  # their bit planes' order is version 4's (manifest.PLANES_OPSET)
            self.g.versions[PERFXLM_DOMAIN] = max(self.g.versions.get(PERFXLM_DOMAIN, 1), PLANES_OPSET)
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
        kind = type(act).__name__
        if kind == "GeluAndMul":
            return self._op("GeluAndMul", [gate_up], approximate=act.approximate)
        if kind != "SiluAndMul":  # (gpt-oss's clamped SwiGLU gates its experts only: an Experts attribute)
            raise ValueError(f"ONNX export (perfxlm flavor): a dense MLP with the activation {kind} has no op.")
        return self._op("SiluAndMul", [gate_up])

    def moe(self, x: str, router: LinearWeight, experts: Experts, routing: Routing, name: str) -> str:
        """A mixture as the module path routes it: softmax top-k over a Linear router's logits in one MoE
        node (Mixtral, Qwen-MoE); gpt-oss's softmax of the top-k logits and DeepSeek's grouped router as
        their own routing nodes feeding an Experts node. The stacks as the engine holds them
        (`experts.formats`: the quantized stacks' linear-method names)."""
        if routing.grouped_router:
            bias = "" if routing.correction_bias is None else self.g.weight(f"{router.name}.e_score_correction_bias",
                                                                             routing.correction_bias)
            weights, ids = self._op("GroupedTopK", [x, self.g.weight(f"{router.name}.weight", router.weight), bias], 2,
                                    since=FAMILIES_OPSET, top_k=routing.top_k, scoring=routing.scoring,
                                    num_groups=routing.num_groups or 0, topk_group=routing.topk_group or 0,
                                    renormalize=int(routing.renormalize),
                                    routed_scaling_factor=routing.scale, name=f"{router.name}")
            return self._experts(x, weights, ids, experts, name)
        if routing.scoring == "topk_softmax":
            weights, ids = self._op("TopKSoftmax", [self.linear(x, router)], 2, since=FAMILIES_OPSET,
                                    top_k=routing.top_k, name=f"{router.name}.topk")
            return self._experts(x, weights, ids, experts, name)
        if routing.scoring != "softmax" or routing.num_groups or routing.scale != 1.0:
            raise ValueError(f"ONNX export (perfxlm flavor): {name} routes by {routing.scoring} scores in "
                             "groups or scaled through a Linear router, which no routing op does.")
        stacks, attrs = self._stacks(experts, name)
        if experts.gate_up_bias is not None or type(experts.act).__name__ not in ("SiluAndMul", "GeluAndMul"):
            raise ValueError(f"ONNX export (perfxlm flavor): {name} has biased experts or the activation "
                             f"{type(experts.act).__name__} under softmax top-k routing, which the MoE op does not.")
        return self._op("MoE", [x, self.linear(x, router), *stacks], top_k=routing.top_k,
                        renormalize=int(routing.renormalize), name=name, **attrs)

    def _stacks(self, experts: Experts, name: str) -> tuple[list[str], dict[str, Any]]:
        """The expert stacks' inputs (gate_up, down, gate_up's scales, mins, levels, down's) and attributes
        (each stack's weight attributes prefixed, the activation)."""
        gu, gu_attrs = self._weight(f"{name}.gate_up_proj", experts.gate_up, experts.formats[0])
        dn, dn_attrs = self._weight(f"{name}.down_proj", experts.down, experts.formats[1])
        _in_order(f"{name}.gate_up_proj", gu)
        _in_order(f"{name}.down_proj", dn)
        attrs = {f"gate_up_{k}": v for k, v in gu_attrs.items()}
        attrs.update({f"down_{k}": v for k, v in dn_attrs.items()})
        act = experts.act
        attrs["activation"] = type(act).__name__
        if attrs["activation"] == "ClampedSwiGLU":
            attrs.update(alpha=float(act.alpha), limit=float(act.limit))
        else:
            attrs["approximate"] = getattr(act, "approximate", "none")
        return [gu[0], dn[0], *gu[1:4], *dn[1:4]], attrs

    def _experts(self, x: str, weights: str, ids: str, experts: Experts, name: str) -> str:
        stacks, attrs = self._stacks(experts, name)
        g = self.g
        biases = ["" if b is None else g.weight(f"{name}.{part}_bias", b)
                  for part, b in (("gate_up_proj", experts.gate_up_bias), ("down_proj", experts.down_bias))]
        return self._op("Experts", [x, weights, ids, *stacks, *biases], since=FAMILIES_OPSET, name=name, **attrs)

    def shared_expert(self, x: str, routed: str, gate_up: LinearWeight, down: LinearWeight, inter: int, act: Any,
                      gate: LinearWeight | None, name: str) -> str:
        """routed + sigmoid(x gate^T) * mlp(x) (Qwen2-MoE), or routed + mlp(x) without a gate (DeepSeek): the
        shared expert as Linear / activation nodes (any weight format a Linear takes), added as the module
        path adds it."""
        shared = self.linear(self.act_and_mul(self.linear(x, gate_up), inter, act), down)
        if gate is None:
            return self.add(routed, shared, name)
        return self._op("SigmoidGatedAdd", [routed, shared, self.linear(x, gate)], name=name)

    # ---- OPT's pieces -----------------------------------------------------------------------------------
    def add(self, x: str, y: str, name: str | None = None) -> str:
        return self._op("Add", [x, y], since=FAMILIES_OPSET, name=name)

    def learned_positions(self, table: np.ndarray, offset: int) -> str:
        return self._op("PositionEmbedding", [self.inputs.positions,
                                              self.g.weight("model.decoder.embed_positions.weight", table)],
                        since=FAMILIES_OPSET, offset=offset, name="embed_positions")

    def layer_norm(self, x: str, weight: np.ndarray, bias: np.ndarray, eps: float, name: str) -> str:
        g = self.g
        return self._op("LayerNorm", [x, g.weight(f"{name}.weight", weight), g.weight(f"{name}.bias", bias)],
                        since=FAMILIES_OPSET, epsilon=eps, name=name)

    def activation(self, x: str, name: str) -> str:
        return self._op("Activation", [x], since=FAMILIES_OPSET, function=name)

    # ---- attention ------------------------------------------------------------------------------------
    def self_attention(self, qkv: str, spec: AttentionSpec, qk_norms: HeadNorms | None, rope: Rope,
                       cache: tuple[str, str], layer: int, name: str) -> str:
        g, s = self.g, self.inputs
        h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        if qk_norms is not None:
            qkv = self._op("HeadRMSNorm", [qkv, g.weight(f"{name}.q_norm.weight", qk_norms.q_weight),
                                           g.weight(f"{name}.k_norm.weight", qk_norms.k_weight)],
                           num_heads=h, num_kv_heads=kvh, head_dim=d, epsilon=qk_norms.eps, name=f"{name}.qk_norm")
        if rope is not None:  # (OPT: positions were added to the embeddings)
            cos, sin = self._rope_tables(rope)
            qkv = self._op("Rotary", [qkv, s.positions, cos, sin], num_heads=h + kvh, head_dim=d,
                           name=f"{name}.rotary")
        attrs: dict[str, Any] = {"scale": spec.scale}
        since = 1
        if spec.soft_cap is not None:  # Gemma 2 (op-set version 2: an engine running 1 refuses the graph)
            attrs["logit_soft_cap"] = spec.soft_cap
            since = SOFT_CAP_OPSET
        if spec.query_scaled:  # OPT: q * scale, attended at scale 1, as the module path rounds it
            attrs.update(scale=1.0, query_scale=spec.scale)
            since = FAMILIES_OPSET
        sinks = ""
        if spec.sinks is not None:  # gpt-oss
            sinks = g.weight(f"{name}.sinks", np.asarray(spec.sinks, np.float32))
            since = FAMILIES_OPSET
        return self._op("PagedAttention", [qkv, cache[0], cache[1], s.block_tables, s.seq_lens, s.query_start_loc,
                                           s.slot_mapping, sinks],
                        since=since, num_heads=h, num_kv_heads=kvh, head_dim=d,
                        sliding_window=spec.sliding_window or 0, name=f"{name}.attn", **attrs)

    def _rope_tables(self, rope: Rope) -> tuple[str, str]:
        g = self.g
        return self._once(("rope", rope.key), lambda: (g.weight(f"{rope.key}.cos", rope.cos),
                                                       g.weight(f"{rope.key}.sin", rope.sin)))

    def latent_attention(self, h: str, w: LatentWeights, rope: Rope, cache: tuple[str, str], layer: int,
                         name: str) -> str:
        """The query and latent projections as Linear (and RMSNorm) nodes, then one LatentAttention node over
        the layer's latent cache (kv_b_proj absorbed, as the module path folds it), then o_proj."""
        g, s = self.g, self.inputs
        if w.q is not None:
            q = self.linear(h, w.q)
        else:
            q = self.linear(self.rms_norm(self.linear(h, w.q_a), *w.q_a_norm, f"{name}.q_a_layernorm"), w.q_b)
        kv = self.linear(h, w.kv_a)
        cos, sin = self._rope_tables(rope)
        norm, eps = w.kv_a_norm
        out = self._op("LatentAttention", [q, kv, cache[0], cache[1], s.block_tables, s.seq_lens, s.query_start_loc,
                                           s.slot_mapping, s.positions, cos, sin,
                                           g.weight(f"{name}.kv_a_layernorm.weight", norm),
                                           g.weight(f"{name}.w_uk", w.w_uk), g.weight(f"{name}.w_uv_t", w.w_uv_t)],
                       since=FAMILIES_OPSET, num_heads=w.num_heads, nope_dim=w.nope_dim, rope_dim=w.rope_dim,
                       v_dim=w.v_dim, kv_lora_rank=w.kv_lora_rank, scale=w.scale, epsilon=eps, name=f"{name}.attn")
        return self.linear(out, w.o)

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
