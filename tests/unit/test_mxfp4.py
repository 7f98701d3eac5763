"""MXFP4 as a `QuantizedWeight`: GGUF blocks and the checkpoint's blocks / scales repacked by moving bits,
dequantized equal to gguf-py's reference bit for bit (odd row counts, stacks, every exponent from the
subnormal 2^-128 up); products through the native kernel (the tier this process was built for: the
per-tier runs of tests/unit/test_portable_kernels.py cover the others) against the plain-torch definition."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch

from perfxlm.ops import native
from perfxlm.ops.gguf_dequant import dequantize
from perfxlm.ops.linear import linear
from perfxlm.quant import mxfp4
from perfxlm.quant.gguf_repack import repack
from perfxlm.quant.reference import reference_linear

Q = gguf.GGMLQuantizationType


def _weights(shape, seed):
    g = np.random.default_rng(seed)
    w = g.standard_normal(shape).astype(np.float32)
    # block magnitudes spread over many binades, a zero block, and the extremes of the exponent byte
    w *= np.exp2(g.integers(-20, 20, size=(*shape[:-1], 1))).astype(np.float32)
    w.reshape(-1, shape[-1])[0, :32] = 0
    return w


def test_e8m0_half_is_exact_for_every_exponent():
    e = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = gguf.quants.MXFP4.e8m0_to_fp32_half(e.numpy().astype(np.uint32))
    assert np.array_equal(mxfp4.e8m0_half(e).numpy(), want)
    assert mxfp4.e8m0_half(torch.tensor([0, 127, 254], dtype=torch.uint8)).tolist() == [2.0**-128, 0.5, 2.0**126]


@pytest.mark.parametrize("shape", [(7, 96), (1, 32), (3, 5, 64), (13, 160)])
def test_gguf_blocks_dequantize_and_repack_exactly(shape):
    w = _weights(shape, seed=sum(shape))
    blocks = gguf.quants.quantize(w, Q.MXFP4)
    want = torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, Q.MXFP4), dtype=np.float32))
    assert torch.equal(dequantize(blocks, Q.MXFP4, shape), want)
    packed = repack(blocks, Q.MXFP4, shape)
    assert packed.bits == 4 and packed.group == 32 and packed.mins is None and packed.exponent_scales
    # the file's 4.25 bits per weight: the exponent byte kept
    assert packed.codes.nbytes + packed.scales.nbytes == math.prod(shape) * 17 // 32
    assert tuple(packed.shape) == shape and torch.equal(packed.dequantize(), want)
    assert packed.describe().startswith("mxfp4")
    if len(shape) == 3:  # a stack: each expert is the matrix alone
        alone = repack(gguf.quants.quantize(w[1], Q.MXFP4), Q.MXFP4, shape[1:])
        assert torch.equal(packed[1].codes, alone.codes) and torch.equal(_bytes(packed[1].scales), _bytes(alone.scales))


def _bytes(scales: torch.Tensor) -> torch.Tensor:
    return scales.view(torch.uint8)  # (torch compares no float8_e8m0fnu tensors)


def test_exponent_bytes_hold_the_scales_and_a_zero_exponent_keeps_float32():
    """A block's scale 2^(e - 128) is the e8m0 byte e - 1 (2^(b - 127)), exactly, for every e ggml writes
    (255 included, which ggml reads as 2^127); exponent 0 (2^-128) has no such byte: an all-zero block
    (+0 / -0 codes) takes byte 0, any other keeps the tensor's scales float32."""
    e = torch.arange(1, 256, dtype=torch.uint8)
    held = mxfp4.scale_bytes(e, torch.full((255 * 16,), 0x35, dtype=torch.uint8))
    assert held.dtype == torch.float8_e8m0fnu and torch.equal(held.float(), mxfp4.e8m0_half(e))
    e = torch.tensor([0, 7, 130], dtype=torch.uint8)
    codes = torch.full((3, 16), 0x21, dtype=torch.uint8)
    codes[0] = torch.tensor([0x00, 0x08, 0x80, 0x88] * 4, dtype=torch.uint8)  # +0 and -0 only
    zero_block = mxfp4.scale_bytes(e, codes.reshape(-1))
    assert zero_block.dtype == torch.float8_e8m0fnu and zero_block.view(torch.uint8).tolist() == [0, 6, 129]
    codes[0, 5] = 0x01  # a value of 2^-128 x 1
    tiny = mxfp4.scale_bytes(e, codes.reshape(-1))
    assert tiny.dtype == torch.float32 and tiny[0].item() == 2.0**-128
    flat = repack(gguf.quants.quantize(_weights((3, 64), seed=5), Q.MXFP4), Q.MXFP4, (3, 64)).flat()
    assert flat.scales.dtype == torch.float32 and not flat.exponent_scales


@pytest.mark.parametrize("rows", [1, 3, 13, 40])
@pytest.mark.parametrize("int8_blocks", [False, True])
def test_native_products_read_the_exponent_bytes_as_the_float_scales(rows, int8_blocks):
    """The kernels multiply the exponent bytes out per run of rows: the same bits as the float32 scales
    of the same weight on every path (GEMV, the float GEMM on dequantized slabs, the int8 GEMM)."""
    ops = native.kernels()
    if ops is None:
        pytest.skip("native kernels unavailable on this machine")
    n, k = 67, 192
    packed = repack(gguf.quants.quantize(_weights((n, k), seed=rows), Q.MXFP4), Q.MXFP4, (n, k))
    flat = packed.flat()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    b = torch.randn(n)
    for gemm_rows in (-1, 0):
        held = ops.linear_q(x, packed.codes, packed.scales, None, packed.levels, b, False, 8, False, int8_blocks, -1, gemm_rows)
        widened = ops.linear_q(x, flat.codes, flat.scales, None, flat.levels, b, False, 8, False, int8_blocks, -1, gemm_rows)
        assert torch.equal(held, widened), gemm_rows
    assert torch.equal(ops.dequantize_q(packed.codes, packed.scales, None, packed.levels, k), packed.dequantize())


@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 96)])
def test_checkpoint_blocks_and_scales_equal_the_gguf_form(shape):
    """The checkpoint's pairs-of-elements nibble order (the converter's input) reordered to Q4_0's: the
    same weight as ggml's quantizer gives from the same floats."""
    w = _weights(shape, seed=len(shape))
    blocks, scales = mxfp4.quantize_reference(torch.from_numpy(w))
    assert blocks.shape == (*shape[:-1], shape[-1] // 32, 16) and scales.shape == (*shape[:-1], shape[-1] // 32)
    got = mxfp4.from_checkpoint(blocks, scales, "experts.down_proj")
    want = repack(gguf.quants.quantize(w, Q.MXFP4), Q.MXFP4, shape)
    assert torch.equal(got.codes, want.codes) and torch.equal(_bytes(got.scales), _bytes(want.scales))


def test_checkpoint_shapes_that_do_not_fit_are_named():
    blocks = torch.zeros(4, 2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="experts.gate_up_proj: MXFP4 blocks .* do not fit"):
        mxfp4.from_checkpoint(blocks, torch.zeros(4, 3, dtype=torch.uint8), "experts.gate_up_proj")
    with pytest.raises(ValueError, match="must be uint8"):
        mxfp4.from_checkpoint(blocks.float(), torch.zeros(4, 2, dtype=torch.uint8), "w")
    with pytest.raises(ValueError, match="not a multiple of MXFP4's block of 32"):
        mxfp4.from_gguf(torch.zeros(17, dtype=torch.uint8), (1, 31))


@pytest.mark.parametrize("rows", [1, 3, 8, 37])
@pytest.mark.parametrize("n,k", [(13, 96), (33, 64), (7, 288)])
@pytest.mark.parametrize("bias", [False, True])
def test_native_product_matches_the_definition(n, k, rows, bias):
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    w = _weights((n, k), seed=n + k + rows)
    w /= np.abs(w).max(axis=-1, keepdims=True)  # rows of comparable size: one tolerance for all outputs
    packed = repack(gguf.quants.quantize(w, Q.MXFP4), Q.MXFP4, (n, k))
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    torch.testing.assert_close(linear(x, packed, b), reference_linear(x, packed, b), atol=2e-5, rtol=2e-5)


def _int8_case(n, k, seed):
    w = _weights((n, k), seed=seed)
    w /= np.abs(w).max(axis=-1, keepdims=True)
    packed = repack(gguf.quants.quantize(w, Q.MXFP4), Q.MXFP4, (n, k))
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # an all-zero activation block
    return packed, x


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n,k", [(13, 64), (33, 192), (6, 576)])
def test_int8_block_products_take_the_table_as_int8(n, k, rows):
    """With int8_blocks the kernel looks each E2M1 code up as an int8 (the doubled value plus 12) and
    multiplies it with the int8 activation blocks exactly, the 12 x scale given back with the mins: the
    float product of the fake-quantized activations with the weight, as llama.cpp's MXFP4 dot computes."""
    from perfxlm.ops.linear import integer_levels
    from perfxlm.quant.reference import fake_quantize_blocks

    ops = native.kernels()
    if ops is None:
        pytest.skip("native kernels unavailable on this machine")
    packed, x = _int8_case(n, k, seed=n * k + rows)
    x = x[:rows]
    assert integer_levels(packed)
    b = torch.randn(n)
    x_used = fake_quantize_blocks(x) if ops.int8_block_dots() else x
    want = torch.nn.functional.linear(x_used.double(), packed.dequantize().double(), b.double()).float()
    codes, scales, levels = packed.codes, packed.scales, packed.levels
    got = ops.linear_q(x, codes, scales, None, levels, b, False, 8, False, True)
    torch.testing.assert_close(got, want, atol=1e-4 * (want.abs().max().item() + 1), rtol=1e-4)
    # a row's result is the same bits alone (batch-1 kernel) as beside others, and past the GEMV's row
    # limit (dequantized slabs with the same activation blocks) within rounding
    alone = torch.cat([ops.linear_q(x[i : i + 1], codes, scales, None, levels, b, False, 8, False, True)
                       for i in range(rows)])  # fmt: skip
    assert torch.equal(alone, got)
    many = ops.linear_q(x, codes, scales, None, levels, b, False, 0, False, True)
    torch.testing.assert_close(many, want, atol=1e-4 * (want.abs().max().item() + 1), rtol=1e-4)


def test_tables_the_int8_products_cannot_take_stay_float():
    """NF4's levels are not integers; a table spanning more than 64 would overflow vpmaddubsw's pairs."""
    from perfxlm.ops.linear import integer_levels
    from perfxlm.quant.quantizers import quantize_nf4

    assert not integer_levels(quantize_nf4(torch.randn(4, 64), 64))
    packed, _ = _int8_case(4, 64, seed=1)
    packed.levels = packed.levels * 3  # -36 .. 36: a span of 72
    assert not integer_levels(packed)
