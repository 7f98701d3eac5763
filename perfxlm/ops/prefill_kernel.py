"""Which path a sequence's causal prefill attention takes on CPU: the native kernel
(csrc/prefill_attention.cpp) or torch's SDPA (perfxlm/ops/attention.py's paths).

The kernel serves plain causal attention (no sliding window, soft cap or attention sinks) of float32
queries over a float32 or bfloat16 KV cache: the prompt's own keys and, with prefix caching or chunked
prefill, the cache's earlier blocks, read through the block table. The new keys are passed in the
cache's dtype, so a prompt's rows come out the same whether its start was computed now or read back.

PERFXLM_PREFILL_ATTENTION = auto | kernel | torch
    auto: the kernel on SIMD builds (AVX2 and up) for sequences whose packed keys and values stay under
    _MAX_PACKED_BYTES (it packs a KV head's keys once per call); torch's SDPA elsewhere: on the scalar
    build its loops are slower than SDPA's. The default model's attention (9 heads over 3 KV heads of
    64), one layer, one thread's CPU time per call, alternating, loaded 2-vCPU Zen 4, against the bf16
    SDPA it replaces: avx512_bf16 build (vdpbf16ps over a bf16 cache) 2.31x at 512 tokens, 1.90x at
    128; float32 FMAs (the kernel's first form, which float32 caches take) 1.57x / 1.29x; avx2 build
    against torch's AVX2 SDPA 1.26x / 1.28x. The whole 512-token prefill, one thread's CPU time,
    alternating in one process, loaded: 1.23x (the float32-FMA form 1.13x).
    kernel: the kernel wherever it applies (any tier, any length); torch: SDPA always.
"""

from __future__ import annotations

import os

import torch

MODES = ("auto", "kernel", "torch")
# 2 (K and V) x KV heads x tokens x head_dim x 4 bytes; past it the tiled SDPA path reads the cache
# tile by tile instead of widening all of it at once.
_MAX_PACKED_BYTES = 256 << 20


def mode() -> str:
    value = os.environ.get("PERFXLM_PREFILL_ATTENTION", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"PERFXLM_PREFILL_ATTENTION={value!r}: expected one of {', '.join(MODES)}.")
    return value


def applies(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    num_context_tokens: int,
    options_set: bool,  # a sliding window, soft cap, sinks or a quantized cache's scales
) -> bool:
    chosen = mode()
    if chosen == "torch" or options_set or query.device.type != "cpu" or query.dtype != torch.float32:
        return False
    if key_cache.dtype not in (torch.float32, torch.bfloat16):
        return False
    if chosen == "kernel":
        return True
    from perfxlm.ops import isa

    if "avx2" not in isa.visible_flags():
        return False
    _, _, num_kv_heads, head_dim = key_cache.shape
    return 8 * num_kv_heads * (num_context_tokens + query.shape[0]) * head_dim <= _MAX_PACKED_BYTES
