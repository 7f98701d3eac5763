"""All-decode steps as one native call per decoder layer.

At small batch a decode step costs more in per-op dispatch (about 25 torch ops and a dozen module calls
per layer) than in arithmetic. `FusedDecode` describes each layer once (`_layer_args`): the Llama family
(Llama, Mistral, Qwen2 with biases, Qwen3 with q/k norms, Phi-3 with partial rotary, sliding windows) and
Gemma 2 / 3 (sandwich norms with 1 + w, GELU-tanh, soft-capped attention, local/global windows, a rope
table per layer kind), GLM-4 (interleaved rotary reordered at load, post-sublayer norms), attention sinks
(gpt-oss), and runs a step whose tokens are all decodes through `torch.ops.perfxlm.decode_layer`, float32
activations over float32, bf16 or quantized weights, with the step's LoRA adapters added after each
projection. Where every layer is one such call with its MLP (and the step has no adapters), all of them
run as one native call: a DecodeStack (csrc/decode_stack.cpp) holds the layers' fixed operands from the
first step and calls the same decode_layer per layer, so the per-layer dispatch and the loop here go.
A layer whose MLP is a mixture of experts (Qwen2/3-MoE, Mixtral, gpt-oss) fuses its attention half: the
call stops after the post-attention norm and the layer's
own MLP module runs on its output. A decoder layer kind joins by implementing `fused_decode_layer()`
(FusableDecoderLayer), built from `fused_attention`, `fused_mlp` and `fused_layer`; no family is named
here. Under tensor parallelism each rank runs its shard's layer in two native calls
(`decode_attention`, `decode_mlp`: `decode_layer`'s halves, the same ops) with the row-parallel
projections' all-reduces between and after them (`FusedAttention.reduce`, `FusedMLP.reduce`). Anything
else (prefill chunks in the batch, MLA and OPT layers, no native kernels, bf16 activations) takes the
module path, which stays the reference the tests compare against.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch import nn

from perfxlm.model.forward_context import AttentionMetadata
from perfxlm.model.layers import attention_backend
from perfxlm.model.layers.activation import GeluAndMul, SiluAndMul
from perfxlm.model.layers.linear import Linear
from perfxlm.model.layers.norm import GemmaRMSNorm, RMSNorm
from perfxlm.ops import cpu_plan, native
from perfxlm.ops.attention import decode_bf16_products
from perfxlm.ops.linear import native_int8_blocks
from perfxlm.quant.split_rows import pieces
from perfxlm.quant.weight import ActivationMode


def decode_stack_enabled() -> bool:
    """PERFXLM_DECODE_STACK: 1 (default) runs an all-decode step's layers in one native call where they
    allow it; 0 calls decode_layer once per layer from Python (the same kernels, the same bits)."""
    value = os.environ.get("PERFXLM_DECODE_STACK", "1").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"PERFXLM_DECODE_STACK={value!r}: expected 1 (one call per step) or 0 (one per layer).")
    return value == "1"


def activation_code(act: nn.Module) -> int | None:
    if type(act) is SiluAndMul:
        return 0
    if type(act) is GeluAndMul:
        return {"tanh": 1, "none": 2}.get(act.approximate)
    return None


def norm_scale(norm: nn.Module) -> torch.Tensor | None:
    """The float32 scale the kernel multiplies by: w (RMSNorm) or 1 + w (Gemma, computed once here)."""
    if norm.weight.dtype != torch.float32:
        return None
    if type(norm) is GemmaRMSNorm:
        return 1.0 + norm.weight
    return norm.weight if type(norm) is RMSNorm else None


def weight_parts(weight: Any) -> list[torch.Tensor]:
    """A projection's weight as `decode_layer` takes it: [w], or a quantized weight's tensors
    [codes, scales, mins (empty: centred codes), levels (empty: none), act_int8], an act-order weight's
    input order sixth (perfxlm.quant.QuantizedWeight.native_parts)."""
    return [weight] if isinstance(weight, torch.Tensor) else weight.native_parts()


@dataclass(frozen=True)
class FusedAttention:
    """An attention block as `decode_layer` runs it: fused q|k|v projection, optional per-head q/k
    RMSNorm, rotary over q and k, paged attention, output projection."""

    qkv: list[torch.Tensor]  # weight_parts of the q|k|v projection
    qkv_bias: torch.Tensor | None
    o: list[torch.Tensor]
    o_bias: torch.Tensor | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    soft_cap: float | None = None
    q_norm: torch.Tensor | None = None  # per-head RMSNorm scales (Qwen3), with one epsilon for both
    k_norm: torch.Tensor | None = None
    head_eps: float = 0.0
    sinks: torch.Tensor | None = None  # float32 [num_heads] sink logits (gpt-oss)
    # the q|k|v and output projection modules: a step's LoRA adapters are looked up by module
    projections: tuple[nn.Module, ...] = field(default=(), compare=False)
    # the output projection's all-reduce where it is row-parallel (its rank's product is a partial sum)
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class FusedMLP:
    """A gated MLP: down(act(gate) * up) with a fused gate|up projection."""

    gate_up: list[torch.Tensor]
    gate_up_bias: torch.Tensor | None
    down: list[torch.Tensor]
    down_bias: torch.Tensor | None
    intermediate: int
    activation: int  # activation_code()
    projections: tuple[nn.Module, ...] = field(default=(), compare=False)  # gate|up and down modules
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)  # down's all-reduce


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer's part of `decode_layer`'s arguments: what a family provides by implementing
    `fused_decode_layer()` (see FusableDecoderLayer); everything per step comes from the forward pass."""

    # input and post-attention norms; for sandwich-norm layers (Gemma 2: the block's output is normed
    # before the residual add) also the pre- and post-feedforward norms, else None
    norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
    eps: float
    attention: FusedAttention
    mlp: FusedMLP | None  # None: `module_mlp` runs after the call, on its normed output
    module_mlp: nn.Module | None = None  # a mixture of experts, which the kernel does not run

    def before_rope(self) -> tuple[Any, ...]:
        a, m = self.attention, self.mlp
        if m is None:  # no MLP weights: the kernel stops after the post-attention norm
            m = FusedMLP([], None, [], None, 0, 0)
        return (
            *self.norms, self.eps, a.q_norm, a.k_norm, a.head_eps, a.qkv, a.qkv_bias, a.o, a.o_bias,
            m.gate_up, m.gate_up_bias, m.down, m.down_bias, a.num_heads, a.num_kv_heads, a.head_dim,
            m.intermediate, m.activation,
        )  # fmt: skip

    def after_rope(self) -> tuple[Any, ...]:
        a = self.attention
        return (a.scale, a.sliding_window or 0, a.soft_cap or 0.0)

    def projections(self) -> tuple[nn.Module, ...]:
        """qkv, o, gate_up, down (the last two only with a fused MLP): the order of decode_layer's `lora`
        operands."""
        return (*self.attention.projections, *(self.mlp.projections if self.mlp is not None else ()))

    def halves(self) -> "_Halves | None":
        """The layer as two calls with all-reduces between them, where a projection's output is a rank's
        partial sum (tensor parallelism); None where one `decode_layer` call does it all."""
        a, m = self.attention, self.mlp
        mlp_reduce = m.reduce if m is not None else None
        if a.reduce is None and mlp_reduce is None:
            return None
        if m is None:
            m = FusedMLP([], None, [], None, 0, 0)
        in_norm, post_norm, pre_ff_norm, post_ff_norm = self.norms
        sandwich = pre_ff_norm is not None
        return _Halves(
            (sandwich, in_norm, self.eps, a.q_norm, a.k_norm, a.head_eps, a.qkv, a.qkv_bias, a.o, a.o_bias,
             a.num_heads, a.num_kv_heads, a.head_dim),
            (sandwich, post_norm, pre_ff_norm, self.eps, m.gate_up, m.gate_up_bias, m.down, m.down_bias,
             m.intermediate, m.activation),
            a.reduce, mlp_reduce, post_ff_norm, self.eps,
        )  # fmt: skip


@dataclass(frozen=True)
class _Halves:
    """`decode_attention`'s and `decode_mlp`'s layer arguments (before the per-step ones), the all-reduces
    after each (None: that projection is whole on this rank), and a sandwich layer's post-feedforward
    norm, applied once the MLP's output is whole."""

    attention: tuple[Any, ...]
    mlp: tuple[Any, ...]
    reduce_attention: Callable[[torch.Tensor], torch.Tensor] | None
    reduce_mlp: Callable[[torch.Tensor], torch.Tensor] | None
    post_ff_norm: torch.Tensor | None
    eps: float


@runtime_checkable
class FusableDecoderLayer(Protocol):
    """A decoder layer kind that can run as one `decode_layer` call: None where this instance's options
    do not fit the kernel (it then takes the module path)."""

    def fused_decode_layer(self) -> FusedLayer | None: ...


def fused_attention(qkv_proj: nn.Module, o_proj: nn.Module, core: nn.Module,
                    q_norm: nn.Module | None = None, k_norm: nn.Module | None = None) -> FusedAttention | None:  # fmt: skip
    """`core`: the block's `Attention` layer (heads, scale, window, soft cap). Where the output projection
    sums the ranks' partial products (tensor parallelism) its all-reduce goes with it (`reduce`)."""
    qn = kn = None
    head_eps = 0.0
    if q_norm is not None:
        qn, kn = norm_scale(q_norm), norm_scale(k_norm)
        if qn is None or kn is None or q_norm.variance_epsilon != k_norm.variance_epsilon:
            return None
        head_eps = q_norm.variance_epsilon
    sinks = None if core.sinks is None else core.sinks.detach().float().contiguous()
    return FusedAttention(
        weight_parts(qkv_proj.weight), qkv_proj.bias, weight_parts(o_proj.weight), o_proj.bias, core.num_heads,
        core.num_kv_heads, core.head_dim, core.scale, core.sliding_window, core.logit_soft_cap, qn, kn, head_eps,
        sinks, (qkv_proj, o_proj), _reduction(o_proj),
    )  # fmt: skip


def _reduction(proj: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The all-reduce a row-parallel projection runs on its output, for the fused call to run instead."""
    return proj.tp.all_reduce if proj.reduces_output else None


def fused_mlp(gate_up_proj: nn.Module, down_proj: nn.Module, act: nn.Module) -> FusedMLP | None:
    code = activation_code(act)
    if code is None:
        return None
    return FusedMLP(weight_parts(gate_up_proj.weight), gate_up_proj.bias, weight_parts(down_proj.weight),
                    down_proj.bias, down_proj.in_features, code, (gate_up_proj, down_proj),
                    _reduction(down_proj))  # fmt: skip


def fused_layer(
    norms: list[nn.Module],
    attention: FusedAttention | None,
    mlp: FusedMLP | None,
    module_mlp: nn.Module | None = None,  # instead of `mlp`: run as a module on the call's output
) -> FusedLayer | None:
    """`norms`: input and post-attention (two), or those and the pre-/post-feedforward ones (four); all of
    one epsilon. A layer with a `module_mlp` must be pre-norm (two norms)."""
    scales = [norm_scale(n) for n in norms]
    eps = {n.variance_epsilon for n in norms}
    if attention is None or (mlp is None) == (module_mlp is None) or any(w is None for w in scales) or len(eps) != 1:
        return None
    if module_mlp is not None and len(norms) != 2:
        return None
    padded = (scales + [None, None])[:4]
    return FusedLayer(tuple(padded), eps.pop(), attention, mlp, module_mlp)  # type: ignore[arg-type]


@dataclass(frozen=True)
class _LayerCall:
    """One layer's `decode_layer` arguments before and after the per-step ones, its sinks, and the MLP
    module to run after the call (a mixture of experts), if any."""

    before: tuple[Any, ...]
    after: tuple[Any, ...]
    sinks: torch.Tensor | None
    module_mlp: nn.Module | None
    projections: tuple[nn.Module, ...]  # qkv, o[, gate_up, down]: where the step's LoRA products go
    halves: _Halves | None  # the two calls and their all-reduces under tensor parallelism, else None


def _layer_call(layer: nn.Module) -> _LayerCall | None:
    """None where the layer does not fit the kernel."""
    fused = layer.fused_decode_layer() if isinstance(layer, FusableDecoderLayer) else None
    if fused is None:
        return None
    return _LayerCall(fused.before_rope(), fused.after_rope(), fused.attention.sinks, fused.module_mlp,
                      fused.projections(), fused.halves())


def _int8_blocks(quantized: list[Any]) -> bool | None:
    """The one int8_blocks flag the kernel takes for every quantized weight of the layers, or None where
    no flag gives what the module path does: weights differing in activation mode, or int8 blocks asked
    on every path (ActivationMode.INT8) where the kernel would not round some (no int8 dots, a layout its
    block GEMV lacks: the module path rounds those in torch)."""
    quantized = [p for w in quantized for p in pieces(w)]  # a split weight's parts each
    modes = {w.activations for w in quantized}
    if len(modes) > 1:
        return None
    mode = modes.pop() if modes else ActivationMode.FLOAT
    if mode is ActivationMode.INT8 and not all(native_int8_blocks(w) for w in quantized):
        return None
    return mode is not ActivationMode.FLOAT


class FusedDecode:
    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers
        self.args: list[_LayerCall] | None = None
        self.lora_fits: bool | None = None  # every adapter target of the layers is a fused projection
        self.eligible = len(layers) > 0
        self.quant_bf16_gemm = True
        self.int8_blocks = False  # whether the kernel rounds activations to int8 blocks (all weights alike)
        self.steps = 0  # steps run fused (tests and workers' stats read it)
        # Every layer in one native call (csrc/decode_stack.cpp) where each is one decode_layer call with
        # its MLP: the layers' fixed operands are handed over once, and a step passes only its own.
        self.use_stack = decode_stack_enabled()
        self.stack: Any = None  # torch.classes.perfxlm.DecodeStack, built at the first step that takes it
        self.stack_attention: list[nn.Module] = []  # the layers' attention modules, whose caches it holds
        self.stack_caches: list[Any] = []  # those KV caches, one per layer (rebuilt if they change)
        self.stack_pattern: list[int] | None = None  # each layer's rope table index (None: one table for all)
        self.stack_steps = 0  # steps run through it (tests read it)

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        if not self.eligible or x.dtype != torch.float32 or meta.prefills or meta.num_decode_tokens != x.shape[0]:
            return False
        if native.kernels_for(x) is None:  # a GPU's tensors: the module path on its own kernels
            return False
        if self.args is None:  # first all-decode step: collect (weights are final by now)
            if not attention_backend.for_device(x.device).fuses_decode:
                self.eligible = False  # the fused layer would bypass the backend's own kernels
                return False
            args = [_layer_call(layer) for layer in self.layers]
            if any(a is None for a in args):
                self.eligible = False
                return False
            self.args = args  # type: ignore[assignment]
            # Quantized weights use the bf16 GEMM and int8 activation blocks only where the module path
            # does (the layers' linear methods, decided at load), so both round alike.
            methods = [m.method for m in self.layers.modules() if isinstance(m, Linear) and m.method.quantized]
            if not all(m.fusable for m in methods):
                # FP8 byte tables: products the kernel does not take; module path (act-order weights it
                # takes: their native_parts carry the input order, which `project` gathers x by)
                self.eligible = False
                return False
            quantized = [m.weight for m in self.layers.modules() if isinstance(m, Linear) and m.method.quantized]
            self.quant_bf16_gemm = all(m.bf16_gemm for m in methods)
            blocks = _int8_blocks(quantized)
            if blocks is None:
                self.eligible = False
                return False
            self.int8_blocks = blocks
        if meta.lora is not None and not self._lora_fits(meta.lora):
            return False
        return True

    def _lora_fits(self, lora: Any) -> bool:
        """Whether the kernel can add this step's adapter products: it adds them after the four
        projections it knows (qkv, o, gate_up, down), and a layer's module MLP (a mixture of experts) adds
        its own as a module; an adapter target elsewhere in a layer sends LoRA steps to the module path."""
        if self.lora_fits is None:
            known = {id(m) for call in self.args or [] for m in call.projections}
            known |= {id(m) for call in self.args or [] if call.module_mlp is not None for m in call.module_mlp.modules()}
            self.lora_fits = all(id(m) in known for m in self.layers.modules() if lora.targets(m))
        return self.lora_fits

    def run(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        layer_ropes: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden, residual); for Gemma 2 (no residual stream) both are the layer output.
        `layer_ropes`: one (cos, sin) per layer where layers rotate differently (Gemma 3's local and
        global bases), else `rope` serves every layer."""
        ops = native.kernels()
        plan = cpu_plan.plan()
        max_rows = plan.native_max_rows
        bf16_gemm = plan.gemm == "bf16" and self.quant_bf16_gemm
        bf16_attention = bool(self.layers) and decode_bf16_products(self.layers[0].self_attn.attn.kv_cache.key.dtype)
        # large batches of int8-block weights take the int8 GEMM where the module path does (run_linear_q)
        gemm_rows = plan.quant_gemm_rows if self.int8_blocks and plan.quant_gemm == "int8" else -1
        residual = x
        lora = meta.lora
        self.steps += 1
        tables, pattern = ([rope], None) if layer_ropes is None else _rope_tables(layer_ropes)
        stack = self._stack(pattern) if lora is None else None
        if stack is not None:
            self.stack_steps += 1
            x, residual = stack.run(x, x, [c for c, _ in tables], [s for _, s in tables], meta.slot_mapping,
                                    meta.decode_block_tables, meta.decode_seq_lens, max_rows, bf16_gemm,
                                    self.int8_blocks, plan.quant_max_rows, plan.quant_block_max_rows, gemm_rows,
                                    bf16_attention)  # fmt: skip
            return x, residual
        for i, (layer, call) in enumerate(zip(self.layers, self.args or [])):
            cos, sin = rope if layer_ropes is None else layer_ropes[i]
            adapters = [] if lora is None else lora.fused_operands(call.projections)
            cache = layer.self_attn.attn.kv_cache
            if call.halves is None:
                x, residual = ops.decode_layer(
                    x, residual, i == 0, *call.before, cos, sin, cache.key, cache.value, meta.slot_mapping,
                    meta.decode_block_tables, meta.decode_seq_lens, *call.after, max_rows, bf16_gemm, adapters,
                    cache.key_scale, cache.value_scale, self.int8_blocks, plan.quant_max_rows, plan.quant_block_max_rows, call.sinks,
                    gemm_rows, bf16_attention,
                )  # fmt: skip
            else:  # a rank's shard: the halves, each row-parallel output all-reduced before it is used
                h = call.halves
                o, stream = ops.decode_attention(
                    x, residual, i == 0, *h.attention, cos, sin, cache.key, cache.value, meta.slot_mapping,
                    meta.decode_block_tables, meta.decode_seq_lens, *call.after, max_rows, bf16_gemm, adapters,
                    cache.key_scale, cache.value_scale, self.int8_blocks, plan.quant_max_rows, plan.quant_block_max_rows, call.sinks,
                    gemm_rows, bf16_attention,
                )  # fmt: skip
                if h.reduce_attention is not None:
                    o = h.reduce_attention(o)
                x, residual = ops.decode_mlp(o, stream, *h.mlp, max_rows, bf16_gemm, adapters, self.int8_blocks,
                                             plan.quant_max_rows, plan.quant_block_max_rows, gemm_rows)  # fmt: skip
                if h.reduce_mlp is not None:
                    x = h.reduce_mlp(x)
                if h.post_ff_norm is not None:  # sandwich: the MLP's output normed once it is whole
                    x = residual = residual + ops.rms_norm(x, h.post_ff_norm, h.eps)
            if call.module_mlp is not None:
                x = call.module_mlp(x).contiguous()
        return x, residual

    def _stack(self, pattern: list[int] | None = None) -> Any:
        """The DecodeStack of these layers, or None where a layer is not one plain decode_layer call (an
        expert MLP, a tensor-parallel shard) or the stack is switched off. `pattern`: each layer's rope
        table (None: one for all). Built on first use; rebuilt when the layers' KV caches are no longer
        the ones it holds (a new runner on the same model) or the pattern changes."""
        if not self.use_stack or not self.args:
            return None
        if (self.stack is not None and pattern == self.stack_pattern
                and all(a.kv_cache is c for a, c in zip(self.stack_attention, self.stack_caches))):
            return self.stack
        if any(call.halves is not None or call.module_mlp is not None for call in self.args):
            self.use_stack = False
            return None
        self.stack_attention = [layer.self_attn.attn for layer in self.layers]
        caches = [a.kv_cache for a in self.stack_attention]
        stack = torch.classes.perfxlm.DecodeStack()
        for call, cache, table in zip(self.args, caches, pattern or [0] * len(self.args)):
            stack.add_layer(*call.before, cache.key, cache.value, *call.after, cache.key_scale, cache.value_scale,
                            call.sinks, table)  # fmt: skip
        self.stack, self.stack_caches, self.stack_pattern = stack, caches, pattern
        return stack


def _rope_tables(layer_ropes: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list, list[int]]:
    """(the distinct (cos, sin) tables of a step, each layer's index among them): layers of one kind share
    their table object (Gemma's local and global bases)."""
    tables: list[tuple[torch.Tensor, torch.Tensor]] = []
    index: dict[int, int] = {}
    pattern = []
    for rope in layer_ropes:
        at = index.get(id(rope))
        if at is None:
            at = index[id(rope)] = len(tables)
            tables.append(rope)
        pattern.append(at)
    return tables, pattern


def fused_decode_steps(model: nn.Module) -> int:
    """Steps a model ran on its fused decode layers (0 where it has none): what tests and tensor-parallel
    workers' `Stats` report to show the fused path was taken."""
    return sum(v.steps for m in model.modules() for v in vars(m).values() if isinstance(v, FusedDecode))
