"""How much GPU memory the KV pool may take: vLLM's `gpu_memory_utilization` rule.

The engine may fill `utilization x total` bytes of the device. What is in use once the model is loaded
(its weights, the CUDA context, and whatever other processes hold: vLLM counts them too) and a reserve
for one step's activations come off first; the KV pool gets the rest. The reserve is estimated from the
model's shapes for the largest step the scheduler may send (`max_num_batched_tokens` rows through the
widest projection, `max_num_seqs` vocabulary-wide logits rows in float32 and the sampler's copies of
them) rather than profiled, plus a fixed allowance for cuBLAS workspaces and Triton's launches.
"""

from __future__ import annotations

import torch

from perfxlm.model.layers.embed_head import LMHead
from perfxlm.model.layers.linear import Linear

# cuBLAS workspaces, Triton's and the caching allocator's slack
FIXED_RESERVE = 512 << 20


def activation_reserve_bytes(model: torch.nn.Module, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Peak bytes one step's activations may take, from the model's shapes (an upper estimate)."""
    widest = hidden = vocab = 0
    elem = 4
    for m in model.modules():
        if isinstance(m, Linear):
            widest = max(widest, m.out_features)
            hidden = max(hidden, m.in_features)
            elem = m.weight.element_size() if isinstance(m.weight, torch.Tensor) else elem
        elif isinstance(m, LMHead):
            vocab = max(vocab, m.weight.shape[0])
    # a layer holds the residual stream, its normed copy and the attention output (hidden wide each),
    # and a projection's input and output (the widest, gate and up together, plus the activation's half)
    per_token = (4 * hidden + 2 * widest) * elem
    # logits in float32, and the sampler's log-softmax / probabilities / sorted copies of them
    logits = max_num_seqs * vocab * 4 * 4
    return max_num_batched_tokens * per_token + logits + FIXED_RESERVE


def kv_budget_bytes(model: torch.nn.Module, device: torch.device, utilization: float, max_num_batched_tokens: int,
                    max_num_seqs: int) -> int:
    """Bytes the KV pool may take on `device` (may be <= 0: then nothing fits)."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free  # weights, the CUDA context, other processes
    reserve = activation_reserve_bytes(model, max_num_batched_tokens, max_num_seqs)
    return int(utilization * total) - in_use - reserve
