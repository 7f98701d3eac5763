"""`quant_activations`: what products with quantized weights do to the activations, decided once per model.

The policy per format and option (resolve_activations), the mode each loaded weight carries, products
under each mode against their references (float activations for weight-only int8, int8 blocks rounded
in torch where the kernel cannot), the fused decode layer's flag, the CLI flag and the errors."""

from __future__ import annotations

import argparse

import gguf
import pytest
import torch
import torch.nn.functional as F

from perfxlm import LLM
from perfxlm.config import EngineConfig
from perfxlm.entrypoints.cli import add_engine_args, engine_kwargs
from perfxlm.model import fused_decode
from perfxlm.ops import linear as linear_ops
from perfxlm.ops import native
from perfxlm.quant import ActivationMode, QuantizedWeight, quantizers, resolve_activations
from perfxlm.quant.reference import fake_quantize_blocks, reference_linear
from tests.conftest import make_llama_checkpoint
from tests.quant.test_quant_engine import model_of, quantized_weights, write_quantized_llama_gguf

FLOAT, NATIVE, INT8 = ActivationMode.FLOAT, ActivationMode.INT8_NATIVE, ActivationMode.INT8
BF16, FP32 = torch.bfloat16, torch.float32
needs_native = pytest.mark.skipif(not hasattr(native.kernels() or object(), "linear_q"), reason="no native kernels")


@pytest.fixture(autouse=True)
def _no_environment_default(monkeypatch):
    monkeypatch.delenv("PERFXLM_QUANT_ACTIVATIONS", raising=False)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llama128(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("llama128"))
    return make_llama_checkpoint(path, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                 num_key_value_heads=2, num_hidden_layers=2)  # fmt: skip


@pytest.fixture(scope="module")
def llama_gguf(llama128, tmp_path_factory) -> str:
    """The same checkpoint as a GGUF file with Q4_0 / Q8_0 matrices."""
    Q = gguf.GGMLQuantizationType
    path = str(tmp_path_factory.mktemp("gguf") / "llama.gguf")
    types = {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_0,
             "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0}  # fmt: skip
    write_quantized_llama_gguf(path, llama128, types)
    return path


# ---------------------------------------------------------------------------------------------------------
# The policy
# ---------------------------------------------------------------------------------------------------------

AUTO_BF16 = {"gguf": NATIVE, "int4": NATIVE, "int8": FLOAT, "nf4": FLOAT, "w8a8": INT8, None: FLOAT}


@pytest.mark.parametrize("int8_dots", [True, False])
@pytest.mark.parametrize("source", list(AUTO_BF16))
def test_auto_policy_per_format_is_the_same_on_every_tier(monkeypatch, source, int8_dots):
    """auto: GGUF and int4 round to int8 blocks where the build can (decided by the kernel at run time),
    int8 and nf4 keep float32 activations, w8a8 always rounds; a float32 model keeps float32 (w8a8 aside).
    The decision does not look at the CPU: int8 is weight-only on every tier."""
    monkeypatch.setattr("perfxlm.ops.cpu_plan.has_int8_dots", lambda: int8_dots)
    assert resolve_activations("auto", source, BF16) is AUTO_BF16[source]
    assert resolve_activations("auto", source, FP32) is (INT8 if source == "w8a8" else FLOAT)


@pytest.mark.parametrize("source", ["gguf", "int4", "int8", "nf4", "w8a8"])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_explicit_option_applies_to_every_format(source, dtype):
    assert resolve_activations("int8", source, dtype) is INT8
    assert resolve_activations(" INT8 ", source, dtype) is INT8
    if source == "w8a8":
        with pytest.raises(ValueError, match=r"'float32' with quantization='w8a8'.*use quantization='int8'"):
            resolve_activations("float32", source, dtype)
    else:
        assert resolve_activations("float32", source, dtype) is FLOAT


def test_no_quantized_weights_and_bad_values():
    assert resolve_activations("auto", None, BF16) is FLOAT
    assert resolve_activations("float32", None, BF16) is FLOAT
    with pytest.raises(ValueError, match=r"'int8' applies to quantized weights and this model has none"):
        resolve_activations("int8", None, FP32)
    for bad in ("int4", "fp8", "", None, 8):
        with pytest.raises(ValueError, match=r"quant_activations=.* supported: auto, int8, float32"):
            resolve_activations(bad, "int8", BF16)
    with pytest.raises(ValueError, match=r"quant_activations='bf16' is not supported; supported: auto, int8"):
        EngineConfig(quant_activations="bf16")  # at construction, before any model is read


def test_environment_stands_in_for_auto(monkeypatch):
    monkeypatch.setenv("PERFXLM_QUANT_ACTIVATIONS", "int8")
    assert resolve_activations("auto", "int8", FP32) is INT8
    assert resolve_activations("float32", "int8", BF16) is FLOAT  # an explicit option wins
    assert resolve_activations("auto", None, BF16) is FLOAT  # nothing to apply to: no error from the knob
    monkeypatch.setenv("PERFXLM_QUANT_ACTIVATIONS", "float32")
    assert resolve_activations("auto", "gguf", BF16) is FLOAT
    assert resolve_activations("auto", "w8a8", BF16) is INT8  # w8a8 keeps its int8 activations
    monkeypatch.setenv("PERFXLM_QUANT_ACTIVATIONS", "int16")
    with pytest.raises(ValueError, match=r"PERFXLM_QUANT_ACTIVATIONS='int16'.*supported: auto, int8, float32"):
        resolve_activations("auto", "int8", BF16)


def test_cli_flag_reaches_the_engine_arguments():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["m"]))["quant_activations"] == "auto"
    for value in ("auto", "int8", "float32"):
        assert engine_kwargs(parser.parse_args(["m", "--quant-activations", value]))["quant_activations"] == value
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--quant-activations", "int4"])


# ---------------------------------------------------------------------------------------------------------
# What the engine puts on each weight
# ---------------------------------------------------------------------------------------------------------


def _modes(llm) -> set[ActivationMode]:
    return {w.activations for w in quantized_weights(model_of(llm)).values()}


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, skip_tokenizer_init=True, num_kv_blocks=16, **kwargs)


@pytest.mark.parametrize(
    "quantization, dtype, option, want",
    [
        ("int8", "bfloat16", "auto", FLOAT),
        ("nf4", "bfloat16", "auto", FLOAT),
        ("int4", "bfloat16", "auto", NATIVE),
        ("w8a8", "bfloat16", "auto", INT8),
        ("int4", "float32", "auto", FLOAT),
        ("int8", "float32", "int8", INT8),
        ("int4", "bfloat16", "float32", FLOAT),
        ("nf4", "float32", "int8", INT8),
    ],
)
def test_each_weight_carries_the_resolved_mode(llama128, quantization, dtype, option, want):
    llm = _llm(llama128, quantization=quantization, dtype=dtype, quant_activations=option)
    assert llm.llm_engine.config.quant_activation_mode is want
    assert _modes(llm) == {want}


def test_gguf_tensors_follow_the_option(llama_gguf):
    assert _modes(_llm(llama_gguf, dtype="bfloat16")) == {NATIVE}  # llama.cpp's scheme, as before
    assert _modes(_llm(llama_gguf, dtype="float32")) == {FLOAT}
    assert _modes(_llm(llama_gguf, dtype="float32", quant_activations="int8")) == {INT8}
    assert _modes(_llm(llama_gguf, dtype="bfloat16", quant_activations="float32")) == {FLOAT}


def test_w8a8_per_token_keeps_its_own_rounding(llama128):
    llm = _llm(llama128, dtype="bfloat16", quantization={"method": "w8a8", "activation_group_size": -1},
               quant_activations="int8")  # fmt: skip
    # rows quantized per token by the format: no blocks on top (the 8-bit tables are weight-only: blocks)
    weights = quantized_weights(model_of(llm))
    assert {w.activations for n, w in weights.items() if "embed" not in n and "lm_head" not in n} == {FLOAT}


def test_errors_before_any_weight_is_read(llama128, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr("perfxlm.model.loader.hf.iter_safetensors_weights", refuse)
    with pytest.raises(ValueError, match=r"'float32' with quantization='w8a8'"):
        _llm(llama128, quantization="w8a8", quant_activations="float32")
    with pytest.raises(ValueError, match=r"'int8' applies to quantized weights and this model has none"):
        _llm(llama128, quant_activations="int8")
    narrow = make_llama_checkpoint(str(tmp_path / "k48"), hidden_size=48, intermediate_size=96,
                                   num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)  # fmt: skip
    with pytest.raises(ValueError, match=r"blocks of 32, which do not divide the input size 48 of "
                                         r"model.layers.0.self_attn.qkv_proj.weight.*'auto' or 'float32'"):  # fmt: skip
        _llm(narrow, quantization="int8", quant_activations="int8")


# ---------------------------------------------------------------------------------------------------------
# Products under each mode
# ---------------------------------------------------------------------------------------------------------


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=rel * (want.abs().max().item() + 1))


@needs_native
@pytest.mark.parametrize("rows", [1, 5])
def test_int8_on_a_bfloat16_model_multiplies_float_activations(llama128, rows):
    """The issue: `quantization="int8"` on a bfloat16 model rounded activations to int8 blocks (W8A8-like
    loss). Now every product equals the float-activation reference to float summation order."""
    llm = _llm(llama128, quantization="int8", dtype="bfloat16")
    g = torch.Generator().manual_seed(rows)
    for name, w in quantized_weights(model_of(llm)).items():
        x = torch.randn(rows, w.in_features, generator=g)
        _close(linear_ops.linear(x, w), F.linear(x, w.dequantize()))
        _close(linear_ops.linear(x, w), reference_linear(x, w))


def _weight(mode: ActivationMode, n: int = 40, k: int = 128, nf4: bool = False) -> QuantizedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k))
    q = quantizers.quantize_nf4(w, 64) if nf4 else quantizers.quantize_symmetric_int4(w, 32)
    q.use_activations(mode)
    return q


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_each_mode_against_its_reference(rows):
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    w_float = F.linear(x, _weight(FLOAT).dequantize())
    w_blocks = F.linear(fake_quantize_blocks(x), _weight(FLOAT).dequantize())
    _close(linear_ops.linear(x, _weight(FLOAT)), w_float)
    _close(linear_ops.linear(x, _weight(INT8)), w_blocks, 1e-4)
    _close(reference_linear(x, _weight(INT8)), w_blocks, 1e-4)
    native_blocks = linear_ops.native_int8_blocks(_weight(NATIVE))
    _close(linear_ops.linear(x, _weight(NATIVE)), w_blocks if native_blocks else w_float, 1e-4)
    # NF4's level tables have no int8 dot path: INT8 rounds in torch, INT8_NATIVE stays float32
    x_nf4 = F.linear(x, _weight(FLOAT, nf4=True).dequantize())
    _close(linear_ops.linear(x, _weight(NATIVE, nf4=True)), x_nf4)
    _close(linear_ops.linear(x, _weight(INT8, nf4=True)), F.linear(fake_quantize_blocks(x),
                                                                    _weight(FLOAT, nf4=True).dequantize()), 1e-4)


@needs_native
def test_int8_without_int8_dots_rounds_in_torch_the_same_way(monkeypatch):
    """quant_activations="int8" on a build without int8 dot products: the activations are rounded in
    torch (fake_quantize_blocks) and multiplied in float32, giving what the int8 kernel gives; without
    native kernels the torch reference does the same."""
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    want = F.linear(fake_quantize_blocks(x), _weight(FLOAT).dequantize())
    with_dots = linear_ops.linear(x, _weight(INT8))
    monkeypatch.setattr(linear_ops, "_int8_dots", lambda: False)
    _close(linear_ops.linear(x, _weight(INT8)), want, 1e-4)
    _close(linear_ops.linear(x, _weight(INT8)), with_dots, 1e-4)
    assert fused_decode._int8_blocks([_weight(INT8)]) is None  # the fused layer leaves it to the module path
    monkeypatch.setattr(native, "kernels", lambda: None)
    _close(linear_ops.linear(x, _weight(INT8)), want, 1e-4)


def test_fused_layer_flag_per_mode(monkeypatch):
    monkeypatch.setattr(linear_ops, "_int8_dots", lambda: True)
    assert fused_decode._int8_blocks([]) is False
    assert fused_decode._int8_blocks([_weight(FLOAT), _weight(FLOAT)]) is False
    assert fused_decode._int8_blocks([_weight(NATIVE), _weight(NATIVE, nf4=True)]) is True  # kernel decides
    assert fused_decode._int8_blocks([_weight(INT8)]) is True
    assert fused_decode._int8_blocks([_weight(INT8, nf4=True)]) is None  # rounded in torch by the module path
    assert fused_decode._int8_blocks([_weight(FLOAT), _weight(NATIVE)]) is None  # one flag cannot serve both


@needs_native
def test_a_long_prompt_reads_the_same_under_the_int8_gemm_and_the_float32_gemm(llama_gguf, monkeypatch):
    """A 161-token prompt of a bfloat16 model with Q4_0 / Q8_0 weights (int8 activation blocks): its
    prefill rows run the int8 GEMM under PERFXLM_QUANT_GEMM=int8 (where the build has it) and dequantized
    slabs for the float32 GEMM otherwise, the same products to float rounding: the same greedy text."""
    from perfxlm import SamplingParams
    from perfxlm.ops import cpu_plan

    prompt = [(7 * i + 3) % 250 + 1 for i in range(161)]
    params = SamplingParams(temperature=0, max_tokens=6)
    texts = []
    for choice in ("float32", "int8" if linear_ops.gemm_max_code() else "float32"):
        monkeypatch.setenv("PERFXLM_QUANT_GEMM", choice)
        cpu_plan.reset()
        llm = LLM(llama_gguf, skip_tokenizer_init=True, num_kv_blocks=32, dtype="bfloat16")
        assert cpu_plan.plan().quant_gemm == choice
        texts.append(llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids)
    cpu_plan.reset()
    assert texts[0] == texts[1]
