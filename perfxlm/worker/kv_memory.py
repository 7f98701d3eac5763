"""KV cache tensors whose pages are committed only when written.

Each tensor lives in its own anonymous memory map: the kernel hands out zero pages on first touch, so
a pool sized for the worst case costs resident memory only for the blocks requests actually write,
and every slot reads as zero until then (masked attention never meets garbage that could be NaN, as
with `torch.zeros`, but without writing the whole pool up front).
"""

from __future__ import annotations

import math
import mmap

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """Zeros in CPU memory committed on first write; on another device (a GPU's pool, sized to what it
    may hold), plain zeros there."""
    if device is not None and torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps a reference to the map: it is unmapped when the tensor is freed
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)
