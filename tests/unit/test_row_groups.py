"""Row groups (perfxlm/quant/row_groups.py, csrc/row_groups.h): the layout's bytes against the plain
layout's, and the native GEMV on it against the plain-torch reference, for GGUF Q8_0 and Q4_0 blocks, at
odd row counts (a last group of fewer than 8 rows) and block counts (K not a multiple of 64), one and
several activation rows, on whichever ISA build runs (test_portable_kernels runs the lower tiers)."""

import gguf
import numpy as np
import pytest
import torch

from perfxlm.quant import joining
from perfxlm.ops import native
from perfxlm.quant import reference, row_groups
from perfxlm.quant.gguf_repack import repack

Q = gguf.GGMLQuantizationType
TYPES = {8: Q.Q8_0, 4: Q.Q4_0}


def gguf_weight(bits: int, n: int, k: int, seed: int = 0):
    """Random GGUF blocks (finite float16 scales) as the engine holds them."""
    qtype = TYPES[bits]
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
    raw[:, 0:2] = (rng.uniform(0.5, 1.5, raw.shape[0]) * 1e-2).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return repack(raw, qtype, (n, k))


def ops_or_skip():
    ops = native.kernels()
    if ops is None or not hasattr(ops, "linear_q_rows8"):
        pytest.skip("no native row-group kernel in this build")
    return ops


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,k", [(1, 32), (13, 96), (16, 64), (37, 160), (8, 576)])
def test_pack_moves_bytes_and_unpack_inverts_it(bits, n, k):
    w = gguf_weight(bits, n, k)
    assert row_groups.takes(w)
    codes8, scales8 = row_groups.pack(w.codes, w.scales, bits)
    groups, blocks = -(-n // 8), k // 32
    assert codes8.shape == (groups, blocks, 8 * (32 if bits == 8 else 16)) and codes8.dtype == torch.uint8
    assert scales8.shape == (groups, blocks, 8) and scales8.dtype == torch.float16
    # row r's quad q of block b sits at [group, b, (q * 8 + r % 8) * 4 : ... + 4]
    per = 32 if bits == 8 else 16
    for r in {0, n - 1, n // 2}:
        for b in {0, blocks - 1}:
            for q in {0, per // 4 - 1}:
                got = codes8[r // 8, b, (q * 8 + r % 8) * 4:(q * 8 + r % 8) * 4 + 4]
                assert torch.equal(got, w.codes[r, b * per + 4 * q:b * per + 4 * q + 4])
            assert scales8[r // 8, b, r % 8] == w.scales[r, b]
    if n % 8:  # the padding rows are zeros
        assert not scales8[-1, :, n % 8:].any() and not codes8.view(groups, blocks, -1, 8, 4)[-1, :, :, n % 8:].any()
    c, s = row_groups.unpack(codes8, scales8, bits, n)
    assert torch.equal(c, w.codes) and torch.equal(s, w.scales)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,k", [(1, 32), (13, 96), (37, 160), (64, 576), (45, 1536)])
@pytest.mark.parametrize("rows", [1, 3])
def test_native_product_matches_the_reference(bits, n, k, rows):
    ops = ops_or_skip()
    w = gguf_weight(bits, n, k, seed=n + k)
    codes8, scales8 = row_groups.pack(w.codes, w.scales, bits)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0  # an all-zero activation block (scale 0)
    bias = torch.randn(n) if rows == 3 else None
    y = ops.linear_q_rows8(x, codes8, scales8, bits, n, bias)
    ref = reference.block_reference_linear(x, w, bias)
    assert y.shape == (rows, n)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows,k", [(2, 224), (3, 160), (5, 224), (6, 320), (7, 96)])
def test_a_row_alone_gives_the_bits_it_has_in_a_batch(bits, rows, k):
    # the GEMV runs rows in tiles that share each block's codes (row_groups_run.h): every tile size and
    # remainder, odd and even block counts
    ops = ops_or_skip()
    n = 21
    w = gguf_weight(bits, n, k, seed=5)
    codes8, scales8 = row_groups.pack(w.codes, w.scales, bits)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7))
    batch = ops.linear_q_rows8(x, codes8, scales8, bits, n, None)
    torch.testing.assert_close(batch, reference.block_reference_linear(x, w, None), rtol=1e-5,
                               atol=1e-5 * batch.abs().max().item())
    for m in range(rows):
        assert torch.equal(ops.linear_q_rows8(x[m:m + 1], codes8, scales8, bits, n, None)[0], batch[m])


def test_the_op_refuses_a_layout_that_is_not_row_groups():
    ops = ops_or_skip()
    w = gguf_weight(8, 16, 64)
    with pytest.raises(RuntimeError, match="row"):
        ops.linear_q_rows8(torch.randn(1, 64), w.codes, w.scales, 8, 16, None)


# ---- the layout on QuantizedWeight, and the engine's consumers of it ------------------------------------

from perfxlm.ops import cpu_plan  # noqa: E402
from perfxlm.ops.linear import run_linear_q  # noqa: E402
from perfxlm.quant.layouts import CodeLayout  # noqa: E402
from perfxlm.quant.reference import fake_quantize_blocks  # noqa: E402
from perfxlm.quant.weight import ActivationMode, QuantizedWeight  # noqa: E402


def grouped(bits, n, k, seed=0):
    """A plain GGUF weight with int8 activation blocks, and the same weight in row groups."""
    w = gguf_weight(bits, n, k, seed)
    w.use_activations(ActivationMode.INT8_NATIVE)
    return w, w.in_row_groups()


@pytest.mark.parametrize("bits", [8, 4])
def test_the_layout_moves_bytes_and_plain_gives_them_back(bits):
    w, r = grouped(bits, 21, 96)
    assert r.layout is CodeLayout.ROWS8 and r.shape == w.shape and r.num_experts is None and "rows8" in r.describe()
    assert r.codes.shape == (3, 3, 8 * (32 if bits == 8 else 16)) and r.scales.shape == (3, 3, 8)
    back = r.plain()
    assert back.layout is CodeLayout.PLAIN and torch.equal(back.codes, w.codes) and torch.equal(back.scales, w.scales)
    assert torch.equal(r.dequantize(), w.dequantize()) and torch.equal(r.dense(), w.dense())
    assert r.in_row_groups() is r and w.plain() is w
    # lookups gather the rows straight out of the groups (a tied embedding table)
    ids = torch.tensor([[20, 0, 7], [8, 8, 15]])
    assert torch.equal(r.embedding(ids), w.embedding(ids))
    assert torch.equal(r.narrow_rows(8, 13).dequantize(), w.narrow_rows(8, 13).dequantize())
    assert r.native_parts()[6].item() == CodeLayout.ROWS8.value.native and r.native_parts()[7].item() == 21


def test_methods_that_read_rows_refuse_row_groups():
    w, r = grouped(8, 16, 64)
    for call in (lambda: r.narrow_columns(0, 32), lambda: r.zero_rows(3), lambda: r.widened(8) and r.regrouped(16),
                 lambda: r.with_mins(), lambda: joining.cat_rows([r, w]), lambda: r.narrow_rows(3, 8),
                 lambda: r.unpacked_codes(), lambda: r.use_activations(ActivationMode.FLOAT)):
        with pytest.raises(ValueError, match="plain|whole groups"):
            call()
    with pytest.raises(ValueError, match="int8"):  # float activations keep the plain layout
        gguf_weight(8, 16, 64).in_row_groups()
    stack = joining.stack_experts([w, w]).in_row_groups()  # a stack takes them (each expert its groups) ...
    for call in (lambda: stack.index_rows(torch.tensor([0])), lambda: joining.stack_experts([stack[0], stack[1]])):
        with pytest.raises(ValueError, match="plain"):  # ... and what reads its rows refuses them
            call()


def _plan_rows(**changes):
    previous = cpu_plan.use(**changes)
    return previous


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,k", [(13, 96), (40, 576), (45, 160)])
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_module_path_products_on_row_groups(bits, n, k, rows):
    ops = ops_or_skip()
    w, r = grouped(bits, n, k, seed=n * rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + n))
    bias = torch.randn(n)
    previous = cpu_plan.use(quant_max_rows=8, quant_block_max_rows=-1, quant_gemm="float32")
    try:
        got = run_linear_q(ops, x, r, bias, False, True, False)
        # within the GEMV's rows its own kernel; past them the plain rows on the same rounded activations
        ref = reference.block_reference_linear(x, w, bias)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        if rows > 8:  # past the GEMV: the plain layout's own product of the rounded rows, bit for bit
            plain = ops.linear_q(fake_quantize_blocks(x), w.codes, w.scales, None, None, bias, False, 8, False)
            assert torch.equal(got, plain)
    finally:
        cpu_plan.use(previous)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,k,rows", [(13, 96, 3), (37, 160, 40), (64, 576, 17), (100, 1536, 65)])
def test_the_int8_gemm_reads_row_groups_as_its_panels(bits, n, k, rows):
    ops = ops_or_skip()
    w, r = grouped(bits, n, k, seed=k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n) if rows % 2 else None
    if int(ops.quant_block_gemm_max_code()) < 255:
        # a build without the GEMM (scalar): the op says so for row groups as for the plain layout, and
        # linear_q, told to use it, runs the rounded rows without it
        with pytest.raises(RuntimeError, match="no int8 GEMM"):
            ops.quant_block_gemm(x, r.codes, r.scales, None, None, bias, 1, n)
        previous = cpu_plan.use(quant_gemm="int8", quant_gemm_rows=2)
        try:
            got = run_linear_q(ops, x, r, bias, False, True, False)
        finally:
            cpu_plan.use(previous)
        ref = reference.block_reference_linear(x, w, bias)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        return
    plain = ops.quant_block_gemm(x, w.codes, w.scales, None, None, bias)
    # the same panels, so the same bits
    assert torch.equal(ops.quant_block_gemm(x, r.codes, r.scales, None, None, bias, 1, n), plain)
    previous = cpu_plan.use(quant_gemm="int8", quant_gemm_rows=2)
    try:  # and linear_q hands it many rows
        assert torch.equal(run_linear_q(ops, x, r, bias, False, True, False), plain)
    finally:
        cpu_plan.use(previous)


@pytest.mark.parametrize("bits", [8, 4])
def test_row_group_products_of_a_row_do_not_depend_on_the_batch(bits):
    ops = ops_or_skip()
    w, r = grouped(bits, 45, 320, seed=3)
    x = torch.randn(8, 320, generator=torch.Generator().manual_seed(9))
    batch = ops.linear_q(x, r.codes, r.scales, None, None, None, False, 8, False, True, -1, -1, 1, 45)
    for m in range(8):
        alone = ops.linear_q(x[m:m + 1], r.codes, r.scales, None, None, None, False, 8, False, True, -1, -1, 1, 45)
        assert torch.equal(alone[0], batch[m])


@pytest.mark.parametrize("bits", [8, 4])
def test_the_fused_projection_and_its_lora_ranges_take_row_groups(bits):
    ops = ops_or_skip()
    if not hasattr(ops, "lora_project"):
        pytest.skip("no fused projection op in this build")
    w, r = grouped(bits, 77, 192, seed=4)
    x = torch.randn(2, 192, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(77)
    want = ops.linear_q(x, r.codes, r.scales, None, None, bias, False, 8, False, True, -1, -1, 1, 77)
    ref = reference.block_reference_linear(x, w, bias)
    torch.testing.assert_close(want, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    got = ops.lora_project(x, r.native_parts(), 77, bias, 8, False, True, 8, -1, -1, [], 0)
    assert torch.equal(got, want)
