"""Llama (and every model that is Llama with other numbers: SmolLM, TinyLlama, Llama 2/3.x).

The Llama-shaped decoders (Mistral, Qwen2/3, Phi-3, the MoE ones) reuse these pieces, choosing their
attention options and MLP through `make_layer`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.model.forward_context import get_forward_context
from perfxlm.model.fused_decode import (
    FusedAttention, FusedDecode, FusedLayer, FusedMLP, fused_attention, fused_layer, fused_mlp,
)
from perfxlm.model.layers.activation import act_and_mul
from perfxlm.model.layers.attention import Attention
from perfxlm.model.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from perfxlm.model.layers.norm import RMSNorm
from perfxlm.model.layers.parallel_linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from perfxlm.model.layers.rotary import RotaryEmbedding, apply_rotary
from perfxlm.model.models.base import CausalLM


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        *,
        qkv_bias: bool | None = None,  # default: config.attention_bias, for q/k/v and o alike
        o_bias: bool | None = None,
        qk_norm: bool = False,  # Qwen3: RMSNorm over each q and k head before rotary
        head_norm: type[RMSNorm] = RMSNorm,  # the q/k norm's kind (Gemma 3: 1 + w)
        sliding_window: int | None = None,
        scale: float | None = None,  # default head_dim^-1/2
        logit_soft_cap: float | None = None,
        sinks: bool = False,  # gpt-oss: a learned sink logit per head (in `attn`)
        causal: bool = True,  # False: bidirectional (a decoder's layers used as an encoder: EmbeddingGemma)
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias if qkv_bias is None else qkv_bias
        o_bias = bias if o_bias is None else o_bias
        # this rank's KV heads and their query heads (all of them with one rank)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, heads, kv_heads, bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, bias=o_bias, input_part=self.qkv_proj.q_part)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if qk_norm:
            self.q_norm = head_norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = head_norm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale or self.head_dim**-0.5,
            sliding_window=sliding_window,
            logit_soft_cap=logit_soft_cap,
            sinks=sinks,
            causal=causal,
            heads_of=(self.qkv_proj.q_part[0] // self.head_dim, heads) if self.qkv_proj.tp.parallel else None,
        )
        self.qk_size = q_size + kv_size

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.qk_size].view(n, -1, self.head_dim)
        v = qkv[:, self.qk_size :].view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = apply_rotary(self.q_norm(qk[:, : self.num_heads]), *rope)
            k = apply_rotary(self.k_norm(qk[:, self.num_heads :]), *rope)
        else:
            # q and k heads are adjacent in the fused output: rotate them in one pass.
            qk = apply_rotary(qk, *rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return self.o_proj(self.attn(q, k, v))

    def fused_decode_attention(self) -> FusedAttention | None:
        norms = (self.q_norm, self.k_norm) if self.qk_norm else ()
        return fused_attention(self.qkv_proj, self.o_proj, self.attn, *norms)


class LlamaMLP(nn.Module):
    def __init__(
        self,
        config: Any,
        intermediate_size: int | None = None,
        bias: bool | None = None,
        activation: str | None = None,
        reduce_results: bool = True,  # False: the caller sums the ranks' partial outputs (a MoE block)
    ) -> None:
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False)) if bias is None else bias
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, {"gate": inter, "up": inter}, bias=bias)
        self.act = act_and_mul(activation or getattr(config, "hidden_act", "silu"))
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def fused_decode_mlp(self) -> FusedMLP | None:
        return fused_mlp(self.gate_up_proj, self.down_proj, self.act)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); the residual add is fused into the norms."""

    def __init__(self, config: Any, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def fused_decode_layer(self) -> FusedLayer | None:
        return fused_llama_layer(self, [self.input_layernorm, self.post_attention_layernorm])


def fused_llama_layer(layer: nn.Module, norms: list[nn.Module]) -> FusedLayer | None:
    """A layer of LlamaAttention and LlamaMLP blocks as one fused decode call; with another MLP (a mixture
    of experts) the call covers the attention half and the MLP module runs after it."""
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(attn, LlamaAttention):
        return None
    if isinstance(mlp, LlamaMLP):
        return fused_layer(norms, attn.fused_decode_attention(), mlp.fused_decode_mlp())
    return fused_layer(norms, attn.fused_decode_attention(), None, module_mlp=mlp)


class LlamaModel(nn.Module):
    def __init__(self, config: Any, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding.from_config(config, head_dim_of(config))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fused_decode = FusedDecode(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.forward_states(input_ids, positions)[0]

    def forward_states(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(final hidden states, the last layer's output before the final norm)."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb.cos_sin(positions, x.dtype)
        meta = get_forward_context()
        if self.fused_decode.applies(x, meta):  # all decodes: one native call per layer
            x, residual = self.fused_decode.run(x.contiguous(), rope, meta)
        else:
            residual = None
            for layer in self.layers:
                x, residual = layer(rope, x, residual)
        # the norm adds the residual stream in place: `pre_norm` is the last layer's output
        x, pre_norm = self.norm(x, residual)
        return x, pre_norm


LLAMA_STACKED_PARAMS = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", "gate"),
    (".gate_up_proj", ".up_proj", "up"),
]


class LlamaForCausalLM(CausalLM):
    stacked_params = LLAMA_STACKED_PARAMS
    supports_tensor_parallel = True

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        """One decoder layer; the Llama-shaped families override this."""
        return LlamaDecoderLayer(config, LlamaAttention(config), LlamaMLP(config))

    def make_model(self, config: Any) -> nn.Module:
        """The decoder stack: embeddings, layers, final norm (GLM-4 carries no residual stream)."""
        return LlamaModel(config, [self.make_layer(config, i) for i in range(config.num_hidden_layers)])

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = self.make_model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tied_to=tied)

    def tied_param_names(self) -> set[str]:
        return {"lm_head.weight"} if self.tie_word_embeddings else set()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
