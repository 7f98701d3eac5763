"""K-quant row groups as a code layout (CodeLayout.ROWS8_K, perfxlm/quant/layouts.py): the weight's round
trips and refusals, linear_q / its ranges told layout 2 against the plain weight (to float32 rounding
through the GEMV, which a plan without the int8 GEMM runs at every row count, a row alone giving the bits it
has in a batch; bit for bit through the int8 GEMM from the plan's GEMM row), and the plan's rule that gives
the layout to every K-quant matrix ("all") or the few-row weights (the LM head) only ("head"). On whichever
ISA build runs (test_portable_kernels runs the lower tiers)."""

import gguf
import numpy as np
import pytest
import torch

from perfxlm.ops import cpu_plan
from perfxlm.ops.linear import gemm_max_code, run_linear_q
from perfxlm.quant.gguf_repack import repack
from perfxlm.quant.layout_choice import choose_layouts
from perfxlm.quant.layouts import CodeLayout, all_for_plan, few_rows_for_plan
from perfxlm.quant.reference import block_reference_linear
from perfxlm.quant.weight import ActivationMode, QuantizedWeight
from tests.unit.test_row_groups_k import FORMATS, gguf_weight, ops_or_skip

Q = gguf.GGMLQuantizationType


def grouped(fmt, n, k, seed=0):
    """A plain K-quant weight with int8 activation blocks, and the same weight in K-quant row groups."""
    w = gguf_weight(fmt, n, k, seed)
    w.use_activations(ActivationMode.INT8_NATIVE)
    return w, w.in_layout(CodeLayout.ROWS8_K)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_layout_moves_bytes_and_plain_gives_them_back(fmt):
    w, r = grouped(fmt, 21, 512, seed=2)
    assert r.layout is CodeLayout.ROWS8_K and r.shape == w.shape and "rows8_k" in r.describe()
    assert r.mins is None and r.scales.dtype == torch.uint8 and r.scales.shape[:2] == (3, 2)
    back = r.plain()
    assert back.layout is CodeLayout.PLAIN and torch.equal(back.codes, w.codes) and torch.equal(back.scales, w.scales)
    assert (w.mins is None and back.mins is None) or torch.equal(back.mins, w.mins)  # Q4_K / Q5_K mins included
    assert torch.equal(r.dequantize(), w.dequantize())
    assert r.in_layout(CodeLayout.ROWS8_K) is r
    # lookups unpack only the groups their rows are in (a tied table)
    ids = torch.tensor([[20, 0, 7], [8, 8, 15]])
    assert torch.equal(r.embedding(ids), w.embedding(ids))
    assert torch.equal(r.narrow_rows(8, 13).dequantize(), w.narrow_rows(8, 13).dequantize())
    parts = r.native_parts()
    assert parts[6].item() == CodeLayout.ROWS8_K.value.native == 2 and parts[7].item() == 21


def test_the_layout_refuses_other_weights_and_forms():
    raw = np.zeros((16 * 256 // 32, 34), dtype=np.uint8)
    q8 = repack(raw, Q.Q8_0, (16, 256))
    q8.use_activations(ActivationMode.INT8_NATIVE)
    with pytest.raises(ValueError, match="does not take"):
        q8.in_layout(CodeLayout.ROWS8_K)
    k4, r = grouped("q4_k", 16, 256)
    with pytest.raises(ValueError, match="does not take"):  # the Q8_0 / Q4_0 groups do not take K-quants
        k4.in_layout(CodeLayout.ROWS8)
    with pytest.raises(ValueError, match="int8"):  # float activations keep the plain layout
        gguf_weight("q6_k", 16, 256).in_layout(CodeLayout.ROWS8_K)
    with pytest.raises(ValueError, match="rows8_k"):  # float16 scales are not its params bytes
        QuantizedWeight(r.codes, r.scales.view(torch.float16), None, None, 4, 32, "float", 16, 256,
                        activations=ActivationMode.INT8_NATIVE, layout=CodeLayout.ROWS8_K)
    with pytest.raises(ValueError, match="rows8_k"):  # the params of another format
        QuantizedWeight(r.codes, r.scales, None, None, 6, 16, "float", 16, 256,
                        activations=ActivationMode.INT8_NATIVE, layout=CodeLayout.ROWS8_K)
    for call in (lambda: r.narrow_columns(0, 256), lambda: r.zero_rows(3), lambda: r.unpacked_codes(),
                 lambda: r.narrow_rows(3, 8), lambda: r.use_activations(ActivationMode.FLOAT)):
        with pytest.raises(ValueError, match="plain|whole groups"):
            call()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(13, 256), (45, 768)])
@pytest.mark.parametrize("rows", [1, 3, 9, 40])
def test_linear_q_takes_the_layout_at_every_row_count(fmt, n, k, rows):
    ops = ops_or_skip()
    w, r = grouped(fmt, n, k, seed=n + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k))
    bias = torch.randn(n) if rows % 2 else None
    previous = cpu_plan.use(quant_max_rows=8, quant_block_max_rows=-1, quant_gemm="float32")
    try:  # past the GEMV's limit too, where the plan has no int8 GEMM: the same kernel
        got = run_linear_q(ops, x, r, bias, False, True, False)
    finally:
        cpu_plan.use(previous)
    ref = block_reference_linear(x, w, bias)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    if ops.int8_block_dots():  # the plain weight's int8-block GEMV: other float orders only
        plain = ops.linear_q(x, w.codes, w.scales, w.mins, None, bias, False, 1 << 30, False, True, 1 << 30)
        torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    for m in {0, rows - 1}:  # a row alone: the bits it has in the batch
        alone = ops.linear_q(x[m : m + 1], r.codes, r.scales, None, None, bias, False, 8, False, True, -1, -1, 2, n)
        assert torch.equal(alone[0], got[m])


@pytest.mark.parametrize("fmt", FORMATS)
def test_many_rows_under_an_int8_plan_give_the_plain_layouts_bits(fmt):
    # the module path (run_linear_q) from the plan's GEMM row: the int8 GEMM on the groups and on the plain
    # rows, the same panels; below it the groups' GEMV; a build without the GEMM (scalar) keeps the GEMV
    ops = ops_or_skip()
    w, r = grouped(fmt, 45, 768, seed=6)
    bias = torch.randn(45)
    previous = cpu_plan.use(quant_max_rows=8, quant_block_max_rows=8, quant_gemm="int8", quant_gemm_rows=16)
    try:
        for rows in (15, 16, 40):
            x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
            got = run_linear_q(ops, x, r, bias, False, True, False)
            if rows >= 16 and gemm_max_code() >= 63:
                assert torch.equal(got, run_linear_q(ops, x, w, bias, False, True, False))
            else:
                assert torch.equal(got, ops.linear_q_rows8_k(x, r.codes, r.scales, w.bits, 45, bias))
    finally:
        cpu_plan.use(previous)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_fused_projection_and_its_lora_ranges_take_the_layout(fmt):
    ops = ops_or_skip()
    if not hasattr(ops, "lora_project"):
        pytest.skip("no fused projection op in this build")
    w, r = grouped(fmt, 77, 512, seed=4)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(77)
    want = ops.linear_q(x, r.codes, r.scales, None, None, bias, False, 8, False, True, -1, -1, 2, 77)
    ref = block_reference_linear(x, w, bias)
    torch.testing.assert_close(want, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    got = ops.lora_project(x, r.native_parts(), 77, bias, 8, False, True, 8, -1, -1, [], 0)
    assert torch.equal(got, want)


def test_linear_q_refuses_mins_with_the_layout():
    ops = ops_or_skip()
    w, r = grouped("q4_k", 16, 256)
    with pytest.raises(RuntimeError, match="K-quant row groups"):
        ops.linear_q(torch.randn(1, 256), r.codes, r.scales, w.mins, None, None, False, 8, False, True, -1, -1, 2, 16)


class _Head(torch.nn.Module):
    few_rows = True

    def __init__(self, weight):
        super().__init__()
        self.weight = weight


class _Layer(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight


def test_the_plan_gives_k_row_groups_to_every_k_matrix_or_the_few_row_weights_only():
    head, proj = grouped("q6_k", 24, 256)[0], grouped("q4_k", 16, 256, seed=1)[0]
    raw = np.zeros((16 * 256 // 32, 34), dtype=np.uint8)
    q8 = repack(raw, Q.Q8_0, (16, 256))
    q8.use_activations(ActivationMode.INT8_NATIVE)
    model = torch.nn.ModuleList([_Layer(head), _Layer(proj), _Layer(q8), _Head(head)])  # the first: a tied table
    assert choose_layouts(model, CodeLayout.ROWS8, few_rows_for_plan("head")) == 2
    assert model[3].weight.layout is CodeLayout.ROWS8_K and model[0].weight is model[3].weight
    assert model[1].weight.layout is CodeLayout.PLAIN  # a projection takes many rows: no K-quant GEMM yet
    assert model[2].weight.layout is CodeLayout.ROWS8
    model = torch.nn.ModuleList([_Layer(proj), _Head(head)])
    assert choose_layouts(model, CodeLayout.ROWS8, few_rows_for_plan("off")) == 0
    assert model[1].weight.layout is CodeLayout.PLAIN
    # "all": every K-quant matrix, beside the Q8_0 / Q4_0 groups (each layout takes its own formats)
    model = torch.nn.ModuleList([_Layer(head), _Layer(proj), _Layer(q8), _Head(head)])
    assert all_for_plan(8, "all") == (CodeLayout.ROWS8, CodeLayout.ROWS8_K)
    assert choose_layouts(model, all_for_plan(8, "all"), few_rows_for_plan("all")) == 3
    assert [m.weight.layout for m in model] == [CodeLayout.ROWS8_K, CodeLayout.ROWS8_K, CodeLayout.ROWS8,
                                                CodeLayout.ROWS8_K]
    assert model[0].weight is model[3].weight
    model = torch.nn.ModuleList([_Layer(proj), _Layer(q8)])
    assert choose_layouts(model, all_for_plan(0, "all"), few_rows_for_plan("all")) == 1  # K groups alone
    assert [m.weight.layout for m in model] == [CodeLayout.ROWS8_K, CodeLayout.PLAIN]
    assert all_for_plan(8, "head") == (CodeLayout.ROWS8,) and all_for_plan(0, "off") == (CodeLayout.PLAIN,)


def test_the_plan_rule_is_forcible(monkeypatch):
    try:
        for groups, k, want in (("8", None, "all"), ("0", None, "off"), ("8", "off", "off"), ("0", "head", "head"),
                                ("8", "head", "head"), ("0", "all", "all")):
            monkeypatch.setenv("PERFXLM_ROW_INTERLEAVE", groups)
            if k is None:
                monkeypatch.delenv("PERFXLM_ROW_GROUPS_K", raising=False)
            else:
                monkeypatch.setenv("PERFXLM_ROW_GROUPS_K", k)
            cpu_plan.reset()
            assert cpu_plan.plan().row_groups_k == want
            assert few_rows_for_plan(want) is (CodeLayout.PLAIN if want == "off" else CodeLayout.ROWS8_K)
    finally:
        monkeypatch.delenv("PERFXLM_ROW_INTERLEAVE", raising=False)
        monkeypatch.delenv("PERFXLM_ROW_GROUPS_K", raising=False)
        cpu_plan.reset()
