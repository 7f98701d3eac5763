"""RMSNorm (with the residual add before it) as one Triton kernel for 16-bit activations on a GPU.

In torch ops a norm is eight kernels (widen, square, mean, add, rsqrt, scale, narrow, weight), nine with
the residual add: at batch 1 a 7B decode step spends more time launching them than computing. This
kernel does one row per program with the same rounding as the torch path (statistics in float32, the
normalised row rounded to the model's type, then multiplied by the weight and rounded again; the
residual sum rounded to the model's type), and the native CPU kernels' contract: `rms_norm(x, w, eps)`
returns a new tensor, `fused_add_rms_norm(x, residual, w, eps)` makes residual += x and x = norm(residual)
in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, eps, stride_x, stride_r, stride_o,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:  # residual += x, rounded to the model's type as torch's add is
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    y = (xf * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor) -> None:
    n = x.shape[-1]
    x2, o2 = x.view(-1, n), out.view(-1, n)
    r2 = residual.view(-1, n) if residual is not None else x2
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, o2, n, float(eps), x2.stride(0), r2.stride(0), o2.stride(0),
        ADD=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip


class GpuNormKernels:
    """The CPU native kernels' norm calls, for 16-bit tensors on a GPU (contiguous rows)."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        _launch(x, None, weight, eps, out)
        return out

    @staticmethod
    def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        _launch(x, residual, weight, eps, x)  # each program reads its row of x before it writes it


KERNELS = GpuNormKernels()
