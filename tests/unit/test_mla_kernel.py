"""Multi-head latent attention's decode kernel (csrc/mla_kernels.cpp) against its plain-torch definition
(ops/mla.py): every cache dtype, float32 and bf16 absorbed weights, odd head counts and ranks, contexts
crossing block boundaries and cut into several token ranges; a row alone is the same bits as in a batch;
bad metadata is refused by name."""

from __future__ import annotations

import pytest
import torch

from perfxlm.ops import native
from perfxlm.ops.attention import write_kv_cache_torch
from perfxlm.ops.kv_quant import KVCacheSpec
from perfxlm.ops.mla import mla_decode_attention_torch

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no compiler for the native kernels")

# (heads, nope, kv_lora_rank, rope, v_head_dim, block size): odd sizes, and DeepSeek-V2-Lite's own rank
SHAPES = [(5, 12, 36, 8, 14, 16), (3, 10, 20, 6, 9, 5), (16, 128, 512, 64, 128, 16)]
# tokens per sequence: one token, a block and one, many blocks, several token ranges (merged per head)
LENS = [1, 17, 129, 700]


def _setup(shape, cache_dtype: str, weight_dtype: torch.dtype, lens, seed: int = 0, group: int | None = None):
    heads, nope, rank, rope, v, block = shape
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block - 1) // block for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    floats = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if cache_dtype in floats:  # a float cache: the model's own dtype
        spec = KVCacheSpec.resolve("auto", floats[cache_dtype])
    else:
        spec = KVCacheSpec.resolve(cache_dtype, torch.float32, group)
    cache = spec.allocate(num_blocks, block, 1, rank + rope, value_is_key=True)
    # each sequence's blocks scattered over the pool, in a shuffled order
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(blocks_per_seq), dtype=torch.int64)
    at = 0
    for b, nb in enumerate(blocks_per_seq):
        tables[b, :nb] = order[at : at + nb]
        at += nb
    for b, n in enumerate(lens):
        rows = torch.randn(n, 1, rank + rope, generator=g)
        slots = tables[b, torch.arange(n) // block] * block + torch.arange(n) % block
        write_kv_cache_torch(rows, rows, cache.key, cache.value, slots, cache.key_scale, cache.value_scale)
    query = torch.randn(len(lens), heads, nope + rope, generator=g)
    w_uk = (torch.randn(heads, nope, rank, generator=g) / nope**0.5).to(weight_dtype)
    w_uv_t = (torch.randn(heads, rank, v, generator=g) / rank**0.5).to(weight_dtype)
    scale = (nope + rope) ** -0.5
    return query, cache, tables, torch.tensor(lens, dtype=torch.int64), w_uk, w_uv_t, scale


def _kernel(query, cache, tables, lens, w_uk, w_uv_t, scale):
    return native.kernels().mla_decode_attention(query, cache.key, cache.key_scale, tables, lens, w_uk, w_uv_t, scale)


def _reference(query, cache, tables, lens, w_uk, w_uv_t, scale):
    return mla_decode_attention_torch(query, cache.key, cache.key_scale, tables, lens, w_uk, w_uv_t, scale)


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_kernel_matches_the_torch_definition(cache_dtype, shape):
    # the reference dequantizes the same cache bits: only the summation order differs
    args = _setup(shape, cache_dtype, torch.float32, LENS)
    torch.testing.assert_close(_kernel(*args), _reference(*args), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype,group", [("int8", 4), ("fp8_e4m3", 11), ("bfloat16", None)])
def test_bf16_weights_and_grouped_scales(cache_dtype, group):
    # several scale groups per row (int8 by 4 values, fp8 by 11: groups that straddle vector chunks)
    args = _setup(SHAPES[0], cache_dtype, torch.bfloat16, [3, 33, 260], seed=1, group=group)
    torch.testing.assert_close(_kernel(*args), _reference(*args), atol=2e-5, rtol=1e-4)


def test_deepseek_v2_lite_shape():
    args = _setup(SHAPES[2], "bfloat16", torch.bfloat16, [1, 600], seed=2)
    torch.testing.assert_close(_kernel(*args), _reference(*args), atol=5e-5, rtol=1e-4)


def test_a_row_alone_is_the_same_bits_as_in_a_batch():
    query, cache, tables, lens, w_uk, w_uv_t, scale = _setup(SHAPES[0], "int8", torch.float32, LENS, seed=3)
    batched = _kernel(query, cache, tables, lens, w_uk, w_uv_t, scale)
    for b in range(len(LENS)):
        alone = _kernel(query[b : b + 1], cache, tables[b : b + 1], lens[b : b + 1], w_uk, w_uv_t, scale)
        assert torch.equal(alone[0], batched[b])


def test_an_empty_sequence_gives_zeros():
    query, cache, tables, lens, w_uk, w_uv_t, scale = _setup(SHAPES[1], "float32", torch.float32, [5, 9])
    lens[0] = 0
    out = _kernel(query, cache, tables, lens, w_uk, w_uv_t, scale)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1:], _reference(query[1:], cache, tables[1:], lens[1:], w_uk, w_uv_t, scale))


def test_bad_inputs_are_refused_by_name():
    query, cache, tables, lens, w_uk, w_uv_t, scale = _setup(SHAPES[1], "int8", torch.float32, [5, 9])
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        _kernel(query, cache, tables, torch.tensor([5, 999]), w_uk, w_uv_t, scale)
    bad = tables.clone()
    bad[0, 0] = 10_000
    with pytest.raises(RuntimeError, match="out of range"):
        _kernel(query, cache, bad, lens, w_uk, w_uv_t, scale)
    with pytest.raises(RuntimeError, match="needs its scales"):
        native.kernels().mla_decode_attention(query, cache.key, None, tables, lens, w_uk, w_uv_t, scale)
    with pytest.raises(RuntimeError, match="kv_lora_rank"):
        _kernel(query[..., 1:].contiguous(), cache, tables, lens, w_uk, w_uv_t, scale)
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        _kernel(query, cache, tables, lens, w_uk, w_uv_t.bfloat16(), scale)
