"""GGUF K-quants kept with two-level scales (quant/super_scales.py): Q4_K / Q5_K (a byte scale and min per
32, float16 d and dmin per 256) and Q6_K (centred 8-bit codes, an int8 scale per 16, float16 d per 256)
in the native products (csrc/quant_linear.cpp): the same bits as the weight with its scales multiplied out
to float32 on every path (GEMV, int8 block products, slab GEMM), within float tolerance of the plain
reference, a row alone equal to the row in a batch; the row and column cuts, stacks and fusions the
engine makes; bad shapes refused by name. Built for AVX2 and scalar too by test_portable_kernels."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from perfxlm.quant.reference import fake_quantize_blocks
from perfxlm.quant import act_blocks, joining
from perfxlm.ops import native
from perfxlm.quant import QuantizedWeight
from perfxlm.quant.gguf_repack import repack

Q = gguf.GGMLQuantizationType
KQUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
_F16_AT = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def k_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random block bytes with finite float16 d / dmin (random bytes there would make inf / nan)."""
    rng = np.random.default_rng(seed)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block_elems * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(-1, block_bytes)
    for at in _F16_AT[qtype]:
        blocks[:, at : at + 2] = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


def _gguf(raw: np.ndarray, qtype: Q, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype), dtype=np.float32)).view(rows, cols)


def _call(ops, x, w: QuantizedWeight, bias, max_rows, blocks, block_max_rows=-1):
    return ops.linear_q(x, w.codes, w.scales, w.mins, None, bias, False, max_rows, False, blocks, block_max_rows)


def _block_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 block kernels see it for a K-quant weight (perfxlm.quant.act_blocks' arithmetic: by
    default ggml's q8_K, a scale per 256)."""
    return fake_quantize_blocks(x.float().contiguous(), kquant=True)


def _same_bits_as_flat(ops, x, w, flat, bias, max_rows, blocks) -> None:
    """The two-level bytes give the bits of their float32 form: without int8 blocks in any mode; with them
    where both round activations alike (fine: blocks of 32; the flat form is no K-quant to the kernels,
    so under ggml it does not take q8_K)."""
    if blocks and act_blocks.mode() == "ggml":
        with act_blocks.using("fine"):
            assert torch.equal(_call(ops, x, w, bias, max_rows, blocks), _call(ops, x, flat, bias, max_rows, blocks))
    else:
        assert torch.equal(_call(ops, x, w, bias, max_rows, blocks), _call(ops, x, flat, bias, max_rows, blocks))


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("n,k", [(1, 256), (7, 512), (33, 768), (13, 256)])
def test_dequantize_bit_exact_and_products_match(qtype, n, k):
    ops = native.kernels()
    raw = k_blocks(qtype, n, k, n * k + int(qtype))
    w = repack(raw, qtype, (n, k))
    want = _gguf(raw, qtype, n, k)
    assert w.two_level and torch.equal(w.dequantize(), want)  # bit for bit, as gguf-py
    if ops is None:
        pytest.skip("no compiler for the native kernels")
    flat = w.flat()
    torch.testing.assert_close(ops.dequantize_q(w.codes, w.scales, w.mins, None, k), want, rtol=1e-6, atol=1e-6)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(k + n)) * 2
    x[1, 32:64] = 0.0  # an all-zero activation block
    x[2, 5] = 40.0  # an outlier
    b = torch.randn(n, generator=torch.Generator().manual_seed(n))
    for blocks in (False, True):
        x_used = _block_rounded(x) if blocks and ops.int8_block_dots() else x
        ref = F.linear(x_used.double(), want.double(), b.double()).float()
        tol = dict(atol=1e-4 * (ref.abs().max().item() + 1), rtol=1e-4)
        for max_rows in (70, 4, 0):  # the GEMV / block kernels, then the slab GEMM past max_rows
            out = _call(ops, x, w, b, max_rows, blocks)
            # the kernels multiply the scales out to the float32 values the flat form holds: the same bits
            _same_bits_as_flat(ops, x, w, flat, b, max_rows, blocks)
            torch.testing.assert_close(out, ref, **tol)
        together = _call(ops, x, w, b, 70, blocks)
        for rows in (1, 2, 3, 5, 17):
            part = _call(ops, x[:rows], w, b, 70, blocks)
            if blocks and ops.int8_block_dots():
                assert torch.equal(part, together[:rows])  # a row alone: the bits it has in a batch
            torch.testing.assert_close(part, ref[:rows], **tol)


def test_many_rows_cross_the_expanded_runs():
    """Rows expand their scales in runs of 32: 1031 rows (runs, tiles and a tail) give the flat form's bits."""
    ops = native.kernels()
    if ops is None:
        pytest.skip("no compiler for the native kernels")
    n, k = 1031, 256
    for qtype in (Q.Q4_K, Q.Q6_K):
        w = repack(k_blocks(qtype, n, k, 5), qtype, (n, k))
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
        for blocks in (False, True):
            _same_bits_as_flat(ops, x[:1], w, w.flat(), None, 8, blocks)
            _same_bits_as_flat(ops, x, w, w.flat(), None, 8, blocks)


def test_cuts_stacks_and_fusions_keep_the_values():
    n, k = 9, 768
    q4 = repack(k_blocks(Q.Q4_K, n, k, 1), Q.Q4_K, (n, k))
    q4b = repack(k_blocks(Q.Q4_K, 5, k, 2), Q.Q4_K, (5, k))
    q6 = repack(k_blocks(Q.Q6_K, n, k, 3), Q.Q6_K, (n, k))
    dense = q4.dequantize()
    # tensor-parallel column cut on super-blocks keeps the form; a cut inside one multiplies the scales out
    cut = q4.narrow_columns(256, 512)
    assert cut.two_level and torch.equal(cut.dequantize(), dense[:, 256:768])
    fine = q4.narrow_columns(32, 224)
    assert not fine.two_level and torch.equal(fine.dequantize(), dense[:, 32:256])
    assert torch.equal(q6.narrow_columns(512, 256).dequantize(), q6.dequantize()[:, 512:])
    assert torch.equal(q4.narrow_rows(2, 5).dequantize(), dense[2:7])
    assert torch.equal(q4.index_rows(torch.tensor([8, 0, 3])).dequantize(), dense[[8, 0, 3]])
    assert torch.equal(q4.zero_rows(3).dequantize(), torch.zeros(3, k))
    # one form: rows concatenate as bytes; mixed forms: the common float form
    same = joining.cat_rows([q4, q4b])
    assert same.two_level and torch.equal(same.dequantize(), torch.cat([dense, q4b.dequantize()]))
    mixed = joining.cat_rows([q4, q6])
    assert not mixed.two_level  # Q6_K's implied min stored beside Q4_K's: u x s + m, two roundings
    torch.testing.assert_close(mixed.dequantize(), torch.cat([dense, q6.dequantize()]), rtol=0, atol=1e-5)
    stack = joining.stack_experts([q4, repack(k_blocks(Q.Q4_K, n, k, 4), Q.Q4_K, (n, k))])
    assert stack.two_level and torch.equal(stack[0].dequantize(), dense)
    raw = k_blocks(Q.Q6_K, 2 * n, k, 6)
    experts = repack(raw, Q.Q6_K, (2, n, k))  # a GGUF expert stack
    assert experts.two_level and torch.equal(experts[1].dequantize(), _gguf(raw, Q.Q6_K, 2 * n, k)[n:])


def test_bad_two_level_shapes_are_errors():
    n, k = 5, 512
    w = repack(k_blocks(Q.Q4_K, n, k, 7), Q.Q4_K, (n, k))
    with pytest.raises(ValueError, match="two-level scales"):
        QuantizedWeight(w.codes, w.scales[:, :-2].contiguous(), w.mins, None, 4, 32, "float", n, k)
    with pytest.raises(ValueError, match="two-level mins"):
        QuantizedWeight(w.codes, w.scales, w.mins.view(torch.int8), None, 4, 32, "float", n, k)
    ops = native.kernels()
    if ops is None:
        return
    x = torch.randn(2, k)
    with pytest.raises(RuntimeError, match="two-level scales"):
        ops.linear_q(x, w.codes, w.scales[:, :-4].contiguous(), None, None, None, False, 8, False, False, -1)
    with pytest.raises(RuntimeError, match="two-level mins"):
        ops.linear_q(x, w.codes, w.scales, w.mins[:, :-2].contiguous(), None, None, False, 8, False, False, -1)
    with pytest.raises(RuntimeError, match="W8A8"):
        ops.linear_q(x, w.codes, w.scales, w.mins, None, None, True, 8, False, False, -1)
