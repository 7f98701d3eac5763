"""The int8 GEMM for many rows of int8-block weights (csrc/quant_gemm.cpp) against the plain definition:
activations rounded to int8 per block of 32 (scale max|x| / 127, half to even), times the dequantized
weight, in float64. Formats: 4-bit (centred and with mins), 5-bit, 6-bit (Q6_K's values, scales per 16 or
32), 8-bit, an integer level table (MXFP4's kind), float32 and float16 scales, groups of 16 (6-bit only), 32,
64 and whole rows; odd row and column counts. Built for
AVX512-VNNI (zmm) and AVX2 (ymm; 8-bit codes as int16 pairs without AVX-VNNI); where a build has no
GEMM (test_portable_kernels runs this file on each tier) the tests check that the op refuses with a clear
error and is never picked."""

import gguf
import pytest
import torch

from perfxlm.ops import cpu_plan, isa, native
from perfxlm.ops.linear import gemm_max_code, gemm_takes, run_linear_q
from perfxlm.quant import act_blocks, super_scales
from perfxlm.quant.gguf_repack import repack
from perfxlm.quant.reference import fake_quantize_blocks
from perfxlm.quant.weight import ActivationMode, QuantizedWeight, pack_codes

from test_kquant_ops import k_blocks
from test_quant_linear_ops import _centred, _dequant, _weight

ops = native.kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="no compiler for the native kernels")


def _refused(bits: int = 4) -> bool:
    """Where the build has no GEMM (scalar): the op says so, and the layer never picks it. Every build with
    one takes 4-, 5- and 8-bit codes (AVX2 without AVX-VNNI: 8-bit ones widened to int16 pairs)."""
    if gemm_max_code() > 0:
        assert gemm_takes(_qweight(bits, 5, 64, 0)) == ((1 << bits) - 1 <= gemm_max_code())
        return False
    codes, scales, _, _ = _centred(5, 64, bits, 32, False, False, 0)
    with pytest.raises(RuntimeError, match="no int8 GEMM"):
        ops.quant_block_gemm(torch.randn(2, 64), codes, scales, None, None, None)
    assert not gemm_takes(_qweight(bits, 5, 64, 0))
    return True

MXFP4_DOUBLED = torch.tensor([0.0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12])

CASES = [  # bits, n, k, group, half, kind: centred codes, stored mins, or an integer table
    (4, 13, 32, 32, False, "centred"),
    (4, 33, 576, 32, True, "centred"),
    (4, 47, 96, 32, False, "mins"),
    (4, 1030, 64, 64, False, "mins"),
    (4, 17, 160, 32, False, "table"),
    (5, 33, 576, 32, True, "centred"),
    (5, 9, 96, 32, False, "mins"),
    (8, 33, 576, 32, True, "centred"),
    (8, 70, 96, 96, False, "mins"),
    (8, 21, 1536, 1536, False, "centred"),
    (6, 33, 576, 16, True, "centred"),  # Q6_K's groups of 16: each half block closes apart
    (6, 21, 256, 16, False, "centred"),
    (6, 9, 96, 32, False, "centred"),  # rows not whole super-blocks: a float16 scale per 32
]


def _case(bits, n, k, group, half, kind):
    if kind == "mins":
        codes, scales, mins, _ = _weight(n, k, bits, group, half, False, n + k)
        return codes, scales, mins, None
    codes, scales, _, _ = _centred(n, k, bits, group, half, False, n + k)
    return codes, scales, None, (MXFP4_DOUBLED.clone() if kind == "table" else None)


@pytest.mark.parametrize("rows", [1, 7, 37, 130])
@pytest.mark.parametrize("bits,n,k,group,half,kind", CASES)
def test_gemm_matches_the_definition(bits, n, k, group, half, kind, rows):
    if _refused(bits):
        return
    codes, scales, mins, levels = _case(bits, n, k, group, half, kind)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows * k))
    x[0, :32] = 0.0  # an all-zero block
    b = torch.randn(n)
    w = _dequant(codes, scales, mins, levels, k)
    ref = torch.nn.functional.linear(fake_quantize_blocks(x).double(), w.double(), b.double()).float()
    out = ops.quant_block_gemm(x, codes, scales, mins, levels, b)
    torch.testing.assert_close(out, ref, atol=1e-5 * (ref.abs().max().item() + 1), rtol=1e-5)
    assert torch.equal(ops.quant_block_gemm(x, codes, scales, mins, levels, None) + b, out)  # bias added last


@pytest.mark.parametrize("bits,n,k,group,half,kind", [CASES[1], CASES[2], CASES[5], CASES[7], CASES[10]])
def test_a_row_alone_is_bit_identical_to_the_row_in_a_batch(bits, n, k, group, half, kind):
    """A row's int32 block sums and its float steps do not depend on the rows beside it (nor on which
    thread or row tile takes it), so a prompt's token gets the same bits whatever its step held."""
    if _refused(bits):
        return
    codes, scales, mins, levels = _case(bits, n, k, group, half, kind)
    x = torch.randn(131, k, generator=torch.Generator().manual_seed(k))
    b = torch.randn(n)
    together = ops.quant_block_gemm(x, codes, scales, mins, levels, b)
    for i in (0, 5, 6, 64, 130):
        assert torch.equal(ops.quant_block_gemm(x[i : i + 1], codes, scales, mins, levels, b)[0], together[i])
    assert torch.equal(ops.quant_block_gemm(x[60:77], codes, scales, mins, levels, b), together[60:77])


def test_bad_weights_are_errors_that_say_what_to_fix():
    if _refused():
        return
    codes, scales, mins, _ = _weight(4, 64, 8, 16, False, False, 0)  # 8-bit groups of 16
    with pytest.raises(RuntimeError, match="multiples of 32"):
        ops.quant_block_gemm(torch.randn(3, 64), codes, scales, mins, None, None)
    codes, scales, mins, _ = _weight(4, 64, 6, 16, False, False, 0)  # 6-bit groups of 16 with mins
    with pytest.raises(RuntimeError, match="multiples of 32"):
        ops.quant_block_gemm(torch.randn(3, 64), codes, scales, mins, None, None)
    codes, scales, mins, _ = _weight(4, 64, 4, 32, False, False, 0)
    with pytest.raises(RuntimeError, match="bytes per row"):
        ops.quant_block_gemm(torch.randn(3, 96), codes, scales, mins, None, None)
    with pytest.raises(RuntimeError, match="integers"):
        ops.quant_block_gemm(torch.randn(3, 64), codes, scales, None, torch.linspace(-1, 1, 16), None)
    with pytest.raises(RuntimeError, match="bias size"):
        ops.quant_block_gemm(torch.randn(3, 64), codes, scales, mins, None, torch.randn(5))
    with pytest.raises(RuntimeError, match="2-D float32"):
        ops.quant_block_gemm(torch.randn(3, 64, dtype=torch.float64), codes, scales, mins, None, None)


def _qweight(bits, n, k, seed, act="float"):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // 32, generator=g) * 0.02 + 0.001
    return QuantizedWeight(pack_codes(values, bits), scales, None, None, bits, 32, act, n, k)


@pytest.mark.parametrize("bits", [4, 8])
def test_many_rows_of_a_layer_run_the_gemm_under_an_int8_plan_and_the_float_gemm_under_float32(bits):
    if _refused(bits) or (1 << bits) - 1 > gemm_max_code():
        return
    weight = _qweight(bits, 45, 192, bits)
    weight.activations = ActivationMode.INT8_NATIVE  # a weight-only format under quant_activations=int8
    assert gemm_takes(weight)
    x = torch.randn(3, 67, 192, generator=torch.Generator().manual_seed(1))  # 201 rows: past every GEMV limit
    b = torch.randn(45)
    previous = cpu_plan.use(quant_gemm="int8", quant_max_rows=32, quant_block_max_rows=128)
    try:
        fast = run_linear_q(ops, x, weight, b, False, True, False)
        cpu_plan.use(quant_gemm="float32")
        slow = run_linear_q(ops, x, weight, b, False, True, False)
    finally:
        cpu_plan.use(previous)
    assert fast.shape == (3, 67, 45)
    direct = ops.quant_block_gemm(x.reshape(-1, 192), weight.codes, weight.scales, None, None, b)
    assert torch.equal(fast.reshape(-1, 45), direct)
    torch.testing.assert_close(fast, slow, atol=1e-4 * (slow.abs().max().item() + 1), rtol=1e-4)


def test_8bit_codes_take_the_gemm_at_every_row_count_the_plan_gives_it():
    """8-bit codes run at the GEMM's full rate on every build with one (AVX2 without AVX-VNNI: int16 pairs),
    so from quant_gemm_rows up, prompt sizes included, the module path (run_linear_q) and the fused layer's
    linear_q route them to it alike; below it the block GEMV."""
    if _refused(8):
        return
    assert gemm_max_code() == 255
    weight = _qweight(8, 37, 192, 8)
    assert gemm_takes(weight)
    weight.activations = ActivationMode.INT8_NATIVE
    b = torch.randn(37)
    previous = cpu_plan.use(quant_gemm="int8", quant_gemm_rows=16, quant_max_rows=32, quant_block_max_rows=128)
    try:
        for rows, gemm in ((15, False), (16, True), (257, True), (603, True)):
            x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
            module = run_linear_q(ops, x, weight, b, False, True, False)
            fused = ops.linear_q(x, weight.codes, weight.scales, None, None, b, False, 32, False, True, 128, 16)
            direct = ops.quant_block_gemm(x, weight.codes, weight.scales, None, None, b)
            assert torch.equal(module, fused)
            assert torch.equal(module, direct) == gemm, rows
    finally:
        cpu_plan.use(previous)


def test_the_plan_takes_the_int8_gemm_only_where_the_tier_has_it(monkeypatch):
    monkeypatch.setenv("PERFXLM_QUANT_GEMM", "float32")
    assert cpu_plan.detect().quant_gemm == "float32"
    monkeypatch.setenv("PERFXLM_QUANT_GEMM", "fast")
    with pytest.raises(ValueError, match="PERFXLM_QUANT_GEMM='fast'"):
        cpu_plan.detect()
    monkeypatch.setenv("PERFXLM_QUANT_GEMM", "int8")
    if "avx2" in isa.visible_flags():
        assert cpu_plan.detect().quant_gemm == "int8"
    else:
        with pytest.raises(ValueError, match="needs AVX2"):
            cpu_plan.detect()
    monkeypatch.delenv("PERFXLM_QUANT_GEMM")
    flags = isa.visible_flags()
    measured = "avx512_vnni" in flags or ("avx2" in flags and "avx512f" not in flags)
    amx = isa.has_fast_bf16() and isa.has_amx()  # only AMX keeps quantized rows on the bf16 GEMM
    assert cpu_plan.detect().quant_gemm == ("int8" if measured and not amx else "float32")
    plan = cpu_plan.detect()
    assert f"then the {plan.quant_gemm} GEMM" in plan.describe()
    # parallel decode's rows take the int8 GEMM from 16 rows where it is the default, else past the GEMV
    assert plan.quant_gemm_rows == (16 if plan.quant_gemm == "int8" and not isa.has_fast_bf16() else 0)


def test_per_token_w8a8_and_groups_of_16_keep_their_own_paths():
    assert not gemm_takes(_qweight(8, 8, 64, 0, act="int8"))
    codes, scales, mins, _ = _weight(8, 64, 8, 16, False, False, 0)
    assert not gemm_takes(QuantizedWeight(codes, scales, None, None, 8, 16, "float", 8, 64))
    codes, scales, mins, _ = _weight(8, 64, 6, 16, False, False, 0)
    assert not gemm_takes(QuantizedWeight(codes, scales, mins, None, 6, 16, "float", 8, 64))
    six = QuantizedWeight(codes, scales, None, None, 6, 16, "float", 8, 64)  # Q6_K's: centred
    assert gemm_takes(six) == (63 <= gemm_max_code())


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_two_level_scales_run_the_gemm(qtype):
    """A GGUF K-quant weight holds byte scales (a byte per group, float16 per 256): a prefill under the int8
    plan hands them to the GEMM as stored, which forms the values of the multiplied-out form (the block
    kernel's). Q6_K's are signed bytes per 16, each half block closing apart."""
    if _refused({"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}[qtype]):
        return
    q = gguf.GGMLQuantizationType[qtype]
    weight = repack(k_blocks(q, 21, 512, 3), q, (21, 512))
    weight.activations = ActivationMode.INT8_NATIVE
    assert weight.two_level and gemm_takes(weight)
    x = torch.randn(150, 512, generator=torch.Generator().manual_seed(2))  # past every GEMV limit
    previous = cpu_plan.use(quant_gemm="int8", quant_max_rows=32, quant_block_max_rows=128)
    try:
        fast = run_linear_q(ops, x, weight, None, False, True, False)
        cpu_plan.use(quant_gemm="float32")
        slow = run_linear_q(ops, x, weight, None, False, True, False)
    finally:
        cpu_plan.use(previous)
    flat = weight.flat()
    # the same bits as the float form where both round alike (the float form is no K-quant: no q8_K)
    assert torch.equal(fast, ops.quant_block_gemm(x, weight.codes, weight.scales, weight.mins, None, None))
    with act_blocks.using("float" if act_blocks.mode() == "float" else "fine"):
        assert torch.equal(ops.quant_block_gemm(x, weight.codes, weight.scales, weight.mins, None, None),
                           ops.quant_block_gemm(x, flat.codes, flat.scales, flat.mins, None, None))
    torch.testing.assert_close(fast, slow, atol=1e-4 * (slow.abs().max().item() + 1), rtol=1e-4)


@pytest.mark.parametrize("bits,group,signed,with_mins,n", [
    (4, 32, False, True, 21),  # Q4_K's form: 8 groups per factor, the panels' 8 x 8 path
    (4, 64, False, True, 13),  # int4's wider groups: fewer than 8 per factor, group by group
    (4, 128, False, True, 40),
    (5, 32, False, True, 9),  # Q5_K's
    (6, 16, True, False, 21),  # Q6_K's: signed bytes per 16, centred
])
def test_two_level_bytes_give_the_bits_of_their_float_form(bits, group, signed, with_mins, n):
    """The GEMM reads K-quants' two-level scales (a byte per group, a float16 factor per 256) as stored,
    forming each group's value as QuantizedWeight.flat() does: the same bits as the multiplied-out form."""
    if _refused(bits):
        return
    k = 512
    g = torch.Generator().manual_seed(bits * group + n)
    codes = pack_codes(torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8), bits)

    def table(sign_ok):
        sub = (torch.randint(-128, 128, (n, k // group), generator=g, dtype=torch.int8) if sign_ok
               else torch.randint(0, 256, (n, k // group), generator=g, dtype=torch.uint8))
        return super_scales.join(sub, (torch.rand(n, k // 256, generator=g) * 1e-3 + 1e-4).half())

    scales = table(signed)
    mins = table(False) if with_mins else None
    weight = QuantizedWeight(codes, scales, mins, None, bits, group, "float", n, k)
    flat = weight.flat()
    x = torch.randn(37, k, generator=g)
    b = torch.randn(n, generator=g)
    raw = ops.quant_block_gemm(x, codes, scales, mins, None, b)
    # the float form is no K-quant to the GEMM (no q8_K under ggml's rule): the same bits where both take
    # blocks of 32
    with act_blocks.using("float" if act_blocks.mode() == "float" else "fine"):
        assert torch.equal(ops.quant_block_gemm(x, codes, scales, mins, None, b),
                           ops.quant_block_gemm(x, flat.codes, flat.scales, flat.mins, None, b))
    ref = torch.nn.functional.linear(fake_quantize_blocks(x, weight.kquant).double(), weight.dequantize().double(),
                                     b.double()).float()
    torch.testing.assert_close(raw, ref, atol=1e-5 * (ref.abs().max().item() + 1), rtol=1e-5)


def test_extreme_6bit_codes_match_the_definition():
    """Codes 0 and 63 (-32 and 31 about the centre) against activations at +-127, scales per 16 of both
    signs (Q6_K's sub-scales are signed): vpmaddubsw's pair sums stay far from int16's limit (2 x 63 x 127)."""
    if _refused(6):
        return
    n, k = 11, 128
    g = torch.Generator().manual_seed(6)
    values = torch.where(torch.rand(n, k, generator=g) < 0.5, 0, 63).to(torch.uint8)
    values[0] = 63
    codes = pack_codes(values, 6)
    scales = (torch.rand(n, k // 16, generator=g) - 0.5) * 0.04
    x = torch.where(torch.rand(7, k, generator=g) < 0.5, -1.0, 1.0)
    x[1] = 1.0
    ref = torch.nn.functional.linear(fake_quantize_blocks(x).double(), _dequant(codes, scales, None, None, k).double()).float()
    out = ops.quant_block_gemm(x, codes, scales, None, None, None)
    torch.testing.assert_close(out, ref, atol=1e-5 * (ref.abs().max().item() + 1), rtol=1e-5)


def test_extreme_8bit_codes_do_not_saturate_the_int16_pair_sums():
    """Codes 0 and 255 (signed -128 and 127 on AVX2 without AVX-VNNI) against activations at +-127: the
    largest pair sums the products form (2 x 128 x 127 in vpmaddwd's int32 lanes on AVX2; vpmaddubsw's int16
    ones would saturate)."""
    if _refused(8):
        return
    n, k = 19, 96
    g = torch.Generator().manual_seed(3)
    codes = torch.where(torch.rand(n, k, generator=g) < 0.5, 0, 255).to(torch.uint8)
    codes[0] = 0  # a row of -128s: |c| = 128, whose negation int8 cannot hold
    scales = torch.rand(n, k // 32, generator=g) * 0.02 + 0.001
    x = torch.where(torch.rand(5, k, generator=g) < 0.5, -1.0, 1.0)
    x[1] = 1.0
    x[2] = -1.0
    ref = torch.nn.functional.linear(fake_quantize_blocks(x).double(), _dequant(codes, scales, None, None, k).double()).float()
    out = ops.quant_block_gemm(x, codes, scales, None, None, None)
    torch.testing.assert_close(out, ref, atol=1e-5 * (ref.abs().max().item() + 1), rtol=1e-5)


@pytest.mark.parametrize(
    "bits,n,k,group,half,kind", [CASES[1], CASES[3], CASES[5], CASES[7], CASES[10], (4, 17, 192, 32, False, "table")])
def test_linear_q_runs_the_gemm_from_gemm_rows_and_the_gemv_below(bits, n, k, group, half, kind):
    """linear_q's gemm_rows (the fused decode layer's way to the GEMM): from that many rows an int8-block
    weight the GEMM takes gets the GEMM's bits, below it the block GEMV's; -1 never, 0 only past the GEMV
    limits."""
    if _refused(bits) or (1 << bits) - 1 > gemm_max_code():
        return
    codes, scales, mins, levels = _case(bits, n, k, group, half, kind)
    b = torch.randn(n)
    for rows in (5, 6, 17):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        gemm = ops.quant_block_gemm(x, codes, scales, mins, levels, b)
        gemv = ops.linear_q(x, codes, scales, mins, levels, b, False, 32, False, True, 128, -1)
        assert torch.equal(ops.linear_q(x, codes, scales, mins, levels, b, False, 32, False, True, 128, 6),
                           gemm if rows >= 6 else gemv)
        assert torch.equal(ops.linear_q(x, codes, scales, mins, levels, b, False, 32, False, True, 128, 0), gemv)
        assert torch.equal(ops.linear_q(x, codes, scales, mins, levels, b, False, 4, False, True, 4, 0), gemm)
        torch.testing.assert_close(gemm, gemv, atol=1e-4 * (gemv.abs().max().item() + 1), rtol=1e-4)


def test_layers_take_the_gemm_from_the_plans_gemm_rows(monkeypatch):
    if _refused(4):
        return
    weight = _qweight(4, 45, 192, 4)
    weight.activations = ActivationMode.INT8_NATIVE
    b = torch.randn(45)
    previous = cpu_plan.use(quant_gemm="int8", quant_max_rows=32, quant_block_max_rows=128, quant_gemm_rows=7)
    try:
        for rows in (6, 7, 9):
            x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
            y = run_linear_q(ops, x, weight, b, False, True, False)
            gemm = ops.quant_block_gemm(x, weight.codes, weight.scales, None, None, b)
            assert torch.equal(y, gemm) == (rows >= 7)
    finally:
        cpu_plan.use(previous)
    monkeypatch.setenv("PERFXLM_QUANT_GEMM", "int8")
    monkeypatch.setenv("PERFXLM_QUANT_GEMM_ROWS", "24")
    plan = cpu_plan.detect()
    assert plan.quant_gemm_rows == 24 and "from 24 rows" in plan.describe()
    monkeypatch.setenv("PERFXLM_QUANT_GEMM_ROWS", "-3")
    with pytest.raises(ValueError, match="PERFXLM_QUANT_GEMM_ROWS"):
        cpu_plan.detect()
