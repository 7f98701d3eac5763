"""The native causal prefill attention kernel (csrc/prefill_attention.cpp), forced with
PERFXLM_PREFILL_ATTENTION=kernel, against the per-token reference on odd sizes (lengths, heads, GQA
ratios, head dims, block sizes, cached context), and its invariance: a query's output is the same bits
whatever else runs with it (a longer prompt, a prompt split into chunks over the cache)."""

import pytest
import torch

from perfxlm.ops import cpu_plan, native, prefill_kernel
from perfxlm.ops.attention import prefill_attention, write_kv_cache
from perfxlm.ops.reference import attention_reference, gather_sequence_kv


@pytest.fixture
def kernel(monkeypatch):
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    monkeypatch.setenv("PERFXLM_PREFILL_ATTENTION", "kernel")


def _sequence(num_context, num_new, num_heads, num_kv_heads, head_dim, block_size, cache_dtype, seed=0):
    """A cache holding the sequence's context and new keys (in random blocks), and the new tokens."""
    gen = torch.Generator().manual_seed(seed)
    total = num_context + num_new
    num_blocks = -(-total // block_size) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    table = torch.randperm(num_blocks, generator=gen)[: -(-total // block_size)]
    q = torch.randn(num_new, num_heads, head_dim, generator=gen)
    k_new = torch.randn(num_new, num_kv_heads, head_dim, generator=gen)
    v_new = torch.randn(num_new, num_kv_heads, head_dim, generator=gen)
    positions = torch.arange(num_context, total)
    write_kv_cache(k_new, v_new, k_cache, v_cache, table[positions // block_size] * block_size + positions % block_size)
    return q, k_new, v_new, k_cache, v_cache, table


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (6, 2, 24, 5), (5, 5, 80, 7), (8, 1, 128, 16), (4, 2, 17, 3)],
)
@pytest.mark.parametrize("num_context,num_new", [(0, 1), (0, 67), (0, 130), (13, 1), (70, 59), (64, 64)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(kernel, num_heads, num_kv_heads, head_dim, block_size, num_context, num_new,
                                  cache_dtype):
    q, k_new, v_new, k_cache, v_cache, table = _sequence(
        num_context, num_new, num_heads, num_kv_heads, head_dim, block_size, cache_dtype
    )
    scale = head_dim**-0.5
    out = prefill_attention(q, k_new, v_new, k_cache, v_cache, table, num_context, scale)
    total = num_context + num_new
    # the reference over the cache's copy of every key: the kernel rounds new keys as the cache does
    k = gather_sequence_kv(k_cache, table.tolist(), total).float()
    v = gather_sequence_kv(v_cache, table.tolist(), total).float()
    ref = attention_reference(q.double(), k.double(), v.double(), scale).float()
    assert out.dtype == torch.float32 and out.shape == q.shape
    # over bf16 keys an AVX512-BF16 build rounds the queries and the softmax's weights to bf16 (vdpbf16ps)
    tol = 2e-5 if cache_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_query_is_the_same_bits_alone_longer_or_chunked(kernel, cache_dtype, threads):
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        num_heads, num_kv_heads, head_dim, block_size, total = 9, 3, 64, 16, 203
        q, k_new, v_new, k_cache, v_cache, table = _sequence(
            0, total, num_heads, num_kv_heads, head_dim, block_size, cache_dtype, seed=3
        )
        scale = 0.125
        whole = prefill_attention(q, k_new, v_new, k_cache, v_cache, table, 0, scale)
        for n in (1, 63, 64, 65, 150):  # a shorter prompt: its rows as the longer prompt's first rows
            part = prefill_attention(q[:n], k_new[:n], v_new[:n], k_cache, v_cache, table, 0, scale)
            assert torch.equal(part, whole[:n]), n
        for c in (1, 64, 100, 190):  # the rest after context read back from the cache (chunked / prefix hit)
            rest = prefill_attention(q[c:], k_new[c:], v_new[c:], k_cache, v_cache, table, c, scale)
            assert torch.equal(rest, whole[c:]), c
    finally:
        torch.set_num_threads(prev)


def test_torch_mode_and_options_keep_the_sdpa_paths(monkeypatch):
    q, k_new, v_new, k_cache, v_cache, table = _sequence(0, 20, 4, 2, 32, 8, torch.float32)
    monkeypatch.setenv("PERFXLM_PREFILL_ATTENTION", "torch")
    assert not prefill_kernel.applies(q, k_cache, 0, False)
    monkeypatch.setenv("PERFXLM_PREFILL_ATTENTION", "kernel")
    assert prefill_kernel.applies(q, k_cache, 0, False)
    assert not prefill_kernel.applies(q, k_cache, 0, True)  # window, soft cap, sinks, quantized cache
    assert not prefill_kernel.applies(q.bfloat16(), k_cache, 0, False)  # bf16 activations: torch's ops
    assert not prefill_kernel.applies(q, k_cache.to(torch.int8), 0, False)
    monkeypatch.setenv("PERFXLM_PREFILL_ATTENTION", "sdpa")
    with pytest.raises(ValueError, match="PERFXLM_PREFILL_ATTENTION='sdpa'"):
        prefill_kernel.mode()


def test_kernel_and_sdpa_agree_through_the_dispatch(kernel, monkeypatch):
    q, k_new, v_new, k_cache, v_cache, table = _sequence(21, 45, 6, 3, 64, 16, torch.bfloat16, seed=5)
    out = prefill_attention(q, k_new, v_new, k_cache, v_cache, table, 21, 0.125)
    monkeypatch.setenv("PERFXLM_PREFILL_ATTENTION", "torch")
    sdpa = prefill_attention(q, k_new, v_new, k_cache, v_cache, table, 21, 0.125)
    torch.testing.assert_close(out, sdpa, atol=2e-2, rtol=2e-2)  # SDPA runs bf16 products on bf16 plans


@pytest.mark.parametrize("num_context", [0, 37])
def test_a_float32_plan_keeps_float32_products_over_a_bf16_cache(kernel, num_context):
    # the plan's float32 attention (AVX2 / AVX-512 without bf16 arithmetic, or forced): no rounding of the
    # queries or the softmax's weights, whatever the build
    q, k_new, v_new, k_cache, v_cache, table = _sequence(num_context, 70, 6, 2, 64, 16, torch.bfloat16, seed=7)
    previous = cpu_plan.use(gemm="float32")
    try:
        out = prefill_attention(q, k_new, v_new, k_cache, v_cache, table, num_context, 0.125)
    finally:
        cpu_plan.use(previous)
    total = num_context + 70
    k = gather_sequence_kv(k_cache, table.tolist(), total).double()
    v = gather_sequence_kv(v_cache, table.tolist(), total).double()
    ref = attention_reference(q.double(), k, v, 0.125).float()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
