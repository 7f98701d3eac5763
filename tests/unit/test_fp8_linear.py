"""Products over FP8 e4m3 weight bytes (csrc/fp8_linear.cpp, DeepSeek-V3's block-FP8 weights) against the
plain-torch definition over the 256-level table: every byte value (subnormals, both zeros) decoded to the
table's value exactly, odd row counts and widths, groups of 16 to 128 columns, one row and many, a bias;
bad shapes refused by name; the linear layer takes the kernel for the weights it can run."""

from __future__ import annotations

import pytest
import torch

from perfxlm.ops import fp8_linear, native
from perfxlm.ops.linear import quantized_linear
from perfxlm.quant.formats.compressed_tensors import fp8_e4m3_levels
from perfxlm.quant.reference import reference_linear
from perfxlm.quant.weight import QuantizedWeight

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no compiler for the native kernels")

FINITE = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # e4m3fn's NaNs out


def _weight(n: int, k: int, group: int, seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    codes = FINITE[torch.randint(len(FINITE), (n, k), generator=g)]
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    return QuantizedWeight(codes, scales, None, fp8_e4m3_levels(), 8, group, "float", n, k)


def _kernel(x, w, bias=None):
    return native.kernels().linear_fp8(x, w.codes, w.scales, w.group, bias)


def test_every_byte_decodes_to_its_table_value():
    # a one-hot activation row picks one weight column: the product is that weight's value, exactly
    k = 256
    codes = torch.cat((FINITE, FINITE[:2])).view(1, -1)[:, :k].repeat(3, 1)  # every finite byte in a row
    scales = torch.tensor([[1.0], [0.37], [3.0e-4]]).expand(3, k // 128).contiguous()
    w = QuantizedWeight(codes, scales, None, fp8_e4m3_levels(), 8, 128, "float", 3, k)
    got = _kernel(torch.eye(k), w)  # [k, 3]: row j is column j of W
    want = fp8_e4m3_levels()[codes.long()] * scales.repeat_interleave(128, dim=1)
    assert torch.equal(got.t(), want)


@pytest.mark.parametrize("n,k,group", [(37, 48, 16), (5, 384, 128), (66, 208, 208), (3, 96, 32)])
@pytest.mark.parametrize("rows", [1, 3, 5, 17])
def test_matches_the_torch_definition(n, k, group, rows):
    w = _weight(n, k, group, seed=n + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n) if rows % 2 else None
    want = reference_linear(x, w, bias)
    # sums of up to 384 products of up to ~10: float32 summation order, relative to the outputs' size
    torch.testing.assert_close(_kernel(x, w, bias), want, atol=2e-6 * want.abs().max().item(), rtol=1e-5)


def test_a_row_alone_is_the_same_bits_as_in_a_batch():
    w = _weight(29, 160, 32, seed=3)
    x = torch.randn(9, 160)
    batch = _kernel(x, w)
    for i in range(9):
        assert torch.equal(_kernel(x[i : i + 1].contiguous(), w)[0], batch[i])


def test_the_linear_layer_takes_it_where_it_can(monkeypatch):
    calls = []
    real = fp8_linear.fp8_linear
    monkeypatch.setattr(fp8_linear, "fp8_linear", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(2, 3, 64)
    w = _weight(11, 64, 16)
    torch.testing.assert_close(quantized_linear(x, w, None), reference_linear(x, w), atol=1e-5, rtol=1e-5)
    assert calls == [1]
    narrow = _weight(11, 64, 8)  # groups of 8 columns (a partial-block checkpoint): the reference's
    torch.testing.assert_close(quantized_linear(x, narrow, None), reference_linear(x, narrow), atol=0, rtol=0)
    assert calls == [1]


@pytest.mark.parametrize("change,named", [
    (dict(group=8), "group must be a multiple of 16"),
    (dict(scales=torch.ones(4, 3)), r"scales must be contiguous float32 \[4, 2\]"),
    (dict(codes=torch.zeros(4, 48, dtype=torch.uint8)), "codes have 48 columns, x has 64"),
    (dict(x=torch.zeros(2, 64, dtype=torch.float64)), "x must be a contiguous float32"),
])  # fmt: skip
def test_bad_shapes_refused_by_name(change, named):
    args = {"x": torch.zeros(2, 64), "codes": torch.zeros(4, 64, dtype=torch.uint8), "scales": torch.ones(4, 2),
            "group": 32}
    args.update(change)
    with pytest.raises(RuntimeError, match=named):
        native.kernels().linear_fp8(args["x"], args["codes"], args["scales"], args["group"], None)


def test_many_rows_take_the_definition(monkeypatch):
    # past MAX_ROWS one dequantized matrix serves every row (the reference itself: the same bits)
    monkeypatch.setattr(fp8_linear, "MAX_ROWS", 4)
    w = _weight(7, 32, 16)
    x = torch.randn(5, 32)
    assert torch.equal(fp8_linear.fp8_linear(native.kernels(), x, w, None), reference_linear(x, w))
