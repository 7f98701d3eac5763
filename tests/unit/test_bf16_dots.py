"""csrc/bf16_dots.cpp: many float32 rows against plain bf16 rows by bf16 dot products (vdpbf16ps where the
build has AVX512-BF16, the same arithmetic in C++ elsewhere), against the plain-torch reference of what it
computes: the activations rounded to bf16, the products exact, float32 sums (only their order differs).
Every build runs it (the tier tests build the lower ones), and each output must not depend on the rows
beside it."""

import pytest
import torch
import torch.nn.functional as F

from perfxlm.ops import cpu_plan, native
from perfxlm.ops.linear import linear


@pytest.fixture(autouse=True)
def _plan_restored():
    cpu_plan.reset()
    yield
    cpu_plan.reset()


@pytest.fixture
def ops():
    ops = native.kernels()
    if ops is None or not hasattr(ops, "linear_bf16_dots"):
        pytest.skip("native kernels unavailable on this machine")
    return ops


def _case(rows, n_out, k, bias, seed):
    torch.manual_seed(seed)
    x = torch.randn(rows, k)
    w = torch.randn(n_out, k).bfloat16()
    b = torch.randn(n_out) if bias else None
    # what the kernel computes, up to float32 summation order
    ref = F.linear(x.bfloat16().double(), w.double(), None if b is None else b.double()).float()
    return x, w, b, ref


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 13, 15, 16, 64, 67])  # 8-row tiles: one whole, 8 + 7, tails
@pytest.mark.parametrize("n_out,k", [(13, 37), (64, 576), (1030, 48), (7, 16), (9, 1), (5, 33), (4, 95)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_bf16_reference(ops, rows, n_out, k, bias):
    x, w, b, ref = _case(rows, n_out, k, bias, rows * 31 + n_out + k)
    out = ops.linear_bf16_dots(x, w, b)
    assert out.shape == ref.shape and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, ref, atol=2e-5 * k**0.5, rtol=1e-5)


def test_each_row_is_the_same_alone_and_in_any_batch(ops):
    # every x row gets the same tiles' arithmetic wherever it falls: bit-identical outputs
    x, w, b, _ = _case(53, 70, 600, True, 5)
    whole = ops.linear_bf16_dots(x, w, b)
    for rows in (1, 3, 6, 7, 16, 29):
        start = 53 - rows
        assert torch.equal(ops.linear_bf16_dots(x[start:], w, b), whole[start:])
    assert torch.equal(ops.linear_bf16_dots(x[17:18], w, b), whole[17:18])


@pytest.mark.parametrize("n_out", [1, 2, 4, 5, 7, 97, 200, 1030])
def test_the_same_bits_with_any_thread_count_and_walk(ops, n_out):
    # up to 16 rows a thread's weight rows are cut into parts read side by side, past 16 adjacent tiles
    # are walked: neither the cut (which moves with the thread count and the tails) nor the walk may
    # change a bit of any output
    x, w, b, ref = _case(16, n_out, 70, True, n_out)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(ops.linear_bf16_dots(x, w, b))
    finally:
        torch.set_num_threads(before)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    torch.testing.assert_close(outs[0], ref, atol=2e-5 * 70**0.5, rtol=1e-5)
    assert torch.equal(ops.linear_bf16_dots(torch.cat([x, x, x]), w, b)[16:32], outs[0])  # 48 rows: blocks


def test_non_finite_and_strided_inputs(ops):
    x, w, _, _ = _case(8, 20, 64, False, 2)
    x[3, 5] = float("inf")
    out = ops.linear_bf16_dots(x[:, :40], w[:, :40].contiguous(), None)  # x strided: taken contiguous
    ref = F.linear(x[:, :40].bfloat16().double(), w[:, :40].double()).float()
    assert not torch.isfinite(out[3]).any() or torch.isinf(out[3]).any()
    torch.testing.assert_close(out[[0, 1, 2, 4, 5, 6, 7]], ref[[0, 1, 2, 4, 5, 6, 7]], atol=1e-4, rtol=1e-5)


def test_empty_and_bad_inputs(ops):
    assert ops.linear_bf16_dots(torch.randn(0, 8), torch.randn(3, 8).bfloat16(), None).shape == (0, 3)
    b = torch.randn(3)
    assert torch.equal(ops.linear_bf16_dots(torch.randn(2, 0), torch.randn(3, 0).bfloat16(), b), b.expand(2, 3))
    with pytest.raises(RuntimeError, match="features"):
        ops.linear_bf16_dots(torch.randn(2, 8), torch.randn(4, 9).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bias size"):
        ops.linear_bf16_dots(torch.randn(2, 9), torch.randn(4, 9).bfloat16(), torch.randn(3))
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        ops.linear_bf16_dots(torch.randn(2, 9), torch.randn(9, 4).bfloat16().t(), None)


def test_the_plan_routes_rows_past_the_row_kernel_to_it(ops):
    # module path and fused layer (csrc project) both: the plan's setting reaches the kernels
    x, w, b, ref = _case(20, 40, 96, True, 9)
    cpu_plan.use(layout="rows", gemm="bf16", native_max_rows=4, bf16_dots=True)
    assert ops.bf16_dots()
    out = linear(x, w, b)
    assert torch.equal(out, ops.linear_bf16_dots(x, w, b))
    assert torch.equal(ops.lora_project(x, [w], 40, b, 4, True, False, -1, -1, -1, [], 0), out)  # the fused layer's
    cpu_plan.use(bf16_dots=False)
    assert not ops.bf16_dots()
    torch.testing.assert_close(linear(x, w, b), ref, atol=2e-2 * 96**0.5, rtol=2e-2)  # torch's bf16 GEMM


def test_plan_from_environment(monkeypatch):
    monkeypatch.setenv("PERFXLM_BF16_DOTS", "0")
    assert not cpu_plan.detect().bf16_dots
    monkeypatch.setenv("PERFXLM_BF16_DOTS", "1")
    assert cpu_plan.detect().bf16_dots
    monkeypatch.setenv("PERFXLM_BF16_DOTS", "yes")
    with pytest.raises(ValueError, match="PERFXLM_BF16_DOTS"):
        cpu_plan.detect()
