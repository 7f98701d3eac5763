"""The int8 block GEMV on each vector width an AVX512-VNNI build has (its zmm tiles, and dots256.h's ymm
tiles with vpdpbusd on ymm, the CPU plan's `dot_width` / PERFXLM_DOT_WIDTH): the block-product tests of
the plain linear path (every format: 4-, 5-, 6- and 8-bit codes, centred or with mins, float and two-level
scales), of the fused experts and of the LoRA ranges, each forced to 256 and to 512 bits, whatever this
CPU's plan picks. Other builds have only the 256-bit tiles: there the 512 cases skip. The AVX2 and
AVX-VNNI builds' own runs of the same tests are test_portable_kernels'."""

import pytest

from perfxlm.ops import cpu_plan, native
from tests.unit.test_kquant_ops import test_dequantize_bit_exact_and_products_match  # noqa: F401
from tests.unit.test_lora_kernel import (  # noqa: F401
    test_projection_with_its_adapters_in_one_region_gives_the_product_then_the_adapters,
)
from tests.unit.test_moe import test_a_row_alone_equals_the_same_row_in_a_batch  # noqa: F401
from tests.unit.test_moe import test_native_experts_equal_the_torch_loop  # noqa: F401
from tests.unit.test_quant_linear_ops import (  # noqa: F401
    test_5_and_6bit_codes_take_the_int8_block_products,
    test_centred_codes_match_reference_and_their_stored_mins,
    test_every_row_count_of_a_verification_step_matches_each_row_alone,
    test_int8_block_activations_match_reference,
    test_int8_block_rows_alone_equal_rows_together_and_the_4bit_row_limit,
    test_parallel_decode_rows_match_reference_and_each_row_alone,
)

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no compiler for the native kernels")


def _has_zmm_tiles() -> bool:
    return native.kernels().compiled_isa() in ("avx512_vnni", "avx512_bf16", "amx")


@pytest.fixture(autouse=True, params=[256, 512], ids=["ymm", "zmm"])
def dot_width(request):
    """Every test of this module under the plan's dot width forced to `request.param`."""
    if request.param == 512 and not _has_zmm_tiles():
        pytest.skip("this build has only the 256-bit int8 tiles")
    previous = cpu_plan.use(dot_width=request.param)
    assert native.kernels().int8_dot_width() == request.param  # the plan put it in the kernels
    yield request.param
    cpu_plan.use(previous)


def test_the_width_changes_the_kernel_not_the_product(dot_width):
    """Both widths compute the block product of the same int8 activations: equal to float rounding, on
    the default model's Q8_0 / Q4_0 shapes at batch 1."""
    import torch

    from tests.unit.test_quant_linear_ops import _block_rounded, _centred, _dequant

    ops = native.kernels()
    for bits, n, k in ((8, 960, 576), (4, 576, 1536)):
        codes, scales, levels, _ = _centred(n, k, bits, 32, True, False, n + k)
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(k))
        ref = torch.nn.functional.linear(_block_rounded(x).double(), _dequant(codes, scales, None, None, k).double())
        out = ops.linear_q(x, codes, scales, None, None, None, False, 8, False, True)
        torch.testing.assert_close(out.double(), ref, atol=1e-4 * (ref.abs().max().item() + 1), rtol=1e-4)


def test_the_plan_and_the_kernels_agree_on_the_width(dot_width, monkeypatch):
    """`reset` gives the kernels the environment's rule again, the rule the kernels load with; a forced
    width reaches them; 512 on a build without zmm tiles is refused by name."""
    ops = native.kernels()
    monkeypatch.delenv("PERFXLM_DOT_WIDTH", raising=False)
    cpu_plan.reset()
    assert ops.int8_dot_width() == cpu_plan.plan().dot_width
    monkeypatch.setenv("PERFXLM_DOT_WIDTH", "256")
    cpu_plan.reset()
    assert cpu_plan.plan().dot_width == 256 and ops.int8_dot_width() == 256
    monkeypatch.setenv("PERFXLM_DOT_WIDTH", "384")
    with pytest.raises(ValueError, match="PERFXLM_DOT_WIDTH"):
        cpu_plan.detect()
    if not _has_zmm_tiles():
        monkeypatch.setenv("PERFXLM_DOT_WIDTH", "512")
        with pytest.raises(ValueError, match="AVX512-VNNI"):
            cpu_plan.detect()
    monkeypatch.delenv("PERFXLM_DOT_WIDTH")
    cpu_plan.reset()
