"""`perfxlm export onnx`: every exportable family on random-weight checkpoints of odd sizes, both flavors,
run in ONNX Runtime over a prompt and 16 greedy decode steps with the growing past fed back: float32
logits of every call within 1e-4 of transformers'; quantized exports (int4 with and without zero points,
int8 per channel, GGUF Q4_0 and Q4_1 files) kept packed in MatMulNBits and greedy-equal to the engine's
own quantized path; refusals that name what is wrong and leave nothing behind; onnxruntime-genai, where
installed, running the folder unchanged."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import onnx
import onnx.numpy_helper
import pytest
import torch

from perfxlm import LLM, SamplingParams
from perfxlm.export.package import export_onnx
from tests.conftest import make_llama_checkpoint
from tests.export.onnx_helpers import ort_greedy
from tests.model.test_architectures_vs_hf import build_checkpoint

STEPS = 16
PROMPT = [int(t) for t in np.random.RandomState(7).randint(3, 1000, size=23)]  # past every sliding window
FAMILIES = ["llama", "qwen2-bias-tied-sliding", "qwen3-qknorm-headdim-bias", "mistral-sliding-mqa",
            "phi3-longrope-partial-sliding"]
CONTRIB = {"GroupQueryAttention", "RotaryEmbedding", "SkipSimplifiedLayerNormalization",
           "SimplifiedLayerNormalization", "MatMulNBits"}


pytestmark = pytest.mark.usefixtures("one_thread")


def _checkpoint(path: str, family: str):
    if family == "llama":  # untied head, odd head count
        make_llama_checkpoint(path, hidden_size=96, intermediate_size=160, num_attention_heads=6,
                              num_key_value_heads=3, num_hidden_layers=2, tie_word_embeddings=False)
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return build_checkpoint(path, family)


def _op_types(folder: str) -> dict[str, str]:
    model = onnx.load(os.path.join(folder, "model.onnx"), load_external_data=False)
    return {n.op_type: n.domain for n in model.graph.node}


@pytest.mark.parametrize("flavor", ["ort", "standard"])
@pytest.mark.parametrize("family", FAMILIES)
def test_float_export_matches_transformers(tmp_path, family, flavor):
    hf = _checkpoint(str(tmp_path / "ckpt"), family)
    out = str(tmp_path / "onnx")
    result = export_onnx(str(tmp_path / "ckpt"), out, flavor=flavor)
    ops = _op_types(out)
    if flavor == "ort":
        assert CONTRIB - {"MatMulNBits"} <= set(ops)
    else:
        assert not set(ops) & CONTRIB and set(ops.values()) == {""}
    assert result.op_census["Identity"] == 2 * hf.config.num_hidden_layers + 1  # present.* and logits

    def reference(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].numpy()

    tokens, _, diffs = ort_greedy(out, PROMPT, STEPS, reference)
    assert len(diffs) == STEPS + 1 and max(diffs) < 1e-4, diffs
    assert len(set(tokens)) > 3  # random enough that the decode steps differ
    genai = json.load(open(os.path.join(out, "genai_config.json")))
    assert genai["model"]["type"] == result.model_type
    assert genai["model"]["decoder"]["num_key_value_heads"] == hf.config.num_key_value_heads
    manifest = json.load(open(os.path.join(out, "perfxlm_onnx.json")))
    assert (manifest["flavor"], manifest["format_version"]) == (flavor, 1)


# whose mins are no zero-point code, so travel as per-block offsets (asymmetric groups)
OFFSETS = {"int4": True, "int4-sym": False, "int8-channel": False}
QUANTIZED = {
    "int4": {"method": "int4", "mixed_precision": False, "calibration": False},  # mins: any float
    "int4-sym": {"method": "int4", "symmetric": True, "mixed_precision": False, "calibration": False},
    "int8-channel": {"method": "int8", "group_size": -1},  # group 96 -> 3 blocks of 32 share a scale
}


@pytest.fixture(scope="module")
def llama96(tmp_path_factory) -> str:
    return make_llama_checkpoint(str(tmp_path_factory.mktemp("llama96")), hidden_size=96,
                                 intermediate_size=160, num_attention_heads=6, num_key_value_heads=2,
                                 num_hidden_layers=2)


def _engine_greedy(path: str, quantization) -> tuple[list[int], list[float]]:
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=32, quantization=quantization,
              quant_activations="float32")
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


def _assert_matches_engine(out: str, path: str, quantization) -> None:
    assert _op_types(out).get("MatMulNBits") == "com.microsoft"
    tokens, logprobs, _ = ort_greedy(out, PROMPT, STEPS)
    want_tokens, want_logprobs = _engine_greedy(path, quantization)
    assert tokens == want_tokens
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_export_keeps_weights_packed_and_matches_the_engine(tmp_path, llama96, name):
    out = str(tmp_path / "onnx")
    export_onnx(llama96, out, flavor="ort", quantization=QUANTIZED[name])
    _assert_matches_engine(out, llama96, QUANTIZED[name])
    # the layers' weights are codes (+ scales), not float: under a third of their float32 bytes
    from safetensors.torch import load_file

    float_bytes = sum(t.numel() * 4 for n, t in load_file(os.path.join(llama96, "model.safetensors")).items()
                      if ".layers." in n and n.endswith("proj.weight"))
    graph = onnx.load(os.path.join(out, "model.onnx"))
    stored = sum(onnx.numpy_helper.to_array(t).nbytes for t in graph.graph.initializer
                 if ".layers." in t.name and "proj" in t.name)
    assert stored < float_bytes / 3
    names = [t.name for t in graph.graph.initializer if ".layers." in t.name]
    assert any("block_offsets" in n for n in names) == OFFSETS[name]


# a zero-point code; a min per block (offsets); 5-bit codes (exported as 8-bit ones)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0"])
def test_gguf_export_matches_the_engine(tmp_path, llama96, qtype):
    from tests.quant.test_quant_engine import write_quantized_llama_gguf

    path = str(tmp_path / "llama.gguf")
    parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    write_quantized_llama_gguf(path, llama96, {p: gguf.GGMLQuantizationType[qtype] for p in parts})
    out = str(tmp_path / "onnx")
    export_onnx(path, out, flavor="ort")
    _assert_matches_engine(out, path, None)


# every decoder family exports in every flavor (test_onnx_export_families.py, test_perfxlm_graph.py); a flavor
# lacking what a family needs refuses it by name (here a flavor's list without learned positions)
def test_unsupported_family_is_named_and_nothing_is_written(tmp_path, monkeypatch):
    from perfxlm.export.perfxlm_ops import PerfxlmOps

    monkeypatch.setattr(PerfxlmOps, "features", PerfxlmOps.features - {"learned_positions"})
    build_checkpoint(str(tmp_path / "ckpt"), "opt-post-ln-projected")
    out = tmp_path / "onnx"
    with pytest.raises(ValueError, match="ONNX export of OPTForCausalLM: model.decoder.embed_positions has learned "
                                         "absolute position embeddings, which the perfxlm flavor cannot express"):
        export_onnx(str(tmp_path / "ckpt"), str(out), flavor="perfxlm")
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".perfxlm-export")]


def test_a_model_that_is_no_decoder_family_is_refused_by_name():
    from perfxlm.export.decoder import genai_model_type

    class BertModel(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="does not support BertModel yet \\(supported: .*OPTForCausalLM"):
        genai_model_type(BertModel())


def test_int8_activations_are_refused_by_name(tmp_path, llama96):
    with pytest.raises(ValueError, match="w8a8 quantizes activations to int8 by definition"):
        export_onnx(llama96, str(tmp_path / "onnx"), quantization="w8a8")
    assert not (tmp_path / "onnx").exists()
    # a weight that rounds its activations (a pre-quantized W8A8 checkpoint) is refused by the exporter
    from types import SimpleNamespace

    from perfxlm.export.decoder import _linear
    from perfxlm.quant import QuantizedWeight

    w8a8 = QuantizedWeight(torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 1), torch.zeros(4, 1), None,
                           bits=8, group=32, act="int8", out_features=4, in_features=32)
    with pytest.raises(ValueError, match="o_proj is u8 .* a8, whose int8 activations the exporter cannot"):
        _linear(SimpleNamespace(weight=w8a8, bias=None), "o_proj")


def test_output_folder_flavor_and_cli(tmp_path, llama96, capsys):
    from perfxlm.entrypoints.cli import main

    out = tmp_path / "onnx"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty; pass --overwrite"):
        export_onnx(llama96, str(out))
    assert os.listdir(out) == ["keep.txt"]
    with pytest.raises(ValueError, match="flavor 'tflite' is not known"):
        export_onnx(llama96, str(tmp_path / "other"), flavor="tflite")
    assert main(["export", "onnx", llama96, "-o", str(out)]) == 2  # not empty: the error, exit status 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert main(["export", "onnx", llama96, "-o", str(out), "--overwrite", "--flavor", "standard"]) == 0
    assert "keep.txt" not in os.listdir(out)
    written = {"model.onnx", "model.onnx.data", "genai_config.json", "config.json", "perfxlm_onnx.json"}
    assert written <= set(os.listdir(out))
    assert "standard flavor" in capsys.readouterr().err


@pytest.mark.parametrize("flavor", ["ort", "standard"])
def test_onnxruntime_genai_runs_the_folder_unchanged(tmp_path, llama96, flavor):
    og = pytest.importorskip("onnxruntime_genai")
    out = str(tmp_path / "onnx")
    export_onnx(llama96, out, flavor=flavor)
    want, _, _ = ort_greedy(out, PROMPT, STEPS)
    model = og.Model(out)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(PROMPT) + STEPS, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(PROMPT)
    while not generator.is_done():
        generator.generate_next_token()
    assert list(generator.get_sequence(0))[len(PROMPT):] == want
