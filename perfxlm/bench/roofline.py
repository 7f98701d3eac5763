"""How close a run came to the machine: bytes/s and FLOP/s achieved next to the measured peaks.

Decode is bound by memory: each step reads every weight once (the embedding table only when it is
also the LM head) plus the KV cache of every sequence. Prefill is bound by GEMM: 2 FLOPs per weight
per token, plus attention (QK^T and PV over the causal triangle) and the LM head for the sampled rows.
"""

from __future__ import annotations

from typing import Any

from perfxlm.bench.env import _find_model


def model_costs(llm: Any) -> dict[str, float] | None:
    """Weight bytes read per decode step, matmul parameters per token, KV bytes per cached token."""
    from perfxlm.model.layers.attention import Attention
    from perfxlm.model.layers.embed_head import LMHead, VocabEmbedding

    engine = llm.llm_engine
    model = _find_model(engine)
    if model is None:
        return None
    embeds = [m for m in model.modules() if isinstance(m, VocabEmbedding)]
    heads = [m for m in model.modules() if isinstance(m, LMHead)]
    head_weight = heads[0].weight if heads else None
    weight_bytes = 0
    matmul_params = 0
    from perfxlm.quant.loading import unique_quantized_weights

    # quantized weights count their stored bytes (codes, scales and mins): what a decode step reads
    for p in [*model.parameters(), *unique_quantized_weights(model)]:
        is_table = any(p is e.weight for e in embeds)
        if is_table and p is not head_weight:
            continue  # an untied embedding: a decode step reads a few rows of it
        weight_bytes += p.nbytes
        if len(p.shape) >= 2 and not is_table and p is not head_weight:
            matmul_params += p.shape.numel()
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    spec = getattr(engine.config, "kv_cache_spec", None)
    return {
        "weight_bytes_per_step": float(weight_bytes),
        "matmul_params_per_token": float(matmul_params),
        "lm_head_params": float(head_weight.shape.numel()) if head_weight is not None else 0.0,
        "kv_bytes_per_token": float(
            sum(m.cache_bytes_per_token(spec) if spec else 8 * m.num_kv_heads * m.head_dim for m in attn)
        ),
        # QK^T and PV: 2 FLOPs per multiply-add, 2 products, per (query, key) pair and head channel
        "attn_flops_per_pair": float(sum(4 * m.num_heads * m.head_dim for m in attn)),
    }


def achieved(costs: dict[str, float], result: dict[str, Any], peaks: dict[str, float], compute_dtype: str
             ) -> dict[str, float]:
    b, i, o = result["batch_size"], result["input_len"], result["output_len"]
    out: dict[str, float] = {}
    decode_s = result.get("median_decode_step_ms", float("nan")) / 1e3
    if decode_s == decode_s and decode_s > 0:
        mean_context = i + o / 2
        step_bytes = costs["weight_bytes_per_step"] + b * mean_context * costs["kv_bytes_per_token"]
        out["decode_bytes_per_step"] = step_bytes
        out["decode_achieved_gbs"] = step_bytes / decode_s / 1e9
        if peaks.get("read_bandwidth_gbs"):
            out["decode_bandwidth_fraction"] = out["decode_achieved_gbs"] / peaks["read_bandwidth_gbs"]
    prefill_s = result["median_prefill_ms"] / 1e3
    flops = (2 * costs["matmul_params_per_token"] * b * i + 2 * costs["lm_head_params"] * b
             + costs["attn_flops_per_pair"] * b * i * (i + 1) / 2)
    out["prefill_flops"] = flops
    out["prefill_achieved_gflops"] = flops / prefill_s / 1e9
    peak = peaks.get(f"matmul_gflops_{compute_dtype}")
    if peak:
        out["prefill_gemm_fraction"] = out["prefill_achieved_gflops"] / peak
    return out


def format_achieved(a: dict[str, float], peaks: dict[str, float], compute_dtype: str) -> str:
    lines = ["achieved vs this machine's measured peaks"]
    if "decode_achieved_gbs" in a:
        line = (f"  decode: {a['decode_bytes_per_step'] / 1e6:.0f} MB read per step -> "
                f"{a['decode_achieved_gbs']:.1f} GB/s")
        if "decode_bandwidth_fraction" in a:
            line += (f" of {peaks['read_bandwidth_gbs']:.1f} GB/s read bandwidth "
                     f"({100 * a['decode_bandwidth_fraction']:.0f} %)")
        lines.append(line)
    line = f"  prefill: {a['prefill_flops'] / 1e9:.1f} GFLOP -> {a['prefill_achieved_gflops']:.1f} GFLOP/s"
    if "prefill_gemm_fraction" in a:
        line += (f" of {peaks[f'matmul_gflops_{compute_dtype}']:.1f} GFLOP/s {compute_dtype} GEMM "
                 f"({100 * a['prefill_gemm_fraction']:.0f} %)")
    lines.append(line)
    return "\n".join(lines)
