"""y = x W^T + b, dispatched on how W is stored.

Same dtype as x: torch's own linear (MKL/oneDNN). bf16 W with float32 x (bf16 weights, float32
compute, on CPUs without bf16 arithmetic): few rows (decode) go to the native kernel, which reads the
bf16 weights and widens them in registers, so a decode step reads half the bytes; many rows (prefill)
widen W a slab at a time into a reused float32 buffer that stays in cache and run float32 GEMMs on it.
The reference for both is `F.linear(x, W.float(), b)`.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from perfxlm.ops import native

# Up to this many rows the native kernel beats widening + float32 GEMM (measured on AVX-512).
NATIVE_MAX_ROWS = 16
# Rows of W widened per slab: 1024 x 576 float32 = 2.3 MB, about the size of L2.
SLAB_ROWS = 1024

_scratch = threading.local()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    if weight.dtype != torch.bfloat16 or x.dtype != torch.float32:
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    rows = x.reshape(-1, x.shape[-1])
    ops = native.kernels()
    if ops is not None and rows.shape[0] <= NATIVE_MAX_ROWS:
        y = ops.linear_bf16w(rows, weight, bias)
    else:
        y = _slab_linear(rows, weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def _slab_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    n_out, k = weight.shape
    slab = min(SLAB_ROWS, n_out)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < slab * k:
        buf = _scratch.buf = torch.empty(slab * k, dtype=torch.float32)
    # Output transposed: each slab's result is a contiguous block of rows, written in place.
    yt = torch.empty(n_out, x.shape[0], dtype=torch.float32)
    xt = x.t()
    for start in range(0, n_out, slab):
        n = min(slab, n_out - start)
        w = buf[: n * k].view(n, k)
        w.copy_(weight[start : start + n])
        torch.mm(w, xt, out=yt[start : start + n])
    y = yt.t()
    if bias is not None:
        y = y + bias.float()
    return y.contiguous() if x.shape[0] > 1 else y
