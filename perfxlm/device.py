"""Which device the engine runs on, and what `dtype="auto"` means there (vLLM's `device` argument).

One engine, two homes: on "cpu" the native kernels, the fused decode layer and the CPU attention path
run; on "cuda" the same scheduler, KV-cache manager and sampler drive a model whose weights, KV cache
and sampling tensors live in GPU memory, its attention on the Triton backend (`ops/gpu/`). The device is
resolved once, here, and travels as a value (`EngineConfig.torch_device`); kernels choose by the device
of the tensors they are given, behind their seams.
"""

from __future__ import annotations

from typing import Any

import torch

DEVICES = ("auto", "cpu", "cuda")
# what dtype names a CUDA engine takes (the CPU engine takes float32 and bfloat16 only)
CUDA_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}  # fmt: skip


def resolve_device(device: Any) -> torch.device:
    """vLLM's `device`: "auto" (CUDA where torch sees a GPU, else the CPU), "cpu", "cuda" or "cuda:N".
    ValueError for anything else, and for CUDA where torch sees none (the engine never falls back
    quietly to the CPU when a GPU was asked for)."""
    name = "auto" if device is None else str(device).strip().lower()
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise ValueError(f"device={device!r} is not a device name: use 'cuda' or 'cuda:N'.") from None
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: torch sees no CUDA device here (torch {torch.__version__}, "
                             f"CUDA build {torch.version.cuda}); use device='cpu' or 'auto'.")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible.")
        return dev
    raise ValueError(f"device must be one of {', '.join(DEVICES)} (or 'cuda:N'), got {device!r}.")


def cuda_dtype(dtype: str | torch.dtype, model_dtype: torch.dtype | None) -> torch.dtype:
    """The compute dtype of a CUDA engine. "auto" is vLLM's rule: the checkpoint's torch_dtype, a float32
    checkpoint downcast to bfloat16 where the GPU computes it (compute capability 8.0 and up), else
    float16."""
    if isinstance(dtype, torch.dtype):
        if dtype not in CUDA_DTYPES.values():
            raise ValueError(f"dtype must be float32, bfloat16 or float16 on CUDA, got {dtype}.")
        return dtype
    if dtype == "auto":
        half = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if model_dtype in (torch.bfloat16, torch.float16):
            return model_dtype if model_dtype != torch.bfloat16 or half == torch.bfloat16 else torch.float16
        return half
    if dtype not in CUDA_DTYPES:
        raise ValueError(f"dtype must be one of 'auto', {', '.join(repr(d) for d in CUDA_DTYPES)} on CUDA, "
                         f"got {dtype!r}.")
    return CUDA_DTYPES[dtype]


def checkpoint_dtype(hf_config: Any) -> torch.dtype | None:
    """The dtype config.json names (`torch_dtype`, or transformers' newer `dtype`), or None."""
    value = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None
