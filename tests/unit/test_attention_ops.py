"""Paged attention ops against the naive per-token reference, on random inputs with odd sizes."""

import pytest
import torch

from perfxlm.ops import cpu_plan, native
from perfxlm.ops.attention import (
    decode_bf16_products,
    decode_mask,
    paged_decode_attention,
    paged_decode_attention_torch,
    prefill_attention,
    write_kv_cache,
)
from perfxlm.ops.reference import attention_reference, gather_sequence_kv


def _random_tables(seq_lens, block_size, num_blocks):
    """Disjoint random blocks per sequence: the lists, and the zero-padded [B, max_blocks] table."""
    perm = torch.randperm(num_blocks).tolist()
    tables, off = [], 0
    for n in seq_lens:
        nb = -(-n // block_size)
        tables.append(perm[off : off + nb])
        off += nb
    max_blocks = max(len(t) for t in tables)
    return tables, torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])


@pytest.fixture(params=["native", "torch"])
def decode_impl(request):
    """The decode op as dispatched (the native kernel where it builds) and its plain-torch path."""
    if request.param == "torch":
        return paged_decode_attention_torch
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    return paged_decode_attention


def _setup(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=0):
    torch.manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    # query heads per KV head 1-7: a task's heads in register tiles (4 on AVX-512, 3 on AVX2) and each
    # remainder (7 = 4 + 3 or 3 + 3 + 1, 5 = 4 + 1 or 3 + 2, 6 = 4 + 2 or 3 + 3)
    [(6, 2, 32, 16), (4, 4, 17, 5), (9, 3, 64, 7), (8, 2, 128, 16), (2, 1, 256, 3), (7, 1, 64, 16),
     (10, 2, 64, 5), (12, 2, 128, 16)],
)
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
def test_decode_matches_reference(num_heads, num_kv_heads, head_dim, block_size, dtype, cache_dtype, decode_impl):
    k_cache, v_cache = _setup(40, block_size, num_kv_heads, head_dim, cache_dtype)
    seq_lens = [1, 13, block_size * 3, 29]
    tables, bt = _random_tables(seq_lens, block_size, 40)
    max_blocks = bt.shape[1]
    q = torch.randn(len(seq_lens), num_heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    out = decode_impl(q, k_cache, v_cache, bt, torch.tensor(seq_lens), scale)
    assert out.dtype == dtype
    for i, n in enumerate(seq_lens):
        k = gather_sequence_kv(k_cache, tables[i], n)
        v = gather_sequence_kv(v_cache, tables[i], n)
        ref = attention_reference(q[i : i + 1], k, v, scale)
        exact = dtype == torch.float32 and not (decode_impl is paged_decode_attention and decode_bf16_products(cache_dtype))
        tol = 1e-5 if exact else 2e-2
        torch.testing.assert_close(out[i : i + 1], ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("gemm", ["bf16", "float32"])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 5), (256, 3), (48, 7)])
@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (20, None), (None, 30.0)])
def test_decode_float32_queries_over_bf16_cache_on_every_plan(gemm, head_dim, block_size, sliding_window, soft_cap):
    """A bfloat16 model decodes in float32 over a bf16 cache: the products run in bf16 (vdpbf16ps, queries
    and softmax weights rounded) under the bf16-GEMM plan where the build has AVX512-BF16, in float32
    otherwise; both within bf16 tolerance of the float32 reference, odd block sizes and context lengths
    (a block's odd last token pairs with zero), and each row the same bits alone as in its batch."""
    num_heads, num_kv_heads = 6, 2
    k_cache, v_cache = _setup(200, block_size, num_kv_heads, head_dim, torch.bfloat16, seed=6)
    seq_lens = [1, 2, 13, block_size * 3 + 1, 150, 151, 152]
    tables, bt = _random_tables(seq_lens[:4] + [152], block_size, 200)
    bt = torch.cat([bt, bt[4:5], bt[4:5]])  # verification rows: the last sequence at 150, 151, 152
    tables += [tables[4], tables[4]]
    q = torch.randn(len(seq_lens), num_heads, head_dim) * 2
    scale = head_dim**-0.5
    lens = torch.tensor(seq_lens)
    previous = cpu_plan.use(gemm=gemm)
    try:
        assert decode_bf16_products(torch.bfloat16) == (gemm == "bf16")
        kw = dict(sliding_window=sliding_window, soft_cap=soft_cap)
        out = paged_decode_attention(q, k_cache, v_cache, bt, lens, scale, **kw)
        for i in range(len(seq_lens)):
            alone = paged_decode_attention(q[i : i + 1], k_cache, v_cache, bt[i : i + 1], lens[i : i + 1], scale, **kw)
            assert torch.equal(out[i : i + 1], alone), i
    finally:
        cpu_plan.use(previous)
    for i, n in enumerate(seq_lens):
        k = gather_sequence_kv(k_cache, tables[i], n).float()
        v = gather_sequence_kv(v_cache, tables[i], n).float()
        ref = attention_reference(q[i : i + 1], k, v, scale, sliding_window=sliding_window, soft_cap=soft_cap)
        torch.testing.assert_close(out[i : i + 1], ref, atol=3e-2, rtol=3e-2)


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


# (sliding_window, soft_cap): windows shorter and longer than the sequences, and a window of 1
OPTIONS = [(5, None), (None, 1.5), (7, 0.8), (1, None), (100, 3.0)]


@pytest.mark.parametrize("sliding_window,soft_cap", OPTIONS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(6, 2, 64, 16), (9, 3, 17, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_options_match_reference(
    sliding_window, soft_cap, num_heads, num_kv_heads, head_dim, block_size, dtype, decode_impl
):
    k_cache, v_cache = _setup(40, block_size, num_kv_heads, head_dim, dtype, seed=2)
    k_cache.mul_(3)  # larger scores, so the soft cap bends them
    seq_lens = [1, 4, 13, block_size * 3 + 2]
    tables, bt = _random_tables(seq_lens, block_size, 40)
    max_blocks = bt.shape[1]
    q = torch.randn(len(seq_lens), num_heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    lens = torch.tensor(seq_lens)
    mask = decode_mask(lens, max_blocks * block_size)
    out = decode_impl(q, k_cache, v_cache, bt, lens, scale, mask, sliding_window=sliding_window, soft_cap=soft_cap)
    plain = decode_impl(q, k_cache, v_cache, bt, lens, scale, mask)
    for i, n in enumerate(seq_lens):
        k = gather_sequence_kv(k_cache, tables[i], n)
        v = gather_sequence_kv(v_cache, tables[i], n)
        ref = attention_reference(q[i : i + 1], k, v, scale, sliding_window=sliding_window, soft_cap=soft_cap)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i : i + 1], ref, atol=tol, rtol=tol)
    # the options do change the result (long sequences with a short window, or any capped one)
    assert not torch.allclose(out[-1], plain[-1], atol=1e-3)


@pytest.mark.parametrize("sliding_window,soft_cap", OPTIONS)
@pytest.mark.parametrize("num_context", [0, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_options_match_reference(sliding_window, soft_cap, num_context, dtype):
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 24, 4
    k_cache, v_cache = _setup(32, block_size, num_kv_heads, head_dim, dtype, seed=3)
    num_new = 13
    total = num_context + num_new
    table = torch.randperm(32)[: -(-total // block_size)]
    q = torch.randn(num_new, num_heads, head_dim, dtype=dtype) * 2
    k_new = torch.randn(num_new, num_kv_heads, head_dim, dtype=dtype) * 2
    v_new = torch.randn(num_new, num_kv_heads, head_dim, dtype=dtype)
    positions = torch.arange(num_context, total)
    slots = table[positions // block_size] * block_size + positions % block_size
    write_kv_cache(k_new, v_new, k_cache, v_cache, slots)
    scale = head_dim**-0.5
    out = prefill_attention(
        q,
        k_new,
        v_new,
        k_cache,
        v_cache,
        table,
        num_context,
        scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    k = gather_sequence_kv(k_cache, table.tolist(), total)
    v = gather_sequence_kv(v_cache, table.tolist(), total)
    ref = attention_reference(q, k, v, scale, sliding_window=sliding_window, soft_cap=soft_cap)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("gemm", ["bf16", "float32"])
@pytest.mark.parametrize("sliding_window,soft_cap", OPTIONS)
@pytest.mark.parametrize("num_context", [0, 5])
def test_prefill_float32_queries_over_bf16_cache_on_every_plan(gemm, sliding_window, soft_cap, num_context):
    """A bfloat16 model computes in float32 over a bf16 cache: prefill attention runs in bf16 under the
    bf16-GEMM plan (AMX / AVX512-BF16), in float32 otherwise; both give float32 within bf16 tolerance."""
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 24, 4
    k_cache, v_cache = _setup(32, block_size, num_kv_heads, head_dim, torch.bfloat16, seed=5)
    num_new = 11
    total = num_context + num_new
    table = torch.randperm(32)[: -(-total // block_size)]
    q = torch.randn(num_new, num_heads, head_dim) * 2
    k_new = torch.randn(num_new, num_kv_heads, head_dim) * 2
    v_new = torch.randn(num_new, num_kv_heads, head_dim)
    positions = torch.arange(num_context, total)
    write_kv_cache(k_new, v_new, k_cache, v_cache, table[positions // block_size] * block_size + positions % block_size)
    previous = cpu_plan.use(gemm=gemm)
    try:
        out = prefill_attention(q, k_new, v_new, k_cache, v_cache, table, num_context, head_dim**-0.5,
                                sliding_window=sliding_window, soft_cap=soft_cap)
    finally:
        cpu_plan.use(previous)
    assert out.dtype == torch.float32 and out.shape == q.shape
    k = gather_sequence_kv(k_cache, table.tolist(), total).float()
    v = gather_sequence_kv(v_cache, table.tolist(), total).float()
    ref = attention_reference(q, k, v, head_dim**-0.5, sliding_window=sliding_window, soft_cap=soft_cap)
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


def test_reference_window_semantics():
    """A query at position p sees exactly keys p - W + 1 .. p: one-hot values make that visible."""
    total, window = 9, 3
    key = torch.zeros(total, 1, total)  # equal scores: uniform weights over what is visible
    value = torch.eye(total)[:, None, :]  # value of key j is the j-th unit vector
    query = torch.zeros(total, 1, total)
    out = attention_reference(query, key, value, 1.0, sliding_window=window)[:, 0]
    for p in range(total):
        seen = out[p].nonzero().flatten().tolist()
        assert seen == list(range(max(0, p - window + 1), p + 1))
    # the convention transformers' sliding-window masks use
    from transformers.masking_utils import sliding_window_causal_mask_function

    allowed = sliding_window_causal_mask_function(window)
    for p in range(total):
        row = [
            bool(allowed(torch.tensor(0), torch.tensor(0), torch.tensor(p), torch.tensor(j)))
            for j in range(total)
        ]
        assert [j for j in range(total) if row[j]] == list(range(max(0, p - window + 1), p + 1))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, "int8", torch.float8_e4m3fn])
@pytest.mark.parametrize("head_dim,block_size,window", [(64, 16, None), (128, 5, None), (64, 16, 700), (80, 16, None)])
def test_native_decode_row_is_the_same_bits_in_any_batch(threads, cache_dtype, head_dim, block_size, window):
    """A row's output does not depend on the other rows of its step: a speculative step's verification
    rows (one sequence at lengths n .. n + k) and a batch of long contexts give each row the bits it gets
    decoded alone, however the kernel cuts long contexts into ranges: with a sliding window, on the fast
    head sizes and another (80), a block size that is no multiple of 4, every cache dtype."""
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    from perfxlm.ops.kv_quant import quantize

    num_heads, num_kv_heads = 9, 3
    num_blocks = 2400 // block_size * 3
    k_cache, v_cache = _setup(num_blocks, block_size, num_kv_heads, head_dim, torch.float32, seed=4)
    k_scale = v_scale = None
    if cache_dtype == "int8" or cache_dtype == torch.float8_e4m3fn:
        dt = torch.int8 if cache_dtype == "int8" else cache_dtype
        (k_cache, k_scale), (v_cache, v_scale) = quantize(k_cache, dt), quantize(v_cache, dt)
    else:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    # verification rows of sequences (lengths n .. n + k), then other sequences: short, past one range,
    # past several
    groups = [[1203, 1204, 1205, 1206, 1207, 1208], [1278, 1279, 1280, 1281, 1282], [2046, 2047, 2048, 2049, 2050],
              [60, 61, 62]]
    others = [131, 7, 517, 2049, 1]
    _, bt = _random_tables([g[-1] for g in groups] + others, block_size, num_blocks)
    bt = torch.cat([bt[i : i + 1].expand(len(g), -1) for i, g in enumerate(groups)] + [bt[len(groups):]])
    seq_lens = [n for g in groups for n in g] + others
    q = torch.randn(len(seq_lens), num_heads, head_dim)
    n = torch.get_num_threads()
    lens = torch.tensor(seq_lens)
    kw = dict(key_scale=k_scale, value_scale=v_scale, sliding_window=window)
    try:
        torch.set_num_threads(threads)
        batch = paged_decode_attention(q, k_cache, v_cache, bt, lens, 0.125, **kw)
        for i in range(len(seq_lens)):
            alone = paged_decode_attention(q[i : i + 1], k_cache, v_cache, bt[i : i + 1], lens[i : i + 1], 0.125, **kw)
            assert torch.equal(batch[i : i + 1], alone), (i, seq_lens[i])
        reference = paged_decode_attention_torch(q, k_cache, v_cache, bt, lens, 0.125, **kw)
        tol = 3e-2 if decode_bf16_products(k_cache.dtype) else 2e-3  # bf16 products under a bf16 plan
        torch.testing.assert_close(batch, reference, atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(n)


def test_native_decode_rejects_bad_metadata():
    """Lengths past the block table and block ids past the cache fail with a message, as the torch path's
    indexing does, instead of reading out of bounds."""
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    k_cache, v_cache = _setup(4, 8, 2, 64, torch.float32)
    q = torch.randn(1, 4, 64)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        paged_decode_attention(q, k_cache, v_cache, torch.tensor([[0, 1]]), torch.tensor([17]), 0.125)
    with pytest.raises(RuntimeError, match="out of range"):
        paged_decode_attention(q, k_cache, v_cache, torch.tensor([[0, 9]]), torch.tensor([12]), 0.125)


def _sinks(num_heads: int, seed: int) -> torch.Tensor:
    """Sink logits of every kind: some far below the scores, some near them, one far above (the sink takes
    almost all of the softmax: the kernel must not overflow computing its share)."""
    g = torch.Generator().manual_seed(seed)
    sinks = torch.randn(num_heads, generator=g) * 3
    sinks[0] = 60.0
    if num_heads > 2:
        sinks[1] = -40.0
    return sinks


# (sliding_window, soft_cap) with sinks: plain, a window shorter than the sequences, a soft cap
SINK_OPTIONS = [(None, None), (9, None), (None, 2.5)]


@pytest.mark.parametrize("sliding_window,soft_cap", SINK_OPTIONS)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size", [(6, 2, 64, 16), (9, 3, 17, 5), (8, 2, 128, 7), (3, 1, 256, 3)]
)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_decode_sinks_match_reference(
    sliding_window, soft_cap, num_heads, num_kv_heads, head_dim, block_size, cache_dtype, decode_impl
):
    """Attention sinks (gpt-oss) in decode: short sequences (one task per head) and one of 700 tokens
    (cut into ranges whose partial results are merged, the sink entering the merge once)."""
    seq_lens = [1, 13, 700, block_size * 3 + 2]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    k_cache, v_cache = _setup(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, seed=7)
    k_cache.mul_(2)
    tables, bt = _random_tables(seq_lens, block_size, num_blocks)
    q = torch.randn(len(seq_lens), num_heads, head_dim)
    scale, lens, sinks = head_dim**-0.5, torch.tensor(seq_lens), _sinks(num_heads, 1)
    out = decode_impl(q, k_cache, v_cache, bt, lens, scale, None, sliding_window, soft_cap, sinks=sinks)
    plain = decode_impl(q, k_cache, v_cache, bt, lens, scale, None, sliding_window, soft_cap)
    for i, n in enumerate(seq_lens):
        k = gather_sequence_kv(k_cache, tables[i], n).float()
        v = gather_sequence_kv(v_cache, tables[i], n).float()
        ref = attention_reference(q[i : i + 1], k, v, scale, sliding_window, soft_cap, sinks=sinks)
        bf16 = decode_impl is paged_decode_attention and decode_bf16_products(cache_dtype)  # bf16 products
        tol = 3e-2 if bf16 else 2e-5
        torch.testing.assert_close(out[i : i + 1], ref, atol=tol, rtol=tol)
    # the sinks count: the far-above one empties its head, the others shrink theirs
    assert out[:, 0].abs().max() < 1e-20 < plain[:, 0].abs().max()
    assert not torch.allclose(out[:, 2:], plain[:, 2:], atol=1e-3)


@pytest.mark.parametrize("sliding_window,soft_cap", SINK_OPTIONS)
@pytest.mark.parametrize("num_context", [0, 5, 37])
@pytest.mark.parametrize("tile_tokens", [2048, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_sinks_match_reference(sliding_window, soft_cap, num_context, tile_tokens, dtype, monkeypatch):
    """Prefill with sinks from the flash kernel's log-sum-exp, against the per-token reference: a fresh
    prompt, a context within one tile, and (tiles of 16 tokens) a context read in merged tiles."""
    from perfxlm.ops import prefill_tiles

    monkeypatch.setattr(prefill_tiles, "TILE_TOKENS", tile_tokens)
    monkeypatch.setattr(prefill_tiles, "SOFTCAP_TILE_TOKENS", tile_tokens)
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 24, 4
    k_cache, v_cache = _setup(32, block_size, num_kv_heads, head_dim, dtype, seed=8)
    num_new = 13
    total = num_context + num_new
    table = torch.randperm(32)[: -(-total // block_size)]
    q = torch.randn(num_new, num_heads, head_dim, dtype=dtype) * 2
    k_new = torch.randn(num_new, num_kv_heads, head_dim, dtype=dtype) * 2
    v_new = torch.randn(num_new, num_kv_heads, head_dim, dtype=dtype)
    positions = torch.arange(num_context, total)
    write_kv_cache(k_new, v_new, k_cache, v_cache, table[positions // block_size] * block_size + positions % block_size)
    scale, sinks = head_dim**-0.5, _sinks(num_heads, 2)
    args = (q, k_new, v_new, k_cache, v_cache, table, num_context, scale, sliding_window, soft_cap)
    out = prefill_attention(*args, sinks=sinks)
    reference = prefill_attention(*args, sinks=sinks, tiled=False)
    k = gather_sequence_kv(k_cache, table.tolist(), total)
    v = gather_sequence_kv(v_cache, table.tolist(), total)
    ref = attention_reference(q, k, v, scale, sliding_window, soft_cap, sinks=sinks)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(reference, ref, atol=tol, rtol=tol)
    assert out[:, 0].float().abs().max() < 1e-20
    assert not torch.allclose(out, prefill_attention(*args), atol=1e-2)


def test_decode_attention_mode_forces_either_way(monkeypatch):
    """PERFXLM_DECODE_ATTENTION forces bf16 or float32 products whatever the plan; a cache that is not
    bf16 never takes them; an unknown value is an error naming the choices."""
    previous = cpu_plan.use(gemm="float32")
    try:
        monkeypatch.setenv("PERFXLM_DECODE_ATTENTION", "bf16")
        assert decode_bf16_products(torch.bfloat16) and not decode_bf16_products(torch.float32)
        cpu_plan.use(gemm="bf16")
        monkeypatch.setenv("PERFXLM_DECODE_ATTENTION", "float32")
        assert not decode_bf16_products(torch.bfloat16)
        monkeypatch.setenv("PERFXLM_DECODE_ATTENTION", "auto")
        assert decode_bf16_products(torch.bfloat16) and not decode_bf16_products(torch.int8)
        monkeypatch.setenv("PERFXLM_DECODE_ATTENTION", "fp16")
        with pytest.raises(ValueError, match="auto, bf16, float32"):
            decode_bf16_products(torch.bfloat16)
    finally:
        cpu_plan.use(previous)
