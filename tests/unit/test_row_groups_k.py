"""Row groups for K-quants (perfxlm/quant/row_groups_k.py, csrc/row_groups_k.h): the layout's bytes against
the loaded form's, and the native GEMV on it against the plain-torch reference and the engine's plain
linear_q, for GGUF Q4_K, Q5_K and Q6_K, at odd row counts (a last group of fewer than 8 rows) and K = 256 x odd,
one and several activation rows, on whichever ISA build runs (test_portable_kernels runs the lower tiers)."""

import gguf
import numpy as np
import pytest
import torch

from perfxlm.ops import native
from perfxlm.quant import row_groups_k
from perfxlm.quant.code_layout import unpack_fives, unpack_sixes
from perfxlm.quant.gguf_repack import repack
from perfxlm.quant.reference import block_reference_linear

Q = gguf.GGMLQuantizationType
FORMATS = {"q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
_F16_AT = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def gguf_weight(fmt: str, n: int, k: int, seed: int = 0):
    """Random GGUF blocks (finite float16 d / dmin) as the engine holds them."""
    qtype = FORMATS[fmt]
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
    for at in _F16_AT[qtype]:
        raw[:, at : at + 2] = (rng.standard_normal(raw.shape[0]) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return repack(raw, qtype, (n, k))


def ops_or_skip():
    ops = native.kernels()
    if ops is None or not hasattr(ops, "linear_q_rows8_k"):
        pytest.skip("no native K-quant row-group kernel in this build")
    return ops


def bits_of(fmt: str) -> int:
    return row_groups_k.FORMATS[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(1, 256), (13, 768), (16, 256), (37, 1280)])
def test_pack_moves_bytes_and_unpack_inverts_it(fmt, n, k):
    w = gguf_weight(fmt, n, k, seed=n + k)
    assert row_groups_k.takes(w) == fmt
    codes, params = row_groups_k.pack(w)
    groups, blocks, supers = -(-n // 8), k // 32, k // 256
    bits = bits_of(fmt)
    assert codes.shape == (groups, blocks, 8 * row_groups_k.CODE_BYTES[bits]) and codes.dtype == torch.uint8
    assert params.shape == (groups, supers, row_groups_k.PARAM_BYTES[bits]) and params.dtype == torch.uint8
    u = {"q4_k": None, "q5_k": unpack_fives, "q6_k": unpack_sixes}[fmt]
    u = u and u(w.codes)
    for r in {0, n - 1, n // 2}:
        g, i = r // 8, r % 8
        for b in {0, blocks - 1}:
            for q in (0, 3):  # quad q of the nibbles: the plain layout's 4 bytes
                got = codes[g, b, (q * 8 + i) * 4 : (q * 8 + i) * 4 + 4]
                assert torch.equal(got, w.codes[r, b * 16 + 4 * q : b * 16 + 4 * q + 4] if fmt != "q6_k"
                                   else (u[r, b * 32 + 4 * q : b * 32 + 4 * q + 4] & 15)
                                   | ((u[r, b * 32 + 16 + 4 * q : b * 32 + 20 + 4 * q] & 15) << 4))  # fmt: skip
                if fmt == "q5_k":  # code 4 q + j's fifth bit at bit q of byte 4 i + j, 16 + 4 q + j's at 4 + q
                    word = codes[g, b, 128 + 4 * i : 128 + 4 * i + 4]
                    assert torch.equal((word >> q) & 1, u[r, b * 32 + 4 * q : b * 32 + 4 * q + 4] >> 4)
                    assert torch.equal((word >> (4 + q)) & 1, u[r, b * 32 + 16 + 4 * q : b * 32 + 20 + 4 * q] >> 4)
                if fmt == "q6_k":  # code 16 h + 4 q + j's bits 4-5 at bits 2q of byte 4 i + j of word h
                    for h in (0, 1):
                        word = codes[g, b, 128 + 32 * h + 4 * i : 128 + 32 * h + 4 * i + 4]
                        assert torch.equal((word >> (2 * q)) & 3, u[r, b * 32 + 16 * h + 4 * q : b * 32 + 16 * h + 4 * q + 4] >> 4)
        s = supers - 1  # the last super-block's parameters
        sub = w.scales.view(torch.uint8)
        per = 16 if fmt == "q6_k" else 8
        assert torch.equal(params[g, s, i : per * 8 : 8], sub[r, s * per : (s + 1) * per])
        d_at = 128  # after the sub-scales (and Q4_K's sub-mins)
        assert torch.equal(params[g, s, d_at + 2 * i : d_at + 2 * i + 2], sub[r, k // (256 // per) + 2 * s : k // (256 // per) + 2 * s + 2])
        if fmt != "q6_k":
            mins = w.mins.view(torch.uint8)
            assert torch.equal(params[g, s, 64 + i : 128 : 8], mins[r, s * 8 : (s + 1) * 8])
            assert torch.equal(params[g, s, 144 + 2 * i : 146 + 2 * i], mins[r, k // 32 + 2 * s : k // 32 + 2 * s + 2])
    if n % 8:  # the padding rows are zeros
        rest = codes.view(groups, blocks, -1, 8, 4)[-1, :, :, n % 8 :]
        assert not rest.any()
    back_codes, back_scales, back_mins = row_groups_k.unpack(codes, params, fmt, n)
    assert torch.equal(back_codes, w.codes) and torch.equal(back_scales, w.scales)
    assert (back_mins is None and w.mins is None) or torch.equal(back_mins, w.mins)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(1, 256), (13, 768), (37, 1280), (64, 256), (45, 2304)])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_native_product_matches_the_reference_and_linear_q(fmt, n, k, rows):
    ops = ops_or_skip()
    w = gguf_weight(fmt, n, k, seed=3 * n + k)
    codes, params = row_groups_k.pack(w)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k))
    x[0, :32] = 0  # an all-zero activation block (scale 0)
    bias = torch.randn(n) if rows == 3 else None
    y = ops.linear_q_rows8_k(x, codes, params, bits_of(fmt), n, bias)
    ref = block_reference_linear(x, w, bias)
    assert y.shape == (rows, n)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # the engine's plain product on the same activation bytes (int8 blocks): other float orders only;
    # a build without the int8 block GEMV (scalar) multiplies float activations there, another product
    if ops.int8_block_dots():
        plain = ops.linear_q(x, w.codes, w.scales, w.mins, None, bias, False, 1 << 30, False, True, 1 << 30)
        torch.testing.assert_close(y, plain, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_alone_gives_the_bits_it_has_in_a_batch(fmt):
    ops = ops_or_skip()
    n, k = 21, 768
    w = gguf_weight(fmt, n, k, seed=5)
    codes, params = row_groups_k.pack(w)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(7))
    batch = ops.linear_q_rows8_k(x, codes, params, bits_of(fmt), n, None)
    for m in range(5):
        assert torch.equal(ops.linear_q_rows8_k(x[m : m + 1], codes, params, bits_of(fmt), n, None)[0], batch[m])


def test_extreme_codes_and_scales_stay_exact():
    """The int16 pair sums of the vpmaddubsw build at their largest (codes 15 / 31 / 63 against +-127, the
    largest sub-scales) and the int32 products stay exact: the result matches the reference."""
    ops = ops_or_skip()
    for fmt in FORMATS:
        w = gguf_weight(fmt, 9, 512, seed=11)
        if fmt != "q6_k":
            w.codes.fill_(0xFF)  # every code 15 (31)
            w.scales[:, : 512 // 32].fill_(63)
            w.mins[:, : 512 // 32].fill_(63)
        else:
            w.codes.fill_(0xFF)  # every code 63
            w.scales[:, : 512 // 16].fill_(-128)
        codes, params = row_groups_k.pack(w)
        for sign in (1.0, -1.0):
            x = torch.full((1, 512), sign)
            x[0, 1::7] = -sign * 0.5
            y = ops.linear_q_rows8_k(x, codes, params, bits_of(fmt), 9, None)
            ref = block_reference_linear(x, w)
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_takes_names_the_formats_and_refuses_others():
    assert row_groups_k.takes(gguf_weight("q4_k", 8, 256)) == "q4_k"
    assert row_groups_k.takes(gguf_weight("q5_k", 8, 256)) == "q5_k"
    assert row_groups_k.takes(gguf_weight("q6_k", 8, 256)) == "q6_k"
    raw = np.zeros((8 * 256 // 32, 34), dtype=np.uint8)
    assert row_groups_k.takes(repack(raw, Q.Q8_0, (8, 256))) is None
    with pytest.raises(ValueError, match="Q4_K, Q5_K or Q6_K"):
        row_groups_k.pack(repack(raw, Q.Q8_0, (8, 256)))


def test_the_op_refuses_a_layout_that_is_not_row_groups():
    ops = ops_or_skip()
    w = gguf_weight("q4_k", 16, 256)
    with pytest.raises(RuntimeError, match="row groups"):
        ops.linear_q_rows8_k(torch.randn(1, 256), w.codes, w.scales, 4, 16, None)
    codes, params = row_groups_k.pack(w)
    with pytest.raises(RuntimeError, match="row groups"):
        ops.linear_q_rows8_k(torch.randn(1, 256), codes, params, 6, 16, None)
