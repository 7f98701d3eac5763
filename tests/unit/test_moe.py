"""The grouped mixture-of-experts computation against the token-by-token reference."""

import pytest
import torch

from perfxlm.model.layers.moe import FusedMoE
from perfxlm.ops import cpu_plan
from perfxlm.ops.reference import moe_reference


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 2), (37, 5, 2), (64, 8, 3), (9, 3, 3)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_experts_match_reference(num_tokens, num_experts, top_k, renormalize):
    torch.manual_seed(num_tokens)
    hidden, inter = 24, 40
    moe = FusedMoE(num_experts, top_k, hidden, inter, renormalize)
    with torch.no_grad():
        moe.gate_up_proj.normal_(0, 0.2)
        moe.down_proj.normal_(0, 0.2)
    x = torch.randn(num_tokens, hidden)
    logits = torch.randn(num_tokens, num_experts) * 2
    out = moe(x, logits)
    ref = moe_reference(x, logits, moe.gate_up_proj, moe.down_proj, top_k, renormalize)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_per_expert_shards_load_into_stacked_parameters():
    moe = FusedMoE(3, 2, 4, 5, renormalize=True)
    gate, up, down = torch.randn(5, 4), torch.randn(5, 4), torch.randn(4, 5)
    moe.load_shard(moe.gate_up_proj, gate, "gate", expert=2)
    moe.load_shard(moe.gate_up_proj, up, "up", expert=2)
    moe.load_shard(moe.down_proj, down, "down", expert=2)
    assert torch.equal(moe.gate_up_proj[2], torch.cat([gate, up]))
    assert torch.equal(moe.down_proj[2], down)
    assert moe.expected_shards("gate_up_proj") == ["0.gate", "0.up", "1.gate", "1.up", "2.gate", "2.up"]
    with pytest.raises(ValueError, match="expert index 3 out of range"):
        moe.load_shard(moe.down_proj, down, "down", expert=3)
    with pytest.raises(ValueError, match="checkpoint shape"):
        moe.load_shard(moe.down_proj, down.T, "down", expert=0)


def _native_or_skip():
    from perfxlm.ops import native

    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")


def _stacks(kind: str, num_experts: int, hidden: int, inter: int, seed: int):
    """gate|up [E, 2 * inter, hidden] and down [E, hidden, inter] stacks as a model may hold them."""
    from perfxlm.quant.quantizers import quantize_symmetric_int4, quantize_symmetric_int8

    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2
    down = torch.randn(num_experts, hidden, inter, generator=g) * 0.2
    if kind == "bf16":
        return gate_up.bfloat16(), down.bfloat16()
    if kind == "transposed":  # views of [E, in, out] stacks (transformers' layout), taken as they are
        return gate_up.transpose(1, 2).contiguous().transpose(1, 2), down.transpose(1, 2).contiguous().transpose(1, 2)
    if kind == "int8":
        return quantize_symmetric_int8(gate_up, 32), quantize_symmetric_int8(down, 32)
    if kind == "int4":
        return quantize_symmetric_int4(gate_up, 32), quantize_symmetric_int4(down, 32)
    if kind == "q4_k":  # a GGUF file's expert stacks, two-level scales: Q4_K gate|up, Q6_K down
        import gguf

        from perfxlm.quant.gguf_repack import repack
        from tests.unit.test_kquant_ops import k_blocks

        q = gguf.GGMLQuantizationType
        return (repack(k_blocks(q.Q4_K, num_experts * 2 * inter, hidden, seed), q.Q4_K, (num_experts, 2 * inter, hidden)),
                repack(k_blocks(q.Q6_K, num_experts * hidden, inter, seed), q.Q6_K, (num_experts, hidden, inter)))  # fmt: skip
    if kind == "mxfp4":  # gpt-oss's experts: E2M1 levels, power-of-two float32 scales
        from perfxlm.quant import mxfp4

        return (mxfp4.from_checkpoint(*mxfp4.quantize_reference(gate_up), "gate_up"),
                mxfp4.from_checkpoint(*mxfp4.quantize_reference(down), "down"))  # fmt: skip
    return gate_up, down


@pytest.mark.parametrize("kind", ["float32", "bf16", "transposed", "int8", "int4", "mxfp4", "q4_k"])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh", "clamped-swiglu"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 5, 2), (37, 7, 4)])
def test_native_experts_equal_the_torch_loop(kind, activation, num_tokens, num_experts, top_k, monkeypatch):
    """The one-call kernel runs the torch loop's ops in the same order: the same bits, for every stack
    kind and activation, with gpt-oss's biases; experts that get no token are skipped."""
    from perfxlm.model.layers import moe as moe_module
    from perfxlm.model.layers.activation import ClampedSwiGLU, act_and_mul
    from perfxlm.ops import fused_moe

    _native_or_skip()
    hidden, inter = (256, 256) if kind == "q4_k" else (64, 96)  # 4-bit codes: in_features in 32s (K-quants: 256s)
    gate_up, down = _stacks(kind, num_experts, hidden, inter, seed=num_tokens)
    act = ClampedSwiGLU(1.702, 1.3) if activation == "clamped-swiglu" else act_and_mul(activation)
    torch.manual_seed(num_experts)
    biases = (torch.randn(num_experts, 2 * inter) * 0.1, torch.randn(num_experts, hidden) * 0.1)
    if activation != "clamped-swiglu":
        biases = (None, None)
    x = torch.randn(num_tokens, hidden)
    weights, ids = torch.softmax(torch.randn(num_tokens, num_experts) * 2, -1).topk(top_k, dim=-1)
    calls = []
    real = fused_moe.experts_call
    monkeypatch.setattr(moe_module, "experts_call", lambda *a: calls.append(1) or real(*a))
    native = moe_module.grouped_experts(x, weights, ids, gate_up, down, act, *biases)
    looped = moe_module.grouped_experts_torch(x, weights, ids, gate_up, down, act, *biases)
    assert calls and real(x, weights, ids, gate_up, down, moe_module.expert_activation(act), *biases) is not None
    assert torch.equal(native, looped)
    # and the routing counts: zeroing one token's weights zeroes its row only
    weights[0] = 0
    again = moe_module.grouped_experts(x, weights, ids, gate_up, down, act, *biases)
    assert again[0].abs().max() == 0 and torch.equal(again[1:], native[1:])


def _routed(num_tokens: int, num_experts: int, top_k: int, hidden: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    weights, ids = torch.softmax(torch.randn(num_tokens, num_experts, generator=g), -1).topk(top_k, dim=-1)
    return x, weights, ids


def _experts(kind: str, num_experts: int, hidden: int, inter: int, seed: int, gpt_oss: bool):
    """Stacks of `kind` ("..._blocks": a weight-only format under quant_activations=int8, llama.cpp's Q8
    products), the activation and the biases (gpt-oss's clamped SwiGLU over interleaved rows, biased)."""
    from perfxlm.model.layers.activation import ClampedSwiGLU, SiluAndMul
    from perfxlm.quant.weight import ActivationMode

    gate_up, down = _stacks(kind.removesuffix("_blocks"), num_experts, hidden, inter, seed=seed)
    if kind.endswith("_blocks"):
        gate_up.activations = down.activations = ActivationMode.INT8_NATIVE
    if not gpt_oss:
        return gate_up, down, SiluAndMul(), (None, None)
    g = torch.Generator().manual_seed(seed + 1)
    biases = (torch.randn(num_experts, 2 * inter, generator=g) * 0.1, torch.randn(num_experts, hidden, generator=g) * 0.1)
    return gate_up, down, ClampedSwiGLU(1.702, 1.3), biases


def _on_three_threads(fn):
    """fn() under inference mode (the engine's: the regions' other threads must write into its inference
    tensors) on three threads (runs end mid-way)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with torch.inference_mode():
            return fn()
    finally:
        torch.set_num_threads(threads)


_SIZES = {"bf16": (70, 99), "float32": (70, 99), "q4_k": (256, 256), "q4_k_blocks": (256, 256)}


@pytest.mark.parametrize(
    "kind,gpt_oss",
    [("float32", False), ("bf16", False), ("int8", False), ("int8_blocks", False), ("int4", False),
     ("int4_blocks", False), ("q4_k", False), ("q4_k_blocks", False), ("float32", True), ("bf16", True),
     ("mxfp4", True), ("mxfp4_blocks", True)],
)  # fmt: skip
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 9, 3), (13, 11, 5), (16, 31, 4), (90, 3, 2)])
def test_native_experts_cut_into_runs_keep_the_bits(kind, gpt_oss, num_tokens, num_experts, top_k):
    """Few rows per expert run as runs of columns over all experts in two parallel regions (float32, bf16
    and quantized stacks; gpt-oss's interleaved gate|up rows with biases and its clamped SwiGLU), down
    over experts where there are four per thread (16 tokens over 31 experts); more
    rows run expert by expert, under int8 activation blocks through the int8 GEMM from the plan's row
    count, as the torch loop's products do: the torch loop's bits every way, with odd hidden /
    intermediate sizes where the format allows them."""
    from perfxlm.model.layers import moe as moe_module

    _native_or_skip()
    hidden, inter = _SIZES.get(kind, (128, 192))
    gate_up, down, act, biases = _experts(kind, num_experts, hidden, inter, num_tokens, gpt_oss)
    x, weights, ids = _routed(num_tokens, num_experts, top_k, hidden, seed=top_k)
    native, looped = _on_three_threads(lambda: (
        moe_module.grouped_experts(x, weights, ids, gate_up, down, act, *biases),
        moe_module.grouped_experts_torch(x, weights, ids, gate_up, down, act, *biases)))  # fmt: skip
    assert torch.equal(native, looped)
    assert native.abs().sum() > 0


@pytest.mark.parametrize(
    "kind,gpt_oss",
    [("bf16", False), ("int8_blocks", False), ("int4", False), ("q4_k", False), ("mxfp4_blocks", True)],
)
def test_a_row_alone_equals_the_same_row_in_a_batch(kind, gpt_oss):
    """Batched decode (every expert within the GEMV's rows) computes each row as if it were alone: the
    GEMV and row kernels do not mix rows, and the activation runs per row (gpt-oss's on intermediate
    sizes in 32s, MXFP4's): 16 parallel requests each get what they would alone."""
    from perfxlm.model.layers.moe import grouped_experts

    _native_or_skip()
    num_experts, top_k = 13, 5
    hidden, inter = _SIZES.get(kind, (128, 192))
    gate_up, down, act, biases = _experts(kind, num_experts, hidden, inter, 7, gpt_oss)
    x, weights, ids = _routed(15, num_experts, top_k, hidden, seed=3)
    # every expert's rows (at most 15 here) within the row kernels' limits, as the docstring's premise (a CPU
    # with fast bf16 sends bf16 stacks past 4 rows to its bf16 GEMM, quantized ones past 8 to a GEMM)
    plan = cpu_plan.plan()
    previous = cpu_plan.use(native_max_rows=max(plan.native_max_rows, 16), quant_max_rows=max(plan.quant_max_rows, 16),
                            quant_block_max_rows=max(plan.quant_block_max_rows, 16) if plan.quant_block_max_rows >= 0 else -1)
    try:
        batch = _on_three_threads(lambda: grouped_experts(x, weights, ids, gate_up, down, act, *biases))
        for t in (0, 6, 14):
            one = slice(t, t + 1)
            alone = _on_three_threads(
                lambda one=one: grouped_experts(x[one], weights[one], ids[one], gate_up, down, act, *biases))
            assert torch.equal(alone[0], batch[t]), f"row {t}"
    finally:
        cpu_plan.use(previous)


def test_two_level_stacks_leave_int8_gemm_steps_to_the_torch_loop():
    """K-quants' two-level scales are multiplied out per call for the torch loop's int8 GEMM, which the
    native linear_q does not do: steps that could reach that GEMM are the loop's, decode steps the
    kernel's (and every step the kernel's where the build has no int8 GEMM)."""
    from perfxlm.model.layers.moe import expert_activation
    from perfxlm.ops import cpu_plan, fused_moe
    from perfxlm.ops.linear import gemm_takes, native_int8_blocks

    _native_or_skip()
    gate_up, down, act, _ = _experts("q4_k_blocks", 4, 256, 256, 0, False)
    previous = cpu_plan.use(quant_gemm="int8", quant_gemm_rows=16)
    try:
        few, many = _routed(3, 4, 2, 256, 0), _routed(16, 4, 2, 256, 0)
        assert fused_moe.experts_call(*few, gate_up, down, expert_activation(act)) is not None
        loop_only = gemm_takes(gate_up)  # the loop's GEMM takes it; the native GEMV's blocks do or not
        assert (fused_moe.experts_call(*many, gate_up, down, expert_activation(act)) is None) == loop_only
        # a flat stack the native products take as the loop does stays the kernel's
        flat_up, flat_down, _, _ = _experts("int4_blocks", 4, 256, 256, 0, False)
        if native_int8_blocks(flat_up):
            assert fused_moe.experts_call(*many, flat_up, flat_down, expert_activation(act)) is not None
    finally:
        cpu_plan.use(previous)


def test_native_experts_refuse_bad_expert_ids():
    from perfxlm.model.layers.activation import SiluAndMul
    from perfxlm.model.layers.moe import grouped_experts

    _native_or_skip()
    gate_up, down = _stacks("float32", 3, 8, 6, seed=0)
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match=r"expert ids must be in \[0, 3\)"):
        grouped_experts(x, torch.ones(2, 1), torch.tensor([[0], [3]]), gate_up, down, SiluAndMul())


def test_quantized_stacks_under_a_bf16_gemm_plan():
    """The plan of a CPU with fast bf16 (many rows on its bf16 GEMM), on any CPU: the fused expert call
    takes quantized stacks with their own bf16-GEMM decision passed in (it once read an attribute the stacks
    do not have, and every such CPU failed here), and computes what the expert-by-expert loop does."""
    from perfxlm.model.layers import moe as moe_module

    _native_or_skip()
    gate_up, down, act, biases = _experts("int8_blocks", 13, 128, 192, 7, False)
    x, weights, ids = _routed(5, 13, 2, 128, seed=1)
    previous = cpu_plan.use(gemm="bf16")
    try:
        fused, looped = _on_three_threads(lambda: (
            moe_module.grouped_experts(x, weights, ids, gate_up, down, act, *biases),
            moe_module.grouped_experts_torch(x, weights, ids, gate_up, down, act, *biases)))  # fmt: skip
    finally:
        cpu_plan.use(previous)
    assert torch.equal(fused, looped) and fused.abs().sum() > 0


@pytest.mark.parametrize("width", [2 * 36, 2 * 18, 2 * 65, 2 * 64, 2 * 2880])
def test_clamped_swiglu_computes_each_row_as_alone(width):
    """gpt-oss's activation over several rows gives each row the bits it gets alone, whatever the row width
    (intermediate sizes off the vector width included): a verification step's rows are the decode steps'."""
    from perfxlm.model.layers.activation import ClampedSwiGLU

    act = ClampedSwiGLU(1.702, 1.5)
    h = torch.randn(7, width, generator=torch.Generator().manual_seed(width)) * 3
    together = act(h)
    assert together.shape == (7, width // 2)
    for r in range(7):
        assert torch.equal(act(h[r : r + 1])[0], together[r]), f"row {r}"
    # the module's formula, unpadded, within float rounding
    gate, up = h[:, ::2].clamp(max=1.5), h[:, 1::2].clamp(-1.5, 1.5)
    torch.testing.assert_close(together, (up + 1) * (gate * torch.sigmoid(gate * 1.702)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scoring,topk_method", [("sigmoid", "noaux_tc"), ("softmax", "group_limited_greedy"),
                                                 ("softmax", "greedy")])
def test_grouped_router_routes_each_row_as_alone(scoring, topk_method):
    """DeepSeek's router over a few rows (a decode batch, a verification step) weighs each row's experts
    with the bits it gets alone: its float32 product and its scoring run row by row there."""
    from perfxlm.model.layers.moe_router import ROW_BY_ROW, GroupedTopKRouter

    router = GroupedTopKRouter(40, 6, 2, scoring, topk_method, 2, 1, False, 1.0)
    g = torch.Generator().manual_seed(1)
    router.weight.copy_(torch.randn(6, 40, generator=g))
    x = torch.randn(ROW_BY_ROW, 40, generator=g)
    for rows in (2, 5, ROW_BY_ROW):
        weights, ids = router(x[:rows])
        for r in range(rows):
            alone_w, alone_ids = router(x[r : r + 1])
            assert torch.equal(alone_w[0], weights[r]) and torch.equal(alone_ids[0], ids[r]), (rows, r)
