"""int4's super-block form (perfxlm.quant.two_level): searched scales and mins held as bytes x float16 per
256 on rows of whole super-blocks. Checked against a plain transcription of the form (values = code x
byte x factor - byte x factor), against int4's float16 form on the search's own objective, through the
native products, the cuts and fusions the engine makes, the configuration's options and errors, and an
engine whose greedy text equals its dequantized twin's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from perfxlm.quant.reference import fake_quantize_blocks
from perfxlm.quant import act_blocks, joining
from perfxlm import LLM
from perfxlm.ops import cpu_plan, native
from perfxlm.ops.linear import gemm_max_code, gemm_takes, run_linear_q
from perfxlm.quant import QuantizationConfig, QuantizedWeight, quantizers, super_scales, two_level
from perfxlm.quant.weight import ActivationMode, unpack_nibbles
from tests.quant.test_quant_engine import assert_same_greedy, dequantized_twin, generate, model_of, quantized_weights
from tests.quant.test_quant_search import importance, weighted_error, weights


def plain_values(q: QuantizedWeight) -> torch.Tensor:
    """The form written out by hand: row bytes [G sub-scales | S float16 factors], value = u x sc x d -
    mn x dmin, each product of a byte and its factor formed in float32 first."""
    n, k, group = q.out_features, q.in_features, q.group
    groups, supers = k // group, k // 256
    per = groups // supers

    def expand(t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(-1, groups + 2 * supers)
        factors = t[:, groups:].contiguous().view(torch.float16).float()
        return t[:, :groups].float() * factors.repeat_interleave(per, dim=1)

    u = unpack_nibbles(q.codes.reshape(-1, k // 2)).float().view(-1, groups, group)
    out = u * expand(q.scales).unsqueeze(-1) - expand(q.mins).unsqueeze(-1)
    return out.reshape(*q.shape)


@pytest.mark.parametrize("with_importance", [False, True])
@pytest.mark.parametrize("n,k,group", [(7, 256, 32), (5, 768, 32), (3, 512, 64), (9, 1280, 128)])
def test_round_trip_near_the_float16_form_and_below_the_plain_rule(n, k, group, with_importance):
    w = weights(n, k, seed=n * k)
    w[1, 40:72] = w[1, 40:72].abs() + 0.2  # an all-positive group: its min clipped to 0
    w[2, :group] = 0.0  # an all-zero group
    imp = importance(k, seed=k) if with_importance else None
    q = two_level.quantize_int4(w, group, imp)
    assert q.two_level and (q.bits, q.group, q.centred) == (4, group, False)
    assert q.scales.dtype == q.mins.dtype == torch.uint8
    assert tuple(q.scales.shape) == tuple(q.mins.shape) == (n, super_scales.row_bytes(k, group))
    assert torch.equal(q.dequantize(), plain_values(q))  # the stored form means what it says
    assert (q.dequantize()[2, :group] == 0).all()
    assert 8 * q.nbytes / (n * k) == 4 + 2 * (8 / group + 16 / 256)  # 4.625 bits per weight at group 32
    ours = weighted_error(q, w, group, imp)
    flat = weighted_error(quantizers.quantize_int4_search(w, group, imp), w, group, imp)
    rule = weighted_error(quantizers.quantize_asymmetric_int4(w, group), w, group, imp)
    # bytes cost at most half a 255th of a super-block's largest scale: the float16 form's error, give or
    # take a little, and well below Q4_1's plain rule over the whole weight
    assert ours.sum() <= flat.sum() * 1.05 + 1e-9
    assert ours.sum() < rule.sum()


def test_stacks_and_odd_widths():
    """An expert stack keeps its leading dimension; widths that are not whole super-blocks keep the float16
    form through the configuration (and the quantizer itself refuses them by name)."""
    c = QuantizationConfig.resolve({"method": "int4", "calibration": False, "super_blocks": True})
    experts = torch.randn(3, 5, 512, generator=torch.Generator().manual_seed(0)) * 0.05
    stack = c.quantize_weight(experts)
    assert stack.two_level and stack.num_experts == 3 and tuple(stack.scales.shape) == (3, 5, 20)
    for e in range(3):  # each expert's rows as that expert alone would have them
        assert torch.equal(stack[e].dequantize(), c.quantize_weight(experts[e]).dequantize())
    for k in (96, 288, 800):  # 3 / 9 / 25 groups of 32: no whole super-blocks
        q = c.quantize_weight(torch.randn(7, k) * 0.05)
        assert not q.two_level and q.scales.dtype == torch.float16
    c = QuantizationConfig.resolve({"method": "int4", "group_size": 512, "super_blocks": True})
    q = c.quantize_weight(torch.randn(3, 1024))
    assert not q.two_level  # a group wider than a super-block
    with pytest.raises(ValueError, match="multiple of 256"):
        two_level.quantize_int4(torch.randn(4, 288), 32)
    with pytest.raises(ValueError, match="importance"):
        two_level.quantize_int4(torch.randn(4, 256), 32, torch.ones(128))


def test_a_factor_beyond_float16_keeps_the_float_form():
    w = torch.randn(2, 256)
    w[0, :32] *= 1e9
    assert two_level.quantize_int4(w, 32) is None
    q = QuantizationConfig.resolve({"method": "int4", "calibration": False, "super_blocks": True}).quantize_weight(w)
    assert not q.two_level and q.scales.dtype == torch.float32


def _block_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 block kernels see it (perfxlm.quant.act_blocks' arithmetic, ggml's by default)."""
    return fake_quantize_blocks(x.float().contiguous(), kquant=True)


def _in_flat_rounding(call):
    """call() where the two-level form and its float form round activations alike: under ggml's rule the
    two-level bytes take q8_K (a scale per 256) and the float form blocks of 32, so both run as fine."""
    with act_blocks.using("fine" if act_blocks.mode() == "ggml" else act_blocks.mode()):
        return call()


def test_native_products_match_the_reference_and_the_flat_form():
    """Sub-scales past Q4_K's 63 through every kernel path of this tier (test_portable_kernels runs it on
    the others): GEMV, int8 block products, the slab GEMM and the int8 GEMM, each the bits of the weight
    with its scales multiplied out, within float tolerance of the plain product."""
    ops = native.kernels()
    if ops is None:
        pytest.skip("no compiler for the native kernels")
    n, k = 37, 768
    q = two_level.quantize_int4(weights(n, k, seed=3), 32, importance(k, seed=3))
    assert int(q.scales[:, : k // 32].max()) > 63 and int(q.mins[:, : k // 32].max()) > 63
    flat = q.flat()
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(4))
    for blocks in (False, True):
        x_used = _block_rounded(x) if blocks and ops.int8_block_dots() else x
        ref = F.linear(x_used.double(), q.dequantize().double()).float()
        for max_rows in (40, 3, 0):  # GEMV / block kernels, then the slab GEMM past max_rows
            out = ops.linear_q(x, q.codes, q.scales, q.mins, None, None, False, max_rows, False, blocks, -1)
            same = _in_flat_rounding(
                lambda: ops.linear_q(x, flat.codes, flat.scales, flat.mins, None, None, False, max_rows, False, blocks, -1))
            assert torch.equal(_in_flat_rounding(
                lambda: ops.linear_q(x, q.codes, q.scales, q.mins, None, None, False, max_rows, False, blocks, -1)), same)
            torch.testing.assert_close(out, ref, atol=1e-4 * (ref.abs().max().item() + 1), rtol=1e-4)
    if gemm_max_code() < 15:
        return  # this tier's build has no int8 GEMM for 4-bit codes (test_quant_gemm checks the refusal)
    q.activations = ActivationMode.INT8_NATIVE
    assert gemm_takes(q)
    many = torch.randn(150, k, generator=torch.Generator().manual_seed(5))  # past every GEMV limit
    previous = cpu_plan.use(quant_gemm="int8", quant_max_rows=32, quant_block_max_rows=128)
    try:
        fast = run_linear_q(ops, many, q, None, False, True, False)
    finally:
        cpu_plan.use(previous)
    assert torch.equal(fast, ops.quant_block_gemm(many, q.codes, q.scales, q.mins, None, None))
    assert torch.equal(_in_flat_rounding(lambda: ops.quant_block_gemm(many, q.codes, q.scales, q.mins, None, None)),
                       _in_flat_rounding(lambda: ops.quant_block_gemm(many, flat.codes, flat.scales, flat.mins, None, None)))
    ref = F.linear(_block_rounded(many).double(), q.dequantize().double()).float()
    torch.testing.assert_close(fast, ref, atol=1e-4 * (ref.abs().max().item() + 1), rtol=1e-4)


@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_every_group_through_the_block_kernels_alone_and_in_a_batch(group):
    """The block kernels form each group's scale and min from the bytes (groups of 32 as 8 per super-block,
    wider ones one per chunk; 24 / 12 / 6 / 3 groups per row: the mins' whole, masked and one-by-one
    steps): the flat form's bits for 1-70 rows, a row alone the bits it has in a batch, near the plain
    product. Odd rows (a tail past the four-row tiles)."""
    ops = native.kernels()
    if ops is None:
        pytest.skip("no compiler for the native kernels")
    n, k = 39, 768
    q = two_level.quantize_int4(weights(n, k, seed=group), group, importance(k, seed=group))
    flat = q.flat()
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(group)) * 2
    x[3, 64:96] = 0.0  # an all-zero activation block
    b = torch.randn(n, generator=torch.Generator().manual_seed(7))
    blocks = ops.int8_block_dots()
    ref = F.linear((_block_rounded(x) if blocks else x).double(), q.dequantize().double(), b.double()).float()
    together = ops.linear_q(x, q.codes, q.scales, q.mins, None, b, False, 70, False, True, 70)
    assert torch.equal(
        _in_flat_rounding(lambda: ops.linear_q(x, q.codes, q.scales, q.mins, None, b, False, 70, False, True, 70)),
        _in_flat_rounding(lambda: ops.linear_q(x, flat.codes, flat.scales, flat.mins, None, b, False, 70, False, True, 70)))
    torch.testing.assert_close(together, ref, atol=1e-4 * (ref.abs().max().item() + 1), rtol=1e-4)
    for rows in (1, 2, 3, 4, 5, 17, 69):
        part = ops.linear_q(x[:rows], q.codes, q.scales, q.mins, None, b, False, 70, False, True, 70)
        assert torch.equal(part, together[:rows])
    one = ops.linear_q(x[5:6], q.codes, q.scales, q.mins, None, b, False, 70, False, True, 70)
    assert torch.equal(one, together[5:6])  # a later row alone, not only the batch's first


def test_cuts_and_fusions_keep_the_values():
    a = two_level.quantize_int4(weights(6, 512, seed=1), 32)
    b = two_level.quantize_int4(weights(4, 512, seed=2), 32)
    fused = joining.cat_rows([a, b])
    assert fused.two_level and torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    half = a.narrow_columns(256, 256)  # a tensor-parallel rank's share: whole super-blocks
    assert half.two_level and torch.equal(half.dequantize(), a.dequantize()[:, 256:])
    odd = a.narrow_columns(32, 64)  # a finer cut takes the float scales
    assert not odd.two_level and torch.equal(odd.dequantize(), a.dequantize()[:, 32:96])
    five = a.widened(5)
    assert torch.equal(five.dequantize(), a.dequantize())


def test_options_and_errors():
    c = QuantizationConfig.resolve("int4")  # on by default: the kernels form its scales in their loops
    assert c.super_blocks and "per 256" in c.describe()
    assert QuantizationConfig.resolve(c.as_dict()) == c == QuantizationConfig.resolve({"method": "int4", "super_blocks": True})
    assert c.quantize_weight(torch.randn(3, 256), bits=4).two_level
    off = QuantizationConfig.resolve({"method": "int4", "super_blocks": False})
    assert not off.super_blocks and QuantizationConfig.resolve(off.as_dict()) == off
    assert not off.quantize_weight(torch.randn(3, 256), bits=4).two_level
    assert not QuantizationConfig.resolve({"method": "int4", "symmetric": True}).super_blocks
    for bad, match in [({"method": "int8", "super_blocks": True}, "asymmetric int4 only"),
                       ({"method": "int4", "symmetric": True, "super_blocks": True}, "symmetric"),
                       ({"method": "int4", "super_blocks": "yes"}, "true or false")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            QuantizationConfig.resolve(bad)


@pytest.fixture(scope="module")
def llama256(tmp_path_factory) -> str:
    from tests.conftest import make_llama_checkpoint

    path = str(tmp_path_factory.mktemp("llama256"))  # FFN 512: down projections read whole super-blocks
    return make_llama_checkpoint(path, hidden_size=160, intermediate_size=512, num_attention_heads=5,
                                 num_key_value_heads=1, num_hidden_layers=3)  # fmt: skip


def test_engine_greedy_equals_the_dequantized_twin(llama256, monkeypatch):
    monkeypatch.setenv("PERFXLM_QUANT_ACTIVATIONS", "float32")  # weight-only products: exact to summation order
    llm = LLM(llama256, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64,
              quantization={"method": "int4", "calibration": False, "super_blocks": True})  # fmt: skip
    ws = quantized_weights(model_of(llm))
    downs = {n: w for n, w in ws.items() if "down_proj" in n}
    # mixed precision widens layer 2's (use_more_bits) to 5 bits; the others are two-level 4-bit
    assert sum(w.two_level and w.bits == 4 for w in downs.values()) == 2
    assert not any(w.two_level for n, w in ws.items() if "down_proj" not in n)  # 160 inputs: float16
    assert_same_greedy(generate(llm), generate(dequantized_twin(llm, llama256)))
