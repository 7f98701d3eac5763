"""The row tiles of the row-group GEMVs (csrc/row_groups_run.h): a step's activation rows run in tiles that
share each block's loaded codes, up to 8 rows per tile on AVX-512VL builds (2 on AVX2, where the registers
hold fewer accumulators). set_row_tile / PERFXLM_ROW_TILE caps the tile; every cap must give each row the
bits it has alone, for GGUF Q8_0, Q4_0 (row_groups.h) and Q4_1 (row_groups_m.h, whose mins' term runs in a
pass of its own past 4 rows), at odd output and block counts, on whichever ISA build runs
(test_portable_kernels runs the lower tiers)."""

import pytest
import torch

from perfxlm.ops import native
from perfxlm.quant import reference, row_groups
from tests.unit.test_row_groups import gguf_weight
from tests.unit.test_row_groups_m import grouped

CAPS = [0, 1, 2, 3, 4, 5, 6, 7, 8]


@pytest.fixture
def ops():
    ops = native.kernels()
    if ops is None or not hasattr(ops, "set_row_tile"):
        pytest.skip("no native row-group kernels in this build")
    before = ops.set_row_tile(0)
    yield ops
    ops.set_row_tile(0)
    assert ops.set_row_tile(0) == before


def test_the_cap_is_checked_and_reported(ops):
    full = ops.set_row_tile(0)
    assert full in (2, 8)  # the build's tile: AVX-512VL 8, else 2
    assert ops.set_row_tile(1) == 1
    assert ops.set_row_tile(8) == full
    for bad in (-1, 9):
        with pytest.raises(RuntimeError):
            ops.set_row_tile(bad)


def products(ops, rows, k, fn):
    """fn(x) at every cap, and each row alone at the build's tile."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows * k))
    by_cap = {}
    for cap in CAPS:
        ops.set_row_tile(cap)
        by_cap[cap] = fn(x)
    ops.set_row_tile(0)
    alone = torch.cat([fn(x[m:m + 1]) for m in range(rows)])
    return x, by_cap, alone


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows,k", [(5, 224), (6, 160), (7, 96), (8, 352), (9, 128), (13, 96)])
def test_q8_0_and_q4_0_rows_keep_their_bits_at_every_tile(ops, bits, rows, k):
    n = 21
    w = gguf_weight(bits, n, k, seed=rows)
    codes8, scales8 = row_groups.pack(w.codes, w.scales, bits)
    bias = torch.randn(n)
    x, by_cap, alone = products(ops, rows, k, lambda x: ops.linear_q_rows8(x, codes8, scales8, bits, n, bias))
    torch.testing.assert_close(by_cap[0], reference.block_reference_linear(x, w, bias), rtol=1e-5,
                               atol=1e-5 * by_cap[0].abs().max().item())
    for cap in CAPS:
        assert torch.equal(by_cap[cap], alone), cap


@pytest.mark.parametrize("rows,k", [(5, 320), (6, 352), (7, 160), (8, 96), (9, 224), (13, 128)])
def test_q4_1_rows_keep_their_bits_at_every_tile(ops, rows, k):
    n = 45
    w, r = grouped(n, k, seed=rows)
    x, by_cap, alone = products(ops, rows, k, lambda x: ops.linear_q_rows8_m(x, r.codes, r.scales, r.mins, n, None))
    torch.testing.assert_close(by_cap[0], reference.block_reference_linear(x, w, None), rtol=1e-5,
                               atol=1e-5 * by_cap[0].abs().max().item())
    for cap in CAPS:
        assert torch.equal(by_cap[cap], alone), cap
