"""K-quant weights' activations as ggml's q8_K (perfxlm.quant.act_blocks "ggml", csrc/act_blocks.h
BlockScales): one float32 scale per 256 values, checked against a plain-torch transcription of ggml's
quantize_row_q8_K (the element of largest |x| with its sign, iscale = -127 / it, nearest_int by the
1.5 x 2^23 trick, capped at 127, d = 1 / iscale) on odd sizes, ties, all-zero super-blocks and super-blocks
whose largest |x| is negative; the native kernels' bytes against the reference bit for bit; the K-quant
products (plain two-level, K-quant row groups, int8 GEMM) under each mode, a row alone as in a batch;
other formats keep blocks of 32 whatever the mode. On every ISA tier via test_portable_kernels."""

import pytest
import torch

from perfxlm.ops import cpu_plan
from perfxlm.quant import act_blocks
from perfxlm.quant.reference import fake_quantize_blocks
from tests.unit import test_kquant_ops as kq
from tests.unit import test_quant_gemm as qg
from tests.unit import test_row_groups_k as rgk
from tests.unit import test_row_groups_k_gemm as rgkg
from tests.unit import test_row_groups_k_layout as rgkl


@pytest.fixture(params=act_blocks.MODES)
def mode(request):
    with act_blocks.using(request.param):
        yield request.param


def ggml_q8k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's quantize_row_q8_K_ref, transcribed: x float32 [M, K] (K % 256 == 0) -> (q int32 [M, K / 256,
    256], d float32 [M, K / 256, 1]), element by element where the order matters."""
    blocks = x.reshape(x.shape[0], -1, 256)
    q = torch.zeros(blocks.shape, dtype=torch.int32)
    d = torch.zeros(blocks.shape[:2] + (1,), dtype=torch.float32)
    for m in range(blocks.shape[0]):
        for b in range(blocks.shape[1]):
            v = blocks[m, b]
            amax, mx = 0.0, 0.0
            for j in range(256):  # the first element of largest |x| (strictly greater), with its sign
                ax = abs(float(v[j]))
                if ax > amax:
                    amax, mx = ax, v[j]
            if amax == 0.0:
                continue
            iscale = torch.tensor(-127.0, dtype=torch.float32) / mx  # float32 division
            # nearest_int: fval + 1.5 x 2^23 in float32, the low 23 bits less 2^22
            val = (iscale * v).float() + torch.tensor(12582912.0, dtype=torch.float32)
            i = (val.view(torch.int32) & 0x007FFFFF) - 0x00400000
            q[m, b] = torch.clamp(i, max=127)
            d[m, b] = torch.tensor(1.0, dtype=torch.float32) / iscale
    return q, d


def awkward(rows: int, k: int, seed: int) -> torch.Tensor:
    """Blocks of very different sizes, and the super-blocks that test the rule's corners."""
    g = torch.Generator().manual_seed(seed)
    size = torch.exp(2 * torch.randn(rows, k // 32, 1, generator=g)).expand(rows, k // 32, 32).reshape(rows, k)
    x = torch.randn(rows, k, generator=g) * size
    x[0, :256] = 0  # an all-zero super-block
    if k >= 512:
        x[0, 256:512] = torch.randn(256, generator=g)
        x[0, 300] = -40.0  # its largest |x| is negative
    # values on rounding ties: largest 127, so iscale is -1 exactly and x.5 is a tie (half to even)
    x[-1, :256] = torch.arange(256, dtype=torch.float32).remainder(127) - 63 + 0.5
    x[-1, 7] = 127.0
    if k >= 512:
        x[-1, 256:512] = -x[-1, :256]  # the same ties, the largest now negative
        x[-1, 260] = 127.0  # +127 after -127 at 263: |x| ties, the first wins
    return x


@pytest.mark.parametrize("rows,k", [(3, 256), (5, 768), (2, 2304)])
def test_the_reference_is_ggmls_q8k_bit_for_bit(rows, k):
    x = awkward(rows, k, rows + k)
    q, d = ggml_q8k(x)
    want = (q.float() * d).view(rows, k)  # ggml's products d x q
    with act_blocks.using("ggml"):
        got = fake_quantize_blocks(x, kquant=True)
        assert torch.equal(got, want)
        assert not got[0, :256].any()
        # each value's size is ggml's (the sign convention only negates d and q together)
        scale = d.abs().expand(-1, -1, 256).reshape(rows, k)
        live = scale > 0
        assert torch.equal(torch.where(live, torch.round(got.abs() / torch.where(live, scale, 1)), 0),
                           q.abs().float().view(rows, k))
        # other weights keep blocks of 32
        assert torch.equal(fake_quantize_blocks(x), fake_quantize_blocks(x, kquant=False))
        assert not torch.equal(fake_quantize_blocks(x), got)
    for other in ("fine", "float"):
        with act_blocks.using(other):
            assert torch.equal(fake_quantize_blocks(x, kquant=True), fake_quantize_blocks(x))


def test_a_short_last_super_block_takes_its_own_values():
    """K not a multiple of 256 (no GGUF K-quant has it; the rule is defined anyway): the last super-block
    is the rest of the row."""
    x = torch.randn(2, 320, generator=torch.Generator().manual_seed(1))
    x[:, 256:] *= 10
    with act_blocks.using("ggml"):
        got = fake_quantize_blocks(x, kquant=True)
    tail = x[:, 256:]
    iscale = torch.full((2, 1), 127.0) / tail.abs().amax(-1, keepdim=True)
    assert torch.equal(got[:, 256:], torch.round(tail * iscale) * (1 / iscale))


def _plain_two_level(n, k, seed):
    return kq.repack(kq.k_blocks(kq.Q.Q4_K, n, k, seed), kq.Q.Q4_K, (n, k))


@pytest.mark.parametrize("rows,k", [(9, 256), (12, 768), (17, 1536)])
def test_the_native_rounding_is_the_references_bit_for_bit(mode, rows, k):
    """Past the GEMV's rows (no int8 GEMM) linear_q multiplies its own rounded rows as floats: equal to the
    same product of the reference's rounded rows only where every byte and scale is equal."""
    ops = rgk.ops_or_skip()
    w = _plain_two_level(11, k, rows)
    x = awkward(rows, k, rows * k)
    got = ops.linear_q(x, w.codes, w.scales, w.mins, None, None, False, 8, False, True, 8, -1)
    # a build without int8 block products (scalar) rounds no activations: the float product of x itself
    rows_in = fake_quantize_blocks(x, w.kquant) if ops.int8_block_dots() else x
    plain = ops.linear_q(rows_in, w.codes, w.scales, w.mins, None, None, False, 8, False)
    assert torch.equal(got, plain)


@pytest.mark.parametrize("fmt", rgk.FORMATS)
def test_k_row_groups_under_each_arithmetic(mode, fmt):
    rgk.test_native_product_matches_the_reference_and_linear_q(fmt, 13, 768, 3)
    rgk.test_native_product_matches_the_reference_and_linear_q(fmt, 45, 2304, 1)
    rgk.test_a_row_alone_gives_the_bits_it_has_in_a_batch(fmt)
    rgkg.test_the_gemm_on_row_groups_gives_the_plain_layouts_bits(fmt, 37, 768, 40)
    rgkg.test_row_slices_and_a_row_alone_keep_the_bits(fmt)
    rgkl.test_linear_q_takes_the_layout_at_every_row_count(fmt, 13, 768, 5)
    rgkl.test_many_rows_under_an_int8_plan_give_the_plain_layouts_bits(fmt)
    rgkl.test_the_fused_projection_and_its_lora_ranges_take_the_layout(fmt)


@pytest.mark.parametrize("qtype", kq.KQUANTS, ids=lambda q: q.name)
def test_plain_k_quants_under_each_arithmetic(mode, qtype):
    kq.test_dequantize_bit_exact_and_products_match(qtype, 7, 512)


@pytest.mark.parametrize("case", [(4, 32, False, True, 21), (5, 32, False, True, 9), (6, 16, True, False, 21)])
def test_the_int8_gemm_on_two_level_bytes_under_each_arithmetic(mode, case):
    qg.test_two_level_bytes_give_the_bits_of_their_float_form(*case)


def test_only_k_quant_products_change_with_q8k():
    """ggml against fine: a K-quant weight's product moves (other activation bytes), a Q4_0-like one
    (float scales per 32) does not move at all; without int8 block products (scalar build) neither moves."""
    ops = rgk.ops_or_skip()
    k = 768
    w = _plain_two_level(9, k, 3)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    codes = torch.randint(0, 256, (9, k // 2), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    scales = torch.rand(9, k // 32) * 0.01

    def both():
        kquant = ops.linear_q(x, w.codes, w.scales, w.mins, None, None, False, 8, False, True, 8)
        plain = ops.linear_q(x, codes, scales, None, None, None, False, 8, False, True, 8)
        return kquant, plain

    with act_blocks.using("ggml"):
        k_ggml, p_ggml = both()
    with act_blocks.using("fine"):
        k_fine, p_fine = both()
    assert torch.equal(p_ggml, p_fine)
    assert torch.equal(k_ggml, k_fine) != ops.int8_block_dots()


def test_the_plan_setting_does_not_bypass_the_rule():
    """The module path (run_linear_q) on a plain K-quant weight rounds as the kernels do at every row
    count: the GEMV's rows and the int8 GEMM's."""
    ops = rgk.ops_or_skip()
    from perfxlm.ops.linear import run_linear_q

    k = 512
    w = _plain_two_level(21, k, 9)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(3))
    with act_blocks.using("ggml"):
        # a build without int8 block products (scalar) rounds no activations on either row path
        rows_in = fake_quantize_blocks(x, True) if ops.int8_block_dots() else x
        ref = torch.nn.functional.linear(rows_in.double(), w.dequantize().double()).float()
        for gemm_rows in (1, 1 << 20):
            previous = cpu_plan.use(quant_gemm="int8", quant_gemm_rows=gemm_rows)
            try:
                got = run_linear_q(ops, x, w, None, False, True, False)
            finally:
                cpu_plan.use(previous)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
