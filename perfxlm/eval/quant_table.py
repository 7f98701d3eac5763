"""`perfxlm eval quant-table`: every weight format the engine offers for one model, side by side, as
llama.cpp's quantize README tabulates them: bits per weight, resident weight size, perplexity and its
change, mean KL divergence from the unquantized model, how often the top token stays the same, and
batch-1 decode speed.

The base is the model unquantized in float32 (a quantized GGUF file: its tensors dequantized), scored
once and saved (perfxlm/eval/kld.py); each format then loads, is compared with it on the same windows,
and decodes one request (random prompt tokens, fixed output length) for the speed column.
"""

from __future__ import annotations

import gc
import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch

FLOAT_FORMATS = ("none", "int8", "w8a8", "int4", "nf4")  # a float checkpoint's choices
GGUF_FORMATS = ("gguf", "none")  # a quantized GGUF file: as stored, or dequantized


@dataclass
class QuantRow:
    label: str
    quantization: str
    bits_per_weight: float  # over every weight the model holds (embeddings and head included)
    weights_mib: float
    ppl: float
    delta_ppl_pct: float  # against the base's perplexity on the same windows
    kld_mean: float
    kld_error: float
    kld_99: float
    same_top_pct: float
    decode_tok_s: float  # NaN when speed was not measured


def weight_footprint(model: torch.nn.Module) -> tuple[int, int]:
    """(weights, bytes) of the model's weight matrices: parameters of two or more dimensions (norms and
    biases are noise) and quantized weights, each counted once (a tied head shares its table). Tensors
    are told apart by address, not storage: the weight arena puts every weight in one storage."""
    from perfxlm.quant.split_rows import pieces
    from perfxlm.quant.weight import QuantizedWeight

    seen: set[int] = set()
    count = size = 0
    for module in model.modules():
        found = [p for p in module._parameters.values() if p is not None and p.dim() >= 2]
        found += [p for v in vars(module).values() for p in pieces(v)]  # a split weight's parts each
        for value in found:
            first = value.codes if isinstance(value, QuantizedWeight) else value
            if first.data_ptr() in seen:
                continue
            seen.add(first.data_ptr())
            if isinstance(value, QuantizedWeight):
                count += math.prod(value.shape)
                size += value.nbytes
            else:
                count += value.numel()
                size += value.numel() * value.element_size()
    return count, size


def default_formats(model: str, load_format: str) -> tuple[str, ...]:
    from perfxlm.quant.loading import gguf_quantized_types

    gguf = load_format == "gguf" or (load_format == "auto" and str(model).endswith(".gguf"))
    return GGUF_FORMATS if gguf and gguf_quantized_types(model) else FLOAT_FORMATS


def run_quant_table(
    engine_kwargs: dict[str, Any],
    text: str,
    formats: Sequence[str],
    base_path: str,
    ctx_size: int = 512,
    n_chunks: int | None = None,
    decode_tokens: int = 64,
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> list[QuantRow]:
    from perfxlm import LLM
    from perfxlm.bench.latency import run_latency
    from perfxlm.eval.kld import kl_divergence, save_base_logprobs

    kwargs = dict(engine_kwargs)
    model = kwargs.pop("model")
    gguf_file = "gguf" in formats or default_formats(model, kwargs.get("load_format", "auto")) == GGUF_FORMATS
    log(f"base: {model}, float32{', dequantized' if gguf_file else ''}")
    base = LLM(model, **{**kwargs, "dtype": "float32", "quantization": "none" if gguf_file else None})
    save_base_logprobs(base, text, base_path, ctx_size, n_chunks=n_chunks, progress=progress)
    del base
    gc.collect()
    rows = []
    for fmt in formats:
        llm = LLM(model, **{**kwargs, "quantization": fmt})
        dtype = str(llm.llm_engine.config.weight_dtype).replace("torch.", "")
        label = {"none": dtype, "gguf": "as stored"}.get(fmt, fmt)
        log(f"{label}: scoring")
        s = kl_divergence(llm, base_path, progress=progress).summary
        weights, size = weight_footprint(llm.llm_engine.core.model)
        speed = math.nan
        if decode_tokens > 0:
            log(f"{label}: decoding")
            speed = run_latency(llm, 1, 128, decode_tokens, num_iters=3, num_iters_warmup=1)["median_decode_throughput_tok_s"]
        rows.append(QuantRow(
            label=label, quantization=fmt, bits_per_weight=8 * size / weights, weights_mib=size / 2**20,
            ppl=s.ppl_model.value, delta_ppl_pct=100 * (s.ppl_model.value / s.ppl_base.value - 1),
            kld_mean=s.kld_mean.value, kld_error=s.kld_mean.error, kld_99=s.kld_percentiles[99.0],
            same_top_pct=100 * s.same_top.value, decode_tok_s=speed,
        ))  # fmt: skip
        log(markdown([rows[-1]]).splitlines()[-1])
        del llm
        gc.collect()
    return rows


def markdown(rows: Sequence[QuantRow]) -> str:
    head = ("| format | bits/weight | weights MiB | PPL | Δppl | mean KLD | 99% KLD | same top | decode tok/s |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        speed = "" if math.isnan(r.decode_tok_s) else f"{r.decode_tok_s:.1f}"
        lines.append(f"| {r.label} | {r.bits_per_weight:.2f} | {r.weights_mib:.1f} | {r.ppl:.4f} | "
                     f"{r.delta_ppl_pct:+.2f} % | {r.kld_mean:.5f} ± {r.kld_error:.5f} | {r.kld_99:.4f} | "
                     f"{r.same_top_pct:.2f} % | {speed} |")
    return "\n".join(lines)


def to_dicts(rows: Sequence[QuantRow]) -> list[dict[str, Any]]:
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(r).items()} for r in rows]


def plot_quant_table(rows: Sequence[QuantRow], path: str, title: str | None = None) -> str:
    """Left: mean KLD against bits per weight (lower left is better). Right: decode speed per format."""
    from perfxlm.bench.plots import pyplot, save_figure

    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4))
    for r in rows:
        kld = max(r.kld_mean, 1e-7)
        ax1.errorbar(r.bits_per_weight, kld, yerr=r.kld_error, fmt="o")
        ax1.annotate(r.label, (r.bits_per_weight, kld), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax1.set_yscale("log")
    ax1.set_xlabel("bits per weight")
    ax1.set_ylabel("mean KL divergence from float32 (nats)")
    ax1.grid(True, which="both", alpha=0.3)
    speeds = [0.0 if math.isnan(r.decode_tok_s) else r.decode_tok_s for r in rows]
    ax2.barh(range(len(rows)), speeds, color="tab:green", alpha=0.8)
    ax2.set_yticks(range(len(rows)))
    ax2.set_yticklabels([r.label for r in rows], fontsize=8)
    ax2.invert_yaxis()
    ax2.set_xlabel("batch-1 decode tokens/s")
    ax2.grid(True, axis="x", alpha=0.3)
    return save_figure(fig, path, title)


def check_formats(formats: Sequence[str]) -> None:
    from perfxlm.quant.config import QuantizationConfig

    for fmt in formats:
        QuantizationConfig.resolve(fmt)  # ValueError naming the choices


def temporary_base_path() -> str:
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".kldbase")
    os.close(fd)
    return path
