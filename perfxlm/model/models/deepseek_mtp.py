"""DeepSeek-V3's multi-token-prediction (MTP) layer: one more decoder layer that, from the target's
hidden state at position t and the embedding of token t+1, predicts token t+2.

    e = enorm(embed(token t+1))      h = hnorm(target's last layer output at t, before the final norm)
    x = decoder_layer(eh_proj([e, h]))   (its own MLA attention and KV cache, MoE or dense MLP)
    logits = shared_head.head(shared_head.norm(x))

Checkpoint keys: `model.layers.{num_hidden_layers + i}.{embed_tokens, enorm, hnorm, eh_proj,
shared_head.norm, shared_head.head}` plus an ordinary decoder layer's under the same prefix. A checkpoint
that omits the embedding or the head shares the target's (`DeepseekMTP.own_embed` / `own_head` False:
the caller passes the target's modules). Speculative decoding (spec_decode/mtp.py) runs it, on its own
output `x` for the guesses past the first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from perfxlm.model.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from perfxlm.model.layers.linear import Linear
from perfxlm.model.layers.mla import MLAttention
from perfxlm.model.layers.norm import RMSNorm
from perfxlm.model.layers.rotary import RotaryEmbedding
from perfxlm.model.models.base import CheckpointModel
from perfxlm.model.models.deepseek_v2 import DeepseekMoE, DeepseekV2ForCausalLM
from perfxlm.model.models.llama import LlamaDecoderLayer, LlamaMLP, head_dim_of


class SharedHead(nn.Module):
    def __init__(self, config: Any, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size) if own_head else None


class DeepseekMTPLayer(LlamaDecoderLayer):
    """The decoder layer's own keys (self_attn, mlp, the two layernorms) sit beside the MTP ones, as in
    the checkpoint."""

    def __init__(self, config: Any, mlp: nn.Module, own_embed: bool, own_head: bool) -> None:
        super().__init__(config, MLAttention(config), mlp)
        hidden = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden) if own_embed else None
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(config, own_head)


class _Layers(nn.Module):
    def __init__(self, layers: dict[str, nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(layers)


class DeepseekMTP(CheckpointModel):
    """The first MTP layer of a checkpoint (DeepSeek-V3 and R1 carry one; with more, the first proposes
    every guess, repeating on its own output, as vLLM's proposer does)."""

    # the decoder layer's fused projections and expert stacks load as the target's do
    stacked_params = DeepseekV2ForCausalLM.stacked_params

    def __init__(
        self, config: Any, own_embed: bool, own_head: bool, make_router: Callable[[Any], nn.Module]
    ) -> None:
        """`make_router`: the target family's (V2's softmax or V3's sigmoid routing)."""
        super().__init__()
        self.config = config
        self.index = config.num_hidden_layers  # the checkpoint's layer number of the first MTP layer
        dense = self.index < (getattr(config, "first_k_dense_replace", None) or 0)
        mlp = LlamaMLP(config, bias=False) if dense else DeepseekMoE(config, make_router(config))
        self.model = _Layers({str(self.index): DeepseekMTPLayer(config, mlp, own_embed, own_head)})
        self.rotary_emb = RotaryEmbedding.from_config(config, head_dim_of(config))

    @property
    def layer(self) -> DeepseekMTPLayer:
        return self.model.layers[str(self.index)]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor, embed: nn.Module
    ) -> torch.Tensor:
        """[n] next-token ids, [n] positions, [n, hidden] the hidden state each row continues (the target's
        before its final norm, or this layer's own output) -> [n, hidden] this layer's output (before the
        shared head's norm). `embed`: the layer's own embedding or the target's."""
        layer = self.layer
        e = layer.enorm(embed(input_ids))
        h = layer.hnorm(previous.to(e.dtype))
        x = layer.eh_proj(torch.cat((e, h), dim=-1))
        rope = self.rotary_emb.cos_sin(positions, x.dtype)
        x, residual = layer(rope, x, None)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """[rows, hidden] outputs -> [rows, vocab] float32, through the shared head's norm and `head` (the
        layer's own or the target's)."""
        return head(self.layer.shared_head.norm(hidden)).float()
