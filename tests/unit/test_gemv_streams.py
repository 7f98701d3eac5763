"""The order batch-1 GEMVs read their weights in (csrc/read_streams.h: one sequential stream, or a range's
two halves side by side): each group's sums are the same either way, so every row-group GEMV (Q8_0 / Q4_0,
Q4_1, the K-quants) gives the same bits under both, at odd group counts (a range whose second half is one
group shorter, a last group of fewer than 8 rows), one and several threads, one and several activation
rows, and through the fused projection's column ranges; the bf16 panel kernel likewise at batch 1. On
whichever ISA build runs (test_portable_kernels runs the lower tiers)."""

import gguf
import numpy as np
import pytest
import torch

from perfxlm.ops import native
from perfxlm.ops.linear import run_linear_q
from perfxlm.quant.gguf_repack import repack
from perfxlm.quant.layouts import CodeLayout
from perfxlm.quant.weight import ActivationMode

Q = gguf.GGMLQuantizationType
# format: (GGUF type, row-group layout, the blocks' float16 fields (d, dmin) to make finite)
FORMATS = {"q8_0": (Q.Q8_0, CodeLayout.ROWS8, (0,)), "q4_0": (Q.Q4_0, CodeLayout.ROWS8, (0,)),
           "q4_1": (Q.Q4_1, CodeLayout.ROWS8_M, (0, 2)), "q4_k": (Q.Q4_K, CodeLayout.ROWS8_K, (0, 2)),
           "q5_k": (Q.Q5_K, CodeLayout.ROWS8_K, (0, 2)), "q6_k": (Q.Q6_K, CodeLayout.ROWS8_K, (208,))}


def grouped(fmt: str, n: int, k: int, seed: int):
    qtype, layout, f16_at = FORMATS[fmt]
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
    for at in f16_at:
        scales = (rng.uniform(0.5, 1.5, raw.shape[0]) * 1e-2).astype(np.float16)
        raw[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    w = repack(raw, qtype, (n, k))
    w.use_activations(ActivationMode.INT8_NATIVE)
    r = w.in_layout(layout)
    assert r.layout is layout
    return r


@pytest.fixture
def ops():
    ops = native.kernels()
    if ops is None or not hasattr(ops, "set_gemv_streams"):
        pytest.skip("no native row-group kernels in this build")
    before, threads = ops.gemv_streams(), torch.get_num_threads()
    yield ops
    ops.set_gemv_streams(before)
    torch.set_num_threads(threads)


def test_the_setting_takes_each_kernels_default_one_or_two(ops):
    assert ops.set_gemv_streams(2) == 2 and ops.gemv_streams() == 2
    assert ops.set_gemv_streams(1) == 1
    assert ops.set_gemv_streams(0) == 0
    for bad in (3, -1):
        with pytest.raises(RuntimeError):
            ops.set_gemv_streams(bad)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [7, 37, 203])  # 1, 5 and 26 groups
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("threads", [1, 2])
def test_both_orders_give_the_same_bits(ops, fmt, n, rows, threads):
    k = 768 if FORMATS[fmt][1] is CodeLayout.ROWS8_K else 160  # 3 super-blocks, 5 blocks: odd counts
    r = grouped(fmt, n, k, seed=n + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n * rows))
    bias = torch.randn(n)
    torch.set_num_threads(threads)
    ops.set_gemv_streams(1)
    one = run_linear_q(ops, x, r, bias, False, True, False)
    ops.set_gemv_streams(2)
    two = run_linear_q(ops, x, r, bias, False, True, False)
    ops.set_gemv_streams(0)
    default = run_linear_q(ops, x, r, bias, False, True, False)
    assert torch.isfinite(one).all()
    assert torch.equal(one, two) and torch.equal(one, default)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q4_k"])
def test_the_fused_projection_ranges_give_the_same_bits(ops, fmt):
    if not hasattr(ops, "lora_project"):
        pytest.skip("no fused projection op in this build")
    k = 512 if fmt == "q4_k" else 192
    r = grouped(fmt, 77, k, seed=4)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1))
    ops.set_gemv_streams(1)
    one = ops.lora_project(x, r.native_parts(), 77, None, 8, False, True, 8, -1, -1, [], 0)
    ops.set_gemv_streams(2)
    two = ops.lora_project(x, r.native_parts(), 77, None, 8, False, True, 8, -1, -1, [], 0)
    assert torch.equal(one, two)


@pytest.mark.parametrize("n", [7, 37, 203, 1000])  # 1, 3, 13 and 63 panels of 16 columns
@pytest.mark.parametrize("k", [64, 200])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_bf16_panels_give_the_same_bits_in_both_orders(ops, n, k, threads):
    from perfxlm.ops.linear import pack_bf16

    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(1, k, generator=g)
    bias = torch.randn(n, generator=g)
    torch.set_num_threads(threads)
    packed = pack_bf16(w)
    ops.set_gemv_streams(1)
    one = ops.linear_bf16_packed(x, packed, n, bias)
    ops.set_gemv_streams(2)
    two = ops.linear_bf16_packed(x, packed, n, bias)
    ref = x @ w.float().t() + bias
    torch.testing.assert_close(one, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(one, two)
