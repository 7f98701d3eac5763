"""The two arithmetics of int8 activation blocks (perfxlm.quant.act_blocks, csrc/act_blocks.h): the
native rounding gives the torch reference's bytes and scales bit for bit in each (zero, tiny and huge
blocks, values on a rounding boundary), ggml's scales are fp16 values, and the block products (GEMV,
row groups, int8 GEMM; a row alone and in a batch) keep matching their references under either. The
rest of the suite runs the default (ggml); this file runs the same checks under both."""

import pytest
import torch

from perfxlm.ops import cpu_plan
from perfxlm.ops.linear import run_linear_q
from perfxlm.quant import act_blocks
from perfxlm.quant.reference import fake_quantize_blocks
from tests.unit import test_quant_gemm as qg
from tests.unit import test_row_groups as rg
from tests.unit import test_row_groups_m as rgm


@pytest.fixture(params=act_blocks.MODES)
def mode(request):
    previous = act_blocks.set_mode(request.param)
    yield request.param
    act_blocks.set_mode(previous)


def awkward(rows: int, k: int, seed: int) -> torch.Tensor:
    """Random rows of blocks of very different sizes, and the blocks that part the two rules."""
    g = torch.Generator().manual_seed(seed)
    size = torch.exp(2 * torch.randn(rows, k // 32, 1, generator=g)).expand(rows, k // 32, 32).reshape(rows, k)
    x = torch.randn(rows, k, generator=g) * size
    x[0, :32] = 0
    if k >= 128:
        x[0, 32:64] *= 1e-7 / x[0, 32:64].abs().max()  # scale ~1e-9: under fp16's subnormals, ggml's block is 0
        x[0, 64:96] *= 1e-4 / x[0, 64:96].abs().max()  # a subnormal fp16 scale
        x[0, 96:128] *= 3e4  # a scale near fp16's largest
    x[-1, :32] = (torch.arange(32) - 15.5) * (127 / 16.5) / 127  # values at halves of either rule's steps
    return x


@pytest.mark.parametrize("rows,k", [(9, 128), (12, 160), (17, 576)])
def test_the_native_rounding_is_the_references_bit_for_bit(mode, rows, k):
    """Past the GEMV's rows the plain layout multiplies the kernels' rounded rows as floats: equal to
    the same product of the reference's rounded rows only where every byte and scale is equal."""
    ops = rg.ops_or_skip()
    w, r = rg.grouped(8, 24, k, seed=rows)
    x = awkward(rows, k, rows * k)
    previous = cpu_plan.use(quant_max_rows=8, quant_block_max_rows=-1, quant_gemm="float32")
    try:
        got = run_linear_q(ops, x, r, None, False, True, False)
        plain = ops.linear_q(fake_quantize_blocks(x), w.codes, w.scales, None, None, None, False, 8, False)
        assert torch.equal(got, plain)
    finally:
        cpu_plan.use(previous)


def test_ggml_scales_are_fp16_values_and_values_are_multiplied_by_the_reciprocal():
    previous = act_blocks.set_mode("ggml")
    try:
        x = awkward(3, 576, 7)
        got = fake_quantize_blocks(x).view(3, -1, 32)
        scale = got.abs().amax(-1) / 127  # the largest value rounds to +-127
        assert torch.equal(scale.half().float(), scale)
        assert not got[0, 1].any()  # the block whose fp16 scale is 0
        amax = x.view(3, -1, 32).abs().amax(-1, keepdim=True)
        live = scale.unsqueeze(-1) > 0
        q = torch.round(x.view(3, -1, 32) * (torch.full_like(amax, 127.0) / torch.where(live, amax, torch.ones_like(amax))))
        assert torch.equal(torch.where(live, q, torch.zeros_like(q)) * scale.unsqueeze(-1), got)
        assert act_blocks.set_mode("float") == "ggml"
        f = fake_quantize_blocks(x).view(3, -1, 32)
        assert not torch.equal(f, got)
        assert torch.equal(f.abs().amax(-1), x.view(3, -1, 32).abs().amax(-1) / 127 * 127)
    finally:
        act_blocks.set_mode(previous)


def test_a_bad_setting_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="PERFXLM_ACT_BLOCKS"):
        act_blocks.set_mode("fp16")
    saved = dict(act_blocks._state)
    act_blocks._state.clear()
    try:
        monkeypatch.setenv(act_blocks.ENV, "half")
        with pytest.raises(ValueError, match="PERFXLM_ACT_BLOCKS='half'"):
            act_blocks.mode()
    finally:
        act_blocks._state.clear()
        act_blocks._state.update(saved)


# The product checks of the row-group and GEMM files, run under each arithmetic.
@pytest.mark.parametrize("bits", [8, 4])
def test_row_groups_under_each_arithmetic(mode, bits):
    rg.test_native_product_matches_the_reference(bits, 37, 160, 3)
    rg.test_a_row_alone_gives_the_bits_it_has_in_a_batch(bits, 5, 224)
    rg.test_module_path_products_on_row_groups(bits, 40, 576, 16)
    rg.test_the_int8_gemm_reads_row_groups_as_its_panels(bits, 37, 160, 40)


def test_affine_row_groups_under_each_arithmetic(mode):
    rgm.test_native_product_matches_the_reference_and_the_plain_block_gemv(45, 160, 3)
    rgm.test_a_row_alone_gives_the_bits_it_has_in_a_batch(5, 224)
    rgm.test_module_path_products_on_affine_row_groups(40, 576, 16)
    rgm.test_the_int8_gemm_reads_affine_row_groups_as_its_panels(37, 160, 40)


@pytest.mark.parametrize("case", [qg.CASES[1], qg.CASES[2], qg.CASES[5], qg.CASES[7], qg.CASES[10]])
def test_the_int8_gemm_under_each_arithmetic(mode, case):
    qg.test_gemm_matches_the_definition(*case, 37)
    qg.test_a_row_alone_is_bit_identical_to_the_row_in_a_batch(*case)
