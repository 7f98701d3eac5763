"""QuantizedWeight: GGUF blocks repacked bit-exactly, the quantizers' error bounds, row operations and
promotion without changing a value, the plain-torch products (weight-only and W8A8) against their
definitions, the native kernel against them, and `quantization=` parsing."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from perfxlm.quant import act_blocks, joining
from perfxlm.ops import native
from perfxlm.ops.linear import linear
from perfxlm.quant import NF4_LEVELS, QuantizationConfig, QuantizedWeight, quantizers
from perfxlm.quant.reference import fake_quantize_blocks, quantize_activations, reference_linear
from perfxlm.quant.gguf_repack import REPACKED_TYPES, repack
from perfxlm.quant.code_layout import plane_from_words
from perfxlm.quant.weight import pack_nibbles, unpack_nibbles

Q = gguf.GGMLQuantizationType

# ---------------------------------------------------------------------------------------------------------
# GGUF repacking
# ---------------------------------------------------------------------------------------------------------

# where each type keeps its float16 scalars (d; d and m / dmin)
_F16_AT = {Q.Q4_0: (0,), Q.Q8_0: (0,), Q.Q5_0: (0,), Q.Q4_1: (0, 2), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2),
           Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.MXFP4: ()}  # fmt: skip (MXFP4: any exponent byte)


def random_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int, scale=0.05) -> np.ndarray:
    """Random block bytes whose float16 scalars are finite (as in real files; random bytes would make
    inf / nan scales, which no affine form reproduces bit for bit)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block_elems * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(-1, block_bytes)
    for at in _F16_AT[qtype]:
        values = (rng.standard_normal(blocks.shape[0]) * scale).astype(np.float16)
        blocks[:, at : at + 2] = values.view(np.uint8).reshape(-1, 2)
    return raw


def _mxfp4_needs_float_scales(raw: np.ndarray) -> bool:
    """Whether an MXFP4 tensor has a block with exponent byte 0 whose codes are not all zero (codes 0 and 8
    are +0 and -0): its scale 2^-128 has no E8M0 byte, so the repack keeps float32 scales."""
    blocks = raw.reshape(-1, 17)
    codes = np.concatenate((blocks[:, 1:] & 0x0F, blocks[:, 1:] >> 4), axis=1)
    return bool(((blocks[:, 0] == 0) & ((codes & 0x7) != 0).any(axis=1)).any())


@pytest.mark.parametrize("qtype", sorted(REPACKED_TYPES, key=lambda t: t.name))
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_repacked_gguf_blocks_dequantize_bit_exactly(qtype, rows):
    cols = 512 if qtype.name.endswith("_K") else 96
    raw = random_blocks(np.random.default_rng(rows), qtype, rows, cols)
    want = torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype), dtype=np.float32)).view(rows, cols)
    w = repack(raw, qtype, (rows, cols))
    assert w.act == "float" and (w.levels is None) == (qtype != Q.MXFP4) and w.codes.dtype == torch.uint8
    f16, f32 = torch.float16, torch.float32
    expected = {Q.Q4_0: (4, 32, f16), Q.Q4_1: (4, 32, f16), Q.Q8_0: (8, 32, f16), Q.Q5_0: (5, 32, f16),
                Q.Q5_1: (5, 32, f16), Q.Q4_K: (4, 32, torch.uint8), Q.Q5_K: (5, 32, torch.uint8),
                Q.Q6_K: (6, 16, torch.int8),
                Q.MXFP4: (4, 32, torch.float8_e8m0fnu)}[qtype]
    if qtype == Q.MXFP4 and _mxfp4_needs_float_scales(raw):
        expected = (4, 32, f32)  # a nonzero block with exponent 0 (2^-128) has no E8M0 byte: float32 scales
    assert (w.bits, w.group, w.scales.dtype) == expected
    torch.testing.assert_close(w.dequantize(), want, rtol=0, atol=0)
    if qtype == Q.Q4_0:  # the nibble layout is Q4_0's, byte for byte, and d alone: 18 bytes per block
        assert torch.equal(w.codes.view(-1, 16), torch.from_numpy(raw.reshape(-1, 18)[:, 2:]))
        assert w.centred and w.mins is None and w.nbytes == raw.nbytes
    if qtype in (Q.Q5_0, Q.Q5_1):  # packed 5-bit codes: the file's bytes moved, 22 / 24 bytes per block
        assert w.centred == (qtype == Q.Q5_0) and w.nbytes == raw.nbytes
        at = 2 if qtype == Q.Q5_0 else 4
        blocks = torch.from_numpy(raw.reshape(-1, at + 20))
        assert torch.equal(w.codes[:, : cols // 2].reshape(-1, 16), blocks[:, at + 4 :])
        # qh's bits (element e at bit e of the block's word) permuted into the plane's order
        assert torch.equal(w.codes[:, cols // 2 :], plane_from_words(blocks[:, at : at + 4].reshape(rows, -1)))
    if qtype.name.endswith("_K"):  # two-level scales: bytes per group, float16 per 256, held as the file's
        held = {Q.Q4_K: 4.625, Q.Q5_K: 5.625, Q.Q6_K: 6.5625}[qtype]  # Q6_K: the file's 210 bytes per 256
        assert w.two_level and w.nbytes * 8 == held * rows * cols and w.centred == (qtype == Q.Q6_K)
        flat = w.flat()  # multiplied out: the same values, one float32 scale per group
        assert not flat.two_level and flat.scales.dtype == f32
        torch.testing.assert_close(flat.dequantize(), want, rtol=0, atol=0)


def test_q8_0_min_overflowing_float16_needs_no_float32():
    raw = random_blocks(np.random.default_rng(0), Q.Q8_0, 3, 64)
    raw.reshape(-1, 34)[0, 0:2] = np.array([1000.0], dtype=np.float16).view(np.uint8)  # -128 d overflows
    w = repack(raw, Q.Q8_0, (3, 64))
    assert w.centred and w.scales.dtype == torch.float16  # the min is implied, computed in float32
    assert torch.equal(w.with_mins().mins.float(), w.full_mins()) and w.with_mins().mins.dtype == torch.float32
    want = torch.from_numpy(np.array(gguf.quants.dequantize(raw, Q.Q8_0), dtype=np.float32)).reshape(3, 64)
    torch.testing.assert_close(w.dequantize(), want, rtol=0, atol=0)


def test_repack_refuses_what_it_cannot_keep():
    with pytest.raises(ValueError, match=r"Q2_K cannot be kept quantized \(supported: .*Q4_0"):
        repack(np.zeros((2, 84), np.uint8), Q.Q2_K, (2, 256))


# ---------------------------------------------------------------------------------------------------------
# Quantizers
# ---------------------------------------------------------------------------------------------------------


def _weights(n=37, k=256, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("group", [32, 128, 256])
def test_int8_symmetric_error_is_half_a_step(group):
    w = _weights()
    q = quantizers.quantize_symmetric_int8(w, group)
    step = w.view(37, -1, group).abs().amax(-1) / 127
    err = (q.dequantize() - w).abs().view(37, -1, group).amax(-1)
    assert (err <= step * 0.5 + 1e-7).all()
    assert q.bits == 8 and q.scales.dtype == torch.float32
    torch.testing.assert_close(q.mins, q.scales * -128, rtol=0, atol=0)  # symmetric: zero is code 128


@pytest.mark.parametrize("group", [32, 64])
def test_int8_asymmetric_zero_point_keeps_zero_exact(group):
    w = _weights() + 0.02  # off-centre groups, where a zero point pays
    w[0, :5] = 0.0
    q = quantizers.quantize_asymmetric_int8(w, group)
    d = q.dequantize()
    assert (d[0, :5] == 0).all()
    lo, hi = w.view(37, -1, group).amin(-1).clamp(max=0), w.view(37, -1, group).amax(-1).clamp(min=0)
    step = (hi - lo) / 255
    err = (d - w).abs().view(37, -1, group).amax(-1)
    assert (err <= step * 0.5 + 1e-6).all()
    assert (err.mean() < quantizers.quantize_symmetric_int8(w, group).dequantize().sub(w).abs().amax() * 0.8)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_error_bounds_and_layout(symmetric, group):
    w = _weights()
    q = (quantizers.quantize_symmetric_int4 if symmetric else quantizers.quantize_asymmetric_int4)(w, group)
    assert q.bits == 4 and q.codes.shape == (37, 128) and q.scales.dtype == torch.float16
    d = q.dequantize()
    g = w.view(37, -1, group)
    span = g.abs().amax(-1) * 2 if symmetric else g.amax(-1).clamp(min=0) - g.amin(-1).clamp(max=0)
    step = span / (16 if symmetric else 15)
    err = (d - w).abs().view(37, -1, group).amax(-1)
    # half a step; Q4_0's rule gives the side opposite the largest magnitude 7 steps, not 8 (a whole step
    # at its end); float16 scales round by 2^-11
    assert (err <= step * (1.0 if symmetric else 0.5) * 1.01 + 1e-5).all()
    assert (d - w).abs().mean() <= step.mean() * 0.3  # about a quarter step on average
    # the codes are the nibbles of the values the quantizer chose
    assert torch.equal(pack_nibbles(unpack_nibbles(q.codes)), q.codes)


def test_int4_symmetric_is_q4_0s_rule():
    w = _weights(n=5, k=64)
    q = quantizers.quantize_symmetric_int4(w, 32)
    assert q.centred and q.mins is None  # the min -8 d is implied, not stored
    torch.testing.assert_close(q.full_mins(), q.scales.float() * -8, rtol=0, atol=0)
    # the largest magnitude of each block is represented exactly (up to its float16 scale): code 0
    u = unpack_nibbles(q.codes).view(5, 2, 32)
    idx = w.view(5, 2, 32).abs().argmax(-1, keepdim=True)
    assert (torch.gather(u, -1, idx) == 0).all()


def test_nf4_picks_the_nearest_level():
    w = _weights(k=128)
    q = quantizers.quantize_nf4(w, 64)
    assert q.levels is not None and torch.equal(q.levels, NF4_LEVELS)
    assert (q.mins == 0).all()
    normed = w.view(37, 2, 64) / q.scales.float().unsqueeze(-1)
    u = unpack_nibbles(q.codes).view(37, 2, 64).long()
    nearest = (normed.unsqueeze(-1) - NF4_LEVELS).abs().argmin(-1)
    chosen = (normed - NF4_LEVELS[u]).abs()
    best = (normed - NF4_LEVELS[nearest]).abs()
    torch.testing.assert_close(chosen, best, rtol=0, atol=1e-6)


def test_all_zero_groups_stay_zero():
    w = torch.zeros(3, 64)
    q = quantizers
    for fn in (q.quantize_symmetric_int8, q.quantize_asymmetric_int8, q.quantize_symmetric_int4,
               q.quantize_asymmetric_int4, q.quantize_nf4):
        assert (fn(w, 32).dequantize() == 0).all(), fn.__name__


# ---------------------------------------------------------------------------------------------------------
# Rows, stacks and promotion
# ---------------------------------------------------------------------------------------------------------


def test_cat_rows_promotes_losslessly():
    rng = np.random.default_rng(3)
    parts = [
        repack(random_blocks(rng, Q.Q4_K, 5, 512), Q.Q4_K, (5, 512)),  # 4-bit, g32, float32
        repack(random_blocks(rng, Q.Q6_K, 3, 512), Q.Q6_K, (3, 512)),  # 6-bit, g16, two-level: widened to 8
        repack(random_blocks(rng, Q.Q4_0, 2, 512), Q.Q4_0, (2, 512)),  # 4-bit, g32, float16
        quantizers.quantize_symmetric_int8(torch.randn(4, 512), 512),  # 8-bit, per channel
    ]
    whole = joining.cat_rows(parts)
    assert (whole.bits, whole.group, whole.scales.dtype, whole.out_features) == (8, 16, torch.float32, 14)
    want = torch.cat([p.dequantize() for p in parts])
    got = whole.dequantize()
    exact = torch.tensor([True] * 5 + [False] * 3 + [True] * 6)
    torch.testing.assert_close(got[exact], want[exact], rtol=0, atol=0)
    # Q6_K's centred codes widened (q + 96, exactly gguf-py's (q - 32) x scale) given a stored min -128 x scale:
    # u x scale + min rounds twice (its codes reach 159)
    torch.testing.assert_close(got[~exact], want[~exact], rtol=0, atol=1e-5 * want.abs().max().item())
    # same form: no promotion, 4-bit float16 stays so
    same = joining.cat_rows(parts[2:3] * 2)
    assert (same.bits, same.group, same.scales.dtype) == (4, 32, torch.float16)


def test_centred_codes_keep_their_values_through_every_reshaping():
    """Centred codes (no stored mins) are narrowed, gathered, stacked, regrouped, widened and fused
    without storing a min, and beside a weight with mins they are given theirs (-8 x scale), losslessly."""
    w = quantizers.quantize_symmetric_int4(torch.randn(12, 128), 64)
    full = w.dequantize()
    assert w.nbytes == 12 * 64 + 12 * 2 * 2  # codes and float16 scales only
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(1))
    for part, want in [(w.narrow_rows(2, 7), full[2:9]), (w.index_rows(perm), full[perm]),
                       (w.regrouped(32), full), (w.widened(), full), (w.with_scale_dtype(torch.float32), full),
                       (joining.cat_rows([w, w]), torch.cat([full, full]))]:
        assert part.centred
        torch.testing.assert_close(part.dequantize(), want, rtol=0, atol=0)
    assert w.widened().codes.min() >= 120 and w.widened().codes.max() <= 135  # u - 8 == (u + 120) - 128
    stack = joining.stack_experts([w, w.index_rows(perm)])
    assert stack.centred and torch.equal(stack[1].dequantize(), full[perm])
    asym = quantizers.quantize_asymmetric_int4(torch.randn(3, 128), 32)
    mixed = joining.cat_rows([w, asym])
    assert not mixed.centred and mixed.group == 32
    torch.testing.assert_close(mixed.dequantize(), torch.cat([full, asym.dequantize()]), rtol=0, atol=1e-6)
    # a min -8 d that float16 cannot hold moves both to float32
    big = QuantizedWeight(w.codes, torch.full_like(w.scales, 10000.0), None, None, 4, 64, "float", 12, 128)
    stored = big.with_mins()
    assert stored.scales.dtype == stored.mins.dtype == torch.float32
    torch.testing.assert_close(stored.dequantize(), big.dequantize(), rtol=0, atol=0)


def _five_bit_reference(codes: torch.Tensor, k: int) -> torch.Tensor:
    """5-bit codes [N, 5 K / 8] -> u [N, K] from the layout's definition: per row K / 2 bytes of Q4_0's
    nibbles (block b, byte j: element 32b + j low, 32b + 16 + j high), then K / 8 bytes, 4 per block read
    as a little-endian word whose bit 8i + 3 - j is element 4j + i's fifth bit and bit 8i + 4 + j element
    16 + 4j + i's (j, i < 4)."""
    n = codes.shape[0]
    u = torch.zeros(n, k, dtype=torch.int64)
    for r in range(n):
        for e in range(k):
            byte = int(codes[r, (e // 32) * 16 + (e % 16)])
            low = byte & 15 if e % 32 < 16 else byte >> 4
            j, i = (e % 16) // 4, e % 4
            bit = 8 * i + (3 - j if e % 32 < 16 else 4 + j)
            word = int.from_bytes(bytes(codes[r, k // 2 + 4 * (e // 32) : k // 2 + 4 * (e // 32) + 4].tolist()), "little")
            u[r, e] = low + 16 * ((word >> bit) & 1)
    return u


def test_five_bit_codes_round_trip_and_keep_values_through_every_reshaping():
    """5-bit codes (mixed precision's widened weights, Q5_0's form): packed as defined, centred on 16,
    promoted from 4-bit codes (q and k fused beside a 5-bit v) and to 8-bit ones without changing a
    value; odd row counts, several groups per row."""
    w = torch.randn(13, 160) * 0.05
    q = quantizers.quantize_int5_search(w, 32, torch.rand(160))
    u = _five_bit_reference(q.codes, 160)
    assert q.codes.shape == (13, 100) and q.centred and q.nbytes == 13 * 100 + 13 * 5 * 2
    assert torch.equal(q.unpacked_codes().long(), u) and u.max() <= 31
    full = ((u.float() - 16).view(13, 5, 32) * q.scales.float().unsqueeze(-1)).view(13, 160)
    assert torch.equal(q.dequantize(), full)
    step = q.scales.float().abs().repeat_interleave(32, 1)  # a searched scale may clip a group's extreme
    assert ((q.dequantize() - w).abs() <= 4 * step + 1e-6).all()
    perm = torch.randperm(13, generator=torch.Generator().manual_seed(2))
    four = quantizers.quantize_symmetric_int4(torch.randn(5, 160), 32)
    for part, want in [(q.narrow_rows(2, 7), full[2:9]), (q.index_rows(perm), full[perm]),
                       (q.narrow_columns(32, 96), full[:, 32:128]),  # a row-parallel rank's share
                       (q.widened(), full), (q.with_scale_dtype(torch.float32), full),
                       (four.widened(5), four.dequantize()),
                       (joining.cat_rows([four, q]), torch.cat([four.dequantize(), full]))]:
        assert part.centred
        torch.testing.assert_close(part.dequantize(), want, rtol=0, atol=0)
    assert joining.cat_rows([four, q]).bits == 5 and q.widened().bits == 8
    stack = joining.stack_experts([q, q.index_rows(perm)])
    assert stack.bits == 5 and torch.equal(stack[1].dequantize(), full[perm])
    ids = torch.tensor([[12, 0], [3, 3]])
    assert torch.equal(q.embedding(ids), full[ids])
    x = torch.randn(3, 160)
    torch.testing.assert_close(reference_linear(x, q, None), F.linear(x, full), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x, q), F.linear(x, full), rtol=1e-5, atol=1e-5)  # native where built
    with pytest.raises(ValueError, match="5-bit codes take no level table"):
        QuantizedWeight(q.codes, q.scales, None, NF4_LEVELS, 5, 32, "float", 13, 160)
    with pytest.raises(ValueError, match="5-bit codes need in_features"):
        QuantizedWeight(torch.zeros(2, 30, dtype=torch.uint8), torch.ones(2, 3), None, None, 5, 16, "float", 2, 48)
    with pytest.raises(ValueError, match="cannot be widened to 4 bits"):
        q.widened(4)


def test_rows_stacks_and_lookups_keep_values():
    w = quantizers.quantize_asymmetric_int4(torch.randn(12, 64), 32)
    full = w.dequantize()
    torch.testing.assert_close(w.narrow_rows(3, 5).dequantize(), full[3:8], rtol=0, atol=0)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(w.index_rows(perm).dequantize(), full[perm], rtol=0, atol=0)
    ids = torch.tensor([[1, 11], [0, 1]])
    torch.testing.assert_close(w.embedding(ids), full[ids], rtol=0, atol=0)
    experts = [quantizers.quantize_nf4(torch.randn(6, 64), 32) for _ in range(3)]
    stack = joining.stack_experts(experts)
    assert stack.shape == (3, 6, 64) and stack.num_experts == 3
    for e in range(3):
        torch.testing.assert_close(stack[e].dequantize(), experts[e].dequantize(), rtol=0, atol=0)
    torch.testing.assert_close(stack.dequantize()[1], experts[1].dequantize(), rtol=0, atol=0)


def test_invalid_forms_are_refused():
    w = quantizers.quantize_symmetric_int8(torch.randn(4, 64), 32)
    with pytest.raises(ValueError, match="group 48 does not divide in_features 64"):
        QuantizedWeight(w.codes, w.scales, w.mins, None, 8, 48, "float", 4, 64)
    with pytest.raises(ValueError, match="multiples of 32"):
        s, m = w.scales[:, :3].contiguous(), w.mins[:, :3].contiguous()
        QuantizedWeight(w.codes[:, :24].contiguous(), s, m, None, 4, 16, "float", 4, 48)
    with pytest.raises(ValueError, match="act='int4'"):
        QuantizedWeight(w.codes, w.scales, w.mins, None, 8, 32, "int4", 4, 64)
    nf4 = quantizers.quantize_nf4(torch.randn(2, 64), 64)
    with pytest.raises(ValueError, match="level tables and affine codes"):
        joining.cat_rows([nf4, w])


# ---------------------------------------------------------------------------------------------------------
# Products
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", ["int8", "int4", "nf4", "q4_k"])
def test_weight_only_reference_is_linear_on_dequantized(make, monkeypatch):
    g = torch.Generator().manual_seed(1)
    if make == "q4_k":
        w = repack(random_blocks(np.random.default_rng(1), Q.Q4_K, 9, 256), Q.Q4_K, (9, 256))
    else:
        fn = {"int8": quantizers.quantize_asymmetric_int8, "int4": quantizers.quantize_symmetric_int4,
              "nf4": quantizers.quantize_nf4}[make]  # fmt: skip
        w = fn(torch.randn(9, 256, generator=g), 64)
    x, b = torch.randn(5, 256, generator=g), torch.randn(9, generator=g)
    want = F.linear(x, w.dequantize(), b)
    torch.testing.assert_close(reference_linear(x, w, b), want, rtol=0, atol=0)
    # many output rows: dequantized a slab at a time, same values
    monkeypatch.setattr("perfxlm.quant.reference.SLAB_ELEMENTS", 256 * 4)
    scale = want.abs().max().item()
    torch.testing.assert_close(reference_linear(x, w, b), want, rtol=1e-5, atol=1e-5 * scale)
    # bf16 activations: computed in float32, returned in bf16
    y = reference_linear(x.bfloat16(), w, b.bfloat16())
    assert y.dtype == torch.bfloat16
    want = F.linear(x.bfloat16().float(), w.dequantize(), b.bfloat16().float())
    torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2)


def test_activation_quantization_rounds_half_to_even_per_row():
    x = torch.tensor([[1.27, -0.5 * 1.27 / 127 * 3, 0.0], [0.0, 0.0, 0.0]])
    q, s = quantize_activations(x)
    assert q.dtype == torch.int8 and s.tolist() == pytest.approx([0.01, 0.0])
    assert q[0, 0] == 127 and q[0, 1] == -2  # -1.5 -> -2
    assert (q[1] == 0).all()


@pytest.mark.parametrize("n", [7, 96])
@pytest.mark.parametrize("group", [48, 96])
def test_w8a8_reference_is_its_definition(group, n):
    g = torch.Generator().manual_seed(2)
    w = quantizers.quantize_symmetric_int8(torch.randn(n, 96, generator=g), group, act="int8")
    w_asym = quantizers.quantize_asymmetric_int8(torch.randn(n, 96, generator=g), group)
    w_asym = QuantizedWeight(w_asym.codes, w_asym.scales, w_asym.mins, None, 8, group, "int8", n, 96)
    x = torch.randn(4 if n == 7 else 20, 96, generator=g)
    x[2] = 0
    for weight in (w, w_asym):
        sx = x.abs().amax(1, keepdim=True) / 127
        qx = torch.where(sx > 0, x / sx, torch.zeros_like(x)).round().clamp(-127, 127)
        want = (qx.double() @ weight.dequantize().double().t()) * sx.double()
        got = reference_linear(x, weight)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        assert (got[2] == 0).all()


def test_activation_blocks_are_quantized_per_32_values():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-1.27, 1.27, 32)
    x[0, 32] = 254.0  # an outlier only costs its own block its small values
    x[0, 33] = 0.9
    x[1, 5] = 1.5
    x[1, 6] = 0.0059  # under half a step (1.5 / 127): to 0
    got = fake_quantize_blocks(x)
    torch.testing.assert_close(got[0, :32], x[0, :32], atol=0.005, rtol=0)  # scale 0.01
    assert got[0, 33] == 0.0 and got[0, 32] == 254.0  # 0.9 / 2 rounds to 0 beside 254
    # the block's maximum comes back as 127 x its scale: 1.5 exactly with a float32 scale, within the fp16
    # rounding of the scale with ggml's blocks (perfxlm.quant.act_blocks)
    assert got[1, 6] == 0.0 and got[1, 5] == pytest.approx(1.5, rel=2**-11) and (got[1, 32:] == 0).all()  # an all-zero block stays zero
    assert got[1, 5] == 127 * ((torch.tensor(1.5) / 127).half().float() if act_blocks.mode() == "ggml" else torch.tensor(1.5) / 127)


@pytest.mark.parametrize("k,group", [(96, 96), (576, 576), (128, 32), (160, 32)])
@pytest.mark.parametrize("rows", [1, 5, 20])
@pytest.mark.parametrize("native_kernels", [True, False])
def test_w8a8_activation_blocks_on_every_path(k, group, rows, native_kernels, monkeypatch):
    """W8A8 with activation blocks (the default w8a8): the VNNI block GEMV where the build and layout
    allow it, else the activations rounded the same way before the float kernel, else plain torch; all
    equal the definition (fake-quantized blocks times the dequantized weight) up to summation order."""
    if not native_kernels:
        monkeypatch.setattr(native, "kernels", lambda: None)
    elif not hasattr(native.kernels() or object(), "linear_q"):
        pytest.skip("no native kernels")
    g = torch.Generator().manual_seed(k + rows)
    w = quantizers.quantize_symmetric_int8(torch.randn(23, k, generator=g), group, act="int8_block")
    x, b = torch.randn(rows, k, generator=g) * 3, torch.randn(23, generator=g)
    x[0, :32] = 0.0
    got = linear(x, w, b, w.out_features)
    want = F.linear(fake_quantize_blocks(x).double(), w.dequantize().double(), b.double()).float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * (want.abs().max().item() + 1))
    assert not torch.allclose(got, F.linear(x, w.dequantize(), b), rtol=1e-5, atol=1e-5)  # x was quantized


def test_w8a8_activation_group_option():
    c = QuantizationConfig.resolve("w8a8")
    assert c.activation_group_size == 32 and c.quantizer()(torch.randn(4, 64)).act == "int8_block"
    per_token = QuantizationConfig.resolve('{"method": "w8a8", "activation_group_size": -1}')
    assert per_token.quantizer()(torch.randn(4, 64)).act == "int8"
    assert QuantizationConfig.resolve(per_token.as_dict()) == per_token and "per token" in per_token.describe()
    with pytest.raises(ValueError, match=r"activation_group_size=64 for w8a8: supported: w8a8 only, with 32"):
        QuantizationConfig.resolve({"method": "w8a8", "activation_group_size": 64})
    with pytest.raises(ValueError, match=r"activation_group_size=-1 for int8: supported: w8a8 only"):
        QuantizationConfig.resolve({"method": "int8", "activation_group_size": -1})
    with pytest.raises(ValueError, match=r"blocks of 32, which do not divide the input size 48 of x.*-1"):
        c.check_in_features(48, "x")
    per_token.check_in_features(48, "x")  # one scale per token: any width


@pytest.mark.skipif(not hasattr(native.kernels() or object(), "linear_q"), reason="no native kernels")
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("fmt", ["q4_1", "q6_k", "int4-asym", "nf4", "w8a8", "table", "table-q6_k", "table8",
                                 "q8_0-form", "int5"])
def test_linear_dispatch_native_matches_reference(fmt, rows):
    g = torch.Generator().manual_seed(rows)
    rng = np.random.default_rng(rows)
    w = {
        "q4_1": lambda: repack(random_blocks(rng, Q.Q4_1, 33, 96), Q.Q4_1, (33, 96)),
        "q6_k": lambda: repack(random_blocks(rng, Q.Q6_K, 33, 256), Q.Q6_K, (33, 256)),
        "int4-asym": lambda: quantizers.quantize_asymmetric_int4(torch.randn(33, 96, generator=g), 32),
        "nf4": lambda: quantizers.quantize_nf4(torch.randn(33, 128, generator=g), 64),
        "w8a8": lambda: quantizers.quantize_symmetric_int8(torch.randn(33, 96, generator=g), 96, act="int8"),
        # int4's 6-bit head (float16 scale per 32; Q6_K's form on whole 256s), the 8-bit head (centred,
        # float32 scale per 64) and mixed precision's Q8_0 and 5-bit forms
        "table": lambda: QuantizationConfig.resolve("int4").quantize_table(torch.randn(33, 192, generator=g)),
        "table-q6_k": lambda: QuantizationConfig.resolve("int4").quantize_table(torch.randn(33, 512, generator=g)),
        "table8": lambda: QuantizationConfig.resolve({"method": "int4", "head_bits": 8}).quantize_table(
            torch.randn(33, 192, generator=g)),
        "q8_0-form": lambda: QuantizationConfig.resolve("int4").quantize_weight(torch.randn(33, 96, generator=g), bits=8),
        "int5": lambda: quantizers.quantize_int5_search(torch.randn(33, 160, generator=g), 32, torch.rand(160, generator=g)),
    }[fmt]()
    x, b = torch.randn(rows, w.in_features, generator=g), torch.randn(33, generator=g)
    got = linear(x, w, b, w.out_features)  # fresh weights: float32 activations (ActivationMode.FLOAT)
    want = reference_linear(x, w, b)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * (want.abs().max().item() + 1))


# ---------------------------------------------------------------------------------------------------------
# quantization= parsing
# ---------------------------------------------------------------------------------------------------------


def test_quantization_names_options_and_defaults():
    assert QuantizationConfig.resolve(None) is None
    c = QuantizationConfig.resolve("int4")
    assert (c.method, c.group_size, c.symmetric, c.bits) == ("int4", 32, False, 4)
    assert QuantizationConfig.resolve("nf4").group_size == 64
    int8 = QuantizationConfig.resolve("int8")
    assert int8.group_size == 64 and not int8.group_explicit and int8.quantizer()(torch.randn(4, 128)).group == 64
    # the default group where it does not divide an input size: one scale per output channel, no error
    int8.check_in_features(96, "x")
    assert int8.group_for(96) == 96 and int8.quantizer()(torch.randn(4, 96)).group == 96
    assert "per channel where it does not divide" in int8.describe()
    with pytest.raises(ValueError, match=r"quantization_group_size=64 does not divide the input size 96 of x"):
        QuantizationConfig.resolve("int8", group_size=64).check_in_features(96, "x")  # asked for: an error
    assert QuantizationConfig.resolve("int8", group_size=-1).group_for(128) == 128
    c = QuantizationConfig.resolve("int8", group_size=64, symmetric=False)
    assert (c.group_size, c.symmetric) == (64, False)
    c = QuantizationConfig.resolve('{"method": "int4", "group_size": 128, "symmetric": false}')
    assert (c.method, c.group_size, c.symmetric) == ("int4", 128, False)
    assert QuantizationConfig.resolve(c.as_dict()) == c and (c.calibration, c.mixed_precision) == ("default", True)
    assert QuantizationConfig.resolve("int4", symmetric=True).symmetric
    nf4 = QuantizationConfig.resolve("nf4")
    assert QuantizationConfig.resolve(nf4.as_dict()) == nf4  # a default group stays the default
    assert QuantizationConfig.resolve("GGUF").method == "gguf"


@pytest.mark.parametrize("args,match", [
    (("int3",), r"quantization='int3' is not supported; supported: int8, int4, nf4, w8a8, gguf, none"),
    ((7,), r"quantization=7 is not supported; supported: int8"),
    (("int4", 48), r"quantization_group_size=48 for int4: supported: multiples of 32"),
    (("int8", 24), r"quantization_group_size=24 for int8: supported: multiples of 16"),
    (("int8", 0), r"quantization_group_size=0: expected a positive integer or -1"),
    (("nf4", None, False), r"nf4 is absmax-scaled; supported: symmetric only"),
    (("w8a8", None, False), r"w8a8 weights are symmetric"),
    (("gguf", 32), r"quantization='gguf' takes no group size"),
    ((None, 32), r"need quantization="),
    (({"method": "int4", "bits": 4},), r"expected the keys method, group_size, symmetric, activation_group_size, calibration.*unknown: bits"),
    (('{"method": "int4"',), r"is not valid JSON"),
])  # fmt: skip
def test_bad_quantization_values_name_the_value_and_the_choices(args, match):
    with pytest.raises(ValueError, match=match):
        QuantizationConfig.resolve(*args)


def test_shape_checks_name_the_weight():
    match = r"quantization_group_size=64 \(the default for nf4\) does not divide the input size 96 of lay"
    with pytest.raises(ValueError, match=match):
        QuantizationConfig.resolve("nf4").check_in_features(96, "layers.0.mlp")
    with pytest.raises(ValueError, match=r"'int4' needs input sizes .* multiples of 32; x has input size 48"):
        QuantizationConfig.resolve("int4", group_size=-1).check_in_features(48, "x")
    QuantizationConfig.resolve("int8", group_size=-1).check_in_features(37, "x")  # per channel: any size


def test_lm_head_option_quantizes_the_tables_by_default():
    assert "6-bit embedding and LM head" in QuantizationConfig.resolve("int4").describe()  # Q6_K's (test_six_bit)
    c = QuantizationConfig.resolve({"method": "int4", "head_bits": 8})
    assert c.lm_head and "8-bit embedding and LM head" in c.describe()
    off = QuantizationConfig.resolve({"method": "int8", "lm_head": False})
    assert not off.lm_head and QuantizationConfig.resolve(off.as_dict()) == off
    with pytest.raises(ValueError, match=r"lm_head='yes': expected true"):
        QuantizationConfig.resolve({"method": "int4", "lm_head": "yes"})
    w = torch.randn(10, 96)
    table = c.quantize_table(w)  # 64 does not divide 96: one scale per 32
    assert (table.bits, table.group, table.act, table.centred) == (8, 32, "float", True)  # Q8_0's form
    d = w.reshape(10, 3, 32).abs().amax(-1, keepdim=True) / 127  # float32 scales: 8 + 32 / 32 bits
    assert torch.equal(table.dequantize(), (torch.round(w.reshape(10, 3, 32) / d) * d).reshape(10, 96))
    assert table.nbytes == 10 * 96 + 10 * 3 * 4
    assert QuantizationConfig.resolve("w8a8").quantize_table(torch.randn(4, 128)).act == "float"
