"""OPT (facebook/opt-*): learned absolute positions (table offset 2), LayerNorm, ReLU MLP, biases
everywhere; pre-LN (`do_layer_norm_before`, all sizes but 350m) or post-LN; project_in/out when the
embedding width differs from the hidden size. Under tensor parallelism the heads, fc1's rows and the
vocabulary are split as for Llama (model/layers/parallel_linear.py); the positions table, the norms and
project_in/out are replicated."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.model.layers.activation import Activation
from perfxlm.model.layers.attention import Attention
from perfxlm.model.layers.embed_head import LearnedPositionalEmbedding, ParallelLMHead, VocabParallelEmbedding
from perfxlm.model.layers.linear import Linear
from perfxlm.model.layers.parallel_linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from perfxlm.model.layers.norm import LayerNorm
from perfxlm.model.models.base import CausalLM


def _layer_norm(config: Any) -> LayerNorm:
    return LayerNorm(
        config.hidden_size, elementwise_affine=getattr(config, "layer_norm_elementwise_affine", True)
    )


class OPTAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads = config.num_attention_heads
        self.head_dim = hidden // heads
        self.scaling = self.head_dim**-0.5
        bias = bool(getattr(config, "enable_bias", True))
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, heads, heads, bias=bias)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias, input_part=self.qkv_proj.q_part)
        # transformers scales q after its projection and attends with scale 1: the same rounding here
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        return self.out_proj(self.attn(q * self.scaling, k, v))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.do_layer_norm_before = bool(config.do_layer_norm_before)
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = _layer_norm(config)
        bias = bool(getattr(config, "enable_bias", True))
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_dim, bias=bias)
        self.act = Activation(config.activation_function)
        self.fc2 = RowParallelLinear(config.ffn_dim, config.hidden_size, bias=bias)
        self.final_layer_norm = _layer_norm(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.do_layer_norm_before
        h = self.self_attn(self.self_attn_layer_norm(x) if pre else x)
        x = x + h
        if not pre:
            x = self.self_attn_layer_norm(x)
        h = self.fc2(self.act(self.fc1(self.final_layer_norm(x) if pre else x)))
        x = x + h
        if not pre:
            x = self.final_layer_norm(x)
        return x


class OPTDecoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        embed_dim = getattr(config, "word_embed_proj_dim", None) or config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, embed_dim)
        self.embed_positions = LearnedPositionalEmbedding(
            config.max_position_embeddings, config.hidden_size, offset=2
        )
        projected = embed_dim != config.hidden_size
        self.project_in = Linear(embed_dim, config.hidden_size) if projected else None
        self.project_out = Linear(config.hidden_size, embed_dim) if projected else None
        keep_final = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        self.final_layer_norm = _layer_norm(config) if keep_final else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions)
        for layer in self.layers:
            x = layer(x)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x


class OPTModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(CausalLM):
    supports_tensor_parallel = True
    # the original facebook/opt-* checkpoints name tensors without the leading "model."
    renames = [(r"^decoder\.", "model.decoder.")]
    stacked_params = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
    ]

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        embed_dim = getattr(config, "word_embed_proj_dim", None) or config.hidden_size
        tied = self.model.decoder.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, embed_dim, tied_to=tied)

    def tied_param_names(self) -> set[str]:
        return {"lm_head.weight"} if self.tie_word_embeddings else set()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.decoder(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
