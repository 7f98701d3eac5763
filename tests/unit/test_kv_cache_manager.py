import pytest

from perfxlm.engine.kv_cache_manager import KVCacheManager
from perfxlm.engine.request import Request
from perfxlm.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), 4, set())


def test_allocate_and_free_keeps_pool_whole():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert len(kv.block_ids("a")) == 3
    assert kv.check_invariants()["used"] == 3
    kv.free(r)
    counts = kv.check_invariants()
    assert counts["used"] == 0 and counts["cached"] == 2  # two full blocks keep their hash


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = req("a", list(range(8))), req("b", list(range(100, 108)))
    assert kv.allocate_slots(a, 8)
    assert not kv.allocate_slots(b, 8)  # needs 2, only 1 left
    assert kv.block_ids("b") == []
    kv.check_invariants()


def test_prefix_hit_reuses_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    b = req("b", list(range(12)))  # identical prompt: 3 full blocks, but the last token must be recomputed
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [h.block_id for h in hits] == kv.block_ids("a")[:2]
    assert kv.allocate_slots(b, 4, hits)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.blocks[kv.block_ids("a")[0]].ref_cnt == 2
    kv.free(a)
    kv.free(b)
    assert kv.check_invariants()["used"] == 0


def test_different_prefix_does_not_hit():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", list(range(12)))
    kv.allocate_slots(a, 12)
    b = req("b", [99] + list(range(1, 12)))
    assert kv.get_computed_blocks(b)[1] == 0


def test_eviction_drops_hash_and_reuses_block():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.free(a)
    assert kv.check_invariants()["cached"] == 2
    b = req("b", list(range(50, 58)))
    assert kv.allocate_slots(b, 8)  # evicts both cached blocks
    counts = kv.check_invariants()
    assert counts["used"] == 2
    assert kv.get_computed_blocks(req("c", list(range(9))))[1] == 0  # a's prefix is gone


def test_touching_cached_blocks_counts_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.free(a)  # 2 cached + 1 free
    b = req("b", list(range(8)) + [7, 7, 7, 7, 7])  # hits 2 blocks, needs 2 more: only 1 left
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    b_ok = kv.allocate_slots(b, 5, hits)
    assert not b_ok
    kv.check_invariants()


def test_invariant_check_catches_corruption():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", list(range(4)))
    kv.allocate_slots(a, 4)
    kv.blocks[kv.block_ids("a")[0]].ref_cnt = 0
    with pytest.raises(AssertionError):
        kv.check_invariants()
