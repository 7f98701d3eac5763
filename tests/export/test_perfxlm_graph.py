"""The `perfxlm` flavor: a graph of the engine's own fused ops (custom ops of the `perfxlm` domain over a
paged KV cache) that the engine itself runs (`LLM(OUT_DIR)`) on the kernels of its module path. Greedy
float32 output of the graph token-identical to the module path for every exportable family on odd
sizes, with chunked prefill and prefix-cache hits, the pool whole afterwards; quantized exports (int4, a
GGUF Q4_0 file) kept packed and equal to the engine's quantized path; bf16 weights; the op census the
README prints; refusals of unknown ops, op-set versions and a non-empty output folder."""

from __future__ import annotations

import json
import os
import re

import gguf
import numpy as np
import onnx
import pytest

from perfxlm import LLM, SamplingParams
from perfxlm.export.package import export_onnx
from perfxlm.ops import native
from tests.conftest import assert_pool_whole, make_llama_checkpoint
from tests.model.test_architectures_vs_hf import build_checkpoint
from tests.model import test_recent_families_vs_hf as recent

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
PROMPTS = [[5], list(range(7, 16)), list(range(40, 77))]  # 1, 9, 37 tokens: chunked at 24, past the windows
FAMILIES = ["llama", "llama-gelu", "qwen2-bias-tied-sliding", "qwen3-qknorm-headdim-bias", "mistral-sliding-mqa",
            "phi3-longrope-partial-sliding", "mixtral-sliding", "qwen2moe-shared-dense-layer",
            "qwen3moe-normtopk-sparse-step", "glm-partial-interleaved", "gemma3-softcaps-untied", "glm4-post-norms",
            "gemma2-softcap-local-global", "opt-pre-ln", "opt-post-ln-projected", "gptoss-sinks-alternating",
            "deepseekv2-lite-yarn", "deepseekv3-noaux-grouped"]
# OPT's and latent attention's layers have no fused decode layer in the module path either (post-sublayer
# norms, a rotary table per layer kind and a mixture's MLP run as a module after the fused call do: Gemma 2 /
# 3, GLM-4, the mixtures)
NOT_FUSED = ("opt-pre-ln", "opt-post-ln-projected", "deepseekv2-lite-yarn", "deepseekv3-noaux-grouped")
README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")

pytestmark = pytest.mark.usefixtures("one_thread")


def _checkpoint(path: str, family: str) -> str:
    if family == "llama":  # untied head, odd head count
        return make_llama_checkpoint(path, hidden_size=96, intermediate_size=160, num_attention_heads=6,
                                     num_key_value_heads=3, num_hidden_layers=2, tie_word_embeddings=False)
    if family == "llama-gelu":  # GELU-tanh gating
        return make_llama_checkpoint(path, hidden_size=80, intermediate_size=144, num_attention_heads=5,
                                     num_key_value_heads=5, num_hidden_layers=2, hidden_act="gelu_pytorch_tanh")
    if family in recent.CASES:  # Qwen3-MoE, GLM, GLM-4, Gemma 3
        recent.build_checkpoint(path, family)
        return path
    build_checkpoint(path, family)
    return path


def graph_layers(ckpt: str) -> list[int]:
    return list(range(json.load(open(os.path.join(ckpt, "config.json")))["num_hidden_layers"]))


def _generate(llm, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


def _logprobs(outs) -> list[float]:
    return [lp[t].logprob for o in outs for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]


def _census(folder: str) -> dict[str, int]:
    model = onnx.load(os.path.join(folder, "model.onnx"), load_external_data=False)
    census: dict[str, int] = {}
    for n in model.graph.node:
        assert n.domain == "perfxlm" or n.op_type == "Gather", (n.domain, n.op_type)
        census[n.op_type] = census.get(n.op_type, 0) + 1
    return census


def _readme_census() -> dict[str, dict[str, int]]:
    """README's "census" lines: `- family: N op types: A, B, ...`."""
    text = open(README).read()
    section = text[text.index("perfxlm-flavor op census"):]
    rows = re.findall(r"^ *- `([a-z0-9-]+)`[^:]*: (\d+) op types: (.+)$", section, re.M)
    out = {}
    for family, count, ops in rows:
        out[family] = {op: int(n) for op, n in (o.split() for o in ops.split(","))}
        assert len(out[family]) == int(count)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_run_by_the_engine_is_the_module_path(tmp_path, family):
    ckpt, out = _checkpoint(str(tmp_path / "ckpt"), family), str(tmp_path / "graph")
    result = export_onnx(ckpt, out, flavor="perfxlm", dtype="float32")
    census = _census(out)
    assert census == result.op_census
    print(f"{family}: {len(census)} op types: {census}")
    assert census == _readme_census()[family]
    assert not os.path.exists(os.path.join(out, "genai_config.json"))
    graph = LLM(out, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24,
                enable_prefix_caching=True)
    assert "perfxlm-flavor" in graph.llm_engine.core.executor.describe()
    module = LLM(ckpt, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24,
                 enable_prefix_caching=True)
    want, want_outs = _generate(module)
    got, got_outs = _generate(graph)
    assert got == want
    np.testing.assert_allclose(_logprobs(got_outs), _logprobs(want_outs), atol=1e-5, rtol=0)
    assert len({t for seq in got for t in seq}) > 5  # random enough that the steps differ
    # again: the prompts' full blocks now come from the prefix cache
    fused = graph.llm_engine.core.executor.graph.fused_decode
    # all-decode steps: one native call per layer, as the module path (a mixture keeps the nodes)
    if native.kernels() is not None and family not in NOT_FUSED:
        assert fused.args is not None and len(fused.args) == len(fused.layers) == len(graph_layers(ckpt))
    again, again_outs = _generate(graph)
    assert again == want and again_outs[2].num_cached_tokens >= 32
    assert_pool_whole(graph)


@pytest.fixture(scope="module")
def llama96(tmp_path_factory) -> str:
    return make_llama_checkpoint(str(tmp_path_factory.mktemp("llama96")), hidden_size=96,
                                 intermediate_size=160, num_attention_heads=6, num_key_value_heads=2,
                                 num_hidden_layers=2)


def _assert_quantized_matches(out: str, source: str, quantization) -> None:
    model = onnx.load(os.path.join(out, "model.onnx"), load_external_data=False)
    codes = [t for t in model.graph.initializer if t.name.endswith(".codes")]
    assert codes and all(t.data_type == onnx.TensorProto.UINT8 for t in codes)
    bits = {a.i for n in model.graph.node if n.op_type == "Linear" for a in n.attribute if a.name == "bits"}
    assert 4 in bits
    kwargs = dict(skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24)
    module = LLM(source, quantization=quantization, quant_activations="float32", **kwargs)
    want, want_outs = _generate(module)
    got, got_outs = _generate(LLM(out, **kwargs))
    assert got == want
    np.testing.assert_allclose(_logprobs(got_outs), _logprobs(want_outs), atol=1e-4, rtol=0)


def test_int4_export_keeps_codes_packed_and_matches_the_quantized_engine(tmp_path, llama96):
    q = {"method": "int4", "mixed_precision": False, "calibration": False}
    out = str(tmp_path / "graph")
    export_onnx(llama96, out, flavor="perfxlm", quantization=q, dtype="float32")
    _assert_quantized_matches(out, llama96, q)


@pytest.mark.parametrize("family", ["mixtral-sliding", "qwen2moe-shared-dense-layer"])
def test_int4_mixture_keeps_its_expert_stacks_packed(tmp_path, family):
    # (Qwen2-MoE's expert width here is 48, no multiple of int4's 32: int8; its shared expert's Linears packed too)
    bits = 4 if family == "mixtral-sliding" else 8
    q = {"method": f"int{bits}", "mixed_precision": False, "calibration": False}
    ckpt, out = _checkpoint(str(tmp_path / "ckpt"), family), str(tmp_path / "graph")
    export_onnx(ckpt, out, flavor="perfxlm", quantization=q, dtype="float32")
    model = onnx.load(os.path.join(out, "model.onnx"), load_external_data=False)
    moe = next(n for n in model.graph.node if n.op_type == "MoE")
    assert {a.name: a.i for a in moe.attribute if a.name.endswith("_bits")} == {"gate_up_bits": bits, "down_bits": bits}
    if family != "mixtral-sliding":
        shared = next(n for n in model.graph.node if n.name == "model.layers.0.mlp.shared_expert.gate_up_proj")
        assert next(a.i for a in shared.attribute if a.name == "bits") == 8
    kwargs = dict(skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24)
    want, want_outs = _generate(LLM(ckpt, quantization=q, quant_activations="float32", **kwargs))
    got, got_outs = _generate(LLM(out, **kwargs))
    assert got == want
    np.testing.assert_allclose(_logprobs(got_outs), _logprobs(want_outs), atol=1e-4, rtol=0)


def test_gguf_q4_0_export_matches_the_engine(tmp_path, llama96):
    from tests.quant.test_quant_engine import write_quantized_llama_gguf

    path = str(tmp_path / "llama.gguf")
    parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    write_quantized_llama_gguf(path, llama96, {p: gguf.GGMLQuantizationType.Q4_0 for p in parts})
    out = str(tmp_path / "graph")
    export_onnx(path, out, flavor="perfxlm", dtype="float32")
    _assert_quantized_matches(out, path, None)


def test_gguf_q4_0_deepseek_keeps_its_latent_and_expert_blocks(tmp_path, monkeypatch):
    """A DeepSeek-V2 GGUF Q4_0 file: the query / latent projections and expert stacks kept as blocks (the
    absorbed kv_b float, as the module path folds it), greedy-equal to the engine's quantized path."""
    from tests.model.dummy_gguf import converter
    from tests.model.test_deepseek_gguf import build

    monkeypatch.setenv("PERFXLM_QUANT_ACTIVATIONS", "float32")
    hf = build("deepseekv2-lite-yarn", quantizable=True)
    path = str(tmp_path / "ds.gguf")
    hf.load_state_dict(converter().write_deepseek2(path, hf, "Q4_0"))
    out = str(tmp_path / "graph")
    export_onnx(path, out, flavor="perfxlm", dtype="float32")
    model = onnx.load(os.path.join(out, "model.onnx"), load_external_data=False)
    experts = next(n for n in model.graph.node if n.op_type == "Experts")
    assert {a.name: a.i for a in experts.attribute if a.name == "gate_up_bits"} == {"gate_up_bits": 4}
    kv_a = next(n for n in model.graph.node if n.name == "model.layers.0.self_attn.kv_a_proj_with_mqa")
    assert next(a.i for a in kv_a.attribute if a.name == "bits") == 4
    _assert_quantized_matches(out, path, None)


def test_int8_gpt_oss_keeps_its_biased_expert_stacks_packed(tmp_path):
    q = {"method": "int8", "mixed_precision": False, "calibration": False}
    ckpt, out = _checkpoint(str(tmp_path / "ckpt"), "gptoss-sinks-alternating"), str(tmp_path / "graph")
    export_onnx(ckpt, out, flavor="perfxlm", quantization=q, dtype="float32")
    model = onnx.load(os.path.join(out, "model.onnx"), load_external_data=False)
    experts = next(n for n in model.graph.node if n.op_type == "Experts")
    assert {a.name: a.i for a in experts.attribute if a.name.endswith("_bits")} == {"gate_up_bits": 8, "down_bits": 8}
    assert experts.input[11].endswith("gate_up_proj_bias") and experts.input[12].endswith("down_proj_bias")
    kwargs = dict(skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24)
    want, want_outs = _generate(LLM(ckpt, quantization=q, quant_activations="float32", **kwargs))
    got, got_outs = _generate(LLM(out, **kwargs))
    assert got == want
    np.testing.assert_allclose(_logprobs(got_outs), _logprobs(want_outs), atol=1e-4, rtol=0)


def test_gguf_k_quants_export_keeps_their_two_level_scales(tmp_path):
    """A Q4_K_M-allocated file: its K-quants' byte scales travel as they are held (uint8 / int8
    initializers) and the graph's Linear runs them as the engine does."""
    from tests.model.test_architectures_vs_hf import write_gguf_decoder

    path = str(tmp_path / "q4_k_m.gguf")
    write_gguf_decoder(path, "qwen2", q4_k_m=True)
    out = str(tmp_path / "graph")
    export_onnx(path, out, flavor="perfxlm", dtype="float32")
    model = onnx.load(os.path.join(out, "model.onnx"), load_external_data=False)
    scales = {t.data_type for t in model.graph.initializer if t.name.endswith(".scales")}
    assert {onnx.TensorProto.UINT8, onnx.TensorProto.INT8} <= scales
    _assert_quantized_matches(out, path, None)


def test_a_quantized_kv_cache_is_the_engine_s_own(exported, llama96):
    kwargs = dict(skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, kv_cache_dtype="int8",
                  max_num_batched_tokens=24)
    got, _ = _generate(LLM(exported, **kwargs))
    want, _ = _generate(LLM(llama96, **kwargs))
    assert got == want


def test_bfloat16_weights_from_the_cli(tmp_path, llama96):
    from perfxlm.entrypoints.cli import main

    out = str(tmp_path / "graph")
    assert main(["export", "onnx", llama96, out, "--flavor", "perfxlm", "--dtype", "bfloat16"]) in (0, None)
    model = onnx.load(os.path.join(out, "model.onnx"), load_external_data=False)
    types = {t.name: t.data_type for t in model.graph.initializer}
    assert types["model.layers.0.mlp.down_proj.weight"] == onnx.TensorProto.BFLOAT16
    assert types["model.norm.weight"] == onnx.TensorProto.FLOAT
    kwargs = dict(skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64)
    one = SamplingParams(temperature=0, max_tokens=1, logprobs=0)
    _, got_outs = _generate(LLM(out, **kwargs), PROMPTS[1:], one)
    _, want_outs = _generate(LLM(llama96, **kwargs), PROMPTS[1:], one)
    np.testing.assert_allclose(_logprobs(got_outs), _logprobs(want_outs), atol=0.05, rtol=0)
    with pytest.raises(ValueError, match="bfloat16 weights are the perfxlm flavor's"):
        export_onnx(llama96, str(tmp_path / "ort"), flavor="ort", dtype="bfloat16")
    assert not os.path.exists(tmp_path / "ort")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, llama96) -> str:
    out = str(tmp_path_factory.mktemp("perfxlm") / "graph")
    export_onnx(llama96, out, flavor="perfxlm", dtype="float32")
    return out


def _edited(exported: str, dst, edit) -> str:
    import shutil

    shutil.copytree(exported, dst)
    path = os.path.join(dst, "model.onnx")
    model = onnx.load(path, load_external_data=False)
    edit(model)
    onnx.save(model, path)
    return str(dst)


def test_unknown_op_and_op_set_version_are_refused_by_name(exported, tmp_path):
    def rename(model):
        node = next(n for n in model.graph.node if n.op_type == "SiluAndMul")
        node.op_type = "SwishAndMul"

    with pytest.raises(ValueError, match="op perfxlm::SwishAndMul, which the engine does not run"):
        LLM(_edited(exported, tmp_path / "op", rename), skip_tokenizer_init=True, num_kv_blocks=16)

    def version(model):
        next(o for o in model.opset_import if o.domain == "perfxlm").version = 5

    with pytest.raises(ValueError, match="perfxlm op set at version 5; this engine runs versions 1 to 4"):
        LLM(_edited(exported, tmp_path / "v5", version), skip_tokenizer_init=True, num_kv_blocks=16)

    def newer_op(function: str, version: int):
        def edit(model):  # SiluAndMul's place taken by an op of version 3
            node = next(n for n in model.graph.node if n.op_type == "SiluAndMul")
            node.op_type = "Activation"
            node.attribute.append(onnx.helper.make_attribute("function", function))
            next(o for o in model.opset_import if o.domain == "perfxlm").version = version
        return edit

    with pytest.raises(ValueError, match=r"\(Activation\) needs the perfxlm op set at version 3 or later; the "
                                         "graph imports version 1"):
        LLM(_edited(exported, tmp_path / "v1", newer_op("relu", 1)), skip_tokenizer_init=True, num_kv_blocks=16)
    with pytest.raises(ValueError, match="SiluAndMul.*activation 'mish' is not supported"):
        LLM(_edited(exported, tmp_path / "fn", newer_op("mish", 3)), skip_tokenizer_init=True, num_kv_blocks=16)

    def attribute(model):
        node = next(n for n in model.graph.node if n.op_type == "PagedAttention")
        keep = [a for a in node.attribute if a.name != "num_kv_heads"]
        del node.attribute[:]
        node.attribute.extend(keep)

    with pytest.raises(ValueError, match="PagedAttention.*lacks attribute 'num_kv_heads'"):
        LLM(_edited(exported, tmp_path / "attr", attribute), skip_tokenizer_init=True, num_kv_blocks=16)


def test_non_empty_output_folder_is_refused_and_kept(exported, llama96, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not empty; pass --overwrite"):
        export_onnx(llama96, str(out), flavor="perfxlm")
    assert os.listdir(out) == ["notes.txt"]
    assert [p for p in os.listdir(tmp_path) if p.startswith(".perfxlm-export")] == []


def test_a_bad_request_fails_alone(exported):
    llm = LLM(exported, skip_tokenizer_init=True, num_kv_blocks=16, dtype="float32")
    with pytest.raises(ValueError, match="out of vocabulary|vocab"):
        llm.generate([{"prompt_token_ids": [5, 10**6]}], GREEDY, use_tqdm=False)
    assert len(_generate(llm, PROMPTS[:2])[0]) == 2
    assert_pool_whole(llm)
    manifest = json.load(open(os.path.join(exported, "perfxlm_onnx.json")))
    assert manifest["flavor"] == "perfxlm"


def test_served_over_the_openai_api(tmp_path):
    """`perfxlm serve OUT_DIR`: the export's own tokenizer, completions equal to the module path's, a bad
    request answered 400 without disturbing the next."""
    import asyncio

    import httpx

    from perfxlm.config import EngineConfig
    from perfxlm.engine.async_engine import AsyncLLM
    from perfxlm.entrypoints.openai.api_server import build_app
    from perfxlm.tokenizer import get_tokenizer
    from tests.conftest import default_model_or_skip

    tokenizer = get_tokenizer(default_model_or_skip())
    ckpt = make_llama_checkpoint(str(tmp_path / "ckpt"), vocab_size=len(tokenizer), hidden_size=64,
                                 intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                 num_hidden_layers=2)
    tokenizer.save_pretrained(ckpt)
    out = str(tmp_path / "graph")
    export_onnx(ckpt, out, flavor="perfxlm", dtype="float32")
    prompt = "The capital of France is"
    want = LLM(ckpt, dtype="float32", num_kv_blocks=64).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    engine = AsyncLLM(EngineConfig(model=out, dtype="float32", num_kv_blocks=64))
    try:
        app = build_app(engine, "graph")

        async def calls() -> list[httpx.Response]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=300) as c:
                body = {"model": "graph", "prompt": prompt, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
                bad = await c.post("/v1/completions", json={**body, "max_tokens": -1})
                good = await c.post("/v1/completions", json=body)
                return [bad, good]

        bad, good = asyncio.run(calls())
        assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
        assert good.status_code == 200, good.text
        assert good.json()["choices"][0]["text"] == want
        counts = engine.engine.check_invariants()
        assert counts["used"] == 0, counts
    finally:
        engine.shutdown()


@pytest.mark.parametrize("case", ["gptq-4bit-g32-sym-act-order", "gptq-8bit-g32-asym-act-order"])
def test_act_order_gptq_keeps_its_column_order(tmp_path, case):
    """A GPTQ act-order checkpoint: each Linear's codes, scales and the input channel of each codes column
    (input_order) kept as loaded, so the graph's products are the module path's (which gathers the inputs
    in that order)."""
    from tests.quant.packed_checkpoints import write_packed
    from tests.quant.test_prequantized import PACKED, tiny_llama

    make_parts, qconfig, _ = PACKED[case]
    ckpt = str(tmp_path / "gptq")
    write_packed(ckpt, tiny_llama(), make_parts, qconfig)
    out = str(tmp_path / "graph")
    export_onnx(ckpt, out, flavor="perfxlm", dtype="float32")
    model = onnx.load(os.path.join(out, "model.onnx"), load_external_data=False)
    qkv = next(n for n in model.graph.node if n.name == "model.layers.0.self_attn.qkv_proj")
    assert qkv.input[6] == "model.layers.0.self_attn.qkv_proj.input_order"
    assert {a.name: a.s for a in qkv.attribute if a.name == "format"} == {"format": b"gptq"}
    kwargs = dict(skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24)
    want, want_outs = _generate(LLM(ckpt, **kwargs))
    got, got_outs = _generate(LLM(out, **kwargs))
    assert got == want
    np.testing.assert_allclose(_logprobs(got_outs), _logprobs(want_outs), atol=1e-5, rtol=0)


def test_5_and_6bit_codes_need_the_op_set_of_their_bit_planes():
    """5- and 6-bit codes' bit planes changed order at op set 4 (manifest.PLANES_OPSET): an older graph
    holding them is refused by name, not read in the old order; other widths keep their versions."""
    from perfxlm.export.manifest import PERFXLM_OPSET, PLANES_OPSET
    from perfxlm.model.graph.model import _since

    assert PLANES_OPSET == 4 <= PERFXLM_OPSET
    for op in ("Linear", "Embedding", "Experts"):
        assert _since(op, {"bits": 5}, []) == _since(op, {"bits": 6}, []) == 4
    assert _since("Linear", {"bits": 4}, []) == _since("Embedding", {"bits": 8}, []) == 1
    assert _since("Experts", {"bits": 4}, []) == 3
