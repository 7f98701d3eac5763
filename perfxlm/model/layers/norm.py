"""Normalisations. RMSNorm (and Gemma's variant) take an optional residual to add first, since the
residual stream is carried between layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from perfxlm.ops import native


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32, scale in the model dtype: the same rounding as transformers.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = self._kernels(x)
        if ops is not None:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.variance_epsilon)
            if x.is_contiguous() and residual.is_contiguous():
                # In place: residual += x, then x = norm(residual). Both are this step's own tensors.
                ops.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)
                return x, residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _kernels(self, x: torch.Tensor):
        """The one-kernel norms for x, else None (the torch path): the CPU's native kernels for float32,
        a GPU's Triton kernel (`ops/gpu/rms_norm.py`) for contiguous 16-bit rows in the weight's type.
        Only this class's formula (Gemma's subclass scales differently)."""
        if type(self) is not RMSNorm:
            return None
        if x.device.type == "cpu":
            both_fp32 = x.dtype == torch.float32 and self.weight.dtype == torch.float32
            return native.kernels_for(x) if both_fp32 else None
        if x.dtype in (torch.float16, torch.bfloat16) and self.weight.dtype == x.dtype and x.is_contiguous():
            from perfxlm.ops.gpu.rms_norm import KERNELS  # imports triton: only for a GPU's tensors

            return KERNELS
        return None


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores w - 1 (zero-initialised), so the scale is 1 + w, and the
    whole product is taken in float32 before the cast back."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with optional affine parameters (OPT's `layer_norm_elementwise_affine`)."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True
    ):
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if elementwise_affine and bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
