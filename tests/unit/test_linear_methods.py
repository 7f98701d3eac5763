"""The linear-method seam: every weight format is one registered class, chosen once per layer at load,
and a layer's product never goes through the per-call dispatch (ops.linear.linear)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from perfxlm.model.layers.embed_head import LMHead
from perfxlm.model.layers.linear import Linear, MergedLinear
from perfxlm.model.layers.linear_methods.base import LinearPlan
from perfxlm.model.layers.linear_methods.registry import LINEAR_METHODS, method_for
from perfxlm.quant import mxfp4
from perfxlm.model.loader import get_model, load_hf_config
from perfxlm.ops import cpu_plan
from perfxlm.ops import linear as linear_ops
from perfxlm.quant import quantizers
from perfxlm.quant.config import GGUF, METHODS
from perfxlm.quant.formats.loading import FORMATS
from perfxlm.quant.loading import install
from perfxlm.quant.reference import reference_linear

F32, BF16 = torch.float32, torch.bfloat16


def _no_dispatch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a layer went through the per-call dispatch")

    monkeypatch.setattr(linear_ops, "linear", refuse)


def test_every_format_is_one_registered_method():
    names = {"float", "bf16_rows", "bf16_panels", GGUF, *METHODS, *FORMATS}
    assert names == set(LINEAR_METHODS)
    for name, cls in LINEAR_METHODS.items():
        assert cls.name == name and cls.quantized == (name not in ("float", "bf16_rows", "bf16_panels"))


@pytest.mark.parametrize("plan,want", [
    (LinearPlan(F32, F32), "float"), (LinearPlan(BF16, BF16), "float"), (LinearPlan(BF16, F32), "bf16_rows"),
    (LinearPlan(BF16, F32, "panels"), "bf16_panels"), (LinearPlan(torch.float16, F32), "float"),
])  # fmt: skip
def test_float_layout_by_plan(plan, want):
    assert method_for(torch.empty(3, 5), plan).name == want
    # expert stacks are read by rows whatever the plan
    assert method_for(torch.empty(3, 5), plan, panels=False).name == ("bf16_rows" if want == "bf16_panels" else want)


def test_quantized_weight_needs_the_models_format():
    w = quantizers.quantize_symmetric_int8(torch.randn(7, 64), 32)
    assert method_for(w, LinearPlan(F32, F32, quantized_format="int8")).name == "int8"
    with pytest.raises(ValueError, match="without a quantized format"):
        method_for(w, LinearPlan(F32, F32))
    with pytest.raises(ValueError, match="no linear method 'q9'; registered: float"):
        method_for(w, LinearPlan(F32, F32, quantized_format="q9"))


def test_a_weight_its_format_cannot_produce_is_named():
    layer = Linear(64, 7)
    install(layer, "weight", quantizers.quantize_symmetric_int4(torch.randn(7, 64), 32))
    with pytest.raises(ValueError, match=r"Linear: a w8a8 weight has 4-bit codes"):
        layer.bind_linear_method(LinearPlan(F32, F32, quantized_format="w8a8"))
    layer.weight = quantizers.quantize_nf4(torch.randn(7, 64), 32)  # a plain attribute by now
    with pytest.raises(ValueError, match=r"Linear: a int4 weight has a level table"):
        layer.bind_linear_method(LinearPlan(F32, F32, quantized_format="int4"))


@pytest.mark.parametrize("layout", ["rows", "panels"])
@pytest.mark.parametrize("rows", [1, 3, 37])
def test_float_layouts_match_the_float_product(layout, rows, monkeypatch):
    g = torch.Generator().manual_seed(rows)
    layer = MergedLinear(45, {"a": 19, "b": 14}, bias=True)
    w, b = torch.randn(33, 45, generator=g), torch.randn(33, generator=g)
    layer.weight.data.copy_(w), layer.bias.data.copy_(b)
    layer.bind_linear_method(LinearPlan(BF16, F32, layout))
    assert layer.method.name == f"bf16_{layout}" and layer.weight.dtype == BF16
    assert layer.weight.dim() == (3 if layout == "panels" else 2)
    torch.testing.assert_close(layer.weight_matrix().float(), w.to(BF16).float())
    x = torch.randn(rows, 45, generator=g)
    _no_dispatch(monkeypatch)
    # float32 activations throughout: a CPU with fast bf16 would send the 37 rows to its bf16 GEMM, which
    # rounds them to bf16 (a path of its own, tested with the plan)
    monkeypatch.setattr(cpu_plan, "_plan", dataclasses.replace(cpu_plan.plan(), gemm="float32"))
    want = F.linear(x.double(), w.to(BF16).double(), b.double()).float()
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quantize,fmt", [
    (lambda w: quantizers.quantize_symmetric_int8(w, 32), "int8"),
    (lambda w: quantizers.quantize_asymmetric_int4(w, 32), "int4"),
    (lambda w: quantizers.quantize_nf4(w, 64), "nf4"),
    (lambda w: quantizers.quantize_symmetric_int8(w, 64, act="int8"), "w8a8"),
    (lambda w: mxfp4.from_checkpoint(*mxfp4.quantize_reference(w), "w"), "mxfp4"),
    (lambda w: mxfp4.from_checkpoint(*mxfp4.quantize_reference(w), "w"), "gguf"),  # a GGUF file's MXFP4
])  # fmt: skip
def test_quantized_methods_match_the_definition(quantize, fmt, monkeypatch):
    g = torch.Generator().manual_seed(5)
    layer = Linear(192, 21, bias=True)
    install(layer, "weight", quantize(torch.randn(21, 192, generator=g)))
    layer.bias.data.copy_(torch.randn(21, generator=g))
    layer.bind_linear_method(LinearPlan(F32, F32, quantized_format=fmt))
    assert layer.method.name == fmt and not layer.method.bf16_gemm
    x = torch.randn(5, 192, generator=g)
    want = reference_linear(x, layer.weight, layer.bias)
    _no_dispatch(monkeypatch)
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4 * (want.abs().max().item() + 1))


def test_a_loaded_model_has_its_methods_chosen_once(tiny_llama, monkeypatch):
    model = get_model(tiny_llama, load_hf_config(tiny_llama), F32, "safetensors", quantization="int4")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and {m.method.name for m in linears} == {"int4"}
    head = next(m for m in model.modules() if isinstance(m, LMHead))
    assert head.method.name == "int4" and head.weight.bits == 6  # the table's 6-bit codes, by int4's method
    first = [m.method for m in linears]
    ids = torch.tensor([3, 17, 250])
    _no_dispatch(monkeypatch)
    x = model.model.embed_tokens(ids)
    assert linears[0](x).shape == (3, linears[0].out_features) and head(x).shape == (3, 1000)
    assert [m.method for m in linears] == first  # nothing rebinds per call
