"""Plain reference implementations: slow, obvious, and what the optimized ops are tested against."""

from __future__ import annotations

import torch


def attention_reference(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [S, num_kv_heads, head_dim], all keys the sequence has (context + new)
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] logits
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Causal attention where query i is the last T tokens of the S-token sequence.

    With a sliding window W the query at position p sees only keys p - W + 1 .. p; with a soft cap c
    the scores become c * tanh(scores / c); a sink is one more score per head whose weight is dropped.
    """
    num_new, num_heads, _ = query.shape
    total, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for i in range(num_new):
        pos = total - num_new + i
        first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
        for h in range(num_heads):
            k = key[first : pos + 1, h // group].float()
            v = value[first : pos + 1, h // group].float()
            scores = (k @ query[i, h].float()) * scale
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            if sinks is not None:
                weights = torch.softmax(torch.cat((scores, sinks[h].float().view(1))), dim=0)[:-1]
            else:
                weights = torch.softmax(scores, dim=0)
            out[i, h] = (weights @ v).to(query.dtype)
    return out


def gather_sequence_kv(
    cache: torch.Tensor, block_table: list[int], num_tokens: int
) -> torch.Tensor:  # [num_tokens, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    rows = [cache[block_table[p // block_size], p % block_size] for p in range(num_tokens)]
    return torch.stack(rows)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def moe_reference(
    x: torch.Tensor,  # [T, hidden]
    router_logits: torch.Tensor,  # [T, num_experts]
    gate_up: torch.Tensor,  # [num_experts, 2 * inter, hidden]
    down: torch.Tensor,  # [num_experts, hidden, inter]
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    """Mixture of experts token by token: softmax routing, top-k, SiLU-gated expert MLPs."""
    out = torch.zeros_like(x)
    probs = torch.softmax(router_logits.float(), dim=-1)
    for t in range(x.shape[0]):
        weights, experts = probs[t].topk(top_k)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), experts.tolist()):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out
