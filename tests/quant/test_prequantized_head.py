"""A pre-quantized checkpoint's float embedding table and LM head: quantized at load as `quantization="int4"`
quantizes them (6-bit Q6_K form or 8-bit Q8_0 form: `{"method": "awq", "lm_head": true, "head_bits": 6}`,
or PERFXLM_PACKED_LM_HEAD), or kept float (`"lm_head": false`, vLLM's way). Quantized, the engine's tables
are exactly `QuantizationConfig.quantize_table` of the checkpoint's tensors and greedy float32 output
equals transformers on the dequantize-then-quantize weights; kept float, it equals transformers on the
checkpoint's. Bad values are refused by name before the model is built."""

from __future__ import annotations

import pytest
import torch

from perfxlm.config import EngineConfig
from perfxlm.quant import QuantizedWeight
from perfxlm.quant.config import QuantizationConfig
from perfxlm.quant.loading import PACKED_HEAD, PACKED_HEAD_ENV
from tests.quant.packed_checkpoints import awq_parts, gptq_parts, write_packed
from tests.quant.test_prequantized import AWQ_CONFIG, assert_matches, engine, gptq_config, model_of, tiny_llama


@pytest.fixture(autouse=True)
def _exact_products(monkeypatch):
    """Float32 activations (auto reads the environment), one thread, and no head default from outside."""
    monkeypatch.setenv("PERFXLM_QUANT_ACTIVATIONS", "float32")
    monkeypatch.delenv(PACKED_HEAD_ENV, raising=False)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tied_llama():
    hf = tiny_llama()
    hf.config.tie_word_embeddings = True
    hf.lm_head.weight = hf.model.embed_tokens.weight
    return hf


def write(path, tied: bool, method: str = "awq"):
    """(the dequantized transformers model, its float tables as the checkpoint stores them)"""
    hf = tied_llama() if tied else tiny_llama()
    if method == "awq":
        write_packed(path, hf, lambda name, w: awq_parts(w, 32), AWQ_CONFIG)
    else:
        write_packed(path, hf, lambda name, w: gptq_parts(w, 4, 32, sym=True), gptq_config(4, 32))
    tables = {"embed": hf.model.embed_tokens.weight.detach().clone(), "head": hf.lm_head.weight.detach().clone()}
    return hf, tables


def tables_of(llm):
    model = model_of(llm)
    return model.model.embed_tokens.weight, model.lm_head.weight


@pytest.mark.parametrize("bits", [6, 8])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_head_quantized_as_int4_does(tmp_path, bits, tied):
    path = str(tmp_path / "awq")
    hf, float_tables = write(path, tied)
    llm = engine(path, quantization={"method": "awq", "lm_head": True, "head_bits": bits})
    embed, head = tables_of(llm)
    assert type(embed) is QuantizedWeight and type(head) is QuantizedWeight
    assert (embed is head) == tied  # a tied head shares the table's codes
    reference = QuantizationConfig.resolve({"method": "int4", "head_bits": bits})
    for name, got in (("embed", embed), ("head", head)):
        want = reference.quantize_table(float_tables[name])
        assert got.bits == want.bits == bits and got.group == want.group and got.mins is None
        assert torch.equal(got.dense(), want.dense())  # the same values (run-time layouts may reorder codes)
        # the dequantize-then-quantize reference
        with torch.no_grad():
            (hf.model.embed_tokens if name == "embed" else hf.lm_head).weight.copy_(want.dense())
    assert_matches(llm, hf)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_head_kept_float(tmp_path, tied):
    path = str(tmp_path / "awq")
    hf, float_tables = write(path, tied)
    llm = engine(path, quantization={"method": "awq", "lm_head": False})
    embed, head = tables_of(llm)
    assert isinstance(embed, torch.nn.Parameter) and isinstance(head, torch.nn.Parameter)
    assert torch.equal(embed, float_tables["embed"]) and torch.equal(head, float_tables["head"])
    assert_matches(llm, hf)  # unchanged: transformers on the checkpoint's own tables


@pytest.mark.parametrize("env, bits", [("float", None), ("8", 8), ("6", 6), ("auto", PACKED_HEAD.get("int4"))])
def test_environment_stands_in_for_the_default(tmp_path, monkeypatch, env, bits):
    path = str(tmp_path / "gptq")
    write(path, tied=False, method="gptq")
    monkeypatch.setenv(PACKED_HEAD_ENV, env)
    _, head = tables_of(engine(path))
    assert (head.bits if type(head) is QuantizedWeight else None) == bits
    # the option wins over the environment
    _, head = tables_of(engine(path, quantization={"method": "gptq", "lm_head": False}))
    assert isinstance(head, torch.nn.Parameter)


def test_default_by_kind_of_codes(tmp_path):
    """Without option or environment: PACKED_HEAD's width for a checkpoint of 4-bit codes; 8-bit GPTQ keeps
    its tables float (int8's own tables stay as the checkpoint has them)."""
    path4, path8 = str(tmp_path / "gptq4"), str(tmp_path / "gptq8")
    write(path4, tied=False, method="gptq")
    write_packed(path8, tiny_llama(), lambda name, w: gptq_parts(w, 8, 32, sym=True), gptq_config(8, 32))
    _, head = tables_of(engine(path4))
    assert (head.bits if type(head) is QuantizedWeight else None) == PACKED_HEAD.get("int4")
    _, head = tables_of(engine(path8))
    assert (head.bits if type(head) is QuantizedWeight else None) == PACKED_HEAD.get("int8")


@pytest.mark.parametrize(
    "quantization, match",
    [
        ({"method": "awq", "lm_head": "yes"}, "lm_head='yes' with awq: expected true .* or false"),
        ({"method": "awq", "head_bits": 4}, "head_bits=4 with awq: supported: 6 or 8"),
        ({"method": "awq", "lm_head": False, "head_bits": 6}, "head_bits=6 with awq: .*with lm_head true"),
        ({"method": "awq", "group_size": 64}, "takes no group_size option; .*: lm_head, head_bits"),
    ],
)
def test_bad_options_refused_by_name(quantization, match):
    with pytest.raises(ValueError, match=match):
        QuantizationConfig.resolve(quantization)


def test_bad_environment_refused_at_configuration(tmp_path, monkeypatch):
    path = str(tmp_path / "awq")
    write(path, tied=False)
    monkeypatch.setenv(PACKED_HEAD_ENV, "4")
    with pytest.raises(ValueError, match=f"{PACKED_HEAD_ENV}='4' is not supported; supported: auto, float, 6, 8"):
        EngineConfig(model=path, skip_tokenizer_init=True).resolve()


def test_option_round_trips():
    """The resolved option travels as its dict form (worker processes resolve it again)."""
    for value in ({"method": "awq", "lm_head": True, "head_bits": 8}, {"method": "gptq", "lm_head": False}):
        config = QuantizationConfig.resolve(value)
        assert QuantizationConfig.resolve(config.as_dict()) == config
    assert QuantizationConfig.resolve("awq").as_dict() == {"method": "awq"}
