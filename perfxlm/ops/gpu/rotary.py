"""Rotary embedding (rotate-half layout) in place as one Triton kernel for 16-bit activations on a GPU.

In torch ops the rotation is five kernels per call (negate, concatenate, two products, a sum) over the
q and k heads; at decode batch sizes a 7B step spends more time between those kernels than in them.
One program rotates one token's heads: out[:h] = x1 * cos[:h] - x2 * sin[:h] and
out[h:] = x2 * cos[h:] + x1 * sin[h:] (h = rotary_dim / 2), computed in float32 and rounded once (the
torch path rounds each product to the model's type: the two agree to the type's last bit). Channels past
`rotary_dim` (partial rotary) are left as they are, the CPU native kernel's contract.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, heads, half, stride_xt, stride_xh, stride_ct,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    dmask = ds < half
    c1 = tl.load(cos_ptr + t * stride_ct + ds, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + half + ds, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_ct + ds, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_ct + half + ds, mask=dmask, other=0.0).to(tl.float32)
    mask = (hs[:, None] < heads) & dmask[None, :]
    base = x_ptr + t * stride_xt + hs[:, None].to(tl.int64) * stride_xh + ds[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c1[None, :] - x2 * s1[None, :]
    o2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(base, o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + half, o2.to(x_ptr.dtype.element_ty), mask=mask)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [tokens, heads, head_dim] (unit stride in head_dim, any stride over tokens and heads:
    q and k may be a view into the fused projection's output) in place; cos, sin: [tokens, rotary_dim]
    (any leading broadcast dims of size 1 between)."""
    tokens, heads = x.shape[0], x.shape[1]
    rotary_dim = cos.shape[-1]
    cos2, sin2 = cos.reshape(tokens, rotary_dim), sin.reshape(tokens, rotary_dim)
    if cos2.stride(-1) != 1 or sin2.stride() != cos2.stride():
        cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    if tokens == 0:
        return x
    half = rotary_dim // 2
    block_h = min(16, triton.next_power_of_2(heads))
    _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
        x, cos2, sin2, heads, half, x.stride(0), x.stride(1), cos2.stride(0),
        BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(half), num_warps=4,
    )  # fmt: skip
    return x
