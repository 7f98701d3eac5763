"""The linear dispatch (bf16 weights under float32 compute) against F.linear on the widened weights, on
every path of every CPU plan (rows / panels layout, native kernel, bf16 GEMM, float32 GEMM), whatever CPU
runs the tests: a path this CPU lacks natively is emulated by torch, so its results are still checked."""

import pytest
import torch
import torch.nn.functional as F

from perfxlm.ops import linear as linear_ops
from perfxlm.ops import cpu_plan, isa, native
from perfxlm.ops.linear import linear, pack_bf16, unpack_bf16


@pytest.fixture(autouse=True)
def _plan_restored():
    cpu_plan.reset()
    yield
    cpu_plan.reset()


@pytest.fixture
def ops():
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    return native.kernels()


def _case(rows, n_out, k, bias, seed):
    torch.manual_seed(seed)
    x = torch.randn(rows, k)
    w = torch.randn(n_out, k).bfloat16()
    b = torch.randn(n_out) if bias else None
    return x, w, b, F.linear(x, w.float(), b)


@pytest.mark.parametrize("n_out,k", [(13, 37), (64, 576), (1030, 48), (7, 16), (33, 1)])
def test_pack_round_trip(n_out, k):
    w = torch.randn(n_out, k).bfloat16()
    packed = pack_bf16(w)
    assert packed.shape == (-(-n_out // 16), k, 16)
    assert torch.equal(unpack_bf16(packed, n_out), w)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 9, 13, 16, 17, 32, 33, 70, 130, 300])
@pytest.mark.parametrize("n_out,k", [(13, 37), (64, 576), (1030, 48), (7, 16)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("panel_gemm", ["kernel", "float32"])
def test_packed_bf16_matches_widened_reference(rows, n_out, k, bias, panel_gemm):
    """Rows up to native_max_rows (256) take the native kernel, more take it too (panel_gemm="kernel")
    or widened slabs + float32 GEMM."""
    cpu_plan.use(layout="panels", gemm="float32", native_max_rows=256, panel_gemm=panel_gemm)
    x, w, b, ref = _case(rows, n_out, k, bias, rows * 1000 + n_out + k)
    out = linear(x, pack_bf16(w), b, n_out)
    assert out.shape == ref.shape and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, ref, atol=1e-4 * k**0.5, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 40, 200])
def test_slabs_with_a_ragged_last_one(monkeypatch, rows):
    cpu_plan.use(native_max_rows=0)
    monkeypatch.setattr(linear_ops, "SLAB_COLUMNS", 32)
    monkeypatch.setattr(linear_ops, "BIG_SLAB_ELEMENTS", 32 * 50)
    x, w, b, ref = _case(rows, 83, 50, True, rows)  # 6 panels in slabs of 2, the last one padded
    torch.testing.assert_close(linear(x, pack_bf16(w), b, 83), ref, atol=1e-4, rtol=1e-4)


def test_native_kernel_called_directly(ops):
    x, w, _, ref = _case(9, 333, 200, False, 0)
    torch.testing.assert_close(ops.linear_bf16_packed(x, pack_bf16(w), 333, None), ref, atol=1e-4, rtol=1e-4)


def test_leading_dims_and_plain_weights():
    x = torch.randn(2, 3, 40)
    w = torch.randn(24, 40)
    torch.testing.assert_close(linear(x, w), F.linear(x, w))
    out = linear(x, pack_bf16(w.bfloat16()), None, 24)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out, F.linear(x, w.bfloat16().float()), atol=1e-4, rtol=1e-4)
    # plain bf16 rows: the row kernel where compiled, else widened per call
    cpu_plan.use(layout="rows", native_max_rows=8)
    torch.testing.assert_close(linear(x, w.bfloat16()), F.linear(x, w.bfloat16().float()), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [2, 5, 6, 7, 13, 16, 25, 64, 131])  # AVX-512: 16-row tiles, 8 + 5, 16 + 8 + 1
@pytest.mark.parametrize("n_out,k", [(7, 16), (40, 33), (333, 200), (50, 2000)])
def test_packed_kernel_row_alone_equals_the_row_in_a_batch(ops, rows, n_out, k):
    # every column is one float32 FMA chain over k whatever the row tile, the block of rows (k = 2000:
    # 131 rows in blocks of 48) or batch 1's two-stream walk: a bfloat16 model's greedy text does not depend on
    # the batch
    x, w, b, _ = _case(rows, n_out, k, True, rows + n_out + k)
    packed = pack_bf16(w)
    batch = ops.linear_bf16_packed(x, packed, n_out, b)
    for i in range(rows):
        assert torch.equal(ops.linear_bf16_packed(x[i : i + 1], packed, n_out, b)[0], batch[i]), i
    assert torch.equal(ops.linear_bf16_packed(x[1:], packed, n_out, b), batch[1:])


def test_bad_shapes_raise_clear_errors(ops):
    with pytest.raises(RuntimeError, match="features"):
        ops.linear_bf16_packed(torch.randn(2, 8), pack_bf16(torch.randn(4, 9).bfloat16()), 4, None)
    with pytest.raises(RuntimeError, match="panels"):
        ops.linear_bf16_packed(torch.randn(2, 9), pack_bf16(torch.randn(4, 9).bfloat16()), 40, None)
    with pytest.raises(RuntimeError, match="bias size"):
        ops.linear_bf16_packed(torch.randn(2, 9), pack_bf16(torch.randn(4, 9).bfloat16()), 4, torch.randn(3))


# rows layout: (gemm, native_max_rows, bf16_dots) -> every row count below takes the native kernel, torch's
# bf16 GEMM, the bf16 dot-product kernel or the widened float32 GEMM
ROWS_PATHS = {"native": ("bf16", 1 << 30, False), "bf16-gemm": ("bf16", 0, False), "dots": ("bf16", 0, True),
              "fp32-gemm": ("float32", 0, False), "auto-split": ("bf16", 4, True)}


@pytest.mark.parametrize("path", list(ROWS_PATHS))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16, 33, 130])
@pytest.mark.parametrize("n_out,k", [(13, 37), (64, 576), (1030, 48), (7, 16), (9, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_rows_every_path(path, rows, n_out, k, bias):
    gemm, max_rows, dots = ROWS_PATHS[path]
    cpu_plan.use(layout="rows", gemm=gemm, native_max_rows=max_rows, bf16_dots=dots)
    x, w, b, ref = _case(rows, n_out, k, bias, rows * 7 + n_out + k)
    out = linear(x, w, b)
    assert out.shape == ref.shape and out.dtype == torch.float32
    if gemm == "bf16" and rows > max_rows:
        # activations rounded to bf16 (and the product to bf16): bf16 tolerance
        torch.testing.assert_close(out, ref, atol=2e-2 * k**0.5, rtol=2e-2)
    else:
        torch.testing.assert_close(out, ref, atol=1e-4 * k**0.5, rtol=1e-4)


def test_rows_kernel_called_directly_and_bad_input(ops):
    x, w, b, ref = _case(6, 333, 200, True, 1)
    torch.testing.assert_close(ops.linear_bf16_rows(x, w, b), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ops.linear_bf16_rows(x[:, :100], w[:, :100].contiguous(), None),
                               F.linear(x[:, :100], w[:, :100].float()), atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="features"):
        ops.linear_bf16_rows(torch.randn(2, 8), torch.randn(4, 9).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bias size"):
        ops.linear_bf16_rows(torch.randn(2, 9), torch.randn(4, 9).bfloat16(), torch.randn(3))
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        ops.linear_bf16_rows(torch.randn(2, 9), torch.randn(9, 4).bfloat16().t(), None)


@pytest.mark.parametrize("n_out", [1, 2, 7, 333])
@pytest.mark.parametrize("k", [16, 200])
@pytest.mark.parametrize("m", [6, 11])
def test_rows_kernel_row_alone_equals_the_row_in_a_batch(ops, n_out, k, m):
    # up to 8 rows walk a task's weight rows in two halves side by side (past the register chunk of x rows
    # too), more take the tiles; each row keeps one summation order, so a bfloat16 model's greedy text does
    # not depend on the batch, nor on how many verification rows a speculative step carries
    x, w, b, _ = _case(m, n_out, k, True, n_out + k + m)
    batch = ops.linear_bf16_rows(x, w, b)
    for i in range(m):
        assert torch.equal(ops.linear_bf16_rows(x[i : i + 1], w, b)[0], batch[i])
    for rows in range(2, m):
        assert torch.equal(ops.linear_bf16_rows(x[:rows].contiguous(), w, b), batch[:rows])


def test_plan_from_environment(monkeypatch):
    monkeypatch.setenv("PERFXLM_BF16_LAYOUT", "panels")
    monkeypatch.setenv("PERFXLM_BF16_GEMM", "bf16")
    monkeypatch.setenv("PERFXLM_NATIVE_MAX_ROWS", "7")
    monkeypatch.setenv("PERFXLM_BF16_COMPUTE", "bfloat16")
    monkeypatch.setenv("PERFXLM_QUANT_MAX_ROWS", "3")
    plan = cpu_plan.detect()
    assert (plan.layout, plan.gemm, plan.native_max_rows, plan.bf16_compute) == ("panels", "bf16", 7, "bfloat16")
    assert plan.quant_max_rows == 3
    monkeypatch.setenv("PERFXLM_QUANT_BLOCK_MAX_ROWS", "5")  # 4-bit codes and heads: their own limit
    assert cpu_plan.detect().quant_block_max_rows == 5 and "(4-bit and heads: 5)" in cpu_plan.detect().describe()
    monkeypatch.setenv("PERFXLM_QUANT_BLOCK_MAX_ROWS", "-2")
    with pytest.raises(ValueError, match="PERFXLM_QUANT_BLOCK_MAX_ROWS"):
        cpu_plan.detect()
    monkeypatch.delenv("PERFXLM_QUANT_BLOCK_MAX_ROWS")
    monkeypatch.setenv("PERFXLM_QUANT_MAX_ROWS", "many")
    with pytest.raises(ValueError, match="PERFXLM_QUANT_MAX_ROWS"):
        cpu_plan.detect()
    monkeypatch.delenv("PERFXLM_QUANT_MAX_ROWS")
    assert "layout=panels" in plan.describe()
    monkeypatch.setenv("PERFXLM_BF16_LAYOUT", "diagonal")
    with pytest.raises(ValueError, match="PERFXLM_BF16_LAYOUT.*rows, panels"):
        cpu_plan.detect()
    monkeypatch.setenv("PERFXLM_BF16_LAYOUT", "auto")
    monkeypatch.setenv("PERFXLM_NATIVE_MAX_ROWS", "-1")
    with pytest.raises(ValueError, match="PERFXLM_NATIVE_MAX_ROWS"):
        cpu_plan.detect()
    monkeypatch.delenv("PERFXLM_NATIVE_MAX_ROWS")
    for value in cpu_plan.PANEL_GEMMS:
        monkeypatch.setenv("PERFXLM_BF16_PANEL_GEMM", value)
        assert cpu_plan.detect().panel_gemm == value
    monkeypatch.setenv("PERFXLM_BF16_PANEL_GEMM", "mkl")
    with pytest.raises(ValueError, match="PERFXLM_BF16_PANEL_GEMM.*kernel, float32"):
        cpu_plan.detect()
    monkeypatch.delenv("PERFXLM_BF16_PANEL_GEMM")
    # the default per forced tier (a tier this CPU lacks is skipped): the kernel on every SIMD build, MKL on
    # widened slabs on the scalar build (its loop)
    for tier, want in (("scalar", "float32"), ("avx2", "kernel"), ("avx512_vnni", "kernel")):
        if tier in isa.supported():
            monkeypatch.setenv("PERFXLM_ISA", tier)
            assert cpu_plan.detect().panel_gemm == want, tier
    monkeypatch.delenv("PERFXLM_ISA", raising=False)
    for name in ("PERFXLM_BF16_LAYOUT", "PERFXLM_BF16_GEMM", "PERFXLM_BF16_COMPUTE"):
        monkeypatch.delenv(name)
    auto = cpu_plan.detect()  # whatever this CPU gets, it is one of the known paths
    assert auto.layout in cpu_plan.LAYOUTS and auto.gemm in cpu_plan.GEMMS and auto.native_max_rows >= 0
    assert auto.panel_gemm in cpu_plan.PANEL_GEMMS


@pytest.mark.parametrize("fast_bf16, amx, rows, block_rows, gemm",
                         [(False, False, 32, 128, None), (True, False, 8, -1, "int8"), (True, True, 8, -1, "float32")])
def test_quantized_row_limits_follow_fast_bf16_and_amx(monkeypatch, fast_bf16, amx, rows, block_rows, gemm):
    """Without fast bf16 (AVX2, AVX-512 without BF16) the int8 products keep more rows; with it, 8 (a
    bfloat16 model's chunks on one kernel), past which AVX512-BF16 alone (Zen 4) takes the int8 GEMM and
    AMX its bf16 GEMM. Either way, on any CPU."""
    for name in ("PERFXLM_QUANT_MAX_ROWS", "PERFXLM_QUANT_BLOCK_MAX_ROWS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu_plan.isa, "has_fast_bf16", lambda: fast_bf16)
    monkeypatch.setattr(cpu_plan.isa, "has_amx", lambda: amx)
    monkeypatch.delenv("PERFXLM_QUANT_GEMM", raising=False)
    plan = cpu_plan.detect()
    assert (plan.quant_max_rows, plan.quant_block_max_rows) == (rows, block_rows)
    if gemm is not None and "avx512_vnni" in cpu_plan.isa.visible_flags():
        assert plan.quant_gemm == gemm and plan.quant_gemm_rows == 0
