"""The linear dispatch (bf16 weights under float32 compute) against F.linear on the widened weights."""

import pytest
import torch
import torch.nn.functional as F

from perfxlm.ops import linear as linear_ops
from perfxlm.ops import native
from perfxlm.ops.linear import linear


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 70])
@pytest.mark.parametrize("n_out,k", [(13, 37), (64, 576), (1030, 48), (7, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_weights_match_widened_reference(rows, n_out, k, bias):
    torch.manual_seed(rows * 1000 + n_out + k)
    x = torch.randn(rows, k)
    w = torch.randn(n_out, k).bfloat16()
    b = torch.randn(n_out) if bias else None
    ref = F.linear(x, w.float(), b)
    out = linear(x, w, b)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-4 * k**0.5, rtol=1e-4)


def test_native_kernel_and_slab_path_agree(monkeypatch):
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    torch.manual_seed(0)
    x = torch.randn(9, 200)
    w = torch.randn(333, 200).bfloat16()
    direct = native.kernels().linear_bf16w(x, w, None)
    monkeypatch.setattr(linear_ops, "NATIVE_MAX_ROWS", 0)
    monkeypatch.setattr(linear_ops, "SLAB_ROWS", 100)  # several slabs and a ragged last one
    slabs = linear(x, w)
    torch.testing.assert_close(direct, slabs, atol=1e-4, rtol=1e-4)


def test_leading_dims_and_same_dtype_passthrough():
    x = torch.randn(2, 3, 40)
    w = torch.randn(24, 40)
    torch.testing.assert_close(linear(x, w), F.linear(x, w))
    out = linear(x, w.bfloat16())
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out, F.linear(x, w.bfloat16().float()), atol=1e-4, rtol=1e-4)


def test_bad_shapes_raise_clear_errors():
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    with pytest.raises(RuntimeError, match="features"):
        native.kernels().linear_bf16w(torch.randn(2, 8), torch.randn(4, 9).bfloat16(), None)
