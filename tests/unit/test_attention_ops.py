"""Paged attention ops against the naive per-token reference, on random inputs with odd sizes."""

import pytest
import torch

from perfxlm.ops.attention import paged_decode_attention, prefill_attention, write_kv_cache
from perfxlm.ops.reference import attention_reference, gather_sequence_kv


def _setup(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=0):
    torch.manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(6, 2, 32, 16), (4, 4, 17, 5), (9, 3, 64, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_reference(num_heads, num_kv_heads, head_dim, block_size, dtype):
    k_cache, v_cache = _setup(40, block_size, num_kv_heads, head_dim, dtype)
    seq_lens = [1, 13, block_size * 3, 29]
    perm = torch.randperm(40).tolist()
    tables, off = [], 0
    for n in seq_lens:
        nb = -(-n // block_size)
        tables.append(perm[off : off + nb])
        off += nb
    max_blocks = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    q = torch.randn(len(seq_lens), num_heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k_cache, v_cache, bt, torch.tensor(seq_lens), scale)
    for i, n in enumerate(seq_lens):
        k = gather_sequence_kv(k_cache, tables[i], n)
        v = gather_sequence_kv(v_cache, tables[i], n)
        ref = attention_reference(q[i : i + 1], k, v, scale)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i : i + 1], ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_context", [0, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_cached_context_matches_reference(num_context, dtype):
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 24, 4
    k_cache, v_cache = _setup(32, block_size, num_kv_heads, head_dim, dtype, seed=1)
    num_new = 11
    total = num_context + num_new
    table = torch.randperm(32)[: -(-total // block_size)]
    q = torch.randn(num_new, num_heads, head_dim, dtype=dtype)
    k_new = torch.randn(num_new, num_kv_heads, head_dim, dtype=dtype)
    v_new = torch.randn(num_new, num_kv_heads, head_dim, dtype=dtype)
    positions = torch.arange(num_context, total)
    slots = table[positions // block_size] * block_size + positions % block_size
    write_kv_cache(k_new, v_new, k_cache, v_cache, slots)
    scale = head_dim**-0.5
    out = prefill_attention(q, k_new, v_new, k_cache, v_cache, table, num_context, scale)
    k = gather_sequence_kv(k_cache, table.tolist(), total)
    v = gather_sequence_kv(v_cache, table.tolist(), total)
    torch.testing.assert_close(k[num_context:], k_new)
    ref = attention_reference(q, k, v, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
