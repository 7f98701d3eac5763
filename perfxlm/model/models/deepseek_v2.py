"""DeepSeek-V2 / V2-Lite and DeepSeek-V3: multi-head latent attention (layers/mla.py, the latent is
the KV cache) with rotary on a split part of each head (YaRN with mscale where configured), and after
`first_k_dense_replace` dense layers a mixture of experts: routed experts chosen by grouped top-k
(layers/moe_router.py) plus always-on shared experts. Their rope rotates interleaved pairs (V3 unless
`rope_interleave` is false): the rope rows of the q and kv-down projections are reordered at load so the
rotate-half kernels apply it (rotary.interleaved_to_halves).

A V3 checkpoint may carry multi-token-prediction layers after the decoder (`num_nextn_predict_layers`,
stored as layers num_hidden_layers and up): the target skips them; speculative decoding's `mtp` method
loads them (deepseek_mtp.py)."""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch
from torch import nn

from perfxlm.distributed.parallel_state import tp_group
from perfxlm.model.layers.mla import MLAttention
from perfxlm.model.layers.moe import FusedMoE
from perfxlm.model.layers.moe_router import GroupedTopKRouter
from perfxlm.model.layers.rotary import interleaved_to_halves
from perfxlm.model.models.llama import LLAMA_STACKED_PARAMS, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from perfxlm.model.models.qwen2_moe import MOE_STACKED_PARAMS

_Q_ROWS = re.compile(r"\.self_attn\.(q_proj|q_b_proj)\.weight$")
_KV_A_ROWS = re.compile(r"\.self_attn\.kv_a_proj_with_mqa\.(weight|bias)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_layer_of(name: str, config: Any) -> int | None:
    """The index (0-based, among the MTP layers) of the multi-token-prediction layer a checkpoint tensor
    belongs to, else None (a decoder tensor)."""
    m = _LAYER.match(name)
    if m is None or int(m.group(1)) < config.num_hidden_layers:
        return None
    return int(m.group(1)) - config.num_hidden_layers


def halves_rope_rows(weights: Iterable[tuple[str, torch.Tensor]], config: Any) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint's interleaved rope rows of the q and kv-down projections reordered into halves (the
    rotate-half kernels' layout)."""
    c = config
    q_head, latent = c.qk_nope_head_dim + c.qk_rope_head_dim, c.kv_lora_rank + c.qk_rope_head_dim
    for name, tensor in weights:
        if _Q_ROWS.search(name):  # every head: [nope | rope]
            tensor = interleaved_to_halves(tensor, q_head, c.qk_rope_head_dim, c.qk_nope_head_dim)
        elif _KV_A_ROWS.search(name):  # one row block: [latent | rope]
            tensor = interleaved_to_halves(tensor, latent, c.qk_rope_head_dim, c.kv_lora_rank)
        yield name, tensor


class DeepseekMoE(nn.Module):
    """Routed experts plus always-on shared experts. Under tensor parallelism both are split by
    intermediate size and the router is replicated: each rank adds its partial routed and shared outputs,
    and one all-reduce sums them."""

    def __init__(self, config: Any, router: GroupedTopKRouter) -> None:
        super().__init__()
        self.gate = router
        self.experts = FusedMoE(
            config.n_routed_experts, config.num_experts_per_tok, config.hidden_size,
            config.moe_intermediate_size, renormalize=False, activation=config.hidden_act, reduce_results=False,
        )  # fmt: skip
        shared = (getattr(config, "n_shared_experts", None) or 0) * config.moe_intermediate_size
        self.shared_experts = (
            LlamaMLP(config, intermediate_size=shared, bias=False, reduce_results=False) if shared else None
        )
        self.tp = tp_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts.run_routed(x, *self.gate(x))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out) if self.tp.parallel else out


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    # the MLPs' gate|up only: MLA keeps its projections apart
    stacked_params = MOE_STACKED_PARAMS + [e for e in LLAMA_STACKED_PARAMS if e[0] == ".gate_up_proj"]

    def make_router(self, config: Any) -> GroupedTopKRouter:
        # V2 weights are the softmax scores as they are: transformers' V2 never renormalises them
        return GroupedTopKRouter(
            config.hidden_size, config.n_routed_experts, config.num_experts_per_tok, "softmax",
            getattr(config, "topk_method", None) or "greedy", getattr(config, "n_group", None),
            getattr(config, "topk_group", None), False, config.routed_scaling_factor,
        )  # fmt: skip

    def rope_interleaved(self, config: Any) -> bool:
        return True

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        dense = layer_idx < (getattr(config, "first_k_dense_replace", None) or 0)
        mlp = LlamaMLP(config, bias=False) if dense else DeepseekMoE(config, self.make_router(config))
        return LlamaDecoderLayer(config, MLAttention(config), mlp)

    def forward_pre_norm(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.forward_states(input_ids, positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], sink: Any = None) -> None:
        c = self.config
        decoder = ((n, t) for n, t in weights if mtp_layer_of(n, c) is None)  # MTP layers: not the target's
        if self.rope_interleaved(c):
            decoder = halves_rope_rows(decoder, c)
        return super().load_weights(decoder, sink)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    def make_router(self, config: Any) -> GroupedTopKRouter:
        return GroupedTopKRouter(
            config.hidden_size, config.n_routed_experts, config.num_experts_per_tok, "sigmoid",
            getattr(config, "topk_method", None) or "noaux_tc", config.n_group, config.topk_group,
            bool(config.norm_topk_prob), config.routed_scaling_factor,
        )  # fmt: skip

    def rope_interleaved(self, config: Any) -> bool:
        return bool(getattr(config, "rope_interleave", True))
