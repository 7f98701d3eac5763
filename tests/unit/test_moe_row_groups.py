"""Expert stacks in row groups (CodeLayout.ROWS8 with a leading expert dimension, perfxlm/quant/row_groups.py):
the stack's bytes against the plain stack's and each expert's own groups, and the one-call MoE kernel
(csrc/moe_kernels.cpp) on them against the torch loop over the same experts (the same bits: both run the
row-group GEMV, or the int8 GEMM reading the groups, per expert) and against the plain stacks (float32
rounding: the GEMV sums a row's blocks in another order), few rows (runs of an expert's rows, whole groups)
and many (expert after expert), on whichever ISA build runs (test_portable_kernels runs the lower tiers).

Sizes: in_features are whole 32-blocks for Q8_0 / Q4_0 (hidden and the expert width both), so the odd
shapes here are odd block counts (K = 32 x odd) and group counts not filling a thread's share."""

import gguf
import numpy as np
import pytest
import torch

from perfxlm.model.layers.activation import SiluAndMul
from perfxlm.model.layers.moe import grouped_experts, grouped_experts_torch
from perfxlm.ops import cpu_plan, native
from perfxlm.quant import joining
from perfxlm.quant.gguf_repack import repack
from perfxlm.quant.layouts import CodeLayout
from perfxlm.quant.weight import ActivationMode

Q = gguf.GGMLQuantizationType
TYPES = {8: Q.Q8_0, 4: Q.Q4_0}


def gguf_stack(bits: int, experts: int, n: int, k: int, seed: int = 0):
    """A random GGUF stack [E, N, K] of Q8_0 / Q4_0 blocks (finite float16 scales) as the engine holds it,
    its products under int8 activation blocks (what the row-group layout takes)."""
    qtype = TYPES[bits]
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(experts * n * k // elems, nbytes), dtype=np.uint8)
    raw[:, 0:2] = (rng.uniform(0.5, 1.5, raw.shape[0]) * 1e-2).astype(np.float16).view(np.uint8).reshape(-1, 2)
    w = repack(raw, qtype, (experts, n, k))
    w.use_activations(ActivationMode.INT8_NATIVE)
    return w


def kernels_or_skip():
    ops = native.kernels()
    if ops is None or not hasattr(ops, "moe_experts"):
        pytest.skip("no native MoE kernel in this build")
    return ops


@pytest.mark.parametrize("bits", [8, 4])
def test_a_stack_in_row_groups_is_each_experts_groups(bits):
    stack = gguf_stack(bits, 3, 40, 96, seed=bits)
    grouped = stack.in_row_groups()
    per = 8 * (32 if bits == 8 else 16)
    assert grouped.layout is CodeLayout.ROWS8 and grouped.codes.shape == (3, 5, 3, per)
    assert grouped.scales.shape == (3, 5, 3, 8) and grouped.num_experts == 3 and grouped.shape == stack.shape
    back = grouped.plain()
    assert torch.equal(back.codes, stack.codes) and torch.equal(back.scales, stack.scales)
    for e in range(3):
        one = grouped[e]  # an expert of the stack: a matrix in row groups
        assert one.layout is CodeLayout.ROWS8 and one.num_experts is None and one.shape == (40, 96)
        assert torch.equal(one.codes, stack[e].in_row_groups().codes) and torch.equal(one.plain().codes, stack[e].codes)
    # rows of every expert: whole groups (the last may end at out_features)
    part = grouped.narrow_rows(8, 16)
    assert part.num_experts == 3 and torch.equal(part.plain().codes, stack.narrow_rows(8, 16).codes)
    with pytest.raises(ValueError, match="whole groups"):
        grouped.narrow_rows(4, 8)
    with pytest.raises(ValueError, match="plain"):
        grouped.index_rows(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="plain"):  # stacking reads rows
        joining.stack_experts([grouped[0], grouped[1]])


def _moe(bits: int, num_experts: int, hidden: int, inter: int, seed: int):
    plain = (gguf_stack(bits, num_experts, 2 * inter, hidden, seed), gguf_stack(bits, num_experts, hidden, inter, seed + 1))
    return plain, tuple(w.in_row_groups() for w in plain)


def _routed(num_tokens: int, num_experts: int, top_k: int, hidden: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    weights, ids = torch.softmax(torch.randn(num_tokens, num_experts, generator=g), -1).topk(top_k, dim=-1)
    return x, weights, ids


def _on_three_threads(fn):
    """fn() under inference mode (the engine's) on three threads (runs of rows end mid-way)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with torch.inference_mode():
            return fn()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("hidden,inter", [(96, 160), (224, 32)])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 9, 3), (13, 11, 5), (16, 31, 4), (90, 3, 2)])
def test_the_kernel_on_row_group_stacks_is_the_torch_loops_bits(bits, hidden, inter, num_tokens, num_experts, top_k):
    """Few rows: runs of an expert's intermediate / output rows (starting at multiples of 32: whole groups)
    on the row-group GEMV; down over experts with four per thread (16 tokens, 31 experts); many rows:
    expert after expert, the int8 GEMM reading the groups from the plan's row count. The torch loop takes
    the same experts (w[e], matrices in row groups) to the same kernels: the same bits."""
    kernels_or_skip()
    _, (gate_up, down) = _moe(bits, num_experts, hidden, inter, seed=num_tokens)
    x, weights, ids = _routed(num_tokens, num_experts, top_k, hidden, seed=top_k)
    native_out, looped = _on_three_threads(lambda: (
        grouped_experts(x, weights, ids, gate_up, down, SiluAndMul()),
        grouped_experts_torch(x, weights, ids, gate_up, down, SiluAndMul())))  # fmt: skip
    assert torch.equal(native_out, looped)
    assert native_out.abs().sum() > 0


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("num_tokens", [1, 16, 90])
def test_row_group_stacks_give_the_plain_stacks_values(bits, num_tokens):
    """Against the plain stacks (the kernel, or the torch loop where it does not take them): the products
    round the activations to the same
    int8 blocks and differ only in the order a row's blocks are summed; the expert width's activations are
    rounded to int8 blocks again, where such a last-bit difference may move one step of a block's scale
    (hence a tolerance of a few of those steps, not float32's)."""
    kernels_or_skip()
    num_experts, top_k, hidden, inter = 12, 4, 96, 160
    (pg, pd), (gg, gd) = _moe(bits, num_experts, hidden, inter, seed=3)
    for w in (pg, pd):  # the plain stacks' activations rounded to int8 blocks on every path, as row groups'
        w.use_activations(ActivationMode.INT8)  # (the plain block GEMV takes K in 64s only)
    x, weights, ids = _routed(num_tokens, num_experts, top_k, hidden, seed=num_tokens)
    plain, grouped = _on_three_threads(lambda: (grouped_experts(x, weights, ids, pg, pd, SiluAndMul()),
                                                grouped_experts(x, weights, ids, gg, gd, SiluAndMul())))
    scale = plain.abs().max().item()
    torch.testing.assert_close(grouped, plain, rtol=0, atol=2e-2 * scale)
    # most values agree to float32 rounding (no int8 step moved them)
    close = (grouped - plain).abs() <= 1e-4 * scale
    assert close.float().mean() > 0.9


@pytest.mark.parametrize("bits", [8, 4])
def test_a_row_alone_equals_the_same_row_in_a_batch(bits):
    """Batched decode on row-group stacks (every expert within the GEMV's rows): each row as if alone."""
    kernels_or_skip()
    num_experts, top_k, hidden, inter = 13, 5, 128, 96
    _, (gate_up, down) = _moe(bits, num_experts, hidden, inter, seed=7)
    x, weights, ids = _routed(15, num_experts, top_k, hidden, seed=3)
    plan = cpu_plan.plan()
    previous = cpu_plan.use(quant_max_rows=max(plan.quant_max_rows, 16),
                            quant_block_max_rows=max(plan.quant_block_max_rows, 16) if plan.quant_block_max_rows >= 0 else -1,
                            quant_gemm_rows=max(plan.quant_gemm_rows, 17) if plan.quant_gemm_rows > 0 else plan.quant_gemm_rows)
    try:
        batch = _on_three_threads(lambda: grouped_experts(x, weights, ids, gate_up, down, SiluAndMul()))
        for t in (0, 6, 14):
            one = slice(t, t + 1)
            alone = _on_three_threads(lambda one=one: grouped_experts(x[one], weights[one], ids[one], gate_up, down,
                                                                      SiluAndMul()))
            assert torch.equal(alone[0], batch[t]), f"row {t}"
    finally:
        cpu_plan.use(previous)


def test_the_op_takes_a_row_group_stacks_eight_parts():
    """native_parts of a stack in row groups: its eight parts (layout and the experts' out_features last),
    checked by the op as any stack's are."""
    ops = kernels_or_skip()
    _, (gate_up, down) = _moe(8, 2, 64, 32, seed=1)
    parts = gate_up.native_parts()
    assert len(parts) == 8 and int(parts[6]) == CodeLayout.ROWS8.value.native and int(parts[7]) == 64
    x, weights, ids = _routed(1, 2, 1, 64, seed=0)
    with pytest.raises(RuntimeError, match="stacks of 3 experts"):
        ops.moe_experts(x, weights, ids, parts, None, down.native_parts(), None, 3, 32, 0, 0.0, 0.0, 8, False,
                        True, 8, 8, -1)


def test_without_the_kernels_the_torch_loop_reads_the_plain_values(monkeypatch):
    """No native kernels: the torch loop's experts (w[e], matrices in row groups) run the plain-torch
    reference, which takes plain() and rounds the activations as the layout's products do: the plain
    stacks' values under int8 activation blocks, bit for bit."""
    (pg, pd), (gg, gd) = _moe(4, 5, 64, 96, seed=2)
    for w in (pg, pd):
        w.use_activations(ActivationMode.INT8)
    x, weights, ids = _routed(6, 5, 2, 64, seed=1)
    monkeypatch.setattr(native, "kernels", lambda: None)
    grouped = grouped_experts(x, weights, ids, gg, gd, SiluAndMul())
    plain = grouped_experts(x, weights, ids, pg, pd, SiluAndMul())
    assert torch.equal(grouped, plain) and plain.abs().sum() > 0
