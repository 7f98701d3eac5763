"""Row groups (perfxlm/quant/row_groups.py, csrc/row_groups.h): the layout's bytes against the plain
layout's, and the native GEMV on it against the plain-torch reference, for GGUF Q8_0 and Q4_0 blocks, at
odd row counts (a last group of fewer than 8 rows) and block counts (K not a multiple of 64), one and
several activation rows, on whichever ISA build runs (test_portable_kernels runs the lower tiers)."""

import gguf
import numpy as np
import pytest
import torch

from perfxlm.ops import native
from perfxlm.quant import row_groups
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
    ref = row_groups.reference_linear(x, w, bias)
    assert y.shape == (rows, n)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("bits", [8, 4])
def test_a_row_alone_gives_the_bits_it_has_in_a_batch(bits):
    ops = ops_or_skip()
    n, k = 21, 224
    w = gguf_weight(bits, n, k, seed=5)
    codes8, scales8 = row_groups.pack(w.codes, w.scales, bits)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(7))
    batch = ops.linear_q_rows8(x, codes8, scales8, bits, n, None)
    for m in range(5):
        assert torch.equal(ops.linear_q_rows8(x[m:m + 1], codes8, scales8, bits, n, None)[0], batch[m])


def test_the_op_refuses_a_layout_that_is_not_row_groups():
    ops = ops_or_skip()
    w = gguf_weight(8, 16, 64)
    with pytest.raises(RuntimeError, match="row"):
        ops.linear_q_rows8(torch.randn(1, 64), w.codes, w.scales, 8, 16, None)
