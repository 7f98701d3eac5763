"""Split weights (perfxlm/quant/split_rows.py): a fused projection whose parts keep their own formats (a Q4_K
q|k beside a Q6_K v, as Q4_K_M files mix them) against the plain-torch dequantized reference, in the plain
layout and the K-quant row groups, at odd row counts; the module path (SplitRowsLinear) and the fused decode
layer's projection (csrc `project` through its test op) give the same bits, a row alone the bits it has in a
batch; joins of one form stay one weight, and bad parts are refused by name. Runs on every ISA tier
(test_portable_kernels)."""

import pytest
import torch
from torch import nn

from perfxlm.model.layers.linear_methods.base import LinearPlan
from perfxlm.model.layers.linear_methods.registry import method_for
from perfxlm.model.layers.linear_methods.split_rows import SplitRowsLinear
from perfxlm.ops import cpu_plan, native
from perfxlm.quant import split_rows
from perfxlm.quant.layout_choice import choose_layouts
from perfxlm.quant.layouts import CodeLayout
from perfxlm.quant.reference import block_reference_linear
from perfxlm.quant.split_rows import SplitRows, join_rows
from perfxlm.quant.weight import ActivationMode, QuantizedWeight
from tests.unit.test_row_groups_k import gguf_weight

PLAN = LinearPlan(torch.float32, torch.float32, quantized_format="gguf")


def _qkv(k: int = 768, q: int = 13, kv: int = 11, seed: int = 0):
    """Q4_K q and k, Q6_K v (odd row counts: last row groups part-filled)."""
    return [gguf_weight("q4_k", q, k, seed=seed), gguf_weight("q4_k", kv, k, seed=seed + 1),
            gguf_weight("q6_k", kv, k, seed=seed + 2)]  # fmt: skip


class _Layer(nn.Module):
    def __init__(self, weight) -> None:
        super().__init__()
        self.weight = weight


def _bound(weight, mode=ActivationMode.INT8_NATIVE, layout=None):
    weight.use_activations(mode, "qkv")
    layer = _Layer(weight)
    if layout is not None:
        choose_layouts(layer, layout)
    layer.method = method_for(layer.weight, PLAN)
    layer.method.process_after_loading(layer, PLAN)
    return layer


def _fused(ops, x, weight, bias, int8_blocks):
    """The fused decode layer's projection of `weight` with the arguments FusedDecode.run passes."""
    plan = cpu_plan.plan()
    gemm_rows = plan.quant_gemm_rows if int8_blocks and plan.quant_gemm == "int8" else -1
    return ops.lora_project(x, weight.native_parts(), weight.out_features, bias, plan.native_max_rows, False,
                            int8_blocks, plan.quant_max_rows, plan.quant_block_max_rows, gemm_rows, [], 0)  # fmt: skip


def test_a_mixed_join_keeps_its_forms_and_one_form_stays_one_weight():
    parts = _qkv()
    split = join_rows(parts)
    assert isinstance(split, SplitRows) and [p.bits for p in split.parts] == [4, 6]  # q|k joined, v apart
    assert [p.out_features for p in split.parts] == [24, 11] and split.shape == (35, 768)
    want = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(split.dequantize(), want)
    assert split.nbytes == sum(p.nbytes for p in parts)
    # the widened form (the switch off, and what a file export writes) holds the same values
    assert torch.equal(split.joined().dequantize(), want)
    assert isinstance(join_rows(parts[:2]), QuantizedWeight)  # one form: one weight


def test_the_switch_joins_every_mix_into_one_widened_weight(monkeypatch):
    monkeypatch.setenv(split_rows.SPLIT_ENV, "0")
    whole = join_rows(_qkv())
    assert isinstance(whole, QuantizedWeight) and whole.bits == 8 and whole.group == 16


@pytest.mark.parametrize("layout", [None, CodeLayout.ROWS8_K])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_products_match_the_reference_and_the_fused_projection(layout, rows):
    ops = native.kernels()
    if ops is None:
        pytest.skip("no native kernels on this machine")
    parts = _qkv(seed=rows)
    layer = _bound(join_rows(parts), layout=layout)
    weight = layer.weight
    assert isinstance(layer.method, SplitRowsLinear)
    if layout is not None:
        assert all(p.layout is CodeLayout.ROWS8_K for p in weight.parts)
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, 768, generator=g), torch.randn(35, generator=g)
    y = layer.method.multiply(x, weight, bias, weight.out_features)
    whole = torch.cat([p.dequantize() for p in parts])
    refs = [block_reference_linear(x, p, None) for p in parts]
    ref = torch.cat(refs, -1) + bias
    scale = ref.abs().max().item()
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=2e-2 * scale)  # int8 activation blocks where native
    torch.testing.assert_close(y, x @ whole.T + bias, rtol=1e-2, atol=5e-2 * scale)
    int8_blocks = layer.method.methods[0].int8_blocks
    fused = _fused(ops, x, weight, bias, int8_blocks)
    # the fused projection is each part's projection side by side, bit for bit
    at = weight.offsets
    for i, p in enumerate(weight.parts):
        assert torch.equal(fused[:, at[i] : at[i + 1]], _fused(ops, x, p, bias[at[i] : at[i + 1]], int8_blocks))
    if rows <= 3:  # decode rows: the module path runs the same GEMV calls (many plain rows: its own GEMM choice)
        assert torch.equal(fused, y)
    torch.testing.assert_close(fused, y, rtol=1e-4, atol=1e-4 * scale)


def test_a_row_alone_gives_the_bits_it_has_in_a_batch():
    ops = native.kernels()
    if ops is None:
        pytest.skip("no native kernels on this machine")
    layer = _bound(join_rows(_qkv(seed=9)), layout=CodeLayout.ROWS8_K)
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(4))
    batch = layer.method.multiply(x, layer.weight, None, 35)
    for m in range(5):
        assert torch.equal(layer.method.multiply(x[m : m + 1], layer.weight, None, 35)[0], batch[m])


def test_bad_parts_and_shapes_are_refused_by_name():
    q4, q6 = gguf_weight("q4_k", 8, 768), gguf_weight("q6_k", 8, 512)
    with pytest.raises(ValueError, match="in_features"):
        SplitRows((q4, q6))
    with pytest.raises(ValueError, match="at least two"):
        SplitRows((q4,))
    with pytest.raises(ValueError, match="QuantizedWeight"):
        SplitRows((q4, torch.zeros(8, 768)))
    ops = native.kernels()
    if ops is None:
        return
    split = join_rows(_qkv())
    split.use_activations(ActivationMode.INT8_NATIVE)
    with pytest.raises(RuntimeError, match="split weight's parts have 35 rows, not 36"):
        ops.lora_project(torch.randn(1, 768), split.native_parts(), 36, None, 32, False, True, 32, 128, -1, [], 0)
