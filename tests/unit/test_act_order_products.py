"""Act-order weights (GPTQ's desc_act: codes column j multiplies input channel input_order[j]) on every
product that takes a quantized weight. Each is the same weight's product without the order on x's columns
gathered into it, bit for bit: the module path's linear (the GEMV with float or int8-block activations,
the int8 block GEMM past the GEMV's rows), the fused decode layer's projection with and without a step's
LoRA adapters (which read x as it is), the native experts of an act-order stack (each expert its own
order) against the torch loop, W8A8's integer GEMM; and each near the dense weight's float product."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from perfxlm.model.layers.linear import Linear
from perfxlm.model.layers.linear_methods.base import LinearPlan
from perfxlm.ops import cpu_plan, native
from perfxlm.ops.linear import quantized_linear
from perfxlm.quant import quantizers
from perfxlm.quant.loading import install
from perfxlm.quant.reference import reference_linear
from perfxlm.quant.weight import ActivationMode, QuantizedWeight

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no compiler for the native kernels")


def _ordered(w: QuantizedWeight, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """w with a random input order (a stack: one per expert), and that order."""
    g = torch.Generator().manual_seed(seed)
    k = w.in_features
    if w.num_experts is None:
        order = torch.randperm(k, generator=g)
    else:
        order = torch.stack([torch.randperm(k, generator=g) for _ in range(w.num_experts)])
    return dataclasses.replace(w, input_order=order), order


def _weight(bits: int, n: int, k: int, seed: int) -> QuantizedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quantizers.quantize_symmetric_int4(w, 32) if bits == 4 else quantizers.quantize_asymmetric_int8(w, 32)


@pytest.fixture
def plan_restored():
    previous = cpu_plan.plan()
    yield
    cpu_plan.use(previous)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mode", list(ActivationMode))
@pytest.mark.parametrize("rows", [1, 3, 9, 40, 130])
def test_linear_is_the_plain_product_on_gathered_inputs(plan_restored, bits, mode, rows):
    """Few rows on the GEMV, more on the int8 block GEMM where the activations are int8 blocks (the plan's
    int8 GEMM from 8 rows) or the float path: an ordered weight gives what the plain one gives on x[:, order]."""
    cpu_plan.use(quant_gemm="int8", quant_gemm_rows=8, quant_max_rows=4, quant_block_max_rows=-1)
    plain = _weight(bits, 67, 192, seed=bits + rows)
    plain.use_activations(mode)
    ordered, order = _ordered(plain, seed=rows)
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, 192, generator=g), torch.randn(67, generator=g)
    got = quantized_linear(x, ordered, bias)
    assert torch.equal(got, quantized_linear(x[:, order], plain, bias))
    want = reference_linear(x, ordered, bias)  # (INT8_NATIVE's activations: float32 there)
    assert (got - want).abs().max() <= (1e-5 if mode is ActivationMode.FLOAT else 2e-2) * want.abs().max()
    if mode is ActivationMode.FLOAT:
        torch.testing.assert_close(got, x @ ordered.dense().t() + bias, rtol=1e-5, atol=1e-5)


def _lora(k: int, n: int, rows: int, seed: int):
    from perfxlm.lora.pack import pack_layer
    from tests.unit.test_lora_kernel import _operands

    parts = [(0, n // 2 + 3), (n // 2 + 3, n)]
    a, bt, scale, cols = _operands(k, parts, [(0, [3, 2]), (2, [1, 4])], seed=seed, dtype=torch.float32)
    row_slot = torch.tensor([(0, -1, 2)[i % 3] for i in range(rows)], dtype=torch.int32)
    return [row_slot, pack_layer([(a, bt, scale, cols)])]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows,int8_blocks,threads,gemm_rows", [
    (1, False, 1, -1), (1, True, 2, 16), (3, True, 2, -1), (16, True, 2, 16), (21, False, 2, -1),
])  # fmt: skip
def test_fused_projection_gathers_the_base_product_only(bits, rows, int8_blocks, threads, gemm_rows):
    """The fused layer's projection (csrc `project`, through the LoRA test op): an ordered weight's parts carry
    the order sixth; its base product is the plain weight's on x[:, order], the adapters read x as it is
    (one parallel region or not)."""
    ops = native.kernels()
    n, k = 200, 256
    plain = _weight(bits, n, k, seed=rows)
    ordered, order = _ordered(plain, seed=rows + 1)
    assert len(ordered.native_parts()) == 6 and len(plain.native_parts()) == 5
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    lora = _lora(k, n, rows, seed=rows)
    args = (32, False, int8_blocks, 32, 128, gemm_rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            base = ops.lora_project(x[:, order].contiguous(), plain.native_parts(), n, bias, *args, [], 0)
            got_base = ops.lora_project(x, ordered.native_parts(), n, bias, *args, [], 0)
            want = base.clone()
            ops.lora_add(want, x, lora, 0)
            got = ops.lora_project(x, ordered.native_parts(), n, bias, *args, lora, 0)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got_base, base)
    assert torch.equal(got, want) and not torch.equal(got, base)
    if not int8_blocks:
        torch.testing.assert_close(got_base, x @ ordered.dense().t() + bias, rtol=1e-5, atol=1e-5)


def test_a_bad_order_is_refused_by_name():
    ops = native.kernels()
    plain = _weight(8, 16, 64, seed=0)
    parts = [*plain.native_parts(), torch.arange(63)]
    with pytest.raises(RuntimeError, match="input order must be contiguous int64 \\[64\\]"):
        ops.lora_project(torch.randn(2, 64), parts, 16, None, 32, False, False, 32, 128, -1, [], 0)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 9, 3), (13, 11, 5), (16, 31, 4), (90, 3, 2)])
def test_act_order_experts_run_natively_as_the_torch_loop(plan_restored, bits, blocks, num_tokens, num_experts, top_k):
    """A stack whose experts each have their own input order runs the one-call kernel (each expert's rows
    gathered once, for all its column runs; expert by expert past the GEMV's rows, into the int8 GEMM under
    int8 blocks): the torch loop's bits, near the dense stacks' float product."""
    from perfxlm.model.layers import moe as moe_module
    from perfxlm.model.layers.activation import SiluAndMul
    from perfxlm.ops import fused_moe
    from tests.unit.test_moe import _on_three_threads, _routed

    cpu_plan.use(quant_gemm="int8", quant_gemm_rows=16)
    hidden, inter = 128, 192
    g = torch.Generator().manual_seed(num_tokens)
    stacks = []
    for i, shape in enumerate(((num_experts, 2 * inter, hidden), (num_experts, hidden, inter))):
        w = torch.randn(*shape, generator=g) * 0.2
        q = quantizers.quantize_symmetric_int4(w, 32) if bits == 4 else quantizers.quantize_symmetric_int8(w, 32)
        q, _ = _ordered(q, seed=num_tokens + i)
        if blocks:
            q.activations = ActivationMode.INT8_NATIVE
        stacks.append(q)
    gate_up, down = stacks
    act = SiluAndMul()
    x, weights, ids = _routed(num_tokens, num_experts, top_k, hidden, seed=top_k)
    assert fused_moe.experts_call(x, weights, ids, gate_up, down, moe_module.expert_activation(act)) is not None
    native_out, looped = _on_three_threads(lambda: (
        moe_module.grouped_experts(x, weights, ids, gate_up, down, act),
        moe_module.grouped_experts_torch(x, weights, ids, gate_up, down, act)))  # fmt: skip
    assert torch.equal(native_out, looped)
    dense = moe_module.grouped_experts_torch(x, weights, ids, gate_up.dense(), down.dense(), act)
    assert (native_out - dense).abs().max() <= (2e-2 if blocks else 1e-5) * dense.abs().max()


def test_w8a8_integer_gemm_takes_an_ordered_weight():
    """Per-token W8A8 past the GEMV's rows (torch's integer GEMM): the ordered weight's rows gathered before
    they are quantized, the definition's bits (a row's scale is its absmax, whatever its column order)."""
    from perfxlm.model.layers.linear_methods.quantized import INT_GEMM_MIN_ROWS

    g = torch.Generator().manual_seed(5)
    k, n = 97, 53
    weight, order = _ordered(quantizers.quantize_symmetric_int8(torch.randn(n, k, generator=g), k, act="int8"), seed=5)
    layer = Linear(k, n, bias=True)
    install(layer, "weight", weight)
    layer.bias.data.copy_(torch.randn(n, generator=g))
    layer.bind_linear_method(LinearPlan(torch.float32, torch.float32, quantized_format="compressed-tensors"))
    assert layer.method.int_gemm is not None
    rows = max(cpu_plan.plan().quant_max_rows, INT_GEMM_MIN_ROWS) + 5
    x = torch.randn(rows, k, generator=g) * 3
    assert torch.equal(layer(x), reference_linear(x, layer.weight, layer.bias))
    dense = x @ weight.dense().t() + layer.bias  # per-token int8 activations: near it
    assert (layer(x) - dense).abs().max() <= 3e-2 * dense.abs().max()
