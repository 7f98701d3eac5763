"""The fused decode layer's LoRA kernel (csrc/lora_kernels.cpp) against a plain-torch reference: rows of
several slots and of none, a fused projection's parts (each B row adds only to its part's columns),
float32, bfloat16 and int8 (codes + 128) adapters, strided rows, and steps big enough to split across threads.
The operands reach the kernel as the layer's adapter block (perfxlm/lora/pack.py), as in the fused layer."""

from __future__ import annotations

import pytest
import torch

from perfxlm.lora.pack import pack_layer
from perfxlm.ops import native

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no compiler for the native kernels")


def _operands(K, parts, slots, seed, dtype):
    """One projection's packed operands for `slots` adapters, each with a rank per part: (A, B^T, scale,
    cols). B^T holds noise outside each row's part, which the kernel must not add."""
    g = torch.Generator().manual_seed(seed)
    N = parts[-1][1]
    cols, a_rows = [], []
    for slot, ranks in slots:
        for (n0, n1), r in zip(parts, ranks):
            cols += [(slot, n0, n1)] * r
    R = len(cols)
    if dtype == torch.uint8:
        a = torch.randint(0, 256, (R, K), generator=g, dtype=torch.uint8)
        bt = torch.randint(0, 256, (R, N), generator=g, dtype=torch.uint8)
    else:
        a = torch.randn(R, K, generator=g).to(dtype)
        bt = torch.randn(R, N, generator=g).to(dtype)
    scale = torch.rand(R, generator=g) + 0.5
    return a, bt, scale, torch.tensor(cols, dtype=torch.int32)


def _values(w):
    return w.double() - 128 if w.dtype == torch.uint8 else w.double()


def _reference(y, x, row_slot, a, bt, scale, cols):
    a, bt = _values(a), _values(bt)
    out = y.double().clone()
    for c, (slot, n0, n1) in enumerate(cols.tolist()):
        rows = row_slot == slot
        h = (x[rows].double() @ a[c].double()) * float(scale[c])
        out[rows, n0:n1] += h[:, None] * bt[c, n0:n1].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("rows,K,parts,threads", [
    (1, 37, [(0, 20), (20, 27), (27, 34)], 1),  # one row, q|k|v parts of odd widths
    (5, 53, [(0, 41)], 2),
    (7, 64, [(0, 96), (96, 101)], 1),  # two rows of a slot, widths a multiple of the paired blocks
    (70, 45, [(0, 13), (13, 150)], 2),  # more rows than a tile, many tiles
    # big enough to split both passes across threads (past 256K multiply-adds)
    (65, 1031, [(0, 250), (250, 333), (333, 419)], 2),
])
def test_lora_rows_match_reference(dtype, rows, K, parts, threads):
    ops = native.kernels()
    # slots 0, 2 and 3 packed (slot 1 empty: its columns absent); slot 3 lacks the first part
    slots = [(0, [3] * len(parts)), (2, [5] * len(parts)), (3, [0] + [2] * (len(parts) - 1))]
    a, bt, scale, cols = _operands(K, parts, slots, seed=rows, dtype=dtype)
    N = parts[-1][1]
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(rows, K + 9, generator=g)
    x = wide[:, 4 : 4 + K]  # rows at a stride, as a projection's input view may be
    y = torch.randn(rows, N, generator=g)
    row_slot = torch.tensor([(-1, 0, 2, 3, 1)[i % 5] for i in range(rows)], dtype=torch.int32)
    want = _reference(y, x, row_slot, a, bt, scale, cols)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = y.clone()
        ops.lora_add(got, x, [row_slot, pack_layer([(a, bt, scale, cols)])], 0)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # rows of no slot, or of a slot without columns here, are untouched
    untouched = (row_slot == -1) | (row_slot == 1)
    assert torch.equal(got[untouched], y[untouched])


def test_lora_second_projection_and_empty_operands():
    ops = native.kernels()
    a, bt, scale, cols = _operands(19, [(0, 23)], [(1, [4])], seed=1, dtype=torch.float32)
    x, y = torch.randn(3, 19), torch.randn(3, 23)
    row_slot = torch.tensor([1, -1, 1], dtype=torch.int32)
    block = pack_layer([None, (a, bt, scale, cols), None])
    got = y.clone()
    ops.lora_add(got, x, [row_slot, block], 1)
    torch.testing.assert_close(got.double(), _reference(y, x, row_slot, a, bt, scale, cols), rtol=1e-5, atol=1e-5)
    same = y.clone()
    ops.lora_add(same, x, [row_slot, block], 0)  # no adapter on projection 0
    ops.lora_add(same, x, [row_slot, block], 2)
    ops.lora_add(same, x, [], 0)  # no adapter in the step
    ops.lora_add(same, x, [row_slot, pack_layer([None, None])], 1)  # an empty block: none in the layer
    assert torch.equal(same, y)


def test_lora_bad_operands_are_clear_errors():
    ops = native.kernels()
    a, bt, scale, cols = _operands(19, [(0, 23)], [(0, [4])], seed=2, dtype=torch.float32)
    x, y = torch.randn(2, 19), torch.randn(2, 23)
    row_slot = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="must all be one of"):
        pack_layer([(a, bt.bfloat16(), scale, cols)])
    block = pack_layer([(a, bt, scale, cols)])
    with pytest.raises(RuntimeError, match=r"take \[T, 19\] to \[T, 23\]"):
        ops.lora_add(torch.randn(2, 20), x, [row_slot, block], 0)
    with pytest.raises(RuntimeError, match="not in the adapter block"):
        ops.lora_add(y, x, [row_slot, block], 1)
    with pytest.raises(RuntimeError, match=r"expected \[row_slot, the layer's adapter block\]"):
        ops.lora_add(y, x, [row_slot, a, bt, scale, cols], 0)  # the operand list this block replaced
    with pytest.raises(RuntimeError, match="not an adapter block"):
        ops.lora_add(y, x, [row_slot, torch.zeros(64, dtype=torch.uint8)], 0)
    with pytest.raises(RuntimeError, match="bad adapter block header|bad segment"):
        ops.lora_add(y, x, [row_slot, block[:48].clone()], 0)  # cut short: its segments lie past the end
    bad = cols.clone()
    bad[0, 2] = 99
    with pytest.raises(RuntimeError, match="bad segment"):
        ops.lora_add(y, x, [row_slot, pack_layer([(a, bt, scale, bad)])], 0)


_SPLIT_SCRIPT = """
import sys, torch
from perfxlm.ops import native
torch.set_num_threads(2)
cases = torch.load(sys.argv[1])
out = []
for y, x, ops in cases:
    y = y.clone()
    native.kernels().lora_add(y, x, ops, 0)
    out.append(y)
torch.save(out, sys.argv[2])
"""


def test_small_steps_split_across_threads_give_the_serial_bits(tmp_path):
    # PERFXLM_LORA_PARALLEL_MACS=0 splits even a batch-1 step's products across threads (shrink blocks,
    # then output blocks): the same sums as the calling thread alone, bit for bit, for every part layout
    import os
    import subprocess
    import sys

    ops_ = native.kernels()
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        for rows, K, parts in ((1, 77, [(0, 75)]), (1, 45, [(0, 40), (40, 53), (53, 66)]),
                               (3, 101, [(0, 131), (131, 262)])):
            slots = [(0, [5] * len(parts)), (2, [3] * len(parts))]
            a, bt, scale, cols = _operands(K, parts, slots, seed=rows + K, dtype=dtype)
            g = torch.Generator().manual_seed(K)
            x, y = torch.randn(rows, K, generator=g), torch.randn(rows, parts[-1][1], generator=g)
            row_slot = torch.tensor([(2, 0, -1)[i % 3] for i in range(rows)], dtype=torch.int32)
            cases.append((y, x, [row_slot, pack_layer([(a, bt, scale, cols)])]))
    torch.save(cases, tmp_path / "in.pt")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PERFXLM_LORA_PARALLEL_MACS="0", PYTHONPATH=root)
    run = subprocess.run([sys.executable, "-c", _SPLIT_SCRIPT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                         env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    split = torch.load(tmp_path / "out.pt")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for (y, x, operands), got in zip(cases, split):
            want = y.clone()
            ops_.lora_add(want, x, operands, 0)
            assert not torch.equal(want, y)  # the adapters added something
            assert torch.equal(got, want)
    finally:
        torch.set_num_threads(before)


def _quantized(kind, n, k, seed, parts=True):
    """A quantized weight's native parts in one of the engine's forms."""
    from perfxlm.quant import quantizers, two_level
    from perfxlm.quant.weight import ActivationMode

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if kind.endswith("_rows8"):  # the row-group layout (int8 activation blocks: its products' scheme)
        q = _quantized(kind.removesuffix("_rows8"), n, k, seed, parts=False)
        q.use_activations(ActivationMode.INT8_NATIVE)
        return q.in_row_groups().native_parts()
    q = {
        "q8_0": lambda: quantizers.quantize_symmetric_int8(w, 32, centred=True, half=True),
        "int8": lambda: quantizers.quantize_asymmetric_int8(w, 64),
        "q4_1": lambda: quantizers.quantize_int4_search(w, 32),
        "q4_0": lambda: quantizers.quantize_symmetric_int4(w, 32),
        "k_quant": lambda: two_level.quantize_int4(w, 32),
        "w8a8": lambda: quantizers.quantize_symmetric_int8(w, k, act="int8"),
    }[kind]()
    assert q is not None
    return q.native_parts() if parts else q


@pytest.mark.parametrize("kind", ["q8_0", "int8", "q4_1", "q4_0", "k_quant", "w8a8", "q8_0_rows8", "q4_0_rows8"])
@pytest.mark.parametrize("rows,n,int8_blocks,threads,gemm_rows", [
    (1, 1000, True, 2, 16),  # batch-1 decode: the output split in two ranges, q|k|v-like parts across them
    (1, 1000, False, 1, -1),
    (3, 200, True, 2, -1),  # ranges not multiples of the parts' widths
    (16, 1000, True, 2, 16),  # 16 rows over the slots and none: the int8 GEMM where the weight takes it
    (21, 520, True, 2, -1),  # past the GEMM's threshold, on the GEMV
    (5, 40, False, 2, -1),  # narrower than one 64-column range
])
def test_projection_with_its_adapters_in_one_region_gives_the_product_then_the_adapters(kind, rows, n, int8_blocks,
                                                                                        threads, gemm_rows):
    """A quantized projection at few rows (its GEMV, or the int8 GEMM) runs with the step's adapters in one parallel
    region (each thread its range of outputs: base product, then adapters): the same bits as the product
    alone followed by lora_add, for every weight form, with a bias, and rows of no adapter untouched."""
    ops = native.kernels()
    k = 256
    parts = _quantized(kind, n, k, seed=n + rows)
    q_parts = [(0, n // 2 + 3), (n // 2 + 3, 3 * n // 4 + 1), (3 * n // 4 + 1, n)]  # q | k | v of odd widths
    slots = [(0, [3, 5, 2]), (2, [7, 1, 4]), (3, [0, 2, 6])]
    lora_ops = [*_operands(k, q_parts, slots, seed=rows + 1, dtype=torch.uint8)]
    lora_ops[0] = (lora_ops[0].int() // 9 + 114).to(torch.uint8)  # codes near 128: products of a sane size
    lora_ops[1] = (lora_ops[1].int() // 9 + 114).to(torch.uint8)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    row_slot = torch.tensor([(-1, 0, 2, 3, 1)[(i + 1) % 5] for i in range(rows)], dtype=torch.int32)
    lora = [row_slot, pack_layer([tuple(lora_ops)])]
    codes, scales, mins, levels, act = parts[:5]
    layout = [int(parts[6]), int(parts[7])] if len(parts) == 8 else []  # row groups: layout, out_features
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            want = ops.linear_q(x, codes, scales, mins if mins.numel() else None, levels if levels.numel() else None,
                                bias, bool(act), 32, False, int8_blocks, 128, gemm_rows, *layout)
            ops.lora_add(want, x, lora, 0)
            got = ops.lora_project(x, parts, n, bias, 32, False, int8_blocks, 32, 128, gemm_rows, lora, 0)
            base = ops.lora_project(x, parts, n, bias, 32, False, int8_blocks, 32, 128, gemm_rows, [], 0)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    untouched = (row_slot == -1) | (row_slot == 1)
    assert torch.equal(got[untouched], base[untouched])
    if (~untouched).any():
        assert not torch.equal(got[~untouched], base[~untouched])


_PREFETCH_SCRIPT = """
import sys, torch
from perfxlm.ops import native
torch.set_num_threads(1)
cases = torch.load(sys.argv[1])
with torch.inference_mode():
    out = [native.kernels().lora_project(x, parts, n, None, 32, False, True, 32, 128, -1, lora, 0)
           for x, parts, n, lora in cases]
torch.save(out, sys.argv[2])
"""


@pytest.mark.parametrize("prefetch", ["1", "0", "4096"])
def test_prefetch_setting_changes_no_output(tmp_path, prefetch):
    """PERFXLM_LORA_PREFETCH (default: prefetch the adapters before the base product in steps of two rows
    or more only; 1 every step, 0 never, N the first N bytes) moves bytes into cache and nothing else: a
    1-row and a 5-row projection with its adapters give the same bits under each setting as by default."""
    import os
    import subprocess
    import sys

    ops = native.kernels()
    cases = []
    for rows, n in ((1, 300), (5, 200)):
        parts = _quantized("q4_1", n, 128, seed=n)
        q_parts = [(0, n // 2), (n // 2, n)]
        a, bt, scale, cols = _operands(128, q_parts, [(0, [4, 3]), (2, [2, 5])], seed=rows, dtype=torch.bfloat16)
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
        row_slot = torch.tensor([(2, 0, -1)[i % 3] for i in range(rows)], dtype=torch.int32)
        cases.append((x, list(parts), n, [row_slot, pack_layer([(a, bt, scale, cols)])]))
    torch.save(cases, tmp_path / "in.pt")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PERFXLM_LORA_PREFETCH=prefetch, PYTHONPATH=root)
    run = subprocess.run([sys.executable, "-c", _PREFETCH_SCRIPT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                         env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for (x, parts, n, lora), got in zip(cases, torch.load(tmp_path / "out.pt")):
                want = ops.lora_project(x, parts, n, None, 32, False, True, 32, 128, -1, lora, 0)
                assert torch.equal(got, want)
                assert not torch.equal(want, ops.lora_project(x, parts, n, None, 32, False, True, 32, 128, -1, [], 0))
    finally:
        torch.set_num_threads(before)
