"""The router, routing and experts of a few-row step in one native call (`moe_routed_experts`,
`FusedMoE.forward_with_router`) against the modules run one after another (the router's Linear, route(),
the experts): the same bits, for float32, bf16-row and bf16-panel routers over float, bf16, 4-bit and
row-group stacks; steps of more rows, and routers with adapters (a Linear subclass), take the modules.
Runs on whichever ISA build is loaded (test_portable_kernels runs the lower tiers)."""

import pytest
import torch

from perfxlm.model.layers.linear import Linear
from perfxlm.model.layers.linear_methods.base import LinearPlan
from perfxlm.model.layers.moe import FusedMoE
from perfxlm.ops import cpu_plan, native
from perfxlm.quant.weight import ActivationMode

HIDDEN, INTER = 160, 96  # 5 and 3 blocks of 32 in; 96 rows per expert: three 32-row runs, twelve groups of 8


def _kernels_or_skip():
    ops = native.kernels()
    if ops is None or not hasattr(ops, "moe_routed_experts"):
        pytest.skip("no native MoE kernel in this build")


def _stacks(kind: str, experts: int, seed: int):
    from perfxlm.quant.quantizers import quantize_symmetric_int4

    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * INTER, HIDDEN, generator=g) * 0.2
    down = torch.randn(experts, HIDDEN, INTER, generator=g) * 0.2
    if kind == "bf16":
        return gate_up.bfloat16(), down.bfloat16()
    if kind == "int4":
        return quantize_symmetric_int4(gate_up, 32), quantize_symmetric_int4(down, 32)
    if kind == "int4_rows8":  # int8 activation blocks, each expert's rows in groups of 8 (a GGUF Q4_0 stack's)
        up, dn = quantize_symmetric_int4(gate_up, 32), quantize_symmetric_int4(down, 32)
        out = []
        for w in (up, dn):
            w.use_activations(ActivationMode.INT8_NATIVE)
            out.append(w.in_row_groups())
        return tuple(out)
    return gate_up, down


def _moe(kind: str, experts: int, top_k: int, renormalize: bool, seed: int) -> FusedMoE:
    moe = FusedMoE(experts, top_k, HIDDEN, INTER, renormalize)
    for name, w in zip(("gate_up_proj", "down_proj"), _stacks(kind, experts, seed)):
        delattr(moe, name)
        setattr(moe, name, w if not isinstance(w, torch.Tensor) else torch.nn.Parameter(w, requires_grad=False))
    return moe


def _router(kind: str, experts: int, seed: int, cls: type = Linear) -> Linear:
    router = cls(HIDDEN, experts)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 0.5)
    if kind != "float32":
        router.bind_linear_method(LinearPlan(torch.bfloat16, torch.float32, layout="panels" if kind == "panels" else "rows"))
    return router


@pytest.mark.parametrize("stacks", ["float32", "bf16", "int4", "int4_rows8"])
@pytest.mark.parametrize("router_kind", ["float32", "bf16", "panels"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_one_call_equals_the_modules(stacks, router_kind, renormalize):
    _kernels_or_skip()
    experts, top_k = 9, 3
    moe = _moe(stacks, experts, top_k, renormalize, seed=1)
    router = _router(router_kind, experts, seed=2)
    rows = cpu_plan.plan().native_max_rows
    with torch.inference_mode():
        for tokens in sorted({1, rows}):
            x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
            call = moe.native_call()
            fused = call.run_routed(x, router.weight, router.bias, top_k, renormalize)
            assert fused is not None  # the one call ran
            want = moe(x, router(x))
            assert torch.equal(fused, want) and want.abs().sum() > 0
            assert torch.equal(moe.forward_with_router(x, router), want)


def test_more_rows_or_an_adapted_router_take_the_modules():
    _kernels_or_skip()

    class Shifted(Linear):  # what a LoRA wrapper is to the block: not the plain Linear
        def forward(self, x):
            return super().forward(x) + torch.arange(self.out_features, dtype=x.dtype)

    moe = _moe("int4", 7, 2, True, seed=3)
    router, shifted = _router("bf16", 7, seed=4), _router("bf16", 7, seed=4, cls=Shifted)
    rows = cpu_plan.plan().native_max_rows + 1
    with torch.inference_mode():
        x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(5))
        assert moe.native_call().run_routed(x, router.weight, router.bias, 2, True) is None
        assert torch.equal(moe.forward_with_router(x, router), moe(x, router(x)))
        one = x[:1]
        assert torch.equal(moe.forward_with_router(one, shifted), moe(one, shifted(one)))
        assert not torch.equal(moe(one, shifted(one)), moe(one, router(one)))  # the shift changes the routing


def test_the_prepared_call_follows_the_plan_and_the_stacks(monkeypatch):
    _kernels_or_skip()
    moe = _moe("int4", 5, 2, False, seed=6)
    call = moe.native_call()
    assert moe.native_call() is call  # kept while plan and stacks stay
    gate_up, down = _stacks("bf16", 5, seed=7)
    moe.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    moe.down_proj = torch.nn.Parameter(down, requires_grad=False)
    assert moe.native_call() is not call and moe.native_call().up_parts[0] is moe.gate_up_proj
    monkeypatch.setattr(native, "kernels", lambda: None)  # a switch to the torch path after a call was kept
    x = torch.randn(1, HIDDEN)
    router = _router("float32", 5, seed=8)
    assert moe.native_call().run_routed(x, router.weight, router.bias, 2, False) is None
    torch.testing.assert_close(moe.forward_with_router(x, router), moe(x, router(x)))
