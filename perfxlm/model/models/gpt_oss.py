"""gpt-oss (GptOssForCausalLM), from float or MXFP4 checkpoints and GGUF files: Llama-shaped attention with
biases everywhere, a learned sink logit per head (an `Attention` option the CPU kernels and the fused decode
layer take), sliding-window and full layers alternating by `layer_types`, YaRN; every layer a mixture of
experts whose router has a bias and softmaxes only the top-k logits, and whose experts have biases and
gpt-oss's clamped SwiGLU over interleaved gate/up rows. The expert stacks are stored [E, out, in] like every
MoE family's (transformers' x @ W stacks transposed at load), so float, bf16 and quantized experts (MXFP4
kept packed) run through the shared `FusedMoE`."""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch
from torch import nn

from perfxlm.model.layers.activation import ClampedSwiGLU
from perfxlm.model.layers.attention import layer_sliding_window
from perfxlm.model.layers.linear import Linear
from perfxlm.model.layers.moe import FusedMoE
from perfxlm.model.models.llama import (
    LLAMA_STACKED_PARAMS, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM,
)  # fmt: skip


def gpt_oss_experts(config: Any) -> FusedMoE:
    """The experts as every MoE family stores them ([E, 2 * inter, hidden] with gate and up rows
    interleaved, [E, hidden, inter]), biased, with the clamped SwiGLU: float, bf16 and quantized stacks
    (MXFP4 included) take the same linear methods and native kernel as the other families'."""
    return FusedMoE(
        config.num_local_experts, config.num_experts_per_tok, config.hidden_size, config.intermediate_size,
        renormalize=False, bias=True, act=ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit), interleaved=True,
    )  # fmt: skip


class GptOssMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k, experts = config.num_experts_per_tok, config.num_local_experts
        if not 0 < self.top_k <= experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) must be in [1, num_local_experts ({experts})]."
            )
        self.router = Linear(config.hidden_size, config.num_local_experts, bias=True)
        self.router.quantize_weight = False  # routers stay float under quantization=
        self.experts = gpt_oss_experts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        return self.experts.reduce(self.experts.run_routed(x, torch.softmax(top, dim=-1), ids))


_TRANSPOSED_STACKS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


class GptOssForCausalLM(LlamaForCausalLM):
    # the sinks are the attention layer's own parameter
    renames = [(r"\.self_attn\.sinks$", ".self_attn.attn.sinks")]
    stacked_params = [e for e in LLAMA_STACKED_PARAMS if e[0] == ".qkv_proj"]

    def load_weights(self, weights: Iterable[tuple[str, Any]], sink: Any = None) -> None:
        """transformers' float stacks are x @ W ([E, hidden, 2 * inter], [E, inter, hidden]): transposed to
        [E, out, in] as they are read, before any sink quantizes them. A QuantizedWeight (GGUF MXFP4 blocks,
        a checkpoint's packed experts) is [E, out, in] already."""

        def transposed() -> Iterable[tuple[str, Any]]:
            for name, tensor in weights:
                if _TRANSPOSED_STACKS.search(name) and isinstance(tensor, torch.Tensor):
                    tensor = tensor.transpose(-1, -2).contiguous()
                yield name, tensor

        super().load_weights(transposed(), sink)

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        attn = LlamaAttention(
            config, qkv_bias=bool(config.attention_bias), o_bias=bool(config.attention_bias),
            sliding_window=layer_sliding_window(config, layer_idx), sinks=True,
        )  # fmt: skip
        return LlamaDecoderLayer(config, attn, GptOssMLP(config))
