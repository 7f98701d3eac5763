"""Weights moved into one huge-page mapping at load (perfxlm.model.loader.weight_arena): the same values,
ties kept, the same outputs; PERFXLM_WEIGHT_ARENA=0 leaves torch's tensors in place."""

import mmap

import pytest
import torch

from perfxlm.model.loader.weight_arena import MIN_BYTES, move_to_arena
from perfxlm.quant.quantizers import quantize_symmetric_int8

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this system")


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(300, 64, generator=g), requires_grad=False)
        self.head = torch.nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed  # tied
        self.up = torch.nn.Linear(64, 1030, bias=True)  # bias too small to move
        self.norm = torch.nn.Parameter(torch.ones(64), requires_grad=False)
        self.q = quantize_symmetric_int8(torch.randn(1100, 64, generator=g), 32, act="float")

    def forward(self, x):
        w = self.q.codes.float() * self.q.scales.float().repeat_interleave(32, 1) + self.q.mins.float().repeat_interleave(32, 1)
        return self.head(x * self.norm) + self.up(x).sum() + (x @ w.t()).sum()


def _storages(model):
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def test_weights_move_with_values_and_ties_kept():
    model = Tiny()
    x = torch.randn(3, 64)
    before = model(x)
    big = [t.clone() for t in (model.embed, model.up.weight, model.q.codes)]
    moved = move_to_arena(model)
    assert moved >= sum(t.nbytes for t in big)
    assert torch.equal(model(x), before)
    assert model.head.weight is model.embed  # the tie is one Parameter still: parameters() counts it once
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in Tiny().parameters())
    for old, new in zip(big, (model.embed, model.up.weight, model.q.codes)):
        assert torch.equal(old, new)
    # one mapping: every moved tensor lies in the same storage, cache-line aligned
    storages = {t.untyped_storage().data_ptr() for t in (model.embed, model.up.weight, model.q.codes)}
    assert len(storages) == 1
    assert all(t.data_ptr() % 64 == 0 for t in (model.embed, model.up.weight, model.q.codes))
    assert model.norm.nbytes < MIN_BYTES and model.up.bias.untyped_storage().data_ptr() not in storages


def test_switched_off_leaves_tensors_in_place(monkeypatch):
    monkeypatch.setenv("PERFXLM_WEIGHT_ARENA", "0")
    model = Tiny()
    before = _storages(model)
    assert move_to_arena(model) == 0
    assert _storages(model) == before


def test_each_original_is_let_go_once_its_owners_point_into_the_arena():
    """The load's peak is the model once plus one weight, not twice the model: by the time a later weight
    moves, an earlier one (tied: both owners rebound) is no longer held by anyone."""
    import weakref

    model = Tiny()
    embed = weakref.ref(model.embed)
    alive_when_up_moved = []

    class Watched(dict):
        def __setitem__(self, key, value):
            alive_when_up_moved.append(embed() is not None)
            super().__setitem__(key, value)

    model.up._parameters = Watched(model.up._parameters)
    assert move_to_arena(model) > 0
    assert alive_when_up_moved == [False]
