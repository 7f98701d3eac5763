"""The linear dispatch (bf16 weights under float32 compute) against F.linear on the widened weights."""

import pytest
import torch
import torch.nn.functional as F

from perfxlm.ops import linear as linear_ops
from perfxlm.ops import native
from perfxlm.ops.linear import linear, pack_bf16, unpack_bf16


@pytest.fixture
def ops():
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    return native.kernels()


def _case(rows, n_out, k, bias, seed):
    torch.manual_seed(seed)
    x = torch.randn(rows, k)
    w = torch.randn(n_out, k).bfloat16()
    b = torch.randn(n_out) if bias else None
    return x, w, b, F.linear(x, w.float(), b)


@pytest.mark.parametrize("n_out,k", [(13, 37), (64, 576), (1030, 48), (7, 16), (33, 1)])
def test_pack_round_trip(n_out, k):
    w = torch.randn(n_out, k).bfloat16()
    packed = pack_bf16(w)
    assert packed.shape == (-(-n_out // 16), k, 16)
    assert torch.equal(unpack_bf16(packed, n_out), w)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 16, 17, 32, 33, 70, 130, 300])
@pytest.mark.parametrize("n_out,k", [(13, 37), (64, 576), (1030, 48), (7, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_matches_widened_reference(rows, n_out, k, bias):
    """Rows up to NATIVE_MAX_ROWS (256) take the native kernel, more take widened slabs + float32 GEMM."""
    x, w, b, ref = _case(rows, n_out, k, bias, rows * 1000 + n_out + k)
    out = linear(x, pack_bf16(w), b, n_out)
    assert out.shape == ref.shape and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, ref, atol=1e-4 * k**0.5, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 40, 200])
def test_slabs_with_a_ragged_last_one(monkeypatch, rows):
    monkeypatch.setattr(linear_ops, "NATIVE_MAX_ROWS", 0)
    monkeypatch.setattr(linear_ops, "SLAB_COLUMNS", 32)
    monkeypatch.setattr(linear_ops, "BIG_SLAB_ELEMENTS", 32 * 50)
    x, w, b, ref = _case(rows, 83, 50, True, rows)  # 6 panels in slabs of 2, the last one padded
    torch.testing.assert_close(linear(x, pack_bf16(w), b, 83), ref, atol=1e-4, rtol=1e-4)


def test_native_kernel_called_directly(ops):
    x, w, _, ref = _case(9, 333, 200, False, 0)
    torch.testing.assert_close(ops.linear_bf16_packed(x, pack_bf16(w), 333, None), ref, atol=1e-4, rtol=1e-4)


def test_leading_dims_and_plain_weights():
    x = torch.randn(2, 3, 40)
    w = torch.randn(24, 40)
    torch.testing.assert_close(linear(x, w), F.linear(x, w))
    out = linear(x, pack_bf16(w.bfloat16()), None, 24)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out, F.linear(x, w.bfloat16().float()), atol=1e-4, rtol=1e-4)
    # plain bf16 weights (no packing) widen per call
    torch.testing.assert_close(linear(x, w.bfloat16()), F.linear(x, w.bfloat16().float()))


def test_bad_shapes_raise_clear_errors(ops):
    with pytest.raises(RuntimeError, match="features"):
        ops.linear_bf16_packed(torch.randn(2, 8), pack_bf16(torch.randn(4, 9).bfloat16()), 4, None)
    with pytest.raises(RuntimeError, match="panels"):
        ops.linear_bf16_packed(torch.randn(2, 9), pack_bf16(torch.randn(4, 9).bfloat16()), 40, None)
    with pytest.raises(RuntimeError, match="bias size"):
        ops.linear_bf16_packed(torch.randn(2, 9), pack_bf16(torch.randn(4, 9).bfloat16()), 4, torch.randn(3))
