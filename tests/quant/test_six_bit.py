"""6-bit codes for float weights (perfxlm.quant.six_bit), int4's LM head: Q6_K's rule against ggml's own
quantizer (where llama-cpp-python's ggml library is installed), the float16-per-32 form on other widths,
the configuration's `head_bits`, and an engine whose greedy text equals its dequantized twin's."""

from __future__ import annotations

import ctypes
import os

import gguf
import numpy as np
import pytest
import torch

from perfxlm import LLM
from perfxlm.quant import QuantizationConfig, six_bit
from perfxlm.quant.gguf_repack import repack
from tests.quant.test_quant_engine import assert_same_greedy, dequantized_twin, generate, model_of, quantized_weights

Q6_K_TYPE = 14  # ggml_type GGML_TYPE_Q6_K


def _ggml() -> ctypes.CDLL | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so")
    if not os.path.exists(path):
        return None
    lib = ctypes.CDLL(path)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]  # fmt: skip
    return lib


def _ggml_q6_k(lib: ctypes.CDLL, w: torch.Tensor) -> np.ndarray:
    n, k = w.shape
    src = np.ascontiguousarray(w.numpy(), dtype=np.float32)
    dst = np.zeros(n * k // 256 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q6_K][1], dtype=np.uint8)
    lib.ggml_quantize_chunk(Q6_K_TYPE, src.ctypes.data, dst.ctypes.data, 0, n, k, None)
    return dst


def _rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).square().mean().sqrt())


@pytest.mark.parametrize("n,k", [(37, 512), (5, 256), (3, 1280)])
def test_q6_k_rule_gives_ggml_bytes(n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)) * 0.05
    w[0, :16] = 0.0  # an all-zero group
    w[1, 3] = 2.0  # an outlier: its super-block's largest scale
    q = six_bit.quantize(w)
    assert (q.bits, q.group, q.centred, q.two_level, q.scales.dtype) == (6, 16, True, True, torch.int8)
    assert q.nbytes * 8 == 6.5625 * n * k  # Q6_K's 210 bytes per 256 weights
    assert torch.equal(q.dequantize()[0, :16], torch.zeros(16))
    lib = _ggml()
    if lib is None:
        pytest.skip("ggml's library (llama-cpp-python) is not installed")
    theirs = repack(_ggml_q6_k(lib, w), gguf.GGMLQuantizationType.Q6_K, (n, k))
    # ggml's rule in ggml's float32 order: the same bytes (codes, sub-scales, float16 factors)
    assert torch.equal(q.codes, theirs.codes) and torch.equal(q.scales, theirs.scales)


def test_other_widths_take_a_float16_scale_per_32():
    n, k = 9, 576  # the default model's hidden size: not whole super-blocks
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    q = six_bit.quantize(w)
    assert (q.bits, q.group, q.centred, q.two_level, q.scales.dtype) == (6, 32, True, False, torch.float16)
    assert q.nbytes * 8 == 6.5 * n * k
    err = _rmse(q.dequantize(), w)
    q8 = QuantizationConfig.resolve({"method": "int4", "head_bits": 8}).quantize_table(w)
    assert q8.bits == 8 and _rmse(q8.dequantize(), w) < err < 6 * _rmse(q8.dequantize(), w)  # ~4x the step of 8-bit
    with pytest.raises(ValueError, match="whole blocks of 32"):
        six_bit.quantize(torch.randn(3, 48))


def test_head_bits_option():
    int4 = QuantizationConfig.resolve("int4")
    assert int4.head_bits == 6 and "6-bit embedding and LM head" in int4.describe()
    assert QuantizationConfig.resolve(int4.as_dict()) == int4 and "head_bits" not in int4.as_dict()
    assert int4.quantize_table(torch.randn(7, 256)).bits == 6
    assert int4.quantize_table(torch.randn(7, 40)).bits == 8  # rows that are not whole blocks of 32
    eight = QuantizationConfig.resolve({"method": "int4", "head_bits": 8})
    assert eight.head_bits == 8 and QuantizationConfig.resolve(eight.as_dict()) == eight
    assert QuantizationConfig.resolve("nf4").head_bits == 8 == QuantizationConfig.resolve("int8").head_bits
    assert QuantizationConfig.resolve({"method": "nf4", "head_bits": 6}).quantize_table(torch.randn(3, 64)).bits == 6
    for bad in ({"method": "int8", "head_bits": 6}, {"method": "int4", "head_bits": 7},
                {"method": "int4", "head_bits": True}):  # fmt: skip
        with pytest.raises(ValueError, match="head_bits"):
            QuantizationConfig.resolve(bad)


@pytest.fixture(scope="module")
def tied256(tmp_path_factory) -> str:
    from tests.conftest import make_llama_checkpoint

    path = str(tmp_path_factory.mktemp("tied256"))  # hidden 256: the tied head in Q6_K's two-level form
    return make_llama_checkpoint(path, hidden_size=256, intermediate_size=320, num_attention_heads=4,
                                 num_key_value_heads=2, num_hidden_layers=2, tie_word_embeddings=True)  # fmt: skip


def test_engine_greedy_with_a_6bit_head_equals_the_dequantized_twin(tied256, monkeypatch):
    monkeypatch.setenv("PERFXLM_QUANT_ACTIVATIONS", "float32")  # weight-only products: exact to summation order
    llm = LLM(tied256, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64,
              quantization={"method": "int4", "calibration": False})  # fmt: skip
    ws = quantized_weights(model_of(llm))
    heads = [w for n, w in ws.items() if "embed_tokens" in n or "lm_head" in n]
    assert heads and all(w.bits == 6 and w.two_level for w in heads)
    assert_same_greedy(generate(llm), generate(dequantized_twin(llm, tied256)))
