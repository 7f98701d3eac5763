"""The runner's adapter slots and the grouped product, on hand-made adapters: LRU slot reuse, and each
row's result equal to its own adapter's B A x times scale, alone or mixed with other adapters' rows."""

from __future__ import annotations

import pytest
import torch

from perfxlm.lora.adapter import LoRAAdapter, LoRAPart
from perfxlm.lora.pack import pack_layer
from perfxlm.lora.request import LoRARequest
from perfxlm.lora.slots import LoRASlots


class _Wrapper:  # what LoRASlots reads of a LoRALinear
    def __init__(self, name: str, out_features: int) -> None:
        self.name, self.out_features, self.packed = name, out_features, None


def _adapter(i: int, rank: int, k: int = 13, parts=((0, 5), (5, 3), (8, 3))) -> LoRAAdapter:
    g = torch.Generator().manual_seed(i)
    made = [LoRAPart(row, rows, torch.randn(rank + j, k, generator=g), torch.randn(rows, rank + j, generator=g),
                     0.5 * (i + j + 1)) for j, (row, rows) in enumerate(parts)]
    return LoRAAdapter(LoRARequest(f"l{i}", i, f"/adapters/{i}"), {"proj": made}, rank + len(parts) - 1)


def _expected(adapter: LoRAAdapter | None, x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], 11)
    for p in (adapter.modules["proj"] if adapter else ()):
        out[:, p.row : p.row + p.rows] += (x @ p.a.T @ p.b.T) * p.scale
    return out


def test_grouped_product_per_row_and_lru_slots():
    wrapper = _Wrapper("proj", 11)
    slots = LoRASlots([wrapper], max_loras=2, dtype=torch.float32)
    a, b, c = _adapter(1, 2), _adapter(2, 4), _adapter(3, 1)
    x = torch.randn(7, 13, generator=torch.Generator().manual_seed(9))

    def check(adapters, rows):
        batch = slots.batch(adapters, rows)
        got = batch.add(wrapper, x, torch.zeros(7, 11))
        per_row = [ad for ad, n in zip(adapters, rows) for _ in range(n)]
        want = torch.cat([_expected(ad, x[i : i + 1]) for i, ad in enumerate(per_row)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    assert slots.batch([None, None], [3, 4]) is None  # no adapter row: no LoRA work at all
    check([a, None, b], [2, 3, 2])  # mixed: the masked product
    check([b], [7])  # one adapter: its own columns
    assert slots.num_repacks == 1
    check([c, None], [1, 6])  # a third adapter takes the least recently used slot (a's)
    assert slots.num_repacks == 2 and {s.adapter.lora_int_id for s in slots.slots.values()} == {2, 3}
    check([b, c], [4, 3])  # both in slots: nothing moves
    assert slots.num_repacks == 2


@pytest.mark.parametrize("grouped_from", ["0", "100000"])  # every step per slot's rows / every step masked
def test_grouped_and_masked_products_agree(monkeypatch, grouped_from):
    # the per-slot form (a prefill's rows: each slot's rows, viewed where one run, gathered elsewhere, over
    # its own columns) and the masked one give every row its own adapter's product, rows without one and
    # adapters without a part on the projection left alone
    monkeypatch.setenv("PERFXLM_LORA_GROUPED_ROWS", grouped_from)
    wrapper = _Wrapper("proj", 11)
    slots = LoRASlots([wrapper], max_loras=3, dtype=torch.float32)
    a, b = _adapter(1, 2), _adapter(2, 4, parts=((3, 8),))
    none = LoRAAdapter(LoRARequest("l9", 9, "/adapters/9"), {}, 1)  # targets another module only
    x = torch.randn(23, 13, generator=torch.Generator().manual_seed(5))
    for adapters, rows in (([a, None, b, a], [5, 3, 6, 9]), ([b, none, None], [20, 2, 1]), ([a, b], [22, 1])):
        base = torch.randn(23, 11, generator=torch.Generator().manual_seed(6))
        got = slots.batch(adapters, rows).add(wrapper, x, base.clone())
        per_row = [ad for ad, n in zip(adapters, rows) for _ in range(n)]
        want = base + torch.cat([_expected(ad if ad is not none else None, x[i : i + 1])
                                 for i, ad in enumerate(per_row)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _block_now(wrapper) -> torch.Tensor:
    p = wrapper.packed
    return pack_layer([None if p is None else (p.kernel_a, p.kernel_bt, p.kernel_scale, p.kernel_cols)])


def test_fused_kernel_block_kept_per_layer_until_a_repack():
    # each layer's adapter block is built once for the slots' contents; a step only puts its rows' slots
    # first, and after a repack (an adapter evicted, another loaded in its slot) no step sees the old block
    wrapper, bare = _Wrapper("proj", 11), _Wrapper("other", 11)
    slots = LoRASlots([wrapper, bare], max_loras=2, dtype=torch.float32)
    a, b, c = _adapter(1, 2), _adapter(2, 4), _adapter(3, 1)
    layer = (wrapper,)
    first = slots.batch([a, None], [1, 1])
    ops = first.fused_operands(layer)
    assert ops[0].tolist() == [next(i for i, s in slots.slots.items() if s.adapter is a), -1]
    assert ops[0].dtype == torch.int32 and len(ops) == 2 and ops[1].dtype == torch.uint8
    assert torch.equal(ops[1], _block_now(wrapper))
    assert first.fused_operands((bare,)) == []  # no adapter targets that layer: nothing to pass
    again = slots.batch([None, a, b], [1, 2, 1])  # b joins: a repack, so the layer's block is built again
    fresh = again.fused_operands(layer)
    assert fresh[1] is not ops[1] and not torch.equal(fresh[1], ops[1]) and torch.equal(fresh[1], _block_now(wrapper))
    same = slots.batch([b, a], [1, 1]).fused_operands(layer)  # no repack: the very same block
    assert same[1] is fresh[1] and same[0].tolist() != fresh[0].tolist()
    evicting = slots.batch([c], [2])  # c takes the least recently used slot (a's, used before b's)
    block = evicting.fused_operands(layer)[1]
    assert block is not fresh[1] and torch.equal(block, _block_now(wrapper))
    assert {s.adapter.lora_int_id for s in slots.slots.values()} == {2, 3}
