"""W8A8 with per-token activations over many rows runs torch's integer GEMM (perfxlm/ops/int8_gemm.py):
the definition's bits at any row count past the GEMV's, the GEMV's results to float rounding below it, and
only for the weights it can take."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from perfxlm.model.layers.linear import Linear
from perfxlm.model.layers.linear_methods.base import LinearPlan
from perfxlm.model.layers.linear_methods.quantized import INT_GEMM_MIN_ROWS
from perfxlm.ops import cpu_plan
from perfxlm.ops.int8_gemm import gemm_weight
from perfxlm.quant import quantizers
from perfxlm.quant.loading import install
from perfxlm.quant.reference import reference_linear

F32 = torch.float32


def _layer(act: str, k: int = 97, n: int = 53, group: int | None = None, seed: int = 3) -> Linear:
    g = torch.Generator().manual_seed(seed)
    layer = Linear(k, n, bias=True)
    install(layer, "weight", quantizers.quantize_symmetric_int8(torch.randn(n, k, generator=g), group or k, act=act))
    layer.bias.data.copy_(torch.randn(n, generator=g))
    layer.bind_linear_method(LinearPlan(F32, F32, quantized_format="w8a8"))
    return layer


# the first row count the integer GEMM takes (past the GEMV, and never under INT_GEMM_MIN_ROWS + 1)
@pytest.mark.parametrize("rows", [max(cpu_plan.plan().quant_max_rows, INT_GEMM_MIN_ROWS) + 1, 37, 301])
def test_many_rows_equal_the_definition_bit_for_bit(rows):
    layer = _layer("int8")
    assert layer.method.int_gemm is not None
    x = torch.randn(rows, 97, generator=torch.Generator().manual_seed(rows)) * 3
    x[1] = 0.0  # an all-zero row: scale 0, output = bias
    want = reference_linear(x, layer.weight, layer.bias)
    got = layer(x)
    assert torch.equal(got, want)
    assert torch.equal(got[1], layer.bias.data)


def test_a_row_alone_and_in_a_batch_agree():
    layer = _layer("int8")
    x = torch.randn(64, 97, generator=torch.Generator().manual_seed(1))
    batched = layer(x)
    for i in (0, 17, 63):
        torch.testing.assert_close(layer(x[i : i + 1])[0], batched[i], rtol=1e-5, atol=1e-5)


def test_only_per_token_per_channel_symmetric_weights_take_it():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=g)
    assert gemm_weight(quantizers.quantize_symmetric_int8(w, 64, act="int8")) is not None
    assert gemm_weight(quantizers.quantize_symmetric_int8(w, 32, act="int8")) is None  # two scales per row
    assert gemm_weight(quantizers.quantize_symmetric_int8(w, 64, act="int8_block")) is None  # block activations
    assert gemm_weight(quantizers.quantize_symmetric_int8(w, 64)) is None  # weight-only
    assert gemm_weight(w) is None
    assert _layer("int8_block", k=96, group=96).method.int_gemm is None


def test_an_encoder_embeds_through_it_as_without_it(tmp_path, monkeypatch):
    """The pooling runner's whole batch goes through the integer GEMM and embeds as the same model whose
    products take the GEMV / float-slab path; both stay near float32 sentence-transformers (a tiny random
    model amplifies int8 rounding far more than a trained one: README's figures are a real model's)."""
    from sentence_transformers import SentenceTransformer

    import perfxlm.model.layers.linear_methods.quantized as quantized
    from perfxlm import LLM
    from tests.pooling.checkpoints import make_encoder

    folder = make_encoder(str(tmp_path / "bge"), hidden_size=96, layers=2, heads=3, intermediate=100)
    texts = ["what is the capital of france?", "the cat sat on the mat", "berlin is the capital of germany " * 5]
    ref = SentenceTransformer(folder, device="cpu").encode(texts, convert_to_numpy=True)
    quant = {"method": "w8a8", "activation_group_size": -1}

    def embed() -> tuple[np.ndarray, list[Linear]]:
        llm = LLM(folder, dtype="float32", quantization=quant)
        linears = [m for m in llm.llm_engine.model.modules() if isinstance(m, Linear)]
        return np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]), linears

    fast, linears = embed()
    assert linears and all(m.method.int_gemm is not None for m in linears)
    monkeypatch.setattr(quantized, "gemm_weight", lambda w: None)
    slow, linears = embed()
    assert all(m.method.int_gemm is None for m in linears)
    np.testing.assert_allclose(fast, slow, rtol=0, atol=2e-5)
    cos = (fast * ref).sum(1) / np.linalg.norm(fast, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 0.9, cos


def test_w8a8_means_per_token_on_the_pooling_runner_and_blocks_on_the_generate_runner():
    from perfxlm.quant.config import QuantizationConfig, resolve_activations
    from perfxlm.quant.weight import ActivationMode

    plain = QuantizationConfig.resolve("w8a8")
    assert plain.activation_group_size == 32 and plain.for_runner("generate") is plain
    pooled = plain.for_runner("pooling")
    assert pooled.per_token_activations and "one scale per token" in pooled.describe()
    blocks = QuantizationConfig.resolve({"method": "w8a8", "activation_group_size": 32})
    assert blocks.for_runner("pooling").activation_group_size == 32  # the user's choice stands
    assert QuantizationConfig.resolve("int8").for_runner("pooling").activation_group_size == 32  # w8a8 only
    # the per-token layers round rows themselves: the 8-bit table and head are weight-only under auto
    assert resolve_activations("auto", "w8a8", F32, per_token=True) is ActivationMode.FLOAT
    assert resolve_activations("auto", "w8a8", torch.bfloat16, per_token=True) is ActivationMode.FLOAT
    assert resolve_activations("int8", "w8a8", F32, per_token=True) is ActivationMode.INT8
    assert resolve_activations("auto", "w8a8", F32) is ActivationMode.INT8
    with pytest.raises(ValueError, match="quantizes activations to int8 by definition"):
        resolve_activations("float32", "w8a8", F32, per_token=True)


def test_w8a8_encoder_whose_hidden_size_is_not_a_multiple_of_32(tmp_path):
    """hidden 36: blocks of 32 fit none of its products, per-token scales fit all; the plain name and the
    dict spelling load the same per-token model (integer GEMM on every layer), and blocks asked for
    explicitly are refused naming what fits."""
    from perfxlm import LLM
    from tests.pooling.checkpoints import make_encoder

    folder = make_encoder(str(tmp_path / "odd"), hidden_size=36, layers=2, heads=3, intermediate=52)
    texts = ["a short one", "the quick brown fox jumps over the lazy dog " * 2]
    outs = []
    for quant in ("w8a8", {"method": "w8a8", "activation_group_size": -1}):
        llm = LLM(folder, dtype="float32", quantization=quant)
        linears = [m for m in llm.llm_engine.model.modules() if isinstance(m, Linear)]
        assert linears and all(m.method.int_gemm is not None for m in linears)
        outs.append(np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]))
    np.testing.assert_array_equal(outs[0], outs[1])
    assert np.isfinite(outs[0]).all() and abs(np.linalg.norm(outs[0][1]) - 1) < 1e-5
    with pytest.raises(ValueError, match="activation_group_size=-1"):
        LLM(folder, dtype="float32", quantization={"method": "w8a8", "activation_group_size": 32})


@pytest.mark.parametrize("rows", [3, 301])
def test_forward_add_equals_the_product_then_the_sum(rows):
    # the post-norm blocks' dense + residual: in the epilogue's pass past the GEMV's rows, after it below
    layer = _layer("int8")
    g = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 97, generator=g), torch.randn(rows, 53, generator=g)
    assert torch.equal(layer.forward_add(x, residual), layer(x) + residual)
    float_layer = Linear(97, 53, bias=True)
    float_layer.weight.data.normal_(generator=g)
    float_layer.bias.data.normal_(generator=g)
    float_layer.bind_linear_method(LinearPlan(F32, F32))
    assert torch.equal(float_layer.forward_add(x, residual), float_layer(x) + residual)


@pytest.mark.parametrize("rows", [3, 301])
def test_forward_act_is_the_product_then_the_activation(rows):
    # an encoder's up projection: GELU in the epilogue's pass past the GEMV's rows (within erf's
    # approximation of the exact GELU, tests/unit/test_int8_rows.py), the product then F.gelu below them;
    # an activation the epilogue lacks, and a float weight, take the product then the activation
    from perfxlm.model.layers.activation import get_activation

    layer = _layer("int8")
    x = torch.randn(rows, 97, generator=torch.Generator().manual_seed(rows)) * 2
    pre = layer(x)
    got = layer.forward_act(x, "gelu")
    exact = torch.nn.functional.gelu(pre.double())
    assert bool(((got.double() - exact).abs() <= 1e-7 + 1.2e-7 * pre.double().abs()).all())
    if rows == 3:
        assert torch.equal(got, torch.nn.functional.gelu(pre))
    assert torch.equal(layer.forward_act(x, "gelu_new"), get_activation("gelu_new")(pre))
    float_layer = Linear(97, 53, bias=True)
    float_layer.weight.data.normal_(generator=torch.Generator().manual_seed(9))
    float_layer.bias.data.zero_()
    float_layer.bind_linear_method(LinearPlan(F32, F32))
    assert torch.equal(float_layer.forward_act(x, "gelu"), torch.nn.functional.gelu(float_layer(x)))
    with pytest.raises(ValueError, match="activation 'swiglu' is not supported"):
        float_layer.forward_act(x, "swiglu")
