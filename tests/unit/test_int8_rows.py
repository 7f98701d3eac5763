"""The native passes around W8A8's integer GEMM (csrc/int8_rows.cpp) against their torch definition
(`int8_gemm_reference`, `quantize_rows`): equal to the bit on odd sizes, all-zero rows, ties at .5 and
huge values, with and without bias and residual. Built for AVX2 and scalar too by test_portable_kernels."""

import pytest
import torch

from perfxlm.ops import native
from perfxlm.ops.int8_gemm import _has_int_mm, int8_gemm_gelu, int8_gemm_linear, int8_gemm_reference, quantize_rows

pytestmark = pytest.mark.skipif(native.kernels() is None or not _has_int_mm(),
                                reason="no native kernels or no integer GEMM here")


def _rows(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    if m > 1:
        x[1] = 0.0  # scale 0: codes 0, scale kept 0
    if m > 2 and k > 2:
        x[2] = torch.arange(k, dtype=torch.float32) - k / 2  # values landing on .5 ties after the division
        x[2, 0] = 127.0 * 3  # max |x| = 381: x / 3 ties at k.5 where x is odd
    if m > 3:
        x[3] *= 1e30  # huge values round as small ones
    return x


@pytest.mark.parametrize("m,k", [(1, 1), (3, 5), (7, 17), (37, 97), (129, 384), (64, 1000)])
def test_quantize_rows_equal_the_definition(m, k):
    ops = native.kernels()
    x = _rows(m, k, m * 1000 + k)
    want_q, want_s = quantize_rows(x)
    got_q, got_s = ops.int8_quantize_rows(x)
    assert got_q.dtype == torch.int8 and got_s.dtype == torch.float32
    assert torch.equal(got_s, want_s)
    assert torch.equal(got_q, want_q)
    assert int(got_q.abs().max()) <= 127


@pytest.mark.parametrize("m,k,n", [(1, 3, 1), (5, 17, 3), (37, 97, 53), (300, 64, 129)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_the_epilogue_equals_the_definition(m, k, n, bias, residual):
    g = torch.Generator().manual_seed(m + k + n)
    x = _rows(m, k, n)
    qw = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, generator=g) / 100
    b = torch.randn(n, generator=g) if bias else None
    r = torch.randn(m, n, generator=g) if residual else None
    got = int8_gemm_linear(x, qw, scales, b, r)
    want = int8_gemm_reference(x, qw, scales, b, r)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert torch.equal(got, want)


def test_leading_dims_strided_input_and_bf16_keep_their_shape_and_dtype():
    g = torch.Generator().manual_seed(5)
    qw = torch.randint(-127, 128, (11, 24), dtype=torch.int8, generator=g)
    scales = torch.rand(11, generator=g)
    x = torch.randn(3, 48, 7, generator=g).transpose(1, 2)[..., :24]  # [3, 7, 24], not contiguous
    got = int8_gemm_linear(x, qw, scales, None)
    assert got.shape == (3, 7, 11)
    assert torch.equal(got, int8_gemm_reference(x.contiguous(), qw, scales, None))
    xb = x.bfloat16()
    assert int8_gemm_linear(xb, qw, scales, None).dtype == torch.bfloat16


def _exact_gelu_error(got: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """How far `got` is past GELU's bound: erf's approximation (Abramowitz-Stegun 7.1.26, absolute error
    under 1.5e-7) scaled by x / 2, plus float32 rounding, against GELU in float64. <= 0 where within."""
    exact = torch.nn.functional.gelu(pre.double())
    return (got.double() - exact).abs() - (1e-7 + 1.2e-7 * pre.double().abs())


@pytest.mark.parametrize("m,k,n", [(1, 3, 1), (5, 17, 3), (37, 97, 53), (70, 64, 129)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_gelu_epilogue_is_gelu_of_the_definition(m, k, n, bias):
    """GELU in the epilogue's pass: the definition's pre-activation, then GELU within erf's approximation
    error of the exact value (torch's F.gelu is not bit-equal either: it is further from exact here)."""
    g = torch.Generator().manual_seed(m * k + n)
    x = _rows(m, k, n + 1)
    qw = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, generator=g) / k / 2
    b = torch.randn(n, generator=g) * 2 if bias else None
    pre = int8_gemm_reference(x, qw, scales, b)
    got = int8_gemm_gelu(x, qw, scales, b)
    assert got.shape == (m, n) and got.dtype == torch.float32 and torch.isfinite(got).all()
    assert float(_exact_gelu_error(got, pre).max()) <= 0


def test_gelu_epilogue_over_the_whole_range():
    """Every value from -12 to 12 in steps of 1/64 (sums -768..768 over a row scale of 1/64, exact in float32),
    rows 37 wide so each row ends in a partial vector."""
    ops = native.kernels()
    rows = 1537 // 37 + 1
    acc = (torch.arange(rows * 37, dtype=torch.int32) - 768).view(rows, 37)
    pre = acc.float() / 64
    ops.int8_gemm_epilogue_gelu(acc, torch.ones(37), torch.full((rows,), 1 / 64), None)
    assert float(_exact_gelu_error(acc.view(torch.float32), pre).max()) <= 0


def test_bad_tensors_are_refused_with_what_to_pass():
    ops = native.kernels()
    with pytest.raises(RuntimeError, match="contiguous 2-D"):
        ops.int8_quantize_rows(torch.randn(4, 6).t())
    acc = torch.zeros(4, 6, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="col_scales"):
        ops.int8_gemm_epilogue(acc, torch.ones(5), torch.ones(4), None, None)
    with pytest.raises(RuntimeError, match="residual"):
        ops.int8_gemm_epilogue(acc, torch.ones(6), torch.ones(4), None, torch.zeros(4, 5))
    with pytest.raises(RuntimeError, match="bias"):
        ops.int8_gemm_epilogue_gelu(acc, torch.ones(6), torch.ones(4), torch.ones(5))
