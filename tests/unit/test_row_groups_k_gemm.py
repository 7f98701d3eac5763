"""The int8 GEMM (csrc/quant_gemm.cpp) on K-quant row groups (layout 2): its panels built from the groups
are the plain layout's, so its products are the plain layout's bit for bit, for GGUF Q4_K, Q5_K and Q6_K
(Q6_K's scales per 16 closing per half block), at odd row counts (a last group of fewer than 8 rows), K = 256
x odd and many activation rows (row slices too); and linear_q on the groups runs it from the plan's GEMM
row, its GEMV below. The scalar build has no GEMM: there linear_q keeps the groups' GEMV at every row count,
which each test checks instead (without_gemm), never skipping."""

import pytest
import torch

from perfxlm.quant import row_groups_k
from perfxlm.quant.reference import block_reference_linear
from tests.unit.test_row_groups_k import FORMATS, bits_of, gguf_weight, ops_or_skip

SHAPES = [(13, 768), (37, 1280), (64, 256), (45, 2304), (70, 256)]


def linear_q(ops, x, codes, params, n, bias, gemm_rows, block_max_rows=8):
    """linear_q on K row groups with a plan's row limits: GEMV up to 8 rows (4-bit and heads: block_max_rows),
    the int8 GEMM from gemm_rows (0: past the GEMV's limit, -1: never)."""
    return ops.linear_q(x, codes, params, None, None, bias, False, 8, False, True, block_max_rows, gemm_rows, 2, n)


def has_gemm(ops) -> bool:
    return int(ops.quant_block_gemm_max_code()) >= 63


def without_gemm(ops, x, codes, params, n, bias, fmt) -> bool:
    """On a build without the int8 GEMM (scalar): the op says so for K row groups as for the plain layout,
    and linear_q, told to use it from 2 rows, runs the groups' GEMV instead; True there (the test is done)."""
    if has_gemm(ops):
        return False
    with pytest.raises(RuntimeError, match="no int8 GEMM"):
        ops.quant_block_gemm(x, codes, params, None, None, bias, 2, n)
    gemv = ops.linear_q_rows8_k(x, codes, params, bits_of(fmt), n, bias)
    assert torch.equal(linear_q(ops, x, codes, params, n, bias, 2), gemv)
    return True


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [9, 16, 37, 64])
def test_the_gemm_on_row_groups_gives_the_plain_layouts_bits(fmt, n, k, rows):
    ops = ops_or_skip()
    w = gguf_weight(fmt, n, k, seed=7 * n + k)
    codes, params = row_groups_k.pack(w)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + n))
    x[1, 32:64] = 0  # an all-zero activation block (scale 0)
    bias = torch.randn(n) if rows % 2 else None
    if without_gemm(ops, x, codes, params, n, bias, fmt):
        return
    plain = ops.quant_block_gemm(x, w.codes, w.scales, w.mins, None, bias)  # two-level bytes as stored
    grouped = ops.quant_block_gemm(x, codes, params, None, None, bias, 2, n)
    assert grouped.shape == (rows, n)
    assert torch.equal(grouped, plain)
    ref = block_reference_linear(x, w, bias)
    torch.testing.assert_close(grouped, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("fmt", FORMATS)
def test_row_slices_and_a_row_alone_keep_the_bits(fmt):
    # 300 rows of 21 outputs: one column task, so the GEMM slices rows (each slice repacks the groups)
    ops = ops_or_skip()
    n, k = 21, 768
    w = gguf_weight(fmt, n, k, seed=3)
    codes, params = row_groups_k.pack(w)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(5))
    if without_gemm(ops, x, codes, params, n, None, fmt):
        return
    grouped = ops.quant_block_gemm(x, codes, params, None, None, None, 2, n)
    assert torch.equal(grouped, ops.quant_block_gemm(x, w.codes, w.scales, w.mins, None, None))
    for m in (0, 131, 299):  # a row's sums do not depend on the other rows
        assert torch.equal(ops.quant_block_gemm(x[m : m + 1], codes, params, None, None, None, 2, n)[0], grouped[m])


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_q_runs_the_gemm_from_the_plans_row_and_the_gemv_below(fmt):
    ops = ops_or_skip()
    n, k = 29, 512
    w = gguf_weight(fmt, n, k, seed=9)
    codes, params = row_groups_k.pack(w)
    bias = torch.randn(n)
    if without_gemm(ops, torch.randn(20, k), codes, params, n, bias, fmt):
        return
    for rows, gemm_rows in [(16, 16), (20, 16), (9, 0), (40, 0)]:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        got = linear_q(ops, x, codes, params, n, bias, gemm_rows)
        assert torch.equal(got, ops.quant_block_gemm(x, codes, params, None, None, bias, 2, n))
    for rows, gemm_rows, block_rows in [(15, 16, 64), (8, 0, 8), (40, -1, 8), (40, 0, 64)]:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        got = linear_q(ops, x, codes, params, n, bias, gemm_rows, block_rows)
        assert torch.equal(got, ops.linear_q_rows8_k(x, codes, params, bits_of(fmt), n, bias))


def test_a_plan_without_the_int8_gemm_keeps_the_gemv():
    """gemm_rows -1 (a float32 quantized GEMM in the plan): K row groups take their GEMV at every row count."""
    ops = ops_or_skip()
    n, k = 19, 512
    w = gguf_weight("q6_k", n, k, seed=1)
    codes, params = row_groups_k.pack(w)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(2))
    gemv = ops.linear_q_rows8_k(x, codes, params, 6, n, None)
    assert torch.equal(linear_q(ops, x, codes, params, n, None, -1), gemv)
    without_gemm(ops, x, codes, params, n, None, "q6_k")


def test_the_gemm_refuses_groups_that_do_not_fit():
    ops = ops_or_skip()
    w = gguf_weight("q4_k", 16, 256)
    codes, params = row_groups_k.pack(w)
    x = torch.randn(20, 256)
    if without_gemm(ops, x, codes, params, 16, None, "q4_k"):
        return
    with pytest.raises(RuntimeError, match="row-group codes"):
        ops.quant_block_gemm(x, codes, params, None, None, None, 2, 17)  # 17 rows need 3 groups
    with pytest.raises(RuntimeError, match="params"):
        ops.quant_block_gemm(x, codes, params[..., :144].contiguous(), None, None, None, 2, 16)
