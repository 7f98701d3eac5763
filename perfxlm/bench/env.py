"""The configuration a benchmark ran with: printed with every result and saved in its JSON, so that a
number can be reproduced and compared with another engine's on the same machine."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import resource
import sys
import time
from typing import Any

from perfxlm.ops import cpu_plan

# The CPU features that decide which kernels run (bf16 and int8 paths, vector width).
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
              "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2", "bf16", "i8mm")


def _cpuinfo_fields() -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if ":" not in line:
                    if fields:  # the first processor's block is enough
                        break
                    continue
                key, value = (s.strip() for s in line.split(":", 1))
                fields.setdefault(key, value)
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    fields = _cpuinfo_fields()
    for key in ("model name", "Model", "Hardware", "cpu model"):
        if fields.get(key):
            return fields[key]
    return platform.processor() or platform.machine() or "unknown"


def cpu_isa_flags() -> list[str]:
    fields = _cpuinfo_fields()
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return [f for f in _ISA_FLAGS if f in flags]


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def total_memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_rss_gib() -> float:
    """Peak resident memory of this process so far (GiB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return rss / (1 << 30) if sys.platform == "darwin" else rss / (1 << 20)


def current_rss_gib() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / (1 << 30)
    except (OSError, ValueError, IndexError):
        return None


def _find_model(engine: Any) -> Any:
    """The torch module behind an engine, wherever the engine keeps it (None when out of process)."""
    for path in ("model", "core.model", "core.runner.model", "runner.model", "model_executor.model"):
        obj = engine
        for name in path.split("."):
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if obj is not None and hasattr(obj, "parameters"):
            return obj
    return None


def estimate_llama_params(hf_config: Any) -> int:
    """Parameter count of a Llama-style decoder from its config (when the module cannot be reached)."""
    h = int(getattr(hf_config, "hidden_size", 0) or 0)
    if not h:
        return 0
    vocab = int(getattr(hf_config, "vocab_size", 0) or 0)
    layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    inter = int(getattr(hf_config, "intermediate_size", 4 * h) or 4 * h)
    heads = int(getattr(hf_config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", heads) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or h // heads)
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    per_layer = attn + 3 * h * inter + 2 * h
    embed = vocab * h * (1 if getattr(hf_config, "tie_word_embeddings", False) else 2)
    return embed + layers * per_layer + h


def model_summary(llm: Any) -> dict[str, Any]:
    """Model path, dtype, parameter count and weight bytes of a loaded LLM."""
    engine = llm.llm_engine
    config = engine.config
    params = weight_bytes = 0
    model = _find_model(engine)
    if model is not None:
        # parameters() yields a tied weight once; buffers (rotary tables) are not weights. A tied LM head
        # packed for the bf16 kernels is a second copy of the embedding: bytes in memory, not parameters.
        tied = bool(getattr(config.hf_config, "tie_word_embeddings", False))
        head = getattr(model, "lm_head", None)
        for p in model.parameters():
            weight_bytes += p.numel() * p.element_size()
            if not (tied and head is not None and p is getattr(head, "weight", None) and p.dim() == 3):
                params += p.numel()
        from perfxlm.quant.loading import unique_quantized_weights

        for w in unique_quantized_weights(model):  # stored quantized: codes, scales and mins
            weight_bytes += w.nbytes
            params += w.shape.numel()
    if params == 0:
        params = estimate_llama_params(config.hf_config)
        weight_bytes = params * (2 if config.torch_dtype is not None and "bfloat16" in str(config.torch_dtype) else 4)
    hf = config.hf_config
    return {
        "model": config.model,
        "architecture": (getattr(hf, "architectures", None) or [type(hf).__name__])[0],
        # The weights' dtype names the run (a "bfloat16" run may compute in float32, see compute_dtype).
        "dtype": str(getattr(config, "weight_dtype", config.torch_dtype)).replace("torch.", ""),
        "compute_dtype": str(config.torch_dtype).replace("torch.", ""),
        # What runs the prefill GEMMs (their peak bounds prefill): the CPU's bf16 GEMM under a bf16-GEMM
        # plan even though activations are float32.
        "gemm_dtype": _gemm_dtype(config),
        "kv_cache_dtype": getattr(getattr(config, "kv_cache_spec", None), "name", None)
        or str(config.torch_dtype).replace("torch.", ""),
        "cpu_plan": cpu_plan.plan().describe(),
        "num_params": params,
        "model_size": format_params(params),
        "weights_gib": weight_bytes / (1 << 30),
        "num_kv_blocks": getattr(engine, "num_kv_blocks", None),
        "block_size": config.block_size,
        "max_model_len": getattr(engine, "resolved", config).max_model_len,  # a generate engine's is fitted to its pool
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_prefix_caching": config.enable_prefix_caching,
        "load_format": config.load_format,
    }


def format_params(n: int) -> str:
    if n <= 0:
        return "?"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return str(n)


def collect_env(llm: Any = None, **extra: Any) -> dict[str, Any]:
    """The configuration block: engine, model, dtype, threads, CPU; `extra` holds the command's settings."""
    import torch

    import perfxlm

    env: dict[str, Any] = {
        "engine": "perfxlm",
        "engine_version": perfxlm.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "cpu_isa": cpu_isa_flags(),
        "memory_gib": total_memory_gib(),
        "platform": platform.platform(),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    if llm is not None:
        env.update(model_summary(llm))
    env.update(extra)
    return env


def format_env(env: dict[str, Any], title: str = "configuration") -> str:
    lines = [f"=== {title} " + "=" * max(0, 60 - len(title))]
    width = max((len(k) for k in env), default=0)
    for key, value in env.items():
        if isinstance(value, float):
            value = f"{value:.3f}"
        elif isinstance(value, (list, tuple)):
            value = " ".join(str(v) for v in value)
        lines.append(f"{key:<{width}} : {value}")
    lines.append("=" * len(lines[0]))
    return "\n".join(lines)


def set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


# ---- machine peaks (cheap: well under a second each) ------------------------------------------
def measure_memory_bandwidth_gbs(size_mib: int = 256, repeats: int = 3) -> float:
    """Copy bandwidth (bytes read + written per second, GB/s), best of `repeats`."""
    import torch

    src = torch.ones(size_mib << 18, dtype=torch.float32)  # size_mib MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * src.element_size() / best / 1e9


def measure_matmul_gflops(dtype: str = "float32", n: int = 1024, repeats: int = 3) -> float:
    """Dense matmul rate (GFLOP/s) for an n x n x n product in `dtype`, best of `repeats`."""
    import torch

    dt = getattr(torch, dtype)
    a = torch.randn(n, n).to(dt)
    b = torch.randn(n, n).to(dt)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def measure_read_bandwidth_gbs(size_mib: int = 512, repeats: int = 3) -> float:
    """Read bandwidth (GB/s): a sum over a buffer far larger than the caches, best of `repeats`.
    What a decode step is bound by: it reads every weight once and writes little."""
    import torch

    src = torch.ones(size_mib << 18, dtype=torch.float32)
    src.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t)
    return src.numel() * src.element_size() / best / 1e9


def _gemm_dtype(config: Any) -> str:
    weights = str(getattr(config, "weight_dtype", config.torch_dtype)).replace("torch.", "")
    if weights == "bfloat16" and cpu_plan.plan().gemm == "bf16" and cpu_plan.plan().bf16_compute == "float32":
        return "bfloat16"
    return str(config.torch_dtype).replace("torch.", "")


def machine_peaks(dtype: str = "float32") -> dict[str, float]:
    """`dtype`: the compute dtype, whose GEMM rate bounds prefill."""
    return {
        "copy_bandwidth_gbs": measure_memory_bandwidth_gbs(),
        "read_bandwidth_gbs": measure_read_bandwidth_gbs(),
        f"matmul_gflops_{dtype}": measure_matmul_gflops(dtype),
    }
