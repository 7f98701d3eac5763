"""int4's searched group scales and mins (perfxlm.quant.search), QLoRA's double-quantized NF4
(perfxlm.quant.nf4) against a plain-torch transcription of bitsandbytes' rule, and mixed precision's
choice of layers (perfxlm.quant.mixed)."""

from __future__ import annotations

import pytest
import torch

from perfxlm.quant import QuantizationConfig, quantizers, search
from perfxlm.quant.mixed import code_bits, use_more_bits
from perfxlm.quant.nf4 import NF4_LEVELS, double_quantize_absmax, dynamic_map

# odd group counts per row (3, 5, 7), odd row counts, outliers
SHAPES = [(7, 96, 32), (5, 160, 32), (3, 448, 64), (33, 64, 64)]


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, 3] = 0.9  # an outlier, which the plain rule spends its range on
    w[n // 2, : k // 2] += 0.03  # a shifted half row: the groups' ranges are not centered on 0
    return w


def importance(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 100)
    imp = torch.rand(k, generator=g).pow(4) * 10  # a few channels dominate, as activations do
    imp[1] = 0.0  # a channel that never fires
    return imp


def weighted_error(q, w: torch.Tensor, group: int, imp: torch.Tensor | None) -> torch.Tensor:
    """Per group: the objective the search minimizes, sum of element_weights * (dequantized - w)^2."""
    g = w.reshape(-1, group)
    layout = None if imp is None else imp.reshape(-1, group).repeat(w.shape[0], 1)
    wt = search.element_weights(g, layout)
    return (wt * (q.dequantize().reshape(-1, group) - g).square()).sum(-1)


def plain(w: torch.Tensor, group: int):
    return quantizers.quantize_asymmetric_int4(w, group)


# the torch variant runs no kernel: the lower tiers' runs leave it to the CPU's own (tests/tier_cases.py)
TORCH_ONLY = pytest.param(False, id="torch", marks=pytest.mark.tier_independent)


@pytest.mark.parametrize("native", [pytest.param(True, id="native"), TORCH_ONLY])
@pytest.mark.parametrize("with_importance", [False, True])
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_search_never_worse_than_the_plain_rule(n, k, group, with_importance, native, monkeypatch):
    if not native:
        monkeypatch.setattr(search, "_native", lambda: None)
    w = weights(n, k, seed=n + k)
    imp = importance(k, seed=k) if with_importance else None
    q = quantizers.quantize_int4_search(w, group, imp)
    assert (q.bits, q.group, q.levels) == (4, group, None)
    assert q.scales.dtype == q.mins.dtype == torch.float16
    u = q.unpacked_codes()
    assert int(u.max()) <= 15  # uint8: never below 0
    assert torch.isfinite(q.scales).all() and torch.isfinite(q.mins).all() and (q.scales >= 0).all()
    ours, base = weighted_error(q, w, group, imp), weighted_error(plain(w, group), w, group, imp)
    assert (ours <= base * (1 + 1e-6) + 1e-12).all()  # per group, up to float summation order
    assert ours[1:].sum() < 0.9 * base[1:].sum()  # and clearly better overall (past the outlier's group)


def test_native_and_torch_searches_agree():
    """The native kernel follows the plain-torch definition: the same stored scales and mins up to a float16
    step where a float sum's order tips a near tie, and the same objective."""
    from perfxlm.ops import native

    if native.kernels() is None or not hasattr(native.kernels(), "search_affine"):
        pytest.skip("native kernels not built")
    w = weights(64, 256, seed=3)
    g = w.reshape(-1, 32)
    for imp in (None, importance(256, seed=1).reshape(8, 32)):  # 8 groups per row, tiled over 64 rows
        u1, s1, m1 = search.search_affine(g, 15, imp, use_native=True)
        u2, s2, m2 = search.search_affine(g, 15, imp, use_native=False)
        assert (s1 == s2).float().mean() > 0.99 and (m1 == m2).float().mean() > 0.99
        wt = search.element_weights(g, None if imp is None else imp.repeat(64, 1))
        e1 = (wt * (s1.float()[:, None] * u1.float() + m1.float()[:, None] - g).square()).sum()
        e2 = (wt * (s2.float()[:, None] * u2.float() + m2.float()[:, None] - g).square()).sum()
        torch.testing.assert_close(e1, e2, rtol=1e-4, atol=0)


@pytest.mark.parametrize("table", ["int5", "nf4"])
@pytest.mark.parametrize("n,k,group", [(37, 96, 32), (5, 448, 64), (129, 160, 32)])
def test_native_and_torch_level_searches_agree(n, k, group, table):
    """The native level search (a table of 32 uniform levels, NF4's 16) follows the plain-torch definition:
    the same codes and float16 scales but where a float sum's order tips a near tie (a candidate's error is
    a difference of sums close to each other, so float32 sums in another order can reorder two candidates
    within 0.1 %), and the same objective overall; zero groups and a group with one outlier included."""
    from perfxlm.ops import native

    if native.kernels() is None or not hasattr(native.kernels(), "search_levels"):
        pytest.skip("native kernels not built")
    uniform32 = (torch.arange(32, dtype=torch.float32) - 16) / 16  # a 5-bit table over [-1, 1)
    levels = uniform32 if table == "int5" else NF4_LEVELS
    w = weights(n, k, seed=n * k)
    w[1, :group] = 0.0
    w[2, :group] = 1e-30  # below float16's range: the plain rule's scale rounds to 0
    g = w.reshape(-1, group)
    for imp in (None, importance(k, seed=k).reshape(k // group, group)):
        u1, s1 = search.search_levels(g, levels, imp, use_native=True)
        u2, s2 = search.search_levels(g, levels, imp, use_native=False)
        assert u1.dtype == torch.uint8 and s1.dtype == s2.dtype == torch.float16
        same = (s1 == s2) & (u1.long() == u2.long()).all(-1)
        assert same.float().mean() > 0.97, same.float().mean()
        assert torch.equal(u1[same].long(), u2[same].long())
        wt = search.element_weights(g, None if imp is None else imp.repeat(n, 1))
        e1 = (wt * (s1.float()[:, None] * levels[u1.long()] - g).square()).sum(-1)
        e2 = (wt * (s2.float()[:, None] * levels[u2.long()] - g).square()).sum(-1)
        torch.testing.assert_close(e1, e2, rtol=2e-3, atol=1e-12)  # per group: a near tie either way
        torch.testing.assert_close(e1.sum(), e2.sum(), rtol=2e-4, atol=0)
        absmax = g.abs().amax(-1).half().float()  # the plain rule, which neither may lose to
        safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        plain = levels[search._nearest(g / safe[:, None], levels)] * absmax[:, None]
        assert (e1 <= (wt * (plain - g).square()).sum(-1) * (1 + 1e-6) + 1e-30).all()


@pytest.mark.parametrize("bits,half", [(5, True), (4, True), (5, False)])
@pytest.mark.parametrize("n,k,group", [(37, 96, 32), (5, 448, 64), (129, 160, 32)])
def test_native_and_torch_centred_searches_agree(n, k, group, bits, half):
    """The native centred search (int4's 5-bit weights) follows `_centred_chunk`: the same codes and
    scales but where a float sum's order tips a near tie, the same objective overall, never worse than
    the plain rule; zero groups, a group below float16's range and an outlier included."""
    from perfxlm.ops import native

    if native.kernels() is None or not hasattr(native.kernels(), "search_centred"):
        pytest.skip("native kernels not built")
    w = weights(n, k, seed=n * k + bits)
    w[1, :group] = 0.0
    w[2, :group] = 1e-30
    g = w.reshape(-1, group)
    for imp in (None, importance(k, seed=k).reshape(k // group, group)):
        q1, d1 = search.search_centred(g, bits, imp, half=half, use_native=True)
        q2, d2 = search.search_centred(g, bits, imp, half=half, use_native=False)
        assert q1.dtype == q2.dtype == torch.float32 and d1.dtype == d2.dtype
        same = (d1 == d2) & (q1 == q2).all(-1)
        if half:  # float32 scales carry the sums' last bits: only the objective is compared there
            assert same.float().mean() > 0.97, same.float().mean()
        else:
            assert ((q1 == q2).all(-1)).float().mean() > 0.97
        wt = search.element_weights(g, None if imp is None else imp.repeat(n, 1))
        e1 = (wt * (d1.float()[:, None] * q1 - g).square()).sum(-1)
        e2 = (wt * (d2.float()[:, None] * q2 - g).square()).sum(-1)
        torch.testing.assert_close(e1, e2, rtol=2e-3, atol=1e-12)  # per group: a near tie either way
        torch.testing.assert_close(e1.sum(), e2.sum(), rtol=2e-4, atol=0)
        extreme = torch.gather(g, -1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)
        plain_d = (extreme / -(1 << (bits - 1))).to(d1.dtype).float()
        safe = torch.where(plain_d != 0, plain_d, torch.ones_like(plain_d))
        top = 1 << (bits - 1)
        plain = torch.round(g / safe[:, None]).clamp(-top, top - 1) * plain_d[:, None]
        assert (e1 <= (wt * (plain - g).square()).sum(-1) * (1 + 1e-6) + 1e-30).all()


def test_int5_search_loads_native_and_torch_to_the_same_objective(monkeypatch):
    """quantize_int5_search (mixed precision's 5-bit weights) through either search: the same weighted
    error, and the torch search stays the fallback where the kernels are not built."""
    w = weights(33, 576, seed=5)
    imp = importance(576, seed=2)
    native_q = quantizers.quantize_int5_search(w, 32, imp)
    monkeypatch.setattr(search, "_native", lambda: None)
    torch_q = quantizers.quantize_int5_search(w, 32, imp)
    torch.testing.assert_close(weighted_error(native_q, w, 32, imp).sum(), weighted_error(torch_q, w, 32, imp).sum(),
                               rtol=2e-4, atol=0)


@pytest.mark.parametrize("native", [pytest.param(True, id="native"), TORCH_ONLY])
def test_zero_and_constant_groups_are_exact(native, monkeypatch):
    """A group of zeros dequantizes to zeros and a constant group to its constant (the min carries it:
    scale 0), with no nan from a zero range or from all-zero importance."""
    if not native:
        monkeypatch.setattr(search, "_native", lambda: None)
    w = torch.randn(4, 96) * 0.1
    w[0, :32] = 0.0
    w[1, 32:64] = 0.25
    w[2, :] = 0.0
    imp = torch.ones(96)
    imp[64:] = 0.0  # the last group's errors count for nothing
    for q in (quantizers.quantize_int4_search(w, 32), quantizers.quantize_int4_search(w, 32, imp)):
        d = q.dequantize()
        assert torch.isfinite(d).all()
        assert torch.equal(d[0, :32], torch.zeros(32)) and torch.equal(d[2], torch.zeros(96))
        torch.testing.assert_close(d[1, 32:64], torch.full((32,), 0.25).half().float(), rtol=0, atol=0)
        assert (d[3, 64:] - w[3, 64:]).abs().max() < 0.1  # unweighted groups still get a sane fit


def test_scales_beyond_float16_fall_back_to_float32():
    w = torch.randn(3, 64) * 1e6
    q = quantizers.quantize_int4_search(w, 32)
    assert q.scales.dtype == torch.float32 and torch.isfinite(q.scales).all()
    ours, base = weighted_error(q, w, 32, None), weighted_error(plain(w, 32), w, 32, None)
    assert (ours <= base * (1 + 1e-6)).all()


def test_importance_must_match_the_input_size():
    with pytest.raises(ValueError, match=r"importance has shape \(32,\), expected \(64,\)"):
        quantizers.quantize_int4_search(torch.randn(2, 64), 32, torch.ones(32))


def test_importance_moves_the_error_to_unimportant_channels():
    w = weights(16, 128, seed=7)
    imp = torch.ones(128)
    imp[::2] = 100.0
    q_plain, q_aware = quantizers.quantize_int4_search(w, 32), quantizers.quantize_int4_search(w, 32, imp)
    err = lambda q: (q.dequantize() - w).square()  # noqa: E731
    assert err(q_aware)[:, ::2].sum() < err(q_plain)[:, ::2].sum()


# ---------------------------------------------------------------------------------------------------------
# NF4 with QLoRA's double quantization, against bitsandbytes' rule written out in plain torch
# ---------------------------------------------------------------------------------------------------------


def bnb_dynamic_map() -> torch.Tensor:
    """bitsandbytes.functional.create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8), as written
    there."""
    data = []
    max_exponent_bits, total_bits = 7, 8
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    assert additional_items == 0
    data.append(0)
    data.append(1.0)
    assert len(data) == 2**total_bits
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def bnb_quantize_blockwise(a: torch.Tensor, code: torch.Tensor, blocksize: int):
    """bitsandbytes' default backend quantize_blockwise: absmax per block, argmin |A / absmax - code|."""
    n = a.numel()
    rem = n % blocksize
    blocks = n // blocksize + (rem > 0)
    absmax = torch.zeros(blocks, dtype=torch.float32)
    flat = a.reshape(n)
    full = flat[: n - rem].reshape(n // blocksize, blocksize)
    absmax[: n // blocksize] = full.abs().max(dim=-1)[0]
    scaled = torch.clamp(full * (1 / absmax[: n // blocksize].view(-1, 1)), -1, 1).reshape(-1)
    if rem:
        absmax[-1] = flat[n - rem :].abs().max()
        scaled = torch.cat([scaled, torch.clamp(flat[n - rem :] * (1 / absmax[-1]), -1, 1)])
    out = torch.argmin((scaled.unsqueeze(-1) - code).abs(), dim=-1).to(torch.uint8)
    return out, absmax


def bnb_nf4_dequantized(w: torch.Tensor, blocksize: int = 64) -> torch.Tensor:
    """quantize_4bit(w, blocksize, quant_type="nf4", compress_statistics=True), then dequantize_4bit, in
    float32: what a QLoRA model computes with."""
    flat = w.reshape(-1).float()
    blocks = flat.reshape(-1, blocksize)
    absmax = blocks.abs().max(dim=-1)[0]
    scaled = torch.clamp(blocks * (1 / absmax.view(-1, 1)), -1, 1).reshape(-1)
    codes = torch.argmin((scaled.view(-1, 1) - NF4_LEVELS).abs(), dim=-1)
    offset = absmax.mean()
    qabsmax, absmax2 = bnb_quantize_blockwise(absmax - offset, bnb_dynamic_map(), 256)
    dq = bnb_dynamic_map()[qabsmax.reshape(-1).int()]
    pad = (-dq.numel()) % 256
    dq = torch.nn.functional.pad(dq, (0, pad)).view(-1, 256) * absmax2.view(-1, 1)
    scales = dq.reshape(-1)[: absmax.numel()] + offset
    return (NF4_LEVELS[codes].view(-1, blocksize) * scales.view(-1, 1)).reshape(w.shape)


def test_dynamic_map_is_bitsandbytes():
    code = dynamic_map()
    assert torch.equal(code, bnb_dynamic_map())
    assert code.shape == (256,) and code[-1] == 1.0 and (code == 0).sum() == 1
    assert (code[1:] > code[:-1]).all()


# absmax blocks of 256: one partial, several, several with a partial one
@pytest.mark.parametrize("n,k", [(5, 128), (40, 192), (3, 64), (300, 128)])
def test_nf4_double_quant_values_equal_qlora(n, k):
    g = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)  # QLoRA quantizes bf16 checkpoints
    w[0, 5] = 0.5
    q = quantizers.quantize_nf4(w, 64, double_quant=True)
    assert (q.bits, q.group, q.scales.dtype) == (4, 64, torch.float32) and torch.equal(q.levels, NF4_LEVELS)
    assert torch.equal(q.mins, torch.zeros_like(q.mins))
    assert torch.equal(q.dequantize(), bnb_nf4_dequantized(w))  # bit for bit


def test_nf4_double_quant_all_zero_blocks_and_stacks():
    w = torch.randn(4, 128) * 0.1
    w[1] = 0.0
    q = quantizers.quantize_nf4(w, 64, double_quant=True)
    d = q.dequantize()
    # bitsandbytes' quirk, kept: 0 * (1 / 0) is nan, which its nearest-level search maps to code 0 (-1.0),
    # and the double-quantized absmax of 0 is not 0, so an all-zero block comes back as -scale
    assert torch.isfinite(d).all() and (q.unpacked_codes()[1] == 0).all()
    assert torch.equal(d, bnb_nf4_dequantized(w))
    experts = torch.randn(3, 8, 128)  # each expert its own tensor, as bitsandbytes quantizes them
    q = quantizers.quantize_nf4(experts, 64, double_quant=True)
    for e in range(3):
        assert torch.equal(q[e].dequantize(), bnb_nf4_dequantized(experts[e]))


def test_double_quantized_absmax_is_close_to_the_absmax():
    absmax = torch.rand(1000) * 0.1 + 0.01
    dq = double_quantize_absmax(absmax)
    # 8-bit dynamic codes of (absmax - mean): within 1 % of the largest, 1 % of each on average
    assert (dq - absmax).abs().max() < 0.01 * absmax.max() and ((dq - absmax).abs() / absmax).mean() < 0.01


def test_nf4_config_defaults_and_plain_absmax():
    c = QuantizationConfig.resolve("nf4")
    assert c.double_quant and c.group_size == 64
    w = torch.randn(6, 128)
    bits = lambda q: (q.nbytes - 16 * 4) * 8 / w.numel()  # noqa: E731  (the level table is per weight matrix)
    dq = c.quantize_weight(w)
    assert dq.scales.dtype == torch.float32 and bits(dq) == 5.0  # stored; QLoRA's own form is 4.127
    plain_nf4 = QuantizationConfig.resolve({"method": "nf4", "double_quant": False}).quantize_weight(w)
    assert plain_nf4.scales.dtype == torch.float16 and bits(plain_nf4) == 4.5


# ---------------------------------------------------------------------------------------------------------
# mixed precision: which layers
# ---------------------------------------------------------------------------------------------------------


def test_use_more_bits_is_llama_cpp_rule():
    # SmolLM2-135M (30 layers): llama.cpp's Q4_K_M file has 14 Q6_K down projections
    assert [i for i in range(30) if use_more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert sum(use_more_bits(i, 32) for i in range(32)) == 16  # a 7B Llama: half


def test_code_bits_follow_q4_k_m_allocation():
    """5 bits where Q4_K_M widens (V inside the fused QKV, dense and expert down projections of llama.cpp's
    layers) or falls back to Q5_0 (rows that are not whole 256-value super-blocks); 4 elsewhere."""
    weights = {}
    for i in range(8):
        weights |= {f"model.layers.{i}.self_attn.qkv_proj.weight": 512, f"model.layers.{i}.self_attn.o_proj.weight": 512,
                    f"model.layers.{i}.mlp.gate_up_proj.weight": 512, f"model.layers.{i}.mlp.down_proj.weight": 1536}
    weights["model.layers.3.block_sparse_moe.experts.down_proj"] = 768
    weights["model.embed_tokens.weight"] = 512  # an untied table that is only looked up
    bits = code_bits(weights)
    wide = {n for n, b in bits.items() if b == 5}
    chosen = (0, 3, 6, 7)  # 8 layers: 0, 7, then every 3rd
    want = {f"model.layers.{i}.{p}.weight" for i in chosen for p in ("mlp.down_proj", "self_attn.qkv_proj")}
    assert wide == want | {"model.layers.3.block_sparse_moe.experts.down_proj"}
    assert set(bits.values()) == {4, 5}
    # input sizes that K-quants cannot hold: Q4_K_M's Q5_0 fallback, whatever the layer
    assert code_bits({"model.layers.1.mlp.gate_up_proj.weight": 576, "model.layers.1.mlp.down_proj.weight": 1536,
                      "model.layers.9.mlp.down_proj.weight": 1536}) == {
        "model.layers.1.mlp.gate_up_proj.weight": 5, "model.layers.1.mlp.down_proj.weight": 4,
        "model.layers.9.mlp.down_proj.weight": 5}  # fmt: skip
    # V widened where its rows do not fit K-quants: Q4_K_M's Q8_0 fallback, 8-bit codes for the whole QKV;
    # a table only looked up: Q4_K_M's token_embd, 4-bit, whatever its width
    assert code_bits({"model.layers.0.self_attn.qkv_proj.weight": 576, "model.layers.4.self_attn.qkv_proj.weight": 576,
                      "model.layers.0.mlp.down_proj.weight": 1536, "model.layers.7.mlp.down_proj.weight": 1536,
                      "model.embed_tokens.weight": 576}, tables={"model.embed_tokens.weight"}) == {
        "model.layers.0.self_attn.qkv_proj.weight": 8, "model.layers.4.self_attn.qkv_proj.weight": 5,
        "model.layers.0.mlp.down_proj.weight": 5, "model.layers.7.mlp.down_proj.weight": 5,
        "model.embed_tokens.weight": 4}  # fmt: skip
    c = QuantizationConfig.resolve({"method": "int4", "mixed_precision": True})
    w = torch.randn(9, 96)
    q8 = c.quantize_weight(w, bits=8)  # Q8_0's form: centred codes, float16 absmax / 127 per 32
    assert (q8.bits, q8.group, q8.scales.dtype, q8.centred) == (8, 32, torch.float16, True)
    d = (w.reshape(9, 3, 32).abs().amax(-1) / 127).half().float()
    ref = torch.round(w.reshape(9, 3, 32) / d.unsqueeze(-1)).clamp(-127, 127) * d.unsqueeze(-1)
    assert torch.equal(q8.dequantize(), ref.reshape(9, 96))
    q = c.quantize_weight(torch.randn(9, 96), bits=5)
    assert (q.bits, q.group, q.scales.dtype, q.centred) == (5, 32, torch.float16, True)
    assert c.quantize_weight(torch.randn(9, 96), bits=4).bits == 4


@pytest.mark.parametrize("with_importance", [False, True])
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_int5_search_beats_the_absmax_rule_and_int4(n, k, group, with_importance):
    """5-bit centred codes (Q5_0's form) with a searched scale: never worse on the weighted objective than
    the absmax scale (Q5_0's rule, written here), and well below int4's searched error."""
    w = weights(n, k, seed=n + k)
    imp = importance(k, seed=k) if with_importance else None
    q = quantizers.quantize_int5_search(w, group, imp)
    assert (q.bits, q.centred) == (5, True) and q.codes.shape == (n, k * 5 // 8)
    g = w.reshape(n, k // group, group)
    idx = g.abs().argmax(-1, keepdim=True)
    d = (torch.gather(g, -1, idx).squeeze(-1) / -16).half().float()  # llama.cpp's Q5_0: max / -16
    u = torch.round(g / torch.where(d == 0, torch.ones_like(d), d).unsqueeze(-1)).add(16).clamp(0, 31)
    plain = ((u - 16) * d.unsqueeze(-1)).reshape(n, k)
    assert torch.equal(quantizers.quantize_symmetric_int5(w, group).dequantize(), plain)  # tables' one-pass rule

    class Plain:
        def dequantize(self):
            return plain

    ours, base = weighted_error(q, w, group, imp), weighted_error(Plain(), w, group, imp)
    assert ours.sum() <= base.sum() * (1 + 1e-6)
    four = weighted_error(quantizers.quantize_int4_search(w, group, imp), w, group, imp)
    assert ours[1:].sum() < 0.6 * four[1:].sum()  # (the outlier's group: a symmetric range spends half on nothing)


@pytest.mark.parametrize("with_importance", [False, True])
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_nf4_search_never_worse_than_the_absmax_rule(n, k, group, with_importance):
    w = weights(n, k, seed=n * k)
    imp = importance(k, seed=k) if with_importance else None
    q = quantizers.quantize_nf4_search(w, group, imp)
    assert q.scales.dtype == torch.float16 and torch.equal(q.levels, NF4_LEVELS)
    assert torch.equal(q.mins, torch.zeros_like(q.mins)) and torch.isfinite(q.scales).all()
    ours = weighted_error(q, w, group, imp)
    base = weighted_error(quantizers.quantize_nf4(w, group), w, group, imp)  # absmax in float16
    assert (ours <= base * (1 + 1e-6) + 1e-12).all()
    assert ours[1:].sum() < 0.95 * base[1:].sum()


def test_nf4_calibration_needs_the_plain_form():
    with pytest.raises(ValueError, match=r"calibration with nf4: its double-quantized form is QLoRA's fixed rule"):
        QuantizationConfig.resolve({"method": "nf4", "calibration": "default"})
    c = QuantizationConfig.resolve({"method": "nf4", "double_quant": False, "calibration": "default"})
    assert "float16 scales searched" in c.describe() and QuantizationConfig.resolve(c.as_dict()) == c
    zero = c.quantize_weight(torch.zeros(2, 64))
    assert torch.equal(zero.dequantize(), torch.zeros(2, 64))


def test_only_an_untied_embedding_table_counts_as_looked_up():
    """A table is narrowed with the projections only when nothing multiplies by it: an embedding untied
    from the LM head, never the head, nor a table a tied head shares."""
    from torch import nn

    from perfxlm.model.layers.embed_head import LMHead, VocabEmbedding
    from perfxlm.quant.loading import lookup_tables

    class Model(nn.Module):
        def __init__(self, tied: bool) -> None:
            super().__init__()
            self.embed_tokens = VocabEmbedding(37, 64)
            self.lm_head = LMHead(37, 64, tied_to=self.embed_tokens if tied else None)

    untied, tied = Model(False), Model(True)
    assert lookup_tables(untied) == {id(untied.embed_tokens.weight)}
    assert lookup_tables(tied) == set()


def _int5_table_search(w: torch.Tensor, group: int, imp: torch.Tensor | None) -> torch.Tensor:
    """The 5-bit codes' scale searched through the generic level-table search (the earlier rule)."""
    levels = (torch.arange(32, dtype=torch.float32) - 16) / 16
    layout = None if imp is None else imp.reshape(-1, group)
    u, s = search.search_levels(w.reshape(-1, group), levels, layout)
    return (s.float().unsqueeze(-1) * levels[u.long()]).reshape(w.shape)


@pytest.mark.parametrize("with_importance", [False, True])
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_centred_search_near_the_best_scale(n, k, group, with_importance):
    """5-bit centred codes: the searched scale's weighted error is within 1 % in total (7 % per group) of
    the best of 2001 scales, each with its nearest codes and rounded to float16 as stored (8 % with heavily
    skewed activation weights), and no worse in total than the level-table search it replaces."""
    w = weights(n, k, seed=3 * n + k)
    imp = importance(k, seed=k + 1) if with_importance else None
    q = quantizers.quantize_int5_search(w, group, imp)
    ours = weighted_error(q, w, group, imp)
    g = w.reshape(-1, group)
    layout = None if imp is None else imp.reshape(-1, group).repeat(n, 1)
    wt = search.element_weights(g, layout)
    extreme = torch.gather(g, -1, g.abs().argmax(-1, keepdim=True))
    best = torch.full((g.shape[0],), float("inf"))
    for f in torch.linspace(-1.2, 1.2, 2001):
        d = (extreme * f / 16).half().float()
        d = torch.where(d == 0, torch.full_like(d, 1e-8), d)
        v = d * torch.round(g / d).clamp(-16, 15)
        best = torch.minimum(best, (wt * (v - g).square()).sum(-1))
    if imp is None:
        assert bool((ours <= best * 1.07 + 1e-12).all()) and ours.sum() <= best.sum() * 1.01
    else:  # (weights skewed as x^4: a few groups stop at a local optimum)
        assert ours.sum() <= best.sum() * 1.08

    class Table:
        def dequantize(self):
            return _int5_table_search(w, group, imp)

    assert ours.sum() <= weighted_error(Table(), w, group, imp).sum() * (1 + 1e-6)


def test_centred_search_zero_and_constant_groups():
    """An all-zero group stays exactly zero (scale 0), a constant one is exact."""
    w = torch.zeros(3, 64)
    w[1, 32:] = 0.25
    q, d = search.search_centred(w.reshape(-1, 32), 5)
    assert torch.equal((d.float().unsqueeze(-1) * q).reshape(3, 64), w)
    with pytest.raises(ValueError, match="float16"):
        search.search_centred(torch.full((1, 32), 1e7), 5)


def test_int4_allocation_within_q4_k_m_bits_on_the_default_models_shapes():
    """SmolLM2-135M's shapes (30 layers, 576 wide, 1536 FFN, untied 49152-row embedding, as the rotated
    model has it): int4's allocation, each weight's bits taken from the form the engine stores, stays at
    or below the bits llama.cpp's Q4_K_M file of that model has (6.044: Q5_0, Q8_0, Q4_K, Q6_K)."""
    hidden, ffn, vocab, layers = 576, 1536, 49152, 30
    shapes = {}
    for i in range(layers):
        shapes |= {f"model.layers.{i}.self_attn.qkv_proj.weight": (960, hidden),
                   f"model.layers.{i}.self_attn.o_proj.weight": (hidden, hidden),
                   f"model.layers.{i}.mlp.gate_up_proj.weight": (2 * ffn, hidden),
                   f"model.layers.{i}.mlp.down_proj.weight": (hidden, ffn)}  # fmt: skip
    shapes["model.embed_tokens.weight"] = (vocab, hidden)
    bits = code_bits({n: k for n, (_, k) in shapes.items()}, tables={"model.embed_tokens.weight"})
    c = QuantizationConfig.resolve("int4")
    per_weight = {}  # stored bits per weight of each (code width, input size), from a few rows

    def stored(b: int, k: int) -> float:
        if (b, k) not in per_weight:
            q = c.quantize_weight(torch.randn(4, k), bits=b)
            per_weight[(b, k)] = 8 * q.nbytes / (4 * k)
        return per_weight[(b, k)]

    total = sum(n * k * stored(bits[name], k) for name, (n, k) in shapes.items())
    head = c.quantize_table(torch.randn(4, hidden))
    total += vocab * hidden * 8 * head.nbytes / (4 * hidden)
    weights = sum(n * k for n, k in shapes.values()) + vocab * hidden
    # Q4_K_M: V and down widened in use_more_bits layers (V: Q8_0 at 576 inputs; down: Q6_K), Q5_0 for
    # every other 576-wide weight and the embedding, Q4_K for the other down projections, Q8_0 head
    wide = sum(use_more_bits(i, layers) for i in range(layers))
    v, qk = 192 * hidden, 768 * hidden
    q4km = (layers * (qk + hidden * hidden + 2 * ffn * hidden) * 5.5 + wide * v * 8.5
            + (layers - wide) * v * 5.5 + wide * hidden * ffn * 6.5625 + (layers - wide) * hidden * ffn * 4.5
            + vocab * hidden * (5.5 + 8.5))  # fmt: skip
    assert round(q4km / weights, 3) == 6.044  # the file's own count (its tensors' bytes)
    assert bits["model.layers.0.self_attn.qkv_proj.weight"] == 8 and bits["model.embed_tokens.weight"] == 4
    assert total / weights <= q4km / weights
    # the 4-bit down projections, which read 1536 = 6 x 256 inputs, take Q4_K's two-level form by default
    # (4.625) and the 576-wide ones float16 scales and mins (5); `super_blocks: false` keeps 5 for both
    assert stored(4, ffn) == 4.625 and stored(4, hidden) == 5.0
    flat16 = QuantizationConfig.resolve({"method": "int4", "super_blocks": False})
    for k in (ffn, hidden):
        assert 8 * flat16.quantize_weight(torch.randn(4, k), bits=4).nbytes / (4 * k) == 5.0
