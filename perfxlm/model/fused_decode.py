"""All-decode steps as one native call per decoder layer.

At small batch a decode step costs more in per-op dispatch (about 25 torch ops and a dozen module calls
per layer) than in arithmetic. `FusedDecode` describes each layer once (`_layer_args`): the Llama family
(Llama, Mistral, Qwen2 with biases, Qwen3 with q/k norms, Phi-3 with partial rotary, sliding windows) and
Gemma 2 (sandwich norms with 1 + w, GELU-tanh, soft-capped attention, local/global windows), and runs a
step whose tokens are all decodes through `torch.ops.perfxlm.decode_layer`, float32 activations over
float32, bf16 or quantized weights. Anything else (prefill chunks in the batch, MoE and OPT layers, no native
kernels, bf16 activations) takes the module path, which stays the reference the tests compare against.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.model.forward_context import AttentionMetadata
from perfxlm.model.layers import attention_backend
from perfxlm.model.layers.activation import GeluAndMul, SiluAndMul
from perfxlm.model.layers.norm import GemmaRMSNorm, RMSNorm
from perfxlm.ops import cpu_plan, native
from perfxlm.ops.linear import native_int8_blocks
from perfxlm.quant.weight import ActivationMode


def _activation_code(act: nn.Module) -> int | None:
    if type(act) is SiluAndMul:
        return 0
    if type(act) is GeluAndMul:
        return {"tanh": 1, "none": 2}.get(act.approximate)
    return None


def _norm_weight(norm: nn.Module, gemma: bool) -> torch.Tensor | None:
    """The float32 scale the kernel multiplies by: w (RMSNorm) or 1 + w (Gemma, computed once here)."""
    if type(norm) is not (GemmaRMSNorm if gemma else RMSNorm) or norm.weight.dtype != torch.float32:
        return None
    return (1.0 + norm.weight) if gemma else norm.weight


def _weight_parts(weight: Any) -> list[torch.Tensor]:
    """A projection's weight as `decode_layer` takes it: [w], or a quantized weight's tensors
    [codes, scales, mins, levels (empty: none), act_int8] (perfxlm.quant.QuantizedWeight)."""
    if isinstance(weight, torch.Tensor):
        return [weight]
    levels = weight.levels if weight.levels is not None else torch.empty(0)
    return [weight.codes, weight.scales, weight.mins, levels, torch.tensor(weight.act == "int8")]


def _attention_args(attn: nn.Module) -> tuple[Any, ...] | None:
    from perfxlm.model.models.llama import LlamaAttention

    if type(attn) is not LlamaAttention:
        return None
    q_norm = k_norm = None
    head_eps = 0.0
    if attn.qk_norm:
        q_norm, k_norm = _norm_weight(attn.q_norm, False), _norm_weight(attn.k_norm, False)
        if q_norm is None or k_norm is None or attn.q_norm.variance_epsilon != attn.k_norm.variance_epsilon:
            return None
        head_eps = attn.q_norm.variance_epsilon
    qkv, o = attn.qkv_proj, attn.o_proj
    return (q_norm, k_norm, head_eps, _weight_parts(qkv.weight), qkv.bias, _weight_parts(o.weight), o.bias)


def _mlp_args(mlp: nn.Module) -> tuple[Any, ...] | None:
    from perfxlm.model.models.llama import LlamaMLP

    if type(mlp) is not LlamaMLP or _activation_code(mlp.act) is None:
        return None
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    return (_weight_parts(gate_up.weight), gate_up.bias, _weight_parts(down.weight), down.bias)


def _layer_args(layer: nn.Module) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
    """The layer's arguments to `decode_layer` before and after the per-step ones, or None where the
    layer does not fit the kernel."""
    from perfxlm.model.models.gemma2 import Gemma2DecoderLayer
    from perfxlm.model.models.llama import LlamaDecoderLayer

    gemma = type(layer) is Gemma2DecoderLayer
    if not gemma and type(layer) is not LlamaDecoderLayer:
        return None
    attn_args, mlp_args = _attention_args(layer.self_attn), _mlp_args(layer.mlp)
    if attn_args is None or mlp_args is None:
        return None
    names = ["input_layernorm", "post_attention_layernorm"]
    names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if gemma else []
    norms = [_norm_weight(getattr(layer, n), gemma) for n in names]
    eps = {getattr(layer, n).variance_epsilon for n in names}
    if any(w is None for w in norms) or len(eps) != 1:
        return None
    if not gemma:
        norms += [None, None]
    attn, mlp = layer.self_attn, layer.mlp
    core = attn.attn
    before_rope = (
        *norms, eps.pop(), *attn_args, *mlp_args,
        core.num_heads, core.num_kv_heads, core.head_dim, mlp.down_proj.in_features, _activation_code(mlp.act),
    )  # fmt: skip
    return before_rope, (core.scale, core.sliding_window or 0, core.logit_soft_cap or 0.0)


def _int8_blocks(quantized: list[Any]) -> bool | None:
    """The one int8_blocks flag the kernel takes for every quantized weight of the layers, or None where
    no flag gives what the module path does: weights differing in activation mode, or int8 blocks asked
    on every path (ActivationMode.INT8) where the kernel would not round some (no int8 dots, a layout its
    block GEMV lacks: the module path rounds those in torch)."""
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
        self.args: list[tuple[tuple[Any, ...], tuple[Any, ...]]] | None = None
        self.eligible = len(layers) > 0
        self.quant_bf16_gemm = True
        self.int8_blocks = False  # whether the kernel rounds activations to int8 blocks (all weights alike)

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        if not self.eligible or x.dtype != torch.float32 or meta.prefills or meta.num_decode_tokens != x.shape[0]:
            return False
        if native.kernels() is None:
            return False
        if self.args is None:  # first all-decode step: collect (weights are final by now)
            if not attention_backend.for_device(x.device).fuses_decode:
                self.eligible = False  # the fused layer would bypass the backend's own kernels
                return False
            args = [_layer_args(layer) for layer in self.layers]
            if any(a is None for a in args):
                self.eligible = False
                return False
            self.args = args  # type: ignore[assignment]
            # Quantized weights use the bf16 GEMM and int8 activation blocks only where the module path
            # does (QuantizedWeight.bf16_gemm / activations, decided at load), so both round alike.
            quantized = [m.weight for m in self.layers.modules()
                         if hasattr(m, "weight") and not isinstance(m.weight, torch.Tensor)]
            self.quant_bf16_gemm = all(w.bf16_gemm for w in quantized)
            blocks = _int8_blocks(quantized)
            if blocks is None:
                self.eligible = False
                return False
            self.int8_blocks = blocks
        return True

    def run(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden, residual); for Gemma 2 (no residual stream) both are the layer output."""
        ops = native.kernels()
        plan = cpu_plan.plan()
        max_rows = plan.native_max_rows
        bf16_gemm = plan.gemm == "bf16" and self.quant_bf16_gemm
        cos, sin = rope
        residual = x
        for i, (layer, (before, after)) in enumerate(zip(self.layers, self.args or [])):
            cache = layer.self_attn.attn.kv_cache
            x, residual = ops.decode_layer(
                x, residual, i == 0, *before, cos, sin, cache.key, cache.value, meta.slot_mapping,
                meta.decode_block_tables, meta.decode_seq_lens, *after, max_rows, bf16_gemm, cache.key_scale,
                cache.value_scale, self.int8_blocks, plan.quant_max_rows, plan.quant_block_max_rows,
            )  # fmt: skip
        return x, residual
