"""The Triton rotary embedding and silu-and-mul for 16-bit activations against the torch paths they
replace on a GPU: same formulas, rounded once where torch rounds each product (so equal but for the
type's last bit), in place on strided views of the fused projection's output, partial rotary included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from perfxlm.model.layers.rotary import apply_rotary
from perfxlm.ops.gpu.activation import silu_and_mul
from perfxlm.ops.gpu.rotary import rotary_embedding

DTYPE = torch.float16  # the interpreter's numpy has no bfloat16


def _table(tokens: int, rotary_dim: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.randint(0, 500, (tokens, 1), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = pos * inv
    # the second half differs from the first on purpose: the kernel must read both halves of the table
    emb = torch.cat((freqs, freqs * 1.01), dim=-1)
    return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)  # [tokens, 1, rotary_dim], as the table gives


@pytest.mark.parametrize("tokens,heads,head_dim,rotary_dim", [(5, 7, 64, 64), (3, 19, 80, 32), (1, 3, 48, 48)])
def test_rotary_in_place_on_a_strided_view(device, tokens, heads, head_dim, rotary_dim):
    g = torch.Generator().manual_seed(heads)
    cos, sin = _table(tokens, rotary_dim, g)
    cos, sin = cos.to(DTYPE), sin.to(DTYPE)
    extra = 5  # v heads after q|k in the fused output: the view's token stride is wider than its heads
    qkv = (2 * torch.randn(tokens, (heads + extra) * head_dim, generator=g)).to(DTYPE)
    view = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    want = apply_rotary(view.clone(), cos, sin)  # torch's path (CPU, 16-bit)
    tail = qkv[:, heads * head_dim :].clone()
    qkv = qkv.to(device)
    view = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    got = rotary_embedding(view, cos.to(device), sin.to(device))
    assert got.data_ptr() == view.data_ptr()  # in place
    torch.testing.assert_close(got.cpu(), want, atol=2e-3, rtol=2e-3)
    assert torch.equal(qkv[:, heads * head_dim :].cpu(), tail)  # nothing past the view is touched
    if rotary_dim < head_dim:  # partial rotary: the remaining channels pass through unchanged
        assert torch.equal(got.cpu()[..., rotary_dim:], want[..., rotary_dim:])


@pytest.mark.parametrize("rows,d", [(1, 11), (7, 300), (4, 1500)])
def test_silu_and_mul_matches_torch(device, rows, d):
    g = torch.Generator().manual_seed(d)
    x = (3 * torch.randn(rows, 2 * d, generator=g)).to(DTYPE)
    gate, up = x.float().chunk(2, dim=-1)
    want = (F.silu(gate).to(DTYPE).float() * up).to(DTYPE)
    got = silu_and_mul(x.to(device))
    assert got.shape == (rows, d)
    torch.testing.assert_close(got.cpu(), want, atol=1e-3, rtol=2e-3)
