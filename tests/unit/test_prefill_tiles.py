"""Prefill attention over cached context, read tile by tile, against the gather-everything reference:
every cache format, odd head and block sizes, contexts that are no tile multiple, GQA, sliding
windows and soft caps; and no copy of the whole context is ever made."""

import pytest
import torch

from perfxlm.ops import attention, cpu_plan, prefill_tiles
from perfxlm.ops.attention import prefill_attention, prefill_attention_reference, write_kv_cache
from perfxlm.ops.kv_quant import KVCacheSpec

# (kv_cache_dtype, int8 group): float caches are "auto" of that model dtype
FORMATS = [("float32", None), ("bfloat16", None), ("int8", None), ("int8", 8), ("fp8_e4m3", None), ("fp8_e5m2", None)]
# (num_heads, num_kv_heads, head_dim, block_size)
SHAPES = [(6, 2, 40, 3), (6, 2, 72, 16)]
# (sliding_window, soft_cap): a window of 1, shorter than the chunk, longer than the chunk but shorter
# than the context, longer than everything; capped with and without a window
OPTIONS = [(None, None), (1, None), (5, None), (40, None), (500, None), (None, 1.5), (7, 0.8)]
# (context tokens, new tokens): no tile multiples; a one-token chunk; a chunk longer than its context
SIZES = [(50, 13), (97, 1), (8, 40)]
TILE = 32


def _setup(name, group, shape, num_context, num_new, query_dtype, seed=0):
    num_heads, num_kv_heads, head_dim, block_size = shape
    torch.manual_seed(seed)
    if name in ("float32", "bfloat16"):
        spec = KVCacheSpec.resolve("auto", getattr(torch, name))
    else:
        spec = KVCacheSpec.resolve(name, torch.float32, group)
    total = num_context + num_new
    num_blocks = -(-total // block_size)
    cache = spec.allocate(num_blocks + 5, block_size, num_kv_heads, head_dim)
    table = torch.randperm(num_blocks + 5)[:num_blocks]
    k = torch.randn(total, num_kv_heads, head_dim) * 2  # larger scores, so the soft cap bends them
    v = torch.randn(total, num_kv_heads, head_dim)
    positions = torch.arange(total)
    slots = table[positions // block_size] * block_size + positions % block_size
    write_kv_cache(k, v, cache.key, cache.value, slots, cache.key_scale, cache.value_scale)
    q = (torch.randn(num_new, num_heads, head_dim) * 2).to(query_dtype)
    new_k, new_v = k[num_context:].to(query_dtype), v[num_context:].to(query_dtype)
    args = (q, new_k, new_v, cache.key, cache.value, table, num_context, head_dim**-0.5)
    return args, {"key_scale": cache.key_scale, "value_scale": cache.value_scale}


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of TILE tokens (whole blocks of them), so short contexts span several tiles; SDPA's paths
    (the native prefill kernel has its own tests)."""
    monkeypatch.setenv("PERFXLM_PREFILL_ATTENTION", "torch")
    monkeypatch.setattr(prefill_tiles, "TILE_TOKENS", TILE)
    monkeypatch.setattr(prefill_tiles, "SOFTCAP_TILE_TOKENS", TILE)


@pytest.mark.parametrize("name,group", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sliding_window,soft_cap", OPTIONS)
@pytest.mark.parametrize("num_context,num_new", SIZES)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_tiled_matches_gathered_reference(
    name, group, shape, sliding_window, soft_cap, num_context, num_new, query_dtype, small_tiles
):
    args, scales = _setup(name, group, shape, num_context, num_new, query_dtype)
    options = {"sliding_window": sliding_window, "soft_cap": soft_cap, **scales}
    previous = cpu_plan.use(gemm="float32")  # float32 queries attend in float32: the tight tolerance
    try:
        out = prefill_attention(*args, **options)
        ref = prefill_attention_reference(*args, **options)
    finally:
        cpu_plan.use(previous)
    assert out.dtype == query_dtype and out.shape == args[0].shape
    tol = 2e-5 if query_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("name,group", [("bfloat16", None), ("int8", None), ("fp8_e4m3", None)])
@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (5, None), (None, 1.5)])
def test_bf16_model_attends_in_bf16_over_tiles(name, group, sliding_window, soft_cap, small_tiles):
    """float32 activations of a bfloat16 model attend in bf16 under the bf16-GEMM plan, tiled as well."""
    args, scales = _setup(name, group, SHAPES[1], 50, 13, torch.float32, seed=1)
    options = {"sliding_window": sliding_window, "soft_cap": soft_cap, "bf16_model": True, **scales}
    previous = cpu_plan.use(gemm="bf16")
    try:
        out = prefill_attention(*args, **options)
        ref = prefill_attention_reference(*args, **options)
    finally:
        cpu_plan.use(previous)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("sliding_window", [None, 20])
def test_no_whole_context_copy(sliding_window, small_tiles, monkeypatch):
    """Only tiles are gathered (at most TILE context tokens, or the chunk's own), never the sequence;
    a window skips the tiles before it."""
    args, scales = _setup("int8", None, SHAPES[1], 150, 13, torch.float32)

    def whole_sequence(*a, **k):
        raise AssertionError("the whole sequence was gathered")

    spans = []
    gather_tile = prefill_tiles.gather_tile

    def recording(cache, table, start, end, *rest):
        spans.append((start, end))
        return gather_tile(cache, table, start, end, *rest)

    monkeypatch.setattr(attention, "gather_blocks", whole_sequence)  # the gathered path's
    monkeypatch.setattr(prefill_tiles, "gather_tile", recording)
    prefill_attention(*args, sliding_window=sliding_window, **scales)
    assert max(end - start for start, end in spans) <= TILE
    assert (150, 163) in spans  # the new tokens' own tile, read from the cache
    first = 0 if sliding_window is None else 150 - sliding_window + 1
    assert min(start for start, _ in spans) == first
