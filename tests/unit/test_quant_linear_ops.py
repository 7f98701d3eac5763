"""The native quantized-weight products (csrc/quant_linear.cpp) against a plain-torch reference written
here from the format's definition: codes (8-bit, 4-bit in GGUF's Q4 nibble order, 5-bit: those nibbles
then a plane of fifth bits, or 6-bit: a second plane of sixth bits after it), a scale and a min per group
(or none: centred codes, w = scale * (u - 8, 16, 32 or 128), or scale * levels[u]), an optional 16-level
table; weight-only and W8A8; the GEMV path, the slab-GEMM path in float32 and bf16; odd sizes. Built for AVX2 and scalar too by test_portable_kernels."""

import pytest
import torch

from perfxlm.quant.reference import fake_quantize_blocks
from perfxlm.ops import native

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no compiler for the native kernels")

NF4 = torch.tensor([-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
                    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0])  # fmt: skip


def _unpack4(codes: torch.Tensor) -> torch.Tensor:
    n, half = codes.shape
    blocks = codes.view(n, half // 16, 16).int()
    return torch.cat([blocks & 15, blocks >> 4], dim=2).view(n, half * 2)


# A bit plane: per block of 32 a little-endian word, element e at bit PLANE_BIT[e] (4j + b at 8b + 3 - j,
# 16 + 4j + b at 8b + 4 + j), written out here from the layout's definition.
PLANE_BIT = [8 * (e % 4) + (3 - e // 4 if e < 16 else 4 + (e - 16) // 4) for e in range(32)]


def _plane(plane: torch.Tensor, k: int) -> torch.Tensor:
    """A plane [N, K // 8] -> each element's bit [N, K]."""
    words = plane.contiguous().view(plane.shape[0], k // 32, 4).long()
    word = words[..., 0] | (words[..., 1] << 8) | (words[..., 2] << 16) | (words[..., 3] << 24)
    return ((word.unsqueeze(-1) >> torch.tensor(PLANE_BIT)) & 1).reshape(plane.shape[0], k).int()


def _unpack5(codes: torch.Tensor, k: int) -> torch.Tensor:
    low = _unpack4(codes[:, : k // 2].contiguous())
    return low + 16 * _plane(codes[:, k // 2 :], k)


def _unpack6(codes: torch.Tensor, k: int) -> torch.Tensor:
    low = _unpack5(codes[:, : 5 * k // 8].contiguous(), k)
    return low + 32 * _plane(codes[:, 5 * k // 8 :], k)


CENTRE = {4: 8, 5: 16, 6: 32, 8: 128}


def _bits(codes, k):
    if codes.shape[1] * 4 == k * 3 and k % 32 == 0:
        return 6
    if codes.shape[1] * 8 == k * 5 and k % 32 == 0:
        return 5
    return 4 if codes.shape[1] * 2 == k and codes.shape[1] != k else 8


def _dequant(codes, scales, mins, levels, k):
    bits = _bits(codes, k)
    bits4 = bits == 4
    u = _unpack4(codes) if bits4 else {5: _unpack5, 6: _unpack6}.get(bits, lambda c, _: c.int())(codes, k)
    v = levels[u.long()] if levels is not None else u.float()
    group = k // scales.shape[1]
    s = scales.float().repeat_interleave(group, 1)
    if mins is None:  # centred codes
        return (v if levels is not None else v - CENTRE[bits]) * s
    m = mins.float().repeat_interleave(group, 1)
    return v * s + m


def _centred(n, k, bits, group, half, lut, seed):
    """A weight with centred codes (no mins), and the same weight with its implied mins stored."""
    codes, scales, _, levels = _weight(n, k, bits, group, half, lut, seed)
    centre = 0 if lut else CENTRE[bits]
    return codes, scales, levels, (scales.float() * -centre).to(scales.dtype)


CENTRED = [  # bits, n, k, group, half, lut: Q4_0 / symmetric int4, Q8_0 / symmetric int8, NF4
    (4, 13, 32, 32, False, False),
    (4, 33, 576, 32, True, False),
    (4, 1030, 64, 64, False, False),
    (4, 11, 192, 192, True, False),
    (4, 17, 96, 32, False, True),
    (8, 33, 576, 32, True, False),
    (8, 1030, 48, 16, False, False),
    (8, 7, 160, 160, True, False),
    (8, 21, 1536, 1536, False, False),
    (8, 11, 128, 16, True, False),
    (5, 33, 576, 32, True, False),  # 5-bit codes (Q5_0's form: mixed precision's widened weights)
    (5, 9, 96, 96, False, False),
    (5, 1030, 64, 32, True, False),
    (6, 33, 576, 16, True, False),  # 6-bit codes (Q6_K's values, a float16 scale per 16 or 32)
    (6, 1030, 64, 32, False, False),
]


def _weight(n, k, bits, group, half, lut, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k * bits // 8), generator=g, dtype=torch.uint8)
    dtype = torch.float16 if half else torch.float32
    levels_max = (1 << bits) - 1
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).to(dtype)
    mins = (-(torch.rand(n, k // group, generator=g)) * 0.02 * levels_max / 2).to(dtype)
    levels = NF4.clone() if lut else None
    return codes, scales, mins, levels


CASES = [  # bits, n, k, group, half, lut
    (4, 13, 32, 32, False, False),
    (4, 33, 576, 32, True, False),
    (4, 1030, 64, 64, False, False),
    (4, 9, 128, 128, True, True),
    (4, 17, 96, 32, False, True),
    (8, 13, 37, 37, False, False),
    (8, 33, 576, 32, True, False),
    (8, 1030, 48, 16, False, False),
    (8, 7, 160, 160, True, False),
    (8, 5, 1, 1, False, False),
    (5, 13, 32, 32, False, False),
    (5, 33, 576, 32, True, False),
    (5, 1030, 64, 64, False, False),
    (5, 7, 160, 160, True, False),
    (6, 13, 32, 16, False, False),
    (6, 33, 576, 32, True, False),
    (6, 7, 160, 160, True, False),
]


@pytest.mark.parametrize("rows,max_rows,bf16", [(1, 4, False), (2, 4, False), (3, 4, False), (4, 4, False),
                                                (5, 16, False), (9, 0, False), (33, 0, True), (130, 0, False)])
@pytest.mark.parametrize("bits,n,k,group,half,lut", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_weight_only_matches_reference(bits, n, k, group, half, lut, rows, max_rows, bf16, bias):
    ops = native.kernels()
    codes, scales, mins, levels = _weight(n, k, bits, group, half, lut, n * 31 + k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k))
    b = torch.randn(n) if bias else None
    w = _dequant(codes, scales, mins, levels, k)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()).float()
    out = ops.linear_q(x, codes, scales, mins, levels, b, False, max_rows, bf16)
    tol = 2e-2 if bf16 else 1e-4
    scale = ref.abs().max().item() + 1.0
    torch.testing.assert_close(out, ref, atol=tol * scale, rtol=tol)
    torch.testing.assert_close(ops.dequantize_q(codes, scales, mins, levels, k), w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rows,max_rows", [(1, 4), (3, 4), (4, 4), (6, 16), (9, 0), (64, 0)])
@pytest.mark.parametrize("n,k,group", [(13, 37, 37), (1030, 64, 64), (33, 576, 576), (9, 130, 130), (8, 576, 32)])
def test_w8a8_matches_reference(n, k, group, rows, max_rows):
    """Rows quantized to int8 per row (scale max|x| / 127, rounded half to even), then the exact integer
    product: VNNI's int32 dot where the CPU has it, the float kernel on integer values elsewhere."""
    ops = native.kernels()
    codes, scales, mins, _ = _weight(n, k, 8, group, False, False, n + k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, : min(3, k)] = 0.0
    if rows > 2:
        x[2] = 0.0  # an all-zero row stays zero
    sx = x.abs().amax(1, keepdim=True) / 127
    xq = torch.where(sx > 0, x / sx, torch.zeros_like(x)).round().clamp(-127, 127)
    w = _dequant(codes, scales, mins, None, k)
    ref = ((xq.double() @ w.double().t()) * sx.double()).float()
    out = ops.linear_q(x, codes, scales, mins, None, None, True, max_rows, False)
    torch.testing.assert_close(out, ref, atol=1e-4 * (ref.abs().max().item() + 1), rtol=1e-4)


def test_bad_shapes_are_errors():
    ops = native.kernels()
    codes, scales, mins, _ = _weight(4, 64, 4, 32, False, False, 0)
    with pytest.raises(RuntimeError, match="bytes per row"):
        ops.linear_q(torch.randn(1, 48), codes, scales, mins, None, None, False, 4, False)
    with pytest.raises(RuntimeError, match="same dtype"):
        ops.linear_q(torch.randn(1, 64), codes, scales, mins.half(), None, None, False, 4, False)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.linear_q(torch.randn(1, 64), codes, scales.repeat(1, 2), mins.repeat(1, 2), None, None, False, 4, False)


def _block_applies(bits, k, group, lut):
    return (not lut and k % 64 == 0 and (group % 64 == 0 or group == 32 or (group == 16 and bits in (6, 8))))


def _block_rounded(x):
    """x as the int8 block kernels see it (perfxlm.quant.act_blocks' arithmetic, ggml's by default)."""
    return fake_quantize_blocks(x.float().contiguous())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("bits,n,k,group,half,lut", CASES + [(8, 11, 128, 16, True, False), (4, 6, 192, 64, False, False),
                                                           (8, 21, 1536, 1536, False, False)])
def test_int8_block_activations_match_reference(bits, n, k, group, half, lut, rows):
    """With int8_blocks the GEMV quantizes x to int8 per block of 32 (scale max|x| / 127, half to even) and
    multiplies exactly: the float product of the fake-quantized x with W. Where the block path does not
    apply (a level table, K not a multiple of 64, an odd group) or the build lacks VNNI, x stays float32."""
    ops = native.kernels()
    codes, scales, mins, levels = _weight(n, k, bits, group, half, lut, n + 7 * k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k + rows))
    x[0, :32] = 0.0  # an all-zero block
    b = torch.randn(n)
    w = _dequant(codes, scales, mins, levels, k)
    if ops.int8_block_dots() and _block_applies(bits, k, group, lut):
        x_used = _block_rounded(x)
    else:
        x_used = x
    ref = torch.nn.functional.linear(x_used.double(), w.double(), b.double()).float()
    out = ops.linear_q(x, codes, scales, mins, levels, b, False, 8, False, True)
    torch.testing.assert_close(out, ref, atol=1e-4 * (ref.abs().max().item() + 1), rtol=1e-4)
    # many rows run the GEMM on dequantized slabs, with the same int8 activation blocks (a row's result
    # does not depend on the rows beside it)
    many = ops.linear_q(x.repeat(3, 1), codes, scales, mins, levels, b, False, 4, False, True)[:rows]
    torch.testing.assert_close(many, ref, atol=1e-4 * (ref.abs().max().item() + 1), rtol=1e-4)


@pytest.mark.parametrize("bits,n,k,group,half,lut", [(4, 13, 192, 32, True, False), (4, 9, 128, 64, False, False),
                                                     (5, 13, 192, 32, True, False), (5, 9, 128, 64, False, False),
                                                     (8, 10, 128, 32, True, False), (8, 11, 192, 64, False, False),
                                                     (8, 7, 128, 16, False, False),
                                                     # 18 groups per row: the mins' last step over 8 groups
                                                     (4, 13, 576, 32, True, False), (5, 13, 576, 32, False, False),
                                                     (8, 13, 576, 32, True, False)])
def test_int8_block_rows_alone_equal_rows_together_and_the_4bit_row_limit(bits, n, k, group, half, lut):
    """Batch-1 decode runs four weight rows at once against one activation row (AVX2), more rows run
    tiles of activation rows: a token's result is the same bits either way. `block_max_rows` lets 4-bit codes
    keep the block products past `max_rows` (AVX2's prefill), with the same bits again."""
    ops = native.kernels()
    codes, scales, mins, levels = _weight(n, k, bits, group, half, lut, 5 * n + k)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(n * k))
    b = torch.randn(n)
    together = ops.linear_q(x, codes, scales, mins, levels, b, False, 8, False, True)
    alone = torch.cat([ops.linear_q(x[i : i + 1], codes, scales, mins, levels, b, False, 8, False, True) for i in range(6)])
    assert torch.equal(alone, together)
    beyond = ops.linear_q(x, codes, scales, mins, levels, b, False, 2, False, True, 64)
    general = ops.linear_q(x, codes, scales, mins, levels, b, False, 2, False, True)
    if bits in (4, 5) and ops.int8_block_dots():
        assert torch.equal(beyond, together)  # the block kernel, not the GEMM on dequantized slabs
    else:
        assert torch.equal(beyond, general)  # 8-bit codes keep the general limit
    torch.testing.assert_close(beyond, together, atol=1e-4 * (together.abs().max().item() + 1), rtol=1e-4)


def test_weights_larger_than_a_slab_keep_the_block_kernel_to_the_block_limit():
    """8-bit codes past max_rows go to the dequantize-and-GEMM path, except a weight of more than 4M values
    (an LM head), whose slabs leave the cache: it keeps the block kernel up to `block_max_rows`."""
    ops = native.kernels()
    n, k = 8200, 576  # 4.7M values
    codes, scales, mins, levels = _weight(n, k, 8, 32, True, False, 3)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(2))
    block = ops.linear_q(x, codes, scales, mins, levels, None, False, 8, False, True)
    limited = ops.linear_q(x, codes, scales, mins, levels, None, False, 2, False, True, 64)
    gemm = ops.linear_q(x, codes, scales, mins, levels, None, False, 2, False, True)  # no block limit: GEMM
    # with int8 dots: the block kernel (same bits); without (the scalar tier), both take the float path
    assert torch.equal(limited, block if ops.int8_block_dots() else gemm)
    torch.testing.assert_close(gemm, block, atol=1e-4 * (block.abs().max().item() + 1), rtol=1e-4)


@pytest.mark.parametrize("rows,max_rows,bf16,blocks", [(1, 4, False, False), (3, 4, False, False),
                                                       (9, 0, False, False), (33, 0, True, False),
                                                       (1, 8, False, True), (4, 8, False, True),
                                                       (5, 8, False, True), (70, 4, False, True)])
@pytest.mark.parametrize("bits,n,k,group,half,lut", CENTRED)
def test_centred_codes_match_reference_and_their_stored_mins(bits, n, k, group, half, lut, rows, max_rows, bf16,
                                                             blocks):
    """No mins (Q4_0, Q8_0, symmetric int4 / int8, NF4): the kernels imply -8 x scale (4-bit), -128 x scale
    (8-bit) or 0 (a level table) and read no mins. The result is the reference's, and the same bits as the
    weight with those mins stored on the float paths (GEMV, slabs for the GEMM); the int8 block products
    may fold the centre into their integer dot products (exact) where stored mins are added in float: equal
    to float rounding there."""
    ops = native.kernels()
    codes, scales, levels, stored = _centred(n, k, bits, group, half, lut, 3 * n + k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows * k))
    b = torch.randn(n)
    w = _dequant(codes, scales, None, levels, k)
    torch.testing.assert_close(w, _dequant(codes, scales, stored, levels, k), atol=1e-6, rtol=1e-6)
    x_used = x
    if blocks and ops.int8_block_dots() and _block_applies(bits, k, group, lut):
        x_used = _block_rounded(x)
    ref = torch.nn.functional.linear(x_used.double(), w.double(), b.double()).float()
    out = ops.linear_q(x, codes, scales, None, levels, b, False, max_rows, bf16, blocks)
    tol = 2e-2 if bf16 else 1e-4
    torch.testing.assert_close(out, ref, atol=tol * (ref.abs().max().item() + 1), rtol=tol)
    with_mins = ops.linear_q(x, codes, scales, stored, levels, b, False, max_rows, bf16, blocks)
    if x_used is x:
        assert torch.equal(out, with_mins)
    else:
        torch.testing.assert_close(out, with_mins, atol=1e-5 * (ref.abs().max().item() + 1), rtol=1e-5)
    # one rounding, as the reference's (u - centre) * scale: the kernels' FMA with the stored mins too
    assert torch.equal(ops.dequantize_q(codes, scales, None, levels, k), w)
    assert torch.equal(ops.dequantize_q(codes, scales, stored, levels, k), w)


@pytest.mark.parametrize("rows,max_rows", [(1, 4), (5, 16), (9, 0)])
@pytest.mark.parametrize("n,k", [(13, 37), (33, 576), (1030, 64)])
def test_w8a8_centred_codes_match_their_stored_mins(n, k, rows, max_rows):
    ops = native.kernels()
    codes, scales, _, stored = _centred(n, k, 8, k, False, False, n + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    out = ops.linear_q(x, codes, scales, None, None, None, True, max_rows, False)
    assert torch.equal(out, ops.linear_q(x, codes, scales, stored, None, None, True, max_rows, False))


@pytest.mark.parametrize("bits,half,mins_stored", [(8, True, False), (8, False, False), (8, True, True), (4, True, False)])
def test_parallel_decode_rows_match_reference_and_each_row_alone(bits, half, mins_stored):
    """Parallel decode (1-70 rows) on the block kernel: tiles of 4 x 4 weight and activation rows and their
    remainders, Q8_0's centred codes (no mins) and stored ones, fp16 and fp32 scales; 70 rows of K = 640
    quantize on two threads, fewer on one. Every row is the fake-quantized reference's, and the same bits
    as that row alone (a token's result does not depend on the rows decoded beside it)."""
    ops = native.kernels()
    n, k, group = 37, 640, 32
    codes, scales, mins, _ = _weight(n, k, bits, group, half, False, bits + 3 * half + mins_stored)
    if not mins_stored:  # centred codes: w = scale x (u - 2^(bits - 1))
        mins = None
    w = _dequant(codes, scales, mins, None, k)
    b = torch.randn(n, generator=torch.Generator().manual_seed(1))
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(2))
    x[5, 64:96] = 0.0  # an all-zero block
    if ops.int8_block_dots():
        x_used = _block_rounded(x)
    else:
        x_used = x
    ref = torch.nn.functional.linear(x_used.double(), w.double(), b.double()).float()
    alone = torch.cat([ops.linear_q(x[i : i + 1], codes, scales, mins, None, b, False, 128, False, True, 128)
                       for i in range(70)])  # fmt: skip
    torch.testing.assert_close(alone, ref, atol=1e-4 * (ref.abs().max().item() + 1), rtol=1e-4)
    for rows in (2, 3, 5, 16, 37, 70):
        together = ops.linear_q(x[:rows], codes, scales, mins, None, b, False, 128, False, True, 128)
        assert torch.equal(together, alone[:rows]), rows


@pytest.mark.parametrize("bits,group,half,centred", [(4, 32, True, False), (4, 32, True, True), (5, 32, True, True),
                                                     (8, 32, True, True), (4, 64, False, False), (8, 16, False, False),
                                                     (8, 64, False, True)],
                         ids=["q4_1", "q4_0", "q5_0", "q8_0", "int4_g64", "int8_g16", "int8_g64"])
def test_every_row_count_of_a_verification_step_matches_each_row_alone(bits, group, half, centred):
    """A verification step's 2-8 rows (a decode row and its guesses) run through the block kernel in one
    pass over the weight rows, more rows in passes of up to 8 and the rest: every row count from 1 to 19
    gives each row the bits it has alone (the exactness of speculative decoding rests on it) and the
    fake-quantized reference's value. 23 weight rows: tiles of four and three rows left one by one."""
    ops = native.kernels()
    n, k = 23, 576
    codes, scales, mins, _ = _weight(n, k, bits, group, half, False, 7 * bits + group + half)
    if centred:
        mins = None
    w = _dequant(codes, scales, mins, None, k)
    b = torch.randn(n, generator=torch.Generator().manual_seed(3))
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(bits + group))
    x[6, 128:160] = 0.0  # an all-zero block in the wide pass
    blocks_apply = ops.int8_block_dots()
    if blocks_apply:
        x_used = _block_rounded(x)
    else:
        x_used = x
    ref = torch.nn.functional.linear(x_used.double(), w.double(), b.double()).float()
    alone = torch.cat([ops.linear_q(x[i : i + 1], codes, scales, mins, None, b, False, 32, False, True, 32)
                       for i in range(19)])  # fmt: skip
    torch.testing.assert_close(alone, ref, atol=1e-4 * (ref.abs().max().item() + 1), rtol=1e-4)
    for rows in range(2, 20):
        together = ops.linear_q(x[:rows], codes, scales, mins, None, b, False, 32, False, True, 32)
        assert torch.equal(together, alone[:rows]) if blocks_apply else torch.allclose(together, alone[:rows]), rows


@pytest.mark.parametrize("centred", [True, False], ids=["centred", "mins"])
@pytest.mark.parametrize("bits,n,k,group,half", [
    (5, 13, 64, 32, True), (5, 33, 192, 64, False), (5, 31, 576, 32, True), (5, 7, 1536, 1536, False),
    (5, 1031, 128, 32, True), (5, 9, 96, 32, False), (6, 13, 64, 16, True), (6, 33, 192, 16, False),
    (6, 31, 576, 32, True), (6, 7, 1536, 1536, False), (6, 1031, 128, 16, True), (6, 9, 96, 16, False)])  # fmt: skip
def test_5_and_6bit_codes_take_the_int8_block_products(bits, n, k, group, half, centred):
    """5-bit codes (nibbles, then the plane of fifth bits; Q5_0 / Q5_1) and 6-bit codes (the sixth bit plane
    after the fifth; Q6_K's values) in the int8 block products, as 4-bit ones: the exact product of the
    block-rounded activations with W, from 1 to 70 activation rows, centred (min -2^(bits-1) x scale) or
    with stored mins, 6-bit codes at groups of 16 too (each nibble half of a 32-block its own scale); one
    row alone gives the same bits as the row beside others, and so does the row past the GEMV's row limit
    where the block limit keeps it. K = 96 (not a multiple of 64) keeps float activations."""
    ops = native.kernels()
    codes, scales, mins, _ = _weight(n, k, bits, group, half, False, n * k + 6 * (bits == 6))
    if centred:
        mins = None
    w = _dequant(codes, scales, mins, None, k)
    b = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(k)) * 2
    x[1, 32:64] = 0.0  # an all-zero block
    x[2, 5] = 40.0  # an outlier: its block's scale
    blocks_apply = ops.int8_block_dots() and _block_applies(bits, k, group, False)
    if blocks_apply:
        x_used = _block_rounded(x)
    else:
        x_used = x
    ref = torch.nn.functional.linear(x_used.double(), w.double(), b.double()).float()
    together = ops.linear_q(x, codes, scales, mins, None, b, False, 70, False, True)
    torch.testing.assert_close(together, ref, atol=1e-4 * (ref.abs().max().item() + 1), rtol=1e-4)
    for rows in (1, 2, 3, 5, 17):
        part = ops.linear_q(x[:rows], codes, scales, mins, None, b, False, 70, False, True)
        assert torch.equal(part, together[:rows]) if blocks_apply else torch.allclose(part, together[:rows])
    beyond = ops.linear_q(x[:9], codes, scales, mins, None, b, False, 2, False, True, 64)
    if blocks_apply:
        assert torch.equal(beyond, together[:9])
    torch.testing.assert_close(ops.dequantize_q(codes, scales, mins, None, k), w, atol=1e-6, rtol=1e-6)
