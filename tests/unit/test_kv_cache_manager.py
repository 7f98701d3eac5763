import pytest

from perfxlm.engine.kv_cache_manager import KVCacheManager
from perfxlm.engine.request import Request
from perfxlm.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), 4, set())


def compute(kv: KVCacheManager, r: Request, n: int, hits=None) -> bool:
    """Allocate and, as a successful forward pass would, write and register n more tokens."""
    if not kv.allocate_slots(r, n, hits):
        return False
    r.num_computed_tokens += n + len(hits or []) * kv.block_size
    kv.cache_blocks(r, r.num_computed_tokens)
    return True


def test_allocate_and_free_keeps_pool_whole():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req("a", list(range(10)))
    assert compute(kv, r, 10)
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
    assert compute(kv, a, 12)
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
    compute(kv, a, 12)
    b = req("b", [99] + list(range(1, 12)))
    assert kv.get_computed_blocks(b)[1] == 0


def test_eviction_drops_hash_and_reuses_block():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = req("a", list(range(8)))
    compute(kv, a, 8)
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
    compute(kv, a, 8)
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


def test_blocks_are_reusable_only_after_their_kv_was_written():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(12)))
    assert kv.allocate_slots(a, 12)  # scheduled, but the forward pass has not run (or failed)
    assert kv.get_computed_blocks(req("b", list(range(12))))[1] == 0
    kv.free(a)  # the step failed: its blocks go back empty
    assert kv.check_invariants()["cached"] == 0
    a2 = req("a2", list(range(12)))
    assert compute(kv, a2, 12)
    assert kv.get_computed_blocks(req("c", list(range(12))))[1] == 8


def test_cache_salt_separates_tenants():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", list(range(12)))
    a.cache_salt = "tenant-a"
    assert compute(kv, a, 12)
    same = req("b", list(range(12)))
    same.cache_salt = "tenant-a"
    other = req("c", list(range(12)))
    other.cache_salt = "tenant-b"
    unsalted = req("d", list(range(12)))
    assert kv.get_computed_blocks(same)[1] == 8
    assert kv.get_computed_blocks(other)[1] == 0
    assert kv.get_computed_blocks(unsalted)[1] == 0


def test_block_digests_are_sha256_chains_from_a_random_root():
    import subprocess
    import sys

    from perfxlm.engine import kv_cache_manager as m

    first = m.block_digest(None, [1, 2, 3, 4])
    assert len(first) == 32 and first != m.block_digest(None, [1, 2, 3, 5])
    assert m.block_digest(first, [5, 6, 7, 8]) != m.block_digest(None, [5, 6, 7, 8])
    assert m.block_digest(None, [1, 2, 3, 4], "") != first  # an empty salt is still a salt
    # the root is random per process: the same tokens hash differently in another process
    code = "from perfxlm.engine.kv_cache_manager import block_digest; print(block_digest(None, [1, 2, 3, 4]).hex())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other != first.hex()
