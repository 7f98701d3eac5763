"""Affine row groups (CodeLayout.ROWS8_M: GGUF Q4_1 in row groups, perfxlm/quant/row_groups.py,
csrc/row_groups_m.h): the layout's bytes against the plain layout's, its GEMV against the plain-torch
reference and the plain layout's block GEMV (to float32 rounding), a row alone against the batch, the int8
GEMM reading the groups as its panels (bit for bit the plain weight's), the module path past the GEMV (the
plain layout's own bits), LoRA's column ranges, and the plan's switch giving Q4_1 this layout. At odd row
counts (a last group of fewer than 8 rows) and block counts, on whichever ISA build runs
(test_portable_kernels runs the lower tiers)."""

import gguf
import numpy as np
import pytest
import torch

from perfxlm.ops import cpu_plan, native
from perfxlm.ops.linear import run_linear_q
from perfxlm.quant import reference, row_groups
from perfxlm.quant.gguf_repack import repack
from perfxlm.quant.layout_choice import choose_layouts
from perfxlm.quant.layouts import CodeLayout, for_plan, members
from perfxlm.quant.reference import fake_quantize_blocks
from perfxlm.quant.weight import ActivationMode

Q = gguf.GGMLQuantizationType


def q4_1(n: int, k: int, seed: int = 0):
    """Random GGUF Q4_1 blocks (finite float16 scales, mins about -8 scales as Q4_1 files have them)."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[Q.Q4_1]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
    d = rng.uniform(0.5, 1.5, raw.shape[0]) * 1e-2
    raw[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw[:, 2:4] = (-d * rng.uniform(5, 10, raw.shape[0])).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return repack(raw, Q.Q4_1, (n, k))


def grouped(n, k, seed=0):
    """A plain Q4_1 weight with int8 activation blocks, and the same weight in affine row groups."""
    w = q4_1(n, k, seed)
    w.use_activations(ActivationMode.INT8_NATIVE)
    return w, w.in_row_groups()


def ops_or_skip():
    ops = native.kernels()
    if ops is None or not hasattr(ops, "linear_q_rows8_m"):
        pytest.skip("no native affine row-group kernel in this build")
    return ops


def close(got, ref):
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("n,k", [(1, 32), (13, 96), (16, 64), (37, 160)])
def test_the_layout_moves_bytes_and_plain_gives_them_back(n, k):
    w, r = grouped(n, k, seed=n)
    assert row_groups.takes_affine(w) and not row_groups.takes(w)
    assert r.layout is CodeLayout.ROWS8_M and r.shape == w.shape and "rows8_m" in r.describe()
    groups, blocks = -(-n // 8), k // 32
    assert r.codes.shape == (groups, blocks, 128) and r.scales.shape == r.mins.shape == (groups, blocks, 8)
    # the codes and scales are the Q4_0 groups' bytes; row r's min of block b sits beside its scale
    codes, scales = row_groups.pack(w.codes, w.scales, 4)
    assert torch.equal(r.codes, codes) and torch.equal(r.scales, scales)
    for row in {0, n - 1, n // 2}:
        for b in {0, blocks - 1}:
            assert r.mins[row // 8, b, row % 8] == w.mins[row, b]
    if n % 8:
        assert not r.mins[-1, :, n % 8:].any()
    back = r.plain()
    assert back.layout is CodeLayout.PLAIN
    assert torch.equal(back.codes, w.codes) and torch.equal(back.scales, w.scales) and torch.equal(back.mins, w.mins)
    assert torch.equal(r.dequantize(), w.dequantize()) and r.in_row_groups() is r
    ids = torch.tensor([[n - 1, 0, n // 2], [0, 0, n - 1]])  # a tied table's lookups gather from the groups
    assert torch.equal(r.embedding(ids), w.embedding(ids))
    if n > 8:
        assert torch.equal(r.narrow_rows(8, n - 8).dequantize(), w.narrow_rows(8, n - 8).dequantize())
    parts = r.native_parts()
    assert parts[2] is r.mins and parts[6].item() == CodeLayout.ROWS8_M.value.native == 3 and parts[7].item() == n


def test_each_row_group_layout_takes_its_own_codes():
    w, r = grouped(16, 64)
    with pytest.raises(ValueError, match="does not take"):  # centred groups hold no mins
        w.in_layout(CodeLayout.ROWS8)
    q40 = repack(np.zeros((16 * 64 // 32, 18), dtype=np.uint8), Q.Q4_0, (16, 64))
    q40.use_activations(ActivationMode.INT8_NATIVE)
    with pytest.raises(ValueError, match="does not take"):
        q40.in_layout(CodeLayout.ROWS8_M)
    assert q40.in_row_groups().layout is CodeLayout.ROWS8
    with pytest.raises(ValueError, match="int8"):  # float activations keep the plain layout
        q4_1(16, 64).in_layout(CodeLayout.ROWS8_M)
    with pytest.raises(ValueError, match="rows8_m"):  # a weight in the layout needs its mins
        r._like(r.codes, r.scales, None)
    assert members(for_plan(8)) == (CodeLayout.ROWS8, CodeLayout.ROWS8_M)
    assert members(for_plan(0)) == (CodeLayout.PLAIN,)


def test_the_plan_switch_gives_q4_1_its_groups():
    w, _ = grouped(24, 96)
    q40 = repack(np.zeros((16 * 64 // 32, 18), dtype=np.uint8), Q.Q4_0, (16, 64))
    q40.use_activations(ActivationMode.INT8_NATIVE)
    model = torch.nn.Module()
    model.a, model.b = torch.nn.Module(), torch.nn.Module()
    model.a.weight, model.b.weight = w, q40
    assert choose_layouts(model, for_plan(8)) == 2
    assert model.a.weight.layout is CodeLayout.ROWS8_M and model.b.weight.layout is CodeLayout.ROWS8


@pytest.mark.parametrize("n,k", [(1, 32), (13, 96), (37, 160), (64, 576), (45, 1536)])
@pytest.mark.parametrize("rows", [1, 3])
def test_native_product_matches_the_reference_and_the_plain_block_gemv(n, k, rows):
    ops = ops_or_skip()
    w, r = grouped(n, k, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0  # an all-zero activation block (scale 0)
    bias = torch.randn(n) if rows == 3 else None
    y = ops.linear_q_rows8_m(x, r.codes, r.scales, r.mins, n, bias)
    assert y.shape == (rows, n)
    close(y, reference.block_reference_linear(x, w, bias))
    if k % 64 == 0 and ops.int8_block_dots():  # the plain layout's block GEMV on the same int8 blocks (where
        # the build has one: the scalar build multiplies the activations as given; K a multiple of 64)
        close(y, ops.linear_q(x, w.codes, w.scales, w.mins, None, bias, False, 8, False, True))


@pytest.mark.parametrize("rows,k", [(8, 320), (2, 352), (3, 96), (5, 320), (6, 352), (7, 160)])
def test_a_row_alone_gives_the_bits_it_has_in_a_batch(rows, k):
    # the GEMV runs rows in tiles that share each block's unpacked codes (row_groups_run.h): every tile
    # size and remainder, odd and even block counts
    ops = ops_or_skip()
    w, r = grouped(45, k, seed=3)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(9))
    batch = ops.linear_q(x, r.codes, r.scales, r.mins, None, None, False, 8, False, True, -1, -1, 3, 45)
    close(batch, reference.block_reference_linear(x, w, None))
    for m in range(rows):
        alone = ops.linear_q(x[m:m + 1], r.codes, r.scales, r.mins, None, None, False, 8, False, True, -1, -1, 3, 45)
        assert torch.equal(alone[0], batch[m])
        assert torch.equal(ops.linear_q_rows8_m(x[m:m + 1], r.codes, r.scales, r.mins, 45, None)[0], batch[m])


def test_the_op_refuses_what_is_not_affine_row_groups():
    ops = ops_or_skip()
    w, r = grouped(16, 64)
    with pytest.raises(RuntimeError, match="row"):
        ops.linear_q_rows8_m(torch.randn(1, 64), w.codes, w.scales, w.mins, 16, None)
    with pytest.raises(RuntimeError, match="mins"):  # layout 3 without its mins
        ops.linear_q(torch.randn(1, 64), r.codes, r.scales, None, None, None, False, 8, False, True, -1, -1, 3, 16)


@pytest.mark.parametrize("n,k", [(13, 96), (40, 576), (45, 160)])
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_module_path_products_on_affine_row_groups(n, k, rows):
    ops = ops_or_skip()
    w, r = grouped(n, k, seed=n * rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + n))
    bias = torch.randn(n)
    previous = cpu_plan.use(quant_max_rows=8, quant_block_max_rows=-1, quant_gemm="float32")
    try:
        got = run_linear_q(ops, x, r, bias, False, True, False)
        close(got, reference.block_reference_linear(x, w, bias))
        if rows > 8:  # past the GEMV: the plain layout's own product of the rounded rows, bit for bit
            plain = ops.linear_q(fake_quantize_blocks(x), w.codes, w.scales, w.mins, None, bias, False, 8, False)
            assert torch.equal(got, plain)
    finally:
        cpu_plan.use(previous)


@pytest.mark.parametrize("n,k,rows", [(13, 96, 3), (37, 160, 40), (64, 576, 17), (100, 1536, 65)])
def test_the_int8_gemm_reads_affine_row_groups_as_its_panels(n, k, rows):
    ops = ops_or_skip()
    w, r = grouped(n, k, seed=k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n) if rows % 2 else None
    if int(ops.quant_block_gemm_max_code()) < 15:  # a build without the GEMM (scalar)
        with pytest.raises(RuntimeError, match="no int8 GEMM"):
            ops.quant_block_gemm(x, r.codes, r.scales, r.mins, None, bias, 3, n)
        previous = cpu_plan.use(quant_gemm="int8", quant_gemm_rows=2)
        try:
            got = run_linear_q(ops, x, r, bias, False, True, False)
        finally:
            cpu_plan.use(previous)
        close(got, reference.block_reference_linear(x, w, bias))
        return
    plain = ops.quant_block_gemm(x, w.codes, w.scales, w.mins, None, bias)
    # the same panels (mins included), so the same bits
    assert torch.equal(ops.quant_block_gemm(x, r.codes, r.scales, r.mins, None, bias, 3, n), plain)
    with pytest.raises(RuntimeError, match="row groups"):  # layout 1 holds no mins
        ops.quant_block_gemm(x, r.codes, r.scales, r.mins, None, bias, 1, n)
    previous = cpu_plan.use(quant_gemm="int8", quant_gemm_rows=2)
    try:  # and linear_q hands it many rows
        assert torch.equal(run_linear_q(ops, x, r, bias, False, True, False), plain)
    finally:
        cpu_plan.use(previous)


def test_the_fused_projection_and_its_lora_ranges_take_affine_row_groups():
    ops = ops_or_skip()
    if not hasattr(ops, "lora_project"):
        pytest.skip("no fused projection op in this build")
    w, r = grouped(77, 192, seed=4)
    x = torch.randn(2, 192, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(77)
    want = ops.linear_q(x, r.codes, r.scales, r.mins, None, bias, False, 8, False, True, -1, -1, 3, 77)
    close(want, reference.block_reference_linear(x, w, bias))
    got = ops.lora_project(x, r.native_parts(), 77, bias, 8, False, True, 8, -1, -1, [], 0)
    assert torch.equal(got, want)
