"""Quantized KV cache (int8 with group scales, fp8 e4m3 / e5m2 with power-of-two group scales): the
plain-torch quantize / dequantize reference against the torch paths and the native kernels (write and
read), on random inputs with odd head sizes and block sizes."""

import pytest
import torch

from perfxlm.ops import cpu_plan, native
from perfxlm.ops.attention import (
    paged_decode_attention,
    paged_decode_attention_torch,
    prefill_attention,
    write_kv_cache,
)
from perfxlm.ops.kv_quant import (
    FP8_MAX,
    KV_CACHE_DTYPES,
    KVCacheSpec,
    dequantize,
    fp8_scale_exponents,
    quantize,
)
from perfxlm.ops.reference import attention_reference

FORMATS = [("int8", None), ("int8", 8), ("int8", 16), ("fp8_e4m3", None), ("fp8_e4m3", 16),
           ("fp8_e5m2", None), ("fp8_e5m2", 8)]
SHAPES = [(6, 2, 32, 16), (4, 4, 24, 5), (9, 3, 64, 7), (8, 2, 128, 16), (2, 1, 256, 3), (3, 1, 48, 1)]


def _fitting(head_dims):
    """(format, group, head_dim) where the group divides the head size."""
    return [(n, g, d) for d in head_dims for n, g in FORMATS if g is None or d % g == 0]


def _native_or_skip():
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    return native.kernels()


def _cache(spec, num_blocks, block_size, kvh, d, seed=0):
    """A cache filled with random K/V written through the torch path, and the float values written."""
    torch.manual_seed(seed)
    cache = spec.allocate(num_blocks, block_size, kvh, d)
    n = num_blocks * block_size
    k, v = torch.randn(n, kvh, d) * 3, torch.randn(n, kvh, d)
    k[0, 0] = 0.0  # an all-zero group: dequantized to 0 (int8 scale 0, fp8 scale 2^0)
    slots = torch.randperm(n)
    write_kv_cache(k, v, cache.key, cache.value, slots, cache.key_scale, cache.value_scale)
    return cache


def _deq(cache, which):
    q = cache.key if which == "k" else cache.value
    s = cache.key_scale if which == "k" else cache.value_scale
    return dequantize(q, s, torch.float32)


@pytest.mark.parametrize("name,group", FORMATS)
def test_quantize_error_bounds(name, group):
    spec = KVCacheSpec.resolve(name, torch.float32, group)
    # heads of very different magnitudes: per-group scales keep each one's relative precision
    x = torch.randn(50, 3, 64) * torch.tensor([4.0, 0.02, 3e-4]).view(1, 3, 1)
    x[0, 0] = 0
    q, s = quantize(x, spec.dtype, 64 // spec.group(64))
    assert q.dtype == spec.dtype and s.shape == (50, 3, 64 // spec.group(64)) and s.dtype == spec.scale_dtype
    back = dequantize(q, s, torch.float32)
    assert torch.equal(back[0, 0], torch.zeros(64))
    if name == "int8":
        # symmetric absmax: error at most half a step of the group's scale
        step = s.repeat_interleave(spec.group(64), dim=-1)
        assert (back - x).abs().le(step / 2 + 1e-6 * step).all()
    else:
        # a power of two 2^e per group: the group's absmax lands in the format's top binade, each value
        # rounds to 3 / 2 mantissa bits (half a unit: 2^-4 / 2^-3 relative), subnormals to half the
        # smallest step (2^-10 / 2^-17) times 2^e
        e = s.to(torch.int32) - 127
        amax = x.unflatten(-1, (s.shape[-1], -1)).abs().amax(-1)
        top = FP8_MAX[spec.dtype]
        live = amax > 0
        scaled = amax[live] / torch.exp2(e[live].double())
        assert (scaled <= top).all() and (scaled > top / 2).all()
        rel, tiny = (2.0**-4, 2.0**-10) if name == "fp8_e4m3" else (2.0**-3, 2.0**-17)
        bound = rel * x.abs() + tiny * torch.exp2(e.double()).repeat_interleave(spec.group(64), dim=-1)
        assert ((back - x).abs() <= bound).all()
    # large values scaled (fp8) or saturated, never NaN / inf
    big, _ = quantize(torch.tensor([1e9, -1e9]), spec.dtype, 1)
    assert torch.isfinite(big.float()).all()


@pytest.mark.parametrize("name,group,head_dim", _fitting([24, 64, 17 * 8]))
def test_native_write_equals_torch_write(name, group, head_dim):
    ops = _native_or_skip()
    spec = KVCacheSpec.resolve(name, torch.float32, group)
    torch.manual_seed(0)
    a, b = spec.allocate(9, 5, 3, head_dim), spec.allocate(9, 5, 3, head_dim)
    k, v = torch.randn(20, 3, head_dim) * 5, torch.randn(20, 3, head_dim)
    k[3] = 1e6  # far past fp8's range: the scale takes it
    slots = torch.randperm(45)[:20]
    ops.write_kv_slots(k, v, a.key, a.value, slots, a.key_scale, a.value_scale)
    # the torch path: quantize() per token, index_copy into the slots
    for t, cache, scale in ((k, b.key, b.key_scale), (v, b.value, b.value_scale)):
        q, s = quantize(t, spec.dtype, scale.shape[-1] if scale is not None else 1)
        cache.view(torch.uint8).view(-1, 3, head_dim)[slots] = q.view(torch.uint8)
        if scale is not None:
            scale.view(-1, 3, scale.shape[-1])[slots] = s
    for x, y in zip(a.tensors(), b.tensors()):
        assert torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else x,
                           y.view(torch.uint8) if y.dtype != torch.float32 else y)  # fmt: skip


@pytest.mark.parametrize(
    "name,group,num_heads,num_kv_heads,head_dim,block_size",
    [(n, g, h, kvh, d, bs) for h, kvh, d, bs in SHAPES for n, g, d2 in _fitting([d])],
)
# the torch variant reads through the torch path: a lower tier's run leaves it to the CPU's own, the
# native variant making the same cache writes (tests/tier_cases.py)
@pytest.mark.parametrize("impl", ["native", pytest.param("torch", marks=pytest.mark.tier_independent)])
def test_decode_reads_quantized_cache(name, group, num_heads, num_kv_heads, head_dim, block_size, impl):
    fn = paged_decode_attention_torch
    if impl == "native":
        _native_or_skip()
        fn = paged_decode_attention
    spec = KVCacheSpec.resolve(name, torch.float32, group)
    cache = _cache(spec, 60, block_size, num_kv_heads, head_dim)
    k_deq, v_deq = _deq(cache, "k"), _deq(cache, "v")
    seq_lens = [1, 13, block_size * 3, 29]
    perm = torch.randperm(60).tolist()
    tables, off = [], 0
    for n in seq_lens:
        nb = -(-n // block_size)
        tables.append(perm[off : off + nb])
        off += nb
    mb = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (mb - len(t)) for t in tables])
    q = torch.randn(len(seq_lens), num_heads, head_dim)
    scale = head_dim**-0.5
    sinks = torch.randn(num_heads) * 2  # gpt-oss: a logit per head in the softmax's denominator
    for options in ({}, {"sliding_window": 5}, {"soft_cap": 3.0}, {"sinks": sinks, "sliding_window": 11}):
        out = fn(q, cache.key, cache.value, bt, torch.tensor(seq_lens), scale, None, key_scale=cache.key_scale,
                 value_scale=cache.value_scale, **options)  # fmt: skip
        for i, n in enumerate(seq_lens):
            k = k_deq[tables[i]].flatten(0, 1)[:n]
            v = v_deq[tables[i]].flatten(0, 1)[:n]
            ref = attention_reference(q[i : i + 1], k, v, scale, **options)
            torch.testing.assert_close(out[i : i + 1], ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name,group", [(n, g) for n, g, _ in _fitting([24])])
@pytest.mark.parametrize("num_context", [0, 5, 16])
@pytest.mark.parametrize("bf16_model", [False, True])
def test_prefill_reads_quantized_context(name, group, num_context, bf16_model):
    """A float32 model's prefill attends in float32; a bfloat16 model's (float32 activations) in bf16
    under the bf16-GEMM plan, whatever this CPU is: bf16 tolerance then."""
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 24, 4
    spec = KVCacheSpec.resolve(name, torch.bfloat16 if bf16_model else torch.float32, group)
    cache = _cache(spec, 32, block_size, num_kv_heads, head_dim, seed=1)
    num_new = 11
    total = num_context + num_new
    table = torch.randperm(32)[: -(-total // block_size)]
    q = torch.randn(num_new, num_heads, head_dim)
    k_new, v_new = torch.randn(num_new, num_kv_heads, head_dim), torch.randn(num_new, num_kv_heads, head_dim)
    positions = torch.arange(num_context, total)
    slots = table[positions // block_size] * block_size + positions % block_size
    write_kv_cache(k_new, v_new, cache.key, cache.value, slots, cache.key_scale, cache.value_scale)
    assert cache.bf16_model == bf16_model
    previous = cpu_plan.use(gemm="bf16")
    try:
        out = prefill_attention(q, k_new, v_new, cache.key, cache.value, table, num_context, 0.3,
                                key_scale=cache.key_scale, value_scale=cache.value_scale,
                                bf16_model=cache.bf16_model)  # fmt: skip
    finally:
        cpu_plan.use(previous)
    assert out.dtype == torch.float32
    tol = 3e-2 if bf16_model else 2e-5
    k_all = _deq(cache, "k")[table].flatten(0, 1)[:total]
    v_all = _deq(cache, "v")[table].flatten(0, 1)[:total]
    if num_context == 0:  # a fresh prompt attends to its own unquantized K/V, as vLLM's prefill
        k_all, v_all = k_new, v_new
    for i in range(num_new):
        p = num_context + i
        ref = attention_reference(q[i : i + 1], k_all[: p + 1], v_all[: p + 1], 0.3)
        torch.testing.assert_close(out[i : i + 1], ref, atol=tol, rtol=tol)


def test_bytes_per_token_and_names():
    bf16 = KVCacheSpec.resolve("auto", torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.bytes_per_token(3, 64) == 2 * 3 * 64 * 2
    assert KVCacheSpec.resolve("int8", torch.bfloat16).bytes_per_token(3, 64) == 2 * 3 * (64 + 4)
    assert KVCacheSpec.resolve("int8", torch.bfloat16, 8).bytes_per_token(3, 64) == 2 * 3 * (64 + 8 * 4)
    assert KVCacheSpec.resolve("fp8", torch.bfloat16).dtype == torch.float8_e4m3fn
    # fp8: one exponent byte per group
    assert KVCacheSpec.resolve("fp8_e5m2", torch.float32).bytes_per_token(3, 64) == 2 * 3 * (64 + 1)
    assert KVCacheSpec.resolve("fp8", torch.float32, 16).bytes_per_token(3, 64) == 2 * 3 * (64 + 4)
    with pytest.raises(ValueError, match="auto, int8, fp8, fp8_e4m3, fp8_e5m2"):
        KVCacheSpec.resolve("int4", torch.float32)
    assert KV_CACHE_DTYPES == ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_widen_gives_torch_conversion_for_every_finite_fp8_code(fp8, dtype):
    from perfxlm.ops.kv_quant import widen

    codes = torch.arange(256, dtype=torch.uint8).view(fp8).reshape(4, 64)
    expected = codes.to(dtype)
    got = widen(codes, dtype)
    finite = expected.isfinite()
    assert got.dtype == dtype and got.shape == codes.shape
    assert torch.equal(got[finite], expected[finite])


@pytest.mark.parametrize("fp8,top", [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)])
def test_fp8_scale_exponent_at_the_edges(fp8, top):
    """The smallest power of two that brings the absmax within the format's maximum, exactly at the
    boundaries; 0 for an all-zero group; clamped where 2^e would leave the normal floats."""
    edges = [top, top * (1 + 2**-20), top / 2, top / 2 * (1 + 2**-20), top * 2**-40, 0.0, 3e38, 1e-44]
    amax = torch.tensor(edges)
    e = fp8_scale_exponents(amax, fp8).tolist()
    assert e[:6] == [0, 1, -1, 0, -40, 0]
    assert e[6] == round(torch.log2(torch.tensor(3e38 / top)).ceil().item()) and e[7] == -126
    q, s = quantize(torch.tensor([[top * 8, -top, 1.0]]), fp8)
    assert s.item() == 127 + 3
    assert torch.equal(dequantize(q, s, torch.float32), torch.tensor([[top * 8, -top, 1.0]]))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_scales_written_by_the_kernel_match_every_exponent(name):
    """The native write picks the same exponent and bits as the torch reference over 2^-120 .. 2^120 and
    at the rule's edges: the format's maximum and half of it (and just past each), 0, the largest float,
    a float32 subnormal, an infinity, a NaN."""
    ops = _native_or_skip()
    spec = KVCacheSpec.resolve(name, torch.float32)
    top = FP8_MAX[spec.dtype]
    mags = torch.exp2(torch.linspace(-120, 120, 256)).view(256, 1, 1)
    k = torch.randn(256, 2, 16) * mags
    inf, nan = float("inf"), float("nan")
    edges = [top, top * (1 + 2**-20), top / 2, top / 2 * (1 + 2**-20), 0.0, 3e38, 1e-44, inf, nan]
    for i, edge in enumerate(edges):  # a head whose absmax is the edge (or holding the inf / NaN)
        k[i, 0] = torch.linspace(-1, 1, 16) * (1 if edge in (inf,) or edge != edge else edge)
        k[i, 0, 3] = edge
    cache = spec.allocate(3, 128, 2, 16)
    ops.write_kv_slots(k, k, cache.key, cache.value, torch.arange(256), cache.key_scale, cache.value_scale)
    q, s = quantize(k, spec.dtype)
    assert torch.equal(cache.key_scale.view(-1, 2, 1)[:256], s)
    assert torch.equal(cache.key.view(torch.uint8).view(-1, 2, 16)[:256], q.view(torch.uint8))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("magnitude", [1e-4, 1.0, 2e3])
@pytest.mark.parametrize("impl", ["native", "torch"])
def test_fp8_attention_keeps_its_precision_at_any_magnitude(name, magnitude, impl):
    """K/V far outside fp8's comfortable range (a scale of 1.0 would flush 1e-4 to zero and saturate
    2e3 K at 448) are read back with the format's relative precision: the decode output against float32
    attention on the unquantized values is within a few mantissa steps, whatever the magnitude."""
    fn = paged_decode_attention_torch
    if impl == "native":
        _native_or_skip()
        fn = paged_decode_attention
    torch.manual_seed(0)
    spec = KVCacheSpec.resolve(name, torch.float32)
    num_heads, kvh, d, bs, n = 4, 2, 64, 8, 40
    cache = spec.allocate(n // bs, bs, kvh, d)
    k, v = torch.randn(n, kvh, d) * magnitude, torch.randn(n, kvh, d) * magnitude
    write_kv_cache(k, v, cache.key, cache.value, torch.arange(n), cache.key_scale, cache.value_scale)
    q = torch.randn(1, num_heads, d) / magnitude  # scores of order 1 at every magnitude
    scale = d**-0.5
    out = fn(q, cache.key, cache.value, torch.arange(n // bs)[None], torch.tensor([n]), scale, None,
             key_scale=cache.key_scale, value_scale=cache.value_scale)  # fmt: skip
    ref = attention_reference(q, k, v, scale)
    rel = (out - ref).norm() / ref.norm()
    assert rel < (0.08 if name == "fp8_e4m3" else 0.15)  # a scale of 1.0: ~1 at 1e-4 and 2e3
