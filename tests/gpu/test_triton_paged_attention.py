"""The Triton paged attention against the plain per-token reference, decode and prefill, on odd sizes."""

from __future__ import annotations

import pytest
import torch

from perfxlm.ops.gpu.paged_attention import paged_attention
from perfxlm.ops.kv_quant import quantize
from perfxlm.ops.reference import attention_reference, gather_sequence_kv


def _case(device, seq_lens, query_lens, num_heads=6, num_kv_heads=2, head_dim=40, block_size=16, dtype=torch.float32,
          kv_dtype=None, groups=1, seed=0):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g)  # blocks scattered over the pool, not in order
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(perm[used : used + n].tolist())
        used += n
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_float = torch.randn(shape, generator=g)
    v_float = torch.randn(shape, generator=g)
    if kv_dtype is torch.int8:
        k_cache, k_scale = quantize(k_float, torch.int8, groups)
        v_cache, v_scale = quantize(v_float, torch.int8, groups)
        k_float = (k_cache.float().unflatten(-1, (groups, -1)) * k_scale.unsqueeze(-1)).flatten(-2)
        v_float = (v_cache.float().unflatten(-1, (groups, -1)) * v_scale.unsqueeze(-1)).flatten(-2)
    else:
        k_cache, v_cache, k_scale, v_scale = k_float.to(dtype), v_float.to(dtype), None, None
        k_float, v_float = k_cache.float(), v_cache.float()
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype)
    return query, (k_cache, v_cache, k_scale, v_scale), (k_float, v_float), block_tables, tables


def _reference(query, kv_float, tables, seq_lens, query_lens, scale, **options):
    outs, start = [], 0
    for table, n, q in zip(tables, seq_lens, query_lens):
        k = gather_sequence_kv(kv_float[0], table, n)
        v = gather_sequence_kv(kv_float[1], table, n)
        outs.append(attention_reference(query[start : start + q].float(), k, v, scale, **options))
        start += q
    return torch.cat(outs)


def _run(device, query, caches, block_tables, seq_lens, query_lens, scale, **options):
    k, v, ks, vs = (t.to(device) if t is not None else None for t in caches)
    out = paged_attention(
        query.to(device), k, v, block_tables.to(device), query_lens, seq_lens, scale, key_scale=ks, value_scale=vs,
        **options,
    )  # fmt: skip
    return out.cpu().float()


@pytest.mark.parametrize(
    "seq_lens,query_lens",
    [
        ([1, 17, 50], [1, 1, 1]),  # decodes: a first token, a block boundary, several blocks
        ([37], [37]),  # a prompt from nothing
        ([45, 70], [13, 1]),  # a chunk over cached context beside a decode
    ],
)
@pytest.mark.parametrize("options", [{}, {"sliding_window": 9}, {"soft_cap": 5.0}])
def test_float_cache_matches_reference(device, seq_lens, query_lens, options):
    scale = 40**-0.5
    query, caches, kv_float, block_tables, tables = _case(device, seq_lens, query_lens)
    got = _run(device, query, caches, block_tables, seq_lens, query_lens, scale, **options)
    want = _reference(query, kv_float, tables, seq_lens, query_lens, scale, **options)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("groups", [1, 4])
def test_int8_cache_with_group_scales(device, groups):
    seq_lens, query_lens, scale = [33, 60], [1, 11], 0.2
    query, caches, kv_float, block_tables, tables = _case(
        device, seq_lens, query_lens, head_dim=32, num_heads=4, num_kv_heads=1, kv_dtype=torch.int8, groups=groups,
    )  # fmt: skip
    got = _run(device, query, caches, block_tables, seq_lens, query_lens, scale)
    want = _reference(query, kv_float, tables, seq_lens, query_lens, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_cache_and_query(device, dtype):
    # both dots in the cache's type (float32 sums): the tensor cores' path on a GPU
    seq_lens, query_lens, scale = [29, 64, 130], [29, 1, 1], 0.125
    query, caches, kv_float, block_tables, tables = _case(
        device, seq_lens, query_lens, dtype=dtype, num_heads=8, num_kv_heads=8, head_dim=64,
    )  # fmt: skip
    got = _run(device, query, caches, block_tables, seq_lens, query_lens, scale)
    want = _reference(query, kv_float, tables, seq_lens, query_lens, scale)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)  # the output is rounded to bf16


def test_bad_input_is_named(device):
    query, caches, _, block_tables, _ = _case(device, [5], [5])
    with pytest.raises(ValueError, match="query_lens sum"):
        _run(device, query, caches, block_tables, [5], [4], 0.1)
    with pytest.raises(ValueError, match="key_scale"):
        k8 = caches[0].to(torch.int8)
        paged_attention(query, k8, k8, block_tables, [5], [5], 0.1)
