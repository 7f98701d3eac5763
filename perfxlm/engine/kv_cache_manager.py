"""The KV block pool: allocation, prefix caching and eviction. The only owner of blocks and ref counts.

Every block is in exactly one state:

    used     ref_cnt > 0                     held by one or more requests
    cached   ref_cnt == 0, has a block_hash  content still valid, reusable by a prefix match
    free     ref_cnt == 0, no hash           empty

Cached and free blocks wait together in one LRU queue (an ordered dict); allocation takes
from its front and drops the hash of a cached block it takes (eviction).

1. get_computed_blocks(req): the longest run of the prompt's full blocks whose hash chain is
   cached; at least one token is always left to compute, so the step that follows can sample.
2. allocate_slots(req, n, hits): all or nothing. Touches the hit blocks and takes new ones.
3. cache_blocks(req, num_computed): after the forward pass wrote their K/V, registers the hash
   of every block now full, so no block is ever reusable before its content exists (a step that
   fails registers nothing).
4. free(req): ref counts down; blocks with none left go to the queue's tail, the request's
   last block first, so the end of a sequence is evicted before its shareable beginning.

Block hashes are SHA-256 over the parent's digest and the block's token ids, the chain starting
from a random per-process root (and the request's cache_salt, which separates tenants): a prompt
cannot be crafted to collide with another user's block, and a hit needs the whole prefix equal.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from perfxlm.engine.request import Request


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


# Random per process: block digests cannot be precomputed from outside, nor carried across restarts.
_ROOT = os.urandom(32)


def block_digest(
    parent: bytes | None, tokens: list[int], cache_salt: str | None = None, adapter: str | None = None
) -> bytes:
    """SHA-256 of the parent digest (or the root, salt and LoRA adapter key, for a first block) and the
    token ids. The adapter changes every K/V of the sequence, so its blocks never serve another's prompt."""
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    if parent is None:
        for tag, value in ((b"salt", cache_salt), (b"lora", adapter)):
            if value is not None:
                data = value.encode("utf-8", "surrogatepass")
                h.update(tag + struct.pack("<Q", len(data)) + data)
    # every full block has block_size tokens, so fixed-width ids need no separator
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}  # block digest -> block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same tables as block ids, kept up to date as blocks are appended, so a step hands the
        # runner a view instead of rebuilding every request's table from its block objects.
        self.req_block_ids: dict[str, np.ndarray] = {}
        self.req_to_hashes: dict[str, list[bytes]] = {}  # digest chain over the request's full blocks
        self.req_num_hashed_blocks: dict[str, int] = {}  # leading blocks already registered
        # Prefix-cache statistics, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + cached)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return self.block_table(request_id).tolist()

    def block_table(self, request_id: str) -> np.ndarray:
        """The request's block table, [num_blocks] int64: a read-only view that stays valid (blocks
        are only ever appended to a table until the request frees it)."""
        ids = self.req_block_ids.get(request_id)
        if ids is None:
            return np.empty(0, dtype=np.int64)
        view = ids[: len(self.req_to_blocks[request_id])]
        view.flags.writeable = False
        return view

    def _sync_ids(self, request_id: str, start: int) -> None:
        """Mirror req_to_blocks[request_id][start:] into the id table (grown by doubling)."""
        blocks = self.req_to_blocks[request_id]
        ids = self.req_block_ids.get(request_id)
        if ids is None or ids.shape[0] < len(blocks):
            grown = np.empty(max(16, 2 * len(blocks)), dtype=np.int64)
            if ids is not None:
                grown[:start] = ids[:start]
            ids = self.req_block_ids[request_id] = grown
        ids[start : len(blocks)] = [b.block_id for b in blocks[start:]]

    # ---- prefix caching ------------------------------------------------------------------
    def _hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        hashes = self.req_to_hashes.setdefault(request.request_id, [])
        tokens, bs = request.all_token_ids, self.block_size
        salt = getattr(request, "cache_salt", None)
        lora = getattr(request, "lora", None)
        adapter = None if lora is None else lora.cache_key
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(block_digest(parent, tokens[i * bs : (i + 1) * bs], salt, adapter))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        # Prompt logprobs need every prompt position computed, so such requests never read the cache.
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in self._hashes(request, max_blocks):
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> bool:
        hits = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_total = num_computed + num_new_tokens
        num_new_blocks = self.blocks_needed(num_total) - len(req_blocks) - len(hits)
        # Hit blocks sitting in the free queue stop being available once touched.
        num_touched_free = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks > len(self.free_queue) - num_touched_free:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return False
        for block in hits:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1
        first_new = len(req_blocks)
        req_blocks.extend(hits)
        for _ in range(max(num_new_blocks, 0)):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:  # evict
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            req_blocks.append(block)
        if len(req_blocks) > first_new:
            self._sync_ids(request.request_id, first_new)
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks up to `num_computed_tokens`, whose K/V the forward pass
        has written, as reusable by prefix matches."""
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid)
        if not self.enable_prefix_caching or not req_blocks:
            return
        num_known = min(num_computed_tokens, request.num_tokens, len(req_blocks) * self.block_size)
        num_full = num_known // self.block_size
        start = self.req_num_hashed_blocks.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full)
        for i in range(start, num_full):
            block = req_blocks[i]
            if block.block_hash is None and hashes[i] not in self.cached:
                block.block_hash = hashes[i]
                self.cached[hashes[i]] = block
        self.req_num_hashed_blocks[rid] = num_full

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None | bool:
        """Give `child` the parent's computed prompt blocks: full blocks are shared (ref_cnt + 1), a
        partial last block is copied into a new block. Returns the (src, dst) copy, None if no copy
        is needed, or False if no block was free (the child must then recompute)."""
        blocks = self.req_to_blocks[parent.request_id]
        num_full, partial = divmod(parent.num_computed_tokens, self.block_size)
        child_blocks = blocks[:num_full]
        copy = None
        if partial:
            if not self.free_queue:
                return False
            _, new = self.free_queue.popitem(last=False)
            if new.block_hash is not None:
                if self.cached.get(new.block_hash) is new:
                    del self.cached[new.block_hash]
                new.block_hash = None
            new.ref_cnt = 1
            copy = (blocks[num_full].block_id, new.block_id)
        for block in child_blocks:
            block.ref_cnt += 1
        self.req_to_blocks[child.request_id] = child_blocks + ([new] if partial else [])
        self.req_block_ids.pop(child.request_id, None)
        self._sync_ids(child.request_id, 0)
        hashes = self.req_to_hashes.get(parent.request_id, [])
        self.req_to_hashes[child.request_id] = hashes[:num_full]
        self.req_num_hashed_blocks[child.request_id] = min(self.req_num_hashed_blocks.get(parent.request_id, 0), num_full)
        return copy

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past its first `num_tokens` tokens: the slots of draft tokens the
        target rejected (speculative decoding). They were never hashed: cache_blocks stops at the computed
        tokens, which these blocks lie past."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = self.blocks_needed(num_tokens)
        if not blocks or len(blocks) <= keep:
            return
        for block in reversed(blocks[keep:]):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
        del blocks[keep:]

    def free(self, request: Request) -> None:
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, [])
        self.req_block_ids.pop(rid, None)  # a later table is a new array: views handed out stay valid
        self.req_to_hashes.pop(rid, None)
        self.req_num_hashed_blocks.pop(rid, None)
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def reset_prefix_cache(self) -> None:
        for block in self.free_queue.values():
            block.block_hash = None
        self.cached = {h: b for h, b in self.cached.items() if b.ref_cnt > 0}

    # ---- invariants ----------------------------------------------------------------------
    def check_invariants(self) -> dict[str, int]:
        """Raise AssertionError if the pool is inconsistent; return the state counts."""
        refs = [0] * self.num_blocks
        for rid, blocks in self.req_to_blocks.items():
            for b in blocks:
                refs[b.block_id] += 1
            assert self.block_ids(rid) == [b.block_id for b in blocks], f"{rid}: id table out of date"
        assert set(self.req_block_ids) <= set(self.req_to_blocks), "id table of a request that holds no blocks"
        counts = {"used": 0, "cached": 0, "free": 0}
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"block {b.block_id} has ref_cnt {b.ref_cnt}"
            assert b.ref_cnt == refs[b.block_id], f"block {b.block_id}: ref_cnt {b.ref_cnt} != holders {refs[b.block_id]}"
            in_queue = b.block_id in self.free_queue
            assert in_queue == (b.ref_cnt == 0), f"block {b.block_id}: ref_cnt {b.ref_cnt}, in free queue {in_queue}"
            if b.block_hash is not None:
                assert self.cached.get(b.block_hash) is b, f"block {b.block_id} hash not registered"
            state = "used" if b.ref_cnt else ("cached" if b.block_hash is not None else "free")
            counts[state] += 1
        for h, b in self.cached.items():
            assert b.block_hash == h, "cached map points at a block with another hash"
        assert sum(counts.values()) == self.num_blocks
        return counts
