"""Kernels for a GPU executor, written in Triton (shipped with torch's CUDA builds).

They take the engine's own layouts (the paged KV cache `[num_blocks, block_size, num_kv_heads, head_dim]`
with its scale tensors, GGUF's packed blocks) so the scheduler, the block tables and the loaders stay
the same on every device. With `TRITON_INTERPRET=1` Triton runs the same kernels on CPU tensors, which is
how the test suite checks them against the plain-torch references on a machine without a GPU.
"""

from __future__ import annotations

import importlib.util
import os


def triton_available() -> bool:
    """Triton is importable and can run here: on a CUDA device, or in its interpreter on CPU tensors."""
    if importlib.util.find_spec("triton") is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    import torch

    return torch.cuda.is_available()


def fused_elementwise(x) -> bool:
    """The one-kernel rotary and activation products apply to x: 16-bit, unit stride in the last dim, on a
    GPU. `PERFXLM_GPU_FUSED=0` keeps torch's ops (the A/B of benchmarks/gpu_sweep.py)."""
    import torch

    return (_FUSED and x.device.type == "cuda" and x.dtype in (torch.float16, torch.bfloat16)
            and x.stride(-1) == 1)


# read once: the check runs for every rotary and activation call of an eager step
_FUSED = os.environ.get("PERFXLM_GPU_FUSED", "1") != "0"
