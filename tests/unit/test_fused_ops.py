"""Fused norm and rotary (native kernels) against the plain-torch layers, on random inputs with odd sizes."""

import pytest
import torch

from perfxlm.model.layers.norm import RMSNorm
from perfxlm.model.layers.rotary import RotaryEmbedding
from perfxlm.ops import native
from perfxlm.ops.reference import rms_norm_reference


@pytest.fixture
def ops():
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    return native.kernels()


def _rotate_half_reference(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 33), (130, 64)])
def test_rms_norm_and_fused_add(ops, rows, hidden):
    torch.manual_seed(rows + hidden)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden)
    x, residual = torch.randn(rows, hidden), torch.randn(rows, hidden)
    torch.testing.assert_close(norm(x), rms_norm_reference(x, norm.weight, 1e-5), atol=1e-5, rtol=1e-5)
    summed = x + residual
    out, new_residual = norm(x.clone(), residual.clone())
    torch.testing.assert_close(new_residual, summed)
    torch.testing.assert_close(out, rms_norm_reference(summed, norm.weight, 1e-5), atol=1e-5, rtol=1e-5)


def test_rms_norm_on_strided_heads(ops):
    """Qwen3's per-head q/k norms take a strided slice of the fused projection."""
    qkv = torch.randn(5, 7, 32)
    norm = RMSNorm(32, 1e-6)
    norm.weight.data = torch.rand(32)
    heads = qkv[:, 2:6]
    torch.testing.assert_close(norm(heads), rms_norm_reference(heads, norm.weight, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 12, 64), (9, 5, 18), (33, 3, 128)])
def test_rotary_in_place_matches_rotate_half(ops, tokens, heads, head_dim):
    torch.manual_seed(tokens)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, {})
    positions = torch.randint(0, 4096, (tokens,))
    cos, sin = rope.cos_sin(positions, torch.float32)
    fused = torch.randn(tokens, heads + 2, head_dim)  # a strided view, as q|k inside the fused projection
    x = fused[:, 1 : heads + 1]
    expected = _rotate_half_reference(x.clone(), cos, sin)
    untouched = fused[:, 0].clone()
    ops.rotary_embedding(x, cos, sin)
    torch.testing.assert_close(x, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused[:, 0], untouched)
