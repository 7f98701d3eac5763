from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from perfxlm.ops.gpu import fused_elementwise

# transformers' `hidden_act` names whose definitions torch has exactly
_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # BERT-era name of the tanh approximation
}


def get_activation(name: str):
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"activation {name!r} is not supported (supported: {', '.join(sorted(_ACTIVATIONS))})."
        ) from None


class Activation(nn.Module):
    """An elementwise activation by its transformers name (OPT's ReLU)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.fn = get_activation(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class SiluAndMul(nn.Module):
    """[..., 2 * d] (gate | up) -> [..., d]: silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_elementwise(x):
            from perfxlm.ops.gpu.activation import silu_and_mul  # imports triton: only for a GPU's tensors

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """[..., 2 * d] (gate | up) -> [..., d]: gelu(gate) * up; approximate="tanh" for Gemma."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


# torch's elementwise sigmoid takes vector steps over a contiguous run and scalar ones at its tail, and
# the two round apart: over several rows at once, a row's last elements would land on one or the other by
# the rows beside it. Rows padded to a multiple of this many elements (two vectors of the widest ISA, and
# of the experts kernel's column runs) are each computed alone as within any batch of decode rows (below
# torch's parallel grain, where one thread runs the op): a speculative step's verification rows as the
# decode steps they stand for (csrc/moe_kernels.cpp pads alike).
ROW_ALIGN = 64


class ClampedSwiGLU(nn.Module):
    """gpt-oss's expert activation: [..., 2 * d] with gate and up interleaved (even, odd columns) ->
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x[..., ::2].clamp(max=self.limit), x[..., 1::2].clamp(-self.limit, self.limit)
        d = gate.shape[-1]
        pad = -d % ROW_ALIGN
        if pad:  # see ROW_ALIGN: the padding's own values are cut off below
            gate = F.pad(gate, (0, pad))
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))[..., :d]


def act_and_mul(name: str) -> nn.Module:
    """The gated-MLP activation for a transformers `hidden_act` name."""
    if name in ("silu", "swish"):
        return SiluAndMul()
    if name in ("gelu", "gelu_pytorch_tanh"):
        return GeluAndMul("tanh" if name == "gelu_pytorch_tanh" else "none")
    raise ValueError(
        f"gated activation {name!r} is not supported (supported: gelu, gelu_pytorch_tanh, silu, swish)."
    )


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): bounds logits smoothly to (-cap, cap) (Gemma 2)."""
    return torch.tanh(x / cap) * cap
