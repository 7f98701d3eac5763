"""The `GraphOps` seam: the few ops a decoder layer is made of (norms, rotary, attention over a past with
its window, soft cap and sinks, linear of each weight format, gated activations; a mixture of experts and
latent attention from `graph_moe.py` / `graph_mla.py`), each flavor emitting them its own way. `decoder.py`
writes every family once against this interface.

Values are graph value names. Hidden states are [batch, seq, features]; a projection's heads stay
folded in the feature axis ([batch, seq, heads * head_dim]) between ops, as ONNX Runtime's contrib
ops take them.

- `StandardOps`: standard ONNX ops only (opset 17), so any ONNX runtime runs the graph. Quantized weights
  are dequantized to float32 initializers (standard ONNX has no packed 4-bit matmul before opset 21).
- `OrtOps`: ONNX Runtime's contrib ops where they exist, the graph onnxruntime-genai's own builder makes:
  SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization, RotaryEmbedding, GroupQueryAttention,
  MatMulNBits for quantized weights (kept packed); the rest as in `StandardOps`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import TensorProto

from perfxlm.export.features import ALL_FEATURES
from perfxlm.export.graph import MS_DOMAIN, Graph
from perfxlm.export.graph_mla import LatentAttentionOps
from perfxlm.export.graph_moe import MoeOps
from perfxlm.export.graph_values import AttentionSpec, DecoderInputs, HeadNorms, LinearWeight, Rope

from perfxlm.export.matmul_nbits import pack_matmul_nbits
from perfxlm.quant.weight import QuantizedWeight

__all__ = ["AttentionSpec", "DecoderInputs", "HeadNorms", "LinearWeight", "Rope", "GraphOps", "OrtOps"]

NEG_LARGE = float(np.finfo(np.float32).min)  # masked scores: exp() is exactly 0, a fully masked row no NaN


def dequantized(weight: QuantizedWeight) -> np.ndarray:
    """The weight as the model multiplies by it, float32 [N, K]: an act-order weight's columns put back in
    input order (`dense`)."""
    return weight.dense().float().numpy()


class GraphOps(MoeOps, LatentAttentionOps):
    """Standard ONNX ops (the `standard` flavor). Shared values (shapes, the attention mask, rotary
    tables gathered at the positions) are built once per graph, at their first use."""

    flavor = "standard"
    activations: tuple[str, ...] = ("SiluAndMul", "GeluAndMul", "ClampedSwiGLU")  # gated-MLP activations
    # what of a family beyond the Llama block it writes (export/features.py names them)
    features: frozenset[str] = ALL_FEATURES
    why_not = ""  # why a feature it lacks cannot be written, as a refusal says it

    def __init__(self, g: Graph) -> None:
        self.g = g
        self.inputs = self.declare_inputs(g)
        self._cache: dict[Any, Any] = {}
        self._table: tuple[str, Any] | None = None  # the embedding table's initializer, for a tied head

    default_dtype = "float32"  # `perfxlm export onnx --dtype` left out

    @classmethod
    def check_weight_dtype(cls, dtype: str) -> str:
        """The dtype the model is loaded and its float matrices stored in: float32 here (standard ONNX
        Runtime kernels have no bf16 GEMM), which "auto" means for this flavor."""
        if dtype not in ("auto", "float32"):
            raise ValueError(f"dtype {dtype!r}: the {cls.flavor} flavor writes float32 weights; "
                             "bfloat16 weights are the perfxlm flavor's (--flavor perfxlm).")
        return "float32"

    # ---- the graph's interface (onnxruntime-genai's layout; the perfxlm flavor has its own) -------------
    @staticmethod
    def declare_inputs(g: Graph) -> DecoderInputs:
        i64 = TensorProto.INT64
        return DecoderInputs(
            g.add_input("input_ids", i64, ["batch_size", "sequence_length"]),
            g.add_input("attention_mask", i64, ["batch_size", "total_sequence_length"]),
            g.add_input("position_ids", i64, ["batch_size", "sequence_length"]),
        )

    def layer_cache(self, layer: int, kv_heads: int, head_dim: int) -> tuple[str, str]:
        """Layer `layer`'s K/V as the graph holds them: here past inputs (with present outputs)."""
        if self.g.kv_shape not in (None, (kv_heads, head_dim)):
            raise ValueError(f"ONNX export: layer {layer}'s cache is {kv_heads} x {head_dim}, another layer's "
                             f"{self.g.kv_shape[0]} x {self.g.kv_shape[1]}; the {self.flavor} flavor's layout has "
                             "one shape for all.")
        self.g.kv_shape = (kv_heads, head_dim)
        past = []
        for kind in ("key", "value"):
            past.append(self.g.add_input(f"past_key_values.{layer}.{kind}", TensorProto.FLOAT,
                                         ["batch_size", kv_heads, "past_sequence_length", head_dim]))
            self.g.add_output(f"present.{layer}.{kind}", TensorProto.FLOAT,
                              ["batch_size", kv_heads, "total_sequence_length", head_dim])
        return past[0], past[1]

    def self_attention(self, qkv: str, spec: AttentionSpec, qk_norms: "HeadNorms | None", rope: Rope,
                       cache: tuple[str, str], layer: int, name: str) -> str:
        """The fused QKV projection's output in, attention's output [.., heads * head_dim] out: split,
        q/k head norms (Qwen3), rotary, attention over the cache."""
        g = self.g
        heads, kv_heads, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q, k, v = g.op("Split", [qkv, g.const([heads * d, kv_heads * d, kv_heads * d])], num_outputs=3, axis=-1)
        if qk_norms is not None:
            q = self.head_rms_norm(q, heads, d, qk_norms.q_weight, qk_norms.eps, f"{name}.q_norm")
            k = self.head_rms_norm(k, kv_heads, d, qk_norms.k_weight, qk_norms.eps, f"{name}.k_norm")
        out, present_k, present_v = self.attention(q, k, v, cache[0], cache[1], spec, rope, f"{name}.attn")
        g.rename(present_k, f"present.{layer}.key")
        g.rename(present_v, f"present.{layer}.value")
        return out

    def logits(self, h: str, head: "LinearWeight | None", vocab: int, soft_cap: float | None = None) -> None:
        """The LM head over the final hidden states, the graph's first output; `head` None: tied to the
        embedding table; `soft_cap`: logits bounded to (-cap, cap) (Gemma 2)."""
        if head is None:
            # shares the float table: no second copy, and a float GEMM (ONNX Runtime's 8-bit MatMulNBits
            # dequantizes the whole weight at every call: 30x slower on a 49k-row head, measured)
            name, table = self._table
            logits = self.tied_head(h, name, table)
        else:
            logits = self.linear(h, head)
        if soft_cap is not None:
            logits = self.soft_cap(logits, soft_cap)
        self.g.rename(logits, "logits")
        self.g.add_output("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", vocab])
        self.g.outputs.insert(0, self.g.outputs.pop())  # logits first, as onnxruntime-genai's builder orders them

    def record_model(self, model: Any) -> None:
        """What the flavor records about the loaded model beside the nodes (the graph's metadata, for the
        runtime that runs it); nothing here: ONNX Runtime needs only the nodes."""

    def _once(self, key: Any, build) -> Any:
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    # ---- shared values -------------------------------------------------------------------------------
    def batch_seq_shape(self) -> str:
        """int64 [2]: (batch, seq) of this call."""
        return self._once("bs", lambda: self.g.op("Shape", [self.inputs.input_ids], name="batch_seq"))

    def with_last(self, n: int) -> str:
        """int64 [3]: (batch, seq, n), the shape of a projection's output."""
        return self._once(("shape", n),
                          lambda: self.g.op("Concat", [self.batch_seq_shape(), self.g.const([n])], axis=0))

    # ---- embedding, norms, projections -------------------------------------------------------------
    def embedding(self, table: Any) -> str:
        # gathered from as float (a quantized table dequantized once, here)
        table = dequantized(table) if isinstance(table, QuantizedWeight) else table
        w = self.g.weight("model.embed_tokens.weight", table)
        self._table = (w, table)
        return self.g.op("Gather", [w, self.inputs.input_ids], axis=0, name="embed_tokens")

    def scaled(self, x: str, factor: float) -> str:
        """x times a constant (Gemma's embeddings by sqrt(hidden))."""
        return self.g.op("Mul", [x, self.g.const(factor, np.float32)])

    def add(self, x: str, y: str) -> str:
        return self.g.op("Add", [x, y])

    def soft_cap(self, x: str, cap: float) -> str:
        """cap * tanh(x / cap), as the engine's soft_cap computes it."""
        g = self.g
        return g.op("Mul", [g.op("Tanh", [g.op("Div", [x, g.const(cap, np.float32)])]), g.const(cap, np.float32)])

    def learned_positions(self, table: np.ndarray, offset: int) -> str:
        """Rows `offset` + position of a position table (OPT's starts two rows in)."""
        g = self.g
        rows = g.op("Add", [self.inputs.position_ids, g.const(offset)]) if offset else self.inputs.position_ids
        return g.op("Gather", [g.weight("model.decoder.embed_positions.weight", table), rows], axis=0,
                    name="embed_positions")

    def layer_norm(self, x: str, weight: np.ndarray, bias: np.ndarray, eps: float, name: str) -> str:
        g = self.g
        return g.op("LayerNormalization", [x, g.weight(f"{name}.weight", weight), g.weight(f"{name}.bias", bias)],
                    axis=-1, epsilon=eps, name=name)

    def activation(self, x: str, name: str) -> str:
        """An elementwise activation by its transformers name (OPT's ReLU)."""
        if name == "relu":
            return self.g.op("Relu", [x])
        if name in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            return self.gelu(x, "none" if name == "gelu" else "tanh")
        if name in ("silu", "swish"):
            return self.g.op("Mul", [x, self.g.op("Sigmoid", [x])])
        raise ValueError(f"ONNX export: activation {name!r} is not one the exporter writes.")

    def gelu(self, x: str, approximate: str) -> str:
        """torch's GELU: 0.5 x (1 + erf(x / sqrt 2)), or its tanh approximation."""
        g = self.g
        f32 = np.float32
        if approximate == "tanh":
            cube = g.op("Mul", [g.op("Mul", [g.op("Mul", [x, x]), x]), g.const(0.044715, f32)])
            inner = g.op("Mul", [g.op("Add", [x, cube]), g.const(float(np.sqrt(2 / np.pi)), f32)])
            core = g.op("Tanh", [inner])
        else:
            core = g.op("Erf", [g.op("Div", [x, g.const(float(np.sqrt(2.0)), f32)])])
        return g.op("Mul", [g.op("Mul", [x, g.const(0.5, f32)]), g.op("Add", [core, g.const(1.0, f32)])])

    def rms_norm(self, x: str, weight: np.ndarray, eps: float, name: str) -> str:
        w = self.g.weight(f"{name}.weight", weight)
        g = self.g
        mean_sq = g.op("ReduceMean", [g.op("Mul", [x, x])], axes=[-1], keepdims=1)
        inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [mean_sq, g.const(eps, np.float32)])])])
        return g.op("Mul", [g.op("Mul", [x, inv]), w], name=name)

    def add_rms_norm(self, x: str, residual: str, weight: np.ndarray, eps: float,
                     name: str) -> tuple[str, str]:
        """(norm(x + residual), x + residual)."""
        total = self.g.op("Add", [x, residual])
        return self.rms_norm(total, weight, eps, name), total

    def head_rms_norm(self, x: str, heads: int, head_dim: int, weight: np.ndarray, eps: float,
                      name: str) -> str:
        """RMSNorm over each head of [batch, seq, heads * head_dim] (Qwen3's q/k norms)."""
        x4 = self.g.op("Reshape", [x, self.g.const([0, 0, heads, head_dim])])
        y = self.rms_norm(x4, weight, eps, name)
        return self.g.op("Reshape", [y, self.g.const([0, 0, heads * head_dim])])

    def linear(self, x: str, lw: LinearWeight, rows: bool = False) -> str:
        """x [b, s, K] (`rows`: [n, K]) times the weight transposed, plus its bias."""
        w = lw.weight
        array = dequantized(w) if isinstance(w, QuantizedWeight) else w
        return self._gemm(x, array, lw, rows=rows)

    def _gemm(self, x: str, array: np.ndarray, lw: LinearWeight, weight_name: str | None = None,
              rows: bool = False) -> str:
        """x [b, s, K] (`rows`: [n, K]) times weight [N, K] transposed (kept as the checkpoint stores it, so a
        tied head shares the embedding table)."""
        g = self.g
        n, k = array.shape
        w = weight_name or g.weight(f"{lw.name}.weight", array)
        args = [x if rows else g.op("Reshape", [x, g.const([-1, k])]), w]
        if lw.bias is not None:
            args.append(g.weight(f"{lw.name}.bias", lw.bias))
        y = g.op("Gemm", args, transB=1, name=lw.name)
        return y if rows else g.op("Reshape", [y, self.with_last(n)])

    def tied_head(self, x: str, table_name: str, table: np.ndarray) -> str:
        return self._gemm(x, table, LinearWeight(table, None, "lm_head"), weight_name=table_name)

    def act_and_mul(self, gate_up: str, inter: int, act: Any) -> str:
        """The gated MLP's activation of a [.., 2 * inter] gate | up value (one of `activations`); gpt-oss's
        clamped SwiGLU reads gate and up interleaved (even, odd columns)."""
        kind = type(act).__name__
        if kind == "GeluAndMul":
            g = self.g
            gate, up = g.op("Split", [gate_up, g.const([inter, inter])], num_outputs=2, axis=-1)
            return g.op("Mul", [self.gelu(gate, act.approximate), up])
        if kind == "ClampedSwiGLU":
            return self.clamped_swiglu(gate_up, inter, act.alpha, act.limit)
        return self.silu_and_mul(gate_up, inter)

    def clamped_swiglu(self, gate_up: str, inter: int, alpha: float, limit: float) -> str:
        """(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit); gate and up columns
        alternate."""
        g = self.g
        f32 = np.float32
        pairs = g.op("Reshape", [gate_up, g.const([0, inter, 2])])  # [n, inter, 2] (rows of experts' tokens)
        gate, up = (g.op("Reshape", [t, g.const([0, inter])])
                    for t in g.op("Split", [pairs, g.const([1, 1])], num_outputs=2, axis=-1))
        gate = g.op("Min", [gate, g.const(limit, f32)])
        up = g.op("Clip", [up, g.const(-limit, f32), g.const(limit, f32)])
        glu = g.op("Mul", [gate, g.op("Sigmoid", [g.op("Mul", [gate, g.const(alpha, f32)])])])
        return g.op("Mul", [g.op("Add", [up, g.const(1.0, f32)]), glu])

    def silu_and_mul(self, gate_up: str, inter: int) -> str:
        g = self.g
        gate, up = g.op("Split", [gate_up, g.const([inter, inter])], num_outputs=2, axis=-1)
        return g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])

    # ---- rotary and attention ----------------------------------------------------------------------
    def rotary(self, x: str, heads: int, head_dim: int, rope: Rope) -> str:
        """Rotate-half rotary on the first rotary_dim channels of each head of x [b, s, heads * head_dim]."""
        g = self.g
        cos, sin = self._once(("rope", rope.key), lambda: tuple(
            g.op("Unsqueeze", [g.op("Gather", [g.weight(f"{_prefix(rope)}{n}_table", t), self.inputs.position_ids],
                                    axis=0), g.const([2])])
            for n, t in (("cos", rope.cos), ("sin", rope.sin))))  # [b, s, 1, rotary_dim]
        rot = rope.rotary_dim
        x4 = g.op("Reshape", [x, g.const([0, 0, heads, head_dim])])
        if rot < head_dim:
            x_rot, x_pass = g.op("Split", [x4, g.const([rot, head_dim - rot])], num_outputs=2, axis=-1)
        else:
            x_rot, x_pass = x4, None
        x1, x2 = g.op("Split", [x_rot, g.const([rot // 2, rot // 2])], num_outputs=2, axis=-1)
        rotated = g.op("Concat", [g.op("Neg", [x2]), x1], axis=-1)
        out = g.op("Add", [g.op("Mul", [x_rot, cos]), g.op("Mul", [rotated, sin])])
        if x_pass is not None:
            out = g.op("Concat", [out, x_pass], axis=-1)
        return g.op("Reshape", [out, g.const([0, 0, heads * head_dim])])

    def _mask_bias(self, window: int | None, groups: int) -> str:
        """float [b, 1, groups * s, total]: 0 where a query may see a key, NEG_LARGE elsewhere. A key's
        position is the count of attended slots before it (attention_mask's running sum - 1), so a row's
        past may end in padding (a batch of pasts of different lengths); query i of row b sits at
        position_ids[b, i] and sees the attended keys at or before it (within the window). Rows repeat
        per query head of a KV group (see attention)."""
        def build() -> str:
            g = self.g
            mask = self.inputs.attention_mask
            keys = g.op("Sub", [g.op("CumSum", [mask, g.const(1)]), g.const(1)])
            keys = g.op("Unsqueeze", [keys, g.const([1])])  # [b, 1, T]
            queries = g.op("Unsqueeze", [self.inputs.position_ids, g.const([2])])  # [b, S, 1]
            allowed = g.op("LessOrEqual", [keys, queries])
            if window is not None:
                first = g.op("Sub", [queries, g.const(window)])
                allowed = g.op("And", [allowed, g.op("Greater", [keys, first])])
            attended = g.op("Unsqueeze", [g.op("Cast", [mask], to=9), g.const([1])])  # bool [b, 1, T]
            allowed = g.op("Unsqueeze", [g.op("And", [allowed, attended]), g.const([1])])  # [b, 1, S, T]
            bias = g.op("Where", [allowed, g.const(0.0, np.float32), g.const(NEG_LARGE, np.float32)])
            return bias if groups == 1 else g.op("Tile", [bias, g.const([1, 1, groups, 1])])
        return self._once(("mask", window, groups), build)

    def attention(self, q: str, k: str, v: str, past_k: str, past_v: str, spec: AttentionSpec,
                  rope: "Rope | None", name: str) -> tuple[str, str, str]:
        """Causal attention of this call's queries over past + new keys, rotary applied here (`rope` None:
        q and k come rotated). q [b, s, H*D], k / v [b, s, KV*D], past [b, KV, P, D] -> (out [b, s, H*D],
        present K, V [b, KV, P + s, D]). The G query heads of a KV head are folded into its query rows
        ([b, KV, G*s, D]), so K/V are never repeated per head."""
        g = self.g
        h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        if rope is not None:
            q = self.rotary(q, h, d, rope)
            k = self.rotary(k, kvh, d, rope)

        def heads_first(t: str, n: int) -> str:  # [b, s, n*D] -> [b, n, s, D]
            return g.op("Transpose", [g.op("Reshape", [t, g.const([0, 0, n, d])])], perm=[0, 2, 1, 3])

        present_k = g.op("Concat", [past_k, heads_first(k, kvh)], axis=2)
        present_v = g.op("Concat", [past_v, heads_first(v, kvh)], axis=2)
        qg = g.op("Reshape", [heads_first(q, h), g.const([0, kvh, -1, d])])  # [b, KV, G*s, D]
        scores = g.op("MatMul", [qg, g.op("Transpose", [present_k], perm=[0, 1, 3, 2])])
        scores = g.op("Mul", [scores, g.const(spec.scale, np.float32)])
        if spec.soft_cap is not None:
            scores = self.soft_cap(scores, spec.soft_cap)
        scores = g.op("Add", [scores, self._mask_bias(spec.sliding_window, h // kvh)])
        if spec.sinks is None:
            probs = g.op("Softmax", [scores], axis=-1)
        else:  # each head's sink logit one more column of its softmax, dropped after it
            probs = g.op("Softmax", [g.op("Concat", [scores, self._sink_column(spec, name)], axis=-1)], axis=-1)
            probs = g.op("Slice", [probs, g.const([0]), g.const([-1]), g.const([-1])])
        out = g.op("MatMul", [probs, present_v])  # [b, KV, G*s, D]
        out = g.op("Transpose", [g.op("Reshape", [out, g.const([0, h, -1, d])])], perm=[0, 2, 1, 3])
        return g.op("Reshape", [out, g.const([0, 0, h * d])], name=name), present_k, present_v


    def _sink_column(self, spec: AttentionSpec, name: str) -> str:
        """float [b, KV, G*s, 1]: the sink logit of each query row's head, rows as `attention` folds them."""
        g = self.g
        kvh, groups = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads
        sinks = g.weight(f"{name}.sinks", np.asarray(spec.sinks, np.float32).reshape(1, kvh, groups, 1, 1))
        bs = self.batch_seq_shape()
        shape = g.op("Concat", [g.op("Slice", [bs, g.const([0]), g.const([1])]), g.const([kvh, groups]),
                                g.op("Slice", [bs, g.const([1]), g.const([2])]), g.const([1])], axis=0)
        return g.op("Reshape", [g.op("Expand", [sinks, shape]), g.const([0, kvh, -1, 1])])


def _prefix(rope: Rope) -> str:
    """Initializer names of a rotary table: the model's one unprefixed, others by their key."""
    return "" if rope.key == "rope" else f"{rope.key}."


class OrtOps(GraphOps):
    """ONNX Runtime's contrib ops (the `ort` flavor)."""

    flavor = "ort"

    def rms_norm(self, x: str, weight: np.ndarray, eps: float, name: str) -> str:
        w = self.g.weight(f"{name}.weight", weight)
        # in ONNX Runtime's default domain, though not a standard op
        return self.g.op("SimplifiedLayerNormalization", [x, w], axis=-1, epsilon=eps, stash_type=1,
                         name=name)

    def add_rms_norm(self, x: str, residual: str, weight: np.ndarray, eps: float,
                     name: str) -> tuple[str, str]:
        w = self.g.weight(f"{name}.weight", weight)
        y, _, _, total = self.g.op("SkipSimplifiedLayerNormalization", [x, residual, w], num_outputs=4,
                                   domain=MS_DOMAIN, epsilon=eps, name=name)
        return y, total

    def linear(self, x: str, lw: LinearWeight, rows: bool = False) -> str:
        w = lw.weight
        if not isinstance(w, QuantizedWeight):
            return self._gemm(x, w, lw, rows=rows)
        packed = pack_matmul_nbits(w)
        if packed is None:  # no power-of-two block fits its groups: float, as the standard flavor does
            return self._gemm(x, dequantized(w), lw, rows=rows)
        g = self.g
        if w.input_order is not None:  # GPTQ act-order: the codes' columns are these input channels
            x = g.op("Gather", [x, g.weight(f"{lw.name}.input_order", w.input_order.numpy())], axis=-1)
        args = [x, g.weight(f"{lw.name}.weight_q", packed.codes),
                g.weight(f"{lw.name}.scales", packed.scales),
                g.weight(f"{lw.name}.zero_points", packed.zero_points)]
        y = g.op("MatMulNBits", args, domain=MS_DOMAIN, K=w.in_features, N=w.out_features, bits=packed.bits,
                 block_size=packed.block_size, accuracy_level=0, name=lw.name)
        if packed.offsets is not None:  # + (sum of each block's activations) x offset
            blocks = w.in_features // packed.block_size
            sums = g.op("ReduceSum", [g.op("Reshape", [x, g.const([0, blocks, packed.block_size] if rows else
                                                                  [0, 0, blocks, packed.block_size])]),
                                      g.const([-1])], keepdims=0)
            offsets = g.weight(f"{lw.name}.block_offsets", np.ascontiguousarray(packed.offsets.T))
            y = g.op("Add", [y, g.op("MatMul", [sums, offsets])])
        if lw.bias is not None:
            y = g.op("Add", [y, g.weight(f"{lw.name}.bias", lw.bias)])
        return y

    def _rope_caches(self, rope: Rope) -> tuple[str, str]:
        half = rope.rotary_dim // 2  # the contrib ops take each frequency once
        return self._once(("rope_half", rope.key), lambda: (
            self.g.weight(f"{_prefix(rope)}cos_cache", rope.cos[:, :half]),
            self.g.weight(f"{_prefix(rope)}sin_cache", rope.sin[:, :half])))

    def rotary(self, x: str, heads: int, head_dim: int, rope: Rope) -> str:
        cos, sin = self._rope_caches(rope)
        return self.g.op("RotaryEmbedding", [x, self.inputs.position_ids, cos, sin], domain=MS_DOMAIN,
                         interleaved=0, num_heads=heads, rotary_embedding_dim=rope.rotary_dim)

    def _seqlens(self) -> tuple[str, str]:
        """GroupQueryAttention's seqlens_k (int32 [b]: index of each row's last token) and total length."""
        def build() -> tuple[str, str]:
            g = self.g
            mask = self.inputs.attention_mask
            last = g.op("Sub", [g.op("ReduceSum", [mask, g.const([1])], keepdims=0), g.const(1)])
            total = g.op("Gather", [g.op("Shape", [mask]), g.const(1)], axis=0)
            return g.op("Cast", [last], to=6), g.op("Cast", [total], to=6)
        return self._once("seqlens", build)

    def attention(self, q: str, k: str, v: str, past_k: str, past_v: str, spec: AttentionSpec, rope: Rope,
                  name: str) -> tuple[str, str, str]:
        # Rotary as its own op (not GroupQueryAttention's do_rotary): Qwen3 normalises q/k heads before it,
        # and partial rotary is the RotaryEmbedding op's attribute.
        if spec.head_dim % 8:
            raise ValueError(f"ONNX export (ort flavor): {name} has heads of {spec.head_dim} channels, and ONNX "
                             "Runtime's GroupQueryAttention takes multiples of 8 only; export with --flavor "
                             "standard.")
        if rope is not None:
            q = self.rotary(q, spec.num_heads, spec.head_dim, rope)
            k = self.rotary(k, spec.num_kv_heads, spec.head_dim, rope)
        seqlens, total = self._seqlens()
        # local_window_size W: a query at p sees keys in (p - W, p], the engine's window (tested)
        window = -1 if spec.sliding_window is None else spec.sliding_window
        inputs = [q, k, v, past_k, past_v, seqlens, total]
        if spec.sinks is not None:  # head_sink: one more term of each head's softmax sum, as a sink logit
            sinks = self.g.weight(f"{name}.sinks", np.asarray(spec.sinks, np.float32))
            inputs += ["", "", "", "", sinks]  # cos / sin caches, position ids, attention bias omitted
        out, present_k, present_v = self.g.op(
            "GroupQueryAttention", inputs, num_outputs=3, domain=MS_DOMAIN,
            num_heads=spec.num_heads, kv_num_heads=spec.num_kv_heads, scale=spec.scale,
            local_window_size=window, softcap=spec.soft_cap or 0.0, name=name)
        return out, present_k, present_v


FLAVORS = {"standard": GraphOps, "ort": OrtOps}
